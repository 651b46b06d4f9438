/* extract_weight.c — one weight of lk_extract: a sketch of D = TUNED - BASE,
 * the exact SVD of the small projected matrix, the factors as written and
 * the exact error of what was written.
 *
 *   rank K:  Omega (n x L, L = K + P) uniform in [-1, 1) from the stream
 *            (seed, weight name), column j at stream index j n;
 *            Y = D Omega, Q = qr(Y); T times: Z = qr(D^T Q), Q = qr(D Z)
 *   --err E: blocks of P columns (Omega's next columns): Y = D Omega_b made
 *            orthogonal to Q (Gram-Schmidt twice), qr, the same power steps,
 *            appended; stop when the residual ||D||^2 - ||Q^T D||_F^2 (exact:
 *            Q is orthonormal to f64 precision) is <= E^2 ||D||^2
 *   exact:   Q = I (m <= n) or Q = qr(D) (m > n): Q^T D is D in Q's basis
 *   then     P = D^T Q (n x L, f64), P = Qp Rp, Rp^T = X diag(s) W^T (Jacobi):
 *            Q^T D = X diag(s) (Qp W)^T, so D ~ (Q X_K) diag(s_K) (Qp W_K)^T
 *   written: Bw = round(Be / c), Aw = round(Ae), c = alpha / K, Be = Q X_K
 *            diag(sqrt s_K), Ae = diag(sqrt s_K) (Qp W_K)^T; Y = c Bw Aw
 *   error:   ||D - Y||^2 = ||D||^2 - 2 <D^T... via D Aw^T (one pass), Bw>
 *            + trace((Bw^T Bw)(Aw Aw^T)), all f64: no dense matrix but the
 *            rows of D streamed.
 * The optimum at rank K is bounded on both sides: Cauchy interlacing gives
 * s_j(Q^T D) <= s_j(D), so the optimum's squared error sum_{j>K} s_j(D)^2 >=
 * sum_{K<j<=L} s_j^2 (the lower bound reported as rel_fro_opt), and the
 * sketch's own truncation is one rank-K matrix, so it is <= that + the
 * residual (rel_fro_opt_upper). Exact mode: both are the optimum.
 * Precision: the sketch's products but the last one into the range (Y =
 * D Omega when T > 0, the D^T Q of every power step, D Z of every step but
 * the last) run in f32 on D's f32 difference (f32 products and sums): they
 * only steer the subspace, re-orthonormalised in f64 after each. The last
 * range product (so Q spans D's column space to f64 precision when D's rank
 * is <= L), P = D^T Q, ||D||^2, the small SVD and the error pass are f64 on
 * D in f64, so rel_fro and both bounds (Q orthonormal to f64 precision) are
 * exact whatever the f32 steps did. Every product is a fixed-order sum
 * (linalg.h: one accumulator per output element, in index order, no FMA),
 * the weight is done by one thread: the bytes depend on neither the thread
 * count nor the CPU path. */
#include <math.h>
#include <string.h>

#include "algebra/extract_int.h"
#include "algebra/linalg.h"
#include "core/alloc.h"
#include "core/rand.h"
#include "lorakit/alloc.h"

#define CHUNK_ELEMS ((size_t)1 << 18) /* elements of D read per chunk */

/* Columns c padded for the kernels (linalg.h): 8 in f64, 16 in f32. */
#define PAD8(c) (((c) + 7) & ~(size_t)7)
#define PAD16(c) (((c) + 15) & ~(size_t)15)

/* The row reader: chunks of rows of D in f64 (exact for F16 / BF16 sides;
 * F32: the difference rounded once, to f64) and / or in f32 (the sketch's
 * products: the f32 difference of the two sides, rounded once), rows at a
 * stride of n + 16 (a multiple of 4 KiB would put a chunk's column in one
 * cache set), with the row-major scratch of the two products. */
