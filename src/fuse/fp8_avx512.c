/* fp8_avx512.c — the FP8 fuse's per-row epilogue (fuse/fp8.h) for
 * AVX-512 (F, BW, VL, DQ), 8 elements per step in double lanes.
 *
 * Per element the same operations as lk_fp8_round_portable, each an IEEE
 * operation with one rounding (or exact), so the bits are the same:
 *   decode by bit manipulation (a normal code's bits shifted into a
 *   double's fields and rebiased; a subnormal's integer times its quantum:
 *   both exact, equal to the table's values), w0 = code * s_old (exact),
 *   v = w0 + d, q = v / s_new (vdivpd, correctly rounded; skipped when
 *   s_new is 1, as the scalar path skips it), then fp8_from_double's
 *   integer rounding on q's bits, lane by lane: round to nearest-even, or
 *   stochastic with lk_fp8_random_bits (SplitMix64's finaliser on 64-bit
 *   lanes, vpmullq). The lanes the fast path does not cover go to the
 *   scalar code, one element at a time: an Inf/NaN code, a non-finite v, a
 *   |q| beyond the format's max (overflow or a tie at the top), and in
 *   stochastic mode a |q| so small that the quantum is over 2^63 times
 *   q's last bit (zero, double subnormals). So in the fast lanes the result
 *   is a finite code and nothing overflows: the counters are the scalar
 *   path's. Row tails (n % 8) are scalar too. */
#include "fuse/fp8.h"

#ifdef LK_FP8_X86
#include <immintrin.h>

#define LK_T __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define LK_TI static inline __attribute__((always_inline)) LK_T

/* A format's constants, by value: the entry points below call the
 * always-inline bodies with literal ones (e4m3fn or e5m2), so the shifts
 * take immediates and nothing is reloaded after each store to w. */
typedef struct fmtc {
    int mb, bias, special; /* mantissa bits, bias, the first Inf/NaN magnitude */
    double max;
} fmtc;
#define E4M3C ((fmtc){3, 7, 0x7f, 448.0})
#define E5M2C ((fmtc){2, 15, 0x7c, 57344.0})

/* The 8 codes' exact values as doubles (Inf/NaN codes: garbage, the
 * caller sends those lanes to the scalar path). */
LK_TI __m512d decode8(__m512i code, fmtc f) {
    const __m512i mag = _mm512_and_si512(code, _mm512_set1_epi64(0x7f));
    const __m512i norm = _mm512_add_epi64(_mm512_slli_epi64(mag, (unsigned)(52 - f.mb)),
                                          _mm512_set1_epi64((int64_t)(1023 - f.bias) << 52));
    /* a subnormal code: its integer times the quantum 2^(1 - bias - mbits) (exact) */
    const __m512d quantum = _mm512_castsi512_pd(_mm512_set1_epi64((int64_t)(1023 + 1 - f.bias - f.mb) << 52));
    const __m512d sub = _mm512_mul_pd(_mm512_cvtepi64_pd(mag), quantum);
    const __mmask8 is_sub = _mm512_cmplt_epi64_mask(mag, _mm512_set1_epi64(1 << f.mb));
    const __m512i val = _mm512_mask_blend_epi64(is_sub, norm, _mm512_castpd_si512(sub));
    const __m512i sign = _mm512_slli_epi64(_mm512_and_si512(code, _mm512_set1_epi64(0x80)), 56);
    return _mm512_castsi512_pd(_mm512_or_si512(val, sign));
}

/* Lanes holding an Inf or NaN code. */
LK_TI __mmask8 special8(__m512i code, fmtc f) {
    const __m512i mag = _mm512_and_si512(code, _mm512_set1_epi64(0x7f));
    return _mm512_cmpge_epi64_mask(mag, _mm512_set1_epi64(f.special));
}

LK_TI __m512i load_codes(const uint8_t *w) {
    return _mm512_cvtepu8_epi64(_mm_loadl_epi64((const __m128i *)(const void *)w));
}

LK_TI float amax_impl(const lk_fp8_ctx *x, const uint8_t *w, const float *d, size_t n, double s_old, float m,
                      const fmtc f) {
    const __m512d so = _mm512_set1_pd(s_old);
    __m256 vm = _mm256_set1_ps(m);
    size_t c = 0;
    for (; c + 8 <= n; c += 8) {
        const __m512i code = load_codes(w + c);
        if (special8(code, f)) {
            m = lk_fp8_amax_portable(x, w + c, d + c, 8, s_old, m);
            continue;
        }
        const __m512d v = _mm512_add_pd(_mm512_mul_pd(decode8(code, f), so), _mm512_cvtps_pd(_mm256_loadu_ps(d + c)));
        const __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), _mm512_cvtpd_ps(v));
        vm = _mm256_max_ps(a, vm); /* a > vm ? a : vm: a NaN never wins, as in the scalar loop */
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, vm);
    for (int i = 0; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
    return lk_fp8_amax_portable(x, w + c, d + c, n - c, s_old, m);
}

LK_T float lk_fp8_amax_avx512(const lk_fp8_ctx *x, const uint8_t *w, const float *d, size_t n, double s_old,
                              float m) {
    return x->fmt->mbits == 3 ? amax_impl(x, w, d, n, s_old, m, E4M3C) : amax_impl(x, w, d, n, s_old, m, E5M2C);
}

/* SplitMix64's finaliser, 8 lanes (lk_fp8_random_bits). */
LK_TI __m512i random8(uint64_t key, uint64_t e) {
    const __m512i idx = _mm512_add_epi64(_mm512_set1_epi64((int64_t)(e + 1)), _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0));
    __m512i z = _mm512_add_epi64(_mm512_set1_epi64((int64_t)key),
                                 _mm512_mullo_epi64(idx, _mm512_set1_epi64((int64_t)0x9e3779b97f4a7c15ull)));
    z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)), _mm512_set1_epi64((int64_t)0xbf58476d1ce4e5b9ull));
    z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)), _mm512_set1_epi64((int64_t)0x94d049bb133111ebull));
    z = _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
    return _mm512_srli_epi64(z, 32);
}

