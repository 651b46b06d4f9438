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
 * LyCORIS's; PEFT writes its own OFT format, which lorakit refuses).
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
 *  then the LoRA term {A = a2, B = WB (F64)} through the kernel's chain. */
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
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define OFT_COLS 512  /* OFT: columns of a block converted to f64 at a time */
#define BOFT_COLS 32  /* BOFT: columns of the whole height per work item */
#define OFT_RB 4      /* rows per register block */
#define OFT_CB 16     /* columns per register block */

struct lk_oft {
    int boft;         /* 1: BOFT stages, 0: OFT's delta form */
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
 * partial pivoting (the first largest |pivot|). work: 2 b b doubles. 0 if
 * singular (I - Q with Q skew never is; guards a hostile NaN). */
static int inv_i_minus_q(double *inv, const double *q, size_t b, double *work) {
    double *a = work;
    for (size_t i = 0; i < b; i++)
        for (size_t j = 0; j < b; j++) {
            a[i * b + j] = (i == j) - q[i * b + j];
            inv[i * b + j] = i == j;
        }
    for (size_t c = 0; c < b; c++) {
        size_t p = c;
        for (size_t r = c + 1; r < b; r++)
            if (fabs(a[r * b + c]) > fabs(a[p * b + c])) p = r;
        if (!(fabs(a[p * b + c]) > 0)) return 0;
        if (p != c)
            for (size_t j = 0; j < b; j++) {
                double x = a[c * b + j], y = inv[c * b + j];
                a[c * b + j] = a[p * b + j], inv[c * b + j] = inv[p * b + j];
                a[p * b + j] = x, inv[p * b + j] = y;
            }
        const double piv = a[c * b + c];
        for (size_t j = 0; j < b; j++) a[c * b + j] /= piv, inv[c * b + j] /= piv;
        for (size_t r = 0; r < b; r++) {
            if (r == c) continue;
            const double f = a[r * b + c];
            if (f == 0.0) continue;
            for (size_t j = 0; j < b; j++) {
                a[r * b + j] = fma(-f, a[c * b + j], a[r * b + j]);
                inv[r * b + j] = fma(-f, inv[c * b + j], inv[r * b + j]);
            }
        }
    }
    return 1;
}

/* Q of every block (skew part, scaled by the constraint c when c > 0). */
static void skew_blocks(double *q, const lk_tensor *X, size_t nblk, size_t b, double c) {
    double ss = 0.0;
    for (size_t k = 0; k < nblk; k++)
        for (size_t i = 0; i < b; i++)
            for (size_t j = 0; j < b; j++) {
                const double v = elem64(X, (k * b + i) * b + j) - elem64(X, (k * b + j) * b + i);
                q[(k * b + i) * b + j] = v;
                ss = fma(v, v, ss);
            }
    const double qn = sqrt(ss) + 1e-8;
    if (c > 0 && qn > c) {
        const double f = c / qn;
        for (size_t i = 0; i < nblk * b * b; i++) q[i] *= f;
    }
}

/* R = (I + Q) inv for every block into r; 0 if a block is singular. */
static int cayley_blocks(double *r, const double *q, size_t nblk, size_t b, double *work) {
    double *inv = work, *w2 = work + b * b;
    for (size_t k = 0; k < nblk; k++) {
        const double *qk = q + k * b * b;
        if (!inv_i_minus_q(inv, qk, b, w2)) return 0;
        for (size_t i = 0; i < b; i++)
            for (size_t j = 0; j < b; j++) { /* (I + Q) inv, an fma chain over u ascending */
                double acc = ((double)(i == 0) + qk[i * b + 0]) * inv[0 * b + j];
                for (size_t u = 1; u < b; u++) acc = fma((double)(i == u) + qk[i * b + u], inv[u * b + j], acc);
                r[(k * b + i) * b + j] = acc;
            }
    }
    return 1;
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

lk_status lk_oft_prepare(const lk_fuse_term *t, int64_t out, lk_convention conv, const char *name, lk_oft **pp) {
    *pp = NULL;
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
    skew_blocks(q, X, nblk, p->b, comfy ? t->alpha : t->alpha * (double)out);
    if (!cayley_blocks(p->T, q, nblk, p->b, work)) {
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
#define LK_AI static inline __attribute__((always_inline))
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
__attribute__((target("avx512f,fma"))) static void mat_rows_avx512(double *const *dst, const double *const *src,
                                                                  const double *M, size_t b, size_t L) {
    MAT_VEC(__m512d, 8, _mm512_loadu_pd, _mm512_storeu_pd, _mm512_set1_pd, _mm512_mul_pd, _mm512_fmadd_pd);
}
#undef MAT_VEC
#endif

typedef void (*mat_fn)(double *const *, const double *const *, const double *, size_t, size_t);

static mat_fn pick_mat(void) {
#ifdef LK_KERNEL_X86
    const char *path = lk_fuse_kernel_path();
    if (!strncmp(path, "avx512", 6)) return mat_rows_avx512;
    if (!strcmp(path, "avx2")) return mat_rows_avx2;
#endif
    return mat_rows_base;
}

/* The delta d (f64, rows x L, row stride ld) of the columns whose f64
 * values X holds (every row of the weight, row stride ld) — BOFT; or of one
 * OFT block (rows b, X its rows). y, y2: scratch of the same size. */
static void oft_delta_tile(const lk_oft *p, mat_fn mat, size_t blk, const double *X, double *d, double *y, double *y2,
                           size_t ld, size_t L, const double **sp, double **dp) {
    const size_t b = p->b;
    if (!p->boft) {
        for (size_t u = 0; u < b; u++) sp[u] = X + u * ld, dp[u] = d + u * ld;
        mat(dp, sp, p->T + blk * b * b, b, L);
        for (size_t t = 0; t < b; t++) {
            double *dr = d + t * ld;
            const double *xr = X + t * ld;
            if (p->rho) {
                const double rho = p->rho[blk * b + t], rm1 = rho - 1.0;
                for (size_t j = 0; j < L; j++) dr[j] = rho * dr[j] + rm1 * xr[j];
            }
            if (p->g != 1.0)
                for (size_t j = 0; j < L; j++) dr[j] = p->g * dr[j];
        }
        return;
    }
    const double *cur = X;
    for (size_t i = 0; i < p->m; i++) {
        double *nxt = cur == y ? y2 : y;
        const uint32_t *pm = p->perm + i * p->out;
        for (size_t k = 0; k < p->nb; k++) {
            for (size_t u = 0; u < b; u++) sp[u] = cur + (size_t)pm[k * b + u] * ld, dp[u] = nxt + (size_t)pm[k * b + u] * ld;
            mat(dp, sp, p->T + (i * p->nb + k) * b * b, b, L);
        }
        cur = nxt;
    }
    for (size_t o = 0; o < p->out; o++) {
        const double *yr = cur + o * ld, *xr = X + o * ld;
        double *dr = d + o * ld;
        const double rho = p->rho ? p->rho[o] : 1.0;
        for (size_t j = 0; j < L; j++) {
            double v = p->rho ? rho * yr[j] - xr[j] : yr[j] - xr[j];
            dr[j] = p->g != 1.0 ? p->g * v : v;
        }
    }
}

static size_t lk_oft_rows(const lk_oft *p) { return p->boft ? p->out : p->b; }
static size_t lk_oft_items(const lk_oft *p, size_t in) {
    return p->boft ? (in + BOFT_COLS - 1) / BOFT_COLS : p->nb * ((in + OFT_COLS - 1) / OFT_COLS);
}
static size_t lk_oft_tile_cols(const lk_oft *p) { return p->boft ? BOFT_COLS : OFT_COLS; }

/* Work item `it` of an out x in weight: its rows [*r0, *r0 + rows), columns
 * [*c0, *c0 + *L) and OFT block. */
static void item_span(const lk_oft *p, size_t in, size_t it, size_t *blk, size_t *r0, size_t *c0, size_t *L) {
    const size_t tc = lk_oft_tile_cols(p), nct = (in + tc - 1) / tc;
    *blk = p->boft ? 0 : it / nct;
    *r0 = *blk * p->b;
    *c0 = (it % nct) * tc;
    *L = in - *c0 < tc ? in - *c0 : tc;
}

/* Scratch doubles per worker: X, d, y, y2 tiles and the row pointers. */
static size_t lk_oft_scratch(const lk_oft *p) {
    return 4 * lk_oft_rows(p) * lk_oft_tile_cols(p) * sizeof(double) + 2 * p->b * sizeof(void *) + 64;
}

/* The delta of item `it` from weight values read by load (f64 X); d gets
 * rows x L at stride tc. */
typedef struct oft_tile {
    double *X, *d, *y, *y2;
    const double **sp;
    double **dp;
} oft_tile;

static oft_tile tile_of(const lk_oft *p, void *scratch) {
    unsigned char *al = (unsigned char *)scratch + ((64u - ((uintptr_t)scratch & 63u)) & 63u);
    const size_t n = lk_oft_rows(p) * lk_oft_tile_cols(p);
    oft_tile t;
    t.X = (double *)(void *)al;
    t.d = t.X + n;
    t.y = t.d + n;
    t.y2 = t.y + n;
    t.sp = (const double **)(void *)(t.y2 + n);
    t.dp = (double **)(t.sp + p->b);
    return t;
}

/* ---- the FP8 and GLoRA helpers (fp8.c, tensor.c) ---- */

lk_status lk_oft_delta_f32(const lk_oft *p, const float *w, float *delta, size_t in, const char *name) {
    void *scr = lk_malloc(lk_oft_scratch(p));
    if (!scr) return lk_error(LK_ERR_NOMEM, "%s: out of memory for the OFT scratch", name);
    fenv_t saved;
    fegetenv(&saved);
    fesetenv(FE_DFL_ENV);
    const mat_fn mat = pick_mat();
    const size_t tc = lk_oft_tile_cols(p), rows = lk_oft_rows(p), ni = lk_oft_items(p, in);
    oft_tile t = tile_of(p, scr);
    for (size_t it = 0; it < ni; it++) {
        size_t blk, r0, c0, L;
        item_span(p, in, it, &blk, &r0, &c0, &L);
        for (size_t r = 0; r < rows; r++)
            for (size_t j = 0; j < L; j++) t.X[r * tc + j] = (double)w[(r0 + r) * in + c0 + j];
        oft_delta_tile(p, mat, blk, t.X, t.d, t.y, t.y2, tc, L, t.sp, t.dp);
        for (size_t r = 0; r < rows; r++)
            for (size_t j = 0; j < L; j++) delta[(r0 + r) * in + c0 + j] = (float)t.d[r * tc + j];
    }
    fesetenv(&saved);
    lk_free(scr);
    return LK_OK;
}

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

typedef struct ojob {
    const lk_oft *p;
    void *w_out;
    const void *w_in;
    lk_dtype dt;
    size_t in, n_items;
    mat_fn mat;
    atomic_size_t next;
} ojob;

typedef struct oworker {
    ojob *job;
    void *scratch;
    size_t bad_at;
    double bad_w, bad_r;
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

static void oblock(oworker *wk, size_t it) {
    const ojob *j = wk->job;
    const lk_oft *p = j->p;
    const size_t in = j->in, tc = lk_oft_tile_cols(p), rows = lk_oft_rows(p), esz = lk_dtype_size(j->dt);
    size_t blk, r0, c0, L;
    item_span(p, in, it, &blk, &r0, &c0, &L);
    oft_tile t = tile_of(p, wk->scratch);
    float tmp[OFT_COLS];
    for (size_t r = 0; r < rows; r++) {
        lk_to_f32(tmp, (const char *)j->w_in + ((r0 + r) * in + c0) * esz, j->dt, L);
        for (size_t c = 0; c < L; c++) t.X[r * tc + c] = (double)tmp[c];
    }
    oft_delta_tile(p, j->mat, blk, t.X, t.d, t.y, t.y2, tc, L, t.sp, t.dp);
    for (size_t r = 0; r < rows; r++) {
        const size_t off = (r0 + r) * in + c0;
        char *dst = (char *)j->w_out + off * esz;
        const double *xr = t.X + r * tc, *dr = t.d + r * tc;
        if (j->dt == LK_DTYPE_F32) {
            for (size_t c = 0; c < L; c++) {
                const uint32_t rb = scalar_round_f64_to_f32(lk_f2u((float)xr[c]), dr[c]);
                memcpy(dst + c * 4, &rb, 4);
                tmp[c] = lk_u2f(rb);
            }
        } else { /* the odd f32 values, then one RNE conversion of the row */
            for (size_t c = 0; c < L; c++) {
                const float w = (float)xr[c];
                const uint32_t uw = lk_f2u(w);
                float o = (uw & 0x7fffffffu) > 0x7f800000u ? lk_u2f(uw | 0x00400000u)
                                                           : odd_f32(scalar_add_odd_f64((double)w, dr[c]));
                if (isnan(o) && !isnan(w)) o = lk_u2f(0x7fc00000u);
                tmp[c] = o;
            }
            lk_from_f32(dst, tmp, j->dt, L);
            lk_to_f32(tmp, dst, j->dt, L); /* what was stored, for the non-finite check */
        }
        for (size_t c = 0; c < L; c++)
            if (isfinite(xr[c]) && !isfinite(tmp[c]) && off + c < wk->bad_at) {
                wk->bad_at = off + c;
                wk->bad_w = xr[c];
                wk->bad_r = tmp[c];
            }
    }
}

static void *oworker_main(void *arg) {
    oworker *wk = arg;
    fesetenv(FE_DFL_ENV);
    for (;;) {
        size_t it = atomic_fetch_add(&wk->job->next, 1);
        if (it >= wk->job->n_items) break;
        oblock(wk, it);
    }
    return NULL;
}

lk_status lk_fuse_tensor_oft(void *w_out, const void *w_in, lk_dtype dtype, int64_t out, int64_t in,
                             const lk_fuse_term *term, const lk_fuse_opts *opts, const char *name) {
    lk_oft *p;
    lk_status s = lk_oft_prepare(term, out, opts ? opts->convention : LK_CONVENTION_LORAKIT, name, &p);
    if (s) return s;
    ojob job = {.p = p, .w_out = w_out, .w_in = w_in, .dt = dtype, .in = (size_t)in, .mat = pick_mat()};
    job.n_items = lk_oft_items(p, (size_t)in);
    int nw = opts && opts->threads > 0 ? opts->threads : lk_fuse_default_threads();
    if (nw > LK_FUSE_MAX_THREADS) nw = LK_FUSE_MAX_THREADS;
    size_t cap = ((size_t)out * (size_t)in) >> 16; /* a thread per 2^16 elements at least */
    if (cap < 1) cap = 1;
    if ((size_t)nw > cap) nw = (int)cap;
    if ((size_t)nw > job.n_items) nw = (int)job.n_items;
    atomic_init(&job.next, 0);
    const size_t per = lk_oft_scratch(p);
    lk_carve cv = {0};
    const size_t o_wk = LK_CARVE(&cv, (size_t)nw, oworker), o_buf = lk_carve_part(&cv, (size_t)nw, per, 64);
    unsigned char *block = cv.overflow ? NULL : lk_malloc(cv.bytes);
    if (!block) {
        lk_oft_free(p);
        return lk_error(LK_ERR_NOMEM, "%s: out of memory for %d OFT buffers of %zu bytes", name, nw, per);
    }
    oworker *wk = (oworker *)(void *)(block + o_wk);
    for (int t = 0; t < nw; t++)
        wk[t] = (oworker){.job = &job, .scratch = block + o_buf + (size_t)t * per, .bad_at = SIZE_MAX};
    lk_fuse_run_threads(nw, oworker_main, wk, sizeof *wk);
    size_t bad_at = SIZE_MAX;
    double bw = 0, br = 0;
    for (int t = 0; t < nw; t++)
        if (wk[t].bad_at < bad_at) bad_at = wk[t].bad_at, bw = wk[t].bad_w, br = wk[t].bad_r;
    lk_free(block);
    lk_oft_free(p);
    return lk_fuse_nonfinite(name, bad_at, (size_t)in, bw, br, opts);
}
