/* config.c — adapter_config.json (PEFT's LoraConfig) and PEFT's pattern rules.
 *
 * Every LoraConfig field is either read (r, lora_alpha, use_rslora,
 * rank_pattern, alpha_pattern, target_modules, exclude_modules,
 * layers_to_transform, layers_pattern, modules_to_save, bias, lora_bias,
 * use_dora, fan_in_fan_out, peft_version), known not to change the merged weights (training
 * and bookkeeping fields), or refused by name when set, because lorakit does
 * not implement what it does to the merge (QA-LoRA, aLoRA,
 * layer_replication, target_parameters, trainable tokens, LoftQ, residual
 * initialisations such as PiSSA, the other LoRA variants). A field lorakit
 * does not know is logged as a warning, never silently trusted.
 *
 * Patterns are Python `re` patterns in PEFT; they are evaluated with PCRE2,
 * which reads that dialect (\d, (?:...), {m,n}, lookarounds), after a small
 * translation of the spots where Python and PCRE2 10.42 differ ({,n} and
 * \Z). PEFT wraps each key in a template (re.match(rf"(.*\.)?({key})$")
 * since 0.15); the same template text is compiled here, so a key with odd
 * parentheses means what it means to Python. Patterns come from downloaded
 * files, so every match runs under PCRE2's match, depth and heap limits: a
 * catastrophic pattern costs bounded time and memory and is reported by key
 * and module instead of hanging a fuse or a serving rank. All PCRE2 memory
 * goes through lk_malloc, so allocation-failure tests reach it too. */
#define PCRE2_CODE_UNIT_WIDTH 8
#include "adapter/adapter_internal.h"
#include "core/file.h"
#include "lorakit/alloc.h"
#include "lorakit/log.h"

#include <jansson.h>
#include <math.h>
#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Bounds for one match of a pattern against one module name. PEFT's
 * patterns need a few hundred steps; these stop (a+)+$ on a long name after
 * a million. */
#define LK_RE_MATCH_LIMIT 1000000u
#define LK_RE_DEPTH_LIMIT 10000u
#define LK_RE_HEAP_KIB 16384u
#define LK_RE_MAX_PATTERN 65536u

static void *re_malloc(PCRE2_SIZE n, void *ctx) {
    (void)ctx;
    return lk_malloc(n ? n : 1);
}
static void re_free(void *p, void *ctx) {
    (void)ctx;
    lk_free(p);
}

/* ---- Python -> PCRE2 ---- */

char *lk_py_regex_to_pcre2(const char *py) {
    size_t n = strlen(py);
    char *out = lk_malloc(2 * n + 1); /* each "{," gains one byte, "\Z" none */
    if (!out) return NULL;
    size_t o = 0;
    int in_class = 0;
    for (size_t i = 0; i < n; i++) {
        char c = py[i];
        if (c == '\\' && i + 1 < n) {
            out[o++] = c;
            out[o++] = (!in_class && py[i + 1] == 'Z') ? 'z' : py[i + 1];
            i++;
            continue;
        }
        if (in_class) {
            if (c == ']') in_class = 0;
            out[o++] = c;
            continue;
        }
        if (c == '[') {
            in_class = 1;
            out[o++] = c;
            /* a ']' right after '[' or '[^' is literal */
            if (i + 1 < n && py[i + 1] == '^') out[o++] = py[++i];
            if (i + 1 < n && py[i + 1] == ']') out[o++] = py[++i];
            continue;
        }
        if (c == '{' && i + 1 < n && py[i + 1] == ',') {
            size_t j = i + 2;
            while (j < n && py[j] >= '0' && py[j] <= '9') j++;
            if (j < n && py[j] == '}') { /* Python's {,n} / {,} is {0,n} / {0,} */
                out[o++] = '{';
                out[o++] = '0';
                continue;
            }
        }
        out[o++] = c;
    }
    out[o] = '\0';
    return out;
}

/* ---- compiling ---- */

