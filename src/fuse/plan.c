/* plan.c — what one model tensor becomes under a set of adapters: the one
 * per-key plan that the offline fuse (fuse_file.c) and the hot-swap tracker
 * (serve/tracker.c) both use, so the two give the same bytes.
 *
 * A key gets, from the adapters in canonical order: LoRA terms (2-D
 * weights; scale = strength * module scale, both doubles, the one place this
 * product is formed; not finite is an error naming both), lora_B bias terms (the layer's 1-D bias: strength *
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
 * none): s = 1 is PEFT's merge, s = 0 the base. The B A part (DoRA's V, or
 * other adapters' LoRA terms next to a replacement) comes from the fuse
 * kernel's own delta chain (fuse_internal.h: f32 for BF16/F16 weights, f64
 * for F32), so it is the kernel's arithmetic; the rest is in double (the
 * row norm an fma chain, j ascending; lora_B bias terms exact products in
 * an fma chain, terms in canonical order), and the final rounding goes
 * through round-to-odd f32 so that BF16/F16 see a single correct rounding
 * of the double. */
#include "lorakit/fuse.h"
#include "lorakit/alloc.h"
#include "lorakit/dtype.h"
#include "fuse/fuse_internal.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

/* strength * module scale, the term scale; LK_ERR_ARG when it is not finite
 * (a huge strength times a large alpha/r overflows the double). */
static lk_status term_scale(const lk_adapter *a, const lk_lora_module *m, double strength, const char *what,
                            double *out) {
    *out = strength * m->scale;
    if (isfinite(*out)) return LK_OK;
    char sb[LK_NUM_STR_MAX], cb[LK_NUM_STR_MAX], ab[LK_NUM_STR_MAX];
    return lk_error(LK_ERR_ARG, "%s: %s: strength %s times the module's %sscale %s (alpha %s, r %d) is not finite",
                    lk_adapter_path(a), m->module, lk_num_str(strength, sb), what, lk_num_str(m->scale, cb),
                    lk_num_str(m->alpha, ab), m->rank);
}

