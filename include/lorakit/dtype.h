/* lorakit/dtype.h — safetensors dtypes and F32/F16/BF16/FP8 conversion.
 *
 * Every safetensors dtype can be named, sized, read and copied; only F32,
 * F16 and BF16 are fusable. f32 -> f16/bf16 rounds to nearest, ties to even;
 * NaN stays NaN (quiet, sign kept); overflow gives Inf. The bulk converters
 * are vectorised where the compiler can and fall back to the scalar code. */
#ifndef LORAKIT_DTYPE_H
#define LORAKIT_DTYPE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum lk_dtype {
    LK_DTYPE_INVALID = 0,
    LK_DTYPE_BOOL,
    LK_DTYPE_U8,
    LK_DTYPE_I8,
    LK_DTYPE_F8_E5M2,
    LK_DTYPE_F8_E4M3,
    LK_DTYPE_I16,
    LK_DTYPE_U16,
    LK_DTYPE_F16,
    LK_DTYPE_BF16,
    LK_DTYPE_I32,
    LK_DTYPE_U32,
    LK_DTYPE_F32,
    LK_DTYPE_F64,
    LK_DTYPE_I64,
    LK_DTYPE_U64,
    LK_DTYPE_COUNT
} lk_dtype;

/* Element size in bytes (0 for INVALID). */
size_t lk_dtype_size(lk_dtype d);
/* The safetensors name ("F32", "BF16", ...). */
const char *lk_dtype_name(lk_dtype d);
/* Parses a safetensors dtype name of length len; INVALID if unknown. */
lk_dtype lk_dtype_from_name(const char *name, size_t len);
/* 1 for F32, F16, BF16. */
int lk_dtype_is_fusable(lk_dtype d);

float lk_bf16_to_f32(uint16_t h);
uint16_t lk_f32_to_bf16(float f);
float lk_f16_to_f32(uint16_t h);
uint16_t lk_f32_to_f16(float f);

/* FP8: F8_E4M3 is e4m3fn (no Inf; S.1111.111 is NaN; max 448), F8_E5M2
 * IEEE-like (Inf, NaNs; max 57344). FP8 weights are fused by their own
 * path (lk_fuse_fp8), not by lk_fuse_tensor's 16/32-bit kernel. */
int lk_dtype_is_fp8(lk_dtype d);
/* The largest finite value of FP8 dtype d (448 or 57344). */
double lk_fp8_max(lk_dtype d);
/* The exact value of an FP8 code (NaN for NaN codes, +-Inf for e5m2's). */
float lk_fp8_to_f32(uint8_t code, lk_dtype d);
/* Rounds x into FP8 dtype d once: to nearest, ties to even, with an
 * unbounded exponent (stochastic == 0), or stochastically: up to the next
 * FP8 value (away from zero) iff rbits * 2^-32 < the fraction of the way
 * there (so P(up) equals the fraction to within 2^-32). NaN gives the NaN
 * code with x's sign. Returns 1, with *code = +-max, when the result would
 * lie beyond the largest finite (nearest: e4m3fn |x| > 464, e5m2
 * |x| >= 61440; stochastic: |x| > max; Inf always); else 0. */
int lk_fp8_from_double(double x, lk_dtype d, int stochastic, uint32_t rbits, uint8_t *code);

/* dst[i] = (float)src[i] for n elements of a fusable or FP8 dtype (FP8 exact). */
void lk_to_f32(float *dst, const void *src, lk_dtype d, size_t n);
/* dst[i] = round(src[i]) into a fusable dtype, RNE. */
void lk_from_f32(void *dst, const float *src, lk_dtype d, size_t n);

#ifdef __cplusplus
}
#endif
#endif
