/* test_config.c — the `models.<role>.lora` rules (src/lora/config.c).
 *
 * One test per rule of fastvideo's LoraConfig (shared/reference/
 * fastvideo_train_lora_utils.py.txt): the expectations are the reference's
 * behaviour read off that file (defaults, which inputs raise, the info/warning
 * cases), with the file:line:key of each error counted by hand in the YAML
 * written here. Also: hostile YAML (alias bombs, deep nesting, garbage), and
 * every allocation failure of a parse giving a clean error. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

/* Parses `yaml` for role "student" with label "t.yaml". */
static lk_status parse(const char *yaml, lk_lora_config *c) {
    return lk_lora_config_parse(yaml, strlen(yaml), "t.yaml", "student", c);
}

static void test_enable_defaults_false(void **state) {
    (void)state;
    lk_lora_config c;
    assert_int_equal(parse("models:\n  student:\n    lora:\n      alpha: 4\n", &c), LK_OK);
    assert_int_equal(c.configured, 1);
    assert_int_equal(c.enable, 0);
    assert_int_equal(c.rank, 0);
    assert_int_equal(c.alpha, 4); /* given alpha kept, as the reference stores it */
    lk_lora_config_clear(&c);
}

static void test_enable_without_rank_is_error(void **state) {
    (void)state;
    lk_lora_config c;
    const char *y = "models:\n"
                    "  student:\n"
                    "    lora:\n"
                    "      enable: true\n"
                    "      alpha: 8\n";
    assert_int_equal(parse(y, &c), LK_ERR_CONFIG);
    /* the block starts on line 4 (its first key) */
    tu_assert_contains(lk_last_error(), "t.yaml:4: models.student.lora.rank:");
    tu_assert_contains(lk_last_error(), "rank is unset");
    assert_int_equal(c.configured, 0); /* left zeroed */
    assert_null(c.targets);
    /* explicit null rank is the same as unset */
    assert_int_equal(parse("models:\n  student:\n    lora: {enable: true, rank: null}\n", &c),
                     LK_ERR_CONFIG);
    tu_assert_contains(lk_last_error(), "rank is unset");
}

static void test_rank_not_positive_is_error(void **state) {
    (void)state;
    lk_lora_config c;
    const char *y0 = "models:\n  student:\n    lora:\n      enable: true\n      rank: 0\n";
    assert_int_equal(parse(y0, &c), LK_ERR_CONFIG);
    tu_assert_contains(lk_last_error(), "t.yaml:5: models.student.lora.rank: must be > 0, got 0");
    const char *yn = "models:\n  student:\n    lora:\n      enable: yes\n      rank: -3\n";
    assert_int_equal(parse(yn, &c), LK_ERR_CONFIG);
    tu_assert_contains(lk_last_error(), "must be > 0, got -3");
}

static void test_rank_not_integer_is_error(void **state) {
    (void)state;
    lk_lora_config c;
    const char *bad[] = {"16.5", "abc", "[16]", "{a: 1}", "1e3", "99999999999", "0x10", "true"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char y[256];
        /* even when disabled: the reference's int() raises first */
        snprintf(y, sizeof y, "models:\n  student:\n    lora:\n      enable: %s\n      rank: %s\n",
                 i % 2 ? "false" : "true", bad[i]);
        assert_int_equal(parse(y, &c), LK_ERR_CONFIG);
        tu_assert_contains(lk_last_error(), "t.yaml:5: models.student.lora.rank: must be an integer");
    }
    /* a quoted integer is an integer (Python's int("16")) */
    assert_int_equal(parse("models:\n  student:\n    lora: {enable: true, rank: \"16\"}\n", &c), LK_OK);
    assert_int_equal(c.rank, 16);
    lk_lora_config_clear(&c);
}

static void test_rank_with_enable_false_is_info(void **state) {
    (void)state;
    lk_lora_config c;
    const char *y = "models:\n  student:\n    lora:\n      enable: false\n      rank: 8\n";
    assert_int_equal(parse(y, &c), LK_OK);
    assert_int_equal(c.configured, 1);
    assert_int_equal(c.enable, 0);
    assert_int_equal(c.rank, 8);
    tu_assert_contains(c.info, "t.yaml:5: models.student.lora.rank=8 is set but lora.enable is false");
    tu_assert_contains(c.info, "NOT be applied");
    assert_string_equal(c.warning, "");
    char d[256];
    lk_lora_config_describe(&c, d, sizeof d);
    assert_string_equal(d, "lora disabled (rank 8 set but enable is false: not applied)");
    /* the reference checks rank <= 0 only when enabled */
    lk_lora_config_clear(&c);
    assert_int_equal(parse("models:\n  student:\n    lora: {rank: -1}\n", &c), LK_OK);
    assert_int_equal(c.enable, 0);
    lk_lora_config_clear(&c);
    /* enabling LoRA on a disabled config is refused */
    lk_lora_model *m;
    assert_int_equal(lk_lora_model_create(&m), LK_OK);
    assert_int_equal(lk_lora_enable(m, &c, NULL, 0, NULL), LK_ERR_CONFIG);
    lk_lora_model_free(m);
}

