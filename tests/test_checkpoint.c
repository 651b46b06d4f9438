/* test_checkpoint.c — sharded checkpoints (lk_ckpt_open) and the sharded
 * output of lk_fuse_file.
 *
 * Oracles:
 *  - tests/fixtures/sharded/ (make_fixtures.py): the same tiny Llama saved by
 *    the real transformers save_pretrained once sharded (3 shards + index)
 *    and once as one model.safetensors; a diffusers-style index written by
 *    hand with the real safetensors package and the same tensors in one
 *    file. The sharded and single forms hold the same tensors by
 *    construction, so their digests must be equal, and so must the digests
 *    of a fuse of each with the same adapter.
 *  - malformed indexes are built here by editing a copy of the real one;
 *    each expected refusal and the names it must carry are written in the
 *    test.
 *  - "nothing new after a failure": the output's parent folder is listed
 *    before and after, and must be identical. */
#include "testutil.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define FIX LK_TEST_SRC_DIR "/tests/fixtures/sharded"
#define LLAMA FIX "/llama"
#define INDEX "model.safetensors.index.json"
#define SH1 "model-00001-of-00003.safetensors"
#define SH2 "model-00002-of-00003.safetensors"
#define SH3 "model-00003-of-00003.safetensors"

static void digest_of(const char *path, char hex[LK_DIGEST_HEX]) {
    lk_ckpt *ck = NULL;
    lk_status s = lk_ckpt_open(path, &ck);
    if (s) fprintf(stderr, "%s\n", lk_last_error());
    assert_int_equal(s, LK_OK);
    assert_int_equal(lk_digest_ckpt(ck, hex), LK_OK);
    lk_ckpt_close(ck);
}

/* Copies every regular file of src into a new folder dst. */
static void copy_dir(const char *src, const char *dst) {
    assert_int_equal(mkdir(dst, 0777), 0);
    DIR *d = opendir(src);
    assert_non_null(d);
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        char *a = tu_path(src, e->d_name), *b = tu_path(dst, e->d_name);
        size_t n = 0;
        void *data = tu_read_file(a, &n);
        assert_non_null(data);
        assert_int_equal(tu_write_file(b, data, n), 0);
        free(data);
        free(a);
        free(b);
    }
    closedir(d);
}

static char *read_text(const char *path) {
    size_t n = 0;
    char *t = tu_read_file(path, &n);
    assert_non_null(t);
    char *z = realloc(t, n + 1);
    assert_non_null(z);
    z[n] = 0;
    return z;
}

/* Replaces the first occurrence of `from` with `to` in the file. */
static void edit_file(const char *path, const char *from, const char *to) {
    char *t = read_text(path);
    char *at = strstr(t, from);
    assert_non_null(at);
    size_t a = (size_t)(at - t), lf = strlen(from), lt = strlen(to), n = strlen(t);
    char *o = malloc(n - lf + lt + 1);
    memcpy(o, t, a);
    memcpy(o + a, to, lt);
    memcpy(o + a + lt, at + lf, n - a - lf + 1);
    assert_int_equal(tu_write_file(path, o, strlen(o)), 0);
    free(o);
    free(t);
}

/* A copy of the llama fixture in a fresh folder (returned, malloc'd), and its parent tmp in *root. */
static char *llama_copy(char **root) {
    *root = tu_mkdtemp();
    char *d = tu_path(*root, "llama");
    copy_dir(LLAMA, d);
    return d;
}

static void expect_open_error(const char *path, lk_status want, const char *const *needles) {
    lk_ckpt *ck = NULL;
    lk_status s = lk_ckpt_open(path, &ck);
    if (s != want) fprintf(stderr, "got %s: %s\n", lk_status_str(s), lk_last_error());
    assert_int_equal(s, want);
    assert_null(ck);
    for (; *needles; needles++) tu_assert_contains(lk_last_error(), *needles);
}

/* transformers' sharded and single-file forms of the same model, opened as
 * an index, as a folder and as a file: same tensors, same digest. */
