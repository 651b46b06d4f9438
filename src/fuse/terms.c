/* terms.c — the terms that are not a plain LoRA product: LoHa (Hadamard),
 * LoKr (Kronecker) and dense deltas (LyCORIS full, .diff), next to LoRA
 * terms on the same weight. One delta API (lk_fuse_delta_prepare / _rows,
 * which FP8 weights, DoRA and replacements also use) and one row driver
 * (lk_fuse_tensor_terms, what lk_fuse_tensor hands such term lists to).
 *
 * THE CANONICAL ARITHMETIC of a weight element (o, j) of an out x in weight
 * (a conv weight [out, in, kh, kw] is out x (in kh kw), row-major), with
 * "acc" the accumulator: f32 for BF16 / F16 / FP8 weights, f64 for F32:
 *  1. The LoRA terms (conv LoRA and Tucker LoCon included: their factors
 *     are reshaped / folded into a plain r x in "A" by the adapter layer)
 *     form kernel.c's stacked chain d0 over all their ranks, in term order.
 *     Without LoRA terms d0 = +0.
 *  2. Every other term t, in term order, adds its own delta x_t:
 *     d = acc(d + x_t), one rounding per term. x_t is:
 *       dense:  x = acc(s_t * D[o, j])                 (s_t * D in f64, rounded once into acc)
 *       LoHa:   x = acc(P1 * P2), P1 and P2 each kernel.c's chain of one
 *               term: P1 = sum_k acc(s_t * w1a[o,k]) * w1b[k,j],
 *               P2 = sum_k w2a[o,k] * w2b[k,j] (fma chains in acc, k ascending)
 *       LoKr:   x = acc(W1s[i, q] * W2[k, m]) with o = i c + k, j = q D + m,
 *               W1 = w1a @ w1b (or lokr_w1), W2 = w2a @ w2b (or lokr_w2, or
 *               the Tucker rebuild folded into w2b by the adapter layer),
 *               each product an fma chain in f64 (k ascending, from the
 *               first product), then W1s = acc(s_t * W1), W2 = acc(W2).
 *  3. W + d is rounded once into the weight's dtype exactly as kernel.c
 *     step 4 rounds it (round to odd in acc, then to nearest-even), with the
 *     kernel's NaN and non-finite rules.
 * So the bytes depend only on the terms and their order (callers pass the
 * canonical order), never on threads, row blocks or the CPU path (every
 * operation is a single IEEE operation; the LoRA chains are kernel.c's,
 * identical on every path). What it guarantees: for F32 weights each
 * factor product is accurate to a few f64 ulps and the result is within
 * 1 ulp of W + exact delta unless the delta cancels to below 2^-29 of its
 * terms; for BF16 / F16 / FP8 the f32 steps carry 16 (13) more bits than the
 * weight, so the one final rounding dominates. tests/test_lycoris.c and
 * test_fuse_kernel.c (test_terms_paths, every CPU path and 1-3 threads)
 * check these chains bit for bit against independent scalar replays, and
 * test_lycoris(_parity).c within 1 ulp of a float64 reference.
 *
 * HOW (speed): a weight whose only live term is one LoHa, LoKr or dense
 * term goes, on the AVX-512 paths, to kernel_avx512.c's fused rows: the
 * delta of each 64-column row segment is made in registers (LoHa: both
 * chains for 3 rows x 64 columns in 24 zmm, column tiles of both A's kept
 * in L1; LoKr: W1s[i, q] times a row of W2; dense: one streaming pass over
 * W and D) and rounded by the LoRA block's epilogue, so no delta is ever
 * stored. Any other mix of terms, and the AVX2 / portable paths, stage a
 * block's delta in a buffer (lk_fuse_delta_rows) and round it with the
 * vector code below: the same operations, so the same bytes. */
/* No FMA contraction anywhere here (the chains above are separate
 * roundings): the fuse layer is built with -ffp-contract=off
 * (CMakeLists.txt; tests/fuzz/CMakeLists.txt for clang), and the AVX2
 * clones are built without the "fma" feature, so no compiler can fuse a
 * multiply and an add here even when the flag is lost. */

#include "lorakit/fuse.h"
#include "lorakit/alloc.h"
#include "core/alloc.h"
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

#define LK_AI static inline __attribute__((always_inline))
#define BLOCK_ELEMS ((size_t)1 << 14) /* a worker's block of rows: ~64 KiB of f32 delta, kept in L2 */
#define CONV_CHUNK 512                /* dense: columns converted at a time */
#define FUSED_ROWS 24                 /* the fused rows' block (fused_rows) */

typedef struct xterm {
    lk_term_kind kind;
    double scale;
    const lk_tensor *dense;  /* dense */
    lk_kdelta *p1, *p2;      /* LoHa: the two products */
    void *w1, *w2;           /* LoKr: acc(s W1) a x b, acc(W2) c x D */
    size_t a, b, c, D;
} xterm;

struct lk_delta_prep {
    int wide;
    size_t O, I, row0, rows;
    lk_kdelta *lora; /* the LoRA terms' stacked chain, or NULL */
    xterm *x;
    size_t nx;
    int hada;
    size_t live;      /* terms with a non-zero scale */
    size_t lora_live; /* LoRA terms among them */
};

/* ---- validation ---- */

static lk_status check_dense(const lk_tensor *t, size_t ti, size_t numel, const char *name) {
    if (!t) return lk_error(LK_ERR_ARG, "%s: term %zu: the dense delta is NULL", name, ti);
    if (!lk_dtype_is_fusable(t->dtype))
        return lk_error(LK_ERR_DTYPE, "%s: term %zu: the dense delta has dtype %s; only F32, F16 and BF16 can be fused",
                        name, ti, lk_dtype_name(t->dtype));
    if (lk_tensor_numel(t) != numel)
        return lk_error(LK_ERR_SHAPE, "%s: term %zu: the dense delta has %zu elements but the weight %zu", name, ti,
                        lk_tensor_numel(t), numel);
    if (!t->data && numel) return lk_error(LK_ERR_ARG, "%s: term %zu: the dense delta has no data", name, ti);
    return LK_OK;
}

