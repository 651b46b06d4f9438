/* module.c — one output module of merge / resize: the stacked factors, the
 * exact thin SVD through QR of both sides and a Jacobi SVD of the core, the
 * truncation, the factors as written, and the exact error of what was
 * written.
 *
 *   X  = sum_t coef_t U_t V_t = U V           (U out x R, V R x N, stacked)
 *   U  = Qu Ru, V^T = Qv Rv                   (Householder, f64)
 *   C  = Ru Rv^T = Xc diag(s) Wc^T            (Jacobi, R x R)
 *   X  = (Qu Xc) diag(s) (Qv Wc)^T            (the thin SVD of X)
 *   Be = Qu Xc_K diag(sqrt s_K), Ae = diag(sqrt s_K) (Qv Wc_K)^T  (or U, V when exact)
 *   written: Bw = round(Be / c), Aw = round(Ae), c = alpha / K; Y = c Bw Aw
 *   X - Y = T + D, T = the discarded tail, D = (Be - c Bw) Ae + c Bw (Ae - Aw)
 *   ||X - Y||^2 = ||T||^2 + ||D||^2 + 2 <T, D>
 * ||T||^2 = sum of the discarded s_j^2; ||D||^2 = trace(Gu Gv) with the 2K
 * x 2K Gram matrices of D's factors (all of D's terms are small: no
 * cancellation); <T, D> through Qu^T and Qv^T of D's factors. ||X - Y||_2
 * from the Gram matrices of T + D's factors: the largest eigenvalue of
 * Fv Gu Fv^T with Fv^T Fv = Gv. No out x N matrix is ever formed. */
#include <float.h>
#include <math.h>
#include <string.h>

#include "algebra/algebra_int.h"
#include "algebra/linalg.h"
#include "core/alloc.h"
#include "lorakit/alloc.h"

double lk_alg_round_store(double v, lk_dtype d, void *dst, size_t i) {
    float f = (float)v;
    if (d == LK_DTYPE_F32) {
        ((float *)dst)[i] = f;
        return (double)f;
    }
    /* round to odd into f32, then to nearest even: one correct rounding
     * (f32 keeps at least two more bits than F16 and BF16) */
    if (isfinite(f) && fabs((double)f) > fabs(v)) f = nextafterf(f, 0.0f);
    if (isfinite(f) && (double)f != v) {
        uint32_t u;
        memcpy(&u, &f, 4);
        u |= 1u;
        memcpy(&f, &u, 4);
    }
    uint16_t h = d == LK_DTYPE_BF16 ? lk_f32_to_bf16(f) : lk_f32_to_f16(f);
    ((uint16_t *)dst)[i] = h;
    return (double)(d == LK_DTYPE_BF16 ? lk_bf16_to_f32(h) : lk_f16_to_f32(h));
}

/* The scratch of one module, carved from one block. */
typedef struct ws {
    double *U, *V, *tu, *tv, *C, *s, *X, *W, *work;
    double *Be, *Ae, *UD, *VD, *Pu, *Pv, *Gu, *Gv, *tmp;
    size_t R, K;
    void *block;
} ws;

static lk_status ws_alloc(ws *w, size_t out, size_t N, size_t R, size_t Kmax, size_t nz) {
    lk_carve c = {0};
    size_t o[18];
    size_t K2 = 2 * Kmax;
    o[0] = LK_CARVE(&c, out * R, double);
    o[1] = LK_CARVE(&c, N * R, double);
    o[2] = LK_CARVE(&c, R, double);
    o[3] = LK_CARVE(&c, R, double);
    o[4] = LK_CARVE(&c, R * R, double);
    o[5] = LK_CARVE(&c, R, double);
    o[6] = LK_CARVE(&c, R * R, double);
    o[7] = LK_CARVE(&c, R * R, double);
    o[8] = LK_CARVE(&c, 4 * nz * nz + 2 * nz, double);
    o[9] = LK_CARVE(&c, out * Kmax, double);
    o[10] = LK_CARVE(&c, N * Kmax, double);
    o[11] = LK_CARVE(&c, out * K2, double);
    o[12] = LK_CARVE(&c, N * K2, double);
    o[13] = LK_CARVE(&c, R * K2, double);
    o[14] = LK_CARVE(&c, R * K2, double);
    o[15] = LK_CARVE(&c, nz * nz, double);
    o[16] = LK_CARVE(&c, nz * nz, double);
    o[17] = LK_CARVE(&c, (out > N ? out : N) * K2, double);
    char *b = lk_carve_alloc_aligned(&c, 64);
    if (!b) return lk_error(LK_ERR_NOMEM, "out of memory for a module of %zu x %zu at stacked rank %zu", out, N, R);
    double **p[18] = {&w->U, &w->V, &w->tu, &w->tv, &w->C, &w->s, &w->X, &w->W, &w->work,
                      &w->Be, &w->Ae, &w->UD, &w->VD, &w->Pu, &w->Pv, &w->Gu, &w->Gv, &w->tmp};
    for (int i = 0; i < 18; i++) *p[i] = (double *)(b + o[i]);
    w->block = b;
    w->R = R;
    return LK_OK;
}

