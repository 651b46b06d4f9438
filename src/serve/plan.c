/* plan.c — parser of the `lorakit swap` plan (see lorakit/plan.h).
 *
 * libyaml's document API builds the node tree; the schema is walked by hand
 * so every error can name the file, the line and the exact key path
 * ("plan.yaml:4: steps[1].loras[0].strength: ..."). The input is hostile:
 * scalars may hold NUL bytes, anchors may fan one list out many times, so
 * sizes and entry counts are bounded and every scalar is checked before use. */
#include "core/file.h"
#include "lorakit/plan.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <yaml.h>

#include "lorakit/alloc.h"

typedef struct pctx {
    yaml_document_t *doc;
    const char *label;
    const char *base_dir;
    size_t entries; /* steps + adapters so far, against LK_PLAN_MAX_ENTRIES */
} pctx;

static int line_of(const yaml_node_t *n) { return n ? (int)n->start_mark.line + 1 : 0; }

static lk_status perr(const pctx *c, const yaml_node_t *n, const char *key, const char *fmt, const char *what) {
    return lk_error(LK_ERR_CONFIG, "%s:%d: %s: %s%s", c->label, line_of(n), key, fmt, what ? what : "");
}

/* A plain or quoted scalar without NUL bytes, or NULL. */
static const char *scalar(const yaml_node_t *n) {
    if (!n || n->type != YAML_SCALAR_NODE) return NULL;
    const char *v = (const char *)n->data.scalar.value;
    if (memchr(v, '\0', n->data.scalar.length)) return NULL;
    return v;
}

static int is_plain(const yaml_node_t *n) { return n->data.scalar.style == YAML_PLAIN_SCALAR_STYLE; }

static lk_status get_bool(const pctx *c, const yaml_node_t *n, const char *key, int *out) {
    const char *v = scalar(n);
    if (v && is_plain(n)) {
        if (!strcasecmp(v, "true") || !strcasecmp(v, "yes") || !strcasecmp(v, "on")) return *out = 1, LK_OK;
        if (!strcasecmp(v, "false") || !strcasecmp(v, "no") || !strcasecmp(v, "off")) return *out = 0, LK_OK;
    }
    return perr(c, n, key, "expected true or false", NULL);
}

static lk_status get_double(const pctx *c, const yaml_node_t *n, const char *key, double *out) {
    const char *v = scalar(n);
    if (v && is_plain(n) && *v) {
        char *end;
        errno = 0;
        double d = strtod(v, &end);
        if (!*end && !errno && isfinite(d)) return *out = d, LK_OK;
    }
    return perr(c, n, key, "expected a finite number, got ", v ? v : "a non-scalar");
}

static const yaml_node_t *node(const pctx *c, yaml_node_item_t id) {
    return yaml_document_get_node(c->doc, id);
}

static lk_status parse_lora(pctx *c, const yaml_node_t *n, const char *key, lk_fuse_input *out) {
    if (!n || n->type != YAML_MAPPING_NODE)
        return perr(c, n, key, "expected a mapping {path: ..., strength: ...}", NULL);
    const char *path = NULL;
    double strength = 1.0; /* the default when a step omits it */
    char sub[200];
    for (yaml_node_pair_t *p = n->data.mapping.pairs.start; p < n->data.mapping.pairs.top; p++) {
        const yaml_node_t *kn = node(c, p->key), *vn = node(c, p->value);
        const char *k = scalar(kn);
        if (!k) return perr(c, kn, key, "keys must be strings", NULL);
        snprintf(sub, sizeof sub, "%s.%.40s", key, k);
        lk_status s = LK_OK;
        if (!strcmp(k, "path")) {
            path = scalar(vn);
            if (!path || !*path) return perr(c, vn, sub, "expected a non-empty file or folder path", NULL);
        } else if (!strcmp(k, "strength")) {
            s = get_double(c, vn, sub, &strength);
        } else if (!strcmp(k, "format")) {
            const char *f = scalar(vn);
            if (!f) return perr(c, vn, sub, "expected a format name", NULL);
            s = lk_adapter_format_parse(f, &out->format);
            if (s) return lk_error_prefix(LK_ERR_CONFIG, "%s:%d: %s", c->label, line_of(vn), sub);
        } else {
            return perr(c, kn, sub, "unknown key (valid: path, strength, format)", NULL);
        }
        if (s) return s;
    }
    if (!path) return perr(c, n, key, "missing 'path'", NULL);
    if (strength < -3.4e38 || strength > 3.4e38) return perr(c, n, key, "strength is out of the float range", NULL);
    out->strength = (float)strength;
    size_t bl = (c->base_dir && path[0] != '/') ? strlen(c->base_dir) : 0;
    char *full = lk_malloc(bl + strlen(path) + 2);
    if (!full) return lk_error(LK_ERR_NOMEM, "%s: out of memory", c->label);
    if (bl) sprintf(full, "%s/%s", c->base_dir, path);
    else strcpy(full, path);
    out->path = full;
    return LK_OK;
}

