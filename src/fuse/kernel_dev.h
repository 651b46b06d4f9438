/* kernel_dev.h — the device fuse kernel's per-thread body, written once and
 * compiled twice: by nvcc inside a __global__ function (kernel_cuda.cu) for
 * the cuda device, and as C (kernel_dev.c) for the emul device, whose
 * launch runs this same body for every thread of the grid. So what CI
 * tests on emul is the CUDA kernel's own source.
 *
 * Shapes: a weight (or one band of rows of it) rows x in, in place or
 * w_out != w_in, dtype F32 / F16 / BF16, in device memory; the LoRA terms'
 * stacked chain as the CPU kernel prepares it (B' rows x R and A, laid out
 * as lk_kdelta_factors says: element (k, j) at ((j / pw) R + k) pw + j % pw;
 * kernel.c steps 1-2: the same buffers, uploaded) and any number of
 * other terms as terms.c prepares them (lk_fuse_delta_parts; their
 * descriptions an array in device memory): dense deltas
 * (out x in values in their own dtype, with their double scale), LoHa's
 * two chains (each a prepared lk_kdelta), LoKr's acc(s W1) and acc(W2).
 * Per element (o, j), exactly the CPU's chain (terms.c's header):
 *   d = R ? fl(B'[o,0] A[0,j]) then d = fma(B'[o,k], A[k,j], d), k = 1..R-1
 *         : +0                                        (kernel.c step 3)
 *   then for each other term in term order, d = d + x_t with
 *     dense x = acc(s_t D[o,j]),  LoHa x = acc(P1 P2) (P1, P2 the chain
 *     above over each product's factors), LoKr x = acc(W1s[i,q] W2[k,m])
 *     (o = i c + k, j = q D + m: host-made index tables)   (terms.c step 2)
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
#include "fuse/keyelem.h"
#include "fuse/fp8elem.h"

#define LK_KDEV_RPT 4        /* rows per thread */
#define LK_KDEV_BLOCK 128    /* threads per block (x) */
/* The chain (lk_kdev_chain32 / _64) is written once per precision and
 * called at LK_KDEV_CHAINS places (the LoRA terms, LoHa's P1 and P2), each
 * unrolled over LK_KDEV_RPT rows with its k loop rolled: the compiled fuse
 * kernel holds exactly LK_KDEV_CHAINS * LK_KDEV_RPT fma per precision, the
 * ones the source writes, which tests/device_ptx.sh counts. */
#define LK_KDEV_CHAINS 3

#ifdef __CUDA_ARCH__ /* the device pass of nvcc (its host pass and C ignore the pragma) */
#define LK_KDEV_UNROLL _Pragma("unroll")
#define LK_KDEV_ROLLED _Pragma("unroll 1")
#else
#define LK_KDEV_UNROLL
#define LK_KDEV_ROLLED
#endif
/* The k loop stays rolled (LK_KDEV_ROLLED): the RPT independent chains give
 * the GPU its instruction-level parallelism. */

/* One stacked chain's prepared factors (lk_kdelta_factors): B' rows x R,
 * A's element (k, j) at ((j / pw) R + k) pw + j % pw. */
typedef struct lk_kdev_chain {
    const void *A, *bs; /* f32 (narrow) or f64 (wide) */
    uint64_t R, pw;
    int pw_shift;       /* log2(pw) when pw is a power of two (panels), else -1 (A plain R x in: pw = in) */
} lk_kdev_chain;

enum { LK_KDEV_X_DENSE = 1, LK_KDEV_X_HADA, LK_KDEV_X_KRON };

/* A non-LoRA term (terms.c step 2), prepared by the CPU's own code. */
typedef struct lk_kdev_x {
    int kind;
    int dt;                /* dense: D's dtype */
    double scale;          /* dense */
    const void *D;         /* dense: rows x in values of dtype dt, row-major */
    lk_kdev_chain p1, p2;  /* LoHa: the two products (p1 carries the scale) */
    const void *w1, *w2;   /* LoKr: acc(s W1) (a x b), acc(W2) (c x D) */
    const uint64_t *rtab;  /* LoKr, per row o: (o / c) b, (o % c) D */
    const uint64_t *ctab;  /* LoKr, per column j: j / D, j % D (no integer division on the device) */
} lk_kdev_x;