/* C (R x R panel) = Ru Rv^T from the two factored panels. */
static void core(const ws *w, size_t out, size_t N) {
    const size_t R = w->R, pu = out < R ? out : R, pv = N < R ? N : R;
    for (size_t j = 0; j < R; j++)
        for (size_t i = 0; i < R; i++) {
            double acc = 0;
            if (i < pu && j < pv)
                for (size_t k = i > j ? i : j; k < R; k++) acc += w->U[k * out + i] * w->V[k * N + j];
            w->C[j * R + i] = acc;
        }
}

/* The rank kept: the options' rule on s, at most the cap, at most the
 * numerically non-zero count, at least 1. */
static size_t choose_rank(const lk_alg_run *run, const lk_alg_module *x, const double *s, size_t R, double norm2) {
    const lk_algebra_opts *o = run->o;
    size_t nz = 0;
    while (nz < R && s[nz] > s[0] * 1e-14) nz++;
    if (run->exact) return R;
    size_t cap = R, k = R;
    if (x->conv && o->conv_rank > 0) cap = (size_t)o->conv_rank;
    else if (o->rank > 0) cap = (size_t)o->rank;
    else if (o->max_rank > 0) cap = (size_t)o->max_rank;
    if (o->err > 0) {
        double tail = 0, lim = o->err * o->err * norm2;
        k = R;
        while (k > 0 && tail + s[k - 1] * s[k - 1] <= lim) {
            tail += s[k - 1] * s[k - 1];
            k--;
        }
    } else if (o->fro > 0) {
        double head = 0, lim = o->fro * o->fro * norm2;
        k = 0;
        while (k < R && head < lim) head += s[k] * s[k], k++;
    } else if (o->ratio > 0) {
        k = 0;
        while (k < R && s[k] >= o->ratio * s[0]) k++;
    }
    if (k > cap) k = cap;
    if (k > nz) k = nz;
    return k ? k : 1;
}

/* Be, Ae of the truncated SVD (sqrt(s) on both sides), canonical signs:
 * each column of Be has its largest-magnitude entry (the first of equals)
 * positive. */
static void truncated(ws *w, size_t out, size_t N) {
    const size_t R = w->R, K = w->K, pu = out < R ? out : R, pv = N < R ? N : R;
    memset(w->Be, 0, out * K * sizeof(double));
    memset(w->Ae, 0, N * K * sizeof(double));
    for (size_t k = 0; k < K; k++) {
        double r = sqrt(w->s[k]);
        for (size_t i = 0; i < pu; i++) w->Be[k * out + i] = w->X[k * R + i] * r;
        for (size_t i = 0; i < pv; i++) w->Ae[k * N + i] = w->W[k * R + i] * r;
    }
    lk_la_q_apply(w->U, out, pu, w->tu, w->Be, K);
    lk_la_q_apply(w->V, N, pv, w->tv, w->Ae, K);
    lk_la_sign_canon(w->Be, out, w->Ae, N, K);
}

/* Rounds the factors into the output dtype (B [out, K] and A [K, N]
 * row-major) and builds D's factors: UD = [Be - c Bw, c Bw], VD = [Ae;
 * Ae - Aw]. Fails on a value the dtype cannot hold. */
