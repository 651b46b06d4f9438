/* kernel_avx512.c — the fuse kernel's block function for AVX-512 (F, BW,
 * VL, DQ) with FMA: the path that runs at the memory system's limit.
 *
 * Blocking: LK_KMR (6) rows x one panel (64 f32 columns, or 32 f64
 * columns) of the delta live in 24 zmm accumulators for the whole k loop;
 * per k, the panel's 4 vectors are loaded once (contiguous, cache-line
 * aligned, packed by kernel.c, L1-resident) and each row's B'[o,k] is
 * broadcast: 24 FMAs per 4 loads + 6 broadcasts, enough independent chains
 * to keep both FMA pipes busy (4 rows x 4 was 16 per 8). Then the
 * epilogue reads the 4 row segments of W, adds and rounds once into W's
 * dtype (round_bf16 explains the BF16 shortcut; F16 and F32 use TwoSum
 * and the odd step of kernel_scalar.h lane by lane) and writes; a group of
 * lanes with an Inf or NaN result (or a BF16 tie) is redone by lk_kernel_finish_slow
 * (the NaN rule, the non-finite check), so the fast case has no NaN code.
 * W is read once and written once; W's lines a few panels ahead (both
 * lines of each row's 128-byte segment) are prefetched while the sums run. Column tails use masked loads/stores
 * (the packed panels are zero-padded, so the sums need no tail code).
 *
 * The bits equal the portable path's: the chain is the same sequence of
 * correctly rounded fmas, and the epilogue is the same integer rules. */
#include "fuse/fuse.h"

#ifdef LK_KERNEL_X86
#include <immintrin.h>
#include <string.h>

#include "lorakit/dtype.h"

/* This file is compiled twice: as lk_kblock_avx512 (AVX-512 F/BW/VL/DQ)
 * and, through kernel_avx512bf16.c, as lk_kblock_avx512bf16, which adds
 * AVX512_BF16 for a shorter BF16 epilogue (round_bf16). */
#ifndef LK_K512_NAME
#define LK_K512_NAME lk_kblock_avx512
#define LK_K512_TARGET "avx512f,avx512bw,avx512vl,avx512dq,fma,f16c"
#define LK_K512_BF16ISA 0
#endif
#define LK_T __attribute__((target(LK_K512_TARGET)))
#define LK_TI static inline __attribute__((always_inline)) LK_T

/* W lines this far ahead (bytes) are prefetched, per row. */
#ifndef PF_AHEAD
#define PF_AHEAD 512
#endif

LK_TI __m512 odd_add_ps(__m512 w, __m512 d) {
    const __m512 s = _mm512_add_ps(w, d);
    const __m512 bb = _mm512_sub_ps(s, w);
    const __m512 e = _mm512_add_ps(_mm512_sub_ps(w, _mm512_sub_ps(s, bb)), _mm512_sub_ps(d, bb));
    const __m512i us = _mm512_castps_si512(s), ue = _mm512_castps_si512(e);
    const __m512i one = _mm512_set1_epi32(1), expm = _mm512_set1_epi32(0x7f800000);
    __mmask16 m = _mm512_cmpneq_epi32_mask(_mm512_and_si512(us, expm), expm);
    m &= _mm512_cmp_ps_mask(e, _mm512_setzero_ps(), _CMP_NEQ_OQ);
    m &= _mm512_testn_epi32_mask(us, one);
    const __m512i step = _mm512_or_si512(_mm512_srai_epi32(_mm512_xor_si512(us, ue), 31), one);
    return _mm512_castsi512_ps(_mm512_mask_add_epi32(us, m, us, step));
}

LK_TI __m512d odd_add_pd(__m512d w, __m512d d) {
    const __m512d s = _mm512_add_pd(w, d);
    const __m512d bb = _mm512_sub_pd(s, w);
    const __m512d e = _mm512_add_pd(_mm512_sub_pd(w, _mm512_sub_pd(s, bb)), _mm512_sub_pd(d, bb));
    const __m512i us = _mm512_castpd_si512(s), ue = _mm512_castpd_si512(e);
    const __m512i one = _mm512_set1_epi64(1), expm = _mm512_set1_epi64(0x7ff0000000000000ll);
    __mmask8 m = _mm512_cmpneq_epi64_mask(_mm512_and_si512(us, expm), expm);
    m &= _mm512_cmp_pd_mask(e, _mm512_setzero_pd(), _CMP_NEQ_OQ);
    m &= _mm512_testn_epi64_mask(us, one);
    const __m512i step = _mm512_or_si512(_mm512_srai_epi64(_mm512_xor_si512(us, ue), 63), one);
    return _mm512_castsi512_pd(_mm512_mask_add_epi64(us, m, us, step));
}

