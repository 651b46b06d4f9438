/* digest.c — the content digest of a set of tensors (DESIGN.md, "Digest").
 *
 * XXH3-128 (libxxhash, streaming) over, for each tensor in byte-wise sorted
 * name order: name, NUL, dtype string, NUL, the shape as little-endian i64s,
 * the raw bytes. Sorting by name makes the digest independent of file order
 * and of metadata, so files written by different paths (offline fuse, a
 * distributed swap) can be compared by one 32-digit string. Duplicate names
 * are refused: their order, hence the digest, would be ambiguous. */
#include "lorakit/digest.h"
#include "lorakit/alloc.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>


/* Tensor bytes read from files go through pread in chunks of this size (a
 * file changed underneath is LK_ERR_IO, never a SIGBUS from the mmap). */
#define READ_CHUNK ((size_t)4 << 20)

typedef lk_status (*read_fn)(const void *src, size_t i, uint64_t off, void *dst, size_t n);

static int cmp_idx_name(const void *a, const void *b, void *ctx) {
    const lk_tensor *const *t = ctx;
    return strcmp(t[*(const size_t *)a]->name, t[*(const size_t *)b]->name);
}

/* The digest of n tensors whose headers are views[] and whose bytes come
 * from rd(src, i, ...). */
static lk_status digest_read(const lk_tensor *const *views, size_t n, read_fn rd, const void *src,
                             const char *label, char hex[LK_DIGEST_HEX]) {
    size_t *ord = lk_malloc((n ? n : 1) * sizeof *ord);
    size_t maxb = 0;
    for (size_t i = 0; i < n; i++)
        if (views[i]->nbytes > maxb) maxb = views[i]->nbytes;
    size_t cap = maxb < READ_CHUNK ? maxb : READ_CHUNK;
    unsigned char *buf = lk_malloc(cap ? cap : 1);
    XXH3_state_t *st = XXH3_createState();
    lk_status s = LK_OK;
    if (!ord || !buf || !st) {
        s = lk_error(LK_ERR_NOMEM, "%s: out of memory for the digest", label);
        goto done;
    }
    for (size_t i = 0; i < n; i++) ord[i] = i;
    qsort_r(ord, n, sizeof *ord, cmp_idx_name, (void *)views);
    for (size_t i = 1; i < n; i++)
        if (!strcmp(views[ord[i]]->name, views[ord[i - 1]]->name)) {
            s = lk_error(LK_ERR_ARG, "%s: %s: tensor name appears twice", label, views[ord[i]]->name);
            goto done;
        }
    XXH3_128bits_reset(st);
    for (size_t k = 0; k < n && !s; k++) {
        const lk_tensor *t = views[ord[k]];
        const char *dn = lk_dtype_name(t->dtype);
        unsigned char shp[8 * LK_MAX_DIMS];
        int nd = t->ndim < 0 ? 0 : t->ndim > LK_MAX_DIMS ? LK_MAX_DIMS : t->ndim;
        for (int d = 0; d < nd; d++)
            for (int b = 0; b < 8; b++) shp[8 * d + b] = (unsigned char)((uint64_t)t->shape[d] >> (8 * b));
        XXH3_128bits_update(st, t->name, strlen(t->name) + 1);
        XXH3_128bits_update(st, dn, strlen(dn) + 1);
        XXH3_128bits_update(st, shp, 8 * (size_t)nd);
        for (uint64_t off = 0; off < t->nbytes && !s;) {
            size_t len = t->nbytes - off < cap ? (size_t)(t->nbytes - off) : cap;
            if (!(s = rd(src, ord[k], off, buf, len))) XXH3_128bits_update(st, buf, len);
            off += len;
        }
    }
    if (!s) {
        XXH128_hash_t h = XXH3_128bits_digest(st);
        snprintf(hex, LK_DIGEST_HEX, "%016llx%016llx", (unsigned long long)h.high64, (unsigned long long)h.low64);
    }
done:
    XXH3_freeState(st);
    lk_free(buf);
    lk_free(ord);
    return s;
}

