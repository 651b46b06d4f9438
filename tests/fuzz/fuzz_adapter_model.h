/* fuzz_adapter_model.h — the toy model and the adapter invariants shared by
 * fuzz_adapter.c and fuzz_adapter_config.c (see those files). */
#ifndef LK_FUZZ_ADAPTER_MODEL_H
#define LK_FUZZ_ADAPTER_MODEL_H

#include <math.h>

#include "fuzz_common.h"
#include "adapter/layout.h"

/* The toy model: names and shapes only (resolve reads nothing else). */
static const struct {
    const char *name;
    int64_t out, in; /* in == 0: a 1-D tensor */
} fz_model_keys[] = {
    {"blocks.0.attn.to_q.weight", 16, 16},     {"blocks.0.attn.to_k.weight", 16, 16},
    {"blocks.0.attn.to_v.weight", 16, 16},     {"blocks.0.attn.to_out.0.weight", 16, 16},
    {"blocks.0.ff.net.0.proj.weight", 32, 16}, {"blocks.0.ff.net.2.weight", 16, 32},
    {"blocks.1.attn.to_q.weight", 16, 16},     {"blocks.1.attn.to_k.weight", 16, 16},
    {"blocks.1.attn.to_v.weight", 16, 16},     {"blocks.1.attn.to_out.0.weight", 16, 16},
    {"blocks.1.ff.net.0.proj.weight", 32, 16}, {"blocks.1.ff.net.2.weight", 16, 32},
    {"blocks.0.norm.weight", 16, 0},           {"blocks.0.attn.to_q.bias", 16, 0},
};
#define FZ_NMODEL (sizeof fz_model_keys / sizeof fz_model_keys[0])

static inline const lk_tensor *fz_model(void) {
    static lk_tensor m[FZ_NMODEL];
    if (!m[0].name)
        for (size_t i = 0; i < FZ_NMODEL; i++) {
            m[i].name = fz_model_keys[i].name;
            m[i].dtype = LK_DTYPE_F32;
            m[i].ndim = fz_model_keys[i].in ? 2 : 1;
            m[i].shape[0] = fz_model_keys[i].out;
            m[i].shape[1] = fz_model_keys[i].in;
            m[i].nbytes = (size_t)fz_model_keys[i].out *
                          (size_t)(fz_model_keys[i].in ? fz_model_keys[i].in : 1) * 4;
            m[i].data = NULL; /* never read */
        }
    return m;
}

static inline const lk_tensor *fz_model_find(const char *name) {
    const lk_tensor *m = fz_model();
    for (size_t i = 0; i < FZ_NMODEL; i++)
        if (!strcmp(m[i].name, name)) return &m[i];
    return NULL;
}

/* Invariants of an opened adapter (before resolve). */
static inline void fz_adapter_check_open(const lk_adapter *a, lk_adapter_format asked) {
    FZ_CHECK(lk_adapter_get_format(a) > LK_FORMAT_AUTO && lk_adapter_get_format(a) < LK_FORMAT_COUNT);
    if (asked != LK_FORMAT_AUTO) FZ_CHECK(lk_adapter_get_format(a) == asked);
    FZ_CHECK(lk_adapter_path(a) != NULL && lk_adapter_file(a) != NULL);
    size_t n = lk_adapter_count(a);
    for (size_t i = 0; i < n; i++) {
        const lk_lora_module *m = lk_adapter_module(a, i);
        FZ_CHECK(m != NULL && m->module != NULL);
        fz_touch(m->module, strlen(m->module));
        FZ_CHECK((int)m->algo >= 0 && m->algo < LK_ALGO_COUNT);
        /* OFT / BOFT rotate the weight's rows: any row width (in 0 until resolved); PEFT's OFT (oft_R.weight,
         * 2-D) its columns: any rows (out 0), n b columns, b = rank with b (b - 1) / 2 packed values per block */
        const int peft_oft = m->algo == LK_ALGO_OFT && m->w1.ndim == 2;
        FZ_CHECK(peft_oft ? m->out == 0 && m->rank >= 2 && m->in == m->w1.shape[0] * m->rank &&
                                m->w1.shape[1] == (int64_t)m->rank * (m->rank - 1) / 2
                          : m->out > 0 && (m->in > 0 || m->algo == LK_ALGO_OFT || m->algo == LK_ALGO_BOFT));
        if (!peft_oft && (m->algo == LK_ALGO_OFT || m->algo == LK_ALGO_BOFT))
            FZ_CHECK(m->w1.ndim == (m->algo == LK_ALGO_BOFT ? 4 : 3) && m->w1.shape[m->w1.ndim - 1] == m->rank);
        const lk_tensor *ts[LK_MODULE_MAX_TENSORS];
        size_t nts = lk_lora_module_tensors(m, ts);
        for (size_t k = 0; k < nts; k++) {
            FZ_CHECK(ts[k]->nbytes == lk_tensor_numel(ts[k]) * lk_dtype_size(ts[k]->dtype));
            fz_touch(ts[k]->data, ts[k]->nbytes);
        }
        if (m->algo != LK_ALGO_LORA) { /* LoHa, LoKr: alpha / r; dense ones: scale 1 */
            FZ_CHECK(m->rank >= 0 && isfinite(m->scale));
            if (m->algo == LK_ALGO_FULL || m->algo == LK_ALGO_NORM || m->algo == LK_ALGO_SET)
                FZ_CHECK(m->scale == 1.0);
            continue;
        }
        FZ_CHECK(m->rank > 0);
        FZ_CHECK((m->A.ndim == 2 || m->A.ndim == 4) && (m->B.ndim == 2 || m->B.ndim == 4));
        FZ_CHECK(m->A.shape[0] == m->rank && m->B.shape[1] == (m->mid.data ? m->mid.shape[0] : m->rank));
        FZ_CHECK(m->A.nbytes == lk_tensor_numel(&m->A) * lk_dtype_size(m->A.dtype));
        FZ_CHECK(m->B.nbytes == lk_tensor_numel(&m->B) * lk_dtype_size(m->B.dtype));
        fz_touch(m->A.data, m->A.nbytes);
        fz_touch(m->B.data, m->B.nbytes);
        /* alpha is the double read, and the scale is formed from it exactly so */
        FZ_CHECK(isfinite(m->alpha));
        FZ_CHECK(m->scale == (lk_adapter_rslora(a) ? m->alpha / sqrt((double)m->rank) : m->alpha / m->rank));
    }
}

