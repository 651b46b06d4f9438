/* round.h — the fuse kernel's per-element rules (kernel.c's canonical
 * arithmetic, steps 4 and 5), written once: W + d rounded to odd in the
 * accumulator's format, the NaN rule, the one rounding into the weight's
 * dtype, and the non-finite test. kernel_scalar.h gives them to every CPU
 * path (the vector paths implement the same rules lane-wise and are tested
 * bit for bit against these); the device kernels (kernel_dev.h, compiled
 * as C for emul and by nvcc for CUDA) call them directly: LK_HD makes them
 * host-and-device functions under nvcc (core/hd.h). Plain C99 + IEEE
 * binary32/64: under nvcc the build's --fmad=false, -ftz=false and IEEE
 * division keep every operation one correctly rounded IEEE operation, as
 * -ffp-contract=off does for the C compiler. Internal. */
#ifndef LK_FUSE_ROUND_H
#define LK_FUSE_ROUND_H

#include <stdint.h>
#include "core/bits.h"
#include "core/hd.h"
#include "core/dtype_scalar.h"

/* Round to odd from round to nearest: s = RN(w + d) and its exact error e
 * (TwoSum: six operations, no branch, no magnitude test). If the sum was
 * inexact (e != 0) and s's last bit is 0, step s one unit toward the
 * exact sum (+1 on the bit pattern when e has s's sign, -1 otherwise):
 * that is the truncated sum with its last bit set. */
LK_HD float lk_round_add_odd_f32(float w, float d) {
    float s = w + d;
    float bb = s - w;
    float e = (w - (s - bb)) + (d - bb);
    uint32_t us = lk_f2u(s), ue = lk_f2u(e);
    uint32_t fin = (us & 0x7f800000u) != 0x7f800000u;
    uint32_t step = ((us ^ ue) >> 31) ? 0xffffffffu : 1u;
    us += (fin & (e != 0.0f) & ((us & 1u) == 0u)) ? step : 0u;
    return lk_u2f(us);
}

LK_HD double lk_round_add_odd_f64(double w, double d) {
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
LK_HD float lk_round_f32(float w, float d) {
    uint32_t uw = lk_f2u(w), ur = lk_f2u(lk_round_add_odd_f32(w, d));
    uint32_t r = (uw & 0x7fffffffu) > 0x7f800000u ? (uw | 0x00400000u)
                 : (ur & 0x7fffffffu) > 0x7f800000u ? 0x7fc00000u
                                                     : ur;
    return lk_u2f(r);
}

LK_HD uint32_t lk_round_f64_to_f32(uint32_t uw, double d) {
    double r = lk_round_add_odd_f64((double)lk_u2f(uw), d);
    uint32_t ur = lk_f2u((float)r); /* RNE, the one rounding */
    return (uw & 0x7fffffffu) > 0x7f800000u ? (uw | 0x00400000u)
           : (ur & 0x7fffffffu) > 0x7f800000u ? 0x7fc00000u
                                               : ur;
}

/* ---- one weight element, the final bits ---- */

/* A BF16 / F16 weight element w (its bits) plus the f32 delta d. */
LK_HD uint16_t lk_round_bf16(uint16_t w, float d) { return lk_sc_f32_to_bf16(lk_round_f32(lk_sc_bf16_to_f32(w), d)); }
LK_HD uint16_t lk_round_f16(uint16_t w, float d) { return lk_sc_f32_to_f16(lk_round_f32(lk_sc_f16_to_f32(w), d)); }

/* 1 when a finite weight (bits w) became Inf or NaN (bits r): the
 * kernel's non-finite error. mask: the dtype's exponent bits. */
LK_HD int lk_round_made_nonfinite(uint32_t w, uint32_t r, uint32_t mask) {
    return (r & mask) == mask && (w & mask) != mask;
}
#define LK_ROUND_EXP_F32 0x7f800000u
#define LK_ROUND_EXP_BF16 0x7f80u
#define LK_ROUND_EXP_F16 0x7c00u

/* A dense term's delta of one element (terms.c step 2): x = acc(s * D),
 * the product in f64, rounded once into the accumulator (f32: s = 1 gives
 * D itself, the same bits). */
LK_HD float lk_round_dense_x32(double s, float D) { return s == 1.0 ? D : (float)(s * (double)D); }
LK_HD double lk_round_dense_x64(double s, float D) { return s * (double)D; }

#endif
