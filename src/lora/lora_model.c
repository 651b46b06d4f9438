/* lora_model.c — a host program's named linear layers and the LoRA wrapping
 * of them: targeting, freezing, seeded init, base checkpoint loading with key
 * aliases, and the per-layer forward/backward.
 *
 * The host keeps its own weight memory (its model may be one allocation,
 * llm.c style) and registers views of it; lorakit owns only what LoRA adds:
 * the parameter set (one buffer, see params.c) and one scratch buffer for the
 * backward. Targeting is FastVideo's substring rule: a layer is wrapped
 * when its name contains a target and no exclude string. Every entry point
 * checks everything first and then commits, so a failure leaves the model as
 * it was. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "lorakit/alloc.h"
#include "lorakit/fuse.h"
#include "lorakit/log.h"
#include "lorakit/checkpoint.h"
#include "lorakit/safetensors.h"
#include "lora/params.h"

struct lk_lora_layer {
    char *name;
    int in, out;
    float *W, *b;
    int wrapped, r;
    float scale;
    long pA, pB; /* parameter indices, -1 until wrapped */
    lk_lora_model *m;
};

typedef struct {
    char *name;
    int ndim;
    int64_t shape[LK_MAX_DIMS];
    size_t numel;
    float *data;
} other_tensor;

struct lk_lora_model {
    lk_lora_layer **layers;
    size_t n_layers, cap_layers;
    other_tensor *tensors;
    size_t n_tensors, cap_tensors;
    int enabled;
    int rank, alpha;
    uint64_t seed;
    lk_lora_params *params;
    float *scratch;
    size_t scratch_cap; /* floats */
};

lk_status lk_lora_model_create(lk_lora_model **out) {
    if (!out) return lk_error(LK_ERR_ARG, "lk_lora_model_create: out is NULL");
    *out = lk_calloc(1, sizeof **out);
    return *out ? LK_OK : lk_error(LK_ERR_NOMEM, "out of memory");
}

void lk_lora_model_free(lk_lora_model *m) {
    if (!m) return;
    for (size_t i = 0; i < m->n_layers; i++) {
        lk_free(m->layers[i]->name);
        lk_free(m->layers[i]);
    }
    lk_free(m->layers);
    for (size_t i = 0; i < m->n_tensors; i++) lk_free(m->tensors[i].name);
    lk_free(m->tensors);
    lk_lora_params_free(m->params);
    lk_free(m->scratch);
    lk_free(m);
}

/* "<base>.<suffix>" into a fresh string. */
static char *join(const char *base, const char *suffix) {
    size_t a = strlen(base), b = strlen(suffix);
    char *s = lk_malloc(a + b + 2);
    if (!s) return NULL;
    memcpy(s, base, a);
    s[a] = '.';
    memcpy(s + a + 1, suffix, b + 1);
    return s;
}

/* 1 if `state` is "<name>.<suffix>". */
static int is_state_of(const char *state, const char *name, const char *suffix) {
    size_t n = strlen(name);
    return !strncmp(state, name, n) && state[n] == '.' && !strcmp(state + n + 1, suffix);
}

/* Is a registered state name already taken by `name` (as a layer or a tensor)? */
static int name_taken(const lk_lora_model *m, const char *name, int as_layer) {
    for (size_t i = 0; i < m->n_layers; i++) {
        const char *ln = m->layers[i]->name;
        if (as_layer && !strcmp(ln, name)) return 1;
        if (!as_layer && (is_state_of(name, ln, "weight") || is_state_of(name, ln, "bias")))
            return 1;
    }
    for (size_t i = 0; i < m->n_tensors; i++) {
        const char *tn = m->tensors[i].name;
        if (!as_layer && !strcmp(tn, name)) return 1;
        if (as_layer && (is_state_of(tn, name, "weight") || is_state_of(tn, name, "bias"))) return 1;
    }
    return 0;
}