/* 16 lanes of a BF16 weight, the fast case: returns the 16 result
 * halves and sets *special for lanes the caller must redo with the full
 * rules (lk_kernel_finish_slow). s = RN32(w + d) rounds to BF16 exactly
 * as the exact sum does unless s is itself a BF16 midpoint (low 16 bits
 * 0x8000): a midpoint is an f32, so if the exact sum were on its other
 * side, the midpoint would be nearer to it than s is. Only those lanes
 * (about 2^-16 of them) need TwoSum's error to break the tie, and they
 * go to the slow path with the Inf/NaN lanes; every other lane is one
 * add and the RNE shift. */
#if !LK_K512_BF16ISA
LK_TI __m256i round_bf16(__m256i w16, __m512 d, __mmask32 *special) {
    const __m512 w = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(w16), 16));
    const __m512i su = _mm512_castps_si512(_mm512_add_ps(w, d));
    const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                          _mm512_and_si512(_mm512_srli_epi32(su, 16), _mm512_set1_epi32(1)));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(su, bias), 16);
    /* |s| >= 0x7f7f8000: s is Inf or NaN, or rounds to Inf (a NaN s such
     * as 0x7fffffff would wrap to 0x8000 when the bias is added) */
    *special = _mm512_cmpeq_epi32_mask(_mm512_and_si512(su, _mm512_set1_epi32(0xffff)), _mm512_set1_epi32(0x8000)) |
               _mm512_cmpge_epu32_mask(_mm512_and_si512(su, _mm512_set1_epi32(0x7fffffff)),
                                       _mm512_set1_epi32(0x7f7f8000));
    return _mm512_cvtepi32_epi16(r);
}

#else
/* The same with AVX512_BF16: VCVTNEPS2BF16 is the RNE shift in one
 * instruction, but it flushes a denormal input to zero, so a denormal s
 * joins the slow lanes (VFPCLASSPS: NaN, Inf, denormal) with the ties and
 * a result that rounded to Inf. The tie test compares the low 16-bit
 * halves only (the even word lanes). */
LK_TI __m256i round_bf16(__m256i w16, __m512 d, __mmask32 *special) {
    const __m512 w = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(w16), 16));
    const __m512 s = _mm512_add_ps(w, d);
    const __m256i r = (__m256i)_mm512_cvtneps_pbh(s);
    const __mmask32 tie = _mm512_mask_cmpeq_epi16_mask((__mmask32)0x55555555u, _mm512_castps_si512(s),
                                                       _mm512_set1_epi32(0x8000));
    const __m256i em = _mm256_set1_epi16(0x7f80);
    *special = tie | (__mmask32)_mm512_fpclass_ps_mask(s, 0xB9) |
               (__mmask32)_mm256_cmpeq_epi16_mask(_mm256_and_si256(r, em), em);
    return r;
}
#endif

