/* yaml_doc.c — see yaml_doc.h. The only file under src/ that includes
 * <yaml.h>.
 *
 * libyaml's document loader composes the node graph (aliases resolved to node
 * ids, so a DAG, and with a self-referencing anchor even a cycle). We mirror
 * it node for node: one array of lk_ynode indexed like libyaml's, one array
 * of child pointers, so the tree costs two allocations however many aliases
 * point into it. A single iterative depth-first pass from the root in
 * document order gives each node its parent (the first place it occurs) and
 * never visits a node twice, so hostile graphs cannot make it loop or blow
 * up. Duplicate keys are found by sorting each mapping's keys: O(n log n)
 * even for a mapping with a million keys. */
#include "io/yaml_doc.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <yaml.h>

#include "core/file.h"
#include "core/msg.h"
#include "lorakit/alloc.h"

struct lk_ydoc {
    yaml_document_t doc; /* owns the scalar texts */
    lk_ynode *nodes;     /* nodes[i] mirrors libyaml node id i + 1 */
    size_t n_nodes;
    lk_ynode **kids;     /* all child pointers */
    char *label;
};

/* ------------------------------------------------------------ scalars */

static int text_is(const char *t, size_t len, const char *s) {
    return len == strlen(s) && !memcmp(t, s, len);
}

static int one_of(const char *t, size_t len, const char *const *list) {
    for (; *list; list++)
        if (text_is(t, len, *list)) return 1;
    return 0;
}

static int is_digit(char c) { return c >= '0' && c <= '9'; }

/* [-+]?[0-9]+ */
static int match_int(const char *t, size_t len) {
    size_t i = (len && (t[0] == '-' || t[0] == '+')) ? 1 : 0;
    if (i == len) return 0;
    for (; i < len; i++)
        if (!is_digit(t[i])) return 0;
    return 1;
}

/* [-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)? */
static int match_float(const char *t, size_t len) {
    size_t i = (len && (t[0] == '-' || t[0] == '+')) ? 1 : 0, d = 0;
    while (i < len && is_digit(t[i])) i++, d++;
    if (i < len && t[i] == '.') {
        i++;
        while (i < len && is_digit(t[i])) i++, d++;
    }
    if (!d) return 0;
    if (i < len && (t[i] == 'e' || t[i] == 'E')) {
        i++;
        if (i < len && (t[i] == '-' || t[i] == '+')) i++;
        size_t e = i;
        while (i < len && is_digit(t[i])) i++;
        if (i == e) return 0;
    }
    return i == len;
}

int lk_ytext_int(const char *t, size_t len, long long lo, long long hi, long long *out) {
    if (!t || len > 20 || !match_int(t, len)) return 0;
    char buf[24];
    memcpy(buf, t, len);
    buf[len] = '\0';
    errno = 0;
    long long v = strtoll(buf, NULL, 10);
    if (errno || v < lo || v > hi) return 0;
    *out = v;
    return 1;
}

/* Resolves a plain scalar by the rules in yaml_doc.h. */
static void resolve_plain(lk_ynode *n) {
    static const char *const nulls[] = {"", "~", "null", "Null", "NULL", NULL};
    static const char *const trues[] = {"true", "True", "TRUE", "yes", "Yes", "YES", "on", "On", "ON", NULL};
    static const char *const falses[] = {"false", "False", "FALSE", "no", "No", "NO", "off", "Off", "OFF", NULL};
    static const char *const infs[] = {".inf", ".Inf", ".INF", "+.inf", "+.Inf", "+.INF", NULL};
    static const char *const ninfs[] = {"-.inf", "-.Inf", "-.INF", NULL};
    static const char *const nans[] = {".nan", ".NaN", ".NAN", NULL};
    const char *t = n->text;
    size_t len = n->len;
    n->type = LK_Y_STR;
    if (memchr(t, '\0', len)) return; /* plain scalars cannot hold NUL, but be sure */
    if (one_of(t, len, nulls)) {
        n->type = LK_Y_NULL;
    } else if (one_of(t, len, trues)) {
        n->type = LK_Y_BOOL;
        n->b = 1;
    } else if (one_of(t, len, falses)) {
        n->type = LK_Y_BOOL;
        n->b = 0;
    } else if (match_int(t, len)) {
        n->type = LK_Y_INT;
        errno = 0;
        n->i = strtoll(t, NULL, 10);
        n->int_ok = !errno;
        n->f = strtod(t, NULL);
    } else if (match_float(t, len)) {
        n->type = LK_Y_FLOAT;
        n->f = strtod(t, NULL); /* overflow gives +-HUGE_VAL: not finite */
    } else if (one_of(t, len, infs)) {
        n->type = LK_Y_FLOAT;
        n->f = INFINITY;
    } else if (one_of(t, len, ninfs)) {
        n->type = LK_Y_FLOAT;
        n->f = -INFINITY;
    } else if (one_of(t, len, nans)) {
        n->type = LK_Y_FLOAT;
        n->f = NAN;
    }
}

