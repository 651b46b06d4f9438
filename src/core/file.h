/* file.h — reading a small text file (config, plan, adapter_config.json)
 * whole, with a size limit. Internal to the library. */
#ifndef LK_CORE_FILE_H
#define LK_CORE_FILE_H

#include <stddef.h>
#include "lorakit/status.h"

/* Reads path into a NUL-terminated lk_malloc'd *buf of *len bytes. At most
 * max + 1 bytes are read, so a caller sees a file past its limit as
 * *len == max + 1 and reports it in its own terms. The buffer is sized from
 * the file when it is a regular file (no max-sized allocation per call). */
lk_status lk_read_file(const char *path, size_t max, char **buf, size_t *len);

#endif
