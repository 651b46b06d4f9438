/* oft.c — the terms whose delta depends on the weight itself: OFT and BOFT
 * (LyCORIS diag-oft / boft: a rotation of the weight's output rows) and
 * GLoRA's first half (scale * W @ a1 @ a2). Kept apart from terms.c because
 * these are not sums of products of the adapter's factors: W is an operand.
 *
 * THE TOOLS' FORMULAS (facts read from LyCORIS 4.1.3 modules/diag_oft.py,
 * boft.py, glora.py, functional/diag_oft.py, boft.py, and ComfyUI's
 * comfy/weight_adapter/oft.py, boft.py, glora.py):
 *  - Both build, from oft_blocks X (OFT [n, b, b]; BOFT [m, n, b, b]),
 *    Q = X - X^T per block, and when the constraint c > 0 and
 *    ||Q|| + 1e-8 > c (the Frobenius norm over all blocks and stages),
 *    Q <- Q c / (||Q|| + 1e-8); then R = (I + Q)(I - Q)^-1 per block.
 *    The constraint: LyCORIS c = alpha x out_dim, ComfyUI c = alpha.
 *  - OFT acts on the output rows, block k holding rows k b .. k b + b - 1,
 *    with R's transpose: row k b + m of W' is sum_n M[n][m] W[k b + n].
 *    LyCORIS at multiplier s: M = I + s (R - I), then W' = rescale (.) (M^T W)
 *    (rescale per output row, when the file has one).
 *    ComfyUI at strength s: W' = W + s (s (R^T - I) W), rescale ignored.
 *  - BOFT, stage i = 0 .. m-1, with k = 2^i b / 2: the rows, read as
 *    (c, g, j) with g in {0, 1} and j < k, are permuted to (c, j, g), cut into
 *    blocks of b rows, each block multiplied by T_i = R_i (not transposed),
 *    and permuted back. At s != 1 both tools use T_i = s R_i + (1 - s) I.
 *    Then Y = rescale (.) Y when the file has one (both tools).
 *    LyCORIS: W' = Y. ComfyUI: W' = W + s (Y - W).
 *  - GLoRA (LyCORIS 4 layout, both tools): delta = (W a1 a2 + b1 b2) alpha / r
 *    with a1 [in, r], a2 [r, in], b1 [out, r], b2 [r, in]; lorakit fuses
 *    the b1 b2 half as a LoRA term and W a1 a2 through LK_TERM_WLORA here.
 * Which of these a fuse uses is lk_fuse_opts.convention: COMFYUI takes
 * ComfyUI's; LORAKIT, LYCORIS and PEFT take LyCORIS's (the files are
 * LyCORIS's; PEFT's own OFT files, oft_R.weight, are the section at the end).
 *
 * THE CANONICAL ARITHMETIC here (every CPU path the same bits):
 *  1. Q, its norm (an fma chain of squares in stored order, sqrt, + 1e-8),
 *     the scaling, R (Gauss-Jordan elimination of [I - Q | I] with partial
 *     pivoting, then (I + Q) times the inverse, fma chains) and the stage
 *     matrices, all in f64 from the file's values.
 *  2. OFT: the delta matrix D = s (R^T - I) (ComfyUI: the same and then a
 *     factor g = s; LyCORIS g = 1); E = D W per block in f64, each element
 *     an fma chain over n ascending from the first product; then
 *     d = rho E + (rho - 1) W with rho the rescale (LyCORIS, when present),
 *     else d = E; then d = g d when g != 1.
 *     BOFT: Y = W in f64, each stage an fma chain of b products in f64;
 *     d = rho Y - W (rho Y when rescaled), then d = g d when g != 1.
 *  3. W + d rounded once into the weight's dtype: F32 as the kernel does
 *     (round to odd in f64, then to nearest-even), BF16 / F16 by rounding the
 *     f64 sum to odd in f64, then to odd in f32, then to nearest-even (which
 *     gives the correctly rounded value of the f64 sum); the kernel's NaN
 *     rules. FP8 weights: d is rounded to f32 and fused as a dense delta
 *     of the dequantised weight (fp8.c).
 * The f64 steps carry 29 more bits than F32, so the result is within 1 ulp
 * of the exact value of the tool's formula (tests/test_oft.c checks every
 * dtype against a float64 reference and LyCORIS's own output).
 *  GLoRA: WB = W a1 in f64 (fma chains over the input index ascending),
 *  then the LoRA term {A = a2, B = WB (F64)} through the kernel's chain.
 *
 * HOW IT RUNS (the bits do not depend on any of it): work items are row
 * tiles x column tiles; an OFT tile is one block (b rows) x up to 512
 * columns, a BOFT tile a group of 2^(m-1) b rows (every stage maps it onto
 * itself) x 64 columns or more (16 above 1024 rows), so the m stages run
 * in L1 (in L2 for the tall groups of LyCORIS's own files). Threads take
 * items from an atomic counter (the workers carved by lk_fuse_workers).
 * Per item: the rows to f64 (load_*), the block products in register
 * blocks (mat_rows_*: every element its own fma chain, so any blocking
 * gives the same bits), then step 3 per row (fin_row_*): the vector paths
 * round with two hardware roundings where that provably equals step 3 and
 * hand the rare rest (midpoints, subnormal grids, NaN, Inf, overflow) to
 * fin_scalar, the portable path's code (FIN_VEC's comment has the proof;
 * tests/test_oft_paths.c checks every path bit for bit, crafted midpoints
 * included). OFT on a BF16 / F16 weight on the AVX-512 paths runs an fp32
 * chain instead and keeps only the lanes whose rounding it can certify
 * equal to step 3's, redoing the others by step 3 (oblock_narrow: the
 * bound and the proof are beside it). The rotation itself (Q, R) is built
 * once per call, with inline FMA instructions where the CPU has them. */
#include "lorakit/fuse.h"
#include "lorakit/alloc.h"
#include "core/alloc.h"
#include "core/bits.h"
#include "fuse/fuse.h"
#include "fuse/kernel_scalar.h"

#include <fenv.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define OFT_COLS 512    /* the most columns of a row tile converted to f64 at a time */
#define OFT_TILE 32768  /* OFT: f64 values per row tile (256 KiB: X and E in L2, one pass each) */
#define BOFT_TILE 2048  /* BOFT: per row tile (16 KiB: X and the stages' two buffers in L1) */
#define OFT_CHUNK 64    /* OFT: columns multiplied and then rounded at a time */
#define OFT_PF_AHEAD 1024 /* bytes ahead on a weight row prefetched while a tile is read */
#define OFT_RB 4      /* rows per register block */
#define OFT_CB 16     /* columns per register block */

struct lk_oft {
    int boft;         /* 1: BOFT stages, 0: OFT's delta form */
    int peft;         /* 1: PEFT's OFT, a rotation of the columns: T = nb blocks D^T (b x b), nb 1 when shared */
    void (*prow)(const struct lk_oft *, const double *, double *, size_t); /* PEFT: one row's delta (peft_row) */
    size_t out, m, nb, b;
    double *T;        /* m x nb x b x b: OFT D, BOFT the stage matrices */
    uint32_t *perm;   /* BOFT: m x out, the row of permuted position p at stage i */
    double *rho;      /* out, or NULL */
    double g;         /* the final factor (1: none) */
    unsigned char *mem;
};

/* ---- validation ---- */

static double elem64(const lk_tensor *t, size_t i) {
    float f;
    if (t->dtype == LK_DTYPE_F64) return ((const double *)t->data)[i];
    lk_to_f32(&f, (const char *)t->data + i * lk_dtype_size(t->dtype), t->dtype, 1);
    return (double)f;
}

lk_status lk_oft_check(const lk_fuse_term *t, int64_t out, size_t ti, const char *name) {
    const lk_tensor *X = t->B, *rs = t->A2;
    char xs[96];
    if (!X || !X->data) return lk_error(LK_ERR_ARG, "%s: term %zu: an OFT term without oft_blocks", name, ti);
    lk_shape_str(X, xs, sizeof xs);
    if (!lk_dtype_is_fusable(X->dtype))
        return lk_error(LK_ERR_DTYPE, "%s: term %zu: '%s' has dtype %s; only F32, F16 and BF16 can be fused", name, ti,
                        X->name ? X->name : "oft_blocks", lk_dtype_name(X->dtype));
    if (X->ndim != 3 && X->ndim != 4)
        return lk_error(LK_ERR_SHAPE, "%s: term %zu: '%s' is %s; OFT needs [n, b, b], BOFT [m, n, b, b]", name, ti,
                        X->name ? X->name : "oft_blocks", xs);
    const int64_t b = X->shape[X->ndim - 1], sq = X->shape[X->ndim - 2], nb = X->shape[X->ndim - 3];
    const int64_t m = X->ndim == 4 ? X->shape[0] : 1;
    if (b <= 0 || nb <= 0 || m <= 0 || sq != b || b > 4096 || nb > out || nb * b != out)
        return lk_error(LK_ERR_SHAPE, "%s: term %zu: '%s' is %s: %s blocks of b x b with n b = %lld (the weight's "
                        "rows) are needed", name, ti, X->name ? X->name : "oft_blocks", xs,
                        X->ndim == 4 ? "m stages of n" : "n", (long long)out);
    if (X->ndim == 4) { /* stage i permutes groups of 2^i b rows of pairs of 2^i b / 2 */
        if (b < 2 || b % 2)
            return lk_error(LK_ERR_SHAPE, "%s: term %zu: '%s' is %s: BOFT needs an even block size", name, ti,
                            X->name ? X->name : "oft_blocks", xs);
        for (int64_t i = 0; i < m; i++)
            if (i >= 62 || nb % ((int64_t)1 << i))
                return lk_error(LK_ERR_SHAPE, "%s: term %zu: '%s' is %s: stage %lld needs the %lld blocks in groups "
                                "of %lld", name, ti, X->name ? X->name : "oft_blocks", xs, (long long)i, (long long)nb,
                                (long long)(i >= 62 ? -1 : (int64_t)1 << i));
    }
    if (rs && (!rs->data || !lk_dtype_is_fusable(rs->dtype) || lk_tensor_numel(rs) != (size_t)out)) {
        char rsh[96];
        lk_shape_str(rs, rsh, sizeof rsh);
        return lk_error(LK_ERR_SHAPE, "%s: term %zu: the rescale '%s' is %s (%s) but the weight has %lld rows", name,
                        ti, rs->name ? rs->name : "rescale", rsh, lk_dtype_name(rs->dtype), (long long)out);
    }
    if (!isfinite(t->scale) || !isfinite(t->alpha))
        return lk_error(LK_ERR_NONFINITE, "%s: term %zu: strength %g, alpha %g", name, ti, t->scale, t->alpha);
    return LK_OK;
}

/* ---- R in f64 ---- */

/* inv = (I - Q)^-1 for one b x b block: Gauss-Jordan on [I - Q | I] with
 * partial pivoting (the first largest |pivot|), the two halves side by
 * side in one b x 2b array (each element's operations as on two arrays).
 * work: 2 b b doubles. 0 if singular (I - Q with Q skew never is; guards a
 * hostile NaN). */
#define LK_AI static inline __attribute__((always_inline))
/* ar[j] = fma(-f, ac[j], ar[j]) for j < w: the row update, element by element. */
LK_AI void gj_row(double *restrict ar, const double *restrict ac, double f, size_t w) {
    for (size_t j = 0; j < w; j++) ar[j] = fma(-f, ac[j], ar[j]);
}
#ifdef LK_KERNEL_X86
#include <immintrin.h>
/* The same, 8 lanes a time (the last ones masked): one fma per element. */
__attribute__((target("avx512f,fma"))) static inline void gj_row512(double *restrict ar, const double *restrict ac,
                                                                   double f, size_t w) {
    const __m512d nf = _mm512_set1_pd(-f);
    size_t j = 0;
    for (; j + 16 <= w; j += 16) {
        const __m512d r0 = _mm512_fmadd_pd(nf, _mm512_loadu_pd(ac + j), _mm512_loadu_pd(ar + j));
        const __m512d r1 = _mm512_fmadd_pd(nf, _mm512_loadu_pd(ac + j + 8), _mm512_loadu_pd(ar + j + 8));
        _mm512_storeu_pd(ar + j, r0);
        _mm512_storeu_pd(ar + j + 8, r1);
    }
    for (; j < w; j += 8) {
        const __mmask8 m = w - j >= 8 ? (__mmask8)0xff : (__mmask8)((1u << (w - j)) - 1u);
        _mm512_mask_storeu_pd(ar + j, m, _mm512_fmadd_pd(nf, _mm512_maskz_loadu_pd(m, ac + j), _mm512_maskz_loadu_pd(m, ar + j)));
    }
}
#endif
LK_AI int inv_i_minus_q_v(double *inv, const double *q, size_t b, double *work, const int v512) {
    double *a = work;
    const size_t w = 2 * b;
    for (size_t i = 0; i < b; i++)
        for (size_t j = 0; j < b; j++) {
            a[i * w + j] = (i == j) - q[i * b + j];
            a[i * w + b + j] = i == j;
        }
    for (size_t c = 0; c < b; c++) {
        size_t p = c;
        for (size_t r = c + 1; r < b; r++)
            if (fabs(a[r * w + c]) > fabs(a[p * w + c])) p = r;
        if (!(fabs(a[p * w + c]) > 0)) return 0;
        if (p != c)
            for (size_t j = 0; j < w; j++) {
                const double x = a[c * w + j];
                a[c * w + j] = a[p * w + j], a[p * w + j] = x;
            }
        const double piv = a[c * w + c];
        for (size_t j = 0; j < w; j++) a[c * w + j] /= piv;
        const double *restrict ac = a + c * w;
        for (size_t r = 0; r < b; r++) {
            if (r == c) continue;
            double *restrict ar = a + r * w; /* another row than ac */
            const double f = ar[c];
            if (f == 0.0) continue;
#ifdef LK_KERNEL_X86
            if (v512) {
                gj_row512(ar, ac, f, w);
                continue;
            }
#endif
            (void)v512;
            gj_row(ar, ac, f, w);
        }
    }
    for (size_t i = 0; i < b; i++) memcpy(inv + i * b, a + i * w + b, b * sizeof *inv);
    return 1;
}
#define inv_i_minus_q(inv, q, b, work) inv_i_minus_q_v((inv), (q), (b), (work), 0)

