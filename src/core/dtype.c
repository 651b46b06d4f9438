/* dtype.c — safetensors dtype table and F32/F16/BF16/FP8 conversion.
 *
 * The scalar converters are written branch-free (selects, not ifs) so that
 * the bulk loops below auto-vectorise; target_clones builds an AVX2 copy of
 * each bulk loop next to the baseline SSE2 one, picked at load time, so the
 * binary runs on any x86-64. Scalar and bulk paths run the same code, hence
 * give the same bits. NaN payloads are kept where the target has room, and a
 * NaN whose kept payload would be zero gets the quiet bit, so NaN never
 * becomes Inf; f16/bf16 -> f32 -> f16/bf16 is the identity on all patterns. */
#include "lorakit/dtype.h"
#include "lorakit/tensor.h"
#include "core/bits.h"
#include "core/dtype_scalar.h"
#include "core/fp8.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

static const struct {
    const char *name;
    size_t size;
} g_dt[LK_DTYPE_COUNT] = {
    [LK_DTYPE_INVALID] = {"INVALID", 0}, [LK_DTYPE_BOOL] = {"BOOL", 1},
    [LK_DTYPE_U8] = {"U8", 1},           [LK_DTYPE_I8] = {"I8", 1},
    [LK_DTYPE_F8_E5M2] = {"F8_E5M2", 1}, [LK_DTYPE_F8_E4M3] = {"F8_E4M3", 1},
    [LK_DTYPE_I16] = {"I16", 2},         [LK_DTYPE_U16] = {"U16", 2},
    [LK_DTYPE_F16] = {"F16", 2},         [LK_DTYPE_BF16] = {"BF16", 2},
    [LK_DTYPE_I32] = {"I32", 4},         [LK_DTYPE_U32] = {"U32", 4},
    [LK_DTYPE_F32] = {"F32", 4},         [LK_DTYPE_F64] = {"F64", 8},
    [LK_DTYPE_I64] = {"I64", 8},         [LK_DTYPE_U64] = {"U64", 8},
};

size_t lk_dtype_size(lk_dtype d) {
    if ((int)d <= 0 || d >= LK_DTYPE_COUNT) return 0;
    return g_dt[d].size;
}

const char *lk_dtype_name(lk_dtype d) {
    if ((int)d < 0 || d >= LK_DTYPE_COUNT) return "INVALID";
    return g_dt[d].name;
}

lk_dtype lk_dtype_from_name(const char *name, size_t len) {
    for (int i = 1; i < LK_DTYPE_COUNT; i++)
        if (strlen(g_dt[i].name) == len && memcmp(g_dt[i].name, name, len) == 0) return (lk_dtype)i;
    return LK_DTYPE_INVALID;
}

int lk_dtype_is_fusable(lk_dtype d) {
    return d == LK_DTYPE_F32 || d == LK_DTYPE_F16 || d == LK_DTYPE_BF16;
}

int lk_dtype_is_fp8(lk_dtype d) { return d == LK_DTYPE_F8_E4M3 || d == LK_DTYPE_F8_E5M2; }

#define FP8_E4M3 LK_FP8_E4M3_FMT
#define FP8_E5M2 LK_FP8_E5M2_FMT

double lk_fp8_max(lk_dtype d) { return d == LK_DTYPE_F8_E5M2 ? FP8_E5M2.max : FP8_E4M3.max; }

float lk_fp8_to_f32(uint8_t code, lk_dtype d) {
    return fp8_to_f32(code, d == LK_DTYPE_F8_E5M2 ? &FP8_E5M2 : &FP8_E4M3);
}

int lk_fp8_from_double(double x, lk_dtype d, int stochastic, uint32_t rbits, uint8_t *code) {
    return fp8_from_double(x, d == LK_DTYPE_F8_E5M2 ? &FP8_E5M2 : &FP8_E4M3, stochastic, rbits, code);
}

float lk_bf16_to_f32(uint16_t h) { return lk_sc_bf16_to_f32(h); }
uint16_t lk_f32_to_bf16(float f) { return lk_sc_f32_to_bf16(f); }
float lk_f16_to_f32(uint16_t h) { return lk_sc_f16_to_f32(h); }
uint16_t lk_f32_to_f16(float f) { return lk_sc_f32_to_f16(f); }

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(LK_NO_CLONES)
#define LK_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define LK_CLONES
#endif