static void test_transformers_forms(void **state) {
    (void)state;
    lk_ckpt *ck = NULL;
    assert_int_equal(lk_ckpt_open(LLAMA, &ck), LK_OK);
    assert_true(lk_ckpt_sharded(ck));
    assert_int_equal(lk_ckpt_shard_count(ck), 3);
    assert_string_equal(lk_ckpt_index_name(ck), INDEX);
    assert_int_equal(lk_ckpt_count(ck), 21); /* 2 layers x 9 + embed, norm, lm_head */
    /* total_size as transformers computed it (BF16: 2 bytes x 6224 params) */
    assert_int_equal(lk_ckpt_total_size(ck), 12448);
    tu_assert_contains(lk_ckpt_index_metadata(ck), "\"total_parameters\":6224");
    long i = lk_ckpt_find(ck, "lm_head.weight");
    assert_true(i >= 0);
    assert_string_equal(lk_ckpt_shard_name(ck, lk_ckpt_tensor_shard(ck, (size_t)i)), SH3);
    lk_ckpt_close(ck);

    char a[LK_DIGEST_HEX], b[LK_DIGEST_HEX], c[LK_DIGEST_HEX];
    digest_of(LLAMA "/" INDEX, a);
    digest_of(LLAMA, b);
    digest_of(FIX "/llama_single/model.safetensors", c);
    assert_string_equal(a, b);
    assert_string_equal(a, c);
    digest_of(FIX "/llama_single", c);
    assert_string_equal(a, c);
    /* diffusers-style index written by hand with safetensors */
    digest_of(FIX "/diffusers", a);
    digest_of(FIX "/diffusers_single.safetensors", b);
    assert_string_equal(a, b);
    /* the CLI digest agrees */
    char *out = NULL, *err = NULL;
    assert_int_equal(tu_run_cli(&out, &err, "digest '%s'", LLAMA), 0);
    digest_of(FIX "/llama_single", c);
    tu_assert_contains(out, c);
    free(out);
    free(err);
}

static void test_folder_candidates(void **state) {
    (void)state;
    char *root = tu_mkdtemp();
    char *d = tu_path(root, "two");
    copy_dir(FIX "/diffusers", d);
    /* a variant index next to the default one: two candidates */
    char *src = tu_path(d, "diffusion_pytorch_model.safetensors.index.json");
    char *var = tu_path(d, "diffusion_pytorch_model.safetensors.index.fp16.json");
    size_t n;
    void *t = tu_read_file(src, &n);
    assert_int_equal(tu_write_file(var, t, n), 0);
    free(t);
    const char *need[] = {"2 checkpoints", "diffusion_pytorch_model.safetensors.index.json",
                          "diffusion_pytorch_model.safetensors.index.fp16.json", NULL};
    expect_open_error(d, LK_ERR_ARG, need);
    /* naming the variant index works */
    char a[LK_DIGEST_HEX], b[LK_DIGEST_HEX];
    digest_of(var, a);
    digest_of(FIX "/diffusers_single.safetensors", b);
    assert_string_equal(a, b);
    /* an empty folder */
    char *e = tu_path(root, "empty");
    assert_int_equal(mkdir(e, 0777), 0);
    const char *need2[] = {"empty", "no .safetensors", NULL};
    expect_open_error(e, LK_ERR_IO, need2);
    free(e);
    free(src);
    free(var);
    free(d);
    tu_rmtree(root);
    free(root);
}

