/* adapter/config.h — shared by the files of src/adapter (not public):
 * the parsed adapter_config.json (PEFT's LoraConfig) and PEFT's pattern
 * rules, evaluated with PCRE2 (which reads Python's `re` dialect). */
#ifndef LK_ADAPTER_CONFIG_H
#define LK_ADAPTER_CONFIG_H

#include <stddef.h>
#include <stdint.h>
#include "lorakit/status.h"
#include "lorakit/adapter.h"
#include "adapter/names.h"

/* Which PEFT release's pattern rule a config follows (peft_version in the
 * config; absent means the current rule: PEFT records it only since 0.18). */
typedef enum lk_peft_rule {
    LK_PEFT_RULE_CURRENT = 0, /* >= 0.15: re.match(r"(.*\.)?(key)$", name), per pattern dict */
    LK_PEFT_RULE_014,         /* 0.14: re.match(r".*\.key$", name), per pattern dict, exact-name fallback */
    LK_PEFT_RULE_013          /* <= 0.13: as 0.14 but one key list (rank keys first) picks both r and alpha */
} lk_peft_rule;

typedef enum lk_peft_bias { LK_PEFT_BIAS_NONE = 0, LK_PEFT_BIAS_ALL, LK_PEFT_BIAS_LORA_ONLY } lk_peft_bias;

typedef struct lk_pattern {
    char *key;     /* as written in the config */
    double value;  /* rank or alpha */
    void *re;      /* pcre2_code: PEFT's wrapper around key */
} lk_pattern;

/* Keys that are a run of one-character atoms (a literal character, an
 * escaped one such as "\\.", '.', \d \w \s and their negations, or a simple
 * [...] set), with no quantifier, group, anchor or alternation: they match
 * exactly the names of their length whose every character is in its atom's
 * set, so they are matched without PCRE2. Grouped by shape (length and the
 * positions of the atoms that are sets of more than one character; the
 * signature is the key with '.' there and 'x' elsewhere), each shape a hash
 * table of the keys' literal bytes (0x01 at the set positions), so a module
 * name costs one lookup per shape of a length its suffixes (or windows)
 * have, not one regex per key; keys with equal literal bytes are chained
 * and their sets checked. */
#define LK_LIT_WILD '\x01'
typedef struct lk_lit_shape {
    const char *sig; /* borrowed from the index's arena */
    const char *example; /* its first key, named when the budget runs out */
    size_t len;
    lk_names keys;   /* literal bytes -> the first key's index in the pattern list */
} lk_lit_shape;

typedef struct lk_lit_index {
    lk_lit_shape *shape; /* sorted by len */
    size_t n_shape;
    char *arena;         /* signatures, literal bytes and set ids */
    size_t *re_keys;     /* indices of the keys that are not atom runs: PCRE2 */
    size_t n_re_keys;
    lk_names all;        /* every key, for PEFT's exact-name fallback */
    size_t *next;        /* per key: the next key with the same shape and literal bytes, or SIZE_MAX */
    const unsigned char **set_of; /* per atom-run key: per position 0 (literal) or 1 + its set's index */
    uint64_t (*sets)[2]; /* the distinct sets, as bitmaps over ASCII */
    size_t n_sets;
    /* The regex keys' prefilter: a key whose text requires a literal run of
     * at least LK_GRAM_LEN characters (no top-level '|', no inline flags) can
     * match only names holding its rarest LK_GRAM_LEN-gram, so a name runs
     * PCRE2 only for the keys whose gram it holds and the keys without one. */
    lk_names grams;      /* gram -> the first key (index into the pattern list) choosing it */
    char *gram_arena;    /* the grams' bytes */
    size_t *gram_next;   /* per key: the next key choosing the same gram, or SIZE_MAX */
    unsigned char *always; /* per key: no gram, PCRE2 on every name */
    uint32_t *mark;      /* per key: the epoch of the last name whose grams named it */
    uint32_t epoch;
    size_t n_keys;       /* keys indexed (the length of always, mark, gram_next) */
} lk_lit_index;
#define LK_GRAM_LEN 3

/* The total PCRE2 work allowed to the patterns of one adapter (every config
 * it reads shares one; see config.c). */
typedef struct lk_re_budget {
    uint64_t used, limit;
    uint64_t matches;
} lk_re_budget;

