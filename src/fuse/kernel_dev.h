/* kernel_dev.h — the device fuse kernel's per-thread body, written once and
 * compiled twice: by nvcc inside a __global__ function (kernel_cuda.cu) for
 * the cuda device, and as C (kernel_dev.c) for the emul device, whose
 * launch runs this same body for every thread of the grid. So what CI
 * tests on emul is the CUDA kernel's own source.
 *
 * Shapes: a weight (or one band of rows of it) rows x in, in place or
 * w_out != w_in, dtype F32 / F16 / BF16, in device memory; B' (rows x R)
 * and A (R x in, laid out as lk_kdelta_factors says: element (k, j) at
 * ((j / pw) R + k) pw + j % pw) as the CPU kernel prepares them
 * (kernel.c steps 1-2: the same buffers, uploaded); up to
 * LK_KDEV_MAX_DENSE dense terms (out x in values in their own dtype, with
 * their double scale). Per element (o, j), exactly the CPU's chain:
 *   d = R ? fl(B'[o,0] A[0,j]) then d = fma(B'[o,k], A[k,j], d), k = 1..R-1
 *         : +0                                        (kernel.c step 3)
 *   d = d + x_t for each dense term, x_t = acc(s_t D[o,j])   (terms.c step 2)
 *   W = W + d rounded once (fuse/round.h: kernel.c steps 4-5)
 * in f32 for F16 / BF16 weights, f64 for F32 weights. Every operation is
 * written as one IEEE operation (fmaf/fma where the chain says fma, the
 * rest plain + and *), and the build forbids contraction (--fmad=false;
 * -ffp-contract=off for C), so no compiler may fuse or reorder them.
 *
 * Work split: thread x of block bx takes column j = bx * blockDim.x + x,
 * and rows o0 .. o0 + LK_KDEV_RPT - 1 for o0 = by * RPT, by * RPT + gridDim.y
 * * RPT, ... (a grid-stride loop over row groups: the grid's y is capped
 * at CUDA's 65535). Each A value serves RPT rows; consecutive threads read
 * consecutive columns of W and A (coalesced); B' is the same for a warp.
 * No shared memory, no barrier: threads are independent, so emul may run
 * them one after another. A finite weight made non-finite is noted as the
 * lowest key (element index << 32 | old bits) in *bad (an atomic min on
 * the GPU; emul's threads run one at a time). */
#ifndef LK_FUSE_KERNEL_DEV_H
#define LK_FUSE_KERNEL_DEV_H

#include <math.h>
#include <stdint.h>
#include "lorakit/dtype.h"
#include "core/hd.h"
#include "core/dtype_scalar.h"
#include "fuse/round.h"

#define LK_KDEV_RPT 4        /* rows per thread */
#define LK_KDEV_BLOCK 128    /* threads per block (x) */
#define LK_KDEV_MAX_DENSE 4  /* dense terms per launch (more: the host path) */

#ifdef __CUDA_ARCH__ /* the device pass of nvcc (its host pass and C ignore the pragma) */
#define LK_KDEV_UNROLL _Pragma("unroll")
#define LK_KDEV_ROLLED _Pragma("unroll 1")
#else
#define LK_KDEV_UNROLL
#define LK_KDEV_ROLLED
#endif
/* The k loop stays rolled (LK_KDEV_ROLLED): the RPT independent chains give
 * the GPU its instruction-level parallelism, and the compiled kernel then
 * holds exactly LK_KDEV_RPT fma per precision, the ones the source writes,
 * which tests/device_ptx.sh counts. */

typedef struct lk_kdev_dense {
    const void *D; /* rows x in values of dtype dt, row-major */
    double scale;
    int dt;
} lk_kdev_dense;

typedef struct lk_kdev_args {
    void *w_out;
    const void *w_in;
    const void *A, *bs;      /* f32 (narrow) or f64 (wide) */
    unsigned long long *bad; /* lowest (index << 32 | old bits) made non-finite; ~0 when none */
    uint64_t rows, in, R, pw;
    int pw_shift;            /* log2(pw) when pw is a power of two (panels), else -1 (A plain R x in: pw = in) */
    uint64_t row_base;       /* the band's first row in the whole weight (for the index) */
    int dt, wide, n_dense;
    lk_kdev_dense dense[LK_KDEV_MAX_DENSE];
} lk_kdev_args;

LK_HD void lk_kdev_note_bad(unsigned long long *bad, uint64_t idx, uint32_t old_bits) {
    const uint64_t i = idx < 0xffffffffull ? idx : 0xffffffffull; /* a weight of 2^32 elements or more: clamped */
    const unsigned long long key = ((unsigned long long)i << 32) | old_bits;
#ifdef __CUDA_ARCH__
    atomicMin(bad, key);
#else
    if (key < *bad) *bad = key;
#endif
}

/* One value of a dense term as f32 (lorakit/dtype.h's conversions). */
LK_HD float lk_kdev_load(const void *p, int dt, uint64_t i) {
    if (dt == LK_DTYPE_F32) return ((const float *)p)[i];
    const uint16_t h = ((const uint16_t *)p)[i];
    return dt == LK_DTYPE_BF16 ? lk_sc_bf16_to_f32(h) : lk_sc_f16_to_f32(h);
}

