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
#include "fuse/kernel_scalar.h"

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
#define LK_X512_NAME lk_xrows_avx512
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

/* The exact BF16 rounding of 16 lanes in vector code, for a group whose
 * fast case found a tie, or for every group where ties are common: the
 * odd sum (TwoSum and the odd step, as for F16), then RNE on the bits
 * (with AVX512_BF16: VCVTNEPS2BF16, a denormal sum left to the slow path
 * as in round_bf16); *special marks lanes left to the slow path: s Inf or
 * NaN, or a result that rounds to Inf. A dense BF16 delta on a BF16 weight
 * makes ties often (8 significant bits each, so W + D is usually exact in
 * f32 and its low 16 bits are 0x8000 for 1 lane in 2^(bits of D below W's
 * unit), 1 in 64 with the bench's data), far too often for the slow path. */
#if !LK_K512_BF16ISA
LK_TI __m256i round_bf16_odd(__m256i w16, __m512 d, __mmask16 *special) {
    const __m512 w = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(w16), 16));
    const __m512i su = _mm512_castps_si512(odd_add_ps(w, d));
    const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                          _mm512_and_si512(_mm512_srli_epi32(su, 16), _mm512_set1_epi32(1)));
    *special = _mm512_cmpge_epu32_mask(_mm512_and_si512(su, _mm512_set1_epi32(0x7fffffff)),
                                       _mm512_set1_epi32(0x7f7f8000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(su, bias), 16));
}
#else
LK_TI __m256i round_bf16_odd(__m256i w16, __m512 d, __mmask16 *special) {
    const __m512 w = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(w16), 16));
    const __m512 s = odd_add_ps(w, d);
    const __m256i r = (__m256i)_mm512_cvtneps_pbh(s);
    const __m256i em = _mm256_set1_epi16(0x7f80);
    *special = _mm512_fpclass_ps_mask(s, 0xB9) | _mm256_cmpeq_epi16_mask(_mm256_and_si256(r, em), em);
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
#define LK_CHAIN(NAME, VT, ET, PW, VL, LOAD, SET1, MUL, FMA, KEEP)                                             \
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
            VT a0 = LOAD(a), a1 = LOAD(a + VL), a2 = LOAD(a + 2 * VL), a3 = LOAD(a + 3 * VL);                  \
            KEEP(a0, a1, a2, a3);                                                                              \
            _Pragma("GCC unroll 6") for (int r = 0; r < MR; r++) {                                             \
                const VT b = SET1(bs[(size_t)r * R + k]);                                                      \
                acc[r][0] = FMA(b, a0, acc[r][0]);                                                             \
                acc[r][1] = FMA(b, a1, acc[r][1]);                                                             \
                acc[r][2] = FMA(b, a2, acc[r][2]);                                                             \
                acc[r][3] = FMA(b, a3, acc[r][3]);                                                             \
            }                                                                                                  \
        }                                                                                                      \
    }
#define LK_NOKEEP(a0, a1, a2, a3) ((void)0)
/* The A vectors held in registers: an empty asm makes them opaque, so the
 * compiler cannot fold each load into every row's FMA (it did in LoHa's
 * 3-row blocks, two chains at a time: 4 loads per 3 FMAs, load-bound). */
#define LK_KEEP(a0, a1, a2, a3) __asm__("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3))
LK_CHAIN(chain16, __m512, float, LK_PW32, 16, _mm512_loadu_ps, _mm512_set1_ps, _mm512_mul_ps, _mm512_fmadd_ps,
         LK_NOKEEP)
LK_CHAIN(chain32, __m512d, double, LK_PW64, 8, _mm512_loadu_pd, _mm512_set1_pd, _mm512_mul_pd, _mm512_fmadd_pd,
         LK_NOKEEP)
LK_CHAIN(chain16k, __m512, float, LK_PW32, 16, _mm512_loadu_ps, _mm512_set1_ps, _mm512_mul_ps, _mm512_fmadd_ps,
         LK_KEEP)
