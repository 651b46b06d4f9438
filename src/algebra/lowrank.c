/* lowrank.c — every low-rank adapter module as U V in f64 (U out x r, V
 * r x N, N the delta's elements per row), exactly: the only roundings are
 * f64 products of the file's values.
 *
 *   LoRA       U = B, V = A (a conv's A is its [r, in kh kw] unfolding)
 *   Tucker     V = fold(core, down): V[p, i K + h] = sum_q core[p, q, h] down[q, i]
 *   LoHa       (U1 V1) o (U2 V2) = (U1 * U2)(V1 * V2): column (a, b) of U is
 *              U1[:, a] o U2[:, b], row (a, b) of V is V1[a, :] o V2[b, :],
 *              an exact LoRA of rank r1 r2 (o: elementwise)
 *   LoKr       kron(U1 V1, U2 V2) = kron(U1, U2) kron(V1, V2), rank p1 p2,
 *              a full factor w (rows x cols) as I w or w I, whichever is thinner
 *
 * The module's scale and the term's strength go into U. */
#include <math.h>
#include <string.h>

#include "algebra/algebra_int.h"
#include "lorakit/alloc.h"

/* dst[0..n) = elements off.. of t as f64 (exact: every adapter dtype widens). */
static void load(const lk_tensor *t, size_t off, size_t n, double *dst) {
    float buf[256];
    size_t es = lk_dtype_size(t->dtype);
    for (size_t i = 0; i < n; i += 256) {
        size_t c = n - i < 256 ? n - i : 256;
        lk_to_f32(buf, (const char *)t->data + (off + i) * es, t->dtype, c);
        for (size_t j = 0; j < c; j++) dst[i + j] = (double)buf[j];
    }
}

/* One factor pair: U (rows x r panel), V (r panel of cols). */
typedef struct pair {
    size_t rows, cols, r;
    double *U, *V;
} pair;

static void pair_free(pair *p) {
    lk_free(p->U);
    lk_free(p->V);
    p->U = p->V = NULL;
}

static lk_status pair_alloc(pair *p, size_t rows, size_t cols, size_t r) {
    size_t nu, nv;
    p->rows = rows, p->cols = cols, p->r = r;
    p->U = p->V = NULL;
    if (!lk_checked_mul(rows, r, &nu) || !lk_checked_mul(cols, r, &nv) || !lk_checked_mul(nu, 8, &nu) ||
        !lk_checked_mul(nv, 8, &nv))
        return lk_error(LK_ERR_NOMEM, "factor of %zu x %zu at rank %zu does not fit in memory", rows, cols, r);
    p->U = lk_malloc(nu ? nu : 1);
    p->V = lk_malloc(nv ? nv : 1);
    if (!p->U || !p->V) {
        pair_free(p);
        return lk_error(LK_ERR_NOMEM, "out of memory for a %zu x %zu factor pair of rank %zu", rows, cols, r);
    }
    return LK_OK;
}

/* up as U: [rows, r] row-major (transposed 0) or [r, rows] (transposed 1). */
static void load_up(pair *p, const lk_tensor *up, int transposed) {
    if (transposed) {
        load(up, 0, p->rows * p->r, p->U);
        return;
    }
    double row[512];
    for (size_t o = 0; o < p->rows; o++)
        for (size_t a0 = 0; a0 < p->r; a0 += 512) {
            size_t c = p->r - a0 < 512 ? p->r - a0 : 512;
            load(up, o * p->r + a0, c, row);
            for (size_t a = 0; a < c; a++) p->U[(a0 + a) * p->rows + o] = row[a];
        }
}