/* Compiles tmpl with %s replaced by the translated key (tmpl NULL: the key
 * alone, with `opts`). Errors name label, field, key and PCRE2's reason. */
static lk_status compile(const char *label, const char *field, const char *key, const char *tmpl, uint32_t opts,
                         void **out) {
    *out = NULL;
    char *tr = lk_py_regex_to_pcre2(key);
    if (!tr) return lk_error(LK_ERR_NOMEM, "%s: out of memory", label);
    char *src = tr;
    if (tmpl) {
        size_t n = strlen(tmpl) + strlen(tr) + 1;
        src = lk_malloc(n);
        if (!src) {
            lk_free(tr);
            return lk_error(LK_ERR_NOMEM, "%s: out of memory", label);
        }
        snprintf(src, n, tmpl, tr);
        lk_free(tr);
    }
    pcre2_general_context *g = pcre2_general_context_create(re_malloc, re_free, NULL);
    pcre2_compile_context *cc = g ? pcre2_compile_context_create(g) : NULL;
    if (!cc) {
        pcre2_general_context_free(g);
        lk_free(src);
        return lk_error(LK_ERR_NOMEM, "%s: out of memory", label);
    }
    pcre2_set_max_pattern_length(cc, LK_RE_MAX_PATTERN);
    int err = 0;
    PCRE2_SIZE off = 0;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)src, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP | opts, &err, &off, cc);
    pcre2_compile_context_free(cc);
    pcre2_general_context_free(g);
    lk_free(src);
    if (!re) {
        if (err == PCRE2_ERROR_HEAP_FAILED || err == PCRE2_ERROR_NOMEMORY) return lk_error(LK_ERR_NOMEM, "%s: out of memory compiling %s", label, field);
        PCRE2_UCHAR msg[256];
        if (pcre2_get_error_message(err, msg, sizeof msg) < 0) snprintf((char *)msg, sizeof msg, "error %d", err);
        return lk_error(LK_ERR_CONFIG, "%s: %s: \"%.200s\" is not a valid pattern (PCRE2: %s)", label, field, key,
                        (const char *)msg);
    }
    *out = re;
    return LK_OK;
}

/* Matches re against name from its start (PEFT uses re.match / fullmatch);
 * *hit = 1 on a match; *idx (when not NULL) gets the named group "idx" as a
 * number (-1 if it is not a plain decimal). Limit errors name the pattern. */
static lk_status match(const lk_peft_config *c, void *re_v, const char *field, const char *key, const char *name,
                       int *hit, long *idx) {
    pcre2_code *re = re_v;
    *hit = 0;
    pcre2_general_context *g = pcre2_general_context_create(re_malloc, re_free, NULL);
    pcre2_match_data *md = g ? pcre2_match_data_create_from_pattern(re, g) : NULL;
    pcre2_general_context_free(g);
    if (!md) return lk_error(LK_ERR_NOMEM, "%s: out of memory matching %s", c->label, field);
    int rc = pcre2_match(re, (PCRE2_SPTR)name, strlen(name), 0, PCRE2_ANCHORED, md, c->mctx);
    lk_status s = LK_OK;
    if (rc >= 0) {
        *hit = 1;
        if (idx) {
            PCRE2_UCHAR buf[24];
            PCRE2_SIZE bl = sizeof buf;
            *idx = -1;
            if (pcre2_substring_copy_byname(md, (PCRE2_SPTR) "idx", buf, &bl) == 0 && bl > 0 && bl < 19) {
                long v = 0;
                size_t k = 0;
                for (; k < bl && buf[k] >= '0' && buf[k] <= '9'; k++) v = v * 10 + (buf[k] - '0');
                if (k == bl) *idx = v;
            }
        }
    } else if (rc != PCRE2_ERROR_NOMATCH) {
        PCRE2_UCHAR msg[256];
        if (pcre2_get_error_message(rc, msg, sizeof msg) < 0) snprintf((char *)msg, sizeof msg, "error %d", rc);
        if (rc == PCRE2_ERROR_NOMEMORY)
            s = lk_error(LK_ERR_NOMEM, "%s: out of memory matching %s \"%.200s\"", c->label, field, key);
        else
            s = lk_error(LK_ERR_CONFIG,
                         "%s: %s: pattern \"%.200s\" could not be matched against module %s within lorakit's limits "
                         "(PCRE2: %s); simplify the pattern",
                         c->label, field, key, name, (const char *)msg);
    }
    pcre2_match_data_free(md);
    return s;
}

