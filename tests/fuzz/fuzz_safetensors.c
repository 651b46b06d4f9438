/* fuzz_safetensors.c — libFuzzer target: the safetensors reader.
 *
 * The input is a whole file image handed to lk_st_open_mem. A refusal must be
 * a clean error; an accepted file must satisfy the format's invariants (every
 * tensor's bytes inside the file after the header, sizes = numel * dtype
 * size, names unique and findable), and every view and metadata string is
 * read end to end so ASan checks it. Accepted files are then written back
 * with lk_st_save and reopened from disk through lk_st_open (the mmap path):
 * the writer must produce a file the reader accepts with the same tensors,
 * which makes the target a round-trip check as well as a crash hunt. */
#include "fuzz_common.h"

/* Checks st against the rules of the format; size is the file size. */
static void fz_st_check(const lk_st *st, size_t size) {
    size_t n = lk_st_count(st);
    uint64_t hl = lk_st_header_len(st);
    FZ_CHECK(hl <= size && 8 + hl <= size);
    for (size_t i = 0; i < n; i++) {
        const lk_tensor *t = lk_st_tensor(st, i);
        FZ_CHECK(t != NULL && t->name != NULL);
        FZ_CHECK(t->ndim >= 0 && t->ndim <= LK_MAX_DIMS);
        FZ_CHECK(lk_dtype_size(t->dtype) > 0);
        size_t numel = 1;
        for (int d = 0; d < t->ndim; d++) {
            FZ_CHECK(t->shape[d] >= 0);
            FZ_CHECK(lk_checked_mul(numel, (size_t)t->shape[d], &numel));
        }
        size_t nbytes;
        FZ_CHECK(lk_checked_mul(numel, lk_dtype_size(t->dtype), &nbytes));
        FZ_CHECK(nbytes == t->nbytes);
        uint64_t off = lk_st_file_offset(st, i);
        FZ_CHECK(off >= 8 + hl && off <= size && t->nbytes <= size - off);
        FZ_CHECK(lk_st_find(st, t->name) == (long)i);
        fz_touch(t->name, strlen(t->name));
        if (t->nbytes) fz_touch(t->data, t->nbytes);
    }
    FZ_CHECK(lk_st_find(st, "\x01no such tensor") == -1);
    size_t nm = lk_st_metadata_count(st);
    for (size_t i = 0; i < nm; i++) {
        const char *k, *v;
        lk_st_metadata_at(st, i, &k, &v);
        FZ_CHECK(k != NULL && v != NULL);
        fz_touch(k, strlen(k));
        fz_touch(v, strlen(v));
        FZ_CHECK(lk_st_metadata_get(st, k) != NULL);
    }
}

/* Writes st's tensors + metadata to a scratch file and reopens it. */
static void fz_st_roundtrip(const lk_st *st) {
    size_t n = lk_st_count(st), nm = lk_st_metadata_count(st);
    lk_tensor *views = calloc(n ? n : 1, sizeof *views);
    const char **kv = calloc(2 * nm + 1, sizeof *kv);
    FZ_CHECK(views && kv);
    for (size_t i = 0; i < n; i++) views[i] = *lk_st_tensor(st, i);
    for (size_t i = 0; i < nm; i++) lk_st_metadata_at(st, i, &kv[2 * i], &kv[2 * i + 1]);
    char path[512];
    snprintf(path, sizeof path, "%s/roundtrip.safetensors", fz_tmpdir());
    lk_status s = lk_st_save(path, views, n, kv, nm);
    if (s != LK_OK) {
        /* The writer may be stricter than the reader; it must say why. */
        fz_clean_error(s);
    } else {
        lk_st *back = NULL;
        s = lk_st_open(path, &back);
        unlink(path);
        if (s == LK_ERR_NOMEM) { /* only under injected allocation failure */
            fz_clean_error(s);
            goto out;
        }
        if (s != LK_OK) fprintf(stderr, "fuzz: reopen failed: %s\n", lk_last_error());
        FZ_CHECK(s == LK_OK);
        FZ_CHECK(lk_st_count(back) == n);
        FZ_CHECK(lk_st_metadata_count(back) == nm);
        for (size_t i = 0; i < n; i++) {
            const lk_tensor *a = &views[i];
            long j = lk_st_find(back, a->name);
            FZ_CHECK(j >= 0);
            const lk_tensor *b = lk_st_tensor(back, (size_t)j);
            FZ_CHECK(a->dtype == b->dtype && a->ndim == b->ndim && a->nbytes == b->nbytes);
            FZ_CHECK(memcmp(a->shape, b->shape, sizeof(int64_t) * (size_t)a->ndim) == 0);
            FZ_CHECK(a->nbytes == 0 || memcmp(a->data, b->data, a->nbytes) == 0);
        }
        lk_st_close(back);
    }
out:
    free(views);
    free(kv);
}

static void fz_safetensors(const uint8_t *data, size_t size) {
    lk_st *st = NULL;
    lk_status s = lk_st_open_mem(data, size, "fuzz.safetensors", &st);
    if (s != LK_OK) {
        fz_clean_error(s);
        FZ_CHECK(st == NULL);
        return;
    }
    fz_st_check(st, size);
    fz_st_roundtrip(st);
    lk_st_close(st);
}

LK_FUZZ_MAIN(fz_safetensors)
