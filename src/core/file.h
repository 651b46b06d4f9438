/* file.h — reading a small text file (config, plan, adapter_config.json)
 * whole, with a size limit, and joining paths. Internal to the library. */
#ifndef LK_CORE_FILE_H
#define LK_CORE_FILE_H

#include <stddef.h>
#include "lorakit/knobs.h"
#include "lorakit/status.h"

/* Opens path read-only as an input file into *fd (O_CLOEXEC, blocking
 * reads): anything that is not a regular file (a FIFO, a device, a socket,
 * a folder) is refused by its kind, "path: is a FIFO, not a regular file",
 * without blocking: a FIFO with no writer would block open(2) forever, so
 * the path is stat'ed first and opened with O_NONBLOCK (cleared after), and
 * what was opened is checked again. Every user-given file lorakit reads
 * (checkpoints, shards, indexes, adapters, configs, plans) goes through it. */
lk_status lk_open_input(const char *path, int *fd);
/* Whether path (links followed) is a regular file an input can be read
 * from, without opening it: LK_OK with *absent = 1 when nothing at all is
 * there (a name that was never made), LK_OK with *absent = 0 for a regular
 * file, else LK_ERR_IO naming what is there: "path: is a FIFO, not a
 * regular file", "path is a symbolic link to 'T', which does not exist (a
 * dangling link, ...)", "path is a symbolic link to 'T' that cannot be
 * followed: a link loop (too many levels of symbolic links)". The link's
 * target is named whole. */
lk_status lk_input_check(const char *path, int *absent);
/* "a FIFO", "a character device", "a block device", "a socket", "a folder",
 * "a symbolic link", "a regular file" or "not a regular file" for an
 * st_mode. */
const char *lk_file_kind(unsigned mode);

/* Reads path into a NUL-terminated lk_malloc'd *buf of *len bytes. At most
 * max + 1 bytes are read, so a caller sees a file past its limit as
 * *len == max + 1 and reports it in its own terms. The buffer is sized from
 * the file's size (no max-sized allocation per call). Only a regular file
 * is read (lk_open_input). */
lk_status lk_read_file(const char *path, size_t max, char **buf, size_t *len);

/* The one size limit for a config file lorakit parses (YAML configs and
 * plans, adapter_config.json): a 16 MiB config is already absurd; the limit
 * bounds what hostile input can make a parser allocate. */
#define LK_CONFIG_MAX_BYTES ((unsigned)LK_KNOB_CONFIG_MAX_BYTES_DEFAULT) /* lorakit/knobs.h */

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