typedef struct rdr {
    const lk_x_src *s;
    size_t rows, es, ld;
    void *rb, *rt;
    float *fb, *ft, *d32;
    double *d;
    double *big;   /* max(m, n) x cmax: W or P row-major */
    double *small; /* rows x cmax: a chunk's Y or Q row-major */
    float *big32, *small32;
} rdr;

static lk_status rd_open(rdr *r, const lk_x_src *s, size_t cmax) {
    memset(r, 0, sizeof *r);
    r->s = s;
    r->es = lk_dtype_size(s->dtype);
    r->rows = s->n >= CHUNK_ELEMS ? 1 : CHUNK_ELEMS / s->n;
    if (r->rows > 4) r->rows &= ~(size_t)3; /* whole 4-row tiles */
    if (r->rows > s->m) r->rows = s->m;
    r->ld = s->n + 16;
    cmax = PAD16(cmax);
    size_t e = r->rows * s->n, ed = r->rows * r->ld, mx = s->m > s->n ? s->m : s->n;
    r->rb = lk_malloc(e * r->es);
    r->rt = lk_malloc(e * r->es);
    r->fb = lk_malloc(e * sizeof(float));
    r->ft = lk_malloc(e * sizeof(float));
    r->d = lk_malloc(ed * sizeof(double));
    r->d32 = lk_malloc(ed * sizeof(float));
    r->big = lk_malloc(mx * cmax * sizeof(double) + 1);
    r->small = lk_malloc(r->rows * cmax * sizeof(double) + 1);
    r->big32 = lk_malloc(mx * cmax * sizeof(float) + 1);
    r->small32 = lk_malloc(r->rows * cmax * sizeof(float) + 1);
    if (!r->rb || !r->rt || !r->fb || !r->ft || !r->d || !r->d32 || !r->big || !r->small || !r->big32 || !r->small32)
        return lk_error(LK_ERR_NOMEM, "out of memory for a read chunk");
    return LK_OK;
}

static void rd_close(rdr *r) {
    lk_free(r->rb), lk_free(r->rt), lk_free(r->fb), lk_free(r->ft), lk_free(r->d), lk_free(r->d32);
    lk_free(r->big), lk_free(r->small), lk_free(r->big32), lk_free(r->small32);
    memset(r, 0, sizeof *r);
}

/* Rows i0 .. i0 + k of D into r->d (f64) when d64, into r->d32 when d32. */
static lk_status rd_rows(rdr *r, size_t i0, size_t k, int d64, int d32) {
    const lk_x_src *s = r->s;
    const size_t n = s->n, e = k * n, off = i0 * n * r->es;
    lk_status st = lk_ckpt_read(s->base, s->ib, off, r->rb, e * r->es);
    if (!st) st = lk_ckpt_read(s->tuned, s->it, off, r->rt, e * r->es);
    if (st) return st;
    lk_to_f32(r->fb, r->rb, s->dtype, e);
    lk_to_f32(r->ft, r->rt, s->dtype, e);
    for (size_t i = 0; i < k; i++) {
        const float *t = r->ft + i * n, *b = r->fb + i * n;
        if (d64)
            for (size_t j = 0; j < n; j++) r->d[i * r->ld + j] = (double)t[j] - (double)b[j];
        if (d32)
            for (size_t j = 0; j < n; j++) r->d32[i * r->ld + j] = t[j] - b[j];
    }
    return LK_OK;
}

/* Y (m x c panel) = D W (W: n x c panel); *norm2 (if given) = ||D||_F^2
 * (f64). lo: the product in f32 (W rounded to f32, Y's f32 sums widened). */