static void test_alpha_defaults_to_rank(void **state) {
    (void)state;
    lk_lora_config c;
    assert_int_equal(parse("models:\n  student:\n    lora: {enable: true, rank: 16}\n", &c), LK_OK);
    assert_int_equal(c.rank, 16);
    assert_int_equal(c.alpha, 16);
    assert_int_equal(c.alpha_given, 0);
    lk_lora_config_clear(&c);
    assert_int_equal(parse("models:\n  student:\n    lora: {enable: true, rank: 16, alpha: 32}\n", &c), LK_OK);
    assert_int_equal(c.alpha, 32);
    assert_int_equal(c.alpha_given, 1);
    lk_lora_config_clear(&c);
    assert_int_equal(parse("models:\n  student:\n    lora: {enable: true, rank: 16, alpha: 1.5}\n", &c),
                     LK_ERR_CONFIG);
    tu_assert_contains(lk_last_error(), "models.student.lora.alpha: must be an integer, got '1.5'");
}

static void test_unknown_keys_warn(void **state) {
    (void)state;
    lk_lora_config c;
    const char *y = "models:\n  student:\n    lora:\n      enable: true\n      rank: 4\n"
                    "      dropout: 0.1\n      rslora: true\n";
    assert_int_equal(parse(y, &c), LK_OK);
    assert_int_equal(c.n_unknown_keys, 2);
    tu_assert_contains(c.warning, "ignoring unrecognized lora keys ['dropout', 'rslora']");
    tu_assert_contains(c.warning, "(valid keys: enable, rank, alpha, target_modules)");
    assert_int_equal(c.rank, 4);
    lk_lora_config_clear(&c);
}

static void test_lora_not_mapping_is_error(void **state) {
    (void)state;
    lk_lora_config c;
    assert_int_equal(parse("models:\n  student:\n    lora: 16\n", &c), LK_ERR_CONFIG);
    tu_assert_contains(lk_last_error(), "t.yaml:3: models.student.lora: must be a mapping, got '16'");
    assert_int_equal(parse("models:\n  student:\n    lora: [to_q]\n", &c), LK_ERR_CONFIG);
    tu_assert_contains(lk_last_error(), "must be a mapping, got a list");
    assert_int_equal(parse("models:\n  student:\n    lora: \"true\"\n", &c), LK_ERR_CONFIG);
}

static void test_no_lora_block_is_not_configured(void **state) {
    (void)state;
    lk_lora_config c;
    assert_int_equal(parse("models:\n  student:\n    path: x\n", &c), LK_OK);
    assert_int_equal(c.configured, 0);
    assert_int_equal(c.enable, 0);
    char d[64];
    lk_lora_config_describe(&c, d, sizeof d);
    assert_string_equal(d, "lora not configured");
    assert_int_equal(parse("models:\n  student:\n    lora: null\n", &c), LK_OK);
    assert_int_equal(c.configured, 0);
    assert_int_equal(parse("models:\n  student:\n", &c), LK_OK);
    assert_int_equal(c.configured, 0);
}

static void test_enable_must_be_boolean(void **state) {
    (void)state;
    lk_lora_config c;
    const char *ok[] = {"true", "True", "yes", "on", "~"};
    for (size_t i = 0; i < 5; i++) {
        char y[160];
        snprintf(y, sizeof y, "models:\n  student:\n    lora: {enable: %s, rank: 2}\n", ok[i]);
        assert_int_equal(parse(y, &c), LK_OK);
        assert_int_equal(c.enable, i < 4);
        lk_lora_config_clear(&c);
    }
    assert_int_equal(parse("models:\n  student:\n    lora: {enable: \"false\", rank: 2}\n", &c),
                     LK_ERR_CONFIG);
    tu_assert_contains(lk_last_error(), "t.yaml:3: models.student.lora.enable: must be true or false, got 'false'");
    assert_int_equal(parse("models:\n  student:\n    lora: {enable: 1, rank: 2}\n", &c), LK_ERR_CONFIG);
}

