/* config.c — the `models.<role>.lora` block of a training config (YAML).
 *
 * The rules are fastvideo's LoraConfig.coerce/__post_init__ (see
 * shared/reference/): enable defaults to false; enable without rank, rank <= 0
 * under enable and a non-integer rank are errors; rank while disabled is
 * accepted and logged at info; alpha defaults to rank; unknown keys are a
 * warning listing the valid ones; a non-mapping block is an error; no block
 * means "not configured". Two deliberate tightenings, both errors rather than
 * Python's silent coercions: `enable` must be a YAML boolean (Python's
 * bool("false") is True), and target_modules must be a list (Python's
 * list("to_q") is four one-letter targets).
 *
 * libyaml's document loader builds a node graph with line marks, which gives
 * every error its file:line. Hostile input: the file is capped at 16 MiB,
 * aliases are never expanded (we only walk three fixed levels), duplicate keys
 * on the walked path are errors instead of "last one wins". */
#include "core/file.h"
#include "lorakit/lora.h"

#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <yaml.h>

#include "lorakit/alloc.h"
#include "lorakit/log.h"

#define CFG_MAX_BYTES (16u << 20)

const char *const lk_lora_default_targets[] = {
    "q_proj", "k_proj", "v_proj", "o_proj", "to_q", "to_k",
    "to_v", "to_out", "to_qkv", "to_gate_compress", NULL,
};

static const char *const g_valid_keys[] = {"enable", "rank", "alpha", "target_modules"};
#define N_VALID_KEYS 4

typedef struct {
    yaml_document_t doc;
    const char *label;
    const char *role;
} cfg_ctx;

static size_t node_line(const yaml_node_t *n) { return n ? n->start_mark.line + 1 : 0; }

static int scalar_is(const yaml_node_t *n, const char *s) {
    return n && n->type == YAML_SCALAR_NODE && n->data.scalar.length == strlen(s) &&
           !memcmp(n->data.scalar.value, s, n->data.scalar.length);
}

static int is_plain(const yaml_node_t *n) {
    return n->type == YAML_SCALAR_NODE && n->data.scalar.style == YAML_PLAIN_SCALAR_STYLE;
}

/* YAML 1.1 null, as PyYAML resolves it: ~, null, Null, NULL or empty (plain). */
static int is_null(const yaml_node_t *n) {
    if (!is_plain(n)) return 0;
    return n->data.scalar.length == 0 || scalar_is(n, "~") || scalar_is(n, "null") ||
           scalar_is(n, "Null") || scalar_is(n, "NULL");
}

/* YAML 1.1 booleans (plain scalars only); returns -1 if not one. */
static int as_bool(const yaml_node_t *n) {
    static const char *const t[] = {"true", "True", "TRUE", "yes", "Yes", "YES", "on", "On", "ON"};
    static const char *const f[] = {"false", "False", "FALSE", "no", "No", "NO", "off", "Off", "OFF"};
    if (!is_plain(n)) return -1;
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++)
        if (scalar_is(n, t[i])) return 1;
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
        if (scalar_is(n, f[i])) return 0;
    return -1;
}

/* A decimal integer (optional sign) fitting in int, as Python's int(str)
 * accepts it (surrounding spaces aside). Returns 1 on success. */
static int as_int(const yaml_node_t *n, long *out) {
    if (n->type != YAML_SCALAR_NODE) return 0;
    const char *s = (const char *)n->data.scalar.value;
    size_t len = n->data.scalar.length, i = 0;
    if (len == 0 || len > 20) return 0;
    if (s[0] == '+' || s[0] == '-') i = 1;
    if (i == len) return 0;
    for (size_t j = i; j < len; j++)
        if (s[j] < '0' || s[j] > '9') return 0;
    char buf[24];
    memcpy(buf, s, len);
    buf[len] = '\0';
    errno = 0;
    long v = strtol(buf, NULL, 10);
    if (errno || v > INT_MAX || v < INT_MIN) return 0;
    *out = v;
    return 1;
}

