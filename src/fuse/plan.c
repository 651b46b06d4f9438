/* plan.c — what one model tensor becomes under a set of adapters: the one
 * per-key plan that the offline fuse (fuse_file.c) and the hot-swap tracker
 * (serve/tracker.c) both use, so the two give the same bytes.
 *
 * A key gets, from the adapters in canonical order: LoRA terms (2-D
 * weights; scale = (float)(strength * module scale), the one place this
 * product is formed), lora_B bias terms (the layer's 1-D bias: strength *
 * scale * lora_B.bias), a replacement (PEFT's modules_to_save and saved
 * biases) or a DoRA module. A key with only LoRA terms goes through the fuse
 * kernel. Everything else (rare, and where PEFT's result is defined in
 * exact arithmetic) is computed in double precision and rounded once into
 * the weight's dtype:
 *   replacement R at strength s:  W + s (R - W)            (R itself at s = 1)
 *   DoRA at strength s:           W + s (W' - W),  W' = m / ||V||_row * V,
 *                                 V = W + c B A, the norm per output row
 *   plus any LoRA / bias terms:   + sum_t s_t c_t (B_t A_t)
 * Strength on replacements and DoRA is lorakit's convention (PEFT has
 * none): s = 1 is PEFT's merge, s = 0 the base. Products of two floats are
 * exact in double, the sums are fma chains in a fixed order (k ascending,
 * terms in canonical order), and the final rounding goes through round-to-
 * odd f32 so that BF16/F16 see a single correct rounding of the double. */
#include "lorakit/fuse.h"
#include "lorakit/alloc.h"
#include "lorakit/dtype.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

lk_status lk_fuse_key_plan(lk_adapter *const *ad, const float *strength, size_t n, const lk_tensor *t,
                           lk_fuse_term *terms, lk_fuse_key *out) {
    memset(out, 0, sizeof *out);
    size_t rep_from = SIZE_MAX, dora_from = SIZE_MAX, other = SIZE_MAX;
    for (size_t i = 0; i < n; i++) {
        if (strength[i] == 0.0f) continue;
        const lk_lora_module *m = lk_adapter_find_target(ad[i], t->name);
        const lk_adapter_tensor *r = lk_adapter_find_replacement(ad[i], t->name);
        const lk_lora_module *b = lk_adapter_find_bias_target(ad[i], t->name);
        if (r) {
            if (rep_from != SIZE_MAX)
                return lk_error(LK_ERR_ARG, "%s and %s both replace %s (%s); fuse them separately",
                                lk_adapter_path(ad[rep_from]), lk_adapter_path(ad[i]), t->name, r->why);
            rep_from = i;
            out->replace = &r->t;
            out->replace_strength = strength[i];
        }
        if ((r || (m && !m->magnitude.data) || b) && other == SIZE_MAX) other = i;
        if (m && m->magnitude.data) {
            dora_from = i;
            out->dora = m;
            out->dora_strength = strength[i];
        } else if (m) {
            float sc = (float)((double)strength[i] * (double)m->scale);
            if (sc != 0.0f) terms[out->n_terms++] = (lk_fuse_term){&m->A, &m->B, sc};
        }
        if (b) {
            float sc = (float)((double)strength[i] * (double)b->scale);
            if (sc != 0.0f) terms[out->n_terms++] = (lk_fuse_term){NULL, &b->bias, sc};
        }
    }
    if (dora_from != SIZE_MAX && (out->n_terms || out->replace))
        return lk_error(LK_ERR_ARG, "%s: a DoRA adapter must be the only adapter in its request (%s also changes %s)",
                        lk_adapter_path(ad[dora_from]), lk_adapter_path(ad[other]), t->name);
    return LK_OK;
}

int lk_fuse_key_touches(const lk_fuse_key *k) { return k->replace || k->dora || k->n_terms; }

/* double -> dtype, one rounding: via round-to-odd f32 for the 16-bit types. */
static void store(void *dst, size_t j, double x, lk_dtype d) {
    float f = (float)x;
    if (d != LK_DTYPE_F32 && isfinite(f) && (double)f != x) {
        uint32_t u;
        memcpy(&u, &f, sizeof u);
        if (!(u & 1)) f = nextafterf(f, x > (double)f ? INFINITY : -INFINITY);
    }
    lk_from_f32((char *)dst + j * lk_dtype_size(d), &f, d, 1);
}

static double load(const void *src, size_t j, lk_dtype d) {
    float f;
    lk_to_f32(&f, (const char *)src + j * lk_dtype_size(d), d, 1);
    return (double)f;
}

static lk_status finite_check(double x, const char *name, size_t j, const lk_fuse_opts *o) {
    if (isfinite(x) || (o && o->allow_nonfinite)) return LK_OK;
    return lk_error(LK_ERR_NONFINITE, "%s: element %zu of the fused tensor is %g", name, j, x);
}