static lk_status pass_rows(rdr *r, const double *W, size_t c, double *Y, double *norm2, int lo) {
    const size_t m = r->s->m, n = r->s->n, cp = lo ? PAD16(c) : PAD8(c);
    double acc = 0;
    for (size_t i = 0; i < n; i++)
        for (size_t j = 0; j < cp; j++) {
            double v = j < c ? W[j * n + i] : 0.0;
            if (lo) r->big32[i * cp + j] = (float)v;
            else r->big[i * cp + j] = v;
        }
    for (size_t i0 = 0; i0 < m; i0 += r->rows) {
        size_t k = m - i0 < r->rows ? m - i0 : r->rows;
        lk_status s = rd_rows(r, i0, k, !lo || norm2, lo);
        if (s) return s;
        if (norm2)
            for (size_t i = 0; i < k; i++) acc += lk_la_dot(r->d + i * r->ld, r->d + i * r->ld, n);
        if (lo) lk_la_rows_f(r->d32, r->ld, k, n, r->big32, cp, r->small32);
        else lk_la_rows(r->d, r->ld, k, n, r->big, cp, r->small);
        for (size_t i = 0; i < k; i++)
            for (size_t j = 0; j < c; j++)
                Y[j * m + i0 + i] = lo ? (double)r->small32[i * cp + j] : r->small[i * cp + j];
    }
    if (norm2) *norm2 = acc;
    return LK_OK;
}

/* P (n x c panel) = D^T Q (Q: m x c panel), each sum in row order; lo: in
 * f32 (Q rounded to f32, P's f32 sums widened). */
static lk_status pass_trans(rdr *r, const double *Q, size_t c, double *P, int lo) {
    const size_t m = r->s->m, n = r->s->n, cp = lo ? PAD16(c) : PAD8(c);
    if (lo) memset(r->big32, 0, n * cp * sizeof(float));
    else memset(r->big, 0, n * cp * sizeof(double));
    for (size_t i0 = 0; i0 < m; i0 += r->rows) {
        size_t k = m - i0 < r->rows ? m - i0 : r->rows;
        lk_status s = rd_rows(r, i0, k, !lo, lo);
        if (s) return s;
        for (size_t i = 0; i < k; i++)
            for (size_t j = 0; j < cp; j++) {
                double v = j < c ? Q[j * m + i0 + i] : 0.0;
                if (lo) r->small32[i * cp + j] = (float)v;
                else r->small[i * cp + j] = v;
            }
        if (lo) lk_la_trans_f(r->d32, r->ld, k, n, r->small32, cp, r->big32);
        else lk_la_trans(r->d, r->ld, k, n, r->small, cp, r->big);
    }
    for (size_t j = 0; j < c; j++)
        for (size_t i = 0; i < n; i++) P[j * n + i] = lo ? (double)r->big32[i * cp + j] : r->big[i * cp + j];
    return LK_OK;
}

/* The scratch of one weight. */
typedef struct xws {
    double *Q, *P, *Y, *Z, *W, *tau, *tmp;
    float *f;
    size_t cap; /* the sketch's most columns */
    size_t blk; /* columns per product */
} xws;

/* Y (len x c) -= Q Q^T Y, twice (Q: len x p, orthonormal). */
static void cgs2(double *Y, size_t len, size_t c, const double *Q, size_t p) {
    for (int t = 0; t < 2; t++)
        for (size_t j = 0; j < c; j++)
            for (size_t q = 0; q < p; q++) lk_la_axpy(Y + j * len, -lk_la_dot(Q + q * len, Y + j * len, len), Q + q * len, len);
}

/* Y (len x c, c <= len) <- an orthonormal basis of its columns (Householder; explicit Q). */
static void qr_explicit(double *Y, size_t len, size_t c, double *tau, double *tmp) {
    lk_la_qr(Y, len, c, tau);
    memset(tmp, 0, len * c * sizeof(double));
    for (size_t j = 0; j < c; j++) tmp[j * len + j] = 1.0;
    lk_la_q_apply(Y, len, c, tau, tmp, c);
    memcpy(Y, tmp, len * c * sizeof(double));
}

/* Y orthonormal and orthogonal to Q's p columns (re-done once: columns
 * that were rounding noise come out orthogonal too). */
static void orth(double *Y, size_t len, size_t c, const double *Q, size_t p, double *tau, double *tmp) {
    for (int pass = 0; pass < (p ? 2 : 1); pass++) {
        if (p) cgs2(Y, len, c, Q, p);
        qr_explicit(Y, len, c, tau, tmp);
    }
}