lk_status lk_lora_model_add_linear(lk_lora_model *m, const char *name, int in, int out,
                                   float *weight, float *bias, lk_lora_layer **layer) {
    if (layer) *layer = NULL;
    if (!m || !name || !*name || !weight)
        return lk_error(LK_ERR_ARG, "lk_lora_model_add_linear: missing model, name or weight");
    if (m->enabled)
        return lk_error(LK_ERR_STATE, "%s: cannot register layers after lk_lora_enable", name);
    if (in <= 0 || out <= 0)
        return lk_error(LK_ERR_SHAPE, "%s: linear shape %dx%d must be positive", name, out, in);
    if (name_taken(m, name, 1)) return lk_error(LK_ERR_ARG, "%s: name registered twice", name);
    if (m->n_layers == m->cap_layers) {
        size_t cap = m->cap_layers ? 2 * m->cap_layers : 16;
        lk_lora_layer **nl = lk_realloc(m->layers, cap * sizeof *nl);
        if (!nl) return lk_error(LK_ERR_NOMEM, "out of memory");
        m->layers = nl;
        m->cap_layers = cap;
    }
    lk_lora_layer *l = lk_calloc(1, sizeof *l);
    char *nm = lk_strdup(name);
    if (!l || !nm) {
        lk_free(l);
        lk_free(nm);
        return lk_error(LK_ERR_NOMEM, "out of memory");
    }
    *l = (lk_lora_layer){.name = nm, .in = in, .out = out, .W = weight, .b = bias,
                         .pA = -1, .pB = -1, .m = m};
    m->layers[m->n_layers++] = l;
    if (layer) *layer = l;
    return LK_OK;
}

lk_status lk_lora_model_add_tensor(lk_lora_model *m, const char *name, int ndim,
                                   const int64_t *shape, float *data) {
    if (!m || !name || !*name || !data || (ndim > 0 && !shape))
        return lk_error(LK_ERR_ARG, "lk_lora_model_add_tensor: missing model, name, shape or data");
    if (m->enabled)
        return lk_error(LK_ERR_STATE, "%s: cannot register tensors after lk_lora_enable", name);
    if (ndim < 0 || ndim > LK_MAX_DIMS)
        return lk_error(LK_ERR_SHAPE, "%s: %d dimensions (at most %d)", name, ndim, LK_MAX_DIMS);
    size_t numel = 1;
    for (int d = 0; d < ndim; d++)
        if (shape[d] <= 0 || !lk_checked_mul(numel, (size_t)shape[d], &numel))
            return lk_error(LK_ERR_SHAPE, "%s: invalid dimension %d", name, d);
    if (name_taken(m, name, 0)) return lk_error(LK_ERR_ARG, "%s: name registered twice", name);
    if (m->n_tensors == m->cap_tensors) {
        size_t cap = m->cap_tensors ? 2 * m->cap_tensors : 16;
        other_tensor *nt = lk_realloc(m->tensors, cap * sizeof *nt);
        if (!nt) return lk_error(LK_ERR_NOMEM, "out of memory");
        m->tensors = nt;
        m->cap_tensors = cap;
    }
    char *nm = lk_strdup(name);
    if (!nm) return lk_error(LK_ERR_NOMEM, "out of memory");
    other_tensor *t = &m->tensors[m->n_tensors++];
    memset(t, 0, sizeof *t);
    t->name = nm;
    t->ndim = ndim;
    for (int d = 0; d < ndim; d++) t->shape[d] = shape[d];
    t->numel = numel;
    t->data = data;
    return LK_OK;
}

size_t lk_lora_model_layer_count(const lk_lora_model *m) { return m ? m->n_layers : 0; }
lk_lora_layer *lk_lora_model_layer(lk_lora_model *m, size_t i) {
    return m && i < m->n_layers ? m->layers[i] : NULL;
}
lk_lora_layer *lk_lora_model_find(lk_lora_model *m, const char *name) {
    if (!m || !name) return NULL;
    for (size_t i = 0; i < m->n_layers; i++)
        if (!strcmp(m->layers[i]->name, name)) return m->layers[i];
    return NULL;
}
lk_lora_params *lk_lora_model_params(lk_lora_model *m) { return m ? m->params : NULL; }

static int contains_any(const char *name, char *const *list, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (list[i] && strstr(name, list[i])) return 1;
    return 0;
}

static int excluded(const char *name, const char *const *exclude) {
    for (size_t i = 0; exclude && exclude[i]; i++)
        if (strstr(name, exclude[i])) return 1;
    return 0;
}

/* Appends a bracketed list to buf for error messages. */
static void list_str(char *buf, size_t cap, char *const *a, size_t n) {
    size_t o = 0;
    o += (size_t)snprintf(buf, cap, "[");
    for (size_t i = 0; i < n && o < cap; i++)
        o += (size_t)snprintf(buf + o, cap - o, "%s%s", i ? ", " : "", a[i]);
    if (o < cap) snprintf(buf + o, cap - o, "]");
}

static void init_layer(lk_lora_layer *l, uint64_t seed) {
    lk_lora_params *p = l->m->params;
    lk_lora_rand_uniform(p->data + p->offset[l->pA], (size_t)l->r * (size_t)l->in, seed, p->names[l->pA],
                         1.0f / sqrtf((float)l->in));
    memset(p->data + p->offset[l->pB], 0, (size_t)l->out * (size_t)l->r * sizeof(float));
}