/* One product B @ A (A may be NULL: B is the matrix); *m x *n its shape. */
static lk_status check_product(const lk_tensor *A, const lk_tensor *B, const char *what, size_t ti, const char *name,
                               int64_t *m, int64_t *n) {
    char an[16], bn[16];
    snprintf(an, sizeof an, "A%s", what);
    snprintf(bn, sizeof bn, "B%s", what);
    lk_status s = lk_fuse_check_factor(B, bn, name, ti);
    if (s) return s;
    if (!A) {
        *m = B->shape[0];
        *n = B->shape[1];
        return LK_OK;
    }
    if ((s = lk_fuse_check_factor(A, an, name, ti))) return s;
    if (B->shape[1] != A->shape[0])
        return lk_error(LK_ERR_SHAPE, "%s: term %zu: %s is %lldx%lld and %s is %lldx%lld (ranks differ)", name, ti, bn,
                        (long long)B->shape[0], (long long)B->shape[1], an, (long long)A->shape[0],
                        (long long)A->shape[1]);
    *m = B->shape[0];
    *n = A->shape[1];
    return LK_OK;
}

static lk_status check_term(int64_t out, int64_t in, const lk_fuse_term *t, size_t ti, const char *name) {
    if (!isfinite(t->scale)) return lk_error(LK_ERR_NONFINITE, "%s: term %zu: scale is %g", name, ti, t->scale);
    int64_t m, n, m2, n2;
    lk_status s;
    switch (t->kind) {
    case LK_TERM_LORA:
        if (!t->A) return lk_error(LK_ERR_ARG, "%s: term %zu: a vector term (no A) on a 2-D weight", name, ti);
        return LK_OK; /* kernel.c checks it */
    case LK_TERM_DENSE: return check_dense(t->B, ti, (size_t)out * (size_t)in, name);
    case LK_TERM_HADA:
        if (!t->A || !t->A2) return lk_error(LK_ERR_ARG, "%s: term %zu: a Hadamard term needs A and A2", name, ti);
        if ((s = check_product(t->A, t->B, "", ti, name, &m, &n)) ||
            (s = check_product(t->A2, t->B2, "2", ti, name, &m2, &n2)))
            return s;
        if (m != out || n != in || m2 != out || n2 != in)
            return lk_error(LK_ERR_SHAPE, "%s: term %zu: the Hadamard factors give %lldx%lld and %lldx%lld but the "
                            "weight is %lldx%lld", name, ti, (long long)m, (long long)n, (long long)m2, (long long)n2,
                            (long long)out, (long long)in);
        return LK_OK;
    case LK_TERM_KRON:
        if ((s = check_product(t->A, t->B, "", ti, name, &m, &n)) ||
            (s = check_product(t->A2, t->B2, "2", ti, name, &m2, &n2)))
            return s;
        if (m * m2 != out || n * n2 != in)
            return lk_error(LK_ERR_SHAPE, "%s: term %zu: kron of %lldx%lld and %lldx%lld is %lldx%lld but the weight "
                            "is %lldx%lld", name, ti, (long long)m, (long long)n, (long long)m2, (long long)n2,
                            (long long)(m * m2), (long long)(n * n2), (long long)out, (long long)in);
        return LK_OK;
    case LK_TERM_OFT:
    case LK_TERM_WLORA: /* lk_fuse_tensor and lk_fuse_fp8 turn these into deltas from the weight's values */
        return lk_error(LK_ERR_UNSUPPORTED, "%s: term %zu: an %s term reads the weight itself; it cannot be combined "
                        "with a replacement or DoRA on the same weight", name, ti,
                        t->kind == LK_TERM_OFT ? "OFT / BOFT" : "GLoRA");
    }
    return lk_error(LK_ERR_ARG, "%s: term %zu: unknown kind %d", name, ti, (int)t->kind);
}

/* ---- preparation ---- */

/* Row r of t (n elements from element off) as doubles; tmp holds n floats. */
static void load_f64(double *dst, const lk_tensor *t, size_t off, size_t n, float *tmp) {
    if (t->dtype == LK_DTYPE_F64) {
        memcpy(dst, (const double *)t->data + off, n * sizeof *dst);
        return;
    }
    lk_to_f32(tmp, (const char *)t->data + off * lk_dtype_size(t->dtype), t->dtype, n);
    for (size_t i = 0; i < n; i++) dst[i] = tmp[i];
}

/* The rows of an fma chain: row[j] = b[0] a[0][j], then fma(b[k], a[k][j], row[j]). */
LK_AI void chain_rows64(double *dst, const double *b, const double *a, size_t r, size_t n) {
    for (size_t j = 0; j < n; j++) dst[j] = b[0] * a[j];
    for (size_t k = 1; k < r; k++)
        for (size_t j = 0; j < n; j++) dst[j] = fma(b[k], a[k * n + j], dst[j]);
}
static void chain64_base(double *dst, const double *b, const double *a, size_t r, size_t n) {
    chain_rows64(dst, b, a, r, n);
}
#ifdef LK_KERNEL_X86
/* fma() inlined as the instruction (correctly rounded either way: the same bits) */
__attribute__((target("avx2,fma"))) static void chain64_fma(double *dst, const double *b, const double *a, size_t r,
                                                           size_t n) {
    chain_rows64(dst, b, a, r, n);
}
#endif

/* dst (m x n, f64) = B @ A as fma chains, k ascending from the first
 * product; A NULL: dst = B. */