int lk_ynode_bool(const lk_ynode *n, int *out) {
    if (!n || n->type != LK_Y_BOOL) return 0;
    *out = n->b;
    return 1;
}

int lk_ynode_int(const lk_ynode *n, long long lo, long long hi, long long *out) {
    if (!n || n->type != LK_Y_INT || !n->int_ok || n->i < lo || n->i > hi) return 0;
    *out = n->i;
    return 1;
}

int lk_ynode_num(const lk_ynode *n, double *out) {
    if (!n || (n->type != LK_Y_INT && n->type != LK_Y_FLOAT) || !isfinite(n->f)) return 0;
    *out = n->f;
    return 1;
}

const char *lk_ynode_str(const lk_ynode *n) {
    if (!n || n->type == LK_Y_NULL || n->type == LK_Y_SEQ || n->type == LK_Y_MAP) return NULL;
    if (memchr(n->text, '\0', n->len)) return NULL;
    return n->text;
}

const lk_ynode *lk_ymap_get(const lk_ynode *m, const char *key) {
    if (!m || m->type != LK_Y_MAP) return NULL;
    for (size_t i = 0; i < m->n; i++) {
        const lk_ynode *k = lk_ymap_key(m, i);
        if (k->type != LK_Y_SEQ && k->type != LK_Y_MAP && text_is(k->text, k->len, key))
            return lk_ymap_val(m, i);
    }
    return NULL;
}

/* ----------------------------------------------------------- messages */

/* Appends a printable excerpt of at most max characters of t (others as
 * '?'), and "...(N bytes)" with t's whole length when t is longer. */
static size_t put_text(char *buf, size_t o, size_t cap, const char *t, size_t len, size_t max) {
    size_t show = len > max ? max : len;
    for (size_t i = 0; i < show && o + 1 < cap; i++) {
        unsigned char c = (unsigned char)t[i];
        buf[o++] = (c >= 0x20 && c < 0x7f) ? (char)c : '?';
    }
    if (len > max && o + 1 < cap) {
        int w = snprintf(buf + o, cap - o, "...(%zu bytes)", len);
        o = w < 0 ? o : o + (size_t)w < cap ? o + (size_t)w : cap - 1;
    }
    buf[o < cap ? o : cap - 1] = '\0';
    return o;
}

void lk_ynode_repr(const lk_ynode *n, char *buf, size_t cap) {
    if (!cap) return;
    if (!n) snprintf(buf, cap, "nothing");
    else if (n->type == LK_Y_MAP) snprintf(buf, cap, "a mapping");
    else if (n->type == LK_Y_SEQ) snprintf(buf, cap, "a list");
    else if (cap >= 3) {
        buf[0] = '\'';
        size_t o = put_text(buf, 1, cap - 1, n->text, n->len, 32);
        buf[o++] = '\'';
        buf[o] = '\0';
    } else {
        buf[0] = '\0';
    }
}

#define PATH_DEPTH 24 /* deeper paths show their innermost levels after "...(N levels)." */

/* The path's text into buf (NULL: only measured); returns its length. Keys
 * are whole, non-printable bytes as '?'. */
