/* test_fuse_file.c — lk_fuse_file end to end: every format x every weight
 * dtype, a 3-adapter mix with a negative strength and a zero one, rsLoRA
 * and patterns through a PEFT folder; fused tensors are checked against the
 * double-precision reference of tests/util/adapter_ref.c computed from the
 * stored values with scales hand-derived from what each test wrote
 * (alpha / r or alpha / sqrt(r), times the strength); untouched tensors
 * must be byte-identical. Then thread-count and adapter-order invariance
 * (identical bytes / digests) and every error path (nothing written), and
 * inputs truncated on disk after they were opened. */
#include "adapter_ref.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define IN 40
#define OUT 24

#define g_dir ar_dir /* the group's temporary folder (ar_setup_dir) */
static tu_rng g_rng = {99};

static const char *const BASE_META[] = {"format", "pt", "note", "base model"};

/* Base: three linear weights of dtype dt, a bias, an integer tensor. */
static af_file *base_model(lk_dtype dt, const char *path) {
    af_file *m = af_new();
    af_rand(m, "blocks.0.attn.to_q.weight", dt, OUT, IN, &g_rng, -1, 1);
    af_rand(m, "blocks.0.attn.to_k.weight", dt, OUT, IN, &g_rng, -1, 1);
    af_rand(m, "blocks.1.attn.to_q.weight", dt, OUT, IN, &g_rng, -1, 1);
    af_rand(m, "blocks.0.attn.to_q.bias", dt, 1, OUT, &g_rng, -1, 1);
    af_rand(m, "pos_ids", LK_DTYPE_F32, 3, 5, &g_rng, -1000, 1000)->dtype = LK_DTYPE_I32;
    af_save(m, path, BASE_META, 2);
    return m;
}

typedef struct expect {
    const char *target;
    const lk_tensor *A, *B;
    double scale; /* alpha / r (or / sqrt r), before strength */
} expect;

/* Writes a 2-module adapter (to_q r=4, to_k r=2) in format fmt at path;
 * fills exp[0..1]. Factor dtype fd. */
static void write_adapter(lk_adapter_format fmt, const char *path, lk_dtype fd, af_file **keep, expect exp[2]) {
    af_file *f = af_new();
    const char *mods[2] = {"blocks.0.attn.to_q", "blocks.0.attn.to_k"};
    const char *kmods[2] = {"lora_unet_blocks_0_attn_to_q", "lora_unet_blocks_0_attn_to_k"};
    const int ranks[2] = {4, 2};
    const double alphas[2] = {2.0, 6.0};
    char a[256], b[256], al[256];
    for (int i = 0; i < 2; i++) {
        const char *sa = ".lora_A.weight", *sb = ".lora_B.weight";
        char stem[200];
        switch (fmt) {
        case LK_FORMAT_PEFT: snprintf(stem, sizeof stem, "base_model.model.%s", mods[i]); break;
        case LK_FORMAT_DIFFUSERS: snprintf(stem, sizeof stem, "transformer.%s", mods[i]); break;
        case LK_FORMAT_KOHYA:
            snprintf(stem, sizeof stem, "%s", kmods[i]);
            sa = ".lora_down.weight";
            sb = ".lora_up.weight";
            break;
        default:
            snprintf(stem, sizeof stem, "%s", mods[i]);
            sa = ".lora_A";
            sb = ".lora_B";
            break;
        }
        snprintf(a, sizeof a, "%s%s", stem, sa);
        snprintf(b, sizeof b, "%s%s", stem, sb);
        exp[i].A = af_rand(f, a, fd, ranks[i], IN, &g_rng, -0.5f, 0.5f);
        exp[i].B = af_rand(f, b, fd, OUT, ranks[i], &g_rng, -0.5f, 0.5f);
        exp[i].target = i ? "blocks.0.attn.to_k.weight" : "blocks.0.attn.to_q.weight";
        exp[i].scale = 1.0; /* alpha = r */
        if (fmt == LK_FORMAT_DIFFUSERS || fmt == LK_FORMAT_KOHYA) {
            snprintf(al, sizeof al, "%s.alpha", stem);
            af_scalar(f, al, LK_DTYPE_F32, alphas[i]);
            exp[i].scale = alphas[i] / ranks[i];
        }
    }
    af_save(f, path, NULL, 0);
    *keep = f;
}