/* Q of every block (skew part, scaled by the constraint c when c > 0)
 * from the blocks' values x. */
LK_AI void skew_blocks(double *q, const double *x, size_t nblk, size_t b, double c) {
    for (size_t k = 0; k < nblk; k++)
        for (size_t i = 0; i < b; i++)
            for (size_t j = 0; j < b; j++) q[(k * b + i) * b + j] = x[(k * b + i) * b + j] - x[(k * b + j) * b + i];
    if (!(c > 0)) return; /* no constraint: the norm is not needed */
    double ss = 0.0;      /* the chain of squares in stored order */
    for (size_t i = 0; i < nblk * b * b; i++) ss = fma(q[i], q[i], ss);
    const double qn = sqrt(ss) + 1e-8;
    if (qn > c) {
        const double f = c / qn;
        for (size_t i = 0; i < nblk * b * b; i++) q[i] *= f;
    }
}

/* R = (I + Q) inv for every block into r; 0 if a block is singular. */
LK_AI int cayley_blocks(double *r, const double *q, size_t nblk, size_t b, double *work, const int v512) {
    double *inv = work, *w2 = work + b * b;
    for (size_t k = 0; k < nblk; k++) {
        const double *qk = q + k * b * b;
        if (!inv_i_minus_q_v(inv, qk, b, w2, v512)) return 0;
        /* (I + Q) inv, an fma chain over u ascending; 16 of a row's chains
         * side by side in a local array (registers), the rest one by one */
        for (size_t i = 0; i < b; i++) {
            double *ri = r + (k * b + i) * b;
            size_t j0 = 0;
            for (; j0 + 16 <= b; j0 += 16) {
                double acc[16];
                const double a0 = (double)(i == 0) + qk[i * b + 0];
                for (int j = 0; j < 16; j++) acc[j] = a0 * inv[j0 + j];
                for (size_t u = 1; u < b; u++) {
                    const double au = (double)(i == u) + qk[i * b + u];
                    for (int j = 0; j < 16; j++) acc[j] = fma(au, inv[u * b + j0 + j], acc[j]);
                }
                memcpy(ri + j0, acc, sizeof acc);
            }
            for (; j0 < b; j0++) {
                double acc = ((double)(i == 0) + qk[i * b + 0]) * inv[j0];
                for (size_t u = 1; u < b; u++) acc = fma((double)(i == u) + qk[i * b + u], inv[u * b + j0], acc);
                ri[j0] = acc;
            }
        }
    }
    return 1;
}

/* Q from the blocks' values x64 (nblk b x b), then R into r: the
 * arithmetic above, compiled twice: with the FMA instructions where the
 * CPU has them (fma() inline) and without (libm's fma): fma is one
 * correctly rounded operation either way, so the bits are the same. */
static int rotation_base(double *r, double *q, const double *x64, size_t nblk, size_t b, double c, double *work) {
    skew_blocks(q, x64, nblk, b, c);
    return cayley_blocks(r, q, nblk, b, work, 0);
}
#ifdef LK_KERNEL_X86
__attribute__((target("fma"))) static int rotation_fma(double *r, double *q, const double *x64, size_t nblk,
                                                       size_t b, double c, double *work) {
    skew_blocks(q, x64, nblk, b, c);
    return cayley_blocks(r, q, nblk, b, work, 0);
}

/* With AVX-512 the row updates (independent elements) run 8 lanes a time: the same operations. */
__attribute__((target("avx512f,avx512vl,fma"))) static int rotation_avx512(double *r, double *q, const double *x64,
                                                                          size_t nblk, size_t b, double c,
                                                                          double *work) {
    skew_blocks(q, x64, nblk, b, c);
    return cayley_blocks(r, q, nblk, b, work, 1);
}
#endif

static int rotation(double *r, double *q, const double *x64, size_t nblk, size_t b, double c, double *work) {
#ifdef LK_KERNEL_X86
    if (__builtin_cpu_supports("avx512f")) return rotation_avx512(r, q, x64, nblk, b, c, work);
    if (__builtin_cpu_supports("fma")) return rotation_fma(r, q, x64, nblk, b, c, work);
#endif
    return rotation_base(r, q, x64, nblk, b, c, work);
}

/* The n values of a fusable (or F64) tensor as f64 into out. */
static void values64(double *out, const lk_tensor *t, size_t n) {
    if (t->dtype == LK_DTYPE_F64) {
        memcpy(out, t->data, n * sizeof *out);
        return;
    }
    float buf[256];
    const size_t esz = lk_dtype_size(t->dtype);
    for (size_t i = 0; i < n; i += 256) {
        const size_t m = n - i < 256 ? n - i : 256;
        lk_to_f32(buf, (const char *)t->data + i * esz, t->dtype, m);
        for (size_t j = 0; j < m; j++) out[i + j] = (double)buf[j];
    }
}

void lk_oft_free(lk_oft *p) {
    if (!p) return;
    lk_free(p->mem);
    lk_free(p);
}

/* The stage matrices from R (in place in T) and the permutations. */
static void oft_stages(lk_oft *p, double s) {
    const size_t b = p->b, n = p->m * p->nb;
    for (size_t k = 0; k < n; k++) {
        double *t = p->T + k * b * b;
        if (!p->boft) { /* D = s (R^T - I): transpose in place */
            for (size_t i = 0; i < b; i++)
                for (size_t j = i + 1; j < b; j++) {
                    double x = t[i * b + j];
                    t[i * b + j] = t[j * b + i];
                    t[j * b + i] = x;
                }
            for (size_t i = 0; i < b; i++)
                for (size_t j = 0; j < b; j++) t[i * b + j] = s * (t[i * b + j] - (double)(i == j));
        } else if (s != 1.0) {
            for (size_t i = 0; i < b; i++)
                for (size_t j = 0; j < b; j++) t[i * b + j] = s * t[i * b + j] + (1.0 - s) * (double)(i == j);
        }
    }
    if (!p->boft) return;
    for (size_t i = 0; i < p->m; i++) {
        const size_t k = ((size_t)1 << i) * (b / 2);
        uint32_t *pm = p->perm + i * p->out;
        for (size_t pp = 0; pp < p->out; pp++) { /* permuted position (c, j, g) holds row (c, g, j) */
            const size_t c = pp / (2 * k), rem = pp % (2 * k), j = rem / 2, g = rem % 2;
            pm[pp] = (uint32_t)(c * 2 * k + g * k + j);
        }
    }
}

static lk_status peft_prepare(const lk_fuse_term *t, int64_t out, lk_convention conv, const char *name, lk_oft **pp);

lk_status lk_oft_prepare(const lk_fuse_term *t, int64_t out, lk_convention conv, const char *name, lk_oft **pp) {
    *pp = NULL;
    if (t->peft) return peft_prepare(t, out, conv, name, pp);
    lk_status s = lk_oft_check(t, out, 0, name);
    if (s) return s;
    const lk_tensor *X = t->B;
    lk_oft *p = lk_calloc(1, sizeof *p);
    if (!p) return lk_error(LK_ERR_NOMEM, "%s: out of memory", name);
    p->boft = X->ndim == 4;
    p->b = (size_t)X->shape[X->ndim - 1];
    p->nb = (size_t)X->shape[X->ndim - 3];
    p->m = p->boft ? (size_t)X->shape[0] : 1;
    p->out = (size_t)out;
    const int comfy = conv == LK_CONVENTION_COMFYUI;
    const size_t nblk = p->m * p->nb, bb = p->b * p->b;
    lk_carve cv = {0};
    const size_t o_t = LK_CARVE(&cv, nblk * bb, double), o_q = LK_CARVE(&cv, nblk * bb, double),
                 o_w = LK_CARVE(&cv, 3 * bb, double), o_p = LK_CARVE(&cv, p->boft ? p->m * p->out : 0, uint32_t),
                 o_r = LK_CARVE(&cv, t->A2 ? p->out : 0, double);
    p->mem = cv.overflow ? NULL : lk_carve_alloc(&cv);
    if (!p->mem) {
        lk_free(p);
        return lk_error(LK_ERR_NOMEM, "%s: out of memory for the OFT blocks", name);
    }
    p->T = (double *)(void *)(p->mem + o_t);
    double *q = (double *)(void *)(p->mem + o_q), *work = (double *)(void *)(p->mem + o_w);
    p->perm = p->boft ? (uint32_t *)(void *)(p->mem + o_p) : NULL;
    /* ComfyUI takes alpha as the constraint; LyCORIS alpha x out_dim */
    /* X's values in T (R overwrites them after Q is made) */
    values64(p->T, X, nblk * bb);
    if (!rotation(p->T, q, p->T, nblk, p->b, comfy ? t->alpha : t->alpha * (double)out, work)) {
        lk_oft_free(p);
        return lk_error(LK_ERR_NONFINITE, "%s: '%s': I - Q is singular (the blocks hold non-finite values)", name,
                        X->name ? X->name : "oft_blocks");
    }
    /* ComfyUI ignores an OFT rescale but applies BOFT's; LyCORIS applies both */
    if (t->A2 && (p->boft || !comfy)) {
        p->rho = (double *)(void *)(p->mem + o_r);
        for (size_t i = 0; i < p->out; i++) p->rho[i] = elem64(t->A2, i);
    }
    p->g = comfy ? t->scale : 1.0;
    oft_stages(p, t->scale);
    *pp = p;
    return LK_OK;
}

/* ---- the block products ---- */

/* dst[t][j] = sum_u M[t][u] src[u][j], j < L, t < b: an fma chain over u
 * ascending from the first product, register blocks of OFT_RB rows x
 * OFT_CB columns (every element the same chain, so any blocking gives the
 * same bits). */
LK_AI void mat_rows(double *const *dst, const double *const *src, const double *M, size_t b, size_t L) {
    size_t j0 = 0;
    for (; j0 + OFT_CB <= L; j0 += OFT_CB) {
        size_t t0 = 0;
        for (; t0 + OFT_RB <= b; t0 += OFT_RB) {
            double acc[OFT_RB][OFT_CB];
            for (int r = 0; r < OFT_RB; r++) {
                const double a = M[(t0 + r) * b];
                for (int c = 0; c < OFT_CB; c++) acc[r][c] = a * src[0][j0 + c];
            }
            for (size_t u = 1; u < b; u++) {
                const double *su = src[u] + j0;
                for (int r = 0; r < OFT_RB; r++) {
                    const double a = M[(t0 + r) * b + u];
                    for (int c = 0; c < OFT_CB; c++) acc[r][c] = fma(a, su[c], acc[r][c]);
                }
            }
            for (int r = 0; r < OFT_RB; r++) memcpy(dst[t0 + r] + j0, acc[r], sizeof acc[r]);
        }
        for (; t0 < b; t0++) {
            double acc[OFT_CB];
            const double a = M[t0 * b];
            for (int c = 0; c < OFT_CB; c++) acc[c] = a * src[0][j0 + c];
            for (size_t u = 1; u < b; u++)
                for (int c = 0; c < OFT_CB; c++) acc[c] = fma(M[t0 * b + u], src[u][j0 + c], acc[c]);
            memcpy(dst[t0] + j0, acc, sizeof acc);
        }
    }
    for (; j0 < L; j0++)
        for (size_t t = 0; t < b; t++) {
            double acc = M[t * b] * src[0][j0];
            for (size_t u = 1; u < b; u++) acc = fma(M[t * b + u], src[u][j0], acc);
            dst[t][j0] = acc;
        }
}

