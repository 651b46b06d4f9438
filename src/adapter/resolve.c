/* resolve.c — mapping adapter modules onto model weights.
 *
 * A module <m> targets the model key "<m>.weight" (diffusers files also try
 * the name with their prefix kept, e.g. "transformer.<m>.weight", for models
 * stored with it); failing both, the one model key ending in ".<m>.weight"
 * (a checkpoint saved with a wrapper prefix, e.g. ComfyUI's
 * "model.diffusion_model."); two such keys are an ambiguity error (the
 * suffixes come from one pass over the model keys with a rolling hash,
 * names.h, so the work is the keys' length, not keys x modules). kohya names lose the dots, so the model's own keys are
 * turned into kohya form ("a.b_c.weight" -> "a_b_c") and looked up; two model
 * keys with the same kohya form are reported when a module hits them, never
 * guessed. Everything is computed into temporaries and committed only when
 * every module checks out, so a failed resolve leaves the adapter as it was. */
#include "lorakit/adapter.h"
#include "lorakit/alloc.h"
#include "lorakit/log.h"
#include "adapter/adapter_struct.h"
#include "adapter/names.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct kname {
    char *name; /* kohya form of a model key without ".weight" */
    size_t idx;
} kname;

static int kname_cmp(const void *a, const void *b) {
    return strcmp(((const kname *)a)->name, ((const kname *)b)->name);
}

static int idx_cmp(const void *pa, const void *pb, void *ctx) {
    const lk_tensor *m = ctx;
    return strcmp(m[*(const size_t *)pa].name, m[*(const size_t *)pb].name);
}

/* Index of the model tensor named exactly key, or SIZE_MAX. */
static size_t find_model(const lk_tensor *model, const size_t *ord, size_t n, const char *key) {
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(model[ord[mid]].name, key);
        if (c == 0) return ord[mid];
        if (c < 0) lo = mid + 1;
        else hi = mid;
    }
    return SIZE_MAX;
}

static size_t find_with_suffix(const lk_tensor *model, const size_t *ord, size_t n, const char *base,
                               char *buf, size_t cap) {
    if ((size_t)snprintf(buf, cap, "%s.weight", base) >= cap) return SIZE_MAX;
    return find_model(model, ord, n, buf);
}

/* For the names in t (ids below n_ids), the first two model keys, in model
 * order, ending in "." + name + tail: first[id], second[id] (SIZE_MAX: none).
 * One pass over the model keys with a rolling hash over each, so the work is
 * the keys' total length, not keys x names. */
static void suffix_hits(const lk_names *t, const lk_tensor *model, size_t n_model, const char *tail, size_t n_ids,
                        size_t *first, size_t *second) {
    size_t tl = strlen(tail);
    for (size_t i = 0; i < n_ids; i++) first[i] = second[i] = SIZE_MAX;
    for (size_t k = 0; k < n_model; k++) {
        const char *nm = model[k].name;
        size_t l = strlen(nm);
        if (l < tl || memcmp(nm + l - tl, tail, tl)) continue;
        l -= tl;
        uint64_t h = 0, pw = 1;
        for (size_t i = l; i > 0; i--) { /* the suffix nm[i..l), after a '.' */
            if (i < l) lk_names_roll(t, &h, &pw, (unsigned char)nm[i]);
            if (nm[i - 1] != '.') continue;
            size_t id = lk_names_get_h(t, h, nm + i, l - i);
            if (id == SIZE_MAX) continue;
            if (first[id] == SIZE_MAX) first[id] = k;
            else if (second[id] == SIZE_MAX) second[id] = k;
        }
    }
}

/* Names to look up by suffix: t gets names[i] for each i with want[i], id i
 * (an equal name already there: *same_as[i] = its id, else i). */
static lk_status suffix_table(const char *file, lk_names *t, char *const *names, const size_t *want, size_t n,
                              size_t *same_as) {
    size_t cnt = 0;
    for (size_t i = 0; i < n; i++) cnt += want[i] == SIZE_MAX;
    if (lk_names_init(t, cnt)) return lk_error(LK_ERR_NOMEM, "%s: out of memory", file);
    for (size_t i = 0; i < n; i++) {
        same_as[i] = i;
        if (want[i] == SIZE_MAX && lk_names_add(t, names[i], strlen(names[i]), i, &same_as[i]))
            return lk_error(LK_ERR_NOMEM, "%s: out of memory", file);
    }
    return LK_OK;
}

