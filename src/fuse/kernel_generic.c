/* kernel_generic.c — the fuse kernel's block function in plain C: the
 * portable path (any CPU, libm's fmaf/fma), and the same source compiled
 * for AVX2 + FMA (x86-64), where the compiler turns fmaf into vfmadd.
 *
 * It computes exactly the canonical chain (kernel.c's header): per
 * element d = B'[0]*A[0], then d = fma(B'[k], A[k], d) for k ascending,
 * then W + d rounded once (kernel_scalar.h). fma is correctly rounded by
 * definition, so however the compiler vectorizes these loops the bits are
 * those of the specification; kernel_avx512.c is the hand-blocked path. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

#include <math.h>
#include <string.h>

#include "lorakit/dtype.h"
#include "fuse/fuse_internal.h"
#include "fuse/kernel_scalar.h"

#define LK_AI static inline __attribute__((always_inline))

/* 1 when a dtype value (bits) has the all-ones exponent: Inf or NaN. */
LK_AI int nonfinite16(int dt, uint16_t h) {
    return dt == LK_DTYPE_BF16 ? (h & 0x7f80u) == 0x7f80u : (h & 0x7c00u) == 0x7c00u;
}

LK_AI void gen_block(const lk_kjob *jb, lk_kworker *wk, size_t o, int mr, size_t p0, size_t p1) {
    const size_t R = jb->R, in = jb->in;
    if (!jb->wide) {
        float acc[LK_KMR][LK_PW32], wv[LK_PW32], rv[LK_PW32];
        uint16_t wb[LK_PW32], ob[LK_PW32];
        for (size_t p = p0; p < p1; p++) {
            const size_t col0 = p * LK_PW32, n = in - col0 < LK_PW32 ? in - col0 : LK_PW32;
            const float *ap = jb->Ap32 + p * R * LK_PW32;
            for (int r = 0; r < mr; r++) {
                const float *b = jb->Bs32 + (o + (size_t)r) * R;
                for (size_t c = 0; c < LK_PW32; c++) acc[r][c] = b[0] * ap[c];
                for (size_t k = 1; k < R; k++) {
                    const float bk = b[k], *a = ap + k * LK_PW32;
                    for (size_t c = 0; c < LK_PW32; c++) acc[r][c] = fmaf(bk, a[c], acc[r][c]);
                }
            }
            for (int r = 0; r < mr; r++) {
                const size_t off = ((o + (size_t)r) * in + col0) * 2;
                memcpy(wb, (const char *)jb->w_in + off, n * 2);
                lk_to_f32(wv, wb, (lk_dtype)jb->dt, n);
                for (size_t c = 0; c < n; c++) rv[c] = lk_k_round_f32(wv[c], acc[r][c]);
                lk_from_f32(ob, rv, (lk_dtype)jb->dt, n);
                int bad = 0;
                for (size_t c = 0; c < n; c++) bad |= nonfinite16(jb->dt, ob[c]) & !nonfinite16(jb->dt, wb[c]);
                memcpy((char *)jb->w_out + off, ob, n * 2);
                if (bad) lk_kernel_note_bad(wk, o + (size_t)r, col0, n, wb, ob);
            }
        }
        return;
    }
    double acc[LK_KMR][LK_PW64];
    uint32_t wb[LK_PW64], ob[LK_PW64];
    for (size_t p = p0; p < p1; p++) {
        const size_t col0 = p * LK_PW64, n = in - col0 < LK_PW64 ? in - col0 : LK_PW64;
        const double *ap = jb->Ap64 + p * R * LK_PW64;
        for (int r = 0; r < mr; r++) {
            const double *b = jb->Bs64 + (o + (size_t)r) * R;
            for (size_t c = 0; c < LK_PW64; c++) acc[r][c] = b[0] * ap[c];
            for (size_t k = 1; k < R; k++) {
                const double bk = b[k], *a = ap + k * LK_PW64;
                for (size_t c = 0; c < LK_PW64; c++) acc[r][c] = fma(bk, a[c], acc[r][c]);
            }
        }
        for (int r = 0; r < mr; r++) {
            const size_t off = ((o + (size_t)r) * in + col0) * 4;
            memcpy(wb, (const char *)jb->w_in + off, n * 4);
            uint32_t bad = 0;
            for (size_t c = 0; c < n; c++) {
                ob[c] = lk_k_round_f64_to_f32(wb[c], acc[r][c]);
                bad |= ((ob[c] & 0x7f800000u) == 0x7f800000u) & ((wb[c] & 0x7f800000u) != 0x7f800000u);
            }
            memcpy((char *)jb->w_out + off, ob, n * 4);
            if (bad) lk_kernel_note_bad(wk, o + (size_t)r, col0, n, wb, ob);
        }
    }
}

void lk_kblock_portable(const lk_kjob *jb, lk_kworker *wk, size_t o, int mr, size_t p0, size_t p1) {
    gen_block(jb, wk, o, mr, p0, p1);
}

#ifdef LK_KERNEL_X86
__attribute__((target("avx2,fma,f16c"))) void lk_kblock_avx2(const lk_kjob *jb, lk_kworker *wk, size_t o, int mr,
                                                             size_t p0, size_t p1) {
    gen_block(jb, wk, o, mr, p0, p1);
}
#endif