/* V = fold(core [R1, R2, K], down [R2, IN]) into p->V (R1 rows of IN K). */
static lk_status load_fold(pair *p, const lk_tensor *core, const lk_tensor *down) {
    const size_t R1 = (size_t)core->shape[0], R2 = (size_t)core->shape[1];
    const size_t K = lk_tensor_numel(core) / (R1 * R2), IN = (size_t)down->shape[1];
    double *c = lk_malloc(R1 * R2 * K * sizeof *c), *d = lk_malloc(R2 * IN * sizeof *d);
    if (!c || !d) {
        lk_free(c);
        lk_free(d);
        return lk_error(LK_ERR_NOMEM, "out of memory for a Tucker fold");
    }
    load(core, 0, R1 * R2 * K, c);
    load(down, 0, R2 * IN, d);
    for (size_t q = 0; q < R1; q++)
        for (size_t i = 0; i < IN; i++)
            for (size_t h = 0; h < K; h++) {
                double acc = 0;
                for (size_t k = 0; k < R2; k++) acc += c[(q * R2 + k) * K + h] * d[k * IN + i];
                p->V[q * IN * K + i * K + h] = acc;
            }
    lk_free(c);
    lk_free(d);
    return LK_OK;
}

/* A low-rank half up @ down (or up^T @ fold(core, down) with a Tucker core). */
static lk_status half(pair *p, const lk_tensor *up, const lk_tensor *down, const lk_tensor *core, size_t rows,
                      size_t cols) {
    size_t r = (size_t)(core && core->data ? core->shape[0] : down->shape[0]);
    lk_status s = pair_alloc(p, rows, cols, r);
    if (s) return s;
    load_up(p, up, core && core->data);
    if (core && core->data) s = load_fold(p, core, down);
    else load(down, 0, r * cols, p->V);
    if (s) pair_free(p);
    return s;
}

/* A full factor w (rows x cols) as I w (rows <= cols) or w I. */
static lk_status full(pair *p, const lk_tensor *w, size_t rows, size_t cols) {
    size_t r = rows <= cols ? rows : cols;
    lk_status s = pair_alloc(p, rows, cols, r);
    if (s) return s;
    memset(p->U, 0, rows * r * sizeof *p->U);
    memset(p->V, 0, cols * r * sizeof *p->V);
    if (rows <= cols) {
        for (size_t i = 0; i < r; i++) p->U[i * rows + i] = 1.0;
        load(w, 0, rows * cols, p->V);
    } else {
        for (size_t i = 0; i < r; i++) p->V[i * cols + i] = 1.0;
        double *row = lk_malloc(cols * sizeof *row);
        if (!row) {
            pair_free(p);
            return lk_error(LK_ERR_NOMEM, "out of memory for a LoKr factor");
        }
        for (size_t o = 0; o < rows; o++) {
            load(w, o * cols, cols, row);
            for (size_t a = 0; a < cols; a++) p->U[a * rows + o] = row[a];
        }
        lk_free(row);
    }
    return LK_OK;
}

int lk_alg_lowrank_supported(const lk_lora_module *m, const char **why) {
    *why = NULL;
    if (m->algo != LK_ALGO_LORA && m->algo != LK_ALGO_LOHA && m->algo != LK_ALGO_LOKR)
        *why = "has no low-rank form (a dense diff, norm or set_weight module); it is not merged";
    else if (m->magnitude.data || m->dora_scale.data)
        *why = "is DoRA: its delta depends on the base weight (refused without --base)";
    else if (m->bias.data)
        *why = "carries a bias delta (lora_B.bias), which a low-rank output cannot hold";
    else if (m->A.name && strstr(m->A.name, "lora_embedding_"))
        *why = "is an embedding LoRA (lora_embedding_A/B), not supported by the adapter algebra";
    return *why == NULL;
}

/* LoKr's two factors' ranks and shapes. */
static void lokr_dims(const lk_lora_module *m, size_t *a1, size_t *b1, size_t *p1, size_t *c2, size_t *d2,
                      size_t *p2) {
    *a1 = (size_t)(m->w1.data ? m->w1.shape[0] : m->w1a.shape[0]);
    *b1 = (size_t)(m->w1.data ? m->w1.shape[1] : m->w1b.shape[1]);
    *c2 = (size_t)m->out / *a1;
    *d2 = (size_t)m->in / *b1;
    *p1 = m->w1.data ? (*a1 <= *b1 ? *a1 : *b1) : (size_t)m->w1b.shape[0];
    *p2 = m->w2.data ? (*c2 <= *d2 ? *c2 : *d2) : (size_t)(m->t2.data ? m->t2.shape[0] : m->w2b.shape[0]);
}

