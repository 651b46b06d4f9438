/* safetensors.c — the safetensors reader (mmap, zero-copy, fully validated)
 * and the atomic, streaming writer.
 *
 * Format: an 8-byte little-endian header length N, N bytes of UTF-8 JSON
 * (an object: tensor name -> {dtype, shape, data_offsets}, plus an optional
 * "__metadata__" string->string object), then the data buffer.
 *
 * Reader. Files are hostile input: we check everything the reference Rust
 * `safetensors` crate checks (header length bound and 8+N overflow, UTF-8,
 * JSON object, known dtype, non-negative integer shape and offsets, begin <=
 * end, element count * element size with overflow checks equal to end-begin,
 * the tensors sorted by offset tiling the data buffer from 0 with no gap or
 * overlap, the file ending exactly at the last end), and a little more
 * (duplicate keys, __metadata__ strictly string->string). Every rejection is
 * LK_ERR_FORMAT naming the file and, where there is one, the tensor. Tensors
 * are views into the mapping, kept in file (offset) order; a name-sorted
 * index gives O(log n) lookup.
 *
 * Writer. Same layout as the reference: tensors ordered by dtype (largest
 * element first; our lk_dtype enum follows the reference's Dtype order) then
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
    uint64_t *off;        /* file offset of each tensor's data */
    size_t *by_name;      /* indices sorted by name */
    char *names;          /* all names, NUL-separated */
    size_t n_meta;
    st_kv *meta;          /* sorted by key */
};