static lk_status product_f64(double *dst, const lk_tensor *B, const lk_tensor *A, const char *name) {
    const size_t m = (size_t)B->shape[0], r = (size_t)B->shape[1], n = A ? (size_t)A->shape[1] : r;
    size_t big = n > r ? n : r;
    /* a row in f32, A in f64 (when given), a row of B in f64: one allocation */
    size_t na = 0;
    lk_carve cv = {.overflow = A && !lk_checked_mul(r, n, &na)};
    const size_t o_tmp = LK_CARVE(&cv, big, float), o_a = LK_CARVE(&cv, na, double), o_b = LK_CARVE(&cv, r, double);
    unsigned char *mem = lk_carve_alloc(&cv);
    if (!mem) return lk_error(LK_ERR_NOMEM, "%s: out of memory for a Kronecker factor", name);
    float *tmp = (float *)(void *)(mem + o_tmp);
    double *a = A ? (double *)(void *)(mem + o_a) : NULL, *b = (double *)(void *)(mem + o_b);
    if (!A) {
        for (size_t i = 0; i < m; i++) load_f64(dst + i * n, B, i * n, n, tmp);
    } else {
        for (size_t k = 0; k < r; k++) load_f64(a + k * n, A, k * n, n, tmp);
        const int fast = strcmp(lk_fuse_kernel_path(), "portable") != 0;
        for (size_t i = 0; i < m; i++) {
            load_f64(b, B, i * r, r, tmp);
#ifdef LK_KERNEL_X86
            if (fast) chain64_fma(dst + i * n, b, a, r, n);
            else
#endif
                chain64_base(dst + i * n, b, a, r, n);
            (void)fast;
        }
    }
    lk_free(mem);
    return LK_OK;
}

/* LoKr: the two factors in the accumulator's precision. */
static lk_status prep_kron(xterm *x, const lk_fuse_term *t, int wide, const char *name) {
    x->a = (size_t)t->B->shape[0];
    x->b = t->A ? (size_t)t->A->shape[1] : (size_t)t->B->shape[1];
    x->c = (size_t)t->B2->shape[0];
    x->D = t->A2 ? (size_t)t->A2->shape[1] : (size_t)t->B2->shape[1];
    const size_t n1 = x->a * x->b, n2 = x->c * x->D, vsz = wide ? sizeof(double) : sizeof(float);
    lk_carve cv = {0}; /* the two f64 products: one scratch allocation */
    const size_t o1 = LK_CARVE(&cv, n1, double), o2 = LK_CARVE(&cv, n2, double);
    unsigned char *f = lk_carve_alloc(&cv);
    double *f1 = f ? (double *)(void *)(f + o1) : NULL, *f2 = f ? (double *)(void *)(f + o2) : NULL;
    x->w1 = lk_malloc(n1 * vsz);
    x->w2 = lk_malloc(n2 * vsz);
    lk_status s = LK_OK;
    if (!f || !x->w1 || !x->w2) s = lk_error(LK_ERR_NOMEM, "%s: out of memory for a Kronecker term", name);
    if (!s) s = product_f64(f1, t->B, t->A, name);
    if (!s) s = product_f64(f2, t->B2, t->A2, name);
    if (!s) {
        for (size_t i = 0; i < n1; i++) {
            double v = t->scale * f1[i];
            if (wide) ((double *)x->w1)[i] = v;
            else ((float *)x->w1)[i] = (float)v;
        }
        for (size_t i = 0; i < n2; i++) {
            if (wide) ((double *)x->w2)[i] = f2[i];
            else ((float *)x->w2)[i] = (float)f2[i];
        }
    }
    lk_free(f);
    return s;
}

void lk_fuse_delta_free(lk_delta_prep *p) {
    if (!p) return;
    lk_kdelta_free(p->lora);
    for (size_t i = 0; i < p->nx; i++) {
        lk_kdelta_free(p->x[i].p1);
        lk_kdelta_free(p->x[i].p2);
        lk_free(p->x[i].w1);
        lk_free(p->x[i].w2);
    }
    lk_free(p->x);
    lk_free(p);
}

lk_status lk_fuse_delta_prepare(int wide, int64_t out, int64_t in, int64_t row0, int64_t rows,
                                const lk_fuse_term *terms, size_t n_terms, const char *name, lk_delta_prep **pp) {
    if (!name) name = "(tensor)";
    *pp = NULL;
    lk_status st = lk_fuse_check_rows(out, in, row0, rows, name);
    if (st) return st;
    if (n_terms && !terms) return lk_error(LK_ERR_ARG, "%s: NULL terms", name);
    size_t nl = 0, nx = 0, live = 0, lora_live = 0;
    for (size_t t = 0; t < n_terms; t++) {
        st = check_term(out, in, &terms[t], t, name);
        if (st) return st;
        if (terms[t].kind == LK_TERM_LORA) nl++;
        else if (terms[t].scale != 0.0) nx++;
        live += terms[t].scale != 0.0;
        lora_live += terms[t].kind == LK_TERM_LORA && terms[t].scale != 0.0;
    }
    lk_delta_prep *p = lk_calloc(1, sizeof *p);
    lk_fuse_term *lt = lk_malloc((nl ? nl : 1) * sizeof *lt);
    if (!p || !lt || !(p->x = lk_calloc(nx ? nx : 1, sizeof *p->x))) {
        lk_free(lt);
        lk_fuse_delta_free(p);
        return lk_error(LK_ERR_NOMEM, "%s: out of memory", name);
    }
    p->wide = wide;
    p->live = live;
    p->lora_live = lora_live;
    p->O = (size_t)out;
    p->I = (size_t)in;
    p->row0 = (size_t)row0;
    p->rows = (size_t)rows;
    size_t k = 0;
    for (size_t t = 0; t < n_terms; t++)
        if (terms[t].kind == LK_TERM_LORA) lt[k++] = terms[t];
    lk_status s = nl ? lk_kdelta_prepare(wide, out, in, row0, rows, lt, nl, name, &p->lora) : LK_OK;
    lk_free(lt);
    for (size_t t = 0; t < n_terms && !s; t++) {
        const lk_fuse_term *tm = &terms[t];
        if (tm->kind == LK_TERM_LORA || tm->scale == 0.0) continue;
        xterm *x = &p->x[p->nx++];
        x->kind = tm->kind;
        x->scale = tm->scale;
        if (tm->kind == LK_TERM_DENSE) {
            x->dense = tm->B;
        } else if (tm->kind == LK_TERM_HADA) {
            const lk_fuse_term t1 = {.A = tm->A, .B = tm->B, .scale = tm->scale};
            const lk_fuse_term t2 = {.A = tm->A2, .B = tm->B2, .scale = 1.0};
            s = lk_kdelta_prepare(wide, out, in, row0, rows, &t1, 1, name, &x->p1);
            if (!s) s = lk_kdelta_prepare(wide, out, in, row0, rows, &t2, 1, name, &x->p2);
            p->hada = 1;
        } else {
            s = prep_kron(x, tm, wide, name);
        }
    }
    if (s) {
        lk_fuse_delta_free(p);
        return s;
    }
    *pp = p;
    return LK_OK;
}