/* Each malformed index is refused naming the index, the shard and the tensor. */
static void test_malformed(void **state) {
    (void)state;
    char *root, *d = llama_copy(&root);
    char *idx = tu_path(d, INDEX);
    char *orig = read_text(idx);
    char *sh2 = tu_path(d, SH2);

    /* missing shard */
    size_t n2;
    void *sh2data = tu_read_file(sh2, &n2);
    assert_int_equal(unlink(sh2), 0);
    const char *m1[] = {INDEX, SH2, "cannot open", "model.layers.", NULL};
    expect_open_error(d, LK_ERR_IO, m1);
    /* a shard that is not safetensors */
    assert_int_equal(tu_write_file(sh2, "not a safetensors file", 22), 0);
    const char *m2[] = {INDEX, SH2, NULL};
    expect_open_error(d, LK_ERR_FORMAT, m2);
    assert_int_equal(tu_write_file(sh2, sh2data, n2), 0);

    /* tensor not where the map says */
    edit_file(idx, "\"lm_head.weight\": \"" SH3 "\"", "\"lm_head.weight\": \"" SH1 "\"");
    const char *m3[] = {INDEX, "lm_head.weight", "is in shard " SH3, "names shard " SH1, NULL};
    expect_open_error(idx, LK_ERR_FORMAT, m3);
    assert_int_equal(tu_write_file(idx, orig, strlen(orig)), 0);

    /* a mapped tensor no shard holds */
    edit_file(idx, "\"weight_map\": {", "\"weight_map\": {\n    \"ghost.weight\": \"" SH2 "\",");
    const char *m4[] = {INDEX, "ghost.weight", SH2, "does not hold it", NULL};
    expect_open_error(idx, LK_ERR_FORMAT, m4);
    assert_int_equal(tu_write_file(idx, orig, strlen(orig)), 0);

    /* a shard holding a tensor the map omits */
    edit_file(idx, "\"lm_head.weight\": \"" SH3 "\",", "");
    const char *m5[] = {INDEX, SH3, "lm_head.weight", "omits", NULL};
    expect_open_error(idx, LK_ERR_FORMAT, m5);
    assert_int_equal(tu_write_file(idx, orig, strlen(orig)), 0);

    /* not JSON */
    assert_int_equal(tu_write_file(idx, "{\"weight_map\": ", 15), 0);
    const char *m6[] = {INDEX, "not a valid JSON index", NULL};
    expect_open_error(idx, LK_ERR_FORMAT, m6);
    /* JSON, but weight_map is not an object / duplicate key */
    assert_int_equal(tu_write_file(idx, "{\"weight_map\": []}", 18), 0);
    const char *m6b[] = {INDEX, "\"weight_map\" is not an object", NULL};
    expect_open_error(idx, LK_ERR_FORMAT, m6b);

    /* path traversal and absolute shard names */
    assert_int_equal(tu_write_file(idx, orig, strlen(orig)), 0);
    edit_file(idx, "\"lm_head.weight\": \"" SH3 "\"", "\"lm_head.weight\": \"../" SH3 "\"");
    const char *m7[] = {INDEX, "lm_head.weight", "'../" SH3 "'", NULL};
    expect_open_error(idx, LK_ERR_FORMAT, m7);
    assert_int_equal(tu_write_file(idx, orig, strlen(orig)), 0);
    edit_file(idx, "\"lm_head.weight\": \"" SH3 "\"", "\"lm_head.weight\": \"/etc/passwd\"");
    const char *m8[] = {INDEX, "lm_head.weight", "absolute path", NULL};
    expect_open_error(idx, LK_ERR_FORMAT, m8);
    assert_int_equal(tu_write_file(idx, orig, strlen(orig)), 0);

    /* a shard that is a symlink pointing out of the folder */
    char *outside = tu_path(root, "outside.safetensors");
    char *sh3 = tu_path(d, SH3);
    assert_int_equal(rename(sh3, outside), 0);
    assert_int_equal(symlink(outside, sh3), 0);
    const char *m9[] = {INDEX, SH3, "outside the index's folder", NULL};
    expect_open_error(idx, LK_ERR_FORMAT, m9);
    /* ... a symlink inside the folder is fine */
    char *inside = tu_path(d, "real3.bin");
    assert_int_equal(unlink(sh3), 0);
    assert_int_equal(rename(outside, inside), 0);
    assert_int_equal(symlink("real3.bin", sh3), 0);
    char a[LK_DIGEST_HEX], b[LK_DIGEST_HEX];
    digest_of(idx, a);
    digest_of(LLAMA, b);
    assert_string_equal(a, b);

    free(inside);
    free(sh3);
    free(outside);
    free(sh2data);
    free(sh2);
    free(orig);
    free(idx);
    free(d);
    tu_rmtree(root);
    free(root);
}

/* A tensor present in two shards (the map can name only one). */
static void test_tensor_in_two_shards(void **state) {
    (void)state;
    char *root = tu_mkdtemp();
    float x[4] = {1, 2, 3, 4};
    lk_tensor a = {.name = "x", .dtype = LK_DTYPE_F32, .ndim = 1, .shape = {4}, .nbytes = 16, .data = x};
    lk_tensor b[2] = {a, a};
    b[1].name = "y";
    char *p1 = tu_path(root, "m-00001-of-00002.safetensors"), *p2 = tu_path(root, "m-00002-of-00002.safetensors");
    assert_int_equal(lk_st_save(p1, &a, 1, NULL, 0), LK_OK);
    assert_int_equal(lk_st_save(p2, b, 2, NULL, 0), LK_OK);
    char *idx = tu_path(root, "m.safetensors.index.json");
    const char *js = "{\"metadata\": {}, \"weight_map\": {\"x\": \"m-00001-of-00002.safetensors\", "
                     "\"y\": \"m-00002-of-00002.safetensors\"}}";
    assert_int_equal(tu_write_file(idx, js, strlen(js)), 0);
    const char *need[] = {"m.safetensors.index.json", "tensor x is in two shards", "m-00001-of-00002.safetensors",
                          "m-00002-of-00002.safetensors", NULL};
    expect_open_error(root, LK_ERR_FORMAT, need);
    free(p1);
    free(p2);
    free(idx);
    tu_rmtree(root);
    free(root);
}

