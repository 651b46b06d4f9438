/* test_oft.c — OFT, BOFT and GLoRA files written by the real lycoris-lora
 * 4.1.3 modules fuse as each convention's tool applies them, within 1 ulp.
 *
 * Oracle: tests/fixtures/oft/, made by make_oft_fixtures.py: per case x
 * base (BF16, F16, F32; FP8 for OFT) x strength (1, 0.7, -0.3) x
 * convention, the float64 fused weight from the tool's formula (LyCORIS's,
 * cross-checked there against LyCORIS's own module code; ComfyUI's, stated
 * from its comfy/weight_adapter code: ComfyUI is not on PyPI). The
 * "lycoris" expectations are also those of the lorakit and peft conventions
 * (README: the three agree on LyCORIS's OFT / BOFT / GLoRA files, but
 * GLoRA's alpha 0, which peft reads as ComfyUI does: scale 0).
 *
 * Checks: every changed tensor within 1 ulp of its dtype (FP8: 1 FP8 ulp at
 * the output's scale) and every other tensor byte-identical
 * (ar_check_expected); lk_fuse_tensors in place at 1 thread gives the same
 * digest as the file fuse at all threads; the conventions really differ
 * where the tools do (oft at s = 1: the constraint); malformed OFT / BOFT /
 * GLoRA shapes are refused naming the key and both shapes, writing nothing;
 * OFT beside another adapter on the same weight is refused. At the end a
 * table: algorithm x convention, the worst error in ulps. */
#include "adapter_ref.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lorakit/dtype.h"
#include "lorakit/fuse.h"
#include "lorakit/safetensors.h"
#include "lorakit/weights.h"

#define FX LK_TEST_SRC_DIR "/tests/fixtures/oft"

#include "fixtures/oft/cases.h"

#define NCASES (sizeof oft_cases / sizeof oft_cases[0])

static const char *const g_algos[] = {"oft", "oft_free", "boft", "glora", "glora_a0"};
#define NALGO (sizeof g_algos / sizeof g_algos[0])
static double g_worst[NALGO][LK_CONVENTION_COUNT];

static size_t algo_index(const char *name) {
    for (size_t i = 0; i < NALGO; i++)
        if (!strcmp(g_algos[i], name)) return i;
    fail_msg("case %s is not in g_algos", name);
    return 0;
}

/* The conventions a case's expectation stands for: lycoris's for lorakit
 * and peft too, but GLoRA's alpha 0, which peft takes as it is (alpha / r,
 * scale 0, the project's rule for every alpha-scaled LyCORIS module), as
 * comfyui does. */
static size_t conventions_of(const oft_case *c, lk_convention *out) {
    const int a0 = !strcmp(c->name, "glora_a0");
    if (!strcmp(c->convention, "comfyui")) {
        out[0] = LK_CONVENTION_COMFYUI;
        if (a0) out[1] = LK_CONVENTION_PEFT;
        return a0 ? 2 : 1;
    }
    out[0] = LK_CONVENTION_LORAKIT;
    out[1] = LK_CONVENTION_LYCORIS;
    out[2] = LK_CONVENTION_PEFT;
    return a0 ? 2 : 3;
}

static void run_one(const oft_case *c, lk_convention conv) {
    char base[512], adapter[512], out[512], exp[512], label[256];
    snprintf(base, sizeof base, FX "/%s", c->base);
    snprintf(adapter, sizeof adapter, FX "/%s.safetensors", c->name);
    snprintf(out, sizeof out, "%s/out.safetensors", ar_dir);
    snprintf(exp, sizeof exp, FX "/%s", c->expected);
    snprintf(label, sizeof label, "%s on %s s=%g --convention %s", c->name, c->base, c->strength,
             lk_convention_name(conv));
    lk_fuse_input in = {adapter, c->strength, LK_FORMAT_AUTO};
    lk_fuse_file_opts fo = {.fuse = {.convention = conv}};
    lk_fuse_stats st;
    if (lk_fuse_file(base, &in, 1, out, &fo, &st)) fail_msg("%s: %s", label, lk_last_error());
    size_t changed;
    char who[64];
    snprintf(who, sizeof who, "%s's formula", c->convention);
    double worst = ar_check_expected(label, who, base, out, exp, &changed);
    size_t ai = algo_index(c->name);
    if (worst > g_worst[ai][conv]) g_worst[ai][conv] = worst;
    /* in place, one thread: the same bytes */
    lk_fuse_file_opts one = {.fuse = {.threads = 1, .convention = conv}};
    ar_check_in_place(label, base, out, &in, 1, &one, NULL);
    remove(out);
}

static void test_case(void **state) {
    const oft_case *c = *state;
    lk_convention cv[3];
    size_t n = conventions_of(c, cv);
    for (size_t i = 0; i < n; i++) run_one(c, cv[i]);
}

