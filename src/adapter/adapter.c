/* adapter.c — opening a LoRA adapter: format detection, pairing of the
 * factors per module, rank / alpha / scale, and every check that can be made
 * without the model (resolve.c does the rest against the model's keys).
 *
 * Each key is classified by its suffix into a family (PEFT/diffusers
 * ".lora_A.weight", kohya ".lora_down.weight", FastVideo ".lora_A") and a
 * role (A, B, alpha); keys are then sorted by stem so that pairing is
 * independent of the order in the file, and every key must find its place:
 * an unknown key, a lone factor, a duplicate or a mix of families is an
 * error naming the key, never silently skipped. Once paired, the factors
 * are copied out of the file into one allocation with pread (lk_st_read),
 * never read through the mmap: adapters are small next to the model, and a
 * file that another process truncates or rewrites later can then no longer
 * crash a fuse or a serving rank with SIGBUS (a change during the copy is
 * LK_ERR_IO). */
#include "lorakit/adapter.h"
#include "core/file.h"
#include "lorakit/alloc.h"
#include "lorakit/log.h"
#include "lorakit/safetensors.h"
#include "adapter/adapter_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "adapter/adapter_struct.h"

static const char *const g_fmt_names[LK_FORMAT_COUNT] = {"auto", "peft", "diffusers", "kohya", "fastvideo"};

const char *lk_adapter_format_name(lk_adapter_format f) {
    if ((int)f < 0 || f >= LK_FORMAT_COUNT) return "unknown";
    return g_fmt_names[f];
}

lk_status lk_adapter_format_parse(const char *name, lk_adapter_format *out) {
    for (int i = 0; i < LK_FORMAT_COUNT; i++)
        if (name && !strcmp(name, g_fmt_names[i])) {
            *out = (lk_adapter_format)i;
            return LK_OK;
        }
    return lk_error(LK_ERR_ARG, "unknown adapter format '%s' (valid: auto, peft, diffusers, kohya, fastvideo)",
                    name ? name : "(null)");
}

/* ---- key classification ---- */

enum family { FAM_NONE = 0, FAM_AB, FAM_KOHYA, FAM_FV };
enum role { ROLE_A = 0, ROLE_B = 1, ROLE_ALPHA = 2 };

static const char *const g_fam_names[] = {"unknown", "PEFT/diffusers", "kohya", "FastVideo"};

static const struct {
    const char *suffix;
    enum family fam;
    enum role role;
} g_suffixes[] = {
    {".lora_A.default.weight", FAM_AB, ROLE_A}, {".lora_B.default.weight", FAM_AB, ROLE_B},
    {".lora_A.weight", FAM_AB, ROLE_A},         {".lora_B.weight", FAM_AB, ROLE_B},
    {".lora_down.weight", FAM_KOHYA, ROLE_A},   {".lora_up.weight", FAM_KOHYA, ROLE_B},
    {".lora_A", FAM_FV, ROLE_A},                {".lora_B", FAM_FV, ROLE_B},
};

static int is_kohya_name(const char *k) { return !strncmp(k, "lora_unet_", 10) || !strncmp(k, "lora_te", 7); }

/* Family and role of a key; stem_len is the length of its module part. */
static enum family classify(const char *k, enum role *role, size_t *stem_len) {
    size_t n = strlen(k);
    for (size_t i = 0; i < sizeof g_suffixes / sizeof g_suffixes[0]; i++) {
        size_t sl = strlen(g_suffixes[i].suffix);
        if (n > sl && !strcmp(k + n - sl, g_suffixes[i].suffix)) {
            *role = g_suffixes[i].role;
            *stem_len = n - sl;
            return g_suffixes[i].fam;
        }
    }
    if (n > 6 && !strcmp(k + n - 6, ".alpha")) {
        *role = ROLE_ALPHA;
        *stem_len = n - 6;
        return is_kohya_name(k) ? FAM_KOHYA : FAM_AB;
    }
    return FAM_NONE;
}

static enum family family_of(lk_adapter_format f) {
    switch (f) {
    case LK_FORMAT_PEFT:
    case LK_FORMAT_DIFFUSERS: return FAM_AB;
    case LK_FORMAT_KOHYA: return FAM_KOHYA;
    case LK_FORMAT_FASTVIDEO: return FAM_FV;
    default: return FAM_NONE;
    }
}

