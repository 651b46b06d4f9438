/* lorakit/digest.h — the content digest of a set of tensors.
 *
 * XXH3-128 over, for each tensor in byte-wise sorted name order: the name, a
 * NUL, the dtype string, a NUL, the shape as little-endian i64s, the raw
 * bytes. Metadata is not included. Printed as 32 lowercase hex digits (the
 * high 64 bits first). Equal tensors give equal digests whatever the file
 * order, so an offline fuse and a distributed swap can be compared. */
#ifndef LORAKIT_DIGEST_H
#define LORAKIT_DIGEST_H

#include <stddef.h>
#include "lorakit/status.h"
#include "lorakit/tensor.h"
#include "lorakit/safetensors.h"
#include "lorakit/checkpoint.h"

#ifdef __cplusplus
extern "C" {
#endif

#define LK_DIGEST_HEX 33 /* 32 digits + NUL */

/* Digest of n tensor views (any order; sorted internally), in host memory
 * (a tensor on a device is LK_ERR_ARG naming it: lk_digest_views). */
lk_status lk_digest_tensors(const lk_tensor *t, size_t n, char hex[LK_DIGEST_HEX]);
/* Digest of n tensors whose headers are views[i] and whose bytes are read
 * by rd(ctx, i, off, dst, len) in pieces of at most 4 MiB (memory lorakit
 * cannot read directly: device tensors, lk_weights_digest). label names
 * the tensors in messages. */
typedef lk_status (*lk_digest_read_fn)(void *ctx, size_t i, uint64_t off, void *dst, size_t len);
lk_status lk_digest_views(const lk_tensor *const *views, size_t n, lk_digest_read_fn rd, void *ctx, const char *label,
                          char hex[LK_DIGEST_HEX]);
/* Digest of every tensor of an open file; the bytes are read with pread
 * (lk_st_read), so a file truncated meanwhile is LK_ERR_IO, not a SIGBUS. */
lk_status lk_digest_st(const lk_st *st, char hex[LK_DIGEST_HEX]);
/* Digest of every tensor of a checkpoint (all shards; equal to the digest
 * of one file holding the same tensors), read the same way. */
lk_status lk_digest_ckpt(const lk_ckpt *ck, char hex[LK_DIGEST_HEX]);

#ifdef __cplusplus
}
#endif
#endif
