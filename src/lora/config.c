/* config.c — the `models.<role>.lora` block of a training config (YAML).
 *
 * The rules are fastvideo's LoraConfig.coerce/__post_init__ (see
 * shared/reference/): enable defaults to false; enable without rank, rank <= 0
 * under enable and a non-integer rank are errors; rank while disabled is
 * accepted and logged at info; alpha defaults to rank; unknown keys are a
 * warning listing the valid ones; a non-mapping block is an error; no block
 * means "not configured". rank and alpha may be quoted integers ("16"), as
 * FastVideo's int() coerces them. Two deliberate tightenings, both errors
 * rather than Python's silent coercions: `enable` must be a YAML boolean
 * (Python's bool("false") is True), and target_modules must be a list
 * (Python's list("to_q") is four one-letter targets).
 *
 * The YAML front-end (io/yaml_doc.h) reads and types the file and refuses
 * repeated keys anywhere in it; this file walks three fixed levels of the
 * tree, so aliases cost nothing. */
#include "lora/config.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/msg.h"
#include "lorakit/alloc.h"
#include "lorakit/log.h"

const char *const lk_lora_default_targets[] = {
    "q_proj", "k_proj", "v_proj", "o_proj", "to_q", "to_k",
    "to_v", "to_out", "to_qkv", "to_gate_compress", NULL,
};

static const char *const g_valid_keys[] = {"enable", "rank", "alpha", "target_modules"};
#define N_VALID_KEYS 4

typedef struct {
    const lk_ydoc *doc;
    const char *label;
    const char *role;
} cfg_ctx;

static int is_null(const lk_ynode *n) { return n && n->type == LK_Y_NULL; }

/* The `models` mapping of the document. With allow_missing, a config
 * without a 'models' key is not an error: *models is NULL. */
static lk_status find_models(cfg_ctx *c, const lk_ynode **models, int allow_missing) {
    const lk_ynode *root = lk_ydoc_root(c->doc);
    *models = NULL;
    if (!root || root->type != LK_Y_MAP)
        return lk_error(LK_ERR_CONFIG, "%s:%d: the config must be a mapping with a 'models' key",
                        c->label, root ? root->line : 0);
    const lk_ynode *m = lk_ymap_get(root, "models");
    if (!m && allow_missing) return LK_OK;
    if (!m) return lk_error(LK_ERR_CONFIG, "%s: no 'models' key", c->label);
    if (m->type != LK_Y_MAP) return lk_yerr(c->doc, m, NULL, "must be a mapping of roles");
    *models = m;
    return LK_OK;
}

static lk_status set_default_targets(lk_lora_config *cfg) {
    size_t n = 0;
    while (lk_lora_default_targets[n]) n++;
    cfg->targets = lk_calloc(n, sizeof(char *));
    if (!cfg->targets) return lk_error(LK_ERR_NOMEM, "out of memory");
    for (size_t i = 0; i < n; i++) {
        cfg->targets[i] = lk_strdup(lk_lora_default_targets[i]);
        cfg->n_targets = i + 1;
        if (!cfg->targets[i]) return lk_error(LK_ERR_NOMEM, "out of memory");
    }
    return LK_OK;
}

static lk_status parse_targets(cfg_ctx *c, const lk_ynode *v, lk_lora_config *cfg) {
    if (is_null(v)) return LK_OK;
    if (v->type != LK_Y_SEQ) {
        char r[64];
        lk_ynode_repr(v, r, sizeof r);
        return lk_yerr(c->doc, v, NULL, "must be a list of module name substrings, got %s", r);
    }
    size_t n = v->n;
    if (n == 0) return LK_OK; /* [] falls back to the defaults, as `or` does in FastVideo's reader */
    cfg->targets = lk_calloc(n, sizeof(char *));
    if (!cfg->targets) return lk_error(LK_ERR_NOMEM, "out of memory");
    for (size_t i = 0; i < n; i++) {
        const lk_ynode *it = v->kids[i];
        const char *t = lk_ynode_str(it);
        if (!t || !*t) {
            char r[64];
            lk_ynode_repr(it, r, sizeof r);
            /* the list's path: an item reached through an alias has another */
            char *where = lk_ynode_path_dup(v, NULL);
            lk_status s = lk_error(LK_ERR_CONFIG, "%s:%d: %s: item %zu must be a non-empty string, got %s",
                                   c->label, it->line, where ? where : "?", i, r);
            lk_free(where);
            return s;
        }
        cfg->targets[i] = lk_strdup(t);
        if (!cfg->targets[i]) return lk_error(LK_ERR_NOMEM, "out of memory");
        cfg->n_targets = i + 1;
    }
    cfg->targets_given = 1;
    return LK_OK;
}

