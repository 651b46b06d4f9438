/* dtype_scalar.h — one F16 / BF16 <-> F32 conversion of one value, the
 * rules of lorakit/dtype.h (RNE, NaN kept quiet, overflow to Inf, f16
 * subnormals exact), written once for dtype.c's bulk converters and for the
 * device kernels (LK_HD: host and device under nvcc). Branch-free selects,
 * so the bulk loops auto-vectorise. Internal. */
#ifndef LK_CORE_DTYPE_SCALAR_H
#define LK_CORE_DTYPE_SCALAR_H

#include <stdint.h>
#include "core/bits.h"
#include "core/hd.h"

LK_HD float lk_sc_bf16_to_f32(uint16_t h) { return lk_u2f((uint32_t)h << 16); }

LK_HD uint16_t lk_sc_f32_to_bf16(float f) {
    uint32_t u = lk_f2u(f);
    uint32_t isnan = (u & 0x7fffffffu) > 0x7f800000u;
    /* RNE: add 0x7fff plus the lowest kept bit; carries into the exponent
     * give the correctly rounded result, including overflow to Inf. */
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t t = u >> 16;
    uint32_t q = t | (((t & 0x7fu) == 0) ? 0x40u : 0u);
    return (uint16_t)(isnan ? q : r);
}

LK_HD float lk_sc_f16_to_f32(uint16_t h) {
    uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
    uint32_t em = (uint32_t)h & 0x7fffu;
    uint32_t normal = (em << 13) + ((127u - 15u) << 23);
    uint32_t infnan = (em << 13) | 0x7f800000u;
    /* Subnormal: value = em * 2^-24, exact in float. */
    uint32_t sub = lk_f2u((float)em * 5.9604644775390625e-08f);
    uint32_t r = em >= 0x7c00u ? infnan : (em < 0x0400u ? sub : normal);
    return lk_u2f(r | sign);
}

LK_HD uint16_t lk_sc_f32_to_f16(float f) {
    uint32_t u = lk_f2u(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    /* NaN: keep the top 10 payload bits, quiet bit if that leaves zero. */
    uint32_t m = (a >> 13) & 0x3ffu;
    uint32_t nan = 0x7c00u | m | (m == 0 ? 0x200u : 0u);
    /* Values >= 65520 round to Inf. */
    uint32_t big = 0x7c00u;
    /* Below 2^-14 the result is subnormal: adding 0.5 aligns the bits so the
     * FPU's own RNE does the rounding; then subtract the magic's bits. */
    uint32_t sub = lk_f2u(lk_u2f(a) + 0.5f) - 0x3f000000u;
    /* Normal: rebias, RNE on the 13 dropped bits. */
    uint32_t odd = (a >> 13) & 1u;
    uint32_t nrm = (a + ((uint32_t)(15 - 127) << 23) + 0xfffu + odd) >> 13;
    uint32_t r = a > 0x7f800000u ? nan
                 : a >= 0x477ff000u ? big
                 : a < 0x38800000u ? sub
                                    : nrm;
    return (uint16_t)(r | sign);
}

#endif
