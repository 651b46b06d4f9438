/* kernel_avx2.c — the fuse kernel's block function for AVX2 with FMA and
 * F16C (x86-64 CPUs without AVX-512): the AVX-512 block's design
 * (kernel_avx512.c) in 16 ymm registers.
 *
 * Blocking: the LK_KMR (6) rows of a block x one packed panel (64 f32 or
 * 32 f64 columns, the same panels kernel.c packs for every path) are done
 * as column sub-blocks of NV (2) ymm; each keeps 6 rows x 2 ymm of the
 * delta (12 of the 16 registers) for the whole k loop: per k, 2 loads of
 * A (contiguous, L1-resident) and 6 broadcasts of B'[o,k] feed 12
 * independent FMA chains. (3 rows x 4 ymm, the block as two row groups,
 * was no faster at any rank in two alternating bench fuse runs, one
 * thread, and up to 1.4x slower at r = 8.) The sub-block's epilogue reads
 * its 16 columns (narrow) or 8 (wide) of each row of W, adds and rounds
 * once into W's dtype with the rules of kernel_scalar.h in vector code
 * (BF16: the one-add shortcut of kernel_avx512.c's round_bf16; F16 and F32:
 * TwoSum and the odd step, then the hardware's RNE conversion) and
 * writes. Lanes with an Inf or NaN sum or result, or a BF16 tie, are
 * redone by lk_kernel_finish_slow (the NaN rule, the non-finite check),
 * so the fast case has no NaN code. W's lines a few panels ahead are
 * prefetched. Column tails go through a small zeroed buffer (the packed
 * panels are zero-padded, so the sums need no tail code).
 *
 * The bits equal the portable path's: the chain is the same sequence of
 * correctly rounded operations (first term a product, then one fma per
 * term, k ascending), and the epilogue is the same rules. */
/* (The chain's products are explicit mul / fmadd; the fuse layer is built
 * with -ffp-contract=off besides, so no other add is ever fused.) */
#include "fuse/fuse.h"
#include "fuse/kernel_scalar.h"

#ifdef LK_KERNEL_X86
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "lorakit/dtype.h"

#define LK_T __attribute__((target("avx2,fma,f16c")))
#define LK_TI static inline __attribute__((always_inline)) LK_T

/* W lines this far ahead (bytes) are prefetched, per row. */
#ifndef PF_AHEAD
#define PF_AHEAD 512
#endif

/* ymm accumulators per row in a sub-block (even: the epilogue takes them
 * in pairs); LK_KMR x NV of them live across the k loop. */
#define NV 2
#define SUB32 (8 * NV) /* f32 columns per sub-block */
#define SUB64 (4 * NV) /* f64 columns per sub-block */

/* kernel_scalar.h's scalar_add_odd_* lane-wise, one body for f32 lanes (UT
 * v8u, SH 31) and f64 lanes (v4u, 63) in GCC vector arithmetic (these are
 * plain adds and compares; the casts reinterpret bits): TwoSum, then +-1
 * on the bits of s where s is finite, inexact (e != 0) and even. A NaN e
 * only comes with a non-finite s, whose step is off anyway. */
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint64_t v4u __attribute__((vector_size(32)));
#define ODD_ADD(UT, SH, EXPM, w, d)                                                                          \
    __extension__({                                                                                          \
        const __typeof__(w) s_ = (w) + (d), bb_ = s_ - (w), e_ = ((w) - (s_ - bb_)) + ((d) - bb_);           \
        const UT us_ = (UT)s_, ue_ = (UT)e_;                                                                 \
        const UT on_ = (UT)((us_ & (EXPM)) != (EXPM)) & (UT)(e_ != 0) & (UT)((us_ & 1) == 0);               \
        (__typeof__(w))(us_ + (on_ & (1 - 2 * ((us_ ^ ue_) >> (SH)))));                                     \
    })
LK_TI __m256 odd_add_ps(__m256 w, __m256 d) { return ODD_ADD(v8u, 31, 0x7f800000u, w, d); }
LK_TI __m256d odd_add_pd(__m256d w, __m256d d) { return ODD_ADD(v4u, 63, 0x7ff0000000000000ull, w, d); }

/* 8 lanes of a BF16 weight (w: 8 halves zero-extended to 32 bits), the
 * fast case (kernel_avx512.c's round_bf16 explains it): r = the RNE of
 * s = RN32(w + d) to BF16, in the low 16 bits of each lane; *sp marks the
 * lanes to redo: s Inf/NaN, r Inf (overflow by rounding) or s a BF16
 * midpoint (the tie needs TwoSum's error). s itself is tested: a NaN s
 * such as 0x7fffffff (a factor's NaN carried through the chain) wraps
 * to 0x8000 when the bias is added, so r alone would not show it. */
