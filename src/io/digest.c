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

static int cmp_name(const void *a, const void *b) {
    return strcmp((*(const lk_tensor *const *)a)->name, (*(const lk_tensor *const *)b)->name);
}

/* Digest of n views given as pointers (sorted in place). */
static lk_status digest_ptrs(const lk_tensor **p, size_t n, char hex[LK_DIGEST_HEX]) {
    for (size_t i = 0; i < n; i++)
        if (!p[i]->name || (p[i]->nbytes && !p[i]->data))
            return lk_error(LK_ERR_ARG, "digest: tensor %zu has no name or no data", i);
    qsort(p, n, sizeof *p, cmp_name);
    for (size_t i = 1; i < n; i++)
        if (!strcmp(p[i]->name, p[i - 1]->name))
            return lk_error(LK_ERR_ARG, "digest: %s: tensor name appears twice", p[i]->name);
    XXH3_state_t *st = XXH3_createState();
    if (!st) return lk_error(LK_ERR_NOMEM, "digest: out of memory");
    XXH3_128bits_reset(st);
    for (size_t i = 0; i < n; i++) {
        const lk_tensor *t = p[i];
        const char *dn = lk_dtype_name(t->dtype);
        unsigned char shp[8 * LK_MAX_DIMS];
        int nd = t->ndim < 0 ? 0 : t->ndim > LK_MAX_DIMS ? LK_MAX_DIMS : t->ndim;
        for (int d = 0; d < nd; d++)
            for (int b = 0; b < 8; b++) shp[8 * d + b] = (unsigned char)((uint64_t)t->shape[d] >> (8 * b));
        XXH3_128bits_update(st, t->name, strlen(t->name) + 1);
        XXH3_128bits_update(st, dn, strlen(dn) + 1);
        XXH3_128bits_update(st, shp, 8 * (size_t)nd);
        if (t->nbytes) XXH3_128bits_update(st, t->data, t->nbytes);
    }
    XXH128_hash_t h = XXH3_128bits_digest(st);
    XXH3_freeState(st);
    snprintf(hex, LK_DIGEST_HEX, "%016llx%016llx", (unsigned long long)h.high64, (unsigned long long)h.low64);
    return LK_OK;
}

lk_status lk_digest_tensors(const lk_tensor *t, size_t n, char hex[LK_DIGEST_HEX]) {
    if ((n && !t) || !hex) return lk_error(LK_ERR_ARG, "lk_digest_tensors: NULL argument");
    const lk_tensor **p = lk_malloc((n ? n : 1) * sizeof *p);
    if (!p) return lk_error(LK_ERR_NOMEM, "digest: out of memory for %zu tensors", n);
    for (size_t i = 0; i < n; i++) p[i] = &t[i];
    lk_status s = digest_ptrs(p, n, hex);
    lk_free(p);
    return s;
}

lk_status lk_digest_st(const lk_st *st, char hex[LK_DIGEST_HEX]) {
    if (!st || !hex) return lk_error(LK_ERR_ARG, "lk_digest_st: NULL argument");
    size_t n = lk_st_count(st);
    const lk_tensor **p = lk_malloc((n ? n : 1) * sizeof *p);
    if (!p) return lk_error(LK_ERR_NOMEM, "%s: out of memory for %zu tensors", lk_st_path(st), n);
    for (size_t i = 0; i < n; i++) p[i] = lk_st_tensor(st, i);
    lk_status s = digest_ptrs(p, n, hex);
    lk_free(p);
    if (s) lk_error_prefix(s, "%s", lk_st_path(st));
    return s;
}
