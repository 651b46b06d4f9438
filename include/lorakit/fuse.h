/* lorakit/fuse.h — the fusion kernel and the offline fuse of a whole file.
 *
 * One kernel: W_out = W_in + sum_i scale_i * (B_i @ A_i), for any mix of
 * F32/F16/BF16 weights and factors, accumulated in fp32 in the order the
 * terms are given, rounded once (RNE) into the weight's dtype. W is read once
 * and written once, tile by tile; no out x in delta is ever materialised.
 * The result bytes do not depend on the thread count. */
#ifndef LORAKIT_FUSE_H
#define LORAKIT_FUSE_H

#include <stddef.h>
#include "lorakit/status.h"
#include "lorakit/tensor.h"
#include "lorakit/adapter.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct lk_fuse_term {
    const lk_tensor *A; /* r x in */
    const lk_tensor *B; /* out x r */
    float scale;        /* strength * alpha-derived scale */
} lk_fuse_term;

typedef struct lk_fuse_opts {
    int threads;          /* 0 = all cores */
    int allow_nonfinite;  /* else a non-finite result from finite input is LK_ERR_NONFINITE */
} lk_fuse_opts;

/* w_out may equal w_in (in place); both are out x in of dtype `dtype`.
 * `name` is used in error messages. On LK_ERR_NONFINITE w_out may have been
 * partly written: callers fusing in place keep a copy to restore. */
lk_status lk_fuse_tensor(void *w_out, const void *w_in, lk_dtype dtype, int64_t out,
                         int64_t in, const lk_fuse_term *terms, size_t n_terms,
                         const lk_fuse_opts *opts, const char *name);

/* One adapter of a fuse request. */
typedef struct lk_fuse_input {
    const char *path;
    float strength;
    lk_adapter_format format;
} lk_fuse_input;

typedef struct lk_fuse_file_opts {
    lk_fuse_opts fuse;
    int allow_unmatched;
    int progress;         /* draw a progress bar on stderr */
} lk_fuse_file_opts;

typedef struct lk_fuse_stats {
    size_t tensors_total;
    size_t tensors_fused;
    size_t modules_unmatched;
    double seconds;
} lk_fuse_stats;

/* Fuses the inputs into base and writes out (atomically; on any error no
 * file exists at out). Refuses out equal to base. */
lk_status lk_fuse_file(const char *base, const lk_fuse_input *inputs, size_t n,
                       const char *out, const lk_fuse_file_opts *opts, lk_fuse_stats *stats);

#ifdef __cplusplus
}
#endif
#endif
