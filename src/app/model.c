/* model.c — the small decoder-only transformer of lorakit (see model.h).
 *
 * Built like llm.c's train_gpt2.c: one allocation holds every parameter, one
 * their gradients, one the activations of a forward and one their gradients;
 * each is carved into named pointers. The activation sets grow on demand to
 * the largest B*T seen, so a model used for both training and decoding never
 * reallocates per step. Linear layers carry an optional hook (LoRA) whose
 * output is added to x W^T + b; the model itself stays LoRA-agnostic.
 * Weights are always f32 here: the model is the training/evaluation side of
 * lorakit, checkpoints in other dtypes are converted on load. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "lorakit/alloc.h"
#include "lorakit/dtype.h"
#include "lorakit/log.h"
#include "app/model.h"
#include "lorakit/safetensors.h"
#include "app/kernels.h"

/* Per-block parameters, in storage order. */
enum {
    P_LN1W, P_LN1B, P_QW, P_QB, P_KW, P_KB, P_VW, P_VB, P_OW, P_OB,
    P_LN2W, P_LN2B, P_FC1W, P_FC1B, P_FC2W, P_FC2B, P_PER_BLOCK
};
/* Linears per block, in order. */
enum { L_Q, L_K, L_V, L_O, L_FC1, L_FC2, L_PER_BLOCK };

typedef struct lk_linear {
    char name[LK_MODEL_NAME_MAX];
    int in_f, out_f;
    size_t w_param, b_param; /* param indices */
    lk_model_linear_hook hook;
    void *ctx;
    int has_hook;
} lk_linear;

/* Activations of one forward (and, same layout, their gradients). */
typedef struct lk_layer_acts {
    float *ln1, *ln1_mean, *ln1_rstd, *q, *k, *v, *att, *atty, *attproj, *res1;
    float *ln2, *ln2_mean, *ln2_rstd, *fch, *fch_gelu, *fcproj, *res2;
} lk_layer_acts;

typedef struct lk_acts {
    float *encoded, *lnf, *lnf_mean, *lnf_rstd, *logits, *probs, *losses;
    float *scratch;
    lk_layer_acts *layer; /* n_layers, inside the same allocation */
} lk_acts;

struct lk_model {
    lk_model_config cfg;
    size_t n_params;
    lk_model_param *params;
    size_t n_floats;
    float *param_mem, *grad_mem;
    size_t n_linears;
    lk_linear *linears;
    size_t first_global; /* index of tok_emb.weight etc.: 0 */
    int train_base;

    /* activations */
    size_t acts_cap; /* bytes in each of act_mem / dact_mem (one carve each) */
    char *act_mem, *dact_mem;
    lk_layer_acts *layer_a, *layer_d;
    lk_acts a, d;
    int *inputs, *targets;
    size_t tok_cap;
    int B, T, count, have_fwd, have_targets;
};

/* Global parameter indices. */
#define G_WTE 0
#define G_WPE 1
#define G_BLOCK0 2
#define G_LNFW(m) (G_BLOCK0 + (size_t)(m)->cfg.n_layers * P_PER_BLOCK)
#define G_LNFB(m) (G_LNFW(m) + 1)
#define G_HEAD(m) (G_LNFW(m) + 2)

static float *pdata(lk_model *m, size_t i) { return m->param_mem + m->params[i].offset; }
static float *pgrad(lk_model *m, size_t i) { return m->grad_mem + m->params[i].offset; }
static size_t bp(int l, int p) { return G_BLOCK0 + (size_t)l * P_PER_BLOCK + (size_t)p; }

lk_status lk_model_config_check(lk_model_config *cfg) {
    if (!cfg) return lk_error(LK_ERR_ARG, "model config: NULL");
    if (cfg->d_ff == 0) cfg->d_ff = 4 * cfg->d_model;
    const struct { const char *k; int v; int max; } f[] = {
        {"vocab", cfg->vocab, 1 << 20},     {"max_seq", cfg->max_seq, 1 << 14},
        {"d_model", cfg->d_model, 1 << 14}, {"n_layers", cfg->n_layers, 1024},
        {"n_heads", cfg->n_heads, 1024},    {"d_ff", cfg->d_ff, 1 << 16},
    };
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
        if (f[i].v <= 0 || f[i].v > f[i].max)
            return lk_error(LK_ERR_CONFIG, "model config: %s = %d is out of range (1..%d)",
                            f[i].k, f[i].v, f[i].max);
    if (cfg->d_model % cfg->n_heads)
        return lk_error(LK_ERR_CONFIG, "model config: n_heads = %d does not divide d_model = %d",
                        cfg->n_heads, cfg->d_model);
    /* total parameter count must fit comfortably in size_t and int sizes */
    double total = (double)cfg->vocab * cfg->d_model * 2 + (double)cfg->max_seq * cfg->d_model +
                   (double)cfg->n_layers *
                       (4.0 * cfg->d_model * cfg->d_model + 2.0 * cfg->d_model * cfg->d_ff);
    if (total > 1e9)
        return lk_error(LK_ERR_CONFIG, "model config: %.0f parameters is more than this model "
                        "supports (1e9)", total);
    return LK_OK;
}