static void mat_rows_base(double *const *dst, const double *const *src, const double *M, size_t b, size_t L) {
    mat_rows(dst, src, M, b, L);
}
#ifdef LK_KERNEL_X86
#include <immintrin.h>
/* Elements [t0, t1) x [j0, j1) one by one: the same chain. */
LK_AI void mat_tail(double *const *dst, const double *const *src, const double *M, size_t b, size_t t0, size_t t1,
                    size_t j0, size_t j1) {
    for (size_t t = t0; t < t1; t++)
        for (size_t j = j0; j < j1; j++) {
            double acc = M[t * b] * src[0][j];
            for (size_t u = 1; u < b; u++) acc = fma(M[t * b + u], src[u][j], acc);
            dst[t][j] = acc;
        }
}

/* Register blocks of 4 rows x 2 vectors (8 accumulators), one vector fma
 * per step of each element's chain; the edges through mat_tail. */
#define MAT_VEC(VT, W, LOAD, STORE, SET1, MUL, FMA)                                                        \
    const size_t bq = b / 4 * 4, jv = L / (2 * (W)) * (2 * (W));                                           \
    for (size_t j0 = 0; j0 < jv; j0 += 2 * (W))                                                            \
        for (size_t t0 = 0; t0 < bq; t0 += 4) {                                                            \
            VT acc[4][2];                                                                                  \
            const VT s0 = LOAD(src[0] + j0), s1 = LOAD(src[0] + j0 + (W));                                  \
            for (int r = 0; r < 4; r++) {                                                                  \
                const VT a = SET1(M[(t0 + r) * b]);                                                        \
                acc[r][0] = MUL(a, s0);                                                                    \
                acc[r][1] = MUL(a, s1);                                                                    \
            }                                                                                              \
            for (size_t u = 1; u < b; u++) {                                                               \
                const VT x0 = LOAD(src[u] + j0), x1 = LOAD(src[u] + j0 + (W));                              \
                for (int r = 0; r < 4; r++) {                                                              \
                    const VT a = SET1(M[(t0 + r) * b + u]);                                                \
                    acc[r][0] = FMA(a, x0, acc[r][0]);                                                     \
                    acc[r][1] = FMA(a, x1, acc[r][1]);                                                     \
                }                                                                                          \
            }                                                                                              \
            for (int r = 0; r < 4; r++) {                                                                  \
                STORE(dst[t0 + r] + j0, acc[r][0]);                                                        \
                STORE(dst[t0 + r] + j0 + (W), acc[r][1]);                                                  \
            }                                                                                              \
        }                                                                                                  \
    mat_tail(dst, src, M, b, bq, b, 0, jv);                                                                \
    mat_tail(dst, src, M, b, 0, b, jv, L)

__attribute__((target("avx2,fma"))) static void mat_rows_avx2(double *const *dst, const double *const *src,
                                                             const double *M, size_t b, size_t L) {
    MAT_VEC(__m256d, 4, _mm256_loadu_pd, _mm256_storeu_pd, _mm256_set1_pd, _mm256_mul_pd, _mm256_fmadd_pd);
}
/* AVX-512 (32 zmm): register blocks of 4 rows x 4 vectors (16
 * accumulators: four per row, two FMA pipes of latency 4 kept busy), then
 * 4 rows x 1 vector, then single rows, the last columns through mat_tail. */
#define MAT_ROWS_512(R, V)                                                                                 \
    do {                                                                                                   \
        __m512d acc[R][V];                                                                                 \
        for (int r = 0; r < (R); r++) {                                                                    \
            const __m512d a = _mm512_set1_pd(M[(t0 + r) * b]);                                             \
            for (int v = 0; v < (V); v++) acc[r][v] = _mm512_mul_pd(a, _mm512_loadu_pd(src[0] + j0 + 8 * v)); \
        }                                                                                                  \
        for (size_t u = 1; u < b; u++) {                                                                   \
            __m512d xv[V];                                                                                 \
            for (int v = 0; v < (V); v++) xv[v] = _mm512_loadu_pd(src[u] + j0 + 8 * v);                    \
            for (int r = 0; r < (R); r++) {                                                                \
                const __m512d a = _mm512_set1_pd(M[(t0 + r) * b + u]);                                     \
                for (int v = 0; v < (V); v++) acc[r][v] = _mm512_fmadd_pd(a, xv[v], acc[r][v]);            \
            }                                                                                              \
        }                                                                                                  \
        for (int r = 0; r < (R); r++)                                                                      \
            for (int v = 0; v < (V); v++) _mm512_storeu_pd(dst[t0 + r] + j0 + 8 * v, acc[r][v]);           \
    } while (0)

__attribute__((target("avx512f,fma"))) static void mat_rows_avx512(double *const *dst, const double *const *src,
                                                                  const double *M, size_t b, size_t L) {
    const size_t bq = b / 4 * 4, j4 = L / 32 * 32, j1 = L / 8 * 8;
    for (size_t j0 = 0; j0 < j4; j0 += 32)
        for (size_t t0 = 0; t0 < bq; t0 += 4) MAT_ROWS_512(4, 4);
    for (size_t j0 = j4; j0 < j1; j0 += 8)
        for (size_t t0 = 0; t0 < bq; t0 += 4) MAT_ROWS_512(4, 1);
    for (size_t j0 = 0; j0 < j1; j0 += 8)
        for (size_t t0 = bq; t0 < b; t0++) MAT_ROWS_512(1, 1);
    mat_tail(dst, src, M, b, 0, b, j1, L);
}
#undef MAT_ROWS_512
#undef MAT_VEC
#endif

typedef void (*mat_fn)(double *const *, const double *const *, const double *, size_t, size_t);


/* The rows of one work item: OFT a block (b rows); BOFT a group of
 * G = 2^(m-1) b rows, which every stage maps onto itself (stage i mixes
 * rows only within groups of 2^i b), so the whole butterfly of a row tile
 * runs in cache. Columns per item: up to OFT_COLS, fewer for tall groups
 * (OFT_TILE / BOFT_TILE f64 values per tile), a multiple of 16; a BOFT
 * tile of up to 1024 rows BOFT_MIN_COLS at least: LyCORIS's files are
 * one group of all the rows (its butterfly_factor: 2^p blocks, p + 1
 * stages), and a 16-column tile of a 1024-row group runs each b-row
 * product on one vector of 8 lanes (mat_rows_avx512's 4 x 4 register
 * blocks need 32 columns) with the stage's row pointers made afresh every
 * 16 columns; 64 columns (three 1024 x 72 f64 buffers, 1.7 MiB a worker)
 * fused a BF16 1024 x 1024 weight with 9 stages of 4 in 4.8 ms instead of
 * 8.6 (a timing driver over lk_fuse_tensor_oft, CPU time, best of 5; 7
 * stages of 16: 9.7 / 10.6). Taller groups keep 16 columns (4096 rows, 10
 * stages of 8: 50 / 54 ms, not worth 7 MiB a worker). The bits do not
 * depend on the tile. */
#define BOFT_MIN_COLS 64
#define BOFT_MIN_COLS_ROWS 1024 /* the tallest group BOFT_MIN_COLS applies to */
static size_t lk_oft_rows(const lk_oft *p) { return p->boft ? ((size_t)1 << (p->m - 1)) * p->b : p->b; }
static size_t lk_oft_tile_cols(const lk_oft *p) {
    size_t tc = ((p->boft ? BOFT_TILE : OFT_TILE) / lk_oft_rows(p)) / 16 * 16;
    if (p->boft && tc < BOFT_MIN_COLS && lk_oft_rows(p) <= BOFT_MIN_COLS_ROWS) tc = BOFT_MIN_COLS;
    return tc < 16 ? 16 : tc > OFT_COLS ? OFT_COLS : tc;
}
/* A tile's row stride in doubles: a cache line more than its columns, so
 * the b rows a product reads at one column are not all in one L1 set (a
 * 4 KiB stride maps them to the same one); buffer: one tile plus 3 lines,
 * so X, y and y2 do not alias either. */
static size_t lk_oft_ld(const lk_oft *p) { return lk_oft_tile_cols(p) + 8; }
static size_t lk_oft_buf(const lk_oft *p) { return lk_oft_rows(p) * lk_oft_ld(p) + 24; }
static size_t lk_oft_items(const lk_oft *p, size_t in) {
    const size_t tc = lk_oft_tile_cols(p);
    return p->out / lk_oft_rows(p) * ((in + tc - 1) / tc);
}

/* The rotated rows (f64, rows x L, row stride ld) of row tile grp whose
 * f64 values X holds: OFT E = D X into y (one block), BOFT the m stages
 * from X through y and y2. Returns the buffer holding the result. */
static const double *oft_rotate_tile(const lk_oft *p, mat_fn mat, size_t grp, const double *X, double *y, double *y2,
                                     size_t ld, size_t L, const double **sp, double **dp) {
    const size_t b = p->b;
    if (!p->boft) {
        for (size_t u = 0; u < b; u++) sp[u] = X + u * ld, dp[u] = y + u * ld;
        mat(dp, sp, p->T + grp * b * b, b, L);
        return y;
    }
    const size_t G = lk_oft_rows(p), r0 = grp * G, k0 = r0 / b, nk = G / b;
    const double *cur = X;
    for (size_t i = 0; i < p->m; i++) {
        double *nxt = cur == y ? y2 : y;
        const uint32_t *pm = p->perm + i * p->out;
        for (size_t k = k0; k < k0 + nk; k++) { /* the blocks of permuted positions inside the tile */
            for (size_t u = 0; u < b; u++) {
                const size_t row = (size_t)pm[k * b + u] - r0;
                sp[u] = cur + row * ld, dp[u] = nxt + row * ld;
            }
            mat(dp, sp, p->T + (i * p->nb + k) * b * b, b, L);
        }
        cur = nxt;
    }
    return cur;
}

/* How the delta of a row comes from its rotated values e and weight x:
 * kind 0: d = e (OFT); kind 1: d = a e + c x (OFT with a rescale rho:
 * a = rho, c = rho - 1; BOFT: a = rho or 1, c = -1, i.e. rho e - x or
 * e - x: the same IEEE operations); then d = g d when g != 1. */
typedef struct rowfin {
    int kind;
    double a, c, g;
} rowfin;

static rowfin row_fin(const lk_oft *p, size_t row) {
    rowfin f = {.kind = p->boft || p->rho, .a = p->rho ? p->rho[row] : 1.0, .g = p->g};
    f.c = p->boft ? -1.0 : f.a - 1.0;
    return f;
}

static inline double fin_delta(rowfin f, double e, double x) {
    double d = f.kind ? f.a * e + f.c * x : e;
    return f.g != 1.0 ? f.g * d : d;
}

/* Work item `it` of an out x in weight: its row tile grp (rows
 * [grp G, grp G + G)), columns [*c0, *c0 + *L). */
static void item_span(const lk_oft *p, size_t in, size_t it, size_t *grp, size_t *c0, size_t *L) {
    const size_t tc = lk_oft_tile_cols(p), nct = (in + tc - 1) / tc;
    *grp = it / nct;
    *c0 = (it % nct) * tc;
    *L = in - *c0 < tc ? in - *c0 : tc;
}

/* Scratch doubles per worker: X, y, y2 tiles and the row pointers. */
static size_t lk_oft_scratch(const lk_oft *p) {
    return 3 * lk_oft_buf(p) * sizeof(double) + 2 * p->b * sizeof(void *) + 64;
}

typedef struct oft_tile {
    double *X, *y, *y2;
    const double **sp;
    double **dp;
} oft_tile;

static oft_tile tile_of(const lk_oft *p, void *scratch) {
    unsigned char *al = (unsigned char *)scratch + ((64u - ((uintptr_t)scratch & 63u)) & 63u);
    const size_t n = lk_oft_buf(p);
    oft_tile t;
    t.X = (double *)(void *)al;
    t.y = t.X + n;
    t.y2 = t.y + n;
    t.sp = (const double **)(void *)(t.y2 + n);
    t.dp = (double **)(t.sp + p->b);
    return t;
}

/* ---- the FP8 and GLoRA helpers (fp8.c, tensor.c) ---- */

lk_status lk_wlora_product(double *wb, const float *w, size_t out, size_t in, const lk_tensor *a1, const char *name) {
    const size_t r = (size_t)a1->shape[1];
    double *a = lk_malloc(in * r * sizeof *a);
    if (!a) return lk_error(LK_ERR_NOMEM, "%s: out of memory for a GLoRA factor", name);
    for (size_t i = 0; i < in * r; i++) a[i] = elem64(a1, i);
    for (size_t o = 0; o < out; o++) {
        double *row = wb + o * r;
        const double w0 = (double)w[o * in];
        for (size_t k = 0; k < r; k++) row[k] = w0 * a[k];
        for (size_t i = 1; i < in; i++) {
            const double wi = (double)w[o * in + i];
            for (size_t k = 0; k < r; k++) row[k] = fma(wi, a[i * r + k], row[k]);
        }
    }
    lk_free(a);
    return LK_OK;
}