static lk_st *open_st(const char *p) {
    lk_st *st;
    if (lk_st_open(p, &st)) fail_msg("open %s: %s", p, lk_last_error());
    return st;
}

/* Checks every tensor of out against base: targets against the reference
 * with the given terms, the rest byte for byte. */
static void check_output(const char *out, af_file *base, const expect *ex, const double *strength, size_t n_ex) {
    lk_st *st = open_st(out);
    assert_int_equal(lk_st_count(st), base->n);
    for (size_t i = 0; i < base->n; i++) {
        const lk_tensor *b = &base->t[i];
        long k = lk_st_find(st, b->name);
        assert_true(k >= 0);
        const lk_tensor *o = lk_st_tensor(st, (size_t)k);
        assert_int_equal(o->dtype, b->dtype);
        assert_int_equal(o->nbytes, b->nbytes);
        ar_term terms[8];
        size_t nt = 0;
        for (size_t e = 0; e < n_ex; e++)
            if (!strcmp(ex[e].target, b->name) && strength[e] != 0)
                /* the scale the kernel gets (fuse.h): the double strength
                 * times the module's double alpha / r (computed here) */
                terms[nt++] = (ar_term){ex[e].A, ex[e].B, strength[e] * ex[e].scale};
        if (nt == 0) {
            assert_memory_equal(o->data, b->data, b->nbytes);
        } else {
            size_t bad = ar_check_fused(o->data, b->data, b->dtype, b->shape[0], b->shape[1], terms, nt);
            if (bad) fail_msg("%s: %zu elements off the reference", b->name, bad);
        }
    }
    assert_string_equal(lk_st_metadata_get(st, "note"), "base model");
    assert_non_null(lk_st_metadata_get(st, "lorakit.fused"));
    lk_st_close(st);
}

static void fuse_ok(const char *base, const lk_fuse_input *in, size_t n, const char *out, int threads) {
    lk_fuse_file_opts o = {.fuse = {.threads = threads}};
    lk_fuse_stats stats;
    if (lk_fuse_file(base, in, n, out, &o, &stats)) fail_msg("fuse: %s", lk_last_error());
    assert_int_equal(stats.tensors_total, 5);
}

/* Every format x every weight dtype x a factor dtype, strength 0.7. */
static void test_formats_dtypes(void **state) {
    (void)state;
    const lk_dtype dts[3] = {LK_DTYPE_F32, LK_DTYPE_F16, LK_DTYPE_BF16};
    const lk_adapter_format fmts[4] = {LK_FORMAT_PEFT, LK_FORMAT_DIFFUSERS, LK_FORMAT_KOHYA, LK_FORMAT_FASTVIDEO};
    char *base = tu_path(g_dir, "base.safetensors"), *ad = tu_path(g_dir, "ad.safetensors"),
         *out = tu_path(g_dir, "out.safetensors");
    for (int d = 0; d < 3; d++)
        for (int f = 0; f < 4; f++) {
            af_file *m = base_model(dts[d], base), *af;
            expect ex[2];
            write_adapter(fmts[f], ad, dts[(d + f) % 3], &af, ex);
            lk_fuse_input in = {ad, 0.7, LK_FORMAT_AUTO};
            fuse_ok(base, &in, 1, out, 2);
            double s[2] = {0.7, 0.7};
            check_output(out, m, ex, s, 2);
            lk_st *st = open_st(out);
            char want[512];
            snprintf(want, sizeof want, "[{\"path\":\"%s\",\"strength\":0.7,\"format\":\"%s\"}]", ad,
                     lk_adapter_format_name(fmts[f]));
            assert_string_equal(lk_st_metadata_get(st, "lorakit.fused"), want);
            lk_st_close(st);
            af_free(af);
            af_free(m);
        }
    free(base);
    free(ad);
    free(out);
}