/* Omega's columns col0 .. col0 + c (n x c panel at W). */
static void omega(const lk_x_run *xr, const char *name, size_t n, size_t col0, size_t c, double *W, float *f) {
    for (size_t j = 0; j < c; j++) {
        lk_rand_uniform_at(f, (col0 + j) * n, n, xr->o->seed, name, 1.0f);
        for (size_t i = 0; i < n; i++) W[j * n + i] = (double)f[i];
    }
}

/* One block of c columns of the range at Q + p m: Y = D Omega_b, then the
 * power steps, each product re-orthonormalised; then its P = D^T Q_b. */
static lk_status block(const lk_x_run *xr, rdr *r, const char *name, xws *w, size_t p, size_t c, double *norm2) {
    const size_t m = r->s->m, n = r->s->n;
    double *Qb = w->Q + p * m;
    omega(xr, name, n, p, c, w->W, w->f);
    lk_status s = pass_rows(r, w->W, c, Qb, p ? NULL : norm2, xr->power > 0);
    if (s) return s;
    orth(Qb, m, c, w->Q, p, w->tau, w->tmp);
    for (int t = 0; t < xr->power; t++) {
        if ((s = pass_trans(r, Qb, c, w->Z, 1))) return s;
        orth(w->Z, n, c, NULL, 0, w->tau, w->tmp);
        if ((s = pass_rows(r, w->Z, c, Qb, NULL, t + 1 < xr->power))) return s;
        orth(Qb, m, c, w->Q, p, w->tau, w->tmp);
    }
    return pass_trans(r, Qb, c, w->P + p * n, 0);
}

/* ||P||_F^2 over its first L columns, in order. */
static double captured(const double *P, size_t n, size_t L) {
    double acc = 0;
    for (size_t j = 0; j < L; j++) acc += lk_la_dot(P + j * n, P + j * n, n);
    return acc;
}

/* The exact "sketch": Q = I (m <= n) or the Q of D's Householder QR, P = D^T Q. */
static lk_status exact(rdr *r, xws *w, double *norm2) {
    const size_t m = r->s->m, n = r->s->n;
    memset(w->Q, 0, m * w->cap * sizeof(double));
    if (m <= n) {
        for (size_t j = 0; j < m; j++) w->Q[j * m + j] = 1.0;
        lk_status s = pass_trans(r, w->Q, m, w->P, 0);
        *norm2 = s ? 0 : captured(w->P, n, m);
        return s;
    }
    /* D's columns as an m x n panel (in Y), QR; P = R^T */
    for (size_t i0 = 0; i0 < m; i0 += r->rows) {
        size_t k = m - i0 < r->rows ? m - i0 : r->rows;
        lk_status s = rd_rows(r, i0, k, 1, 0);
        if (s) return s;
        for (size_t i = 0; i < k; i++)
            for (size_t j = 0; j < n; j++) w->Y[j * m + i0 + i] = r->d[i * r->ld + j];
    }
    *norm2 = 0;
    for (size_t j = 0; j < n; j++) *norm2 += lk_la_dot(w->Y + j * m, w->Y + j * m, m);
    lk_la_qr(w->Y, m, n, w->tau);
    for (size_t l = 0; l < n; l++)
        for (size_t j = 0; j < n; j++) w->P[l * n + j] = l <= j ? w->Y[j * m + l] : 0.0;
    for (size_t j = 0; j < n; j++) w->Q[j * m + j] = 1.0;
    lk_la_q_apply(w->Y, m, n, w->tau, w->Q, n);
    return LK_OK;
}

