/* test_peft_parity.c — adapters written by the real `peft` package fuse
 * exactly as PEFT merges them.
 *
 * Oracle: tests/fixtures/peft/, made by make_peft_fixtures.py with peft
 * 0.21.2 (and 0.13.2 for old013) on a small BERT: each case's adapter as
 * save_pretrained wrote it, and the float64 tensors PEFT's own
 * merge_and_unload produced from the base of each dtype (base + s (merged -
 * base) for a strength s != 1, lorakit's documented convention). The
 * cases: Python-regex rank/alpha patterns, a regex target_modules,
 * layers_to_transform, the config beside a file (rsLoRA), modules_to_save,
 * bias = "all" / "lora_only", lora_bias, DoRA, PEFT 0.13's pattern rule, an
 * embedding LoRA, and GPT-2's Conv1D layers (fan_in_fan_out, one square).
 *
 * Each is fused with lk_fuse_file into BF16, F16 and F32 bases. Every tensor
 * the merge changed must be within 1 ulp of the float64 expectation (the
 * kernel's canonical arithmetic: fp64 accumulation for F32 weights, one
 * rounding); every other tensor must be byte-identical to the base. */
#include "adapter_ref.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lorakit/adapter.h"
#include "lorakit/dtype.h"
#include "lorakit/fuse.h"
#include "lorakit/safetensors.h"

#define FX LK_TEST_SRC_DIR "/tests/fixtures/peft"

#define g_dir ar_dir /* the group's temporary folder (ar_setup_dir) */

static const struct {
    const char *name;
    int file;            /* fuse through <case>/adapter_model.safetensors */
    float strengths[2];  /* 0 ends the list */
    const char *base;    /* base_<dtype> (BERT) or base_gpt2_<dtype> */
} g_cases[] = {
    {"patterns", 0, {1.0f}, "base"},          {"target_regex", 0, {1.0f}, "base"},
    {"layers", 0, {1.0f}, "base"},            {"sidecar", 1, {1.0f}, "base"},
    {"modules_to_save", 0, {1.0f, 0.5f}, "base"}, {"bias_all", 0, {1.0f}, "base"},
    {"bias_lora_only", 0, {1.0f}, "base"},    {"lora_bias", 0, {1.0f, 0.5f}, "base"},
    {"dora", 0, {1.0f, 0.5f}, "base"},        {"old013", 0, {1.0f}, "base"},
    {"embedding", 0, {1.0f, 0.5f}, "base"},   {"gpt2_conv1d", 0, {1.0f}, "base_gpt2"},
};
static const char *const g_dtypes[3] = {"bf16", "f16", "f32"};

static void check_case(size_t ci, int di, float s) {
    const char *name = g_cases[ci].name;
    char base[512], adapter[512], out[512], exp[512];
    snprintf(base, sizeof base, FX "/%s_%s.safetensors", g_cases[ci].base, g_dtypes[di]);
    snprintf(adapter, sizeof adapter, FX "/%s%s", name, g_cases[ci].file ? "/adapter_model.safetensors" : "");
    snprintf(out, sizeof out, "%s/%s_%s.safetensors", g_dir, name, g_dtypes[di]);
    snprintf(exp, sizeof exp, FX "/expected/%s_%s_s%g.safetensors", name, g_dtypes[di], (double)s);
    lk_fuse_input in = {adapter, s, LK_FORMAT_AUTO};
    lk_fuse_stats st;
    if (lk_fuse_file(base, &in, 1, out, NULL, &st)) fail_msg("%s: %s", name, lk_last_error());
    char label[256];
    snprintf(label, sizeof label, "%s %s s=%g", name, g_dtypes[di], (double)s);
    size_t changed;
    double worst = ar_check_expected(label, "PEFT's merge", base, out, exp, &changed);
    assert_int_equal(st.tensors_fused, changed);
    print_message("%-16s %s s=%-4g %2zu tensors fused, worst %.3f ulp\n", name, g_dtypes[di], (double)s, changed,
                  worst);
}