static const char *kohya_rest(const char *m) {
    static const char *const pre[] = {"lora_unet_", "lora_te1_", "lora_te2_", "lora_te_"};
    for (size_t i = 0; i < 4; i++)
        if (!strncmp(m, pre[i], strlen(pre[i]))) return m + strlen(pre[i]);
    return m;
}

static lk_status kohya_names(const char *file, const lk_tensor *model, size_t n_model, kname **out, size_t *n_out) {
    kname *k = lk_calloc(n_model ? n_model : 1, sizeof *k);
    if (!k) return lk_error(LK_ERR_NOMEM, "%s: out of memory for the model's kohya names", file);
    size_t n = 0;
    for (size_t i = 0; i < n_model; i++) {
        const char *nm = model[i].name;
        size_t l = nm ? strlen(nm) : 0;
        if (l <= 7 || strcmp(nm + l - 7, ".weight")) continue;
        char *s = lk_malloc(l - 6);
        if (!s) {
            for (size_t j = 0; j < n; j++) lk_free(k[j].name);
            lk_free(k);
            return lk_error(LK_ERR_NOMEM, "%s: out of memory for the model's kohya names", file);
        }
        for (size_t j = 0; j < l - 7; j++) s[j] = nm[j] == '.' ? '_' : nm[j];
        s[l - 7] = '\0';
        k[n].name = s;
        k[n].idx = i;
        n++;
    }
    qsort(k, n, sizeof *k, kname_cmp);
    *out = k;
    *n_out = n;
    return LK_OK;
}

static void free_knames(kname *k, size_t n) {
    for (size_t i = 0; i < n; i++) lk_free(k[i].name);
    lk_free(k);
}

/* Whether module i's factors apply transposed to weight w, as PEFT's
 * transpose(B @ A, fan_in_fan_out): always for an embedding LoRA (the
 * weight is num_embeddings x dim, lora_embedding_A r x num_embeddings);
 * with fan_in_fan_out (PEFT keeps it only for Conv1D layers, whose weight is
 * in x out) when the weight has the in x out shape, which a square Conv1D
 * weight also has. */
static int is_transposed(const lk_adapter *a, size_t i, const lk_tensor *w) {
    if (a->embed[i]) return 1;
    if (!(a->format == LK_FORMAT_PEFT && a->has_config && a->cfg.fan_in_fan_out) || w->ndim != 2) return 0;
    return w->shape[0] == a->fa[i].shape[1] && w->shape[1] == a->fb[i].shape[0];
}

/* dst (cols x rows) = src^T (src rows x cols), elements of es bytes. */
static void transpose_into(void *dst, const lk_tensor *src) {
    size_t rows = (size_t)src->shape[0], cols = (size_t)src->shape[1], es = lk_dtype_size(src->dtype);
    const unsigned char *s = src->data;
    unsigned char *d = dst;
    for (size_t r = 0; r < rows; r++)
        for (size_t c = 0; c < cols; c++) memcpy(d + (c * rows + r) * es, s + (r * cols + c) * es, es);
}

/* The module's factors oriented for the kernel (W += B A): the file's, or
 * for a transposed module B' = A^T (in x r), A' = B^T (r x out), copied
 * into *buf (advanced). Without buf only the shapes are set. */
static void orient(const lk_adapter *a, size_t i, int transposed, lk_tensor *A, lk_tensor *B, unsigned char **buf) {
    if (!transposed) {
        *A = a->fa[i];
        *B = a->fb[i];
        return;
    }
    const lk_tensor *fa = &a->fa[i], *fb = &a->fb[i];
    *A = *fb;
    A->shape[0] = fb->shape[1];
    A->shape[1] = fb->shape[0];
    *B = *fa;
    B->shape[0] = fa->shape[1];
    B->shape[1] = fa->shape[0];
    if (buf) {
        A->data = *buf;
        transpose_into(*buf, fb);
        *buf += (fb->nbytes + 15) & ~(size_t)15;
        B->data = *buf;
        transpose_into(*buf, fa);
        *buf += (fa->nbytes + 15) & ~(size_t)15;
    }
}

