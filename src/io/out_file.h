/* out_file.h — the one way lorakit writes an output file (internal, not
 * installed): into a temporary file next to it, renamed into place only when
 * complete, so a reader never sees a partial file and a failed write leaves
 * the old one (or none) in place. The safetensors writer, PEFT's
 * adapter_config.json and the CLI's loss.csv / train.json / loss.png all go
 * through here.
 *
 * What an output may replace: nothing, or a regular file (a symlink to one:
 * the link is replaced) that is none of the command's inputs. A device, a
 * FIFO, a socket or a folder at the output's path is refused before
 * anything is written and again just before the rename; an input is
 * recognised by device and inode, so no path to it (a symlink, a hard link,
 * "./x") gets past. */
#ifndef LK_IO_OUT_FILE_H
#define LK_IO_OUT_FILE_H

#include <stddef.h>
#include "lorakit/status.h"

typedef struct lk_out_file {
    char *tmp; /* the temporary file's path while one is open, else NULL */
    int fd;    /* open on tmp (read-write), else -1 */
    void *reg; /* its registration for removal on a signal (io/temp.h) */
} lk_out_file;

#define LK_OUT_FILE_INIT {NULL, -1, NULL}

/* Checks path may be replaced (see above), sweeps stale temporaries of
 * path left by killed processes (io/temp.h), then creates a new temporary
 * file "<path>.tmp.<pid>.<n>" (O_EXCL) in path's folder. */
lk_status lk_out_file_begin(lk_out_file *o, const char *path);
/* fsyncs and closes the temporary file, renames it onto path and fsyncs the
 * folder (best effort). On failure the temporary file is still there for
 * lk_out_file_abort. */
lk_status lk_out_file_commit(lk_out_file *o, const char *path);
/* Closes and removes the temporary file (nothing open: no-op). */
void lk_out_file_abort(lk_out_file *o);

/* path = data[0..n), whole or not at all. */
lk_status lk_out_file_write(const char *path, const void *data, size_t n);

/* The files a command reads, by identity. */
typedef struct lk_out_inputs {
    size_t n, cap;
    struct lk_out_input *v;
} lk_out_inputs;
#define LK_OUT_INPUTS_INIT {0, 0, NULL}

/* Adds the file at path (what names it in messages: "base shard",
 * "adapter config", a string literal). A path that does not exist is
 * skipped: no output can be it. LK_ERR_NOMEM. */
lk_status lk_out_inputs_add(lk_out_inputs *in, const char *path, const char *what);
void lk_out_inputs_free(lk_out_inputs *in);
/* LK_OK when path may be written as an output file: it does not exist, or
 * it is a regular file that is none of in's files (in may be NULL).
 * LK_ERR_ARG "output P is the same file as the base shard S" or "P: exists
 * and is a character device; an output replaces only a regular file". */
lk_status lk_out_check(const char *path, const lk_out_inputs *in);

#endif