static char *peft_dir(const char *name, const char *config, af_file *f) {
    char *dir = tu_path(g_dir, name);
    mkdir(dir, 0755);
    char *p = tu_path(dir, "adapter_model.safetensors");
    af_save(f, p, NULL, 0);
    free(p);
    af_write_text(dir, "adapter_config.json", config);
    return dir;
}

/* A PEFT folder with rank/alpha patterns and rsLoRA, a kohya file at -0.5,
 * a diffusers file at 0.25 and a FastVideo file at strength 0, mixed
 * dtypes, overlapping targets. */
static void test_mix(void **state) {
    (void)state;
    char *base = tu_path(g_dir, "mixbase.safetensors"), *out = tu_path(g_dir, "mixout.safetensors");
    af_file *m = base_model(LK_DTYPE_BF16, base);
    af_file *p = af_new();
    expect ex[8];
    double str[8];
    size_t ne = 0;
    /* PEFT: r 4 (to_q: rank_pattern 8), lora_alpha 16, alpha_pattern to_k
     * 2, rsLoRA: to_q 16/sqrt(8), to_k 2/sqrt(4) = 1. */
    ex[ne] = (expect){"blocks.0.attn.to_q.weight",
                      af_rand(p, "base_model.model.blocks.0.attn.to_q.lora_A.weight", LK_DTYPE_F32, 8, IN, &g_rng, -.5f, .5f),
                      af_rand(p, "base_model.model.blocks.0.attn.to_q.lora_B.weight", LK_DTYPE_F32, OUT, 8, &g_rng, -.5f, .5f),
                      16.0 / sqrt(8.0)};
    str[ne++] = 1.0;
    ex[ne] = (expect){"blocks.0.attn.to_k.weight",
                      af_rand(p, "base_model.model.blocks.0.attn.to_k.lora_A.weight", LK_DTYPE_BF16, 4, IN, &g_rng, -.5f, .5f),
                      af_rand(p, "base_model.model.blocks.0.attn.to_k.lora_B.weight", LK_DTYPE_BF16, OUT, 4, &g_rng, -.5f, .5f),
                      2.0 / sqrt(4.0)};
    str[ne++] = 1.0;
    char *pd = peft_dir("mixpeft", "{\"r\": 4, \"lora_alpha\": 16, \"use_rslora\": true, "
                                   "\"rank_pattern\": {\"blocks.0.attn.to_q\": 8}, \"alpha_pattern\": {\"to_k\": 2}}",
                        p);
    af_file *k = af_new();
    ex[ne] = (expect){"blocks.0.attn.to_q.weight",
                      af_rand(k, "lora_unet_blocks_0_attn_to_q.lora_down.weight", LK_DTYPE_F16, 2, IN, &g_rng, -.5f, .5f),
                      af_rand(k, "lora_unet_blocks_0_attn_to_q.lora_up.weight", LK_DTYPE_F16, OUT, 2, &g_rng, -.5f, .5f),
                      3.0 / 2.0};
    af_scalar(k, "lora_unet_blocks_0_attn_to_q.alpha", LK_DTYPE_F16, 3.0);
    str[ne++] = -0.5;
    ex[ne] = (expect){"blocks.1.attn.to_q.weight",
                      af_rand(k, "lora_unet_blocks_1_attn_to_q.lora_down.weight", LK_DTYPE_F16, 2, IN, &g_rng, -.5f, .5f),
                      af_rand(k, "lora_unet_blocks_1_attn_to_q.lora_up.weight", LK_DTYPE_F16, OUT, 2, &g_rng, -.5f, .5f),
                      1.0};
    str[ne++] = -0.5;
    char *kp = tu_path(g_dir, "mixkohya.safetensors");
    af_save(k, kp, NULL, 0);
    af_file *d = af_new();
    ex[ne] = (expect){"blocks.0.attn.to_q.weight",
                      af_rand(d, "diffusion_model.blocks.0.attn.to_q.lora_A.weight", LK_DTYPE_BF16, 3, IN, &g_rng, -.5f, .5f),
                      af_rand(d, "diffusion_model.blocks.0.attn.to_q.lora_B.weight", LK_DTYPE_F32, OUT, 3, &g_rng, -.5f, .5f),
                      1.0};
    str[ne++] = 0.25;
    char *dp = tu_path(g_dir, "mixdiff.safetensors");
    af_save(d, dp, NULL, 0);
    af_file *z = af_new();
    af_rand(z, "blocks.0.attn.to_k.lora_A", LK_DTYPE_F32, 2, IN, &g_rng, -.5f, .5f);
    af_rand(z, "blocks.0.attn.to_k.lora_B", LK_DTYPE_F32, OUT, 2, &g_rng, -.5f, .5f);
    char *zp = tu_path(g_dir, "mixzero.safetensors");
    af_save(z, zp, NULL, 0);

    lk_fuse_input in[4] = {{pd, 1.0f, LK_FORMAT_AUTO},
                           {kp, -0.5f, LK_FORMAT_AUTO},
                           {dp, 0.25f, LK_FORMAT_AUTO},
                           {zp, 0.0f, LK_FORMAT_AUTO}};
    fuse_ok(base, in, 4, out, 0);
    check_output(out, m, ex, str, ne);
    lk_st *st = open_st(out);
    char d1[LK_DIGEST_HEX], d2[LK_DIGEST_HEX];
    assert_int_equal(lk_digest_st(st, d1), LK_OK);
    lk_st_close(st);

    /* Adapter order and thread count do not change the bytes. */
    lk_fuse_input rev[4] = {in[3], in[2], in[0], in[1]};
    const int threads[3] = {1, 3, 8};
    for (int t = 0; t < 3; t++) {
        fuse_ok(base, t == 1 ? rev : in, 4, out, threads[t]);
        st = open_st(out);
        assert_int_equal(lk_digest_st(st, d2), LK_OK);
        lk_st_close(st);
        assert_string_equal(d1, d2);
    }

    /* Strength 0 alone: every byte of every tensor as in the base. */
    lk_fuse_input zero[2] = {{pd, 0.0f, LK_FORMAT_AUTO}, {kp, 0.0f, LK_FORMAT_AUTO}};
    fuse_ok(base, zero, 2, out, 2);
    double s0[8] = {0};
    check_output(out, m, ex, s0, ne);

    free(pd);
    free(kp);
    free(dp);
    free(zp);
    af_free(p);
    af_free(k);
    af_free(d);
    af_free(z);
    af_free(m);
    free(base);
    free(out);
}