int lk_adapter_looks_like(const char *path) {
    struct stat sb;
    if (!path || stat(path, &sb) != 0) return 0;
    if (S_ISDIR(sb.st_mode)) return 1;
    lk_st *st;
    if (lk_st_open(path, &st) != LK_OK) return 0;
    int found = 0, other = 0;
    for (size_t i = 0; i < lk_st_count(st) && !other; i++) {
        enum role r;
        size_t sl;
        enum family f = classify(lk_st_tensor(st, i)->name, &r, &sl);
        other = f == FAM_NONE;
        found |= f != FAM_NONE && r != ROLE_ALPHA;
    }
    lk_st_close(st);
    return found && !other;
}

/* ---- small accessors ---- */

const char *lk_adapter_path(const lk_adapter *a) { return a ? a->path : NULL; }
lk_adapter_format lk_adapter_get_format(const lk_adapter *a) { return a ? a->format : LK_FORMAT_AUTO; }
size_t lk_adapter_count(const lk_adapter *a) { return a ? a->n : 0; }
const lk_lora_module *lk_adapter_module(const lk_adapter *a, size_t i) {
    return a && i < a->n ? &a->mods[i] : NULL;
}
int lk_adapter_rslora(const lk_adapter *a) { return a ? a->rslora : 0; }
int lk_adapter_has_config(const lk_adapter *a) { return a ? a->has_config : 0; }
size_t lk_adapter_untargeted(const lk_adapter *a) { return a ? a->n_untargeted : 0; }
const char *lk_adapter_file(const lk_adapter *a) { return a ? a->file : NULL; }

void lk_adapter_free(lk_adapter *a) {
    if (!a) return;
    for (size_t i = 0; i < a->n; i++) {
        lk_free(a->names[i]);
        lk_free(a->stems[i]);
        lk_free(a->targets[i]);
    }
    lk_free(a->names);
    lk_free(a->stems);
    lk_free(a->targets);
    lk_free(a->mods);
    lk_free(a->by_target);
    lk_peft_config_free(&a->cfg);
    lk_free(a->factors);
    lk_st_close(a->st);
    lk_free(a->file);
    lk_free(a->path);
    lk_free(a);
}

/* ---- opening ---- */

typedef struct keyinfo {
    const lk_tensor *t;
    size_t stem_len;
    enum role role;
} keyinfo;

static int key_cmp(const void *pa, const void *pb) {
    const keyinfo *a = pa, *b = pb;
    size_t n = a->stem_len < b->stem_len ? a->stem_len : b->stem_len;
    int c = memcmp(a->t->name, b->t->name, n);
    if (c) return c;
    if (a->stem_len != b->stem_len) return a->stem_len < b->stem_len ? -1 : 1;
    return (int)a->role - (int)b->role;
}

static int file_exists(const char *p) {
    struct stat sb;
    return p && stat(p, &sb) == 0 && S_ISREG(sb.st_mode);
}

/* Finds the safetensors file (and config) of a path. */
static lk_status locate(lk_adapter *a) {
    struct stat sb;
    if (stat(a->path, &sb) != 0) return lk_error(LK_ERR_IO, "%s: no such file or directory", a->path);
    if (!S_ISDIR(sb.st_mode)) {
        a->file = lk_strdup(a->path);
        return a->file ? LK_OK : lk_error(LK_ERR_NOMEM, "%s: out of memory", a->path);
    }
    static const char *const names[] = {"adapter_model.safetensors", "pytorch_lora_weights.safetensors"};
    for (size_t i = 0; i < 2; i++) {
        char *p = lk_path_join(a->path, names[i]);
        if (!p) return lk_error(LK_ERR_NOMEM, "%s: out of memory", a->path);
        if (file_exists(p)) {
            a->file = p;
            break;
        }
        lk_free(p);
    }
    if (!a->file) {
        char *bin = lk_path_join(a->path, "adapter_model.bin");
        int has_bin = file_exists(bin);
        lk_free(bin);
        if (has_bin)
            return lk_error(LK_ERR_UNSUPPORTED,
                            "%s: adapter_model.bin (pickle) is not supported; save the adapter as safetensors",
                            a->path);
        return lk_error(LK_ERR_IO, "%s: folder has no adapter_model.safetensors", a->path);
    }
    char *cfg = lk_path_join(a->path, "adapter_config.json");
    if (!cfg) return lk_error(LK_ERR_NOMEM, "%s: out of memory", a->path);
    lk_status s = LK_OK;
    if (file_exists(cfg)) {
        s = lk_peft_config_load(cfg, &a->cfg);
        if (!s) a->has_config = 1;
    }
    lk_free(cfg);
    return s;
}