/* The sketch: Q (m x L), P = D^T Q (n x L), ||D||^2 and the residual ||D||^2 - ||P||^2. */
static lk_status sketch(const lk_x_run *xr, rdr *r, const char *name, xws *w, size_t *L, double *norm2, double *res2) {
    const lk_extract_opts *o = xr->o;
    lk_status s = LK_OK;
    if (o->exact_svd) {
        *L = w->cap;
        s = exact(r, w, norm2);
        *res2 = 0;
        return s;
    }
    size_t p = 0;
    *res2 = 0;
    while (p < w->cap && !s) {
        size_t c = w->cap - p < w->blk ? w->cap - p : w->blk;
        if ((s = block(xr, r, name, w, p, c, norm2))) break;
        p += c;
        if (*norm2 == 0) break;
        *res2 = *norm2 - captured(w->P, r->s->n, p);
        if (*res2 < 0) *res2 = 0;
        if (o->alg.err > 0 && *res2 <= o->alg.err * o->alg.err * *norm2) break;
    }
    *L = p;
    return s;
}

/* The small SVD's results and the factors. */
typedef struct svd {
    double *s, *X, *Wv, *C, *work, *Pq, *tq; /* s (L), X W (L x L), C, Jacobi work, P's QR */
    double *Be, *Ae;                          /* m x K and n x K panels */
    size_t L, K;
} svd;

/* Q^T D = P^T = X diag(s) (Qp W)^T from P = Qp Rp and Rp^T = X diag(s) W^T. */
static void small_svd(const xws *w, svd *v, size_t n) {
    const size_t L = v->L;
    memcpy(v->Pq, w->P, n * L * sizeof(double));
    lk_la_qr(v->Pq, n, L, v->tq);
    for (size_t j = 0; j < L; j++)
        for (size_t i = 0; i < L; i++) v->C[j * L + i] = j <= i ? v->Pq[i * n + j] : 0.0;
    lk_la_svd(v->C, L, v->s, v->X, v->Wv, v->work);
}

/* The rank kept: --rank / --conv-rank, or the least rank whose error in the
 * sketch (residual + discarded s^2) meets --err, capped; >= 1, at most the
 * numerically non-zero count. */
static size_t keep(const lk_x_run *xr, const lk_alg_module *x, const svd *v, double norm2, double res2) {
    const lk_algebra_opts *o = &xr->o->alg;
    size_t nz = 0, L = v->L, k = L, cap = L;
    while (nz < L && v->s[nz] > v->s[0] * 1e-14) nz++;
    if (x->conv && o->conv_rank > 0) cap = (size_t)o->conv_rank;
    else if (o->rank > 0) cap = (size_t)o->rank;
    else if (o->max_rank > 0) cap = (size_t)o->max_rank;
    if (o->err > 0) {
        double tail = res2, lim = o->err * o->err * norm2;
        while (k > 0 && tail + v->s[k - 1] * v->s[k - 1] <= lim) tail += v->s[k - 1] * v->s[k - 1], k--;
    }
    if (k > cap) k = cap;
    if (k > nz) k = nz;
    return k ? k : 1;
}

/* Be = Q X_K diag(sqrt s), Ae = Qp W_K diag(sqrt s), canonical signs: each
 * column of Be has its largest-magnitude entry (the first of equals) positive. */
static void factors(const xws *w, svd *v, size_t m, size_t n) {
    const size_t L = v->L, K = v->K;
    memset(v->Be, 0, m * K * sizeof(double));
    memset(v->Ae, 0, n * K * sizeof(double));
    for (size_t k = 0; k < K; k++) {
        double r = sqrt(v->s[k]);
        for (size_t l = 0; l < L; l++) lk_la_axpy(v->Be + k * m, v->X[k * L + l] * r, w->Q + l * m, m);
        for (size_t i = 0; i < L; i++) v->Ae[k * n + i] = v->Wv[k * L + i] * r;
    }
    lk_la_q_apply(v->Pq, n, L, v->tq, v->Ae, K);
    lk_la_sign_canon(v->Be, m, v->Ae, n, K);
}

/* Rounds B = Be / c into x->b_bytes ([out, K]) and A = Ae into x->a_bytes
 * ([K, n]) in the output dtype; Be <- c Bw, Ae <- Aw (what the file holds). */