/* sum_t c_t sum_k B_t[o,k] A_t[k,j] for one row o into d[0..in) (2-D terms). */
static lk_status row_delta(double *d, const lk_fuse_term *terms, size_t nt, int64_t o, int64_t in, float *fa,
                           float *fb) {
    for (int64_t j = 0; j < in; j++) d[j] = 0.0;
    for (size_t t = 0; t < nt; t++) {
        const lk_tensor *A = terms[t].A, *B = terms[t].B;
        int64_t r = A->shape[0];
        lk_to_f32(fb, (const char *)B->data + (size_t)(o * r) * lk_dtype_size(B->dtype), B->dtype, (size_t)r);
        for (int64_t k = 0; k < r; k++) {
            double cb = (double)terms[t].scale * (double)fb[k]; /* exact */
            lk_to_f32(fa, (const char *)A->data + (size_t)(k * in) * lk_dtype_size(A->dtype), A->dtype, (size_t)in);
            for (int64_t j = 0; j < in; j++) d[j] = fma(cb, (double)fa[j], d[j]);
        }
    }
    return LK_OK;
}

lk_status lk_fuse_key_apply(void *w_out, const void *w_in, const lk_tensor *t, const lk_fuse_key *k,
                            const lk_fuse_term *terms, const lk_fuse_opts *opts) {
    lk_dtype d = t->dtype;
    const char *name = t->name;
    if (!k->replace && !k->dora && k->n_terms && terms[0].A) /* plain LoRA: the kernel */
        return lk_fuse_tensor(w_out, w_in, d, t->shape[0], t->shape[1], terms, k->n_terms, opts, name);
    if (!lk_fuse_key_touches(k)) {
        if (w_out != w_in) memcpy(w_out, w_in, t->nbytes);
        return LK_OK;
    }
    if (!lk_dtype_is_fusable(d)) { /* only a same-dtype replacement at strength 1 */
        if (!k->replace || k->replace_strength != 1.0f || k->n_terms || k->replace->dtype != d)
            return lk_error(LK_ERR_DTYPE, "%s is %s: it can only be replaced whole at strength 1", name,
                            lk_dtype_name(d));
        memcpy(w_out, k->replace->data, t->nbytes);
        return LK_OK;
    }
    size_t numel = lk_tensor_numel(t);
    int two_d = t->ndim == 2 && (k->dora || (k->n_terms && terms[0].A));
    int64_t rows = two_d ? t->shape[0] : 1, cols = two_d ? t->shape[1] : (int64_t)numel;
    size_t maxr = 1;
    for (size_t i = 0; i < k->n_terms; i++)
        if (terms[i].A && (size_t)terms[i].A->shape[0] > maxr) maxr = (size_t)terms[i].A->shape[0];
    if (k->dora && (size_t)k->dora->A.shape[0] > maxr) maxr = (size_t)k->dora->A.shape[0];
    double *acc = lk_malloc(2 * (size_t)cols * sizeof *acc);
    float *fa = lk_malloc(((size_t)cols + maxr) * sizeof *fa);
    if (!acc || !fa) {
        lk_free(acc);
        lk_free(fa);
        return lk_error(LK_ERR_NOMEM, "%s: out of memory for a %lld-element row", name, (long long)cols);
    }
    double *delta = acc + cols;
    float *fb = fa + cols;
    lk_status s = LK_OK;
    for (int64_t o = 0; o < rows && !s; o++) {
        size_t base = (size_t)(o * cols);
        for (int64_t j = 0; j < cols; j++) acc[j] = load(w_in, base + (size_t)j, d);
        if (k->dora) {
            const lk_lora_module *m = k->dora;
            lk_fuse_term dt = {&m->A, &m->B, m->scale}; /* PEFT's scaling, not the strength */
            row_delta(delta, &dt, 1, o, cols, fa, fb);
            double ss = 0.0;
            for (int64_t j = 0; j < cols; j++) {
                delta[j] += acc[j]; /* V = W + c B A */
                ss = fma(delta[j], delta[j], ss);
            }
            double mag = load(m->magnitude.data, (size_t)o, m->magnitude.dtype);
            double f = mag / sqrt(ss), sd = (double)k->dora_strength;
            for (int64_t j = 0; j < cols; j++) acc[j] = sd == 1.0 ? f * delta[j] : acc[j] + sd * (f * delta[j] - acc[j]);
        } else {
            if (k->replace) {
                double sr = (double)k->replace_strength;
                for (int64_t j = 0; j < cols; j++) {
                    double r = load(k->replace->data, base + (size_t)j, k->replace->dtype);
                    acc[j] = sr == 1.0 ? r : acc[j] + sr * (r - acc[j]);
                }
            }
            if (two_d) {
                row_delta(delta, terms, k->n_terms, o, cols, fa, fb);
                for (int64_t j = 0; j < cols; j++) acc[j] += delta[j];
            } else if (k->n_terms) { /* lora_B bias terms on a 1-D bias */
                for (int64_t j = 0; j < cols; j++) delta[j] = 0.0;
                for (size_t i = 0; i < k->n_terms; i++)
                    for (int64_t j = 0; j < cols; j++)
                        delta[j] = fma((double)terms[i].scale, load(terms[i].B->data, (size_t)j, terms[i].B->dtype), delta[j]);
                for (int64_t j = 0; j < cols; j++) acc[j] += delta[j];
            }
        }
        for (int64_t j = 0; j < cols && !s; j++) s = finite_check(acc[j], name, base + (size_t)j, opts);
        for (int64_t j = 0; j < cols && !s; j++) store(w_out, base + (size_t)j, acc[j], d);
    }
    lk_free(acc);
    lk_free(fa);
    return s;
}
