/* lorakit/safetensors.h — safetensors reader (mmap, fully validated) and
 * atomic, streaming writer.
 *
 * Reader: lk_st_open maps the file and validates the header exactly as the
 * reference implementation does (see src/io/safetensors.c); tensors are
 * zero-copy views into the mapping, looked up by name in O(log n); the
 * descriptor stays open until lk_st_close, so lk_st_read can copy a tensor's
 * bytes with pread instead (a truncated file is then an error, not a SIGBUS).
 * Writer: declare every tensor, then lk_st_writer_begin, then supply each
 * tensor's bytes (whole or in chunks, any order), then lk_st_writer_commit,
 * which fsyncs a temporary file in the destination directory and renames it
 * into place. Any failure, or lk_st_writer_free without commit, removes the
 * temporary file: a partial output never exists under the final name. */
#ifndef LORAKIT_SAFETENSORS_H
#define LORAKIT_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>
#include "lorakit/status.h"
#include "lorakit/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

#define LK_ST_MAX_HEADER 100000000ull

typedef struct lk_st lk_st;

/* Opens and validates path. */
lk_status lk_st_open(const char *path, lk_st **out);
/* Parses an in-memory file image (copied); label names it in errors. */
lk_status lk_st_open_mem(const void *buf, size_t len, const char *label, lk_st **out);
void lk_st_close(lk_st *st);

const char *lk_st_path(const lk_st *st);
size_t lk_st_count(const lk_st *st);
/* Tensor i < count, in file order (by data offset; empty tensors sharing an
 * offset keep their header order). data points into the mapping. */
const lk_tensor *lk_st_tensor(const lk_st *st, size_t i);
/* Index of a tensor by name, or -1. O(log n). */
long lk_st_find(const lk_st *st, const char *name);
/* Byte offset of tensor i's data from the start of the file. */
uint64_t lk_st_file_offset(const lk_st *st, size_t i);
/* Size of the JSON header in bytes (the N of the 8-byte prefix). */
uint64_t lk_st_header_len(const lk_st *st);
/* Copies n bytes at byte offset off within tensor i into dst, read with
 * pread from the descriptor the reader keeps open since lk_st_open (memory
 * images: a memcpy). Unlike touching the mapping, a file that shrank since it
 * was opened is an error, not a SIGBUS: LK_ERR_IO "<file>: <tensor>: changed
 * on disk while being read: expected N bytes at offset O, got M" (O counted
 * from the start of the file). For callers that must survive another process
 * rewriting their input (lk_fuse_file, adapter loading). */
lk_status lk_st_read(const lk_st *st, size_t i, uint64_t off, void *dst, size_t n);

size_t lk_st_metadata_count(const lk_st *st);
void lk_st_metadata_at(const lk_st *st, size_t i, const char **key, const char **value);
/* Value for key, or NULL. */
const char *lk_st_metadata_get(const lk_st *st, const char *key);

/* ---- writer ---- */
typedef struct lk_st_writer lk_st_writer;

lk_status lk_st_writer_create(const char *path, lk_st_writer **out);
lk_status lk_st_writer_metadata(lk_st_writer *w, const char *key, const char *value);
/* Declares a tensor; returns its index in *index (may be NULL). */
lk_status lk_st_writer_declare(lk_st_writer *w, const char *name, lk_dtype dtype,
                               int ndim, const int64_t *shape, size_t *index);
/* Fixes the layout and writes the header to the temporary file. */
lk_status lk_st_writer_begin(lk_st_writer *w);
/* Writes n bytes of tensor `index` at byte offset `off` within that tensor. */
lk_status lk_st_writer_write(lk_st_writer *w, size_t index, uint64_t off,
                             const void *data, size_t n);
/* Checks every byte was written, fsyncs, renames into place. */
lk_status lk_st_writer_commit(lk_st_writer *w);
/* Frees; removes the temporary file if not committed. */
void lk_st_writer_free(lk_st_writer *w);

/* Convenience: writes a whole file from views (metadata as key/value pairs). */
lk_status lk_st_save(const char *path, const lk_tensor *tensors, size_t n,
                     const char *const *meta_kv, size_t n_meta);

/* ---- interrupted writes ----
 * Every temporary file or folder an output is being written through (this
 * writer's, a sharded output folder's, every other file lorakit writes) is
 * registered while it exists. lk_temp_cleanup removes them all; it is
 * async-signal-safe (unlink and rmdir of paths allocated beforehand, no
 * lock), for a host program's own signal handlers, and may be called once
 * (the registrations are consumed). lk_temp_cleanup_on_signals installs
 * handlers for every asynchronous signal whose default action ends the
 * process (SIGINT, SIGTERM, SIGHUP, SIGPIPE, SIGXFSZ, SIGQUIT, SIGALRM,
 * SIGUSR1/2, SIGXCPU, SIGVTALRM, SIGPROF, SIGIO, SIGPWR, SIGSTKFLT), each only where
 * the signal's action is still the default (an ignored signal stays
 * ignored), that call lk_temp_cleanup, restore the default action and
 * re-raise the signal, so the process still ends by it. The library never
 * installs handlers by itself; the lorakit CLI calls this first thing. A
 * temporary that nothing could remove (SIGKILL, a power cut) is removed by
 * the next write of the same output once its process is gone. */
void lk_temp_cleanup(void);
lk_status lk_temp_cleanup_on_signals(void);
/* 1 when signal sig's action now is lk_temp_cleanup_on_signals' handler
 * (a host that installs handlers of its own for a while, as the Python
 * package does during a call, treats that as the default action). */
int lk_temp_cleanup_handles(int sig);

#ifdef __cplusplus
}
#endif
#endif