int lk_fuse_wterms(const lk_fuse_term *terms, size_t n) {
    int k = 0;
    for (size_t t = 0; terms && t < n; t++) {
        if (terms[t].scale == 0.0) continue;
        if (terms[t].kind == LK_TERM_WLORA) k |= 1;
        if (terms[t].kind == LK_TERM_OFT) k |= 2;
    }
    return k;
}

static lk_status check_wlora(const lk_fuse_term *t, int64_t out, int64_t in, size_t ti, const char *name) {
    lk_status s;
    if ((s = lk_fuse_check_factor(t->B, "B", name, ti)) || (s = lk_fuse_check_factor(t->A, "A", name, ti))) return s;
    if (t->B->shape[0] != in || t->B->shape[1] != t->A->shape[0] || t->A->shape[1] != in || out <= 0)
        return lk_error(LK_ERR_SHAPE, "%s: term %zu: W @ B @ A with B %lldx%lld and A %lldx%lld on a weight of "
                        "%lldx%lld", name, ti, (long long)t->B->shape[0], (long long)t->B->shape[1],
                        (long long)t->A->shape[0], (long long)t->A->shape[1], (long long)out, (long long)in);
    return LK_OK;
}

lk_status lk_fuse_expand_wterms(const float *w, int64_t out, int64_t in, const lk_fuse_term *terms, size_t n,
                                const lk_fuse_term **xt, void **mem, const char *name) {
    *xt = terms;
    *mem = NULL;
    size_t nw = 0, bytes = 0, live = 0;
    int oft = 0;
    lk_status s;
    for (size_t t = 0; t < n; t++) {
        if (terms[t].scale == 0.0) continue;
        live++;
        oft |= terms[t].kind == LK_TERM_OFT;
        if (terms[t].kind != LK_TERM_WLORA) continue;
        if ((s = check_wlora(&terms[t], out, in, t, name))) return s;
        nw++;
        bytes += ((size_t)out * (size_t)terms[t].B->shape[1] * sizeof(double) + 63) & ~(size_t)63;
    }
    if (oft && live > 1)
        return lk_error(LK_ERR_UNSUPPORTED, "%s: an OFT / BOFT rotation with other adapters' terms on the same weight "
                        "is not supported (the result depends on the order); fuse them one after another", name);
    if (!nw) return LK_OK;
    lk_carve cv = {0};
    const size_t o_t = LK_CARVE(&cv, n, lk_fuse_term), o_v = LK_CARVE(&cv, nw, lk_tensor),
                 o_b = lk_carve_part(&cv, bytes, 1, 64);
    unsigned char *m = cv.overflow ? NULL : lk_carve_alloc(&cv);
    if (!m) return lk_error(LK_ERR_NOMEM, "%s: out of memory for GLoRA's W a1", name);
    lk_fuse_term *nt = (lk_fuse_term *)(void *)(m + o_t);
    lk_tensor *v = (lk_tensor *)(void *)(m + o_v);
    unsigned char *buf = m + o_b;
    size_t k = 0;
    for (size_t t = 0; t < n && !s; t++) {
        nt[t] = terms[t];
        if (terms[t].scale == 0.0 || terms[t].kind != LK_TERM_WLORA) continue;
        const size_t r = (size_t)terms[t].B->shape[1];
        v[k] = (lk_tensor){.name = terms[t].B->name, .dtype = LK_DTYPE_F64, .ndim = 2,
                           .shape = {out, (int64_t)r}, .nbytes = (size_t)out * r * sizeof(double), .data = buf};
        s = lk_wlora_product((double *)(void *)buf, w, (size_t)out, (size_t)in, terms[t].B, name);
        nt[t] = (lk_fuse_term){.A = terms[t].A, .B = &v[k], .scale = terms[t].scale};
        buf += (v[k].nbytes + 63) & ~(size_t)63;
        k++;
    }
    if (s) {
        lk_free(m);
        return s;
    }
    *xt = nt;
    *mem = m;
    return LK_OK;
}

/* ---- the driver ---- */

struct oworker;
struct finrow;
typedef struct ojob {
    const lk_oft *p;
    void *w_out;
    const void *w_in;
    lk_dtype dt;
    size_t in, n_items;
    mat_fn mat;
    void (*fin)(struct oworker *, lk_dtype, const struct finrow *, size_t);
    void (*load)(double *, const void *, lk_dtype, size_t);
    const float *d32, *k32; /* the narrow path (oft_narrow_*): fl32(D') per block, K per row */
    float a0;
    int bf16isa; /* the narrow path with AVX512_BF16 (the avx512bf16 kernel path, BF16 weights) */
    atomic_size_t next;
} ojob;

typedef struct oworker {
    ojob *job;
    void *scratch;
    lk_kworker kw; /* the first element made non-finite (kw.job unused) */
} oworker;

/* f64 sum x rounded to odd in f32 (x from lk_fuse_add_odd_f64). */
static inline float odd_f32(double x) {
    float f = (float)x;
    uint32_t u = lk_f2u(f);
    if ((u & 0x7f800000u) != 0x7f800000u && (double)f != x && !(u & 1u)) {
        /* one unit toward x: away from zero when |x| > |f| (0 steps to x's side) */
        if ((u & 0x7fffffffu) == 0) u = (x < 0 ? 0x80000000u : 0u) | 1u;
        else u += (fabs(x) > fabs((double)f)) ? 1u : (uint32_t)-1;
        f = lk_u2f(u);
    }
    return f;
}

/* One output row segment: x the weight's f64 values, e the rotated ones,
 * dst the row's elements [c0, ...) in the weight's dtype; off the element
 * index of dst[0] (the non-finite report). */
typedef struct finrow {
    const double *x, *e;
    char *dst;
    size_t off;
    rowfin f;
} finrow;

/* Columns [c0, c1) of a row by the scalar rules (step 3 of the header),
 * element by element: the portable path, and the vector paths' edges and
 * rare lanes (Inf, NaN, overflow). */
static void fin_scalar(oworker *wk, lk_dtype dt, const finrow *r, size_t c0, size_t c1) {
    const size_t esz = lk_dtype_size(dt);
    for (size_t c = c0; c < c1; c++) {
        const double x = r->x[c], d = fin_delta(r->f, r->e[c], x);
        char *dst = r->dst + c * esz;
        float res;
        if (dt == LK_DTYPE_F32) {
            const uint32_t rb = scalar_round_f64_to_f32(lk_f2u((float)x), d);
            memcpy(dst, &rb, 4);
            res = lk_u2f(rb);
        } else { /* odd in f64, odd in f32, then the one RNE conversion */
            const float w = (float)x;
            const uint32_t uw = lk_f2u(w);
            float o = (uw & 0x7fffffffu) > 0x7f800000u ? lk_u2f(uw | 0x00400000u)
                                                       : odd_f32(scalar_add_odd_f64((double)w, d));
            if (isnan(o) && !isnan(w)) o = lk_u2f(0x7fc00000u);
            lk_from_f32(dst, &o, dt, 1);
            lk_to_f32(&res, dst, dt, 1); /* what was stored, for the non-finite check */
        }
        if (isfinite(x) && !isfinite(res) && r->off + c < wk->kw.bad_at) {
            wk->kw.bad_at = r->off + c;
            wk->kw.bad_w = x;
            wk->kw.bad_r = res;
        }
    }
}

typedef void (*fin_fn)(oworker *, lk_dtype, const finrow *, size_t);

static void fin_row_base(oworker *wk, lk_dtype dt, const finrow *r, size_t L) { fin_scalar(wk, dt, r, 0, L); }

#ifdef LK_KERNEL_X86
/* The same results N lanes at a time (GCC vector arithmetic; the
 * conversions are the hardware's RNE under the default environment, as
 * the scalar casts). Step 3 gives RN_t(v), the correctly rounded value of
 * the exact sum v = x + d in the weight's dtype t (round to odd in f64 and
 * f32 loses nothing that a final RNE to fewer bits needs). The fast lanes
 * get the same value with two roundings: s = RN64(v), f = RN32(s), then
 * RN_t(f). Every midpoint m of t's grid (where RN_t changes) is an f32 and
 * an f64, so unless f is such a midpoint, v, s and f lie strictly on the
 * same side of every m (an m between v and s would be nearer to v than s
 * is; one between s and f nearer to s than f; v = m or s = m gives f = m)
 * and RN_t(f) = RN_t(v). A lane goes to fin_scalar (the exact sequence:
 * the odd sums, the NaN rule, the non-finite report) when f is a midpoint
 * (F32: s's 29 bits below f32's 24 are 1000...0; BF16: f's low 16 bits
 * are 0x8000; F16: f's low 13 are 0x1000), when the midpoint test does not
 * apply (F32: 0 < |s| < 2^-126; F16: 0 < |f| < 2^-14, the subnormal
 * grids), when x is NaN, or when f or the result is Inf or NaN (the
 * overflow thresholds are midpoints too). So the bits equal fin_scalar's;
 * tests/test_oft_paths.c checks them on every path, midpoints included. */
#define FIN_VEC(N, VD, VQ, VF, VU, VH, ANY, F16)                                                                \
    const size_t esz = lk_dtype_size(dt), nv = L / (N) * (N);                                                  \
    const rowfin f = r->f;                                                                                     \
    const VU expf = (VU){0} + 0x7f800000u;                                                                     \
    for (size_t c = 0; c < nv; c += (N)) {                                                                     \
        VD x, e;                                                                                               \
        memcpy(&x, r->x + c, sizeof x);                                                                        \
        memcpy(&e, r->e + c, sizeof e);                                                                        \
        VD d = f.kind ? f.a * e + f.c * x : e;                                                                 \
        if (f.g != 1.0) d = f.g * d;                                                                           \
        const VD s = x + d;                                                                                    \
        const VU u = (VU)__builtin_convertvector(s, VF); /* RNE */                                            \
        const VU mag = u & 0x7fffffffu;                                                                        \
        VU spec = (VU)((u & expf) == expf) | __builtin_convertvector((VQ)(x != x), VU);                        \
        char *dst = r->dst + c * esz;                                                                          \
        if (dt == LK_DTYPE_F32) {                                                                              \
            const VQ us = (VQ)s & 0x7fffffffffffffffull;                                                       \
            spec |= __builtin_convertvector((VQ)((us & 0x1fffffffull) == 0x10000000ull) |                      \
                                                (VQ)((us - 1) < 0x380fffffffffffffull), VU);                   \
            if (!ANY(spec)) {                                                                                  \
                memcpy(dst, &u, sizeof u);                                                                     \
                continue;                                                                                      \
            }                                                                                                  \
        } else {                                                                                               \
            VH h;                                                                                              \
            if (dt == LK_DTYPE_BF16) {                                                                         \
                h = __builtin_convertvector((u + 0x7fffu + ((u >> 16) & 1u)) >> 16, VH);                       \
                spec |= (VU)((u & 0xffffu) == 0x8000u) | __builtin_convertvector((h & 0x7f80u) == 0x7f80u, VU); \
            } else {                                                                                           \
                h = F16((VF)u);                                                                                \
                spec |= (VU)((u & 0x1fffu) == 0x1000u) | (VU)((mag - 1u) < 0x387fffffu) |                      \
                        __builtin_convertvector((h & 0x7c00u) == 0x7c00u, VU);                                 \
            }                                                                                                  \
            if (!ANY(spec)) {                                                                                  \
                memcpy(dst, &h, sizeof h);                                                                     \
                continue;                                                                                      \
            }                                                                                                  \
        }                                                                                                      \
        fin_scalar(wk, dt, r, c, c + (N));                                                                     \
    }                                                                                                          \
    fin_scalar(wk, dt, r, nv, L)

typedef double vd4 __attribute__((vector_size(32)));
typedef uint64_t vq4 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));
typedef uint32_t vu4 __attribute__((vector_size(16)));
typedef uint16_t vh4 __attribute__((vector_size(8)));

#define ANY4(m) (_mm_movemask_ps((__m128)(m)) != 0)
#define F16_4(v) (__extension__({                                                                            \
    const __m128i h_ = _mm_cvtps_ph((__m128)(v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);              \
    vh4 r_;                                                                                                  \
    memcpy(&r_, &h_, sizeof r_);                                                                             \
    r_;                                                                                                      \
}))

/* AVX-512: FIN_VEC's rules in intrinsics, 16 lanes (two f64 vectors, one
 * f32 vector) per step, the lanes to redo as a k-mask. */