const lk_kdelta *lk_fuse_delta_parts(const lk_delta_prep *p, lk_delta_xpart *x, size_t max, size_t *nx) {
    *nx = p->nx;
    for (size_t i = 0; i < p->nx && i < max; i++) {
        const xterm *t = &p->x[i];
        x[i] = (lk_delta_xpart){.kind = t->kind, .scale = t->scale, .dense = t->dense, .p1 = t->p1, .p2 = t->p2,
                                .w1 = t->w1, .w2 = t->w2, .a = t->a, .b = t->b, .c = t->c, .D = t->D};
    }
    return p->lora;
}

size_t lk_fuse_delta_scratch(const lk_delta_prep *p, size_t n) {
    if (!p || !p->hada) return 0;
    return 2 * n * p->I * (p->wide ? sizeof(double) : sizeof(float)) + 64;
}

/* ---- the rows ---- */


LK_AI void add_dense(const xterm *x, int wide, void *d, size_t ld, size_t I, size_t row, size_t n) {
    const lk_dtype dt = x->dense->dtype;
    const size_t esz = lk_dtype_size(dt);
    float tmp[CONV_CHUNK];
    for (size_t i = 0; i < n; i++)
        for (size_t c0 = 0; c0 < I; c0 += CONV_CHUNK) {
            const size_t len = I - c0 < CONV_CHUNK ? I - c0 : CONV_CHUNK;
            lk_to_f32(tmp, (const char *)x->dense->data + ((row + i) * I + c0) * esz, dt, len);
            if (wide) {
                double *r = (double *)d + i * ld + c0;
                for (size_t j = 0; j < len; j++) r[j] = r[j] + x->scale * (double)tmp[j];
            } else if (x->scale == 1.0) { /* acc(1 * D) is D itself: the same bits without the f64 round trip */
                float *r = (float *)d + i * ld + c0;
                for (size_t j = 0; j < len; j++) r[j] = r[j] + tmp[j];
            } else {
                float *r = (float *)d + i * ld + c0;
                for (size_t j = 0; j < len; j++) r[j] = r[j] + (float)(x->scale * (double)tmp[j]);
            }
        }
}

/* d += P1 * P2 of rows [row, row + n), each product one rounding in T. */
#define HADA_ROWS(T)                                                                                         \
    do {                                                                                                     \
        T *s1 = (T *)al, *s2 = s1 + n * I;                                                                   \
        lk_kdelta_rows(x->p1, s1, I, row, n);                                                                \
        lk_kdelta_rows(x->p2, s2, I, row, n);                                                                \
        for (size_t i = 0; i < n; i++) {                                                                     \
            T *r = (T *)d + i * ld;                                                                          \
            const T *a = s1 + i * I, *b = s2 + i * I;                                                        \
            for (size_t j = 0; j < I; j++) r[j] = r[j] + a[j] * b[j];                                        \
        }                                                                                                    \
    } while (0)

LK_AI void add_hada(const xterm *x, int wide, void *d, size_t ld, size_t I, size_t row, size_t n, void *scratch) {
    unsigned char *al = (unsigned char *)scratch + ((64u - ((uintptr_t)scratch & 63u)) & 63u);
    if (wide) HADA_ROWS(double);
    else HADA_ROWS(float);
}
#undef HADA_ROWS

LK_AI void add_kron(const xterm *x, int wide, void *d, size_t ld, size_t row, size_t n) {
    const size_t b = x->b, c = x->c, D = x->D;
    for (size_t i = 0; i < n; i++) {
        const size_t o = row + i, ii = o / c, kk = o % c;
        if (wide) {
            const double *w1 = (const double *)x->w1 + ii * b, *w2 = (const double *)x->w2 + kk * D;
            for (size_t q = 0; q < b; q++) {
                double *r = (double *)d + i * ld + q * D;
                const double w = w1[q];
                for (size_t m = 0; m < D; m++) r[m] = r[m] + w * w2[m];
            }
        } else {
            const float *w1 = (const float *)x->w1 + ii * b, *w2 = (const float *)x->w2 + kk * D;
            for (size_t q = 0; q < b; q++) {
                float *r = (float *)d + i * ld + q * D;
                const float w = w1[q];
                for (size_t m = 0; m < D; m++) r[m] = r[m] + w * w2[m];
            }
        }
    }
}

LK_AI void add_terms(const lk_delta_prep *p, void *d, size_t ld, size_t row, size_t n, void *scratch) {
    for (size_t t = 0; t < p->nx; t++) {
        const xterm *x = &p->x[t];
        if (x->kind == LK_TERM_DENSE) add_dense(x, p->wide, d, ld, p->I, row, n);
        else if (x->kind == LK_TERM_HADA) add_hada(x, p->wide, d, ld, p->I, row, n, scratch);
        else add_kron(x, p->wide, d, ld, row, n);
    }
}