/* The format from the families present; keys of no family are errors. */
static lk_status detect(lk_adapter *a, const keyinfo *ki, const enum family *fam, size_t n,
                        lk_adapter_format forced) {
    const char *f = a->file;
    size_t first[4] = {SIZE_MAX, SIZE_MAX, SIZE_MAX, SIZE_MAX};
    for (size_t i = 0; i < n; i++)
        if (first[fam[i]] == SIZE_MAX) first[fam[i]] = i;
    if (forced != LK_FORMAT_AUTO) {
        enum family want = family_of(forced);
        for (size_t i = 0; i < n; i++)
            if (fam[i] != want)
                return lk_error(LK_ERR_FORMAT, "%s: key '%s' is not a %s adapter key", f, ki[i].t->name,
                                lk_adapter_format_name(forced));
        if (n == 0) return lk_error(LK_ERR_FORMAT, "%s: no tensors: not a LoRA adapter", f);
        a->format = forced;
        return LK_OK;
    }
    if (first[FAM_NONE] != SIZE_MAX)
        return lk_error(LK_ERR_FORMAT,
                        "%s: key '%s' is not a LoRA factor or alpha (expected lora_A/lora_B, lora_down/lora_up)", f,
                        ki[first[FAM_NONE]].t->name);
    enum family found = FAM_NONE;
    for (int k = FAM_AB; k <= FAM_FV; k++) {
        if (first[k] == SIZE_MAX) continue;
        if (found != FAM_NONE)
            return lk_error(LK_ERR_FORMAT, "%s: mixes %s keys ('%s') and %s keys ('%s')", f, g_fam_names[found],
                            ki[first[found]].t->name, g_fam_names[k], ki[first[k]].t->name);
        found = (enum family)k;
    }
    if (found == FAM_NONE) return lk_error(LK_ERR_FORMAT, "%s: no LoRA keys: not an adapter", f);
    if (found == FAM_KOHYA) a->format = LK_FORMAT_KOHYA;
    else if (found == FAM_FV) a->format = LK_FORMAT_FASTVIDEO;
    else {
        int all_peft = 1;
        for (size_t i = 0; i < n && all_peft; i++)
            if (ki[i].role != ROLE_ALPHA) all_peft = !strncmp(ki[i].t->name, "base_model.model.", 17);
        a->format = (a->has_config || all_peft) ? LK_FORMAT_PEFT : LK_FORMAT_DIFFUSERS;
    }
    return LK_OK;
}

/* The module name for a stem in the adapter's format. */
static char *module_name(lk_adapter_format f, const char *stem, size_t len) {
    static const char *const peft_pre[] = {"base_model.model."};
    static const char *const diff_pre[] = {"transformer.", "unet.", "diffusion_model."};
    const char *const *pre = NULL;
    size_t npre = 0;
    if (f == LK_FORMAT_PEFT) pre = peft_pre, npre = 1;
    if (f == LK_FORMAT_DIFFUSERS) pre = diff_pre, npre = 3;
    for (size_t i = 0; i < npre; i++) {
        size_t pl = strlen(pre[i]);
        if (len > pl && !strncmp(stem, pre[i], pl)) {
            stem += pl;
            len -= pl;
            break;
        }
    }
    char *m = lk_malloc(len + 1);
    if (m) {
        memcpy(m, stem, len);
        m[len] = '\0';
    }
    return m;
}

/* Index of tensor t (a view returned by lk_st_tensor) in st. */
static size_t st_index(const lk_st *st, const lk_tensor *t) { return (size_t)lk_st_find(st, t->name); }

