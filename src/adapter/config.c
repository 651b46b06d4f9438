/* config.c — adapter_config.json (PEFT's LoraConfig) and PEFT's pattern rule.
 *
 * Only the fields that change the fused result are read: r, lora_alpha,
 * use_rslora, rank_pattern, alpha_pattern, target_modules; fields that would
 * change it in a way lorakit does not implement (fan_in_fan_out, use_dora,
 * another peft_type) are refused rather than ignored. Defaults are PEFT's
 * (r = 8, lora_alpha = 8). Pattern keys are regexes, as in PEFT: a key k
 * matches module n when n matches (.*\.)?(k)$; patterns are compiled once
 * here so a bad one is reported with the config, not at fuse time. */
#include "adapter/adapter_internal.h"
#include "core/file.h"
#include "lorakit/alloc.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

/* Patterns come from downloaded files and glibc's regcomp copies a
 * repeated subexpression once per repetition, so "t{0,32767}", "t+++..."
 * or ((t+)+)+ cost gigabytes. PEFT keys are module names with at most a
 * little regex, so anything that can multiply is refused: counted
 * repetitions {m,n}, a quantifier after a quantifier, a quantified group
 * that itself holds a quantifier or a group, more than 8 nested groups,
 * keys over 256 bytes. What remains ("(attn\\.)?to_q", ".*_proj")
 * compiles to a tree linear in the key's length. */
static const char *pattern_problem(const char *k) {
    if (strlen(k) > 256) return "is longer than 256 bytes";
    int depth = 0, after_quant = 0, after_group = 0; /* after_group: 1 plain, 2 holds quantifiers/groups */
    int inner[10] = {0};                             /* per open group: holds a quantifier or a group */
    for (size_t i = 0; k[i]; i++) {
        char c = k[i];
        if (c == '\\') {
            if (k[i + 1]) i++;
            after_quant = after_group = 0;
            continue;
        }
        if (c == '[') { /* a bracket expression: its characters are literal */
            size_t j = i + 1;
            if (k[j] == '^') j++;
            if (k[j] == ']') j++;
            while (k[j] && k[j] != ']') j++;
            if (!k[j]) return NULL; /* unterminated: regcomp reports it */
            i = j;
            after_quant = after_group = 0;
            continue;
        }
        if (c == '{') return "uses a counted repetition {m,n}";
        if (c == '*' || c == '+' || c == '?') {
            if (after_quant) return "stacks quantifiers";
            if (after_group == 2) return "quantifies a group that holds quantifiers or groups";
            inner[depth] = 1;
            after_quant = 1;
            after_group = 0;
            continue;
        }
        after_quant = after_group = 0;
        if (c == '(') {
            if (depth == 8) return "nests more than 8 groups";
            inner[depth] = 1;
            inner[++depth] = 0;
        } else if (c == ')' && depth > 0) {
            after_group = inner[depth--] ? 2 : 1;
        }
    }
    return NULL;
}

static lk_status compile_anchored(regex_t *re, const char *pre, const char *key, const char *label,
                                  const char *field) {
    const char *why = pattern_problem(key);
    if (why)
        return lk_error(LK_ERR_CONFIG, "%s: %s: pattern \"%.80s\" %s (patterns are module names; lorakit refuses "
                        "regex forms that can exhaust memory)", label, field, key, why);
    size_t n = strlen(pre) + strlen(key) + 8;
    char *src = lk_malloc(n);
    if (!src) return lk_error(LK_ERR_NOMEM, "%s: out of memory", label);
    snprintf(src, n, "^%s(%s)$", pre, key);
    int rc = regcomp(re, src, REG_EXTENDED | REG_NOSUB);
    lk_free(src);
    if (rc != 0) return lk_error(LK_ERR_CONFIG, "%s: %s: \"%s\" is not a valid pattern", label, field, key);
    return LK_OK;
}

static void free_patterns(lk_pattern *p, size_t n) {
    for (size_t i = 0; i < n; i++) {
        regfree(&p[i].re);
        lk_free(p[i].key);
    }
    lk_free(p);
}

void lk_peft_config_free(lk_peft_config *c) {
    if (!c) return;
    free_patterns(c->rank_pat, c->n_rank_pat);
    free_patterns(c->alpha_pat, c->n_alpha_pat);
    for (size_t i = 0; i < c->n_targets; i++) lk_free(c->targets[i]);
    lk_free(c->targets);
    lk_free(c->target_str);
    if (c->has_target_re) regfree(&c->target_re);
    memset(c, 0, sizeof *c);
}