/* What lk_lora_enable wraps: the targets (the config's, or the defaults),
 * the excludes, and the selected layers' parameter specs and names. specs
 * and names are carved from one allocation (block); the names are owned
 * and freed with it by enable_plan_free. */
typedef struct enable_plan {
    char *const *targets;
    size_t n_targets;
    const char *const *exclude;
    size_t n;                   /* selected layers */
    void *block;                /* specs[2n], then names[2n] */
    lk_lora_param_spec *specs;
    char **names;
} enable_plan;

/* Whether the plan wraps layer l: a target substring in its name, no exclude substring. */
static int selected(const enable_plan *e, const lk_lora_layer *l) {
    return contains_any(l->name, e->targets, e->n_targets) && !excluded(l->name, e->exclude);
}

/* Fills e's targets and counts the selected layers into e->n; none selected is
 * the config's error, naming the targets and the excludes. Allocates nothing. */
static lk_status enable_select(const lk_lora_model *m, const lk_lora_config *cfg, const char *const *exclude,
                               enable_plan *e) {
    e->targets = cfg->targets;
    e->n_targets = cfg->n_targets;
    e->exclude = exclude;
    if (!e->targets || !e->n_targets) {
        e->targets = (char *const *)lk_lora_default_targets;
        e->n_targets = 0;
        while (lk_lora_default_targets[e->n_targets]) e->n_targets++;
    }
    for (size_t i = 0; i < m->n_layers; i++) e->n += (size_t)selected(e, m->layers[i]);
    if (e->n) return LK_OK;
    char tl[1024], el[512] = "[]";
    list_str(tl, sizeof tl, e->targets, e->n_targets);
    size_t ne = 0;
    while (exclude && exclude[ne]) ne++;
    if (ne) list_str(el, sizeof el, (char *const *)exclude, ne);
    return lk_error(LK_ERR_CONFIG,
                    "no LoRA-compatible layers were found for the requested target modules "
                    "%s (excluded: %s; %zu linear layers registered)",
                    tl, el, m->n_layers);
}

/* The "<layer>.lora_A" [rank, in] and "<layer>.lora_B" [out, rank] specs of
 * every selected layer, in layer order, into e's one block (freed, names
 * too, by enable_plan_free, also on a failure here). */
static lk_status enable_specs(const lk_lora_model *m, int rank, enable_plan *e) {
    lk_carve c = {0};
    const size_t o_specs = lk_carve_part(&c, e->n, 2 * sizeof *e->specs, _Alignof(lk_lora_param_spec)),
                 o_names = lk_carve_part(&c, e->n, 2 * sizeof *e->names, _Alignof(char *));
    if (!(e->block = lk_carve_alloc(&c))) return lk_error(LK_ERR_NOMEM, "out of memory");
    e->specs = (lk_lora_param_spec *)(void *)((char *)e->block + o_specs);
    e->names = (char **)(void *)((char *)e->block + o_names);
    size_t k = 0;
    for (size_t i = 0; i < m->n_layers; i++) {
        const lk_lora_layer *l = m->layers[i];
        if (!selected(e, l)) continue;
        e->names[k] = join(l->name, "lora_A");
        e->names[k + 1] = join(l->name, "lora_B");
        if (!e->names[k] || !e->names[k + 1]) return lk_error(LK_ERR_NOMEM, "out of memory");
        e->specs[k] = (lk_lora_param_spec){e->names[k], rank, l->in};
        e->specs[k + 1] = (lk_lora_param_spec){e->names[k + 1], l->out, rank};
        k += 2;
    }
    return LK_OK;
}

static void enable_plan_free(enable_plan *e) {
    for (size_t i = 0; e->block && i < 2 * e->n; i++) lk_free(e->names[i]);
    lk_free(e->block);
}

/* Commit (cannot fail): the model takes p and wraps every selected layer
 * onto its A/B parameters, initialised from seed. */
static void enable_commit(lk_lora_model *m, const lk_lora_config *cfg, const enable_plan *e, lk_lora_params *p,
                          uint64_t seed) {
    m->params = p;
    m->enabled = 1;
    m->rank = cfg->rank;
    m->alpha = cfg->alpha_given || cfg->alpha ? cfg->alpha : cfg->rank;
    m->seed = seed;
    size_t k = 0;
    for (size_t i = 0; i < m->n_layers; i++) {
        lk_lora_layer *l = m->layers[i];
        if (!selected(e, l)) continue;
        l->wrapped = 1;
        l->r = cfg->rank;
        l->scale = (float)m->alpha / (float)cfg->rank;
        l->pA = lk_lora_params_find(p, e->names[k]);
        l->pB = lk_lora_params_find(p, e->names[k + 1]);
        init_layer(l, seed);
        k += 2;
    }
}

