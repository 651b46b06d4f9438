/* linalg.c — thin Householder QR and one-sided Jacobi SVD in f64, the two
 * kernels every algebra operation is built from (see linalg.h). Plain C: the
 * matrices are small (the stacked rank R, a few hundred at most) or tall and
 * thin (out x R), where a Householder sweep is a dot and an axpy per column
 * and the compiler vectorises both; no LAPACK, so no second copy of these
 * semantics and no library whose threading or rounding we do not control. */
#include <math.h>
#include <string.h>

#include "algebra/linalg.h"

/* The vector kernels are built for AVX-512, AVX2 and the baseline; every
 * copy does the same IEEE operations in the same order (eight independent
 * partial sums are eight lanes, no FMA: -ffp-contract=off), so the bits do
 * not depend on which one runs. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(LK_NO_CLONES)
#define LK_LA_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define LK_LA_CLONES
#endif

LK_LA_CLONES double lk_la_dot(const double *x, const double *y, size_t n) {
    double s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) s[l] += x[i + l] * y[i + l];
    double t = 0;
    for (; i < n; i++) t += x[i] * y[i];
    return (((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]))) + t;
}

LK_LA_CLONES void lk_la_axpy(double *y, double a, const double *x, size_t n) {
    for (size_t i = 0; i < n; i++) y[i] += a * x[i];
}

static void scal(double *x, double a, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] *= a;
}

/* The reflector of column j (rows j..m): LAPACK's dlarfg convention,
 * H = I - tau v v^T with v[0] = 1, H x = beta e_1. */
static double reflector(double *x, size_t len) {
    double xnorm2 = len > 1 ? lk_la_dot(x + 1, x + 1, len - 1) : 0.0;
    if (xnorm2 == 0.0) return 0.0;
    double alpha = x[0];
    double beta = -copysign(sqrt(alpha * alpha + xnorm2), alpha);
    double tau = (beta - alpha) / beta;
    scal(x + 1, 1.0 / (alpha - beta), len - 1);
    x[0] = beta;
    return tau;
}

/* y (len) <- (I - tau v v^T) y, v = (1, vs[1..len)). */
static void reflect(const double *vs, size_t len, double tau, double *y) {
    double w = y[0] + (len > 1 ? lk_la_dot(vs + 1, y + 1, len - 1) : 0.0);
    double f = tau * w;
    y[0] -= f;
    if (len > 1) lk_la_axpy(y + 1, -f, vs + 1, len - 1);
}

void lk_la_qr(double *a, size_t m, size_t k, double *tau) {
    size_t p = m < k ? m : k;
    for (size_t j = 0; j < p; j++) {
        double *x = a + j * m + j;
        tau[j] = reflector(x, m - j);
        if (tau[j] == 0.0) continue;
        for (size_t c = j + 1; c < k; c++) reflect(x, m - j, tau[j], a + c * m + j);
    }
}

void lk_la_qr_r(const double *a, size_t m, size_t k, double *r) {
    size_t p = m < k ? m : k;
    for (size_t i = 0; i < p; i++)
        for (size_t j = 0; j < k; j++) r[i * k + j] = j >= i ? a[j * m + i] : 0.0;
}

void lk_la_q_apply(const double *qr, size_t m, size_t p, const double *tau, double *z, size_t c) {
    for (size_t jj = p; jj-- > 0;) {
        if (tau[jj] == 0.0) continue;
        for (size_t col = 0; col < c; col++) reflect(qr + jj * m + jj, m - jj, tau[jj], z + col * m + jj);
    }
}

void lk_la_qt_apply(const double *qr, size_t m, size_t p, const double *tau, double *z, size_t c) {
    for (size_t jj = 0; jj < p; jj++) {
        if (tau[jj] == 0.0) continue;
        for (size_t col = 0; col < c; col++) reflect(qr + jj * m + jj, m - jj, tau[jj], z + col * m + jj);
    }
}