LK_CHAIN(chain32k, __m512d, double, LK_PW64, 8, _mm512_loadu_pd, _mm512_set1_pd, _mm512_mul_pd, _mm512_fmadd_pd,
         LK_KEEP)
#undef LK_CHAIN
#undef LK_NOKEEP
#undef LK_KEEP

/* One 16-lane group of a narrow weight: the fast rounding into *out; a
 * BF16 tie is redone exactly in vector code (round_bf16_odd). Nonzero:
 * the group needs the slow path (Inf, NaN, or F16's special lanes). */
LK_TI unsigned group16(int bf, __m256i w16, __m512 d, __m256i *out, const int exact) {
    if (exact && bf) {
        __mmask16 sx;
        *out = round_bf16_odd(w16, d, &sx);
        return sx;
    }
    __mmask32 sp;
    *out = bf ? round_bf16(w16, d, &sp) : round_f16(w16, d, &sp);
    if (__builtin_expect(sp != 0, 0) && bf) {
        __mmask16 sx;
        *out = round_bf16_odd(w16, d, &sx);
        return sx;
    }
    return sp;
}

/* One row segment of a narrow (BF16 / F16) weight: v[0..3] the f32 delta
 * of columns col0 .. col0 + 63, n of them real (n >= 64: the whole
 * segment; else lanes [0, n), loaded and stored masked: past n the
 * caller's delta is 0 and the masked load gives w = 0, never special),
 * W + d rounded once from src into dst; a group with an Inf or NaN redone
 * by the slow path. The LoRA block and terms' fused rows (below) all end
 * here. */
LK_TI void seg16x(lk_kworker *wk, int bf, size_t o, size_t col0, long n, const unsigned char *src,
                  unsigned char *dst, const __m512 v[4], const int exact) {
    __m256i o16[4];
    unsigned sp = 0;
    if (__builtin_expect(n >= LK_PW32, 1)) { /* the common case: whole panel, one test per row */
#pragma GCC unroll 4
        for (int h = 0; h < 4; h++) sp |= group16(bf, _mm256_loadu_si256((const __m256i *)(src + 32 * h)), v[h], &o16[h], exact);
        if (__builtin_expect(sp == 0, 1)) {
#pragma GCC unroll 4
            for (int h = 0; h < 4; h++) _mm256_storeu_si256((__m256i *)(dst + 32 * h), o16[h]);
            return;
        }
    } else {
#pragma GCC unroll 4
        for (int h = 0; h < 4; h++)
            sp |= group16(bf, _mm256_maskz_loadu_epi16(lanes16(n - 16 * h), src + 32 * h), v[h], &o16[h], exact);
        if (__builtin_expect(sp == 0, 1)) {
#pragma GCC unroll 4
            for (int h = 0; h < 4; h++) _mm256_mask_storeu_epi16(dst + 32 * h, lanes16(n - 16 * h), o16[h]);
            return;
        }
    }
    row_slow(wk, 0, o, col0, n >= LK_PW32 ? LK_PW32 : (size_t)n, src, dst, _mm512_castps_si512(v[0]),
             _mm512_castps_si512(v[1]), _mm512_castps_si512(v[2]), _mm512_castps_si512(v[3]));
}

LK_TI void seg16(lk_kworker *wk, int bf, size_t o, size_t col0, long n, const unsigned char *src, unsigned char *dst,
                 const __m512 v[4]) {
    seg16x(wk, bf, o, col0, n, src, dst, v, 0);
}

