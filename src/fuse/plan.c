/* plan.c — what one model tensor becomes under a set of adapters: the one
 * per-key plan that the offline fuse (fuse_file.c) and the hot-swap tracker
 * (serve/tracker.c) both use, so the two give the same bytes.
 *
 * A key gets, from the adapters in canonical order: one term per module
 * (scale = strength * module scale, both doubles, the one place this
 * product is formed; not finite is an error naming both) of the module's kind: LoRA (conv and Tucker LoRA
 * included, as 2-D factors), LoHa (Hadamard), LoKr (Kronecker) or dense
 * (LyCORIS full .diff); vector terms on a 1-D tensor (lora_B bias, diff_b,
 * w_norm / b_norm on a norm layer: strength * scale * vector); a
 * replacement (PEFT's modules_to_save and saved biases, set_weight) or a
 * DoRA module (PEFT's lora_magnitude_vector, LyCORIS's dora_scale). A key
 * with terms only goes through lk_fuse_tensor (the kernel for LoRA terms,
 * terms.c's row driver with any other kind). Everything else (rare, and where
 * the result is defined in exact arithmetic) is computed in double precision
 * and rounded once into the weight's dtype:
 *   replacement R at strength s:  W + s (R - W)            (R itself at s = 1)
 *   DoRA at strength s:           W + s (W' - W),  W' = m / (||V|| + eps) * V,
 *                                 V = W + c delta, the norm per output row
 *                                 (PEFT, eps 0; LyCORIS with dora_scale
 *                                 [out, 1, ...]) or per input channel
 *                                 (dora_scale [1, in, ...]), LyCORIS's eps,
 *                                 finfo(float64).eps here (computed in double)
 *   plus any LoRA / bias terms:   + sum_t s_t c_t (B_t A_t)
 * Strength on replacements and DoRA is lorakit's convention (PEFT has
 * none): s = 1 is PEFT's merge, s = 0 the base; the other conventions'
 * rules are at replace_strength and apply_dora (README "Conventions"). The B A part (DoRA's V, or
 * other adapters' LoRA terms next to a replacement) comes from the fuse
 * kernel's own delta chain (fuse/fuse.h: f32 for BF16/F16 weights, f64
 * for F32), so it is the kernel's arithmetic; the rest is in double (the
 * row norm an fma chain, j ascending; lora_B bias terms exact products in
 * an fma chain, terms in canonical order), and the final rounding goes
 * through round-to-odd f32 so that BF16/F16 see a single correct rounding
 * of the double. */
#include "lorakit/fuse.h"
#include "lorakit/alloc.h"
#include "core/alloc.h"
#include "lorakit/dtype.h"
#include "fuse/fuse.h"
#include "core/bits.h"
#include "fuse/keyelem.h"

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

/* The term a module adds at scale sc onto tensor t (its 2-D factors are
 * the ones resolve prepared, lk_lora_module.k). */
static lk_fuse_term module_term(const lk_lora_module *m, const lk_tensor *t, double sc) {
    const lk_tensor *k = m->k;
    switch (m->algo) {
    case LK_ALGO_LOHA:
        return (lk_fuse_term){.A = &k[0], .B = &k[1], .scale = sc, .kind = LK_TERM_HADA, .A2 = &k[2], .B2 = &k[3]};
    case LK_ALGO_LOKR:
        return (lk_fuse_term){.A = k[0].data ? &k[0] : NULL, .B = &k[1], .scale = sc, .kind = LK_TERM_KRON,
                              .A2 = k[2].data ? &k[2] : NULL, .B2 = &k[3]};
    case LK_ALGO_OFT:
    case LK_ALGO_BOFT: /* the strength itself, and the file's alpha (the constraint) */
        return (lk_fuse_term){.B = &k[1], .A2 = k[2].data ? &k[2] : NULL, .scale = sc, .kind = LK_TERM_OFT,
                              .alpha = m->alpha, .peft = m->w1.ndim == 2 || m->oft_peft.boft ? &m->oft_peft : NULL};
    case LK_ALGO_FULL:
    case LK_ALGO_NORM:
    case LK_ALGO_SET: /* a 1-D weight (a norm layer's) takes a vector term */
        return (lk_fuse_term){.B = &k[1], .scale = sc, .kind = t->ndim == 1 ? LK_TERM_LORA : LK_TERM_DENSE};
    default: return (lk_fuse_term){.A = &k[0], .B = &k[1], .scale = sc};
    }
}