/* A tensor entry while parsing. */
typedef struct {
    const char *name;     /* jansson-owned until copied */
    lk_dtype dtype;
    int ndim;
    int64_t shape[LK_MAX_DIMS];
    uint64_t begin, end;
    size_t seq;           /* header order, for a stable sort */
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
    /* Element count and byte size, overflow-checked (as the reference). */
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

static int cmp_entry_off(const void *a, const void *b) {
    const st_entry *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return x->seq < y->seq ? -1 : x->seq > y->seq;
}

/* qsort has no context argument; the name index sorts pointers to tensors. */
static int cmp_tensor_name(const void *a, const void *b) {
    const lk_tensor *const *x = a, *const *y = b;
    return strcmp((*x)->name, (*y)->name);
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
    lk_free(st->off);
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

/* Parses and validates st->base[0..len) (already loaded); fills the index. */
static lk_status st_parse(lk_st *st) {
    const char *lbl = st->path;
    const unsigned char *b = st->base;
    if (st->len < 8)
        return lk_error(LK_ERR_FORMAT, "%s: file is %zu bytes, shorter than the 8-byte header length",
                        lbl, st->len);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = (n << 8) | b[i];
    if (n > LK_ST_MAX_HEADER)
        return lk_error(LK_ERR_FORMAT, "%s: header length %llu exceeds the limit of %llu bytes", lbl,
                        (unsigned long long)n, (unsigned long long)LK_ST_MAX_HEADER);
    /* n <= 1e8 here, so 8+n cannot overflow; the check stays for clarity. */
    if (n > UINT64_MAX - 8 || 8 + n > st->len)
        return lk_error(LK_ERR_FORMAT, "%s: header length %llu runs past the end of the %zu-byte file",
                        lbl, (unsigned long long)n, st->len);
    st->header_len = n;
    const char *h = (const char *)b + 8;
    if (!utf8_valid((const unsigned char *)h, (size_t)n))
        return lk_error(LK_ERR_FORMAT, "%s: header is not valid UTF-8", lbl);
    json_error_t jerr;
    /* DECODE_ANY so a scalar header gets the specific "expected an object"
     * message below; duplicate keys (tensor, metadata or field) are refused. */
    json_t *root = json_loadb(h, (size_t)n, JSON_REJECT_DUPLICATES | JSON_DECODE_ANY, &jerr);
    if (!root)
        return lk_error(LK_ERR_FORMAT, "%s: header is not valid JSON (line %d, column %d): %s", lbl,
                        jerr.line, jerr.column, jerr.text);
    lk_status s = LK_OK;
    st_entry *ent = NULL;
    if (!json_is_object(root)) {
        s = lk_error(LK_ERR_FORMAT, "%s: header is %s, expected a JSON object", lbl, json_kind(root));
        goto done;
    }
    size_t cnt = json_object_size(root);
    const json_t *meta = json_object_get(root, META_KEY);
    if (meta) {
        cnt--;
        if ((s = parse_metadata(st, lbl, meta)) != LK_OK) goto done;
    }
    ent = lk_calloc(cnt ? cnt : 1, sizeof *ent);
    if (!ent) {
        s = lk_error(LK_ERR_NOMEM, "%s: out of memory indexing %zu tensors", lbl, cnt);
        goto done;
    }
    size_t names_len = 0, k = 0;
    const char *key;
    json_t *val;
    json_object_foreach(root, key, val) {
        if (!strcmp(key, META_KEY)) continue;
        st_entry *e = &ent[k];
        e->name = key;
        e->seq = k++;
        if ((s = parse_entry(lbl, key, val, e)) != LK_OK) goto done;
        names_len += strlen(key) + 1;
    }
    /* Offsets: sorted by begin they must tile [0, data_len) exactly. */
    qsort(ent, cnt, sizeof *ent, cmp_entry_off);
    uint64_t data_len = st->len - 8 - n, pos = 0;
    for (size_t i = 0; i < cnt; i++) {
        if (ent[i].begin > pos) {
            s = lk_error(LK_ERR_FORMAT, "%s: %s: data_offsets begin %llu leaves a gap after byte %llu of the data buffer",
                         lbl, ent[i].name, (unsigned long long)ent[i].begin, (unsigned long long)pos);
            goto done;
        }
        if (ent[i].begin < pos) {
            s = lk_error(LK_ERR_FORMAT, "%s: %s: data_offsets [%llu, %llu] overlap %s, which ends at %llu",
                         lbl, ent[i].name, (unsigned long long)ent[i].begin,
                         (unsigned long long)ent[i].end, ent[i - 1].name, (unsigned long long)pos);
            goto done;
        }
        if (ent[i].end > data_len) {
            s = lk_error(LK_ERR_FORMAT, "%s: %s: data_offsets end %llu is past the end of the %llu-byte data buffer",
                         lbl, ent[i].name, (unsigned long long)ent[i].end, (unsigned long long)data_len);
            goto done;
        }
        pos = ent[i].end;
    }
    if (pos != data_len) {
        s = lk_error(LK_ERR_FORMAT, "%s: the tensors cover %llu bytes but the data buffer has %llu (trailing bytes)",
                     lbl, (unsigned long long)pos, (unsigned long long)data_len);
        goto done;
    }
    st->t = lk_calloc(cnt ? cnt : 1, sizeof *st->t);
    st->off = lk_calloc(cnt ? cnt : 1, sizeof *st->off);
    st->by_name = lk_calloc(cnt ? cnt : 1, sizeof *st->by_name);
    st->names = lk_malloc(names_len ? names_len : 1);
    lk_tensor **tp = lk_malloc((cnt ? cnt : 1) * sizeof *tp);
    if (!st->t || !st->off || !st->by_name || !st->names || !tp) {
        lk_free(tp);
        s = lk_error(LK_ERR_NOMEM, "%s: out of memory indexing %zu tensors", lbl, cnt);
        goto done;
    }
    char *np = st->names;
    for (size_t i = 0; i < cnt; i++) {
        lk_tensor *t = &st->t[i];
        size_t l = strlen(ent[i].name) + 1;
        memcpy(np, ent[i].name, l);
        t->name = np;
        np += l;
        t->dtype = ent[i].dtype;
        t->ndim = ent[i].ndim;
        memcpy(t->shape, ent[i].shape, sizeof t->shape);
        t->nbytes = (size_t)(ent[i].end - ent[i].begin);
        st->off[i] = 8 + n + ent[i].begin;
        t->data = st->base + st->off[i];
        tp[i] = t;
    }
    qsort(tp, cnt, sizeof *tp, cmp_tensor_name);
    for (size_t i = 0; i < cnt; i++) st->by_name[i] = (size_t)(tp[i] - st->t);
    lk_free(tp);
    st->n = cnt;
done:
    lk_free(ent);
    json_decref(root);
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
    *out = st;
    return LK_OK;
fail:
    lk_st_close(st);
    return s;
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
uint64_t lk_st_file_offset(const lk_st *st, size_t i) { return i < st->n ? st->off[i] : 0; }
uint64_t lk_st_header_len(const lk_st *st) { return st->header_len; }

lk_status lk_st_read(const lk_st *st, size_t i, uint64_t off, void *dst, size_t n) {
    if (!st || i >= st->n || (n && !dst)) return lk_error(LK_ERR_ARG, "lk_st_read: bad argument");
    const lk_tensor *t = &st->t[i];
    if (off > t->nbytes || n > t->nbytes - off)
        return lk_error(LK_ERR_ARG, "%s: %s: read of %zu bytes at %llu is past the tensor's %zu bytes", st->path,
                        t->name, n, (unsigned long long)off, t->nbytes);
    uint64_t at = st->off[i] + off;
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
    char *name;
    lk_dtype dtype;
    int ndim;
    int64_t shape[LK_MAX_DIMS];
    uint64_t nbytes;
    uint64_t off;   /* absolute file offset, set by begin */
    st_span *spans; /* merged written ranges, sorted */
    size_t n_spans, cap_spans;
} st_wt;

struct lk_st_writer {
    char *path;
    lk_out_file of; /* the temporary file (io/out_file.h) */
    int begun, failed;
    st_wt *t;
    size_t n, cap;
    st_kv *meta;
    size_t n_meta, cap_meta;
};

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
    for (size_t i = 0; i < w->n; i++) {
        lk_free(w->t[i].name);
        lk_free(w->t[i].spans);
    }
    lk_free(w->t);
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
    if (!(t->name = lk_strdup(name))) return lk_error(LK_ERR_NOMEM, "%s: out of memory", w->path);
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
static lk_status build_header(lk_st_writer *w, st_wt **order, char **out) {
    lk_status s = LK_OK;
    json_t *root = json_object();
    if (!root) return lk_error(LK_ERR_NOMEM, "%s: out of memory building the header", w->path);
    if (w->n_meta) {
        json_t *m = json_object();
        if (!m || json_object_set_new(root, META_KEY, m)) {
            json_decref(root);
            return lk_error(LK_ERR_NOMEM, "%s: out of memory building the header", w->path);
        }
        /* Keys sorted so equal metadata gives byte-identical files. */
        qsort(w->meta, w->n_meta, sizeof *w->meta, cmp_kv);
        for (size_t i = 0; i < w->n_meta; i++)
            if (json_object_set_new(m, w->meta[i].k, json_string(w->meta[i].v))) s = LK_ERR_NOMEM;
    }
    uint64_t pos = 0;
    for (size_t i = 0; i < w->n && !s; i++) {
        st_wt *t = order[i];
        json_t *e = json_object(), *sh = json_array(), *of = json_array();
        if (!e || !sh || !of) {
            json_decref(e); json_decref(sh); json_decref(of);
            s = LK_ERR_NOMEM;
            break;
        }
        /* Every insertion is checked: a lost one (jansson out of memory)
         * would otherwise write a header that names the wrong layout. */
        int bad = 0;
        for (int d = 0; d < t->ndim; d++) bad |= json_array_append_new(sh, json_integer(t->shape[d]));
        bad |= json_array_append_new(of, json_integer((json_int_t)pos));
        bad |= json_array_append_new(of, json_integer((json_int_t)(pos + t->nbytes)));
        bad |= json_object_set_new(e, "dtype", json_string(lk_dtype_name(t->dtype)));
        bad |= json_object_set_new(e, "shape", sh);
        bad |= json_object_set_new(e, "data_offsets", of);
        bad |= json_object_set_new(root, t->name, e);
        if (bad) s = LK_ERR_NOMEM;
        t->off = pos; /* relative for now */
        pos += t->nbytes;
    }
    char *txt = s ? NULL : json_dumps(root, JSON_COMPACT);
    json_decref(root);
    if (!txt) return lk_error(LK_ERR_NOMEM, "%s: out of memory building the header", w->path);
    *out = txt;
    return LK_OK;
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
    char *hdr = NULL;
    s = build_header(w, order, &hdr);
    lk_free(order);
    if (s) return s;
    size_t hl = strlen(hdr), pad = (8 - hl % 8) % 8;
    uint64_t n = hl + pad, data_len = 0;
    for (size_t i = 0; i < w->n; i++) {
        w->t[i].off += 8 + n;
        data_len += w->t[i].nbytes;
    }
    if (n > LK_ST_MAX_HEADER) {
        free(hdr);
        return lk_error(LK_ERR_ARG, "%s: header of %llu bytes exceeds the %llu-byte limit", w->path,
                        (unsigned long long)n, (unsigned long long)LK_ST_MAX_HEADER);
    }
    if ((s = lk_out_file_begin(&w->of, w->path)) != LK_OK) {
        free(hdr);
        return s;
    }
    unsigned char *buf = lk_malloc(8 + n);
    if (!buf) {
        free(hdr);
        return lk_error(LK_ERR_NOMEM, "%s: out of memory", w->path);
    }
    for (int i = 0; i < 8; i++) buf[i] = (unsigned char)(n >> (8 * i));
    memcpy(buf + 8, hdr, hl);
    memset(buf + 8 + hl, ' ', pad);
    free(hdr);
    s = write_all(w, buf, 8 + n, 0);
    lk_free(buf);
    if (s) return s;
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
    size_t i = 0;
    while (i < t->n_spans && t->spans[i].b < a) i++;
    size_t j = i;
    while (j < t->n_spans && t->spans[j].a <= b) {
        if (t->spans[j].a < a) a = t->spans[j].a;
        if (t->spans[j].b > b) b = t->spans[j].b;
        j++;
    }
    if (j == i) { /* insert at i */
        if (t->n_spans == t->cap_spans) {
            size_t nc = t->cap_spans ? 2 * t->cap_spans : 4;
            st_span *s = lk_realloc(t->spans, nc * sizeof *s);
            if (!s) return 0;
            t->spans = s;
            t->cap_spans = nc;
        }
        memmove(t->spans + i + 1, t->spans + i, (t->n_spans - i) * sizeof *t->spans);
        t->n_spans++;
    } else if (j > i + 1) { /* merged several into one */
        memmove(t->spans + i + 1, t->spans + j, (t->n_spans - j) * sizeof *t->spans);
        t->n_spans -= j - i - 1;
    }
    t->spans[i].a = a;
    t->spans[i].b = b;
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
        uint64_t done = t->n_spans == 1 && t->spans[0].a == 0 ? t->spans[0].b : 0;
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
