/* test_alpha_given.c — alpha is never silently lost (issue 28, item 1).
 *
 * A FastVideo-legacy file (<m>.lora_A, <m>.lora_B) carries no alpha of its
 * own in FastVideo's format, so lorakit takes one from, in order: an
 * adapter_config.json beside it, `.alpha` tensors beside its keys, its
 * lora_adapter_metadata, or the caller (lk_adapter_opts / lk_fuse_input
 * has_alpha, `-l PATH:S:alpha=A`, a plan's `alpha:`). Without any it
 * fuses at alpha = r and warns. Integer `.alpha` scalars (diffusers'
 * convert_state_dict_to_kohya writes an I64) are read as their value.
 *
 * Oracles: the fused weights are checked element by element against the
 * float64 reference W + s * (alpha / r) * B @ A (ar_check_fused) with the
 * hand-chosen alpha; files and calls that mean the same scale are compared
 * by digest (strength 0.5 at alpha 8 is strength 1 at alpha 4: r = 4). */
#include "adapter_ref.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "lorakit/alloc.h"

#define IN 12
#define OUT 8
#define R 4

static tu_rng g_rng = {2801};
static char *g_base;
static af_file *g_model;
static const char *const W = "blocks.0.attn.to_q.weight";

static void write_base(void) {
    g_model = af_new();
    af_rand(g_model, W, LK_DTYPE_F32, OUT, IN, &g_rng, -1, 1);
    g_base = tu_path(ar_dir, "base.safetensors");
    af_save(g_model, g_base, NULL, 0);
}

/* The factors every adapter below shares (same bytes, so scales compare). */
static af_file *fv_factors(void) {
    static tu_rng rng = {99};
    tu_rng r = rng;
    af_file *f = af_new();
    af_rand(f, "blocks.0.attn.to_q.lora_A", LK_DTYPE_F32, R, IN, &r, -1, 1);
    af_rand(f, "blocks.0.attn.to_q.lora_B", LK_DTYPE_F32, OUT, R, &r, -1, 1);
    return f;
}

/* An integer scalar tensor (the buffer ar_tensor_scalar gives holds 8 bytes). */
static void int_scalar(af_file *f, const char *name, lk_dtype dt, int64_t v) {
    lk_tensor *t = af_scalar(f, name, LK_DTYPE_F64, 0);
    t->dtype = dt;
    t->nbytes = lk_dtype_size(dt);
    uint64_t u = (uint64_t)v;
    for (size_t b = 0; b < t->nbytes; b++) ((unsigned char *)t->data)[b] = (unsigned char)(u >> (8 * b));
}

/* A FastVideo-legacy file in its own folder `dir` (a config may be put beside it). */
static char *fv_file(const char *dir, af_file *f, const char *const *meta, size_t n_meta) {
    char *d = tu_path(ar_dir, dir);
    tu_rmtree(d);
    assert_int_equal(mkdir(d, 0700), 0);
    char *p = tu_path(d, "fv.safetensors");
    af_save(f, p, meta, n_meta);
    free(d);
    return p;
}

static lk_adapter *open_alpha(const char *p, int has, double alpha, lk_status want) {
    lk_adapter_opts o = {.has_alpha = has, .alpha = alpha};
    lk_adapter *a = NULL;
    lk_status s = lk_adapter_open_opts(p, &o, &a);
    if (s != want) fail_msg("%s: status %d, want %d: %s", p, s, want, lk_last_error());
    return a;
}

static void expect_module(const char *p, int has, double alpha, double want_alpha, const char *source) {
    lk_adapter *a = open_alpha(p, has, alpha, LK_OK);
    assert_int_equal(lk_adapter_get_format(a), LK_FORMAT_FASTVIDEO);
    const lk_lora_module *m = lk_adapter_module(a, 0);
    assert_int_equal(m->rank, R);
    if (m->alpha != want_alpha) fail_msg("%s: alpha %g, want %g", p, m->alpha, want_alpha);
    assert_true(m->scale == want_alpha / R);
    assert_string_equal(m->alpha_source, source);
    lk_adapter_free(a);
}