static void test_target_modules(void **state) {
    (void)state;
    lk_lora_config c;
    assert_int_equal(parse("models:\n  student:\n    lora:\n      enable: true\n      rank: 2\n"
                           "      target_modules: [to_q, \"to_v\"]\n", &c), LK_OK);
    assert_int_equal(c.n_targets, 2);
    assert_string_equal(c.targets[0], "to_q");
    assert_string_equal(c.targets[1], "to_v");
    assert_int_equal(c.targets_given, 1);
    char d[256];
    lk_lora_config_describe(&c, d, sizeof d);
    assert_string_equal(d, "lora enabled: rank 2, alpha 2 (= rank), targets [to_q, to_v]");
    lk_lora_config_clear(&c);
    /* absent and [] give the reference's default list */
    const char *forms[] = {"", ", target_modules: []", ", target_modules: null"};
    for (int i = 0; i < 3; i++) {
        char y[160];
        snprintf(y, sizeof y, "models:\n  student:\n    lora: {enable: true, rank: 2%s}\n", forms[i]);
        assert_int_equal(parse(y, &c), LK_OK);
        assert_int_equal(c.n_targets, 10);
        assert_string_equal(c.targets[0], "q_proj");
        assert_string_equal(c.targets[9], "to_gate_compress");
        assert_int_equal(c.targets_given, 0);
        lk_lora_config_clear(&c);
    }
    assert_int_equal(parse("models:\n  student:\n    lora: {enable: true, rank: 2, target_modules: to_q}\n", &c),
                     LK_ERR_CONFIG);
    tu_assert_contains(lk_last_error(), "models.student.lora.target_modules: must be a list");
    assert_int_equal(parse("models:\n  student:\n    lora:\n      enable: true\n      rank: 2\n"
                           "      target_modules:\n        - to_q\n        - [x]\n", &c), LK_ERR_CONFIG);
    tu_assert_contains(lk_last_error(), "t.yaml:8: models.student.lora.target_modules: item 1 must be a non-empty string");
}

static void test_structure_errors(void **state) {
    (void)state;
    lk_lora_config c;
    assert_int_equal(parse("models:\n  teacher: {}\n  critic: {}\n", &c), LK_ERR_CONFIG);
    tu_assert_contains(lk_last_error(), "models: no role 'student' (roles: 'teacher', 'critic')");
    assert_int_equal(parse("other: 1\n", &c), LK_ERR_CONFIG);
    tu_assert_contains(lk_last_error(), "t.yaml: no 'models' key");
    assert_int_equal(parse("models: [a]\n", &c), LK_ERR_CONFIG);
    assert_int_equal(parse("- a\n", &c), LK_ERR_CONFIG);
    assert_int_equal(parse("", &c), LK_ERR_CONFIG);
    assert_int_equal(parse("models:\n  student: 3\n", &c), LK_ERR_CONFIG);
    tu_assert_contains(lk_last_error(), "t.yaml:2: models.student: must be a mapping");
    assert_int_equal(parse("models:\n  student:\n    lora: {rank: 1, rank: 2}\n", &c), LK_ERR_CONFIG);
    tu_assert_contains(lk_last_error(), "models.student.lora.rank: duplicate key");
    /* a repeated key anywhere in the file, not only on the walked path, names both lines */
    assert_int_equal(parse("models:\n  student:\n    lora: {rank: 1}\nother:\n  a: 1\n  a: 2\n", &c),
                     LK_ERR_CONFIG);
    tu_assert_contains(lk_last_error(), "t.yaml:6: other.a: duplicate key (first at line 5)");
    assert_int_equal(parse("models:\n  student: {}\n  student: {}\n", &c), LK_ERR_CONFIG);
    tu_assert_contains(lk_last_error(), "t.yaml:3: models.student: duplicate key (first at line 2)");
    assert_int_equal(parse("models:\n  student:\n    lora: {enable: true\n", &c), LK_ERR_FORMAT);
    tu_assert_contains(lk_last_error(), "t.yaml:4: invalid YAML");
    assert_int_equal(lk_lora_config_load("/nonexistent/x.yaml", "student", &c), LK_ERR_IO);
    tu_assert_contains(lk_last_error(), "/nonexistent/x.yaml: cannot open");
}