static lk_status parse_step(pctx *c, const yaml_node_t *n, size_t si, lk_plan_step *st) {
    char key[96];
    snprintf(key, sizeof key, "steps[%zu]", si);
    st->line = line_of(n);
    if (!n || n->type != YAML_MAPPING_NODE) return perr(c, n, key, "expected a mapping with 'loras'", NULL);
    const yaml_node_t *list = NULL;
    for (yaml_node_pair_t *p = n->data.mapping.pairs.start; p < n->data.mapping.pairs.top; p++) {
        const yaml_node_t *kn = node(c, p->key);
        const char *k = scalar(kn);
        if (!k || strcmp(k, "loras"))
            return perr(c, kn, key, "unknown key (valid: loras) ", k ? k : "");
        list = node(c, p->value);
    }
    snprintf(key, sizeof key, "steps[%zu].loras", si);
    if (!list || list->type != YAML_SEQUENCE_NODE)
        return perr(c, list ? list : n, key, "expected a list of {path, strength} ([] resets)", NULL);
    size_t cnt = (size_t)(list->data.sequence.items.top - list->data.sequence.items.start);
    if (cnt > LK_PLAN_MAX_ENTRIES - c->entries) return perr(c, list, key, "too many adapters in the plan", NULL);
    c->entries += cnt;
    if (cnt) {
        st->loras = lk_calloc(cnt, sizeof *st->loras);
        if (!st->loras) return lk_error(LK_ERR_NOMEM, "%s: out of memory", c->label);
    }
    for (size_t i = 0; i < cnt; i++) {
        char sub[128];
        snprintf(sub, sizeof sub, "%s[%zu]", key, i);
        lk_status s = parse_lora(c, node(c, list->data.sequence.items.start[i]), sub, &st->loras[i]);
        if (s) return s;
        st->n++;
    }
    return LK_OK;
}

static lk_status parse_root(pctx *c, lk_plan *p) {
    const yaml_node_t *root = yaml_document_get_root_node(c->doc);
    if (!root) return lk_error(LK_ERR_CONFIG, "%s: the plan is empty (it needs 'steps')", c->label);
    if (root->type != YAML_MAPPING_NODE) return perr(c, root, "(top level)", "expected a mapping with 'steps'", NULL);
    const yaml_node_t *steps = NULL;
    for (yaml_node_pair_t *q = root->data.mapping.pairs.start; q < root->data.mapping.pairs.top; q++) {
        const yaml_node_t *kn = node(c, q->key), *vn = node(c, q->value);
        const char *k = scalar(kn);
        if (!k) return perr(c, kn, "(top level)", "keys must be strings", NULL);
        if (!strcmp(k, "bucket_mb")) {
            const char *v = scalar(vn);
            char *end = NULL;
            errno = 0;
            long b = (v && is_plain(vn) && *v) ? strtol(v, &end, 10) : 0;
            if (!v || !end || *end || errno || b <= 0 || b > (1L << 20))
                return perr(c, vn, "bucket_mb", "expected a whole number of MiB in 1..1048576, got ", v ? v : "a non-scalar");
            p->bucket_mb = b;
        } else if (!strcmp(k, "no_lora_swap")) {
            lk_status s = get_bool(c, vn, "no_lora_swap", &p->no_lora_swap);
            if (s) return s;
        } else if (!strcmp(k, "allow_nonfinite")) {
            lk_status s = get_bool(c, vn, "allow_nonfinite", &p->allow_nonfinite);
            if (s) return s;
        } else if (!strcmp(k, "steps")) {
            steps = vn;
        } else {
            return perr(c, kn, k, "unknown key (valid: bucket_mb, no_lora_swap, allow_nonfinite, steps)", NULL);
        }
    }
    if (!steps || steps->type != YAML_SEQUENCE_NODE)
        return perr(c, steps ? steps : root, "steps", "expected a list of steps", NULL);
    size_t cnt = (size_t)(steps->data.sequence.items.top - steps->data.sequence.items.start);
    if (cnt > LK_PLAN_MAX_ENTRIES) return perr(c, steps, "steps", "too many steps", NULL);
    c->entries = cnt;
    if (cnt) {
        p->steps = lk_calloc(cnt, sizeof *p->steps);
        if (!p->steps) return lk_error(LK_ERR_NOMEM, "%s: out of memory", c->label);
    }
    for (size_t i = 0; i < cnt; i++) {
        lk_status s = parse_step(c, node(c, steps->data.sequence.items.start[i]), i, &p->steps[i]);
        p->n_steps = i + 1; /* so lk_plan_free releases a partly parsed step */
        if (s) return s;
    }
    return LK_OK;
}

