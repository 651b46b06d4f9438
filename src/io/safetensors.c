/* safetensors.c — the safetensors reader (mmap, zero-copy, fully validated)
 * and the atomic, streaming writer.
 *
 * Format: an 8-byte little-endian header length N, N bytes of UTF-8 JSON
 * (an object: tensor name -> {dtype, shape, data_offsets}, plus an optional
 * "__metadata__" string->string object), then the data buffer.
 *
 * Reader. Files are hostile input: we check everything huggingface's Rust
 * `safetensors` crate (the format's reference implementation) checks (header length bound and 8+N overflow, UTF-8,
 * JSON object, known dtype, non-negative integer shape and offsets, begin <=
 * end, element count * element size with overflow checks equal to end-begin,
 * the tensors sorted by offset tiling the data buffer from 0 with no gap or
 * overlap, the file ending exactly at the last end), and a little more
 * (duplicate keys, __metadata__ strictly string->string). Every rejection is
 * LK_ERR_FORMAT naming the file and, where there is one, the tensor. Tensors
 * are views into the mapping, kept in file (offset) order; a name-sorted
 * index gives O(log n) lookup.
 *
 * Writer. Same layout as the crate's serializer: tensors ordered by dtype
 * (largest element first; our lk_dtype enum follows the crate's Dtype order) then
 * name, packed, header padded with spaces to a multiple of 8, so every tensor
 * is aligned to its element size within the file. The caller declares all
 * tensors, then begin() writes the header into a temporary file next to the
 * destination and sizes the file; data arrives in any order and any chunking
 * through pwrite, so multi-GB outputs never sit in memory. commit() checks
 * that every byte was written, fsyncs, renames into place and fsyncs the
 * directory; any failure (or free without commit) unlinks the temporary. */
#include "lorakit/safetensors.h"
#include "io/out_file.h"
#include "core/file.h"
#include "core/alloc.h"
#include "lorakit/alloc.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define META_KEY "__metadata__"

/* ------------------------------------------------------------------ reader */

typedef struct {
    char *k, *v;
} st_kv;

struct lk_st {
    char *path;
    unsigned char *base;  /* whole file image */
    size_t len;
    int mapped;           /* base from mmap (else lk_malloc) */
    int fd;               /* kept open for lk_st_read (-1 for memory images) */
    uint64_t header_len;
    size_t n;
    lk_tensor *t;         /* file (offset) order */
    size_t *by_name;      /* indices sorted by name */
    char *names;          /* all names, NUL-separated */
    size_t n_meta;
    st_kv *meta;          /* sorted by key */
};

/* A tensor entry while parsing. */
typedef struct {
    lk_dtype dtype;
    int ndim;
    int64_t shape[LK_MAX_DIMS];
    uint64_t begin, end;
} st_entry;

static int utf8_valid(const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        unsigned c = s[i];
        size_t k;
        uint32_t cp;
        if (c < 0x80) { i++; continue; }
        if (c >= 0xc2 && c <= 0xdf) { k = 1; cp = c & 0x1f; }
        else if (c >= 0xe0 && c <= 0xef) { k = 2; cp = c & 0x0f; }
        else if (c >= 0xf0 && c <= 0xf4) { k = 3; cp = c & 0x07; }
        else return 0;
        if (n - i <= k) return 0;
        for (size_t j = 1; j <= k; j++) {
            if ((s[i + j] & 0xc0) != 0x80) return 0;
            cp = (cp << 6) | (s[i + j] & 0x3f);
        }
        if ((k == 2 && cp < 0x800) || (k == 3 && (cp < 0x10000 || cp > 0x10ffff)) ||
            (cp >= 0xd800 && cp <= 0xdfff))
            return 0;
        i += k + 1;
    }
    return 1;
}

/* A JSON value that must be a non-negative integer (jansson already rejects
 * integers beyond int64 at parse time). */
static int get_u64(const json_t *v, uint64_t *out) {
    if (!json_is_integer(v)) return 0;
    json_int_t x = json_integer_value(v);
    if (x < 0) return 0;
    *out = (uint64_t)x;
    return 1;
}

static const char *json_kind(const json_t *v) {
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_STRING: return "a string";
    case JSON_INTEGER: return json_integer_value(v) < 0 ? "a negative integer" : "an integer";
    case JSON_REAL: return "a non-integer number";
    case JSON_TRUE:
    case JSON_FALSE: return "a boolean";
    case JSON_NULL: return "null";
    }
    return "?";
}

static lk_status parse_entry(const char *lbl, const char *name, const json_t *v, st_entry *e) {
    if (!json_is_object(v))
        return lk_error(LK_ERR_FORMAT, "%s: %s: tensor entry is %s, expected an object", lbl, name,
                        json_kind(v));
    const json_t *dt = json_object_get(v, "dtype");
    const json_t *sh = json_object_get(v, "shape");
    const json_t *of = json_object_get(v, "data_offsets");
    if (!dt) return lk_error(LK_ERR_FORMAT, "%s: %s: missing \"dtype\"", lbl, name);
    if (!sh) return lk_error(LK_ERR_FORMAT, "%s: %s: missing \"shape\"", lbl, name);
    if (!of) return lk_error(LK_ERR_FORMAT, "%s: %s: missing \"data_offsets\"", lbl, name);
    if (!json_is_string(dt))
        return lk_error(LK_ERR_FORMAT, "%s: %s: dtype is %s, expected a string", lbl, name, json_kind(dt));
    e->dtype = lk_dtype_from_name(json_string_value(dt), json_string_length(dt));
    if (e->dtype == LK_DTYPE_INVALID)
        return lk_error(LK_ERR_FORMAT, "%s: %s: unknown dtype \"%.32s\"", lbl, name, json_string_value(dt));
    if (!json_is_array(sh))
        return lk_error(LK_ERR_FORMAT, "%s: %s: shape is %s, expected an array", lbl, name, json_kind(sh));
    size_t nd = json_array_size(sh);
    if (nd > LK_MAX_DIMS)
        return lk_error(LK_ERR_FORMAT, "%s: %s: shape has %zu dimensions, lorakit supports at most %d",
                        lbl, name, nd, LK_MAX_DIMS);
    e->ndim = (int)nd;
    for (size_t i = 0; i < nd; i++) {
        uint64_t d;
        const json_t *x = json_array_get(sh, i);
        if (!get_u64(x, &d))
            return lk_error(LK_ERR_FORMAT, "%s: %s: shape[%zu] is %s, expected a non-negative integer",
                            lbl, name, i, json_kind(x));
        e->shape[i] = (int64_t)d;
    }
    if (!json_is_array(of) || json_array_size(of) != 2)
        return lk_error(LK_ERR_FORMAT, "%s: %s: data_offsets must be an array [begin, end]", lbl, name);
    for (size_t i = 0; i < 2; i++) {
        const json_t *x = json_array_get(of, i);
        uint64_t d;
        if (!get_u64(x, &d))
            return lk_error(LK_ERR_FORMAT, "%s: %s: data_offsets[%zu] is %s, expected a non-negative integer",
                            lbl, name, i, json_kind(x));
        if (i == 0) e->begin = d; else e->end = d;
    }
    if (e->begin > e->end)
        return lk_error(LK_ERR_FORMAT, "%s: %s: data_offsets begin %llu > end %llu", lbl, name,
                        (unsigned long long)e->begin, (unsigned long long)e->end);
    /* Element count and byte size, overflow-checked (as the crate). */
    uint64_t numel = 1;
    for (int i = 0; i < e->ndim; i++) {
        uint64_t d = (uint64_t)e->shape[i];
        if (d != 0 && numel > UINT64_MAX / d)
            return lk_error(LK_ERR_FORMAT, "%s: %s: element count of the shape overflows", lbl, name);
        numel *= d;
    }
    uint64_t es = lk_dtype_size(e->dtype);
    if (numel > UINT64_MAX / es || numel * es > SIZE_MAX)
        return lk_error(LK_ERR_FORMAT, "%s: %s: byte size of the shape overflows", lbl, name);
    if (numel * es != e->end - e->begin)
        return lk_error(LK_ERR_FORMAT,
                        "%s: %s: shape and dtype give %llu bytes but data_offsets [%llu, %llu] span %llu",
                        lbl, name, (unsigned long long)(numel * es), (unsigned long long)e->begin,
                        (unsigned long long)e->end, (unsigned long long)(e->end - e->begin));
    return LK_OK;
}


