/* kernel_scalar.h — the kernel's per-element rounding rules as inline
 * scalar code, shared by kernel.c (the exported lk_fuse_add_odd_* and
 * lk_fuse_round_* of fuse/fuse.h) and the generic block functions.
 * The vector paths (kernel_avx512.c, kernel_avx2.c) implement the same
 * rules lane-wise; tests/test_fuse_kernel.c checks the bytes of every path. */
#ifndef LK_FUSE_KERNEL_SCALAR_H
#define LK_FUSE_KERNEL_SCALAR_H

#include <stdint.h>
#include <string.h>
#include "core/bits.h"

/* Round to odd from round to nearest: s = RN(w + d) and its exact error e
 * (TwoSum: six operations, no branch, no magnitude test). If the sum was
 * inexact (e != 0) and s's last bit is 0, step s one unit toward the
 * exact sum (+1 on the bit pattern when e has s's sign, -1 otherwise):
 * that is the truncated sum with its last bit set. */
static inline float scalar_add_odd_f32(float w, float d) {
    float s = w + d;
    float bb = s - w;
    float e = (w - (s - bb)) + (d - bb);
    uint32_t us = lk_f2u(s), ue = lk_f2u(e);
    uint32_t fin = (us & 0x7f800000u) != 0x7f800000u;
    uint32_t step = ((us ^ ue) >> 31) ? 0xffffffffu : 1u;
    us += (fin & (e != 0.0f) & ((us & 1u) == 0u)) ? step : 0u;
    return lk_u2f(us);
}

static inline double scalar_add_odd_f64(double w, double d) {
    double s = w + d;
    double bb = s - w;
    double e = (w - (s - bb)) + (d - bb);
    uint64_t us = lk_d2u(s), ue = lk_d2u(e);
    uint64_t fin = (us & 0x7ff0000000000000ull) != 0x7ff0000000000000ull;
    uint64_t step = ((us ^ ue) >> 63) ? ~0ull : 1ull;
    us += (fin & (e != 0.0) & ((us & 1u) == 0u)) ? step : 0u;
    return lk_u2d(us);
}

/* The NaN rule on top: a NaN weight stays that NaN, quieted; a NaN made
 * from a non-NaN weight is the positive quiet NaN. */
static inline float scalar_round_f32(float w, float d) {
    uint32_t uw = lk_f2u(w), ur = lk_f2u(scalar_add_odd_f32(w, d));
    uint32_t r = (uw & 0x7fffffffu) > 0x7f800000u ? (uw | 0x00400000u)
                 : (ur & 0x7fffffffu) > 0x7f800000u ? 0x7fc00000u
                                                     : ur;
    return lk_u2f(r);
}

static inline uint32_t scalar_round_f64_to_f32(uint32_t uw, double d) {
    double r = scalar_add_odd_f64((double)lk_u2f(uw), d);
    uint32_t ur = lk_f2u((float)r); /* RNE, the one rounding */
    return (uw & 0x7fffffffu) > 0x7f800000u ? (uw | 0x00400000u)
           : (ur & 0x7fffffffu) > 0x7f800000u ? 0x7fc00000u
                                               : ur;
}

#endif