/* ---- freeing ---- */

static void free_patterns(lk_pattern *p, size_t n) {
    for (size_t i = 0; i < n; i++) {
        pcre2_code_free(p[i].re);
        lk_free(p[i].key);
    }
    lk_free(p);
}

static void free_strs(char **s, size_t n) {
    for (size_t i = 0; s && i < n; i++) lk_free(s[i]);
    lk_free(s);
}

static void free_codes(void **r, size_t n) {
    for (size_t i = 0; r && i < n; i++) pcre2_code_free(r[i]);
    lk_free(r);
}

static void free_match(lk_peft_match *m) {
    free_strs(m->list, m->n);
    lk_free(m->str);
    pcre2_code_free(m->re);
}

void lk_peft_config_free(lk_peft_config *c) {
    if (!c) return;
    free_patterns(c->rank_pat, c->n_rank_pat);
    free_patterns(c->alpha_pat, c->n_alpha_pat);
    free_match(&c->target);
    free_match(&c->exclude);
    lk_free(c->layers);
    free_codes(c->layers_re, c->n_layers_re);
    free_strs(c->to_save, c->n_to_save);
    free_codes(c->to_save_re, c->n_to_save);
    pcre2_match_context_free(c->mctx);
    lk_free(c->label);
    memset(c, 0, sizeof *c);
}

/* ---- parsing ---- */

static lk_status parse_patterns(lk_peft_config *c, json_t *obj, const char *field, int is_rank, lk_pattern **out,
                                size_t *n_out) {
    const char *label = c->label;
    if (!obj || json_is_null(obj)) return LK_OK;
    if (!json_is_object(obj)) return lk_error(LK_ERR_CONFIG, "%s: %s must be an object", label, field);
    size_t n = json_object_size(obj);
    if (n == 0) return LK_OK;
    lk_pattern *p = lk_calloc(n, sizeof *p);
    if (!p) return lk_error(LK_ERR_NOMEM, "%s: out of memory", label);
    /* PEFT's rule since 0.15 vs the older one (see lk_peft_rule) */
    const char *tmpl = c->rule == LK_PEFT_RULE_CURRENT ? "(.*\\.)?(%s)$" : ".*\\.%s$";
    size_t i = 0;
    const char *k;
    json_t *v;
    lk_status s = LK_OK;
    json_object_foreach(obj, k, v) { /* jansson keeps the file's key order */
        if (!json_is_number(v)) {
            s = lk_error(LK_ERR_CONFIG, "%s: %s[\"%s\"] must be a number", label, field, k);
            break;
        }
        double d = json_number_value(v);
        if (!isfinite(d)) {
            s = lk_error(LK_ERR_CONFIG, "%s: %s[\"%s\"] = %g is not finite", label, field, k, d);
            break;
        }
        if (is_rank && (d <= 0 || d != floor(d) || d > 1e9)) {
            s = lk_error(LK_ERR_CONFIG, "%s: %s[\"%s\"] = %g: a rank must be a positive integer", label, field, k, d);
            break;
        }
        p[i].key = lk_strdup(k);
        if (!p[i].key) {
            s = lk_error(LK_ERR_NOMEM, "%s: out of memory", label);
            break;
        }
        p[i].value = d;
        if ((s = compile(label, field, k, tmpl, 0, &p[i].re))) {
            lk_free(p[i].key);
            break;
        }
        i++;
    }
    if (s) {
        free_patterns(p, i);
        return s;
    }
    *out = p;
    *n_out = i;
    return LK_OK;
}