LK_TI __m256i round_bf16_8(__m256i w32, __m256 d, __m256i *sp) {
    const __m256i su = _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(_mm256_slli_epi32(w32, 16)), d));
    const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                          _mm256_and_si256(_mm256_srli_epi32(su, 16), _mm256_set1_epi32(1)));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(su, bias), 16);
    const __m256i em = _mm256_set1_epi32(0x7f80), em32 = _mm256_set1_epi32(0x7f800000);
    *sp = _mm256_or_si256(
        _mm256_or_si256(_mm256_cmpeq_epi32(_mm256_and_si256(su, _mm256_set1_epi32(0xffff)), _mm256_set1_epi32(0x8000)),
                        _mm256_cmpeq_epi32(_mm256_and_si256(r, em), em)),
        _mm256_cmpeq_epi32(_mm256_and_si256(su, em32), em32));
    return r;
}

/* 16 halves of W at src (BF16 or F16) + the delta's 16 lanes at dv ->
 * 16 result halves; the lanes to redo as a 16-bit mask. */
LK_TI __m256i round16(const unsigned char *src, int bf, const float *dv, unsigned *spm) {
    const __m256 d0 = _mm256_load_ps(dv), d1 = _mm256_load_ps(dv + 8);
    const __m128i w0 = _mm_loadu_si128((const __m128i *)src), w1 = _mm_loadu_si128((const __m128i *)(src + 16));
    if (bf) {
        __m256i s0, s1;
        const __m256i r0 = round_bf16_8(_mm256_cvtepu16_epi32(w0), d0, &s0);
        const __m256i r1 = round_bf16_8(_mm256_cvtepu16_epi32(w1), d1, &s1);
        *spm = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(s0)) |
               (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(s1)) << 8;
        /* r0, r1 < 2^16: pack per 128-bit lane, then put the quarters in order */
        return _mm256_permute4x64_epi64(_mm256_packus_epi32(r0, r1), 0xd8);
    }
    const __m128i o0 = _mm256_cvtps_ph(odd_add_ps(_mm256_cvtph_ps(w0), d0), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m128i o1 = _mm256_cvtps_ph(odd_add_ps(_mm256_cvtph_ps(w1), d1), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m128i em = _mm_set1_epi16(0x7c00);
    const __m128i e0 = _mm_cmpeq_epi16(_mm_and_si128(o0, em), em), e1 = _mm_cmpeq_epi16(_mm_and_si128(o1, em), em);
    *spm = (unsigned)_mm_movemask_epi8(_mm_packs_epi16(e0, e1));
    return _mm256_set_m128i(o1, o0);
}

/* 8 F32 weights at src + the f64 delta's 8 lanes at dv -> 8 result
 * words; the lanes to redo (Inf/NaN result) as an 8-bit mask. */
LK_TI __m256i round8_f32w(const unsigned char *src, const double *dv, unsigned *spm) {
    const __m256d d0 = _mm256_load_pd(dv), d1 = _mm256_load_pd(dv + 4);
    const __m128 w0 = _mm_loadu_ps((const float *)(const void *)src);
    const __m128 w1 = _mm_loadu_ps((const float *)(const void *)(src + 16));
    const __m128 o0 = _mm256_cvtpd_ps(odd_add_pd(_mm256_cvtps_pd(w0), d0)); /* RNE: the one rounding */
    const __m128 o1 = _mm256_cvtpd_ps(odd_add_pd(_mm256_cvtps_pd(w1), d1));
    const __m256i out = _mm256_castps_si256(_mm256_set_m128(o1, o0));
    const __m256i em = _mm256_set1_epi32(0x7f800000);
    *spm = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(out, em), em)));
    return out;
}

/* The epilogue of one row's 16 columns (narrow) or 8 (wide), the delta
 * at dv (32-byte aligned): m of them are real (fewer than a group only in
 * the last panel's tail, which goes through a zeroed buffer). */
LK_TI void finish(lk_kworker *wk, size_t row, size_t col, long m, const unsigned char *src, unsigned char *dst,
                  const int wide, int bf, const void *dv) {
    const long lanes = wide ? 8 : 16;
    const size_t esz = wide ? 4 : 2;
    unsigned char buf[32];
    const unsigned char *s = src;
    if (m < lanes) {
        memset(buf, 0, sizeof buf);
        memcpy(buf, src, (size_t)m * esz);
        s = buf;
    }
    unsigned sp;
    const __m256i out = wide ? round8_f32w(s, dv, &sp) : round16(s, bf, dv, &sp);
    if (m < lanes) sp &= (1u << m) - 1u;
    if (__builtin_expect(sp != 0, 0)) {
        lk_kernel_finish_slow(wk, row, col, (size_t)(m < lanes ? m : lanes), src, wide ? NULL : dv,
                              wide ? dv : NULL, dst);
    } else if (m >= lanes) {
        _mm256_storeu_si256((__m256i *)(void *)dst, out);
    } else {
        _mm256_storeu_si256((__m256i *)(void *)buf, out);
        memcpy(dst, buf, (size_t)m * esz);
    }
}

/* Prefetches each row's W segment PF_AHEAD bytes past off (128 bytes: a
 * panel's row segment, 64 halves or 32 floats). */
