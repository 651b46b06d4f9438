/* yaml_doc.h — the one YAML front-end of lorakit (internal, not installed).
 *
 * Every YAML file lorakit reads (swap plans, training configs, the
 * `models.<role>.lora` block) goes through here: a bounded read
 * (LK_CONFIG_MAX_BYTES), one YAML document turned into a tree of nodes with
 * line numbers, one rule set for what a plain scalar means, duplicate keys
 * refused anywhere in the file, and messages of the form
 * `file:line: path.to.key: ...`. The schema walkers (serve/plan.c,
 * lora/config.c, app/train.c) only walk this tree; libyaml is used by
 * yaml_doc.c alone.
 *
 * Scalar rules (one set, YAML 1.1 as PyYAML resolves it for null and bool,
 * decimal numbers only):
 *   - a quoted scalar ('x' or "x") is always a string;
 *   - a plain scalar is null if it is empty, ~, null, Null or NULL;
 *     a bool if it is true/True/TRUE/yes/Yes/YES/on/On/ON (1) or
 *     false/False/FALSE/no/No/NO/off/Off/OFF (0);
 *     an int if it matches [-+]?[0-9]+ (decimal; 0x.., 0o.. are strings);
 *     a float if it matches [-+]?(.[0-9]+|[0-9]+(.[0-9]*)?)([eE][-+]?[0-9]+)?
 *     or is .inf/-.inf/.nan (any of the three YAML spellings);
 *     otherwise a string.
 * Tags are not interpreted. Aliases share the anchored node (no copies, so
 * alias fan-out costs nothing); a node's path and line are those of its
 * first occurrence in the file, which is where its text is. */
#ifndef LK_IO_YAML_DOC_H
#define LK_IO_YAML_DOC_H

#include <stddef.h>
#include "lorakit/status.h"

typedef enum lk_ytype {
    LK_Y_NULL,
    LK_Y_BOOL,
    LK_Y_INT,
    LK_Y_FLOAT,
    LK_Y_STR,
    LK_Y_SEQ,
    LK_Y_MAP,
} lk_ytype;

typedef struct lk_ynode lk_ynode;
struct lk_ynode {
    lk_ytype type;
    int line;            /* 1-based line where the node starts */
    const char *text;    /* scalars: the text as written, NUL-terminated */
    size_t len;          /* scalars: its length (the text may hold NUL bytes) */
    int b;               /* LK_Y_BOOL: 0 or 1 */
    double f;            /* LK_Y_INT, LK_Y_FLOAT: the value (ints also exactly in i) */
    long long i;         /* LK_Y_INT: the value, if int_ok */
    int int_ok;          /* LK_Y_INT: the value fits in long long */
    size_t n;            /* LK_Y_SEQ: items; LK_Y_MAP: key/value pairs */
    lk_ynode **kids;     /* LK_Y_SEQ: n items; LK_Y_MAP: key0, value0, key1, value1, ... */
    const lk_ynode *parent; /* where the node first occurs (NULL for the root) */
    size_t slot;         /* its index in parent->kids */
};

typedef struct lk_ydoc lk_ydoc;

/* Reads path (at most LK_CONFIG_MAX_BYTES) and parses it; errors name the
 * path. A file is one YAML document: a second one is an error. */
lk_status lk_ydoc_load(const char *path, lk_ydoc **out);
/* Parses text[0..len) (need not be NUL-terminated); label names it in
 * messages. Malformed YAML is LK_ERR_FORMAT, a repeated key in any mapping
 * LK_ERR_CONFIG naming both lines, a text past LK_CONFIG_MAX_BYTES
 * LK_ERR_CONFIG. */
lk_status lk_ydoc_parse(const char *text, size_t len, const char *label, lk_ydoc **out);
void lk_ydoc_free(lk_ydoc *d);

/* The root node, NULL for an empty document. */
const lk_ynode *lk_ydoc_root(const lk_ydoc *d);
const char *lk_ydoc_label(const lk_ydoc *d);

/* Mappings: pair i's key and value; the value of a string key or NULL. */
static inline const lk_ynode *lk_ymap_key(const lk_ynode *m, size_t i) { return m->kids[2 * i]; }
static inline const lk_ynode *lk_ymap_val(const lk_ynode *m, size_t i) { return m->kids[2 * i + 1]; }
const lk_ynode *lk_ymap_get(const lk_ynode *map, const char *key);

/* Typed reads by the rules above; each returns 1 and sets *out on success,
 * 0 (out untouched) otherwise. NULL n is never a match. */
int lk_ynode_bool(const lk_ynode *n, int *out);
/* an int in lo..hi */
int lk_ynode_int(const lk_ynode *n, long long lo, long long hi, long long *out);
/* an int or a float, finite */
int lk_ynode_num(const lk_ynode *n, double *out);
/* The text of a string, or of any other non-null scalar (paths and names
 * such as `123` or `true` are taken as written); NULL for null, a
 * collection, or text with a NUL byte. */
const char *lk_ynode_str(const lk_ynode *n);
/* Decimal integer text ([-+]?[0-9]+, at most 20 characters) in lo..hi:
 * the coercion Python's int(str) does, for schemas that follow a Python
 * reference which coerces strings. */
int lk_ytext_int(const char *text, size_t len, long long lo, long long hi, long long *out);

/* "steps[1].loras[0].strength" (empty for the root), keys whole (bytes
 * outside printable ASCII as '?'), then ".key" when key is given: an
 * lk_malloc'd string, NULL when out of memory. */
char *lk_ynode_path_dup(const lk_ynode *n, const char *key);
/* The same into buf; one longer than cap loses its middle, which is
 * replaced by "...(N bytes elided)...". */
void lk_ynode_path(const lk_ynode *n, char *buf, size_t cap);
/* A printable excerpt for messages: 'text' (at most 32 characters, others
 * as ?, a longer one followed by "...(N bytes)" with its length), "a
 * mapping" or "a list". */
void lk_ynode_repr(const lk_ynode *n, char *buf, size_t cap);
/* Records LK_ERR_CONFIG "label:line: path[.key]: message" for node n (the
 * line of n; n NULL gives "label: key: message") and returns it. */
lk_status lk_yerr(const lk_ydoc *d, const lk_ynode *n, const char *key, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#endif