/* The same for F16: odd rounding in f32, then the hardware's RNE. */
LK_TI __m256i round_f16(__m256i w16, __m512 d, __mmask32 *special) {
    const __m512 s = odd_add_ps(_mm512_cvtph_ps(w16), d);
    const __m256i out = _mm512_cvtps_ph(s, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i em = _mm256_set1_epi16(0x7c00);
    *special = _mm256_cmpeq_epi16_mask(_mm256_and_si256(out, em), em);
    return out;
}

/* 8 lanes of an F32 weight with an f64 delta. */
LK_TI __m256i round_f32w(__m256i w32, __m512d d, __mmask8 *special) {
    const __m512d s = odd_add_pd(_mm512_cvtps_pd(_mm256_castsi256_ps(w32)), d);
    const __m256i out = _mm256_castps_si256(_mm512_cvtpd_ps(s)); /* RNE: the one rounding */
    const __m256i em = _mm256_set1_epi32(0x7f800000);
    *special = _mm256_cmpeq_epi32_mask(_mm256_and_si256(out, em), em);
    return out;
}

/* Lanes [0, n) of a 16-lane group, n may be <= 0 or >= 16. */
LK_TI __mmask16 lanes16(long n) { return n >= 16 ? (__mmask16)0xffff : n <= 0 ? 0 : (__mmask16)((1u << n) - 1u); }
LK_TI __mmask8 lanes8(long n) { return n >= 8 ? (__mmask8)0xff : n <= 0 ? 0 : (__mmask8)((1u << n) - 1u); }

/* One row segment's lanes (n of them real: <= 64 f32 or <= 32 f64 deltas
 * in d0..d3) through the exact slow path: rare (a special lane: Inf, NaN,
 * a BF16 tie), kept out of line so the accumulators never need an address
 * in the fast path. */
__attribute__((noinline, cold)) LK_T static void row_slow(lk_kworker *wk, int wide, size_t o, size_t col0, size_t n,
                                                          const unsigned char *src, unsigned char *dst, __m512i d0,
                                                          __m512i d1, __m512i d2, __m512i d3) {
    union {
        float f[64];
        double d[32];
    } dv;
    _mm512_storeu_si512(dv.f, d0);
    _mm512_storeu_si512(dv.f + 16, d1);
    _mm512_storeu_si512(dv.f + 32, d2);
    _mm512_storeu_si512(dv.f + 48, d3);
    lk_kernel_finish_slow(wk, o, col0, n, src, wide ? NULL : dv.f, wide ? dv.d : NULL, dst);
}

/* The W lines PF_AHEAD bytes past each of MR rows' panel segment (128
 * bytes: two lines), fetched while the chain runs. */
LK_TI void prefetch_rows(const unsigned char *seg, size_t ldw, const int MR) {
#pragma GCC unroll 6
    for (int r = 0; r < MR; r++) {
        const char *pf = (const char *)seg + (size_t)r * ldw + PF_AHEAD;
        _mm_prefetch(pf, _MM_HINT_T0);
        _mm_prefetch(pf + 64, _MM_HINT_T0);
    }
}

/* The chain of an MR x panel block: acc[r][h] = the delta of row r, the
 * panel's h-th vector of columns, from the panel ap ([k][PW]) and B' rows
 * bs (stride R): the first product, then one fma per k (step 3 of
 * kernel.c). chain16: f32, 64 columns; chain32: f64, 32 columns. */
#define LK_CHAIN(NAME, VT, ET, PW, VL, LOAD, SET1, MUL, FMA)                                                   \
    LK_TI void NAME(VT acc[LK_KMR][4], const ET *ap, const ET *bs, size_t R, const int MR) {                  \
        {                                                                                                      \
            const VT a0 = LOAD(ap), a1 = LOAD(ap + VL), a2 = LOAD(ap + 2 * VL), a3 = LOAD(ap + 3 * VL);        \
            _Pragma("GCC unroll 6") for (int r = 0; r < MR; r++) {                                             \
                const VT b = SET1(bs[(size_t)r * R]);                                                          \
                acc[r][0] = MUL(b, a0);                                                                        \
                acc[r][1] = MUL(b, a1);                                                                        \
                acc[r][2] = MUL(b, a2);                                                                        \
                acc[r][3] = MUL(b, a3);                                                                        \
            }                                                                                                  \
        }                                                                                                      \
        for (size_t k = 1; k < R; k++) {                                                                       \
            const ET *a = ap + k * PW;                                                                         \
            const VT a0 = LOAD(a), a1 = LOAD(a + VL), a2 = LOAD(a + 2 * VL), a3 = LOAD(a + 3 * VL);            \
            _Pragma("GCC unroll 6") for (int r = 0; r < MR; r++) {                                             \
                const VT b = SET1(bs[(size_t)r * R + k]);                                                      \
                acc[r][0] = FMA(b, a0, acc[r][0]);                                                             \
                acc[r][1] = FMA(b, a1, acc[r][1]);                                                             \
                acc[r][2] = FMA(b, a2, acc[r][2]);                                                             \
                acc[r][3] = FMA(b, a3, acc[r][3]);                                                             \
            }                                                                                                  \
        }                                                                                                      \
    }
LK_CHAIN(chain16, __m512, float, LK_PW32, 16, _mm512_loadu_ps, _mm512_set1_ps, _mm512_mul_ps, _mm512_fmadd_ps)
LK_CHAIN(chain32, __m512d, double, LK_PW64, 8, _mm512_loadu_pd, _mm512_set1_pd, _mm512_mul_pd, _mm512_fmadd_pd)
#undef LK_CHAIN

/* The MR x 64 f32 block and its BF16/F16 epilogue. MR is a constant in
 * each instantiation and every loop over rows and vectors is unrolled, so
 * acc lives in registers from the first product to the store. */
LK_TI void block16(const lk_kjob *jb, lk_kworker *wk, size_t o, const int MR, size_t p0, size_t p1) {
    const size_t R = jb->R, in = jb->in, ldw = in * 2;
    const int bf = jb->dt == LK_DTYPE_BF16;
    const float *bs = jb->Bs32 + o * R;
    const unsigned char *win = (const unsigned char *)jb->w_in + o * ldw;
    unsigned char *wout = (unsigned char *)jb->w_out + o * ldw;
    for (size_t p = p0; p < p1; p++) {
        const size_t col0 = p * LK_PW32;
        const long n = (long)(in - col0);
        __m512 acc[LK_KMR][4];
        prefetch_rows(win + col0 * 2, ldw, MR);
        chain16(acc, jb->Ap32 + p * R * LK_PW32, bs, R, MR);
        const int whole = n >= LK_PW32;
#pragma GCC unroll 6
        for (int r = 0; r < MR; r++) {
            const unsigned char *src = win + (size_t)r * ldw + col0 * 2;
            unsigned char *dst = wout + (size_t)r * ldw + col0 * 2;
            if (__builtin_expect(whole, 1)) { /* the common case: whole panel, one test per row */
                __m256i o16[4];
                __mmask32 sp[4];
#pragma GCC unroll 4
                for (int h = 0; h < 4; h++)
                    o16[h] = bf ? round_bf16(_mm256_loadu_si256((const __m256i *)(src + 32 * h)), acc[r][h], &sp[h])
                                : round_f16(_mm256_loadu_si256((const __m256i *)(src + 32 * h)), acc[r][h], &sp[h]);
                if (__builtin_expect((sp[0] | sp[1] | sp[2] | sp[3]) != 0, 0)) {
                    row_slow(wk, 0, o + (size_t)r, col0, LK_PW32, src, dst, _mm512_castps_si512(acc[r][0]),
                             _mm512_castps_si512(acc[r][1]), _mm512_castps_si512(acc[r][2]),
                             _mm512_castps_si512(acc[r][3]));
                    continue;
                }
#pragma GCC unroll 4
                for (int h = 0; h < 4; h++) _mm256_storeu_si256((__m256i *)(dst + 32 * h), o16[h]);
                continue;
            }
            /* the last panel of a row: lanes [0, n); the zero-padded panel
             * gives d = 0 and the masked load w = 0 past n, never special */
            __m256i o16[4];
            __mmask32 spall = 0;
#pragma GCC unroll 4
            for (int h = 0; h < 4; h++) {
                __mmask32 sp;
                const __mmask16 m = lanes16(n - 16 * h);
                const __m256i w16 = _mm256_maskz_loadu_epi16(m, src + 32 * h);
                o16[h] = bf ? round_bf16(w16, acc[r][h], &sp) : round_f16(w16, acc[r][h], &sp);
                spall |= sp;
            }
            if (__builtin_expect(spall != 0, 0)) {
                row_slow(wk, 0, o + (size_t)r, col0, (size_t)n, src, dst, _mm512_castps_si512(acc[r][0]),
                         _mm512_castps_si512(acc[r][1]), _mm512_castps_si512(acc[r][2]),
                         _mm512_castps_si512(acc[r][3]));
                continue;
            }
#pragma GCC unroll 4
            for (int h = 0; h < 4; h++) _mm256_mask_storeu_epi16(dst + 32 * h, lanes16(n - 16 * h), o16[h]);
        }
    }
}

/* The MR x 32 f64 block and its F32 epilogue, unrolled like block16. */
LK_TI void block32(const lk_kjob *jb, lk_kworker *wk, size_t o, const int MR, size_t p0, size_t p1) {
    const size_t R = jb->R, in = jb->in, ldw = in * 4;
    const double *bs = jb->Bs64 + o * R;
    const unsigned char *win = (const unsigned char *)jb->w_in + o * ldw;
    unsigned char *wout = (unsigned char *)jb->w_out + o * ldw;
    for (size_t p = p0; p < p1; p++) {
        const size_t col0 = p * LK_PW64;
        const long n = (long)(in - col0);
        __m512d acc[LK_KMR][4];
        prefetch_rows(win + col0 * 4, ldw, MR);
        chain32(acc, jb->Ap64 + p * R * LK_PW64, bs, R, MR);
        const int whole = n >= LK_PW64;
#pragma GCC unroll 6
        for (int r = 0; r < MR; r++) {
            const unsigned char *src = win + (size_t)r * ldw + col0 * 4;
            unsigned char *dst = wout + (size_t)r * ldw + col0 * 4;
            __m256i o32[4];
            __mmask8 sp[4];
            if (__builtin_expect(whole, 1)) {
#pragma GCC unroll 4
                for (int h = 0; h < 4; h++)
                    o32[h] = round_f32w(_mm256_loadu_si256((const __m256i *)(src + 32 * h)), acc[r][h], &sp[h]);
            } else {
#pragma GCC unroll 4
                for (int h = 0; h < 4; h++) /* past n: w = 0, d = 0, never special */
                    o32[h] = round_f32w(_mm256_maskz_loadu_epi32(lanes8(n - 8 * h), src + 32 * h), acc[r][h], &sp[h]);
            }
            if (__builtin_expect((sp[0] | sp[1] | sp[2] | sp[3]) != 0, 0)) {
                row_slow(wk, 1, o + (size_t)r, col0, whole ? LK_PW64 : (size_t)n, src, dst,
                         _mm512_castpd_si512(acc[r][0]), _mm512_castpd_si512(acc[r][1]),
                         _mm512_castpd_si512(acc[r][2]), _mm512_castpd_si512(acc[r][3]));
                continue;
            }
            if (__builtin_expect(whole, 1)) {
#pragma GCC unroll 4
                for (int h = 0; h < 4; h++) _mm256_storeu_si256((__m256i *)(dst + 32 * h), o32[h]);
            } else {
#pragma GCC unroll 4
                for (int h = 0; h < 4; h++) _mm256_mask_storeu_epi32(dst + 32 * h, lanes8(n - 8 * h), o32[h]);
            }
        }
    }
}

LK_T void LK_K512_NAME(const lk_kjob *jb, lk_kworker *wk, size_t o, int mr, size_t p0, size_t p1) {
#define WIDE(M) block32(jb, wk, o, M, p0, p1)
#define NARROW(M) block16(jb, wk, o, M, p0, p1)
    LK_KMR_DISPATCH(jb->wide, mr, WIDE, NARROW);
#undef WIDE
#undef NARROW
}
#if !LK_K512_BF16ISA /* the delta alone has no BF16 epilogue: built once */
/* MR rows of the delta, every panel, stored (masked in the last panel). */
LK_TI void dblock16(float *d, size_t ld, const float *ap, const float *bs, size_t R, size_t in, const int MR) {
    const size_t npan = (in + LK_PW32 - 1) / LK_PW32;
    for (size_t p = 0; p < npan; p++) {
        const size_t col0 = p * LK_PW32;
        const long n = (long)(in - col0);
        __m512 acc[LK_KMR][4];
        chain16(acc, ap + p * R * LK_PW32, bs, R, MR);
#pragma GCC unroll 6
        for (int r = 0; r < MR; r++) {
            float *dst = d + (size_t)r * ld + col0;
            if (__builtin_expect(n >= LK_PW32, 1)) {
#pragma GCC unroll 4
                for (int h = 0; h < 4; h++) _mm512_storeu_ps(dst + 16 * h, acc[r][h]);
            } else {
#pragma GCC unroll 4
                for (int h = 0; h < 4; h++) _mm512_mask_storeu_ps(dst + 16 * h, lanes16(n - 16 * h), acc[r][h]);
            }
        }
    }
}

LK_T void lk_kdelta32_avx512(float *d, size_t ld, const float *ap, const float *bs, size_t R, size_t in, size_t rows) {
    for (size_t o = 0; o < rows; o += LK_KMR) {
        float *dr = d + o * ld;
        const float *br = bs + o * R;
#define DELTA(M) dblock16(dr, ld, ap, br, R, in, M)
        LK_KMR_SWITCH(rows - o < LK_KMR ? (int)(rows - o) : LK_KMR, DELTA);
#undef DELTA
    }
}
#endif
#endif