/* An integer, or a string holding one (FastVideo's int()); null: unset. */
static lk_status parse_int_key(cfg_ctx *c, const lk_ynode *v, int *val, int *given) {
    long long x;
    *given = 0;
    if (is_null(v)) return LK_OK;
    if (!lk_ynode_int(v, INT_MIN, INT_MAX, &x) &&
        !(v->type == LK_Y_STR && lk_ytext_int(v->text, v->len, INT_MIN, INT_MAX, &x))) {
        char r[64];
        lk_ynode_repr(v, r, sizeof r);
        return lk_yerr(c->doc, v, NULL, "must be an integer, got %s", r);
    }
    *val = (int)x;
    *given = 1;
    return LK_OK;
}

/* The lora mapping itself. */
static lk_status parse_block(cfg_ctx *c, const lk_ynode *lora, lk_lora_config *cfg) {
    const lk_ynode *v[N_VALID_KEYS];
    lk_status s;
    for (int k = 0; k < N_VALID_KEYS; k++) v[k] = lk_ymap_get(lora, g_valid_keys[k]);
    char unknown[1024] = ""; /* the first unknown keys; the count says how many there are */
    size_t ulen = 0, listed = 0;
    for (size_t i = 0; i < lora->n; i++) {
        const lk_ynode *k = lk_ymap_key(lora, i);
        const char *kt = lk_ynode_str(k);
        int known = 0;
        for (int j = 0; j < N_VALID_KEYS && kt && !known; j++) known = !strcmp(kt, g_valid_keys[j]);
        if (known) continue;
        char r[64];
        lk_ynode_repr(k, r, sizeof r);
        cfg->n_unknown_keys++;
        if (ulen + strlen(r) + 2 < sizeof unknown - 32) { /* whole entries only, room left for the count */
            ulen += (size_t)snprintf(unknown + ulen, sizeof unknown - ulen, "%s%s", ulen ? ", " : "", r);
            listed++;
        }
    }
    const lk_ynode *enable = v[0], *rank = v[1], *alpha = v[2], *targets = v[3];
    if (enable && !is_null(enable)) {
        if (!lk_ynode_bool(enable, &cfg->enable)) {
            char r[64];
            lk_ynode_repr(enable, r, sizeof r);
            return lk_yerr(c->doc, enable, NULL, "must be true or false, got %s", r);
        }
    }
    int rank_given = 0;
    if (rank && (s = parse_int_key(c, rank, &cfg->rank, &rank_given)) != LK_OK) return s;
    if (alpha && (s = parse_int_key(c, alpha, &cfg->alpha, &cfg->alpha_given)) != LK_OK)
        return s;
    if (targets && (s = parse_targets(c, targets, cfg)) != LK_OK) return s;
    if (!cfg->targets && (s = set_default_targets(cfg)) != LK_OK) return s;

    if (cfg->enable) {
        if (!rank_given)
            return lk_yerr(c->doc, rank ? rank : lora, rank ? NULL : "rank",
                           "enable is true but rank is unset: an explicit positive rank is "
                           "required to enable LoRA");
        if (cfg->rank <= 0) return lk_yerr(c->doc, rank, NULL, "must be > 0, got %d", cfg->rank);
    }
    if (!cfg->alpha_given) cfg->alpha = rank_given ? cfg->rank : 0;
    if (!rank_given) cfg->rank = 0;

    if (cfg->n_unknown_keys) {
        if (listed < cfg->n_unknown_keys)
            snprintf(unknown + ulen, sizeof unknown - ulen, ", ... (%zu in all)", cfg->n_unknown_keys);
        char *w = lk_msg_dup("%s:%d: models.%s.lora: ignoring unrecognized lora keys [%s] (valid keys: "
                             "enable, rank, alpha, target_modules)",
                             c->label, lora->line, c->role, unknown);
        if (!w) return lk_error(LK_ERR_NOMEM, "out of memory");
        lk_log(LK_LOG_WARN, "%s", w); /* whole; the struct's copy loses its middle, with the count, if it must */
        lk_msg_fit(cfg->warning, sizeof cfg->warning, w, strlen(w));
        lk_free(w);
    }
    if (!cfg->enable && rank_given) {
        snprintf(cfg->info, sizeof cfg->info,
                 "%s:%d: models.%s.lora.rank=%d is set but lora.enable is false: LoRA will "
                 "NOT be applied (the model trains on its normal trainable path)",
                 c->label, rank->line, c->role, cfg->rank);
        lk_log(LK_LOG_INFO, "%s", cfg->info);
    }
    return LK_OK;
}