size_t lk_alg_lowrank_rank(const lk_lora_module *m) {
    size_t a1, b1, p1, c2, d2, p2;
    switch (m->algo) {
    case LK_ALGO_LORA: return (size_t)m->rank;
    case LK_ALGO_LOHA:
        return (size_t)(m->t1.data ? m->t1.shape[0] : m->w1b.shape[0]) *
               (size_t)(m->t2.data ? m->t2.shape[0] : m->w2b.shape[0]);
    case LK_ALGO_LOKR: lokr_dims(m, &a1, &b1, &p1, &c2, &d2, &p2); return p1 * p2;
    default: return 0;
    }
}

/* LoRA: straight into the stacked panels. */
static lk_status put_lora(const lk_lora_module *m, double coef, double *U, size_t out, double *V, size_t N) {
    pair p = {out, N, (size_t)m->rank, U, V};
    load_up(&p, &m->B, 0);
    if (m->mid.data) {
        lk_tensor down = m->A;
        down.ndim = 2;
        down.shape[1] = (int64_t)(lk_tensor_numel(&m->A) / (size_t)m->A.shape[0]);
        lk_status s = load_fold(&p, &m->mid, &down);
        if (s) return s;
    } else {
        load(&m->A, 0, p.r * N, V);
    }
    for (size_t i = 0; i < out * p.r; i++) U[i] *= coef;
    return LK_OK;
}

static lk_status put_loha(const lk_lora_module *m, double coef, double *U, size_t out, double *V, size_t N) {
    pair h1, h2;
    lk_status s = half(&h1, &m->w1a, &m->w1b, &m->t1, out, N);
    if (s) return s;
    if ((s = half(&h2, &m->w2a, &m->w2b, &m->t2, out, N))) {
        pair_free(&h1);
        return s;
    }
    for (size_t a = 0; a < h1.r; a++)
        for (size_t b = 0; b < h2.r; b++) {
            double *u = U + (a * h2.r + b) * out, *v = V + (a * h2.r + b) * N;
            for (size_t o = 0; o < out; o++) u[o] = coef * (h1.U[a * out + o] * h2.U[b * out + o]);
            for (size_t i = 0; i < N; i++) v[i] = h1.V[a * N + i] * h2.V[b * N + i];
        }
    pair_free(&h1);
    pair_free(&h2);
    return LK_OK;
}

static lk_status put_lokr(const lk_lora_module *m, double coef, double *U, size_t out, double *V, size_t N) {
    size_t a1, b1, p1, c2, d2, p2;
    lokr_dims(m, &a1, &b1, &p1, &c2, &d2, &p2);
    pair f1, f2;
    lk_status s = m->w1.data ? full(&f1, &m->w1, a1, b1) : half(&f1, &m->w1a, &m->w1b, NULL, a1, b1);
    if (s) return s;
    s = m->w2.data ? full(&f2, &m->w2, c2, d2) : half(&f2, &m->w2a, &m->w2b, &m->t2, c2, d2);
    if (s) {
        pair_free(&f1);
        return s;
    }
    for (size_t a = 0; a < p1; a++)
        for (size_t b = 0; b < p2; b++) {
            double *u = U + (a * p2 + b) * out, *v = V + (a * p2 + b) * N;
            for (size_t i = 0; i < a1; i++)
                for (size_t k = 0; k < c2; k++) u[i * c2 + k] = coef * (f1.U[a * a1 + i] * f2.U[b * c2 + k]);
            for (size_t j = 0; j < b1; j++)
                for (size_t l = 0; l < d2; l++) v[j * d2 + l] = f1.V[a * b1 + j] * f2.V[b * d2 + l];
        }
    pair_free(&f1);
    pair_free(&f2);
    return LK_OK;
}

lk_status lk_alg_lowrank_put(const lk_lora_module *m, double coef, double *U, size_t out, double *V, size_t N) {
    switch (m->algo) {
    case LK_ALGO_LORA: return put_lora(m, coef, U, out, V, N);
    case LK_ALGO_LOHA: return put_loha(m, coef, U, out, V, N);
    case LK_ALGO_LOKR: return put_lokr(m, coef, U, out, V, N);
    default: return lk_error(LK_ERR_UNSUPPORTED, "%s: no low-rank form", m->module);
    }
}