static lk_status written(const lk_alg_run *run, lk_alg_module *x, ws *w, double c) {
    const size_t out = x->out, N = x->N, K = w->K;
    const size_t es = lk_dtype_size(run->dtype);
    x->b_bytes = lk_malloc(out * K * es + 1);
    x->a_bytes = lk_malloc(N * K * es + 1);
    if (!x->b_bytes || !x->a_bytes) return lk_error(LK_ERR_NOMEM, "%s: out of memory for the output factors", x->name);
    for (size_t k = 0; k < K; k++) {
        for (size_t o = 0; o < out; o++) {
            double be = w->Be[k * out + o];
            double bw = lk_alg_round_store(be / c, run->dtype, x->b_bytes, o * K + k);
            if (!isfinite(bw))
                return lk_error(LK_ERR_NONFINITE, "%s: B[%zu, %zu] = %g does not fit in %s", x->name, o, k, be / c,
                                lk_dtype_name(run->dtype));
            w->UD[k * out + o] = be - c * bw;
            w->UD[(K + k) * out + o] = c * bw;
        }
        for (size_t i = 0; i < N; i++) {
            double ae = w->Ae[k * N + i];
            double aw = lk_alg_round_store(ae, run->dtype, x->a_bytes, k * N + i);
            if (!isfinite(aw))
                return lk_error(LK_ERR_NONFINITE, "%s: A[%zu, %zu] = %g does not fit in %s", x->name, k, i, ae,
                                lk_dtype_name(run->dtype));
            w->VD[k * N + i] = ae;
            w->VD[(K + k) * N + i] = ae - aw;
        }
    }
    return LK_OK;
}

/* G (n x n, row-major) = P^T P for the n-vector panel P of length len. */
static void gram(const double *P, size_t len, size_t n, double *G, size_t ld, size_t off) {
    for (size_t i = 0; i < n; i++)
        for (size_t j = 0; j <= i; j++) {
            double v = lk_la_dot(P + i * len, P + j * len, len);
            G[(off + i) * ld + off + j] = v;
            G[(off + j) * ld + off + i] = v;
        }
}

/* The coordinates of D's factors in Qu's and Qv's bases: Pu (R x 2K
 * panel, rows >= pu zero), Pv likewise. */
static void project(ws *w, size_t out, size_t N) {
    const size_t R = w->R, K2 = 2 * w->K, pu = out < R ? out : R, pv = N < R ? N : R;
    double *tmp = w->tmp;
    memcpy(tmp, w->UD, out * K2 * sizeof(double));
    lk_la_qt_apply(w->U, out, pu, w->tu, tmp, K2);
    for (size_t c = 0; c < K2; c++)
        for (size_t i = 0; i < R; i++) w->Pu[c * R + i] = i < pu ? tmp[c * out + i] : 0.0;
    memcpy(tmp, w->VD, N * K2 * sizeof(double));
    lk_la_qt_apply(w->V, N, pv, w->tv, tmp, K2);
    for (size_t c = 0; c < K2; c++)
        for (size_t i = 0; i < R; i++) w->Pv[c * R + i] = i < pv ? tmp[c * N + i] : 0.0;
}

/* Gram matrices of T + D's factors (nz = R - K + 2K), the error terms,
 * and ||X - Y||_2. */