void lk_st_close(lk_st *st) {
    if (!st) return;
    if (st->base) {
        if (st->mapped) munmap(st->base, st->len);
        else lk_free(st->base);
    }
    if (st->fd >= 0) close(st->fd);
    for (size_t i = 0; i < st->n_meta; i++) {
        lk_free(st->meta[i].k);
        lk_free(st->meta[i].v);
    }
    lk_free(st->meta);
    lk_free(st->t);
    lk_free(st->by_name);
    lk_free(st->names);
    lk_free(st->path);
    lk_free(st);
}

static int cmp_kv(const void *a, const void *b) {
    return strcmp(((const st_kv *)a)->k, ((const st_kv *)b)->k);
}

static lk_status parse_metadata(lk_st *st, const char *lbl, const json_t *m) {
    if (json_is_null(m)) return LK_OK;
    if (!json_is_object(m))
        return lk_error(LK_ERR_FORMAT, "%s: " META_KEY " is %s, expected an object of strings", lbl,
                        json_kind(m));
    size_t n = json_object_size(m);
    st->meta = lk_calloc(n ? n : 1, sizeof *st->meta);
    if (!st->meta) return lk_error(LK_ERR_NOMEM, "%s: out of memory reading metadata", lbl);
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)m, k, v) {
        if (!json_is_string(v))
            return lk_error(LK_ERR_FORMAT, "%s: " META_KEY ": value of \"%.200s\" is %s, expected a string",
                            lbl, k, json_kind(v));
        if (strlen(json_string_value(v)) != json_string_length(v))
            return lk_error(LK_ERR_FORMAT, "%s: " META_KEY ": value of \"%.200s\" contains a NUL", lbl, k);
        st_kv *kv = &st->meta[st->n_meta++];
        kv->k = lk_strdup(k);
        kv->v = lk_strdup(json_string_value(v));
        if (!kv->k || !kv->v) return lk_error(LK_ERR_NOMEM, "%s: out of memory reading metadata", lbl);
    }
    qsort(st->meta, st->n_meta, sizeof *st->meta, cmp_kv);
    return LK_OK;
}

/* ---- the header, without a DOM of it ----
 *
 * A 1.3 M-tensor header (95 MB) took 1.7 GB as one jansson DOM. The header
 * is read instead by a scanner that knows JSON's structure (strings with
 * their escapes, nesting, scalars) and hands each tensor entry's value, the
 * metadata and any escaped key, one at a time, to jansson (JSON_DECODE_ANY,
 * JSON_REJECT_DUPLICATES), which checks them as it checked the whole
 * header: so a value is valid exactly when it was, and what is held is the
 * mapping, one lk_tensor per tensor and the names once. The order of the
 * checks is the old one: invalid JSON (structure, a value, a duplicate
 * key), then __metadata__, then the entries in header order, then the
 * offsets. */

#define ST_MAX_DEPTH 2048 /* jansson's JSON_PARSER_MAX_DEPTH */

typedef struct {
    const char *h, *p, *end; /* header start, position, end */
    const char *why;         /* what a failed scan_value found */
} st_scan;

static void scan_ws(st_scan *s) {
    while (s->p < s->end && (*s->p == ' ' || *s->p == '\t' || *s->p == '\n' || *s->p == '\r')) s->p++;
}

/* The JSON error at byte p of the header, with jansson's line and column. */
static lk_status json_err_at(const char *lbl, const st_scan *s, const char *p, const char *what) {
    int line = 1, col = 0;
    for (const char *q = s->h; q < p; q++) {
        if (*q == '\n') line++, col = 0;
        else col++;
    }
    return lk_error(LK_ERR_FORMAT, "%s: header is not valid JSON (line %d, column %d): %s", lbl, line, col + 1, what);
}

/* A string token at s->p (a '"'): moves past it. *esc: it has an escape
 * (its raw bytes are then not its text). 0: unterminated, or a control
 * character inside (invalid JSON). */
static int scan_string(st_scan *s, int *esc) {
    *esc = 0;
    for (const char *p = s->p + 1; p < s->end; p++) {
        unsigned char c = (unsigned char)*p;
        if (c == '"') {
            s->p = p + 1;
            return 1;
        }
        if (c < 0x20) return 0;
        if (c == '\\') {
            *esc = 1;
            p++;
        }
    }
    return 0;
}

/* The extent of one value at s->p: moves past it; 0 on a structural error.
 * Its content is checked by jansson later. */
static int scan_value(st_scan *s) {
    int esc;
    s->why = "invalid JSON value";
    if (s->p >= s->end) return 0;
    if (*s->p == '"') return scan_string(s, &esc);
    if (*s->p == '{' || *s->p == '[') {
        size_t depth = 0;
        while (s->p < s->end) {
            char c = *s->p;
            if (c == '"') {
                if (!scan_string(s, &esc)) return 0;
                continue;
            }
            if (c == '{' || c == '[') {
                if (++depth >= ST_MAX_DEPTH) {
                    s->why = "maximum parsing depth reached";
                    return 0;
                }
            } else if (c == '}' || c == ']') {
                if (--depth == 0) {
                    s->p++;
                    return 1;
                }
            }
            s->p++;
        }
        return 0;
    }
    const char *q = s->p;
    while (q < s->end && *q != ',' && *q != '}' && *q != ']' && *q != ' ' && *q != '\t' && *q != '\n' && *q != '\r' &&
           *q != ':' && *q != '"')
        q++;
    if (q == s->p) return 0;
    s->p = q;
    return 1;
}

/* jansson's reading of the bytes [p, q) (one value); NULL with the error
 * raised when they are not valid JSON. */
static json_t *load_part(const char *lbl, const st_scan *s, const char *p, const char *q) {
    json_error_t je;
    json_t *v = json_loadb(p, (size_t)(q - p), JSON_DECODE_ANY | JSON_REJECT_DUPLICATES, &je);
    if (!v) json_err_at(lbl, s, p + (je.position > 0 ? je.position - 1 : 0), je.text);
    return v;
}