static void test_parity(void **state) {
    (void)state;
    for (size_t ci = 0; ci < sizeof g_cases / sizeof g_cases[0]; ci++)
        for (int di = 0; di < 3; di++)
            for (int k = 0; k < 2 && g_cases[ci].strengths[k] != 0.0f; k++) check_case(ci, di, g_cases[ci].strengths[k]);
}

/* What lorakit reads from each config: ranks, alphas and where each alpha
 * came from. Hand-derived from the generator's LoraConfig arguments and
 * PEFT's rules (first matching key; (.*\.)?(key)$ since 0.15; 0.13: one key
 * list for both patterns). */
static void test_alpha_sources(void **state) {
    (void)state;
    static const struct {
        const char *adapter, *module;
        int rank;
        double alpha, scale;
        const char *source;
    } cases[] = {
        {"patterns", "encoder.layer.1.attention.self.value", 4, 3, 0.75,
         "alpha_pattern \"layer\\.\\d\\.attention\\.self\\.value\""},
        {"patterns", "encoder.layer.2.attention.output.dense", 2, 8, 4, "config"},
        {"patterns", "encoder.layer.0.attention.self.query", 4, 8, 2, "config"},
        {"sidecar/adapter_model.safetensors", "encoder.layer.0.attention.self.key", 4, 8, 4, "config"},
        {"old013", "encoder.layer.0.attention.self.query", 2, 8, 4, "config"},
        {"old013", "encoder.layer.1.attention.self.query", 4, 16, 4, "alpha_pattern \"query\""},
        {"dora", "encoder.layer.2.intermediate.dense", 4, 8, 2, "config"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char p[512];
        snprintf(p, sizeof p, FX "/%s", cases[i].adapter);
        lk_adapter *a;
        if (lk_adapter_open(p, LK_FORMAT_AUTO, &a)) fail_msg("%s: %s", p, lk_last_error());
        assert_int_equal(lk_adapter_has_config(a), 1);
        assert_int_equal(lk_adapter_untargeted(a), 0); /* PEFT's targeting rule agrees with what PEFT wrote */
        const lk_lora_module *m = NULL;
        for (size_t k = 0; k < lk_adapter_count(a); k++)
            if (!strcmp(lk_adapter_module(a, k)->module, cases[i].module)) m = lk_adapter_module(a, k);
        if (!m) fail_msg("%s: no module %s", p, cases[i].module);
        assert_int_equal(m->rank, cases[i].rank);
        assert_true(m->alpha == (float)cases[i].alpha);
        assert_true(m->scale == cases[i].scale);
        assert_string_equal(m->alpha_source, cases[i].source);
        lk_adapter_free(a);
    }
}

/* Requests lorakit refuses for these adapters, each by name. */
static void test_refusals(void **state) {
    (void)state;
    char out[512];
    snprintf(out, sizeof out, "%s/refused.safetensors", g_dir);
    lk_fuse_input two_dora[2] = {{FX "/dora", 1.0f, LK_FORMAT_AUTO}, {FX "/patterns", 1.0f, LK_FORMAT_AUTO}};
    assert_int_equal(lk_fuse_file(FX "/base_f32.safetensors", two_dora, 2, out, NULL, NULL), LK_ERR_ARG);
    tu_assert_contains(lk_last_error(), "a DoRA adapter must be the only adapter in its request");
    assert_false(tu_exists(out));
    /* two adapters replacing pooler.dense: both named */
    lk_fuse_input two_rep[2] = {{FX "/modules_to_save", 1.0f, LK_FORMAT_AUTO},
                                {FX "/modules_to_save/adapter_model.safetensors", 0.5f, LK_FORMAT_AUTO}};
    assert_int_equal(lk_fuse_file(FX "/base_f32.safetensors", two_rep, 2, out, NULL, NULL), LK_ERR_ARG);
    tu_assert_contains(lk_last_error(), "modules_to_save and " FX "/modules_to_save/adapter_model.safetensors both replace pooler.dense.");
    assert_false(tu_exists(out));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parity),
        cmocka_unit_test(test_alpha_sources),
        cmocka_unit_test(test_refusals),
    };
    return cmocka_run_group_tests(tests, ar_setup_dir, ar_teardown_dir);
}