static lk_status str_list(json_t *v, const char *label, const char *field, char ***out, size_t *n_out) {
    size_t n = json_array_size(v);
    char **l = lk_calloc(n ? n : 1, sizeof *l);
    if (!l) return lk_error(LK_ERR_NOMEM, "%s: out of memory", label);
    for (size_t i = 0; i < n; i++) {
        json_t *e = json_array_get(v, i);
        if (!json_is_string(e)) {
            free_strs(l, i);
            return lk_error(LK_ERR_CONFIG, "%s: %s[%zu] must be a string", label, field, i);
        }
        if (!(l[i] = lk_strdup(json_string_value(e)))) {
            free_strs(l, i);
            return lk_error(LK_ERR_NOMEM, "%s: out of memory", label);
        }
    }
    *out = l;
    *n_out = n;
    return LK_OK;
}

/* target_modules / exclude_modules: a list, or one string matched with
 * re.fullmatch ("all-linear" is a keyword for target_modules). */
static lk_status parse_match(lk_peft_config *c, json_t *v, const char *field, lk_peft_match *m) {
    if (!v || json_is_null(v)) return LK_OK;
    if (json_is_string(v)) {
        const char *t = json_string_value(v);
        if (!(m->str = lk_strdup(t))) return lk_error(LK_ERR_NOMEM, "%s: out of memory", c->label);
        if (!strcmp(field, "target_modules") && !strcmp(t, "all-linear")) return LK_OK;
        return compile(c->label, field, t, NULL, PCRE2_ANCHORED | PCRE2_ENDANCHORED, &m->re);
    }
    if (!json_is_array(v)) return lk_error(LK_ERR_CONFIG, "%s: %s must be a list or a string", c->label, field);
    m->has_list = 1;
    return str_list(v, c->label, field, &m->list, &m->n);
}

static lk_status parse_layers(lk_peft_config *c, json_t *root) {
    json_t *v = json_object_get(root, "layers_to_transform");
    if (v && !json_is_null(v)) {
        size_t n = json_is_array(v) ? json_array_size(v) : 1;
        if (!json_is_array(v) && !json_is_integer(v))
            return lk_error(LK_ERR_CONFIG, "%s: layers_to_transform must be an integer or a list of integers", c->label);
        if (n) { /* an empty list means every layer, as in PEFT */
            if (!(c->layers = lk_calloc(n, sizeof *c->layers))) return lk_error(LK_ERR_NOMEM, "%s: out of memory", c->label);
            for (size_t i = 0; i < n; i++) {
                json_t *e = json_is_array(v) ? json_array_get(v, i) : v;
                if (!json_is_integer(e))
                    return lk_error(LK_ERR_CONFIG, "%s: layers_to_transform[%zu] must be an integer", c->label, i);
                c->layers[i] = (long)json_integer_value(e);
            }
            c->n_layers = n;
        }
    }
    if (!c->n_layers) return LK_OK;
    /* PEFT's layer-index rule: the first numbered segment after a layers_pattern
     * name (or after any name when there is none); lazy since PEFT 0.15, greedy
     * (the last such segment) before. */
    int cur = c->rule == LK_PEFT_RULE_CURRENT;
    json_t *p = json_object_get(root, "layers_pattern");
    char **pats = NULL;
    size_t np = 0;
    lk_status s = LK_OK;
    if (p && json_is_string(p) && json_string_length(p)) {
        if (!(pats = lk_calloc(1, sizeof *pats)) || !(pats[0] = lk_strdup(json_string_value(p)))) {
            lk_free(pats);
            return lk_error(LK_ERR_NOMEM, "%s: out of memory", c->label);
        }
        np = 1;
    } else if (p && json_is_array(p)) {
        if ((s = str_list(p, c->label, "layers_pattern", &pats, &np))) return s;
    } else if (p && !json_is_null(p) && !json_is_string(p)) {
        return lk_error(LK_ERR_CONFIG, "%s: layers_pattern must be a string or a list of strings", c->label);
    }
    size_t nre = np ? np : 1;
    if (!(c->layers_re = lk_calloc(nre, sizeof *c->layers_re))) s = lk_error(LK_ERR_NOMEM, "%s: out of memory", c->label);
    for (size_t i = 0; !s && i < nre; i++) {
        if (np)
            s = compile(c->label, "layers_pattern", pats[i],
                        cur ? "(?:^|.*?\\.)%s\\.(?P<idx>\\d+)\\." : ".*\\.%s\\.(?P<idx>\\d+)\\.", 0, &c->layers_re[i]);
        else
            s = compile(c->label, "layers_to_transform", "", cur ? ".*?\\.[^.]*\\.(?P<idx>\\d+)\\.%s" : ".*\\.[^.]*\\.(?P<idx>\\d+)\\.%s",
                        0, &c->layers_re[i]);
        if (!s) c->n_layers_re = i + 1;
    }
    free_strs(pats, np);
    return s;
}