/* The text of the key token [p, q) (quotes included) into dst (room for
 * q - p bytes); *len its length. Raw bytes unless esc (then decoded by
 * jansson: \uXXXX, surrogate pairs; a NUL is invalid). */
static lk_status key_text(const char *lbl, const st_scan *s, const char *p, const char *q, int esc, char *dst,
                          size_t *len) {
    if (!esc) {
        *len = (size_t)(q - p) - 2;
        memcpy(dst, p + 1, *len);
        dst[*len] = '\0';
        return LK_OK;
    }
    json_t *v = load_part(lbl, s, p, q);
    if (!v) return LK_ERR_FORMAT;
    *len = json_string_length(v); /* an escape never lengthens a string */
    memcpy(dst, json_string_value(v), *len + 1);
    json_decref(v);
    return LK_OK;
}

static int idx_by_name(const void *a, const void *b, void *ctx) {
    const lk_tensor *t = ctx;
    return strcmp(t[*(const size_t *)a].name, t[*(const size_t *)b].name);
}

typedef struct {
    const lk_tensor *t;
    const uint64_t *begin;
} off_ctx;

static int idx_by_offset(const void *a, const void *b, void *ctx) {
    const off_ctx *c = ctx;
    size_t x = *(const size_t *)a, y = *(const size_t *)b;
    if (c->begin[x] != c->begin[y]) return c->begin[x] < c->begin[y] ? -1 : 1;
    uint64_t ex = c->begin[x] + c->t[x].nbytes, ey = c->begin[y] + c->t[y].nbytes;
    if (ex != ey) return ex < ey ? -1 : 1;
    return x < y ? -1 : x > y; /* header order: a stable sort */
}

/* A check that failed after the first (raised again at the end). */
typedef struct {
    lk_status s;
    char msg[2048];
} st_later;

static void later_keep(st_later *l, lk_status s) {
    if (s && !l->s) {
        l->s = s;
        snprintf(l->msg, sizeof l->msg, "%s", lk_last_error());
    }
}

/* ---- st_parse in steps: bound the header, scan it (pass 1), allocate the
 * table, read every value through jansson (pass 2), check the names, then
 * the offsets, and put the table into file order. Each step returns the
 * first error it finds; what it allocates into st is freed by lk_st_close,
 * the scratch by st_parse. */

/* The state shared by st_parse's steps. */
typedef struct {
    lk_st *st;
    const char *lbl;
    st_scan sc;                /* over the header's bytes */
    const char *first;         /* just after the header's '{' */
    const char *meta0, *meta1; /* the __metadata__ value's bytes (NULL: none) */
    size_t cnt;                /* tensor entries */
    size_t names_len;          /* room for their names and NULs */
    void *scratch;             /* one allocation holding begin and perm */
    uint64_t *begin;           /* each entry's first data byte, header order */
    size_t *perm;              /* header indices, put into offset order */
    st_later meta_err, ent_err; /* the first bad metadata / entry, raised after the names' check */
} st_parser;

/* A key token [k0, k1) spelling __metadata__ without escapes. */
static int raw_is_meta(const char *k0, const char *k1) {
    return (size_t)(k1 - k0) == sizeof META_KEY + 1 && !memcmp(k0 + 1, META_KEY, sizeof META_KEY - 1);
}

/* The 8-byte header length: bounded and inside the file; the header valid
 * UTF-8. Sets st->header_len and the scanner over the header. */
static lk_status parse_header_len(st_parser *p) {
    const lk_st *st = p->st;
    const unsigned char *b = st->base;
    if (st->len < 8)
        return lk_error(LK_ERR_FORMAT, "%s: file is %zu bytes, shorter than the 8-byte header length",
                        p->lbl, st->len);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = (n << 8) | b[i];
    if (n > LK_ST_MAX_HEADER)
        return lk_error(LK_ERR_FORMAT, "%s: header length %llu exceeds the limit of %llu bytes", p->lbl,
                        (unsigned long long)n, (unsigned long long)LK_ST_MAX_HEADER);
    /* n <= 1e8 here, so 8+n cannot overflow; the check stays for clarity. */
    if (n > UINT64_MAX - 8 || 8 + n > st->len)
        return lk_error(LK_ERR_FORMAT, "%s: header length %llu runs past the end of the %zu-byte file",
                        p->lbl, (unsigned long long)n, st->len);
    p->st->header_len = n;
    const char *h = (const char *)b + 8;
    if (!utf8_valid((const unsigned char *)h, (size_t)n))
        return lk_error(LK_ERR_FORMAT, "%s: header is not valid UTF-8", p->lbl);
    p->sc = (st_scan){h, h, h + n, NULL};
    return LK_OK;
}

/* A header whose first token is not '{': always an error saying what it is
 * (an array by its extent, without a DOM; anything else through jansson). */
static lk_status header_not_object(st_parser *p) {
    st_scan *sc = &p->sc;
    const char *v0 = sc->p;
    if (!scan_value(sc)) return json_err_at(p->lbl, sc, v0, sc->why);
    const char *v1 = sc->p;
    scan_ws(sc);
    if (sc->p != sc->end) return json_err_at(p->lbl, sc, sc->p, "end of file expected");
    /* an array is checked by jansson too unless large (its DOM would be many times its text) */
    if (*v0 == '[' && v1 - v0 > (1 << 20))
        return lk_error(LK_ERR_FORMAT, "%s: header is an array, expected a JSON object", p->lbl);
    json_t *v = load_part(p->lbl, sc, v0, v1);
    if (!v) return LK_ERR_FORMAT;
    lk_status s = lk_error(LK_ERR_FORMAT, "%s: header is %s, expected a JSON object", p->lbl, json_kind(v));
    json_decref(v);
    return s;
}

/* One member of the header object, at sc->p (after whitespace): its key and
 * value checked for structure, counted, __metadata__ noted. *more: 0 after
 * the object's closing '}'. Decodes an escaped key through jansson (freed). */
static lk_status scan_member(st_parser *p, int *more) {
    st_scan *sc = &p->sc;
    const char *k0 = sc->p;
    int esc;
    if (sc->p >= sc->end || *sc->p != '"') return json_err_at(p->lbl, sc, sc->p, "string or '}' expected");
    if (!scan_string(sc, &esc))
        return json_err_at(p->lbl, sc, k0, "invalid string (unterminated or a control character)");
    const char *k1 = sc->p;
    int is_meta = 0;
    if (!esc) {
        is_meta = raw_is_meta(k0, k1);
    } else {
        json_t *kv = load_part(p->lbl, sc, k0, k1);
        if (!kv) return LK_ERR_FORMAT;
        is_meta = !strcmp(json_string_value(kv), META_KEY);
        json_decref(kv);
    }
    scan_ws(sc);
    if (sc->p >= sc->end || *sc->p != ':') return json_err_at(p->lbl, sc, sc->p, "':' expected");
    sc->p++;
    scan_ws(sc);
    const char *v0 = sc->p;
    if (!scan_value(sc)) return json_err_at(p->lbl, sc, v0, sc->why);
    p->names_len += (size_t)(k1 - k0) - 1; /* the text (at most the raw bytes) and a NUL */
    if (is_meta) {
        if (p->meta0) return json_err_at(p->lbl, sc, k0, "duplicate object key");
        p->meta0 = v0, p->meta1 = sc->p;
    } else {
        p->cnt++;
    }
    scan_ws(sc);
    if (sc->p < sc->end && *sc->p == ',') sc->p++;
    else if (sc->p < sc->end && *sc->p == '}') *more = 0;
    else return json_err_at(p->lbl, sc, sc->p, "',' or '}' expected");
    return LK_OK;
}

