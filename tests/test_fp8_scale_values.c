/* test_fp8_scale_values.c — an FP8 weight's scale that is NaN, Inf, 0 or
 * negative is refused naming the scale tensor and the value (issue 20, item
 * 5): the real weight is code x scale, so NaN/Inf would turn every code into
 * NaN and 0 would erase the weight. Checked on every path before anything
 * is written: lk_fuse_file (no output), lk_fuse_tensors and the tracker
 * (every tensor keeps its bytes: digest before = after), the CLI (exit 1),
 * and lk_fuse_fp8 itself (the weight buffer untouched). Layouts: a per-tensor
 * F32 weight_scale [], a per-channel BF16 weight_scale [out] with one bad
 * row, ComfyUI's scale_weight (with the scaled_fp8 marker). A good scale
 * fuses (the control). */
#include "adapter_ref.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define OUT 8
#define IN 16

static tu_rng g_rng = {55};

/* An e4m3 OUT x IN weight "m.weight" (codes 0x30..0x3f: 0.5 .. 0.9375) plus
 * its scale (kind: 0 weight_scale [] F32, 1 weight_scale [OUT] BF16 with
 * value v at row 3 and 1 elsewhere, 2 ComfyUI scale_weight [] F32). */
static void write_base(const char *path, int kind, float v) {
    af_file *f = af_new();
    lk_tensor *w = af_rand(f, "m.weight", LK_DTYPE_BF16, OUT, IN / 2, &g_rng, 0, 1);
    w->dtype = LK_DTYPE_F8_E4M3; /* the same bytes, read as OUT x IN codes */
    w->shape[1] = IN;
    for (size_t i = 0; i < w->nbytes; i++) ((unsigned char *)w->data)[i] = (unsigned char)(0x30 + i % 16);
    if (kind == 1) {
        lk_tensor *s = af_rand(f, "m.weight_scale", LK_DTYPE_BF16, 1, OUT, &g_rng, 1, 1);
        s->ndim = 1;
        s->shape[0] = OUT;
        lk_from_f32((char *)s->data + 3 * 2, &v, LK_DTYPE_BF16, 1);
    } else {
        af_scalar(f, kind == 2 ? "m.scale_weight" : "m.weight_scale", LK_DTYPE_F32, v);
        if (kind == 2) af_scalar(f, "scaled_fp8", LK_DTYPE_F32, 0); /* ComfyUI's marker */
    }
    af_save(f, path, NULL, 0);
    af_free(f);
}

static char *g_ad;

static void write_adapter(void) {
    af_file *f = af_new();
    af_rand(f, "m.lora_A.weight", LK_DTYPE_F32, 2, IN, &g_rng, -0.1f, 0.1f);
    af_rand(f, "m.lora_B.weight", LK_DTYPE_F32, OUT, 2, &g_rng, -0.1f, 0.1f);
    g_ad = tu_path(ar_dir, "ad.safetensors");
    af_save(f, g_ad, NULL, 0);
    af_free(f);
}

static void digest_w(lk_weights *w, char hex[LK_DIGEST_HEX]) { assert_int_equal(lk_weights_digest(w, hex), LK_OK); }