static int is_dora(const lk_lora_module *m) { return m->magnitude.data || m->dora_scale.data; }
static int is_rotation(const lk_lora_module *m) { return m->algo == LK_ALGO_OFT || m->algo == LK_ALGO_BOFT; }

/* The strength a replacement is applied at (s != 0): lorakit interpolates,
 * W + s (R - W). ComfyUI's "set" patch (set_weight) copies R whatever the
 * strength; PEFT's modules_to_save and saved biases are swapped in whole
 * (no strength reaches them). LyCORIS has neither: lorakit's rule. */
static double replace_strength(const lk_adapter *a, int peft_replacement, double s) {
    lk_convention c = lk_adapter_convention(a);
    if (c == LK_CONVENTION_COMFYUI && !peft_replacement) return 1.0;
    if (c == LK_CONVENTION_PEFT && peft_replacement) return 1.0;
    return s;
}

lk_status lk_fuse_key_plan(lk_adapter *const *ad, const double *strength, size_t n, const lk_tensor *t,
                           lk_fuse_term *terms, lk_fuse_key *out) {
    memset(out, 0, sizeof *out);
    size_t rep_from = SIZE_MAX, dora_from = SIZE_MAX, other = SIZE_MAX, rot_from = SIZE_MAX;
    lk_status s;
    int sliced = 0;
    for (size_t i = 0; i < n; i++) {
        if (strength[i] == 0.0) continue;
        const lk_adapter_placement *pl;
        size_t np = lk_adapter_placements(ad[i], t->name, &pl);
        const lk_lora_module *m = np == 1 && pl->whole ? pl->module : NULL;
        const lk_adapter_tensor *r = lk_adapter_find_replacement(ad[i], t->name);
        const lk_lora_module *b = lk_adapter_find_bias_target(ad[i], t->name);
        const lk_tensor *rt = r ? &r->t : m && m->algo == LK_ALGO_SET ? &m->dense : NULL;
        if (rt) {
            if (rep_from != SIZE_MAX)
                return lk_error(LK_ERR_ARG, "%s and %s both replace %s (%s); fuse them separately",
                                lk_adapter_path(ad[rep_from]), lk_adapter_path(ad[i]), t->name,
                                r ? r->why : "set_weight");
            rep_from = i;
            out->replace = rt;
            out->replace_strength = replace_strength(ad[i], r != NULL, strength[i]);
        }
        if ((rt || (m && !is_dora(m)) || b || (np && !m)) && other == SIZE_MAX) other = i;
        if (np && !m) { /* row slices of a fused weight (LoRA only: resolve refused the rest there) */
            for (size_t k = 0; k < np; k++) {
                double sc;
                if ((s = term_scale(ad[i], pl[k].module, strength[i], "", &sc))) return s;
                if (sc != 0.0)
                    terms[out->n_terms++] = (lk_fuse_term){.A = &pl[k].module->k[0], .B = &pl[k].B, .scale = sc,
                                                           .slice = pl[k].row0 + 1};
            }
            sliced = 1;
        }
        if (m && is_dora(m)) {
            if (dora_from != SIZE_MAX)
                return lk_error(LK_ERR_ARG, "%s and %s both put DoRA on %s; fuse them separately",
                                lk_adapter_path(ad[dora_from]), lk_adapter_path(ad[i]), t->name);
            dora_from = i;
            out->dora = m;
            out->dora_strength = strength[i];
            out->dora_convention = lk_adapter_convention(ad[i]);
        } else if (m && m->algo != LK_ALGO_SET) {
            double sc = strength[i]; /* OFT / BOFT: the strength (alpha is a constraint, not a scale) */
            if (!is_rotation(m) && (s = term_scale(ad[i], m, strength[i], "", &sc))) return s;
            if (sc != 0.0) terms[out->n_terms++] = module_term(m, t, sc);
            if (sc != 0.0 && m->algo == LK_ALGO_GLORA) /* W a1 a2 beside b1 b2 */
                terms[out->n_terms++] = (lk_fuse_term){.A = &m->k[2], .B = &m->k[3], .scale = sc,
                                                       .kind = LK_TERM_WLORA};
            if (is_rotation(m)) rot_from = i;
        }
        if (b) {
            double sc;
            if ((s = term_scale(ad[i], b, strength[i], "lora_B.bias ", &sc))) return s;
            if (sc != 0.0) terms[out->n_terms++] = (lk_fuse_term){.B = &b->bias, .scale = sc};
        }
    }
    if (sliced && (out->replace || dora_from != SIZE_MAX))
        return lk_error(LK_ERR_UNSUPPORTED, "%s: modules on row slices of it together with a %s are not supported",
                        t->name, out->replace ? "replacement (modules_to_save)" : "DoRA module");
    if (rot_from != SIZE_MAX && (out->n_terms > 1 || out->replace || sliced))
        return lk_error(LK_ERR_ARG, "%s: an OFT / BOFT adapter (%s) rotates the weight, so it must be the only adapter "
                        "changing it; fuse the others separately", t->name, lk_adapter_path(ad[rot_from]));
    if (dora_from != SIZE_MAX && (out->n_terms || out->replace))
        return lk_error(LK_ERR_ARG, "%s: a DoRA adapter must be the only adapter in its request (%s also changes %s)",
                        lk_adapter_path(ad[dora_from]), lk_adapter_path(ad[other]), t->name);
    return LK_OK;
}