lk_status lk_plan_parse(const char *text, size_t len, const char *label, const char *base_dir, lk_plan **out) {
    if (!out || (len && !text)) return lk_error(LK_ERR_ARG, "lk_plan_parse: NULL argument");
    *out = NULL;
    if (!label) label = "(plan)";
    if (len > LK_PLAN_MAX_BYTES)
        return lk_error(LK_ERR_CONFIG, "%s: %zu bytes is past the %u-byte limit for a plan", label, len, LK_PLAN_MAX_BYTES);
    lk_plan *p = lk_calloc(1, sizeof *p);
    if (!p) return lk_error(LK_ERR_NOMEM, "%s: out of memory", label);
    yaml_parser_t parser;
    yaml_document_t doc;
    if (!yaml_parser_initialize(&parser)) {
        lk_free(p);
        return lk_error(LK_ERR_NOMEM, "%s: out of memory", label);
    }
    yaml_parser_set_input_string(&parser, (const unsigned char *)(text ? text : ""), len);
    lk_status s = LK_OK;
    if (!yaml_parser_load(&parser, &doc)) {
        s = lk_error(LK_ERR_CONFIG, "%s:%d: YAML error: %s%s%s", label, (int)parser.problem_mark.line + 1,
                     parser.problem ? parser.problem : "malformed input", parser.context ? " " : "",
                     parser.context ? parser.context : "");
    } else {
        pctx c = {&doc, label, base_dir, 0};
        s = parse_root(&c, p);
        yaml_document_delete(&doc);
        if (!s) { /* a second document is refused, not silently ignored */
            yaml_document_t extra;
            if (!yaml_parser_load(&parser, &extra)) {
                s = lk_error(LK_ERR_CONFIG, "%s:%d: YAML error: %s", label, (int)parser.problem_mark.line + 1,
                             parser.problem ? parser.problem : "malformed input");
            } else {
                if (yaml_document_get_root_node(&extra))
                    s = lk_error(LK_ERR_CONFIG, "%s:%d: a plan is one YAML document; found another", label,
                                 (int)extra.start_mark.line + 1);
                yaml_document_delete(&extra);
            }
        }
    }
    yaml_parser_delete(&parser);
    if (s) {
        lk_plan_free(p);
        return s;
    }
    *out = p;
    return LK_OK;
}

lk_status lk_plan_load(const char *path, lk_plan **out) {
    if (!path || !out) return lk_error(LK_ERR_ARG, "lk_plan_load: NULL argument");
    *out = NULL;
    /* a file past the limit comes back as LK_PLAN_MAX_BYTES + 1 bytes, which
     * lk_plan_parse reports */
    char *buf;
    size_t len;
    lk_status s = lk_read_file(path, LK_PLAN_MAX_BYTES, &buf, &len);
    if (s != LK_OK) return s;
    const char *slash = strrchr(path, '/');
    char *dir = NULL;
    if (slash) {
        size_t dl = slash == path ? 1 : (size_t)(slash - path);
        dir = lk_malloc(dl + 1);
        if (dir) {
            memcpy(dir, path, dl);
            dir[dl] = '\0';
        }
    }
    s = (slash && !dir) ? lk_error(LK_ERR_NOMEM, "%s: out of memory", path)
                        : lk_plan_parse(buf, len, path, dir, out);
    lk_free(dir);
    lk_free(buf);
    return s;
}

void lk_plan_free(lk_plan *p) {
    if (!p) return;
    for (size_t i = 0; i < p->n_steps; i++) {
        for (size_t j = 0; j < p->steps[i].n; j++) lk_free((void *)p->steps[i].loras[j].path);
        lk_free(p->steps[i].loras);
    }
    lk_free(p->steps);
    lk_free(p);
}
