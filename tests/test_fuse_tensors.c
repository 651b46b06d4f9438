/* test_fuse_tensors.c — lk_fuse_tensors (the in-place fuse of caller-owned
 * tensors the Python package's fuse_ uses), lk_fuse_summary_json and
 * lk_inspect_json. Oracles: the fused bytes must equal those of
 * lk_fuse_file on a file holding the same tensors (compared by digest; that
 * path is itself checked against the double-precision reference in
 * test_fuse_file.c), and one tensor is also checked here against
 * ar_check_fused's double reference; every error must leave every tensor's
 * bytes as they were (digest before == digest after); the JSON fields are
 * checked against values written in the test. */
#include "adapter_ref.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define IN 24
#define OUT 16

#define g_dir ar_dir
static tu_rng g_rng = {1234};

/* Base with two F16 linears, one BF16 linear, one F32 linear and a bias. */
static af_file *make_base(const char *path) {
    af_file *m = af_new();
    af_rand(m, "layers.0.q.weight", LK_DTYPE_F16, OUT, IN, &g_rng, -1, 1);
    af_rand(m, "layers.0.k.weight", LK_DTYPE_F16, OUT, IN, &g_rng, -1, 1);
    af_rand(m, "layers.1.q.weight", LK_DTYPE_BF16, OUT, IN, &g_rng, -1, 1);
    af_rand(m, "layers.1.k.weight", LK_DTYPE_F32, OUT, IN, &g_rng, -1, 1);
    af_rand(m, "layers.0.q.bias", LK_DTYPE_F32, 1, OUT, &g_rng, -1, 1);
    af_save(m, path, NULL, 0);
    return m;
}

/* A diffusers-form adapter over the given modules, rank r, A/B in [lo, hi). */
static char *make_adapter(const char *name, const char *const *mods, size_t n, int r, float lo, float hi) {
    af_file *f = af_new();
    char a[256], b[256];
    for (size_t i = 0; i < n; i++) {
        snprintf(a, sizeof a, "%s.lora_A.weight", mods[i]);
        snprintf(b, sizeof b, "%s.lora_B.weight", mods[i]);
        af_rand(f, a, LK_DTYPE_F32, r, IN, &g_rng, lo, hi);
        af_rand(f, b, LK_DTYPE_F32, OUT, r, &g_rng, lo, hi);
    }
    char *p = tu_path(g_dir, name);
    af_save(f, p, NULL, 0);
    af_free(f);
    return p;
}

static void digest_of(lk_weights *w, char hex[LK_DIGEST_HEX]) {
    assert_int_equal(lk_weights_digest(w, hex), LK_OK);
}

/* The tensors of w as a mutable array (views of w's memory). */
static lk_tensor *views(lk_weights *w) {
    size_t n = lk_weights_count(w);
    lk_tensor *t = calloc(n, sizeof *t);
    for (size_t i = 0; i < n; i++) t[i] = *lk_weights_tensor(w, i);
    return t;
}