static lk_status read_alpha(const lk_adapter *a, const lk_tensor *t, double *out) {
    const char *file = a->file;
    if (lk_tensor_numel(t) != 1)
        return lk_error(LK_ERR_SHAPE, "%s: %s: alpha must hold one value, not %zu", file, t->name, lk_tensor_numel(t));
    double v;
    unsigned char raw[8] = {0}; /* one element of at most 8 bytes (numel is 1) */
    if (t->nbytes > sizeof raw)
        return lk_error(LK_ERR_DTYPE, "%s: %s: alpha has dtype %s; expected a float", file, t->name,
                        lk_dtype_name(t->dtype));
    lk_status s = lk_st_read(a->st, st_index(a->st, t), 0, raw, t->nbytes);
    if (s) return s;
    if (t->dtype == LK_DTYPE_F64) {
        memcpy(&v, raw, 8);
    } else if (lk_dtype_is_fusable(t->dtype)) {
        float f;
        lk_to_f32(&f, raw, t->dtype, 1);
        v = f;
    } else {
        return lk_error(LK_ERR_DTYPE, "%s: %s: alpha has dtype %s; expected a float", file, t->name,
                        lk_dtype_name(t->dtype));
    }
    if (!isfinite(v)) return lk_error(LK_ERR_NONFINITE, "%s: %s: alpha is %g", file, t->name, v);
    *out = v;
    return LK_OK;
}

static lk_status check_factor(const char *file, const char *m, const lk_tensor *t, const char *role) {
    if (!lk_dtype_is_fusable(t->dtype))
        return lk_error(LK_ERR_DTYPE, "%s: %s: %s has dtype %s; LoRA factors must be F32, F16 or BF16", file, m,
                        role, lk_dtype_name(t->dtype));
    if (t->ndim == 4)
        return lk_error(LK_ERR_UNSUPPORTED, "%s: %s: %s is 4-D (a convolution LoRA); only linear layers are supported",
                        file, m, role);
    if (t->ndim != 2) return lk_error(LK_ERR_SHAPE, "%s: %s: %s has %d dimensions, expected 2", file, m, role, t->ndim);
    return LK_OK;
}

/* Fills module i from its A, B and optional alpha tensors. */
static lk_status build_module(lk_adapter *a, size_t i, const lk_tensor *A, const lk_tensor *B,
                              const lk_tensor *alpha_t) {
    const char *f = a->file, *m = a->names[i];
    const char *an = lk_adapter_factor_name(a, 0), *bn = lk_adapter_factor_name(a, 1);
    lk_status s;
    if ((s = check_factor(f, m, A, an)) || (s = check_factor(f, m, B, bn))) return s;
    int64_t r = A->shape[0];
    if (r <= 0 || A->shape[1] <= 0 || B->shape[0] <= 0)
        return lk_error(LK_ERR_SHAPE, "%s: %s: %s is %lldx%lld and %s is %lldx%lld: rank must be > 0", f, m, an,
                        (long long)A->shape[0], (long long)A->shape[1], bn, (long long)B->shape[0],
                        (long long)B->shape[1]);
    if (B->shape[1] != r)
        return lk_error(LK_ERR_SHAPE, "%s: %s: %s is %lldx%lld but %s is %lldx%lld (ranks differ)", f, m, an,
                        (long long)A->shape[0], (long long)A->shape[1], bn, (long long)B->shape[0],
                        (long long)B->shape[1]);
    double alpha = (double)r;
    if (a->format == LK_FORMAT_PEFT && a->has_config) {
        const lk_pattern *rp = lk_peft_pattern_find(a->cfg.rank_pat, a->cfg.n_rank_pat, m);
        long want = rp ? (long)rp->value : a->cfg.r;
        if (want != r) {
            if (rp)
                return lk_error(LK_ERR_SHAPE, "%s: %s: %s has rank %lld but adapter_config.json says %ld (rank_pattern \"%s\")",
                                f, m, an, (long long)r, want, rp->key);
            return lk_error(LK_ERR_SHAPE, "%s: %s: %s has rank %lld but adapter_config.json says r = %ld", f, m, an,
                            (long long)r, want);
        }
        const lk_pattern *ap = lk_peft_pattern_find(a->cfg.alpha_pat, a->cfg.n_alpha_pat, m);
        alpha = ap ? ap->value : a->cfg.alpha;
        if (!lk_peft_targets(&a->cfg, m)) a->n_untargeted++;
    }
    if (alpha_t && (s = read_alpha(a, alpha_t, &alpha))) return s;
    double scale = a->rslora ? alpha / sqrt((double)r) : alpha / (double)r;
    if (!isfinite((float)scale))
        return lk_error(LK_ERR_NONFINITE, "%s: %s: scale alpha/%s = %g is not finite as a float", f, m,
                        a->rslora ? "sqrt(r)" : "r", scale);
    lk_lora_module *mod = &a->mods[i];
    mod->module = m;
    mod->target = NULL;
    mod->rank = (int)r;
    mod->alpha = (float)alpha;
    mod->scale = (float)scale;
    mod->A = *A;
    mod->B = *B;
    return LK_OK;
}