static lk_status check_target(const lk_adapter *a, const lk_lora_module *m, const lk_tensor *w) {
    const char *an = lk_adapter_factor_name(a, 0), *bn = lk_adapter_factor_name(a, 1);
    if (w->ndim != 2)
        return lk_error(LK_ERR_SHAPE, "%s: %s: the model weight %s has %d dimensions; LoRA needs a 2-D weight", a->file,
                        m->module, w->name, w->ndim);
    if (!lk_dtype_is_fusable(w->dtype) && !lk_dtype_is_fp8(w->dtype))
        return lk_error(LK_ERR_DTYPE, "%s: %s: the model weight %s is %s; only F32, F16, BF16 and FP8 can be fused",
                        a->file, m->module, w->name, lk_dtype_name(w->dtype));
    if (m->B.shape[0] != w->shape[0])
        return lk_error(LK_ERR_SHAPE, "%s: %s: %s is %lldx%lld but the model weight is %lldx%lld", a->file, m->module,
                        bn, (long long)m->B.shape[0], (long long)m->B.shape[1], (long long)w->shape[0],
                        (long long)w->shape[1]);
    if (m->A.shape[1] != w->shape[1])
        return lk_error(LK_ERR_SHAPE, "%s: %s: %s is %lldx%lld but the model weight is %lldx%lld", a->file, m->module,
                        an, (long long)m->A.shape[0], (long long)m->A.shape[1], (long long)w->shape[0],
                        (long long)w->shape[1]);
    return LK_OK;
}

static int target_cmp(const void *pa, const void *pb, void *ctx) {
    char **t = ctx;
    return strcmp(t[*(const size_t *)pa], t[*(const size_t *)pb]);
}