/* (x, y) <- (cs x - sn y, sn x + cs y) over n elements. */
LK_LA_CLONES static void rot(double *restrict x, double *restrict y, double cs, double sn, size_t n) {
    for (size_t r = 0; r < n; r++) {
        double a = x[r], b = y[r];
        x[r] = cs * a - sn * b;
        y[r] = sn * a + cs * b;
    }
}

/* One rotation of columns i, j of g (and of w, when given) when they are
 * not yet orthogonal to working accuracy; nrm holds the columns' squared
 * norms (updated: a - t c, b + t c). Returns 1 when it rotated. */
static int rotate(double *g, double *w, double *nrm, size_t n, size_t i, size_t j) {
    double *gi = g + i * n, *gj = g + j * n;
    double a = nrm[i], b = nrm[j], c = lk_la_dot(gi, gj, n);
    if (c == 0.0 || fabs(c) <= 1e-15 * sqrt(a) * sqrt(b)) return 0;
    double zeta = (b - a) / (2.0 * c);
    double t = copysign(1.0, zeta) / (fabs(zeta) + sqrt(1.0 + zeta * zeta));
    double cs = 1.0 / sqrt(1.0 + t * t), sn = cs * t;
    rot(gi, gj, cs, sn, n);
    if (w) rot(w + i * n, w + j * n, cs, sn, n);
    nrm[i] = a - t * c;
    nrm[j] = b + t * c;
    return 1;
}

int lk_la_svd(const double *c, size_t n, double *s, double *x, double *w, double *work) {
    double *g = work, *wt = w ? work + n * n : NULL, *norms = work + 2 * n * n;
    memcpy(g, c, n * n * sizeof *g);
    if (wt) {
        memset(wt, 0, n * n * sizeof *wt);
        for (size_t i = 0; i < n; i++) wt[i * n + i] = 1.0;
    }
    int sweep = 0;
    for (; sweep < 60; sweep++) {
        int rotated = 0;
        for (size_t i = 0; i < n; i++) norms[i] = lk_la_dot(g + i * n, g + i * n, n);
        for (size_t i = 0; i + 1 < n; i++)
            for (size_t j = i + 1; j < n; j++) rotated |= rotate(g, wt, norms, n, i, j);
        if (!rotated) break;
    }
    for (size_t i = 0; i < n; i++) norms[i] = sqrt(lk_la_dot(g + i * n, g + i * n, n));
    /* descending by value, ties in index order (a stable selection) */
    for (size_t k = 0; k < n; k++) {
        size_t best = n;
        for (size_t i = 0; i < n; i++)
            if (norms[i] >= 0 && (best == n || norms[i] > norms[best])) best = i;
        s[k] = norms[best];
        double *xk = x + k * n;
        if (s[k] > 0) {
            for (size_t r = 0; r < n; r++) xk[r] = g[best * n + r] / s[k];
        } else {
            memset(xk, 0, n * sizeof *xk);
            xk[best] = 1.0;
        }
        if (w) memcpy(w + k * n, wt + best * n, n * sizeof *w);
        norms[best] = -1.0;
    }
    return sweep;
}

void lk_la_sign_canon(double *b, size_t m, double *a, size_t n, size_t K) {
    for (size_t k = 0; k < K; k++) {
        double *bk = b + k * m, best = 0;
        size_t at = 0;
        for (size_t i = 0; i < m; i++)
            if (fabs(bk[i]) > best) best = fabs(bk[i]), at = i;
        if (bk[at] < 0) {
            for (size_t i = 0; i < m; i++) bk[i] = -bk[i];
            for (size_t i = 0; i < n; i++) a[k * n + i] = -a[k * n + i];
        }
    }
}

/* The products' tiles in GCC / clang vector types: four-lane groups of the
 * same IEEE operations in the same order on every path (a clone without
 * AVX lowers each to two SSE2 halves), so the bits do not change. */
typedef double lk_v4d __attribute__((vector_size(32)));

/* Unaligned moves (macros: a vector passed by value to a function changes the ABI without AVX). */
#define V4_LOAD(v, p) memcpy(&(v), (p), sizeof(lk_v4d))
#define V4_STORE(p, v) memcpy((p), &(v), sizeof(lk_v4d))

