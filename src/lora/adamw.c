/* adamw.c — AdamW on the adapter parameter buffer, and its state on disk.
 *
 * The update is torch.optim.AdamW's (single-tensor path): decoupled weight
 * decay p *= 1 - lr*wd, moments by lerp, bias correction folded into the step
 * size and the denominator sqrt(v)/sqrt(1-b2^t) + eps. The moments live in
 * one buffer laid out like the parameters, so the step is one loop over the
 * flat buffer. The state is saved per parameter name, so a resume checks it
 * against the model's adapters instead of trusting a flat layout. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lorakit/alloc.h"
#include "lorakit/safetensors.h"
#include "lora/params.h"

struct lk_adamw {
    lk_adamw_opts o;
    long t;
    size_t numel;
    float *m; /* exp_avg then exp_avg_sq: one allocation of 2 * numel */
};

lk_status lk_adamw_create(const lk_lora_params *p, const lk_adamw_opts *opts, lk_adamw **out) {
    if (!out) return lk_error(LK_ERR_ARG, "lk_adamw_create: out is NULL");
    *out = NULL;
    if (!p || !opts) return lk_error(LK_ERR_ARG, "lk_adamw_create: missing parameters or options");
    lk_adamw_opts o = *opts;
    if (o.beta1 == 0.0f && o.beta2 == 0.0f) {
        o.beta1 = 0.9f;
        o.beta2 = 0.999f;
    }
    if (o.eps == 0.0f) o.eps = 1e-8f;
    if (!(o.lr >= 0.0f) || !(o.beta1 >= 0.0f && o.beta1 < 1.0f) || !(o.beta2 >= 0.0f && o.beta2 < 1.0f) ||
        !(o.eps > 0.0f) || !(o.weight_decay >= 0.0f))
        return lk_error(LK_ERR_ARG, "AdamW: invalid options lr=%g betas=(%g, %g) eps=%g weight_decay=%g",
                        o.lr, o.beta1, o.beta2, o.eps, o.weight_decay);
    lk_adamw *a = lk_calloc(1, sizeof *a);
    float *m = lk_calloc(2 * p->numel, sizeof(float));
    if (!a || !m) {
        lk_free(a);
        lk_free(m);
        return lk_error(LK_ERR_NOMEM, "AdamW: out of memory for %zu floats of state", 2 * p->numel);
    }
    a->o = o;
    a->numel = p->numel;
    a->m = m;
    *out = a;
    return LK_OK;
}

void lk_adamw_free(lk_adamw *o) {
    if (!o) return;
    lk_free(o->m);
    lk_free(o);
}

long lk_adamw_steps(const lk_adamw *o) { return o ? o->t : 0; }
void lk_adamw_set_lr(lk_adamw *o, float lr) {
    if (o) o->o.lr = lr;
}

/* The optimizer state belongs to one parameter layout; every use checks it. */
static lk_status check_layout(const lk_adamw *o, const lk_lora_params *p) {
    if (p->numel != o->numel)
        return lk_error(LK_ERR_SHAPE, "AdamW: state for %zu floats but the parameters have %zu",
                        o->numel, p->numel);
    return LK_OK;
}

lk_status lk_adamw_step(lk_adamw *o, lk_lora_params *p) {
    if (!o || !p) return lk_error(LK_ERR_ARG, "lk_adamw_step: missing optimizer or parameters");
    lk_status ls = check_layout(o, p);
    if (ls != LK_OK) return ls;
    o->t++;
    const float lr = o->o.lr, b1 = o->o.beta1, b2 = o->o.beta2, eps = o->o.eps;
    const float bc1 = 1.0f - powf(b1, (float)o->t);
    const float bc2 = 1.0f - powf(b2, (float)o->t);
    const float step = lr / bc1, bc2_sqrt = sqrtf(bc2), decay = 1.0f - lr * o->o.weight_decay;
    float *m = o->m, *v = o->m + o->numel, *w = p->data;
    const float *g = p->grad;
    for (size_t i = 0; i < o->numel; i++) {
        w[i] *= decay;
        m[i] += (1.0f - b1) * (g[i] - m[i]);
        v[i] = b2 * v[i] + (1.0f - b2) * g[i] * g[i];
        float denom = sqrtf(v[i]) / bc2_sqrt + eps;
        w[i] -= step * (m[i] / denom);
    }
    return LK_OK;
}

static char *state_path(const char *dir) {
    size_t n = strlen(dir) + 32;
    char *s = lk_malloc(n);
    if (s) snprintf(s, n, "%s/optimizer.safetensors", dir);
    return s;
}

/* "<param>.exp_avg" (j = 0) or "<param>.exp_avg_sq" (j = 1), as torch names them. */
static char *state_name(const lk_lora_params *p, size_t k, int j) {
    size_t len = strlen(p->names[k]) + 16;
    char *nm = lk_malloc(len);
    if (nm) snprintf(nm, len, "%s.%s", p->names[k], j ? "exp_avg_sq" : "exp_avg");
    return nm;
}

