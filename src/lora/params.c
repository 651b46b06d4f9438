/* params.c — the adapter parameter set: every LoRA tensor in one contiguous
 * f32 buffer and every gradient in another, ordered by name.
 *
 * One buffer is what makes the gradient sync O(buckets) instead of
 * O(parameters) and lets a rank that skipped a layer contribute exact zeros
 * simply by not touching them after zero_grad. Name order (not registration
 * order) makes the layout identical on every rank whatever order the host
 * registered its layers in. Also here: the seeded counter-based init and the
 * global-norm clipping, both pure functions of the buffer. */
#include "lora/params.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "core/alloc.h"
#include "core/rand.h"
#include "lorakit/alloc.h"
#include "lorakit/comm.h"

void lk_lora_rand_uniform(float *dst, size_t n, uint64_t seed, const char *name, float bound) {
    lk_rand_uniform_at(dst, 0, n, seed, name, bound);
}

void lk_lora_params_free(lk_lora_params *p) {
    if (!p) return;
    if (p->names)
        for (size_t i = 0; i < p->count; i++) lk_free(p->names[i]);
    lk_free(p->names);
    lk_free(p->offset);
    lk_free(p->rows);
    lk_free(p->cols);
    lk_free(p->data);
    lk_free(p->grad);
    lk_free(p);
}

/* Merge sort of indices by name (qsort would need a global for the specs). */
static void sort_idx(size_t *idx, size_t n, const lk_lora_param_spec *s, size_t *tmp) {
    if (n < 2) return;
    size_t h = n / 2;
    sort_idx(idx, h, s, tmp);
    sort_idx(idx + h, n - h, s, tmp);
    size_t i = 0, j = h, k = 0;
    while (i < h && j < n) tmp[k++] = strcmp(s[idx[i]].name, s[idx[j]].name) <= 0 ? idx[i++] : idx[j++];
    while (i < h) tmp[k++] = idx[i++];
    while (j < n) tmp[k++] = idx[j++];
    memcpy(idx, tmp, n * sizeof *idx);
}

lk_status lk_lora_params_create(const lk_lora_param_spec *specs, size_t n, lk_lora_params **out) {
    if (!out) return lk_error(LK_ERR_ARG, "lk_lora_params_create: out is NULL");
    *out = NULL;
    if (n == 0 || !specs) return lk_error(LK_ERR_ARG, "lk_lora_params_create: no parameters");
    for (size_t i = 0; i < n; i++) {
        if (!specs[i].name || !specs[i].name[0])
            return lk_error(LK_ERR_ARG, "LoRA parameter %zu has no name", i);
        if (specs[i].rows <= 0 || specs[i].cols <= 0)
            return lk_error(LK_ERR_SHAPE, "%s: shape %lldx%lld must be positive", specs[i].name,
                            (long long)specs[i].rows, (long long)specs[i].cols);
    }
    lk_lora_params *p = lk_calloc(1, sizeof *p);
    /* the sort's scratch, idx and tmp (n each), from one allocation */
    lk_carve c = {0};
    const size_t o_idx = LK_CARVE(&c, n, size_t), o_tmp = LK_CARVE(&c, n, size_t);
    char *scratch = lk_carve_alloc(&c);
    size_t *idx = scratch ? (size_t *)(void *)(scratch + o_idx) : NULL;
    size_t *tmp = scratch ? (size_t *)(void *)(scratch + o_tmp) : NULL;
    lk_status s = LK_OK;
    if (!p || !scratch) {
        s = lk_error(LK_ERR_NOMEM, "out of memory for %zu LoRA parameters", n);
        goto done;
    }
    p->count = n;
    p->names = lk_calloc(n, sizeof(char *));
    p->offset = lk_calloc(n, sizeof(size_t));
    p->rows = lk_calloc(n, sizeof(int64_t));
    p->cols = lk_calloc(n, sizeof(int64_t));
    if (!p->names || !p->offset || !p->rows || !p->cols) {
        s = lk_error(LK_ERR_NOMEM, "out of memory for %zu LoRA parameters", n);
        goto done;
    }
    for (size_t i = 0; i < n; i++) idx[i] = i;
    sort_idx(idx, n, specs, tmp);
    size_t total = 0;
    for (size_t k = 0; k < n; k++) {
        const lk_lora_param_spec *sp = &specs[idx[k]];
        if (k && !strcmp(sp->name, specs[idx[k - 1]].name)) {
            s = lk_error(LK_ERR_ARG, "duplicate LoRA parameter name '%s'", sp->name);
            goto done;
        }
        size_t numel;
        if ((uint64_t)sp->rows > SIZE_MAX || (uint64_t)sp->cols > SIZE_MAX ||
            !lk_checked_mul((size_t)sp->rows, (size_t)sp->cols, &numel) ||
            !lk_checked_add(total, numel, &total) || total > SIZE_MAX / sizeof(float)) {
            s = lk_error(LK_ERR_SHAPE, "%s: LoRA parameters too large", sp->name);
            goto done;
        }
        p->names[k] = lk_strdup(sp->name);
        if (!p->names[k]) {
            s = lk_error(LK_ERR_NOMEM, "out of memory");
            goto done;
        }
        p->offset[k] = total - numel;
        p->rows[k] = sp->rows;
        p->cols[k] = sp->cols;
    }
    p->numel = total;
    p->data = lk_calloc(total, sizeof(float));
    p->grad = lk_calloc(total, sizeof(float));
    if (!p->data || !p->grad) {
        s = lk_error(LK_ERR_NOMEM, "out of memory for %zu LoRA parameter floats", total);
        goto done;
    }
done:
    lk_free(scratch);
    if (s != LK_OK) {
        lk_lora_params_free(p);
        return s;
    }
    *out = p;
    return LK_OK;
}

