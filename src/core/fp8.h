/* core/fp8.h — FP8 decoding and rounding as inline functions, shared by
 * src/core/dtype.c (the public lk_fp8_* functions) and the FP8 fuse loop
 * (src/fuse/fp8.c), which calls them once per element and must not pay a
 * call; and, LK_HD (core/hd.h), by the device fuse kernel (kernel_dev.h),
 * which calls these very functions (the format passed by value in its
 * arguments: device code does not read these host constants). Internal to
 * the library. */
#ifndef LK_CORE_FP8_H
#define LK_CORE_FP8_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#include "core/bits.h"
#include "core/hd.h"

/* count of leading zeros of a non-zero 64-bit value, on the host and on a device */
#ifdef __CUDA_ARCH__
#define LK_FP8_CLZLL(x) __clzll((long long)(x))
#else
#define LK_FP8_CLZLL(x) __builtin_clzll(x)
#endif

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

static const fp8fmt LK_FP8_E4M3_FMT = {3, 7, 448.0, 0x7e, 0x7f, 0};
static const fp8fmt LK_FP8_E5M2_FMT = {2, 15, 57344.0, 0x7b, 0x7e, 0x7c};

LK_HD float fp8_to_f32(uint8_t c, const fp8fmt *f) {
    uint32_t sign = (uint32_t)(c & 0x80u) << 24;
    uint32_t e = (c & 0x7fu) >> f->mbits, m = c & ((1u << f->mbits) - 1u);
    uint32_t emax = 0x7fu >> f->mbits;
    float v;
    if (f->infcode && e == emax) {
        v = m ? lk_u2f(0x7fc00000u) : lk_u2f(0x7f800000u);
    } else if (!f->infcode && (c & 0x7fu) == 0x7fu) {
        v = lk_u2f(0x7fc00000u);
    } else if (e == 0) { /* subnormal: m * 2^(1 - bias - mbits), exact */
        v = (float)m * lk_u2f((uint32_t)(127 + 1 - f->bias - f->mbits) << 23);
    } else {
        v = lk_u2f(((e - (uint32_t)f->bias + 127u) << 23) | (m << (23 - f->mbits)));
    }
    return lk_u2f(lk_f2u(v) | sign);
}

/* Integer rounding on the double's bits (no FP environment dependence, no
 * libm): the significand m (53 bits with the hidden one) is shifted right
 * so its last kept bit is the FP8 quantum 2^(max(e, emin) - mbits); the
 * dropped bits decide the rounding. */
LK_HD int fp8_from_double(double x, const fp8fmt *f, int stochastic, uint32_t rbits, uint8_t *code) {
    uint64_t u = lk_d2u(x);
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
        e = -1074 + 63 - LK_FP8_CLZLL(m);
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
            up = (int)((rem > half) | ((rem == half) & (int)(r & 1)));
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

#endif
