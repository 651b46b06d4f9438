/* out_file.h — the one way lorakit writes an output file (internal, not
 * installed): into a temporary file next to it, renamed into place only when
 * complete, so a reader never sees a partial file and a failed write leaves
 * the old one (or none) in place. The safetensors writer, PEFT's
 * adapter_config.json and the CLI's loss.csv / train.json / loss.png all go
 * through here. */
#ifndef LK_IO_OUT_FILE_H
#define LK_IO_OUT_FILE_H

#include <stddef.h>
#include "lorakit/status.h"

typedef struct lk_out_file {
    char *tmp; /* the temporary file's path while one is open, else NULL */
    int fd;    /* open on tmp (read-write), else -1 */
} lk_out_file;

#define LK_OUT_FILE_INIT {NULL, -1}

/* Creates a new temporary file "<path>.tmp.<pid>.<n>" (O_EXCL) in path's
 * folder. */
lk_status lk_out_file_begin(lk_out_file *o, const char *path);
/* fsyncs and closes the temporary file, renames it onto path and fsyncs the
 * folder (best effort). On failure the temporary file is still there for
 * lk_out_file_abort. */
lk_status lk_out_file_commit(lk_out_file *o, const char *path);
/* Closes and removes the temporary file (nothing open: no-op). */
void lk_out_file_abort(lk_out_file *o);

/* path = data[0..n), whole or not at all. */
lk_status lk_out_file_write(const char *path, const void *data, size_t n);

#endif
