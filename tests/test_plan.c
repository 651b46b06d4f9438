/* test_plan.c — the swap plan parser. Expected values are the literal
 * contents of each YAML text below; error messages are checked for the
 * file label, the line and the key path the parser promises to name. */
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static lk_plan *parse(const char *text, lk_status want) {
    lk_plan *p = (lk_plan *)1;
    lk_status s = lk_plan_parse(text, strlen(text), "plan.yaml", "/plans", &p);
    if (s != want) fprintf(stderr, "parse: got %s: %s\n", lk_status_str(s), lk_last_error());
    assert_int_equal(s, want);
    if (s) assert_null(p);
    return s ? NULL : p;
}

static void test_full_plan(void **state) {
    (void)state;
    lk_plan *p = parse("bucket_mb: 32\n"
                       "no_lora_swap: false\n"
                       "steps:\n"
                       "  - loras: [{path: a/, strength: 1.0}, {path: /abs/b.safetensors, strength: -0.5e0, format: kohya}]\n"
                       "  - loras:\n"
                       "      - path: \"c d.safetensors\"\n"
                       "  - loras: []\n",
                       LK_OK);
    assert_int_equal(p->bucket_mb, 32);
    assert_int_equal(p->no_lora_swap, 0);
    assert_int_equal(p->allow_nonfinite, 0); /* unset: off */
    assert_true(p->timeout == -1);           /* unset */
    assert_int_equal(p->n_steps, 3);
    assert_int_equal(p->steps[0].n, 2);
    assert_int_equal(p->steps[0].line, 4);
    assert_string_equal(p->steps[0].loras[0].path, "/plans/a/"); /* relative to the plan's folder */
    assert_true(p->steps[0].loras[0].strength == 1.0f);
    assert_int_equal(p->steps[0].loras[0].format, LK_FORMAT_AUTO);
    assert_string_equal(p->steps[0].loras[1].path, "/abs/b.safetensors");
    assert_true(p->steps[0].loras[1].strength == -0.5f);
    assert_int_equal(p->steps[0].loras[1].format, LK_FORMAT_KOHYA);
    assert_string_equal(p->steps[1].loras[0].path, "/plans/c d.safetensors");
    assert_true(p->steps[1].loras[0].strength == 1.0f); /* default */
    assert_int_equal(p->steps[1].line, 5);
    assert_int_equal(p->steps[2].n, 0);
    lk_plan_free(p);

    p = parse("steps: []\nno_lora_swap: yes\n", LK_OK);
    assert_int_equal(p->bucket_mb, 0); /* unset */
    assert_int_equal(p->no_lora_swap, 1);
    assert_int_equal(p->n_steps, 0);
    lk_plan_free(p);

    /* a strength is read by the CLI's parser (lk_fuse_strength_parse) from the text as written, quoted or not:
     * hex floats and quoted numbers as -l PATH:0x1p-3 and -l PATH:0.7 take them (QA: the plan refused both) */
    p = parse("steps:\n  - loras: [{path: a, strength: 0x1p-3}, {path: b, strength: \"0.7\"}, {path: c, strength: '-2e0'},"
              " {path: d, strength: 7}]\n",
              LK_OK);
    assert_true(p->steps[0].loras[0].strength == 0.125);
    assert_true(p->steps[0].loras[1].strength == 0.7); /* the double 0.7, as strtod reads "0.7" */
    assert_true(p->steps[0].loras[2].strength == -2.0);
    assert_true(p->steps[0].loras[3].strength == 7.0);
    lk_plan_free(p);

    p = parse("timeout: 2.5\nsteps: []\n", LK_OK);
    assert_true(p->timeout == 2.5);
    lk_plan_free(p);
    p = parse("timeout: 0\nsteps: []\n", LK_OK); /* none */
    assert_true(p->timeout == 0);
    lk_plan_free(p);

    p = parse("allow_nonfinite: true\nsteps: []\n", LK_OK);
    assert_int_equal(p->allow_nonfinite, 1);
    assert_int_equal(p->no_lora_swap, 0);
    lk_plan_free(p);
    p = parse("steps: []\nallow_nonfinite: false\n", LK_OK);
    assert_int_equal(p->allow_nonfinite, 0);
    assert_int_equal(p->fp8.rounding, LK_FP8_NEAREST); /* unset: the defaults */
    assert_int_equal(p->fp8.scale, LK_FP8_RESCALE);
    assert_int_equal(p->fp8.seed, 0);
    assert_int_equal(p->fp8.saturate, 0);
    lk_plan_free(p);
    p = parse("fp8_rounding: stochastic\nfp8_seed: 12345678901\nfp8_scale: keep\nfp8_saturate: true\nsteps: []\n",
              LK_OK);
    assert_int_equal(p->fp8.rounding, LK_FP8_STOCHASTIC);
    assert_true(p->fp8.seed == 12345678901ull);
    assert_int_equal(p->fp8.scale, LK_FP8_KEEP);
    assert_int_equal(p->fp8.saturate, 1);
    lk_plan_free(p);
    /* the name tables, as `lorakit fuse --arch / --map`: map paths relative to the plan's folder */
    p = parse("arch: flux\nmaps: [mine.lkmap, /abs/other.lkmap]\nsteps: []\n", LK_OK);
    assert_string_equal(p->arch, "flux");
    assert_int_equal(p->n_maps, 2);
    assert_string_equal(p->maps[0], "/plans/mine.lkmap");
    assert_string_equal(p->maps[1], "/abs/other.lkmap");
    lk_plan_free(p);
    /* the convention (issue 29): unset is lorakit's */
    p = parse("convention: comfyui\nsteps: []\n", LK_OK);
    assert_int_equal(p->convention, LK_CONVENTION_COMFYUI);
    lk_plan_free(p);
    p = parse("maps: []\nsteps: []\n", LK_OK);
    assert_int_equal(p->convention, LK_CONVENTION_LORAKIT);
    assert_null(p->arch); /* unset: recognised from the base */
    assert_int_equal(p->n_maps, 0);
    lk_plan_free(p);
}