static void test_equals_fuse_file(void **state) {
    (void)state;
    char *base = tu_path(g_dir, "base.safetensors"), *out = tu_path(g_dir, "fused.safetensors");
    af_file *m = make_base(base);
    const char *m1[] = {"layers.0.q", "layers.1.q", "layers.1.k"}, *m2[] = {"layers.0.q", "layers.0.k"};
    char *a1 = make_adapter("a1.safetensors", m1, 3, 4, -0.5f, 0.5f);
    char *a2 = make_adapter("a2.safetensors", m2, 2, 2, -0.5f, 0.5f);
    /* Given in the reverse of canonical order: the sum order must not follow it. */
    lk_fuse_input in[2] = {{a2, -0.7, LK_FORMAT_AUTO}, {a1, 1.3, LK_FORMAT_AUTO}};
    lk_fuse_stats fs, ts;
    assert_int_equal(lk_fuse_file(base, in, 2, out, NULL, &fs), LK_OK);
    lk_st *fused;
    assert_int_equal(lk_st_open(out, &fused), LK_OK);
    char want[LK_DIGEST_HEX], got[LK_DIGEST_HEX];
    assert_int_equal(lk_digest_st(fused, want), LK_OK);

    for (int threads = 1; threads <= 3; threads += 2) {
        lk_weights *w;
        assert_int_equal(lk_weights_load(base, &w), LK_OK);
        lk_tensor *t = views(w);
        lk_fuse_file_opts o = {.fuse = {.threads = threads}};
        assert_int_equal(lk_fuse_tensors(t, lk_weights_count(w), in, 2, &o, &ts), LK_OK);
        digest_of(w, got);
        assert_string_equal(got, want);
        assert_int_equal(ts.tensors_total, 5);
        assert_int_equal(ts.tensors_fused, 4);
        assert_int_equal(ts.tensors_fused, fs.tensors_fused);
        assert_int_equal(ts.modules_unmatched, 0);
        free(t);
        lk_weights_free(w);
    }
    /* One tensor against the double reference as well: layers.0.k (a2 only,
     * rank 2, alpha = r so scale 1, times the strength). */
    lk_weights *w;
    assert_int_equal(lk_weights_load(base, &w), LK_OK);
    lk_tensor *t = views(w);
    assert_int_equal(lk_fuse_tensors(t, lk_weights_count(w), in, 2, NULL, NULL), LK_OK);
    lk_st *ad;
    assert_int_equal(lk_st_open(a2, &ad), LK_OK);
    ar_term term = {lk_st_tensor(ad, (size_t)lk_st_find(ad, "layers.0.k.lora_A.weight")),
                    lk_st_tensor(ad, (size_t)lk_st_find(ad, "layers.0.k.lora_B.weight")), -0.7};
    const lk_tensor *k = lk_weights_tensor(w, (size_t)lk_weights_find(w, "layers.0.k.weight"));
    assert_int_equal(ar_check_fused(k->data, af_get(m, "layers.0.k.weight")->data, LK_DTYPE_F16, OUT, IN, &term, 1), 0);

    /* The summary: the CLI's --json fields, base/out only when given. */
    char *js = lk_fuse_summary_json(NULL, NULL, in, 2, &ts);
    assert_non_null(js);
    json_t *o = json_loads(js, 0, NULL);
    assert_non_null(o);
    assert_null(json_object_get(o, "base"));
    assert_int_equal(json_integer_value(json_object_get(o, "tensors_fused")), 4);
    assert_int_equal(json_integer_value(json_object_get(o, "tensors_total")), 5);
    json_t *e = json_array_get(json_object_get(o, "adapters"), 0);
    assert_string_equal(json_string_value(json_object_get(e, "path")), a2);
    assert_true(json_real_value(json_object_get(e, "strength")) == -0.7); /* the double used, recorded exactly */
    json_decref(o);
    lk_free(js);
    js = lk_fuse_summary_json(base, out, in, 2, &fs);
    o = json_loads(js, 0, NULL);
    assert_string_equal(json_string_value(json_object_get(o, "out")), out);
    json_decref(o);
    lk_free(js);

    lk_st_close(ad);
    lk_st_close(fused);
    free(t);
    lk_weights_free(w);
    af_free(m);
    free(base); free(out); free(a1); free(a2);
}

/* Every failure: the error names what is wrong, every tensor unchanged. */
static void expect_unchanged(lk_weights *w, const lk_fuse_input *in, size_t n, const lk_fuse_file_opts *o,
                             lk_status want, const char *msg) {
    char before[LK_DIGEST_HEX], after[LK_DIGEST_HEX];
    digest_of(w, before);
    lk_tensor *t = views(w);
    assert_int_equal(lk_fuse_tensors(t, lk_weights_count(w), in, n, o, NULL), want);
    tu_assert_contains(lk_last_error(), msg);
    digest_of(w, after);
    assert_string_equal(before, after);
    free(t);
}

static void test_errors_leave_tensors(void **state) {
    (void)state;
    char *base = tu_path(g_dir, "base2.safetensors");
    af_file *m = make_base(base);
    lk_weights *w;
    assert_int_equal(lk_weights_load(base, &w), LK_OK);
    const char *good[] = {"layers.0.q", "layers.0.k"}, *unm[] = {"layers.0.q", "layers.9.v"};
    char *ag = make_adapter("good.safetensors", good, 2, 2, -0.5f, 0.5f);
    char *au = make_adapter("unmatched.safetensors", unm, 2, 2, -0.5f, 0.5f);
    /* Huge factors on layers.1.q only (BF16 stays finite up to 3e38, F16
     * overflows at 65504): layers.0.k (F16) overflows after layers.0.q
     * (also F16, small) may already have been fused: both come back. */
    const char *big0[] = {"layers.0.q"}, *big1[] = {"layers.0.k"};
    char *ab0 = make_adapter("small_q.safetensors", big0, 1, 1, -0.5f, 0.5f);
    char *ab1 = make_adapter("huge_k.safetensors", big1, 1, 1, 300.0f, 301.0f);

    lk_fuse_input un = {au, 1.0f, LK_FORMAT_AUTO};
    expect_unchanged(w, &un, 1, NULL, LK_ERR_UNMATCHED, "layers.9.v");
    lk_fuse_input two[2] = {{ag, 1.0f, LK_FORMAT_AUTO}, {au, 1.0f, LK_FORMAT_AUTO}};
    expect_unchanged(w, two, 2, NULL, LK_ERR_UNMATCHED, "layers.9.v");
    lk_fuse_input missing = {"/nonexistent/adapter.safetensors", 1.0f, LK_FORMAT_AUTO};
    expect_unchanged(w, &missing, 1, NULL, LK_ERR_IO, "/nonexistent/adapter.safetensors");
    lk_fuse_input nan_in = {ag, NAN, LK_FORMAT_AUTO};
    expect_unchanged(w, &nan_in, 1, NULL, LK_ERR_ARG, "not finite");
    lk_fuse_input ovf[2] = {{ab0, 1.0f, LK_FORMAT_AUTO}, {ab1, 1.0f, LK_FORMAT_AUTO}};
    expect_unchanged(w, ovf, 2, NULL, LK_ERR_NONFINITE, "layers.0.k.weight");

    /* allow_unmatched: the matched module is fused, the other counted. */
    lk_fuse_file_opts allow = {.allow_unmatched = 1};
    lk_fuse_stats st;
    lk_tensor *t = views(w);
    assert_int_equal(lk_fuse_tensors(t, lk_weights_count(w), &un, 1, &allow, &st), LK_OK);
    assert_int_equal(st.modules_unmatched, 1);
    assert_int_equal(st.tensors_fused, 1);
    free(t);

    lk_weights_free(w);
    af_free(m);
    free(base); free(ag); free(au); free(ab0); free(ab1);
}

