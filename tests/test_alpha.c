/* test_alpha.c — where a file's alpha comes from (issue 20, items 2 and 3).
 *
 * Expectations, from the readers lorakit follows: diffusers, ComfyUI and
 * A1111 scale a kohya module that has no `.alpha` tensor by 1 (alpha = r)
 * and never read ss_network_alpha, so lorakit does too and warns, naming
 * both values, when ss_network_alpha says otherwise (an unparsable one is a
 * warning); diffusers refuses a file whose `.alpha` tensors and
 * lora_adapter_metadata disagree, so lorakit refuses it naming both values
 * unless told which to use (LK_ALPHA_TENSORS / LK_ALPHA_METADATA: C,
 * `--alpha-from` on fuse, swap and inspect, the plan's alpha_from). The
 * scales below are hand-computed alpha / r. */
#include "adapter_ref.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define IN 12
#define OUT 8
#define R 4

static tu_rng g_rng = {77};

static char *g_base;

/* A base with blocks.0.attn.to_q.weight (F32 OUT x IN). */
static void write_base(void) {
    af_file *m = af_new();
    af_rand(m, "blocks.0.attn.to_q.weight", LK_DTYPE_F32, OUT, IN, &g_rng, -1, 1);
    g_base = tu_path(ar_dir, "base.safetensors");
    af_save(m, g_base, NULL, 0);
    af_free(m);
}

/* An adapter on blocks.0.attn.to_q (rank R) in kohya (lora_down/up) or
 * diffusers (transformer. prefix, lora_A/B) form, with an optional .alpha
 * tensor (alpha < 0: none) and metadata. */
static char *adapter(int is_kohya, const char *name, double alpha, const char *const *meta, size_t n_meta) {
    const char *stem = is_kohya ? "lora_unet_blocks_0_attn_to_q" : "transformer.blocks.0.attn.to_q";
    char k[128];
    af_file *f = af_new();
    snprintf(k, sizeof k, "%s.%s", stem, is_kohya ? "lora_down.weight" : "lora_A.weight");
    af_rand(f, k, LK_DTYPE_F32, R, IN, &g_rng, -1, 1);
    snprintf(k, sizeof k, "%s.%s", stem, is_kohya ? "lora_up.weight" : "lora_B.weight");
    af_rand(f, k, LK_DTYPE_F32, OUT, R, &g_rng, -1, 1);
    snprintf(k, sizeof k, "%s.alpha", stem);
    if (alpha >= 0) af_scalar(f, k, LK_DTYPE_F32, alpha);
    char *p = tu_path(ar_dir, name);
    af_save(f, p, meta, n_meta);
    af_free(f);
    return p;
}
#define kohya(...) adapter(1, __VA_ARGS__)
#define diffusers(...) adapter(0, __VA_ARGS__)

/* Opens path with alpha_from and checks the one module's alpha, scale and source. */
static void expect_alpha(const char *path, lk_alpha_from from, double alpha, const char *source) {
    lk_adapter_opts o = {.format = LK_FORMAT_AUTO, .alpha_from = from};
    lk_adapter *a;
    if (lk_adapter_open_opts(path, &o, &a)) fail_msg("%s: %s", path, lk_last_error());
    assert_int_equal(lk_adapter_count(a), 1);
    const lk_lora_module *m = lk_adapter_module(a, 0);
    assert_int_equal(m->rank, R);
    assert_true(m->alpha == alpha);
    assert_true(m->scale == alpha / R);
    assert_string_equal(m->alpha_source, source);
    lk_adapter_free(a);
}

/* Item 2: a kohya module without .alpha is at alpha = r; ss_network_alpha
 * only warns (or counts with metadata). */