/* The same for an F32 weight: v[0..3] the f64 delta of 32 columns. */
LK_TI void seg32(lk_kworker *wk, size_t o, size_t col0, long n, const unsigned char *src, unsigned char *dst,
                 const __m512d v[4]) {
    const int whole = n >= LK_PW64;
    __m256i o32[4];
    __mmask8 sp[4];
    if (__builtin_expect(whole, 1)) {
#pragma GCC unroll 4
        for (int h = 0; h < 4; h++)
            o32[h] = round_f32w(_mm256_loadu_si256((const __m256i *)(src + 32 * h)), v[h], &sp[h]);
    } else {
#pragma GCC unroll 4
        for (int h = 0; h < 4; h++) /* past n: w = 0, d = 0, never special */
            o32[h] = round_f32w(_mm256_maskz_loadu_epi32(lanes8(n - 8 * h), src + 32 * h), v[h], &sp[h]);
    }
    if (__builtin_expect((sp[0] | sp[1] | sp[2] | sp[3]) != 0, 0)) {
        row_slow(wk, 1, o, col0, whole ? LK_PW64 : (size_t)n, src, dst, _mm512_castpd_si512(v[0]),
                 _mm512_castpd_si512(v[1]), _mm512_castpd_si512(v[2]), _mm512_castpd_si512(v[3]));
        return;
    }
    if (__builtin_expect(whole, 1)) {
#pragma GCC unroll 4
        for (int h = 0; h < 4; h++) _mm256_storeu_si256((__m256i *)(dst + 32 * h), o32[h]);
    } else {
#pragma GCC unroll 4
        for (int h = 0; h < 4; h++) _mm256_mask_storeu_epi32(dst + 32 * h, lanes8(n - 8 * h), o32[h]);
    }
}

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
        __m512 acc[LK_KMR][4];
        prefetch_rows(win + col0 * 2, ldw, MR);
        chain16(acc, jb->Ap32 + p * R * LK_PW32, bs, R, MR);
#pragma GCC unroll 6
        for (int r = 0; r < MR; r++)
            seg16(wk, bf, o + (size_t)r, col0, (long)(in - col0), win + (size_t)r * ldw + col0 * 2,
                  wout + (size_t)r * ldw + col0 * 2, acc[r]);
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
        __m512d acc[LK_KMR][4];
        prefetch_rows(win + col0 * 4, ldw, MR);
        chain32(acc, jb->Ap64 + p * R * LK_PW64, bs, R, MR);
#pragma GCC unroll 6
        for (int r = 0; r < MR; r++)
            seg32(wk, o + (size_t)r, col0, (long)(in - col0), win + (size_t)r * ldw + col0 * 4,
                  wout + (size_t)r * ldw + col0 * 4, acc[r]);
    }
}

LK_T void LK_K512_NAME(const lk_kjob *jb, lk_kworker *wk, size_t o, int mr, size_t p0, size_t p1) {
#define WIDE(M) block32(jb, wk, o, M, p0, p1)
#define NARROW(M) block16(jb, wk, o, M, p0, p1)
    LK_KMR_DISPATCH(jb->wide, mr, WIDE, NARROW);
#undef WIDE
#undef NARROW
}
/* ---- terms.c's fused rows: one LoHa, LoKr or dense term alone ----
 * The delta of each 64-column (f64: 32-column) row segment is made in
 * registers exactly as terms.c's canonical arithmetic says (d0 = +0, then
 * d = acc(d0 + x), x the term's delta) and handed to seg16 / seg32, the
 * LoRA block's single rounding: no row of the delta is ever stored. */

/* LoHa: MR (1..3) rows x one panel get both chains (P1 with the scale in
 * B', P2 without: chain16 / chain32, the LoRA chain's operations) in
 * 2 x MR x 4 registers; x = acc(P1 * P2). */
#define LK_HADA(NAME, VT, ET, PW, CHAIN, MUL, ADD, ZERO, SEG, ESZ, ...)                                       \
    LK_TI void NAME(const lk_xjob *jb, lk_kworker *wk, size_t o, const int MR, size_t p0, size_t p1) {          \
        const size_t R1 = jb->R1, R2 = jb->R2, in = jb->k.in, ldw = in * ESZ;                                  \
        const ET *b1 = (const ET *)jb->bs1 + o * R1, *b2 = (const ET *)jb->bs2 + o * R2;                       \
        const unsigned char *win = (const unsigned char *)jb->k.w_in + o * ldw;                               \
        unsigned char *wout = (unsigned char *)jb->k.w_out + o * ldw;                                          \
        for (size_t p = p0; p < p1; p++) {                                                                     \
            const size_t col0 = p * PW;                                                                        \
            VT p1v[LK_KMR][4], p2v[LK_KMR][4];                                                                 \
            prefetch_rows(win + col0 * ESZ, ldw, MR);                                                          \
            CHAIN(p1v, (const ET *)jb->ap1 + p * R1 * PW, b1, R1, MR);                                         \
            CHAIN(p2v, (const ET *)jb->ap2 + p * R2 * PW, b2, R2, MR);                                         \
            _Pragma("GCC unroll 3") for (int r = 0; r < MR; r++) {                                             \
                VT d[4];                                                                                       \
                _Pragma("GCC unroll 4") for (int h = 0; h < 4; h++) d[h] = ADD(ZERO, MUL(p1v[r][h], p2v[r][h])); \
                SEG(wk, __VA_ARGS__ o + (size_t)r, col0, (long)(in - col0), win + (size_t)r * ldw + col0 * ESZ,    \
                    wout + (size_t)r * ldw + col0 * ESZ, d);                                                   \
            }                                                                                                  \
        }                                                                                                      \
    }