lk_status lk_lora_enable(lk_lora_model *m, const lk_lora_config *cfg, const char *const *exclude,
                         uint64_t seed, size_t *count) {
    if (count) *count = 0;
    if (!m || !cfg) return lk_error(LK_ERR_ARG, "lk_lora_enable: missing model or config");
    if (m->enabled) return lk_error(LK_ERR_STATE, "lk_lora_enable: LoRA is already enabled");
    if (!cfg->configured || !cfg->enable)
        return lk_error(LK_ERR_CONFIG, "lk_lora_enable: the LoRA config is not enabled");
    if (cfg->rank <= 0)
        return lk_error(LK_ERR_CONFIG, "lk_lora_enable: lora rank must be > 0, got %d", cfg->rank);
    enable_plan e = {0};
    lk_status s = enable_select(m, cfg, exclude, &e);
    if (s) return s;
    if ((size_t)cfg->rank > (size_t)INT32_MAX / 2)
        return lk_error(LK_ERR_CONFIG, "lora rank %d too large", cfg->rank);
    lk_lora_params *p = NULL;
    s = enable_specs(m, cfg->rank, &e);
    if (s == LK_OK) s = lk_lora_params_create(e.specs, 2 * e.n, &p);
    if (s == LK_OK) {
        enable_commit(m, cfg, &e, p, seed);
        if (count) *count = e.n;
        lk_log(LK_LOG_INFO, "enabled LoRA training with rank=%d alpha=%d on %zu layers", m->rank,
               m->alpha, e.n);
    }
    enable_plan_free(&e);
    return s;
}

lk_status lk_lora_finalize(lk_lora_model *m, size_t *count) {
    if (count) *count = 0;
    if (!m) return lk_error(LK_ERR_ARG, "lk_lora_finalize: no model");
    size_t n = 0;
    for (size_t i = 0; i < m->n_layers; i++) {
        lk_lora_layer *l = m->layers[i];
        if (!l->wrapped) continue;
        if (!m->params || l->pA < 0 || l->pB < 0)
            return lk_error(LK_ERR_STATE, "%s: training LoRA wrapper is missing adapter parameters",
                            l->name);
        n++;
    }
    if (n == 0)
        return lk_error(LK_ERR_STATE, "no training LoRA wrappers were found after checkpoint loading");
    /* Frozen/trainable is a property of the state, not a flag a load can
     * flip: base tensors never get gradients once enabled, adapters always. */
    if (count) *count = n;
    return LK_OK;
}

int lk_lora_model_is_trainable(const lk_lora_model *m, const char *state_name) {
    if (!m || !state_name) return 0;
    if (m->enabled) return lk_lora_params_find(m->params, state_name) >= 0;
    for (size_t i = 0; i < m->n_layers; i++) {
        const char *ln = m->layers[i]->name;
        if (is_state_of(state_name, ln, "weight")) return 1;
        if (m->layers[i]->b && is_state_of(state_name, ln, "bias")) return 1;
    }
    for (size_t i = 0; i < m->n_tensors; i++)
        if (!strcmp(m->tensors[i].name, state_name)) return 1;
    return 0;
}

/* ---- base checkpoint ---- */

typedef struct {
    float *dst;
    size_t numel;
    long src; /* tensor index in the file; -1: missing */
    const char *what;
} load_item;

/* Finds the first of two candidate names; both present is ambiguous. */
static lk_status find2(const lk_ckpt *st, const char *path, const char *a, const char *b, long *idx) {
    long ia = lk_ckpt_find(st, a), ib = b ? lk_ckpt_find(st, b) : -1;
    if (ia >= 0 && ib >= 0)
        return lk_error(LK_ERR_FORMAT, "%s: both '%s' and its alias '%s' are present", path, a, b);
    *idx = ia >= 0 ? ia : ib;
    return LK_OK;
}

static lk_status check_shape(const lk_ckpt *st, const char *path, long i, int ndim,
                             const int64_t *shape) {
    const lk_tensor *t = lk_ckpt_tensor(st, (size_t)i);
    if (!lk_dtype_is_fusable(t->dtype))
        return lk_error(LK_ERR_DTYPE, "%s: %s: dtype %s (expected F32, F16 or BF16)", path, t->name,
                        lk_dtype_name(t->dtype));
    int ok = t->ndim == ndim;
    for (int d = 0; ok && d < ndim; d++) ok = t->shape[d] == shape[d];
    if (!ok) {
        char have[128], want[128];
        lk_tensor w = {.ndim = ndim};
        for (int d = 0; d < ndim; d++) w.shape[d] = shape[d];
        lk_shape_str(t, have, sizeof have);
        lk_shape_str(&w, want, sizeof want);
        return lk_error(LK_ERR_SHAPE, "%s: %s is %s but the model expects %s", path, t->name, have,
                        want);
    }
    return LK_OK;
}