void lk_lora_config_clear(lk_lora_config *cfg) {
    if (!cfg) return;
    for (size_t i = 0; i < cfg->n_targets; i++) lk_free(cfg->targets[i]);
    lk_free(cfg->targets);
    memset(cfg, 0, sizeof *cfg);
}

lk_status lk_lora_config_from_doc(const lk_ydoc *d, const char *role, lk_lora_config *out) {
    if (!out) return lk_error(LK_ERR_ARG, "lk_lora_config_from_doc: out is NULL");
    memset(out, 0, sizeof *out);
    if (!d || !role || !*role) return lk_error(LK_ERR_ARG, "lk_lora_config_from_doc: no YAML document or no role");
    cfg_ctx c = {.doc = d, .label = lk_ydoc_label(d), .role = role};
    const lk_ynode *models, *r = NULL, *lora = NULL;
    lk_status s = find_models(&c, &models, 0);
    if (s == LK_OK) r = lk_ymap_get(models, role);
    if (s == LK_OK && !r) {
        char names[1024] = ""; /* whole entries, then the count of all when they do not fit */
        size_t o = 0, i = 0;
        for (; i < models->n; i++) {
            char rr[64];
            lk_ynode_repr(lk_ymap_key(models, i), rr, sizeof rr);
            if (o + strlen(rr) + 2 >= sizeof names - 32) break;
            o += (size_t)snprintf(names + o, sizeof names - o, "%s%s", o ? ", " : "", rr);
        }
        if (i < models->n) snprintf(names + o, sizeof names - o, ", ... (%zu in all)", models->n);
        s = lk_yerr(d, models, NULL, "no role '%s' (roles: %s)", role, o ? names : "none");
    } else if (s == LK_OK && is_null(r)) {
        /* `student:` with nothing under it: no lora block either. */
    } else if (s == LK_OK && r->type != LK_Y_MAP) {
        s = lk_yerr(d, r, NULL, "must be a mapping");
    } else if (s == LK_OK) {
        lora = lk_ymap_get(r, "lora");
    }
    if (s == LK_OK && lora && !is_null(lora)) {
        if (lora->type != LK_Y_MAP) {
            char rr[64];
            lk_ynode_repr(lora, rr, sizeof rr);
            s = lk_yerr(d, lora, NULL, "must be a mapping, got %s", rr);
        } else {
            out->configured = 1;
            s = parse_block(&c, lora, out);
        }
    }
    if (s != LK_OK) lk_lora_config_clear(out);
    return s;
}