/* Pass 1: the header's structure; counts the entries and their names'
 * bytes, finds __metadata__, checks that nothing follows the object. */
static lk_status scan_header(st_parser *p) {
    st_scan *sc = &p->sc;
    scan_ws(sc);
    if (sc->p == sc->end) return json_err_at(p->lbl, sc, sc->p, "'[' or '{' expected near end of file");
    if (*sc->p != '{') return header_not_object(p);
    p->first = ++sc->p;
    for (int more = 1; more;) {
        scan_ws(sc);
        if (sc->p < sc->end && *sc->p == '}' && p->cnt == 0 && !p->meta0) break;
        lk_status s = scan_member(p, &more);
        if (s) return s;
    }
    sc->p++;
    scan_ws(sc);
    if (sc->p != sc->end) return json_err_at(p->lbl, sc, sc->p, "end of file expected");
    return LK_OK;
}

/* The tensor table, the name index and the names (owned by st), and the
 * scratch begin and perm carved from one allocation (owned by p). */
static lk_status alloc_tables(st_parser *p) {
    lk_st *st = p->st;
    size_t c1 = p->cnt ? p->cnt : 1;
    lk_carve lay = {0};
    const size_t o_begin = LK_CARVE(&lay, c1, uint64_t), o_perm = LK_CARVE(&lay, c1, size_t);
    st->t = lk_calloc(c1, sizeof *st->t);
    st->by_name = lk_calloc(c1, sizeof *st->by_name);
    st->names = lk_malloc(p->names_len ? p->names_len : 1);
    p->scratch = lk_carve_alloc(&lay);
    if (!st->t || !st->by_name || !st->names || !p->scratch)
        return lk_error(LK_ERR_NOMEM, "%s: out of memory indexing %zu tensors", p->lbl, p->cnt);
    p->begin = (uint64_t *)(void *)((unsigned char *)p->scratch + o_begin);
    p->perm = (size_t *)(void *)((unsigned char *)p->scratch + o_perm);
    return LK_OK;
}

/* __metadata__ through jansson: invalid JSON is raised now, a bad value
 * kept for later (meta_err). The metadata table is owned by st. */
static lk_status read_metadata(st_parser *p) {
    if (!p->meta0) return LK_OK;
    json_t *m = load_part(p->lbl, &p->sc, p->meta0, p->meta1);
    if (!m) return LK_ERR_FORMAT;
    later_keep(&p->meta_err, parse_metadata(p->st, p->lbl, m));
    json_decref(m);
    return LK_OK;
}

/* Entry k of the table from its value v: name, dtype, shape, size and
 * begin; a bad entry is kept for later (ent_err), after which the entries
 * are only named. */
static void take_entry(st_parser *p, size_t k, const json_t *v) {
    lk_tensor *t = &p->st->t[k];
    if (!p->ent_err.s) {
        st_entry e;
        memset(&e, 0, sizeof e);
        lk_status es = parse_entry(p->lbl, t->name, v, &e);
        later_keep(&p->ent_err, es);
        t->dtype = e.dtype;
        t->ndim = e.ndim;
        memcpy(t->shape, e.shape, sizeof t->shape);
        t->nbytes = (size_t)(e.end - e.begin);
        p->begin[k] = e.begin;
    }
    p->perm[k] = p->st->by_name[k] = k;
}

/* Pass 2: every entry's value through jansson, in header order (the
 * structure is known good from pass 1); the names into st->names. */
static lk_status read_entries(st_parser *p) {
    st_scan *sc = &p->sc;
    char *np = p->st->names;
    sc->p = p->first;
    for (size_t k = 0; k < p->cnt;) {
        scan_ws(sc);
        const char *k0 = sc->p;
        int esc;
        scan_string(sc, &esc);
        const char *k1 = sc->p;
        scan_ws(sc);
        sc->p++; /* ':' */
        scan_ws(sc);
        const char *v0 = sc->p;
        scan_value(sc);
        const char *v1 = sc->p;
        scan_ws(sc);
        sc->p++; /* ',' or '}' */
        if (!esc && raw_is_meta(k0, k1)) continue;
        size_t kl;
        lk_status s = key_text(p->lbl, sc, k0, k1, esc, np, &kl);
        if (s) return s;
        if (esc && !strcmp(np, META_KEY)) continue; /* the escaped spelling of __metadata__ */
        json_t *v = load_part(p->lbl, sc, v0, v1);
        if (!v) return LK_ERR_FORMAT;
        p->st->t[k].name = np;
        np += kl + 1;
        take_entry(p, k, v);
        json_decref(v);
        k++;
    }
    return LK_OK;
}

/* Sorts the name index; a name twice is invalid JSON (jansson's duplicate
 * key), so it is raised before the errors kept for later. */
static lk_status check_names(st_parser *p) {
    const lk_st *st = p->st;
    qsort_r(st->by_name, p->cnt, sizeof *st->by_name, idx_by_name, st->t);
    for (size_t i = 1; i < p->cnt; i++)
        if (!strcmp(st->t[st->by_name[i]].name, st->t[st->by_name[i - 1]].name))
            return lk_error(LK_ERR_FORMAT, "%s: header is not valid JSON: duplicate object key \"%.200s\"", p->lbl,
                            st->t[st->by_name[i]].name);
    return LK_OK;
}

/* The first error kept for later, raised again: the metadata's, else the
 * first bad entry's. */
static lk_status raise_later(const st_parser *p) {
    if (!p->meta_err.s && !p->ent_err.s) return LK_OK;
    const st_later *l = p->meta_err.s ? &p->meta_err : &p->ent_err;
    return lk_error(l->s, "%s", l->msg);
}