static lk_status written(const lk_x_run *xr, lk_alg_module *x, svd *v, double c) {
    const size_t m = x->out, n = x->N, K = v->K, es = lk_dtype_size(xr->run.dtype);
    const lk_dtype d = xr->run.dtype;
    x->b_bytes = lk_malloc(m * K * es + 1);
    x->a_bytes = lk_malloc(n * K * es + 1);
    if (!x->b_bytes || !x->a_bytes) return lk_error(LK_ERR_NOMEM, "%s: out of memory for the output factors", x->name);
    for (size_t k = 0; k < K; k++) {
        for (size_t i = 0; i < m; i++) {
            double *be = &v->Be[k * m + i], bw = lk_alg_round_store(*be / c, d, x->b_bytes, i * K + k);
            if (!isfinite(bw))
                return lk_error(LK_ERR_NONFINITE, "%s: B[%zu, %zu] = %g does not fit in %s", x->name, i, k, *be / c,
                                lk_dtype_name(d));
            *be = c * bw;
        }
        for (size_t i = 0; i < n; i++) {
            double *ae = &v->Ae[k * n + i], aw = lk_alg_round_store(*ae, d, x->a_bytes, k * n + i);
            if (!isfinite(aw))
                return lk_error(LK_ERR_NONFINITE, "%s: A[%zu, %zu] = %g does not fit in %s", x->name, k, i, *ae,
                                lk_dtype_name(d));
            *ae = aw;
        }
    }
    return LK_OK;
}

/* ||D - Y||_F^2 = ||D||^2 - 2 <D Aw^T, c Bw> + trace((c Bw)^T (c Bw) Aw Aw^T): one pass over D. */
static lk_status fro_error(rdr *r, lk_alg_module *x, const svd *v, double *DA) {
    const size_t m = x->out, n = x->N, K = v->K;
    lk_status s = pass_rows(r, v->Ae, K, DA, NULL, 0);
    if (s) return s;
    double inner = 0, ba2 = 0;
    for (size_t k = 0; k < K; k++) inner += lk_la_dot(v->Be + k * m, DA + k * m, m);
    for (size_t k = 0; k < K; k++)
        for (size_t l = 0; l < K; l++)
            ba2 += lk_la_dot(v->Be + k * m, v->Be + l * m, m) * lk_la_dot(v->Ae + k * n, v->Ae + l * n, n);
    x->err2 = x->norm2 - 2.0 * inner + ba2;
    if (x->err2 < 0) x->err2 = 0;
    return LK_OK;
}

/* ||Q^T (D - Y)||_2 (exact: Q spans D's column space in exact mode): E = P^T
 * - (Q^T c Bw) Aw, L x n, through its L x L Gram matrix. E and G from scratch. */
static void spec_error(const xws *w, lk_alg_module *x, svd *v, double *E, double *G) {
    const size_t m = x->out, n = x->N, L = v->L, K = v->K;
    for (size_t l = 0; l < L; l++) {
        memcpy(E + l * n, w->P + l * n, n * sizeof(double));
        for (size_t k = 0; k < K; k++) lk_la_axpy(E + l * n, -lk_la_dot(w->Q + l * m, v->Be + k * m, m), v->Ae + k * n, n);
    }
    for (size_t i = 0; i < L; i++)
        for (size_t j = 0; j <= i; j++) G[i * L + j] = G[j * L + i] = lk_la_dot(E + i * n, E + j * n, n);
    lk_la_svd(G, L, v->C, v->X, NULL, v->work); /* eigenvalues of the PSD G into C's first L */
    x->err_spec = sqrt(v->C[0] > 0 ? v->C[0] : 0);
}