/* The OFT file at s = 1 gives different weights under comfyui and lycoris
 * (the constraint alpha vs alpha x out_dim), so the conventions are not a
 * no-op: the two expectations differ by far more than 1 ulp. */
static void test_conventions_differ(void **state) {
    (void)state;
    lk_st *a, *b;
    assert_int_equal(lk_st_open(FX "/expected/oft_lycoris_f32_s1.safetensors", &a), LK_OK);
    assert_int_equal(lk_st_open(FX "/expected/oft_comfyui_f32_s1.safetensors", &b), LK_OK);
    const lk_tensor *ta = lk_st_tensor(a, 0), *tb = lk_st_tensor(b, 0);
    double d = 0;
    for (size_t i = 0; i < lk_tensor_numel(ta); i++) d = fmax(d, fabs(ar_get(ta, i) - ar_get(tb, i)));
    assert_true(d > 1e-3);
    lk_st_close(a);
    lk_st_close(b);
}

/* A malformed adapter: fuse fails, no output, the message names the key
 * (or module) and each of the given shapes. */
static void refused(const char *label, af_file *f, const char *const *want, size_t nwant) {
    char ad[512], out[512];
    snprintf(ad, sizeof ad, "%s/bad.safetensors", ar_dir);
    snprintf(out, sizeof out, "%s/bad_out.safetensors", ar_dir);
    af_save(f, ad, NULL, 0);
    lk_fuse_input in = {ad, 1.0, LK_FORMAT_AUTO};
    if (lk_fuse_file(FX "/base_f32.safetensors", &in, 1, out, NULL, NULL) == LK_OK) fail_msg("%s: fused", label);
    const char *msg = lk_last_error();
    assert_false(tu_exists(out));
    for (size_t i = 0; i < nwant; i++)
        if (!strstr(msg, want[i])) fail_msg("%s: the error does not contain \"%s\": %s", label, want[i], msg);
    print_message("%-22s refused: %s\n", label, msg);
    remove(ad);
}

static void test_malformed(void **state) {
    (void)state;
    tu_rng rng = {42};
    af_file *f = af_new();
    /* 3 blocks of 4 rotate 12 rows; the weight has 16 */
    lk_tensor *x = af_rand(f, "lycoris_oft_lin.oft_blocks", LK_DTYPE_F32, 12, 4, &rng, -1, 1);
    x->ndim = 3, x->shape[0] = 3, x->shape[1] = 4, x->shape[2] = 4;
    refused("oft rows", f, (const char *const[]){"lycoris_oft_lin.oft_blocks", "[3, 4, 4]", "[16, 12]"}, 3);
    af_free(f);
    f = af_new(); /* non-square blocks */
    x = af_rand(f, "lycoris_oft_lin.oft_blocks", LK_DTYPE_F32, 16, 3, &rng, -1, 1);
    x->ndim = 3, x->shape[0] = 4, x->shape[1] = 4, x->shape[2] = 3;
    refused("oft square", f, (const char *const[]){"lycoris_oft_lin.oft_blocks", "[4, 4, 3]"}, 2);
    af_free(f);
    f = af_new(); /* a rescale of the wrong length */
    x = af_rand(f, "lycoris_oft_lin.oft_blocks", LK_DTYPE_F32, 16, 4, &rng, -1, 1);
    x->ndim = 3, x->shape[0] = 4, x->shape[1] = 4, x->shape[2] = 4;
    af_rand(f, "lycoris_oft_lin.rescale", LK_DTYPE_F32, 8, 1, &rng, 0.5f, 1.5f);
    refused("oft rescale", f, (const char *const[]){"lycoris_oft_lin.rescale", "[8, 1]", "[4, 4, 4]"}, 3);
    af_free(f);
    f = af_new(); /* BOFT: 5 stages of 8 blocks of 2; stage 4 pairs groups of 16 blocks */
    x = af_rand(f, "lycoris_boft_lin.oft_blocks", LK_DTYPE_F32, 5 * 8 * 2 * 2, 1, &rng, -1, 1);
    x->ndim = 4, x->shape[0] = 5, x->shape[1] = 8, x->shape[2] = 2, x->shape[3] = 2;
    refused("boft stages", f, (const char *const[]){"lycoris_boft_lin.oft_blocks", "[5, 8, 2, 2]", "stage 4"}, 3);
    af_free(f);
    f = af_new(); /* BOFT with an odd block size */
    x = af_rand(f, "lycoris_boft_lin.oft_blocks", LK_DTYPE_F32, 16 * 1 * 1, 1, &rng, -1, 1);
    x->ndim = 4, x->shape[0] = 1, x->shape[1] = 16, x->shape[2] = 1, x->shape[3] = 1;
    refused("boft odd block", f, (const char *const[]){"lycoris_boft_lin.oft_blocks", "[1, 16, 1, 1]", "even"}, 3);
    af_free(f);
    f = af_new(); /* GLoRA: b2 of the wrong width */
    af_rand(f, "lycoris_glora_lin.a1.weight", LK_DTYPE_F32, 12, 3, &rng, -1, 1);
    af_rand(f, "lycoris_glora_lin.a2.weight", LK_DTYPE_F32, 3, 12, &rng, -1, 1);
    af_rand(f, "lycoris_glora_lin.b1.weight", LK_DTYPE_F32, 16, 3, &rng, -1, 1);
    af_rand(f, "lycoris_glora_lin.b2.weight", LK_DTYPE_F32, 3, 10, &rng, -1, 1);
    refused("glora b2", f, (const char *const[]){"lycoris_glora_lin.b2.weight", "[3, 10]", "[16, 12]"}, 3);
    af_free(f);
    f = af_new(); /* GLoRA: a1 not [in, r] */
    af_rand(f, "lycoris_glora_lin.a1.weight", LK_DTYPE_F32, 3, 12, &rng, -1, 1);
    af_rand(f, "lycoris_glora_lin.a2.weight", LK_DTYPE_F32, 3, 12, &rng, -1, 1);
    af_rand(f, "lycoris_glora_lin.b1.weight", LK_DTYPE_F32, 16, 3, &rng, -1, 1);
    af_rand(f, "lycoris_glora_lin.b2.weight", LK_DTYPE_F32, 3, 12, &rng, -1, 1);
    refused("glora a1", f, (const char *const[]){"lycoris_glora_lin.a1.weight", "lycoris_glora_lin.a2.weight"}, 2);
    af_free(f);
    f = af_new(); /* GLoRA without b1 */
    af_rand(f, "lycoris_glora_lin.a1.weight", LK_DTYPE_F32, 12, 3, &rng, -1, 1);
    af_rand(f, "lycoris_glora_lin.a2.weight", LK_DTYPE_F32, 3, 12, &rng, -1, 1);
    af_rand(f, "lycoris_glora_lin.b2.weight", LK_DTYPE_F32, 3, 12, &rng, -1, 1);
    refused("glora missing", f, (const char *const[]){"glora_lin", "b1.weight"}, 2);
    af_free(f);
}