/* A target_modules / exclude_modules value: a list (exact names or
 * ".name" suffixes) or one regex string (re.fullmatch). */
typedef struct lk_peft_match {
    char **list;
    size_t n;
    lk_names set;   /* the list's entries */
    int has_list;   /* a list was given (may be empty) */
    char *str;      /* the string form, or NULL */
    void *re;       /* pcre2_code for str (NULL for "all-linear") */
} lk_peft_match;

typedef struct lk_peft_config {
    char *label;       /* file (or metadata key) named in errors */
    long r;            /* default 8, as PEFT's LoraConfig */
    double alpha;      /* lora_alpha, default 8 */
    int rslora, use_dora, lora_bias, fan_in_fan_out;
    /* peft_type "OFT" (oft = 1): OFTConfig's merge fields (PEFT's defaults when
     * absent: coft false, eps 6e-5, use_cayley_neumann true, 5 terms); the
     * block size and count come from each oft_R.weight's shape */
    int oft;
    lk_oft_peft oft_opts;
    lk_peft_bias bias;
    lk_peft_rule rule;
    char version[32];  /* peft_version as written, or "" */
    lk_pattern *rank_pat;
    size_t n_rank_pat;
    lk_pattern *alpha_pat;
    size_t n_alpha_pat;
    lk_lit_index rank_lit, alpha_lit;
    lk_peft_match target, exclude;
    long *layers;      /* layers_to_transform (NULL: all) */
    size_t n_layers;
    void **layers_re;  /* layers_pattern, compiled per PEFT's rule (none: any layer name) */
    char **layers_pats; /* their layers_pattern entries as written (NULL: no layers_pattern) */
    size_t n_layers_re;
    char **to_save;    /* modules_to_save */
    void **to_save_re; /* (^|.*\.)entry($|\..*): PEFT keeps LoRA off these */
    size_t n_to_save;
    lk_lit_index to_save_lit;
    lk_names to_save_set; /* the entries, for lk_peft_saved_module */
    size_t to_save_max;   /* the longest entry */
    void *mctx;        /* pcre2_match_context with the match/depth/heap limits */
    lk_re_budget own;  /* the budget when no shared one is set */
    lk_re_budget *budget; /* shared by an adapter's configs, or NULL: own */
} lk_peft_config;

/* Parses the JSON text of an adapter_config.json (or a LoraConfig dict found
 * in a file's metadata); label names it in errors. Fields that change the
 * fused result in a way lorakit does not implement are refused by name
 * (LK_ERR_UNSUPPORTED naming the key and value); see config.c. */
lk_status lk_peft_config_parse(const char *text, size_t len, const char *label, lk_peft_config *out);
lk_status lk_peft_config_load(const char *path, lk_peft_config *out);
void lk_peft_config_free(lk_peft_config *c);
/* Makes c draw on budget b (b->limit 0: set to lorakit's per-adapter
 * budget), so the configs of one adapter share one budget. */
void lk_peft_config_share_budget(lk_peft_config *c, lk_re_budget *b);

/* PEFT's rank_pattern / alpha_pattern lookup for module `name` (without the
 * "base_model.model." prefix): *out = the pattern whose key wins, or NULL.
 * which: 0 rank_pattern, 1 alpha_pattern. A pattern that hits PCRE2's match
 * limits on this name is an error naming the key, pattern and module. */
lk_status lk_peft_pattern_find(const lk_peft_config *c, int which, const char *name, const lk_pattern **out);
/* PEFT's check_target_module_exists: *hit = 1 when name is targeted
 * (exclude_modules, modules_to_save, target_modules list/regex,
 * layers_to_transform / layers_pattern); 1 when target_modules is absent or
 * "all-linear". */
lk_status lk_peft_targets(const lk_peft_config *c, const char *name, int *hit);
/* 1 when module `name` is (inside) a modules_to_save module: some prefix of
 * name ending at a '.' (or name itself) ends with an entry, PEFT's
 * `key.endswith(entry)`. */
int lk_peft_saved_module(const lk_peft_config *c, const char *name);

/* Python `re` pattern text -> PCRE2 pattern text (lk_malloc'd): `{,n}`
 * becomes `{0,n}`, `\Z` becomes `\z`. NULL when out of memory. */
char *lk_py_regex_to_pcre2(const char *py);

#endif
