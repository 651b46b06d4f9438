/* test_messages.c — errors name the real field and value and keep their
 * reason whatever the names' length (issue 20, item 16). Expectations
 * written here: a %s argument over LK_MSG_ARG_MAX (1 KiB) keeps its head
 * and tail and the message its end; a module name over 4 KiB matches its
 * weight (it was reported as matching nothing: "<m>.weight" was built in a
 * 4 KiB buffer); a layers_pattern over the matching budget is named as
 * `layers_pattern: pattern "<it>"` (was `pattern ""`); a rank of 2^31 is
 * printed as 2147483648 (was 2.14748e+09) with the real limit. */
#include "adapter_ref.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "adapter/config.h"
#include "io/yaml_doc.h"

static tu_rng g_rng = {16};

/* A name of n bytes: "blocks." then 'x's. */
static char *long_name(size_t n) {
    char *s = malloc(n + 1);
    memcpy(s, "blocks.", 7);
    memset(s + 7, 'x', n - 7);
    s[n] = '\0';
    return s;
}

static void test_error_keeps_its_end(void **state) {
    (void)state;
    char *name = long_name(20000);
    lk_error(LK_ERR_UNMATCHED, "a.safetensors: %s matches no model weight (looked for %s.weight)", name, name);
    const char *m = lk_last_error();
    assert_true(strlen(m) < 8192);
    tu_assert_contains(m, "a.safetensors: blocks.xxxx");
    tu_assert_contains(m, "bytes elided)...xxxx");
    tu_assert_contains(m, "xxxx matches no model weight (looked for blocks.xxx");
    size_t ml = strlen(m);
    assert_string_equal(m + ml - 13, "xxxxx.weight)");
    /* a prefix added while it propagates keeps the end too */
    lk_error_prefix(LK_ERR_UNMATCHED, "%s", name);
    m = lk_last_error();
    assert_true(strlen(m) < 8192);
    assert_string_equal(m + strlen(m) - 13, "xxxxx.weight)");
    tu_assert_contains(m, "matches no model weight");
    /* precision, '*', length modifiers and %% go through as printf has them */
    lk_error(LK_ERR_ARG, "%.3s|%*d|%-4s|%zu|%lld|%5.2f|%%|%c|%.*s|%x", "abcdef", 4, 7, "ab", (size_t)12,
             (long long)-5, 3.14159, 'z', 2, "xyz", 255u);
    assert_string_equal(lk_last_error(), "abc|   7|ab  |12|-5| 3.14|%|z|xy|ff");
    /* A negative '*' precision is taken as if there were none and a
     * negative '*' width as the '-' flag (C11 7.21.6.1p5); the spec reader
     * once copied "-1" after the '.', which printf cannot parse, and the
     * whole spec came out as text. Expectation: the C library's snprintf. */
    char want[64];
    snprintf(want, sizeof want, "%.*s|%*d|%-*.*f|", -1, "abcdef", -4, 7, 6, -5, 0.25);
    assert_string_equal(want, "abcdef|7   |0.250000|");
    lk_error(LK_ERR_ARG, "%.*s|%*d|%-*.*f|", -1, "abcdef", -4, 7, 6, -5, 0.25);
    assert_string_equal(lk_last_error(), want);
    free(name);
}

/* Saves the F32 tensors names[i] (rows[i] x cols[i], random) to path
 * (adapter_ref's af_file keeps names of at most 255 bytes). */
static void save_f32(const char *path, const char *const *names, const int64_t *rows, const int64_t *cols, size_t n) {
    lk_tensor t[4];
    for (size_t i = 0; i < n; i++) {
        size_t k = (size_t)(rows[i] * cols[i]);
        float *d = malloc(k * sizeof *d);
        for (size_t j = 0; j < k; j++) d[j] = tu_uniform(&g_rng, -1, 1);
        t[i] = (lk_tensor){.name = names[i], .dtype = LK_DTYPE_F32, .ndim = 2, .shape = {rows[i], cols[i]},
                           .data = d, .nbytes = k * sizeof *d};
    }
    if (lk_st_save(path, t, n, NULL, 0)) fail_msg("save %s: %.200s", path, lk_last_error());
    for (size_t i = 0; i < n; i++) free(t[i].data);
}