static void add_terms_base(const lk_delta_prep *p, void *d, size_t ld, size_t row, size_t n, void *scratch) {
    add_terms(p, d, ld, row, n, scratch);
}
#ifdef LK_KERNEL_X86
/* The same operations with AVX2 vectors (no FMA: nothing to contract
 * into), so the bytes are those of the base version. */
__attribute__((target("avx2"))) static void add_terms_avx2(const lk_delta_prep *p, void *d, size_t ld, size_t row,
                                                              size_t n, void *scratch) {
    add_terms(p, d, ld, row, n, scratch);
}
#endif

void lk_fuse_delta_rows(const lk_delta_prep *p, void *delta, size_t ld, size_t row, size_t n, void *scratch) {
    const size_t vsz = p->wide ? sizeof(double) : sizeof(float);
    if (p->lora) lk_kdelta_rows(p->lora, delta, ld, row, n);
    else
        for (size_t i = 0; i < n; i++) memset((char *)delta + i * ld * vsz, 0, p->I * vsz);
    if (!p->nx) return;
    fenv_t saved;
    fegetenv(&saved);
    fesetenv(FE_DFL_ENV);
#ifdef LK_KERNEL_X86
    if (strcmp(lk_fuse_kernel_path(), "portable")) add_terms_avx2(p, delta, ld, row, n, scratch);
    else
#endif
        add_terms_base(p, delta, ld, row, n, scratch);
    fesetenv(&saved);
}

/* ---- the delta alone into a buffer (fuse/fuse.h) ---- */

static lk_status fuse_delta(void *delta, int wide, size_t ld, int64_t out, int64_t in, int64_t row0, int64_t rows,
                            const lk_fuse_term *terms, size_t n_terms, const char *name) {
    if (!name) name = "(tensor)";
    if (rows > 0 && (!delta || ld < (size_t)(in > 0 ? in : 0)))
        return lk_error(LK_ERR_ARG, "%s: NULL delta or row stride below %lld", name, (long long)in);
    lk_delta_prep *p;
    lk_status st = lk_fuse_delta_prepare(wide, out, in, row0, rows, terms, n_terms, name, &p);
    if (st) return st;
    size_t sb = rows > 0 ? lk_fuse_delta_scratch(p, (size_t)rows) : 0;
    void *scratch = sb ? lk_malloc(sb) : NULL;
    if (sb && !scratch) {
        lk_fuse_delta_free(p);
        return lk_error(LK_ERR_NOMEM, "%s: out of memory for %zu bytes of scratch", name, sb);
    }
    if (rows > 0) lk_fuse_delta_rows(p, delta, ld, (size_t)row0, (size_t)rows, scratch);
    lk_free(scratch);
    lk_fuse_delta_free(p);
    return LK_OK;
}

lk_status lk_fuse_delta_f32(float *delta, size_t ld, int64_t out, int64_t in, int64_t row0, int64_t rows,
                            const lk_fuse_term *terms, size_t n_terms, const char *name) {
    return fuse_delta(delta, 0, ld, out, in, row0, rows, terms, n_terms, name);
}

lk_status lk_fuse_delta_f64(double *delta, size_t ld, int64_t out, int64_t in, int64_t row0, int64_t rows,
                            const lk_fuse_term *terms, size_t n_terms, const char *name) {
    return fuse_delta(delta, 1, ld, out, in, row0, rows, terms, n_terms, name);
}

/* ---- the row driver ---- */

typedef struct tjob {
    void *w_out;
    const void *w_in;
    lk_dtype dt;
    size_t O, I, rb, n_blocks;
    const lk_delta_prep *prep;
    lk_xrows_fn xrows; /* the fused rows of one term alone (AVX-512), else NULL: the staged rows */
    lk_xjob x;
    atomic_size_t next;
} tjob;

typedef struct tworker {
    tjob *job;
    void *d, *scratch;
    float *wv, *rv;
    lk_kworker kw; /* the first element made non-finite (kw.job: &job->x.k) */
} tworker;

static void note_bad(tworker *wk, size_t at, double w, double r) {
    if (at < wk->kw.bad_at) {
        wk->kw.bad_at = at;
        wk->kw.bad_w = w;
        wk->kw.bad_r = r;
    }
}

/* kernel_scalar.h's scalar_round_f32 / scalar_round_f64_to_f32, eight (four)
 * lanes at a time with the compilers' vector extensions (comparisons give
 * lane masks, the selects become masks): the same IEEE operations and bit
 * steps, so the same bits; the tail goes through the scalar definitions. */
typedef float lk_v8f __attribute__((vector_size(32)));
typedef uint32_t lk_v8u __attribute__((vector_size(32)));
typedef int32_t lk_v8i __attribute__((vector_size(32)));
typedef double lk_v4d __attribute__((vector_size(32)));
typedef uint64_t lk_v4ul __attribute__((vector_size(32)));
typedef int64_t lk_v4l __attribute__((vector_size(32)));
typedef float lk_v4f __attribute__((vector_size(16)));
typedef uint32_t lk_v4u __attribute__((vector_size(16)));
typedef int32_t lk_v4i __attribute__((vector_size(16)));