/* OFT with a LoRA on the same weight: refused (the result would depend on
 * the order), nothing written. */
static void test_oft_with_other(void **state) {
    (void)state;
    tu_rng rng = {7};
    char ad[512], out[512];
    snprintf(ad, sizeof ad, "%s/lora.safetensors", ar_dir);
    snprintf(out, sizeof out, "%s/both.safetensors", ar_dir);
    af_file *f = af_new();
    af_rand(f, "lora_unet_oft_lin.lora_down.weight", LK_DTYPE_F32, 2, 12, &rng, -1, 1);
    af_rand(f, "lora_unet_oft_lin.lora_up.weight", LK_DTYPE_F32, 16, 2, &rng, -1, 1);
    af_save(f, ad, NULL, 0);
    af_free(f);
    lk_fuse_input in[2] = {{FX "/oft.safetensors", 1.0, LK_FORMAT_AUTO}, {ad, 0.5, LK_FORMAT_AUTO}};
    assert_int_not_equal(lk_fuse_file(FX "/base_f32.safetensors", in, 2, out, NULL, NULL), LK_OK);
    assert_non_null(strstr(lk_last_error(), "oft_lin.weight"));
    assert_non_null(strstr(lk_last_error(), "OFT"));
    assert_false(tu_exists(out));
    remove(ad);
}

static int print_table(void **state) {
    (void)state;
    print_message("worst error (ulp) against each convention's float64 reference\n%-10s", "algorithm");
    for (int c = 0; c < LK_CONVENTION_COUNT; c++) print_message(" %8s", lk_convention_name((lk_convention)c));
    print_message("\n");
    for (size_t a = 0; a < NALGO; a++) {
        print_message("%-10s", g_algos[a]);
        for (int c = 0; c < LK_CONVENTION_COUNT; c++) print_message(" %8.3f", g_worst[a][c]);
        print_message("\n");
    }
    return ar_teardown_dir(state);
}

int main(void) {
    static struct CMUnitTest tests[NCASES + 3];
    static char names[NCASES][200];
    size_t n = 0;
    tests[n++] = (struct CMUnitTest)cmocka_unit_test(test_conventions_differ);
    tests[n++] = (struct CMUnitTest)cmocka_unit_test(test_malformed);
    tests[n++] = (struct CMUnitTest)cmocka_unit_test(test_oft_with_other);
    for (size_t i = 0; i < NCASES; i++) {
        const oft_case *c = &oft_cases[i];
        snprintf(names[i], sizeof names[i], "%s %s %s s=%g", c->name, c->convention, c->base, c->strength);
        tests[n++] = (struct CMUnitTest){names[i], test_case, NULL, NULL, (void *)c};
    }
    return _cmocka_run_group_tests("test_oft", tests, n, ar_setup_dir, print_table);
}