LK_TI void round_impl(const lk_fp8_ctx *x, uint8_t *w, const float *d, size_t n, double s_old, double s_new,
                      size_t e0, lk_fp8_stats *st, const fmtc f, const int stoch) {
    const int mb = f.mb, emin = 1 - f.bias, divide = s_new != 1.0;
    const uint64_t key = x->key;
    const __m512d so = _mm512_set1_pd(s_old), sn = _mm512_set1_pd(s_new), vmax = _mm512_set1_pd(f.max);
    const __m512d dmax = _mm512_set1_pd(1.7976931348623157e308);
    const __m512i one = _mm512_set1_epi64(1), c63 = _mm512_set1_epi64(63);
    size_t c = 0;
    for (; c + 8 <= n; c += 8) {
        const __m512i code = load_codes(w + c);
        __mmask8 rare = special8(code, f);
        const __m512d v = _mm512_add_pd(_mm512_mul_pd(decode8(code, f), so), _mm512_cvtps_pd(_mm256_loadu_ps(d + c)));
        const __m512d q = divide ? _mm512_div_pd(v, sn) : v;
        rare |= _mm512_cmp_pd_mask(_mm512_abs_pd(v), dmax, _CMP_NLE_UQ); /* Inf, NaN */
        rare |= _mm512_cmp_pd_mask(_mm512_abs_pd(q), vmax, _CMP_NLE_UQ); /* beyond max, Inf, NaN */
        /* fp8_from_double on q's bits: m with the hidden one, e unbiased;
         * the quantum's exponent max(e, emin) - mbits; sh = bits of m
         * below the quantum (>= 52 - mbits) */
        const __m512i u = _mm512_castpd_si512(q);
        const __m512i sign = _mm512_and_si512(_mm512_srli_epi64(u, 56), _mm512_set1_epi64(0x80));
        const __m512i e = _mm512_sub_epi64(_mm512_and_si512(_mm512_srli_epi64(u, 52), _mm512_set1_epi64(0x7ff)),
                                           _mm512_set1_epi64(1023));
        const __m512i m = _mm512_or_si512(_mm512_and_si512(u, _mm512_set1_epi64(0xfffffffffffffll)),
                                          _mm512_set1_epi64(1ll << 52));
        const __m512i ec = _mm512_max_epi64(e, _mm512_set1_epi64(emin));
        __m512i sh = _mm512_add_epi64(_mm512_sub_epi64(ec, e), _mm512_set1_epi64(52 - mb));
        /* nearest: a quantum over 2^63 x q's last bit rounds to 0, as
         * sh = 63 does (m < 2^53 < half); stochastic: the scalar path */
        if (stoch) rare |= _mm512_cmpgt_epi64_mask(sh, c63);
        sh = _mm512_min_epi64(sh, c63);
        __m512i r = _mm512_srlv_epi64(m, sh);
        const __m512i rem = _mm512_and_si512(m, _mm512_sub_epi64(_mm512_sllv_epi64(one, sh), one));
        __mmask8 up;
        if (stoch) { /* up iff rbits * 2^-32 < rem * 2^-sh (sh >= 49) */
            const __m512i rb = random8(key, e0 + c);
            up = _mm512_cmplt_epu64_mask(_mm512_sllv_epi64(rb, _mm512_sub_epi64(sh, _mm512_set1_epi64(32))), rem);
        } else {
            const __m512i half = _mm512_sllv_epi64(one, _mm512_sub_epi64(sh, one));
            up = _mm512_cmpgt_epu64_mask(rem, half) |
                 (_mm512_cmpeq_epu64_mask(rem, half) & _mm512_test_epi64_mask(r, one));
        }
        r = _mm512_mask_add_epi64(r, up, r, one);
        /* code = ((max(e, emin) + bias - 1) << mbits) + r: one formula for
         * subnormal results, normal ones and a carry into the next binade */
        const __m512i cv = _mm512_add_epi64(
            _mm512_slli_epi64(_mm512_add_epi64(ec, _mm512_set1_epi64(f.bias - 1)), (unsigned)mb), r);
        const __m128i out = _mm512_cvtepi64_epi8(_mm512_or_si512(cv, sign));
        if (!rare) {
            _mm_storel_epi64((__m128i *)(void *)(w + c), out);
            continue;
        }
        _mm_mask_storeu_epi8(w + c, (__mmask16)(uint8_t)~rare, out);
        for (int i = 0; i < 8; i++)
            if (rare >> i & 1) lk_fp8_round_portable(x, w + c + i, d + c + i, 1, s_old, s_new, e0 + c + i, st);
    }
    lk_fp8_round_portable(x, w + c, d + c, n - c, s_old, s_new, e0 + c, st);
}

LK_T void lk_fp8_round_avx512(const lk_fp8_ctx *x, uint8_t *w, const float *d, size_t n, double s_old,
                              double s_new, size_t e0, lk_fp8_stats *st) {
    if (x->fmt->mbits == 3) {
        if (x->stoch) round_impl(x, w, d, n, s_old, s_new, e0, st, E4M3C, 1);
        else round_impl(x, w, d, n, s_old, s_new, e0, st, E4M3C, 0);
    } else {
        if (x->stoch) round_impl(x, w, d, n, s_old, s_new, e0, st, E5M2C, 1);
        else round_impl(x, w, d, n, s_old, s_new, e0, st, E5M2C, 0);
    }
}
#endif