LK_HADA(hada16, __m512, float, LK_PW32, chain16k, _mm512_mul_ps, _mm512_add_ps, _mm512_setzero_ps(), seg16, 2, jb->k.dt == LK_DTYPE_BF16,)
LK_HADA(hada32, __m512d, double, LK_PW64, chain32k, _mm512_mul_pd, _mm512_add_pd, _mm512_setzero_pd(), seg32, 4,)
#undef LK_HADA

/* 16 lanes (n real, masked past n: 0) of a dense delta of dtype DDT from
 * element e, as f32 (exact). */
LK_TI __m512 dense_load16(const void *dense, int ddt, size_t e, long n) {
    const __mmask16 m = lanes16(n);
    if (ddt == LK_DTYPE_F32) return _mm512_maskz_loadu_ps(m, (const float *)dense + e);
    const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)dense + e);
    if (ddt == LK_DTYPE_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* s * (double)x for the low (hi = 0) or high 8 lanes of x, in f64. */
LK_TI __m512d scaled_pd(__m512d s, __m512 x, const int hi) {
    return _mm512_mul_pd(s, _mm512_cvtps_pd(hi ? _mm512_extractf32x8_ps(x, 1) : _mm512_castps512_ps256(x)));
}

/* Dense, narrow: x = acc(s * D) (D itself when s = 1: the same bits), one
 * pass over W and D, 64 columns at a time. */
LK_TI void dense16_rows(const lk_xjob *jb, lk_kworker *wk, size_t o0, size_t o1, const int ddt, const int one) {
    const size_t in = jb->k.in;
    const int bf = jb->k.dt == LK_DTYPE_BF16;
    const __m512d sc = _mm512_set1_pd(jb->scale);
    for (size_t o = o0; o < o1; o++) {
        const unsigned char *src = (const unsigned char *)jb->k.w_in + o * in * 2;
        unsigned char *dst = (unsigned char *)jb->k.w_out + o * in * 2;
        for (size_t c = 0; c < in; c += LK_PW32) {
            const long n = (long)(in - c);
            __m512 d[4];
#pragma GCC unroll 4
            for (int h = 0; h < 4; h++) {
                __m512 x = dense_load16(jb->dense, ddt, o * in + c + 16 * (size_t)h, n - 16 * h);
                if (!one) /* each half rounded once from f64 */
                    x = _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtpd_ps(scaled_pd(sc, x, 0))),
                                           _mm512_cvtpd_ps(scaled_pd(sc, x, 1)), 1);
                d[h] = _mm512_add_ps(_mm512_setzero_ps(), x);
            }
            seg16x(wk, bf, o, c, n, src + c * 2, dst + c * 2, d, 1);
        }
    }
}