/* The Hugging Face cache layout: snapshots/<rev>/ files are symlinks into
 * the repo's blobs/. Accepted; a symlink elsewhere outside is not. */
static void test_hf_cache_layout(void **state) {
    (void)state;
    char *root = tu_mkdtemp();
    char *repo = tu_path(root, "models--x--tiny");
    char *blobs = tu_path(repo, "blobs"), *snaps = tu_path(repo, "snapshots");
    char *rev = tu_path(snaps, "abc123");
    assert_int_equal(mkdir(repo, 0777), 0);
    assert_int_equal(mkdir(blobs, 0777), 0);
    assert_int_equal(mkdir(snaps, 0777), 0);
    assert_int_equal(mkdir(rev, 0777), 0);
    const char *files[] = {INDEX, SH1, SH2, SH3, NULL};
    for (int i = 0; files[i]; i++) {
        char *src = tu_path(LLAMA, files[i]);
        char blobname[32];
        snprintf(blobname, sizeof blobname, "sha%d", i);
        char *blob = tu_path(blobs, blobname), *link = tu_path(rev, files[i]);
        size_t n;
        void *t = tu_read_file(src, &n);
        assert_int_equal(tu_write_file(blob, t, n), 0);
        char target[64];
        snprintf(target, sizeof target, "../../blobs/%s", blobname);
        assert_int_equal(symlink(target, link), 0);
        free(t);
        free(src);
        free(blob);
        free(link);
    }
    char a[LK_DIGEST_HEX], b[LK_DIGEST_HEX];
    digest_of(rev, a);
    digest_of(LLAMA, b);
    assert_string_equal(a, b);
    free(rev);
    free(snaps);
    free(blobs);
    free(repo);
    tu_rmtree(root);
    free(root);
}

/* Sorted listing of a folder as one string. */
static char *listing(const char *dir) {
    char *names[256];
    size_t n = 0;
    DIR *d = opendir(dir);
    assert_non_null(d);
    struct dirent *e;
    while ((e = readdir(d)) && n < 256)
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) names[n++] = strdup(e->d_name);
    closedir(d);
    for (size_t i = 0; i < n; i++)
        for (size_t j = i + 1; j < n; j++)
            if (strcmp(names[j], names[i]) < 0) {
                char *t = names[i];
                names[i] = names[j];
                names[j] = t;
            }
    size_t cap = 16;
    for (size_t i = 0; i < n; i++) cap += strlen(names[i]) + 1;
    char *s = calloc(1, cap);
    for (size_t i = 0; i < n; i++) {
        strcat(s, names[i]);
        strcat(s, "\n");
        free(names[i]);
    }
    return s;
}