static int name_cmp_idx(const void *pa, const void *pb, void *ctx) {
    char **names = ctx;
    return strcmp(names[*(const size_t *)pa], names[*(const size_t *)pb]);
}

/* Pairs the sorted keys into modules. */
static lk_status pair(lk_adapter *a, keyinfo *ki, size_t n) {
    const char *f = a->file;
    const char *rn[3] = {lk_adapter_factor_name(a, 0), lk_adapter_factor_name(a, 1), "alpha"};
    size_t cap = n / 2 + 1;
    a->mods = lk_calloc(cap, sizeof *a->mods);
    a->names = lk_calloc(cap, sizeof *a->names);
    a->stems = lk_calloc(cap, sizeof *a->stems);
    a->targets = lk_calloc(cap, sizeof *a->targets);
    if (!a->mods || !a->names || !a->stems || !a->targets) return lk_error(LK_ERR_NOMEM, "%s: out of memory", f);
    for (size_t i = 0; i < n;) {
        size_t j = i;
        const lk_tensor *by_role[3] = {NULL, NULL, NULL};
        for (; j < n && ki[j].stem_len == ki[i].stem_len && !memcmp(ki[j].t->name, ki[i].t->name, ki[i].stem_len);
             j++) {
            if (by_role[ki[j].role])
                return lk_error(LK_ERR_FORMAT, "%s: '%s' and '%s' are both the %s of one module", f,
                                by_role[ki[j].role]->name, ki[j].t->name, rn[ki[j].role]);
            by_role[ki[j].role] = ki[j].t;
        }
        size_t k = a->n;
        char *stem = lk_malloc(ki[i].stem_len + 1);
        if (!stem) return lk_error(LK_ERR_NOMEM, "%s: out of memory", f);
        memcpy(stem, ki[i].t->name, ki[i].stem_len);
        stem[ki[i].stem_len] = '\0';
        a->stems[k] = stem;
        a->names[k] = module_name(a->format, stem, ki[i].stem_len);
        a->n = k + 1; /* owned strings are freed from here on */
        if (!a->names[k]) return lk_error(LK_ERR_NOMEM, "%s: out of memory", f);
        if (!by_role[ROLE_A] || !by_role[ROLE_B]) {
            if (!by_role[ROLE_A] && !by_role[ROLE_B])
                return lk_error(LK_ERR_FORMAT, "%s: %s: alpha without %s and %s", f, a->names[k], rn[0], rn[1]);
            return lk_error(LK_ERR_FORMAT, "%s: %s: %s without %s", f, a->names[k],
                            by_role[ROLE_A] ? rn[0] : rn[1], by_role[ROLE_A] ? rn[1] : rn[0]);
        }
        if (a->format == LK_FORMAT_PEFT && by_role[ROLE_ALPHA])
            return lk_error(LK_ERR_FORMAT, "%s: %s: PEFT adapters keep alpha in adapter_config.json, not in '%s'", f,
                            a->names[k], by_role[ROLE_ALPHA]->name);
        lk_status s = build_module(a, k, by_role[ROLE_A], by_role[ROLE_B], by_role[ROLE_ALPHA]);
        if (s) return s;
        i = j;
    }
    /* Two stems giving one module name (e.g. "transformer.x" and "x"). */
    size_t *ord = lk_malloc((a->n ? a->n : 1) * sizeof *ord);
    if (!ord) return lk_error(LK_ERR_NOMEM, "%s: out of memory", f);
    for (size_t i = 0; i < a->n; i++) ord[i] = i;
    qsort_r(ord, a->n, sizeof *ord, name_cmp_idx, a->names);
    lk_status s = LK_OK;
    for (size_t i = 1; i < a->n && !s; i++)
        if (!strcmp(a->names[ord[i]], a->names[ord[i - 1]]))
            s = lk_error(LK_ERR_FORMAT, "%s: '%s' and '%s' are the same module %s", f, a->stems[ord[i - 1]],
                         a->stems[ord[i]], a->names[ord[i]]);
    lk_free(ord);
    return s;
}

