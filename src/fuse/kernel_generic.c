/* kernel_generic.c — the fuse kernel's block function in plain C: the
 * portable path (any CPU, libm's fmaf/fma; built and tested everywhere).
 *
 * It computes exactly the canonical chain (kernel.c's header): per
 * element d = B'[0]*A[0], then d = fma(B'[k], A[k], d) for k ascending,
 * then W + d rounded once (kernel_scalar.h). fma is correctly rounded by
 * definition, so however the compiler vectorizes these loops the bits are
 * those of the specification; kernel_avx512.c and kernel_avx2.c are the
 * hand-blocked paths. */
/* (No FMA contraction: the fuse layer is built with -ffp-contract=off.) */

#include <math.h>
#include <string.h>

#include "lorakit/dtype.h"
#include "fuse/fuse.h"
#include "fuse/kernel_scalar.h"

#define LK_AI static inline __attribute__((always_inline))

/* 1 when a dtype value (bits) has the all-ones exponent: Inf or NaN. */
LK_AI int nonfinite16(int dt, uint16_t h) {
    return dt == LK_DTYPE_BF16 ? (h & 0x7f80u) == 0x7f80u : (h & 0x7c00u) == 0x7c00u;
}

/* kernel_scalar.h's scalar_round_f32 over a row segment (n <= LK_PW32) in
 * GCC vector types, 8 lanes at a time (the auto-vectorizer would not take
 * the float/bit reinterpretation): TwoSum, the odd step and the NaN rule
 * with masks instead of branches; the bits are scalar_round_f32's (e != 0 is
 * tested on its bits: when s is finite e is finite, and when s is not the
 * step is off anyway). */
typedef float lk_v8f __attribute__((vector_size(32)));
typedef uint32_t lk_v8u __attribute__((vector_size(32)));

LK_AI void round_row_f32(float *rv, float *wv, const float *d, size_t n) {
    /* whole vectors of 8: wv (LK_PW32 long) is zeroed past n so the lanes
     * past the segment compute on defined values; they are not stored back
     * into W (the caller converts n values) */
    if (n < LK_PW32) memset(wv + n, 0, (LK_PW32 - n) * sizeof *wv);
    for (size_t c = 0; c < n; c += 8) {
        lk_v8f w, x;
        memcpy(&w, wv + c, sizeof w);
        memcpy(&x, d + c, sizeof x);
        const lk_v8f s = w + x, bb = s - w, e = (w - (s - bb)) + (x - bb);
        lk_v8u us, ue, uw;
        memcpy(&us, &s, sizeof us);
        memcpy(&ue, &e, sizeof ue);
        memcpy(&uw, &w, sizeof uw);
        const lk_v8u on = (lk_v8u)((us & 0x7f800000u) != 0x7f800000u) & (lk_v8u)((ue & 0x7fffffffu) != 0u) &
                          (lk_v8u)((us & 1u) == 0u);
        us += on & (1u - 2u * ((us ^ ue) >> 31));
        const lk_v8u wnan = (lk_v8u)((uw & 0x7fffffffu) > 0x7f800000u);
        const lk_v8u rnan = (lk_v8u)((us & 0x7fffffffu) > 0x7f800000u);
        us = (wnan & (uw | 0x00400000u)) | (~wnan & ((rnan & 0x7fc00000u) | (~rnan & us)));
        memcpy(rv + c, &us, sizeof us);
    }
}

/* scalar_round_f64_to_f32 over a row segment (n <= LK_PW64), split the same
 * way: odd sum in f64, then one RNE conversion to f32, then the NaN rule. */
LK_AI void round_row_f64(uint32_t *ob, const uint32_t *wb, const double *d, size_t n) {
    double sv[LK_PW64], ev[LK_PW64];
    uint64_t us[LK_PW64], ue[LK_PW64];
    float fv[LK_PW64], wf[LK_PW64];
    uint32_t ur[LK_PW64];
    memcpy(wf, wb, n * 4);
    for (size_t c = 0; c < n; c++) {
        const double w = (double)wf[c], s = w + d[c], bb = s - w;
        ev[c] = (w - (s - bb)) + (d[c] - bb);
        sv[c] = s;
    }
    memcpy(us, sv, n * 8);
    memcpy(ue, ev, n * 8);
    for (size_t c = 0; c < n; c++) {
        uint64_t u = us[c];
        const uint64_t on = (uint64_t)((u & 0x7ff0000000000000ull) != 0x7ff0000000000000ull) &
                            (uint64_t)((ue[c] & 0x7fffffffffffffffull) != 0u) & (uint64_t)((u & 1u) == 0u);
        u += on * (1u - 2u * ((u ^ ue[c]) >> 63));
        us[c] = u;
    }
    memcpy(sv, us, n * 8);
    for (size_t c = 0; c < n; c++) fv[c] = (float)sv[c];
    memcpy(ur, fv, n * 4);
    for (size_t c = 0; c < n; c++) {
        const uint32_t uw = wb[c], u = ur[c];
        const uint32_t wnan = -(uint32_t)((uw & 0x7fffffffu) > 0x7f800000u);
        const uint32_t rnan = -(uint32_t)((u & 0x7fffffffu) > 0x7f800000u);
        ob[c] = (wnan & (uw | 0x00400000u)) | (~wnan & ((rnan & 0x7fc00000u) | (~rnan & u)));
    }
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
                round_row_f32(rv, wv, acc[r], n);
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
            round_row_f64(ob, wb, acc[r], n);
            uint32_t bad = 0;
            for (size_t c = 0; c < n; c++)
                bad |= ((ob[c] & 0x7f800000u) == 0x7f800000u) & ((wb[c] & 0x7f800000u) != 0x7f800000u);
            memcpy((char *)jb->w_out + off, ob, n * 4);
            if (bad) lk_kernel_note_bad(wk, o + (size_t)r, col0, n, wb, ob);
        }
    }
}

void lk_kblock_portable(const lk_kjob *jb, lk_kworker *wk, size_t o, int mr, size_t p0, size_t p1) {
    gen_block(jb, wk, o, mr, p0, p1);
}