#define FIN16(DT_BODY)                                                                                         \
    for (size_t c = 0; c < nv; c += 16) {                                                                      \
        const __m512d x0 = _mm512_loadu_pd(xp + c), x1 = _mm512_loadu_pd(xp + c + 8);                         \
        __m512d d0 = _mm512_loadu_pd(ep + c), d1 = _mm512_loadu_pd(ep + c + 8);                                \
        if (f.kind) {                                                                                          \
            d0 = _mm512_add_pd(_mm512_mul_pd(va, d0), _mm512_mul_pd(vc, x0));                                  \
            d1 = _mm512_add_pd(_mm512_mul_pd(va, d1), _mm512_mul_pd(vc, x1));                                  \
        }                                                                                                      \
        if (f.g != 1.0) d0 = _mm512_mul_pd(vg, d0), d1 = _mm512_mul_pd(vg, d1);                                \
        const __m512d s0 = _mm512_add_pd(x0, d0), s1 = _mm512_add_pd(x1, d1);                                  \
        const __m512 fv = _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtpd_ps(s0)), _mm512_cvtpd_ps(s1), 1); \
        const __m512i u = _mm512_castps_si512(fv);                                                             \
        __mmask16 k = (__mmask16)(_mm512_cmp_pd_mask(x0, x0, _CMP_UNORD_Q) |                                   \
                                  ((unsigned)_mm512_cmp_pd_mask(x1, x1, _CMP_UNORD_Q) << 8)) |                 \
                      _mm512_cmpeq_epi32_mask(_mm512_and_si512(u, expf), expf);                                \
        DT_BODY                                                                                                \
        fin_scalar(wk, dt, r, c, c + 16);                                                                      \
    }

__attribute__((target("avx512f,avx512vl,avx512dq,avx512bw,fma,f16c"))) static void
fin_row_avx512(oworker *wk, lk_dtype dt, const finrow *r, size_t L) {
    const size_t nv = L / 16 * 16;
    const rowfin f = r->f;
    const double *xp = r->x, *ep = r->e;
    char *dp = r->dst;
    const __m512d va = _mm512_set1_pd(f.a), vc = _mm512_set1_pd(f.c), vg = _mm512_set1_pd(f.g);
    const __m512i expf = _mm512_set1_epi32(0x7f800000);
    if (dt == LK_DTYPE_F32) {
        const __m512i abs64 = _mm512_set1_epi64(0x7fffffffffffffffll), lo29 = _mm512_set1_epi64(0x1fffffff),
                      mid = _mm512_set1_epi64(0x10000000), one = _mm512_set1_epi64(1),
                      sub = _mm512_set1_epi64(0x380fffffffffffffll);
        FIN16({
            const __m512i a0 = _mm512_and_si512(_mm512_castpd_si512(s0), abs64);
            const __m512i a1 = _mm512_and_si512(_mm512_castpd_si512(s1), abs64);
            const __mmask8 m0 = _mm512_cmpeq_epi64_mask(_mm512_and_si512(a0, lo29), mid) |
                                _mm512_cmplt_epu64_mask(_mm512_sub_epi64(a0, one), sub);
            const __mmask8 m1 = _mm512_cmpeq_epi64_mask(_mm512_and_si512(a1, lo29), mid) |
                                _mm512_cmplt_epu64_mask(_mm512_sub_epi64(a1, one), sub);
            k |= (__mmask16)(m0 | ((unsigned)m1 << 8));
            if (!k) {
                _mm512_storeu_si512(dp + c * 4, u);
                continue;
            }
        })
    } else if (dt == LK_DTYPE_BF16) {
        const __m512i lo16 = _mm512_set1_epi32(0xffff), mid = _mm512_set1_epi32(0x8000),
                      bias = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
        const __m256i e16 = _mm256_set1_epi16(0x7f80);
        FIN16({
            k |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(u, lo16), mid);
            const __m512i rb = _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(u, 16), one));
            const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(u, rb), 16));
            k |= _mm256_cmpeq_epi16_mask(_mm256_and_si256(h, e16), e16);
            if (!k) {
                _mm256_storeu_si256((__m256i *)(void *)(dp + c * 2), h);
                continue;
            }
        })
    } else {
        const __m512i lo13 = _mm512_set1_epi32(0x1fff), mid = _mm512_set1_epi32(0x1000),
                      abs32 = _mm512_set1_epi32(0x7fffffff), one = _mm512_set1_epi32(1),
                      sub = _mm512_set1_epi32(0x387fffff);
        const __m256i e16 = _mm256_set1_epi16(0x7c00);
        FIN16({
            k |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(u, lo13), mid) |
                 _mm512_cmplt_epu32_mask(_mm512_sub_epi32(_mm512_and_si512(u, abs32), one), sub);
            const __m256i h = _mm512_cvtps_ph(fv, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            k |= _mm256_cmpeq_epi16_mask(_mm256_and_si256(h, e16), e16);
            if (!k) {
                _mm256_storeu_si256((__m256i *)(void *)(dp + c * 2), h);
                continue;
            }
        })
    }
    fin_scalar(wk, dt, r, nv, L);
}
#undef FIN16
__attribute__((target("avx2,fma,f16c"))) static void fin_row_avx2(oworker *wk, lk_dtype dt, const finrow *r, size_t L) {
    FIN_VEC(4, vd4, vq4, vf4, vu4, vh4, ANY4, F16_4);
}
#undef FIN_VEC
#endif

/* A row segment of the weight (dtype dt, L values at src, any alignment)
 * as f64 into x: what lk_to_f32 and the cast give (exact conversions). */
typedef void (*load_fn)(double *, const void *, lk_dtype, size_t);

static void load_base(double *x, const void *src, lk_dtype dt, size_t L) {
    float tmp[64];
    const size_t esz = lk_dtype_size(dt);
    for (size_t c = 0; c < L; c += 64) {
        const size_t n = L - c < 64 ? L - c : 64;
        lk_to_f32(tmp, (const char *)src + c * esz, dt, n);
        for (size_t k = 0; k < n; k++) x[c + k] = (double)tmp[k];
    }
}

#ifdef LK_KERNEL_X86
__attribute__((target("avx512f,avx512vl,avx512dq,avx512bw,f16c"))) static void load_avx512(double *x, const void *src,
                                                                                           lk_dtype dt, size_t L) {
    const size_t nv = L / 16 * 16;
    const char *sp = src;
    const size_t esz = lk_dtype_size(dt);
    for (size_t c = 0; c < nv; c += 16) {
        _mm_prefetch(sp + c * esz + OFT_PF_AHEAD, _MM_HINT_T0); /* the next tile's line of this row */
        __m512 f;
        if (dt == LK_DTYPE_F32) f = _mm512_loadu_ps(sp + c * 4);
        else {
            const __m256i h = _mm256_loadu_si256((const __m256i *)(const void *)(sp + c * 2));
            f = dt == LK_DTYPE_BF16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
                                    : _mm512_cvtph_ps(h);
        }
        _mm512_storeu_pd(x + c, _mm512_cvtps_pd(_mm512_castps512_ps256(f)));
        _mm512_storeu_pd(x + c + 8, _mm512_cvtps_pd(_mm512_extractf32x8_ps(f, 1)));
    }
    load_base(x + nv, sp + nv * esz, dt, L - nv);
}
#endif

/* The block product, the row rounding and the row load of the kernel
 * path (lk_fuse_kernel_path: LORAKIT_KERNEL or the CPU's best). */
typedef struct oft_fns {
    mat_fn mat;
    fin_fn fin;
    load_fn load;
} oft_fns;

static oft_fns pick_fns(void) {
    oft_fns f = {mat_rows_base, fin_row_base, load_base};
#ifdef LK_KERNEL_X86
    const char *path = lk_fuse_kernel_path();
    if (!strncmp(path, "avx512", 6)) f = (oft_fns){mat_rows_avx512, fin_row_avx512, load_avx512};
    else if (!strcmp(path, "avx2")) f = (oft_fns){mat_rows_avx2, fin_row_avx2, load_base};
#endif
    return f;
}


/* ---- BF16 / F16 weights: an fp32 chain whose rounding is certified ----
 *
 * The bytes stay those of step 3 of the header (RN_t of the f64 sum): this
 * is a faster way to compute them, not another rule. Per element (row t of
 * block k, column j) the narrow path forms, with D' the row's whole delta
 * matrix (d = g (a e + c x) folded in: D'_tu = g (a D_tu) + [t = u] g c,
 * made in f64 and rounded to f32 once per call),
 *   e32 = the fp32 fma chain sum_u fl32(D'_tu) x_u (u ascending from the
 *         first product, as the f64 chain), s = fl32(x_t + e32),
 * and an error bound E valid for |x_t + e32 - V| where V is the exact value
 * x_t + d64 that step 3 rounds (d64: the f64 rule's delta):
 *   E = K_t maxW_j + A0, maxW_j = max_u |x_u| (the block's column j),
 *   K_t = (b + 1) 2^-24 (1 + 2^-10) H_t + (b + 1) 2^-150, A0 = (b + 2) 2^-149,
 *   H_t = |g| (|a_t| sum_u |D_tu| + |c_t|) >= sum_u |D'_tu| (exact D');
 * the terms: rounding D' to f32 (2^-24 |D'| + 2^-150 each, times |x_u| <=
 * maxW), the fp32 chain (gamma_b = b 2^-24 / (1 - b 2^-24) of
 * sum |D'32_tu| |x_u|, plus 2^-150 per rounding below the normal range),
 * D' in f64 (three roundings, 2^-51 H_t) and the f64 rule's own chain and
 * final steps ((b + 4) 2^-53 H_t maxW): for b <= 4096 they sum to less
 * than E; K_t and A0 are rounded up and carry 2^-20 more, which covers
 * the fp32 evaluation of E itself and of the interval below. Then
 *   B2 = fl32(|s| 2^-22 + E), lo = fl32(s - B2), hi = fl32(s + B2)
 * encloses V (|s - (x_t + e32)| <= 2^-24 |s|; each endpoint's rounding
 * <= 2^-24 of it). RN_t is monotone, so when RN_t(lo) and RN_t(hi) are the
 * same finite value (and lo, hi nonzero, s finite), every point of
 * [lo, hi], V among them, rounds to it: it is step 3's result. Otherwise
 * (a midpoint of t's grid, a sign change, zero, Inf, NaN or overflow in
 * the interval) the lane is redone by the f64 rule itself: its f64 chain
 * and fin_scalar. So the bytes do not depend on which lanes took which
 * way, on the path (the AVX2 and portable paths run step 3 directly) or
 * on the thread count; tests/test_oft_paths.c checks them against the
 * portable path, adversarial rows included. How often a lane is redone:
 * about 2 E / ulp_t(s), E ~ (b + 1) 2^-24 |D'| maxW; for rotations near I
 * (trained adapters, the bench) well under 1 in 1000 lanes.
 * The fp32 chain does 16 lanes per FMA where the f64 one does 8, and the
 * certificate is a few integer operations on the two endpoints. */
#define NARROW_MAX_B 4096

/* fl32(D') per block (row-major [t][u]) and K per row into d32 / k32;
 * 0 when some value does not fit the fp32 bound (then the f64 path runs). */
static int oft_narrow_prepare(const lk_oft *p, float *d32, float *k32, float *a0) {
    const size_t b = p->b;
    if (p->boft || p->peft || b > NARROW_MAX_B) return 0;
    for (size_t row = 0; row < p->out; row++) {
        const size_t k = row / b, t = row % b;
        const rowfin f = row_fin(p, row);
        const double *T = p->T + k * b * b + t * b;
        double h = 0.0;
        for (size_t u = 0; u < b; u++) {
            double v = f.kind ? f.a * T[u] : T[u];
            if (f.kind && u == t) v = v + f.c;
            if (f.g != 1.0) v = f.g * v;
            if (!(fabs(v) <= 0x1p100)) return 0;
            d32[k * b * b + t * b + u] = (float)v;
            h += fabs(T[u]);
        }
        h = fabs(f.g) * ((f.kind ? fabs(f.a) : 1.0) * h + (f.kind ? fabs(f.c) : 0.0)) * (1.0 + 0x1p-40);
        const double K = ((double)(b + 1) * 0x1p-24 * (1.0 + 0x1p-10) * h + (double)(b + 1) * 0x1p-150) *
                         (1.0 + 0x1p-20);
        if (!(K <= 0x1p100)) return 0;
        float kf = (float)K;
        if ((double)kf < K) kf = nextafterf(kf, INFINITY);
        k32[row] = kf;
    }
    *a0 = (float)(b + 2) * 0x1p-149f; /* an exact multiple of the least subnormal */
    return 1;
}

#ifdef LK_KERNEL_X86
/* The f64 rule for one element (the lane a certificate refused): row t of
 * the item's block, tile column j; x32 the tile (row stride ld). */