/* One tile of lk_la_rows: 4 rows x 4 QV columns from q0, each element
 * summed over j in order (4 QV independent sums per row hide the add
 * latency). */
static inline __attribute__((always_inline)) void rows_tile(const double *d, size_t n, const double *W, size_t c,
                                                             size_t q0, double *Y, const int QV) {
    lk_v4d a[4][3];
    for (int r = 0; r < 4; r++)
        for (int v = 0; v < QV; v++) a[r][v] = (lk_v4d){0, 0, 0, 0};
    for (size_t j = 0; j < n; j++) {
        lk_v4d w[3];
        for (int v = 0; v < QV; v++) V4_LOAD(w[v], W + j * c + q0 + 4 * v);
        for (int r = 0; r < 4; r++) {
            const double x = d[r * n + j];
            const lk_v4d xv = {x, x, x, x};
            for (int v = 0; v < QV; v++) a[r][v] += xv * w[v];
        }
    }
    for (int r = 0; r < 4; r++)
        for (int v = 0; v < QV; v++) V4_STORE(Y + r * c + q0 + 4 * v, a[r][v]);
}

/* Y[r][q] = sum_j d[r][j] W[j][q], j in order. */
static void rows_one(const double *d, size_t n, const double *W, size_t c, size_t q, double *y) {
    double acc = 0;
    for (size_t j = 0; j < n; j++) acc += d[j] * W[j * c + q];
    *y = acc;
}

LK_LA_CLONES void lk_la_rows(const double *d, size_t k, size_t n, const double *W, size_t c, double *Y) {
    size_t r0 = 0;
    for (; r0 + 4 <= k; r0 += 4) {
        size_t q0 = 0;
        for (; q0 + 12 <= c; q0 += 12) rows_tile(d + r0 * n, n, W, c, q0, Y + r0 * c, 3);
        for (; q0 + 4 <= c; q0 += 4) rows_tile(d + r0 * n, n, W, c, q0, Y + r0 * c, 1);
        for (size_t r = r0; r < r0 + 4; r++)
            for (size_t q = q0; q < c; q++) rows_one(d + r * n, n, W, c, q, Y + r * c + q);
    }
    for (size_t r = r0; r < k; r++)
        for (size_t q = 0; q < c; q++) rows_one(d + r * n, n, W, c, q, Y + r * c + q);
}

/* One tile of lk_la_trans: Q's 4 rows x 8 columns from q0 held in
 * registers, P's row j updated by the four rows in order. */
static inline __attribute__((always_inline)) void trans_tile(const double *d, size_t n, const double *Q, size_t c,
                                                              size_t q0, double *P) {
    lk_v4d b[4][2];
    for (int r = 0; r < 4; r++)
        for (int v = 0; v < 2; v++) V4_LOAD(b[r][v], Q + r * c + q0 + 4 * v);
    for (size_t j = 0; j < n; j++) {
        for (int v = 0; v < 2; v++) {
            lk_v4d p;
            V4_LOAD(p, P + j * c + q0 + 4 * v);
            for (int r = 0; r < 4; r++) {
                const double x = d[r * n + j];
                const lk_v4d xv = {x, x, x, x};
                p = p + xv * b[r][v];
            }
            V4_STORE(P + j * c + q0 + 4 * v, p);
        }
    }
}

LK_LA_CLONES void lk_la_trans(const double *d, size_t k, size_t n, const double *Q, size_t c, double *P) {
    size_t r0 = 0;
    for (; r0 + 4 <= k; r0 += 4) {
        size_t q0 = 0;
        for (; q0 + 8 <= c; q0 += 8) trans_tile(d + r0 * n, n, Q + r0 * c, c, q0, P);
        for (size_t r = r0; r < r0 + 4; r++)
            for (size_t j = 0; j < n; j++)
                for (size_t q = q0; q < c; q++) P[j * c + q] += d[r * n + j] * Q[r * c + q];
    }
    for (size_t r = r0; r < k; r++)
        for (size_t j = 0; j < n; j++)
            for (size_t q = 0; q < c; q++) P[j * c + q] += d[r * n + j] * Q[r * c + q];
}