static lk_status parse_to_save(lk_peft_config *c, json_t *v) {
    if (!v || json_is_null(v)) return LK_OK;
    if (!json_is_array(v)) return lk_error(LK_ERR_CONFIG, "%s: modules_to_save must be a list of strings", c->label);
    lk_status s = str_list(v, c->label, "modules_to_save", &c->to_save, &c->n_to_save);
    if (s) return s;
    if (!(c->to_save_re = lk_calloc(c->n_to_save ? c->n_to_save : 1, sizeof *c->to_save_re)))
        return lk_error(LK_ERR_NOMEM, "%s: out of memory", c->label);
    for (size_t i = 0; i < c->n_to_save && !s; i++)
        s = compile(c->label, "modules_to_save", c->to_save[i], "(^|.*\\.)%s($|\\..*)", 0, &c->to_save_re[i]);
    return s;
}

static int is_set(json_t *v) {
    if (!v || json_is_null(v) || json_is_false(v)) return 0;
    if (json_is_object(v)) return json_object_size(v) > 0;
    if (json_is_array(v)) return json_array_size(v) > 0;
    if (json_is_string(v)) return json_string_length(v) > 0;
    return 1;
}

static void value_text(json_t *v, char *buf, size_t cap) {
    char *js = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
    snprintf(buf, cap, "%.60s%s", js ? js : "?", js && strlen(js) > 60 ? "..." : "");
    free(js);
}

/* Fields that change the merge in a way lorakit does not implement. */
static const struct {
    const char *key, *why;
} g_refused[] = {
    {"use_qalora", "QA-LoRA merges through quantization groups, which lorakit does not implement"},
    {"alora_invocation_tokens", "an activated LoRA (aLoRA) applies only after its invocation tokens and cannot be merged"},
    {"layer_replication", "layer replication changes the model's structure"},
    {"target_parameters", "LoRA on nn.Parameter targets (e.g. MoE experts) is not supported"},
    {"trainable_token_indices", "trainable tokens (token-level embedding deltas) are not supported"},
    {"megatron_config", "Megatron tensor-parallel LoRA layers are not supported"},
    {"loftq_config", "LoftQ adapters go with a quantized residual base, not the original weights"},
    {"velora_config", "the VeLoRA variant is not supported"},
    {"monteclora_config", "the MonteCLoRA variant is not supported"},
    {"arrow_config", "Arrow routing between adapters cannot be merged into one weight"},
    {"kasa_config", "the KaSA variant is not supported"},
    {"use_bdlora", "block-diagonal LoRA (BD-LoRA) is not supported"},
};

/* Fields that do not change the merged weights (or are read above). */
static const char *const g_known[] = {
    "task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
    "inference_mode", "r", "target_modules", "exclude_modules", "lora_alpha", "lora_dropout", "bias",
    "use_rslora", "modules_to_save", "init_lora_weights", "layers_to_transform", "layers_pattern",
    "rank_pattern", "alpha_pattern", "megatron_core", "eva_config", "corda_config", "lora_ga_config",
    "use_dora", "qalora_group_size", "runtime_config", "lora_bias", "ensure_weight_tying",
    "target_modules_to_tie", "fan_in_fan_out",
};

