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
 * guessed. A module none of this finds goes through layout.h: prefixes and
 * components stripped on both sides, then the model family's table, which
 * may place it on rows of a fused weight or split it over several (each
 * placement checked: rows exact, the module's B covered once, no two
 * modules on overlapping rows of one weight). Everything is computed into
 * temporaries and committed only when every module checks out, so a failed
 * resolve leaves the adapter as it was. */
#include "lorakit/adapter.h"
#include "lorakit/alloc.h"
#include "lorakit/log.h"
#include "adapter/adapter.h"
#include "adapter/layout.h"
#include "adapter/names.h"
#include "core/alloc.h"

#include <math.h>
#include <stdint.h>
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

/* strcmp(name, head[0..hl) + tail), without building the second string
 * (a name of any length: a fixed buffer once made a module name over 4 KiB
 * match nothing). */
static int cmp_concat(const char *name, const char *head, size_t hl, const char *tail) {
    int c = strncmp(name, head, hl);
    return c ? c : strcmp(name + hl, tail);
}

/* Index of the model tensor named exactly head[0..hl) + tail, or SIZE_MAX. */
static size_t find_concat(const lk_tensor *model, const size_t *ord, size_t n, const char *head, size_t hl,
                          const char *tail) {
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = cmp_concat(model[ord[mid]].name, head, hl, tail);
        if (c == 0) return ord[mid];
        if (c < 0) lo = mid + 1;
        else hi = mid;
    }
    return SIZE_MAX;
}

/* Index of the model tensor named exactly key, or SIZE_MAX. */
static size_t find_model(const lk_tensor *model, const size_t *ord, size_t n, const char *key) {
    return find_concat(model, ord, n, key, strlen(key), "");
}

/* Index of the model key a tied name "<base>.weight" stands for (opts->tied), or SIZE_MAX. */
static size_t find_tied(const lk_resolve_opts *o, const lk_tensor *model, const size_t *ord, size_t n, const char *base) {
    const size_t bl = strlen(base);
    for (size_t j = 0; o && o->tied && j < o->n_tied; j++) {
        const char *nm = o->tied[2 * j];
        if (nm && !strncmp(nm, base, bl) && !strcmp(nm + bl, ".weight") && o->tied[2 * j + 1])
            return find_concat(model, ord, n, o->tied[2 * j + 1], strlen(o->tied[2 * j + 1]), "");
    }
    return SIZE_MAX;
}

/* Index of the model tensor "<base>.weight", or SIZE_MAX. */
static size_t find_with_suffix(const lk_tensor *model, const size_t *ord, size_t n, const char *base) {
    return find_concat(model, ord, n, base, strlen(base), ".weight");
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
    int comp;
    return lk_layout_strip_module(m, 1, &comp);
}

/* Whether model key nm (l bytes) is a weight, "<x>.weight". */
static int is_weight_key(const char *nm, size_t l) { return l > 7 && !strcmp(nm + l - 7, ".weight"); }

/* The model's weights in kohya form ("a.b_c.weight" -> "a_b_c"), sorted by
 * name: the kname array and its strings carved from one allocation (*out,
 * freed with lk_free). */
static lk_status kohya_names(const char *file, const lk_tensor *model, size_t n_model, kname **out, size_t *n_out) {
    size_t n = 0, chars = 0;
    int ok = 1;
    for (size_t i = 0; i < n_model; i++) {
        const char *nm = model[i].name;
        size_t l = nm ? strlen(nm) : 0;
        if (!is_weight_key(nm, l)) continue;
        n++;
        ok = ok && lk_checked_add(chars, l - 6, &chars); /* each name and its NUL */
    }
    lk_carve lay = {.overflow = !ok};
    LK_CARVE(&lay, n ? n : 1, kname); /* at 0 */
    const size_t o_str = LK_CARVE(&lay, chars, char);
    kname *k = lk_carve_alloc(&lay);
    if (!k) return lk_error(LK_ERR_NOMEM, "%s: out of memory for the model's kohya names", file);
    char *s = (char *)k + o_str;
    n = 0;
    for (size_t i = 0; i < n_model; i++) {
        const char *nm = model[i].name;
        size_t l = nm ? strlen(nm) : 0;
        if (!is_weight_key(nm, l)) continue;
        for (size_t j = 0; j < l - 7; j++) s[j] = nm[j] == '.' ? '_' : nm[j];
        s[l - 7] = '\0';
        k[n++] = (kname){s, i};
        s += l - 6;
    }
    qsort(k, n, sizeof *k, kname_cmp);
    *out = k;
    *n_out = n;
    return LK_OK;
}

/* The axes of model weight k: the caller's (lk_tensor.axes, from the
 * owning layer's type), else by GPT-2's names: in a block whose
 * attn.c_attn.weight is [x, 3x] (transformers' Conv1D stores [in, out]; an
 * nn.Linear's fused qkv would be [3x, x]), attn.c_attn / attn.c_proj /
 * crossattention.{c_attn, q_attn, c_proj} / mlp.c_fc / mlp.c_proj are Conv1D
 * (GPT-2, ImageGPT, Decision Transformer). Square ones (attn.c_proj) are
 * why this matters: their shape fits either way. */
static lk_axes weight_axes(const lk_tensor *model, const size_t *ord, size_t n, size_t k) {
    const lk_tensor *w = &model[k];
    if (w->axes != LK_AXES_UNKNOWN || w->ndim != 2) return w->axes;
    static const char *const parts[] = {".attn.c_attn.weight", ".attn.c_proj.weight", ".crossattention.c_attn.weight",
                                        ".crossattention.q_attn.weight", ".crossattention.c_proj.weight",
                                        ".mlp.c_fc.weight", ".mlp.c_proj.weight"};
    const size_t nl = strlen(w->name);
    for (size_t p = 0; p < sizeof parts / sizeof parts[0]; p++) {
        const size_t pl = strlen(parts[p]);
        if (nl <= pl || strcmp(w->name + nl - pl, parts[p])) continue;
        const size_t qkv = find_concat(model, ord, n, w->name, nl - pl, ".attn.c_attn.weight");
        if (qkv == SIZE_MAX || model[qkv].ndim != 2 || model[qkv].shape[0] <= 0) return LK_AXES_UNKNOWN;
        return model[qkv].shape[1] == 3 * model[qkv].shape[0] ? LK_AXES_IN_OUT : LK_AXES_UNKNOWN;
    }
    return LK_AXES_UNKNOWN;
}

/* Whether module i's factors apply transposed to model weight k, as PEFT's
 * transpose(B @ A, fan_in_fan_out): always for an embedding LoRA (the
 * weight is num_embeddings x dim, lora_embedding_A r x num_embeddings). A
 * PEFT LoRA on a weight known to be [in, out] (weight_axes: a Conv1D) is
 * transposed and one known to be [out, in] is not, whatever the saved
 * config's fan_in_fan_out says: PEFT sets the flag per layer from its type
 * (and saves the value the last layer set: a file targeting Conv1D layers
 * and an nn.Linear lm_head says false). Else, with fan_in_fan_out, when
 * the weight has the in x out shape. */