/* lk_lora_model_load_base's steps: match (every model tensor to its file
 * tensor, shapes checked), validate (nothing in the file left over), read
 * (all present tensors staged, nothing written yet), commit. */

/* A layer's weight and bias (wrapped or plain names) and, when wrapped, its
 * lora_A / lora_B, appended to items[*ni]. */
static lk_status match_layer(lk_lora_model *m, lk_lora_layer *l, lk_ckpt *st, const char *path,
                             const lk_lora_load_opts *o, load_item *items, size_t *ni) {
    static const char *const parts[2] = {"weight", "bias"};
    lk_status s = LK_OK;
    for (int part = 0; part < 2 && s == LK_OK; part++) {
        float *dst = part ? l->b : l->W;
        char *plain = join(l->name, parts[part]);
        char *based = join(l->name, part ? "base_layer.bias" : "base_layer.weight");
        if (!plain || !based) {
            lk_free(plain);
            lk_free(based);
            return lk_error(LK_ERR_NOMEM, "out of memory");
        }
        long idx = -1;
        /* The wrapped name first, the plain one as its alias (and the other
         * way round before wrapping): both load the same weight. */
        s = l->wrapped ? find2(st, path, based, plain, &idx) : find2(st, path, plain, based, &idx);
        if (s == LK_OK && idx >= 0 && !dst)
            s = lk_error(LK_ERR_SHAPE, "%s: %s: the model's layer has no bias", path,
                         lk_ckpt_tensor(st, (size_t)idx)->name);
        if (s == LK_OK && dst) {
            int64_t shape[2] = {l->out, l->in};
            if (idx >= 0) s = check_shape(st, path, idx, part ? 1 : 2, shape);
            else if (!o->allow_missing)
                s = lk_error(LK_ERR_FORMAT, "%s: missing tensor '%s' (nor '%s')", path, l->wrapped ? based : plain,
                             l->wrapped ? plain : based);
            items[(*ni)++] = (load_item){dst, (size_t)l->out * (part ? 1 : (size_t)l->in), idx, parts[part]};
        }
        lk_free(plain);
        lk_free(based);
    }
    if (s != LK_OK || !l->wrapped) return s;
    lk_lora_params *p = m->params;
    for (int ab = 0; ab < 2 && s == LK_OK; ab++) {
        long pi = ab ? l->pB : l->pA;
        long idx = lk_ckpt_find(st, p->names[pi]);
        int64_t shape[2] = {p->rows[pi], p->cols[pi]};
        if (idx >= 0) s = check_shape(st, path, idx, 2, shape);
        items[(*ni)++] = (load_item){p->data + p->offset[pi], (size_t)(p->rows[pi] * p->cols[pi]), idx,
                                     ab ? "lora_B" : "lora_A"};
    }
    return s;
}

/* Every layer, then the model's other tensors. */
static lk_status match_all(lk_lora_model *m, lk_ckpt *st, const char *path, const lk_lora_load_opts *o,
                           load_item *items, size_t *ni) {
    lk_status s = LK_OK;
    for (size_t i = 0; s == LK_OK && i < m->n_layers; i++) s = match_layer(m, m->layers[i], st, path, o, items, ni);
    for (size_t i = 0; s == LK_OK && i < m->n_tensors; i++) {
        other_tensor *t = &m->tensors[i];
        long idx = lk_ckpt_find(st, t->name);
        if (idx >= 0) s = check_shape(st, path, idx, t->ndim, t->shape);
        else if (!o->allow_missing) s = lk_error(LK_ERR_FORMAT, "%s: missing tensor '%s'", path, t->name);
        items[(*ni)++] = (load_item){t->data, t->numel, idx, "tensor"};
    }
    return s;
}

/* The file's tensors no item uses (used: n_file bytes of scratch): an error
 * unless allow_unexpected; *n_unexpected counts them. */
static lk_status check_unexpected(lk_ckpt *st, const char *path, const lk_lora_load_opts *o, const load_item *items,
                                  size_t ni, unsigned char *used, size_t *n_unexpected) {
    for (size_t i = 0; i < ni; i++)
        if (items[i].src >= 0) used[items[i].src] = 1;
    lk_status s = LK_OK;
    for (size_t i = 0; s == LK_OK && i < lk_ckpt_count(st); i++) {
        if (used[i]) continue;
        if (!o->allow_unexpected)
            s = lk_error(LK_ERR_UNMATCHED, "%s: tensor '%s' matches nothing in the model", path,
                         lk_ckpt_tensor(st, i)->name);
        (*n_unexpected)++;
    }
    return s;
}