typedef struct lk_kdev_args {
    void *w_out;
    const void *w_in;
    lk_kdev_chain lora;      /* R = 0: no LoRA term (d starts at +0) */
    unsigned long long *bad; /* lowest (index << 32 | old bits) made non-finite; ~0 when none */
    uint64_t rows, in;
    uint64_t row_base;       /* the band's first row in the whole weight (for the index) */
    int dt, wide, n_x;
    const lk_kdev_x *x;      /* n_x other terms, in device memory */
} lk_kdev_args;

/* *bad = min(*bad, key): an atomic min on the GPU; emul's threads run one at a time. */
LK_HD void lk_kdev_min(unsigned long long *bad, unsigned long long key) {
#ifdef __CUDA_ARCH__
    atomicMin(bad, key);
#else
    if (key < *bad) *bad = key;
#endif
}

LK_HD void lk_kdev_note_bad(unsigned long long *bad, uint64_t idx, uint32_t old_bits) {
    const uint64_t i = idx < 0xffffffffull ? idx : 0xffffffffull; /* a weight of 2^32 elements or more: clamped */
    lk_kdev_min(bad, ((unsigned long long)i << 32) | old_bits);
}

/* A's (0, j) in a chain's layout: no integer division on the device (its
 * SASS would use the approximate reciprocal unit, which the audit
 * forbids): panels have a power-of-two width, and a plain A (pw = in) has
 * j < pw. */
LK_HD uint64_t lk_kdev_aoff(const lk_kdev_chain *c, uint64_t j) {
    return c->pw_shift < 0 ? j : ((j >> c->pw_shift) * c->R << c->pw_shift) + (j & (c->pw - 1));
}

/* The chain of kernel.c step 3 for the RPT rows row[] of column j, in T:
 * d = fl(B'[o,0] A[0,j]), then d = FMA(B'[o,k], A[k,j], d), k ascending;
 * R = 0: d = +0. */
#define LK_KDEV_CHAIN(NAME, T, FMA)                                                                          \
    LK_HD void NAME(T *d, const lk_kdev_chain *c, const uint64_t *row, uint64_t j) {                         \
        const T *A = (const T *)c->A, *bs = (const T *)c->bs;                                                \
        const uint64_t R = c->R;                                                                             \
        if (!R) {                                                                                            \
            LK_KDEV_UNROLL                                                                                   \
            for (int r = 0; r < LK_KDEV_RPT; r++) d[r] = (T)0;                                               \
            return;                                                                                          \
        }                                                                                                    \
        const uint64_t aoff = lk_kdev_aoff(c, j);                                                            \
        const T a0 = A[aoff];                                                                                \
        LK_KDEV_UNROLL                                                                                       \
        for (int r = 0; r < LK_KDEV_RPT; r++) d[r] = bs[row[r] * R] * a0;                                    \
        LK_KDEV_ROLLED                                                                                       \
        for (uint64_t k = 1; k < R; k++) {                                                                   \
            const T ak = A[aoff + k * c->pw];                                                                \
            LK_KDEV_UNROLL                                                                                   \
            for (int r = 0; r < LK_KDEV_RPT; r++) d[r] = FMA(bs[row[r] * R + k], ak, d[r]);                  \
        }                                                                                                    \
    }
LK_KDEV_CHAIN(lk_kdev_chain32, float, fmaf)
LK_KDEV_CHAIN(lk_kdev_chain64, double, fma)

/* The delta d of the RPT rows row[] of column j in T (terms.c's chain): the
 * LoRA terms' chain, then each other term's x added in term order, one
 * rounding each: dense acc(s D), LoHa acc(P1 P2), LoKr acc(W1s W2). */