/* Offsets: sorted by begin (perm) they must tile [0, data_len) exactly. */
static lk_status check_tiling(st_parser *p) {
    const lk_st *st = p->st;
    size_t *perm = p->perm;
    off_ctx oc = {st->t, p->begin};
    qsort_r(perm, p->cnt, sizeof *perm, idx_by_offset, &oc);
    uint64_t data_len = st->len - 8 - st->header_len, pos = 0;
    for (size_t i = 0; i < p->cnt; i++) {
        const lk_tensor *t = &st->t[perm[i]];
        uint64_t bg = p->begin[perm[i]], en = bg + t->nbytes;
        if (bg > pos)
            return lk_error(LK_ERR_FORMAT, "%s: %s: data_offsets begin %llu leaves a gap after byte %llu of the data buffer",
                            p->lbl, t->name, (unsigned long long)bg, (unsigned long long)pos);
        if (bg < pos)
            return lk_error(LK_ERR_FORMAT, "%s: %s: data_offsets [%llu, %llu] overlap %s, which ends at %llu",
                            p->lbl, t->name, (unsigned long long)bg, (unsigned long long)en, st->t[perm[i - 1]].name,
                            (unsigned long long)pos);
        if (en > data_len)
            return lk_error(LK_ERR_FORMAT, "%s: %s: data_offsets end %llu is past the end of the %llu-byte data buffer",
                            p->lbl, t->name, (unsigned long long)en, (unsigned long long)data_len);
        pos = en;
    }
    if (pos != data_len)
        return lk_error(LK_ERR_FORMAT, "%s: the tensors cover %llu bytes but the data buffer has %llu (trailing bytes)",
                        p->lbl, (unsigned long long)pos, (unsigned long long)data_len);
    return LK_OK;
}

/* Into file (offset) order, in place: t[i] <- t[perm[i]]; the name index
 * follows through the inverse, kept in begin once each data pointer is set.
 * Cannot fail; sets st->n. */
static void into_file_order(st_parser *p) {
    lk_st *st = p->st;
    size_t cnt = p->cnt, *perm = p->perm;
    uint64_t *begin = p->begin;
    for (size_t i = 0; i < cnt; i++) st->t[i].data = st->base + 8 + st->header_len + begin[i];
    for (size_t i = 0; i < cnt; i++) begin[perm[i]] = i;
    for (size_t i = 0; i < cnt; i++) st->by_name[i] = (size_t)begin[st->by_name[i]];
    for (size_t i = 0; i < cnt; i++) {
        if (perm[i] == SIZE_MAX || perm[i] == i) continue;
        lk_tensor tmp = st->t[i];
        size_t q = i;
        for (;;) {
            size_t src = perm[q];
            perm[q] = SIZE_MAX;
            if (src == i) {
                st->t[q] = tmp;
                break;
            }
            st->t[q] = st->t[src];
            q = src;
        }
    }
    st->n = cnt;
}

/* Parses and validates st->base[0..len) (already loaded); fills the index.
 * On failure st holds what was allocated (freed by lk_st_close), n is 0. */
static lk_status st_parse(lk_st *st) {
    st_parser p;
    memset(&p, 0, sizeof p);
    p.st = st;
    p.lbl = st->path;
    lk_status s = parse_header_len(&p);
    if (!s) s = scan_header(&p);
    if (!s) s = alloc_tables(&p);
    if (!s) s = read_metadata(&p);
    if (!s) s = read_entries(&p);
    if (!s) s = check_names(&p);
    if (!s) s = raise_later(&p);
    if (!s) s = check_tiling(&p);
    if (!s) into_file_order(&p);
    lk_free(p.scratch);
    return s;
}

static lk_status st_new(const char *label, lk_st **out) {
    lk_st *st = lk_calloc(1, sizeof *st);
    if (!st || !(st->path = lk_strdup(label ? label : "(memory)"))) {
        lk_free(st);
        return lk_error(LK_ERR_NOMEM, "%s: out of memory", label ? label : "(memory)");
    }
    st->fd = -1;
    *out = st;
    return LK_OK;
}

lk_status lk_st_open(const char *path, lk_st **out) {
    if (!path || !out) return lk_error(LK_ERR_ARG, "lk_st_open: NULL argument");
    *out = NULL;
    lk_st *st = NULL;
    lk_status s = st_new(path, &st);
    if (s) return s;
    int fd;
    if ((s = lk_open_input(path, &fd))) goto fail; /* a FIFO or a device is refused, never waited on */
    st->fd = fd; /* closed by lk_st_close */
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        s = lk_error(LK_ERR_IO, "%s: cannot stat: %s", path, strerror(errno));
        goto fail;
    }
    st->len = (size_t)sb.st_size;
    if (st->len > 0) {
        void *m = mmap(NULL, st->len, PROT_READ, MAP_PRIVATE, fd, 0);
        if (m == MAP_FAILED) {
            s = errno == ENOMEM ? lk_error(LK_ERR_NOMEM, "%s: out of memory: cannot map its %zu bytes (address-space "
                                           "limit, ulimit -v?)", path, st->len)
                                : lk_error(LK_ERR_IO, "%s: cannot mmap %zu bytes: %s", path, st->len, strerror(errno));
            goto fail;
        }
        st->base = m;
        st->mapped = 1;
    }
    if ((s = st_parse(st)) != LK_OK) goto fail;
    if (st->mapped) { /* the header's text is read (names copied): its pages need not stay resident */
        long pg = sysconf(_SC_PAGESIZE);
        size_t hb = pg > 0 ? (size_t)((8 + st->header_len) / (uint64_t)pg * (uint64_t)pg) : 0;
        if (hb) madvise(st->base, hb, MADV_DONTNEED);
    }
    *out = st;
    return LK_OK;
fail:
    lk_st_close(st);
    return lk_error_at(s, path, NULL);
}

lk_status lk_st_open_mem(const void *buf, size_t len, const char *label, lk_st **out) {
    if ((!buf && len) || !out) return lk_error(LK_ERR_ARG, "lk_st_open_mem: NULL argument");
    *out = NULL;
    lk_st *st = NULL;
    lk_status s = st_new(label, &st);
    if (s) return s;
    st->base = lk_malloc(len ? len : 1);
    if (!st->base) {
        s = lk_error(LK_ERR_NOMEM, "%s: out of memory copying %zu bytes", st->path, len);
        goto fail;
    }
    if (len) memcpy(st->base, buf, len);
    st->len = len;
    if ((s = st_parse(st)) != LK_OK) goto fail;
    *out = st;
    return LK_OK;
fail:
    lk_st_close(st);
    return s;
}

const char *lk_st_path(const lk_st *st) { return st->path; }
size_t lk_st_count(const lk_st *st) { return st->n; }
const lk_tensor *lk_st_tensor(const lk_st *st, size_t i) { return i < st->n ? &st->t[i] : NULL; }
uint64_t lk_st_file_offset(const lk_st *st, size_t i) {
    return i < st->n ? (uint64_t)((const unsigned char *)st->t[i].data - st->base) : 0;
}
uint64_t lk_st_header_len(const lk_st *st) { return st->header_len; }

lk_status lk_st_read(const lk_st *st, size_t i, uint64_t off, void *dst, size_t n) {
    if (!st || i >= st->n || (n && !dst)) return lk_error(LK_ERR_ARG, "lk_st_read: bad argument");
    const lk_tensor *t = &st->t[i];
    if (off > t->nbytes || n > t->nbytes - off)
        return lk_error(LK_ERR_ARG, "%s: %s: read of %zu bytes at %llu is past the tensor's %zu bytes", st->path,
                        t->name, n, (unsigned long long)off, t->nbytes);
    uint64_t at = lk_st_file_offset(st, i) + off;
    if (st->fd < 0) { /* a memory image cannot change */
        if (n) memcpy(dst, st->base + at, n);
        return LK_OK;
    }
    size_t got = 0;
    while (got < n) {
        size_t want = n - got;
        if (want > ((size_t)1 << 30)) want = (size_t)1 << 30; /* Linux caps one read below 2 GiB */
        ssize_t r = pread(st->fd, (unsigned char *)dst + got, want, (off_t)(at + got));
        if (r < 0 && errno == EINTR) continue;
        if (r < 0)
            return lk_error(LK_ERR_IO, "%s: %s: cannot read %zu bytes at offset %llu: %s", st->path, t->name, n,
                            (unsigned long long)at, strerror(errno));
        if (r == 0) break;
        got += (size_t)r;
    }
    if (got < n)
        return lk_error(LK_ERR_IO, "%s: %s: changed on disk while being read: expected %zu bytes at offset %llu, got %zu",
                        st->path, t->name, n, (unsigned long long)at, got);
    return LK_OK;
}