lk_status lk_lora_config_parse(const char *yaml, size_t len, const char *label, const char *role,
                               lk_lora_config *out) {
    if (!out) return lk_error(LK_ERR_ARG, "lk_lora_config_parse: out is NULL");
    memset(out, 0, sizeof *out);
    if (!yaml || !role || !*role) return lk_error(LK_ERR_ARG, "lk_lora_config_parse: no YAML or no role");
    lk_ydoc *d;
    lk_status s = lk_ydoc_parse(yaml, len, label ? label : "<config>", &d);
    if (s != LK_OK) return s;
    s = lk_lora_config_from_doc(d, role, out);
    lk_ydoc_free(d);
    return s;
}

lk_status lk_lora_config_load(const char *path, const char *role, lk_lora_config *out) {
    if (!out) return lk_error(LK_ERR_ARG, "lk_lora_config_load: out is NULL");
    memset(out, 0, sizeof *out);
    if (!path) return lk_error(LK_ERR_ARG, "lk_lora_config_load: path is NULL");
    if (!role || !*role) return lk_error(LK_ERR_ARG, "lk_lora_config_load: no role");
    lk_ydoc *d;
    lk_status s = lk_ydoc_load(path, &d);
    if (s != LK_OK) return s;
    s = lk_lora_config_from_doc(d, role, out);
    lk_ydoc_free(d);
    return s;
}

void lk_lora_roles_free(char **roles, size_t n) {
    if (!roles) return;
    for (size_t i = 0; i < n; i++) lk_free(roles[i]);
    lk_free(roles);
}

lk_status lk_lora_config_roles_doc(const lk_ydoc *d, char ***roles, size_t *n) {
    *roles = NULL;
    *n = 0;
    cfg_ctx c = {.doc = d, .label = lk_ydoc_label(d), .role = ""};
    const lk_ynode *models;
    lk_status s = find_models(&c, &models, 1);
    if (s != LK_OK || !models) return s; /* no models block: no roles, LoRA not configured */
    size_t cnt = models->n;
    char **r = lk_calloc(cnt ? cnt : 1, sizeof(char *));
    if (!r) return lk_error(LK_ERR_NOMEM, "%s: out of memory", c.label);
    for (size_t i = 0; s == LK_OK && i < cnt; i++) {
        const char *k = lk_ynode_str(lk_ymap_key(models, i));
        if (!k) s = lk_yerr(d, models, NULL, "role names must be strings");
        else if (!(r[i] = lk_strdup(k))) s = lk_error(LK_ERR_NOMEM, "%s: out of memory", c.label);
    }
    if (s != LK_OK) {
        lk_lora_roles_free(r, cnt);
        return s;
    }
    *roles = r;
    *n = cnt;
    return LK_OK;
}

lk_status lk_lora_config_roles(const char *path, char ***roles, size_t *n) {
    if (!roles || !n || !path) return lk_error(LK_ERR_ARG, "lk_lora_config_roles: NULL argument");
    *roles = NULL;
    *n = 0;
    lk_ydoc *d;
    lk_status s = lk_ydoc_load(path, &d);
    if (s != LK_OK) return s;
    s = lk_lora_config_roles_doc(d, roles, n);
    lk_ydoc_free(d);
    return s;
}

int lk_lora_config_describe(const lk_lora_config *cfg, char *buf, size_t cap) {
    if (!cfg->configured) return snprintf(buf, cap, "lora not configured");
    if (!cfg->enable) {
        if (cfg->info[0])
            return snprintf(buf, cap, "lora disabled (rank %d set but enable is false: not applied)",
                            cfg->rank);
        return snprintf(buf, cap, "lora disabled");
    }
    int n = snprintf(buf, cap, "lora enabled: rank %d, alpha %d%s, targets [", cfg->rank, cfg->alpha,
                     cfg->alpha_given ? "" : " (= rank)");
    for (size_t i = 0; i < cfg->n_targets; i++) {
        size_t o = n < 0 ? 0 : (size_t)n;
        n += snprintf(o < cap ? buf + o : NULL, o < cap ? cap - o : 0, "%s%s", i ? ", " : "",
                      cfg->targets[i]);
    }
    size_t o = (size_t)n;
    n += snprintf(o < cap ? buf + o : NULL, o < cap ? cap - o : 0, "]%s",
                  cfg->targets_given ? "" : " (default)");
    return n;
}