/* Every path refuses base's bad scale with a message holding want. */
static void refused_everywhere(const char *base, const char *want) {
    char *out = tu_path(ar_dir, "out.safetensors");
    unlink(out);
    lk_fuse_input in = {g_ad, 1.0, LK_FORMAT_AUTO};
    assert_int_equal(lk_fuse_file(base, &in, 1, out, NULL, NULL), LK_ERR_FORMAT);
    tu_assert_contains(lk_last_error(), want);
    assert_false(tu_exists(out));
    /* in memory: lk_fuse_tensors and the tracker leave every byte */
    lk_weights *w;
    assert_int_equal(lk_weights_load(base, &w), LK_OK);
    char before[LK_DIGEST_HEX], after[LK_DIGEST_HEX];
    digest_w(w, before);
    size_t n = lk_weights_count(w);
    lk_tensor *t = calloc(n, sizeof *t);
    for (size_t i = 0; i < n; i++) t[i] = *lk_weights_tensor(w, i);
    assert_int_equal(lk_fuse_tensors(t, n, &in, 1, NULL, NULL), LK_ERR_FORMAT);
    tu_assert_contains(lk_last_error(), want);
    free(t);
    lk_comm *c;
    lk_tracker *tr;
    assert_int_equal(lk_comm_self(&c), LK_OK);
    lk_tracker_opts o = LK_TRACKER_OPTS_DEFAULT;
    assert_int_equal(lk_tracker_create(c, w, &o, &tr), LK_OK);
    assert_int_equal(lk_tracker_apply(tr, &in, 1, NULL), LK_ERR_FORMAT);
    tu_assert_contains(lk_last_error(), want);
    /* the scale is the base's: named under the base, the adapter only as what was being applied
     * (QA: swap named the adapter file) */
    char named[4096];
    snprintf(named, sizeof named, "base weights (applying %s): m.", g_ad);
    tu_assert_contains(lk_last_error(), named);
    digest_w(w, after);
    assert_string_equal(before, after);
    lk_tracker_free(tr);
    o.base_label = base;
    assert_int_equal(lk_tracker_create(c, w, &o, &tr), LK_OK);
    assert_int_equal(lk_tracker_apply(tr, &in, 1, NULL), LK_ERR_FORMAT);
    snprintf(named, sizeof named, "%s (applying %s): m.", base, g_ad);
    tu_assert_contains(lk_last_error(), named);
    lk_tracker_free(tr);
    lk_comm_free(c);
    /* lk_fuse_fp8 on its own: refused before the weight is touched */
    long si = lk_weights_find(w, "m.weight_scale");
    if (si < 0) si = lk_weights_find(w, "m.scale_weight");
    const lk_tensor *wt = lk_weights_tensor(w, (size_t)lk_weights_find(w, "m.weight"));
    const lk_tensor *sc = lk_weights_tensor(w, (size_t)si);
    lk_st *ad;
    assert_int_equal(lk_st_open(g_ad, &ad), LK_OK);
    lk_fuse_term term = {.A = lk_st_tensor(ad, (size_t)lk_st_find(ad, "m.lora_A.weight")),
                         .B = lk_st_tensor(ad, (size_t)lk_st_find(ad, "m.lora_B.weight")), .scale = 1.0};
    assert_int_equal(lk_fuse_fp8(wt->data, wt->dtype, OUT, IN, sc->data, sc->dtype, (int64_t)lk_tensor_numel(sc),
                                 &term, 1, NULL, "m.weight"),
                     LK_ERR_FORMAT);
    tu_assert_contains(lk_last_error(), "m.weight's scale");
    digest_w(w, after);
    assert_string_equal(before, after);
    lk_st_close(ad);
    lk_weights_free(w);
    /* the CLI */
    char *so = NULL, *se = NULL;
    assert_int_equal(tu_run_cli(&so, &se, "fuse '%s' -l '%s' -o '%s'", base, g_ad, out), 1);
    tu_assert_contains(se, want);
    assert_false(tu_exists(out));
    free(so);
    free(se);
    /* swap names the base's file */
    char *plan = tu_path(ar_dir, "plan.yaml");
    FILE *pf = fopen(plan, "w");
    assert_non_null(pf);
    fprintf(pf, "steps:\n  - loras: [{path: '%s', strength: 0.5}]\n", g_ad);
    fclose(pf);
    assert_int_equal(tu_run_cli(&so, &se, "swap '%s' --plan '%s'", base, plan), 1);
    snprintf(named, sizeof named, "%s (applying %s): m.", base, g_ad);
    tu_assert_contains(se, named);
    tu_assert_contains(se, want);
    free(so);
    free(se);
    free(plan);
    free(out);
}

static void test_bad_scales(void **state) {
    (void)state;
    char *base = tu_path(ar_dir, "base.safetensors");
    const struct {
        int kind;
        float v;
        const char *want;
    } cases[] = {
        {0, NAN, "m.weight_scale: FP8 scale is nan; a scale must be finite and > 0 (the weight is code x scale: "
                 "NaN would make every code NaN)"},
        {0, INFINITY, "m.weight_scale: FP8 scale is inf; a scale must be finite and > 0"},
        {0, 0.0f, "m.weight_scale: FP8 scale is 0; a scale must be finite and > 0 (the weight is code x scale: 0 "
                  "would erase the weight)"},
        {0, -0.5f, "m.weight_scale: FP8 scale is -0.5; a scale must be finite and > 0"},
        {1, -INFINITY, "m.weight_scale: FP8 scale at [3] is -inf"},
        {1, 0.0f, "m.weight_scale: FP8 scale at [3] is 0"},
        {2, NAN, "m.scale_weight: FP8 scale is nan"},
        {2, -2.0f, "m.scale_weight: FP8 scale is -2"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        write_base(base, cases[i].kind, cases[i].v);
        refused_everywhere(base, cases[i].want);
    }
    /* the control: a good scale of each layout fuses */
    char *out = tu_path(ar_dir, "good.safetensors");
    lk_fuse_input in = {g_ad, 1.0, LK_FORMAT_AUTO};
    for (int kind = 0; kind < 3; kind++) {
        write_base(base, kind, 0.25f);
        unlink(out);
        if (lk_fuse_file(base, &in, 1, out, NULL, NULL)) fail_msg("layout %d: %s", kind, lk_last_error());
    }
    free(out);
    free(base);
}

static int setup(void **state) {
    int r = ar_setup_dir(state);
    if (!r) write_adapter();
    return r;
}

static int teardown(void **state) {
    free(g_ad);
    return ar_teardown_dir(state);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_bad_scales)};
    return cmocka_run_group_tests(tests, setup, teardown);
}