static lk_status check_fields(lk_peft_config *c, json_t *root) {
    const char *label = c->label;
    char val[96];
    json_t *v;
    for (size_t i = 0; i < sizeof g_refused / sizeof g_refused[0]; i++)
        if (is_set(v = json_object_get(root, g_refused[i].key))) {
            value_text(v, val, sizeof val);
            return lk_error(LK_ERR_UNSUPPORTED, "%s: %s = %s: %s", label, g_refused[i].key, val, g_refused[i].why);
        }
    if ((v = json_object_get(root, "init_lora_weights")) && json_is_string(v)) {
        const char *s = json_string_value(v);
        static const char *const residual[] = {"pissa", "olora", "corda", "loftq", "lora_ga", "mica"};
        for (size_t i = 0; i < sizeof residual / sizeof residual[0]; i++)
            if (!strncmp(s, residual[i], strlen(residual[i])))
                return lk_error(LK_ERR_UNSUPPORTED,
                                "%s: init_lora_weights = \"%s\": this initialisation changes the base weights (or the "
                                "merge), so the adapter does not apply to the original model; convert it with PEFT's "
                                "save_pretrained(path_initial_model_for_weight_conversion=...) first",
                                label, s);
    }
    const char *k;
    json_object_foreach(root, k, v) {
        int known = 0;
        for (size_t i = 0; i < sizeof g_known / sizeof g_known[0] && !known; i++) known = !strcmp(k, g_known[i]);
        for (size_t i = 0; i < sizeof g_refused / sizeof g_refused[0] && !known; i++) known = !strcmp(k, g_refused[i].key);
        if (!known && is_set(v)) {
            value_text(v, val, sizeof val);
            lk_log(LK_LOG_WARN, "%s: unknown field %s = %s ignored (lorakit follows PEFT up to 0.21)", label, k, val);
        }
    }
    return LK_OK;
}

static lk_peft_rule rule_of(const char *version) {
    unsigned maj = 0, min = 0;
    if (!version[0] || sscanf(version, "%u.%u", &maj, &min) != 2 || maj > 0) return LK_PEFT_RULE_CURRENT;
    if (min <= 13) return LK_PEFT_RULE_013;
    if (min == 14) return LK_PEFT_RULE_014;
    return LK_PEFT_RULE_CURRENT;
}

