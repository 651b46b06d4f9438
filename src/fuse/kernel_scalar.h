/* kernel_scalar.h — the kernel's per-element rounding rules as inline
 * scalar code, shared by kernel.c (the exported lk_fuse_add_odd_* and
 * lk_fuse_round_* of fuse/fuse.h), terms.c and the block functions of every
 * path: the generic ones use them directly, the vector paths
 * (kernel_avx512.c, kernel_avx2.c) implement the same rules lane-wise and
 * hand their rare lanes to lk_kernel_finish_slow here. So the block files
 * are leaves: they call nothing in kernel.c, their dispatcher.
 * tests/test_fuse_kernel.c checks the bytes of every path. */
#ifndef LK_FUSE_KERNEL_SCALAR_H
#define LK_FUSE_KERNEL_SCALAR_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#include "core/bits.h"
#include "lorakit/dtype.h"
#include "fuse/fuse.h"
#include "fuse/round.h"

/* The per-element rules themselves live in fuse/round.h (shared with the
 * device kernels); these are their names on the CPU paths. */
static inline float scalar_add_odd_f32(float w, float d) { return lk_round_add_odd_f32(w, d); }
static inline double scalar_add_odd_f64(double w, double d) { return lk_round_add_odd_f64(w, d); }
static inline float scalar_round_f32(float w, float d) { return lk_round_f32(w, d); }
static inline uint32_t scalar_round_f64_to_f32(uint32_t uw, double d) { return lk_round_f64_to_f32(uw, d); }

/* ---- non-finite results: the vector paths' rare lanes ----
 * Out of line (rare, and the hot block functions stay as they were) and
 * static in each kernel file that uses them, so a block function calls
 * only downward: kernel.c dispatches to kernel_<path>.c, which never calls
 * back into kernel.c. */
#define LK_KERNEL_SLOW static __attribute__((noinline, unused))

/* Records the first element of row o, columns col0 .. col0+n, that went
 * from a finite weight to a non-finite result (win, res: n elements of the
 * weight before and of the result, in the weight's dtype). Rare path. */
LK_KERNEL_SLOW void lk_kernel_note_bad(lk_kworker *wk, size_t o, size_t col0, size_t n, const void *win, const void *res) {
    const lk_kjob *jb = wk->job;
    const size_t esz = lk_dtype_size((lk_dtype)jb->dt);
    for (size_t j = 0; j < n; j++) {
        size_t off = o * jb->in + col0 + j;
        if (off >= wk->bad_at) break;
        float wv, rv;
        lk_to_f32(&wv, (const char *)win + j * esz, (lk_dtype)jb->dt, 1);
        lk_to_f32(&rv, (const char *)res + j * esz, (lk_dtype)jb->dt, 1);
        if (isfinite(wv) && !isfinite(rv)) {
            wk->bad_at = off;
            wk->bad_w = wv;
            wk->bad_r = rv;
            break;
        }
    }
}

/* The rare lanes of a vector path: elements [col0, col0 + n) of row o
 * (n <= 64), W read from src (the weight's dtype; may equal dst), the
 * delta from d32 (narrow) or d64 (wide), written to dst with every rule of
 * the scalar definition (NaN, Inf), noting a finite weight made
 * non-finite. */
LK_KERNEL_SLOW void lk_kernel_finish_slow(lk_kworker *wk, size_t o, size_t col0, size_t n, const void *src,
                                          const float *d32, const double *d64, void *dst) {
    const lk_kjob *jb = wk->job;
    const lk_dtype dt = (lk_dtype)jb->dt;
    const size_t esz = lk_dtype_size(dt);
    unsigned char win[64 * 4], res[64 * 4];
    memcpy(win, src, n * esz);
    int bad = 0;
    for (size_t j = 0; j < n; j++) {
        if (dt == LK_DTYPE_F32) {
            uint32_t wb, rb;
            memcpy(&wb, win + j * 4, 4);
            rb = scalar_round_f64_to_f32(wb, d64[j]);
            memcpy(res + j * 4, &rb, 4);
            bad |= ((rb & 0x7f800000u) == 0x7f800000u) & ((wb & 0x7f800000u) != 0x7f800000u);
        } else {
            float wv, rv;
            lk_to_f32(&wv, win + j * esz, dt, 1);
            rv = scalar_round_f32(wv, d32[j]);
            lk_from_f32(res + j * esz, &rv, dt, 1);
            float back;
            lk_to_f32(&back, res + j * esz, dt, 1);
            bad |= isfinite(wv) && !isfinite(back);
        }
    }
    memcpy(dst, res, n * esz);
    if (bad) lk_kernel_note_bad(wk, o, col0, n, win, res);
}

#endif