/* A module name over 4 KiB still finds its weight; an unmatched one keeps its reason. */
static void test_long_module_name(void **state) {
    (void)state;
    char *name = long_name(5000);
    size_t nl = strlen(name) + 32;
    char *w = malloc(nl), *ka = malloc(nl), *kb = malloc(nl);
    snprintf(w, nl, "%s.weight", name);
    snprintf(ka, nl, "%s.lora_A.weight", name);
    snprintf(kb, nl, "%s.lora_B.weight", name);
    char *base = tu_path(ar_dir, "long_base.safetensors"), *ad = tu_path(ar_dir, "long_ad.safetensors"),
         *out = tu_path(ar_dir, "long_out.safetensors");
    const char *bn[1] = {w}, *an[2] = {ka, kb};
    const int64_t br[1] = {4}, bc[1] = {6}, ar[2] = {2, 4}, ac[2] = {6, 2};
    save_f32(base, bn, br, bc, 1);
    save_f32(ad, an, ar, ac, 2);
    lk_fuse_input in = {ad, 1.0, LK_FORMAT_AUTO};
    lk_fuse_stats st;
    if (lk_fuse_file(base, &in, 1, out, NULL, &st)) fail_msg("%.300s", lk_last_error());
    assert_int_equal(st.tensors_fused, 1);
    /* the same adapter on a model without that weight: the reason survives */
    char *base2 = tu_path(ar_dir, "other_base.safetensors"), *out2 = tu_path(ar_dir, "other_out.safetensors");
    const char *on[1] = {"blocks.0.q.weight"};
    save_f32(base2, on, br, bc, 1);
    assert_int_equal(lk_fuse_file(base2, &in, 1, out2, NULL, NULL), LK_ERR_UNMATCHED);
    const char *e = lk_last_error();
    tu_assert_contains(e, "long_ad.safetensors: blocks.xxx");
    tu_assert_contains(e, "xxx matches no model weight (looked for blocks.xxx");
    tu_assert_contains(e, "xxx.weight) (and nothing else of it matches: is it for this model?)");
    free(w);
    free(ka);
    free(kb);
    free(base);
    free(ad);
    free(out);
    free(base2);
    free(out2);
    free(name);
}

static void expect_config_error(const char *cfg, const char *want) {
    lk_peft_config c;
    lk_status s = lk_peft_config_parse(cfg, strlen(cfg), "adapter_config.json", &c);
    if (s == LK_OK) {
        lk_peft_config_free(&c);
        fail_msg("%s: accepted", cfg);
    }
    assert_int_equal(s, LK_ERR_CONFIG);
    tu_assert_contains(lk_last_error(), want);
}

/* Ranks print as integers, with the limit that refused them. */
static void test_rank_messages(void **state) {
    (void)state;
    expect_config_error("{\"r\": 2147483648}",
                        "adapter_config.json: r = 2147483648: the rank must be a whole number from 1 to 1000000000");
    expect_config_error("{\"r\": 4, \"rank_pattern\": {\"to_q\": 4294967296}}",
                        "adapter_config.json: rank_pattern[\"to_q\"] = 4294967296: a rank must be a whole number "
                        "from 1 to 1000000000");
    expect_config_error("{\"r\": 2.5}", "adapter_config.json: r = 2.5: the rank must be a whole number");
}

/* layers_pattern over lorakit's matching limits: named as written. */
static void test_layers_pattern_named(void **state) {
    (void)state;
    char a[64] = "";
    memset(a, 'a', 40);
    af_file *f = af_new();
    char k[128];
    snprintf(k, sizeof k, "base_model.model.%s.q.lora_A.weight", a);
    af_rand(f, k, LK_DTYPE_F32, 2, 6, &g_rng, -1, 1);
    snprintf(k, sizeof k, "base_model.model.%s.q.lora_B.weight", a);
    af_rand(f, k, LK_DTYPE_F32, 4, 2, &g_rng, -1, 1);
    char *dir = tu_path(ar_dir, "layers_peft");
    mkdir(dir, 0755);
    char *p = tu_path(dir, "adapter_model.safetensors");
    af_save(f, p, NULL, 0);
    af_write_text(dir, "adapter_config.json",
                  "{\"r\": 2, \"target_modules\": [\"q\"], \"layers_to_transform\": [0], \"layers_pattern\": \"(a|aa)+\"}");
    lk_adapter *ad;
    lk_status s = lk_adapter_open(dir, LK_FORMAT_AUTO, &ad);
    if (s == LK_OK) {
        lk_adapter_free(ad);
        fail_msg("the catastrophic layers_pattern was matched within the limits");
    }
    assert_int_equal(s, LK_ERR_CONFIG);
    tu_assert_contains(lk_last_error(), "adapter_config.json: layers_pattern: pattern \"(a|aa)+\"");
    tu_assert_contains(lk_last_error(), "against module aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa.q");
    assert_null(strstr(lk_last_error(), "pattern \"\""));
    af_free(f);
    free(p);
    free(dir);
}

