/* model_lora.c — LoRA on the small transformer through the training API.
 *
 * The model stays LoRA-agnostic: it exposes its linears and parameters, and
 * this file registers them with an lk_lora_model (lorakit/lora.h), lets
 * lk_lora_enable decide which layers are wrapped (targets, excludes, seeded
 * init), and attaches each wrapped layer's delta kernels as the linear's
 * hook. Base weights stay in the model's own memory (borrowed), so a base
 * checkpoint loaded through lk_lora_model_load_base (with the
 * `<m>.base_layer.weight` aliases) lands directly in the model. */
#include <string.h>

#include "lorakit/alloc.h"
#include "app/model.h"

struct lk_model_lora {
    lk_lora_model *lm;
};

static lk_status hook_fwd(void *ctx, float *out, const float *inp, int n) {
    return lk_lora_layer_delta_forward(ctx, out, inp, n);
}

static lk_status hook_bwd(void *ctx, float *dinp, const float *dout, const float *inp, int n) {
    return lk_lora_layer_delta_backward(ctx, dinp, dout, inp, n);
}

lk_status lk_model_lora_attach(lk_model *m, const lk_lora_config *cfg, uint64_t seed,
                               lk_model_lora **out) {
    if (!m || !cfg || !out) return lk_error(LK_ERR_ARG, "lk_model_lora_attach: NULL argument");
    lk_model_lora *ml = lk_calloc(1, sizeof *ml);
    if (!ml) return lk_error(LK_ERR_NOMEM, "model lora: out of memory");
    lk_status st = lk_lora_model_create(&ml->lm);
    if (st) goto fail;
    size_t nl = lk_model_linear_count(m);
    for (size_t i = 0; i < nl; i++) {
        int in_f, out_f;
        float *W, *b;
        lk_model_linear_info(m, i, &in_f, &out_f, &W, &b);
        if ((st = lk_lora_model_add_linear(ml->lm, lk_model_linear_name(m, i), in_f, out_f, W, b,
                                           NULL)))
            goto fail;
    }
    /* every other parameter (embeddings, norms, head) by its state name */
    float *data = lk_model_params(m);
    for (size_t i = 0; i < lk_model_param_count(m); i++) {
        const lk_model_param *p = lk_model_param_at(m, i);
        size_t len = strlen(p->name);
        char mod[LK_MODEL_NAME_MAX];
        /* skip "<linear>.weight" / "<linear>.bias": registered above */
        const char *dot = strrchr(p->name, '.');
        size_t ml_len = dot ? (size_t)(dot - p->name) : len;
        memcpy(mod, p->name, ml_len);
        mod[ml_len] = 0;
        if (lk_model_find_linear(m, mod) >= 0) continue;
        if ((st = lk_lora_model_add_tensor(ml->lm, p->name, p->ndim, p->shape, data + p->offset)))
            goto fail;
    }
    size_t wrapped = 0;
    if ((st = lk_lora_enable(ml->lm, cfg, NULL, seed, &wrapped))) goto fail;
    lk_model_linear_hook hk = {hook_fwd, hook_bwd};
    for (size_t i = 0; i < nl; i++) {
        lk_lora_layer *l = lk_lora_model_find(ml->lm, lk_model_linear_name(m, i));
        if (l && lk_lora_layer_wrapped(l)) lk_model_set_linear_hook(m, i, &hk, l);
    }
    lk_model_set_train_base(m, 0);
    *out = ml;
    return LK_OK;
fail:
    lk_lora_model_free(ml->lm);
    lk_free(ml);
    return st;
}

lk_lora_model *lk_model_lora_get(lk_model_lora *ml) { return ml ? ml->lm : NULL; }

void lk_model_lora_detach(lk_model *m, lk_model_lora *ml) {
    if (!ml) return;
    if (m) {
        for (size_t i = 0; i < lk_model_linear_count(m); i++)
            lk_model_set_linear_hook(m, i, NULL, NULL);
        lk_model_set_train_base(m, 1);
    }
    lk_lora_model_free(ml->lm);
    lk_free(ml);
}
