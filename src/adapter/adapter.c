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
#include "core/alloc.h"
#include "core/file.h"
#include "core/msg.h"
#include "lorakit/alloc.h"
#include "lorakit/log.h"
#include "lorakit/safetensors.h"
#include "adapter/config.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "adapter/adapter.h"

static const char *const g_fmt_names[LK_FORMAT_COUNT] = {"auto", "peft", "diffusers", "kohya", "fastvideo"};

const char *lk_adapter_format_name(lk_adapter_format f) {
    if ((int)f < 0 || f >= LK_FORMAT_COUNT) return "unknown";
    return g_fmt_names[f];
}

/* Index of name in tab[0..n), or -1. */
static int name_index(const char *const *tab, int n, const char *name) {
    for (int i = 0; i < n && name; i++)
        if (!strcmp(name, tab[i])) return i;
    return -1;
}

lk_status lk_adapter_format_parse(const char *name, lk_adapter_format *out) {
    int i = name_index(g_fmt_names, LK_FORMAT_COUNT, name);
    if (i < 0)
        return lk_error(LK_ERR_ARG, "unknown adapter format '%s' (valid: auto, peft, diffusers, kohya, fastvideo)",
                        name ? name : "(null)");
    *out = (lk_adapter_format)i;
    return LK_OK;
}

static const char *const g_alpha_names[LK_ALPHA_COUNT] = {"auto", "tensors", "metadata"};

const char *lk_alpha_from_name(lk_alpha_from a) {
    if ((int)a < 0 || a >= LK_ALPHA_COUNT) return "unknown";
    return g_alpha_names[a];
}

lk_status lk_alpha_from_parse(const char *name, lk_alpha_from *out) {
    int i = name_index(g_alpha_names, LK_ALPHA_COUNT, name);
    if (i < 0)
        return lk_error(LK_ERR_ARG, "unknown alpha source '%s' (valid: tensors, metadata, auto)", name ? name : "(null)");
    *out = (lk_alpha_from)i;
    return LK_OK;
}

static const char *const g_conv_names[LK_CONVENTION_COUNT] = {"lorakit", "comfyui", "lycoris", "peft"};

const char *lk_convention_name(lk_convention c) {
    if ((int)c < 0 || c >= LK_CONVENTION_COUNT) return "unknown";
    return g_conv_names[c];
}

lk_status lk_convention_parse(const char *name, lk_convention *out) {
    int i = name_index(g_conv_names, LK_CONVENTION_COUNT, name);
    if (i < 0)
        return lk_error(LK_ERR_ARG, "unknown convention '%s' (valid: lorakit, comfyui, lycoris, peft)",
                        name ? name : "(null)");
    *out = (lk_convention)i;
    return LK_OK;
}

/* ---- key classification ---- */

enum family { FAM_NONE = 0, FAM_AB, FAM_KOHYA, FAM_FV, FAM_ALPHA, FAM_ANY };
enum role {
    ROLE_A = 0, ROLE_B, ROLE_ALPHA, ROLE_MAG, ROLE_BBIAS,
    ROLE_MID,                                        /* LoCon Tucker core */
    ROLE_HW1A, ROLE_HW1B, ROLE_HW2A, ROLE_HW2B, ROLE_HT1, ROLE_HT2, /* LoHa */
    ROLE_KW1, ROLE_KW1A, ROLE_KW1B, ROLE_KW2, ROLE_KW2A, ROLE_KW2B, ROLE_KT2, /* LoKr */
    ROLE_DIFF, ROLE_DIFFB, ROLE_SETW, ROLE_WNORM, ROLE_BNORM, ROLE_DORA,
    ROLE_OFTB, ROLE_RESC,                            /* OFT / BOFT */
    ROLE_OFTR, ROLE_BOFTR, ROLE_BOFTS,               /* PEFT's OFT, BOFT */
    ROLE_GA1, ROLE_GA2, ROLE_GB1, ROLE_GB2,          /* GLoRA */
    ROLE_COUNT
};

static const char *const g_fam_names[] = {"unknown", "PEFT/diffusers", "kohya", "FastVideo", "alpha", "any"};

/* Keys of the LyCORIS / dense algorithms carry no naming family of their
 * own (FAM_ANY): a file's family comes from its LoRA keys, or its names. */
static const struct {
    const char *suffix;
    enum family fam;
    enum role role;
} g_suffixes[] = {
    {".lora_A.default.weight", FAM_AB, ROLE_A}, {".lora_B.default.weight", FAM_AB, ROLE_B},
    {".lora_A.weight", FAM_AB, ROLE_A},         {".lora_B.weight", FAM_AB, ROLE_B},
    {".lora_embedding_A", FAM_AB, ROLE_A},      {".lora_embedding_B", FAM_AB, ROLE_B},
    {".lora_B.default.bias", FAM_AB, ROLE_BBIAS}, {".lora_B.bias", FAM_AB, ROLE_BBIAS},
    {".lora_magnitude_vector.default.weight", FAM_AB, ROLE_MAG}, {".lora_magnitude_vector.default", FAM_AB, ROLE_MAG},
    {".lora_magnitude_vector.weight", FAM_AB, ROLE_MAG}, {".lora_magnitude_vector", FAM_AB, ROLE_MAG},
    {".lora_down.weight", FAM_KOHYA, ROLE_A},   {".lora_up.weight", FAM_KOHYA, ROLE_B},
    /* diffusers' own training scripts (attention processors, LoRALinearLayer) */
    {".lora.down.weight", FAM_AB, ROLE_A},      {".lora.up.weight", FAM_AB, ROLE_B},
    {".lora_linear_layer.down.weight", FAM_AB, ROLE_A}, {".lora_linear_layer.up.weight", FAM_AB, ROLE_B},
    {".lora_mid.weight", FAM_ANY, ROLE_MID},
    {".lora_A", FAM_FV, ROLE_A},                {".lora_B", FAM_FV, ROLE_B},
    {".hada_w1_a", FAM_ANY, ROLE_HW1A}, {".hada_w1_b", FAM_ANY, ROLE_HW1B}, {".hada_w2_a", FAM_ANY, ROLE_HW2A},
    {".hada_w2_b", FAM_ANY, ROLE_HW2B}, {".hada_t1", FAM_ANY, ROLE_HT1},    {".hada_t2", FAM_ANY, ROLE_HT2},
    {".lokr_w1", FAM_ANY, ROLE_KW1},    {".lokr_w1_a", FAM_ANY, ROLE_KW1A}, {".lokr_w1_b", FAM_ANY, ROLE_KW1B},
    {".lokr_w2", FAM_ANY, ROLE_KW2},    {".lokr_w2_a", FAM_ANY, ROLE_KW2A}, {".lokr_w2_b", FAM_ANY, ROLE_KW2B},
    {".lokr_t2", FAM_ANY, ROLE_KT2},
    {".diff", FAM_ANY, ROLE_DIFF},      {".diff_b", FAM_ANY, ROLE_DIFFB},   {".set_weight", FAM_ANY, ROLE_SETW},
    {".w_norm", FAM_ANY, ROLE_WNORM},   {".b_norm", FAM_ANY, ROLE_BNORM},   {".dora_scale", FAM_ANY, ROLE_DORA},
    {".oft_blocks", FAM_ANY, ROLE_OFTB}, {".rescale", FAM_ANY, ROLE_RESC},
    {".oft_R.weight", FAM_AB, ROLE_OFTR}, {".boft_R", FAM_AB, ROLE_BOFTR}, {".boft_s", FAM_AB, ROLE_BOFTS},
    {".a1.weight", FAM_ANY, ROLE_GA1},  {".a2.weight", FAM_ANY, ROLE_GA2},  {".b1.weight", FAM_ANY, ROLE_GB1},
    {".b2.weight", FAM_ANY, ROLE_GB2},
};

/* diffusers' old attention processors (LoRAAttnProcessor):
 * "<attn>.processor.to_q_lora.down.weight", stem "<attn>.processor.to_q"
 * (the suffix's first `keep` bytes stay in the stem); old_attn_module names
 * the module. */
static const struct {
    const char *suffix;
    enum role role;
    size_t keep;
} g_old_attn[] = {
    {".to_q_lora.down.weight", ROLE_A, 5},   {".to_q_lora.up.weight", ROLE_B, 5},
    {".to_k_lora.down.weight", ROLE_A, 5},   {".to_k_lora.up.weight", ROLE_B, 5},
    {".to_v_lora.down.weight", ROLE_A, 5},   {".to_v_lora.up.weight", ROLE_B, 5},
    {".to_out_lora.down.weight", ROLE_A, 7}, {".to_out_lora.up.weight", ROLE_B, 7},
    /* USO's Flux LoRA (ComfyUI's convert_uso_lora): "<block>.processor.qkv_lora1.down.weight", the stem keeps its
     * own name (data/families/flux.lkmap places it) */
    {".qkv_lora1.down.weight", ROLE_A, 10},  {".qkv_lora1.up.weight", ROLE_B, 10},
    {".qkv_lora2.down.weight", ROLE_A, 10},  {".qkv_lora2.up.weight", ROLE_B, 10},
    {".proj_lora1.down.weight", ROLE_A, 11}, {".proj_lora1.up.weight", ROLE_B, 11},
    {".proj_lora2.down.weight", ROLE_A, 11}, {".proj_lora2.up.weight", ROLE_B, 11},
    {".qkv_lora.down.weight", ROLE_A, 9},    {".qkv_lora.up.weight", ROLE_B, 9},
    {".proj_lora.down.weight", ROLE_A, 10},  {".proj_lora.up.weight", ROLE_B, 10},
    /* ComfyUI's "<m>_lora.up.weight" for any module m */
    {"_lora.down.weight", ROLE_A, 0},        {"_lora.up.weight", ROLE_B, 0},
};

/* PEFT's adapter-name infix with any adapter name: "<m>.lora_A.<name>.weight"
 * (and lora_B, the lora_B bias, the DoRA magnitude). */
static const struct {
    const char *part, *end;
    enum role role;
} g_infix[] = {
    {".lora_A.", ".weight", ROLE_A},
    {".lora_B.", ".weight", ROLE_B},
    {".lora_B.", ".bias", ROLE_BBIAS},
    {".lora_magnitude_vector.", ".weight", ROLE_MAG},
};

/* The role's key suffix, for messages. */
static const char *role_key(enum role r) {
    for (size_t i = 0; i < sizeof g_suffixes / sizeof g_suffixes[0]; i++)
        if (g_suffixes[i].role == r) return g_suffixes[i].suffix + 1;
    return r == ROLE_ALPHA ? "alpha" : "?";
}

int lk_adapter_kohya_name(const char *k) {
    return !strncmp(k, "lora_unet_", 10) || !strncmp(k, "lora_te", 7) || !strncmp(k, "lycoris_", 8) ||
           !strncmp(k, "lora_transformer_", 17) || !strncmp(k, "lora_prior_", 11);
}

/* Family and role of a key; stem_len is the length of its module part. An
 * ".alpha" belongs to whichever family its module's factors are in
 * (FAM_ALPHA: kohya, ComfyUI's "diffusion_model.<m>.alpha", diffusers). */