lk_status lk_fuse_key_plan(lk_adapter *const *ad, const double *strength, size_t n, const lk_tensor *t,
                           lk_fuse_term *terms, lk_fuse_key *out) {
    memset(out, 0, sizeof *out);
    size_t rep_from = SIZE_MAX, dora_from = SIZE_MAX, other = SIZE_MAX;
    lk_status s;
    int sliced = 0;
    for (size_t i = 0; i < n; i++) {
        if (strength[i] == 0.0) continue;
        const lk_adapter_placement *pl;
        size_t np = lk_adapter_placements(ad[i], t->name, &pl);
        const lk_lora_module *m = np == 1 && pl->whole ? pl->module : NULL;
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
        if ((r || (m && !m->magnitude.data) || b || (np && !m)) && other == SIZE_MAX) other = i;
        if (np && !m) { /* row slices of a fused weight (resolve refused DoRA there) */
            for (size_t k = 0; k < np; k++) {
                double sc;
                if ((s = term_scale(ad[i], pl[k].module, strength[i], "", &sc))) return s;
                if (sc != 0.0) terms[out->n_terms++] = (lk_fuse_term){&pl[k].module->A, &pl[k].B, sc, pl[k].row0 + 1};
            }
            sliced = 1;
        }
        if (m && m->magnitude.data) {
            dora_from = i;
            out->dora = m;
            out->dora_strength = strength[i];
        } else if (m) {
            double sc;
            if ((s = term_scale(ad[i], m, strength[i], "", &sc))) return s;
            if (sc != 0.0) terms[out->n_terms++] = (lk_fuse_term){&m->A, &m->B, sc, 0};
        }
        if (b) {
            double sc;
            if ((s = term_scale(ad[i], b, strength[i], "lora_B.bias ", &sc))) return s;
            if (sc != 0.0) terms[out->n_terms++] = (lk_fuse_term){NULL, &b->bias, sc, 0};
        }
    }
    if (sliced && (out->replace || dora_from != SIZE_MAX))
        return lk_error(LK_ERR_UNSUPPORTED, "%s: modules on row slices of it together with a %s are not supported",
                        t->name, out->replace ? "replacement (modules_to_save)" : "DoRA module");
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

/* Rows per call of the kernel's delta API (it converts A once per call). */
static int64_t chunk_rows(int64_t rows, int64_t cols) {
    int64_t c = ((int64_t)1 << 18) / (cols ? cols : 1);
    if (c < 1) c = 1;
    return c < rows ? c : rows;
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
        if (!k->replace || k->replace_strength != 1.0 || k->n_terms || k->replace->dtype != d)
            return lk_error(LK_ERR_DTYPE, "%s is %s: it can only be replaced whole at strength 1", name,
                            lk_dtype_name(d));
        memcpy(w_out, k->replace->data, t->nbytes);
        return LK_OK;
    }
    size_t numel = lk_tensor_numel(t);
    /* the 2-D LoRA part (DoRA's c B A, or other adapters' terms next to a
     * replacement) comes from the kernel's own delta chain: f32 for narrow
     * weights, f64 for F32 weights, exactly as lk_fuse_tensor sums it */
    lk_fuse_term dterm;
    const lk_fuse_term *lt = NULL;
    size_t n_lt = 0;
    if (k->dora) {
        dterm = (lk_fuse_term){&k->dora->A, &k->dora->B, k->dora->scale, 0}; /* PEFT's scaling, not the strength */
        lt = &dterm;
        n_lt = 1;
    } else if (k->n_terms && terms[0].A) {
        lt = terms;
        n_lt = k->n_terms;
    }
    int two_d = n_lt > 0, wide = d == LK_DTYPE_F32;
    int64_t rows = two_d ? t->shape[0] : 1, cols = two_d ? t->shape[1] : (int64_t)numel;
    int64_t chunk = two_d ? chunk_rows(rows, cols) : 1;
    double *acc = lk_malloc((size_t)cols * sizeof *acc);
    void *dl = two_d ? lk_malloc((size_t)(chunk * cols) * (wide ? sizeof(double) : sizeof(float))) : NULL;
    if (!acc || (two_d && !dl)) {
        lk_free(acc);
        lk_free(dl);
        return lk_error(LK_ERR_NOMEM, "%s: out of memory for %lld rows of %lld", name, (long long)chunk,
                        (long long)cols);
    }
    lk_status s = LK_OK;
    for (int64_t r0 = 0; r0 < rows && !s; r0 += chunk) {
        int64_t nr = rows - r0 < chunk ? rows - r0 : chunk;
        if (two_d) {
            s = wide ? lk_fuse_delta_f64(dl, (size_t)cols, rows, cols, r0, nr, lt, n_lt, name)
                     : lk_fuse_delta_f32(dl, (size_t)cols, rows, cols, r0, nr, lt, n_lt, name);
            if (s) break;
        }
        for (int64_t o = r0; o < r0 + nr && !s; o++) {
            size_t base = (size_t)(o * cols), drow = (size_t)((o - r0) * cols);
#define DELTA(j) (wide ? ((const double *)dl)[drow + (size_t)(j)] : (double)((const float *)dl)[drow + (size_t)(j)])
            for (int64_t j = 0; j < cols; j++) acc[j] = load(w_in, base + (size_t)j, d);
            if (k->dora) { /* V = W + c B A; W' = m / ||V|| V; W + s (W' - W) */
                double ss = 0.0;
                for (int64_t j = 0; j < cols; j++) {
                    double v = acc[j] + DELTA(j);
                    ss = fma(v, v, ss);
                }
                double f = load(k->dora->magnitude.data, (size_t)o, k->dora->magnitude.dtype) / sqrt(ss);
                double sd = k->dora_strength;
                for (int64_t j = 0; j < cols; j++) {
                    double v = acc[j] + DELTA(j);
                    acc[j] = sd == 1.0 ? f * v : acc[j] + sd * (f * v - acc[j]);
                }
            } else {
                if (k->replace) {
                    double sr = k->replace_strength;
                    for (int64_t j = 0; j < cols; j++) {
                        double r = load(k->replace->data, base + (size_t)j, k->replace->dtype);
                        acc[j] = sr == 1.0 ? r : acc[j] + sr * (r - acc[j]);
                    }
                }
                if (two_d) {
                    for (int64_t j = 0; j < cols; j++) acc[j] += DELTA(j);
                } else if (k->n_terms) { /* lora_B bias terms on a 1-D bias: exact products, fma chain */
                    for (int64_t j = 0; j < cols; j++) {
                        double dj = 0.0;
                        for (size_t i = 0; i < k->n_terms; i++)
                            dj = fma((double)terms[i].scale, load(terms[i].B->data, (size_t)j, terms[i].B->dtype), dj);
                        acc[j] += dj;
                    }
                }
            }
#undef DELTA
            for (int64_t j = 0; j < cols && !s; j++) s = finite_check(acc[j], name, base + (size_t)j, opts);
            for (int64_t j = 0; j < cols && !s; j++) store(w_out, base + (size_t)j, acc[j], d);
        }
    }
    lk_free(acc);
    lk_free(dl);
    return s;
}