long lk_st_find(const lk_st *st, const char *name) {
    size_t lo = 0, hi = st->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(st->t[st->by_name[mid]].name, name);
        if (c == 0) return (long)st->by_name[mid];
        if (c < 0) lo = mid + 1;
        else hi = mid;
    }
    return -1;
}

size_t lk_st_metadata_count(const lk_st *st) { return st->n_meta; }

void lk_st_metadata_at(const lk_st *st, size_t i, const char **key, const char **value) {
    if (i >= st->n_meta) {
        if (key) *key = NULL;
        if (value) *value = NULL;
        return;
    }
    if (key) *key = st->meta[i].k;
    if (value) *value = st->meta[i].v;
}

const char *lk_st_metadata_get(const lk_st *st, const char *key) {
    size_t lo = 0, hi = st->n_meta;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(st->meta[mid].k, key);
        if (c == 0) return st->meta[mid].v;
        if (c < 0) lo = mid + 1;
        else hi = mid;
    }
    return NULL;
}

/* ------------------------------------------------------------------ writer */

typedef struct {
    uint64_t a, b; /* [a, b) written */
} st_span;

typedef struct {
    char *name;     /* in the writer's name chunks */
    lk_dtype dtype;
    int ndim;
    int64_t shape[LK_MAX_DIMS];
    uint64_t nbytes;
    uint64_t off;   /* absolute file offset, set by begin */
    st_span one;    /* the written range while there is one (no allocation per tensor) */
    st_span *spans; /* merged written ranges, sorted, once there are more; else NULL (then `one`) */
    size_t n_spans, cap_spans;
} st_wt;

/* Tensor names, packed into chunks: no allocation per tensor. */
typedef struct st_chunk {
    struct st_chunk *next;
    size_t used, cap;
    char data[];
} st_chunk;

struct lk_st_writer {
    char *path;
    lk_out_file of; /* the temporary file (io/out_file.h) */
    int begun, failed;
    st_wt *t;
    size_t n, cap;
    st_chunk *names;
    st_kv *meta;
    size_t n_meta, cap_meta;
};

static char *chunk_dup(st_chunk **head, const char *s) {
    size_t l = strlen(s) + 1;
    st_chunk *c = *head;
    if (!c || c->cap - c->used < l) {
        size_t cap = l > ((size_t)1 << 16) ? l : (size_t)1 << 16;
        if (!(c = lk_malloc(sizeof *c + cap))) return NULL;
        c->next = *head;
        c->used = 0;
        c->cap = cap;
        *head = c;
    }
    char *p = c->data + c->used;
    memcpy(p, s, l);
    c->used += l;
    return p;
}

lk_status lk_st_writer_create(const char *path, lk_st_writer **out) {
    if (!path || !out || !*path) return lk_error(LK_ERR_ARG, "lk_st_writer_create: empty path");
    *out = NULL;
    lk_st_writer *w = lk_calloc(1, sizeof *w);
    if (!w || !(w->path = lk_strdup(path))) {
        lk_free(w);
        return lk_error(LK_ERR_NOMEM, "%s: out of memory", path);
    }
    w->of = (lk_out_file)LK_OUT_FILE_INIT;
    *out = w;
    return LK_OK;
}

void lk_st_writer_free(lk_st_writer *w) {
    if (!w) return;
    lk_out_file_abort(&w->of);
    for (size_t i = 0; i < w->n; i++) lk_free(w->t[i].spans);
    lk_free(w->t);
    for (st_chunk *c = w->names, *nx; c; c = nx) {
        nx = c->next;
        lk_free(c);
    }
    for (size_t i = 0; i < w->n_meta; i++) {
        lk_free(w->meta[i].k);
        lk_free(w->meta[i].v);
    }
    lk_free(w->meta);
    lk_free(w->path);
    lk_free(w);
}

static lk_status w_state(lk_st_writer *w, int want_begun, const char *what) {
    if (!w) return lk_error(LK_ERR_ARG, "%s: NULL writer", what);
    if (w->failed) return lk_error(LK_ERR_STATE, "%s: %s: an earlier write failed", w->path, what);
    if (w->begun != want_begun)
        return lk_error(LK_ERR_STATE, "%s: %s: only allowed %s lk_st_writer_begin", w->path, what,
                        want_begun ? "after" : "before");
    return LK_OK;
}

lk_status lk_st_writer_metadata(lk_st_writer *w, const char *key, const char *value) {
    lk_status s = w_state(w, 0, "metadata");
    if (s) return s;
    if (!key || !value) return lk_error(LK_ERR_ARG, "%s: metadata: NULL key or value", w->path);
    if (!utf8_valid((const unsigned char *)key, strlen(key)) ||
        !utf8_valid((const unsigned char *)value, strlen(value)))
        return lk_error(LK_ERR_ARG, "%s: metadata \"%.200s\": not valid UTF-8", w->path, key);
    for (size_t i = 0; i < w->n_meta; i++)
        if (!strcmp(w->meta[i].k, key)) {
            char *v = lk_strdup(value);
            if (!v) return lk_error(LK_ERR_NOMEM, "%s: out of memory", w->path);
            lk_free(w->meta[i].v);
            w->meta[i].v = v;
            return LK_OK;
        }
    if (w->n_meta == w->cap_meta) {
        size_t nc = w->cap_meta ? 2 * w->cap_meta : 8;
        st_kv *m = lk_realloc(w->meta, nc * sizeof *m);
        if (!m) return lk_error(LK_ERR_NOMEM, "%s: out of memory", w->path);
        w->meta = m;
        w->cap_meta = nc;
    }
    char *k = lk_strdup(key), *v = lk_strdup(value);
    if (!k || !v) {
        lk_free(k);
        lk_free(v);
        return lk_error(LK_ERR_NOMEM, "%s: out of memory", w->path);
    }
    w->meta[w->n_meta].k = k;
    w->meta[w->n_meta].v = v;
    w->n_meta++;
    return LK_OK;
}

