/* fuzz_ckpt_index.c — libFuzzer target: the sharded-checkpoint index parser
 * and its cross-checks (include/lorakit/checkpoint.h).
 *
 * The input is an index's JSON text. lk_ckpt_parse_index must accept or
 * cleanly refuse it; an accepted index is then opened for real from a
 * scratch folder holding two small valid shards ("a-00001-of-00002.
 * safetensors" with tensors x, y; "a-00002-of-00002.safetensors" with z),
 * so the shard-name, path-containment and tensor/map cross-checks run on
 * mutated maps too. An opened checkpoint obeys checkpoint.h: every tensor
 * is found by name, lies in a listed shard, and is readable. */
#include "fuzz_common.h"

static void fz_ckpt_setup(void) {
    static int done;
    if (done) return;
    float v[3] = {1, 2, 3};
    lk_tensor t[3] = {
        {.name = "x", .dtype = LK_DTYPE_F32, .ndim = 1, .shape = {1}, .nbytes = 4, .data = &v[0]},
        {.name = "y", .dtype = LK_DTYPE_F32, .ndim = 1, .shape = {1}, .nbytes = 4, .data = &v[1]},
        {.name = "z", .dtype = LK_DTYPE_F32, .ndim = 1, .shape = {1}, .nbytes = 4, .data = &v[2]},
    };
    char p[600];
    const char *d = fz_mkdir_tmp("ckpt");
    snprintf(p, sizeof p, "%s/a-00001-of-00002.safetensors", d);
    FZ_CHECK(lk_st_save(p, t, 2, NULL, 0) == LK_OK);
    snprintf(p, sizeof p, "%s/a-00002-of-00002.safetensors", d);
    FZ_CHECK(lk_st_save(p, t + 2, 1, NULL, 0) == LK_OK);
    done = 1;
}

static void fz_ckpt_index(const uint8_t *data, size_t size) {
    size_t n = 0;
    lk_status s = lk_ckpt_parse_index((const char *)data, size, "fuzz.index.json", &n);
    if (s) {
        fz_clean_error(s);
        return;
    }
    fz_ckpt_setup();
    char p[600];
    snprintf(p, sizeof p, "%s/ckpt/a.safetensors.index.json", fz_tmpdir());
    FILE *f = fopen(p, "wb");
    FZ_CHECK(f && (!size || fwrite(data, 1, size, f) == size) && fclose(f) == 0);
    lk_ckpt *ck = NULL;
    s = lk_ckpt_open(p, &ck);
    if (s) {
        fz_clean_error(s);
        FZ_CHECK(ck == NULL);
        return;
    }
    FZ_CHECK(lk_ckpt_count(ck) == n);
    for (size_t i = 0; i < lk_ckpt_count(ck); i++) {
        const lk_tensor *t = lk_ckpt_tensor(ck, i);
        FZ_CHECK(lk_ckpt_find(ck, t->name) == (long)i);
        FZ_CHECK(lk_ckpt_tensor_shard(ck, i) < lk_ckpt_shard_count(ck));
        float x;
        FZ_CHECK(t->nbytes == 4 && lk_ckpt_read(ck, i, 0, &x, 4) == LK_OK);
    }
    FZ_CHECK(lk_ckpt_total_size(ck) == 4 * n);
    lk_ckpt_close(ck);
}

LK_FUZZ_MAIN(fz_ckpt_index)