size_t lk_lora_params_count(const lk_lora_params *p) { return p ? p->count : 0; }
size_t lk_lora_params_numel(const lk_lora_params *p) { return p ? p->numel : 0; }
float *lk_lora_params_data(lk_lora_params *p) { return p ? p->data : NULL; }
float *lk_lora_params_grad(lk_lora_params *p) { return p ? p->grad : NULL; }
const char *lk_lora_params_name(const lk_lora_params *p, size_t i) {
    return p && i < p->count ? p->names[i] : NULL;
}
size_t lk_lora_params_offset(const lk_lora_params *p, size_t i) {
    return p && i < p->count ? p->offset[i] : 0;
}
void lk_lora_params_shape(const lk_lora_params *p, size_t i, int64_t *rows, int64_t *cols) {
    int ok = p && i < p->count;
    if (rows) *rows = ok ? p->rows[i] : 0;
    if (cols) *cols = ok ? p->cols[i] : 0;
}

long lk_lora_params_find(const lk_lora_params *p, const char *name) {
    if (!p || !name) return -1;
    size_t lo = 0, hi = p->count;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(p->names[mid], name);
        if (c == 0) return (long)mid;
        if (c < 0) lo = mid + 1;
        else hi = mid;
    }
    return -1;
}

void lk_lora_params_zero_grad(lk_lora_params *p) {
    if (p && p->grad) memset(p->grad, 0, p->numel * sizeof(float));
}

uint64_t lk_lora_params_layout_hash(const lk_lora_params *p) {
    /* Chained: each name and shape hashed with the previous hash as seed. */
    uint64_t h = 0x6c6f72616b6974ull;
    for (size_t i = 0; i < p->count; i++) {
        int64_t sh[2] = {p->rows[i], p->cols[i]};
        h = XXH3_64bits_withSeed(p->names[i], strlen(p->names[i]) + 1, h);
        h = XXH3_64bits_withSeed(sh, sizeof sh, h);
    }
    return h;
}

lk_status lk_lora_clip_grad_norm(lk_lora_params *p, float max_norm, float *norm) {
    if (!p) return lk_error(LK_ERR_ARG, "lk_lora_clip_grad_norm: no parameters");
    double ss = 0.0;
    for (size_t i = 0; i < p->numel; i++) ss += (double)p->grad[i] * (double)p->grad[i];
    double nrm = sqrt(ss);
    if (norm) *norm = (float)nrm;
    if (!isfinite(nrm)) {
        /* name the first non-finite parameter, to make the failure actionable */
        for (size_t k = 0; k < p->count; k++) {
            size_t numel = (size_t)p->rows[k] * (size_t)p->cols[k];
            for (size_t i = 0; i < numel; i++)
                if (!isfinite(p->grad[p->offset[k] + i]))
                    return lk_error(LK_ERR_NONFINITE, "%s: gradient element %zu is not finite",
                                    p->names[k], i);
        }
        return lk_error(LK_ERR_NONFINITE, "the LoRA gradient norm overflowed");
    }
    if (max_norm > 0.0f) {
        float coef = (float)(max_norm / (nrm + 1e-6));
        if (coef < 1.0f)
            for (size_t i = 0; i < p->numel; i++) p->grad[i] *= coef;
    }
    return LK_OK;
}