LK_TI void prefetch_rows(const unsigned char *win, size_t ldw, size_t off, const int MR) {
    for (int r = 0; r < MR; r++) {
        const char *pf = (const char *)win + (size_t)r * ldw + off + PF_AHEAD;
        _mm_prefetch(pf, _MM_HINT_T0);
        _mm_prefetch(pf + 64, _MM_HINT_T0);
    }
}

/* The chain for MR rows x NV vectors of LANES columns at ap (panel rows pw
 * apart; B' rows R apart at bs), k ascending: the first term a product,
 * then one fma per term; the sums are stored to dv[r][...] (32-byte
 * aligned). Going through memory once per sub-block keeps acc indexed by
 * constants only, so it stays in registers (GCC otherwise kept it on the
 * stack and stored all 12 at every k). */
#define SUB_SUMS(VT, LANES, LOAD, BCAST, MUL, FMADD, STORE, ap, pw, bs, R, MR, dv)                       \
    do {                                                                                                 \
        VT acc_[LK_KMR][NV], a_[NV];                                                                     \
        for (int v = 0; v < NV; v++) a_[v] = LOAD((ap) + LANES * v);                                     \
        for (int r = 0; r < (MR); r++) {                                                                 \
            const VT b_ = BCAST((bs) + (size_t)r * (R));                                                 \
            for (int v = 0; v < NV; v++) acc_[r][v] = MUL(b_, a_[v]);                                    \
        }                                                                                                \
        for (size_t k = 1; k < (R); k++) {                                                               \
            for (int v = 0; v < NV; v++) a_[v] = LOAD((ap) + k * (pw) + LANES * v);                      \
            for (int r = 0; r < (MR); r++) {                                                             \
                const VT b_ = BCAST((bs) + (size_t)r * (R) + k);                                         \
                for (int v = 0; v < NV; v++) acc_[r][v] = FMADD(b_, a_[v], acc_[r][v]);                  \
            }                                                                                            \
        }                                                                                                \
        for (int r = 0; r < (MR); r++)                                                                   \
            for (int v = 0; v < NV; v++) STORE(&(dv)[r][LANES * v], acc_[r][v]);                         \
    } while (0)

/* MR rows x panels [p0, p1): for each panel, its sub-blocks' sums, then
 * each row's columns of the sub-block rounded into W. wide (F32 weights,
 * f64 accumulators) and MR are constants in each instantiation. */
LK_TI void block(const lk_kjob *jb, lk_kworker *wk, size_t o, const int MR, size_t p0, size_t p1, const int wide) {
    const size_t R = jb->R, in = jb->in, esz = wide ? 4 : 2, ldw = in * esz;
    const size_t pw = wide ? LK_PW64 : LK_PW32, sub = wide ? SUB64 : SUB32, grp = wide ? 8 : 16;
    const int bf = jb->dt == LK_DTYPE_BF16;
    const unsigned char *win = (const unsigned char *)jb->w_in + o * ldw;
    unsigned char *wout = (unsigned char *)jb->w_out + o * ldw;
    for (size_t p = p0; p < p1; p++) {
        const size_t col0 = p * pw;
        const long n = (long)(in - col0);
        prefetch_rows(win, ldw, col0 * esz, MR);
        for (size_t sb = 0; sb < pw / sub && n > (long)(sb * sub); sb++) {
            union {
                float f[LK_KMR][SUB32];
                double d[LK_KMR][SUB64];
            } dv __attribute__((aligned(32)));
            if (wide)
                SUB_SUMS(__m256d, 4, _mm256_loadu_pd, _mm256_broadcast_sd, _mm256_mul_pd, _mm256_fmadd_pd,
                         _mm256_store_pd, jb->Ap64 + p * R * LK_PW64 + sb * SUB64, LK_PW64, jb->Bs64 + o * R, R, MR,
                         dv.d);
            else
                SUB_SUMS(__m256, 8, _mm256_loadu_ps, _mm256_broadcast_ss, _mm256_mul_ps, _mm256_fmadd_ps,
                         _mm256_store_ps, jb->Ap32 + p * R * LK_PW32 + sb * SUB32, LK_PW32, jb->Bs32 + o * R, R, MR,
                         dv.f);
            for (int r = 0; r < MR; r++)
                for (size_t g = 0; g < sub / grp; g++) {
                    const size_t col = col0 + sb * sub + grp * g;
                    const long m = n - (long)(col - col0);
                    if (m <= 0) break;
                    const unsigned char *src = win + (size_t)r * ldw + col * esz;
                    unsigned char *dst = wout + (size_t)r * ldw + col * esz;
                    finish(wk, o + (size_t)r, col, m, src, dst, wide, bf,
                           wide ? (const void *)&dv.d[r][grp * g] : (const void *)&dv.f[r][grp * g]);
                }
        }
    }
}

LK_T void lk_kblock_avx2(const lk_kjob *jb, lk_kworker *wk, size_t o, int mr, size_t p0, size_t p1) {
#define WIDE(M) block(jb, wk, o, M, p0, p1, 1)
#define NARROW(M) block(jb, wk, o, M, p0, p1, 0)
    LK_KMR_DISPATCH(jb->wide, mr, WIDE, NARROW);
#undef WIDE
#undef NARROW
}
#endif