/* The fused out file against the float64 reference at scale s * alpha / r. */
static void check_fused(const char *out, const char *adapter, double s, double alpha) {
    lk_st *so, *sa;
    assert_int_equal(lk_st_open(out, &so), LK_OK);
    assert_int_equal(lk_st_open(adapter, &sa), LK_OK);
    const lk_tensor *fw = lk_st_tensor(so, (size_t)lk_st_find(so, W));
    ar_term t = {lk_st_tensor(sa, (size_t)lk_st_find(sa, "blocks.0.attn.to_q.lora_A")),
                 lk_st_tensor(sa, (size_t)lk_st_find(sa, "blocks.0.attn.to_q.lora_B")), s * alpha / R};
    assert_int_equal(ar_check_fused(fw->data, af_get(g_model, W)->data, LK_DTYPE_F32, OUT, IN, &t, 1), 0);
    lk_st_close(so);
    lk_st_close(sa);
}

static void file_digest(const char *path, char hex[LK_DIGEST_HEX]) { assert_int_equal(tu_file_digest(path, hex), LK_OK); }

/* Every source of alpha for a FastVideo-legacy file, and the caller's
 * against the file's. */
static void test_fastvideo_sources(void **state) {
    (void)state;
    af_file *f = fv_factors();
    char *plain = fv_file("plain", f, NULL, 0);
    expect_module(plain, 0, 0, R, "default r");                      /* FastVideo's own reading: scale 1 */
    expect_module(plain, 1, 8, 8, "caller");                         /* scale 2 */
    tu_cli_expect(0, NULL, "alpha defaults to r (scale 1) for 1 of 1 modules (e.g. blocks.0.attn.to_q: r = 4)", NULL,
                  "inspect '%s'", plain);
    /* a sidecar adapter_config.json gives it (was: ignored with a warning) */
    char *cfgd = fv_file("cfg", f, NULL, 0);
    char *dir = tu_path(ar_dir, "cfg");
    af_write_text(dir, "adapter_config.json", "{\"r\": 4, \"lora_alpha\": 8}");
    expect_module(cfgd, 0, 0, 8, "config");
    expect_module(cfgd, 1, 8, 8, "config"); /* the caller agreeing */
    lk_adapter *a = open_alpha(cfgd, 1, 16, LK_ERR_CONFIG);
    tu_assert_contains(lk_last_error(), "blocks.0.attn.to_q: the file gives alpha = 8 (config) but the caller gives "
                                        "alpha = 16; drop the caller's alpha or fix the file");
    af_write_text(dir, "adapter_config.json", "{\"r\": 2, \"lora_alpha\": 8}");
    a = open_alpha(cfgd, 0, 0, LK_ERR_SHAPE);
    tu_assert_contains(lk_last_error(), "lora_A has rank 4 but");
    (void)a;
    /* .alpha tensors beside its keys (were refused), float and integer */
    struct {
        lk_dtype dt;
        int64_t v;
    } ints[] = {{LK_DTYPE_I64, 8}, {LK_DTYPE_I32, 8}, {LK_DTYPE_I16, 8}, {LK_DTYPE_I8, -3}, {LK_DTYPE_U8, 200},
                {LK_DTYPE_U64, 8}, {LK_DTYPE_U16, 8}, {LK_DTYPE_U32, 8}};
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++) {
        af_file *g = fv_factors();
        int_scalar(g, "blocks.0.attn.to_q.alpha", ints[i].dt, ints[i].v);
        char *p = fv_file("int", g, NULL, 0);
        expect_module(p, 0, 0, (double)ints[i].v, ".alpha tensor");
        free(p);
        af_free(g);
    }
    af_file *g = fv_factors();
    af_scalar(g, "blocks.0.attn.to_q.alpha", LK_DTYPE_F32, 8);
    char *ta = fv_file("tensor", g, NULL, 0);
    expect_module(ta, 0, 0, 8, ".alpha tensor");
    a = open_alpha(ta, 1, 4, LK_ERR_CONFIG);
    tu_assert_contains(lk_last_error(), "the file gives alpha = 8 (.alpha tensor) but the caller gives alpha = 4");
    /* with a config too: the two must agree */
    char *tdir = tu_path(ar_dir, "tensor");
    af_write_text(tdir, "adapter_config.json", "{\"r\": 4, \"lora_alpha\": 16}");
    a = open_alpha(ta, 0, 0, LK_ERR_CONFIG);
    tu_assert_contains(lk_last_error(), "the .alpha tensor says alpha = 8 but");
    /* lora_adapter_metadata */
    const char *meta[] = {"lora_adapter_metadata", "{\"r\": 4, \"lora_alpha\": 8}"};
    char *md = fv_file("meta", f, meta, 1);
    expect_module(md, 0, 0, 8, "metadata lora_adapter_metadata");
    /* a caller's alpha that is not finite */
    a = open_alpha(plain, 1, 1.0 / 0.0, LK_ERR_ARG);
    tu_assert_contains(lk_last_error(), "alpha inf is not finite");
    free(plain);
    free(cfgd);
    free(dir);
    free(ta);
    free(tdir);
    free(md);
    af_free(g);
    af_free(f);
}