/* The narrow chain (F16 / BF16 weights) for rows o0 .. o0 + nr - 1 of column j. */
LK_HD void lk_kdev_rows32(const lk_kdev_args *a, uint64_t o0, uint64_t nr, uint64_t j, uint64_t aoff) {
    const float *A = (const float *)a->A, *bs = (const float *)a->bs;
    const uint64_t R = a->R, in = a->in, last = nr - 1;
    float d[LK_KDEV_RPT];
    uint64_t row[LK_KDEV_RPT];
    LK_KDEV_UNROLL
    for (int r = 0; r < LK_KDEV_RPT; r++) row[r] = o0 + ((uint64_t)r < nr ? (uint64_t)r : last); /* spare lanes redo the last row, unstored */
    if (R) {
        const float a0 = A[aoff];
        LK_KDEV_UNROLL
        for (int r = 0; r < LK_KDEV_RPT; r++) d[r] = bs[row[r] * R] * a0;
        LK_KDEV_ROLLED
        for (uint64_t k = 1; k < R; k++) {
            const float ak = A[aoff + k * a->pw];
            LK_KDEV_UNROLL
            for (int r = 0; r < LK_KDEV_RPT; r++) d[r] = fmaf(bs[row[r] * R + k], ak, d[r]);
        }
    } else {
        LK_KDEV_UNROLL
        for (int r = 0; r < LK_KDEV_RPT; r++) d[r] = 0.0f;
    }
    for (int t = 0; t < a->n_dense; t++) {
        const lk_kdev_dense *x = &a->dense[t];
        LK_KDEV_UNROLL
        for (int r = 0; r < LK_KDEV_RPT; r++) d[r] = d[r] + lk_round_dense_x32(x->scale, lk_kdev_load(x->D, x->dt, row[r] * in + j));
    }
    const uint32_t mask = a->dt == LK_DTYPE_BF16 ? LK_ROUND_EXP_BF16 : LK_ROUND_EXP_F16;
    LK_KDEV_UNROLL
    for (int r = 0; r < LK_KDEV_RPT; r++) {
        if ((uint64_t)r >= nr) break;
        const uint64_t i = row[r] * in + j;
        const uint16_t w = ((const uint16_t *)a->w_in)[i];
        const uint16_t v = a->dt == LK_DTYPE_BF16 ? lk_round_bf16(w, d[r]) : lk_round_f16(w, d[r]);
        ((uint16_t *)a->w_out)[i] = v;
        if (lk_round_made_nonfinite(w, v, mask)) lk_kdev_note_bad(a->bad, (a->row_base + row[r]) * in + j, w);
    }
}

/* The wide chain (F32 weights), the same steps in f64. */
LK_HD void lk_kdev_rows64(const lk_kdev_args *a, uint64_t o0, uint64_t nr, uint64_t j, uint64_t aoff) {
    const double *A = (const double *)a->A, *bs = (const double *)a->bs;
    const uint64_t R = a->R, in = a->in, last = nr - 1;
    double d[LK_KDEV_RPT];
    uint64_t row[LK_KDEV_RPT];
    LK_KDEV_UNROLL
    for (int r = 0; r < LK_KDEV_RPT; r++) row[r] = o0 + ((uint64_t)r < nr ? (uint64_t)r : last);
    if (R) {
        const double a0 = A[aoff];
        LK_KDEV_UNROLL
        for (int r = 0; r < LK_KDEV_RPT; r++) d[r] = bs[row[r] * R] * a0;
        LK_KDEV_ROLLED
        for (uint64_t k = 1; k < R; k++) {
            const double ak = A[aoff + k * a->pw];
            LK_KDEV_UNROLL
            for (int r = 0; r < LK_KDEV_RPT; r++) d[r] = fma(bs[row[r] * R + k], ak, d[r]);
        }
    } else {
        LK_KDEV_UNROLL
        for (int r = 0; r < LK_KDEV_RPT; r++) d[r] = 0.0;
    }
    for (int t = 0; t < a->n_dense; t++) {
        const lk_kdev_dense *x = &a->dense[t];
        LK_KDEV_UNROLL
        for (int r = 0; r < LK_KDEV_RPT; r++) d[r] = d[r] + lk_round_dense_x64(x->scale, lk_kdev_load(x->D, x->dt, row[r] * in + j));
    }
    LK_KDEV_UNROLL
    for (int r = 0; r < LK_KDEV_RPT; r++) {
        if ((uint64_t)r >= nr) break;
        const uint64_t i = row[r] * in + j;
        const uint32_t w = ((const uint32_t *)a->w_in)[i];
        const uint32_t v = lk_round_f64_to_f32(w, d[r]);
        ((uint32_t *)a->w_out)[i] = v;
        if (lk_round_made_nonfinite(w, v, LK_ROUND_EXP_F32)) lk_kdev_note_bad(a->bad, (a->row_base + row[r]) * in + j, w);
    }
}

/* One thread: block (bx, by) of gdy row blocks, thread x of bdx. */
LK_HD void lk_kdev_fuse_thread(const lk_kdev_args *a, unsigned bx, unsigned by, unsigned tx, unsigned bdx, unsigned gdy) {
    const uint64_t j = (uint64_t)bx * bdx + tx;
    if (j >= a->in) return;
    /* A's (0, j): no integer division on the device (its SASS would use the
     * approximate reciprocal unit, which the audit forbids): panels have a
     * power-of-two width, and a plain A (pw = in) has j < pw */
    const uint64_t aoff = a->pw_shift < 0 ? j : ((j >> a->pw_shift) * a->R << a->pw_shift) + (j & (a->pw - 1));
    for (uint64_t o0 = (uint64_t)by * LK_KDEV_RPT; o0 < a->rows; o0 += (uint64_t)gdy * LK_KDEV_RPT) {
        const uint64_t nr = a->rows - o0 < LK_KDEV_RPT ? a->rows - o0 : LK_KDEV_RPT;
        if (a->wide) lk_kdev_rows64(a, o0, nr, j, aoff);
        else lk_kdev_rows32(a, o0, nr, j, aoff);
    }
}

#endif