/* Reads every present tensor (pread, not the mapping: a file truncated
 * meanwhile is an error, not a SIGBUS) into one staging buffer, item i at
 * (*at)[i], before anything is written: on a read error the model is
 * unchanged. */
static lk_status read_staged(lk_ckpt *st, const char *path, const load_item *items, size_t ni, unsigned char **stage,
                             size_t **at) {
    size_t total = 0;
    *at = lk_malloc((ni ? ni : 1) * sizeof **at);
    for (size_t i = 0; *at && i < ni; i++) {
        (*at)[i] = total;
        if (items[i].src >= 0) total += lk_ckpt_tensor(st, (size_t)items[i].src)->nbytes;
    }
    *stage = *at ? lk_malloc(total ? total : 1) : NULL;
    if (!*stage) return lk_error(LK_ERR_NOMEM, "%s: out of memory for %zu tensors", path, ni);
    lk_status s = LK_OK;
    for (size_t i = 0; s == LK_OK && i < ni; i++)
        if (items[i].src >= 0)
            s = lk_ckpt_read(st, (size_t)items[i].src, 0, *stage + (*at)[i],
                             lk_ckpt_tensor(st, (size_t)items[i].src)->nbytes);
    return s;
}

/* Commit (cannot fail): convert every present tensor; re-initialise absent
 * adapters from the seed. Returns how many adapter layers were. */
static size_t commit_loaded(lk_lora_model *m, lk_ckpt *st, const load_item *items, size_t ni,
                            const unsigned char *stage, const size_t *at) {
    size_t n_init = 0;
    for (size_t i = 0; i < ni; i++)
        if (items[i].src >= 0)
            lk_to_f32(items[i].dst, stage + at[i], lk_ckpt_tensor(st, (size_t)items[i].src)->dtype, items[i].numel);
    for (size_t i = 0; i < m->n_layers; i++) {
        lk_lora_layer *l = m->layers[i];
        if (!l->wrapped) continue;
        long ia = lk_ckpt_find(st, m->params->names[l->pA]);
        long ib = lk_ckpt_find(st, m->params->names[l->pB]);
        if (ia < 0 && ib < 0) {
            init_layer(l, m->seed);
            n_init++;
        } else if (ia < 0 || ib < 0) {
            /* Only one factor present: initialise the missing one alone. */
            lk_lora_params *p = m->params;
            if (ia < 0)
                lk_lora_rand_uniform(p->data + p->offset[l->pA], (size_t)l->r * (size_t)l->in, m->seed,
                                     p->names[l->pA], 1.0f / sqrtf((float)l->in));
            else
                memset(p->data + p->offset[l->pB], 0, (size_t)l->out * (size_t)l->r * sizeof(float));
            n_init++;
        }
    }
    return n_init;
}

lk_status lk_lora_model_load_base(lk_lora_model *m, const char *path, const lk_lora_load_opts *opts) {
    if (!m || !path) return lk_error(LK_ERR_ARG, "lk_lora_model_load_base: missing model or path");
    lk_lora_load_opts o = {0};
    if (opts) o = *opts;
    lk_ckpt *st;
    lk_status s = lk_ckpt_open(path, &st);
    if (s != LK_OK) return s;
    size_t n_file = lk_ckpt_count(st), n_unexpected = 0, ni = 0;
    load_item *items = lk_calloc(4 * m->n_layers + m->n_tensors + 1, sizeof *items);
    unsigned char *used = lk_calloc(n_file ? n_file : 1, 1), *stage = NULL;
    size_t *at = NULL;
    if (!items || !used) s = lk_error(LK_ERR_NOMEM, "out of memory");
    if (s == LK_OK) s = match_all(m, st, path, &o, items, &ni);
    if (s == LK_OK) s = check_unexpected(st, path, &o, items, ni, used, &n_unexpected);
    if (s == LK_OK) s = read_staged(st, path, items, ni, &stage, &at);
    if (s == LK_OK) {
        size_t n_init = commit_loaded(m, st, items, ni, stage, at);
        lk_log(LK_LOG_INFO, "%s: loaded %zu tensors, %zu adapter layers initialised from the seed, %zu ignored",
               path, n_file - n_unexpected, n_init, n_unexpected);
    }
    lk_free(stage);
    lk_free(at);
    lk_free(items);
    lk_free(used);
    lk_ckpt_close(st);
    return s;
}