LK_AI void round_row32(float *rv, const float *wv, const float *d, size_t n) {
    size_t j = 0;
    for (; j + 8 <= n; j += 8) {
        lk_v8f w, dd;
        memcpy(&w, wv + j, sizeof w);
        memcpy(&dd, d + j, sizeof dd);
        const lk_v8f s = w + dd, bb = s - w, e = (w - (s - bb)) + (dd - bb);
        const lk_v8u uw = (lk_v8u)w, ue = (lk_v8u)e;
        lk_v8u us = (lk_v8u)s;
        const lk_v8u fin = (lk_v8u)((us & 0x7f800000u) != 0x7f800000u);
        const lk_v8u inexact = (lk_v8u)(e != 0.0f), even = (lk_v8u)((us & 1u) == 0u);
        const lk_v8u step = 1u - (((us ^ ue) >> 31) << 1);
        us += fin & inexact & even & step;
        const lk_v8u mw = (lk_v8u)((uw & 0x7fffffffu) > 0x7f800000u);
        const lk_v8u mr = (lk_v8u)((us & 0x7fffffffu) > 0x7f800000u) & ~mw;
        const lk_v8u r = (mw & (uw | 0x00400000u)) | (mr & 0x7fc00000u) | (~(mw | mr) & us);
        memcpy(rv + j, &r, sizeof r);
    }
    for (; j < n; j++) rv[j] = scalar_round_f32(wv[j], d[j]);
}

LK_AI void round_row64(uint32_t *o, const uint32_t *w, const double *d, size_t n) {
    size_t j = 0;
    for (; j + 4 <= n; j += 4) {
        lk_v4u uw;
        lk_v4d dd;
        memcpy(&uw, w + j, sizeof uw);
        memcpy(&dd, d + j, sizeof dd);
        const lk_v4d x = __builtin_convertvector((lk_v4f)uw, lk_v4d);
        const lk_v4d s = x + dd;
        lk_v4ul us = (lk_v4ul)s;
        /* as for BF16: the odd step matters only on an f32 tie (the low 29
         * bits 0x10000000) or below f32's normal range (more bits dropped) */
        const lk_v4ul slow = (lk_v4ul)((us & 0x1fffffffull) == 0x10000000ull) |
                             (lk_v4ul)((us & 0x7ff0000000000000ull) < 0x3810000000000000ull);
        if (slow[0] | slow[1] | slow[2] | slow[3]) {
            const lk_v4d bb = s - x, e = (x - (s - bb)) + (dd - bb);
            const lk_v4ul ue = (lk_v4ul)e;
            const lk_v4ul fin = (lk_v4ul)((us & 0x7ff0000000000000ull) != 0x7ff0000000000000ull);
            const lk_v4ul inexact = (lk_v4ul)(e != 0.0), even = (lk_v4ul)((us & 1u) == 0u);
            us += fin & inexact & even & (1u - (((us ^ ue) >> 63) << 1));
        }
        const lk_v4u ur = (lk_v4u)__builtin_convertvector((lk_v4d)us, lk_v4f); /* RNE, the one rounding */
        const lk_v4u mw = (lk_v4u)((uw & 0x7fffffffu) > 0x7f800000u);
        const lk_v4u mr = (lk_v4u)((ur & 0x7fffffffu) > 0x7f800000u) & ~mw;
        const lk_v4u r = (mw & (uw | 0x00400000u)) | (mr & 0x7fc00000u) | (~(mw | mr) & ur);
        memcpy(o + j, &r, sizeof r);
    }
    for (; j < n; j++) o[j] = scalar_round_f64_to_f32(w[j], d[j]);
}

typedef uint16_t lk_v8h __attribute__((vector_size(16)));

/* A BF16 row in one pass: decode, round_row32's steps, dtype.c's RNE to
 * BF16 (NaN kept quiet), store; *bad |= a finite weight stored as Inf/NaN. */
LK_AI void round_row_bf16(uint16_t *dst, const uint16_t *src, const float *d, size_t n, uint32_t *bad) {
    size_t j = 0;
    lk_v8u anyv = {0, 0, 0, 0, 0, 0, 0, 0};
    for (; j + 8 <= n; j += 8) {
        lk_v8h h;
        lk_v8f dd;
        memcpy(&h, src + j, sizeof h);
        memcpy(&dd, d + j, sizeof dd);
        const lk_v8u uw = __builtin_convertvector(h, lk_v8u) << 16;
        const lk_v8f w = (lk_v8f)uw;
        const lk_v8f s = w + dd;
        lk_v8u us = (lk_v8u)s;
        /* Round to odd moves s by one f32 unit at most, which changes its
         * BF16 rounding only when s's low 16 bits are a tie (0x8000): the
         * exact error (TwoSum) is needed only for such a group of lanes. */
        const lk_v8u tie = (lk_v8u)((us & 0xffffu) == 0x8000u);
        uint32_t any_tie = 0;
        for (int k = 0; k < 8; k++) any_tie |= tie[k];
        if (any_tie) {
            const lk_v8f bb = s - w, e = (w - (s - bb)) + (dd - bb);
            const lk_v8u ue = (lk_v8u)e;
            const lk_v8u fin = (lk_v8u)((us & 0x7f800000u) != 0x7f800000u);
            const lk_v8u inexact = (lk_v8u)(e != 0.0f), even = (lk_v8u)((us & 1u) == 0u);
            us += fin & inexact & even & (1u - (((us ^ ue) >> 31) << 1));
        }
        const lk_v8u mw = (lk_v8u)((uw & 0x7fffffffu) > 0x7f800000u);
        const lk_v8u mr = (lk_v8u)((us & 0x7fffffffu) > 0x7f800000u) & ~mw;
        const lk_v8u r = (mw & (uw | 0x00400000u)) | (mr & 0x7fc00000u) | (~(mw | mr) & us);
        const lk_v8u isnan = (lk_v8u)((r & 0x7fffffffu) > 0x7f800000u), t = r >> 16;
        const lk_v8u q = t | ((lk_v8u)((t & 0x7fu) == 0u) & 0x40u);
        const lk_v8u o = (isnan & q) | (~isnan & ((r + 0x7fffu + ((r >> 16) & 1u)) >> 16));
        anyv |= (lk_v8u)((uw & 0x7f800000u) != 0x7f800000u) & (lk_v8u)((o & 0x7f80u) == 0x7f80u);
        const lk_v8h oh = __builtin_convertvector(o, lk_v8h);
        memcpy(dst + j, &oh, sizeof oh);
    }
    uint32_t any = 0;
    for (int k = 0; k < 8; k++) any |= anyv[k];
    for (; j < n; j++) {
        float w, r, back;
        lk_to_f32(&w, src + j, LK_DTYPE_BF16, 1);
        r = scalar_round_f32(w, d[j]);
        lk_from_f32(dst + j, &r, LK_DTYPE_BF16, 1);
        lk_to_f32(&back, dst + j, LK_DTYPE_BF16, 1);
        any |= isfinite(w) && !isfinite(back);
    }
    *bad |= any;
}

