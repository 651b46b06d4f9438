/* fuse/fp8.h — the FP8 fuse's per-row epilogue (src/fuse/fp8.c): the
 * per-element definition in plain C (lk_fp8_*_portable), and the AVX-512
 * one (fp8_avx512.c); fp8.c also has a branch-free C version for the avx2
 * and portable paths. All compute, element by
 * element, exactly the chain fp8.c's header states (decode, w0 = code *
 * s_old, v = w0 + d, q = v / s_new in double, one FP8 rounding), so they
 * give identical bytes; fp8.c picks one per call from lk_fuse_kernel_path.
 * Internal to src/fuse. */
#ifndef LK_FUSE_FP8_H
#define LK_FUSE_FP8_H

/* The chain's mul and add stay two roundings: the fuse layer is built
 * with -ffp-contract=off (CMakeLists.txt), so no compiler fuses them. */

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include "core/fp8.h"
#include "fuse/fp8elem.h"

typedef struct lk_fp8_ctx {
    const fp8fmt *fmt;
    int stoch;          /* stochastic rounding, bits keyed by (key, element index) */
    uint64_t key;       /* lk_fp8_stream_key(seed, name) */
    const float *dec;   /* the 256 codes' values */
} lk_fp8_ctx;

typedef struct lk_fp8_stats {
    size_t over;  /* elements that overflow the format's range */
    size_t bad_e; /* first element index made non-finite from a finite weight, or SIZE_MAX */
    double bad_v;
} lk_fp8_stats;

/* max(m, max_c |(float)(code[c] * s_old + d[c])|) over c < n (NaN never
 * wins). */
typedef float (*lk_fp8_amax_fn)(const lk_fp8_ctx *x, const uint8_t *w, const float *d, size_t n, double s_old,
                                float m);
/* w[c] = the FP8 rounding of (code[c] * s_old + d[c]) / s_new, c < n, in
 * place; e0 is w[0]'s element index in the tensor (the stochastic key). */
typedef void (*lk_fp8_round_fn)(const lk_fp8_ctx *x, uint8_t *w, const float *d, size_t n, double s_old,
                                double s_new, size_t e0, lk_fp8_stats *st);

/* The per-element definition in plain C: the portable path, and the vector
 * paths' rare lanes and row tails (inline here, so the vector files call
 * nothing in fp8.c, their dispatcher), element by element the rule of
 * fuse/fp8elem.h, which the device kernel runs too. */
static inline float lk_fp8_amax_portable(const lk_fp8_ctx *x, const uint8_t *w, const float *d, size_t n, double s_old, float m) {
    for (size_t c = 0; c < n; c++) {
        float a = lk_fp8_elem_abs(x->dec[w[c]], d[c], s_old);
        m = a > m ? a : m; /* NaN never wins */
    }
    return m;
}

static inline void lk_fp8_round_portable(const lk_fp8_ctx *x, uint8_t *w, const float *d, size_t n, double s_old,
                                         double s_new, size_t e0, lk_fp8_stats *st) {
    for (size_t c = 0; c < n; c++) {
        const size_t e = e0 + c;
        uint8_t code;
        int bad;
        double v;
        st->over += (size_t)lk_fp8_elem(x->dec[w[c]], d[c], s_old, s_new, x->fmt, x->stoch, x->key, e, &code, &bad, &v);
        if (bad && e < st->bad_e) {
            st->bad_e = e;
            st->bad_v = v;
        }
        w[c] = code;
    }
}
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define LK_FP8_X86 1
float lk_fp8_amax_avx512(const lk_fp8_ctx *x, const uint8_t *w, const float *d, size_t n, double s_old, float m);
void lk_fp8_round_avx512(const lk_fp8_ctx *x, uint8_t *w, const float *d, size_t n, double s_old, double s_new,
                         size_t e0, lk_fp8_stats *st);
#endif

#endif