lk_status lk_st_writer_declare(lk_st_writer *w, const char *name, lk_dtype dtype, int ndim,
                               const int64_t *shape, size_t *index) {
    lk_status s = w_state(w, 0, "declare");
    if (s) return s;
    if (!name) return lk_error(LK_ERR_ARG, "%s: declare: NULL name", w->path);
    if (!strcmp(name, META_KEY))
        return lk_error(LK_ERR_ARG, "%s: a tensor may not be named " META_KEY, w->path);
    if (!utf8_valid((const unsigned char *)name, strlen(name)))
        return lk_error(LK_ERR_ARG, "%s: tensor name is not valid UTF-8", w->path);
    if (lk_dtype_size(dtype) == 0)
        return lk_error(LK_ERR_ARG, "%s: %s: invalid dtype %d", w->path, name, (int)dtype);
    if (ndim < 0 || ndim > LK_MAX_DIMS || (ndim > 0 && !shape))
        return lk_error(LK_ERR_ARG, "%s: %s: %d dimensions (0..%d allowed)", w->path, name, ndim, LK_MAX_DIMS);
    size_t nb = lk_dtype_size(dtype);
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0)
            return lk_error(LK_ERR_ARG, "%s: %s: negative dimension %lld", w->path, name, (long long)shape[i]);
        if (!lk_checked_mul(nb, (size_t)shape[i], &nb))
            return lk_error(LK_ERR_ARG, "%s: %s: byte size overflows", w->path, name);
    }
    if (w->n == w->cap) {
        size_t nc = w->cap ? 2 * w->cap : 16;
        st_wt *t = lk_realloc(w->t, nc * sizeof *t);
        if (!t) return lk_error(LK_ERR_NOMEM, "%s: out of memory", w->path);
        w->t = t;
        w->cap = nc;
    }
    st_wt *t = &w->t[w->n];
    memset(t, 0, sizeof *t);
    if (!(t->name = chunk_dup(&w->names, name))) return lk_error(LK_ERR_NOMEM, "%s: out of memory", w->path);
    t->dtype = dtype;
    t->ndim = ndim;
    for (int i = 0; i < ndim; i++) t->shape[i] = shape[i];
    t->nbytes = nb;
    if (index) *index = w->n;
    w->n++;
    return LK_OK;
}

/* Reference layout order: dtype descending (largest element first), then name. */
static int cmp_wt_layout(const void *a, const void *b) {
    const st_wt *x = *(st_wt *const *)a, *y = *(st_wt *const *)b;
    if (x->dtype != y->dtype) return x->dtype > y->dtype ? -1 : 1;
    return strcmp(x->name, y->name);
}

static int cmp_wt_name(const void *a, const void *b) {
    return strcmp((*(st_wt *const *)a)->name, (*(st_wt *const *)b)->name);
}

static lk_status write_all(lk_st_writer *w, const void *buf, size_t n, uint64_t off) {
    const char *p = buf;
    while (n > 0) {
        size_t chunk = n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n;
        ssize_t k = pwrite(w->of.fd, p, chunk, (off_t)off);
        if (k < 0) {
            if (errno == EINTR) continue;
            w->failed = 1;
            return lk_error(LK_ERR_IO, "%s: write failed: %s", w->of.tmp, strerror(errno));
        }
        p += k;
        off += (uint64_t)k;
        n -= (size_t)k;
    }
    return LK_OK;
}

/* Builds the header JSON for the layout in `order`; malloc'd by jansson. */
/* The header text, produced twice: once to measure it (dst NULL), once into
 * the file through a 1 MiB staging buffer, so a 100 MB header is neither a
 * DOM nor one string. The bytes are jansson's compact dump of the object
 * (strings escaped as jansson does: \" \\ \b \f \n \r \t, other controls
 * \u00XX, the rest as UTF-8), so files stay byte-identical. */
typedef struct {
    lk_st_writer *w;
    unsigned char *buf; /* NULL: measure only */
    size_t fill, cap;
    uint64_t pos; /* bytes produced so far (file offset - 8 when writing) */
    lk_status s;
} hdr_out;

static void hdr_flush(hdr_out *o) {
    if (o->buf && o->fill && !o->s) o->s = write_all(o->w, o->buf, o->fill, 8 + o->pos - o->fill);
    o->fill = 0;
}

static void hdr_put(hdr_out *o, const char *p, size_t n) {
    if (!o->buf) {
        o->pos += n;
        return;
    }
    while (n) {
        if (o->fill == o->cap) hdr_flush(o);
        size_t k = o->cap - o->fill < n ? o->cap - o->fill : n;
        memcpy(o->buf + o->fill, p, k);
        o->fill += k, o->pos += k, p += k, n -= k;
    }
}

static void hdr_str(hdr_out *o, const char *s) {
    hdr_put(o, "\"", 1);
    const char *run = s;
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c >= 0x20 && c != '"' && c != '\\') continue;
        hdr_put(o, run, (size_t)(s - run));
        char e[8];
        const char *short_esc = c == '"' ? "\\\"" : c == '\\' ? "\\\\" : c == '\b' ? "\\b" : c == '\f' ? "\\f"
                              : c == '\n' ? "\\n" : c == '\r' ? "\\r" : c == '\t' ? "\\t" : NULL;
        if (short_esc) hdr_put(o, short_esc, 2);
        else hdr_put(o, e, (size_t)snprintf(e, sizeof e, "\\u%04X", c));
        run = s + 1;
    }
    hdr_put(o, run, (size_t)(s - run));
    hdr_put(o, "\"", 1);
}

/* The header (order: the layout), setting each tensor's offset relative
 * to the data buffer. */
static void hdr_emit(lk_st_writer *w, st_wt **order, hdr_out *o) {
    hdr_put(o, "{", 1);
    int first = 1;
    if (w->n_meta) {
        hdr_str(o, META_KEY);
        hdr_put(o, ":{", 2);
        for (size_t i = 0; i < w->n_meta; i++) {
            if (i) hdr_put(o, ",", 1);
            hdr_str(o, w->meta[i].k);
            hdr_put(o, ":", 1);
            hdr_str(o, w->meta[i].v);
        }
        hdr_put(o, "}", 1);
        first = 0;
    }
    uint64_t pos = 0;
    char num[64];
    for (size_t i = 0; i < w->n; i++) {
        st_wt *t = order[i];
        if (!first) hdr_put(o, ",", 1);
        first = 0;
        hdr_str(o, t->name);
        hdr_put(o, ":{\"dtype\":", 10);
        hdr_str(o, lk_dtype_name(t->dtype));
        hdr_put(o, ",\"shape\":[", 10);
        for (int d = 0; d < t->ndim; d++)
            hdr_put(o, num, (size_t)snprintf(num, sizeof num, d ? ",%lld" : "%lld", (long long)t->shape[d]));
        hdr_put(o, num, (size_t)snprintf(num, sizeof num, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)pos,
                                         (unsigned long long)(pos + t->nbytes)));
        t->off = pos; /* relative for now */
        pos += t->nbytes;
    }
    hdr_put(o, "}", 1);
}

