/* algebra/linalg.h — the dense f64 kernels of the adapter algebra: thin
 * Householder QR, applying its Q, one-sided Jacobi SVD, small products.
 *
 * Matrices are "panels": k vectors of length m, vector j at a + j * m
 * (column-major m x k). A LoRA's B (out x r) is a panel of r columns of
 * length out; its A (r x in) is a panel of r rows of length in (A's rows
 * are the columns of A^T). Every reduction runs in a fixed order (eight
 * partial sums, combined pairwise) with no fused multiply-add (the layer is
 * built with -ffp-contract=off), so results are the same bits on every CPU
 * and for any thread count (threads only ever split whole modules). */
#ifndef LK_ALGEBRA_LINALG_H
#define LK_ALGEBRA_LINALG_H

#include <stddef.h>
#include <stdint.h>

/* x . y over n elements, in the fixed order above. */
double lk_la_dot(const double *x, const double *y, size_t n);
/* y += a x. */
void lk_la_axpy(double *y, double a, const double *x, size_t n);

/* Householder QR of the m x k panel a, in place: on return the upper
 * triangle of its first p = min(m, k) rows holds R (R[i][j] at a[j*m + i],
 * i <= j) and below it the reflectors' vectors (implicit leading 1), their
 * factors in tau[0..p). A zero column gives tau 0 (no reflection). */
void lk_la_qr(double *a, size_t m, size_t k, double *tau);
/* R of a factored panel into r (p x k, row-major, zeros below). */
void lk_la_qr_r(const double *a, size_t m, size_t k, double *r);
/* z (m x c panel) <- Q z: the reflectors of qr (p of them) applied last to
 * first. The caller puts the small matrix in z's first p rows, zeros
 * below. */
void lk_la_q_apply(const double *qr, size_t m, size_t p, const double *tau, double *z, size_t c);
/* z (m x c panel) <- Q^T z: first to last; the result's first p rows are
 * the coordinates in Q's basis. */
void lk_la_qt_apply(const double *qr, size_t m, size_t p, const double *tau, double *z, size_t c);

/* One-sided (Hestenes) Jacobi SVD of the n x n panel c (not changed), cyclic
 * by rows, to full f64 accuracy (at most 60 sweeps): c = X diag(s) W^T.
 * On return s[0..n) descending (ties keep index order), x (n x n panel)
 * the left and w (n x n panel; NULL: not wanted, which halves the work)
 * the right singular vectors in the same order; a zero singular value gets the unit vector of its index in x.
 * work: 2 n^2 + n doubles. Returns the sweeps used. */
int lk_la_svd(const double *c, size_t n, double *s, double *x, double *w, double *work);

/* The two products of a streamed dense matrix's rows (extract's passes).
 * d: k rows of n (row-major, row r at d + r * ldd); W: n x c row-major;
 * Q, Y: k x c row-major; P: n x c row-major; c a multiple of 8 (f64) or
 * 16 (f32): pad the panels with zero columns. Each output element is one sum in
 * the order of its index (j for rows, the row for trans), whatever the
 * tiling, vector width or CPU, so the bits do not depend on how rows are
 * chunked nor on the machine.
 *   lk_la_rows:  Y[r][q] = sum_j d[r][j] W[j][q]
 *   lk_la_trans: P[j][q] += d[r][j] Q[r][q], r = 0, 1, ... in order
 * The _f versions: the same in f32 (each product and sum rounded to f32). */
void lk_la_rows(const double *d, size_t ldd, size_t k, size_t n, const double *W, size_t c, double *Y);
void lk_la_trans(const double *d, size_t ldd, size_t k, size_t n, const double *Q, size_t c, double *P);
void lk_la_rows_f(const float *d, size_t ldd, size_t k, size_t n, const float *W, size_t c, float *Y);
void lk_la_trans_f(const float *d, size_t ldd, size_t k, size_t n, const float *Q, size_t c, float *P);

/* Canonical signs of K rank-one terms b_k a_k^T (b: m x K panel, a: n x K
 * panel): each b_k's largest-magnitude entry (the first of equals) is made
 * positive, a_k flipped with it, so the factors do not depend on the sign
 * an SVD happened to pick. */
void lk_la_sign_canon(double *b, size_t m, double *a, size_t n, size_t K);

#endif