static size_t path_text(const lk_ynode *n, const char *key, char *buf) {
    const lk_ynode *chain[PATH_DEPTH];
    size_t depth = 0, cut = 0, o = 0;
    for (const lk_ynode *x = n; x && x->parent; x = x->parent) {
        if (depth == PATH_DEPTH) cut++;
        else chain[depth++] = x;
    }
    char ix[48];
    if (cut) {
        int w = snprintf(ix, sizeof ix, "...(%zu levels)", cut);
        if (buf) memcpy(buf + o, ix, (size_t)w);
        o += (size_t)w;
    }
    while (depth-- > 0) {
        const lk_ynode *x = chain[depth], *p = x->parent;
        const char *t;
        size_t tl;
        int dot = 0;
        if (p->type == LK_Y_SEQ) {
            int w = snprintf(ix, sizeof ix, "[%zu]", x->slot);
            t = ix, tl = (size_t)w;
        } else {
            const lk_ynode *k = p->kids[x->slot & ~(size_t)1];
            dot = o > 0;
            if (k->type == LK_Y_SEQ || k->type == LK_Y_MAP) t = "?", tl = 1;
            else t = k->text, tl = k->len;
        }
        if (dot && buf) buf[o] = '.';
        o += (size_t)dot;
        for (size_t i = 0; buf && i < tl; i++) {
            unsigned char c = (unsigned char)t[i];
            buf[o + i] = (c >= 0x20 && c < 0x7f) ? (char)c : '?';
        }
        o += tl;
    }
    if (key && *key) {
        size_t kl = strlen(key);
        if (o && buf) buf[o] = '.';
        o += o > 0;
        if (buf) memcpy(buf + o, key, kl);
        o += kl;
    }
    if (buf) buf[o] = '\0';
    return o;
}

char *lk_ynode_path_dup(const lk_ynode *n, const char *key) {
    char *b = lk_malloc(path_text(n, key, NULL) + 1);
    if (b) path_text(n, key, b);
    return b;
}

void lk_ynode_path(const lk_ynode *n, char *buf, size_t cap) {
    if (!cap) return;
    char *p = lk_ynode_path_dup(n, NULL);
    if (!p) {
        buf[0] = '\0';
        return;
    }
    lk_msg_fit(buf, cap, p, strlen(p)); /* a path longer than cap loses its middle, with the count */
    lk_free(p);
}

lk_status lk_yerr(const lk_ydoc *d, const lk_ynode *n, const char *key, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    lk_verror(LK_ERR_CONFIG, fmt, ap); /* the reason first, whole (a long argument keeps head, tail and length) */
    va_end(ap);
    char line[32] = "";
    if (n) snprintf(line, sizeof line, ":%d", n->line);
    char *path = lk_ynode_path_dup(n, key); /* whole; the message shortens a long one with its length */
    if (path && *path) lk_error_prefix(LK_ERR_CONFIG, "%s%s: %s", d->label, line, path);
    else lk_error_prefix(LK_ERR_CONFIG, "%s%s", d->label, line);
    lk_free(path);
    return LK_ERR_CONFIG;
}

/* ------------------------------------------------------------ the tree */

const lk_ynode *lk_ydoc_root(const lk_ydoc *d) { return d->n_nodes ? &d->nodes[0] : NULL; }
const char *lk_ydoc_label(const lk_ydoc *d) { return d->label; }

void lk_ydoc_free(lk_ydoc *d) {
    if (!d) return;
    yaml_document_delete(&d->doc);
    lk_free(d->nodes);
    lk_free(d->kids);
    lk_free(d->label);
    lk_free(d);
}