/* The columns of the sketch and of each product. */
static void sizes(const lk_x_run *xr, const lk_alg_module *x, size_t *cap, size_t *blk) {
    const lk_algebra_opts *o = &xr->o->alg;
    size_t full = x->out < x->N ? x->out : x->N, k = 0;
    if (x->conv && o->conv_rank > 0) k = (size_t)o->conv_rank;
    else if (o->rank > 0) k = (size_t)o->rank;
    else if (o->max_rank > 0) k = (size_t)o->max_rank;
    if (xr->o->exact_svd) {
        *cap = *blk = full;
    } else if (o->err > 0) {
        *blk = 2 * (size_t)xr->oversample;
        *cap = k ? k + *blk : full;
    } else {
        *cap = *blk = k + (size_t)xr->oversample;
    }
    if (*cap > full) *cap = full;
    if (*blk > *cap) *blk = *cap;
}

lk_status lk_x_weight(const lk_x_run *xr, const lk_x_src *src, lk_alg_module *x, lk_x_result *res) {
    const size_t m = src->m, n = src->n, mx = m > n ? m : n;
    xws w = {0};
    svd v = {0};
    sizes(xr, x, &w.cap, &w.blk);
    const size_t C = w.cap, B = w.blk;
    lk_carve c = {0};
    size_t o[20];
    o[0] = LK_CARVE(&c, m * C, double), o[1] = LK_CARVE(&c, n * C, double);
    o[2] = LK_CARVE(&c, xr->o->exact_svd && m > n ? m * C : 0, double);
    o[3] = LK_CARVE(&c, n * B, double), o[4] = LK_CARVE(&c, n * B, double), o[5] = LK_CARVE(&c, mx, double);
    o[6] = LK_CARVE(&c, mx * B, double), o[7] = LK_CARVE(&c, n, float);
    o[8] = LK_CARVE(&c, C, double), o[9] = LK_CARVE(&c, C * C, double), o[10] = LK_CARVE(&c, C * C, double);
    o[11] = LK_CARVE(&c, C * C, double), o[12] = LK_CARVE(&c, 2 * C * C + C, double);
    o[13] = LK_CARVE(&c, n * C, double), o[14] = LK_CARVE(&c, C, double);
    o[15] = LK_CARVE(&c, m * C, double), o[16] = LK_CARVE(&c, n * C, double);
    o[17] = LK_CARVE(&c, m * C, double), o[18] = LK_CARVE(&c, C * n, double), o[19] = LK_CARVE(&c, C * C, double);
    char *b = lk_carve_alloc(&c);
    if (!b) return lk_error(LK_ERR_NOMEM, "%s: out of memory for a %zu x %zu weight at sketch size %zu", x->name, m, n, C);
    double **pd[20] = {&w.Q, &w.P, &w.Y, &w.Z, &w.W, &w.tau, &w.tmp, NULL, &v.s, &v.X, &v.Wv, &v.C, &v.work,
                       &v.Pq, &v.tq, &v.Be, &v.Ae, NULL, NULL, NULL};
    for (int i = 0; i < 20; i++)
        if (pd[i]) *pd[i] = (double *)(b + o[i]);
    w.f = (float *)(b + o[7]);
    double *DA = (double *)(b + o[17]), *E = (double *)(b + o[18]), *G = (double *)(b + o[19]);
    rdr r;
    double res2 = 0;
    lk_status s = rd_open(&r, src, C);
    if (!s) s = sketch(xr, &r, x->name, &w, &v.L, &x->norm2, &res2);
    if (s || x->norm2 == 0) {
        res->unchanged = !s;
        goto done;
    }
    res->sketch = v.L;
    small_svd(&w, &v, n);
    v.K = x->rank = keep(xr, x, &v, x->norm2, res2);
    x->spec = v.s[0];
    x->opt2 = 0;
    for (size_t j = v.L; j-- > v.K;) x->opt2 += v.s[j] * v.s[j];
    res->opt_up2 = x->opt2 + res2;
    factors(&w, &v, m, n);
    if (!(s = written(xr, x, &v, xr->run.alpha / (double)v.K))) s = fro_error(&r, x, &v, DA);
    if (!s) spec_error(&w, x, &v, E, G);
done:
    rd_close(&r);
    lk_free(b);
    if (s) lk_alg_module_free(x);
    return s;
}