int lk_fuse_key_touches(const lk_fuse_key *k) { return k->replace || k->dora || k->n_terms; }

/* double -> dtype, one rounding (fuse/keyelem.h: round to odd f32 for the
 * 16-bit types, the NaN rule); w holds the old bits at j. */
static void store(void *dst, const void *w, size_t j, double x, lk_dtype d) {
    lk_key_put(dst, (int)d, j, lk_key_store(x, lk_key_bits(w, (int)d, j), (int)d));
}

static double load(const void *src, size_t j, lk_dtype d) {
    float f;
    lk_to_f32(&f, (const char *)src + j * lk_dtype_size(d), d, 1);
    return (double)f;
}

double lk_fuse_dora_factor(double m, double ss, double eps) { return m / (sqrt(ss) + eps); }

lk_status lk_fuse_key_nonfinite(double x, const char *name, size_t j, const lk_fuse_opts *o) {
    if (isfinite(x) || (o && o->allow_nonfinite)) return LK_OK;
    /* a NaN is named without its sign: which NaN arithmetic makes (Inf - Inf is -NaN on x86) is the hardware's */
    return lk_error(LK_ERR_NONFINITE, "%s: element %zu of the fused tensor is %g", name, j, x != x ? fabs(x) : x);
}
#define finite_check lk_fuse_key_nonfinite

/* Rows per call of the kernel's delta API (it converts A once per call). */
static int64_t chunk_rows(int64_t rows, int64_t cols) {
    int64_t c = ((int64_t)1 << 18) / (cols ? cols : 1);
    if (c < 1) c = 1;
    return c < rows ? c : rows;
}

/* The delta of rows [r0, r0 + nr) of a key's 2-D part into dl (row stride
 * cols): the one chain of fuse/fuse.h, whatever the term kinds. */
typedef struct dstream {
    lk_delta_prep *p;
    void *dl, *scratch; /* scratch is carved from dl's allocation */
    int64_t chunk;
} dstream;

static void dstream_free(dstream *ds) {
    lk_fuse_delta_free(ds->p);
    lk_free(ds->dl);
}

static lk_status dstream_open(dstream *ds, int wide, int64_t rows, int64_t cols, const lk_fuse_term *lt, size_t n_lt,
                              const char *name) {
    memset(ds, 0, sizeof *ds);
    ds->chunk = chunk_rows(rows, cols);
    lk_status s = lk_fuse_delta_prepare(wide, rows, cols, 0, rows, lt, n_lt, name, &ds->p);
    if (s) return s;
    size_t sb = lk_fuse_delta_scratch(ds->p, (size_t)ds->chunk);
    /* the delta rows, then the scratch: one allocation, lk_malloc'd (each
     * part is written before it is read) */
    lk_carve cv = {0};
    const size_t o_dl = lk_carve_part(&cv, (size_t)(ds->chunk * cols), wide ? sizeof(double) : sizeof(float), 64),
                 o_scr = lk_carve_part(&cv, sb, 1, 64);
    unsigned char *m = cv.overflow ? NULL : lk_malloc(cv.bytes);
    ds->dl = m ? m + o_dl : NULL;
    ds->scratch = m && sb ? m + o_scr : NULL;
    if (!ds->dl) {
        dstream_free(ds);
        return lk_error(LK_ERR_NOMEM, "%s: out of memory for %lld rows of %lld", name, (long long)ds->chunk,
                        (long long)cols);
    }
    return LK_OK;
}