lk_status lk_peft_config_parse(const char *text, size_t len, const char *label, lk_peft_config *out) {
    lk_peft_config c;
    memset(&c, 0, sizeof c);
    c.r = 8;
    c.alpha = 8;
    if (!(c.label = lk_strdup(label))) return lk_error(LK_ERR_NOMEM, "%s: out of memory", label);
    json_error_t je;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &je);
    lk_status s = LK_OK;
    json_t *v;
    if (!root) {
        s = lk_error(LK_ERR_CONFIG, "%s: invalid JSON at line %d column %d: %s", label, je.line, je.column, je.text);
        goto done;
    }
    if (!json_is_object(root)) {
        s = lk_error(LK_ERR_CONFIG, "%s: not a JSON object", label);
        goto done;
    }
    {
        pcre2_general_context *g = pcre2_general_context_create(re_malloc, re_free, NULL);
        c.mctx = g ? pcre2_match_context_create(g) : NULL;
        pcre2_general_context_free(g);
        if (!c.mctx) {
            s = lk_error(LK_ERR_NOMEM, "%s: out of memory", label);
            goto done;
        }
        pcre2_set_match_limit(c.mctx, LK_RE_MATCH_LIMIT);
        pcre2_set_depth_limit(c.mctx, LK_RE_DEPTH_LIMIT);
        pcre2_set_heap_limit(c.mctx, LK_RE_HEAP_KIB);
    }
    if ((v = json_object_get(root, "peft_type")) && !json_is_null(v) &&
        (!json_is_string(v) || strcmp(json_string_value(v), "LORA"))) {
        char val[96];
        value_text(v, val, sizeof val);
        s = lk_error(LK_ERR_UNSUPPORTED, "%s: peft_type = %s; only LORA adapters can be fused", label, val);
        goto done;
    }
    if ((s = check_fields(&c, root))) goto done;
    if ((v = json_object_get(root, "peft_version")) && json_is_string(v)) {
        snprintf(c.version, sizeof c.version, "%s", json_string_value(v));
        c.rule = rule_of(c.version);
    }
    if ((v = json_object_get(root, "r")) && !json_is_null(v)) {
        double d = json_is_number(v) ? json_number_value(v) : NAN;
        if (!json_is_number(v) || d != floor(d) || d <= 0 || d > 1e9) {
            if (json_is_number(v))
                s = lk_error(LK_ERR_CONFIG, "%s: r = %g: the rank must be a positive integer", label, d);
            else
                s = lk_error(LK_ERR_CONFIG, "%s: r must be a number", label);
            goto done;
        }
        c.r = (long)d;
    }
    if ((v = json_object_get(root, "lora_alpha")) && !json_is_null(v)) {
        if (!json_is_number(v) || !isfinite(json_number_value(v))) {
            s = lk_error(LK_ERR_CONFIG, "%s: lora_alpha must be a finite number", label);
            goto done;
        }
        c.alpha = json_number_value(v);
    }
    c.rslora = json_is_true(json_object_get(root, "use_rslora"));
    c.use_dora = json_is_true(json_object_get(root, "use_dora"));
    c.lora_bias = json_is_true(json_object_get(root, "lora_bias"));
    c.fan_in_fan_out = json_is_true(json_object_get(root, "fan_in_fan_out"));
    if ((v = json_object_get(root, "bias")) && !json_is_null(v)) {
        const char *b = json_is_string(v) ? json_string_value(v) : "";
        if (!strcmp(b, "none")) c.bias = LK_PEFT_BIAS_NONE;
        else if (!strcmp(b, "all")) c.bias = LK_PEFT_BIAS_ALL;
        else if (!strcmp(b, "lora_only")) c.bias = LK_PEFT_BIAS_LORA_ONLY;
        else {
            char val[96];
            value_text(v, val, sizeof val);
            s = lk_error(LK_ERR_UNSUPPORTED, "%s: bias = %s (PEFT's values: \"none\", \"all\", \"lora_only\")", label, val);
            goto done;
        }
    }
    if ((s = parse_patterns(&c, json_object_get(root, "rank_pattern"), "rank_pattern", 1, &c.rank_pat, &c.n_rank_pat)))
        goto done;
    if ((s = parse_patterns(&c, json_object_get(root, "alpha_pattern"), "alpha_pattern", 0, &c.alpha_pat,
                            &c.n_alpha_pat)))
        goto done;
    if ((s = parse_match(&c, json_object_get(root, "target_modules"), "target_modules", &c.target))) goto done;
    if ((s = parse_match(&c, json_object_get(root, "exclude_modules"), "exclude_modules", &c.exclude))) goto done;
    if ((s = parse_layers(&c, root))) goto done;
    s = parse_to_save(&c, json_object_get(root, "modules_to_save"));
done:
    json_decref(root);
    if (s) {
        lk_peft_config_free(&c);
        return s;
    }
    *out = c;
    return LK_OK;
}

lk_status lk_peft_config_load(const char *path, lk_peft_config *out) {
    char *buf;
    size_t len;
    lk_status s = lk_read_config(path, &buf, &len);
    if (s) return s;
    s = lk_peft_config_parse(buf, len, path, out);
    lk_free(buf);
    return s;
}

/* ---- the rules ---- */

