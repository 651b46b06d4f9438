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

static inline uint32_t f2u(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static inline float u2f(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float bf16_to_f32(uint16_t h) { return u2f((uint32_t)h << 16); }

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u = f2u(f);
    uint32_t isnan = (u & 0x7fffffffu) > 0x7f800000u;
    /* RNE: add 0x7fff plus the lowest kept bit; carries into the exponent
     * give the correctly rounded result, including overflow to Inf. */
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t t = u >> 16;
    uint32_t q = t | (((t & 0x7fu) == 0) ? 0x40u : 0u);
    return (uint16_t)(isnan ? q : r);
}

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
    uint32_t em = (uint32_t)h & 0x7fffu;
    uint32_t normal = (em << 13) + ((127u - 15u) << 23);
    uint32_t infnan = (em << 13) | 0x7f800000u;
    /* Subnormal: value = em * 2^-24, exact in float. */
    uint32_t sub = f2u((float)em * 5.9604644775390625e-08f);
    uint32_t r = em >= 0x7c00u ? infnan : (em < 0x0400u ? sub : normal);
    return u2f(r | sign);
}

static inline uint16_t f32_to_f16(float f) {
    uint32_t u = f2u(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    /* NaN: keep the top 10 payload bits, quiet bit if that leaves zero. */
    uint32_t m = (a >> 13) & 0x3ffu;
    uint32_t nan = 0x7c00u | m | (m == 0 ? 0x200u : 0u);
    /* Values >= 65520 round to Inf. */
    uint32_t big = 0x7c00u;
    /* Below 2^-14 the result is subnormal: adding 0.5 aligns the bits so the
     * FPU's own RNE does the rounding; then subtract the magic's bits. */
    uint32_t sub = f2u(u2f(a) + 0.5f) - 0x3f000000u;
    /* Normal: rebias, RNE on the 13 dropped bits. */
    uint32_t odd = (a >> 13) & 1u;
    uint32_t nrm = (a + ((uint32_t)(15 - 127) << 23) + 0xfffu + odd) >> 13;
    uint32_t r = a > 0x7f800000u ? nan
                 : a >= 0x477ff000u ? big
                 : a < 0x38800000u ? sub
                                    : nrm;
    return (uint16_t)(r | sign);
}

/* ---- FP8 ----
 * F8_E4M3 is e4m3fn (OCP/NVIDIA, torch.float8_e4m3fn): bias 7, 3 mantissa
 * bits, no infinities, S.1111.111 the only NaN per sign, so the largest
 * finite is S.1111.110 = 448. F8_E5M2 is IEEE-like: bias 15, 2 mantissa
 * bits, S.11111.00 = Inf, S.11111.xx NaN, largest finite 57344.
 * Decoding is exact (every FP8 value is a float). Encoding takes a double
 * and rounds once: to nearest, ties to even, with an unbounded exponent,
 * then checks the range (so for e4m3fn exactly 464 = halfway between 448
 * and the would-be 480 ties to 448, whose mantissa 110 is even, and only
 * |x| > 464 overflows; for e5m2 57344's mantissa 11 is odd, so 61440 ties
 * up, and |x| >= 61440 overflows), or stochastically. Subnormals round on
 * the fixed quantum 2^(1-bias-mbits). */
typedef struct {
    int mbits, bias;
    double max;
    uint8_t maxcode, nancode, infcode; /* infcode 0: no infinities */
} fp8fmt;

static const fp8fmt FP8_E4M3 = {3, 7, 448.0, 0x7e, 0x7f, 0};
static const fp8fmt FP8_E5M2 = {2, 15, 57344.0, 0x7b, 0x7e, 0x7c};

int lk_dtype_is_fp8(lk_dtype d) { return d == LK_DTYPE_F8_E4M3 || d == LK_DTYPE_F8_E5M2; }

double lk_fp8_max(lk_dtype d) { return d == LK_DTYPE_F8_E5M2 ? FP8_E5M2.max : FP8_E4M3.max; }

static inline float fp8_to_f32(uint8_t c, const fp8fmt *f) {
    uint32_t sign = (uint32_t)(c & 0x80u) << 24;
    uint32_t e = (c & 0x7fu) >> f->mbits, m = c & ((1u << f->mbits) - 1u);
    uint32_t emax = 0x7fu >> f->mbits;
    float v;
    if (f->infcode && e == emax) {
        v = m ? u2f(0x7fc00000u) : u2f(0x7f800000u);
    } else if (!f->infcode && (c & 0x7fu) == 0x7fu) {
        v = u2f(0x7fc00000u);
    } else if (e == 0) { /* subnormal: m * 2^(1 - bias - mbits), exact */
        v = (float)m * u2f((uint32_t)(127 + 1 - f->bias - f->mbits) << 23);
    } else {
        v = u2f(((e - (uint32_t)f->bias + 127u) << 23) | (m << (23 - f->mbits)));
    }
    return u2f(f2u(v) | sign);
}

float lk_fp8_to_f32(uint8_t code, lk_dtype d) {
    return fp8_to_f32(code, d == LK_DTYPE_F8_E5M2 ? &FP8_E5M2 : &FP8_E4M3);
}

/* Integer rounding on the double's bits (no FP environment dependence, no
 * libm): the significand m (53 bits with the hidden one) is shifted right
 * so its last kept bit is the FP8 quantum 2^(max(e, emin) - mbits); the
 * dropped bits decide the rounding. */
int lk_fp8_from_double(double x, lk_dtype d, int stochastic, uint32_t rbits, uint8_t *code) {
    const fp8fmt *f = d == LK_DTYPE_F8_E5M2 ? &FP8_E5M2 : &FP8_E4M3;
    uint64_t u;
    memcpy(&u, &x, 8);
    uint8_t sign = (uint8_t)((u >> 56) & 0x80u);
    uint64_t a = u & 0x7fffffffffffffffull;
    if (a > 0x7ff0000000000000ull) { /* NaN */
        *code = sign | f->nancode;
        return 0;
    }
    if (a == 0) {
        *code = sign;
        return 0;
    }
    if (a == 0x7ff0000000000000ull) {
        *code = sign | f->maxcode;
        return 1;
    }
    int be = (int)(a >> 52);
    uint64_t m = a & 0xfffffffffffffull;
    int e;
    if (be == 0) { /* a double subnormal: far below any FP8 value */
        e = -1074 + 63 - __builtin_clzll(m);
        m <<= 52 - (e + 1074); /* normalise so the leading one is bit 52 */
    } else {
        e = be - 1023;
        m |= 1ull << 52;
    }
    const int emin = 1 - f->bias, emax = (0x7f >> f->mbits) - f->bias; /* emax: top binade incl. NaN/Inf codes */
    if (e > emax) {
        *code = sign | f->maxcode;
        return 1;
    }
    int qe = (e < emin ? emin : e) - f->mbits; /* the quantum's exponent */
    int shift = 52 - (e - qe);                  /* bits of m below the quantum */
    uint64_t r, rem;
    int up;
    if (shift >= 64) {
        r = 0;
        rem = m; /* fraction m / 2^shift < 2^-10 */
        up = stochastic ? ((double)rbits < ldexp((double)m, 32 - shift)) : 0;
    } else {
        r = m >> shift;
        rem = m & ((1ull << shift) - 1);
        if (stochastic) {
            /* up iff rbits * 2^-32 < rem * 2^-shift */
            up = shift >= 32 ? ((uint64_t)rbits << (shift - 32)) < rem : (uint64_t)rbits < (rem << (32 - shift));
        } else {
            uint64_t half = 1ull << (shift - 1);
            up = rem > half || (rem == half && (r & 1));
        }
    }
    r += (uint64_t)up;
    if (stochastic && fabs(x) > f->max) {
        *code = sign | f->maxcode;
        return 1;
    }
    unsigned one = 1u << f->mbits;
    if (r >= 2 * one) { /* rounded up into the next binade */
        r >>= 1;
        qe++;
    }
    unsigned c;
    if (r < one) c = (unsigned)r; /* subnormal (or zero) */
    else c = ((unsigned)(qe + f->mbits + f->bias) << f->mbits) | ((unsigned)r - one);
    if (c > f->maxcode) {
        *code = sign | f->maxcode;
        return 1;
    }
    *code = sign | (uint8_t)c;
    return 0;
}

float lk_bf16_to_f32(uint16_t h) { return bf16_to_f32(h); }
uint16_t lk_f32_to_bf16(float f) { return f32_to_bf16(f); }
float lk_f16_to_f32(uint16_t h) { return f16_to_f32(h); }
uint16_t lk_f32_to_f16(float f) { return f32_to_f16(f); }

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(LK_NO_CLONES)
#define LK_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define LK_CLONES
#endif

LK_CLONES static void bf16_to_f32_n(float *restrict d, const uint16_t *restrict s, size_t n) {
    for (size_t i = 0; i < n; i++) d[i] = bf16_to_f32(s[i]);
}
LK_CLONES static void f16_to_f32_n(float *restrict d, const uint16_t *restrict s, size_t n) {
    for (size_t i = 0; i < n; i++) d[i] = f16_to_f32(s[i]);
}
LK_CLONES static void f32_to_bf16_n(uint16_t *restrict d, const float *restrict s, size_t n) {
    for (size_t i = 0; i < n; i++) d[i] = f32_to_bf16(s[i]);
}
LK_CLONES static void f32_to_f16_n(uint16_t *restrict d, const float *restrict s, size_t n) {
    for (size_t i = 0; i < n; i++) d[i] = f32_to_f16(s[i]);
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