__attribute__((target("avx512f,fma"), noinline)) static void narrow_redo(oworker *wk, const float *x32, size_t ld,
                                                                       size_t t, size_t j, size_t row, size_t col) {
    const ojob *jb = wk->job;
    const lk_oft *p = jb->p;
    const size_t b = p->b;
    const double *T = p->T + (row / b) * b * b + t * b;
    double e = T[0] * (double)x32[j];
    for (size_t u = 1; u < b; u++) e = fma(T[u], (double)x32[u * ld + j], e);
    const double x = (double)x32[t * ld + j];
    const size_t esz = lk_dtype_size(jb->dt), off = row * jb->in + col;
    const finrow fr = {.x = &x, .e = &e, .dst = (char *)jb->w_out + off * esz, .off = off, .f = row_fin(p, row)};
    fin_scalar(wk, jb->dt, &fr, 0, 1);
}

/* The certificate of 16 lanes (the comment above): returns the lanes that
 * hold step 3's result in *out (16 BF16 / F16 values). A lane passes when
 * RN_t(lo) = RN_t(hi) is a normal finite value: then lo and hi are nonzero
 * and of one sign, so no zero, sign change or subnormal is in between;
 * NaN and Inf endpoints give an all-ones exponent, subnormal ones (and,
 * with AVX512_BF16, whose VCVTNEPS2BF16 reads a subnormal as 0) a zero
 * exponent, both refused. ISA: 1 with AVX512_BF16 (the conversion in one
 * instruction), else RNE on the bits (BF16) or VCVTPS2PH (F16). */
#define LK_NI static inline __attribute__((always_inline, target("avx512f,avx512vl,avx512dq,avx512bw,fma,f16c")))
LK_NI __mmask16 narrow_cert(int bf, int isa, __m512 x, __m512 e, __m512 kt, __m512 mx, __m512 a0, __m256i *out) {
    const __m512 s = _mm512_add_ps(x, e);
    const __m512 as = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(s), _mm512_set1_epi32(0x7fffffff)));
    const __m512 b2 = _mm512_fmadd_ps(as, _mm512_set1_ps(0x1p-22f), _mm512_fmadd_ps(kt, mx, a0));
    const __m512 lo = _mm512_sub_ps(s, b2), hi = _mm512_add_ps(s, b2);
    __m256i rl, rh;
    if (bf && isa) { /* VCVTNEPS2BF16 (run only where the CPU has it: the avx512bf16 path) */
        __asm__("vcvtneps2bf16 %1, %0" : "=v"(rl) : "v"(lo));
        __asm__("vcvtneps2bf16 %1, %0" : "=v"(rh) : "v"(hi));
    } else if (bf) { /* RNE on the bits: monotone, subnormals included */
        const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff);
        const __m512i ul = _mm512_castps_si512(lo), uh = _mm512_castps_si512(hi);
        rl = _mm512_cvtepi32_epi16(_mm512_srli_epi32(
            _mm512_add_epi32(ul, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(ul, 16), one))), 16));
        rh = _mm512_cvtepi32_epi16(_mm512_srli_epi32(
            _mm512_add_epi32(uh, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(uh, 16), one))), 16));
    } else {
        rl = _mm512_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        rh = _mm512_cvtps_ph(hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    /* the exponent field minus one below all-ones minus one: normal and finite */
    const __m256i em = _mm256_set1_epi16(bf ? 0x7f80 : 0x7c00), e1 = _mm256_set1_epi16(bf ? 0x80 : 0x400);
    const __mmask16 normal =
        _mm256_cmplt_epu16_mask(_mm256_sub_epi16(_mm256_and_si256(rl, em), e1), _mm256_sub_epi16(em, e1));
    *out = rl;
    return normal & _mm256_cmpeq_epi16_mask(rl, rh);
}

/* Lanes [0, n) of 16. */
static inline __mmask16 nlanes(size_t n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u); }

/* R rows (t0 .. t0 + R - 1) of a 16-column strip at tile column j: the
 * chains in registers, then the certificate, the stores, the redo. */
#define NARROW_ROWS(R)                                                                                      \
    do {                                                                                                    \
        __m512 acc[R];                                                                                      \
        const float *dm = D + t0 * b;                                                                       \
        const __m512 x0 = _mm512_load_ps(X + j);                                                            \
        for (int r = 0; r < (R); r++) acc[r] = _mm512_mul_ps(_mm512_set1_ps(dm[r * b]), x0);                \
        for (size_t u = 1; u < b; u++) {                                                                    \
            const __m512 xu = _mm512_load_ps(X + u * ld + j);                                               \
            for (int r = 0; r < (R); r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(dm[r * b + u]), xu, acc[r]); \
        }                                                                                                   \
        unsigned bad[R], anybad = 0;                                                                        \
        _Pragma("GCC unroll 8") for (int r = 0; r < (R); r++) {                                             \
            const size_t row = r0 + t0 + r;                                                                 \
            __m256i h;                                                                                      \
            const __mmask16 ok = narrow_cert(bf, isa, _mm512_load_ps(X + (t0 + r) * ld + j), acc[r],        \
                                             _mm512_set1_ps(jb->k32[row]), mx, a0, &h) & lanes;             \
            _mm256_mask_storeu_epi16((char *)jb->w_out + (row * in + c0 + j) * 2, ok, h);                   \
            bad[r] = (unsigned)(lanes & ~ok);                                                               \
            anybad |= bad[r];                                                                               \
        }                                                                                                   \
        if (__builtin_expect(anybad != 0, 0))                                                               \
            for (int r = 0; r < (R); r++)                                                                   \
                for (unsigned m = bad[r]; m; m &= m - 1) {                                                  \
                    const size_t jj = j + (size_t)__builtin_ctz(m);                                         \
                    narrow_redo(wk, X, ld, t0 + r, jj, r0 + t0 + r, c0 + jj);                               \
                }                                                                                           \
    } while (0)

/* One work item on the narrow path: the block's rows of the column tile
 * to f32 (exact), then per 16-column strip maxW and the rows' chains;
 * compiled with and without AVX512_BF16 (isa). */
LK_NI void oblock_narrow_body(oworker *wk, size_t it, const int isa) {
    const ojob *jb = wk->job;
    const lk_oft *p = jb->p;
    /* f32 rows 64 bytes longer than the tile (aligned; no 4 KiB stride) */
    const size_t in = jb->in, b = p->b, ld = lk_oft_tile_cols(p) + 16;
    const int bf = jb->dt == LK_DTYPE_BF16;
    size_t grp, c0, L;
    item_span(p, in, it, &grp, &c0, &L);
    const size_t r0 = grp * b;
    float *X = (float *)(void *)tile_of(p, wk->scratch).X;
    for (size_t u = 0; u < b; u++) {
        const char *src = (const char *)jb->w_in + ((r0 + u) * in + c0) * 2;
        float *dst = X + u * ld;
        for (size_t j = 0; j < L; j += 16) {
            const __mmask16 m = nlanes(L - j);
            _mm_prefetch(src + j * 2 + OFT_PF_AHEAD, _MM_HINT_T0); /* the next tile's line of this row */
            const __m256i h = _mm256_maskz_loadu_epi16(m, src + j * 2);
            const __m512 f = bf ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
                                : _mm512_cvtph_ps(h);
            _mm512_store_ps(dst + j, f);
        }
    }
    const float *D = jb->d32 + grp * b * b;
    const __m512 a0 = _mm512_set1_ps(jb->a0);
    const __m512i absm = _mm512_set1_epi32(0x7fffffff);
    for (size_t j = 0; j < L; j += 16) {
        const __mmask16 lanes = nlanes(L - j);
        __m512 mx = _mm512_setzero_ps();
        for (size_t u = 0; u < b; u++)
            mx = _mm512_max_ps(mx, _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(_mm512_load_ps(X + u * ld + j)), absm)));
        size_t t0 = 0;
        for (; t0 + 8 <= b; t0 += 8) NARROW_ROWS(8);
        for (; t0 + 4 <= b; t0 += 4) NARROW_ROWS(4);
        for (; t0 < b; t0++) NARROW_ROWS(1);
    }
}
__attribute__((target("avx512f,avx512vl,avx512dq,avx512bw,fma,f16c"))) static void oblock_narrow(oworker *wk,
                                                                                                size_t it) {
    oblock_narrow_body(wk, it, 0);
}
__attribute__((target("avx512f,avx512vl,avx512dq,avx512bw,fma,f16c"))) static void oblock_narrow_bf16(oworker *wk,
                                                                                                     size_t it) {
    oblock_narrow_body(wk, it, 1);
}
#undef NARROW_ROWS
#undef LK_NI
#endif

/* The FP8 path (fp8.c): the delta rounded to f32, for the dense fuse of a
 * dequantised weight. */
static lk_status peft_delta_f32(const lk_oft *p, const float *w, float *delta, size_t in, const char *name);

lk_status lk_oft_delta_f32(const lk_oft *p, const float *w, float *delta, size_t in, const char *name) {
    if (p->peft) return peft_delta_f32(p, w, delta, in, name);
    void *scr = lk_malloc(lk_oft_scratch(p));
    if (!scr) return lk_error(LK_ERR_NOMEM, "%s: out of memory for the OFT scratch", name);
    fenv_t saved;
    fegetenv(&saved);
    fesetenv(FE_DFL_ENV);
    const mat_fn mat = pick_fns().mat;
    const size_t tc = lk_oft_ld(p), rows = lk_oft_rows(p), ni = lk_oft_items(p, in);
    oft_tile t = tile_of(p, scr);
    for (size_t it = 0; it < ni; it++) {
        size_t grp, c0, L;
        item_span(p, in, it, &grp, &c0, &L);
        const size_t r0 = grp * rows;
        for (size_t r = 0; r < rows; r++)
            for (size_t j = 0; j < L; j++) t.X[r * tc + j] = (double)w[(r0 + r) * in + c0 + j];
        const double *e = oft_rotate_tile(p, mat, grp, t.X, t.y, t.y2, tc, L, t.sp, t.dp);
        for (size_t r = 0; r < rows; r++) {
            const rowfin f = row_fin(p, r0 + r);
            for (size_t j = 0; j < L; j++)
                delta[(r0 + r) * in + c0 + j] = (float)fin_delta(f, e[r * tc + j], t.X[r * tc + j]);
        }
    }
    fesetenv(&saved);
    lk_free(scr);
    return LK_OK;
}

static void oblock(oworker *wk, size_t it) {
    const ojob *j = wk->job;
    const lk_oft *p = j->p;
    const size_t in = j->in, tc = lk_oft_ld(p), rows = lk_oft_rows(p), esz = lk_dtype_size(j->dt);
    size_t grp, c0, L;
    item_span(p, in, it, &grp, &c0, &L);
    const size_t r0 = grp * rows;
    oft_tile t = tile_of(p, wk->scratch);
    for (size_t r = 0; r < rows; r++) j->load(t.X + r * tc, (const char *)j->w_in + ((r0 + r) * in + c0) * esz, j->dt, L);
    /* OFT: the product and the rounding OFT_CHUNK columns at a time, so E
     * is rounded while in L1 (BOFT's tile is that small already) */
    const size_t ch = p->boft ? L : OFT_CHUNK;
    for (size_t j0 = 0; j0 < L; j0 += ch) {
        const size_t n = L - j0 < ch ? L - j0 : ch;
        const double *e = oft_rotate_tile(p, j->mat, grp, t.X + j0, t.y + j0, t.y2 + j0, tc, n, t.sp, t.dp);
        for (size_t r = 0; r < rows; r++) {
            const size_t off = (r0 + r) * in + c0 + j0;
            const finrow fr = {.x = t.X + r * tc + j0, .e = e + r * tc, .dst = (char *)j->w_out + off * esz,
                               .off = off, .f = row_fin(p, r0 + r)};
            j->fin(wk, j->dt, &fr, n);
        }
    }
}

size_t lk_oft_round_row(lk_dtype dt, const double *x, const double *d, void *dst, size_t n) {
    oworker wk = {.kw = {.bad_at = SIZE_MAX}};
    const finrow fr = {.x = x, .e = d, .dst = dst, .f = {.kind = 0, .a = 1.0, .c = 0.0, .g = 1.0}};
    fenv_t saved;
    fegetenv(&saved);
    fesetenv(FE_DFL_ENV);
    pick_fns().fin(&wk, dt, &fr, n);
    fesetenv(&saved);
    return wk.kw.bad_at;
}

static void *oworker_main(void *arg) {
    oworker *wk = arg;
    fesetenv(FE_DFL_ENV);
    for (;;) {
        size_t it = atomic_fetch_add(&wk->job->next, 1);
        if (it >= wk->job->n_items) break;
#ifdef LK_KERNEL_X86
        if (wk->job->d32) {
            if (wk->job->bf16isa) oblock_narrow_bf16(wk, it);
            else oblock_narrow(wk, it);
            continue;
        }
#endif
        oblock(wk, it);
    }
    return NULL;
}