/* The pipeline component a module's own key prefix names (text_encoder.,
 * lora_te1_, ...), or LK_COMP_ANY: from its first tensor's key, as the
 * resolver reads it from the key's stem. */
static inline int fz_module_comp(const lk_adapter *a, const lk_lora_module *m) {
    const lk_tensor *ts[LK_MODULE_MAX_TENSORS];
    size_t nts = lk_lora_module_tensors(m, ts);
    const char *key = nts && ts[0]->name ? ts[0]->name : m->module;
    int comp = LK_COMP_ANY;
    (void)lk_layout_strip_module(key, lk_adapter_get_format(a) == LK_FORMAT_KOHYA && !strchr(m->module, '.'), &comp);
    return comp;
}

/* Invariants after a successful resolve. Strict mode: every module has a
 * target, except (by design: resolve.c's skip_foreign) the modules of a
 * pipeline component the base holds none of, beside others that land: those
 * are skipped, counted in n_unmatched and warned about (n_foreign_warned:
 * the skip warnings logged during the resolve). */
static inline void fz_adapter_check_resolved(const lk_adapter *a, int allow, size_t n_unmatched,
                                             size_t n_foreign_warned) {
    size_t n = lk_adapter_count(a), none = 0, landed = 0;
    int comp_landed[LK_COMP_COUNT] = {0}, comp_skipped[LK_COMP_COUNT] = {0};
    for (size_t i = 0; i < n; i++) {
        const lk_lora_module *m = lk_adapter_module(a, i);
        int comp = fz_module_comp(a, m);
        FZ_CHECK(comp >= LK_COMP_ANY && comp < LK_COMP_COUNT);
        if (!m->target) {
            none++;
            comp_skipped[comp] = 1;
            continue;
        }
        landed++;
        comp_landed[comp] = 1;
        const lk_tensor *w = fz_model_find(m->target);
        FZ_CHECK(w != NULL);
        size_t numel = lk_tensor_numel(w);
        if (m->algo == LK_ALGO_LORA) /* the kernel's factors: out x r and r x (elements per row) */
            FZ_CHECK(w->ndim == 2 && m->k[1].shape[0] == w->shape[0] &&
                     (size_t)(m->k[0].shape[1] * w->shape[0]) == numel && m->k[0].shape[0] == m->k[1].shape[1]);
        else if (m->dense.data) /* full, norm, set_weight: the tensor itself */
            FZ_CHECK(lk_tensor_numel(&m->dense) == numel);
        if (m->algo == LK_ALGO_LOHA || m->algo == LK_ALGO_LOKR)
            FZ_CHECK(m->out == w->shape[0] && (size_t)(m->out * m->in) == numel);
        const lk_lora_module *f = lk_adapter_find_target(a, m->target);
        FZ_CHECK(f != NULL && f->target != NULL && !strcmp(f->target, m->target));
    }
    FZ_CHECK(none == n_unmatched);
    if (!allow && none) { /* only foreign components' modules, beside modules that land, each component warned */
        size_t ncomp = 0;
        FZ_CHECK(landed > 0 && !comp_skipped[LK_COMP_ANY]);
        for (int k = LK_COMP_ANY + 1; k < LK_COMP_COUNT; k++) {
            FZ_CHECK(!(comp_skipped[k] && comp_landed[k]));
            ncomp += (size_t)comp_skipped[k];
        }
        FZ_CHECK(n_foreign_warned == ncomp);
    }
    FZ_CHECK(lk_adapter_find_target(a, "\x01no such key") == NULL);
}

/* Counts the warnings that skip a foreign component's modules. */
static inline void fz_count_skips(void *ctx, lk_log_level level, const char *msg) {
    if (level == LK_LOG_WARN && strstr(msg, " are skipped: the base holds no ")) ++*(size_t *)ctx;
}

/* lk_adapter_resolve against the toy model, counting the foreign-component
 * skip warnings it logs (the logger's level and sink restored after). */
static inline lk_status fz_resolve_counting(lk_adapter *a, int allow, size_t *unmatched, size_t *warned) {
    lk_log_level lv = lk_log_get_level();
    lk_log_set_level(LK_LOG_WARN);
    lk_log_set_sink(fz_count_skips, warned);
    lk_status r = lk_adapter_resolve(a, fz_model(), FZ_NMODEL, allow, unmatched);
    lk_log_set_sink(NULL, NULL);
    lk_log_set_level(lv);
    return r;
}

#endif