/* Mirrors libyaml's nodes; every id it holds is in range (it assigned them). */
static lk_status build(lk_ydoc *d) {
    yaml_document_t *doc = &d->doc;
    size_t n = (size_t)(doc->nodes.top - doc->nodes.start), nk = 0;
    for (yaml_node_t *y = doc->nodes.start; y < doc->nodes.top; y++) {
        if (y->type == YAML_SEQUENCE_NODE) nk += (size_t)(y->data.sequence.items.top - y->data.sequence.items.start);
        if (y->type == YAML_MAPPING_NODE) nk += 2 * (size_t)(y->data.mapping.pairs.top - y->data.mapping.pairs.start);
    }
    d->n_nodes = n;
    if (!n) return LK_OK;
    d->nodes = lk_calloc(n, sizeof *d->nodes);
    d->kids = nk ? lk_calloc(nk, sizeof *d->kids) : NULL;
    if (!d->nodes || (nk && !d->kids)) return lk_error(LK_ERR_NOMEM, "%s: out of memory", d->label);
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        yaml_node_t *y = &doc->nodes.start[i];
        lk_ynode *x = &d->nodes[i];
        x->line = (int)y->start_mark.line + 1;
        if (y->type == YAML_SCALAR_NODE) {
            x->text = (const char *)y->data.scalar.value;
            x->len = y->data.scalar.length;
            if (y->data.scalar.style == YAML_PLAIN_SCALAR_STYLE) resolve_plain(x);
            else x->type = LK_Y_STR;
        } else if (y->type == YAML_SEQUENCE_NODE) {
            x->type = LK_Y_SEQ;
            x->text = "";
            x->kids = nk ? d->kids + k : NULL;
            for (yaml_node_item_t *it = y->data.sequence.items.start; it < y->data.sequence.items.top; it++)
                d->kids[k++] = &d->nodes[*it - 1];
            x->n = (size_t)(y->data.sequence.items.top - y->data.sequence.items.start);
        } else {
            x->type = LK_Y_MAP;
            x->text = "";
            x->kids = nk ? d->kids + k : NULL;
            for (yaml_node_pair_t *p = y->data.mapping.pairs.start; p < y->data.mapping.pairs.top; p++) {
                d->kids[k++] = &d->nodes[p->key - 1];
                d->kids[k++] = &d->nodes[p->value - 1];
            }
            x->n = (size_t)(y->data.mapping.pairs.top - y->data.mapping.pairs.start);
        }
    }
    /* parents: depth-first from the root in document order, so a node's
     * parent is its first occurrence (an anchor before its aliases); each
     * node is expanded once, each child pointer pushed at most once */
    typedef struct { lk_ynode *node, *parent; size_t slot; } visit;
    visit *stack = lk_malloc((nk + 1) * sizeof *stack);
    char *seen = lk_calloc(n, 1);
    if (!stack || !seen) {
        lk_free(stack);
        lk_free(seen);
        return lk_error(LK_ERR_NOMEM, "%s: out of memory", d->label);
    }
    size_t top = 0;
    stack[top++] = (visit){&d->nodes[0], NULL, 0};
    while (top) {
        visit v = stack[--top];
        size_t id = (size_t)(v.node - d->nodes);
        if (seen[id]) continue;
        seen[id] = 1;
        v.node->parent = v.parent;
        v.node->slot = v.slot;
        size_t cnt = v.node->type == LK_Y_SEQ ? v.node->n : v.node->type == LK_Y_MAP ? 2 * v.node->n : 0;
        for (size_t j = cnt; j-- > 0;) /* reversed, so the first child is visited first */
            if (!seen[v.node->kids[j] - d->nodes]) stack[top++] = (visit){v.node->kids[j], v.node, j};
    }
    lk_free(stack);
    lk_free(seen);
    return LK_OK;
}

static int cmp_key(const void *a, const void *b) {
    const lk_ynode *x = *(const lk_ynode *const *)a, *y = *(const lk_ynode *const *)b;
    if (x->len != y->len) return x->len < y->len ? -1 : 1;
    int c = memcmp(x->text, y->text, x->len);
    if (c) return c;
    return (x->line > y->line) - (x->line < y->line);
}

/* A repeated scalar key in any mapping: reports the repeat on the smallest
 * line, naming the line of the first copy. */