/* fuse with the caller's alpha, against the float64 reference; the CLI's
 * -l PATH:S:alpha=A and a plan's alpha: give the same bytes. */
static void test_fuse_cli_plan(void **state) {
    (void)state;
    af_file *f = fv_factors();
    char *p = fv_file("fuse", f, NULL, 0);
    char *out = tu_path(ar_dir, "o.safetensors"), *out2 = tu_path(ar_dir, "o2.safetensors");
    lk_fuse_input in = {.path = p, .strength = 0.5, .has_alpha = 1, .alpha = 8};
    unlink(out);
    assert_int_equal(lk_fuse_file(g_base, &in, 1, out, NULL, NULL), LK_OK);
    check_fused(out, p, 0.5, 8);
    char d1[LK_DIGEST_HEX], d2[LK_DIGEST_HEX];
    file_digest(out, d1);
    unlink(out2);
    tu_cli_expect(0, "\"alpha\":4", NULL, NULL, "fuse '%s' -l '%s:alpha=4' -o '%s' --json", g_base, p, out2);
    file_digest(out2, d2);
    assert_string_equal(d1, d2); /* 0.5 * 8 / 4 = 1 * 4 / 4 */
    unlink(out2);
    tu_cli_expect(0, NULL, NULL, "alpha defaults to r", "fuse '%s' -l '%s:0.5:alpha=8' -o '%s'", g_base, p, out2);
    file_digest(out2, d2);
    assert_string_equal(d1, d2);
    tu_cli_expect(0, "\"alpha\":8", NULL, NULL, "inspect '%s'", out2); /* lorakit.fused records it */
    unlink(out2);
    tu_cli_expect(2, NULL, "alpha: ", NULL, "fuse '%s' -l '%s:alpha=x' -o '%s'", g_base, p, out2);
    assert_false(tu_exists(out2));
    /* a plan entry's alpha (and a bad one named by line) */
    char *plan = tu_path(ar_dir, "plan.yaml");
    char text[1024];
    snprintf(text, sizeof text, "steps:\n  - loras: [{path: '%s', strength: 0.5, alpha: 8}]\n", p);
    assert_int_equal(tu_write_file(plan, text, strlen(text)), 0);
    lk_plan *pl;
    assert_int_equal(lk_plan_load(plan, &pl), LK_OK);
    assert_true(pl->steps[0].loras[0].has_alpha && pl->steps[0].loras[0].alpha == 8);
    lk_plan_free(pl);
    char want[96];
    snprintf(want, sizeof want, "\"digest\":\"%s\"", d1);
    tu_cli_expect(0, want, NULL, NULL, "swap '%s' --plan '%s' --json", g_base, plan);
    const char *bad = "steps:\n  - loras: [{path: a, alpha: [1]}]\n";
    assert_int_equal(lk_plan_parse(bad, strlen(bad), "plan.yaml", NULL, &pl), LK_ERR_CONFIG);
    tu_assert_contains(lk_last_error(), "plan.yaml:2: ");
    tu_assert_contains(lk_last_error(), "alpha: expected a finite number");
    /* the tracker: the alpha is part of the request (another alpha is another set, not a skip) */
    lk_comm *c;
    lk_weights *w;
    lk_tracker *tr;
    assert_int_equal(lk_comm_self(&c), LK_OK);
    assert_int_equal(lk_weights_load(g_base, &w), LK_OK);
    lk_tracker_opts o = LK_TRACKER_OPTS_DEFAULT;
    assert_int_equal(lk_tracker_create(c, w, &o, &tr), LK_OK);
    lk_tracker_stats st;
    lk_fuse_input one = {.path = p, .strength = 1.0, .has_alpha = 1, .alpha = 2};
    assert_int_equal(lk_tracker_apply(tr, &one, 1, &st), LK_OK);
    one.alpha = 4;
    assert_int_equal(lk_tracker_apply(tr, &one, 1, &st), LK_OK);
    assert_false(st.skipped);
    assert_int_equal(st.keys_fused, 1);
    char dw[LK_DIGEST_HEX];
    assert_int_equal(lk_weights_digest(w, dw), LK_OK);
    assert_string_equal(dw, d1);
    assert_int_equal(lk_tracker_apply(tr, &one, 1, &st), LK_OK);
    assert_true(st.skipped);
    lk_tracker_free(tr);
    lk_weights_free(w);
    lk_comm_free(c);
    free(plan);
    free(out);
    free(out2);
    free(p);
    af_free(f);
}