/* DoRA at strength sd: V = W + c delta, W' = m / (||.|| + eps) V; what is
 * normed, eps and the strength rule are the convention's (k->dora_convention;
 * README "Conventions"):
 *   lorakit: ||V|| per output row for PEFT's lora_magnitude_vector (eps 0)
 *            and for a dora_scale with out values in its first dimension
 *            (LyCORIS's wd_on_out), else per input channel (over the output
 *            rows and the kernel window), eps 2^-52 for dora_scale (LyCORIS
 *            adds finfo(dtype).eps of the dtype it computes in; lorakit
 *            computes in double); result W + sd (W' - W).
 *   comfyui: (comfy/weight_adapter/base.py weight_decompose) on the output
 *            axis when dora_scale's first dimension is out, and then the norm
 *            is of the ORIGINAL W's rows, not V's; else V per input channel;
 *            eps = finfo(float32).eps = 2^-23 (it computes in float32) in
 *            both cases; result W + sd (W' - W).
 *   lycoris: (lycoris/functional/general.py weight_decompose) the axis as
 *            lorakit's, eps = finfo(float32).eps = 2^-23 (dora_scale is a
 *            float32 parameter and W is cast to it); result
 *            V + sd (W' - V) (its multiplier rescales m / ||V|| around 1,
 *            V itself carries the full c delta). A PEFT magnitude (which
 *            LyCORIS does not read) follows lorakit's rule.
 *   peft:    (peft/tuners/lora/dora.py) ||V|| per output row (dora_scale per
 *            input channel keeps its axis), eps 0; the strength is PEFT's
 *            scaling multiplier: V = W + sd c delta, result W' itself.
 * Norms are fma chains in double (rows ascending, then columns ascending). */
lk_dora_rule lk_fuse_dora_rule(const lk_fuse_key *k, const lk_tensor *t, int64_t rows, int64_t cols) {
    const lk_lora_module *m = k->dora;
    const int peft_mag = m->magnitude.data != NULL;
    lk_dora_rule r = {.wide = t->dtype == LK_DTYPE_F32, .sd = (double)k->dora_strength, .c = m->scale,
                   .mag = peft_mag ? &m->magnitude : &m->dora_scale, .finish = LK_KEY_DORA_INTERP_W};
    lk_convention cv = k->dora_convention;
    if (cv == LK_CONVENTION_LYCORIS && peft_mag) cv = LK_CONVENTION_LORAKIT;
    r.on_out = peft_mag || (r.mag->shape[0] == rows && (int64_t)lk_tensor_numel(r.mag) == rows);
    r.eps = peft_mag ? 0.0 : 0x1p-52;
    if (cv == LK_CONVENTION_COMFYUI) {
        r.on_out = r.mag->shape[0] == rows;
        r.norm_w = r.on_out;
        r.eps = 0x1p-23;
    } else if (cv == LK_CONVENTION_LYCORIS) {
        r.eps = 0x1p-23;
        r.finish = LK_KEY_DORA_INTERP_V;
    } else if (cv == LK_CONVENTION_PEFT) {
        r.eps = 0.0;
        r.c = r.sd * m->scale;
        r.finish = LK_KEY_DORA_PEFT;
    }
    r.in_ch = r.on_out ? 1 : (int64_t)lk_tensor_numel(r.mag);
    r.K = r.on_out ? 1 : cols / r.in_ch;
    return r;
}