static lk_status peft_fuse(const lk_oft *p, void *w_out, const void *w_in, lk_dtype dtype, size_t in,
                           const lk_fuse_opts *opts, const char *name);

lk_status lk_fuse_tensor_oft(void *w_out, const void *w_in, lk_dtype dtype, int64_t out, int64_t in,
                             const lk_fuse_term *term, const lk_fuse_opts *opts, const char *name) {
    lk_oft *p;
    lk_status s = lk_oft_prepare(term, out, opts ? opts->convention : LK_CONVENTION_LORAKIT, name, &p);
    if (s) return s;
    if (p->peft) {
        s = peft_fuse(p, w_out, w_in, dtype, (size_t)in, opts, name);
        lk_oft_free(p);
        return s;
    }
    const oft_fns fn = pick_fns();
    ojob job = {.p = p, .w_out = w_out, .w_in = w_in, .dt = dtype, .in = (size_t)in, .mat = fn.mat, .fin = fn.fin,
                .load = fn.load};
    job.n_items = lk_oft_items(p, (size_t)in);
    /* BF16 / F16 on the AVX-512 paths: the certified fp32 chain (same bytes) */
    float *narrow = NULL;
#ifdef LK_KERNEL_X86
    if ((dtype == LK_DTYPE_BF16 || dtype == LK_DTYPE_F16) && !p->boft && !strncmp(lk_fuse_kernel_path(), "avx512", 6)) {
        narrow = lk_malloc((p->nb * p->b * p->b + p->out) * sizeof(float));
        if (narrow && oft_narrow_prepare(p, narrow, narrow + p->nb * p->b * p->b, &job.a0))
            job.d32 = narrow, job.k32 = narrow + p->nb * p->b * p->b;
        job.bf16isa = dtype == LK_DTYPE_BF16 && !strcmp(lk_fuse_kernel_path(), "avx512bf16");
    }
#endif
    /* a thread per 2^16 elements at least */
    const int nw = lk_fuse_thread_count(opts, ((size_t)out * (size_t)in) >> 16, job.n_items);
    atomic_init(&job.next, 0);
    const size_t per = lk_oft_scratch(p);
    void *blk;
    unsigned char *buf = NULL;
    if ((s = lk_fuse_workers(nw, sizeof(oworker), per, &blk, &buf, name, "OFT buffers"))) {
        lk_free(narrow);
        lk_oft_free(p);
        return s;
    }
    oworker *wk = blk;
    for (int t = 0; t < nw; t++)
        wk[t] = (oworker){.job = &job, .scratch = buf + (size_t)t * per, .kw = {.bad_at = SIZE_MAX}};
    lk_fuse_run_threads(nw, oworker_main, wk, sizeof *wk);
    s = lk_fuse_workers_verdict(wk, nw, sizeof *wk, offsetof(oworker, kw), (size_t)in, opts, name);
    lk_free(blk);
    lk_free(narrow);
    lk_oft_free(p);
    return s;
}

/* ---- PEFT's OFT and BOFT (peft_type "OFT": <m>.oft_R.weight; "BOFT": <m>.boft_R, <m>.boft_s) ----
 *
 * THE FORMULA (facts read from peft 0.21 tuners/oft/layer.py, OFTRotationModule
 * and Linear / Conv2d merge): oft_R.weight is [n, b (b - 1) / 2], block k's
 * strictly upper triangle in row-major order (triu_indices(b, b, 1)); Q_k =
 * U - U^T. coft: eps' = fl32(fl32(1 / fl32(sqrt(n))) * fl32(eps)) (PEFT
 * computes eps * 1 / sqrt(tensor(n)) in float32), and each block with
 * ||Q_k||_F > eps' becomes eps' (Q_k / ||Q_k||_F). Then R_k:
 *  - use_cayley_neumann (t terms): R = I (t <= 1); t >= 2 adds 2 Q; t >= 3
 *    adds 2 Q^2, then 2 Q^j for j = 3 .. t - 2, then Q^p once with p =
 *    max(3, t - 1) (so t = 3 and t = 4 give I + 2Q + 2Q^2 + Q^3);
 *  - else R = (I - Q)(I + Q)^-1 (torch.linalg.solve(I + Q, I - Q, left=False)).
 * The merge: W' = W BD^T with BD = block_diag(R_0 .. R_{c/b - 1}) over the
  * weight's c = in (x kh x kw: a conv's weight as [out, in kh kw]) columns;
 * block_share: one R for every block. PEFT's BOFT (boft_R [m, n, b, b],
 * boft_s [out, 1] or [1, out]; tuners/boft/layer.py): Q = 0.5 (X - X^T)
 * per full block, always the exact Cayley; m stages (boft_n_butterfly_factor;
 * PEFT runs more than one only with its fbd_cuda extension, which builds the
 * block diagonals) W' = boft_s (.) (W M^T), M = B_{m-1} .. B_0, B_i = P_i BD_i
 * P_i^T with PEFT's butterfly permutations P_i (peft_perms), boft_s per output
 * row; one stage: W' = boft_s (.) (W BD^T). PEFT has no strength for OFT (its
 * set_scale warns and keeps 1). lorakit at strength s, under every
 * convention (they agree on these files): W + s (W' - W); for OFT that is
 * W (I + s (BD - I))^T, the delta d = s W (BD - I)^T, LyCORIS's multiplier
 * rule on the input axis; s = 1 is PEFT's merge.
 * THE ARITHMETIC: Q, the norm (fma chain of squares, sqrt), the scaling,
 * the series (each power an fma chain over the inner index ascending; R +
 * 2 P one rounding each) or the inverse (oft.c's Gauss-Jordan on I + Q)
 * and (I - Q) times it, then D_k = s (R_k - I): all f64. Per row,
 * d[k b + c] = sum_u x[k b + u] D_k[c][u], an fma chain over u ascending
 * from the first product; W + d rounded once as step 3 above. */

/* PEFT's number of blocks from the packed row length: b with b (b - 1) / 2 = ne (0: none). */
static size_t peft_block(int64_t ne) {
    if (ne < 1 || ne > 4096 * 4095 / 2) return 0;
    size_t b = (size_t)((1.0 + sqrt(1.0 + 8.0 * (double)ne)) / 2.0 + 0.5);
    for (size_t c = b > 2 ? b - 1 : 2; c <= b + 1; c++)
        if (c * (c - 1) / 2 == (size_t)ne) return c;
    return 0;
}

/* r = a b (b x b), each element an fma chain over u ascending. */
static void peft_mm(double *r, const double *a, const double *b2, size_t b) {
    for (size_t i = 0; i < b; i++)
        for (size_t j = 0; j < b; j++) {
            double acc = a[i * b] * b2[j];
            for (size_t u = 1; u < b; u++) acc = fma(a[i * b + u], b2[u * b + j], acc);
            r[i * b + j] = acc;
        }
}

/* R of one block from its skew Q (b x b) into r; work 5 b b doubles. 0: I + Q singular. */
static int peft_rotation(double *r, const double *q, size_t b, int terms, double *work) {
    double *p = work, *p2 = work + b * b, *nq = work + 2 * b * b;
    const size_t bb = b * b;
    for (size_t i = 0; i < bb; i++) r[i] = (double)(i % (b + 1) == 0);
    if (!terms) { /* (I - Q)(I + Q)^-1: the inverse of I - (-Q) */
        double *inv = p2;
        for (size_t i = 0; i < bb; i++) nq[i] = -q[i];
        if (!inv_i_minus_q(inv, nq, b, work + 3 * bb)) return 0;
        for (size_t i = 0; i < b; i++)
            for (size_t j = 0; j < b; j++) {
                double acc = ((double)(i == 0) - q[i * b]) * inv[j];
                for (size_t u = 1; u < b; u++) acc = fma((double)(i == u) - q[i * b + u], inv[u * b + j], acc);
                r[i * b + j] = acc;
            }
        return 1;
    }
    if (terms <= 1) return 1;
    for (size_t i = 0; i < bb; i++) r[i] += 2.0 * q[i];
    if (terms <= 2) return 1;
    peft_mm(p, q, q, b);
    for (size_t i = 0; i < bb; i++) r[i] += 2.0 * p[i];
    for (int j = 3; j < terms - 1; j++) {
        peft_mm(p2, p, q, b);
        memcpy(p, p2, bb * sizeof *p);
        for (size_t i = 0; i < bb; i++) r[i] += 2.0 * p[i];
    }
    peft_mm(p2, p, q, b);
    for (size_t i = 0; i < bb; i++) r[i] += p2[i];
    return 1;
}

/* Q of block k from its packed values v (b (b - 1) / 2 of them) into q. */
static void peft_skew(double *q, const double *v, size_t b) {
    memset(q, 0, b * b * sizeof *q);
    size_t t = 0;
    for (size_t i = 0; i < b; i++)
        for (size_t j = i + 1; j < b; j++, t++) {
            q[i * b + j] = v[t] - 0.0;
            q[j * b + i] = 0.0 - v[t];
        }
}

/* coft's projection of every block (PEFT's _project_batch). */
static void peft_project(double *q, size_t nb, size_t b, double eps) {
    const float rs = 1.0f / sqrtf((float)nb);
    const double e = (double)(rs * (float)eps);
    for (size_t k = 0; k < nb; k++) {
        double *qk = q + k * b * b, ss = 0.0;
        for (size_t i = 0; i < b * b; i++) ss = fma(qk[i], qk[i], ss);
        const double n = sqrt(ss);
        if (n <= e) continue;
        for (size_t i = 0; i < b * b; i++) qk[i] = e * (qk[i] / n);
    }
}

static void (*peft_row_pick(void))(const lk_oft *, const double *, double *, size_t);

/* Q of every block into q from the file's values v: OFT's packed upper
 * triangles (ne values a block), BOFT's 0.5 (X - X^T) of full b x b blocks
 * (PEFT's cayley_batch), then coft's projection. */
static void peft_q(double *q, const double *v, const lk_fuse_term *t, size_t nb, size_t b, size_t ne) {
    const size_t bb = b * b;
    for (size_t k = 0; k < nb; k++) {
        if (!t->peft->boft) {
            peft_skew(q + k * bb, v + k * ne, b);
            continue;
        }
        const double *x = v + k * bb;
        for (size_t i = 0; i < b; i++)
            for (size_t j = 0; j < b; j++) q[k * bb + i * b + j] = 0.5 * (x[i * b + j] - x[j * b + i]);
    }
    if (t->peft->coft) peft_project(q, nb, b, t->peft->eps);
}

/* PEFT's butterfly permutations (boft_P; block_butterfly_perm in
 * tuners/boft/layer.py), m x in with in = nb b: stage i cuts the columns
 * into nb / 2^i groups of b 2^i and reorders each group's 2^(i+1) runs of
 * b / 2 columns even runs first, then odd ones: perm[g + q r + t] =
 * g + seq(q) r + t, r = b / 2, seq(q) = 2q for q < 2^i, else 2 (q - 2^i) + 1
 * (stage 0: the identity). P_i[p][perm[p]] = 1. */
static void peft_perms(uint32_t *perm, size_t m, size_t nb, size_t b) {
    const size_t in = nb * b, r = b / 2;
    for (size_t i = 0; i < m; i++) {
        uint32_t *pm = perm + i * in;
        const size_t gs = b << i, half = (size_t)1 << i;
        for (size_t g = 0; g < in; g += gs)
            for (size_t q = 0; q < 2 * half; q++) {
                const size_t src = q < half ? 2 * q : 2 * (q - half) + 1;
                for (size_t u = 0; u < r; u++) pm[g + q * r + u] = (uint32_t)(g + src * r + u);
            }
    }
}

/* OFT: D = s (R - I) per block, stored transposed; BOFT: D = R - I, the
 * rows' boft_s in rho and the strength in g (d = s (rho (W + W D^T) - W)). */