lk_status lk_adapter_resolve(lk_adapter *a, const lk_tensor *model, size_t n_model, int allow_unmatched,
                             size_t *n_unmatched) {
    if (!a || (n_model && !model)) return lk_error(LK_ERR_ARG, "lk_adapter_resolve: NULL argument");
    lk_status s = LK_OK;
    size_t *ord = lk_malloc((n_model ? n_model : 1) * sizeof *ord);
    char **tnames = lk_calloc(a->n ? a->n : 1, sizeof *tnames);
    size_t *by = lk_malloc((a->n ? a->n : 1) * sizeof *by);
    char **bnames = lk_calloc(a->n ? a->n : 1, sizeof *bnames);
    size_t *bby = lk_malloc((a->n ? a->n : 1) * sizeof *bby), n_bby = 0;
    char **rnames = lk_calloc(a->n_rep ? a->n_rep : 1, sizeof *rnames);
    unsigned char *trans = lk_calloc(a->n ? a->n : 1, sizeof *trans);
    size_t tbytes = 0;
    size_t *rby = lk_malloc((a->n_rep ? a->n_rep : 1) * sizeof *rby), n_rby = 0;
    kname *kn = NULL;
    size_t n_kn = 0, unmatched = 0, first_unmatched = SIZE_MAX, n_by = 0;
    /* per module and per saved tensor: the exact hit, and the first two keys ending in ".<name>[.weight]" */
    size_t nm_ = a->n ? a->n : 1, nr_ = a->n_rep ? a->n_rep : 1, nsz;
    size_t *mx = lk_checked_mul(nm_ + nr_, 4 * sizeof *mx, &nsz) ? lk_malloc(nsz) : NULL;
    size_t *mfirst = NULL, *msecond = NULL, *msame = NULL, *rx = NULL, *rfirst = NULL, *rsecond = NULL, *rsame = NULL;
    lk_names mt = {0}, rt = {0};
    const char *first_unmatched_rep = NULL;
    char buf[4096];
    if (!ord || !tnames || !by || !bnames || !bby || !rnames || !rby || !trans || !mx) {
        s = lk_error(LK_ERR_NOMEM, "%s: out of memory", a->file);
        goto done;
    }
    mfirst = mx + nm_, msecond = mfirst + nm_, msame = msecond + nm_;
    rx = msame + nm_, rfirst = rx + nr_, rsecond = rfirst + nr_, rsame = rsecond + nr_;
    for (size_t i = 0; i < n_model; i++) {
        if (!model[i].name) {
            s = lk_error(LK_ERR_ARG, "lk_adapter_resolve: model tensor %zu has no name", i);
            goto done;
        }
        ord[i] = i;
    }
    qsort_r(ord, n_model, sizeof *ord, idx_cmp, (void *)model);
    if (a->format == LK_FORMAT_KOHYA && (s = kohya_names(a->file, model, n_model, &kn, &n_kn))) goto done;
    if (a->format != LK_FORMAT_KOHYA) {
        for (size_t i = 0; i < a->n; i++) {
            const lk_lora_module *m = &a->mods[i];
            size_t t = find_with_suffix(model, ord, n_model, m->module, buf, sizeof buf);
            if (t == SIZE_MAX && strcmp(a->stems[i], m->module))
                t = find_with_suffix(model, ord, n_model, a->stems[i], buf, sizeof buf);
            mx[i] = t;
        }
        if ((s = suffix_table(a->file, &mt, a->names, mx, a->n, msame))) goto done;
        suffix_hits(&mt, model, n_model, ".weight", a->n, mfirst, msecond);
    }
    for (size_t r = 0; r < a->n_rep; r++) rx[r] = find_model(model, ord, n_model, a->rep_names[r]);
    if ((s = suffix_table(a->file, &rt, a->rep_names, rx, a->n_rep, rsame))) goto done;
    suffix_hits(&rt, model, n_model, "", a->n_rep, rfirst, rsecond);

    for (size_t i = 0; i < a->n; i++) {
        const lk_lora_module *m = &a->mods[i];
        size_t t = SIZE_MAX;
        if (a->format == LK_FORMAT_KOHYA) {
            kname key = {.name = (char *)kohya_rest(m->module)};
            kname *hit = bsearch(&key, kn, n_kn, sizeof *kn, kname_cmp);
            if (hit) {
                kname *lo = hit, *hi = hit;
                while (lo > kn && !strcmp(lo[-1].name, key.name)) lo--;
                while (hi + 1 < kn + n_kn && !strcmp(hi[1].name, key.name)) hi++;
                if (lo != hi) {
                    s = lk_error(LK_ERR_FORMAT, "%s: %s: ambiguous: matches both model weights %s and %s", a->file,
                                 m->module, model[lo->idx].name, model[lo[1].idx].name);
                    goto done;
                }
                t = hit->idx;
            }
        } else {
            t = mx[i];
            if (t == SIZE_MAX) { /* the one model key ending in ".<m>.weight" */
                t = mfirst[msame[i]];
                if (msecond[msame[i]] != SIZE_MAX) {
                    s = lk_error(LK_ERR_FORMAT, "%s: %s: ambiguous: matches both model weights %s and %s", a->file,
                                 m->module, model[t].name, model[msecond[msame[i]]].name);
                    goto done;
                }
            }
        }
        if (t == SIZE_MAX) {
            if (unmatched++ == 0) first_unmatched = i;
            continue;
        }
        int tr = is_transposed(a, i, &model[t]);
        if (tr && m->magnitude.name) {
            s = lk_error(LK_ERR_UNSUPPORTED, "%s: %s: DoRA on a transposed (fan_in_fan_out) weight is not supported",
                         a->file, m->module);
            goto done;
        }
        lk_lora_module om = *m; /* shapes as the kernel will see them */
        orient(a, i, tr, &om.A, &om.B, NULL);
        if ((s = check_target(a, &om, &model[t]))) goto done;
        if (tr) {
            size_t nb = ((a->fa[i].nbytes + 15) & ~(size_t)15) + ((a->fb[i].nbytes + 15) & ~(size_t)15);
            if (!lk_checked_add(tbytes, nb, &tbytes)) {
                s = lk_error(LK_ERR_NOMEM, "%s: the transposed factors' size overflows", a->file);
                goto done;
            }
            trans[i] = 1;
        }
        if (!(tnames[i] = lk_strdup(model[t].name))) {
            s = lk_error(LK_ERR_NOMEM, "%s: out of memory", a->file);
            goto done;
        }
        by[n_by++] = i;
        if (m->bias.name) { /* lora_bias: the layer's own bias, "<m>.bias" */
            size_t tl = strlen(model[t].name);
            if ((size_t)snprintf(buf, sizeof buf, "%.*sbias", (int)(tl - 6), model[t].name) >= sizeof buf) buf[0] = 0;
            size_t b = find_model(model, ord, n_model, buf);
            if (b == SIZE_MAX) {
                s = lk_error(LK_ERR_UNMATCHED, "%s: %s has a lora_B bias but the model has no %s to add it to", a->file,
                             m->module, buf);
                goto done;
            }
            const lk_tensor *bw = &model[b];
            if (bw->ndim != 1 || bw->shape[0] != a->fb[i].shape[0] || !lk_dtype_is_fusable(bw->dtype)) {
                s = lk_error(LK_ERR_SHAPE, "%s: %s: the model's %s is %s with %d dims; lora_bias needs a 1-D "
                             "F32/F16/BF16 bias of %lld values", a->file, m->module, bw->name, lk_dtype_name(bw->dtype),
                             bw->ndim, (long long)a->fb[i].shape[0]);
                goto done;
            }
            if (!(bnames[i] = lk_strdup(bw->name))) {
                s = lk_error(LK_ERR_NOMEM, "%s: out of memory", a->file);
                goto done;
            }
            bby[n_bby++] = i;
        }
    }
    for (size_t r = 0; r < a->n_rep; r++) { /* tensors saved whole: the model key of that name */
        const lk_adapter_tensor *rp = &a->reps[r];
        size_t t = rx[r];
        if (t == SIZE_MAX) { /* the one model key ending in "." + nm */
            t = rfirst[rsame[r]];
            if (rsecond[rsame[r]] != SIZE_MAX) {
                s = lk_error(LK_ERR_FORMAT, "%s: %s: ambiguous: matches both model tensors %s and %s", a->file, rp->key,
                             model[t].name, model[rsecond[rsame[r]]].name);
                goto done;
            }
        }
        if (t == SIZE_MAX) {
            if (unmatched++ == 0) first_unmatched_rep = rp->key;
            continue;
        }
        const lk_tensor *w = &model[t];
        int same = w->ndim == rp->t.ndim;
        for (int d = 0; same && d < w->ndim; d++) same = w->shape[d] == rp->t.shape[d];
        char ws[64], rs[64];
        if (!same) {
            lk_shape_str(w, ws, sizeof ws);
            lk_shape_str(&rp->t, rs, sizeof rs);
            s = lk_error(LK_ERR_SHAPE, "%s: '%s' (%s) is %s but the model's %s is %s", a->file, rp->key, rp->why, rs,
                         w->name, ws);
            goto done;
        }
        if (!(lk_dtype_is_fusable(w->dtype) && lk_dtype_is_fusable(rp->t.dtype)) && w->dtype != rp->t.dtype) {
            s = lk_error(LK_ERR_DTYPE, "%s: '%s' (%s) is %s but the model's %s is %s", a->file, rp->key, rp->why,
                         lk_dtype_name(rp->t.dtype), w->name, lk_dtype_name(w->dtype));
            goto done;
        }
        if (!(rnames[r] = lk_strdup(w->name))) {
            s = lk_error(LK_ERR_NOMEM, "%s: out of memory", a->file);
            goto done;
        }
        rby[n_rby++] = r;
    }
    if (unmatched && !allow_unmatched && first_unmatched == SIZE_MAX) {
        s = lk_error(LK_ERR_UNMATCHED, "%s: '%s' matches no model tensor%s", a->file, first_unmatched_rep,
                     unmatched > 1 ? " (and more; --allow-unmatched skips them)" : "");
        goto done;
    }
    if (unmatched && !allow_unmatched) {
        const lk_lora_module *m = &a->mods[first_unmatched];
        if (a->format == LK_FORMAT_KOHYA)
            s = lk_error(LK_ERR_UNMATCHED, "%s: %s matches no model weight (no key <x>.weight with x's dots as '_' = %s)%s",
                         a->file, m->module, kohya_rest(m->module),
                         unmatched > 1 ? " (and more modules; --allow-unmatched skips them)" : "");
        else
            s = lk_error(LK_ERR_UNMATCHED, "%s: %s matches no model weight (looked for %s.weight)%s", a->file,
                         m->module, m->module, unmatched > 1 ? " (and more modules; --allow-unmatched skips them)" : "");
        goto done;
    }
    qsort_r(by, n_by, sizeof *by, target_cmp, tnames);
    for (size_t i = 1; i < n_by; i++)
        if (!strcmp(tnames[by[i]], tnames[by[i - 1]])) {
            s = lk_error(LK_ERR_FORMAT, "%s: modules %s and %s both target %s", a->file, a->mods[by[i - 1]].module,
                         a->mods[by[i]].module, tnames[by[i]]);
            goto done;
        }
    qsort_r(rby, n_rby, sizeof *rby, target_cmp, rnames);
    for (size_t i = 1; i < n_rby; i++)
        if (!strcmp(rnames[rby[i]], rnames[rby[i - 1]])) {
            s = lk_error(LK_ERR_FORMAT, "%s: '%s' and '%s' both replace %s", a->file, a->reps[rby[i - 1]].key,
                         a->reps[rby[i]].key, rnames[rby[i]]);
            goto done;
        }
    for (size_t i = 0; i < n_rby; i++) { /* a tensor both replaced and LoRA-fused by this adapter */
        size_t lo = 0, hi = n_by, r = rby[i];
        while (lo < hi) {
            size_t mid = lo + (hi - lo) / 2;
            int c = strcmp(tnames[by[mid]], rnames[r]);
            if (!c) {
                s = lk_error(LK_ERR_FORMAT, "%s: '%s' replaces %s, which module %s also fuses into", a->file,
                             a->reps[r].key, rnames[r], a->mods[by[mid]].module);
                goto done;
            }
            if (c < 0) lo = mid + 1;
            else hi = mid;
        }
    }
    qsort_r(bby, n_bby, sizeof *bby, target_cmp, bnames);
    void *tf = tbytes ? lk_malloc(tbytes) : NULL;
    if (tbytes && !tf) {
        s = lk_error(LK_ERR_NOMEM, "%s: out of memory for %zu bytes of transposed factors", a->file, tbytes);
        goto done;
    }
    /* Commit. */
    unsigned char *tp = tf;
    for (size_t i = 0; i < a->n; i++) orient(a, i, trans[i], &a->mods[i].A, &a->mods[i].B, &tp);
    lk_free(a->tfactors);
    a->tfactors = tf;
    for (size_t i = 0; i < a->n; i++) {
        lk_free(a->targets[i]);
        a->targets[i] = tnames[i];
        a->mods[i].target = tnames[i];
        tnames[i] = NULL;
        lk_free(a->bias_targets[i]);
        a->bias_targets[i] = bnames[i];
        a->mods[i].bias_target = bnames[i];
        bnames[i] = NULL;
    }
    for (size_t r = 0; r < a->n_rep; r++) {
        lk_free(a->rep_targets[r]);
        a->rep_targets[r] = rnames[r];
        a->reps[r].target = rnames[r];
        rnames[r] = NULL;
    }
    lk_free(a->by_target);
    a->by_target = by;
    a->n_by_target = n_by;
    by = NULL;
    lk_free(a->by_bias);
    a->by_bias = bby;
    a->n_by_bias = n_bby;
    bby = NULL;
    lk_free(a->rep_by_target);
    a->rep_by_target = rby;
    a->n_rep_by_target = n_rby;
    rby = NULL;
    if (unmatched)
        lk_log(LK_LOG_WARN, "%s: %zu of %zu modules%s match no model weight and are skipped (first: %s)", a->path,
               unmatched, a->n + a->n_rep, a->n_rep ? " and saved tensors" : "",
               first_unmatched != SIZE_MAX ? a->mods[first_unmatched].module : first_unmatched_rep);
    if (n_unmatched) *n_unmatched = unmatched;
done:
    if (tnames)
        for (size_t i = 0; i < a->n; i++) lk_free(tnames[i]);
    lk_free(tnames);
    if (bnames)
        for (size_t i = 0; i < a->n; i++) lk_free(bnames[i]);
    lk_free(bnames);
    if (rnames)
        for (size_t i = 0; i < a->n_rep; i++) lk_free(rnames[i]);
    lk_free(rnames);
    lk_free(bby);
    lk_free(rby);
    lk_free(trans);
    lk_free(ord);
    lk_free(by);
    lk_free(mx);
    lk_names_free(&mt);
    lk_names_free(&rt);
    free_knames(kn, n_kn);
    return s;
}