/* A printable excerpt of a scalar (or the node kind) for messages. */
static void node_repr(const yaml_node_t *n, char *buf, size_t cap) {
    if (n->type == YAML_MAPPING_NODE) {
        snprintf(buf, cap, "a mapping");
    } else if (n->type == YAML_SEQUENCE_NODE) {
        snprintf(buf, cap, "a list");
    } else {
        size_t len = n->data.scalar.length;
        if (len > 40) len = 40;
        size_t o = 0;
        if (cap < 4) return;
        buf[o++] = '\'';
        for (size_t i = 0; i < len && o + 3 < cap; i++) {
            unsigned char c = n->data.scalar.value[i];
            buf[o++] = (c >= 0x20 && c < 0x7f) ? (char)c : '?';
        }
        if (n->data.scalar.length > len && o + 6 < cap) {
            memcpy(buf + o, "...", 3);
            o += 3;
        }
        buf[o++] = '\'';
        buf[o] = '\0';
    }
}

/* Finds `key` in a mapping node; duplicate keys are an error. */
static lk_status map_get(cfg_ctx *c, yaml_node_t *map, const char *key, const char *path,
                         yaml_node_t **out) {
    *out = NULL;
    for (yaml_node_pair_t *p = map->data.mapping.pairs.start; p < map->data.mapping.pairs.top; p++) {
        yaml_node_t *k = yaml_document_get_node(&c->doc, p->key);
        if (!scalar_is(k, key)) continue;
        if (*out)
            return lk_error(LK_ERR_CONFIG, "%s:%zu: %s%s%s: duplicate key", c->label,
                            node_line(k), path, *path ? "." : "", key);
        *out = yaml_document_get_node(&c->doc, p->value);
    }
    return LK_OK;
}

static lk_status read_file(const char *path, char **buf, size_t *len) {
    lk_status s = lk_read_file(path, CFG_MAX_BYTES, buf, len);
    if (s == LK_OK && *len > CFG_MAX_BYTES) {
        lk_free(*buf);
        *buf = NULL;
        return lk_error(LK_ERR_FORMAT, "%s: config larger than %u bytes", path, CFG_MAX_BYTES);
    }
    return s;
}

/* Parses the YAML and returns the `models` mapping node. With
 * allow_missing, a config without a 'models' key is not an error: *models
 * is NULL and the document stays loaded for the caller to delete. */
static lk_status load_models(cfg_ctx *c, const char *yaml, size_t len, yaml_node_t **models,
                             int allow_missing) {
    yaml_parser_t parser;
    if (len > CFG_MAX_BYTES)
        return lk_error(LK_ERR_FORMAT, "%s: config larger than %u bytes", c->label, CFG_MAX_BYTES);
    if (!yaml_parser_initialize(&parser))
        return lk_error(LK_ERR_NOMEM, "%s: cannot initialise the YAML parser", c->label);
    yaml_parser_set_input_string(&parser, (const unsigned char *)yaml, len);
    if (!yaml_parser_load(&parser, &c->doc)) {
        lk_status s = lk_error(parser.error == YAML_MEMORY_ERROR ? LK_ERR_NOMEM : LK_ERR_FORMAT,
                               "%s:%zu: invalid YAML: %s%s%s", c->label,
                               (size_t)parser.problem_mark.line + 1,
                               parser.problem ? parser.problem : "parse error",
                               parser.context ? " " : "", parser.context ? parser.context : "");
        yaml_parser_delete(&parser);
        return s;
    }
    yaml_parser_delete(&parser);
    yaml_node_t *root = yaml_document_get_root_node(&c->doc);
    if (!root || root->type != YAML_MAPPING_NODE) {
        lk_status s = lk_error(LK_ERR_CONFIG, "%s:%zu: the config must be a mapping with a 'models' key",
                               c->label, node_line(root));
        yaml_document_delete(&c->doc);
        return s;
    }
    lk_status s = map_get(c, root, "models", "", models);
    if (s == LK_OK && !*models && allow_missing) return LK_OK;
    if (s == LK_OK && !*models)
        s = lk_error(LK_ERR_CONFIG, "%s: no 'models' key", c->label);
    else if (s == LK_OK && (*models)->type != YAML_MAPPING_NODE)
        s = lk_error(LK_ERR_CONFIG, "%s:%zu: models: must be a mapping of roles", c->label,
                     node_line(*models));
    if (s != LK_OK) yaml_document_delete(&c->doc);
    return s;
}

