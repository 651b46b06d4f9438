/* test_tracker_cli.c — `lorakit swap` and examples/serve_swap as a user runs
 * them: alone (one rank) and under `mpirun -n 2|3`, parsing the JSON lines.
 * Expectations: each step's digest equals `lorakit digest` of an offline
 * `lorakit fuse` of the same set (adapters given in sorted path order, the
 * order the tracker sums them in), the reset step equals the base's digest,
 * a failed step keeps the previous digest, and ranks handed different plans
 * get an error on the differing steps (no hang: ctest's timeout would fire). */
#include "testutil.h"
#include "swap_fixture.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>

static const swap_model M = {2, 96, 192, 1};
static char *g_dir, *g_base, *g_a, *g_b;
static char g_want[4][LK_DIGEST_HEX]; /* base, A@1, A@0.7+B@-0.5, B@1.3 */

static const char *bin(void) {
    const char *b = getenv("LORAKIT_BIN");
    return b ? b : LK_TEST_BIN_DIR "/lorakit";
}

/* Runs a shell command; stdout into *out (malloc'd), stderr into *err. */
static int sh(char **out, char **err, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int sh(char **out, char **err, const char *fmt, ...) {
    char cmd[8192], full[9000];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    char *o = tu_path(g_dir, "out.txt"), *e = tu_path(g_dir, "err.txt");
    snprintf(full, sizeof full, "%s >'%s' 2>'%s' </dev/null", cmd, o, e);
    int st = system(full);
    int rc = (st >= 0 && WIFEXITED(st)) ? WEXITSTATUS(st) : -1;
    char *ot = tu_read_file(o, NULL), *et = tu_read_file(e, NULL);
    if (rc < 0 || rc > 2) fprintf(stderr, "command: %s\nrc %d\nstdout:\n%s\nstderr:\n%s\n", cmd, rc, ot, et);
    if (out) *out = ot;
    else free(ot);
    if (err) *err = et;
    else free(et);
    free(o);
    free(e);
    return rc;
}

/* The digest of `lorakit fuse BASE ARGS`: loras holds the -l options and any other fuse options. */
static void offline_on(const char *base, const char *loras, char hex[LK_DIGEST_HEX]) {
    char *out = NULL;
    assert_int_equal(sh(NULL, NULL, "'%s' fuse '%s' %s -o '%s/off.safetensors'", bin(), base, loras, g_dir), 0);
    assert_int_equal(sh(&out, NULL, "'%s' digest '%s/off.safetensors'", bin(), g_dir), 0);
    assert_int_equal(strlen(out), 33);
    memcpy(hex, out, 32);
    hex[32] = '\0';
    free(out);
}

static void offline(const char *loras, char hex[LK_DIGEST_HEX]) { offline_on(g_base, loras, hex); }

static int setup(void **state) {
    (void)state;
    /* mpirun as root, oversubscribed, and (under ASan) Open MPI's own
     * leaks suppressed: the same settings tests/CMakeLists.txt gives mpi_*. */
    setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
    setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
    setenv("OMPI_MCA_rmaps_base_oversubscribe", "1", 1);
    setenv("OMPI_MCA_mpi_yield_when_idle", "1", 1);
    setenv("OMPI_MCA_btl_vader_single_copy_mechanism", "none", 1);
    setenv("OMPI_MCA_mca_base_component_disable_dlclose", "1", 1);
    setenv("LSAN_OPTIONS", "suppressions=" LK_TEST_SRC_DIR "/tests/mpi_lsan.supp", 1);
    const char *asan = getenv("ASAN_OPTIONS");
    char opts[1024];
    snprintf(opts, sizeof opts, "%s%sfast_unwind_on_malloc=0", asan ? asan : "", asan && *asan ? ":" : "");
    setenv("ASAN_OPTIONS", opts, 1);

    g_dir = tu_mkdtemp();
    g_base = tu_path(g_dir, "base.safetensors");
    g_a = tu_path(g_dir, "a.safetensors");
    g_b = tu_path(g_dir, "b.safetensors");
    if (swap_write_base(g_base, &M, 21) || swap_write_adapter(g_a, &M, SWAP_ATTN, 4, 8.0f, 0.05f, 0, 22) ||
        swap_write_adapter(g_b, &M, SWAP_FF, 2, 2.0f, 0.05f, 0, 23))
        return -1;
    char *out = NULL;
    if (sh(&out, NULL, "'%s' digest '%s'", bin(), g_base) != 0) return -1;
    memcpy(g_want[0], out, 32);
    free(out);
    char l[1024];
    snprintf(l, sizeof l, "-l '%s:1'", g_a);
    offline(l, g_want[1]);
    snprintf(l, sizeof l, "-l '%s:0.7' -l '%s:-0.5'", g_a, g_b);
    offline(l, g_want[2]);
    snprintf(l, sizeof l, "-l '%s:1.3'", g_b);
    offline(l, g_want[3]);
    return 0;
}

static int teardown(void **state) {
    (void)state;
    tu_rmtree(g_dir);
    free(g_dir); free(g_base); free(g_a); free(g_b);
    return 0;
}

static char *write_plan(const char *name, const char *text) {
    char *p = tu_path(g_dir, name);
    assert_int_equal(tu_write_file(p, text, strlen(text)), 0);
    return p;
}

/* Six steps: A; B+A (relative paths, other order); B; reset; A again; a
 * missing adapter (fails, weights kept). */
static const char PLAN[] =
    "bucket_mb: 1\n"
    "steps:\n"
    "  - loras: [{path: a.safetensors, strength: 1.0}]\n"
    "  - loras: [{path: b.safetensors, strength: -0.5}, {path: a.safetensors, strength: 0.7}]\n"
    "  - loras: [{path: b.safetensors, strength: 1.3}]\n"
    "  - loras: []\n"
    "  - loras: [{path: a.safetensors}]\n"
    "  - loras: [{path: a.safetensors}, {path: gone.safetensors, strength: 2}]\n";
static const int PLAN_WANT[6] = {1, 2, 3, 0, 1, 1};

/* Checks the JSON lines of PLAN's run; ok[k] says which steps should pass. */
static void check_lines(const char *out, int n_steps, const int *want, const int *ok) {
    const char *p = out;
    for (int k = 0; k < n_steps; k++) {
        const char *nl = strchr(p, '\n');
        assert_non_null(nl);
        json_error_t je;
        json_t *o = json_loadb(p, (size_t)(nl - p), 0, &je);
        assert_non_null(o);
        assert_int_equal(json_integer_value(json_object_get(o, "step")), k + 1);
        assert_string_equal(json_string_value(json_object_get(o, "status")), ok[k] ? "ok" : "error");
        assert_string_equal(json_string_value(json_object_get(o, "digest")), g_want[want[k]]);
        assert_true(json_is_true(json_object_get(o, "digests_agree")));
        assert_non_null(json_object_get(o, "keys_fused"));
        assert_non_null(json_object_get(o, "keys_restored"));
        assert_non_null(json_object_get(o, "bytes_broadcast"));
        assert_true(json_is_real(json_object_get(o, "seconds")));
        if (!ok[k]) assert_true(json_is_string(json_object_get(o, "error")));
        json_decref(o);
        p = nl + 1;
    }
    assert_string_equal(p, "");
}

static void test_plan_at_1_2_3_ranks(void **state) {
    (void)state;
    char *plan = write_plan("plan.yaml", PLAN);
    const int ok[6] = {1, 1, 1, 1, 1, 0};
    for (int k = 1; k <= 3; k++) {
        char *out = NULL, *err = NULL;
        int rc;
        if (k == 1) rc = sh(&out, &err, "'%s' swap '%s' --plan '%s' --json", bin(), g_base, plan);
#ifdef LK_HAVE_MPI
        else rc = sh(&out, &err, "mpirun -n %d '%s' swap '%s' --plan '%s' --json", k, bin(), g_base, plan);
#else
        else break;
#endif
        assert_int_equal(rc, 1); /* the last step fails */
        check_lines(out, 6, PLAN_WANT, ok);
        tu_assert_contains(out, "gone.safetensors");
        /* counts at step 1 (A from clean, 8 attention keys) are rank-independent */
        tu_assert_contains(out, "\"step\":1,\"status\":\"ok\",\"keys_fused\":8,\"keys_restored\":0");
        free(out);
        free(err);
    }
    /* text output, and a bucket larger than the model: same digests */
    char *out = NULL;
    assert_int_equal(sh(&out, NULL, "'%s' swap '%s' --plan '%s' --bucket-mb 4096", bin(), g_base, plan), 1);
    tu_assert_contains(out, g_want[2]);
    tu_assert_contains(out, "step 6: error: ");
    free(out);
    free(plan);
}

static void test_different_plans_per_rank(void **state) {
    (void)state;
#ifndef LK_HAVE_MPI
    skip();
#endif
    char *p1 = write_plan("p1.yaml", "steps:\n"
                                     "  - loras: [{path: a.safetensors}]\n"
                                     "  - loras: [{path: b.safetensors, strength: 1.3}]\n"
                                     "  - loras: []\n");
    char *p2 = write_plan("p2.yaml", "steps:\n"
                                     "  - loras: [{path: a.safetensors}]\n"
                                     "  - loras: [{path: b.safetensors, strength: 0.3}]\n");
    char *out = NULL, *err = NULL;
    int rc = sh(&out, &err, "mpirun -n 1 '%s' swap '%s' --plan '%s' --json : -n 1 '%s' swap '%s' --plan '%s' --json",
                bin(), g_base, p1, bin(), g_base, p2);
    assert_int_equal(rc, 1);
    const int want[3] = {1, 1, 1}, ok[3] = {1, 0, 0};
    check_lines(out, 3, want, ok);
    tu_assert_contains(out, "ranks disagree on the adapter request");
    tu_assert_contains(out, "p2.yaml has 2 steps");
    free(out); free(err); free(p1); free(p2);
}

static void test_usage_and_bad_plan(void **state) {
    (void)state;
    char *out = NULL, *err = NULL;
    assert_int_equal(sh(&out, NULL, "'%s' swap --help", bin()), 0);
    tu_assert_contains(out, "usage: lorakit swap BASE --plan PLAN.yaml");
    free(out);
    assert_int_equal(sh(NULL, &err, "'%s' swap '%s'", bin(), g_base), 2);
    tu_assert_contains(err, "missing --plan");
    free(err);
    assert_int_equal(sh(NULL, &err, "'%s' swap '%s' --plan x --bucket-mb 0", bin(), g_base), 2);
    tu_assert_contains(err, "--bucket-mb");
    free(err);
    char *bad = write_plan("bad.yaml", "steps:\n  - loras: [{path: a.safetensors, strength: lots}]\n");
    assert_int_equal(sh(NULL, &err, "'%s' swap '%s' --plan '%s'", bin(), g_base, bad), 1);
    tu_assert_contains(err, "bad.yaml:2: steps[0].loras[0].strength");
    free(err);
    free(bad);
}

/* --arch / --map and the plan's arch / maps (issue 19): a diffusers Flux
 * LoRA on Flux's BFL single file (its to_q/to_k/to_v/proj_mlp on row slices
 * of the fused qkv and linear1) ends with the digest of `lorakit fuse` with
 * the same tables (whose bytes test_layouts checks against diffusers' own
 * fuse); with no table the step fails and the weights stay the base's; the
 * command line overrides the plan; a table that cannot be read fails setup
 * naming it. */
static void test_layout_tables(void **state) {
    (void)state;
#define LFX LK_TEST_SRC_DIR "/tests/fixtures/layouts"
    const char *base = LFX "/flux_bfl.safetensors", *map = LK_TEST_SRC_DIR "/data/families/flux.lkmap";
    char want[LK_DIGEST_HEX], clean[LK_DIGEST_HEX], l[1024], *out = NULL, *err = NULL;
    snprintf(l, sizeof l, "-l '" LFX "/flux_lora_diffusers.safetensors:0.8' --arch none --map '%s'", map);
    offline_on(base, l, want);
    assert_int_equal(sh(&out, NULL, "'%s' digest '%s'", bin(), base), 0);
    memcpy(clean, out, 32);
    clean[32] = '\0';
    free(out);
    assert_string_not_equal(want, clean);
    char text[1200];
    snprintf(text, sizeof text, "arch: none\nmaps: ['%s']\nsteps:\n"
             "  - loras: [{path: '" LFX "/flux_lora_diffusers.safetensors', strength: 0.8}]\n  - loras: []\n", map);
    char *plan = write_plan("layout.yaml", text);
    assert_int_equal(sh(&out, NULL, "'%s' swap '%s' --plan '%s'", bin(), base, plan), 0);
    char line[256];
    snprintf(line, sizeof line, "step 1: ok: 8 keys fused, 0 restored, 0.00 MiB broadcast");
    tu_assert_contains(out, line);
    tu_assert_contains(out, want);
    free(out);
    /* --map replaces the plan's maps: with arch none and a table of the user's for another model, nothing
     * lands; --arch flux overrides the plan's none: the same bytes again */
    char *other = write_plan("other.lkmap", "lorakit-family 1\nmap blk.#.wqkv layers.#.q\n");
    assert_int_equal(sh(&out, NULL, "'%s' swap '%s' --plan '%s' --arch flux --map '%s'", bin(), base, plan, other), 0);
    tu_assert_contains(out, want);
    free(out);
    assert_int_equal(sh(&out, &err, "'%s' swap '%s' --plan '%s' --map '%s'", bin(), base, plan, other), 1);
    tu_assert_contains(out, "step 1: error: ");
    tu_assert_contains(err, "norm_out.linear matches no model weight");
    snprintf(line, sizeof line, "step 2: ok (unchanged set, skipped): 0 keys fused, 0 restored, 0.00 MiB broadcast, ");
    tu_assert_contains(out, line);
    tu_assert_contains(out, clean);
    free(out);
    free(err);
    assert_int_equal(sh(NULL, &err, "'%s' swap '%s' --plan '%s' --map '%s/none.lkmap'", bin(), base, plan, g_dir), 1);
    tu_assert_contains(err, "none.lkmap");
    free(err);
    assert_int_equal(sh(NULL, &err, "'%s' swap '%s' --plan '%s' --arch nope", bin(), base, plan), 1);
    tu_assert_contains(err, "--arch nope: no such family table");
    free(err);
    assert_int_equal(sh(NULL, &err, "'%s' swap '%s' --plan '%s' --arch", bin(), base, plan), 2);
    tu_assert_contains(err, "--arch needs a value");
    free(err);
    free(other);
    free(plan);
#undef LFX
}

/* A diffusers pipeline folder as BASE (issue 19): refused, naming the
 * component folders to pass; its transformer/ folder swaps as the offline
 * fuse of that folder gives. */
static void test_pipeline_base(void **state) {
    (void)state;
    char *pipe = tu_path(g_dir, "pipe"), *tr = tu_path(pipe, "transformer"), *sch = tu_path(pipe, "scheduler");
    assert_int_equal(mkdir(pipe, 0755), 0);
    assert_int_equal(mkdir(tr, 0755), 0);
    assert_int_equal(mkdir(sch, 0755), 0);
    size_t n;
    char *bytes = tu_read_file(LK_TEST_SRC_DIR "/tests/fixtures/layouts/flux_diffusers.safetensors", &n);
    char *model = tu_path(tr, "diffusion_pytorch_model.safetensors");
    assert_int_equal(tu_write_file(model, bytes, n), 0);
    char *mi = tu_path(pipe, "model_index.json");
    assert_int_equal(tu_write_file(mi, "{}", 2), 0);
    const char *lora = LK_TEST_SRC_DIR "/tests/fixtures/layouts/flux_lora_diffusers.safetensors";
    char text[700], want[LK_DIGEST_HEX], l[600], *out = NULL, *err = NULL;
    snprintf(text, sizeof text, "steps:\n  - loras: [{path: '%s', strength: 0.6}]\n", lora);
    char *plan = write_plan("pipe.yaml", text);
    assert_int_equal(sh(&out, &err, "'%s' swap '%s' --plan '%s'", bin(), pipe, plan), 1);
    tu_assert_contains(err, "is a diffusers pipeline folder (model_index.json)");
    tu_assert_contains(err, "pass the component's folder (");
    tu_assert_contains(err, tr);
    assert_null(strstr(err, "scheduler")); /* only the model components are offered */
    assert_string_equal(out, "");
    free(out);
    free(err);
    snprintf(l, sizeof l, "-l '%s:0.6'", lora);
    offline_on(tr, l, want);
    assert_int_equal(sh(&out, NULL, "'%s' swap '%s' --plan '%s'", bin(), tr, plan), 0);
    tu_assert_contains(out, want);
    free(out);
    free(bytes);
    free(plan);
    free(mi);
    free(model);
    free(sch);
    free(tr);
    free(pipe);
}

/* examples/serve_swap at 2 ranks: A, A+B, reset, as its README snippet shows. */
static void test_example(void **state) {
    (void)state;
#ifndef LK_HAVE_MPI
    skip();
#endif
    char *out = NULL, *err = NULL, want[LK_DIGEST_HEX];
    char l[1024];
    snprintf(l, sizeof l, "-l '%s:0.6' -l '%s:0.8'", g_a, g_b);
    offline(l, want);
    int rc = sh(&out, &err, "mpirun -n 2 '%s/serve_swap' '%s' '%s' '%s'", LK_TEST_BIN_DIR, g_base, g_a, g_b);
    assert_int_equal(rc, 0);
    char line[256];
    snprintf(line, sizeof line, "A        digest %s", g_want[1]);
    tu_assert_contains(out, line);
    snprintf(line, sizeof line, "A+B      digest %s", want);
    tu_assert_contains(out, line);
    snprintf(line, sizeof line, "reset    digest %s", g_want[0]);
    tu_assert_contains(out, line);
    free(out);
    free(err);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_plan_at_1_2_3_ranks),
        cmocka_unit_test(test_different_plans_per_rank),
        cmocka_unit_test(test_usage_and_bad_plan),
        cmocka_unit_test(test_layout_tables),
        cmocka_unit_test(test_pipeline_base),
        cmocka_unit_test(test_example),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