LK_CLONES static void bf16_to_f32_n(float *restrict d, const uint16_t *restrict s, size_t n) {
    for (size_t i = 0; i < n; i++) d[i] = lk_sc_bf16_to_f32(s[i]);
}
LK_CLONES static void f16_to_f32_n(float *restrict d, const uint16_t *restrict s, size_t n) {
    for (size_t i = 0; i < n; i++) d[i] = lk_sc_f16_to_f32(s[i]);
}
LK_CLONES static void f32_to_bf16_n(uint16_t *restrict d, const float *restrict s, size_t n) {
    for (size_t i = 0; i < n; i++) d[i] = lk_sc_f32_to_bf16(s[i]);
}
LK_CLONES static void f32_to_f16_n(uint16_t *restrict d, const float *restrict s, size_t n) {
    for (size_t i = 0; i < n; i++) d[i] = lk_sc_f32_to_f16(s[i]);
}

/* The 16-bit loops read and write uint16_t, which needs 2-byte alignment,
 * but src/dst may be a tensor inside a file image at any address (the
 * header length of a safetensors file need not be even). Such buffers go
 * through an aligned stack buffer in chunks; the common aligned case runs
 * the loops directly. */
#define BOUNCE 512

static int odd(const void *p) { return ((uintptr_t)p & 1u) != 0; }

void lk_to_f32(float *dst, const void *src, lk_dtype d, size_t n) {
    void (*conv)(float *restrict, const uint16_t *restrict, size_t);
    switch (d) {
    case LK_DTYPE_F32: memmove(dst, src, n * 4); return;
    case LK_DTYPE_BF16: conv = bf16_to_f32_n; break;
    case LK_DTYPE_F16: conv = f16_to_f32_n; break;
    case LK_DTYPE_F8_E4M3:
    case LK_DTYPE_F8_E5M2: {
        const fp8fmt *f = d == LK_DTYPE_F8_E5M2 ? &FP8_E5M2 : &FP8_E4M3;
        const uint8_t *b = src;
        for (size_t i = 0; i < n; i++) dst[i] = fp8_to_f32(b[i], f);
        return;
    }
    default: return; /* callers check lk_dtype_is_fusable / lk_dtype_is_fp8 */
    }
    if (!odd(src)) {
        conv(dst, src, n);
        return;
    }
    uint16_t tmp[BOUNCE];
    for (size_t i = 0; i < n; i += BOUNCE) {
        size_t k = n - i < BOUNCE ? n - i : BOUNCE;
        memcpy(tmp, (const unsigned char *)src + 2 * i, 2 * k);
        conv(dst + i, tmp, k);
    }
}

void lk_from_f32(void *dst, const float *src, lk_dtype d, size_t n) {
    void (*conv)(uint16_t *restrict, const float *restrict, size_t);
    switch (d) {
    case LK_DTYPE_F32: memmove(dst, src, n * 4); return;
    case LK_DTYPE_BF16: conv = f32_to_bf16_n; break;
    case LK_DTYPE_F16: conv = f32_to_f16_n; break;
    default: return;
    }
    if (!odd(dst)) {
        conv(dst, src, n);
        return;
    }
    uint16_t tmp[BOUNCE];
    for (size_t i = 0; i < n; i += BOUNCE) {
        size_t k = n - i < BOUNCE ? n - i : BOUNCE;
        conv(tmp, src + i, k);
        memcpy((unsigned char *)dst + 2 * i, tmp, 2 * k);
    }
}

size_t lk_tensor_numel(const lk_tensor *t) {
    size_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= (size_t)t->shape[i];
    return n;
}

void lk_shape_str(const lk_tensor *t, char *buf, size_t cap) {
    size_t off = 0;
    if (cap == 0) return;
    buf[0] = '\0';
    off += (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < t->ndim && off < cap; i++)
        off += (size_t)snprintf(buf + off, cap - off, i ? ", %lld" : "%lld", (long long)t->shape[i]);
    if (off < cap) snprintf(buf + off, cap - off, "]");
}