static lk_status cfg_err(cfg_ctx *c, const yaml_node_t *n, const char *key, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static lk_status cfg_err(cfg_ctx *c, const yaml_node_t *n, const char *key, const char *fmt, ...) {
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return lk_error(LK_ERR_CONFIG, "%s:%zu: models.%s.lora%s%s: %s", c->label, node_line(n),
                    c->role, key ? "." : "", key ? key : "", msg);
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

static lk_status parse_targets(cfg_ctx *c, yaml_node_t *v, lk_lora_config *cfg) {
    if (is_null(v)) return LK_OK;
    if (v->type != YAML_SEQUENCE_NODE) {
        char r[64];
        node_repr(v, r, sizeof r);
        return cfg_err(c, v, "target_modules", "must be a list of module name substrings, got %s", r);
    }
    size_t n = (size_t)(v->data.sequence.items.top - v->data.sequence.items.start);
    if (n == 0) return LK_OK; /* [] falls back to the defaults, as `or` does in the reference */
    cfg->targets = lk_calloc(n, sizeof(char *));
    if (!cfg->targets) return lk_error(LK_ERR_NOMEM, "out of memory");
    for (size_t i = 0; i < n; i++) {
        yaml_node_t *it = yaml_document_get_node(&c->doc, v->data.sequence.items.start[i]);
        if (!it || it->type != YAML_SCALAR_NODE || it->data.scalar.length == 0 || is_null(it) ||
            memchr(it->data.scalar.value, '\0', it->data.scalar.length)) {
            char r[64] = "?";
            if (it) node_repr(it, r, sizeof r);
            return cfg_err(c, it ? it : v, "target_modules",
                           "item %zu must be a non-empty string, got %s", i, r);
        }
        cfg->targets[i] = lk_malloc(it->data.scalar.length + 1);
        if (!cfg->targets[i]) return lk_error(LK_ERR_NOMEM, "out of memory");
        memcpy(cfg->targets[i], it->data.scalar.value, it->data.scalar.length);
        cfg->targets[i][it->data.scalar.length] = '\0';
        cfg->n_targets = i + 1;
    }
    cfg->targets_given = 1;
    return LK_OK;
}

static lk_status parse_int_key(cfg_ctx *c, yaml_node_t *v, const char *key, int *val, int *given) {
    long x;
    *given = 0;
    if (is_null(v)) return LK_OK;
    if (!as_int(v, &x)) {
        char r[64];
        node_repr(v, r, sizeof r);
        return cfg_err(c, v, key, "must be an integer, got %s", r);
    }
    *val = (int)x;
    *given = 1;
    return LK_OK;
}

/* The lora mapping itself. */
static lk_status parse_block(cfg_ctx *c, yaml_node_t *lora, lk_lora_config *cfg) {
    yaml_node_t *v[N_VALID_KEYS] = {0};
    lk_status s;
    /* Known keys (duplicates are errors), then unknown ones (a warning). */
    for (int k = 0; k < N_VALID_KEYS; k++) {
        char path[320];
        snprintf(path, sizeof path, "models.%s.lora", c->role);
        if ((s = map_get(c, lora, g_valid_keys[k], path, &v[k])) != LK_OK) return s;
    }
    char unknown[384] = "";
    size_t ulen = 0;
    for (yaml_node_pair_t *p = lora->data.mapping.pairs.start; p < lora->data.mapping.pairs.top; p++) {
        yaml_node_t *k = yaml_document_get_node(&c->doc, p->key);
        int known = 0;
        for (int j = 0; j < N_VALID_KEYS && !known; j++) known = scalar_is(k, g_valid_keys[j]);
        if (known) continue;
        char r[64];
        node_repr(k, r, sizeof r);
        cfg->n_unknown_keys++;
        if (ulen < sizeof unknown - 1) {
            int w = snprintf(unknown + ulen, sizeof unknown - ulen, "%s%s", ulen ? ", " : "", r);
            if (w > 0) ulen += (size_t)w;
            if (ulen >= sizeof unknown) ulen = sizeof unknown - 1;
        }
    }
    yaml_node_t *enable = v[0], *rank = v[1], *alpha = v[2], *targets = v[3];
    if (enable && !is_null(enable)) {
        int b = as_bool(enable);
        if (b < 0) {
            char r[64];
            node_repr(enable, r, sizeof r);
            return cfg_err(c, enable, "enable", "must be true or false, got %s", r);
        }
        cfg->enable = b;
    }
    int rank_given = 0;
    if (rank && (s = parse_int_key(c, rank, "rank", &cfg->rank, &rank_given)) != LK_OK) return s;
    if (alpha && (s = parse_int_key(c, alpha, "alpha", &cfg->alpha, &cfg->alpha_given)) != LK_OK)
        return s;
    if (targets && (s = parse_targets(c, targets, cfg)) != LK_OK) return s;
    if (!cfg->targets && (s = set_default_targets(cfg)) != LK_OK) return s;

    if (cfg->enable) {
        if (!rank_given)
            return cfg_err(c, rank ? rank : lora, "rank",
                           "enable is true but rank is unset: an explicit positive rank is "
                           "required to enable LoRA");
        if (cfg->rank <= 0) return cfg_err(c, rank, "rank", "must be > 0, got %d", cfg->rank);
    }
    if (!cfg->alpha_given) cfg->alpha = rank_given ? cfg->rank : 0;
    if (!rank_given) cfg->rank = 0;

    if (cfg->n_unknown_keys) {
        snprintf(cfg->warning, sizeof cfg->warning,
                 "%s:%zu: models.%s.lora: ignoring unrecognized lora keys [%s] (valid keys: "
                 "enable, rank, alpha, target_modules)",
                 c->label, node_line(lora), c->role, unknown);
        lk_log(LK_LOG_WARN, "%s", cfg->warning);
    }
    if (!cfg->enable && rank_given) {
        snprintf(cfg->info, sizeof cfg->info,
                 "%s:%zu: models.%s.lora.rank=%d is set but lora.enable is false: LoRA will "
                 "NOT be applied (the model trains on its normal trainable path)",
                 c->label, node_line(rank), c->role, cfg->rank);
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

lk_status lk_lora_config_parse(const char *yaml, size_t len, const char *label, const char *role,
                               lk_lora_config *out) {
    if (!out) return lk_error(LK_ERR_ARG, "lk_lora_config_parse: out is NULL");
    memset(out, 0, sizeof *out);
    if (!yaml || !role || !*role) return lk_error(LK_ERR_ARG, "lk_lora_config_parse: no YAML or no role");
    cfg_ctx c = {.label = label ? label : "<config>", .role = role};
    yaml_node_t *models;
    lk_status s = load_models(&c, yaml, len, &models, 0);
    if (s != LK_OK) return s;
    yaml_node_t *r = NULL, *lora = NULL;
    s = map_get(&c, models, role, "models", &r);
    if (s == LK_OK && !r) {
        char names[512] = "";
        size_t o = 0;
        for (yaml_node_pair_t *p = models->data.mapping.pairs.start;
             p < models->data.mapping.pairs.top && o < sizeof names - 1; p++) {
            char rr[64];
            node_repr(yaml_document_get_node(&c.doc, p->key), rr, sizeof rr);
            int w = snprintf(names + o, sizeof names - o, "%s%s", o ? ", " : "", rr);
            if (w > 0) o += (size_t)w;
        }
        s = lk_error(LK_ERR_CONFIG, "%s:%zu: models: no role '%s' (roles: %s)", c.label,
                     node_line(models), role, o ? names : "none");
    } else if (s == LK_OK && is_null(r)) {
        /* `student:` with nothing under it: no lora block either. */
    } else if (s == LK_OK && r->type != YAML_MAPPING_NODE) {
        s = lk_error(LK_ERR_CONFIG, "%s:%zu: models.%s: must be a mapping", c.label, node_line(r), role);
    } else if (s == LK_OK) {
        char path[320];
        snprintf(path, sizeof path, "models.%s", role);
        s = map_get(&c, r, "lora", path, &lora);
    }
    if (s == LK_OK && lora && !is_null(lora)) {
        if (lora->type != YAML_MAPPING_NODE) {
            char rr[64];
            node_repr(lora, rr, sizeof rr);
            s = cfg_err(&c, lora, NULL, "must be a mapping, got %s", rr);
        } else {
            out->configured = 1;
            s = parse_block(&c, lora, out);
        }
    }
    yaml_document_delete(&c.doc);
    if (s != LK_OK) lk_lora_config_clear(out);
    return s;
}

lk_status lk_lora_config_load(const char *path, const char *role, lk_lora_config *out) {
    if (!out) return lk_error(LK_ERR_ARG, "lk_lora_config_load: out is NULL");
    memset(out, 0, sizeof *out);
    if (!path) return lk_error(LK_ERR_ARG, "lk_lora_config_load: path is NULL");
    char *buf;
    size_t len;
    lk_status s = read_file(path, &buf, &len);
    if (s != LK_OK) return s;
    s = lk_lora_config_parse(buf, len, path, role, out);
    lk_free(buf);
    return s;
}

void lk_lora_roles_free(char **roles, size_t n) {
    if (!roles) return;
    for (size_t i = 0; i < n; i++) lk_free(roles[i]);
    lk_free(roles);
}

lk_status lk_lora_config_roles(const char *path, char ***roles, size_t *n) {
    if (!roles || !n || !path) return lk_error(LK_ERR_ARG, "lk_lora_config_roles: NULL argument");
    *roles = NULL;
    *n = 0;
    char *buf;
    size_t len;
    lk_status s = read_file(path, &buf, &len);
    if (s != LK_OK) return s;
    cfg_ctx c = {.label = path, .role = ""};
    yaml_node_t *models;
    s = load_models(&c, buf, len, &models, 1);
    lk_free(buf);
    if (s != LK_OK) return s;
    if (!models) { /* no models block: no roles, LoRA not configured anywhere */
        yaml_document_delete(&c.doc);
        return LK_OK;
    }
    size_t cnt = (size_t)(models->data.mapping.pairs.top - models->data.mapping.pairs.start);
    char **r = lk_calloc(cnt ? cnt : 1, sizeof(char *));
    if (!r) s = lk_error(LK_ERR_NOMEM, "%s: out of memory", path);
    size_t i = 0;
    for (; s == LK_OK && i < cnt; i++) {
        yaml_node_t *k = yaml_document_get_node(&c.doc, models->data.mapping.pairs.start[i].key);
        if (!k || k->type != YAML_SCALAR_NODE ||
            memchr(k->data.scalar.value, '\0', k->data.scalar.length)) {
            s = lk_error(LK_ERR_CONFIG, "%s:%zu: models: role names must be strings", path,
                         node_line(k));
            break;
        }
        r[i] = lk_malloc(k->data.scalar.length + 1);
        if (!r[i]) {
            s = lk_error(LK_ERR_NOMEM, "%s: out of memory", path);
            break;
        }
        memcpy(r[i], k->data.scalar.value, k->data.scalar.length);
        r[i][k->data.scalar.length] = '\0';
    }
    yaml_document_delete(&c.doc);
    if (s != LK_OK) {
        lk_lora_roles_free(r, cnt);
        return s;
    }
    *roles = r;
    *n = cnt;
    return LK_OK;
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