/* Dense, wide (F32 weights): x = s * (double)D in f64, 32 columns at a time. */
LK_TI void dense32_rows(const lk_xjob *jb, lk_kworker *wk, size_t o0, size_t o1, const int ddt) {
    const size_t in = jb->k.in;
    const __m512d sc = _mm512_set1_pd(jb->scale);
    for (size_t o = o0; o < o1; o++) {
        const unsigned char *src = (const unsigned char *)jb->k.w_in + o * in * 4;
        unsigned char *dst = (unsigned char *)jb->k.w_out + o * in * 4;
        for (size_t c = 0; c < in; c += LK_PW64) {
            const long n = (long)(in - c);
            __m512d d[4];
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                const __m512 x = dense_load16(jb->dense, ddt, o * in + c + 16 * (size_t)h, n - 16 * h);
                d[2 * h] = _mm512_add_pd(_mm512_setzero_pd(), scaled_pd(sc, x, 0));
                d[2 * h + 1] = _mm512_add_pd(_mm512_setzero_pd(), scaled_pd(sc, x, 1));
            }
            seg32(wk, o, c, n, src + c * 4, dst + c * 4, d);
        }
    }
}

/* LoKr: row o = i c + k of kron(W1s, W2) is, for each q < b, W1s[i, q] *
 * W2[k, :] in columns q D .. q D + D - 1: x = acc(W1s[i, q] * W2[k, m]),
 * 64 (f64: 32) columns of one q at a time (masked past D: W2 0). */
