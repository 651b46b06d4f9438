/* fp8elem.h — the FP8 fuse's per-element rule (fp8.c's header, steps 2-4
 * for one element), written once for the CPU (fp8.h's portable loops,
 * which every CPU path falls back to for its rare lanes and tails) and the
 * device kernel (kernel_dev.h, compiled as C for emul and by nvcc for
 * CUDA; LK_HD: core/hd.h):
 *   w0 = code's value * s_old, v = w0 + d          (double, exact decode)
 *   |v| as float                                     (the rescale's amax)
 *   q = s_new == 1 ? v : v / s_new, rounded once into FP8 by
 *   fp8_from_double (core/fp8.h): nearest-even, or stochastic with the 32
 *   bits fp8_random_bits(key, element index).
 * Every operation is one IEEE double operation (-ffp-contract=off for C,
 * --fmad=false and IEEE division under nvcc). Internal. */
#ifndef LK_FUSE_FP8ELEM_H
#define LK_FUSE_FP8ELEM_H

#include <math.h>
#include <stdint.h>
#include "core/hd.h"
#include "core/fp8.h"

/* SplitMix64's finaliser, and the stochastic rounding's 32 random bits for
 * element `index` of the stream `key` (lk_fp8_random_bits, fuse.h). */
LK_HD uint64_t fp8_mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
LK_HD uint32_t fp8_random_bits(uint64_t key, uint64_t index) {
    return (uint32_t)(fp8_mix64(key + (index + 1) * 0x9e3779b97f4a7c15ull) >> 32);
}

/* |(float)(wv * s_old + d)|: one element's part of the rescale's amax (wv
 * the code's exact value). */
LK_HD float lk_fp8_elem_abs(float wv, float d, double s_old) {
    return fabsf((float)((double)wv * s_old + (double)d));
}

/* Element e's new code (*code) from its code's exact value wv and delta d;
 * returns 1 when it overflows the format (fp8_from_double's rule: *code is
 * then +-max). *made_bad: v became non-finite from a finite w0 (*v its
 * value), the non-finite error's element. */
LK_HD int lk_fp8_elem(float wv, float d, double s_old, double s_new, const fp8fmt *fmt, int stoch, uint64_t key,
                      uint64_t e, uint8_t *code, int *made_bad, double *v) {
    const double w0 = (double)wv * s_old;
    *v = w0 + (double)d;
    *made_bad = !isfinite(*v) && isfinite(w0);
    return fp8_from_double(s_new == 1.0 ? *v : *v / s_new, fmt, stoch, stoch ? fp8_random_bits(key, e) : 0, code);
}

#endif