/* Sharded fuse keeps the layout; the digest equals the single-file fuse. */
static void test_sharded_fuse(void **state) {
    (void)state;
    char *root, *d = llama_copy(&root);
    /* a stale total_size (older transformers counted bool tensors as 1/8
     * byte): a warning, and the output gets the right value */
    char *idx = tu_path(d, INDEX);
    edit_file(idx, "\"total_size\": 12448", "\"total_size\": 12000");
    lk_fuse_input in = {.path = FIX "/peft", .strength = 0.75f};
    char *out = tu_path(root, "out");
    lk_fuse_stats st;
    lk_status s = lk_fuse_file(d, &in, 1, out, NULL, &st);
    if (s) fprintf(stderr, "%s\n", lk_last_error());
    assert_int_equal(s, LK_OK);
    assert_int_equal(st.tensors_fused, 4); /* q_proj, v_proj x 2 layers */
    char *want = listing(LLAMA), *got = listing(out);
    /* same shard names, index name, config files, plus lorakit's record of
     * the files it wrote (io/out_dir.h) */
    assert_string_equal(got + strlen(".lorakit-output\n"), want);
    assert_memory_equal(got, ".lorakit-output\n", strlen(".lorakit-output\n"));
    char *oi = tu_path(out, INDEX), *text = read_text(oi);
    tu_assert_contains(text, "\"total_size\": 12448");
    tu_assert_contains(text, "\"total_parameters\": 6224");
    tu_assert_contains(text, "\"lorakit.fused\"");
    tu_assert_contains(text, "\"lm_head.weight\": \"" SH3 "\"");
    lk_ckpt *ck;
    assert_int_equal(lk_ckpt_open(out, &ck), LK_OK);
    for (size_t j = 0; j < lk_ckpt_shard_count(ck); j++)
        assert_non_null(lk_st_metadata_get(lk_ckpt_shard(ck, j), "lorakit.fused"));
    /* each tensor in the same shard as in the base */
    lk_ckpt *base;
    assert_int_equal(lk_ckpt_open(LLAMA, &base), LK_OK);
    for (size_t i = 0; i < lk_ckpt_count(ck); i++) {
        long b = lk_ckpt_find(base, lk_ckpt_tensor(ck, i)->name);
        assert_true(b >= 0);
        assert_string_equal(lk_ckpt_shard_name(ck, lk_ckpt_tensor_shard(ck, i)),
                            lk_ckpt_shard_name(base, lk_ckpt_tensor_shard(base, (size_t)b)));
    }
    lk_ckpt_close(base);
    lk_ckpt_close(ck);
    char *cfg_a = read_text(LLAMA "/config.json"), *cfgp = tu_path(out, "config.json"), *cfg_b = read_text(cfgp);
    assert_string_equal(cfg_a, cfg_b);

    /* the single-file fuse of the single-file form, and -o FILE from the sharded base */
    char *one = tu_path(root, "one.safetensors"), *single = tu_path(root, "single.safetensors");
    assert_int_equal(lk_fuse_file(FIX "/llama_single", &in, 1, single, NULL, NULL), LK_OK);
    assert_int_equal(lk_fuse_file(d, &in, 1, one, NULL, NULL), LK_OK);
    char a[LK_DIGEST_HEX], b[LK_DIGEST_HEX], c[LK_DIGEST_HEX], base_d[LK_DIGEST_HEX];
    digest_of(out, a);
    digest_of(single, b);
    digest_of(one, c);
    digest_of(LLAMA, base_d);
    assert_string_equal(a, b);
    assert_string_equal(a, c);
    assert_string_not_equal(a, base_d);

    /* an existing empty OUT_DIR is filled */
    char *empty = tu_path(root, "empty");
    assert_int_equal(mkdir(empty, 0777), 0);
    assert_int_equal(lk_fuse_file(d, &in, 1, empty, NULL, NULL), LK_OK);
    digest_of(empty, c);
    assert_string_equal(a, c);
    /* a folder lorakit wrote is replaced whole (here by the fuse at
     * strength 0.5, so the digest must change), and nothing else is left in
     * its parent */
    char *before = listing(root);
    lk_fuse_input half = {.path = FIX "/peft", .strength = 0.5f};
    assert_int_equal(lk_fuse_file(d, &half, 1, out, NULL, NULL), LK_OK);
    char *after = listing(root);
    assert_string_equal(before, after);
    char h[LK_DIGEST_HEX];
    digest_of(out, h);
    assert_string_not_equal(a, h);
    free(after);
    after = listing(out);
    assert_string_equal(after, got);
    free(after);
    /* a folder holding a file lorakit did not write is refused by its name, untouched */
    char *note = tu_path(out, "notes.txt");
    assert_int_equal(tu_write_file(note, "mine", 4), 0);
    assert_int_equal(lk_fuse_file(d, &in, 1, out, NULL, NULL), LK_ERR_ARG);
    tu_assert_contains(lk_last_error(), "holds notes.txt, which lorakit did not write there");
    digest_of(out, c);
    assert_string_equal(h, c);
    free(note);
    /* a non-empty folder without lorakit's record is refused */
    assert_int_equal(lk_fuse_file(d, &in, 1, d, NULL, NULL), LK_ERR_ARG);
    tu_assert_contains(lk_last_error(), "was not written by lorakit");
    after = listing(root);
    assert_string_equal(before, after);

    free(before);
    free(after);
    free(empty);
    free(one);
    free(single);
    free(cfg_a);
    free(cfg_b);
    free(cfgp);
    free(text);
    free(oi);
    free(want);
    free(got);
    free(out);
    free(idx);
    free(d);
    tu_rmtree(root);
    free(root);
}