static lk_status check_duplicates(lk_ydoc *d) {
    size_t most = 0;
    for (size_t i = 0; i < d->n_nodes; i++)
        if (d->nodes[i].type == LK_Y_MAP && d->nodes[i].n > most) most = d->nodes[i].n;
    if (most < 2) return LK_OK;
    const lk_ynode **keys = lk_malloc(most * sizeof *keys);
    if (!keys) return lk_error(LK_ERR_NOMEM, "%s: out of memory", d->label);
    const lk_ynode *dup = NULL;
    int first_line = 0;
    for (size_t i = 0; i < d->n_nodes; i++) {
        const lk_ynode *m = &d->nodes[i];
        if (m->type != LK_Y_MAP || m->n < 2) continue;
        size_t nk = 0;
        for (size_t j = 0; j < m->n; j++) {
            const lk_ynode *k = lk_ymap_key(m, j);
            if (k->type != LK_Y_SEQ && k->type != LK_Y_MAP) keys[nk++] = k;
        }
        qsort(keys, nk, sizeof *keys, cmp_key);
        for (size_t j = 0; j + 1 < nk; j++) {
            const lk_ynode *a = keys[j], *b = keys[j + 1];
            if (a->len != b->len || memcmp(a->text, b->text, a->len)) continue;
            if (!dup || b->line < dup->line) {
                dup = b;
                first_line = a->line;
            }
            while (j + 1 < nk && keys[j + 1]->len == a->len && !memcmp(keys[j + 1]->text, a->text, a->len)) j++;
        }
    }
    lk_free(keys);
    if (!dup) return LK_OK;
    /* dup may be a key node of a mapping reached only through an alias of a
     * key: give it its own path from the mapping that holds it */
    return lk_yerr(d, dup, NULL, "duplicate key (first at line %d)", first_line);
}

static lk_status yaml_fail(const lk_ydoc *d, yaml_parser_t *p) {
    return lk_error(p->error == YAML_MEMORY_ERROR ? LK_ERR_NOMEM : LK_ERR_FORMAT,
                    "%s:%d: invalid YAML: %s%s%s", d->label, (int)p->problem_mark.line + 1,
                    p->problem ? p->problem : "parse error", p->context ? " " : "",
                    p->context ? p->context : "");
}

lk_status lk_ydoc_parse(const char *text, size_t len, const char *label, lk_ydoc **out) {
    if (!out || (len && !text)) return lk_error(LK_ERR_ARG, "lk_ydoc_parse: NULL argument");
    *out = NULL;
    if (!label) label = "(yaml)";
    if (len > LK_CONFIG_MAX_BYTES)
        return lk_error(LK_ERR_CONFIG, "%s: %zu bytes is past the %u-byte limit for a config file",
                        label, len, LK_CONFIG_MAX_BYTES);
    lk_ydoc *d = lk_calloc(1, sizeof *d);
    if (!d) return lk_error(LK_ERR_NOMEM, "%s: out of memory", label);
    d->label = lk_strdup(label);
    yaml_parser_t parser;
    if (!d->label || !yaml_parser_initialize(&parser)) {
        lk_free(d->label);
        lk_free(d);
        return lk_error(LK_ERR_NOMEM, "%s: out of memory", label);
    }
    yaml_parser_set_input_string(&parser, (const unsigned char *)(text ? text : ""), len);
    lk_status s = LK_OK;
    if (!yaml_parser_load(&parser, &d->doc)) {
        s = yaml_fail(d, &parser);
        yaml_parser_delete(&parser);
        lk_free(d->label);
        lk_free(d);
        return s;
    }
    /* a second document is refused, not silently ignored */
    yaml_document_t extra;
    if (!yaml_parser_load(&parser, &extra)) {
        s = yaml_fail(d, &parser);
    } else {
        if (yaml_document_get_root_node(&extra))
            s = lk_error(LK_ERR_CONFIG, "%s:%d: a config file is one YAML document; found another",
                         d->label, (int)extra.start_mark.line + 1);
        yaml_document_delete(&extra);
    }
    yaml_parser_delete(&parser);
    if (!s) s = build(d);
    if (!s) s = check_duplicates(d);
    if (s) {
        lk_ydoc_free(d);
        return s;
    }
    *out = d;
    return LK_OK;
}

lk_status lk_ydoc_load(const char *path, lk_ydoc **out) {
    if (!path || !out) return lk_error(LK_ERR_ARG, "lk_ydoc_load: NULL argument");
    *out = NULL;
    char *buf;
    size_t len;
    lk_status s = lk_read_config(path, &buf, &len);
    if (s) return s;
    s = lk_ydoc_parse(buf, len, path, out);
    lk_free(buf);
    return s;
}