/* ---- deterministic init: splitmix64 + Box-Muller ---- */
static uint64_t sm64(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static float normal01(uint64_t *s) {
    double u1 = ((double)(sm64(s) >> 11) + 1.0) / 9007199254740993.0; /* (0, 1] */
    double u2 = (double)(sm64(s) >> 11) / 9007199254740992.0;
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

static void add_param(lk_model *m, size_t *off, const char *name, int ndim, int64_t d0,
                      int64_t d1) {
    lk_model_param *p = &m->params[m->n_params++];
    snprintf(p->name, sizeof p->name, "%s", name);
    p->ndim = ndim;
    p->shape[0] = d0;
    p->shape[1] = ndim == 2 ? d1 : 0;
    p->numel = (size_t)d0 * (size_t)(ndim == 2 ? d1 : 1);
    p->offset = *off;
    *off += p->numel;
}

/* Block l's parameters and linears at *off, in the fixed order: norm1,
 * then each linear's weight and bias, norm2 before the first FF linear. */
static void lay_out_block(lk_model *m, size_t *off, int l) {
    static const char *const lin_names[L_PER_BLOCK] = {
        "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2"};
    int C = m->cfg.d_model, F = m->cfg.d_ff;
    char nm[LK_MODEL_NAME_MAX];
    snprintf(nm, sizeof nm, "blocks.%d.norm1.weight", l);
    add_param(m, off, nm, 1, C, 0);
    snprintf(nm, sizeof nm, "blocks.%d.norm1.bias", l);
    add_param(m, off, nm, 1, C, 0);
    for (int j = 0; j < L_PER_BLOCK; j++) {
        if (j == L_FC1) {
            snprintf(nm, sizeof nm, "blocks.%d.norm2.weight", l);
            add_param(m, off, nm, 1, C, 0);
            snprintf(nm, sizeof nm, "blocks.%d.norm2.bias", l);
            add_param(m, off, nm, 1, C, 0);
        }
        lk_linear *li = &m->linears[m->n_linears++];
        snprintf(li->name, sizeof li->name, "blocks.%d.%s", l, lin_names[j]);
        li->in_f = j == L_FC2 ? F : C;
        li->out_f = j == L_FC1 ? F : C;
        li->w_param = m->n_params;
        snprintf(nm, sizeof nm, "blocks.%d.%s.weight", l, lin_names[j]);
        add_param(m, off, nm, 2, li->out_f, li->in_f);
        li->b_param = m->n_params;
        snprintf(nm, sizeof nm, "blocks.%d.%s.bias", l, lin_names[j]);
        add_param(m, off, nm, 1, li->out_f, 0);
    }
}

/* The parameter table (names, shapes, offsets into one float array) and the
 * linears, in the fixed order; sets n_floats. The tables are allocated to
 * their full size by the caller. */
static void lay_out_params(lk_model *m) {
    size_t off = 0;
    int C = m->cfg.d_model, V = m->cfg.vocab;
    add_param(m, &off, "tok_emb.weight", 2, V, C);
    add_param(m, &off, "pos_emb.weight", 2, m->cfg.max_seq, C);
    for (int l = 0; l < m->cfg.n_layers; l++) lay_out_block(m, &off, l);
    add_param(m, &off, "norm_out.weight", 1, C, 0);
    add_param(m, &off, "norm_out.bias", 1, C, 0);
    add_param(m, &off, "lm_head.weight", 2, V, C);
    m->n_floats = off;
}

/* The deterministic init from seed into param_mem (zeroed): norms weight 1,
 * bias 0; other biases 0; weights N(0, 0.02), the residual-stream
 * projections N(0, 0.02/sqrt(2L)). */
static void init_params(lk_model *m, uint64_t seed) {
    uint64_t s = seed ^ 0x6C6F72616B6974ull; /* "lorakit" */
    float std_res = 0.02f / sqrtf(2.0f * (float)m->cfg.n_layers);
    for (size_t i = 0; i < m->n_params; i++) {
        lk_model_param *p = &m->params[i];
        float *d = pdata(m, i);
        size_t len = strlen(p->name);
        int is_bias = len > 5 && !strcmp(p->name + len - 5, ".bias");
        int is_norm = strstr(p->name, "norm") != NULL;
        if (is_norm) {
            float v = is_bias ? 0.0f : 1.0f;
            for (size_t k = 0; k < p->numel; k++) d[k] = v;
        } else if (is_bias) {
            /* zero (calloc) */
        } else {
            int resid = strstr(p->name, "to_out.0") || strstr(p->name, "ff.net.2");
            float sd = resid ? std_res : 0.02f;
            for (size_t k = 0; k < p->numel; k++) d[k] = sd * normal01(&s);
        }
    }
}

lk_status lk_model_create(const lk_model_config *cfg_in, uint64_t seed, lk_model **out) {
    if (!cfg_in || !out) return lk_error(LK_ERR_ARG, "lk_model_create: NULL argument");
    lk_model_config cfg = *cfg_in;
    lk_status st = lk_model_config_check(&cfg);
    if (st) return st;
    lk_model *m = lk_calloc(1, sizeof *m);
    if (!m) return lk_error(LK_ERR_NOMEM, "model: out of memory");
    m->cfg = cfg;
    m->train_base = 1;
    size_t np = G_BLOCK0 + (size_t)cfg.n_layers * P_PER_BLOCK + 3;
    m->params = lk_calloc(np, sizeof *m->params);
    m->linears = lk_calloc((size_t)cfg.n_layers * L_PER_BLOCK, sizeof *m->linears);
    if (!m->params || !m->linears) goto nomem;
    lay_out_params(m);
    m->param_mem = lk_calloc(m->n_floats, sizeof(float));
    m->grad_mem = lk_calloc(m->n_floats, sizeof(float));
    if (!m->param_mem || !m->grad_mem) goto nomem;
    init_params(m, seed);
    *out = m;
    return LK_OK;
nomem:
    lk_model_free(m);
    return lk_error(LK_ERR_NOMEM, "model: out of memory creating a %d-layer, d_model %d model",
                    cfg.n_layers, cfg.d_model);
}

void lk_model_free(lk_model *m) {
    if (!m) return;
    lk_free(m->params);
    lk_free(m->linears);
    lk_free(m->param_mem);
    lk_free(m->grad_mem);
    lk_free(m->act_mem);
    lk_free(m->dact_mem);
    lk_free(m->layer_a);
    lk_free(m->layer_d);
    lk_free(m->inputs);
    lk_free(m->targets);
    lk_free(m);
}

const lk_model_config *lk_model_get_config(const lk_model *m) { return &m->cfg; }
float *lk_model_params(lk_model *m) { return m->param_mem; }
float *lk_model_grads(lk_model *m) { return m->grad_mem; }
size_t lk_model_num_floats(const lk_model *m) { return m->n_floats; }
size_t lk_model_param_count(const lk_model *m) { return m->n_params; }
const lk_model_param *lk_model_param_at(const lk_model *m, size_t i) {
    return i < m->n_params ? &m->params[i] : NULL;
}

/* "<m>.base_layer.<x>" -> "<m>.<x>" (PEFT's name for a wrapped layer's base). */
static const char *unalias(const char *name, char *buf, size_t cap) {
    const char *p = strstr(name, ".base_layer.");
    if (!p) return name;
    size_t pre = (size_t)(p - name);
    const char *rest = p + strlen(".base_layer");
    if (pre + strlen(rest) + 1 > cap) return name;
    memcpy(buf, name, pre);
    strcpy(buf + pre, rest);
    return buf;
}

long lk_model_find_param(const lk_model *m, const char *name) {
    char buf[LK_MODEL_NAME_MAX + 16];
    if (!name) return -1;
    name = unalias(name, buf, sizeof buf);
    for (size_t i = 0; i < m->n_params; i++)
        if (!strcmp(m->params[i].name, name)) return (long)i;
    return -1;
}

void lk_model_tensors(lk_model *m, lk_tensor *out) {
    for (size_t i = 0; i < m->n_params; i++) {
        lk_model_param *p = &m->params[i];
        memset(&out[i], 0, sizeof out[i]);
        out[i].name = p->name;
        out[i].dtype = LK_DTYPE_F32;
        out[i].ndim = p->ndim;
        out[i].shape[0] = p->shape[0];
        if (p->ndim == 2) out[i].shape[1] = p->shape[1];
        out[i].nbytes = p->numel * sizeof(float);
        out[i].data = pdata(m, i);
    }
}

lk_status lk_model_set_tensors(lk_model *m, const lk_tensor *ts, size_t n, const char *label,
                               int allow_missing) {
    if (!label) label = "weights";
    unsigned char *seen = lk_calloc(m->n_params ? m->n_params : 1, 1);
    long *idx = lk_calloc(n ? n : 1, sizeof *idx);
    lk_status st = LK_OK;
    if (!seen || !idx) {
        st = lk_error(LK_ERR_NOMEM, "%s: out of memory", label);
        goto done;
    }
    for (size_t i = 0; i < n; i++) {
        const lk_tensor *t = &ts[i];
        long j = lk_model_find_param(m, t->name);
        if (j < 0) {
            st = lk_error(LK_ERR_UNMATCHED, "%s: %s: the model has no such weight", label,
                          t->name);
            goto done;
        }
        const lk_model_param *p = &m->params[j];
        if (seen[j]) {
            st = lk_error(LK_ERR_FORMAT, "%s: %s: given twice (directly or through an alias)",
                          label, p->name);
            goto done;
        }
        seen[j] = 1;
        idx[i] = j;
        if (t->dtype != LK_DTYPE_F32 && t->dtype != LK_DTYPE_F16 && t->dtype != LK_DTYPE_BF16) {
            st = lk_error(LK_ERR_DTYPE, "%s: %s: dtype %s cannot be loaded (F32, F16, BF16)", label,
                          t->name, lk_dtype_name(t->dtype));
            goto done;
        }
        int ok = t->ndim == p->ndim && t->shape[0] == p->shape[0] &&
                 (p->ndim == 1 || t->shape[1] == p->shape[1]);
        if (!ok || t->nbytes != p->numel * lk_dtype_size(t->dtype) || !t->data) {
            char got[128];
            lk_shape_str(t, got, sizeof got);
            if (p->ndim == 2)
                st = lk_error(LK_ERR_SHAPE, "%s: %s is %s but the model weight is [%lld, %lld]",
                              label, t->name, got, (long long)p->shape[0], (long long)p->shape[1]);
            else
                st = lk_error(LK_ERR_SHAPE, "%s: %s is %s but the model weight is [%lld]", label,
                              t->name, got, (long long)p->shape[0]);
            goto done;
        }
    }
    if (!allow_missing)
        for (size_t j = 0; j < m->n_params; j++)
            if (!seen[j]) {
                st = lk_error(LK_ERR_FORMAT, "%s: %s is missing", label, m->params[j].name);
                goto done;
            }
    for (size_t i = 0; i < n; i++) lk_to_f32(pdata(m, (size_t)idx[i]), ts[i].data, ts[i].dtype,
                                             m->params[idx[i]].numel);
done:
    lk_free(seen);
    lk_free(idx);
    return st;
}

#define META_PREFIX "lorakit.model."

lk_status lk_model_save(lk_model *m, const char *path) {
    lk_tensor *ts = lk_calloc(m->n_params, sizeof *ts);
    if (!ts) return lk_error(LK_ERR_NOMEM, "%s: out of memory", path);
    lk_model_tensors(m, ts);
    const lk_model_config *c = &m->cfg;
    char vals[6][24];
    const int v[6] = {c->vocab, c->max_seq, c->d_model, c->n_layers, c->n_heads, c->d_ff};
    for (int i = 0; i < 6; i++) snprintf(vals[i], sizeof vals[i], "%d", v[i]);
    const char *kv[14] = {
        META_PREFIX "vocab",    vals[0], META_PREFIX "max_seq", vals[1],
        META_PREFIX "d_model",  vals[2], META_PREFIX "n_layers", vals[3],
        META_PREFIX "n_heads",  vals[4], META_PREFIX "d_ff",    vals[5],
        "format", "pt"};
    lk_status st = lk_st_save(path, ts, m->n_params, kv, 7);
    lk_free(ts);
    return st;
}

static lk_status meta_int(const lk_st *st, const char *path, const char *key, int *out) {
    const char *s = lk_st_metadata_get(st, key);
    if (!s) return lk_error(LK_ERR_FORMAT, "%s: metadata %s is missing (not a lorakit model "
                            "checkpoint)", path, key);
    char *end;
    long v = strtol(s, &end, 10);
    if (end == s || *end || v <= 0 || v > (1 << 20))
        return lk_error(LK_ERR_FORMAT, "%s: metadata %s = \"%s\" is not a valid size", path, key, s);
    *out = (int)v;
    return LK_OK;
}

/* Copies every tensor of an open checkpoint into m (see set_tensors). */
static lk_status set_from_st(lk_model *m, const lk_st *st, const char *path) {
    size_t n = lk_st_count(st);
    lk_tensor *ts = lk_calloc(n ? n : 1, sizeof *ts);
    if (!ts) return lk_error(LK_ERR_NOMEM, "%s: out of memory", path);
    for (size_t i = 0; i < n; i++) ts[i] = *lk_st_tensor(st, i);
    lk_status s = lk_model_set_tensors(m, ts, n, path, 0);
    lk_free(ts);
    return s;
}

lk_status lk_model_load(const char *path, lk_model **out) {
    lk_st *st = NULL;
    lk_status s = lk_st_open(path, &st);
    if (s) return s;
    lk_model_config c;
    memset(&c, 0, sizeof c);
    lk_model *m = NULL;
    if ((s = meta_int(st, path, META_PREFIX "vocab", &c.vocab)) ||
        (s = meta_int(st, path, META_PREFIX "max_seq", &c.max_seq)) ||
        (s = meta_int(st, path, META_PREFIX "d_model", &c.d_model)) ||
        (s = meta_int(st, path, META_PREFIX "n_layers", &c.n_layers)) ||
        (s = meta_int(st, path, META_PREFIX "n_heads", &c.n_heads)) ||
        (s = meta_int(st, path, META_PREFIX "d_ff", &c.d_ff)))
        goto done;
    if ((s = lk_model_create(&c, 0, &m))) {
        lk_error_prefix(s, "%s", path);
        goto done;
    }
    if ((s = set_from_st(m, st, path))) {
        lk_model_free(m);
        goto done;
    }
    *out = m;
done:
    lk_st_close(st);
    return s;
}

lk_status lk_model_load_weights(lk_model *m, const char *path) {
    lk_st *st = NULL;
    lk_status s = lk_st_open(path, &st);
    if (s) return s;
    s = set_from_st(m, st, path);
    lk_st_close(st);
    return s;
}

/* ---- activations ---- */

/* Lays one activation set for (B, T) out in lay (from {0}), each array
 * carved from mem when mem is not NULL (lay.bytes: the block's size; lay
 * overflowed when it does not fit). */
static void carve(const lk_model_config *c, int B, int T, lk_carve *lay, char *mem, lk_acts *a, lk_layer_acts *la) {
    size_t N = (size_t)B * T, C = (size_t)c->d_model, F = (size_t)c->d_ff, V = (size_t)c->vocab;
    size_t att = (size_t)B * c->n_heads * T * T;
#define TAKE(ptr, n)                                       \
    do {                                                   \
        size_t at_ = LK_CARVE(lay, (n), float);            \
        if (mem) (ptr) = (float *)(void *)(mem + at_);     \
    } while (0)
    lk_acts tmpa;
    if (!mem) a = &tmpa;
    TAKE(a->encoded, N * C);
    for (int l = 0; l < c->n_layers; l++) {
        lk_layer_acts tmp, *x = mem ? &la[l] : &tmp;
        TAKE(x->ln1, N * C);
        TAKE(x->ln1_mean, N);
        TAKE(x->ln1_rstd, N);
        TAKE(x->q, N * C);
        TAKE(x->k, N * C);
        TAKE(x->v, N * C);
        TAKE(x->att, att);
        TAKE(x->atty, N * C);
        TAKE(x->attproj, N * C);
        TAKE(x->res1, N * C);
        TAKE(x->ln2, N * C);
        TAKE(x->ln2_mean, N);
        TAKE(x->ln2_rstd, N);
        TAKE(x->fch, N * F);
        TAKE(x->fch_gelu, N * F);
        TAKE(x->fcproj, N * C);
        TAKE(x->res2, N * C);
    }
    TAKE(a->lnf, N * C);
    TAKE(a->lnf_mean, N);
    TAKE(a->lnf_rstd, N);
    TAKE(a->logits, N * V);
    TAKE(a->probs, N * V);
    TAKE(a->losses, N);
    TAKE(a->scratch, (size_t)T);
#undef TAKE
    if (mem) a->layer = la;
}

/* The bytes of one activation set for (B, T); SIZE_MAX when it does not fit. */
static size_t acts_bytes(const lk_model_config *c, int B, int T) {
    lk_carve lay = {0};
    carve(c, B, T, &lay, NULL, NULL, NULL);
    return lay.bytes;
}

static lk_status ensure_acts(lk_model *m, int B, int T) {
    lk_carve lay = {0};
    carve(&m->cfg, B, T, &lay, NULL, NULL, NULL);
    size_t ntok = (size_t)B * T;
    if (lay.overflow || lay.bytes > m->acts_cap || !m->act_mem) {
        char *a = lk_carve_alloc(&lay);
        char *d = lk_carve_alloc(&lay);
        if (!a || !d) {
            lk_free(a);
            lk_free(d);
            return lk_error(LK_ERR_NOMEM, "model: out of memory for activations of B=%d, T=%d",
                            B, T);
        }
        lk_free(m->act_mem);
        lk_free(m->dact_mem);
        m->act_mem = a;
        m->dact_mem = d;
        m->acts_cap = lay.bytes;
    }
    if (ntok > m->tok_cap || !m->layer_a) {
        int *in = lk_malloc(ntok * sizeof(int));
        int *tg = lk_malloc(ntok * sizeof(int));
        lk_layer_acts *la = m->layer_a ? m->layer_a
                                       : lk_calloc((size_t)m->cfg.n_layers, sizeof *la);
        lk_layer_acts *ld = m->layer_d ? m->layer_d
                                       : lk_calloc((size_t)m->cfg.n_layers, sizeof *ld);
        if (la) m->layer_a = la;
        if (ld) m->layer_d = ld;
        if (!in || !tg || !la || !ld) {
            lk_free(in);
            lk_free(tg);
            return lk_error(LK_ERR_NOMEM, "model: out of memory for a batch of B=%d, T=%d", B, T);
        }
        lk_free(m->inputs);
        lk_free(m->targets);
        m->inputs = in;
        m->targets = tg;
        m->tok_cap = ntok;
    }
    lk_carve at = {0};
    carve(&m->cfg, B, T, &at, m->act_mem, &m->a, m->layer_a);
    at = (lk_carve){0};
    carve(&m->cfg, B, T, &at, m->dact_mem, &m->d, m->layer_d);
    return LK_OK;
}

/* y = x W^T + b (+ hook) for linear li over N rows. */
static lk_status linear_forward(lk_model *m, size_t li, float *out, const float *inp, int N) {
    lk_linear *l = &m->linears[li];
    lk_k_matmul_forward(out, inp, pdata(m, l->w_param), pdata(m, l->b_param), N, l->in_f,
                        l->out_f);
    if (l->has_hook && l->hook.forward) return l->hook.forward(l->ctx, out, inp, N);
    return LK_OK;
}

static lk_status linear_backward(lk_model *m, size_t li, float *dinp, const float *dout,
                                 const float *inp, int N) {
    lk_linear *l = &m->linears[li];
    int tb = m->train_base;
    lk_k_matmul_backward(dinp, tb ? pgrad(m, l->w_param) : NULL, tb ? pgrad(m, l->b_param) : NULL,
                         dout, inp, pdata(m, l->w_param), N, l->in_f, l->out_f);
    if (l->has_hook && l->hook.backward) return l->hook.backward(l->ctx, dinp, dout, inp, N);
    return LK_OK;
}

lk_status lk_model_forward(lk_model *m, const int *inputs, const int *targets, int B, int T,
                           float *loss) {
    const lk_model_config *c = &m->cfg;
    if (!inputs || B <= 0 || T <= 0 || T > c->max_seq)
        return lk_error(LK_ERR_ARG, "model forward: B = %d, T = %d (max_seq %d)", B, T,
                        c->max_seq);
    if ((size_t)B * (size_t)T > (size_t)1 << 28)
        return lk_error(LK_ERR_ARG, "model forward: batch B*T = %lld is too large",
                        (long long)B * T);
    size_t N = (size_t)B * T;
    for (size_t i = 0; i < N; i++) {
        if (inputs[i] < 0 || inputs[i] >= c->vocab)
            return lk_error(LK_ERR_ARG, "model forward: input token %d at %zu is outside the "
                            "vocabulary (0..%d)", inputs[i], i, c->vocab - 1);
        if (targets && targets[i] >= c->vocab)
            return lk_error(LK_ERR_ARG, "model forward: target %d at %zu is outside the "
                            "vocabulary (0..%d)", targets[i], i, c->vocab - 1);
    }
    m->have_fwd = 0;
    lk_status st = ensure_acts(m, B, T);
    if (st) return st;
    m->B = B;
    m->T = T;
    memcpy(m->inputs, inputs, N * sizeof(int));
    m->have_targets = targets != NULL;
    if (targets) memcpy(m->targets, targets, N * sizeof(int));

    int C = c->d_model, F = c->d_ff, NH = c->n_heads, V = c->vocab, n = (int)N;
    lk_acts *a = &m->a;
    lk_k_embed_forward(a->encoded, m->inputs, pdata(m, G_WTE), pdata(m, G_WPE), B, T, C);
    const float *x = a->encoded;
    for (int l = 0; l < c->n_layers; l++) {
        lk_layer_acts *la = &a->layer[l];
        size_t lin = (size_t)l * L_PER_BLOCK;
        lk_k_layernorm_forward(la->ln1, la->ln1_mean, la->ln1_rstd, x, pdata(m, bp(l, P_LN1W)),
                               pdata(m, bp(l, P_LN1B)), n, C);
        if ((st = linear_forward(m, lin + L_Q, la->q, la->ln1, n)) ||
            (st = linear_forward(m, lin + L_K, la->k, la->ln1, n)) ||
            (st = linear_forward(m, lin + L_V, la->v, la->ln1, n)))
            return st;
        lk_k_attention_forward(la->atty, la->att, la->q, la->k, la->v, B, T, C, NH);
        if ((st = linear_forward(m, lin + L_O, la->attproj, la->atty, n))) return st;
        lk_k_residual_forward(la->res1, x, la->attproj, N * C);
        lk_k_layernorm_forward(la->ln2, la->ln2_mean, la->ln2_rstd, la->res1,
                               pdata(m, bp(l, P_LN2W)), pdata(m, bp(l, P_LN2B)), n, C);
        if ((st = linear_forward(m, lin + L_FC1, la->fch, la->ln2, n))) return st;
        lk_k_gelu_forward(la->fch_gelu, la->fch, N * F);
        if ((st = linear_forward(m, lin + L_FC2, la->fcproj, la->fch_gelu, n))) return st;
        lk_k_residual_forward(la->res2, la->res1, la->fcproj, N * C);
        x = la->res2;
    }
    lk_k_layernorm_forward(a->lnf, a->lnf_mean, a->lnf_rstd, x, pdata(m, G_LNFW(m)),
                           pdata(m, G_LNFB(m)), n, C);
    lk_k_matmul_forward(a->logits, a->lnf, pdata(m, G_HEAD(m)), NULL, n, C, V);
    m->count = lk_k_crossentropy_forward(a->probs, a->losses, a->logits,
                                         targets ? m->targets : NULL, n, V);
    if (loss) {
        double sum = 0.0;
        for (size_t i = 0; i < N; i++) sum += a->losses[i];
        *loss = m->count ? (float)(sum / m->count) : 0.0f;
    }
    m->have_fwd = 1;
    return LK_OK;
}

const float *lk_model_logits(const lk_model *m) { return m->have_fwd ? m->a.logits : NULL; }

void lk_model_zero_grad(lk_model *m) { memset(m->grad_mem, 0, m->n_floats * sizeof(float)); }

void lk_model_set_train_base(lk_model *m, int on) { m->train_base = on != 0; }

lk_status lk_model_backward(lk_model *m) {
    if (!m->have_fwd || !m->have_targets)
        return lk_error(LK_ERR_STATE, "model backward: no forward pass with targets to go back "
                        "through");
    const lk_model_config *c = &m->cfg;
    int B = m->B, T = m->T, C = c->d_model, F = c->d_ff, NH = c->n_heads, V = c->vocab;
    int n = B * T;
    size_t N = (size_t)n;
    lk_acts *a = &m->a, *d = &m->d;
    int tb = m->train_base;
    lk_status st;
    memset(m->dact_mem, 0, acts_bytes(c, B, T));
    if (!m->count) return LK_OK;

    lk_k_crossentropy_backward(d->logits, a->probs, m->targets, 1.0f / (float)m->count, n, V);
    lk_k_matmul_backward(d->lnf, tb ? pgrad(m, G_HEAD(m)) : NULL, NULL, d->logits, a->lnf,
                         pdata(m, G_HEAD(m)), n, C, V);
    const float *xlast = c->n_layers ? a->layer[c->n_layers - 1].res2 : a->encoded;
    float *dxlast = c->n_layers ? d->layer[c->n_layers - 1].res2 : d->encoded;
    lk_k_layernorm_backward(dxlast, tb ? pgrad(m, G_LNFW(m)) : NULL,
                            tb ? pgrad(m, G_LNFB(m)) : NULL, d->lnf, xlast, pdata(m, G_LNFW(m)),
                            a->lnf_mean, a->lnf_rstd, n, C);
    for (int l = c->n_layers - 1; l >= 0; l--) {
        lk_layer_acts *la = &a->layer[l], *dl = &d->layer[l];
        const float *x = l ? a->layer[l - 1].res2 : a->encoded;
        float *dx = l ? d->layer[l - 1].res2 : d->encoded;
        size_t lin = (size_t)l * L_PER_BLOCK;
        /* res2 = res1 + fcproj */
        for (size_t i = 0; i < N * C; i++) {
            dl->res1[i] += dl->res2[i];
            dl->fcproj[i] += dl->res2[i];
        }
        if ((st = linear_backward(m, lin + L_FC2, dl->fch_gelu, dl->fcproj, la->fch_gelu, n)))
            return st;
        lk_k_gelu_backward(dl->fch, la->fch, dl->fch_gelu, N * F);
        if ((st = linear_backward(m, lin + L_FC1, dl->ln2, dl->fch, la->ln2, n))) return st;
        lk_k_layernorm_backward(dl->res1, tb ? pgrad(m, bp(l, P_LN2W)) : NULL,
                                tb ? pgrad(m, bp(l, P_LN2B)) : NULL, dl->ln2, la->res1,
                                pdata(m, bp(l, P_LN2W)), la->ln2_mean, la->ln2_rstd, n, C);
        /* res1 = x + attproj */
        for (size_t i = 0; i < N * C; i++) {
            dx[i] += dl->res1[i];
            dl->attproj[i] += dl->res1[i];
        }
        if ((st = linear_backward(m, lin + L_O, dl->atty, dl->attproj, la->atty, n))) return st;
        lk_k_attention_backward(dl->q, dl->k, dl->v, d->scratch, dl->atty, la->att, la->q, la->k,
                                la->v, B, T, C, NH);
        if ((st = linear_backward(m, lin + L_Q, dl->ln1, dl->q, la->ln1, n)) ||
            (st = linear_backward(m, lin + L_K, dl->ln1, dl->k, la->ln1, n)) ||
            (st = linear_backward(m, lin + L_V, dl->ln1, dl->v, la->ln1, n)))
            return st;
        lk_k_layernorm_backward(dx, tb ? pgrad(m, bp(l, P_LN1W)) : NULL,
                                tb ? pgrad(m, bp(l, P_LN1B)) : NULL, dl->ln1, x,
                                pdata(m, bp(l, P_LN1W)), la->ln1_mean, la->ln1_rstd, n, C);
    }
    if (tb) lk_k_embed_backward(pgrad(m, G_WTE), pgrad(m, G_WPE), d->encoded, m->inputs, B, T, C);
    return LK_OK;
}

lk_status lk_model_generate(lk_model *m, const int *prompts, int B, int P, int gen_len,
                            int *out) {
    const lk_model_config *c = &m->cfg;
    if (!prompts || !out || B <= 0 || P <= 0 || gen_len < 0 || P + gen_len - 1 > c->max_seq)
        return lk_error(LK_ERR_ARG, "model generate: B = %d, prompt %d + %d new tokens "
                        "(max_seq %d)", B, P, gen_len, c->max_seq);
    if (gen_len == 0) return LK_OK;
    /* the last new token is never fed back, so rows are P + gen_len - 1 long */
    int T = P + gen_len - 1;
    int *tok = lk_calloc((size_t)B * T, sizeof(int));
    if (!tok) return lk_error(LK_ERR_NOMEM, "model generate: out of memory");
    for (int b = 0; b < B; b++)
        memcpy(tok + (size_t)b * T, prompts + (size_t)b * P, (size_t)P * sizeof(int));
    lk_status st = LK_OK;
    int V = c->vocab;
    for (int g = 0; g < gen_len; g++) {
        /* causal: positions >= P + g do not influence position P + g - 1, so
         * running the whole row gives the same logits there as its prefix */
        int pos = P + g - 1;
        if ((st = lk_model_forward(m, tok, NULL, B, T, NULL))) break;
        for (int b = 0; b < B; b++) {
            const float *lg = m->a.logits + ((size_t)b * T + pos) * V;
            int best = 0;
            for (int v = 1; v < V; v++)
                if (lg[v] > lg[best]) best = v;
            if (pos + 1 < T) tok[(size_t)b * T + pos + 1] = best;
            out[(size_t)b * gen_len + g] = best;
        }
    }
    lk_free(tok);
    return st;
}

/* ---- linears ---- */
size_t lk_model_linear_count(const lk_model *m) { return m->n_linears; }
const char *lk_model_linear_name(const lk_model *m, size_t i) {
    return i < m->n_linears ? m->linears[i].name : NULL;
}
long lk_model_find_linear(const lk_model *m, const char *module) {
    char buf[LK_MODEL_NAME_MAX + 16];
    if (!module) return -1;
    size_t len = strlen(module);
    const char *suffix = ".base_layer";
    size_t sl = strlen(suffix);
    if (len > sl && len - sl < sizeof buf && !strcmp(module + len - sl, suffix)) {
        memcpy(buf, module, len - sl);
        buf[len - sl] = 0;
        module = buf;
    }
    for (size_t i = 0; i < m->n_linears; i++)
        if (!strcmp(m->linears[i].name, module)) return (long)i;
    return -1;
}
void lk_model_linear_info(lk_model *m, size_t i, int *in_f, int *out_f, float **W, float **b) {
    lk_linear *l = &m->linears[i];
    if (in_f) *in_f = l->in_f;
    if (out_f) *out_f = l->out_f;
    if (W) *W = pdata(m, l->w_param);
    if (b) *b = pdata(m, l->b_param);
}
void lk_model_set_linear_hook(lk_model *m, size_t i, const lk_model_linear_hook *hook,
                              void *ctx) {
    lk_linear *l = &m->linears[i];
    if (hook) {
        l->hook = *hook;
        l->ctx = ctx;
        l->has_hook = 1;
    } else {
        memset(&l->hook, 0, sizeof l->hook);
        l->ctx = NULL;
        l->has_hook = 0;
    }
}