static lk_status apply_dora(void *w_out, const void *w_in, const lk_tensor *t, const lk_fuse_key *k, int64_t rows,
                            int64_t cols, const lk_fuse_opts *opts) {
    const lk_dora_rule r = lk_fuse_dora_rule(k, t, rows, cols);
    const lk_dtype d = t->dtype;
    const char *name = t->name;
    const int64_t K = r.K;
    lk_fuse_term lt = lk_fuse_dora_term(k, t, &r);
    dstream ds;
    lk_status s = dstream_open(&ds, r.wide, rows, cols, &lt, 1, name);
    if (s) return s;
    /* a row of the base values, a row of V, and the per-channel norms (zeroed): one allocation */
    lk_carve cv = {0};
    const size_t o_acc = LK_CARVE(&cv, (size_t)cols, double), o_v = LK_CARVE(&cv, (size_t)cols, double),
                 o_cs = LK_CARVE(&cv, r.on_out ? 0 : (size_t)r.in_ch, double);
    unsigned char *mem = lk_carve_alloc(&cv);
    double *acc = mem ? (double *)(void *)(mem + o_acc) : NULL, *v = mem ? (double *)(void *)(mem + o_v) : NULL;
    double *cs = mem && !r.on_out ? (double *)(void *)(mem + o_cs) : NULL;
    if (!mem) {
        s = lk_error(LK_ERR_NOMEM, "%s: out of memory", name);
        goto done;
    }
    for (int pass = r.on_out ? 1 : 0; pass < 2 && !s; pass++) /* pass 0: the per-channel norms */
        for (int64_t r0 = 0; r0 < rows && !s; r0 += ds.chunk) {
            int64_t nr = rows - r0 < ds.chunk ? rows - r0 : ds.chunk;
            lk_fuse_delta_rows(ds.p, ds.dl, (size_t)cols, (size_t)r0, (size_t)nr, ds.scratch);
            for (int64_t o = r0; o < r0 + nr && !s; o++) {
                size_t base = (size_t)(o * cols), drow = (size_t)((o - r0) * cols);
                for (int64_t j = 0; j < cols; j++) {
                    acc[j] = load(w_in, base + (size_t)j, d);
                    v[j] = acc[j] + (r.wide ? ((const double *)ds.dl)[drow + (size_t)j]
                                            : (double)((const float *)ds.dl)[drow + (size_t)j]);
                }
                if (pass == 0) {
                    for (int64_t j = 0; j < cols; j++) cs[j / K] = fma(v[j], v[j], cs[j / K]);
                    continue;
                }
                double f = 0.0;
                if (r.on_out) {
                    const double *x = r.norm_w ? acc : v;
                    double ss = 0.0;
                    for (int64_t j = 0; j < cols; j++) ss = fma(x[j], x[j], ss);
                    f = lk_fuse_dora_factor(load(r.mag->data, (size_t)o, r.mag->dtype), ss, r.eps);
                }
                for (int64_t j = 0; j < cols; j++) {
                    double fj = r.on_out ? f : lk_fuse_dora_factor(load(r.mag->data, (size_t)(j / K), r.mag->dtype), cs[j / K], r.eps);
                    acc[j] = lk_key_dora_finish(r.finish, r.sd, acc[j], v[j], fj);
                }
                for (int64_t j = 0; j < cols && !s; j++) s = finite_check(acc[j], name, base + (size_t)j, opts);
                for (int64_t j = 0; j < cols && !s; j++) store(w_out, w_in, base + (size_t)j, acc[j], d);
            }
        }
done:
    lk_free(mem);
    dstream_free(&ds);
    return s;
}

lk_fuse_term lk_fuse_dora_term(const lk_fuse_key *k, const lk_tensor *t, const lk_dora_rule *r) {
    return module_term(k->dora, t, r->c);
}

lk_status lk_fuse_key_check(const lk_tensor *t, const lk_fuse_key *k) {
    if (!lk_dtype_is_fusable(t->dtype) &&
        (!k->replace || k->replace_strength != 1.0 || k->n_terms || k->replace->dtype != t->dtype))
        return lk_error(LK_ERR_DTYPE, "%s is %s: it can only be replaced whole at strength 1", t->name,
                        lk_dtype_name(t->dtype));
    if (lk_dtype_is_fusable(t->dtype) && k->dora && t->ndim < 2)
        return lk_error(LK_ERR_SHAPE, "%s: DoRA on a 1-D tensor", t->name);
    return LK_OK;
}

