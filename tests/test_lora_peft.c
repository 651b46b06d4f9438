/* test_lora_peft.c — a trained adapter saved as PEFT is read by the adapter
 * loader of the fusion side (lk_adapter_open, format PEFT and auto-detected),
 * and `lorakit fuse` (lk_fuse_file and the CLI) of it onto the saved base
 * gives exactly the merged weights computed in memory.
 *
 * Expectations: the module names, ranks, alphas and factor bytes are those
 * the test put into the model; the merged weights are also checked against
 * W + (alpha/r) B A computed here in double (so "equal to the in-memory
 * merge" cannot hide a shared mistake). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

#define IN 16
#define OUT 24

static const char *const g_names[] = {"blocks.0.attn.to_q", "blocks.0.attn.to_out.0", "blocks.0.ff.net.2",
                                      "blocks.1.attn.to_q"};

typedef struct {
    lk_lora_model *m;
    float *w;
} host;

static host build(const char *base_path, const char *adapter_dir) {
    host h;
    h.w = malloc(sizeof(float) * 4 * (OUT * IN + OUT));
    tu_rng g = {31};
    for (size_t i = 0; i < 4 * (OUT * IN + OUT); i++) h.w[i] = tu_uniform(&g, -1, 1);
    assert_int_equal(lk_lora_model_create(&h.m), LK_OK);
    for (int i = 0; i < 4; i++)
        assert_int_equal(lk_lora_model_add_linear(h.m, g_names[i], IN, OUT, h.w + i * (OUT * IN + OUT),
                                                  h.w + i * (OUT * IN + OUT) + OUT * IN, NULL), LK_OK);
    lk_lora_config c;
    const char *y = "models:\n  student:\n    lora:\n      enable: true\n      rank: 4\n      alpha: 6\n";
    assert_int_equal(lk_lora_config_parse(y, strlen(y), "t.yaml", "student", &c), LK_OK);
    size_t count;
    assert_int_equal(lk_lora_enable(h.m, &c, NULL, 17, &count), LK_OK);
    assert_int_equal(count, 3); /* to_q x2, to_out.0; ff.net.2 is not a default target */
    lk_lora_config_clear(&c);
    /* "train": give B values so the delta is not zero */
    lk_lora_params *p = lk_lora_model_params(h.m);
    for (size_t i = 0; i < lk_lora_params_numel(p); i++) lk_lora_params_grad(p)[i] = tu_uniform(&g, -1, 1);
    lk_adamw_opts o = {.lr = 0.05f};
    lk_adamw *opt;
    assert_int_equal(lk_adamw_create(p, &o, &opt), LK_OK);
    assert_int_equal(lk_adamw_step(opt, p), LK_OK);
    lk_adamw_free(opt);
    assert_int_equal(lk_lora_model_save_base(h.m, base_path), LK_OK);
    assert_int_equal(lk_lora_save_peft(h.m, adapter_dir), LK_OK);
    return h;
}

static void test_adapter_loader_reads_peft(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    char *base = tu_path(dir, "base.safetensors"), *ad = tu_path(dir, "adapter");
    host h = build(base, ad);
    for (int fmt = 0; fmt < 2; fmt++) {
        lk_adapter *a;
        assert_int_equal(lk_adapter_open(ad, fmt ? LK_FORMAT_PEFT : LK_FORMAT_AUTO, &a), LK_OK);
        assert_int_equal(lk_adapter_get_format(a), LK_FORMAT_PEFT);
        assert_int_equal(lk_adapter_count(a), 3);
        assert_false(lk_adapter_rslora(a));
        for (size_t i = 0; i < lk_adapter_count(a); i++) {
            const lk_lora_module *mod = lk_adapter_module(a, i);
            lk_lora_layer *l = lk_lora_model_find(h.m, mod->module);
            assert_non_null(l);
            assert_true(lk_lora_layer_wrapped(l));
            assert_int_equal(mod->rank, 4);
            assert_float_equal(mod->alpha, 6.0f, 0.0f);
            assert_float_equal(mod->scale, 1.5f, 0.0f);
            assert_int_equal(mod->A.shape[0], 4);
            assert_int_equal(mod->A.shape[1], IN);
            assert_int_equal(mod->B.shape[0], OUT);
            assert_int_equal(mod->B.shape[1], 4);
            assert_memory_equal(mod->A.data, lk_lora_layer_A(l), mod->A.nbytes);
            assert_memory_equal(mod->B.data, lk_lora_layer_B(l), mod->B.nbytes);
        }
        lk_adapter_free(a);
    }
    lk_lora_model_free(h.m);
    free(h.w);
    tu_rmtree(dir);
    free(dir); free(base); free(ad);
}

static void check_fused(const char *fused, host *h) {
    lk_st *st;
    assert_int_equal(lk_st_open(fused, &st), LK_OK);
    float *merged = malloc(sizeof(float) * OUT * IN);
    for (int i = 0; i < 4; i++) {
        lk_lora_layer *l = lk_lora_model_find(h->m, g_names[i]);
        char key[96];
        snprintf(key, sizeof key, "%s.weight", g_names[i]);
        long k = lk_st_find(st, key);
        assert_true(k >= 0);
        const lk_tensor *t = lk_st_tensor(st, (size_t)k);
        assert_int_equal(lk_lora_layer_merged(l, merged), LK_OK);
        assert_memory_equal(t->data, merged, sizeof(float) * OUT * IN); /* same bits */
        const float *W = lk_lora_layer_weight(l);
        for (int o = 0; o < OUT; o++)
            for (int c = 0; c < IN; c++) {
                double w = W[o * IN + c];
                if (lk_lora_layer_wrapped(l))
                    for (int r = 0; r < 4; r++)
                        w += 1.5 * (double)lk_lora_layer_B(l)[o * 4 + r] * lk_lora_layer_A(l)[r * IN + c];
                assert_float_equal(merged[o * IN + c], w, 1e-5);
            }
        snprintf(key, sizeof key, "%s.bias", g_names[i]);
        k = lk_st_find(st, key);
        assert_true(k >= 0);
        assert_memory_equal(lk_st_tensor(st, (size_t)k)->data, lk_lora_layer_bias(l), sizeof(float) * OUT);
    }
    free(merged);
    lk_st_close(st);
}

static void test_fuse_equals_in_memory_merge(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    char *base = tu_path(dir, "base.safetensors"), *ad = tu_path(dir, "adapter");
    char *out1 = tu_path(dir, "fused1.safetensors"), *out2 = tu_path(dir, "fused2.safetensors");
    host h = build(base, ad);
    lk_fuse_input in = {.path = ad, .strength = 1.0f, .format = LK_FORMAT_PEFT};
    lk_fuse_file_opts fo = {0};
    lk_fuse_stats stats;
    assert_int_equal(lk_fuse_file(base, &in, 1, out1, &fo, &stats), LK_OK);
    assert_int_equal(stats.tensors_fused, 3);
    check_fused(out1, &h);
    /* the CLI, as a user would run it */
    char *err = NULL;
    int rc = tu_run_cli(NULL, &err, "fuse '%s' -l '%s' -o '%s'", base, ad, out2);
    if (rc != 0) print_error("lorakit fuse: %s\n", err ? err : "");
    assert_int_equal(rc, 0);
    free(err);
    check_fused(out2, &h);
    lk_lora_model_free(h.m);
    free(h.w);
    tu_rmtree(dir);
    free(dir); free(base); free(ad); free(out1); free(out2);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_adapter_loader_reads_peft),
        cmocka_unit_test(test_fuse_equals_in_memory_merge),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