lk_status lk_lora_model_save_base(const lk_lora_model *m, const char *path) {
    if (!m || !path) return lk_error(LK_ERR_ARG, "lk_lora_model_save_base: missing model or path");
    size_t cap = 2 * m->n_layers + m->n_tensors;
    if (cap == 0) return lk_error(LK_ERR_STATE, "%s: the model has no tensors to save", path);
    /* one allocation: the tensors, then the names this call makes */
    lk_carve c = {0};
    const size_t o_t = LK_CARVE(&c, cap, lk_tensor), o_names = LK_CARVE(&c, cap, char *);
    char *block = lk_carve_alloc(&c);
    lk_tensor *t = block ? (lk_tensor *)(void *)(block + o_t) : NULL;
    char **names = block ? (char **)(void *)(block + o_names) : NULL;
    size_t n = 0;
    lk_status s = t ? LK_OK : lk_error(LK_ERR_NOMEM, "out of memory");
    for (size_t i = 0; s == LK_OK && i < m->n_layers; i++) {
        const lk_lora_layer *l = m->layers[i];
        for (int part = 0; part < 2; part++) {
            if (part && !l->b) continue;
            names[n] = join(l->name, part ? "bias" : "weight");
            if (!names[n]) {
                s = lk_error(LK_ERR_NOMEM, "out of memory");
                break;
            }
            lk_tensor *v = &t[n];
            v->name = names[n];
            v->dtype = LK_DTYPE_F32;
            v->ndim = part ? 1 : 2;
            v->shape[0] = l->out;
            v->shape[1] = l->in;
            v->nbytes = (size_t)l->out * (part ? 1 : (size_t)l->in) * sizeof(float);
            v->data = part ? l->b : l->W;
            n++;
        }
    }
    for (size_t i = 0; s == LK_OK && i < m->n_tensors; i++) {
        const other_tensor *o = &m->tensors[i];
        lk_tensor *v = &t[n++];
        v->name = o->name;
        v->dtype = LK_DTYPE_F32;
        v->ndim = o->ndim;
        for (int d = 0; d < o->ndim; d++) v->shape[d] = o->shape[d];
        v->nbytes = o->numel * sizeof(float);
        v->data = o->data;
    }
    if (s == LK_OK) s = lk_st_save(path, t, n, NULL, 0);
    for (size_t i = 0; names && i < cap; i++) lk_free(names[i]);
    lk_free(block);
    return s;
}

/* ---- layers ---- */

const char *lk_lora_layer_name(const lk_lora_layer *l) { return l->name; }
int lk_lora_layer_in(const lk_lora_layer *l) { return l->in; }
int lk_lora_layer_out(const lk_lora_layer *l) { return l->out; }
int lk_lora_layer_wrapped(const lk_lora_layer *l) { return l->wrapped; }
int lk_lora_layer_rank(const lk_lora_layer *l) { return l->wrapped ? l->r : 0; }
float lk_lora_layer_scale(const lk_lora_layer *l) { return l->wrapped ? l->scale : 0.0f; }
static float *pptr(lk_lora_layer *l, long pi, int grad) {
    if (!l->wrapped) return NULL;
    lk_lora_params *p = l->m->params;
    return (grad ? p->grad : p->data) + p->offset[pi];
}
float *lk_lora_layer_A(lk_lora_layer *l) { return pptr(l, l->pA, 0); }
float *lk_lora_layer_B(lk_lora_layer *l) { return pptr(l, l->pB, 0); }
float *lk_lora_layer_dA(lk_lora_layer *l) { return pptr(l, l->pA, 1); }
float *lk_lora_layer_dB(lk_lora_layer *l) { return pptr(l, l->pB, 1); }
const float *lk_lora_layer_weight(const lk_lora_layer *l) { return l->W; }
const float *lk_lora_layer_bias(const lk_lora_layer *l) { return l->b; }

/* Model scratch of at least `floats` floats. */
static lk_status scratch(lk_lora_layer *l, size_t floats, float **out) {
    lk_lora_model *m = l->m;
    if (floats > m->scratch_cap) {
        if (floats > SIZE_MAX / sizeof(float))
            return lk_error(LK_ERR_NOMEM, "%s: scratch too large", l->name);
        float *s = lk_realloc(m->scratch, floats * sizeof(float));
        if (!s) return lk_error(LK_ERR_NOMEM, "%s: out of memory for %zu scratch floats", l->name, floats);
        m->scratch = s;
        m->scratch_cap = floats;
    }
    *out = m->scratch;
    return LK_OK;
}

static lk_status check_call(const lk_lora_layer *l, const void *y, const void *x, int n) {
    if (!l || !y || (!x && n > 0) || n < 0)
        return lk_error(LK_ERR_ARG, "%s: invalid LoRA layer call (n = %d)", l ? l->name : "?", n);
    return LK_OK;
}