#define LK_KRON(NAME, VT, ET, PW, VL, SET1, MLOAD, MASK, MUL, ADD, ZERO, SEG, ESZ, ...)                         \
    LK_TI void NAME(const lk_xjob *jb, lk_kworker *wk, size_t o0, size_t o1) {                                  \
        const size_t in = jb->k.in, b = jb->b, c = jb->c, D = jb->D;                                           \
        for (size_t o = o0; o < o1; o++) {                                                                     \
            const ET *w1 = (const ET *)jb->w1 + (o / c) * b, *w2 = (const ET *)jb->w2 + (o % c) * D;          \
            const unsigned char *src = (const unsigned char *)jb->k.w_in + o * in * ESZ;                       \
            unsigned char *dst = (unsigned char *)jb->k.w_out + o * in * ESZ;                                  \
            for (size_t q = 0; q < b; q++) {                                                                   \
                const VT s = SET1(w1[q]);                                                                      \
                for (size_t m = 0; m < D; m += PW) {                                                           \
                    const long n = (long)(D - m);                                                              \
                    const size_t col = q * D + m;                                                              \
                    VT d[4];                                                                                   \
                    _Pragma("GCC unroll 4") for (int h = 0; h < 4; h++) d[h] =                                 \
                        ADD(ZERO, MUL(s, MLOAD(MASK(n - VL * h), w2 + m + VL * (size_t)h)));                   \
                    SEG(wk, __VA_ARGS__ o, col, n, src + col * ESZ, dst + col * ESZ, d);                       \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
    }
LK_KRON(kron16_rows, __m512, float, LK_PW32, 16, _mm512_set1_ps, _mm512_maskz_loadu_ps, lanes16, _mm512_mul_ps,
        _mm512_add_ps, _mm512_setzero_ps(), seg16, 2, jb->k.dt == LK_DTYPE_BF16,)
LK_KRON(kron32_rows, __m512d, double, LK_PW64, 8, _mm512_set1_pd, _mm512_maskz_loadu_pd, lanes8, _mm512_mul_pd,
        _mm512_add_pd, _mm512_setzero_pd(), seg32, 4,)
#undef LK_KRON

/* Rows [o0, o1) of the job (kind in jb->kind; see fuse/fuse.h). */
LK_T void LK_X512_NAME(const lk_xjob *jb, lk_kworker *wk, size_t o0, size_t o1) {
    const int wide = jb->k.wide;
    if (jb->kind == LK_TERM_HADA) {
        for (size_t pt = 0; pt < jb->k.npan; pt += jb->k.pan_tile) {
            const size_t pe = pt + jb->k.pan_tile < jb->k.npan ? pt + jb->k.pan_tile : jb->k.npan;
            for (size_t o = o0; o < o1; o += 3) {
                const int mr = o1 - o < 3 ? (int)(o1 - o) : 3;
#define HADA(M) (wide ? hada32(jb, wk, o, M, pt, pe) : hada16(jb, wk, o, M, pt, pe))
                if (mr == 3) HADA(3);
                else if (mr == 2) HADA(2);
                else HADA(1);
#undef HADA
            }
        }
    } else if (jb->kind == LK_TERM_KRON) {
        if (wide) kron32_rows(jb, wk, o0, o1);
        else kron16_rows(jb, wk, o0, o1);
    } else if (wide) {
        if (jb->ddt == LK_DTYPE_F32) dense32_rows(jb, wk, o0, o1, LK_DTYPE_F32);
        else if (jb->ddt == LK_DTYPE_F16) dense32_rows(jb, wk, o0, o1, LK_DTYPE_F16);
        else dense32_rows(jb, wk, o0, o1, LK_DTYPE_BF16);
    } else {
        const int one = jb->scale == 1.0;
#define DENSE(T) (one ? dense16_rows(jb, wk, o0, o1, T, 1) : dense16_rows(jb, wk, o0, o1, T, 0))
        if (jb->ddt == LK_DTYPE_F32) DENSE(LK_DTYPE_F32);
        else if (jb->ddt == LK_DTYPE_F16) DENSE(LK_DTYPE_F16);
        else DENSE(LK_DTYPE_BF16);
#undef DENSE
    }
}

#if !LK_K512_BF16ISA /* the delta alone has no BF16 epilogue: built once */
/* MR rows of the delta, every panel, stored (masked in the last panel):
 * f32 (dblock16, 64 columns a panel) or f64 (dblock32, 32). */
#define LK_DBLOCK(NAME, ET, VT, PW, VL, CHAIN, STORE, MSTORE, MASK)                                           \
    LK_TI void NAME(ET *d, size_t ld, const ET *ap, const ET *bs, size_t R, size_t in, const int MR) {        \
        const size_t npan = (in + PW - 1) / PW;                                                                \
        for (size_t p = 0; p < npan; p++) {                                                                    \
            const size_t col0 = p * PW;                                                                        \
            const long n = (long)(in - col0);                                                                  \
            VT acc[LK_KMR][4];                                                                                 \
            CHAIN(acc, ap + p * R * PW, bs, R, MR);                                                            \
            _Pragma("GCC unroll 6") for (int r = 0; r < MR; r++) {                                             \
                ET *dst = d + (size_t)r * ld + col0;                                                           \
                if (__builtin_expect(n >= PW, 1)) {                                                            \
                    _Pragma("GCC unroll 4") for (int h = 0; h < 4; h++) STORE(dst + VL * h, acc[r][h]);        \
                } else {                                                                                       \
                    _Pragma("GCC unroll 4") for (int h = 0; h < 4; h++)                                        \
                        MSTORE(dst + VL * h, MASK(n - VL * h), acc[r][h]);                                     \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
    }
LK_DBLOCK(dblock16, float, __m512, LK_PW32, 16, chain16, _mm512_storeu_ps, _mm512_mask_storeu_ps, lanes16)
LK_DBLOCK(dblock32, double, __m512d, LK_PW64, 8, chain32, _mm512_storeu_pd, _mm512_mask_storeu_pd, lanes8)
#undef LK_DBLOCK

LK_T void lk_kdelta32_avx512(float *d, size_t ld, const float *ap, const float *bs, size_t R, size_t in, size_t rows) {
    for (size_t o = 0; o < rows; o += LK_KMR) {
        float *dr = d + o * ld;
        const float *br = bs + o * R;
#define DELTA(M) dblock16(dr, ld, ap, br, R, in, M)
        LK_KMR_SWITCH(rows - o < LK_KMR ? (int)(rows - o) : LK_KMR, DELTA);
#undef DELTA
    }
}

LK_T void lk_kdelta64_avx512(double *d, size_t ld, const double *ap, const double *bs, size_t R, size_t in,
                             size_t rows) {
    for (size_t o = 0; o < rows; o += LK_KMR) {
        double *dr = d + o * ld;
        const double *br = bs + o * R;
#define DELTA(M) dblock32(dr, ld, ap, br, R, in, M)
        LK_KMR_SWITCH(rows - o < LK_KMR ? (int)(rows - o) : LK_KMR, DELTA);
#undef DELTA
    }
}
#endif
#endif