static void test_file_and_roles(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    char *p = tu_path(dir, "c.yaml");
    const char *y = "models:\n  student:\n    lora: {enable: true, rank: 8, alpha: 16}\n"
                    "  teacher:\n    path: t\n";
    assert_int_equal(tu_write_file(p, y, strlen(y)), 0);
    char **roles;
    size_t n;
    assert_int_equal(lk_lora_config_roles(p, &roles, &n), LK_OK);
    assert_int_equal(n, 2);
    assert_string_equal(roles[0], "student");
    assert_string_equal(roles[1], "teacher");
    lk_lora_roles_free(roles, n);
    lk_lora_config c;
    assert_int_equal(lk_lora_config_load(p, "student", &c), LK_OK);
    assert_int_equal(c.rank, 8);
    assert_int_equal(c.alpha, 16);
    lk_lora_config_clear(&c);
    assert_int_equal(lk_lora_config_load(p, "teacher", &c), LK_OK);
    assert_int_equal(c.configured, 0);
    tu_rmtree(dir);
    free(p);
    free(dir);
}

/* Billion laughs, deep nesting, control bytes: bounded time and memory, a
 * clean status, never a crash. */
static void test_hostile_yaml(void **state) {
    (void)state;
    lk_lora_config c;
    const char *bomb =
        "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
        "b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
        "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\n"
        "d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
        "e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\n"
        "f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]\n"
        "g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f, *f]\n"
        "models:\n  student:\n    lora: {enable: true, rank: 4, target_modules: *g}\n";
    assert_int_equal(parse(bomb, &c), LK_ERR_CONFIG); /* items are lists, not strings */
    const char *alias_ok = "t: &t [to_q, to_k]\nmodels:\n  student:\n    lora: {enable: true, rank: 4, target_modules: *t}\n";
    assert_int_equal(parse(alias_ok, &c), LK_OK);
    assert_int_equal(c.n_targets, 2);
    lk_lora_config_clear(&c);
    size_t depth = 20000;
    char *deep = malloc(2 * depth + 64);
    size_t o = (size_t)sprintf(deep, "models:\n  student:\n    lora: ");
    for (size_t i = 0; i < depth; i++) deep[o++] = '[';
    for (size_t i = 0; i < depth; i++) deep[o++] = ']';
    deep[o++] = '\n';
    assert_int_not_equal(lk_lora_config_parse(deep, o, "t.yaml", "student", &c), LK_OK);
    free(deep);
    tu_rng r = {7};
    char junk[512];
    for (int k = 0; k < 200; k++) {
        for (size_t i = 0; i < sizeof junk; i++) junk[i] = (char)(tu_next(&r) & 0xff);
        lk_status s = lk_lora_config_parse(junk, sizeof junk, "j", "student", &c);
        assert_int_not_equal(s, LK_OK);
    }
    const char nul[] = "models:\n  student:\n    lora: {enable: true, rank: 4, target_modules: [\"a\\0b\"]}\n";
    assert_int_equal(parse(nul, &c), LK_ERR_CONFIG);
}

/* Every allocation of a successful parse, failed in turn: a clean status,
 * nothing leaked (ASan), *out left zeroed. */
static void test_alloc_failures(void **state) {
    (void)state;
    const char *y = "models:\n  student:\n    lora: {enable: true, rank: 4, target_modules: [a, b, c]}\n";
    lk_lora_config c;
    int succeeded = 0;
    for (unsigned long k = 1; k < 200 && !succeeded; k++) {
        lk_alloc_fail_at(k);
        lk_status s = parse(y, &c);
        lk_alloc_fail_at(0);
        if (s == LK_OK) {
            succeeded = 1;
            assert_int_equal(c.n_targets, 3);
            lk_lora_config_clear(&c);
        } else {
            assert_int_equal(s, LK_ERR_NOMEM);
            assert_null(c.targets);
        }
    }
    assert_true(succeeded);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_enable_defaults_false),
        cmocka_unit_test(test_enable_without_rank_is_error),
        cmocka_unit_test(test_rank_not_positive_is_error),
        cmocka_unit_test(test_rank_not_integer_is_error),
        cmocka_unit_test(test_rank_with_enable_false_is_info),
        cmocka_unit_test(test_alpha_defaults_to_rank),
        cmocka_unit_test(test_unknown_keys_warn),
        cmocka_unit_test(test_lora_not_mapping_is_error),
        cmocka_unit_test(test_no_lora_block_is_not_configured),
        cmocka_unit_test(test_enable_must_be_boolean),
        cmocka_unit_test(test_target_modules),
        cmocka_unit_test(test_structure_errors),
        cmocka_unit_test(test_file_and_roles),
        cmocka_unit_test(test_hostile_yaml),
        cmocka_unit_test(test_alloc_failures),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