static lk_status parse_patterns(json_t *obj, const char *label, const char *field, int is_rank,
                                lk_pattern **out, size_t *n_out) {
    if (!obj || json_is_null(obj)) return LK_OK;
    if (!json_is_object(obj)) return lk_error(LK_ERR_CONFIG, "%s: %s must be an object", label, field);
    size_t n = json_object_size(obj);
    if (n == 0) return LK_OK;
    lk_pattern *p = lk_calloc(n, sizeof *p);
    if (!p) return lk_error(LK_ERR_NOMEM, "%s: out of memory", label);
    size_t i = 0;
    const char *k;
    json_t *v;
    lk_status s = LK_OK;
    json_object_foreach(obj, k, v) {
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
        if ((s = compile_anchored(&p[i].re, "(.*\\.)?", k, label, field))) {
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

static lk_status parse_targets(json_t *v, const char *label, lk_peft_config *c) {
    if (!v || json_is_null(v)) return LK_OK;
    if (json_is_string(v)) {
        const char *t = json_string_value(v);
        if (!(c->target_str = lk_strdup(t))) return lk_error(LK_ERR_NOMEM, "%s: out of memory", label);
        if (!strcmp(t, "all-linear")) return LK_OK;
        lk_status s = compile_anchored(&c->target_re, "", t, label, "target_modules");
        if (!s) c->has_target_re = 1;
        return s;
    }
    if (!json_is_array(v)) return lk_error(LK_ERR_CONFIG, "%s: target_modules must be a list or a string", label);
    size_t n = json_array_size(v);
    if (n == 0) return LK_OK;
    if (!(c->targets = lk_calloc(n, sizeof *c->targets))) return lk_error(LK_ERR_NOMEM, "%s: out of memory", label);
    for (size_t i = 0; i < n; i++) {
        json_t *e = json_array_get(v, i);
        if (!json_is_string(e)) return lk_error(LK_ERR_CONFIG, "%s: target_modules[%zu] must be a string", label, i);
        if (!(c->targets[i] = lk_strdup(json_string_value(e))))
            return lk_error(LK_ERR_NOMEM, "%s: out of memory", label);
        c->n_targets = i + 1;
    }
    return LK_OK;
}

static int get_bool(json_t *root, const char *key) {
    json_t *v = json_object_get(root, key);
    return v && json_is_true(v);
}

lk_status lk_peft_config_parse(const char *text, size_t len, const char *label, lk_peft_config *out) {
    lk_peft_config c;
    memset(&c, 0, sizeof c);
    c.r = 8;
    c.alpha = 8;
    json_error_t je;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return lk_error(LK_ERR_CONFIG, "%s: invalid JSON at line %d column %d: %s", label, je.line, je.column,
                        je.text);
    lk_status s = LK_OK;
    json_t *v;
    if (!json_is_object(root)) {
        s = lk_error(LK_ERR_CONFIG, "%s: not a JSON object", label);
        goto done;
    }
    if ((v = json_object_get(root, "peft_type")) && json_is_string(v) && strcmp(json_string_value(v), "LORA")) {
        s = lk_error(LK_ERR_UNSUPPORTED, "%s: peft_type is \"%s\"; only LORA adapters can be fused", label,
                     json_string_value(v));
        goto done;
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
    c.rslora = get_bool(root, "use_rslora");
    if (get_bool(root, "fan_in_fan_out")) {
        s = lk_error(LK_ERR_UNSUPPORTED,
                     "%s: fan_in_fan_out = true (weights stored in x out, as GPT-2's Conv1D) is not supported", label);
        goto done;
    }
    if (get_bool(root, "use_dora")) {
        s = lk_error(LK_ERR_UNSUPPORTED, "%s: use_dora = true (DoRA) is not supported", label);
        goto done;
    }
    if ((s = parse_patterns(json_object_get(root, "rank_pattern"), label, "rank_pattern", 1, &c.rank_pat,
                            &c.n_rank_pat)))
        goto done;
    if ((s = parse_patterns(json_object_get(root, "alpha_pattern"), label, "alpha_pattern", 0, &c.alpha_pat,
                            &c.n_alpha_pat)))
        goto done;
    s = parse_targets(json_object_get(root, "target_modules"), label, &c);
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

const lk_pattern *lk_peft_pattern_find(const lk_pattern *p, size_t n, const char *name) {
    for (size_t i = 0; i < n; i++)
        if (regexec(&p[i].re, name, 0, NULL, 0) == 0) return &p[i];
    return NULL;
}

int lk_peft_targets(const lk_peft_config *c, const char *name) {
    if (c->has_target_re) return regexec(&c->target_re, name, 0, NULL, 0) == 0;
    if (!c->n_targets) return 1;
    size_t nl = strlen(name);
    for (size_t i = 0; i < c->n_targets; i++) {
        size_t tl = strlen(c->targets[i]);
        if (!strcmp(name, c->targets[i])) return 1;
        if (nl > tl && name[nl - tl - 1] == '.' && !strcmp(name + nl - tl, c->targets[i])) return 1;
    }
    return 0;
}