lk_status lk_st_writer_begin(lk_st_writer *w) {
    lk_status s = w_state(w, 0, "begin");
    if (s) return s;
    st_wt **order = lk_malloc((w->n ? w->n : 1) * sizeof *order);
    if (!order) return lk_error(LK_ERR_NOMEM, "%s: out of memory", w->path);
    for (size_t i = 0; i < w->n; i++) order[i] = &w->t[i];
    qsort(order, w->n, sizeof *order, cmp_wt_name);
    for (size_t i = 1; i < w->n; i++)
        if (!strcmp(order[i]->name, order[i - 1]->name)) {
            s = lk_error(LK_ERR_ARG, "%s: %s: tensor declared twice", w->path, order[i]->name);
            lk_free(order);
            return s;
        }
    qsort(order, w->n, sizeof *order, cmp_wt_layout);
    /* Keys sorted so equal metadata gives byte-identical files. */
    if (w->n_meta) qsort(w->meta, w->n_meta, sizeof *w->meta, cmp_kv);
    hdr_out o = {w, NULL, 0, 0, 0, LK_OK};
    hdr_emit(w, order, &o); /* measure */
    uint64_t hl = o.pos, pad = (8 - hl % 8) % 8;
    uint64_t n = hl + pad, data_len = 0;
    for (size_t i = 0; i < w->n; i++) data_len += w->t[i].nbytes;
    if (n > LK_ST_MAX_HEADER) {
        lk_free(order);
        return lk_error(LK_ERR_ARG, "%s: header of %llu bytes exceeds the %llu-byte limit", w->path,
                        (unsigned long long)n, (unsigned long long)LK_ST_MAX_HEADER);
    }
    if ((s = lk_out_file_begin(&w->of, w->path)) != LK_OK) {
        lk_free(order);
        return s;
    }
    unsigned char len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (unsigned char)(n >> (8 * i));
    o = (hdr_out){w, lk_malloc((size_t)1 << 20), 0, (size_t)1 << 20, 0, LK_OK};
    if (!o.buf) {
        lk_free(order);
        return lk_error(LK_ERR_NOMEM, "%s: out of memory", w->path);
    }
    s = write_all(w, len8, 8, 0);
    if (!s) {
        hdr_emit(w, order, &o); /* write: the same text */
        for (uint64_t k = 0; k < pad; k++) hdr_put(&o, " ", 1);
        hdr_flush(&o);
        s = o.s;
    }
    lk_free(o.buf);
    lk_free(order);
    if (s) return s;
    for (size_t i = 0; i < w->n; i++) w->t[i].off += 8 + n; /* relative to the data buffer until now */
    if (ftruncate(w->of.fd, (off_t)(8 + n + data_len)) != 0) {
        w->failed = 1;
        return lk_error(LK_ERR_IO, "%s: cannot size to %llu bytes: %s", w->of.tmp,
                        (unsigned long long)(8 + n + data_len), strerror(errno));
    }
    w->begun = 1;
    return LK_OK;
}

/* Records [a, b) as written in t's sorted, merged span list. */
static int add_span(st_wt *t, uint64_t a, uint64_t b) {
    st_span *sp = t->spans ? t->spans : &t->one;
    size_t cap = t->spans ? t->cap_spans : 1;
    size_t i = 0;
    while (i < t->n_spans && sp[i].b < a) i++;
    size_t j = i;
    while (j < t->n_spans && sp[j].a <= b) {
        if (sp[j].a < a) a = sp[j].a;
        if (sp[j].b > b) b = sp[j].b;
        j++;
    }
    if (j == i) { /* insert at i */
        if (t->n_spans == cap) {
            size_t nc = 4 * cap;
            st_span *s = t->spans ? lk_realloc(t->spans, nc * sizeof *s) : lk_malloc(nc * sizeof *s);
            if (!s) return 0;
            if (!t->spans) s[0] = t->one;
            t->spans = sp = s;
            t->cap_spans = nc;
        }
        memmove(sp + i + 1, sp + i, (t->n_spans - i) * sizeof *sp);
        t->n_spans++;
    } else if (j > i + 1) { /* merged several into one */
        memmove(sp + i + 1, sp + j, (t->n_spans - j) * sizeof *sp);
        t->n_spans -= j - i - 1;
    }
    sp[i].a = a;
    sp[i].b = b;
    return 1;
}

lk_status lk_st_writer_write(lk_st_writer *w, size_t index, uint64_t off, const void *data, size_t n) {
    lk_status s = w_state(w, 1, "write");
    if (s) return s;
    if (index >= w->n) return lk_error(LK_ERR_ARG, "%s: write: no tensor %zu (%zu declared)", w->path, index, w->n);
    st_wt *t = &w->t[index];
    if (off > t->nbytes || n > t->nbytes - off)
        return lk_error(LK_ERR_ARG, "%s: %s: write of %zu bytes at %llu exceeds its %llu bytes", w->path,
                        t->name, n, (unsigned long long)off, (unsigned long long)t->nbytes);
    if (n == 0) return LK_OK;
    if (!data) return lk_error(LK_ERR_ARG, "%s: %s: NULL data", w->path, t->name);
    if ((s = write_all(w, data, n, t->off + off)) != LK_OK) return s;
    if (!add_span(t, off, off + n)) {
        w->failed = 1;
        return lk_error(LK_ERR_NOMEM, "%s: out of memory", w->path);
    }
    return LK_OK;
}

lk_status lk_st_writer_commit(lk_st_writer *w) {
    lk_status s = w_state(w, 1, "commit");
    if (s) return s;
    for (size_t i = 0; i < w->n; i++) {
        st_wt *t = &w->t[i];
        if (t->nbytes == 0) continue;
        const st_span *sp = t->spans ? t->spans : &t->one;
        uint64_t done = t->n_spans == 1 && sp[0].a == 0 ? sp[0].b : 0;
        if (done != t->nbytes)
            return lk_error(LK_ERR_STATE, "%s: %s: data incomplete (%llu of %llu bytes written from the start)",
                            w->path, t->name, (unsigned long long)done, (unsigned long long)t->nbytes);
    }
    if ((s = lk_out_file_commit(&w->of, w->path)) != LK_OK) {
        w->failed = 1;
        return s;
    }
    w->begun = 0;
    w->failed = 1; /* committed: no further use */
    return LK_OK;
}

lk_status lk_st_save(const char *path, const lk_tensor *tensors, size_t n, const char *const *meta_kv,
                     size_t n_meta) {
    if (n && !tensors) return lk_error(LK_ERR_ARG, "%s: lk_st_save: NULL tensors", path ? path : "?");
    lk_st_writer *w;
    lk_status s = lk_st_writer_create(path, &w);
    if (s) return s;
    for (size_t i = 0; i < n_meta && !s; i++) s = lk_st_writer_metadata(w, meta_kv[2 * i], meta_kv[2 * i + 1]);
    for (size_t i = 0; i < n && !s; i++) {
        const lk_tensor *t = &tensors[i];
        s = lk_st_writer_declare(w, t->name, t->dtype, t->ndim, t->shape, NULL);
        if (!s && w->t[i].nbytes != t->nbytes)
            s = lk_error(LK_ERR_ARG, "%s: %s: nbytes is %zu but the shape and dtype give %llu", path, t->name,
                         t->nbytes, (unsigned long long)w->t[i].nbytes);
    }
    if (!s) s = lk_st_writer_begin(w);
    for (size_t i = 0; i < n && !s; i++) s = lk_st_writer_write(w, i, 0, tensors[i].data, tensors[i].nbytes);
    if (!s) s = lk_st_writer_commit(w);
    lk_st_writer_free(w);
    return s;
}
