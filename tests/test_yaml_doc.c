/* test_yaml_doc.c — the YAML front-end (src/io/yaml_doc.h) that every YAML
 * reader of lorakit uses.
 *
 * Oracles: the scalar table is written here by hand from the rules in
 * yaml_doc.h (YAML 1.1 null/bool as PyYAML resolves them, decimal
 * numbers); lines and paths are counted by hand in each literal text. */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"
#include "core/file.h"
#include "io/yaml_doc.h"

static lk_ydoc *parse_ok(const char *text) {
    lk_ydoc *d = NULL;
    lk_status s = lk_ydoc_parse(text, strlen(text), "t.yaml", &d);
    if (s) fprintf(stderr, "unexpected: %s\n", lk_last_error());
    assert_int_equal(s, LK_OK);
    return d;
}

static void expect_fail(const char *text, lk_status want, const char *needle) {
    lk_ydoc *d = (lk_ydoc *)1;
    assert_int_equal(lk_ydoc_parse(text, strlen(text), "t.yaml", &d), want);
    assert_null(d);
    tu_assert_contains(lk_last_error(), needle);
}

static void test_scalar_rules(void **state) {
    (void)state;
    const struct {
        const char *text;
        lk_ytype type;
        double value; /* bool: 0/1; int, float: the value */
    } cases[] = {
        {"~", LK_Y_NULL, 0}, {"null", LK_Y_NULL, 0}, {"Null", LK_Y_NULL, 0},
        {"NULL", LK_Y_NULL, 0}, {"''", LK_Y_STR, 0}, {"'null'", LK_Y_STR, 0},
        {"nULL", LK_Y_STR, 0},
        {"true", LK_Y_BOOL, 1}, {"True", LK_Y_BOOL, 1}, {"TRUE", LK_Y_BOOL, 1},
        {"yes", LK_Y_BOOL, 1}, {"On", LK_Y_BOOL, 1}, {"off", LK_Y_BOOL, 0},
        {"NO", LK_Y_BOOL, 0}, {"False", LK_Y_BOOL, 0},
        {"tRuE", LK_Y_STR, 0}, {"y", LK_Y_STR, 0}, {"\"true\"", LK_Y_STR, 0},
        {"0", LK_Y_INT, 0}, {"-17", LK_Y_INT, -17}, {"+5", LK_Y_INT, 5},
        {"007", LK_Y_INT, 7}, {"0x10", LK_Y_STR, 0}, {"0o7", LK_Y_STR, 0},
        {"1_000", LK_Y_STR, 0}, {"'16'", LK_Y_STR, 0},
        {"1.5", LK_Y_FLOAT, 1.5}, {"-.25", LK_Y_FLOAT, -0.25}, {"3.", LK_Y_FLOAT, 3.0},
        {"1e3", LK_Y_FLOAT, 1000.0}, {"2E-2", LK_Y_FLOAT, 0.02}, {"1e", LK_Y_STR, 0},
        {".", LK_Y_STR, 0}, {"+", LK_Y_STR, 0}, {".inf", LK_Y_FLOAT, INFINITY},
        {"-.Inf", LK_Y_FLOAT, -INFINITY}, {"inf", LK_Y_STR, 0}, {"nan", LK_Y_STR, 0},
        {"abc", LK_Y_STR, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char text[64];
        snprintf(text, sizeof text, "k: %s\n", cases[i].text);
        lk_ydoc *d = parse_ok(text);
        const lk_ynode *v = lk_ymap_get(lk_ydoc_root(d), "k");
        assert_non_null(v);
        if (v->type != cases[i].type) fprintf(stderr, "case %s\n", cases[i].text);
        assert_int_equal(v->type, cases[i].type);
        int b;
        long long x;
        double f;
        assert_int_equal(lk_ynode_bool(v, &b), cases[i].type == LK_Y_BOOL);
        if (cases[i].type == LK_Y_BOOL) assert_int_equal(b, (int)cases[i].value);
        assert_int_equal(lk_ynode_int(v, -100, 100, &x), cases[i].type == LK_Y_INT);
        if (cases[i].type == LK_Y_INT) assert_true(x == (long long)cases[i].value);
        int finite_num = (cases[i].type == LK_Y_INT || cases[i].type == LK_Y_FLOAT) && isfinite(cases[i].value);
        assert_int_equal(lk_ynode_num(v, &f), finite_num);
        if (finite_num) assert_true(f == cases[i].value);
        if (cases[i].type == LK_Y_FLOAT && !finite_num) assert_true(v->f == cases[i].value);
        assert_int_equal(lk_ynode_str(v) == NULL, cases[i].type == LK_Y_NULL);
        lk_ydoc_free(d);
    }
    /* range and overflow */
    lk_ydoc *d = parse_ok("a: 99999999999999999999999\nb: 1e999\nc: 101\n");
    const lk_ynode *root = lk_ydoc_root(d);
    long long x;
    double f;
    assert_int_equal(lk_ymap_get(root, "a")->type, LK_Y_INT);
    assert_false(lk_ynode_int(lk_ymap_get(root, "a"), LLONG_MIN, LLONG_MAX, &x));
    assert_false(lk_ynode_num(lk_ymap_get(root, "b"), &f)); /* overflows to inf */
    assert_false(lk_ynode_int(lk_ymap_get(root, "c"), 1, 100, &x));
    assert_true(lk_ynode_int(lk_ymap_get(root, "c"), 1, 101, &x) && x == 101);
    lk_ydoc_free(d);
    /* the int(str) coercion some schemas use */
    assert_true(lk_ytext_int("-42", 3, -100, 100, &x) && x == -42);
    assert_false(lk_ytext_int(" 4", 2, -100, 100, &x));
    assert_false(lk_ytext_int("123456789012345678901", 21, LLONG_MIN, LLONG_MAX, &x));
}

static void test_paths_lines_and_errors(void **state) {
    (void)state;
    lk_ydoc *d = parse_ok("# comment\nsteps:\n  - loras:\n      - {path: a, strength: x}\n");
    const lk_ynode *root = lk_ydoc_root(d);
    const lk_ynode *lora = lk_ymap_get(root, "steps")->kids[0];
    const lk_ynode *st = lk_ymap_get(lk_ymap_get(lora, "loras")->kids[0], "strength");
    char buf[128];
    lk_ynode_path(st, buf, sizeof buf);
    assert_string_equal(buf, "steps[0].loras[0].strength");
    assert_int_equal(st->line, 4);
    assert_int_equal(lk_yerr(d, st, NULL, "bad %d", 7), LK_ERR_CONFIG);
    assert_string_equal(lk_last_error(), "t.yaml:4: steps[0].loras[0].strength: bad 7");
    lk_yerr(d, lora, "loras", "missing");
    assert_string_equal(lk_last_error(), "t.yaml:3: steps[0].loras: missing");
    lk_yerr(d, NULL, "x", "no node");
    assert_string_equal(lk_last_error(), "t.yaml: x: no node");
    lk_ynode_repr(st, buf, sizeof buf);
    assert_string_equal(buf, "'x'");
    lk_ynode_repr(root, buf, sizeof buf);
    assert_string_equal(buf, "a mapping");
    /* truncation never overruns */
    lk_ynode_path(st, buf, 8);
    assert_int_equal(strlen(buf), 7);
    lk_ydoc_free(d);
    /* an empty document has no root */
    d = parse_ok("# nothing\n");
    assert_null(lk_ydoc_root(d));
    lk_ydoc_free(d);
}

static void test_duplicates_anywhere(void **state) {
    (void)state;
    expect_fail("a: 1\nb: 2\na: 3\n", LK_ERR_CONFIG, "t.yaml:3: a: duplicate key (first at line 1)");
    expect_fail("m:\n  - {x: 1}\n  - {y: 1,\n     y: 2}\n", LK_ERR_CONFIG,
                "t.yaml:4: m[1].y: duplicate key (first at line 3)");
    /* quoted and plain spellings of one key are the same key */
    expect_fail("k: 1\n'k': 2\n", LK_ERR_CONFIG, "t.yaml:2: k: duplicate key (first at line 1)");
    /* the earliest repeat in the file is the one reported */
    expect_fail("deep: {z: 1, z: 2}\nq: 1\nq: 2\n", LK_ERR_CONFIG, "t.yaml:1: deep.z: duplicate key");
    /* the same text under different mappings is fine */
    lk_ydoc_free(parse_ok("a: {k: 1}\nb: {k: 2}\n"));
    /* a mapping with many keys is checked without quadratic work */
    size_t n = 200000;
    char *big = malloc(n * 16 + 16), *q = big;
    for (size_t i = 0; i < n; i++) q += sprintf(q, "k%zu: %zu\n", i, i);
    q += sprintf(q, "k17: 0\n");
    lk_ydoc *d = (lk_ydoc *)1;
    assert_int_equal(lk_ydoc_parse(big, (size_t)(q - big), "big.yaml", &d), LK_ERR_CONFIG);
    tu_assert_contains(lk_last_error(), "big.yaml:200001: k17: duplicate key (first at line 18)");
    free(big);
}

static void test_documents_aliases_limits(void **state) {
    (void)state;
    expect_fail("a: [1\n", LK_ERR_FORMAT, "t.yaml:2: invalid YAML");
    expect_fail("a: 1\n---\nb: 2\n", LK_ERR_CONFIG, "t.yaml:2: a config file is one YAML document");
    /* aliases share the anchored node: path and line are the anchor's */
    lk_ydoc *d = parse_ok("x: &A {v: 1}\ny: *A\nz: [*A, *A]\n");
    const lk_ynode *root = lk_ydoc_root(d);
    assert_ptr_equal(lk_ymap_get(root, "x"), lk_ymap_get(root, "y"));
    char buf[64];
    lk_ynode_path(lk_ymap_get(lk_ymap_get(root, "z")->kids[1], "v"), buf, sizeof buf);
    assert_string_equal(buf, "x.v");
    lk_ydoc_free(d);
    /* a self-referencing anchor, if the YAML library composes one, is walked once */
    d = NULL;
    const char *cyc = "a: &A [1, *A]\n";
    lk_status s = lk_ydoc_parse(cyc, strlen(cyc), "t.yaml", &d);
    assert_true(s == LK_OK || s == LK_ERR_FORMAT);
    lk_ydoc_free(d);
    /* a NUL byte in a quoted scalar is kept, and never taken as a string */
    d = parse_ok("k: \"a\\0b\"\n");
    const lk_ynode *k = lk_ymap_get(lk_ydoc_root(d), "k");
    assert_int_equal(k->len, 3);
    assert_null(lk_ynode_str(k));
    lk_ydoc_free(d);
    /* the size limit: in memory, and from a file (read bounded, never whole) */
    size_t big = LK_CONFIG_MAX_BYTES + 1;
    char *huge = malloc(big + 1);
    memset(huge, '#', big);
    huge[big] = '\0';
    expect_fail(huge, LK_ERR_CONFIG, "limit");
    char *dir = tu_mkdtemp(), *p = tu_path(dir, "huge.yaml");
    assert_int_equal(tu_write_file(p, huge, big), 0);
    d = (lk_ydoc *)1;
    assert_int_equal(lk_ydoc_load(p, &d), LK_ERR_CONFIG);
    assert_null(d);
    tu_assert_contains(lk_last_error(), "huge.yaml: larger than the 16777216-byte limit");
    free(huge);
    /* every allocation failing in turn ends in LK_ERR_NOMEM, never a crash */
    const char *t = "a: {b: [1, 2, {c: d}]}\ne: &E f\ng: *E\n";
    for (unsigned long i = 1; i < 1000; i++) {
        lk_alloc_fail_at(i);
        d = NULL;
        s = lk_ydoc_parse(t, strlen(t), "t.yaml", &d);
        lk_alloc_fail_at(0);
        if (!s) {
            lk_ydoc_free(d);
            break;
        }
        assert_int_equal(s, LK_ERR_NOMEM);
    }
    tu_rmtree(dir);
    free(dir);
    free(p);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_scalar_rules),
        cmocka_unit_test(test_paths_lines_and_errors),
        cmocka_unit_test(test_duplicates_anywhere),
        cmocka_unit_test(test_documents_aliases_limits),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