/* Copies every module's A and B out of the file into a->factors (one
 * allocation, each factor 16-byte aligned) and points the modules at it. */
static lk_status copy_factors(lk_adapter *a) {
    size_t total = 0;
    for (size_t i = 0; i < a->n; i++) {
        const lk_tensor *t2[2] = {&a->mods[i].A, &a->mods[i].B};
        for (int k = 0; k < 2; k++) {
            size_t nb = t2[k]->nbytes;
            if (!lk_checked_add(nb, 15, &nb) || !lk_checked_add(total, nb & ~(size_t)15, &total))
                return lk_error(LK_ERR_NOMEM, "%s: the factors' size overflows", a->file);
        }
    }
    a->factors = lk_malloc(total ? total : 1);
    if (!a->factors) return lk_error(LK_ERR_NOMEM, "%s: out of memory for %zu bytes of LoRA factors", a->file, total);
    unsigned char *p = a->factors;
    for (size_t i = 0; i < a->n; i++) {
        lk_tensor *t2[2] = {&a->mods[i].A, &a->mods[i].B};
        for (int k = 0; k < 2; k++) {
            lk_status s = lk_st_read(a->st, st_index(a->st, t2[k]), 0, p, t2[k]->nbytes);
            if (s) return s;
            t2[k]->data = p;
            p += (t2[k]->nbytes + 15) & ~(size_t)15;
        }
    }
    return LK_OK;
}

lk_status lk_adapter_open(const char *path, lk_adapter_format format, lk_adapter **out) {
    if (!path || !out) return lk_error(LK_ERR_ARG, "lk_adapter_open: NULL argument");
    if ((int)format < 0 || format >= LK_FORMAT_COUNT)
        return lk_error(LK_ERR_ARG, "%s: invalid adapter format %d", path, (int)format);
    lk_adapter *a = lk_calloc(1, sizeof *a);
    if (!a) return lk_error(LK_ERR_NOMEM, "%s: out of memory", path);
    keyinfo *ki = NULL;
    enum family *fam = NULL;
    lk_status s = LK_OK;
    if (!(a->path = lk_strdup(path))) {
        s = lk_error(LK_ERR_NOMEM, "%s: out of memory", path);
        goto fail;
    }
    if ((s = locate(a))) goto fail;
    if ((s = lk_st_open(a->file, &a->st))) goto fail;
    size_t n = lk_st_count(a->st);
    ki = lk_malloc((n ? n : 1) * sizeof *ki);
    fam = lk_malloc((n ? n : 1) * sizeof *fam);
    if (!ki || !fam) {
        s = lk_error(LK_ERR_NOMEM, "%s: out of memory", a->file);
        goto fail;
    }
    for (size_t i = 0; i < n; i++) {
        ki[i].t = lk_st_tensor(a->st, i);
        fam[i] = classify(ki[i].t->name, &ki[i].role, &ki[i].stem_len);
    }
    if ((s = detect(a, ki, fam, n, format))) goto fail;
    if (a->has_config && a->format != LK_FORMAT_PEFT) {
        lk_log(LK_LOG_WARN, "%s: adapter_config.json ignored: the adapter is read as %s", a->path,
               lk_adapter_format_name(a->format));
        lk_peft_config_free(&a->cfg);
        a->has_config = 0;
    }
    a->rslora = a->has_config && a->cfg.rslora;
    qsort(ki, n, sizeof *ki, key_cmp);
    if ((s = pair(a, ki, n))) goto fail;
    if ((s = copy_factors(a))) goto fail;
    if (a->n_untargeted)
        lk_log(LK_LOG_WARN, "%s: %zu of %zu modules are not covered by target_modules in adapter_config.json",
               a->path, a->n_untargeted, a->n);
    lk_free(ki);
    lk_free(fam);
    *out = a;
    return LK_OK;
fail:
    lk_free(ki);
    lk_free(fam);
    lk_adapter_free(a);
    return s;
}