/* Binary search of idx[0..n) whose names[idx[k]] are sorted; SIZE_MAX if absent. */
static size_t find_sorted(char *const *names, const size_t *idx, size_t n, const char *key) {
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(names[idx[mid]], key);
        if (c == 0) return idx[mid];
        if (c < 0) lo = mid + 1;
        else hi = mid;
    }
    return SIZE_MAX;
}

const lk_lora_module *lk_adapter_find_target(const lk_adapter *a, const char *target) {
    if (!a || !target) return NULL;
    size_t i = find_sorted(a->targets, a->by_target, a->n_by_target, target);
    return i == SIZE_MAX ? NULL : &a->mods[i];
}

const lk_lora_module *lk_adapter_find_bias_target(const lk_adapter *a, const char *target) {
    if (!a || !target) return NULL;
    size_t i = find_sorted(a->bias_targets, a->by_bias, a->n_by_bias, target);
    return i == SIZE_MAX ? NULL : &a->mods[i];
}

const lk_adapter_tensor *lk_adapter_find_replacement(const lk_adapter *a, const char *target) {
    if (!a || !target) return NULL;
    size_t i = find_sorted(a->rep_targets, a->rep_by_target, a->n_rep_by_target, target);
    return i == SIZE_MAX ? NULL : &a->reps[i];
}