static void bf16_base(uint16_t *dst, const uint16_t *src, const float *d, size_t n, uint32_t *bad) {
    round_row_bf16(dst, src, d, n, bad);
}
#ifdef LK_KERNEL_X86
__attribute__((target("avx2"))) static void bf16_avx2(uint16_t *dst, const uint16_t *src, const float *d, size_t n,
                                                       uint32_t *bad) {
    round_row_bf16(dst, src, d, n, bad);
}
#endif

static void round32_base(float *rv, const float *wv, const float *d, size_t n) { round_row32(rv, wv, d, n); }
static void round64_base(uint32_t *o, const uint32_t *w, const double *d, size_t n) { round_row64(o, w, d, n); }
#ifdef LK_KERNEL_X86
__attribute__((target("avx2"))) static void round32_avx2(float *rv, const float *wv, const float *d, size_t n) {
    round_row32(rv, wv, d, n);
}
__attribute__((target("avx2"))) static void round64_avx2(uint32_t *o, const uint32_t *w, const double *d,
                                                            size_t n) {
    round_row64(o, w, d, n);
}
#endif

static void tblock(tworker *wk, size_t b, int fast) {
    tjob *j = wk->job;
    const size_t r0 = b * j->rb, n = j->O - r0 < j->rb ? j->O - r0 : j->rb, I = j->I, esz = lk_dtype_size(j->dt);
    if (j->xrows) {
        j->xrows(&j->x, &wk->kw, r0, r0 + n);
        return;
    }
    lk_fuse_delta_rows(j->prep, wk->d, I, r0, n, wk->scratch);
    for (size_t i = 0; i < n; i++) {
        const size_t o = r0 + i;
        const char *src = (const char *)j->w_in + o * I * esz;
        char *dst = (char *)j->w_out + o * I * esz;
        if (j->dt == LK_DTYPE_F32) {
            const double *d = (const double *)wk->d + i * I;
            uint32_t *w = (uint32_t *)wk->wv, *r = (uint32_t *)wk->rv;
            memcpy(w, src, I * 4);
#ifdef LK_KERNEL_X86
            if (fast) round64_avx2(r, w, d, I);
            else
#endif
                round64_base(r, w, d, I);
            memcpy(dst, r, I * 4);
            uint32_t any = 0;
            for (size_t c = 0; c < I; c++) any |= ((r[c] & 0x7f800000u) == 0x7f800000u) & ((w[c] & 0x7f800000u) != 0x7f800000u);
            for (size_t c = 0; any && c < I; c++)
                if (((r[c] & 0x7f800000u) == 0x7f800000u) && ((w[c] & 0x7f800000u) != 0x7f800000u))
                    note_bad(wk, o * I + c, (double)lk_u2f(w[c]), (double)lk_u2f(r[c]));
        } else if (j->dt == LK_DTYPE_BF16) {
            const float *d = (const float *)wk->d + i * I;
            uint32_t bad = 0;
            memcpy(wk->wv, src, I * 2); /* the row's old bits (w_out may be w_in), for a rare non-finite report */
#ifdef LK_KERNEL_X86
            if (fast) bf16_avx2((uint16_t *)dst, (const uint16_t *)wk->wv, d, I, &bad);
            else
#endif
                bf16_base((uint16_t *)dst, (const uint16_t *)wk->wv, d, I, &bad);
            for (size_t c = 0; bad && c < I; c++) {
                float w, r;
                lk_to_f32(&w, (const uint16_t *)wk->wv + c, LK_DTYPE_BF16, 1);
                lk_to_f32(&r, (const uint16_t *)dst + c, LK_DTYPE_BF16, 1);
                if (isfinite(w) && !isfinite(r)) note_bad(wk, o * I + c, (double)w, (double)r);
            }
        } else {
            const float *d = (const float *)wk->d + i * I;
            lk_to_f32(wk->wv, src, j->dt, I);
#ifdef LK_KERNEL_X86
            if (fast) round32_avx2(wk->rv, wk->wv, d, I);
            else
#endif
                round32_base(wk->rv, wk->wv, d, I);
            lk_from_f32(dst, wk->rv, j->dt, I);
            lk_to_f32(wk->rv, dst, j->dt, I); /* what was stored, for the non-finite check */
            const uint32_t *wb = (const uint32_t *)wk->wv, *rb = (const uint32_t *)wk->rv;
            uint32_t any = 0;
            for (size_t c = 0; c < I; c++) any |= ((rb[c] & 0x7f800000u) == 0x7f800000u) & ((wb[c] & 0x7f800000u) != 0x7f800000u);
            for (size_t c = 0; any && c < I; c++)
                if (isfinite(wk->wv[c]) && !isfinite(wk->rv[c]))
                    note_bad(wk, o * I + c, (double)wk->wv[c], (double)wk->rv[c]);
        }
    }
}

/* The fused rows for a weight whose only live term is one LoHa, LoKr or
 * dense term, on an AVX-512 path (x filled in); NULL otherwise (the staged
 * rows: any other mix of terms, or the AVX2 / portable paths, whose bytes
 * are the same). */
