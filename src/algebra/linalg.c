/* linalg.c — thin Householder QR and one-sided Jacobi SVD in f64, the two
 * kernels every algebra operation is built from (see linalg.h). Plain C: the
 * matrices are small (the stacked rank R, a few hundred at most) or tall and
 * thin (out x R), where a Householder sweep is a dot and an axpy per column
 * and the compiler vectorises both; no LAPACK, so no second copy of these
 * semantics and no library whose threading or rounding we do not control. */
#include <math.h>
#include <string.h>

#include "algebra/linalg.h"
#include "fuse/fuse.h"

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

/* The streamed products (linalg_prod.h), in f64 and in f32, each built
 * for AVX-512, AVX2 and the baseline (vector widths and tiles below). Same operations in the same order per element, so the same
 * bits on every path; the path is the fuse layer's choice
 * (lk_fuse_kernel_path: the CPU's best, or LORAKIT_KERNEL). */
#define LK_LA_JB 512 /* W's rows per cache block in rows */

#if defined(__x86_64__) && defined(__GNUC__)
#define LK_LA_X86 1
#else
#define LK_LA_X86 0
#endif

/* Instantiations: _p* portable (16-byte vectors, tiles of 4 x 3), _a* AVX2
 * (32 bytes, 4 x 3), _w* AVX-512 (64 bytes, 4 x 5); *d f64, *f f32. */
#define LK_QV 3
#define LK_ATTR
#define LK_T double
#define LK_VL 2
#define LK_FN(x) x##_pd
#include "algebra/linalg_prod.h"
#undef LK_T
#undef LK_VL
#undef LK_FN
#define LK_T float
#define LK_VL 4
#define LK_FN(x) x##_pf
#include "algebra/linalg_prod.h"
#if LK_LA_X86
#undef LK_ATTR
#undef LK_VL
#undef LK_FN
#define LK_ATTR __attribute__((target("avx2")))
#define LK_VL 8
#define LK_FN(x) x##_af
#include "algebra/linalg_prod.h"
#undef LK_T
#undef LK_VL
#undef LK_FN
#define LK_T double
#define LK_VL 4
#define LK_FN(x) x##_ad
#include "algebra/linalg_prod.h"
#undef LK_QV
#undef LK_ATTR
#undef LK_VL
#undef LK_FN
#define LK_QV 5
#define LK_ATTR __attribute__((target("avx512f")))
#define LK_VL 8
#define LK_FN(x) x##_wd
#include "algebra/linalg_prod.h"
#undef LK_T
#undef LK_VL
#undef LK_FN
#define LK_T float
#define LK_VL 16
#define LK_FN(x) x##_wf
#include "algebra/linalg_prod.h"
#endif

/* 2 AVX-512, 1 AVX2, 0 portable. */
static int path(void) {
    const char *p = lk_fuse_kernel_path();
    if (!LK_LA_X86 || !strcmp(p, "portable")) return 0;
    return strcmp(p, "avx2") ? 2 : 1;
}

#if LK_LA_X86
/* f_<path><t> args: f rows or trans, t d (f64) or f (f32) */
#define LK_LA_PICK(f, t, args) \
    do { \
        int p_ = path(); \
        if (p_ == 2) f##_w##t args; \
        else if (p_ == 1) f##_a##t args; \
        else f##_p##t args; \
    } while (0)
#else
#define LK_LA_PICK(f, t, args) f##_p##t args
#endif

void lk_la_rows(const double *d, size_t ldd, size_t k, size_t n, const double *W, size_t c, double *Y) {
    LK_LA_PICK(rows, d, (d, ldd, k, n, W, c, Y));
}

void lk_la_trans(const double *d, size_t ldd, size_t k, size_t n, const double *Q, size_t c, double *P) {
    LK_LA_PICK(trans, d, (d, ldd, k, n, Q, c, P));
}

void lk_la_rows_f(const float *d, size_t ldd, size_t k, size_t n, const float *W, size_t c, float *Y) {
    LK_LA_PICK(rows, f, (d, ldd, k, n, W, c, Y));
}

void lk_la_trans_f(const float *d, size_t ldd, size_t k, size_t n, const float *Q, size_t c, float *P) {
    LK_LA_PICK(trans, f, (d, ldd, k, n, Q, c, P));
}