static lk_status st_rd(const void *src, size_t i, uint64_t off, void *dst, size_t n) {
    return lk_st_read(src, i, off, dst, n);
}

static lk_status ckpt_rd(const void *src, size_t i, uint64_t off, void *dst, size_t n) {
    return lk_ckpt_read(src, i, off, dst, n);
}

/* In-memory views: the bytes are the views' own. */
static lk_status mem_rd(const void *src, size_t i, uint64_t off, void *dst, size_t n) {
    const lk_tensor *const *v = src;
    memcpy(dst, (const unsigned char *)v[i]->data + off, n);
    return LK_OK;
}

lk_status lk_digest_tensors(const lk_tensor *t, size_t n, char hex[LK_DIGEST_HEX]) {
    if ((n && !t) || !hex) return lk_error(LK_ERR_ARG, "lk_digest_tensors: NULL argument");
    const lk_tensor **p = lk_malloc((n ? n : 1) * sizeof *p);
    if (!p) return lk_error(LK_ERR_NOMEM, "digest: out of memory for %zu tensors", n);
    lk_status s = LK_OK;
    for (size_t i = 0; i < n; i++) {
        p[i] = &t[i];
        if (!s && (!t[i].name || (t[i].nbytes && !t[i].data)))
            s = lk_error(LK_ERR_ARG, "digest: tensor %zu has no name or no data", i);
        else if (!s && !lk_tensor_on_host(&t[i]))
            s = lk_error(LK_ERR_ARG, "digest: %s is in device memory (kind %d), which the host digest cannot read",
                         t[i].name, (int)t[i].device.kind);
    }
    if (!s) s = digest_read(p, n, mem_rd, p, "digest", hex);
    lk_free(p);
    return s;
}

lk_status lk_digest_st(const lk_st *st, char hex[LK_DIGEST_HEX]) {
    if (!st || !hex) return lk_error(LK_ERR_ARG, "lk_digest_st: NULL argument");
    size_t n = lk_st_count(st);
    const lk_tensor **p = lk_malloc((n ? n : 1) * sizeof *p);
    if (!p) return lk_error(LK_ERR_NOMEM, "%s: out of memory for %zu tensors", lk_st_path(st), n);
    for (size_t i = 0; i < n; i++) p[i] = lk_st_tensor(st, i);
    lk_status s = digest_read(p, n, st_rd, st, lk_st_path(st), hex);
    lk_free(p);
    return s;
}

lk_status lk_digest_ckpt(const lk_ckpt *ck, char hex[LK_DIGEST_HEX]) {
    if (!ck || !hex) return lk_error(LK_ERR_ARG, "lk_digest_ckpt: NULL argument");
    size_t n = lk_ckpt_count(ck);
    const lk_tensor **p = lk_malloc((n ? n : 1) * sizeof *p);
    if (!p) return lk_error(LK_ERR_NOMEM, "%s: out of memory for %zu tensors", lk_ckpt_path(ck), n);
    for (size_t i = 0; i < n; i++) p[i] = lk_ckpt_tensor(ck, i);
    lk_status s = digest_read(p, n, ckpt_rd, ck, lk_ckpt_path(ck), hex);
    lk_free(p);
    return s;
}

/* The caller's reader behind digest_read's. */
typedef struct views_rd {
    lk_digest_read_fn rd;
    void *ctx;
} views_rd;

static lk_status caller_rd(const void *src, size_t i, uint64_t off, void *dst, size_t n) {
    const views_rd *v = src;
    return v->rd(v->ctx, i, off, dst, n);
}

lk_status lk_digest_views(const lk_tensor *const *views, size_t n, lk_digest_read_fn rd, void *ctx, const char *label,
                          char hex[LK_DIGEST_HEX]) {
    if ((n && !views) || !rd || !hex) return lk_error(LK_ERR_ARG, "lk_digest_views: NULL argument");
    views_rd v = {rd, ctx};
    return digest_read(views, n, caller_rd, &v, label ? label : "digest", hex);
}