lk_status lk_peft_pattern_find(const lk_peft_config *c, int which, const char *name, const lk_pattern **out) {
    *out = NULL;
    /* PEFT <= 0.13 chained rank_pattern's keys and alpha_pattern's keys and took
     * the first that matched for both lookups. */
    const lk_pattern *lists[2] = {c->rank_pat, c->alpha_pat};
    size_t ns[2] = {c->n_rank_pat, c->n_alpha_pat};
    const char *fields[2] = {"rank_pattern", "alpha_pattern"};
    int from = which, to = which;
    if (c->rule == LK_PEFT_RULE_013) from = 0, to = 1;
    for (int l = from; l <= to; l++)
        for (size_t i = 0; i < ns[l]; i++) {
            int hit;
            lk_status s = match(c, lists[l][i].re, fields[l], lists[l][i].key, name, &hit, NULL);
            if (s) return s;
            if (!hit) continue;
            if (l != which) { /* 0.13: the key found names no entry of this dict, unless both have it */
                for (size_t j = 0; j < ns[which]; j++)
                    if (!strcmp(lists[which][j].key, lists[l][i].key)) *out = &lists[which][j];
                return LK_OK;
            }
            *out = &lists[l][i];
            return LK_OK;
        }
    /* No pattern matched: PEFT then looks the module's own name up. */
    for (size_t i = 0; i < ns[which]; i++)
        if (!strcmp(lists[which][i].key, name)) {
            *out = &lists[which][i];
            break;
        }
    return LK_OK;
}

static int list_hit(char *const *list, size_t n, const char *name) {
    size_t nl = strlen(name);
    for (size_t i = 0; i < n; i++) {
        size_t tl = strlen(list[i]);
        if (!strcmp(name, list[i])) return 1;
        if (nl > tl && name[nl - tl - 1] == '.' && !strcmp(name + nl - tl, list[i])) return 1;
    }
    return 0;
}

lk_status lk_peft_targets(const lk_peft_config *c, const char *name, int *hit) {
    lk_status s;
    int h = 0;
    *hit = 0;
    if (c->exclude.re) {
        if ((s = match(c, c->exclude.re, "exclude_modules", c->exclude.str, name, &h, NULL))) return s;
        if (h) return LK_OK;
    } else if (c->exclude.has_list && list_hit(c->exclude.list, c->exclude.n, name)) {
        return LK_OK;
    }
    for (size_t i = 0; i < c->n_to_save; i++) {
        if ((s = match(c, c->to_save_re[i], "modules_to_save", c->to_save[i], name, &h, NULL))) return s;
        if (h) return LK_OK;
    }
    if (c->target.re) return match(c, c->target.re, "target_modules", c->target.str, name, hit, NULL);
    if (!c->target.has_list) { /* absent, or "all-linear" */
        *hit = 1;
        return LK_OK;
    }
    if (!strcmp(name, "") || !list_hit(c->target.list, c->target.n, name)) return LK_OK;
    /* layers_to_transform applies to the list form only, and not to an exact name */
    int exact = 0;
    for (size_t i = 0; i < c->target.n && !exact; i++) exact = !strcmp(name, c->target.list[i]);
    if (!c->n_layers || exact) {
        *hit = 1;
        return LK_OK;
    }
    for (size_t i = 0; i < c->n_layers_re; i++) {
        long idx = -1;
        if ((s = match(c, c->layers_re[i], "layers_pattern", "", name, &h, &idx))) return s;
        if (!h) continue;
        for (size_t j = 0; j < c->n_layers; j++)
            if (idx >= 0 && idx == c->layers[j]) *hit = 1;
        return LK_OK;
    }
    return LK_OK;
}

int lk_peft_saved_module(const lk_peft_config *c, const char *name) {
    size_t nl = strlen(name);
    for (size_t end = 1; end <= nl; end++) {
        if (end < nl && name[end] != '.') continue;
        for (size_t i = 0; i < c->n_to_save; i++) {
            size_t tl = strlen(c->to_save[i]);
            if (tl && tl <= end && !memcmp(name + end - tl, c->to_save[i], tl)) return 1;
        }
    }
    return 0;
}