lk_status lk_adamw_save(const lk_adamw *o, const lk_lora_params *p, const char *dir) {
    if (!o || !p || !dir) return lk_error(LK_ERR_ARG, "lk_adamw_save: missing argument");
    lk_status ls = check_layout(o, p);
    if (ls != LK_OK) return ls;
    char *path = state_path(dir);
    lk_tensor *t = lk_calloc(2 * p->count, sizeof *t); /* each t[i].name owned (freed below) */
    lk_status s = (path && t) ? LK_OK : lk_error(LK_ERR_NOMEM, "out of memory");
    for (size_t k = 0; s == LK_OK && k < p->count; k++)
        for (int j = 0; j < 2; j++) {
            char *nm = state_name(p, k, j);
            if (!nm) {
                s = lk_error(LK_ERR_NOMEM, "out of memory");
                break;
            }
            lk_tensor *v = &t[2 * k + j];
            v->name = nm;
            v->dtype = LK_DTYPE_F32;
            v->ndim = 2;
            v->shape[0] = p->rows[k];
            v->shape[1] = p->cols[k];
            v->nbytes = (size_t)(p->rows[k] * p->cols[k]) * sizeof(float);
            v->data = o->m + (j ? o->numel : 0) + p->offset[k];
        }
    char vals[6][40];
    snprintf(vals[0], sizeof vals[0], "%ld", o->t);
    snprintf(vals[1], sizeof vals[1], "%.9g", (double)o->o.lr);
    snprintf(vals[2], sizeof vals[2], "%.9g", (double)o->o.beta1);
    snprintf(vals[3], sizeof vals[3], "%.9g", (double)o->o.beta2);
    snprintf(vals[4], sizeof vals[4], "%.9g", (double)o->o.eps);
    snprintf(vals[5], sizeof vals[5], "%.9g", (double)o->o.weight_decay);
    const char *kv[] = {"lorakit.optimizer", "adamw", "step", vals[0], "lr", vals[1],
                        "beta1", vals[2], "beta2", vals[3], "eps", vals[4], "weight_decay", vals[5]};
    if (s == LK_OK) s = lk_st_save(path, t, 2 * p->count, kv, 7);
    for (size_t i = 0; t && i < 2 * p->count; i++) lk_free((char *)t[i].name);
    lk_free(t);
    lk_free(path);
    return s;
}

lk_status lk_adamw_load(lk_adamw *o, const lk_lora_params *p, const char *dir) {
    if (!o || !p || !dir) return lk_error(LK_ERR_ARG, "lk_adamw_load: missing argument");
    lk_status ls = check_layout(o, p);
    if (ls != LK_OK) return ls;
    char *path = state_path(dir);
    if (!path) return lk_error(LK_ERR_NOMEM, "out of memory");
    lk_st *st;
    lk_status s = lk_st_open(path, &st);
    if (s != LK_OK) {
        lk_free(path);
        return s;
    }
    long step = -1;
    const char *sv = lk_st_metadata_get(st, "step");
    if (sv) {
        char *end;
        step = strtol(sv, &end, 10);
        if (*end || end == sv) step = -1;
    }
    if (step < 0) s = lk_error(LK_ERR_FORMAT, "%s: missing or invalid 'step' metadata", path);
    long *idx = s == LK_OK ? lk_calloc(2 * p->count, sizeof *idx) : NULL;
    if (s == LK_OK && !idx) s = lk_error(LK_ERR_NOMEM, "out of memory");
    for (size_t k = 0; s == LK_OK && k < p->count; k++)
        for (int j = 0; j < 2 && s == LK_OK; j++) {
            char *nm = state_name(p, k, j);
            if (!nm) {
                s = lk_error(LK_ERR_NOMEM, "out of memory");
                break;
            }
            long i = lk_st_find(st, nm);
            if (i < 0) {
                s = lk_error(LK_ERR_FORMAT, "%s: missing optimizer state '%s'", path, nm);
                lk_free(nm);
                break;
            }
            const lk_tensor *t = lk_st_tensor(st, (size_t)i);
            if (t->dtype != LK_DTYPE_F32 || t->ndim != 2 || t->shape[0] != p->rows[k] ||
                t->shape[1] != p->cols[k]) {
                char have[96];
                lk_shape_str(t, have, sizeof have);
                s = lk_error(LK_ERR_SHAPE, "%s: %s is %s %s but the parameter is F32 [%lld, %lld]",
                             path, nm, lk_dtype_name(t->dtype), have, (long long)p->rows[k],
                             (long long)p->cols[k]);
            }
            lk_free(nm);
            idx[2 * k + j] = i;
        }
    if (s == LK_OK && lk_st_count(st) != 2 * p->count)
        s = lk_error(LK_ERR_FORMAT, "%s: %zu tensors, expected %zu (2 per parameter)", path,
                     lk_st_count(st), 2 * p->count);
    if (s == LK_OK) {
        for (size_t k = 0; k < p->count; k++)
            for (int j = 0; j < 2; j++) {
                const lk_tensor *t = lk_st_tensor(st, (size_t)idx[2 * k + j]);
                memcpy(o->m + (j ? o->numel : 0) + p->offset[k], t->data, t->nbytes);
            }
        o->t = step;
    }
    lk_free(idx);
    lk_st_close(st);
    lk_free(path);
    return s;
}