static void expect_fuse_error(const char *base, const lk_fuse_input *in, size_t n, const char *out,
                              const lk_fuse_file_opts *o, lk_status s, const char *msg) {
    lk_status got = lk_fuse_file(base, in, n, out, o, NULL);
    if (got != s) fail_msg("expected %s, got %s (%s)", lk_status_str(s), lk_status_str(got), lk_last_error());
    tu_assert_contains(lk_last_error(), msg);
}

/* Refusals and failures: nothing is written, the base is untouched. */
static void test_errors(void **state) {
    (void)state;
    char *base = tu_path(g_dir, "ebase.safetensors"), *out = tu_path(g_dir, "eout.safetensors"),
         *ad = tu_path(g_dir, "ead.safetensors");
    af_file *m = base_model(LK_DTYPE_F16, base), *af;
    expect ex[2];
    write_adapter(LK_FORMAT_DIFFUSERS, ad, LK_DTYPE_F32, &af, ex);
    size_t blen;
    void *before = tu_read_file(base, &blen);
    lk_fuse_input in = {ad, 1.0f, LK_FORMAT_AUTO};

    /* OUT = BASE, by the same path, another spelling, and a hard link. */
    expect_fuse_error(base, &in, 1, base, NULL, LK_ERR_ARG, "is the same file as the base");
    char *other = tu_path(g_dir, "./ebase.safetensors");
    expect_fuse_error(base, &in, 1, other, NULL, LK_ERR_ARG, "is the same file as the base");
    char *link_p = tu_path(g_dir, "elink.safetensors");
    assert_int_equal(link(base, link_p), 0);
    expect_fuse_error(base, &in, 1, link_p, NULL, LK_ERR_ARG, "is the same file as the base");
    expect_fuse_error(base, &in, 1, ad, NULL, LK_ERR_ARG, "is the same file as the adapter");
    size_t alen;
    void *after = tu_read_file(base, &alen);
    assert_int_equal(alen, blen);
    assert_memory_equal(after, before, blen);
    free(after);

    /* A non-finite result: F16 weight near its max plus a big delta. */
    af_file *big = af_new();
    af_rand(big, "blocks.0.attn.to_q.lora_A.weight", LK_DTYPE_F32, 1, IN, &g_rng, 100, 101);
    af_rand(big, "blocks.0.attn.to_q.lora_B.weight", LK_DTYPE_F32, OUT, 1, &g_rng, 1000, 1001);
    char *bp = tu_path(g_dir, "ebig.safetensors");
    af_save(big, bp, NULL, 0);
    lk_fuse_input bin = {bp, 1.0f, LK_FORMAT_AUTO};
    expect_fuse_error(base, &bin, 1, out, NULL, LK_ERR_NONFINITE,
                      "ebase.safetensors: blocks.0.attn.to_q.weight: fusion made element [0, 0] non-finite");
    assert_false(tu_exists(out));
    lk_fuse_file_opts allow = {.fuse = {.allow_nonfinite = 1}};
    assert_int_equal(lk_fuse_file(base, &bin, 1, out, &allow, NULL), LK_OK);
    assert_true(tu_exists(out));
    unlink(out);

    /* Unmatched module: error, nothing written; allowed: a count. An adapter
     * none of whose modules matches is an error even when allowed. */
    af_file *un = af_new();
    af_rand(un, "blocks.5.ff.lora_A.weight", LK_DTYPE_F32, 2, IN, &g_rng, -1, 1);
    af_rand(un, "blocks.5.ff.lora_B.weight", LK_DTYPE_F32, OUT, 2, &g_rng, -1, 1);
    char *up = tu_path(g_dir, "eun.safetensors");
    af_save(un, up, NULL, 0);
    lk_fuse_input none[2] = {{ad, 1.0f, LK_FORMAT_AUTO}, {up, 1.0f, LK_FORMAT_AUTO}};
    lk_fuse_file_opts allow_un = {.allow_unmatched = 1};
    expect_fuse_error(base, none, 2, out, &allow_un, LK_ERR_UNMATCHED,
                      "eun.safetensors: none of its 1 module matches a weight of the model (first: blocks.5.ff), so it "
                      "would change nothing; --allow-unmatched skips some unmatched modules, never all of them");
    assert_false(tu_exists(out));
    af_rand(un, "blocks.0.attn.to_q.lora_A.weight", LK_DTYPE_F32, 2, IN, &g_rng, -1, 1);
    af_rand(un, "blocks.0.attn.to_q.lora_B.weight", LK_DTYPE_F32, OUT, 2, &g_rng, -1, 1);
    af_save(un, up, NULL, 0);
    lk_fuse_input uin[2] = {{ad, 1.0f, LK_FORMAT_AUTO}, {up, 1.0f, LK_FORMAT_AUTO}};
    expect_fuse_error(base, uin, 2, out, NULL, LK_ERR_UNMATCHED, "eun.safetensors: blocks.5.ff matches no model weight");
    assert_false(tu_exists(out));
    lk_fuse_file_opts au = {.allow_unmatched = 1};
    lk_fuse_stats stats;
    assert_int_equal(lk_fuse_file(base, uin, 2, out, &au, &stats), LK_OK);
    assert_int_equal(stats.modules_unmatched, 1);
    assert_int_equal(stats.tensors_fused, 2);
    unlink(out);

    /* Bad strength; a broken adapter; forced wrong format. */
    lk_fuse_input nan_in = {ad, NAN, LK_FORMAT_AUTO};
    expect_fuse_error(base, &nan_in, 1, out, NULL, LK_ERR_ARG, "strength nan is not finite");
    lk_fuse_input kin = {ad, 1.0f, LK_FORMAT_KOHYA};
    expect_fuse_error(base, &kin, 1, out, NULL, LK_ERR_FORMAT, "is not a kohya adapter key");
    assert_false(tu_exists(out));

    /* An adapter whose path is not UTF-8 opens, but lorakit.fused cannot
     * record it: a clear LK_ERR_ARG (once reported as out of memory), no
     * output. */
    char *latin1 = tu_path(g_dir, "ead-\xe9.safetensors"); /* Latin-1 e-acute: not UTF-8 */
    assert_int_equal(link(ad, latin1), 0);
    lk_fuse_input lin = {latin1, 1.0f, LK_FORMAT_AUTO};
    expect_fuse_error(base, &lin, 1, out, NULL, LK_ERR_ARG, "adapter path is not valid UTF-8");
    assert_false(tu_exists(out));
    unlink(latin1);
    free(latin1);

    /* Allocation failures anywhere: LK_ERR_NOMEM and no output, until it
     * succeeds. */
    int ok = 0;
    for (unsigned long k = 1; k < 400 && !ok; k++) {
        lk_alloc_fail_at(k);
        lk_status s = lk_fuse_file(base, &in, 1, out, NULL, NULL);
        lk_alloc_fail_at(0);
        if (s == LK_OK) ok = 1;
        else {
            if (s != LK_ERR_NOMEM) fail_msg("alloc %lu: %s", k, lk_last_error());
            assert_false(tu_exists(out));
        }
    }
    assert_true(ok);

    free(before);
    free(other);
    free(link_p);
    free(bp);
    free(up);
    af_free(big);
    af_free(un);
    af_free(af);
    af_free(m);
    free(base);
    free(out);
    free(ad);
}