lk_status lk_lora_layer_forward(lk_lora_layer *l, float *y, const float *x, int n) {
    lk_status s = check_call(l, y, x, n);
    float *h = NULL;
    if (s == LK_OK && l->wrapped) s = scratch(l, (size_t)n * (size_t)l->r, &h);
    if (s != LK_OK) return s;
    lk_lora_linear_forward(y, h, x, l->W, l->b, lk_lora_layer_A(l), lk_lora_layer_B(l), l->scale, n,
                           l->in, l->out, l->wrapped ? l->r : 0);
    return LK_OK;
}

lk_status lk_lora_layer_backward(lk_lora_layer *l, float *dx, const float *dy, const float *x, int n) {
    lk_status s = check_call(l, dy, x, n);
    float *h = NULL;
    if (s == LK_OK && l->wrapped) s = scratch(l, 2 * (size_t)n * (size_t)l->r, &h);
    if (s != LK_OK) return s;
    int r = l->wrapped ? l->r : 0;
    if (r) lk_sgemm(0, 1, n, r, l->in, 1.0f, x, l->in, lk_lora_layer_A(l), l->in, 0.0f, h, r);
    lk_lora_linear_backward(dx, lk_lora_layer_dA(l), lk_lora_layer_dB(l), h ? h + (size_t)n * r : NULL,
                            dy, x, h, l->W, lk_lora_layer_A(l), lk_lora_layer_B(l), l->scale, n, l->in,
                            l->out, r);
    return LK_OK;
}

lk_status lk_lora_layer_delta_forward(lk_lora_layer *l, float *y, const float *x, int n) {
    lk_status s = check_call(l, y, x, n);
    float *h = NULL;
    if (s != LK_OK || !l->wrapped || n == 0) return s;
    if ((s = scratch(l, (size_t)n * (size_t)l->r, &h)) != LK_OK) return s;
    lk_sgemm(0, 1, n, l->r, l->in, 1.0f, x, l->in, lk_lora_layer_A(l), l->in, 0.0f, h, l->r);
    lk_sgemm(0, 1, n, l->out, l->r, l->scale, h, l->r, lk_lora_layer_B(l), l->r, 1.0f, y, l->out);
    return LK_OK;
}

lk_status lk_lora_layer_delta_backward(lk_lora_layer *l, float *dx, const float *dy, const float *x,
                                       int n) {
    lk_status s = check_call(l, dy, x, n);
    float *h = NULL;
    if (s != LK_OK || !l->wrapped || n == 0) return s;
    if ((s = scratch(l, 2 * (size_t)n * (size_t)l->r, &h)) != LK_OK) return s;
    lk_sgemm(0, 1, n, l->r, l->in, 1.0f, x, l->in, lk_lora_layer_A(l), l->in, 0.0f, h, l->r);
    lk_lora_linear_backward(dx, lk_lora_layer_dA(l), lk_lora_layer_dB(l), h + (size_t)n * l->r, dy, x,
                            h, NULL, lk_lora_layer_A(l), lk_lora_layer_B(l), l->scale, n, l->in,
                            l->out, l->r);
    return LK_OK;
}

lk_status lk_lora_layer_merged(const lk_lora_layer *l, float *dst) {
    if (!l || !dst) return lk_error(LK_ERR_ARG, "lk_lora_layer_merged: missing layer or output");
    if (!l->wrapped) {
        memcpy(dst, l->W, (size_t)l->out * (size_t)l->in * sizeof(float));
        return LK_OK;
    }
    /* Through the fuse kernel, as `lorakit fuse` of the saved adapter: the
     * same fp32 sequence, hence the same bits. */
    const lk_lora_params *p = l->m->params;
    lk_tensor A = {.name = "lora_A", .dtype = LK_DTYPE_F32, .ndim = 2, .shape = {l->r, l->in},
                   .nbytes = (size_t)l->r * (size_t)l->in * sizeof(float),
                   .data = p->data + p->offset[l->pA]};
    lk_tensor B = {.name = "lora_B", .dtype = LK_DTYPE_F32, .ndim = 2, .shape = {l->out, l->r},
                   .nbytes = (size_t)l->out * (size_t)l->r * sizeof(float),
                   .data = p->data + p->offset[l->pB]};
    lk_fuse_term term = {.A = &A, .B = &B, .scale = l->scale};
    lk_fuse_opts fo = {0};
    return lk_fuse_tensor(dst, l->W, LK_DTYPE_F32, l->out, l->in, &term, 1, &fo, l->name);
}

/* Accessors used by peft.c (same module, not public). */
int lk_lora_model_rank_alpha(const lk_lora_model *m, int *alpha) {
    if (alpha) *alpha = m->alpha;
    return m->enabled ? m->rank : 0;
}