/* A kohya file's I64 .alpha (diffusers' convert_state_dict_to_kohya), and
 * the warning for every format without alpha. */
static void test_kohya_int_and_warnings(void **state) {
    (void)state;
    tu_rng r = {5};
    af_file *f = af_new();
    af_rand(f, "lora_unet_blocks_0_attn_to_q.lora_down.weight", LK_DTYPE_F32, R, IN, &r, -1, 1);
    af_rand(f, "lora_unet_blocks_0_attn_to_q.lora_up.weight", LK_DTYPE_F32, OUT, R, &r, -1, 1);
    int_scalar(f, "lora_unet_blocks_0_attn_to_q.alpha", LK_DTYPE_I64, 8);
    char *p = tu_path(ar_dir, "k.safetensors");
    af_save(f, p, NULL, 0);
    lk_adapter *a = open_alpha(p, 0, 0, LK_OK);
    assert_true(lk_adapter_module(a, 0)->alpha == 8 && lk_adapter_module(a, 0)->scale == 2.0);
    lk_adapter_free(a);
    tu_cli_expect(0, ".alpha tensor", NULL, "alpha defaults to r", "inspect '%s'", p);
    /* a bool alpha is still refused by name */
    af_file *b = af_new();
    tu_rng r2 = {5};
    af_rand(b, "lora_unet_blocks_0_attn_to_q.lora_down.weight", LK_DTYPE_F32, R, IN, &r2, -1, 1);
    af_rand(b, "lora_unet_blocks_0_attn_to_q.lora_up.weight", LK_DTYPE_F32, OUT, R, &r2, -1, 1);
    int_scalar(b, "lora_unet_blocks_0_attn_to_q.alpha", LK_DTYPE_BOOL, 1);
    af_save(b, p, NULL, 0);
    a = open_alpha(p, 0, 0, LK_ERR_DTYPE);
    tu_assert_contains(lk_last_error(), "alpha has dtype BOOL; expected a float or an integer");
    /* diffusers form with no alpha anywhere: the same warning as PEFT's */
    af_file *d = af_new();
    af_rand(d, "transformer.blocks.0.attn.to_q.lora_A.weight", LK_DTYPE_F32, R, IN, &r, -1, 1);
    af_rand(d, "transformer.blocks.0.attn.to_q.lora_B.weight", LK_DTYPE_F32, OUT, R, &r, -1, 1);
    char *q = tu_path(ar_dir, "d.safetensors");
    af_save(d, q, NULL, 0);
    tu_cli_expect(0, NULL, "alpha defaults to r", NULL, "inspect '%s'", q);
    free(p);
    free(q);
    af_free(f);
    af_free(b);
    af_free(d);
}

/* Out of memory anywhere in an open with the caller's alpha: LK_ERR_NOMEM
 * and nothing leaked (ASan), until it succeeds. */
static void test_alloc_failures(void **state) {
    (void)state;
    af_file *f = fv_factors();
    char *p = fv_file("alloc", f, NULL, 0);
    int ok = 0;
    for (unsigned long k = 1; k < 300 && !ok; k++) {
        lk_adapter_opts o = {.has_alpha = 1, .alpha = 8};
        lk_adapter *a = NULL;
        lk_alloc_fail_at(k);
        lk_status s = lk_adapter_open_opts(p, &o, &a);
        lk_alloc_fail_at(0);
        if (s == LK_OK) {
            ok = 1;
            assert_string_equal(lk_adapter_module(a, 0)->alpha_source, "caller");
        } else {
            assert_int_equal(s, LK_ERR_NOMEM);
        }
        lk_adapter_free(a);
    }
    assert_true(ok);
    free(p);
    af_free(f);
}

static int setup(void **state) {
    int r = ar_setup_dir(state);
    if (!r) write_base();
    return r;
}

static int teardown(void **state) {
    free(g_base);
    af_free(g_model);
    return ar_teardown_dir(state);
}

int main(void) {
    lk_log_set_level(LK_LOG_ERROR); /* warnings are checked through the CLI's stderr */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fastvideo_sources),
        cmocka_unit_test(test_fuse_cli_plan),
        cmocka_unit_test(test_kohya_int_and_warnings),
        cmocka_unit_test(test_alloc_failures),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