/* A fuse that fails after the output was started leaves nothing new: a
 * non-finite result in the second shard, and every allocation failure. */
static void test_failed_sharded_fuse(void **state) {
    (void)state;
    char *root = tu_mkdtemp();
    /* diffusers-format adapter on to_v (shard 2): 1e30 * 1e30 overflows f32 */
    float A[2 * 8], B[8 * 2];
    for (int i = 0; i < 16; i++) A[i] = B[i] = 1e30f;
    lk_tensor t[2] = {
        {.name = "transformer_blocks.0.attn1.to_v.lora_A.weight", .dtype = LK_DTYPE_F32, .ndim = 2, .shape = {2, 8},
         .nbytes = sizeof A, .data = A},
        {.name = "transformer_blocks.0.attn1.to_v.lora_B.weight", .dtype = LK_DTYPE_F32, .ndim = 2, .shape = {8, 2},
         .nbytes = sizeof B, .data = B},
    };
    char *ad = tu_path(root, "huge.safetensors");
    assert_int_equal(lk_st_save(ad, t, 2, NULL, 0), LK_OK);
    char *outp = tu_path(root, "out");
    char *before = listing(root);
    lk_fuse_input in = {.path = ad, .strength = 1.0f};
    assert_int_equal(lk_fuse_file(FIX "/diffusers", &in, 1, outp, NULL, NULL), LK_ERR_NONFINITE);
    char *after = listing(root);
    assert_string_equal(before, after);
    free(after);

    /* every allocation failure in a sharded fuse: a clean error, nothing new */
    for (int i = 0; i < 16; i++) A[i] = B[i] = 0.25f;
    assert_int_equal(lk_st_save(ad, t, 2, NULL, 0), LK_OK);
    free(before);
    before = listing(root);
    int ok_at = 0;
    for (unsigned long k = 1; k < 4000 && !ok_at; k++) {
        lk_alloc_fail_at(k);
        lk_status s = lk_fuse_file(FIX "/diffusers", &in, 1, outp, NULL, NULL);
        lk_alloc_fail_at(0);
        if (s == LK_OK) {
            ok_at = (int)k;
            break;
        }
        assert_int_equal(s, LK_ERR_NOMEM);
        after = listing(root);
        assert_string_equal(before, after);
        free(after);
    }
    assert_true(ok_at > 1);
    char a[LK_DIGEST_HEX];
    digest_of(outp, a);
    free(before);
    free(outp);
    free(ad);
    tu_rmtree(root);
    free(root);
}

/* The index parser alone (also the fuzz target's entry point). */
static void test_parse_index(void **state) {
    (void)state;
    size_t n = 0;
    const char *ok = "{\"metadata\":{\"total_size\":1.5e3,\"x\":[1]},\"weight_map\":{\"a\":\"s.safetensors\",\"b\":\"s.safetensors\"}}";
    assert_int_equal(lk_ckpt_parse_index(ok, strlen(ok), "i", &n), LK_OK);
    assert_int_equal(n, 2);
    const char *bad[] = {"", "[]", "{}", "{\"weight_map\":{\"a\":1}}", "{\"weight_map\":{\"\":\"s\"}}",
                         "{\"weight_map\":{\"a\":\"..\"}}", "{\"weight_map\":{\"a\":\"x/../y\"}}",
                         "{\"weight_map\":{\"a\":\"s\",\"a\":\"t\"}}", "{\"weight_map\":{},\"metadata\":3}", NULL};
    for (int i = 0; bad[i]; i++) assert_int_equal(lk_ckpt_parse_index(bad[i], strlen(bad[i]), "i", &n), LK_ERR_FORMAT);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_transformers_forms), cmocka_unit_test(test_folder_candidates),
        cmocka_unit_test(test_malformed),          cmocka_unit_test(test_tensor_in_two_shards),
        cmocka_unit_test(test_hf_cache_layout),    cmocka_unit_test(test_sharded_fuse),
        cmocka_unit_test(test_failed_sharded_fuse), cmocka_unit_test(test_parse_index),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