/* tests/fixtures/adapters/ref: the expected output was computed by
 * make_reference.py in float64 with numpy, with PEFT's and kohya's rules
 * applied in Python (re-based pattern matching), rounded once: lorakit's
 * fused values must be within 1 ulp of it, the untouched tensor identical. */
static void test_python_reference(void **state) {
    (void)state;
    char *out = tu_path(g_dir, "ref_out.safetensors");
    const char *fx = LK_TEST_SRC_DIR "/tests/fixtures/adapters/ref";
    char base[512], peft[512], kohya[512], expected[512];
    snprintf(base, sizeof base, "%s/base.safetensors", fx);
    snprintf(peft, sizeof peft, "%s/peft", fx);
    snprintf(kohya, sizeof kohya, "%s/kohya.safetensors", fx);
    snprintf(expected, sizeof expected, "%s/expected.safetensors", fx);
    lk_fuse_input in[2] = {{peft, 0.8, LK_FORMAT_AUTO}, {kohya, -0.6, LK_FORMAT_AUTO}};
    lk_fuse_stats stats;
    if (lk_fuse_file(base, in, 2, out, NULL, &stats)) fail_msg("fuse: %s", lk_last_error());
    assert_int_equal(stats.tensors_fused, 3);
    lk_st *got = open_st(out), *want = open_st(expected);
    assert_int_equal(lk_st_count(got), lk_st_count(want));
    for (size_t i = 0; i < lk_st_count(want); i++) {
        const lk_tensor *w = lk_st_tensor(want, i);
        long k = lk_st_find(got, w->name);
        assert_true(k >= 0);
        const lk_tensor *g = lk_st_tensor(got, (size_t)k);
        assert_int_equal(g->dtype, w->dtype);
        assert_int_equal(g->nbytes, w->nbytes);
        if (w->dtype == LK_DTYPE_F32) { /* untouched */
            assert_memory_equal(g->data, w->data, w->nbytes);
            continue;
        }
        for (size_t j = 0; j < lk_tensor_numel(w); j++) {
            double a = ar_get(g, j), b = ar_get(w, j);
            if (fabs(a - b) > ar_ulp(w->dtype, b)) fail_msg("%s[%zu]: lorakit %.9g, numpy %.9g", w->name, j, a, b);
        }
    }
    lk_st_close(got);
    lk_st_close(want);
    free(out);
}