static void errors(lk_alg_module *x, ws *w, size_t out, size_t N) {
    const size_t R = w->R, K = w->K, K2 = 2 * K, nt = R - K, nz = nt + K2;
    double *Gu = w->Gu, *Gv = w->Gv;
    memset(Gu, 0, nz * nz * sizeof(double));
    memset(Gv, 0, nz * nz * sizeof(double));
    gram(w->UD, out, K2, Gu, nz, nt);
    gram(w->VD, N, K2, Gv, nz, nt);
    double d2 = 0, t2 = 0, cross = 0;
    for (size_t i = 0; i < K2; i++)
        for (size_t j = 0; j < K2; j++) d2 += Gu[(nt + i) * nz + nt + j] * Gv[(nt + i) * nz + nt + j];
    if (nt) project(w, out, N);
    for (size_t a = 0; a < nt; a++) {
        const size_t j = K + a;
        t2 += w->s[j] * w->s[j];
        Gu[a * nz + a] = w->s[j] * w->s[j];
        Gv[a * nz + a] = 1.0;
        for (size_t c = 0; c < K2; c++) {
            double pu = w->s[j] * lk_la_dot(w->X + j * R, w->Pu + c * R, R);
            double pv = lk_la_dot(w->W + j * R, w->Pv + c * R, R);
            Gu[a * nz + nt + c] = Gu[(nt + c) * nz + a] = pu;
            Gv[a * nz + nt + c] = Gv[(nt + c) * nz + a] = pv;
        }
        for (size_t c = 0; c < K2; c++) cross += Gu[a * nz + nt + c] * Gv[a * nz + nt + c];
    }
    x->opt2 = t2;
    x->err2 = t2 + d2 + 2.0 * cross;
    if (x->err2 < 0) x->err2 = 0;
    /* ||T + D||_2^2 = lambda_max(Gu Gv) = lambda_max(Fv Gu Fv^T), Gv = E diag(l) E^T, Fv = diag(sqrt l) E^T */
    double *ev = w->work, *E = ev + nz, *E2 = E + nz * nz, *jw = E2 + nz * nz;
    lk_la_svd(Gv, nz, ev, E, NULL, jw);
    double *F = w->Gv; /* Gv is consumed: F[i][:] = sqrt(l_i) E[:, i]^T */
    for (size_t i = 0; i < nz; i++)
        for (size_t r = 0; r < nz; r++) F[i * nz + r] = sqrt(ev[i]) * E[i * nz + r];
    double *T1 = E2; /* T1 = Gu F^T (nz x nz): T1[r][i] = sum_q Gu[r][q] F[i][q] */
    for (size_t r = 0; r < nz; r++)
        for (size_t i = 0; i < nz; i++) T1[r * nz + i] = lk_la_dot(Gu + r * nz, F + i * nz, nz);
    double *M = E; /* M[i][j] = sum_r F[i][r] T1[r][j]; symmetric, stored as a panel */
    for (size_t j = 0; j < nz; j++)
        for (size_t i = 0; i < nz; i++) {
            double acc = 0;
            for (size_t r = 0; r < nz; r++) acc += F[i * nz + r] * T1[r * nz + j];
            M[j * nz + i] = acc;
        }
    double *sv = ev, *X2 = T1;
    lk_la_svd(M, nz, sv, X2, NULL, jw);
    x->err_spec = sqrt(sv[0] > 0 ? sv[0] : 0);
}

lk_status lk_alg_module_run(const lk_alg_run *run, lk_alg_module *x) {
    const size_t out = x->out, N = x->N;
    size_t R = 0;
    for (size_t t = 0; t < x->n_terms; t++) R += lk_alg_lowrank_rank(x->terms[t].m);
    if (R > 16384)
        return lk_error(LK_ERR_UNSUPPORTED, "%s: the stacked rank %zu exceeds 16384 (the core SVD is R x R)", x->name, R);
    size_t Kmax = R;
    ws w = {0};
    lk_status s = ws_alloc(&w, out, N, R, Kmax, R + Kmax);
    if (s) return lk_error_prefix(s, "%s", x->name);
    size_t col = 0;
    for (size_t t = 0; t < x->n_terms && !s; t++) {
        s = lk_alg_lowrank_put(x->terms[t].m, x->terms[t].coef, w.U + col * out, out, w.V + col * N, N);
        col += lk_alg_lowrank_rank(x->terms[t].m);
    }
    if (s) goto done;
    if (run->exact) {
        memcpy(w.Be, w.U, out * R * sizeof(double));
        memcpy(w.Ae, w.V, N * R * sizeof(double));
    }
    lk_la_qr(w.U, out, R, w.tu);
    lk_la_qr(w.V, N, R, w.tv);
    core(&w, out, N);
    x->sweeps = lk_la_svd(w.C, R, w.s, w.X, w.W, w.work);
    x->norm2 = 0;
    for (size_t j = R; j-- > 0;) x->norm2 += w.s[j] * w.s[j];
    x->spec = w.s[0];
    w.K = choose_rank(run, x, w.s, R, x->norm2);
    x->rank = w.K;
    if (!run->exact) truncated(&w, out, N);
    double c = run->alpha / (double)w.K;
    if ((s = written(run, x, &w, c))) goto done;
    errors(x, &w, out, N);
done:
    lk_free(w.block);
    return s;
}

void lk_alg_module_free(lk_alg_module *x) {
    lk_free(x->b_bytes);
    lk_free(x->a_bytes);
    x->b_bytes = x->a_bytes = NULL;
}