static void test_kohya_no_alpha(void **state) {
    (void)state;
    const char *ss8[] = {"ss_network_alpha", "8.0", "ss_network_dim", "4"};
    char *p = kohya("k8.safetensors", -1, ss8, 2);
    expect_alpha(p, LK_ALPHA_AUTO, R, "default r");       /* scale 1, as diffusers / ComfyUI / A1111 */
    expect_alpha(p, LK_ALPHA_TENSORS, R, "default r");
    expect_alpha(p, LK_ALPHA_METADATA, 8, "metadata ss_network_alpha"); /* scale 2, on request */
    tu_cli_expect(0, "default r", "k8.safetensors: 1 of 1 modules have no .alpha tensor, so alpha = r (as diffusers, "
        "ComfyUI and A1111 read them), but metadata ss_network_alpha = 8.0 differs (e.g. "
        "lora_unet_blocks_0_attn_to_q: r = 4)", NULL, "inspect '%s'", p);
    tu_cli_expect(0, "metadata ss_network_alpha", NULL, "differs", "inspect '%s' --alpha-from metadata", p);
    /* fused at scale 1: the same bytes as the file with an explicit .alpha = r */
    char *out1 = tu_path(ar_dir, "o1.safetensors"), *out2 = tu_path(ar_dir, "o2.safetensors");
    lk_fuse_input in = {p, 1.0, LK_FORMAT_AUTO};
    assert_int_equal(lk_fuse_file(g_base, &in, 1, out1, NULL, NULL), LK_OK);
    lk_st *st;
    assert_int_equal(lk_st_open(p, &st), LK_OK); /* the same factors, with .alpha = 4 and no metadata */
    af_file *f = af_new();
    for (size_t i = 0; i < lk_st_count(st); i++) {
        const lk_tensor *t = lk_st_tensor(st, i);
        memcpy(af_rand(f, t->name, t->dtype, t->shape[0], t->shape[1], &g_rng, 0, 1)->data, t->data, t->nbytes);
    }
    lk_st_close(st);
    af_scalar(f, "lora_unet_blocks_0_attn_to_q.alpha", LK_DTYPE_F32, R);
    char *pr = tu_path(ar_dir, "k_explicit.safetensors");
    af_save(f, pr, NULL, 0);
    af_free(f);
    in.path = pr;
    assert_int_equal(lk_fuse_file(g_base, &in, 1, out2, NULL, NULL), LK_OK);
    char d1[LK_DIGEST_HEX], d2[LK_DIGEST_HEX];
    assert_int_equal(tu_file_digest(out1, d1), LK_OK);
    assert_int_equal(tu_file_digest(out2, d2), LK_OK);
    assert_string_equal(d1, d2);
    /* agreeing metadata: no warning */
    const char *ss4[] = {"ss_network_alpha", "4", "ss_network_dim", "4"};
    char *q = kohya("k4.safetensors", -1, ss4, 2);
    tu_cli_expect(0, "default r", NULL, "ss_network_alpha", "inspect '%s'", q);
    /* a .alpha tensor is used whatever ss_network_alpha says (no warning) */
    char *t = kohya("k_t.safetensors", 2, ss8, 2);
    expect_alpha(t, LK_ALPHA_AUTO, 2, ".alpha tensor");
    tu_cli_expect(0, ".alpha tensor", NULL, "ss_network_alpha", "inspect '%s'", t);
    /* ss_network_alpha that is not a number: a warning, and ignored */
    const char *bad[][2] = {{"ss_network_alpha", "abc"}, {"ss_network_alpha", "nan"}, {"ss_network_alpha", ""},
                            {"ss_network_alpha", "1e999"}};
    for (size_t i = 0; i < 4; i++) {
        char *b = kohya("k_bad.safetensors", -1, bad[i], 1);
        expect_alpha(b, LK_ALPHA_METADATA, R, "default r");
        char want[128];
        snprintf(want, sizeof want, "metadata ss_network_alpha '%s' is not a finite number; ignored", bad[i][1]);
        tu_cli_expect(0, NULL, want, NULL, "inspect '%s'", b);
        free(b);
    }
    free(p);
    free(q);
    free(t);
    free(pr);
    free(out1);
    free(out2);
}