static enum family classify(const char *k, enum role *role, size_t *stem_len) {
    size_t n = strlen(k);
    for (size_t i = 0; i < sizeof g_old_attn / sizeof g_old_attn[0]; i++) {
        size_t sl = strlen(g_old_attn[i].suffix);
        if (n > sl && !strcmp(k + n - sl, g_old_attn[i].suffix)) {
            *role = g_old_attn[i].role;
            *stem_len = n - sl + g_old_attn[i].keep;
            return FAM_AB;
        }
    }
    for (size_t i = 0; i < sizeof g_suffixes / sizeof g_suffixes[0]; i++) {
        size_t sl = strlen(g_suffixes[i].suffix);
        if (n > sl && !strcmp(k + n - sl, g_suffixes[i].suffix)) {
            *role = g_suffixes[i].role;
            *stem_len = n - sl;
            if (g_suffixes[i].fam == FAM_ANY && lk_adapter_kohya_name(k)) return FAM_KOHYA;
            /* kohya's module names with diffusers' / PEFT's factor names
             * (lora_unet_..._qkv.lora.down.weight, .lora_A.weight): ComfyUI's
             * loader tries every factor spelling on every name it maps, so
             * they are kohya keys (the name decides, as for LyCORIS's) */
            if (g_suffixes[i].fam == FAM_AB && (*role == ROLE_A || *role == ROLE_B) && lk_adapter_kohya_name(k))
                return FAM_KOHYA;
            return g_suffixes[i].fam;
        }
    }
    for (size_t i = 0; i < sizeof g_infix / sizeof g_infix[0]; i++) {
        size_t el = strlen(g_infix[i].end), pl = strlen(g_infix[i].part);
        if (n <= el || strcmp(k + n - el, g_infix[i].end)) continue;
        /* the one component before the end: the adapter name */
        const char *e = k + n - el, *b = e;
        while (b > k && b[-1] != '.') b--;
        if (b == e || (size_t)(b - k) < pl + 1 || strncmp(b - pl, g_infix[i].part, pl)) continue;
        *role = g_infix[i].role;
        *stem_len = (size_t)(b - pl - k);
        return FAM_AB;
    }
    if (n > 6 && !strcmp(k + n - 6, ".alpha")) {
        *role = ROLE_ALPHA;
        *stem_len = n - 6;
        return FAM_ALPHA;
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

static int file_exists(const char *p);
static char *sidecar_config(const char *file);

int lk_adapter_looks_like(const char *path) {
    struct stat sb;
    if (!path || stat(path, &sb) != 0) return 0;
    if (S_ISDIR(sb.st_mode)) return 1;
    lk_st *st;
    if (lk_st_open(path, &st) != LK_OK) return 0;
    int found = 0, other = 0, all_peft = 1;
    for (size_t i = 0; i < lk_st_count(st); i++) {
        enum role r;
        size_t sl;
        const char *k = lk_st_tensor(st, i)->name;
        enum family f = classify(k, &r, &sl);
        other |= f == FAM_NONE;
        found |= f != FAM_NONE && r != ROLE_ALPHA && r != ROLE_MAG && r != ROLE_BBIAS && r != ROLE_DORA;
        all_peft &= !strncmp(k, "base_model.model.", 17);
    }
    lk_st_close(st);
    if (found && other && all_peft) { /* PEFT's modules_to_save / biases: only with a config */
        char *cfg = sidecar_config(path);
        other = !file_exists(cfg);
        lk_free(cfg);
    }
    return found && !other;
}

/* ---- small accessors ---- */

const char *lk_adapter_path(const lk_adapter *a) { return a ? a->path : NULL; }
lk_adapter_format lk_adapter_get_format(const lk_adapter *a) { return a ? a->format : LK_FORMAT_AUTO; }
size_t lk_adapter_count(const lk_adapter *a) { return a ? a->n : 0; }
const lk_lora_module *lk_adapter_module(const lk_adapter *a, size_t i) {
    return a && i < a->n ? &a->mods[i] : NULL;
}
const char *lk_adapter_module_stem(const lk_adapter *a, size_t i) { return a && i < a->n ? a->stems[i] : NULL; }
size_t lk_adapter_replacement_count(const lk_adapter *a) { return a ? a->n_rep : 0; }
const lk_adapter_tensor *lk_adapter_replacement(const lk_adapter *a, size_t i) {
    return a && i < a->n_rep ? &a->reps[i] : NULL;
}
int lk_adapter_dora(const lk_adapter *a) { return a ? a->dora : 0; }
int lk_adapter_rslora(const lk_adapter *a) { return a ? a->rslora : 0; }
lk_convention lk_adapter_convention(const lk_adapter *a) { return a ? a->convention : LK_CONVENTION_LORAKIT; }
int lk_adapter_has_config(const lk_adapter *a) { return a ? a->has_config : 0; }
size_t lk_adapter_untargeted(const lk_adapter *a) { return a ? a->n_untargeted : 0; }
const char *lk_adapter_file(const lk_adapter *a) { return a ? a->file : NULL; }
const char *lk_adapter_config_file(const lk_adapter *a) { return a ? a->config_path : NULL; }

static void free_strv(char **v, size_t n) {
    if (!v) return;
    for (size_t i = 0; i < n; i++) lk_free(v[i]);
    lk_free(v);
}

void lk_adapter_free(lk_adapter *a) {
    if (!a) return;
    free_strv(a->names, a->n);
    free_strv(a->stems, a->n);
    free_strv(a->targets, a->n);
    free_strv(a->bias_targets, a->n);
    free_strv(a->sources, a->n);
    free_strv(a->rep_names, a->n_rep);
    free_strv(a->rep_targets, a->n_rep);
    lk_free(a->reps);
    lk_free(a->rep_by_target);
    lk_free(a->mods);
    lk_free(a->fa);
    lk_free(a->fb);
    lk_free(a->embed);
    lk_free(a->tfactors);
    free_strv(a->pl_strs, 2 * a->n_pl);
    lk_free(a->pl);
    lk_free(a->family);
    lk_free(a->xfactors);
    lk_free(a->by_bias);
    for (size_t i = 0; i < a->n_meta; i++) {
        lk_free(a->meta[i].prefix);
        lk_peft_config_free(&a->meta[i].cfg);
    }
    lk_free(a->meta);
    lk_peft_config_free(&a->cfg);
    lk_free(a->factors);
    lk_st_close(a->st);
    lk_free(a->config_path);
    lk_free(a->file);
    lk_free(a->path);
    lk_free(a);
}

/* ---- opening ---- */

/* One LoRA key of the file: its tensor, module part, role and family. */
typedef struct keyinfo {
    const lk_tensor *t;
    size_t stem_len;
    enum role role;
    enum family fam;
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

/* "<folder of file>/adapter_config.json" (lk_malloc'd; NULL without memory). */
static char *sidecar_config(const char *file) {
    const char *slash = strrchr(file, '/');
    if (!slash) return lk_strdup("adapter_config.json");
    size_t dl = (size_t)(slash - file) + 1, n = dl + sizeof "adapter_config.json";
    char *p = lk_malloc(n);
    if (p) snprintf(p, n, "%.*sadapter_config.json", (int)dl, file);
    return p;
}

/* After reading the config at cfg with status s: keeps it (taking cfg) or
 * frees cfg and passes s on. */
static lk_status keep_config(lk_adapter *a, char *cfg, lk_status s) {
    if (s) {
        lk_free(cfg);
        return s;
    }
    a->has_config = 1;
    a->config_path = cfg;
    return LK_OK;
}

/* Reads the adapter_config.json at cfg (taking it) when one is there. Only
 * nothing at all at that path means "no config": a config that exists but
 * cannot be read as a regular file (a dangling symlink, such as an HF cache
 * snapshot whose blob is missing; a folder; a FIFO, opened without blocking;
 * no permission) is an error naming the path and why, never read as absent
 * (the adapter would fuse at alpha = r). */
static lk_status read_config(lk_adapter *a, char *cfg) {
    int absent;
    lk_status s = lk_input_check(cfg, &absent);
    if (!s && absent) {
        lk_free(cfg);
        return LK_OK;
    }
    if (!s) s = lk_peft_config_load(cfg, &a->cfg); /* lk_open_input: a regular file, named by kind otherwise */
    if (s && s != LK_ERR_NOMEM && s != LK_ERR_CONFIG && s != LK_ERR_FORMAT && s != LK_ERR_UNSUPPORTED)
        lk_error_prefix(s, "%s: adapter_config.json exists but cannot be read", a->path);
    return keep_config(a, cfg, s);
}

/* Finds the safetensors file and the config: the folder's, or (a file
 * given) the adapter_config.json beside it, read exactly as the folder's. */
static lk_status locate(lk_adapter *a) {
    struct stat sb;
    if (stat(a->path, &sb) != 0) return lk_error(LK_ERR_IO, "%s: no such file or directory", a->path);
    if (!S_ISDIR(sb.st_mode)) {
        if (!(a->file = lk_strdup(a->path))) return lk_error(LK_ERR_NOMEM, "%s: out of memory", a->path);
        char *cfg = sidecar_config(a->file);
        if (!cfg) return lk_error(LK_ERR_NOMEM, "%s: out of memory", a->path);
        lk_status s = read_config(a, cfg);
        if (!s && a->has_config) lk_log(LK_LOG_INFO, "%s: reading %s beside it", a->path, a->config_path);
        return s;
    }
    static const char *const names[] = {"adapter_model.safetensors", "pytorch_lora_weights.safetensors"};
    for (size_t i = 0; i < 2; i++) {
        char *p = lk_path_join(a->path, names[i]);
        if (!p) return lk_error(LK_ERR_NOMEM, "%s: out of memory", a->path);
        /* something there that is not a readable file (a FIFO, a dangling link) is named, not taken as absent */
        int absent;
        lk_status s = lk_input_check(p, &absent);
        if (s) {
            lk_free(p);
            return lk_error_prefix(s, "%s", a->path);
        }
        if (!absent) {
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
    return read_config(a, cfg);
}

/* Keys of adapter algorithms lorakit recognises but does not fuse, named
 * when refused (lycoris: LyCORIS-only, checked on keys outside PEFT's
 * "base_model.model." namespace, where a model's own names could hold them). */
static const struct {
    const char *part, *what;
    int lycoris;
} g_foreign[] = {
    {".on_input", "an IA3 vector (LyCORIS ia3)", 1},
    {".bm.weight", "a GLoRA Tucker core (LyCORIS glora with use_tucker)", 1},
    {".lambda_layer", "a T-LoRA vector (LyCORIS tlora)", 1},
    {".q_layer.weight", "a T-LoRA factor (LyCORIS tlora)", 1},
    {".p_layer.weight", "a T-LoRA factor (LyCORIS tlora)", 1},
    {".oft_embedding_R", "an OFT rotation of an embedding (PEFT OFT on nn.Embedding)", 0},
    {".oft_", "an OFT factor (PEFT OFT) other than oft_R.weight", 0},
    {".boft_", "a BOFT factor (PEFT BOFT) other than boft_R / boft_s", 0},
    {".ia3_l", "an IA3 vector (PEFT IA3)", 0},
    {".vera_lambda", "a VeRA vector", 0},
    {".lora_E", "an AdaLoRA singular-value vector (lora_E)", 0},
    {".trainable_tokens_delta", "a trainable-tokens delta", 0},
    /* BFL's Flux Canny / Depth LoRAs: ComfyUI (convert_lora_bfl_control) sets these norm scales and zero-pads
     * img_in.weight to the LoRA's wider input, a different model; lorakit keeps every weight's shape */
    {"_norm.scale", "a BFL Flux control LoRA's norm scale (ComfyUI replaces the norms and widens img_in.weight "
                    "with zero columns to the LoRA's input width; lorakit never changes a weight's shape)", 1},
};

/* A key that is not a LoRA factor: a tensor PEFT saved whole (its
 * modules_to_save, or a bias with bias = "all" / "lora_only"), or an error
 * saying what it is. *name gets the model key it replaces (lk_malloc'd). */
static lk_status other_key(const lk_adapter *a, const char *k, char **name, const char **why) {
    const char *f = a->file;
    *name = NULL;
    const int peft_key = !strncmp(k, "base_model.model.", 17);
    for (size_t i = 0; i < sizeof g_foreign / sizeof g_foreign[0]; i++)
        if (strstr(k, g_foreign[i].part) && !(g_foreign[i].lycoris && peft_key))
            return lk_error(LK_ERR_UNSUPPORTED, "%s: key '%s' is %s: lorakit recognises that algorithm but does not "
                            "fuse it", f, k, g_foreign[i].what);
    const char *rest = !strncmp(k, "base_model.model.", 17) ? k + 17 : NULL;
    if (!a->has_config || !rest || !*rest) {
        if (rest)
            return lk_error(LK_ERR_FORMAT,
                            "%s: key '%s' is not a LoRA factor; PEFT saves such tensors for modules_to_save or bias, "
                            "which need the adapter_config.json that is not beside the file", f, k);
        return lk_error(LK_ERR_FORMAT,
                        "%s: key '%s' belongs to no adapter algorithm lorakit knows (LoRA lora_A/lora_B or "
                        "lora_down/lora_up (+ lora_mid), LoHa hada_*, LoKr lokr_*, full diff/diff_b, set_weight, norm "
                        "w_norm/b_norm, DoRA dora_scale, alpha)", f, k);
    }
    size_t rl = strlen(rest);
    int is_bias = rl >= 4 && !strcmp(rest + rl - 4, "bias") && (rl == 4 || rest[rl - 5] == '.');
    /* the module the tensor belongs to: rest without its last component */
    const char *dot = strrchr(rest, '.');
    size_t ml = dot ? (size_t)(dot - rest) : 0;
    char *mod = lk_malloc(ml + 1);
    if (!mod) return lk_error(LK_ERR_NOMEM, "%s: out of memory", f);
    memcpy(mod, rest, ml);
    mod[ml] = '\0';
    int saved = ml && lk_peft_saved_module(&a->cfg, mod);
    lk_free(mod);
    static const char bl[] = ".base_layer.bias";
    size_t bll = sizeof bl - 1;
    int base_layer = rl > bll && !strcmp(rest + rl - bll, bl);
    if (saved || (is_bias && a->cfg.bias != LK_PEFT_BIAS_NONE)) {
        /* bias = "lora_only" before PEFT 0.7 saved <m>.bias (the LoRA layer
         * held it); check_replacements verifies <m> is a LoRA module */
        char *n = lk_malloc(rl + 1);
        if (!n) return lk_error(LK_ERR_NOMEM, "%s: out of memory", f);
        if (base_layer) snprintf(n, rl + 1, "%.*s.bias", (int)(rl - bll), rest);
        else memcpy(n, rest, rl + 1);
        *name = n;
        *why = saved ? "modules_to_save" : "bias";
        return LK_OK;
    }
    if (is_bias)
        return lk_error(LK_ERR_FORMAT, "%s: key '%s' is a saved bias, but %s has bias = \"none\"", f, k, a->config_path);
    /* PEFT's save_embedding_layers (on by default when an embedding or
     * lm_head is targeted) saves the layer's base weight too, and loading
     * the adapter puts it back into the model before the LoRA applies: a
     * replacement of <m>.weight (the frozen base itself, as a rule: then a
     * no-op; a resized vocabulary's is refused by its shape) */
    static const char bw[] = ".base_layer.weight";
    const size_t bwl = sizeof bw - 1;
    if (rl > bwl && !strcmp(rest + rl - bwl, bw)) {
        char *n = lk_malloc(rl + 1);
        if (!n) return lk_error(LK_ERR_NOMEM, "%s: out of memory", f);
        snprintf(n, rl + 1, "%.*s.weight", (int)(rl - bwl), rest);
        *name = n;
        *why = "base_layer";
        return LK_OK;
    }
    return lk_error(LK_ERR_FORMAT,
                    "%s: key '%s' is not a LoRA factor, and %s's modules_to_save (%zu entries) does not cover it", f,
                    k, a->config_path, a->cfg.n_to_save);
}

/* comfyui: a file with PEFT-style (lora_A / lora_B) and kohya-style keys and
 * nothing else (no FastVideo keys, no adapter_config.json) is read key by key
 * as ComfyUI's loader reads it (each module under its own name), with one
 * warning naming a key of each. first[]: each family's first key. */
static int mixed_comfyui(const lk_adapter *a, const keyinfo *ki, size_t n, const size_t *first) {
    if (a->convention != LK_CONVENTION_COMFYUI || a->has_config || first[FAM_AB] == SIZE_MAX ||
        first[FAM_KOHYA] == SIZE_MAX || first[FAM_FV] != SIZE_MAX)
        return 0;
    size_t n_ab = 0, n_kohya = 0;
    for (size_t i = 0; i < n; i++) {
        n_ab += ki[i].fam == FAM_AB;
        n_kohya += ki[i].fam == FAM_KOHYA;
    }
    lk_log(LK_LOG_WARN, "%s: convention comfyui: %zu PEFT-style keys (e.g. '%s') and %zu kohya-style keys (e.g. "
           "'%s') in one file: each key is read alone, as ComfyUI does (lorakit's own convention refuses the mix)",
           a->file, n_ab, ki[first[FAM_AB]].t->name, n_kohya, ki[first[FAM_KOHYA]].t->name);
    return 1;
}

/* The format from the families present (every key here has a family). */
static lk_status detect(lk_adapter *a, const keyinfo *ki, size_t n, lk_adapter_format forced) {
    const char *f = a->file;
    size_t first[6] = {SIZE_MAX, SIZE_MAX, SIZE_MAX, SIZE_MAX, SIZE_MAX, SIZE_MAX};
    for (size_t i = 0; i < n; i++)
        if (first[ki[i].fam] == SIZE_MAX) first[ki[i].fam] = i;
    if (forced != LK_FORMAT_AUTO) {
        enum family want = family_of(forced);
        for (size_t i = 0; i < n; i++)
            if (ki[i].fam != want && ki[i].fam != FAM_ALPHA && ki[i].fam != FAM_ANY)
                return lk_error(LK_ERR_FORMAT, "%s: key '%s' is not a %s adapter key", f, ki[i].t->name,
                                lk_adapter_format_name(forced));
        if (n == 0) return lk_error(LK_ERR_FORMAT, "%s: no tensors: not a LoRA adapter", f);
        a->format = forced;
        return LK_OK;
    }
    enum family found = FAM_NONE;
    if (mixed_comfyui(a, ki, n, first)) { /* ComfyUI reads each key alone */
        a->kohya_mixed = 1;
        first[FAM_KOHYA] = SIZE_MAX;
    }
    for (int k = FAM_AB; k <= FAM_FV; k++) {
        if (first[k] == SIZE_MAX) continue;
        if (found != FAM_NONE)
            return lk_error(LK_ERR_FORMAT, "%s: mixes %s keys ('%s') and %s keys ('%s')%s", f, g_fam_names[found],
                            ki[first[found]].t->name, g_fam_names[k], ki[first[k]].t->name,
                            found == FAM_AB && k == FAM_KOHYA && !a->has_config
                                ? "; --convention comfyui reads each key alone, as ComfyUI does"
                                : "");
        found = (enum family)k;
    }
    if (found == FAM_NONE && first[FAM_ANY] == SIZE_MAX)
        return lk_error(LK_ERR_FORMAT, "%s: no LoRA keys: not an adapter", f);
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

/* The module an old attention-processor stem (module name m, len bytes:
 * "<attn>[.processor].to_q" ... "to_out") stands for, as diffusers' loader
 * converts it (UNET_TO_DIFFUSERS, DIFFUSERS_OLD_TO_PEFT; ".processor." always
 * dropped): to_q, to_k, to_v, to_out.0 in a UNet; q_proj, k_proj, v_proj,
 * out_proj in a text encoder ("text_encoder[_N]." prefix). */
static char *old_attn_module(const char *m, size_t len) {
    const char *last = m + len;
    while (last > m && last[-1] != '.') last--;
    size_t head = (size_t)(last - m), tl = len - head;
    int te = !strncmp(m, "text_encoder.", 13) || !strncmp(m, "text_encoder_", 13);
    const char *tail = NULL;
    static const char *const from[] = {"to_q", "to_k", "to_v", "to_out"}, *const unet[] = {"to_q", "to_k", "to_v", "to_out.0"},
                             *const clip[] = {"q_proj", "k_proj", "v_proj", "out_proj"};
    for (size_t i = 0; i < 4; i++)
        if (tl == strlen(from[i]) && !memcmp(last, from[i], tl)) tail = te ? clip[i] : unet[i];
    char *out = lk_malloc(len + 16), *o = out;
    if (!out) return NULL;
    for (const char *c = m; c < last;) { /* the components before the last one, but "processor" */
        const char *e = memchr(c, '.', (size_t)(last - c));
        size_t cl = e ? (size_t)(e - c) : (size_t)(last - c);
        if (!(cl == 9 && !memcmp(c, "processor", 9))) {
            memcpy(o, c, cl);
            o += cl;
            *o++ = '.';
        }
        c += cl + 1;
    }
    if (!tail) { /* (the suffix table only gives these four) */
        memcpy(o, last, tl);
        o[tl] = '\0';
    } else {
        strcpy(o, tail);
    }
    return out;
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

/* ---- alpha and rank from the file's metadata ---- */

#define LK_META_KEY "lora_adapter_metadata"

/* One LoraConfig in JSON text txt (json_dumps', freed here) into
 * a->meta[a->n_meta], labelled plabel (borrowed), under component prefix
 * (taken: kept on success, freed on failure; NULL: the whole file's
 * config). txt or plabel NULL: out of memory. */
static lk_status meta_add(lk_adapter *a, char *txt, const char *plabel, char *prefix) {
    lk_status s = txt && plabel ? LK_OK : lk_error(LK_ERR_NOMEM, "%s: out of memory", a->file);
    if (!s) s = lk_peft_config_parse(txt, strlen(txt), plabel, &a->meta[a->n_meta].cfg);
    free(txt);
    if (s) {
        lk_free(prefix);
        return s;
    }
    a->meta[a->n_meta++].prefix = prefix;
    return LK_OK;
}

/* One component's config given as a nested object ({"transformer": {"r":
 * 4, "lora_alpha": 8}}) into a->meta; refused when the same component is
 * also packed ("transformer.r"), as which one wins would be a guess. */
static lk_status meta_nested(lk_adapter *a, json_t *root, const char *label, const char *comp, json_t *cfg) {
    size_t pl = strlen(comp);
    const char *k;
    json_t *v;
    json_object_foreach(root, k, v) if (!strncmp(k, comp, pl) && k[pl] == '.')
        return lk_error(LK_ERR_CONFIG, "%s: component \"%s\" is given both as an object and as packed keys (\"%s\"); "
                        "keep one", label, comp, k);
    char *prefix = lk_strdup(comp), *plabel = lk_msg_dup("%s (%s)", label, comp);
    lk_status s = prefix ? meta_add(a, json_dumps(cfg, JSON_COMPACT), plabel, prefix)
                         : lk_error(LK_ERR_NOMEM, "%s: out of memory", a->file);
    lk_free(plabel);
    return s;
}

/* kohya's ss_network_alpha (a finite number, else a warning) and
 * ss_network_dim (a positive whole number, else ignored). Cannot fail. */
static void read_kohya_meta(lk_adapter *a) {
    const char *ssa = lk_st_metadata_get(a->st, "ss_network_alpha");
    if (ssa) {
        char *end;
        double v = strtod(ssa, &end);
        a->ss_alpha_text = ssa;
        if (end != ssa && !*end && isfinite(v)) {
            a->has_ss_alpha = 1;
            a->ss_alpha = v;
        } else {
            lk_log(LK_LOG_WARN, "%s: metadata ss_network_alpha '%s' is not a finite number; ignored", a->file, ssa);
        }
    }
    const char *ssd = lk_st_metadata_get(a->st, "ss_network_dim");
    if (ssd) {
        char *end;
        long v = strtol(ssd, &end, 10);
        if (end != ssd && !*end && v > 0) a->ss_dim = v;
    }
}

/* The component k[0..pl) of a packed record ({"transformer.r": 4, ...}):
 * its "<component>.<field>" keys gathered into one LoraConfig, read into
 * a->meta. */
static lk_status meta_packed(lk_adapter *a, json_t *root, const char *label, const char *k, size_t pl) {
    json_t *sub = json_object();
    char *prefix = lk_malloc(pl + 1);
    lk_status s = LK_OK;
    if (!sub || !prefix) {
        json_decref(sub);
        lk_free(prefix);
        return lk_error(LK_ERR_NOMEM, "%s: out of memory", a->file);
    }
    memcpy(prefix, k, pl);
    prefix[pl] = '\0';
    const char *k2;
    json_t *v2;
    json_object_foreach(root, k2, v2) if (!strncmp(k2, prefix, pl) && k2[pl] == '.' && k2[pl + 1]) {
        if (json_object_set(sub, k2 + pl + 1, v2)) s = lk_error(LK_ERR_NOMEM, "%s: out of memory", a->file);
    }
    char *txt = s ? NULL : json_dumps(sub, JSON_COMPACT);
    json_decref(sub);
    if (s) {
        lk_free(prefix);
        return s;
    }
    char *plabel = lk_msg_dup("%s (%s)", label, prefix);
    s = meta_add(a, txt, plabel, prefix);
    lk_free(plabel);
    return s;
}

/* Every component of a per-component record (keys "<component>.<field>",
 * or a component's whole config as an object) into a->meta; other keys
 * are named in a warning and skipped. */
static lk_status meta_components(lk_adapter *a, json_t *root, const char *label) {
    const char *k;
    json_t *v;
    json_object_foreach(root, k, v) {
        const char *dot = strchr(k, '.');
        lk_status s;
        if (!dot && json_is_object(v) && *k) { /* {"transformer": {"r": 4, ...}}: one component's config, nested */
            if ((s = meta_nested(a, root, label, k, v))) return s;
            continue;
        }
        if (!dot || dot == k) { /* neither "component.field" nor a component's object: said, not silently dropped */
            lk_log(LK_LOG_WARN, "%s: key \"%s\" is neither a LoraConfig field of a component (\"component.r\") nor a "
                   "component's config object; ignored", label, k);
            continue;
        }
        size_t pl = (size_t)(dot - k), j = 0;
        while (j < a->n_meta && (strlen(a->meta[j].prefix) != pl || strncmp(a->meta[j].prefix, k, pl))) j++;
        if (j < a->n_meta) continue; /* component already built */
        if ((s = meta_packed(a, root, label, k, pl))) return s;
    }
    return LK_OK;
}

/* diffusers' lora_adapter_metadata: a LoraConfig dict, or one packed per
 * component ({"transformer.r": 4, "transformer.lora_alpha": 8, ...}), or
 * (read the same way) one object per component ({"transformer": {...}}).
 * kohya's ss_network_alpha. Only for adapters without an adapter_config.json.
 * In steps: kohya's keys, the JSON record, then one config or one per
 * component into a->meta (owned by a). */
static lk_status read_metadata(lk_adapter *a) {
    const char *f = a->file;
    read_kohya_meta(a);
    const char *js = lk_st_metadata_get(a->st, LK_META_KEY);
    if (!js) return LK_OK;
    char *label = lk_msg_dup("%s: metadata %s", f, LK_META_KEY); /* whole: a long path is shortened by the message */
    if (!label) return lk_error(LK_ERR_NOMEM, "%s: out of memory", f);
    json_error_t je;
    json_t *root = json_loads(js, JSON_REJECT_DUPLICATES, &je);
    lk_status s = LK_OK;
    int packed = 0;
    if (!root || !json_is_object(root)) s = lk_error(LK_ERR_CONFIG, "%s: not a JSON object", label);
    else packed = !json_object_get(root, "r") && !json_object_get(root, "lora_alpha") &&
                  !json_object_get(root, "peft_type");
    size_t cap = packed ? json_object_size(root) : 1;
    if (!s && !(a->meta = lk_calloc(cap ? cap : 1, sizeof *a->meta))) s = lk_error(LK_ERR_NOMEM, "%s: out of memory", f);
    if (!s && !packed) s = meta_add(a, json_dumps(root, JSON_COMPACT), label, NULL);
    if (!s && packed) s = meta_components(a, root, label);
    json_decref(root);
    lk_free(label);
    return s;
}

/* The metadata config for a module with stem `stem`, and the name its
 * patterns see; NULL when none applies. */
static const lk_peft_config *meta_for(const lk_adapter *a, const char *stem, const char *module, const char **name) {
    for (size_t i = 0; i < a->n_meta; i++) {
        if (!a->meta[i].prefix) {
            *name = module;
            return &a->meta[i].cfg;
        }
        size_t pl = strlen(a->meta[i].prefix);
        if (!strncmp(stem, a->meta[i].prefix, pl) && stem[pl] == '.') {
            *name = stem + pl + 1;
            return &a->meta[i].cfg;
        }
    }
    return NULL;
}

/* Index of tensor t (a view returned by lk_st_tensor) in st. */
static size_t st_index(const lk_st *st, const lk_tensor *t) { return (size_t)lk_st_find(st, t->name); }

/* An integer scalar of dtype d (little-endian bytes raw) as a double (a
 * 64-bit value beyond 2^53 rounds to nearest, as Python's float() does);
 * 0 when d is no integer dtype. */
static int int_value(lk_dtype d, const unsigned char *raw, double *v) {
    uint64_t u = 0;
    int bytes = d == LK_DTYPE_U8 || d == LK_DTYPE_I8 ? 1 : d == LK_DTYPE_I16 || d == LK_DTYPE_U16 ? 2
              : d == LK_DTYPE_I32 || d == LK_DTYPE_U32 ? 4 : d == LK_DTYPE_I64 || d == LK_DTYPE_U64 ? 8 : 0;
    int is_signed = d == LK_DTYPE_I8 || d == LK_DTYPE_I16 || d == LK_DTYPE_I32 || d == LK_DTYPE_I64;
    if (!bytes) return 0;
    for (int b = bytes - 1; b >= 0; b--) u = u << 8 | raw[b];
    if (is_signed && bytes < 8 && (u >> (8 * bytes - 1))) u |= ~0ull << (8 * bytes); /* sign-extend */
    *v = is_signed ? (double)(int64_t)u : (double)u;
    return 1;
}

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
    } else if (int_value(t->dtype, raw, &v)) { /* diffusers' convert_state_dict_to_kohya writes an I64 */
    } else {
        return lk_error(LK_ERR_DTYPE, "%s: %s: alpha has dtype %s; expected a float or an integer", file, t->name,
                        lk_dtype_name(t->dtype));
    }
    if (!isfinite(v)) return lk_error(LK_ERR_NONFINITE, "%s: %s: alpha is %g", file, t->name, v);
    *out = v;
    return LK_OK;
}

/* A factor: F32/F16/BF16, 2-D, or 4-D (a convolution's [r, in, kh, kw] /
 * [out, r, 1, 1], LyCORIS cores [r, r, kh, kw]) with every dimension > 0;
 * all: the first two are checked here too (LoRA's A and B pass 0: their
 * rank check names them). */
static lk_status check_factor(const char *file, const char *m, const lk_tensor *t, const char *role, int all) {
    if (!lk_dtype_is_fusable(t->dtype))
        return lk_error(LK_ERR_DTYPE, "%s: %s: %s has dtype %s; adapter factors must be F32, F16 or BF16", file, m,
                        role, lk_dtype_name(t->dtype));
    if (t->ndim != 2 && t->ndim != 4) {
        char sh[96];
        lk_shape_str(t, sh, sizeof sh);
        return lk_error(LK_ERR_SHAPE, "%s: %s: %s is %s: expected 2 dimensions (4 for a convolution)", file, m, role, sh);
    }
    for (int d = all ? 0 : 2; d < t->ndim; d++)
        if (t->shape[d] <= 0) {
            char sh[96];
            lk_shape_str(t, sh, sizeof sh);
            return lk_error(LK_ERR_SHAPE, "%s: %s: %s is %s: every dimension must be > 0", file, m, role, sh);
        }
    return LK_OK;
}

/* 1 if t's dimensions after the first two are all 1 (a 2-D factor, or a 1x1 conv's). */
static int trailing_ones(const lk_tensor *t) {
    for (int d = 2; d < t->ndim; d++)
        if (t->shape[d] != 1) return 0;
    return 1;
}

/* A [out] vector of a module (DoRA magnitude, lora_B bias). */
static lk_status check_vector(const char *file, const char *m, const lk_tensor *t, const char *role, int64_t out) {
    if (!lk_dtype_is_fusable(t->dtype))
        return lk_error(LK_ERR_DTYPE, "%s: %s: %s has dtype %s; it must be F32, F16 or BF16", file, m, role,
                        lk_dtype_name(t->dtype));
    int64_t len = t->ndim == 1 ? t->shape[0] : t->ndim == 2 && t->shape[1] == 1 ? t->shape[0] : -1;
    if (t->ndim == 4 || (t->ndim > 2 && len < 0))
        return lk_error(LK_ERR_UNSUPPORTED, "%s: %s: %s has %d dimensions (a convolution layer's); only linear layers "
                        "are supported", file, m, role, t->ndim);
    if (len != out)
        return lk_error(LK_ERR_SHAPE, "%s: %s: %s has %lld values but lora_B has %lld rows", file, m, role,
                        (long long)(t->ndim ? t->shape[0] : 1), (long long)out);
    return LK_OK;
}

static char *source_str(const char *what, const char *key) {
    size_t n = strlen(what) + (key ? strlen(key) + 4 : 0) + 1;
    char *p = lk_malloc(n);
    if (p) {
        if (key) snprintf(p, n, "%s \"%s\"", what, key);
        else snprintf(p, n, "%s", what);
    }
    return p;
}

/* Rank check and alpha from a PEFT-style config (the file's or metadata's). */
static lk_status config_alpha(lk_adapter *a, const lk_peft_config *c, const char *name, const char *m, const char *an,
                              int64_t r, const char *src_prefix, double *alpha, char **source) {
    const char *f = a->file;
    const lk_pattern *rp, *ap;
    lk_status s;
    if ((s = lk_peft_pattern_find(c, 0, name, &rp))) return s;
    long want = rp ? (long)rp->value : c->r;
    if (want != r) {
        if (rp)
            return lk_error(LK_ERR_SHAPE, "%s: %s: %s has rank %lld but %s says %ld (rank_pattern \"%s\")", f, m, an,
                            (long long)r, c->label, want, rp->key);
        return lk_error(LK_ERR_SHAPE, "%s: %s: %s has rank %lld but %s says r = %ld", f, m, an, (long long)r, c->label,
                        want);
    }
    if ((s = lk_peft_pattern_find(c, 1, name, &ap))) return s;
    *alpha = ap ? ap->value : c->alpha;
    char what[64];
    snprintf(what, sizeof what, "%s%s", src_prefix, ap ? "alpha_pattern" : (*src_prefix ? LK_META_KEY : "config"));
    *source = source_str(what, ap ? ap->key : NULL);
    return *source ? LK_OK : lk_error(LK_ERR_NOMEM, "%s: out of memory", f);
}

/* Alpha of module i (rank r) of a file without adapter_config.json, by
 * a->alpha_from (lk_alpha_from in adapter.h): from its .alpha tensor
 * alpha_t (may be NULL), lora_adapter_metadata, ss_network_alpha or r. */
static lk_status file_alpha(lk_adapter *a, size_t i, const lk_tensor *alpha_t, const char *an, int64_t r,
                            double *alpha, char **source) {
    const char *f = a->file, *m = a->names[i], *pname = m;
    lk_status s;
    double ta = 0, ma = 0;
    char *msrc = NULL;
    /* ComfyUI's loader and LyCORIS's read only .alpha tensors: under their
     * conventions lora_adapter_metadata counts only when asked for */
    const int meta_ignored = a->alpha_from == LK_ALPHA_AUTO &&
                             (a->convention == LK_CONVENTION_COMFYUI || a->convention == LK_CONVENTION_LYCORIS);
    const lk_peft_config *mc = a->alpha_from == LK_ALPHA_TENSORS || meta_ignored ? NULL
                                                                                 : meta_for(a, a->stems[i], m, &pname);
    if (alpha_t && (s = read_alpha(a, alpha_t, &ta))) return s;
    if (mc && (s = config_alpha(a, mc, pname, m, an, r, "metadata ", &ma, &msrc))) return s;
    if (alpha_t && mc && a->alpha_from == LK_ALPHA_AUTO && ta != ma) {
        char tb[LK_NUM_STR_MAX], mb[LK_NUM_STR_MAX];
        lk_error(LK_ERR_CONFIG, "%s: %s: the .alpha tensor says alpha = %s but %s says %s; choose one with "
                 "--alpha-from tensors|metadata (alpha_from in a plan or in Python)", f, m, lk_num_str(ta, tb),
                 msrc, lk_num_str(ma, mb));
        lk_free(msrc);
        return LK_ERR_CONFIG;
    }
    if (mc && (!alpha_t || a->alpha_from == LK_ALPHA_METADATA)) { /* lora_adapter_metadata */
        *alpha = ma;
        *source = msrc;
        return LK_OK;
    }
    lk_free(msrc);
    if (a->has_ss_alpha && a->alpha_from == LK_ALPHA_METADATA) {
        *alpha = a->ss_alpha;
        *source = source_str("metadata ss_network_alpha", NULL);
        if (a->ss_dim && a->ss_dim != r) a->n_ss_dim_off++;
    } else if (alpha_t && ta == 0.0 && a->convention == LK_CONVENTION_LYCORIS) {
        *alpha = (double)r; /* LyCORIS's LoCon (and kohya's networks.lora) read alpha 0 as r */
        *source = source_str(".alpha tensor (0: r, as LyCORIS)", NULL);
    } else if (alpha_t) {
        *alpha = ta;
        *source = source_str(".alpha tensor", NULL);
    } else if (meta_ignored && meta_for(a, a->stems[i], m, &pname)) {
        *alpha = (double)r; /* the metadata's alpha, which ComfyUI and LyCORIS never read */
        *source = source_str(a->convention == LK_CONVENTION_COMFYUI ? "r (metadata alpha ignored, as ComfyUI)"
                                                                    : "r (metadata alpha ignored, as LyCORIS)", NULL);
    } else {
        /* alpha = r, as diffusers, ComfyUI and A1111 read a module without .alpha */
        *alpha = (double)r;
        *source = source_str("default r", NULL);
        if (a->has_ss_alpha && a->alpha_from == LK_ALPHA_AUTO && a->ss_alpha != (double)r && !a->n_ss_off++)
            a->ss_off_first = i;
    }
    return *source ? LK_OK : lk_error(LK_ERR_NOMEM, "%s: out of memory", f);
}

/* Checks LoRA module i's factors (A and B present): dtypes and shapes,
 * rank > 0 and equal on both sides, a convolution's up factor [out, r, 1,
 * 1], a LoCon Tucker core lora_mid between them. *r: the rank. */
static lk_status check_lora_factors(const lk_adapter *a, size_t i, const lk_tensor *const *by_role, int64_t *r) {
    const char *f = a->file, *m = a->names[i];
    const char *an = lk_adapter_factor_name(a, 0), *bn = lk_adapter_factor_name(a, 1);
    const lk_tensor *A = by_role[ROLE_A], *B = by_role[ROLE_B], *mid = by_role[ROLE_MID];
    lk_status s;
    if ((s = check_factor(f, m, A, an, 0)) || (s = check_factor(f, m, B, bn, 0))) return s;
    *r = A->shape[0];
    if (*r <= 0 || A->shape[1] <= 0 || B->shape[0] <= 0)
        return lk_error(LK_ERR_SHAPE, "%s: %s: %s is %lldx%lld and %s is %lldx%lld: rank must be > 0", f, m, an,
                        (long long)A->shape[0], (long long)A->shape[1], bn, (long long)B->shape[0],
                        (long long)B->shape[1]);
    if (B->shape[1] != *r && !mid)
        return lk_error(LK_ERR_SHAPE, "%s: %s: %s is %lldx%lld but %s is %lldx%lld (ranks differ)", f, m, an,
                        (long long)A->shape[0], (long long)A->shape[1], bn, (long long)B->shape[0],
                        (long long)B->shape[1]);
    char as[96], bs[96], ms[96];
    lk_shape_str(A, as, sizeof as);
    lk_shape_str(B, bs, sizeof bs);
    if (!trailing_ones(B))
        return lk_error(LK_ERR_SHAPE, "%s: %s: %s is %s: a convolution's up factor must be [out, r, 1, 1]", f, m, bn, bs);
    if (!mid) return LK_OK;
    /* LoCon Tucker: down [r, in, 1, 1], mid [r, r, kh, kw], up [out, r, 1, 1] */
    lk_shape_str(mid, ms, sizeof ms);
    if ((s = check_factor(f, m, mid, "lora_mid", 1))) return s;
    if (mid->shape[0] != B->shape[1] || mid->shape[1] != *r || !trailing_ones(A))
        return lk_error(LK_ERR_SHAPE, "%s: %s: Tucker core lora_mid is %s but %s is %s and %s is %s (expected "
                        "[%lld, %lld, kh, kw] between [out, %lld, 1, 1] and [%lld, in, 1, 1])", f, m, ms, bn, bs, an,
                        as, (long long)B->shape[1], (long long)*r, (long long)B->shape[1], (long long)*r);
    return LK_OK;
}

/* Checks LoRA module i's vectors: one DoRA magnitude at most, none on an
 * embedding, each allowed by the config and [out] (B's rows) long. */
static lk_status check_lora_vectors(const lk_adapter *a, size_t i, const lk_tensor *const *by_role) {
    const char *f = a->file, *m = a->names[i];
    const lk_tensor *mag = by_role[ROLE_MAG], *bb = by_role[ROLE_BBIAS], *B = by_role[ROLE_B];
    lk_status s;
    if (mag && by_role[ROLE_DORA])
        return lk_error(LK_ERR_FORMAT, "%s: %s: both '%s' and '%s' (two DoRA magnitudes)", f, m, mag->name,
                        by_role[ROLE_DORA]->name);
    if (mag && a->embed[i])
        return lk_error(LK_ERR_UNSUPPORTED, "%s: %s: DoRA on an embedding layer is not supported", f, m);
    if (mag) {
        if (a->has_config && !a->cfg.use_dora)
            return lk_error(LK_ERR_FORMAT, "%s: %s: '%s' is a DoRA magnitude but %s has use_dora = false", f, m,
                            mag->name, a->config_path);
        if ((s = check_vector(f, m, mag, "lora_magnitude_vector", B->shape[0]))) return s;
    }
    if (bb) {
        if (a->has_config && !a->cfg.lora_bias)
            return lk_error(LK_ERR_FORMAT, "%s: %s: '%s' is a lora_B bias but %s has lora_bias = false", f, m,
                            bb->name, a->config_path);
        if ((s = check_vector(f, m, bb, "lora_B.bias", B->shape[0]))) return s;
    }
    return LK_OK;
}

/* A non-PEFT module's .alpha tensor against the alpha its config gives
 * (source says where): equal, or LK_ERR_CONFIG naming both. */
static lk_status config_vs_tensor(const lk_adapter *a, size_t i, const lk_tensor *alpha_t, double alpha,
                                  const char *source) {
    double ta;
    lk_status s = read_alpha(a, alpha_t, &ta);
    if (s || ta == alpha) return s;
    char tb[LK_NUM_STR_MAX], cb[LK_NUM_STR_MAX];
    return lk_error(LK_ERR_CONFIG, "%s: %s: the .alpha tensor says alpha = %s but %s (%s) says %s; keep one",
                    a->file, a->names[i], lk_num_str(ta, tb), a->config_path, source, lk_num_str(alpha, cb));
}

/* Alpha of LoRA module i (rank r): from adapter_config.json for PEFT with
 * one (counting a module outside target_modules), else from the file
 * (file_alpha). Its source text goes to a->sources[i] (owned by a). */
static lk_status lora_alpha(lk_adapter *a, size_t i, const lk_tensor *alpha_t, int64_t r, double *alpha) {
    const char *f = a->file, *m = a->names[i], *an = lk_adapter_factor_name(a, 0);
    char *source = NULL;
    lk_status s;
    if (a->has_config) { /* PEFT's, or one beside a file of another format (a FastVideo-legacy file) */
        if ((s = config_alpha(a, &a->cfg, m, m, an, r, "", alpha, &source))) return s;
        int hit = 1;
        if (a->format == LK_FORMAT_PEFT) s = lk_peft_targets(&a->cfg, m, &hit);
        else if (alpha_t) s = config_vs_tensor(a, i, alpha_t, *alpha, source);
        if (s) {
            lk_free(source);
            return s;
        }
        if (!hit) a->n_untargeted++;
    } else if ((s = file_alpha(a, i, alpha_t, an, r, alpha, &source))) {
        return s;
    }
    if (!source) return lk_error(LK_ERR_NOMEM, "%s: out of memory", f);
    a->sources[i] = source;
    return LK_OK;
}

/* Fills LoRA module i from its tensors (by role; A and B present) in
 * steps: check the factors, check the vectors, alpha, then scale and the
 * module itself. */
static lk_status build_module(lk_adapter *a, size_t i, const lk_tensor *const *by_role) {
    const char *m = a->names[i];
    const lk_tensor *A = by_role[ROLE_A], *B = by_role[ROLE_B], *mid = by_role[ROLE_MID];
    const lk_tensor *mag = by_role[ROLE_MAG], *bb = by_role[ROLE_BBIAS];
    int64_t r;
    double alpha = 0;
    lk_status s;
    if ((s = check_lora_factors(a, i, by_role, &r)) || (s = check_lora_vectors(a, i, by_role)) ||
        (s = lora_alpha(a, i, by_role[ROLE_ALPHA], r, &alpha)))
        return s;
    double scale = a->rslora ? alpha / sqrt((double)r) : alpha / (double)r;
    if (!isfinite((float)scale))
        return lk_error(LK_ERR_NONFINITE, "%s: %s: scale alpha/%s = %g is not finite as a float", a->file, m,
                        a->rslora ? "sqrt(r)" : "r", scale);
    lk_lora_module *mod = &a->mods[i];
    mod->module = m;
    mod->target = NULL;
    mod->rank = (int)r;
    mod->alpha = alpha;
    mod->scale = scale;
    mod->A = *A;
    mod->B = *B;
    mod->alpha_source = a->sources[i];
    if (mag) mod->magnitude = *mag;
    if (bb) mod->bias = *bb;
    mod->algo = LK_ALGO_LORA;
    mod->out = B->shape[0];
    mod->in = (int64_t)(lk_tensor_numel(A) / (size_t)r);
    if (mid) {
        mod->mid = *mid;
        mod->in = A->shape[1] * (int64_t)(lk_tensor_numel(mid) / (size_t)(mid->shape[0] * mid->shape[1]));
    }
    if (by_role[ROLE_DORA]) mod->dora_scale = *by_role[ROLE_DORA];
    return LK_OK;
}

/* The algorithm a role belongs to, or -1 for the roles any algorithm may carry. */
static int role_algo(enum role r) {
    switch (r) {
    case ROLE_A: case ROLE_B: case ROLE_MID: return LK_ALGO_LORA;
    case ROLE_HW1A: case ROLE_HW1B: case ROLE_HW2A: case ROLE_HW2B: case ROLE_HT1: case ROLE_HT2: return LK_ALGO_LOHA;
    case ROLE_KW1: case ROLE_KW1A: case ROLE_KW1B: case ROLE_KW2: case ROLE_KW2A: case ROLE_KW2B: case ROLE_KT2:
        return LK_ALGO_LOKR;
    case ROLE_DIFF: case ROLE_DIFFB: return LK_ALGO_FULL;
    case ROLE_WNORM: case ROLE_BNORM: return LK_ALGO_NORM;
    case ROLE_SETW: return LK_ALGO_SET;
    case ROLE_OFTB: case ROLE_RESC: case ROLE_OFTR: return LK_ALGO_OFT; /* BOFT when oft_blocks is 4-D (build_oft) */
    case ROLE_BOFTR: case ROLE_BOFTS: return LK_ALGO_BOFT;
    case ROLE_GA1: case ROLE_GA2: case ROLE_GB1: case ROLE_GB2: return LK_ALGO_GLORA;
    default: return -1;
    }
}

/* Shape error between two named tensors. */
static lk_status shape_pair_error(const char *f, const char *m, const char *what, const lk_tensor *x,
                                  const lk_tensor *y) {
    char xs[96], ys[96];
    lk_shape_str(x, xs, sizeof xs);
    lk_shape_str(y, ys, sizeof ys);
    return lk_error(LK_ERR_SHAPE, "%s: %s: %s: '%s' is %s and '%s' is %s", f, m, what, x->name, xs, y->name, ys);
}

/* One low-rank half of LoHa / LoKr: up [out, r] (or [out, r, 1, 1]) and
 * down [r, N] or [r, in, kh, kw]; with a Tucker core t [r1, r2, kh, kw]:
 * up [r1, out], down [r2, in]. *out / *in: the half's delta rows and
 * elements per row; *rank: its rank. */
static lk_status low_rank_half(const char *f, const char *m, const lk_tensor *up, const lk_tensor *down,
                               const lk_tensor *t, int64_t *out, int64_t *in, int64_t *rank) {
    lk_status s;
    if ((s = check_factor(f, m, up, up->name, 1)) || (s = check_factor(f, m, down, down->name, 1))) return s;
    if (t) {
        if ((s = check_factor(f, m, t, t->name, 1))) return s;
        if (up->ndim != 2 || down->ndim != 2 || t->shape[0] != up->shape[0] || t->shape[1] != down->shape[0]) {
            char ts[96], us[96], ds[96];
            lk_shape_str(t, ts, sizeof ts);
            lk_shape_str(up, us, sizeof us);
            lk_shape_str(down, ds, sizeof ds);
            return lk_error(LK_ERR_SHAPE, "%s: %s: Tucker core '%s' is %s but '%s' is %s and '%s' is %s (expected "
                            "[r1, r2, kh, kw] with '%s' [r1, out] and '%s' [r2, in])", f, m, t->name, ts, up->name, us,
                            down->name, ds, up->name, down->name);
        }
        *out = up->shape[1];
        *in = down->shape[1] * (int64_t)(lk_tensor_numel(t) / (size_t)(t->shape[0] * t->shape[1]));
        *rank = down->shape[0];
        return LK_OK;
    }
    if (!trailing_ones(up)) return shape_pair_error(f, m, "the up factor must be [out, r] or [out, r, 1, 1]", up, down);
    if (up->shape[1] != down->shape[0]) return shape_pair_error(f, m, "ranks differ", up, down);
    *out = up->shape[0];
    *in = (int64_t)(lk_tensor_numel(down) / (size_t)down->shape[0]);
    *rank = down->shape[0];
    return LK_OK;
}

/* What a LyCORIS / dense module's tensors give: its delta's rows (out)
 * and elements per row (in), its rank, whether alpha / r applies, and the
 * alpha source when the algorithm fixes it. */
typedef struct lyco_shape {
    int64_t rank, out, in;
    int scaled;
    const char *src;
} lyco_shape;

/* Checks the keys of LyCORIS / dense module i before its algorithm's own
 * checks: every tensor but alpha F32/F16/BF16, no PEFT-only tensor, no
 * DoRA on a dense module. */
static lk_status check_lyco_keys(const lk_adapter *a, size_t i, const lk_tensor *const *br, lk_algo algo) {
    const char *f = a->file, *m = a->names[i];
    for (int r = 0; r < ROLE_COUNT; r++)
        if (br[r] && r != ROLE_ALPHA && !lk_dtype_is_fusable(br[r]->dtype))
            return lk_error(LK_ERR_DTYPE, "%s: %s: '%s' has dtype %s; adapter tensors must be F32, F16 or BF16", f, m,
                            br[r]->name, lk_dtype_name(br[r]->dtype));
    if (br[ROLE_MAG] || br[ROLE_BBIAS])
        return lk_error(LK_ERR_FORMAT, "%s: %s: '%s' is PEFT's, but the module is %s", f, m,
                        (br[ROLE_MAG] ? br[ROLE_MAG] : br[ROLE_BBIAS])->name, lk_algo_name(algo));
    if (br[ROLE_DORA] && (algo == LK_ALGO_FULL || algo == LK_ALGO_NORM || algo == LK_ALGO_SET || algo >= LK_ALGO_OFT))
        return lk_error(LK_ERR_FORMAT, "%s: %s: '%s' (DoRA) on a %s module", f, m, br[ROLE_DORA]->name,
                        lk_algo_name(algo));
    return LK_OK;
}

/* LoHa module i: four factors (two Tucker cores or none), two halves of
 * one delta shape; its tensors into a->mods[i]. */
static lk_status build_loha(lk_adapter *a, size_t i, const lk_tensor *const *br, lyco_shape *sh) {
    const char *f = a->file, *m = a->names[i];
    lk_lora_module *mod = &a->mods[i];
    static const enum role need[] = {ROLE_HW1A, ROLE_HW1B, ROLE_HW2A, ROLE_HW2B};
    for (size_t k = 0; k < 4; k++)
        if (!br[need[k]])
            return lk_error(LK_ERR_FORMAT, "%s: %s: LoHa needs hada_w1_a, hada_w1_b, hada_w2_a and hada_w2_b; "
                            "%s is missing", f, m, role_key(need[k]));
    if (!br[ROLE_HT1] != !br[ROLE_HT2])
        return lk_error(LK_ERR_FORMAT, "%s: %s: '%s' without %s (LoHa Tucker needs both cores)", f, m,
                        (br[ROLE_HT1] ? br[ROLE_HT1] : br[ROLE_HT2])->name, br[ROLE_HT1] ? "hada_t2" : "hada_t1");
    int64_t o2, i2, r2;
    lk_status s;
    if ((s = low_rank_half(f, m, br[ROLE_HW1A], br[ROLE_HW1B], br[ROLE_HT1], &sh->out, &sh->in, &sh->rank)) ||
        (s = low_rank_half(f, m, br[ROLE_HW2A], br[ROLE_HW2B], br[ROLE_HT2], &o2, &i2, &r2)))
        return s;
    if (o2 != sh->out || i2 != sh->in)
        return lk_error(LK_ERR_SHAPE, "%s: %s: the Hadamard halves differ: hada_w1 gives %lld x %lld, hada_w2 "
                        "%lld x %lld", f, m, (long long)sh->out, (long long)sh->in, (long long)o2, (long long)i2);
    mod->w1a = *br[ROLE_HW1A];
    mod->w1b = *br[ROLE_HW1B];
    mod->w2a = *br[ROLE_HW2A];
    mod->w2b = *br[ROLE_HW2B];
    if (br[ROLE_HT1]) mod->t1 = *br[ROLE_HT1], mod->t2 = *br[ROLE_HT2];
    return LK_OK;
}

/* One Kronecker factor of LoKr, full (w, rows x columns) or low-rank (wa,
 * wb, Tucker core t): *rows, *cols and *rank (0 when full). */
static lk_status lokr_factor(const char *f, const char *m, const lk_tensor *w, const lk_tensor *wa,
                             const lk_tensor *wb, const lk_tensor *t, int first, int64_t *rows, int64_t *cols,
                             int64_t *rank) {
    lk_status s;
    *rank = 0;
    if (!w) return low_rank_half(f, m, wa, wb, t, rows, cols, rank);
    if ((s = check_factor(f, m, w, w->name, 1))) return s;
    if (first && w->ndim != 2) return shape_pair_error(f, m, "lokr_w1 must be 2-D", w, w);
    *rows = w->shape[0];
    *cols = first ? w->shape[1] : (int64_t)(lk_tensor_numel(w) / (size_t)w->shape[0]);
    return LK_OK;
}

/* LoKr module i: lokr_w1 or its two factors, lokr_w2 or its two factors
 * (with a Tucker core or not); delta [a1 c2, b1 d2]; scale 1 when both are
 * full (LyCORIS). Its tensors into a->mods[i]. */
static lk_status build_lokr(lk_adapter *a, size_t i, const lk_tensor *const *br, lyco_shape *sh) {
    const char *f = a->file, *m = a->names[i];
    lk_lora_module *mod = &a->mods[i];
    const lk_tensor *w1 = br[ROLE_KW1], *w1a = br[ROLE_KW1A], *w1b = br[ROLE_KW1B];
    const lk_tensor *w2 = br[ROLE_KW2], *w2a = br[ROLE_KW2A], *w2b = br[ROLE_KW2B], *t2 = br[ROLE_KT2];
    if (!w1 == !(w1a || w1b) || (!w1 && (!w1a || !w1b)))
        return lk_error(LK_ERR_FORMAT, "%s: %s: LoKr needs lokr_w1, or lokr_w1_a and lokr_w1_b (found %s%s%s)", f,
                        m, w1 ? "lokr_w1 " : "", w1a ? "lokr_w1_a " : "", w1b ? "lokr_w1_b" : "");
    if (!w2 == !(w2a || w2b) || (!w2 && (!w2a || !w2b)))
        return lk_error(LK_ERR_FORMAT, "%s: %s: LoKr needs lokr_w2, or lokr_w2_a and lokr_w2_b (found %s%s%s)", f,
                        m, w2 ? "lokr_w2 " : "", w2a ? "lokr_w2_a " : "", w2b ? "lokr_w2_b" : "");
    if (t2 && w2) return lk_error(LK_ERR_FORMAT, "%s: %s: '%s' (a Tucker core) with a full lokr_w2", f, m, t2->name);
    int64_t a1, b1, c2, d2, r1, r2;
    lk_status s;
    if ((s = lokr_factor(f, m, w1, w1a, w1b, NULL, 1, &a1, &b1, &r1)) ||
        (s = lokr_factor(f, m, w2, w2a, w2b, t2, 0, &c2, &d2, &r2)))
        return s;
    if (r1 && r2 && r1 != r2)
        return shape_pair_error(f, m, "the two decomposed LoKr factors have different ranks", w1b, w2b);
    sh->out = a1 * c2;
    sh->in = b1 * d2;
    sh->rank = r1 ? r1 : r2;
    sh->scaled = !(w1 && w2);
    if (!sh->scaled) sh->src = "LoKr with both factors full: scale 1 (LyCORIS)";
    if (w1) mod->w1 = *w1;
    else mod->w1a = *w1a, mod->w1b = *w1b;
    if (w2) mod->w2 = *w2;
    else mod->w2a = *w2a, mod->w2b = *w2b;
    if (t2) mod->t2 = *t2;
    return LK_OK;
}

/* A full (diff / diff_b), norm (w_norm / b_norm) or set_weight module i:
 * the tensor itself at scale 1; its tensors into a->mods[i]. */
static lk_status build_dense(lk_adapter *a, size_t i, const lk_tensor *const *br, lk_algo algo, lyco_shape *sh) {
    const char *f = a->file, *m = a->names[i];
    lk_lora_module *mod = &a->mods[i];
    const lk_tensor *w = algo == LK_ALGO_FULL ? br[ROLE_DIFF] : algo == LK_ALGO_NORM ? br[ROLE_WNORM] : br[ROLE_SETW];
    const lk_tensor *b = algo == LK_ALGO_FULL ? br[ROLE_DIFFB] : algo == LK_ALGO_NORM ? br[ROLE_BNORM] : NULL;
    const lk_tensor *x = w ? w : b;
    if (!x) return lk_error(LK_ERR_FORMAT, "%s: %s: no tensor", f, m);
    if (x->ndim < 1 || lk_tensor_numel(x) == 0)
        return lk_error(LK_ERR_SHAPE, "%s: %s: '%s' has no elements", f, m, x->name);
    if (b && b->ndim != 1) return shape_pair_error(f, m, "a bias delta must be 1-D", b, b);
    if (w) mod->dense = *w;
    if (b) mod->bias = *b;
    sh->out = x->shape[0];
    sh->in = (int64_t)(lk_tensor_numel(x) / (size_t)sh->out);
    sh->scaled = 0;
    sh->src = "none: dense, scale 1";
    return LK_OK;
}

/* OFT / BOFT module i: oft_blocks [n, b, b] (OFT) or [m, n, b, b] (BOFT)
 * with square blocks, and an optional rescale of n b values (LyCORIS
 * [out, 1, ...]); the delta has n b rows and any columns. Its alpha is the
 * rotation's constraint, read as is (no alpha / r); *algo becomes BOFT for
 * a 4-D oft_blocks. */
/* PEFT's OFT module i: oft_R.weight [n, b (b - 1) / 2] (n blocks of b
 * columns, n 1 with block_share), its options from adapter_config.json
 * (PEFT's OFTConfig defaults without one); the delta has any rows, and its
 * columns are checked against the weight by the fuse (oft.c). */
static lk_status build_oft_peft(lk_adapter *a, size_t i, const lk_tensor *const *br, lyco_shape *sh) {
    const char *f = a->file, *m = a->names[i];
    lk_lora_module *mod = &a->mods[i];
    const lk_tensor *x = br[ROLE_OFTR];
    char xs[96];
    lk_shape_str(x, xs, sizeof xs);
    if (br[ROLE_OFTB] || br[ROLE_RESC] || br[ROLE_ALPHA])
        return lk_error(LK_ERR_FORMAT, "%s: %s: '%s' (PEFT's OFT) with '%s' (LyCORIS's) in one module", f, m, x->name,
                        (br[ROLE_OFTB] ? br[ROLE_OFTB] : br[ROLE_RESC] ? br[ROLE_RESC] : br[ROLE_ALPHA])->name);
    if (a->has_config && (!a->cfg.oft || a->cfg.oft_opts.boft))
        return lk_error(LK_ERR_FORMAT, "%s: %s: '%s' is PEFT's OFT but %s is not peft_type \"OFT\"", f, m, x->name,
                        a->config_path);
    int64_t b = 0;
    for (int64_t c = 2; x->ndim == 2 && c <= 4096 && c * (c - 1) / 2 <= x->shape[1]; c++)
        if (c * (c - 1) / 2 == x->shape[1]) b = c;
    if (!b || x->shape[0] < 1)
        return lk_error(LK_ERR_SHAPE, "%s: %s: '%s' is %s; PEFT's oft_R.weight must be [n, b (b - 1) / 2] (n blocks "
                        "of b columns, b from 2 to 4096)", f, m, x->name, xs);
    sh->out = 0; /* any: the rotation acts on the columns */
    sh->in = x->shape[0] * b;
    sh->rank = b;
    sh->scaled = 0;
    sh->src = NULL;
    mod->w1 = *x;
    mod->oft_peft = a->has_config ? a->cfg.oft_opts : (lk_oft_peft){.coft = 0, .eps = 6e-5, .neumann_terms = 5, .block_share = -1};
    return LK_OK;
}

/* PEFT's BOFT module i: boft_R [m, n, b, b] (m butterfly stages; m > 1
 * needs b even and n a multiple of 2^(m - 1), as PEFT checks) and boft_s
 * [out, 1] (a conv's [1, out]); n b columns, boft_s's rows. */
static lk_status build_boft_peft(lk_adapter *a, size_t i, const lk_tensor *const *br, lyco_shape *sh) {
    const char *f = a->file, *m = a->names[i];
    lk_lora_module *mod = &a->mods[i];
    const lk_tensor *x = br[ROLE_BOFTR], *rs = br[ROLE_BOFTS];
    if (!x || !rs)
        return lk_error(LK_ERR_FORMAT, "%s: %s: PEFT's BOFT needs boft_R and boft_s; '%s' is alone", f, m,
                        (x ? x : rs)->name);
    if (a->has_config && !(a->cfg.oft && a->cfg.oft_opts.boft))
        return lk_error(LK_ERR_FORMAT, "%s: %s: '%s' is PEFT's BOFT but %s is not peft_type \"BOFT\"", f, m, x->name,
                        a->config_path);
    char xs[96], ss[96];
    lk_shape_str(x, xs, sizeof xs);
    lk_shape_str(rs, ss, sizeof ss);
    if (x->ndim != 4 || x->shape[2] != x->shape[3] || x->shape[2] < 1 || x->shape[2] > 4096 || x->shape[1] < 1 ||
        x->shape[0] < 1)
        return lk_error(LK_ERR_SHAPE, "%s: %s: '%s' is %s; PEFT's boft_R must be [m, n, b, b]", f, m, x->name, xs);
    if (x->shape[0] > 16 || (x->shape[0] > 1 && (x->shape[2] % 2 || x->shape[1] % ((int64_t)1 << (x->shape[0] - 1)))))
        return lk_error(LK_ERR_SHAPE, "%s: %s: '%s' is %s: PEFT's butterfly of %lld stages (boft_n_butterfly_factor "
                        "%lld) needs an even block size and a block count that is a multiple of 2^%lld", f, m, x->name,
                        xs, (long long)x->shape[0], (long long)x->shape[0], (long long)x->shape[0] - 1);
    if (rs->ndim != 2 || (rs->shape[0] != 1 && rs->shape[1] != 1) || lk_tensor_numel(rs) < 1)
        return lk_error(LK_ERR_SHAPE, "%s: %s: '%s' is %s; PEFT's boft_s must be [out, 1] (a conv's [1, out])", f, m,
                        rs->name, ss);
    sh->out = (int64_t)lk_tensor_numel(rs);
    sh->in = x->shape[1] * x->shape[2];
    sh->rank = x->shape[2];
    sh->scaled = 0;
    sh->src = NULL;
    mod->w1 = *x;
    mod->w2 = *rs;
    mod->oft_peft = (lk_oft_peft){.neumann_terms = 0, .boft = 1, .block_share = 0};
    return LK_OK;
}

static lk_status build_oft(lk_adapter *a, size_t i, const lk_tensor *const *br, lyco_shape *sh, lk_algo *algo) {
    const char *f = a->file, *m = a->names[i];
    lk_lora_module *mod = &a->mods[i];
    if (br[ROLE_OFTR]) return build_oft_peft(a, i, br, sh);
    if (br[ROLE_BOFTR] || br[ROLE_BOFTS]) return build_boft_peft(a, i, br, sh);
    const lk_tensor *x = br[ROLE_OFTB], *rs = br[ROLE_RESC];
    if (!x) return lk_error(LK_ERR_FORMAT, "%s: %s: '%s' without oft_blocks", f, m, rs->name);
    const int nd = x->ndim;
    char xs[96];
    lk_shape_str(x, xs, sizeof xs);
    if ((nd != 3 && nd != 4) || x->shape[nd - 1] != x->shape[nd - 2] || lk_tensor_numel(x) == 0 ||
        x->shape[nd - 3] > INT64_MAX / (x->shape[nd - 1] ? x->shape[nd - 1] : 1))
        return lk_error(LK_ERR_SHAPE, "%s: %s: '%s' is %s; oft_blocks must be [n, b, b] (OFT) or [m, n, b, b] (BOFT)",
                        f, m, x->name, xs);
    const int64_t b = x->shape[nd - 1], nb = x->shape[nd - 3];
    if (nd == 4 && (b % 2 || x->shape[0] > 62)) /* BOFT's stages pair halves of blocks */
        return lk_error(LK_ERR_SHAPE, "%s: %s: '%s' is %s; BOFT needs an even block size and at most 62 stages", f, m,
                        x->name, xs);
    for (int64_t i = 1; nd == 4 && i < x->shape[0]; i++)
        if (nb % ((int64_t)1 << i))
            return lk_error(LK_ERR_SHAPE, "%s: %s: '%s' is %s: BOFT stage %lld needs the %lld blocks in groups of %lld",
                            f, m, x->name, xs, (long long)i, (long long)nb, (long long)((int64_t)1 << i));
    sh->out = nb * b;
    if (rs && lk_tensor_numel(rs) != (size_t)sh->out)
        return shape_pair_error(f, m, "the rescale needs one value per row of the n b rows the blocks rotate", rs, x);
    *algo = nd == 4 ? LK_ALGO_BOFT : LK_ALGO_OFT;
    sh->in = 0; /* any: the rotation acts on the rows */
    sh->rank = x->shape[nd - 1];
    sh->scaled = 0;
    sh->src = NULL;
    mod->w1 = *x;
    if (rs) mod->w2 = *rs;
    return LK_OK;
}

/* GLoRA module i (LyCORIS 4's layout): a1 [in, r] (a conv's [in, r, 1, 1]),
 * a2 [r, in], b1 [out, r], b2 [r, N] (N = in, or in kh kw for a conv);
 * delta W a1 a2 + b1 b2 at alpha / r. */
static lk_status build_glora(lk_adapter *a, size_t i, const lk_tensor *const *br, lyco_shape *sh) {
    const char *f = a->file, *m = a->names[i];
    lk_lora_module *mod = &a->mods[i];
    static const enum role need[] = {ROLE_GA1, ROLE_GA2, ROLE_GB1, ROLE_GB2};
    for (size_t k = 0; k < 4; k++)
        if (!br[need[k]])
            return lk_error(LK_ERR_FORMAT, "%s: %s: GLoRA needs a1.weight, a2.weight, b1.weight and b2.weight; %s is "
                            "missing", f, m, role_key(need[k]));
    const lk_tensor *a1 = br[ROLE_GA1], *a2 = br[ROLE_GA2], *b1 = br[ROLE_GB1], *b2 = br[ROLE_GB2];
    lk_status s;
    int64_t o, n, r;
    if ((s = low_rank_half(f, m, b1, b2, NULL, &o, &n, &r))) return s;
    if (a1->ndim < 2 || a2->ndim < 2 || !trailing_ones(a1) || !trailing_ones(a2) || a1->shape[1] != r ||
        a2->shape[0] != r || a2->shape[1] != a1->shape[0] || lk_tensor_numel(a1) != (size_t)(a1->shape[0] * r))
        return lk_error(LK_ERR_SHAPE, "%s: %s: GLoRA's a1 '%s' and a2 '%s' must be [in, r] and [r, in] with r = %lld "
                        "(b1 '%s', b2 '%s'): old-layout GLoRA (a1 [r, in]) is not supported", f, m, a1->name,
                        a2->name, (long long)r, b1->name, b2->name);
    sh->out = o;
    sh->in = n;
    sh->rank = r;
    mod->w1a = *a1;
    mod->w1b = *a2;
    mod->w2a = *b1;
    mod->w2b = *b2;
    return LK_OK;
}

/* Alpha of a LyCORIS module scaled by alpha / r: its .alpha tensor (0
 * read as r, as LyCORIS does) or r; an .alpha on an unscaled module is
 * ignored with a warning (LoKr with both factors full: silently). */
static lk_status lyco_alpha(const lk_adapter *a, size_t i, const lk_tensor *alpha_t, lk_algo algo, lyco_shape *sh,
                            double *alpha) {
    *alpha = (double)sh->rank;
    if (sh->scaled && alpha_t) {
        lk_status s = read_alpha(a, alpha_t, alpha);
        if (s) return s;
        /* alpha 0: r for LyCORIS (and lorakit); ComfyUI (alpha / rank) and PEFT
         * (alpha / r) take it as it is: scale 0 */
        const int zero_is_r = a->convention == LK_CONVENTION_LORAKIT || a->convention == LK_CONVENTION_LYCORIS;
        sh->src = *alpha != 0.0 ? ".alpha tensor"
                  : zero_is_r   ? ".alpha tensor (0: r, as LyCORIS)"
                  : a->convention == LK_CONVENTION_COMFYUI ? ".alpha tensor (0: scale 0, as ComfyUI)"
                                                           : ".alpha tensor (0: scale 0, as PEFT)";
        if (*alpha == 0.0 && zero_is_r) *alpha = (double)sh->rank;
    } else if (sh->scaled) {
        sh->src = "default r";
    } else if (alpha_t && algo != LK_ALGO_LOKR) {
        lk_log(LK_LOG_WARN, "%s: %s: '%s' ignored: a %s module has no alpha", a->file, a->names[i], alpha_t->name,
               lk_algo_name(algo));
    }
    return LK_OK;
}

/* LoHa, LoKr, full, norm, set_weight: module i from its tensors, in steps:
 * check the keys, the algorithm's shapes and tensors, alpha, then the
 * scale and the module (its alpha source owned by a->sources[i]). */
static lk_status build_lyco(lk_adapter *a, size_t i, const lk_tensor *const *br, lk_algo algo) {
    const char *f = a->file, *m = a->names[i];
    lk_lora_module *mod = &a->mods[i];
    lyco_shape sh = {0, 0, 0, 1, NULL}; /* alpha / r applies unless the algorithm says otherwise */
    double alpha;
    lk_status s = check_lyco_keys(a, i, br, algo);
    if (!s) s = algo == LK_ALGO_LOHA    ? build_loha(a, i, br, &sh)
                : algo == LK_ALGO_LOKR  ? build_lokr(a, i, br, &sh)
                : algo == LK_ALGO_OFT || algo == LK_ALGO_BOFT ? build_oft(a, i, br, &sh, &algo)
                : algo == LK_ALGO_GLORA ? build_glora(a, i, br, &sh)
                                        : build_dense(a, i, br, algo, &sh);
    char osrc[160];
    if (!s && (br[ROLE_BOFTR] || br[ROLE_BOFTS])) { /* PEFT's BOFT: no alpha */
        alpha = 0.0;
        sh.src = "none (PEFT BOFT: exact Cayley, boft_s)";
    } else if (!s && br[ROLE_OFTR]) { /* PEFT's OFT: no alpha; the options it fuses with */
        const lk_oft_peft *o = &mod->oft_peft;
        char eb[LK_NUM_STR_MAX], terms[48] = "exact Cayley";
        alpha = 0.0;
        if (o->neumann_terms) snprintf(terms, sizeof terms, "Cayley-Neumann, %d terms", o->neumann_terms);
        snprintf(osrc, sizeof osrc, "none (PEFT OFT%s: %s%s%s)",
                 a->has_config ? "" : " without adapter_config.json: OFTConfig's defaults", terms,
                 o->coft ? ", coft eps " : "", o->coft ? lk_num_str(o->eps, eb) : "");
        sh.src = osrc;
    } else if (!s && (algo == LK_ALGO_OFT || algo == LK_ALGO_BOFT)) { /* alpha: the constraint, as read (none: 0) */
        alpha = 0.0;
        if (br[ROLE_ALPHA]) s = read_alpha(a, br[ROLE_ALPHA], &alpha);
        sh.src = br[ROLE_ALPHA] ? ".alpha tensor (OFT constraint)" : "none (OFT constraint 0: unconstrained)";
    } else if (!s) {
        s = lyco_alpha(a, i, br[ROLE_ALPHA], algo, &sh, &alpha);
    }
    if (s) return s;
    char *source = source_str(sh.src, NULL);
    if (!source) return lk_error(LK_ERR_NOMEM, "%s: out of memory", f);
    a->sources[i] = source;
    double scale = sh.scaled ? alpha / (double)sh.rank : 1.0;
    if (!isfinite((float)scale))
        return lk_error(LK_ERR_NONFINITE, "%s: %s: scale alpha/r = %g is not finite as a float", f, m, scale);
    mod->module = m;
    mod->target = NULL;
    mod->rank = (int)sh.rank;
    mod->alpha = sh.scaled || algo == LK_ALGO_OFT || algo == LK_ALGO_BOFT ? alpha : 1.0;
    mod->scale = scale;
    mod->alpha_source = source;
    mod->algo = algo;
    mod->out = sh.out;
    mod->in = sh.in;
    if (br[ROLE_DORA]) mod->dora_scale = *br[ROLE_DORA];
    return LK_OK;
}

static int name_cmp_idx(const void *pa, const void *pb, void *ctx) {
    char **names = ctx;
    return strcmp(names[*(const size_t *)pa], names[*(const size_t *)pb]);
}

/* A key of module i, for messages (its stem when it has no factor key). */
static const char *first_key(const lk_adapter *a, size_t i) {
    const lk_tensor *t[LK_MODULE_MAX_TENSORS];
    size_t n = lk_lora_module_tensors(&a->mods[i], t);
    return n && t[0]->name ? t[0]->name : a->stems[i];
}

/* The name of role r's tensor in a's format, for messages. */
static const char *role_name(const lk_adapter *a, enum role r) {
    switch (r) {
    case ROLE_A: return lk_adapter_factor_name(a, 0);
    case ROLE_B: return lk_adapter_factor_name(a, 1);
    case ROLE_ALPHA: return "alpha";
    case ROLE_MAG: return "lora_magnitude_vector";
    case ROLE_BBIAS: return "lora_B bias";
    default: return role_key(r);
    }
}

/* The module arrays (mods, names, stems, targets, bias_targets, sources,
 * embed) for at most n modules, owned by a; every config of the adapter on
 * one matching budget. */
static lk_status alloc_modules(lk_adapter *a, size_t n) {
    if (a->has_config) lk_peft_config_share_budget(&a->cfg, &a->re_budget);
    for (size_t i = 0; i < a->n_meta; i++) lk_peft_config_share_budget(&a->meta[i].cfg, &a->re_budget);
    size_t cap = n + 1;
    a->mods = lk_calloc(cap, sizeof *a->mods);
    a->names = lk_calloc(cap, sizeof *a->names);
    a->stems = lk_calloc(cap, sizeof *a->stems);
    a->targets = lk_calloc(cap, sizeof *a->targets);
    a->bias_targets = lk_calloc(cap, sizeof *a->bias_targets);
    a->sources = lk_calloc(cap, sizeof *a->sources);
    a->embed = lk_calloc(cap, sizeof *a->embed);
    if (!a->mods || !a->names || !a->stems || !a->targets || !a->bias_targets || !a->sources || !a->embed)
        return lk_error(LK_ERR_NOMEM, "%s: out of memory", a->file);
    return LK_OK;
}
/* The keys of one module: the run of sorted keys ki[i..*end) sharing
 * ki[i]'s stem, by role into by_role (ROLE_COUNT entries, all NULL on
 * entry). Two keys of one role are an error naming both. */
static lk_status group_keys(const lk_adapter *a, const keyinfo *ki, size_t n, size_t i, const lk_tensor **by_role,
                            size_t *end) {
    size_t j = i;
    for (; j < n && ki[j].stem_len == ki[i].stem_len && !memcmp(ki[j].t->name, ki[i].t->name, ki[i].stem_len); j++) {
        if (by_role[ki[j].role])
            return lk_error(LK_ERR_FORMAT, "%s: '%s' and '%s' are both the %s of one module", a->file,
                            by_role[ki[j].role]->name, ki[j].t->name, role_name(a, ki[j].role));
        by_role[ki[j].role] = ki[j].t;
    }
    *end = j;
    return LK_OK;
}

/* Whether stem (len bytes) ends in ".processor.<last>", last one of to_q, to_k, to_v, to_out. */
static int processor_stem(const char *stem, size_t len) {
    static const char *const last[] = {".processor.to_q", ".processor.to_k", ".processor.to_v", ".processor.to_out"};
    for (size_t i = 0; i < 4; i++) {
        size_t n = strlen(last[i]);
        if (len > n && !memcmp(stem + len - n, last[i], n)) return 1;
    }
    return 0;
}

/* Module k's stem (its full name; an old attention-processor stem as the
 * module it stands for) and name, from key ki; both owned by a (a->n is
 * k + 1 from here on). */
static lk_status add_stem(lk_adapter *a, size_t k, const keyinfo *ki) {
    const char *key = ki->t->name;
    /* also "<attn>.processor.to_q" with any factor names: ComfyUI maps its UNets' diffusers names so
     * (model_lora_keys_unet: ".to_" -> ".processor.to_", "to_out.0" -> "to_out") */
    int old_attn = !strncmp(key + ki->stem_len, "_lora.", 6) || processor_stem(key, ki->stem_len);
    char *stem = old_attn ? old_attn_module(key, ki->stem_len) : lk_malloc(ki->stem_len + 1);
    if (!stem) return lk_error(LK_ERR_NOMEM, "%s: out of memory", a->file);
    if (!old_attn) {
        memcpy(stem, key, ki->stem_len);
        stem[ki->stem_len] = '\0';
    }
    a->stems[k] = stem;
    a->names[k] = module_name(a->format, stem, strlen(stem));
    a->n = k + 1; /* owned strings are freed from here on */
    return a->names[k] ? LK_OK : lk_error(LK_ERR_NOMEM, "%s: out of memory", a->file);
}

/* The algorithm of module k's tensors (-1: none names one): keys of two
 * algorithms in one module are an error naming a key of each. */
static lk_status module_algo(const lk_adapter *a, size_t k, const lk_tensor *const *by_role, int *algo) {
    const lk_tensor *algo_key = NULL;
    *algo = -1;
    for (int r = 0; r < ROLE_COUNT; r++) {
        int ar = by_role[r] ? role_algo((enum role)r) : -1;
        if (ar < 0) continue;
        if (*algo >= 0 && ar != *algo)
            return lk_error(LK_ERR_FORMAT, "%s: %s: '%s' (%s) and '%s' (%s) in one module", a->file, a->names[k],
                            algo_key->name, lk_algo_name((lk_algo)*algo), by_role[r]->name, lk_algo_name((lk_algo)ar));
        if (*algo < 0) *algo = ar, algo_key = by_role[r];
    }
    return LK_OK;
}

/* Checks LoRA module k's keys before it is built: both factors there, no
 * .alpha in a PEFT file, both factors embedding or both linear; notes
 * DoRA (a->dora) and an embedding (a->embed[k]). */
static lk_status check_lora_keys(lk_adapter *a, size_t k, const lk_tensor *const *by_role) {
    const char *f = a->file, *m = a->names[k];
    const lk_tensor *A = by_role[ROLE_A], *B = by_role[ROLE_B];
    if (!A || !B) {
        const lk_tensor *only = NULL;
        for (int r = ROLE_COUNT - 1; r >= 0; r--)
            if (by_role[r]) only = by_role[r];
        const char *an = role_name(a, ROLE_A), *bn = role_name(a, ROLE_B);
        if (!A && !B) return lk_error(LK_ERR_FORMAT, "%s: %s: '%s' without %s and %s", f, m, only->name, an, bn);
        return lk_error(LK_ERR_FORMAT, "%s: %s: %s without %s", f, m, A ? an : bn, A ? bn : an);
    }
    if (a->format == LK_FORMAT_PEFT && by_role[ROLE_ALPHA])
        return lk_error(LK_ERR_FORMAT, "%s: %s: PEFT adapters keep alpha in adapter_config.json, not in '%s'", f, m,
                        by_role[ROLE_ALPHA]->name);
    if (by_role[ROLE_MAG]) a->dora = 1;
    size_t al = strlen(A->name), bl = strlen(B->name);
    int ea = al >= 16 && !strcmp(A->name + al - 16, "lora_embedding_A");
    int eb = bl >= 16 && !strcmp(B->name + bl - 16, "lora_embedding_B");
    if (ea != eb)
        return lk_error(LK_ERR_FORMAT, "%s: %s: '%s' and '%s' mix an embedding LoRA and a linear one", f, m, A->name,
                        B->name);
    a->embed[k] = (unsigned char)ea;
    return LK_OK;
}

/* Checks the modules as a whole: DoRA on every module or none, and no two
 * stems giving one module name (e.g. "transformer.x" and "x"; found by
 * sorting an index of the names, its only allocation, freed here). */
static lk_status check_modules(const lk_adapter *a) {
    const char *f = a->file;
    for (size_t i = 0; i < a->n; i++)
        if (a->dora && !a->mods[i].magnitude.name)
            return lk_error(LK_ERR_FORMAT, "%s: %s has no lora_magnitude_vector but other modules do (DoRA)", f,
                            a->names[i]);
    size_t *ord = lk_malloc((a->n ? a->n : 1) * sizeof *ord);
    if (!ord) return lk_error(LK_ERR_NOMEM, "%s: out of memory", f);
    for (size_t i = 0; i < a->n; i++) ord[i] = i;
    qsort_r(ord, a->n, sizeof *ord, name_cmp_idx, a->names);
    lk_status s = LK_OK;
    for (size_t i = 1; i < a->n && !s; i++)
        if (!strcmp(a->names[ord[i]], a->names[ord[i - 1]])) {
            /* stems, or keys where the stems are equal too (an old attention-processor module and its PEFT twin) */
            int same = !strcmp(a->stems[ord[i - 1]], a->stems[ord[i]]);
            s = lk_error(LK_ERR_FORMAT, "%s: '%s' and '%s' are the same module %s", f,
                         same ? first_key(a, ord[i - 1]) : a->stems[ord[i - 1]],
                         same ? first_key(a, ord[i]) : a->stems[ord[i]], a->names[ord[i]]);
        }
    lk_free(ord);
    return s;
}

/* Pairs the sorted keys ki[0..n) into modules, in steps: group one stem's
 * keys by role, name the module, find its algorithm, build it (LyCORIS /
 * dense, or LoRA after its key checks); then check the modules as a whole.
 * What is built is owned by a. */
static lk_status pair(lk_adapter *a, keyinfo *ki, size_t n) {
    lk_status s = alloc_modules(a, n);
    for (size_t i = 0, j = 0; !s && i < n; i = j) {
        const lk_tensor *by_role[ROLE_COUNT] = {NULL};
        int algo;
        size_t k = a->n;
        if ((s = group_keys(a, ki, n, i, by_role, &j))) {
            lk_error_at(s, NULL, ki[i].t->name);
            break;
        }
        if (k == n + 1) {
            s = lk_error(LK_ERR_FORMAT, "%s: more modules than factor pairs", a->file);
            break;
        }
        if ((s = add_stem(a, k, &ki[i]))) break;
        if (!(s = module_algo(a, k, by_role, &algo))) {
            if (algo > LK_ALGO_LORA) s = build_lyco(a, k, by_role, (lk_algo)algo);
            else if (!(s = check_lora_keys(a, k, by_role))) s = build_module(a, k, by_role);
        }
        if (s) lk_error_at(s, NULL, a->names[k]); /* the module the message names */
    }
    return s ? s : check_modules(a);
}

/* Checks the replacements against the modules: a module both LoRA-wrapped
 * and in modules_to_save, and (bias = "lora_only", PEFT < 0.7 layout) a
 * "<m>.bias" whose <m> is no LoRA module. */
static lk_status check_replacements(const lk_adapter *a) {
    for (size_t r = 0; r < a->n_rep; r++) {
        const char *nm = a->rep_names[r];
        const char *dot = strrchr(nm, '.');
        size_t ml = dot ? (size_t)(dot - nm) : 0;
        int is_lora = 0;
        for (size_t i = 0; i < a->n && !is_lora; i++)
            is_lora = strlen(a->names[i]) == ml && !strncmp(a->names[i], nm, ml);
        if (is_lora && !strcmp(a->reps[r].why, "modules_to_save"))
            return lk_error(LK_ERR_FORMAT, "%s: '%s' is saved whole (modules_to_save) but %.*s also has LoRA factors",
                            a->file, a->reps[r].key, (int)ml, nm);
        if (!strcmp(a->reps[r].why, "base_layer") && !is_lora)
            return lk_error(LK_ERR_FORMAT, "%s: '%s' is a LoRA layer's base weight, but %.*s has no LoRA factors",
                            a->file, a->reps[r].key, (int)ml, nm);
        if (!strcmp(a->reps[r].why, "bias") && a->cfg.bias == LK_PEFT_BIAS_LORA_ONLY && !is_lora &&
            !strstr(a->reps[r].key, ".base_layer.bias"))
            return lk_error(LK_ERR_FORMAT, "%s: '%s' is a bias, but with bias = \"lora_only\" PEFT saves only the "
                            "biases of LoRA modules", a->file, a->reps[r].key);
    }
    return LK_OK;
}

static const char *const g_algo_names[LK_ALGO_COUNT] = {"lora", "loha",  "lokr", "full", "norm",
                                                          "set_weight", "oft", "boft", "glora"};

const char *lk_algo_name(lk_algo a) { return (int)a >= 0 && a < LK_ALGO_COUNT ? g_algo_names[a] : "unknown"; }

/* Every tensor slot of a module (present or not). */
#define N_SLOTS 15
static void module_slots(lk_lora_module *m, lk_tensor **t) {
    lk_tensor *const v[N_SLOTS] = {&m->A, &m->B, &m->magnitude, &m->bias, &m->mid, &m->w1a, &m->w1b, &m->w2a,
                                   &m->w2b, &m->t1, &m->t2, &m->w1, &m->w2, &m->dense, &m->dora_scale};
    memcpy(t, v, sizeof v);
}

size_t lk_lora_module_tensors(const lk_lora_module *m, const lk_tensor **out) {
    lk_tensor *t[N_SLOTS];
    module_slots((lk_lora_module *)m, t);
    size_t n = 0;
    for (size_t k = 0; k < N_SLOTS; k++)
        if (t[k]->name && n < LK_MODULE_MAX_TENSORS) out[n++] = t[k];
    return n;
}

/* Every module's tensor slot that holds a tensor, then each replacement's,
 * in order, carved from c (each tensor 16-byte aligned); with a->factors
 * set, each tensor's data is read there. A factor that does not fit
 * leaves c overflowed. */
static lk_status carve_factors(lk_adapter *a, lk_carve *c) {
    for (size_t i = 0; i < a->n + a->n_rep; i++) {
        lk_tensor *ts[N_SLOTS] = {NULL};
        if (i < a->n) module_slots(&a->mods[i], ts);
        else ts[0] = &a->reps[i - a->n].t;
        for (size_t k = 0; k < N_SLOTS; k++) {
            if (!ts[k] || !ts[k]->name) continue;
            size_t at = lk_carve_part(c, ts[k]->nbytes, 1, 16);
            if (!a->factors) continue;
            unsigned char *p = (unsigned char *)a->factors + at;
            lk_status s = lk_st_read(a->st, st_index(a->st, ts[k]), 0, p, ts[k]->nbytes);
            if (s) return s;
            ts[k]->data = p;
        }
    }
    lk_carve_part(c, 0, 1, 16); /* the block ends 16-byte aligned */
    return LK_OK;
}

/* Copies every module's tensors and the replacements out of the file into
 * a->factors (one allocation, laid out by carve_factors). */
static lk_status copy_factors(lk_adapter *a) {
    lk_carve lay = {0};
    carve_factors(a, &lay); /* only lays out: a->factors is NULL */
    if (lay.overflow) return lk_error(LK_ERR_NOMEM, "%s: the factors' size overflows", a->file);
    a->factors = lk_carve_alloc(&lay);
    if (!a->factors)
        return lk_error(LK_ERR_NOMEM, "%s: out of memory for %zu bytes of LoRA factors", a->file, lay.bytes);
    lk_carve at = {0};
    return carve_factors(a, &at);
}

/* The file and config of an in-memory adapter: its label, its config text. */
static lk_status from_memory(lk_adapter *a, const lk_adapter_source *src) {
    if (!(a->file = lk_strdup(a->path))) return lk_error(LK_ERR_NOMEM, "%s: out of memory", a->path);
    if (!src->config_json) return LK_OK;
    char *cfg = lk_path_join(a->path, "adapter_config.json");
    if (!cfg) return lk_error(LK_ERR_NOMEM, "%s: out of memory", a->path);
    return keep_config(a, cfg, lk_peft_config_parse(src->config_json, strlen(src->config_json), cfg, &a->cfg));
}

static lk_status open_any(const char *path, const lk_adapter_source *src, const lk_adapter_opts *opts,
                          lk_adapter **out);

lk_status lk_adapter_open(const char *path, lk_adapter_format format, lk_adapter **out) {
    lk_adapter_opts o = {.format = format};
    return lk_adapter_open_opts(path, &o, out);
}

lk_status lk_adapter_open_opts(const char *path, const lk_adapter_opts *opts, lk_adapter **out) {
    lk_status s = open_any(path, NULL, opts, out);
    return s ? lk_error_at(s, path, NULL) : LK_OK;
}

lk_status lk_adapter_open_mem(const lk_adapter_source *src, const lk_adapter_opts *opts, lk_adapter **out) {
    if (!src || !src->label || (src->n && !src->bytes))
        return lk_error(LK_ERR_ARG, "lk_adapter_open_mem: NULL argument");
    lk_status s = open_any(src->label, src, opts, out);
    return s ? lk_error_at(s, src->label, NULL) : LK_OK;
}

/* The file's keys sorted out (a->file and a->st open): each LoRA key into
 * *ki (allocated here, one entry per key of the file; the caller frees it,
 * on failure too), *nl of them; every other key a tensor PEFT saved whole
 * into a->reps (allocated here with rep_names / rep_targets, owned by a). A
 * key no format reads is an error naming it. */
static lk_status split_keys(lk_adapter *a, lk_adapter_format format, keyinfo **kip, size_t *nl) {
    size_t n = lk_st_count(a->st);
    keyinfo *ki = *kip = lk_malloc((n ? n : 1) * sizeof *ki);
    a->reps = lk_calloc(n ? n : 1, sizeof *a->reps);
    a->rep_names = lk_calloc(n ? n : 1, sizeof *a->rep_names);
    a->rep_targets = lk_calloc(n ? n : 1, sizeof *a->rep_targets);
    if (!ki || !a->reps || !a->rep_names || !a->rep_targets) return lk_error(LK_ERR_NOMEM, "%s: out of memory", a->file);
    *nl = 0;
    for (size_t i = 0; i < n; i++) {
        const lk_tensor *t = lk_st_tensor(a->st, i);
        keyinfo *k = &ki[*nl];
        k->t = t;
        k->fam = classify(t->name, &k->role, &k->stem_len);
        if (k->fam != FAM_NONE) {
            (*nl)++;
            continue;
        }
        if (format != LK_FORMAT_AUTO && format != LK_FORMAT_PEFT)
            return lk_error_at(lk_error(LK_ERR_FORMAT, "%s: key '%s' is not a %s adapter key", a->file, t->name,
                                        lk_adapter_format_name(format)),
                               NULL, t->name);
        const char *why = NULL;
        lk_status s = other_key(a, t->name, &a->rep_names[a->n_rep], &why);
        if (s) return lk_error_at(s, NULL, t->name);
        a->reps[a->n_rep] = (lk_adapter_tensor){.key = t->name, .why = why, .t = *t};
        a->n_rep++;
    }
    return LK_OK;
}

/* The adapter's format from its LoRA keys ki[0..nl) (detect), then what
 * the format decides: replacements only in PEFT, the config only for PEFT
 * (another format drops it with a warning), alpha / rank from the file's
 * metadata without one, rsLoRA. */
static lk_status settle_format(lk_adapter *a, const keyinfo *ki, size_t nl, lk_adapter_format format) {
    lk_status s = detect(a, ki, nl, format);
    if (s) return s;
    if (a->n_rep && a->format != LK_FORMAT_PEFT)
        return lk_error(LK_ERR_FORMAT, "%s: key '%s' is saved whole, which only PEFT adapters do, but the file reads "
                        "as %s", a->file, a->reps[0].key, lk_adapter_format_name(a->format));
    if (a->has_config && a->format != LK_FORMAT_PEFT) /* it gives r, alpha, rsLoRA (lora_alpha: config_alpha) */
        lk_log(LK_LOG_INFO, "%s: the adapter is read as %s, with r, lora_alpha, rank/alpha_pattern and use_rslora "
               "from %s", a->path, lk_adapter_format_name(a->format), a->config_path);
    if (!a->has_config && (s = read_metadata(a))) return s;
    a->rslora = a->has_config ? a->cfg.rslora : (a->n_meta == 1 && a->meta[0].cfg.rslora);
    return LK_OK;
}

/* 1 if module i is scaled by alpha / r (not a dense, norm, set_weight or
 * full-factor LoKr module, whose source says "none: ..." / "LoKr with"). */
static int alpha_scaled(const lk_adapter *a, size_t i) {
    const char *src = a->sources[i];
    return strncmp(src, "none", 4) && strncmp(src, "LoKr with", 9);
}

/* The caller's alpha (lk_adapter_opts.alpha) on every scaled module the
 * file leaves at "default r"; a module the file gives another alpha is
 * LK_ERR_CONFIG naming both. */
static lk_status caller_alpha(lk_adapter *a) {
    const double ua = a->user_alpha;
    for (size_t i = 0; a->has_user_alpha && i < a->n; i++) {
        lk_lora_module *mod = &a->mods[i];
        if (!alpha_scaled(a, i)) continue;
        if (strcmp(a->sources[i], "default r")) {
            char fb[LK_NUM_STR_MAX], ub[LK_NUM_STR_MAX];
            if (mod->alpha == ua) continue;
            return lk_error(LK_ERR_CONFIG, "%s: %s: the file gives alpha = %s (%s) but the caller gives alpha = %s; "
                            "drop the caller's alpha or fix the file", a->path, mod->module,
                            lk_num_str(mod->alpha, fb), a->sources[i], lk_num_str(ua, ub));
        }
        double scale = mod->algo == LK_ALGO_LORA && a->rslora ? ua / sqrt((double)mod->rank) : ua / (double)mod->rank;
        if (!isfinite((float)scale))
            return lk_error(LK_ERR_NONFINITE, "%s: %s: scale alpha/r = %g (alpha %g from the caller) is not finite as "
                            "a float", a->path, mod->module, scale, ua);
        char *src = source_str("caller", NULL);
        if (!src) return lk_error(LK_ERR_NOMEM, "%s: out of memory", a->file);
        lk_free(a->sources[i]);
        a->sources[i] = src;
        mod->alpha_source = src;
        mod->alpha = ua;
        mod->scale = scale;
    }
    return LK_OK;
}

/* The modules from the LoRA keys ki[0..nl) (sorted here), checked against
 * the replacements, their tensors copied out of the file, and each
 * module's A and B as the file holds them (a->fa, a->fb). Everything made
 * is owned by a. */
static lk_status build_modules(lk_adapter *a, keyinfo *ki, size_t nl) {
    qsort(ki, nl, sizeof *ki, key_cmp);
    lk_status s;
    if ((s = pair(a, ki, nl)) || (s = caller_alpha(a)) || (s = check_replacements(a)) || (s = copy_factors(a)))
        return s;
    a->fa = lk_malloc((a->n ? a->n : 1) * sizeof *a->fa);
    a->fb = lk_malloc((a->n ? a->n : 1) * sizeof *a->fb);
    if (!a->fa || !a->fb) return lk_error(LK_ERR_NOMEM, "%s: out of memory", a->file);
    for (size_t i = 0; i < a->n; i++) a->fa[i] = a->mods[i].A, a->fb[i] = a->mods[i].B;
    return LK_OK;
}

/* The warnings of an opened adapter: modules outside target_modules, alpha
 * = r where ss_network_alpha says otherwise or where its rank is not
 * ss_network_dim, and a PEFT file with neither a config nor alpha in its
 * metadata. Cannot fail. */
/* comfyui: ComfyUI's loader reads DoRA only from dora_scale keys; a PEFT
 * lora_magnitude_vector is left unloaded (it warns "lora key not loaded")
 * and the module fuses as the plain LoRA it then is. */
static void drop_magnitudes(lk_adapter *a) {
    if (a->convention != LK_CONVENTION_COMFYUI) return;
    for (size_t i = 0; i < a->n; i++)
        if (a->mods[i].magnitude.data) {
            memset(&a->mods[i].magnitude, 0, sizeof a->mods[i].magnitude);
            a->n_mag_dropped++;
        }
    if (a->n_mag_dropped) a->dora = 0;
}

static void warn_opened(const lk_adapter *a) {
    if (a->n_untargeted)
        lk_log(LK_LOG_WARN, "%s: %zu of %zu modules are not covered by target_modules in adapter_config.json",
               a->path, a->n_untargeted, a->n);
    if (a->n_ss_off)
        lk_log(LK_LOG_WARN, "%s: %zu of %zu modules have no .alpha tensor, so alpha = r (as diffusers, ComfyUI and "
               "A1111 read them), but metadata ss_network_alpha = %s differs (e.g. %s: r = %d); --alpha-from "
               "metadata uses ss_network_alpha", a->path, a->n_ss_off, a->n, a->ss_alpha_text,
               a->mods[a->ss_off_first].module, a->mods[a->ss_off_first].rank);
    if (a->n_ss_dim_off)
        lk_log(LK_LOG_WARN, "%s: %zu modules take alpha from ss_network_alpha = %g but their rank is not "
               "ss_network_dim = %ld", a->path, a->n_ss_dim_off, a->ss_alpha, a->ss_dim);
    if (a->n_mag_dropped)
        lk_log(LK_LOG_WARN, "%s: convention comfyui: lora_magnitude_vector of %zu modules ignored (ComfyUI's loader "
               "reads DoRA only as dora_scale): they fuse as plain LoRA", a->path, a->n_mag_dropped);
    size_t dflt = 0, first = 0; /* every format (kohya's is said above when ss_network_alpha differs) */
    for (size_t i = 0; i < a->n && !a->n_ss_off; i++)
        if (!strcmp(a->sources[i], "default r") && !dflt++) first = i;
    if (dflt)
        lk_log(LK_LOG_WARN, "%s: no adapter_config.json beside it, .alpha tensor or alpha in its metadata: alpha "
               "defaults to r (scale 1) for %zu of %zu modules (e.g. %s: r = %d); give the alpha it was trained "
               "with: alpha= (Python), -l PATH:STRENGTH:alpha=A (CLI), alpha: (plan)", a->path, dflt, a->n,
               a->mods[first].module, a->mods[first].rank);
}

/* Opens path (a file or folder; src: the bytes of an in-memory one) in
 * steps: locate the file and config, open the safetensors, split the keys,
 * settle the format, build the modules, warn. ki (split_keys') is the
 * open's only scratch; on failure everything made so far is freed with the
 * adapter. */
static lk_status open_any(const char *path, const lk_adapter_source *src, const lk_adapter_opts *opts,
                          lk_adapter **out) {
    static const lk_adapter_opts defaults;
    if (!opts) opts = &defaults;
    const lk_adapter_format format = opts->format;
    if (!path || !out) return lk_error(LK_ERR_ARG, "lk_adapter_open: NULL argument");
    if ((int)format < 0 || format >= LK_FORMAT_COUNT)
        return lk_error(LK_ERR_ARG, "%s: invalid adapter format %d", path, (int)format);
    if ((int)opts->alpha_from < 0 || opts->alpha_from >= LK_ALPHA_COUNT)
        return lk_error(LK_ERR_ARG, "%s: invalid alpha source %d", path, (int)opts->alpha_from);
    if (opts->has_alpha && !isfinite(opts->alpha)) {
        char b[LK_NUM_STR_MAX];
        return lk_error(LK_ERR_ARG, "%s: alpha %s is not finite", path, lk_num_str(opts->alpha, b));
    }
    if ((int)opts->convention < 0 || opts->convention >= LK_CONVENTION_COUNT)
        return lk_error(LK_ERR_ARG, "%s: invalid convention %d", path, (int)opts->convention);
    lk_adapter *a = lk_calloc(1, sizeof *a);
    if (!a) return lk_error(LK_ERR_NOMEM, "%s: out of memory", path);
    a->alpha_from = opts->alpha_from;
    a->convention = opts->convention;
    a->has_user_alpha = opts->has_alpha != 0;
    a->user_alpha = opts->alpha;
    keyinfo *ki = NULL;
    size_t nl = 0;
    lk_status s = (a->path = lk_strdup(path)) ? LK_OK : lk_error(LK_ERR_NOMEM, "%s: out of memory", path);
    if (!s) s = src ? from_memory(a, src) : locate(a);
    if (!s) s = src ? lk_st_open_mem(src->bytes, src->n, a->file, &a->st) : lk_st_open(a->file, &a->st);
    if (!s) s = split_keys(a, format, &ki, &nl);
    if (!s) s = settle_format(a, ki, nl, format);
    if (!s) s = build_modules(a, ki, nl);
    if (!s) drop_magnitudes(a);
    lk_free(ki);
    if (s) {
        lk_adapter_free(a);
        return s;
    }
    warn_opened(a);
    *out = a;
    return LK_OK;
}