static int is_transposed(const lk_adapter *a, size_t i, const lk_tensor *model, const size_t *ord, size_t n, size_t k) {
    const lk_tensor *w = &model[k];
    if (a->mods[i].algo != LK_ALGO_LORA) return 0;
    if (a->embed[i]) return 1;
    if (a->format != LK_FORMAT_PEFT || w->ndim != 2) return 0;
    const lk_axes ax = weight_axes(model, ord, n, k);
    if (ax != LK_AXES_UNKNOWN) return ax == LK_AXES_IN_OUT;
    if (!(a->has_config && a->cfg.fan_in_fan_out)) return 0;
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

/* ---- other shapes: conv LoRA, Tucker, LoHa, LoKr, dense ---- */

/* The dimensions after the first, trailing 1s dropped, into o; the count. */
static int tail_dims(const int64_t *sh, int nd, int64_t *o) {
    int n = 0;
    for (int d = 1; d < nd; d++) o[n++] = sh[d];
    while (n > 0 && o[n - 1] == 1) n--;
    return n;
}

/* 1 if a delta of shape [out, tail...] lands on w (trailing 1s ignored: a
 * linear delta on a 1x1 conv weight and back). */
static int same_tail(const int64_t *dsh, int dn, const lk_tensor *w) {
    int64_t x[LK_MAX_DIMS + 1], y[LK_MAX_DIMS + 1];
    int a = tail_dims(dsh, dn, x), b = tail_dims(w->shape, w->ndim, y);
    if (dsh[0] != w->shape[0] || a != b) return 0;
    for (int d = 0; d < a; d++)
        if (x[d] != y[d]) return 0;
    return 1;
}

static void shape_of(const int64_t *sh, int nd, char *buf, size_t cap) {
    lk_tensor t = {0};
    t.ndim = nd;
    for (int d = 0; d < nd; d++) t.shape[d] = sh[d];
    lk_shape_str(&t, buf, cap);
}

static size_t al16(size_t n) { return (n + 15) & ~(size_t)15; }

/* The delta a module adds to its weight, as fit_module checks it: its shape
 * sh[0..n) (n = 0: nothing left to check) and the tensor an error names. */
typedef struct delta_shape {
    int64_t sh[LK_MAX_DIMS + 2];
    int n;
    const lk_tensor *named;
} delta_shape;

/* A replacement (LK_ALGO_SET) against w: the same shape, a dtype the fuse
 * converts (ws: w's shape as text). */
static lk_status fit_replacement(const lk_adapter *a, const lk_lora_module *m, const lk_tensor *w, const char *ws) {
    char xs[96];
    int same = w->ndim == m->dense.ndim;
    for (int d = 0; same && d < w->ndim; d++) same = w->shape[d] == m->dense.shape[d];
    lk_shape_str(&m->dense, xs, sizeof xs);
    if (!same)
        return lk_error(LK_ERR_SHAPE, "%s: %s: '%s' is %s but the model weight %s is %s", a->file, m->module,
                        m->dense.name, xs, w->name, ws);
    if (!(lk_dtype_is_fusable(w->dtype) && lk_dtype_is_fusable(m->dense.dtype)) && w->dtype != m->dense.dtype)
        return lk_error(LK_ERR_DTYPE, "%s: %s: '%s' is %s but the model weight %s is %s", a->file, m->module,
                        m->dense.name, lk_dtype_name(m->dense.dtype), w->name, lk_dtype_name(w->dtype));
    return LK_OK;
}

/* A LoRA's delta (conv and Tucker too) on a weight of N elements per row;
 * *xbytes: a Tucker fold's bytes. */
static void lora_delta(const lk_lora_module *m, size_t N, delta_shape *ds, size_t *xbytes) {
    ds->named = m->mid.data ? &m->mid : &m->A;
    ds->sh[0] = m->B.shape[0];
    if (m->mid.data) {
        ds->sh[1] = m->A.shape[1];
        for (int d = 2; d < m->mid.ndim; d++) ds->sh[d] = m->mid.shape[d];
        ds->n = m->mid.ndim;
        *xbytes = al16((size_t)m->mid.shape[0] * N * sizeof(double));
    } else {
        for (int d = 1; d < m->A.ndim; d++) ds->sh[d] = m->A.shape[d];
        ds->n = m->A.ndim;
    }
}

/* A LoHa's delta on w (N elements per row); *xbytes: its Tucker folds and
 * transposed factors' bytes. */
static void loha_delta(const lk_lora_module *m, const lk_tensor *w, size_t N, delta_shape *ds, size_t *xbytes) {
    ds->named = &m->w1b;
    ds->sh[0] = m->out;
    if (m->t1.data) {
        ds->sh[1] = m->w1b.shape[1];
        for (int d = 2; d < m->t1.ndim; d++) ds->sh[d] = m->t1.shape[d];
        ds->n = m->t1.ndim;
        *xbytes = 2 * al16((size_t)m->t1.shape[0] * N * sizeof(double)) + al16(m->w1a.nbytes) + al16(m->w2a.nbytes);
    } else if (m->w1b.ndim > 2) {
        for (int d = 1; d < m->w1b.ndim; d++) ds->sh[d] = m->w1b.shape[d];
        ds->n = m->w1b.ndim;
    } else { /* LyCORIS flattens a conv's factor to [r, in kh kw] */
        ds->sh[1] = m->in;
        ds->n = (size_t)m->in == N ? 0 : 2; /* matches by elements per row */
        if (!ds->n && m->out != w->shape[0]) ds->n = 2;
    }
}

/* A LoKr's kron(w1, w2) checked against w (N elements per row, ws its shape
 * as text) with a message of its own; *xbytes: its Tucker fold and
 * transposed factor's bytes. Leaves nothing for fit_module to check. */
static lk_status lokr_delta(const lk_adapter *a, const lk_lora_module *m, const lk_tensor *w, size_t N,
                            const char *ws, delta_shape *ds, size_t *xbytes) {
    const lk_tensor *w1 = m->w1.data ? &m->w1 : &m->w1a, *w2 = m->w2.data ? &m->w2 : m->t2.data ? &m->t2 : &m->w2b;
    const int64_t a1 = m->w1.data ? m->w1.shape[0] : m->w1a.shape[0],
                  b1 = m->w1.data ? m->w1.shape[1] : m->w1b.shape[1];
    ds->named = w1;
    ds->sh[0] = m->out;
    if (m->w2.data && m->w2.ndim > 2) { /* kron(w1 [a, b, 1, 1], w2 [c, d, kh, kw]) */
        ds->sh[1] = b1 * m->w2.shape[1];
        for (int d = 2; d < m->w2.ndim; d++) ds->sh[d] = m->w2.shape[d];
        ds->n = m->w2.ndim;
    } else if (m->t2.data) {
        ds->sh[1] = b1 * m->w2b.shape[1];
        for (int d = 2; d < m->t2.ndim; d++) ds->sh[d] = m->t2.shape[d];
        ds->n = m->t2.ndim;
        *xbytes = al16((size_t)m->t2.shape[0] * (size_t)(m->in / b1) * sizeof(double)) + al16(m->w2a.nbytes);
    } else {
        ds->sh[1] = m->in;
        ds->n = 2;
        if ((size_t)m->in == N && m->out == w->shape[0]) ds->n = 0;
    }
    if (ds->n && !same_tail(ds->sh, ds->n, w)) {
        char s1[96], s2[96], dss[96];
        lk_shape_str(w1, s1, sizeof s1);
        lk_shape_str(w2, s2, sizeof s2);
        shape_of(ds->sh, ds->n, dss, sizeof dss);
        return lk_error(LK_ERR_SHAPE, "%s: %s: kron('%s' %s, '%s' %s) is %s (a = %lld rows of w1) but the model "
                        "weight %s is %s", a->file, m->module, w1->name, s1, w2->name, s2, dss, (long long)a1, w->name,
                        ws);
    }
    ds->n = 0;
    return LK_OK;
}

/* A full or norm diff's delta: the dense tensor's own shape (none: nothing
 * to check). */
static void dense_delta(const lk_lora_module *m, const lk_tensor *w, delta_shape *ds) {
    ds->named = m->dense.data ? &m->dense : NULL;
    if (ds->named) {
        for (int d = 0; d < m->dense.ndim; d++) ds->sh[d] = m->dense.shape[d];
        ds->n = m->dense.ndim;
        if (ds->n == 1 && w->ndim == 1) ds->n = ds->sh[0] == w->shape[0] ? 0 : 1;
    }
}

/* OFT / BOFT (the blocks rotate the weight's rows: n b of them) and GLoRA
 * (W a1 a2 needs a1 on the weight's input channels, so a linear or 1 x 1
 * conv weight, and b1 b2 the weight's shape) against w, N elements per row. */
static lk_status wterm_fit(const lk_adapter *a, const lk_lora_module *m, const lk_tensor *w, size_t N,
                           const char *ws) {
    char xs[96];
    if (m->algo != LK_ALGO_GLORA) {
        lk_shape_str(&m->w1, xs, sizeof xs);
        const int64_t b = m->w1.ndim == 2 ? m->rank : 0; /* PEFT's OFT: n blocks of b columns (n 1: shared) */
        const int share = m->oft_peft.block_share;
        if (b && (share == 1 ? m->w1.shape[0] != 1 || N % (size_t)b
                             : (size_t)m->in != N && !(share < 0 && m->w1.shape[0] == 1 && N % (size_t)b == 0)))
            return lk_error(LK_ERR_SHAPE, "%s: %s: '%s' is %s, %lld block(s) of %lld columns%s, but the model weight %s "
                            "is %s (%zu elements per output row)", a->file, m->module, m->w1.name, xs,
                            (long long)m->w1.shape[0], (long long)b,
                            share == 1 ? " (block_share: one block, a multiple of b columns)"
                            : share == 0 ? " (block_share false: n b columns)" : "", w->name, ws, N);
        if (b) return LK_OK;
        if (m->oft_peft.boft && (size_t)m->in != N)
            return lk_error(LK_ERR_SHAPE, "%s: %s: '%s' is %s, %lld blocks of %lld columns, but the model weight %s is %s "
                            "(%zu elements per output row)", a->file, m->module, m->w1.name, xs,
                            (long long)m->w1.shape[1], (long long)m->rank, w->name, ws, N);
        if (m->out != w->shape[0])
            return lk_error(LK_ERR_SHAPE, "%s: %s: '%s' is %s, a rotation of %lld rows, but the model weight %s is %s",
                            a->file, m->module, m->w1.name, xs, (long long)m->out, w->name, ws);
        return LK_OK;
    }
    lk_shape_str(&m->w2b, xs, sizeof xs);
    if (m->out != w->shape[0] || (size_t)m->in != N)
        return lk_error(LK_ERR_SHAPE, "%s: %s: b1 '%s' and b2 '%s' (%s) give a %lld x %lld delta but the model weight %s "
                        "is %s", a->file, m->module, m->w2a.name, m->w2b.name, xs, (long long)m->out,
                        (long long)m->in, w->name, ws);
    if (m->w1a.shape[0] != w->shape[1] || (int64_t)N != w->shape[1]) {
        lk_shape_str(&m->w1a, xs, sizeof xs);
        return lk_error(LK_ERR_SHAPE, "%s: %s: a1 '%s' is %s but the model weight %s is %s (GLoRA needs a1 [in, r] on a "
                        "linear or 1x1 conv weight)", a->file, m->module, m->w1a.name, xs, w->name, ws);
    }
    return LK_OK;
}

/* A DoRA magnitude against w (ws its shape as text): per output row or per
 * input channel, and not on an FP8 weight. */
static lk_status fit_dora(const lk_adapter *a, const lk_lora_module *m, const lk_tensor *w, const char *ws) {
    const lk_tensor *d = &m->dora_scale;
    char xs[96];
    size_t n = lk_tensor_numel(d);
    int on_out = d->shape[0] == w->shape[0] && n == (size_t)w->shape[0];
    int on_in = w->ndim >= 2 && d->ndim >= 2 && d->shape[0] == 1 && n == (size_t)w->shape[1];
    if (!on_out && !on_in) {
        lk_shape_str(d, xs, sizeof xs);
        return lk_error(LK_ERR_SHAPE, "%s: %s: '%s' is %s; for the model weight %s %s DoRA needs [%lld, 1, ...] "
                        "(per output row) or [1, %lld, ...] (per input channel)", a->file, m->module, d->name, xs,
                        w->name, ws, (long long)w->shape[0], (long long)(w->ndim >= 2 ? w->shape[1] : 0));
    }
    if (lk_dtype_is_fp8(w->dtype))
        return lk_error(LK_ERR_UNSUPPORTED, "%s: %s: DoRA on an FP8 weight (%s) is not supported", a->file, m->module,
                        w->name);
    return LK_OK;
}

/* Checks module i (its factors oriented as in m) against weight w; *xbytes
 * gets the bytes its folded / transposed kernel factors need. Steps: a
 * replacement's own check; the weight's dtype and rank; the algorithm's
 * delta shape against the weight; DoRA's magnitude. */
static lk_status fit_module(const lk_adapter *a, const lk_lora_module *m, const lk_tensor *w, size_t *xbytes) {
    char ws[96], xs[96], dss[96];
    lk_shape_str(w, ws, sizeof ws);
    *xbytes = 0;
    if (m->algo == LK_ALGO_SET) return fit_replacement(a, m, w, ws);
    if (!lk_dtype_is_fusable(w->dtype) && !lk_dtype_is_fp8(w->dtype))
        return lk_error(LK_ERR_DTYPE, "%s: %s: the model weight %s is %s; only F32, F16, BF16 and FP8 can be fused",
                        a->file, m->module, w->name, lk_dtype_name(w->dtype));
    if (w->ndim < 1 || (w->ndim < 2 && m->algo != LK_ALGO_FULL && m->algo != LK_ALGO_NORM))
        return lk_error(LK_ERR_SHAPE, "%s: %s: the model weight %s is %s; %s needs a 2-D or convolution weight",
                        a->file, m->module, w->name, ws, lk_algo_name(m->algo));
    const size_t N = lk_tensor_numel(w) / (size_t)w->shape[0];
    delta_shape ds = {.n = 0, .named = NULL};
    lk_status s = LK_OK;
    switch (m->algo) {
    case LK_ALGO_LORA: lora_delta(m, N, &ds, xbytes); break;
    case LK_ALGO_LOHA: loha_delta(m, w, N, &ds, xbytes); break;
    case LK_ALGO_LOKR: s = lokr_delta(a, m, w, N, ws, &ds, xbytes); break;
    case LK_ALGO_OFT:
    case LK_ALGO_BOFT:
    case LK_ALGO_GLORA: s = wterm_fit(a, m, w, N, ws); break;
    default: dense_delta(m, w, &ds); break;
    }
    if (s) return s;
    if (ds.n && !same_tail(ds.sh, ds.n, w)) {
        lk_shape_str(ds.named, xs, sizeof xs);
        shape_of(ds.sh, ds.n, dss, sizeof dss);
        return lk_error(LK_ERR_SHAPE, "%s: %s: '%s' is %s, a delta of %s, but the model weight %s is %s", a->file,
                        m->module, ds.named->name, xs, dss, w->name, ws);
    }
    return m->dora_scale.data ? fit_dora(a, m, w, ws) : LK_OK;
}

/* A 2-D view of t (same data). */
static lk_tensor view2(const lk_tensor *t, int64_t r, int64_t c) {
    lk_tensor v = *t;
    v.ndim = 2;
    v.shape[0] = r;
    v.shape[1] = c;
    for (int d = 2; d < LK_MAX_DIMS; d++) v.shape[d] = 0;
    return v;
}

static double elem(const lk_tensor *t, size_t i) {
    float f;
    lk_to_f32(&f, (const char *)t->data + i * lk_dtype_size(t->dtype), t->dtype, 1);
    return (double)f;
}

/* The Tucker fold, the "A" of the kernel: F[p, i K + h] = sum_q core[p, q, h]
 * down[q, i] (core [R1, R2, K...], down [R2, IN]), an fma chain in f64, q
 * ascending from the first product; F is an F64 tensor R1 x (IN K). */
static lk_tensor fold(const lk_tensor *core, const lk_tensor *down, unsigned char **buf) {
    const size_t R1 = (size_t)core->shape[0], R2 = (size_t)core->shape[1];
    const size_t K = lk_tensor_numel(core) / (R1 * R2), IN = (size_t)down->shape[1];
    double *F = (double *)*buf;
    for (size_t p = 0; p < R1; p++)
        for (size_t i = 0; i < IN; i++)
            for (size_t h = 0; h < K; h++) {
                double acc = elem(core, (p * R2 + 0) * K + h) * elem(down, i);
                for (size_t q = 1; q < R2; q++) acc = fma(elem(core, (p * R2 + q) * K + h), elem(down, q * IN + i), acc);
                F[p * IN * K + i * K + h] = acc;
            }
    lk_tensor v = {0};
    v.name = down->name;
    v.dtype = LK_DTYPE_F64;
    v.ndim = 2;
    v.shape[0] = (int64_t)R1;
    v.shape[1] = (int64_t)(IN * K);
    v.nbytes = R1 * IN * K * sizeof(double);
    v.data = F;
    *buf += al16(v.nbytes);
    return v;
}

/* up [R, out] transposed into [out, R] (its own dtype). */
static lk_tensor transposed(const lk_tensor *up, unsigned char **buf) {
    lk_tensor v = *up;
    v.shape[0] = up->shape[1];
    v.shape[1] = up->shape[0];
    v.data = *buf;
    transpose_into(*buf, up);
    *buf += al16(up->nbytes);
    return v;
}

/* Module m's kernel factors (lk_lora_module.k) for weight w, from buf. */
static void build_kernel_factors(lk_lora_module *m, const lk_tensor *w, unsigned char **buf) {
    const int64_t N = (int64_t)(lk_tensor_numel(w) / (size_t)w->shape[0]);
    memset(m->k, 0, sizeof m->k);
    switch (m->algo) {
    case LK_ALGO_LORA:
        m->k[1] = view2(&m->B, m->B.shape[0], m->B.shape[1]);
        m->k[0] = m->mid.data ? fold(&m->mid, &(lk_tensor){.name = m->A.name, .dtype = m->A.dtype, .ndim = 2,
                                                            .shape = {m->A.shape[0], m->A.shape[1]}, .data = m->A.data},
                                     buf)
                              : view2(&m->A, m->A.shape[0], N);
        break;
    case LK_ALGO_LOHA:
        if (m->t1.data) {
            m->k[0] = fold(&m->t1, &m->w1b, buf);
            m->k[1] = transposed(&m->w1a, buf);
            m->k[2] = fold(&m->t2, &m->w2b, buf);
            m->k[3] = transposed(&m->w2a, buf);
        } else {
            m->k[0] = view2(&m->w1b, m->w1b.shape[0], N);
            m->k[1] = view2(&m->w1a, m->w1a.shape[0], m->w1a.shape[1]);
            m->k[2] = view2(&m->w2b, m->w2b.shape[0], N);
            m->k[3] = view2(&m->w2a, m->w2a.shape[0], m->w2a.shape[1]);
        }
        break;
    case LK_ALGO_LOKR:
        if (m->w1.data) {
            m->k[1] = view2(&m->w1, m->w1.shape[0], m->w1.shape[1]);
        } else {
            m->k[0] = view2(&m->w1b, m->w1b.shape[0], m->w1b.shape[1]);
            m->k[1] = view2(&m->w1a, m->w1a.shape[0], m->w1a.shape[1]);
        }
        {
            const int64_t b1 = m->k[0].data ? m->k[0].shape[1] : m->k[1].shape[1], D = N / b1;
            if (m->w2.data) {
                m->k[3] = view2(&m->w2, m->w2.shape[0], D);
            } else if (m->t2.data) {
                m->k[2] = fold(&m->t2, &m->w2b, buf);
                m->k[3] = transposed(&m->w2a, buf);
            } else {
                m->k[2] = view2(&m->w2b, m->w2b.shape[0], D);
                m->k[3] = view2(&m->w2a, m->w2a.shape[0], m->w2a.shape[1]);
            }
        }
        break;
    case LK_ALGO_OFT:
    case LK_ALGO_BOFT: /* the blocks and the rescale as they are (oft.c reads them) */
        m->k[1] = m->w1;
        if (m->w2.data) m->k[2] = m->w2;
        break;
    case LK_ALGO_GLORA: /* k[1] @ k[0] = b1 b2, and W k[3] k[2] = W a1 a2 */
        m->k[0] = view2(&m->w2b, m->w2b.shape[0], N);
        m->k[1] = view2(&m->w2a, m->w2a.shape[0], m->w2a.shape[1]);
        m->k[2] = view2(&m->w1b, m->w1b.shape[0], m->w1b.shape[1]);
        m->k[3] = view2(&m->w1a, m->w1a.shape[0], m->w1a.shape[1]);
        break;
    default:
        if (m->dense.data) m->k[1] = m->dense;
        break;
    }
}

static int target_cmp(const void *pa, const void *pb, void *ctx) {
    char **t = ctx;
    return strcmp(t[*(const size_t *)pa], t[*(const size_t *)pb]);
}

/* One candidate weight of a module, before its rows are known. */
typedef struct cand {
    size_t key;
    lk_frac w, m;       /* rows of the weight / of the module's B, as fractions */
    const char *rule;
    int kohya;          /* found by its kohya (underscore) spelling */
} cand;

static const lk_frac g_whole = {0, 1, 1, 1};

static int frac_whole(const lk_frac *f) { return f->n0 == 0 && f->n1 == f->d1; }

/* rows * n / d when exact, else -1. */
static int64_t frac_rows(int64_t rows, int64_t n, int64_t d) {
    if (rows < 0 || rows > INT64_MAX / 4096 || (rows * n) % d) return -1;
    return rows * n / d;
}

/* A module's placement being built (committed once every module checks out). */
typedef struct tplace {
    size_t mod, key;
    int64_t row0, b_row0, rows;
    int whole;
    const char *rule;
    int kohya;
} tplace;

static int tplace_cmp(const void *pa, const void *pb, void *ctx) {
    const lk_tensor *model = ctx;
    const tplace *a = pa, *b = pb;
    int c = strcmp(model[a->key].name, model[b->key].name);
    if (c) return c;
    return (a->row0 > b->row0) - (a->row0 < b->row0);
}

static int cand_m_cmp(const void *pa, const void *pb, void *ctx) {
    const int64_t *m0 = ctx;
    const size_t *a = pa, *b = pb;
    return (m0[*a] > m0[*b]) - (m0[*a] < m0[*b]);
}

/* Turns module i's candidates into placements on tp (appended): concrete
 * rows from the weight's and B's row counts, the shapes checked, the
 * module's rows covered exactly once. */
static lk_status place(const lk_adapter *a, size_t i, const lk_tensor *model, const cand *c, size_t nc, int tr,
                       tplace *tp, size_t *ntp, size_t *xbytes) {
    const lk_lora_module *m = &a->mods[i];
    lk_lora_module om = *m;
    orient(a, i, tr, &om.A, &om.B, NULL);
    int64_t mb = om.B.shape[0];
    int64_t w0[LK_ADAPTER_MAX_SLICES], m0[LK_ADAPTER_MAX_SLICES], len[LK_ADAPTER_MAX_SLICES];
    size_t ord[LK_ADAPTER_MAX_SLICES];
    /* a plain 2-D LoRA keeps its 2-D messages; conv / Tucker LoRA, LoHa,
     * LoKr, dense ones and DoRA through fit_module */
    const int plain = m->algo == LK_ALGO_LORA && !m->mid.data && om.A.ndim == 2 && om.B.ndim == 2 && !m->dora_scale.data;
    if (nc == 1 && frac_whole(&c[0].w) && frac_whole(&c[0].m)) {
        const lk_tensor *w = &model[c[0].key];
        lk_status s = plain && w->ndim <= 2 ? check_target(a, &om, w) : fit_module(a, &om, w, xbytes);
        if (s) return s;
        tp[(*ntp)++] = (tplace){i, c[0].key, 0, 0, m->algo == LK_ALGO_LORA ? mb : m->out, 1, c[0].rule, c[0].kohya};
        return LK_OK;
    }
    if (tr || m->magnitude.name || m->bias.name || !plain)
        return lk_error(LK_ERR_UNSUPPORTED, "%s: %s lands on rows of %s (%s); %s on a row slice is not supported",
                        a->file, m->module, model[c[0].key].name, c[0].rule,
                        tr ? "a transposed (embedding / fan_in_fan_out) LoRA"
                        : m->magnitude.name || m->dora_scale.name ? "DoRA"
                        : m->bias.name ? "lora_bias"
                        : m->algo != LK_ALGO_LORA ? lk_algo_name(m->algo) : "a conv or Tucker LoRA");
    for (size_t k = 0; k < nc; k++) {
        const lk_tensor *w = &model[c[k].key];
        if (w->ndim != 2) {
            lk_status s = check_target(a, &om, w);
            if (s) return s;
        }
        int64_t wr = w->shape[0];
        int64_t a0 = frac_rows(wr, c[k].w.n0, c[k].w.d0), a1 = frac_rows(wr, c[k].w.n1, c[k].w.d1);
        int64_t b0 = frac_rows(mb, c[k].m.n0, c[k].m.d0), b1 = frac_rows(mb, c[k].m.n1, c[k].m.d1);
        if (a0 < 0 || a1 < 0 || b0 < 0 || b1 < 0 || a1 - a0 != b1 - b0)
            return lk_error(LK_ERR_SHAPE,
                            "%s: %s: rows %lld/%lld..%lld/%lld of its %s (%lld rows) do not fit rows %lld/%lld..%lld/%lld "
                            "of %s (%lld rows) (%s)", a->file, m->module, (long long)c[k].m.n0, (long long)c[k].m.d0,
                            (long long)c[k].m.n1, (long long)c[k].m.d1, lk_adapter_factor_name(a, 1), (long long)mb,
                            (long long)c[k].w.n0, (long long)c[k].w.d0, (long long)c[k].w.n1, (long long)c[k].w.d1,
                            w->name, (long long)wr, c[k].rule);
        if (om.A.shape[1] != w->shape[1])
            return lk_error(LK_ERR_SHAPE, "%s: %s: %s is %lldx%lld but the model weight %s is %lldx%lld (%s)", a->file,
                            m->module, lk_adapter_factor_name(a, 0), (long long)om.A.shape[0], (long long)om.A.shape[1],
                            w->name, (long long)w->shape[0], (long long)w->shape[1], c[k].rule);
        if (!lk_dtype_is_fusable(w->dtype))
            return lk_error(LK_ERR_DTYPE, "%s: %s: the model weight %s is %s; a row slice needs F32, F16 or BF16",
                            a->file, m->module, w->name, lk_dtype_name(w->dtype));
        w0[k] = a0;
        m0[k] = b0;
        len[k] = a1 - a0;
        ord[k] = k;
    }
    qsort_r(ord, nc, sizeof *ord, cand_m_cmp, m0);
    int64_t at = 0;
    for (size_t j = 0; j < nc; j++) {
        size_t k = ord[j];
        if (m0[k] < at)
            return lk_error(LK_ERR_FORMAT, "%s: %s: ambiguous: matches both model weights %s and %s", a->file,
                            m->module, model[c[ord[j - 1]].key].name, model[c[k].key].name);
        if (m0[k] > at) break;
        at += len[k];
    }
    if (at != mb)
        return lk_error(LK_ERR_SHAPE, "%s: %s: only rows 0..%lld of its %s's %lld land on the model (%s onto %s)",
                        a->file, m->module, (long long)at, lk_adapter_factor_name(a, 1), (long long)mb, c[0].rule,
                        model[c[0].key].name);
    for (size_t j = 0; j < nc; j++) {
        size_t k = ord[j];
        int whole = w0[k] == 0 && len[k] == model[c[k].key].shape[0] && len[k] == mb;
        tp[(*ntp)++] = (tplace){i, c[k].key, w0[k], m0[k], len[k], whole, c[k].rule, c[k].kohya};
    }
    return LK_OK;
}

/* Module i's candidates through the layout (prefixes, kohya form, tables). */
static lk_status layout_cands(const lk_adapter *a, size_t i, const lk_layout *lay, const lk_tensor *model, cand *c,
                              size_t *nc, int *comp) {
    const char *mn = a->mods[i].module;
    int kohya = lk_adapter_kohya_module(a, mn);
    const char *q = lk_layout_strip_module(kohya ? mn : a->stems[i], kohya, comp);
    size_t idx[LK_ADAPTER_MAX_SLICES + 1];
    size_t n = lk_layout_find(lay, q, kohya, *comp, idx, LK_ADAPTER_MAX_SLICES + 1);
    *nc = 0;
    for (size_t k = 0; k < n && k < LK_ADAPTER_MAX_SLICES + 1; k++) {
        const lk_alias *al = &lay->al[idx[k]];
        size_t j = 0; /* one weight reached under two spellings counts once */
        while (j < *nc && !(c[j].key == al->key && !memcmp(&c[j].w, &al->w, sizeof al->w) &&
                            !memcmp(&c[j].m, &al->m, sizeof al->m)))
            j++;
        if (j < *nc) continue;
        if (*nc == LK_ADAPTER_MAX_SLICES)
            return lk_error(LK_ERR_FORMAT, "%s: %s lands on more than %d weights (%s, %s, ...)", a->file, mn,
                            LK_ADAPTER_MAX_SLICES, model[c[0].key].name, model[c[1].key].name);
        c[(*nc)++] = (cand){al->key, al->w, al->m, al->rule, kohya};
    }
    if (*nc > 1 && frac_whole(&c[0].m) && frac_whole(&c[0].w))
        return lk_error(LK_ERR_FORMAT, "%s: %s: ambiguous: matches both model weights %s and %s (%s%s)", a->file, mn,
                        model[c[0].key].name, model[c[1].key].name, kohya ? "kohya form " : "", q);
    return LK_OK;
}

lk_status lk_adapter_resolve(lk_adapter *a, const lk_tensor *model, size_t n_model, int allow_unmatched,
                             size_t *n_unmatched) {
    lk_resolve_opts o = {.allow_unmatched = allow_unmatched};
    return lk_adapter_resolve_opts(a, model, n_model, &o, n_unmatched);
}

/* ---- lk_adapter_resolve_opts in steps: scratch, index the model, match
 * and place each module and saved tensor, check the whole, build, commit ---- */

/* One resolve. scratch is one allocation carved into the per-key,
 * per-module and per-saved-tensor arrays below. Owned here until commit
 * moves them into the adapter (resolve_free frees what is left): the
 * strings in tnames / bnames / rnames, tp, bby, rby, pl, plstr, tf, xf,
 * the name tables, kn and the layout. */
typedef struct resolve_ctx {
    lk_adapter *a;
    const lk_tensor *model;
    size_t n_model;
    const lk_resolve_opts *opts;
    int allow_unmatched, want_comp;
    unsigned char *scratch;
    size_t *ord;                  /* model indices sorted by name */
    size_t *tidx;                 /* per module: its (first) weight */
    size_t *mx, *mfirst, *msecond, *msame; /* per module: exact hit, first two suffix hits, id in mt */
    size_t *rx, *rfirst, *rsecond, *rsame; /* the same per saved tensor, in rt */
    char **tnames, **bnames;      /* per module: its weight's and its bias's names, or NULL */
    char **rnames;                /* per saved tensor: the model tensor it replaces, or NULL */
    unsigned char *trans, *mcomp; /* per module: transposed; the component of an unmatched one */
    lk_names mt, rt;              /* module and saved-tensor names looked up by suffix */
    kname *kn;                    /* kohya: the model's kohya names, sorted */
    size_t n_kn;
    lk_layout lay;
    int have_lay;
    char *family;                 /* a copy of lay.family, for the adapter */
    tplace *tp;                   /* the placements being built */
    size_t n_tp, tp_cap;
    size_t *bby, n_bby;           /* modules with a bias target (a->by_bias) */
    size_t *rby, n_rby;           /* matched saved tensors (a->rep_by_target) */
    size_t tbytes, xbytes;        /* transposed / folded factors' bytes */
    lk_adapter_placement *pl;
    char **plstr;
    void *tf, *xf;                /* the transposed and folded factors */
    size_t matched, unmatched, foreign, first_unmatched;
    const char *first_unmatched_rep;
    size_t comp_hit[LK_COMP_COUNT], comp_miss[LK_COMP_COUNT], comp_first[LK_COMP_COUNT];
} resolve_ctx;

/* The resolve's scratch as one zeroed allocation, carved (the name arrays
 * NULL, the flags 0); bby and rby on their own (the adapter keeps them). On
 * failure c owns what was made. */
static lk_status resolve_scratch(resolve_ctx *c) {
    const size_t n = c->a->n, nr = c->a->n_rep;
    lk_carve lay = {0};
    const size_t o_ord = LK_CARVE(&lay, c->n_model, size_t);
    const size_t o_tidx = LK_CARVE(&lay, n, size_t);
    const size_t o_mx = lk_carve_part(&lay, n, 4 * sizeof(size_t), _Alignof(size_t));
    const size_t o_rx = lk_carve_part(&lay, nr, 4 * sizeof(size_t), _Alignof(size_t));
    const size_t o_names = lk_carve_part(&lay, n, 2 * sizeof(char *), _Alignof(char *));
    const size_t o_rnames = LK_CARVE(&lay, nr, char *);
    const size_t o_flags = lk_carve_part(&lay, n, 2, 1);
    unsigned char *p = c->scratch = lk_carve_alloc(&lay);
    c->bby = lk_calloc(n ? n : 1, sizeof *c->bby);
    c->rby = lk_calloc(nr ? nr : 1, sizeof *c->rby);
    if (!p || !c->bby || !c->rby) return lk_error(LK_ERR_NOMEM, "%s: out of memory", c->a->file);
    c->ord = (size_t *)(p + o_ord);
    c->tidx = (size_t *)(p + o_tidx);
    c->mx = (size_t *)(p + o_mx), c->mfirst = c->mx + n, c->msecond = c->mfirst + n, c->msame = c->msecond + n;
    c->rx = (size_t *)(p + o_rx), c->rfirst = c->rx + nr, c->rsecond = c->rfirst + nr, c->rsame = c->rsecond + nr;
    c->tnames = (char **)(p + o_names), c->bnames = c->tnames + n;
    c->rnames = (char **)(p + o_rnames);
    c->trans = p + o_flags, c->mcomp = c->trans + n;
    return LK_OK;
}

/* The layout (prefixes, components, the family's table), built once, when
 * first needed; c owns it. */
static lk_status need_layout(resolve_ctx *c) {
    if (c->have_lay) return LK_OK;
    const lk_resolve_opts *o = c->opts;
    lk_layout_opts lo = {o ? o->arch : NULL, o ? o->maps : NULL, o ? o->n_maps : 0};
    lk_status s = lk_layout_build(c->model, c->n_model, &lo, c->a->path, &c->lay);
    if (!s) c->have_lay = 1;
    return s;
}

/* The lookups every module shares: the table the user named, the model's
 * keys sorted, their kohya names, and for each module and saved tensor the
 * exact key and the first two keys ending in ".<name>[.weight]". */
static lk_status resolve_index(resolve_ctx *c) {
    const lk_adapter *a = c->a;
    const lk_tensor *model = c->model;
    const size_t n_model = c->n_model;
    lk_status s;
    /* A table the user named (--arch, --map) is read and checked even where every module lands
     * without it: a missing or malformed one is an error, never silently unused. */
    if (c->opts && (c->opts->arch || c->opts->n_maps) && (s = need_layout(c))) return s;
    for (size_t i = 0; i < n_model; i++) {
        if (!model[i].name) return lk_error(LK_ERR_ARG, "lk_adapter_resolve: model tensor %zu has no name", i);
        c->ord[i] = i;
    }
    qsort_r(c->ord, n_model, sizeof *c->ord, idx_cmp, (void *)model);
    for (size_t j = 0; c->opts && j < c->opts->n_tied; j++) {
        const char *nm = c->opts->tied ? c->opts->tied[2 * j] : NULL, *key = nm ? c->opts->tied[2 * j + 1] : NULL;
        if (!nm || !key) return lk_error(LK_ERR_ARG, "lk_adapter_resolve: tied pair %zu is NULL", j);
        if (find_model(model, c->ord, n_model, key) == SIZE_MAX)
            return lk_error(LK_ERR_ARG, "tied name %s=%s: the model has no tensor %s", nm, key, key);
    }
    if ((a->format == LK_FORMAT_KOHYA || a->kohya_mixed) && (s = kohya_names(a->file, model, n_model, &c->kn, &c->n_kn)))
        return s;
    for (size_t i = 0; i < a->n; i++) { /* dotted names (kohya's underscore names are looked up by match_module) */
        const lk_lora_module *m = &a->mods[i];
        if (lk_adapter_kohya_module(a, m->module)) {
            c->mx[i] = SIZE_MAX;
            continue;
        }
        size_t t = find_with_suffix(model, c->ord, n_model, m->module);
        if (t == SIZE_MAX && strcmp(a->stems[i], m->module)) t = find_with_suffix(model, c->ord, n_model, a->stems[i]);
        if (t == SIZE_MAX) t = find_tied(c->opts, model, c->ord, n_model, m->module);
        if (t == SIZE_MAX && strcmp(a->stems[i], m->module)) t = find_tied(c->opts, model, c->ord, n_model, a->stems[i]);
        c->mx[i] = t;
    }
    if ((s = suffix_table(a->file, &c->mt, a->names, c->mx, a->n, c->msame))) return s;
    suffix_hits(&c->mt, model, n_model, ".weight", a->n, c->mfirst, c->msecond);
    for (size_t r = 0; r < a->n_rep; r++) c->rx[r] = find_model(model, c->ord, n_model, a->rep_names[r]);
    if ((s = suffix_table(a->file, &c->rt, a->rep_names, c->rx, a->n_rep, c->rsame))) return s;
    suffix_hits(&c->rt, model, n_model, "", a->n_rep, c->rfirst, c->rsecond);
    return LK_OK;
}

/* Module i's weight by name alone (*rule says how): its kohya form among
 * the model's kohya names, else "<m>.weight" (or its stem's), else the one
 * key ending in ".<m>.weight"; *t = SIZE_MAX when none. Two hits: an
 * ambiguity error. */
static lk_status match_module(const resolve_ctx *c, size_t i, int kohya, size_t *t, const char **rule) {
    const lk_adapter *a = c->a;
    const lk_lora_module *m = &a->mods[i];
    *t = SIZE_MAX;
    *rule = "exact";
    if (kohya) {
        kname key = {.name = (char *)kohya_rest(m->module)};
        kname *hit = bsearch(&key, c->kn, c->n_kn, sizeof *c->kn, kname_cmp);
        *rule = "kohya form";
        if (!hit) return LK_OK;
        kname *lo = hit, *hi = hit;
        while (lo > c->kn && !strcmp(lo[-1].name, key.name)) lo--;
        while (hi + 1 < c->kn + c->n_kn && !strcmp(hi[1].name, key.name)) hi++;
        if (lo != hi)
            return lk_error(LK_ERR_FORMAT, "%s: %s: ambiguous: matches both model weights %s and %s", a->file,
                            m->module, c->model[lo->idx].name, c->model[lo[1].idx].name);
        *t = hit->idx;
        return LK_OK;
    }
    *t = c->mx[i];
    if (*t == SIZE_MAX) { /* the one model key ending in ".<m>.weight" */
        *rule = "suffix";
        *t = c->mfirst[c->msame[i]];
        if (c->msecond[c->msame[i]] != SIZE_MAX)
            return lk_error(LK_ERR_FORMAT, "%s: %s: ambiguous: matches both model weights %s and %s", a->file,
                            m->module, c->model[*t].name, c->model[c->msecond[c->msame[i]]].name);
    }
    return LK_OK;
}

/* Room in c->tp for nc more placements. */
static lk_status tp_reserve(resolve_ctx *c, size_t nc) {
    if (c->n_tp + nc <= c->tp_cap) return LK_OK;
    size_t cap = (c->tp_cap ? 2 * c->tp_cap : 64) + nc;
    tplace *tp = lk_realloc(c->tp, cap * sizeof *tp);
    if (!tp) return lk_error(LK_ERR_NOMEM, "%s: out of memory", c->a->file);
    c->tp = tp;
    c->tp_cap = cap;
    return LK_OK;
}

/* Module i on its candidate weights cs[0..nc): transposed or not, placed
 * (place), its transposed / folded bytes counted, its weight's name kept
 * (tnames[i], owned by c). */
static lk_status place_module(resolve_ctx *c, size_t i, const cand *cs, size_t nc) {
    const lk_adapter *a = c->a;
    const lk_lora_module *m = &a->mods[i];
    int tr = nc == 1 && is_transposed(a, i, c->model, c->ord, c->n_model, cs[0].key);
    if (tr && m->magnitude.name)
        return lk_error(LK_ERR_UNSUPPORTED, "%s: %s: DoRA on a transposed (fan_in_fan_out) weight is not supported",
                        a->file, m->module);
    lk_status s = tp_reserve(c, nc);
    size_t xb = 0;
    if (s || (s = place(a, i, c->model, cs, nc, tr, c->tp, &c->n_tp, &xb))) return lk_error_at(s, a->file, m->module);
    if (!lk_checked_add(c->xbytes, xb, &c->xbytes))
        return lk_error(LK_ERR_NOMEM, "%s: the folded factors' size overflows", a->file);
    const size_t t = cs[0].key;
    c->tidx[i] = t;
    if (tr) {
        size_t nb = ((a->fa[i].nbytes + 15) & ~(size_t)15) + ((a->fb[i].nbytes + 15) & ~(size_t)15);
        if (!lk_checked_add(c->tbytes, nb, &c->tbytes))
            return lk_error(LK_ERR_NOMEM, "%s: the transposed factors' size overflows", a->file);
        c->trans[i] = 1;
    }
    if (!(c->tnames[i] = lk_strdup(c->model[t].name))) return lk_error(LK_ERR_NOMEM, "%s: out of memory", a->file);
    return LK_OK;
}

/* lora_bias of placed module i: the layer's own bias, "<m>.bias" beside its
 * weight, checked; its name kept (bnames[i], owned by c). */
static lk_status module_bias(resolve_ctx *c, size_t i) {
    const lk_adapter *a = c->a;
    const lk_lora_module *m = &a->mods[i];
    const lk_tensor *model = c->model, *w = &model[c->tidx[i]];
    size_t tl = strlen(w->name) - 6; /* "<m>." of "<m>.weight" */
    size_t b = find_concat(model, c->ord, c->n_model, w->name, tl, "bias");
    if (b == SIZE_MAX)
        return lk_error(LK_ERR_UNMATCHED, "%s: %s has a bias delta ('%s') but the model has no %.*sbias to add it "
                        "to", a->file, m->module, m->bias.name, (int)tl, w->name);
    const lk_tensor *bw = &model[b];
    if (bw->ndim != 1 || bw->shape[0] != w->shape[0] || !lk_dtype_is_fusable(bw->dtype) ||
        lk_tensor_numel(&m->bias) != (size_t)bw->shape[0])
        return lk_error(LK_ERR_SHAPE, "%s: %s: the model's %s is %s with %d dims; '%s' needs a 1-D "
                        "F32/F16/BF16 bias of %lld values", a->file, m->module, bw->name, lk_dtype_name(bw->dtype),
                        bw->ndim, m->bias.name, (long long)w->shape[0]);
    if (!(c->bnames[i] = lk_strdup(bw->name))) return lk_error(LK_ERR_NOMEM, "%s: out of memory", a->file);
    c->bby[c->n_bby++] = i;
    return LK_OK;
}

/* Module i: its candidate weights by name (match_module) or through the
 * layout; skipped when it belongs to another pipeline component, counted
 * when it lands nowhere, else placed (place_module) with its bias. */
static lk_status resolve_module(resolve_ctx *c, size_t i) {
    const lk_adapter *a = c->a;
    const lk_lora_module *m = &a->mods[i];
    const int kohya = lk_adapter_kohya_module(a, m->module);
    const char *rule, *stem = kohya ? m->module : a->stems[i];
    size_t t;
    lk_status s = match_module(c, i, kohya, &t, &rule);
    if (s) return s;
    if (c->want_comp) { /* one component of a pipeline: another component's modules are not ours */
        int mc;
        lk_layout_strip_module(stem, kohya, &mc);
        if (mc != LK_COMP_ANY && mc != c->want_comp) return LK_OK;
    }
    cand cs[LK_ADAPTER_MAX_SLICES];
    size_t nc = 0;
    int comp = LK_COMP_ANY;
    if (t != SIZE_MAX) {
        cs[0] = (cand){t, g_whole, g_whole, rule, 0};
        nc = 1;
        lk_layout_strip_module(stem, kohya, &comp);
    } else if ((s = need_layout(c)) || (s = layout_cands(a, i, &c->lay, c->model, cs, &nc, &comp))) {
        return s;
    }
    if (nc == 0 && c->want_comp) return LK_OK; /* the pipeline checks that every module landed somewhere */
    if (nc == 0 && m->algo == LK_ALGO_SET) /* a replacement needs its weight, always */
        return lk_error(LK_ERR_UNMATCHED, "%s: %s: '%s' replaces a weight the model does not have (no %s.weight)",
                        a->file, m->module, m->dense.name, lk_adapter_kohya_module(a, m->module) ? kohya_rest(m->module)
                                                                                         : m->module);
    if (nc == 0) {
        c->mcomp[i] = (unsigned char)comp;
        if (c->comp_miss[comp]++ == 0) c->comp_first[comp] = i;
        if (c->unmatched++ == 0) c->first_unmatched = i;
        return LK_OK;
    }
    c->comp_hit[comp]++;
    c->matched++;
    if ((s = place_module(c, i, cs, nc))) return s;
    return m->bias.name ? module_bias(c, i) : LK_OK;
}

/* Saved tensor r (kept whole): the model key of its name, or the one key
 * ending in "." + name, with its shape and dtype checked; its name kept
 * (rnames[r], owned by c); counted when none. */
static lk_status resolve_rep(resolve_ctx *c, size_t r) {
    const lk_adapter *a = c->a;
    const lk_adapter_tensor *rp = &a->reps[r];
    size_t t = c->rx[r];
    if (t == SIZE_MAX) { /* the one model key ending in "." + nm */
        t = c->rfirst[c->rsame[r]];
        if (c->rsecond[c->rsame[r]] != SIZE_MAX)
            return lk_error(LK_ERR_FORMAT, "%s: %s: ambiguous: matches both model tensors %s and %s", a->file, rp->key,
                            c->model[t].name, c->model[c->rsecond[c->rsame[r]]].name);
    }
    for (size_t j = 0; t == SIZE_MAX && c->opts && c->opts->tied && j < c->opts->n_tied; j++) /* a tied name */
        if (c->opts->tied[2 * j] && c->opts->tied[2 * j + 1] && !strcmp(c->opts->tied[2 * j], a->rep_names[r]))
            t = find_model(c->model, c->ord, c->n_model, c->opts->tied[2 * j + 1]);
    if (t == SIZE_MAX) {
        if (c->unmatched++ == 0) c->first_unmatched_rep = rp->key;
        return LK_OK;
    }
    const lk_tensor *w = &c->model[t];
    int same = w->ndim == rp->t.ndim;
    for (int d = 0; same && d < w->ndim; d++) same = w->shape[d] == rp->t.shape[d];
    char ws[64], rs[64];
    if (!same) {
        lk_shape_str(w, ws, sizeof ws);
        lk_shape_str(&rp->t, rs, sizeof rs);
        return lk_error(LK_ERR_SHAPE, "%s: '%s' (%s) is %s but the model's %s is %s", a->file, rp->key, rp->why, rs,
                        w->name, ws);
    }
    if (!(lk_dtype_is_fusable(w->dtype) && lk_dtype_is_fusable(rp->t.dtype)) && w->dtype != rp->t.dtype)
        return lk_error(LK_ERR_DTYPE, "%s: '%s' (%s) is %s but the model's %s is %s", a->file, rp->key, rp->why,
                        lk_dtype_name(rp->t.dtype), w->name, lk_dtype_name(w->dtype));
    if (!(c->rnames[r] = lk_strdup(w->name))) return lk_error(LK_ERR_NOMEM, "%s: out of memory", a->file);
    c->rby[c->n_rby++] = r;
    return LK_OK;
}

/* Modules of a component the base does not hold (a diffusers SD LoRA's
 * text_encoder. half on a UNet file): one warning per component, not
 * unmatched, when other modules landed and none of that component did. */
static void skip_foreign(resolve_ctx *c) {
    const lk_adapter *a = c->a;
    for (int k = LK_COMP_DIFFUSION; k < LK_COMP_COUNT; k++)
        if (c->comp_miss[k] && !c->comp_hit[k] && c->matched) {
            lk_log(LK_LOG_WARN, "%s: %zu modules for component %s (first: %s) are skipped: the base holds no %s "
                   "weights", a->path, c->comp_miss[k], lk_comp_name(k), a->mods[c->comp_first[k]].module,
                   lk_comp_name(k));
            c->foreign += c->comp_miss[k];
            c->unmatched -= c->comp_miss[k];
            if (c->first_unmatched != SIZE_MAX && c->mcomp[c->first_unmatched] == k) c->first_unmatched = SIZE_MAX;
        }
    if (c->foreign && c->first_unmatched == SIZE_MAX) /* the first unmatched module of another component */
        for (size_t i = 0; i < a->n && c->first_unmatched == SIZE_MAX; i++)
            if (!c->tnames[i] && !(c->comp_miss[c->mcomp[i]] && !c->comp_hit[c->mcomp[i]] && c->mcomp[i] != LK_COMP_ANY))
                c->first_unmatched = i;
}

/* The hint for an unmatched output head ("lm_head", "<...>.lm_head"): its
 * weight may be tied to the input embedding and so saved once, under the
 * embedding's name (transformers' tie_word_embeddings). */
static const char *tied_hint(const char *module) {
    const size_t l = strlen(module);
    if (l < 7 || strcmp(module + l - 7, "lm_head") || (l > 7 && module[l - 8] != '.')) return "";
    return "; if the model ties it to its input embedding (transformers' tie_word_embeddings), the checkpoint holds "
           "that weight once, under the embedding's name: say so with --tie NAME=KEY (e.g. --tie "
           "lm_head.weight=model.embed_tokens.weight; Python: tied={NAME: KEY})";
}

/* Unmatched modules and saved tensors: an error naming the first unless
 * allow_unmatched; an adapter of which nothing lands, always an error. */
static lk_status check_unmatched(const resolve_ctx *c) {
    const lk_adapter *a = c->a;
    const size_t unmatched = c->unmatched, first_unmatched = c->first_unmatched;
    /* the hint for the first unmatched module: --allow-unmatched helps only when something else lands */
    const char *more_unmatched = !c->matched && !c->n_rby ? " (and nothing else of it matches: is it for this model?)"
                                 : unmatched > 1          ? " (and more; --allow-unmatched skips them)"
                                                          : "";
    if (unmatched && !c->allow_unmatched && first_unmatched == SIZE_MAX && c->first_unmatched_rep)
        return lk_error_at(lk_error(LK_ERR_UNMATCHED, "%s: '%s' matches no model tensor%s", a->file,
                                    c->first_unmatched_rep, more_unmatched),
                           a->file, c->first_unmatched_rep);
    if (unmatched && !c->allow_unmatched && first_unmatched != SIZE_MAX) {
        const lk_lora_module *m = &a->mods[first_unmatched];
        if (lk_adapter_kohya_module(a, m->module))
            lk_error(LK_ERR_UNMATCHED, "%s: %s matches no model weight (no key <x>.weight with x's dots as '_' = "
                     "%s)%s", a->file, m->module, kohya_rest(m->module), more_unmatched);
        else
            lk_error(LK_ERR_UNMATCHED, "%s: %s matches no model weight (looked for %s.weight)%s%s", a->file, m->module,
                     m->module, more_unmatched, tied_hint(m->module));
        return lk_error_at(LK_ERR_UNMATCHED, a->file, m->module);
    }
    /* An adapter none of whose modules (or saved tensors) lands anywhere is an
     * error even with allow_unmatched: that flag skips some modules, and a
     * fuse that changes nothing at all is never what was meant (the wrong
     * adapter, or the wrong base). */
    if (a->n + a->n_rep && !c->matched && !c->n_rby && c->allow_unmatched != LK_RESOLVE_LIST_ALL) {
        const char *first = first_unmatched != SIZE_MAX ? a->mods[first_unmatched].module : c->first_unmatched_rep;
        return lk_error(LK_ERR_UNMATCHED, "%s: none of its %zu module%s matches a weight of the model (first: %s), so "
                        "it would change nothing; --allow-unmatched skips some unmatched modules, never all of them",
                        a->file, a->n + a->n_rep, a->n + a->n_rep == 1 ? "" : "s", first ? first : "?");
    }
    return LK_OK;
}

/* Two modules on one weight only on disjoint rows, at most
 * LK_ADAPTER_MAX_SLICES on one; sorts tp by (weight, first row). */
static lk_status check_placements(resolve_ctx *c) {
    const lk_adapter *a = c->a;
    const lk_tensor *model = c->model;
    const tplace *tp = c->tp;
    if (c->n_tp) qsort_r(c->tp, c->n_tp, sizeof *c->tp, tplace_cmp, (void *)model);
    for (size_t i = 1; i < c->n_tp; i++) {
        const tplace *p = &tp[i - 1], *q = &tp[i];
        if (p->key != q->key || p->row0 + p->rows <= q->row0) continue;
        if (p->whole && q->whole)
            return lk_error(LK_ERR_FORMAT, "%s: modules %s and %s both target %s", a->file, a->mods[p->mod].module,
                            a->mods[q->mod].module, model[q->key].name);
        return lk_error(LK_ERR_FORMAT, "%s: modules %s (%s) and %s (%s) both land on rows %lld..%lld of %s", a->file,
                        a->mods[p->mod].module, p->rule, a->mods[q->mod].module, q->rule, (long long)q->row0,
                        (long long)(p->row0 + p->rows < q->row0 + q->rows ? p->row0 + p->rows : q->row0 + q->rows),
                        model[q->key].name);
    }
    for (size_t i = 0, run = 0; i < c->n_tp; i++) {
        run = i && tp[i].key == tp[i - 1].key ? run + 1 : 1;
        if (run > LK_ADAPTER_MAX_SLICES)
            return lk_error(LK_ERR_FORMAT, "%s: more than %d modules land on %s", a->file, LK_ADAPTER_MAX_SLICES,
                            model[tp[i].key].name);
    }
    return LK_OK;
}

/* No model tensor replaced twice, nor both replaced and fused into; sorts
 * rby by target (tp must be sorted by weight: check_placements). */
static lk_status check_replacements(resolve_ctx *c) {
    const lk_adapter *a = c->a;
    char **rnames = c->rnames;
    qsort_r(c->rby, c->n_rby, sizeof *c->rby, target_cmp, rnames);
    for (size_t i = 1; i < c->n_rby; i++)
        if (!strcmp(rnames[c->rby[i]], rnames[c->rby[i - 1]]))
            return lk_error(LK_ERR_FORMAT, "%s: '%s' and '%s' both replace %s", a->file, a->reps[c->rby[i - 1]].key,
                            a->reps[c->rby[i]].key, rnames[c->rby[i]]);
    for (size_t i = 0; i < c->n_rby; i++) { /* a tensor both replaced and LoRA-fused by this adapter */
        size_t lo = 0, hi = c->n_tp, r = c->rby[i];
        if (!strcmp(a->reps[r].why, "base_layer")) continue; /* the LoRA layer's own base weight: R, then B A */
        while (lo < hi) {
            size_t mid = lo + (hi - lo) / 2;
            int cmp = strcmp(c->model[c->tp[mid].key].name, rnames[r]);
            if (!cmp)
                return lk_error(LK_ERR_FORMAT, "%s: '%s' replaces %s, which module %s also fuses into", a->file,
                                a->reps[r].key, rnames[r], a->mods[c->tp[mid].mod].module);
            if (cmp < 0) lo = mid + 1;
            else hi = mid;
        }
    }
    return LK_OK;
}

/* Everything commit moves into the adapter, made while failing is still
 * harmless: bby sorted by bias target, the placements' target and rule
 * strings, the buffers for transposed and folded factors, the copy of the
 * model family's name (owned by c). */
static lk_status build_outputs(resolve_ctx *c) {
    const lk_adapter *a = c->a;
    const size_t n_tp = c->n_tp;
    qsort_r(c->bby, c->n_bby, sizeof *c->bby, target_cmp, c->bnames);
    c->pl = lk_calloc(n_tp ? n_tp : 1, sizeof *c->pl);
    c->plstr = lk_calloc(2 * (n_tp ? n_tp : 1), sizeof *c->plstr);
    if (!c->pl || !c->plstr) return lk_error(LK_ERR_NOMEM, "%s: out of memory", a->file);
    for (size_t i = 0; i < n_tp; i++) {
        const tplace *p = &c->tp[i];
        size_t rl = strlen(p->rule) + sizeof "kohya form, ";
        if (!(c->plstr[2 * i] = lk_strdup(c->model[p->key].name)) || !(c->plstr[2 * i + 1] = lk_malloc(rl)))
            return lk_error(LK_ERR_NOMEM, "%s: out of memory", a->file);
        snprintf(c->plstr[2 * i + 1], rl, "%s%s", p->kohya ? "kohya form, " : "", p->rule);
    }
    c->tf = c->tbytes ? lk_malloc(c->tbytes) : NULL;
    c->xf = c->xbytes ? lk_malloc(c->xbytes) : NULL;
    if ((c->tbytes && !c->tf) || (c->xbytes && !c->xf))
        return lk_error(LK_ERR_NOMEM, "%s: out of memory for %zu bytes of transposed and folded factors", a->file,
                        c->tbytes + c->xbytes);
    if (c->have_lay && c->lay.family && !(c->family = lk_strdup(c->lay.family)))
        return lk_error(LK_ERR_NOMEM, "%s: out of memory for the model family's name", a->file);
    return LK_OK;
}

/* The placements' records: each module's B cut to its rows. */
static void fill_placements(resolve_ctx *c) {
    for (size_t i = 0; i < c->n_tp; i++) {
        const tplace *p = &c->tp[i];
        const lk_lora_module *m = &c->a->mods[p->mod];
        lk_tensor B = m->B;
        size_t es = lk_dtype_size(B.dtype);
        if (B.data) /* a module without a B factor (dense, LoKr, ...): no rows to offset */
            B.data = (unsigned char *)B.data + (size_t)p->b_row0 * (size_t)B.shape[1] * es;
        B.shape[0] = p->rows;
        B.nbytes = (size_t)p->rows * (size_t)B.shape[1] * es;
        c->pl[i] = (lk_adapter_placement){m, c->plstr[2 * i], p->row0, p->b_row0, p->rows, p->whole,
                                          c->plstr[2 * i + 1], B};
    }
}

/* Commit (cannot fail): the kernel factors built, every result moved from c
 * into the adapter (the adapter's old ones freed), the unmatched warned of. */
static void commit(resolve_ctx *c, size_t *n_unmatched) {
    lk_adapter *a = c->a;
    unsigned char *tfp = c->tf, *xp = c->xf;
    for (size_t i = 0; i < a->n; i++) {
        if (a->mods[i].algo == LK_ALGO_LORA) orient(a, i, c->trans[i], &a->mods[i].A, &a->mods[i].B, &tfp);
        if (c->tnames[i]) build_kernel_factors(&a->mods[i], &c->model[c->tidx[i]], &xp);
        else memset(a->mods[i].k, 0, sizeof a->mods[i].k);
    }
    lk_free(a->tfactors);
    a->tfactors = c->tf;
    lk_free(a->xfactors);
    a->xfactors = c->xf;
    c->tf = c->xf = NULL;
    for (size_t i = 0; i < a->n; i++) {
        lk_free(a->targets[i]);
        a->targets[i] = c->tnames[i];
        a->mods[i].target = c->tnames[i];
        c->tnames[i] = NULL;
        lk_free(a->bias_targets[i]);
        a->bias_targets[i] = c->bnames[i];
        a->mods[i].bias_target = c->bnames[i];
        c->bnames[i] = NULL;
    }
    for (size_t r = 0; r < a->n_rep; r++) {
        lk_free(a->rep_targets[r]);
        a->rep_targets[r] = c->rnames[r];
        a->reps[r].target = c->rnames[r];
        c->rnames[r] = NULL;
    }
    fill_placements(c);
    for (size_t i = 0; i < 2 * a->n_pl; i++) lk_free(a->pl_strs[i]);
    lk_free(a->pl_strs);
    lk_free(a->pl);
    a->pl = c->pl;
    a->pl_strs = c->plstr;
    a->n_pl = c->n_tp;
    c->pl = NULL;
    c->plstr = NULL;
    lk_free(a->family);
    a->family = c->family;
    c->family = NULL;
    lk_free(a->by_bias);
    a->by_bias = c->bby;
    a->n_by_bias = c->n_bby;
    c->bby = NULL;
    lk_free(a->rep_by_target);
    a->rep_by_target = c->rby;
    a->n_rep_by_target = c->n_rby;
    c->rby = NULL;
    if (c->unmatched)
        lk_log(LK_LOG_WARN, "%s: %zu of %zu modules%s match no model weight and are skipped (first: %s)", a->path,
               c->unmatched, a->n + a->n_rep, a->n_rep ? " and saved tensors" : "",
               c->first_unmatched != SIZE_MAX ? a->mods[c->first_unmatched].module : c->first_unmatched_rep);
    if (n_unmatched) *n_unmatched = c->unmatched + c->foreign;
}

/* Frees what c still owns (everything, after a failure). */
static void resolve_free(resolve_ctx *c) {
    if (c->tnames) /* carved: resolve_scratch succeeded */
        for (size_t i = 0; i < c->a->n; i++) {
            lk_free(c->tnames[i]);
            lk_free(c->bnames[i]);
        }
    if (c->rnames)
        for (size_t r = 0; r < c->a->n_rep; r++) lk_free(c->rnames[r]);
    if (c->plstr)
        for (size_t i = 0; i < 2 * c->n_tp; i++) lk_free(c->plstr[i]);
    lk_free(c->plstr);
    lk_free(c->pl);
    lk_free(c->tf);
    lk_free(c->xf);
    lk_free(c->bby);
    lk_free(c->rby);
    lk_free(c->tp);
    lk_free(c->scratch);
    lk_names_free(&c->mt);
    lk_names_free(&c->rt);
    lk_free(c->kn);
    lk_free(c->family);
    if (c->have_lay) lk_layout_free(&c->lay);
}

lk_status lk_adapter_resolve_opts(lk_adapter *a, const lk_tensor *model, size_t n_model, const lk_resolve_opts *opts,
                                  size_t *n_unmatched) {
    if (!a || (n_model && !model)) return lk_error(LK_ERR_ARG, "lk_adapter_resolve: NULL argument");
    int want_comp = opts && opts->component ? lk_comp_from_name(opts->component) : LK_COMP_ANY;
    if (opts && opts->component && want_comp == LK_COMP_ANY)
        return lk_error(LK_ERR_ARG, "%s: unknown pipeline component '%s'", a->file, opts->component);
    resolve_ctx c = {.a = a, .model = model, .n_model = n_model, .opts = opts,
                     .allow_unmatched = opts ? opts->allow_unmatched : 0, .want_comp = want_comp,
                     .first_unmatched = SIZE_MAX};
    lk_status s = resolve_scratch(&c);
    if (!s) s = resolve_index(&c);
    for (size_t i = 0; !s && i < a->n; i++) s = resolve_module(&c, i);
    for (size_t r = 0; !s && r < a->n_rep; r++) s = resolve_rep(&c, r);
    if (!s) {
        skip_foreign(&c);
        s = check_unmatched(&c);
    }
    if (!s) s = check_placements(&c);
    if (!s) s = check_replacements(&c);
    if (!s) s = build_outputs(&c);
    if (!s) commit(&c, n_unmatched);
    resolve_free(&c);
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

size_t lk_adapter_placements(const lk_adapter *a, const char *target, const lk_adapter_placement **out) {
    *out = NULL;
    if (!a || !target) return 0;
    size_t lo = 0, hi = a->n_pl;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (strcmp(a->pl[mid].target, target) < 0) lo = mid + 1;
        else hi = mid;
    }
    size_t n = 0;
    while (lo + n < a->n_pl && !strcmp(a->pl[lo + n].target, target)) n++;
    if (n) *out = &a->pl[lo];
    return n;
}

size_t lk_adapter_placement_count(const lk_adapter *a) { return a ? a->n_pl : 0; }
const lk_adapter_placement *lk_adapter_placement_at(const lk_adapter *a, size_t i) {
    return a && i < a->n_pl ? &a->pl[i] : NULL;
}
const char *lk_adapter_family(const lk_adapter *a) { return a ? a->family : NULL; }

const lk_lora_module *lk_adapter_find_target(const lk_adapter *a, const char *target) {
    const lk_adapter_placement *p;
    size_t n = lk_adapter_placements(a, target, &p);
    return n == 1 && p->whole ? p->module : NULL;
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