#define LK_KDEV_DELTA(NAME, T, CHAIN, DENSE_X)                                                               \
    LK_HD void NAME(const lk_kdev_args *a, T *d, const uint64_t *row, uint64_t j) {                          \
        CHAIN(d, &a->lora, row, j);                                                                          \
        for (int t = 0; t < a->n_x; t++) {                                                                   \
            const lk_kdev_x *x = &a->x[t];                                                                   \
            if (x->kind == LK_KDEV_X_DENSE) {                                                                \
                LK_KDEV_UNROLL                                                                               \
                for (int r = 0; r < LK_KDEV_RPT; r++)                                                        \
                    d[r] = d[r] + DENSE_X(x->scale, lk_key_load(x->D, x->dt, row[r] * a->in + j));          \
            } else if (x->kind == LK_KDEV_X_HADA) {                                                          \
                T p1[LK_KDEV_RPT], p2[LK_KDEV_RPT];                                                          \
                CHAIN(p1, &x->p1, row, j);                                                                   \
                CHAIN(p2, &x->p2, row, j);                                                                   \
                LK_KDEV_UNROLL                                                                               \
                for (int r = 0; r < LK_KDEV_RPT; r++) d[r] = d[r] + p1[r] * p2[r];                           \
            } else {                                                                                         \
                const T *w1 = (const T *)x->w1, *w2 = (const T *)x->w2;                                      \
                const uint64_t q = x->ctab[2 * j], m = x->ctab[2 * j + 1];                                   \
                LK_KDEV_UNROLL                                                                               \
                for (int r = 0; r < LK_KDEV_RPT; r++)                                                        \
                    d[r] = d[r] + w1[x->rtab[2 * row[r]] + q] * w2[x->rtab[2 * row[r] + 1] + m];             \
            }                                                                                                \
        }                                                                                                    \
    }
LK_KDEV_DELTA(lk_kdev_delta32, float, lk_kdev_chain32, lk_round_dense_x32)
LK_KDEV_DELTA(lk_kdev_delta64, double, lk_kdev_chain64, lk_round_dense_x64)