/* Files changed on disk after they were opened. Expected values come from
 * this test: the bytes it wrote, and the offsets and lengths it truncated to.
 * (The whole lk_fuse_file path under a truncated base is test_fault_fuse.) */
static void test_changed_on_disk(void **state) {
    (void)state;
    char *bp = tu_path(g_dir, "shrink_base.safetensors");
    af_file *base = base_model(LK_DTYPE_F32, bp);
    lk_st *st = open_st(bp);
    long k = lk_st_find(st, "blocks.1.attn.to_q.weight");
    assert_true(k >= 0);
    const lk_tensor *t = lk_st_tensor(st, (size_t)k);
    uint64_t off = lk_st_file_offset(st, (size_t)k);
    const lk_tensor *want = af_get(base, "blocks.1.attn.to_q.weight");
    /* The file now ends 12 bytes into this tensor: lk_st_read reports it
     * (the mapping would raise SIGBUS on the lost pages). */
    assert_int_equal(truncate(bp, (off_t)(off + 12)), 0);
    unsigned char *buf = malloc(t->nbytes);
    assert_int_equal(lk_st_read(st, (size_t)k, 0, buf, 12), LK_OK);
    assert_memory_equal(buf, want->data, 12);
    assert_int_equal(lk_st_read(st, (size_t)k, 0, buf, t->nbytes), LK_ERR_IO);
    char msg[512];
    snprintf(msg, sizeof msg,
             "%s: blocks.1.attn.to_q.weight: changed on disk while being read: expected %zu bytes at offset %llu, got 12",
             bp, t->nbytes, (unsigned long long)off);
    assert_string_equal(lk_last_error(), msg);
    assert_int_equal(lk_st_read(st, (size_t)k, 8, buf, t->nbytes), LK_ERR_ARG); /* past the tensor */
    free(buf);
    lk_st_close(st);
    af_free(base);
    free(bp);

    /* An adapter truncated to nothing after lk_adapter_open: its factors were
     * copied at open, so they still read back as written. */
    char *ap = tu_path(g_dir, "shrink_adapter.safetensors");
    af_file *keep;
    expect ex[2];
    write_adapter(LK_FORMAT_DIFFUSERS, ap, LK_DTYPE_BF16, &keep, ex);
    lk_adapter *a;
    assert_int_equal(lk_adapter_open(ap, LK_FORMAT_AUTO, &a), LK_OK);
    assert_int_equal(truncate(ap, 0), 0);
    assert_int_equal(lk_adapter_count(a), 2);
    for (size_t i = 0; i < 2; i++) {
        const lk_lora_module *m = lk_adapter_module(a, i);
        /* modules are in stem order: to_k before to_q */
        const expect *e = &ex[strstr(m->module, "to_q") ? 0 : 1];
        assert_int_equal(m->A.nbytes, e->A->nbytes);
        assert_int_equal(m->B.nbytes, e->B->nbytes);
        assert_memory_equal(m->A.data, e->A->data, e->A->nbytes);
        assert_memory_equal(m->B.data, e->B->data, e->B->nbytes);
    }
    lk_adapter_free(a);
    af_free(keep);
    free(ap);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_changed_on_disk),
        cmocka_unit_test(test_formats_dtypes),
        cmocka_unit_test(test_mix),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_python_reference),
    };
    return cmocka_run_group_tests(tests, ar_setup_dir, ar_teardown_dir);
}
