/* file.h — reading a small text file (config, plan, adapter_config.json)
 * whole, with a size limit, and joining paths. Internal to the library. */
#ifndef LK_CORE_FILE_H
#define LK_CORE_FILE_H

#include <stddef.h>
#include "lorakit/status.h"

/* Reads path into a NUL-terminated lk_malloc'd *buf of *len bytes. At most
 * max + 1 bytes are read, so a caller sees a file past its limit as
 * *len == max + 1 and reports it in its own terms. The buffer is sized from
 * the file when it is a regular file (no max-sized allocation per call). */
lk_status lk_read_file(const char *path, size_t max, char **buf, size_t *len);

/* The one size limit for a config file lorakit parses (YAML configs and
 * plans, adapter_config.json): a 16 MiB config is already absurd; the limit
 * bounds what hostile input can make a parser allocate. */
#define LK_CONFIG_MAX_BYTES (16u << 20)

/* lk_read_file with LK_CONFIG_MAX_BYTES; a larger file is LK_ERR_CONFIG
 * "path: larger than the 16777216-byte limit for a config file". */
lk_status lk_read_config(const char *path, char **buf, size_t *len);

/* "dir/name" in a new lk_malloc'd string, or a copy of name when dir is
 * NULL or empty or name is absolute; NULL when out of memory. */
char *lk_path_join(const char *dir, const char *name);
/* The folder part of path in a new lk_malloc'd *dir ("a/b/c" -> "a/b",
 * "/c" -> "/"), or *dir = NULL when path names no folder (the current one).
 * LK_ERR_NOMEM names path. */
lk_status lk_path_dir(const char *path, char **dir);

#endif