/* YAML files (plans, train configs) keep names whole in their messages
 * (issue 20 item 16, QA: lk_yerr built them in 512/768-byte buffers and the
 * path cut keys at 40 characters): a 1,000-byte key is in the message
 * whole, the reason after it; a reason longer than 768 bytes keeps its end; a
 * value excerpt that is cut says its whole length. */
static void test_yaml_names_whole(void **state) {
    (void)state;
    char *key = long_name(1000); /* YAML's longest implicit key is 1024 characters */
    size_t tl = 2 * strlen(key) + 200;
    char *text = malloc(tl);
    snprintf(text, tl, "steps:\n  - loras: [{path: a, %s: 1}]\n", key);
    lk_plan *p = NULL;
    assert_int_equal(lk_plan_parse(text, strlen(text), "plan.yaml", NULL, &p), LK_ERR_CONFIG);
    const char *m = lk_last_error();
    snprintf(text, tl, "plan.yaml:2: steps[0].loras[0].%s: unknown key (valid: path, strength, format, alpha)", key);
    assert_string_equal(m, text);
    /* a strength of 2,000 bytes that is not a number: the reason survives */
    char *val = long_name(2000);
    free(text);
    tl = strlen(val) + 200;
    text = malloc(tl);
    snprintf(text, tl, "steps:\n  - loras: [{path: a, strength: \"1%s\"}]\n", val);
    assert_int_equal(lk_plan_parse(text, strlen(text), "plan.yaml", NULL, &p), LK_ERR_CONFIG);
    m = lk_last_error();
    tu_assert_contains(m, "plan.yaml:2: steps[0].loras[0].strength: strength '1blocks.xxx");
    size_t ml = strlen(m);
    assert_true(ml > 20 && !strcmp(m + ml - 17, "' is not a number"));
    /* a value excerpt names its length */
    snprintf(text, tl, "steps:\n  - loras: [{path: a, strength: true}]\n  - loras: [{path: %s, strength: [1]}]\n", val);
    assert_int_equal(lk_plan_parse(text, strlen(text), "plan.yaml", NULL, &p), LK_ERR_CONFIG);
    tu_assert_contains(lk_last_error(), "expected a finite number, got 'true'");
    lk_ydoc *d = NULL;
    snprintf(text, tl, "k: %s\n", val);
    assert_int_equal(lk_ydoc_parse(text, strlen(text), "t.yaml", &d), LK_OK);
    char r[64];
    lk_ynode_repr(lk_ymap_get(lk_ydoc_root(d), "k"), r, sizeof r);
    assert_string_equal(r, "'blocks.xxxxxxxxxxxxxxxxxxxxxxxxx...(2000 bytes)'");
    lk_ydoc_free(d);
    free(text);
    free(val);
    free(key);
}

/* A pattern key and module name in a matching message are whole (they were
 * cut at 200 bytes, "%.200s", without a mark). */
static void test_pattern_named_whole(void **state) {
    (void)state;
    char *key = long_name(600);
    size_t n = strlen(key) + 100;
    char *cfg = malloc(n);
    snprintf(cfg, n, "{\"r\": 4, \"rank_pattern\": {\"%s(\": 4}}", key);
    expect_config_error(cfg, "is not a valid pattern");
    tu_assert_contains(lk_last_error(), key); /* all 600 bytes */
    free(cfg);
    free(key);
}

int main(void) {
    lk_log_set_level(LK_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_error_keeps_its_end),
        cmocka_unit_test(test_long_module_name),
        cmocka_unit_test(test_rank_messages),
        cmocka_unit_test(test_layers_pattern_named),
        cmocka_unit_test(test_yaml_names_whole),
        cmocka_unit_test(test_pattern_named_whole),
    };
    return cmocka_run_group_tests(tests, ar_setup_dir, ar_teardown_dir);
}