/* Weights of 4 MiB (many kernel row chunks and threads): the first is
 * fused, the second overflows to Inf, and both must come back to their
 * exact bytes from the backup (digest before == after), with 1, 2 and 3
 * threads. */
static void test_big_tensors_restored(void **state) {
    (void)state;
    const int64_t out = 1024, in = 2112; /* 4.1 MiB in BF16 / F16 */
    char *base = tu_path(g_dir, "big_base.safetensors");
    af_file *m = af_new();
    af_rand(m, "big.a.weight", LK_DTYPE_BF16, out, in, &g_rng, -1, 1);
    af_rand(m, "big.b.weight", LK_DTYPE_F16, out, in, &g_rng, -1, 1);
    af_save(m, base, NULL, 0);
    af_file *ad = af_new();
    af_rand(ad, "big.a.lora_A.weight", LK_DTYPE_F32, 2, in, &g_rng, -0.5f, 0.5f);
    af_rand(ad, "big.a.lora_B.weight", LK_DTYPE_F32, out, 2, &g_rng, -0.5f, 0.5f);
    af_rand(ad, "big.b.lora_A.weight", LK_DTYPE_F32, 2, in, &g_rng, 300.0f, 301.0f);
    af_rand(ad, "big.b.lora_B.weight", LK_DTYPE_F32, out, 2, &g_rng, 300.0f, 301.0f);
    char *ap = tu_path(g_dir, "big_ovf.safetensors");
    af_save(ad, ap, NULL, 0);
    lk_weights *w;
    assert_int_equal(lk_weights_load(base, &w), LK_OK);
    lk_fuse_input in1 = {ap, 1.0f, LK_FORMAT_AUTO};
    for (int th = 1; th <= 3; th++) {
        lk_fuse_file_opts o = {.fuse = {.threads = th}};
        expect_unchanged(w, &in1, 1, &o, LK_ERR_NONFINITE, "big.b.weight");
    }
    lk_weights_free(w);
    af_free(m);
    af_free(ad);
    free(base);
    free(ap);
}

static void test_inspect_json(void **state) {
    (void)state;
    char *base = tu_path(g_dir, "base3.safetensors");
    af_file *m = make_base(base);
    char *js;
    assert_int_equal(lk_inspect_json(base, &js), LK_OK);
    json_t *o = json_loads(js, 0, NULL);
    assert_int_equal(json_integer_value(json_object_get(o, "tensor_count")), 5);
    /* 2 F16 + 1 BF16 at 2 bytes, 1 F32 at 4 bytes, bias 16 floats */
    assert_int_equal(json_integer_value(json_object_get(o, "total_bytes")), 3 * OUT * IN * 2 + OUT * IN * 4 + OUT * 4);
    json_t *tf16 = json_object_get(json_object_get(o, "totals"), "F16");
    assert_int_equal(json_integer_value(json_object_get(tf16, "tensors")), 2);
    json_decref(o);
    lk_free(js);
    const char *mods[] = {"layers.0.q", "layers.1.k"};
    char *ad = make_adapter("insp.safetensors", mods, 2, 4, -1, 1);
    assert_int_equal(lk_inspect_json(ad, &js), LK_OK);
    o = json_loads(js, 0, NULL);
    assert_string_equal(json_string_value(json_object_get(o, "format")), "diffusers");
    assert_int_equal(json_integer_value(json_object_get(o, "module_count")), 2);
    json_t *g = json_array_get(json_object_get(o, "groups"), 0);
    assert_int_equal(json_integer_value(json_object_get(g, "rank")), 4);
    assert_int_equal(json_integer_value(json_object_get(g, "count")), 2);
    json_decref(o);
    lk_free(js);
    assert_int_equal(lk_inspect_json("/nonexistent.safetensors", &js), LK_ERR_IO);
    assert_null(js);
    af_free(m);
    free(base); free(ad);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_equals_fuse_file),
        cmocka_unit_test(test_errors_leave_tensors),
        cmocka_unit_test(test_big_tensors_restored),
        cmocka_unit_test(test_inspect_json),
    };
    return cmocka_run_group_tests(tests, ar_setup_dir, ar_teardown_dir);
}