/* The narrow epilogue (F16 / BF16 weights) for rows o0 .. o0 + nr - 1 of column j. */
LK_HD void lk_kdev_rows32(const lk_kdev_args *a, uint64_t o0, uint64_t nr, uint64_t j) {
    const uint64_t in = a->in, last = nr - 1;
    float d[LK_KDEV_RPT];
    uint64_t row[LK_KDEV_RPT];
    LK_KDEV_UNROLL
    for (int r = 0; r < LK_KDEV_RPT; r++) row[r] = o0 + ((uint64_t)r < nr ? (uint64_t)r : last); /* spare lanes redo the last row, unstored */
    lk_kdev_delta32(a, d, row, j);
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

/* The wide epilogue (F32 weights), the delta in f64. */
LK_HD void lk_kdev_rows64(const lk_kdev_args *a, uint64_t o0, uint64_t nr, uint64_t j) {
    const uint64_t in = a->in, last = nr - 1;
    double d[LK_KDEV_RPT];
    uint64_t row[LK_KDEV_RPT];
    LK_KDEV_UNROLL
    for (int r = 0; r < LK_KDEV_RPT; r++) row[r] = o0 + ((uint64_t)r < nr ? (uint64_t)r : last);
    lk_kdev_delta64(a, d, row, j);
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
    for (uint64_t o0 = (uint64_t)by * LK_KDEV_RPT; o0 < a->rows; o0 += (uint64_t)gdy * LK_KDEV_RPT) {
        const uint64_t nr = a->rows - o0 < LK_KDEV_RPT ? a->rows - o0 : LK_KDEV_RPT;
        if (a->wide) lk_kdev_rows64(a, o0, nr, j);
        else lk_kdev_rows32(a, o0, nr, j);
    }
}

/* ---- FP8 weights (fp8.c's chain, element by element fuse/fp8elem.h) ----
 *
 * The codes rows x in (w_out = w_in, in place), the narrow (f32) delta of
 * the terms (the chain above, terms.c's), the scales s_old / s_new (per
 * row, or [0] for plain and per-tensor FP8) as doubles from the host.
 * The passes write the weight only in the last one, so a failed verdict
 * leaves it as it was:
 *   amax (a rescale): the max |(float) v| of each row, without atomics,
 *     in two kernels: lk_kdev_fp8amax_thread, thread g of P = n_part
 *     slots (P = ceil(in / LK_KDEV_AMAX_COLS)), takes the columns g, g + P,
 *     g + 2P, ... (consecutive threads, consecutive columns) of its RPT
 *     rows and stores each row's maximum into part[g * rows + row]; then
 *     lk_kdev_fp8red_thread, one thread per row, takes the max of the
 *     row's P slots into amax[row]. Max is exact and order-free; NaN
 *     never wins (the start is 0, compared as float, then as the bits of
 *     non-negative floats, which order as the values do), as on the CPU.
 *     The host makes the new scales (fp8.c's lk_fp8_rescale; a per-tensor
 *     scale from the max of the rows' maxima).
 *   judge (pass 2): each element's rounding computed, nothing stored: the
 *     overflow count added to *over (one atomic per thread) and the first
 *     element made non-finite noted as the lowest (index << 2 | class),
 *     class 0 +Inf, 1 -Inf, 2 NaN, 3 -NaN, in the bad slot; the host
 *     judges (fp8.c's lk_fp8_verdict).
 *   write (pass 3, only after a passing verdict): each element's one FP8
 *     rounding (lk_fp8_elem: nearest-even, or stochastic keyed by the
 *     tensor's stream key, computed on the host, and the element's index
 *     in the whole tensor) stored. */
#define LK_KDEV_AMAX_COLS 32 /* columns per amax slot: the partials are at most an eighth of the codes' bytes */

typedef struct lk_kdev_fp8 {
    lk_kdev_args d;            /* the codes, the delta's terms (narrow: wide 0), the bad slot */
    fp8fmt fmt;                /* by value: device code reads no host constant */
    int stoch, pass, per_row;
    uint64_t key;              /* lk_fp8_stream_key(seed, name) */
    const double *s_old, *s_new;
    unsigned *part;            /* amax: n_part x rows partial maxima (f32 bits) */
    uint64_t n_part;
    unsigned *amax;            /* amax: per row, from part */
    unsigned long long *over;  /* pass 2, zeroed by the host */
} lk_kdev_fp8;

LK_HD void lk_kdev_add_u64(unsigned long long *c, unsigned long long v) {
#ifdef __CUDA_ARCH__
    atomicAdd(c, v);
#else
    *c += v;
#endif
}

/* The RPT rows of the row group at o0 (nr of them real; spare lanes redo
 * the last row and are neither stored nor counted). */
LK_HD uint64_t lk_kdev_rowgroup(uint64_t *row, uint64_t o0, uint64_t rows) {
    const uint64_t nr = rows - o0 < LK_KDEV_RPT ? rows - o0 : LK_KDEV_RPT;
    LK_KDEV_UNROLL
    for (int r = 0; r < LK_KDEV_RPT; r++) row[r] = o0 + ((uint64_t)r < nr ? (uint64_t)r : nr - 1);
    return nr;
}

/* The amax's first kernel: slot g = bx * bdx + tx, row groups from by
 * (grid-stride gdy), each row's max over the slot's columns into part. */
LK_HD void lk_kdev_fp8amax_thread(const lk_kdev_fp8 *f, unsigned bx, unsigned by, unsigned tx, unsigned bdx,
                                  unsigned gdy) {
    const lk_kdev_args *a = &f->d;
    const uint64_t g = (uint64_t)bx * bdx + tx, in = a->in, P = f->n_part;
    if (g >= P) return;
    for (uint64_t o0 = (uint64_t)by * LK_KDEV_RPT; o0 < a->rows; o0 += (uint64_t)gdy * LK_KDEV_RPT) {
        uint64_t row[LK_KDEV_RPT];
        const uint64_t nr = lk_kdev_rowgroup(row, o0, a->rows);
        float d[LK_KDEV_RPT], m[LK_KDEV_RPT];
        LK_KDEV_UNROLL
        for (int r = 0; r < LK_KDEV_RPT; r++) m[r] = 0.0f;
        for (uint64_t j = g; j < in; j += P) {
            lk_kdev_delta32(a, d, row, j);
            LK_KDEV_UNROLL
            for (int r = 0; r < LK_KDEV_RPT; r++) {
                const float wv = fp8_to_f32(((const uint8_t *)a->w_in)[row[r] * in + j], &f->fmt);
                const float v = lk_fp8_elem_abs(wv, d[r], f->s_old[f->per_row ? row[r] : 0]);
                m[r] = v > m[r] ? v : m[r]; /* NaN never wins */
            }
        }
        LK_KDEV_UNROLL
        for (int r = 0; r < LK_KDEV_RPT; r++)
            if ((uint64_t)r < nr) f->part[g * a->rows + row[r]] = lk_f2u(m[r]);
    }
}

/* The amax's second kernel: row o's max over its n_part slots. */
LK_HD void lk_kdev_fp8red_thread(const lk_kdev_fp8 *f, uint64_t o) {
    if (o >= f->d.rows) return;
    unsigned m = 0;
    for (uint64_t g = 0; g < f->n_part; g++) {
        const unsigned v = f->part[g * f->d.rows + o];
        m = v > m ? v : m;
    }
    f->amax[o] = m;
}

/* One thread of the FP8 kernel (pass 2 judge, pass 3 write): rows o0 ..
 * o0 + RPT - 1 (grid-stride) of column j; the overflow count reduced in
 * the thread first (one atomic). */
LK_HD void lk_kdev_fp8_thread(const lk_kdev_fp8 *f, unsigned bx, unsigned by, unsigned tx, unsigned bdx, unsigned gdy) {
    const lk_kdev_args *a = &f->d;
    const uint64_t j = (uint64_t)bx * bdx + tx, in = a->in;
    if (j >= in) return;
    const int judge = f->pass == 2;
    unsigned long long over = 0;
    for (uint64_t o0 = (uint64_t)by * LK_KDEV_RPT; o0 < a->rows; o0 += (uint64_t)gdy * LK_KDEV_RPT) {
        uint64_t row[LK_KDEV_RPT];
        const uint64_t nr = lk_kdev_rowgroup(row, o0, a->rows);
        float d[LK_KDEV_RPT];
        lk_kdev_delta32(a, d, row, j);
        LK_KDEV_UNROLL
        for (int r = 0; r < LK_KDEV_RPT; r++) {
            if ((uint64_t)r >= nr) break;
            const uint64_t i = row[r] * in + j, si = f->per_row ? row[r] : 0;
            const float wv = fp8_to_f32(((const uint8_t *)a->w_in)[i], &f->fmt);
            const uint64_t e = (a->row_base + row[r]) * in + j;
            uint8_t code;
            int bad;
            double v;
            const int ov = lk_fp8_elem(wv, d[r], f->s_old[si], f->s_new[si], &f->fmt, f->stoch, f->key, e, &code, &bad, &v);
            if (!judge) {
                ((uint8_t *)a->w_out)[i] = code;
                continue;
            }
            over += (unsigned long long)ov;
            if (bad) lk_kdev_min(a->bad, ((unsigned long long)e << 2) | (v != v ? 2u : 0u) | (unsigned)(lk_d2u(v) >> 63));
        }
    }
    if (over) lk_kdev_add_u64(f->over, over);
}

/* ---- plan.c's double path on the device: replacements, vector terms, DoRA ----
 *
 * fuse/keyelem.h's rules per element, in plan.c's order: x from the base
 * value w (a replacement at its strength), then + the terms' delta (the
 * chain above, in the weight's accumulator) on a 2-D weight or + the
 * vector terms' fma chain on a 1-D one; DoRA: v = w + c d and x =
 * finish(w, v, f) with f per row or column made on the host from the norm
 * kernels' sums. Stored once (lk_key_store). A non-finite x is noted as
 * the lowest (element index << 2 | class), class 0 +Inf, 1 -Inf, 2 NaN:
 * the CPU's message names the element and the value (a NaN without its
 * sign, which is the hardware's). */
typedef struct lk_kdev_vec {
    const void *v;           /* the vector's values, dtype dt */
    double scale;
    int dt;
} lk_kdev_vec;

typedef struct lk_kdev_key {
    lk_kdev_args d;          /* the weight, the bad slot, the delta's terms (two_d or DoRA) */
    int two_d;               /* add the terms' delta */
    const void *rep;         /* a replacement (NULL: none), dtype rep_dt, at strength sr */
    int rep_dt;
    double sr;
    int n_vec;               /* vector terms on a 1-D tensor ... */
    const lk_kdev_vec *vec;  /* ... in device memory */
    int dora, finish, norm_w, f_per_row;
    double sd;
    const double *f;         /* DoRA's m / (norm + eps): per row (f_per_row) or per column */
    double *norm;            /* the norm kernels' sums: per row, or per channel of K columns */
    uint64_t K, n_ch;
} lk_kdev_key;

/* The delta of the RPT rows row[] of column j in double (the weight's
 * accumulator's value, widened exactly). */
LK_HD void lk_kdev_delta_d(const lk_kdev_args *a, double *dd, const uint64_t *row, uint64_t j) {
    if (a->wide) {
        lk_kdev_delta64(a, dd, row, j);
        return;
    }
    float d[LK_KDEV_RPT];
    lk_kdev_delta32(a, d, row, j);
    LK_KDEV_UNROLL
    for (int r = 0; r < LK_KDEV_RPT; r++) dd[r] = (double)d[r];
}

LK_HD void lk_kdev_note_key(unsigned long long *bad, uint64_t idx, double x) {
    const uint64_t cls = x != x ? 2u : lk_d2u(x) >> 63;
    lk_kdev_min(bad, ((unsigned long long)idx << 2) | cls);
}

/* One thread of the key kernel: rows o0 .. o0 + RPT - 1 (grid-stride) of column j. */
LK_HD void lk_kdev_key_thread(const lk_kdev_key *k, unsigned bx, unsigned by, unsigned tx, unsigned bdx, unsigned gdy) {
    const lk_kdev_args *a = &k->d;
    const uint64_t j = (uint64_t)bx * bdx + tx, in = a->in;
    if (j >= in) return;
    for (uint64_t o0 = (uint64_t)by * LK_KDEV_RPT; o0 < a->rows; o0 += (uint64_t)gdy * LK_KDEV_RPT) {
        const uint64_t nr = a->rows - o0 < LK_KDEV_RPT ? a->rows - o0 : LK_KDEV_RPT;
        uint64_t row[LK_KDEV_RPT];
        double dd[LK_KDEV_RPT];
        LK_KDEV_UNROLL
        for (int r = 0; r < LK_KDEV_RPT; r++) {
            row[r] = o0 + ((uint64_t)r < nr ? (uint64_t)r : nr - 1);
            dd[r] = 0.0;
        }
        if (k->two_d || k->dora) lk_kdev_delta_d(a, dd, row, j);
        LK_KDEV_UNROLL
        for (int r = 0; r < LK_KDEV_RPT; r++) {
            if ((uint64_t)r >= nr) break;
            const uint64_t i = row[r] * in + j;
            const uint32_t wb = lk_key_bits(a->w_in, a->dt, i);
            const double w = (double)lk_key_load(a->w_in, a->dt, i);
            double x = w;
            if (k->dora) {
                x = lk_key_dora_finish(k->finish, k->sd, w, w + dd[r], k->f[k->f_per_row ? row[r] : j]);
            } else {
                if (k->rep) x = lk_key_replace(x, (double)lk_key_load(k->rep, k->rep_dt, i), k->sr);
                if (k->two_d) x = x + dd[r];
                else if (k->n_vec) {
                    double dj = 0.0;
                    LK_KDEV_ROLLED
                    for (int t = 0; t < k->n_vec; t++) dj = fma(k->vec[t].scale, (double)lk_key_load(k->vec[t].v, k->vec[t].dt, i), dj);
                    x = x + dj;
                }
            }
            if ((lk_d2u(x) & 0x7ff0000000000000ull) == 0x7ff0000000000000ull)
                lk_kdev_note_key(a->bad, (a->row_base + row[r]) * in + j, x);
            lk_key_put(a->w_out, a->dt, i, lk_key_store(x, wb, a->dt));
        }
    }
}

/* DoRA's sums per output row, RPT rows per thread g: ss = fma(x, x, ss)
 * over the columns ascending, x = w (norm_w) or v = w + c d (plan.c's
 * order). */
LK_HD void lk_kdev_normrows_thread(const lk_kdev_key *k, uint64_t g) {
    const lk_kdev_args *a = &k->d;
    const uint64_t o0 = g * LK_KDEV_RPT, in = a->in;
    if (o0 >= a->rows) return;
    const uint64_t nr = a->rows - o0 < LK_KDEV_RPT ? a->rows - o0 : LK_KDEV_RPT;
    uint64_t row[LK_KDEV_RPT];
    double ss[LK_KDEV_RPT], dd[LK_KDEV_RPT];
    LK_KDEV_UNROLL
    for (int r = 0; r < LK_KDEV_RPT; r++) {
        row[r] = o0 + ((uint64_t)r < nr ? (uint64_t)r : nr - 1);
        ss[r] = 0.0;
    }
    for (uint64_t j = 0; j < in; j++) {
        lk_kdev_delta_d(a, dd, row, j);
        LK_KDEV_UNROLL
        for (int r = 0; r < LK_KDEV_RPT; r++) {
            const double w = (double)lk_key_load(a->w_in, a->dt, row[r] * in + j);
            const double x = k->norm_w ? w : w + dd[r];
            ss[r] = fma(x, x, ss[r]);
        }
    }
    LK_KDEV_UNROLL
    for (int r = 0; r < LK_KDEV_RPT; r++)
        if ((uint64_t)r < nr) k->norm[row[r]] = ss[r];
}

/* DoRA's sums per input channel ch (columns ch K .. ch K + K - 1): rows
 * ascending, then the channel's columns ascending (plan.c's order); every
 * lane of the delta takes the same row and only lane 0 is read, so the
 * compiler keeps one lane of each chain (the audit counts LK_KDEV_CHAINS
 * fma per precision, plus the sum's). */
LK_HD void lk_kdev_normcols_thread(const lk_kdev_key *k, uint64_t ch) {
    const lk_kdev_args *a = &k->d;
    if (ch >= k->n_ch) return;
    double cs = 0.0, dd[LK_KDEV_RPT];
    for (uint64_t o = 0; o < a->rows; o++) {
        uint64_t row[LK_KDEV_RPT];
        LK_KDEV_UNROLL
        for (int r = 0; r < LK_KDEV_RPT; r++) row[r] = o;
        for (uint64_t jj = 0; jj < k->K; jj++) {
            const uint64_t j = ch * k->K + jj;
            lk_kdev_delta_d(a, dd, row, j);
            const double v = (double)lk_key_load(a->w_in, a->dt, o * a->in + j) + dd[0];
            cs = fma(v, v, cs);
        }
    }
    k->norm[ch] = cs;
}

#endif