static lk_xrows_fn fused_rows(const lk_delta_prep *p, void *w_out, const void *w_in, lk_dtype dt, lk_xjob *x) {
    if (p->lora_live || p->nx != 1) return NULL;
#ifdef LK_KERNEL_X86
    const char *path = lk_fuse_kernel_path();
    lk_xrows_fn fn = !strcmp(path, "avx512bf16") ? lk_xrows_avx512bf16
                     : !strcmp(path, "avx512")   ? lk_xrows_avx512
                                                 : NULL;
    if (!fn) return NULL;
    const xterm *t = &p->x[0];
    const int wide = p->wide;
    const size_t pw = wide ? LK_PW64 : LK_PW32, vsz = wide ? sizeof(double) : sizeof(float);
    *x = (lk_xjob){.k = {.w_out = w_out, .w_in = w_in, .dt = (int)dt, .wide = wide, .out = p->O, .in = p->I},
                   .kind = (int)t->kind};
    if (t->kind == LK_TERM_DENSE) {
        x->dense = t->dense->data;
        x->ddt = (int)t->dense->dtype;
        x->scale = t->scale;
    } else if (t->kind == LK_TERM_HADA) {
        if (!lk_kdelta_panels(t->p1, &x->ap1, &x->bs1, &x->R1) || !lk_kdelta_panels(t->p2, &x->ap2, &x->bs2, &x->R2))
            return NULL;
        x->k.npan = (p->I + pw - 1) / pw;
        x->k.pan_tile = LK_TILE_BYTES / ((x->R1 + x->R2) * pw * vsz); /* both chains' A slices stay in L1 */
        if (x->k.pan_tile < 1) x->k.pan_tile = 1;
    } else {
        x->w1 = t->w1;
        x->w2 = t->w2;
        x->b = t->b;
        x->c = t->c;
        x->D = t->D;
    }
    return fn;
#else
    (void)w_out, (void)w_in, (void)dt, (void)x;
    return NULL;
#endif
}

static void *tworker_main(void *arg) {
    tworker *wk = arg;
    fesetenv(FE_DFL_ENV);
    const int fast = strcmp(lk_fuse_kernel_path(), "portable") != 0;
    for (;;) {
        size_t b = atomic_fetch_add(&wk->job->next, 1);
        if (b >= wk->job->n_blocks) break;
        tblock(wk, b, fast);
    }
    return NULL;
}

lk_status lk_fuse_tensor_terms(void *w_out, const void *w_in, lk_dtype dtype, int64_t out, int64_t in,
                               const lk_fuse_term *terms, size_t n_terms, const lk_fuse_opts *opts, const char *name) {
    /* lk_fuse_tensor checked the buffers, the dtype and the shape */
    const size_t O = (size_t)out, I = (size_t)in, numel = O * I;
    const int wide = dtype == LK_DTYPE_F32;
    const size_t vsz = wide ? sizeof(double) : sizeof(float);
    lk_delta_prep *prep;
    lk_status s = lk_fuse_delta_prepare(wide, out, in, 0, out, terms, n_terms, name, &prep);
    if (s) return s;
    if (!prep->live) { /* nothing to add: the bytes stay exactly as they are */
        lk_fuse_delta_free(prep);
        if (w_out != w_in) memmove(w_out, w_in, numel * lk_dtype_size(dtype));
        return LK_OK;
    }
    /* a thread per 2^18 elements at least: a small weight runs on this thread */
    int nw = lk_fuse_thread_count(opts, numel >> 18, 0);
    tjob job = {.w_out = w_out, .w_in = w_in, .dt = dtype, .O = O, .I = I, .prep = prep};
    job.xrows = fused_rows(prep, w_out, w_in, dtype, &job.x);
    /* staged: a block's delta (~64 KiB) in a buffer; fused: FUSED_ROWS rows
     * (a multiple of LoHa's 3-row block) share each tile of the factors */
    size_t rb = job.xrows ? FUSED_ROWS : BLOCK_ELEMS / I, per = (O + 4 * (size_t)nw - 1) / (4 * (size_t)nw);
    if (rb > per) rb = job.xrows ? (per + 2) / 3 * 3 : per;
    if (rb < 1) rb = 1;
    size_t n_blocks = (O + rb - 1) / rb;
    if ((size_t)nw > n_blocks) nw = (int)n_blocks;
    job.rb = rb;
    job.n_blocks = n_blocks;
    const size_t sb = job.xrows ? 0 : lk_fuse_delta_scratch(prep, rb);
    const size_t per_w = job.xrows ? 64 : rb * I * vsz + sb + 2 * I * sizeof(float) + 64;
    /* the workers, then their buffers (each per_w bytes): one allocation */
    unsigned char *mem = NULL;
    void *blk;
    if ((s = lk_fuse_workers(nw, sizeof(tworker), per_w, &blk, &mem, name, "row buffers"))) {
        lk_fuse_delta_free(prep);
        return s;
    }
    tworker *wk = blk;
    atomic_init(&job.next, 0);
    for (int t = 0; t < nw; t++) {
        unsigned char *m = mem + (size_t)t * per_w;
        wk[t] = (tworker){.job = &job, .kw = {.job = &job.x.k, .bad_at = SIZE_MAX}};
        if (job.xrows) continue; /* the fused rows need no buffers */
        wk[t].d = m;
        wk[t].scratch = sb ? m + rb * I * vsz : NULL;
        wk[t].wv = (float *)(m + rb * I * vsz + sb);
        wk[t].rv = wk[t].wv + I;
    }
    lk_fuse_run_threads(nw, tworker_main, wk, sizeof *wk);
    const lk_status v = lk_fuse_workers_verdict(wk, nw, sizeof *wk, offsetof(tworker, kw), I, opts, name);
    lk_free(wk);
    lk_fuse_delta_free(prep);
    return v;
}
