/* adapter_internal.h — shared by the files of src/adapter (not public):
 * the parsed adapter_config.json and PEFT's pattern rule. */
#ifndef LK_ADAPTER_INTERNAL_H
#define LK_ADAPTER_INTERNAL_H

#include <regex.h>
#include <stddef.h>
#include "lorakit/status.h"

typedef struct lk_pattern {
    char *key;     /* as written in the config */
    double value;  /* rank or alpha */
    regex_t re;    /* ^(.*\.)?(key)$, PEFT's rule */
} lk_pattern;

typedef struct lk_peft_config {
    long r;            /* default 8, as PEFT's LoraConfig */
    double alpha;      /* lora_alpha, default 8 */
    int rslora;
    lk_pattern *rank_pat;
    size_t n_rank_pat;
    lk_pattern *alpha_pat;
    size_t n_alpha_pat;
    char **targets;    /* target_modules as a list (NULL if absent or a string) */
    size_t n_targets;
    char *target_str;  /* target_modules as one string (regex, or "all-linear") */
    regex_t target_re; /* ^(target_str)$ when target_str is a regex */
    int has_target_re;
} lk_peft_config;

/* Parses the JSON text of an adapter_config.json; label names it in errors.
 * Rejects r <= 0, a non-finite or non-numeric lora_alpha, rank_pattern
 * values <= 0, fan_in_fan_out = true, use_dora = true and a peft_type other
 * than LORA. */
lk_status lk_peft_config_parse(const char *text, size_t len, const char *label, lk_peft_config *out);
lk_status lk_peft_config_load(const char *path, lk_peft_config *out);
void lk_peft_config_free(lk_peft_config *c);

/* PEFT's rule: the first pattern whose key k matches name as the regex
 * (.*\.)?(k)$ (the whole name); NULL if none. */
const lk_pattern *lk_peft_pattern_find(const lk_pattern *p, size_t n, const char *name);
/* 1 when name is covered by target_modules (always 1 when it is absent or
 * "all-linear"): a list entry t matches name == t or name ending in ".t";
 * a string is a regex matched against the whole name. */
int lk_peft_targets(const lk_peft_config *c, const char *name);

#endif