static lk_status peft_prepare(const lk_fuse_term *t, int64_t out, lk_convention conv, const char *name, lk_oft **pp) {
    const lk_tensor *X = t->B;
    const int boft = t->peft->boft;
    const char *xn = X && X->name ? X->name : boft ? "boft_R" : "oft_R.weight";
    char xs[96];
    if (!X || !X->data) return lk_error(LK_ERR_ARG, "%s: a PEFT OFT term without %s", name, xn);
    lk_shape_str(X, xs, sizeof xs);
    const size_t b = boft ? (X->ndim == 4 && X->shape[0] >= 1 && X->shape[0] <= 16 && X->shape[2] == X->shape[3] &&
                             X->shape[2] >= 1 && X->shape[2] <= 4096 ? (size_t)X->shape[2] : 0)
                          : X->ndim == 2 ? peft_block(X->shape[1]) : 0;
    const int64_t nbl = boft ? (X->ndim == 4 ? X->shape[1] : 0) : X->shape[0];
    if (!b || nbl < 1 || nbl > out * 4096 || !lk_dtype_is_fusable(X->dtype))
        return lk_error(LK_ERR_SHAPE, "%s: '%s' is %s %s; PEFT's %s (F32, F16 or BF16)", name, xn, xs,
                        lk_dtype_name(X->dtype),
                        boft ? "BOFT needs [m, n, b, b], 1 <= m <= 16" : "OFT needs [n, b (b - 1) / 2], b >= 2");
    const size_t m = boft ? (size_t)X->shape[0] : 1;
    if (m > 1 && (b % 2 || nbl % ((int64_t)1 << (m - 1)) || nbl < 2))
        return lk_error(LK_ERR_SHAPE, "%s: '%s' is %s: PEFT's butterfly of %zu stages needs an even block size and a "
                        "block count that is a multiple of 2^%zu (boft_n_butterfly_factor %zu)", name, xn, xs, m, m - 1,
                        m);
    if (boft && (!t->A2 || !t->A2->data || lk_tensor_numel(t->A2) != (size_t)out || !lk_dtype_is_fusable(t->A2->dtype)))
        return lk_error(LK_ERR_SHAPE, "%s: PEFT's BOFT needs boft_s with one value per row (%lld rows)", name,
                        (long long)out);
    (void)conv; /* the four conventions agree: PEFT's merge at s = 1, W + s (W' - W) at any s */
    if (!isfinite(t->scale) || !isfinite(t->peft->eps))
        return lk_error(LK_ERR_NONFINITE, "%s: strength %g, eps %g", name, t->scale, t->peft->eps);
    lk_oft *p = lk_calloc(1, sizeof *p);
    if (!p) return lk_error(LK_ERR_NOMEM, "%s: out of memory", name);
    const size_t nb = (size_t)nbl, bb = b * b, ne = boft ? bb : (size_t)X->shape[1], in = nb * b;
    p->peft = 1, p->b = b, p->nb = nb, p->m = m, p->out = (size_t)out, p->g = boft ? t->scale : 1.0;
    p->prow = peft_row_pick();
    lk_carve cv = {0};
    const size_t o_t = LK_CARVE(&cv, m * nb * bb, double), o_q = LK_CARVE(&cv, m * nb * bb, double),
                 o_v = LK_CARVE(&cv, m * nb * ne, double), o_w = LK_CARVE(&cv, 5 * bb, double),
                 o_r = LK_CARVE(&cv, boft ? (size_t)out : 0, double), o_p = LK_CARVE(&cv, m > 1 ? m * in : 0, uint32_t);
    p->mem = cv.overflow ? NULL : lk_carve_alloc(&cv);
    if (!p->mem) {
        lk_free(p);
        return lk_error(LK_ERR_NOMEM, "%s: out of memory for the OFT blocks", name);
    }
    p->T = (double *)(void *)(p->mem + o_t);
    double *q = (double *)(void *)(p->mem + o_q), *v = (double *)(void *)(p->mem + o_v),
           *work = (double *)(void *)(p->mem + o_w);
    if (boft) {
        p->rho = (double *)(void *)(p->mem + o_r);
        for (size_t i = 0; i < (size_t)out; i++) p->rho[i] = elem64(t->A2, i);
    }
    values64(v, X, m * nb * ne);
    peft_q(q, v, t, m * nb, b, ne);
    if (m > 1) peft_perms(p->perm = (uint32_t *)(void *)(p->mem + o_p), m, nb, b);
    const double s = boft ? 1.0 : t->scale;
    for (size_t k = 0; k < m * nb; k++) {
        double *d = p->T + k * bb;
        if (!peft_rotation(d, q + k * bb, b, t->peft->neumann_terms, work)) {
            lk_oft_free(p);
            return lk_error(LK_ERR_NONFINITE, "%s: '%s': I + Q of block %zu is singular (non-finite values)", name, xn,
                            k);
        }
        for (size_t i = 0; i < bb; i++) d[i] = s * (d[i] - (double)(i % (b + 1) == 0));
        for (size_t i = 0; i < b; i++) /* stored as D^T (peft_row) */
            for (size_t j = i + 1; j < b; j++) {
                const double y = d[i * b + j];
                d[i * b + j] = d[j * b + i], d[j * b + i] = y;
            }
        for (size_t i = 0; i < bb; i++)
            if (!isfinite(d[i])) {
                lk_oft_free(p);
                return lk_error(LK_ERR_NONFINITE, "%s: '%s': the rotation of block %zu is not finite", name, xn, k);
            }
    }
    *pp = p;
    return LK_OK;
}

/* The columns of an out x in weight against the blocks: n b = in, or one shared block with in a multiple of b. */
static lk_status peft_cols(const lk_oft *p, size_t in, const char *name) {
    if (p->nb * p->b == in || (!p->rho && p->nb == 1 && in % p->b == 0)) return LK_OK;
    if (p->rho)
        return lk_error(LK_ERR_SHAPE, "%s: PEFT's BOFT has %zu blocks of %zu columns (boft_R [1, %zu, %zu, %zu]) but the "
                        "weight has %zu columns (elements per output row)", name, p->nb, p->b, p->nb, p->b, p->b, in);
    return lk_error(LK_ERR_SHAPE, "%s: PEFT's OFT has %zu blocks of %zu columns (oft_R.weight [%zu, %zu]) but the weight "
                    "has %zu columns (elements per output row)", name, p->nb, p->b, p->nb, p->b * (p->b - 1) / 2, in);
}

/* d = x D^T per block for one row of in values (both f64): d[k b + c] an
 * fma chain over u ascending from the first product, the chains of a
 * block's c side by side (Dt = D^T, so c is contiguous: the compiler may
 * run them in vector lanes; each element's chain is the same). Compiled
 * with the FMA instructions where the CPU has them and without (libm's
 * fma, one correctly rounded operation either way: the same bits). */
LK_AI void peft_row_body(const lk_oft *p, const double *x, double *d, size_t in) {
    const size_t b = p->b, bb = b * b;
    for (size_t k = 0; k * b < in; k++) {
        const double *Dt = p->T + (p->nb == 1 ? 0 : k) * bb, *xk = x + k * b;
        double *dk = d + k * b;
        for (size_t c = 0; c < b; c++) dk[c] = xk[0] * Dt[c];
        for (size_t u = 1; u < b; u++) {
            const double xu = xk[u], *row = Dt + u * b;
            for (size_t c = 0; c < b; c++) dk[c] = fma(xu, row[c], dk[c]);
        }
    }
}
static void peft_row_base(const lk_oft *p, const double *x, double *d, size_t in) { peft_row_body(p, x, d, in); }
#ifdef LK_KERNEL_X86
__attribute__((target("avx2,fma"))) static void peft_row_fma(const lk_oft *p, const double *x, double *d, size_t in) {
    peft_row_body(p, x, d, in);
}
#endif
/* The row function of the kernel path (lk_fuse_kernel_path). */
static void (*peft_row_pick(void))(const lk_oft *, const double *, double *, size_t) {
#ifdef LK_KERNEL_X86
    if (!strncmp(lk_fuse_kernel_path(), "avx", 3) && __builtin_cpu_supports("fma")) return peft_row_fma;
#endif
    return peft_row_base;
}
#define peft_row(p, x, d, in) ((p)->prow((p), (x), (d), (in)))

/* Doubles of scratch one row needs beyond x and its delta: 2 in with stages. */
static size_t peft_work(const lk_oft *p, size_t in) { return p->m > 1 ? 2 * in : 0; }

/* One row's delta e = x M^T - x with PEFT's butterfly M = B_{m-1} .. B_0,
 * B_i = P_i BD_i P_i^T (merge: W' = boft_s (.) (W M^T)). Stage 0's P is the
 * identity: e = x D_0^T, the one-stage rule itself; then per stage i >= 1,
 * with v = x + e (the row so far), u = P_i^T v (u[perm[p]] = v[p]), z = u D_i^T
 * per block (peft_row's chains on stage i's blocks), e[p] += z[perm[p]]:
 * all f64, in this order. */
static void peft_rows(const lk_oft *p, const double *x, double *e, size_t in, double *work) {
    peft_row(p, x, e, in);
    if (p->m < 2) return;
    double *u = work, *z = work + in;
    lk_oft st = *p;
    for (size_t i = 1; i < p->m; i++) {
        const uint32_t *pm = p->perm + i * in;
        for (size_t q = 0; q < in; q++) u[pm[q]] = x[q] + e[q];
        st.T = p->T + i * p->nb * p->b * p->b;
        peft_row(&st, u, z, in);
        for (size_t q = 0; q < in; q++) e[q] += z[pm[q]];
    }
}

/* Row o's last step: OFT d = e; BOFT d = g (rho e + (rho - 1) x), i.e.
 * s (rho (x + e) - x) with e = x D^T (row_fin's kind 1). */
static rowfin peft_fin(const lk_oft *p, size_t o) {
    if (!p->rho) return (rowfin){.kind = 0, .a = 1.0, .c = 0.0, .g = 1.0};
    return (rowfin){.kind = 1, .a = p->rho[o], .c = p->rho[o] - 1.0, .g = p->g};
}

static lk_status peft_delta_f32(const lk_oft *p, const float *w, float *delta, size_t in, const char *name) {
    lk_status s = peft_cols(p, in, name);
    if (s) return s;
    double *x = lk_malloc((2 * in + peft_work(p, in)) * sizeof *x);
    if (!x) return lk_error(LK_ERR_NOMEM, "%s: out of memory for the OFT rows", name);
    for (size_t o = 0; o < p->out; o++) {
        for (size_t j = 0; j < in; j++) x[j] = (double)w[o * in + j];
        peft_rows(p, x, x + in, in, x + 2 * in);
        const rowfin f = peft_fin(p, o);
        for (size_t j = 0; j < in; j++) delta[o * in + j] = (float)fin_delta(f, x[in + j], x[j]);
    }
    lk_free(x);
    return LK_OK;
}

/* Rows per work item of the PEFT path; a worker's scratch: the row's f64
 * values and its delta. */
#define PEFT_ROWS 16

static void *peft_worker(void *arg) {
    oworker *wk = arg;
    const ojob *j = wk->job;
    const lk_oft *p = j->p;
    const size_t in = j->in, esz = lk_dtype_size(j->dt);
    double *x = wk->scratch, *d = x + in + 8, *work = d + in + 8;
    fesetenv(FE_DFL_ENV);
    for (;;) {
        const size_t it = atomic_fetch_add(&wk->job->next, 1);
        if (it >= j->n_items) break;
        for (size_t o = it * PEFT_ROWS; o < p->out && o < (it + 1) * PEFT_ROWS; o++) {
            j->load(x, (const char *)j->w_in + o * in * esz, j->dt, in);
            peft_rows(p, x, d, in, work);
            const finrow fr = {.x = x, .e = d, .dst = (char *)j->w_out + o * in * esz, .off = o * in,
                               .f = peft_fin(p, o)};
            j->fin(wk, j->dt, &fr, in);
        }
    }
    return NULL;
}

/* The rows on the workers (items of PEFT_ROWS rows from an atomic counter),
 * each loaded, rotated and rounded by the kernel path's load and fin (the
 * bits do not depend on the path or the thread count). */
static lk_status peft_fuse(const lk_oft *p, void *w_out, const void *w_in, lk_dtype dtype, size_t in,
                           const lk_fuse_opts *opts, const char *name) {
    lk_status s = peft_cols(p, in, name);
    if (s) return s;
    const oft_fns fn = pick_fns();
    ojob job = {.p = p, .w_out = w_out, .w_in = w_in, .dt = dtype, .in = in, .fin = fn.fin, .load = fn.load,
                .n_items = (p->out + PEFT_ROWS - 1) / PEFT_ROWS};
    const int nw = lk_fuse_thread_count(opts, (p->out * in * p->b) >> 18, job.n_items);
    atomic_init(&job.next, 0);
    const size_t per = (2 * in + 16 + peft_work(p, in)) * sizeof(double) + 64;
    void *blk;
    unsigned char *buf = NULL;
    if ((s = lk_fuse_workers(nw, sizeof(oworker), per, &blk, &buf, name, "OFT rows"))) return s;
    oworker *wk = blk;
    for (int t = 0; t < nw; t++)
        wk[t] = (oworker){.job = &job, .scratch = buf + (size_t)t * per, .kw = {.bad_at = SIZE_MAX}};
    lk_fuse_run_threads(nw, peft_worker, wk, sizeof *wk);
    s = lk_fuse_workers_verdict(wk, nw, sizeof *wk, offsetof(oworker, kw), in, opts, name);
    lk_free(blk);
    return s;
}