/* Item 3: .alpha tensors and lora_adapter_metadata that disagree. */
static void test_tensor_vs_metadata(void **state) {
    (void)state;
    const char *meta16[] = {"lora_adapter_metadata", "{\"r\": 4, \"lora_alpha\": 16}"};
    char *p = diffusers("d.safetensors", 8, meta16, 1);
    lk_adapter *a;
    assert_int_equal(lk_adapter_open(p, LK_FORMAT_AUTO, &a), LK_ERR_CONFIG);
    tu_assert_contains(lk_last_error(), "d.safetensors: blocks.0.attn.to_q: the .alpha tensor says alpha = 8 but "
                                        "metadata lora_adapter_metadata says 16; choose one with --alpha-from "
                                        "tensors|metadata");
    expect_alpha(p, LK_ALPHA_TENSORS, 8, ".alpha tensor");                    /* scale 2 */
    expect_alpha(p, LK_ALPHA_METADATA, 16, "metadata lora_adapter_metadata"); /* scale 4 */
    /* the same values agree: no error, the tensor named */
    const char *meta8[] = {"lora_adapter_metadata", "{\"r\": 4, \"lora_alpha\": 8}"};
    char *q = diffusers("d_same.safetensors", 8, meta8, 1);
    expect_alpha(q, LK_ALPHA_AUTO, 8, ".alpha tensor");
    /* an alpha_pattern in the metadata is named as the source */
    const char *pat[] = {"lora_adapter_metadata", "{\"r\": 4, \"lora_alpha\": 8, \"alpha_pattern\": {\"to_q\": 2}}"};
    char *pp = diffusers("d_pat.safetensors", 8, pat, 1);
    assert_int_equal(lk_adapter_open(pp, LK_FORMAT_AUTO, &a), LK_ERR_CONFIG);
    tu_assert_contains(lk_last_error(), "the .alpha tensor says alpha = 8 but metadata alpha_pattern \"to_q\" says 2");
    /* the CLI: fuse refuses, --alpha-from chooses; the output records the choice */
    char *out = tu_path(ar_dir, "fused.safetensors");
    unlink(out);
    tu_cli_expect(1, NULL, "the .alpha tensor says alpha = 8 but metadata lora_adapter_metadata says 16", NULL,
        "fuse '%s' -l '%s' -o '%s'", g_base, p, out);
    assert_false(tu_exists(out));
    tu_cli_expect(2, NULL, "unknown alpha source 'both' (valid: tensors, metadata, auto)", NULL,
        "fuse '%s' -l '%s' -o '%s' --alpha-from both", g_base, p, out);
    tu_cli_expect(0, NULL, NULL, NULL, "fuse '%s' -l '%s' -o '%s' --alpha-from metadata", g_base, p, out);
    tu_cli_expect(0, "\"alpha_from\":\"metadata\"", NULL, NULL, "inspect '%s'", out);
    /* fused at scale 4 = the file with .alpha 16 read from its tensors */
    char *out_t = tu_path(ar_dir, "fused_t.safetensors");
    lk_fuse_input in = {p, 4.0, LK_FORMAT_AUTO};
    lk_fuse_file_opts fo = {.alpha_from = LK_ALPHA_TENSORS}; /* 4 x (8 / 4) = 1 x (16 / 4) */
    assert_int_equal(lk_fuse_file(g_base, &in, 1, out_t, &fo, NULL), LK_OK);
    char d1[LK_DIGEST_HEX], d2[LK_DIGEST_HEX];
    assert_int_equal(tu_file_digest(out, d1), LK_OK);
    unlink(out);
    in.strength = 2.0; /* 2 x (8 / 4) = 4 */
    assert_int_equal(lk_fuse_file(g_base, &in, 1, out, &fo, NULL), LK_OK);
    assert_int_equal(tu_file_digest(out, d2), LK_OK);
    assert_string_equal(d1, d2);
    tu_cli_expect(1, NULL, "says 16", NULL, "inspect '%s'", p);
    tu_cli_expect(0, "metadata lora_adapter_metadata", NULL, NULL, "inspect '%s' --alpha-from metadata --json", p);
    /* and with --base (QA: --alpha-from was refused there): refused under auto, chosen by --alpha-from */
    tu_cli_expect(1, NULL, "says 16", NULL, "inspect '%s' --base '%s'", p, g_base);
    tu_cli_expect(0, "\"alpha\":16", NULL, NULL, "inspect '%s' --base '%s' --alpha-from metadata --json", p, g_base);
    tu_cli_expect(0, "\"alpha\":8", NULL, NULL, "inspect '%s' --base '%s' --alpha-from tensors --json", p, g_base);
    /* the tracker: refused under auto, chosen at creation */
    lk_comm *c;
    lk_weights *w;
    lk_tracker *tr;
    assert_int_equal(lk_comm_self(&c), LK_OK);
    assert_int_equal(lk_weights_load(g_base, &w), LK_OK);
    lk_tracker_opts o = LK_TRACKER_OPTS_DEFAULT;
    assert_int_equal(lk_tracker_create(c, w, &o, &tr), LK_OK);
    lk_fuse_input one = {p, 1.0, LK_FORMAT_AUTO};
    assert_int_equal(lk_tracker_apply(tr, &one, 1, NULL), LK_ERR_CONFIG);
    tu_assert_contains(lk_last_error(), "says 16");
    lk_tracker_free(tr);
    o.alpha_from = LK_ALPHA_METADATA;
    assert_int_equal(lk_tracker_create(c, w, &o, &tr), LK_OK);
    assert_int_equal(lk_tracker_apply(tr, &one, 1, NULL), LK_OK);
    char dw[LK_DIGEST_HEX];
    assert_int_equal(lk_weights_digest(w, dw), LK_OK);
    assert_string_equal(dw, d1); /* the offline fuse with --alpha-from metadata */
    lk_tracker_free(tr);
    lk_weights_free(w);
    lk_comm_free(c);
    /* the plan key, and swap --alpha-from overriding it */
    char *plan = tu_path(ar_dir, "plan.yaml");
    char text[1024];
    snprintf(text, sizeof text, "alpha_from: tensors\nsteps:\n  - loras: [{path: '%s'}]\n", p);
    assert_int_equal(tu_write_file(plan, text, strlen(text)), 0);
    lk_plan *pl;
    assert_int_equal(lk_plan_load(plan, &pl), LK_OK);
    assert_int_equal(pl->alpha_from, LK_ALPHA_TENSORS);
    lk_plan_free(pl);
    tu_cli_expect(0, "digest", NULL, NULL, "swap '%s' --plan '%s' --json", g_base, plan);
    char want[96];
    snprintf(want, sizeof want, "\"digest\":\"%s\"", d1);
    tu_cli_expect(0, want, NULL, NULL, "swap '%s' --plan '%s' --json --alpha-from metadata", g_base, plan);
    snprintf(text, sizeof text, "steps:\n  - loras: [{path: '%s'}]\n", p);
    assert_int_equal(tu_write_file(plan, text, strlen(text)), 0);
    tu_cli_expect(1, NULL, "says 16", NULL, "swap '%s' --plan '%s'", g_base, plan);
    const char *bad = "alpha_from: both\nsteps: []\n";
    assert_int_equal(lk_plan_parse(bad, strlen(bad), "plan.yaml", NULL, &pl), LK_ERR_CONFIG);
    tu_assert_contains(lk_last_error(), "plan.yaml:1: alpha_from: expected tensors or metadata");
    free(plan);
    free(out);
    free(out_t);
    free(p);
    free(q);
    free(pp);
}

static int setup(void **state) {
    int r = ar_setup_dir(state);
    if (!r) write_base();
    return r;
}

static int teardown(void **state) {
    free(g_base);
    return ar_teardown_dir(state);
}

int main(void) {
    lk_log_set_level(LK_LOG_ERROR); /* the warnings are checked through the CLI's stderr */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kohya_no_alpha),
        cmocka_unit_test(test_tensor_vs_metadata),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
