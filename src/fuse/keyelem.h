/* keyelem.h — the per-element rules of plan.c's double path (replacements,
 * 1-D vector terms, DoRA), written once for the CPU (plan.c) and the
 * device kernel (kernel_dev.h, compiled as C for emul and by nvcc for
 * CUDA; LK_HD: core/hd.h). What plan.c's header states, element by
 * element:
 *   w = (double) the weight's value;
 *   replacement R at strength s:  x = s == 1 ? R : w + s (R - w)
 *   terms on a 2-D weight:        x = x + (double) d   (d the fuse chain)
 *   vector terms on a 1-D tensor: x = x + (fma chain over the terms of
 *                                 s_t * B_t[j], terms in order, from 0)
 *   DoRA:                         v = w + (double) d, x = finish(w, v, f)
 *                                 with f = m / (sqrt(ss) + eps) per row or
 *                                 channel (lk_key_dora_factor: host only,
 *                                 so no division or square root runs on a
 *                                 device) and ss the fma chain of the
 *                                 squares in plan.c's order;
 * then x is stored once (lk_key_store): rounded to odd into f32 (F16 /
 * BF16 weights, so that their one RNE narrowing is the correct rounding of
 * x) or to nearest (F32); a NaN x is the weight's own NaN quieted when the
 * weight was NaN, else the dtype's positive quiet NaN (the fuse kernel's
 * rule, round.h), so no hardware's NaN propagation shows in the bytes.
 * Every operation is one IEEE double operation (no contraction: the
 * build's -ffp-contract=off and --fmad=false). Internal. */
#ifndef LK_FUSE_KEYELEM_H
#define LK_FUSE_KEYELEM_H

#include <stdint.h>
#include "lorakit/dtype.h"
#include "core/bits.h"
#include "core/hd.h"
#include "core/dtype_scalar.h"

/* x rounded to odd into f32 (a finite inexact RNE result with an even last
 * bit is stepped one unit toward x: nextafterf's step, in bits). */
LK_HD float lk_key_odd_f32(double x) {
    const float f = (float)x;
    uint32_t u = lk_f2u(f);
    if ((u & 0x7f800000u) != 0x7f800000u && (double)f != x && !(u & 1u)) {
        if (f == 0.0f) u = x > 0.0 ? 1u : 0x80000001u;
        else u += (x > (double)f) == (f > 0.0f) ? 1u : 0xffffffffu;
    }
    return lk_u2f(u);
}

/* The stored bits of x in dtype dt (F32 / F16 / BF16), w the old bits. */
LK_HD uint32_t lk_key_store(double x, uint32_t w, int dt) {
    if (x != x) {
        if (dt == LK_DTYPE_F32) return (w & 0x7fffffffu) > 0x7f800000u ? w | 0x00400000u : 0x7fc00000u;
        if (dt == LK_DTYPE_BF16) return (w & 0x7fffu) > 0x7f80u ? w | 0x40u : 0x7fc0u;
        return (w & 0x7fffu) > 0x7c00u ? w | 0x200u : 0x7e00u;
    }
    if (dt == LK_DTYPE_F32) return lk_f2u((float)x);
    const float f = lk_key_odd_f32(x);
    return dt == LK_DTYPE_BF16 ? lk_sc_f32_to_bf16(f) : lk_sc_f32_to_f16(f);
}

/* A value of dtype dt (F32 / F16 / BF16) as f32 bits' value. */
LK_HD float lk_key_load(const void *p, int dt, uint64_t i) {
    if (dt == LK_DTYPE_F32) return ((const float *)p)[i];
    const uint16_t h = ((const uint16_t *)p)[i];
    return dt == LK_DTYPE_BF16 ? lk_sc_bf16_to_f32(h) : lk_sc_f16_to_f32(h);
}

/* The weight's old bits at element i. */
LK_HD uint32_t lk_key_bits(const void *p, int dt, uint64_t i) {
    return dt == LK_DTYPE_F32 ? ((const uint32_t *)p)[i] : ((const uint16_t *)p)[i];
}

LK_HD void lk_key_put(void *p, int dt, uint64_t i, uint32_t bits) {
    if (dt == LK_DTYPE_F32) ((uint32_t *)p)[i] = bits;
    else ((uint16_t *)p)[i] = (uint16_t)bits;
}

/* A replacement r at strength s. */
LK_HD double lk_key_replace(double w, double r, double s) { return s == 1.0 ? r : w + s * (r - w); }

/* DoRA's finish (plan.c's dora_rule.finish): w the base value, v = w + c d,
 * f = m / (norm + eps). */
enum { LK_KEY_DORA_INTERP_W, LK_KEY_DORA_INTERP_V, LK_KEY_DORA_PEFT };
LK_HD double lk_key_dora_finish(int finish, double sd, double w, double v, double f) {
    if (finish == LK_KEY_DORA_PEFT) return f * v;
    if (finish == LK_KEY_DORA_INTERP_V) return sd == 1.0 ? f * v : v + sd * (f * v - v);
    return sd == 1.0 ? f * v : w + sd * (f * v - w);
}

#endif
