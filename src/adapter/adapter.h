/* adapter/adapter.h — the lk_adapter object, shared by adapter.c and
 * resolve.c only (other modules use the accessors in lorakit/adapter.h). */
#ifndef LK_ADAPTER_ADAPTER_H
#define LK_ADAPTER_ADAPTER_H

#include "lorakit/adapter.h"
#include "lorakit/safetensors.h"
#include "adapter/config.h"

#include <string.h>

struct lk_adapter {
    char *path;             /* as given: file or folder */
    char *file;             /* the safetensors file read */
    char *config_path;      /* the adapter_config.json read, or NULL */
    lk_adapter_format format;
    int has_config, rslora, dora;
    lk_peft_config cfg;     /* valid when has_config */
    lk_st *st;              /* the file; owns the tensor names */
    void *factors;          /* every module's tensors and the replacements, copied at open */
    size_t n;               /* modules, sorted by stem */
    lk_lora_module *mods;
    lk_tensor *fa, *fb;     /* each module's A and B as the file holds them */
    unsigned char *embed;   /* module i is an embedding LoRA (lora_embedding_A/B) */
    void *tfactors;         /* transposed factors of the modules resolve found
                               transposed (embeddings, Conv1D with fan_in_fan_out) */
    void *xfactors;         /* Tucker folds and transposed LyCORIS factors (lk_lora_module.k), from resolve */
    char **names, **stems, **targets, **bias_targets, **sources; /* owned strings behind mods[i] */
    lk_adapter_placement *pl; /* where resolved modules land, sorted by (target, row0) */
    size_t n_pl;
    char **pl_strs;         /* owned target and rule strings of pl[i]: [2i], [2i + 1] */
    char *family;           /* the family table the last resolve used, or NULL */
    size_t *by_bias;        /* resolved modules with a lora_B.bias, sorted by bias target */
    size_t n_by_bias;
    size_t n_rep;           /* replacements, sorted by key */
    lk_adapter_tensor *reps;
    char **rep_names;       /* model name of each replacement (key without prefix / base_layer) */
    char **rep_targets;
    size_t *rep_by_target;  /* resolved replacements sorted by target */
    size_t n_rep_by_target;
    size_t n_untargeted;    /* modules outside target_modules */
    /* alpha/rank from the file's own metadata (files without a config) */
    struct lk_meta_cfg {
        char *prefix;       /* component ("transformer") of a packed diffusers record, or NULL */
        lk_peft_config cfg;
    } *meta;
    size_t n_meta;
    lk_alpha_from alpha_from; /* lk_adapter_opts.alpha_from */
    int has_user_alpha;     /* lk_adapter_opts.has_alpha: the caller's alpha below */
    double user_alpha;
    lk_convention convention; /* lk_adapter_opts.convention: whose rules where the tools disagree */
    size_t n_mag_dropped;   /* comfyui: modules whose lora_magnitude_vector ComfyUI's loader ignores */
    int has_ss_alpha;       /* kohya's ss_network_alpha, a finite number */
    double ss_alpha;
    const char *ss_alpha_text; /* its text (metadata string), or NULL */
    size_t n_ss_off;        /* AUTO: modules at alpha = r that ss_network_alpha contradicts */
    size_t ss_off_first;    /* the first of them */
    long ss_dim;            /* kohya's ss_network_dim (0: absent or "Dynamic") */
    size_t n_ss_dim_off;    /* modules using ss_network_alpha whose rank is not ss_network_dim */
    lk_re_budget re_budget; /* the PCRE2 work all its configs' patterns may take */
    int kohya_mixed;        /* comfyui: PEFT-style and kohya-style keys in one file, each read alone (format
                               diffusers; its kohya-prefixed dotless modules read in kohya form) */
};

/* Whether module name k starts with a kohya / LyCORIS / OneTrainer / Stable Cascade prefix (lora_unet_,
 * lora_te*, lycoris_, lora_transformer_, lora_prior_). */
int lk_adapter_kohya_name(const char *k);

/* Whether module m (its module name) is read in kohya's underscore form: a
 * dotless name of a kohya file, or of a mixed file (kohya_mixed) with a
 * kohya prefix. */
static inline int lk_adapter_kohya_module(const lk_adapter *a, const char *m) {
    if (strchr(m, '.')) return 0;
    return a->format == LK_FORMAT_KOHYA || (a->kohya_mixed && lk_adapter_kohya_name(m));
}

/* The name of a factor in the adapter's format: A (b = 0) or B (b = 1). */
static inline const char *lk_adapter_factor_name(const lk_adapter *a, int b) {
    if (a->format == LK_FORMAT_KOHYA) return b ? "lora_up" : "lora_down";
    return b ? "lora_B" : "lora_A";
}

#endif