static void test_errors(void **state) {
    (void)state;
    const struct {
        const char *text;
        const char *needle;
    } cases[] = {
        {"", "plan.yaml: the plan is empty"},
        {"- 1\n", "plan.yaml:1: (top level): expected a mapping"},
        {"bucket_mb: 0\nsteps: []\n", "plan.yaml:1: bucket_mb: expected a whole number of MiB in 1..1048576, got '0'"},
        {"bucket_mb: 1048577\nsteps: []\n", "expected a whole number of MiB in 1..1048576, got '1048577'"},
        {"timeout: 2e9\nsteps: []\n", "plan.yaml:1: timeout: expected seconds in 0..1e9 (0 = none), got '2e9'"},
        {"bucket_mb: 1.5\nsteps: []\n", "bucket_mb"},
        {"bucket_mb: '8'\nsteps: []\n", "bucket_mb"},
        {"no_lora_swap: maybe\nsteps: []\n", "plan.yaml:1: no_lora_swap: expected true or false"},
        {"steps: []\nallow_nonfinite: 1\n", "plan.yaml:2: allow_nonfinite: expected true or false"},
        {"bucket_mb: 8\nsteps: []\nallow_nonfinite: 'true'\n", "plan.yaml:3: allow_nonfinite: expected true or false"},
        {"allow_nonfinite: [true]\nsteps: []\n", "plan.yaml:1: allow_nonfinite: expected true or false"},
        {"steps: []\ncolour: red\n", "plan.yaml:2: colour: unknown key (valid: bucket_mb, no_lora_swap, allow_nonfinite, "
                                    "fp8_rounding, fp8_seed, fp8_scale, fp8_saturate, timeout, alpha_from, convention, arch, "
                                    "maps, steps)"},
        {"convention: a1111\nsteps: []\n", "plan.yaml:1: convention: expected lorakit, comfyui, lycoris or peft"},
        {"convention: [peft]\nsteps: []\n", "plan.yaml:1: convention: expected lorakit, comfyui, lycoris or peft"},
        {"arch: ''\nsteps: []\n", "plan.yaml:1: arch: expected a family name"},
        {"arch: [flux]\nsteps: []\n", "plan.yaml:1: arch: expected a family name"},
        {"maps: a.lkmap\nsteps: []\n", "plan.yaml:1: maps: expected a list of table files"},
        {"maps: [a.lkmap, {x: 1}]\nsteps: []\n", "plan.yaml:1: maps[1]: expected a non-empty file path"},
        {"timeout: -1\nsteps: []\n", "plan.yaml:1: timeout: expected seconds in 0..1e9 (0 = none), got '-1'"},
        {"timeout: .inf\nsteps: []\n", "plan.yaml:1: timeout: expected seconds"},
        {"timeout: 5m\nsteps: []\n", "plan.yaml:1: timeout: expected seconds"},
        {"timeout: [1]\nsteps: []\n", "plan.yaml:1: timeout: expected seconds"},
        {"fp8_rounding: up\nsteps: []\n", "plan.yaml:1: fp8_rounding: expected nearest or stochastic"},
        {"fp8_scale: [keep]\nsteps: []\n", "plan.yaml:1: fp8_scale: expected rescale or keep"},
        {"fp8_seed: -1\nsteps: []\n", "plan.yaml:1: fp8_seed: expected a whole number >= 0"},
        {"fp8_saturate: 2\nsteps: []\n", "plan.yaml:1: fp8_saturate: expected true or false"},
        {"bucket_mb: 8\n", "plan.yaml:1: steps: expected a list"},
        {"steps:\n  - {}\n", "plan.yaml:2: steps[0].loras: expected a list"},
        {"steps:\n  - loras: [{strength: 1}]\n", "plan.yaml:2: steps[0].loras[0]: missing 'path'"},
        {"steps:\n  - loras: []\n  - loras: [{path: a, strength: abc}]\n",
         "plan.yaml:3: steps[1].loras[0].strength: strength 'abc' is not a number"},
        {"steps:\n  - loras: [{path: a, strength: \"0.7 \"}]\n", "strength '0.7 ' is not a number"},
        /* not numbers, as the CLI's parser (and Python) say: a bool, null, a list */
        {"steps:\n  - loras: [{path: a, strength: true}]\n",
         "plan.yaml:2: steps[0].loras[0].strength: expected a finite number, got 'true'"},
        {"steps:\n  - loras: [{path: a, strength: ~}]\n", "strength: expected a finite number"},
        {"steps:\n  - loras: [{path: a, strength: [1]}]\n", "strength: expected a finite number, got a list"},
        {"steps:\n  - loras: [{path: a, strength: .nan}]\n", "strength: strength '.nan' is not finite"},
        {"steps:\n  - loras: [{path: a, strength: -.inf}]\n", "strength: strength '-.inf' is not finite"},
        {"steps:\n  - loras: [{path: a, strength: \"inf\"}]\n", "strength: strength 'inf' is not finite"},
        {"steps:\n  - loras: [{path: a, strength: 1e999}]\n", "strength"},
        /* a strength is a double (1e39 is fine); one that reads as 0 is not what was typed */
        {"steps:\n  - loras: [{path: a, strength: -1e-400}]\n",
         "plan.yaml:2: steps[0].loras[0].strength: strength '-1e-400' is too small: it reads as 0"},
        {"steps:\n  - loras: [{path: a, format: onnx}]\n", "plan.yaml:2: steps[0].loras[0].format: unknown adapter format 'onnx'"},
        {"steps:\n  - loras: [{path: a, rank: 4}]\n", "steps[0].loras[0].rank: unknown key"},
        {"steps:\n  - loras: [{path: \"a\\0b\"}]\n", "steps[0].loras[0].path"},
        {"steps:\n  - loras: [{path: ''}]\n", "non-empty"},
        {"steps: []\n---\nsteps: []\n", "one YAML document"},
        /* a repeated key anywhere is an error naming both lines (the last one does not win) */
        {"steps:\n  - loras: [{path: a}]\n    loras: []\n", "plan.yaml:3: steps[0].loras: duplicate key (first at line 2)"},
        {"steps:\n  - loras: [{path: a, strength: 1,\n      strength: 2}]\n",
         "plan.yaml:3: steps[0].loras[0].strength: duplicate key (first at line 2)"},
        {"x: {a: 1, a: 2}\nsteps: []\n", "plan.yaml:1: x.a: duplicate key (first at line 1)"},
        /* YAML's plain-scalar rules, the same as every lorakit YAML file: no mixed-case booleans */
        {"no_lora_swap: tRuE\nsteps: []\n", "plan.yaml:1: no_lora_swap: expected true or false"},
        {"steps:\n  - loras: []\n    reset: true\n", "plan.yaml:3: steps[0].reset: unknown key (valid: loras)"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        lk_plan *p = (lk_plan *)1;
        lk_status s = lk_plan_parse(cases[i].text, strlen(cases[i].text), "plan.yaml", NULL, &p);
        assert_int_equal(s, LK_ERR_CONFIG);
        assert_null(p);
        tu_assert_contains(lk_last_error(), cases[i].needle);
    }
    /* malformed YAML is a format error, with its line */
    const char *bad = "steps:\n  - loras: [\n";
    lk_plan *p = (lk_plan *)1;
    assert_int_equal(lk_plan_parse(bad, strlen(bad), "plan.yaml", NULL, &p), LK_ERR_FORMAT);
    assert_null(p);
    tu_assert_contains(lk_last_error(), "plan.yaml:3: invalid YAML");
}

/* Anchors reusing one list many times cannot blow up memory: the total
 * number of adapters is bounded. */
static void test_alias_fanout(void **state) {
    (void)state;
    char *text = malloc(1 << 20), *q = text;
    q += sprintf(q, "x: &L [");
    for (int i = 0; i < 1000; i++) q += sprintf(q, "%s{path: a}", i ? "," : "");
    q += sprintf(q, "]\nsteps:\n");
    for (int i = 0; i < 100; i++) q += sprintf(q, "  - loras: *L\n");
    /* 'x' is an unknown key: first error; move it to be checked second */
    lk_plan *p;
    assert_int_equal(lk_plan_parse(text, strlen(text), "p", NULL, &p), LK_ERR_CONFIG);
    q = text;
    q += sprintf(q, "steps:\n  - loras: &L [");
    for (int i = 0; i < 1000; i++) q += sprintf(q, "%s{path: a}", i ? "," : "");
    q += sprintf(q, "]\n");
    for (int i = 0; i < 100; i++) q += sprintf(q, "  - loras: *L\n");
    assert_int_equal(lk_plan_parse(text, strlen(text), "p", NULL, &p), LK_ERR_CONFIG);
    tu_assert_contains(lk_last_error(), "too many adapters");
    free(text);
}

static void test_load_file(void **state) {
    (void)state;
    char *dir = tu_mkdtemp(), *path = tu_path(dir, "plan.yaml");
    const char *text = "steps:\n  - loras: [{path: x.safetensors, strength: 2}]\n";
    assert_int_equal(tu_write_file(path, text, strlen(text)), 0);
    lk_plan *p;
    assert_int_equal(lk_plan_load(path, &p), LK_OK);
    char *want = tu_path(dir, "x.safetensors");
    assert_string_equal(p->steps[0].loras[0].path, want);
    lk_plan_free(p);
    /* one byte past the size limit: refused before parsing */
    size_t big = LK_PLAN_MAX_BYTES + 1;
    char *huge = malloc(big);
    memset(huge, '#', big);
    char *hp = tu_path(dir, "huge.yaml");
    assert_int_equal(tu_write_file(hp, huge, big), 0);
    assert_int_equal(lk_plan_load(hp, &p), LK_ERR_CONFIG);
    tu_assert_contains(lk_last_error(), "limit");
    free(huge);
    free(hp);
    char *missing = tu_path(dir, "nope.yaml");
    assert_int_equal(lk_plan_load(missing, &p), LK_ERR_IO);
    tu_assert_contains(lk_last_error(), "nope.yaml");
    /* every allocation failing in turn */
    for (unsigned long k = 1; k < 1000; k++) {
        lk_alloc_fail_at(k);
        lk_status s = lk_plan_load(path, &p);
        lk_alloc_fail_at(0);
        if (!s) {
            lk_plan_free(p);
            break;
        }
        assert_int_equal(s, LK_ERR_NOMEM);
    }
    tu_rmtree(dir);
    free(dir); free(path); free(want); free(missing);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_full_plan),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_alias_fanout),
        cmocka_unit_test(test_load_file),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