lk_status lk_fuse_key_apply(void *w_out, const void *w_in, const lk_tensor *t, const lk_fuse_key *k,
                            const lk_fuse_term *terms, const lk_fuse_opts *opts) {
    lk_dtype d = t->dtype;
    const char *name = t->name;
    size_t numel = lk_tensor_numel(t);
    const int vec = t->ndim < 2; /* a bias or a norm layer's weight: vector terms */
    lk_status cs = lk_cancel_check(opts ? opts->cancel : NULL, name);
    if (cs) return cs;
    /* a conv weight [out, in, kh, kw] is out x (in kh kw) */
    const int64_t out_rows = vec ? 1 : t->shape[0], out_cols = out_rows ? (int64_t)(numel / (size_t)out_rows) : 0;
    if (!k->replace && !k->dora && k->n_terms && !vec) /* LoRA (the kernel), LoHa, LoKr, dense terms */
        return lk_fuse_tensor(w_out, w_in, d, out_rows, out_cols, terms, k->n_terms, opts, name);
    if (!lk_fuse_key_touches(k)) {
        if (w_out != w_in) memcpy(w_out, w_in, t->nbytes);
        return LK_OK;
    }
    lk_status s = lk_fuse_key_check(t, k);
    if (s) return s;
    if (!lk_dtype_is_fusable(d)) { /* a same-dtype replacement at strength 1 */
        memcpy(w_out, k->replace->data, t->nbytes);
        return LK_OK;
    }
    if (k->dora) return apply_dora(w_out, w_in, t, k, out_rows, out_cols, opts);
    /* a replacement, plus any terms: the terms' delta comes from the one
     * delta chain (f32 for narrow weights, f64 for F32 weights), exactly
     * as lk_fuse_tensor sums it */
    int two_d = k->n_terms && !vec, wide = d == LK_DTYPE_F32;
    int64_t rows = two_d ? out_rows : 1, cols = two_d ? out_cols : (int64_t)numel;
    dstream ds = {0};
    s = two_d ? dstream_open(&ds, wide, rows, cols, terms, k->n_terms, name) : LK_OK;
    if (s) return s;
    if (!two_d) ds.chunk = 1;
    double *acc = lk_malloc((size_t)cols * sizeof *acc);
    if (!acc) {
        dstream_free(&ds);
        return lk_error(LK_ERR_NOMEM, "%s: out of memory for %lld values", name, (long long)cols);
    }
    for (int64_t r0 = 0; r0 < rows && !s; r0 += ds.chunk) {
        int64_t nr = rows - r0 < ds.chunk ? rows - r0 : ds.chunk;
        if (two_d) lk_fuse_delta_rows(ds.p, ds.dl, (size_t)cols, (size_t)r0, (size_t)nr, ds.scratch);
        for (int64_t o = r0; o < r0 + nr && !s; o++) {
            size_t base = (size_t)(o * cols), drow = (size_t)((o - r0) * cols);
            for (int64_t j = 0; j < cols; j++) acc[j] = load(w_in, base + (size_t)j, d);
            if (k->replace) {
                double sr = (double)k->replace_strength;
                for (int64_t j = 0; j < cols; j++) {
                    double r = load(k->replace->data, base + (size_t)j, k->replace->dtype);
                    acc[j] = lk_key_replace(acc[j], r, sr);
                }
            }
            if (two_d) {
                for (int64_t j = 0; j < cols; j++)
                    acc[j] += wide ? ((const double *)ds.dl)[drow + (size_t)j]
                                   : (double)((const float *)ds.dl)[drow + (size_t)j];
            } else if (k->n_terms) { /* vector terms on a 1-D tensor: exact products, fma chain */
                for (int64_t j = 0; j < cols; j++) {
                    double dj = 0.0;
                    for (size_t i = 0; i < k->n_terms; i++)
                        dj = fma((double)terms[i].scale, load(terms[i].B->data, (size_t)j, terms[i].B->dtype), dj);
                    acc[j] += dj;
                }
            }
            for (int64_t j = 0; j < cols && !s; j++) s = finite_check(acc[j], name, base + (size_t)j, opts);
            for (int64_t j = 0; j < cols && !s; j++) store(w_out, w_in, base + (size_t)j, acc[j], d);
        }
    }
    lk_free(acc);
    dstream_free(&ds);
    return s;
}
