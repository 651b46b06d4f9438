/* test_model_lora.c — LoRA on the small transformer through the training API
 * (lk_model_lora_attach over lorakit/lora.h).
 *
 * Expectations, each independent of the code under test:
 *  - the reference default target list wraps exactly to_q/to_k/to_v/to_out.0
 *    of every block (names chosen to match diffusers), an explicit list adds
 *    the MLP projections;
 *  - the gradients of every adapter parameter against central finite
 *    differences of the model's loss, with the base frozen (zero gradient);
 *  - the hooked model's logits against a plain model whose weights are
 *    W + (alpha/r) B A computed in double here;
 *  - a PEFT adapter saved from the model, fused OFFLINE into the base by
 *    lk_fuse_file (the `lorakit fuse` path), gives the same logits as the
 *    hooked model: training and fusion agree on names, shapes and scale;
 *  - a base checkpoint whose keys are `<m>.base_layer.weight` (PEFT's
 *    wrapped names) loads through the key aliases. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"
#include "app/model.h"

static lk_model_config cfg(void) {
    lk_model_config c = {.vocab = LK_TASK_VOCAB, .max_seq = 8, .d_model = 8, .n_layers = 2,
                         .n_heads = 2, .d_ff = 16};
    return c;
}

static lk_lora_config lora_cfg(int rank, int alpha, const char **targets, size_t n) {
    lk_lora_config l;
    memset(&l, 0, sizeof l);
    l.configured = 1;
    l.enable = 1;
    l.rank = rank;
    l.alpha = alpha;
    l.alpha_given = 1;
    l.targets = (char **)targets;
    l.n_targets = n;
    l.targets_given = targets != NULL;
    return l;
}

/* B starts at zero; give every B random values so A's gradients are live. */
static void randomise_B(lk_lora_model *lm, uint64_t seed) {
    tu_rng r = {seed};
    for (size_t i = 0; i < lk_lora_model_layer_count(lm); i++) {
        lk_lora_layer *l = lk_lora_model_layer(lm, i);
        if (!lk_lora_layer_wrapped(l)) continue;
        float *B = lk_lora_layer_B(l);
        for (int k = 0; k < lk_lora_layer_out(l) * lk_lora_layer_rank(l); k++)
            B[k] = tu_uniform(&r, -0.3f, 0.3f);
    }
}

static void test_default_targets_match_the_reference_list(void **state) {
    (void)state;
    lk_model_config c = cfg();
    lk_model *m;
    assert_int_equal(lk_model_create(&c, 1, &m), LK_OK);
    /* the default list: targets NULL means the reference's defaults */
    size_t nd = 0;
    while (lk_lora_default_targets[nd]) nd++;
    lk_lora_config l = lora_cfg(4, 4, (const char **)lk_lora_default_targets, nd);
    lk_model_lora *ml;
    assert_int_equal(lk_model_lora_attach(m, &l, 1, &ml), LK_OK);
    lk_lora_model *lm = lk_model_lora_get(ml);
    const char *want[] = {"attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"};
    size_t wrapped = 0;
    for (size_t i = 0; i < lk_lora_model_layer_count(lm); i++) {
        lk_lora_layer *ly = lk_lora_model_layer(lm, i);
        int expect = 0;
        for (int k = 0; k < 4; k++) expect |= strstr(lk_lora_layer_name(ly), want[k]) != NULL;
        assert_int_equal(lk_lora_layer_wrapped(ly), expect);
        wrapped += (size_t)expect;
    }
    assert_int_equal(wrapped, 8);
    lk_model_lora_detach(m, ml);

    const char *all[] = {"to_q", "to_k", "to_v", "to_out", "ff.net.0.proj", "ff.net.2"};
    l = lora_cfg(4, 8, all, 6);
    assert_int_equal(lk_model_lora_attach(m, &l, 1, &ml), LK_OK);
    assert_int_equal(lk_lora_params_count(lk_lora_model_params(lk_model_lora_get(ml))), 24);
    lk_model_lora_detach(m, ml);

    const char *none[] = {"q_proj"};
    l = lora_cfg(4, 8, none, 1);
    assert_int_equal(lk_model_lora_attach(m, &l, 1, &ml), LK_ERR_CONFIG);
    lk_model_free(m);
}

static void test_lora_gradcheck_frozen_base(void **state) {
    (void)state;
    lk_model_config c = cfg();
    lk_model *m;
    assert_int_equal(lk_model_create(&c, 2, &m), LK_OK);
    const char *t[] = {"to_q", "to_v", "to_out", "ff.net.0.proj", "ff.net.2"};
    lk_lora_config l = lora_cfg(2, 4, t, 5);
    lk_model_lora *ml;
    assert_int_equal(lk_model_lora_attach(m, &l, 3, &ml), LK_OK);
    lk_lora_model *lm = lk_model_lora_get(ml);
    randomise_B(lm, 4);
    lk_lora_params *p = lk_lora_model_params(lm);
    int B = 2, T = 8, in[16], tg[16];
    tu_rng r = {6};
    for (int i = 0; i < 16; i++) {
        in[i] = (int)(tu_next(&r) % 11);
        tg[i] = i % 4 == 0 ? -1 : (int)(tu_next(&r) % 11);
    }
    float loss;
    assert_int_equal(lk_model_forward(m, in, tg, B, T, &loss), LK_OK);
    lk_model_zero_grad(m);
    lk_lora_params_zero_grad(p);
    assert_int_equal(lk_model_backward(m), LK_OK);
    for (size_t i = 0; i < lk_model_num_floats(m); i++) assert_true(lk_model_grads(m)[i] == 0.0f);
    size_t n = lk_lora_params_numel(p);
    float *g = malloc(n * sizeof *g);
    memcpy(g, lk_lora_params_grad(p), n * sizeof *g);
    float *x = lk_lora_params_data(p);
    double worst = 0;
    const double eps = 3e-3;
    for (size_t i = 0; i < n; i++) {
        float o = x[i], lp, lmi;
        x[i] = o + (float)eps;
        assert_int_equal(lk_model_forward(m, in, tg, B, T, &lp), LK_OK);
        x[i] = o - (float)eps;
        assert_int_equal(lk_model_forward(m, in, tg, B, T, &lmi), LK_OK);
        x[i] = o;
        double fd = ((double)lp - lmi) / (2 * eps);
        double e = fabs(fd - g[i]) / (fabs(fd) + fabs(g[i]) + 1e-2);
        if (e > worst) worst = e;
    }
    fprintf(stderr, "lora gradcheck: %zu adapter floats, worst normalised error %.3g\n", n, worst);
    assert_true(worst < 0.02);
    free(g);
    lk_model_lora_detach(m, ml);
    lk_model_free(m);
}

/* Plain copy of m's weights with W += scale * B A (double) for each wrapped layer. */
static lk_model *merged_copy(lk_model *m, lk_lora_model *lm) {
    lk_model *p;
    assert_int_equal(lk_model_create(lk_model_get_config(m), 0, &p), LK_OK);
    memcpy(lk_model_params(p), lk_model_params(m), lk_model_num_floats(m) * 4);
    for (size_t i = 0; i < lk_lora_model_layer_count(lm); i++) {
        lk_lora_layer *l = lk_lora_model_layer(lm, i);
        if (!lk_lora_layer_wrapped(l)) continue;
        long li = lk_model_find_linear(p, lk_lora_layer_name(l));
        assert_true(li >= 0);
        int in_f, out_f, r = lk_lora_layer_rank(l);
        float *W;
        lk_model_linear_info(p, (size_t)li, &in_f, &out_f, &W, NULL);
        const float *A = lk_lora_layer_A(l), *Bm = lk_lora_layer_B(l);
        double sc = lk_lora_layer_scale(l);
        for (int o = 0; o < out_f; o++)
            for (int k = 0; k < in_f; k++) {
                double s = 0;
                for (int j = 0; j < r; j++) s += (double)Bm[o * r + j] * A[j * in_f + k];
                W[o * in_f + k] = (float)(W[o * in_f + k] + sc * s);
            }
    }
    return p;
}

static void assert_logits_close(lk_model *a, lk_model *b, const int *in, int B, int T) {
    assert_int_equal(lk_model_forward(a, in, NULL, B, T, NULL), LK_OK);
    assert_int_equal(lk_model_forward(b, in, NULL, B, T, NULL), LK_OK);
    const float *la = lk_model_logits(a), *lb = lk_model_logits(b);
    double worst = 0;
    for (int i = 0; i < B * T * LK_TASK_VOCAB; i++) worst = fmax(worst, fabs(la[i] - lb[i]));
    fprintf(stderr, "max logit difference %.3g\n", worst);
    assert_true(worst < 1e-4);
}

static void test_hooks_equal_merged_and_offline_fuse(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    char *base = tu_path(dir, "base.safetensors"), *ad = tu_path(dir, "adapter");
    char *fused = tu_path(dir, "fused.safetensors");
    lk_model_config c = cfg();
    lk_model *m;
    assert_int_equal(lk_model_create(&c, 9, &m), LK_OK);
    assert_int_equal(lk_model_save(m, base), LK_OK);
    const char *t[] = {"to_q", "to_k", "to_v", "to_out", "ff.net.0.proj", "ff.net.2"};
    lk_lora_config l = lora_cfg(4, 8, t, 6);
    lk_model_lora *ml;
    assert_int_equal(lk_model_lora_attach(m, &l, 3, &ml), LK_OK);
    randomise_B(lk_model_lora_get(ml), 10);
    int in[16];
    tu_rng r = {12};
    for (int i = 0; i < 16; i++) in[i] = (int)(tu_next(&r) % 11);

    lk_model *ref = merged_copy(m, lk_model_lora_get(ml));
    assert_logits_close(m, ref, in, 2, 8);

    /* PEFT save -> offline fuse -> load the fused checkpoint as a model */
    assert_int_equal(lk_lora_save_peft(lk_model_lora_get(ml), ad), LK_OK);
    lk_fuse_input fi = {ad, 1.0f, LK_FORMAT_AUTO};
    lk_status st = lk_fuse_file(base, &fi, 1, fused, NULL, NULL);
    if (st) fprintf(stderr, "%s\n", lk_last_error());
    assert_int_equal(st, LK_OK);
    lk_model *f;
    assert_int_equal(lk_model_load(fused, &f), LK_OK);
    assert_logits_close(m, f, in, 2, 8);

    lk_model_free(f);
    lk_model_free(ref);
    lk_model_lora_detach(m, ml);
    lk_model_free(m);
    tu_rmtree(dir);
    free(base);
    free(ad);
    free(fused);
    free(dir);
}

static void test_base_loads_through_aliases(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    char *path = tu_path(dir, "wrapped_names.safetensors");
    lk_model_config c = cfg();
    lk_model *src, *dst;
    assert_int_equal(lk_model_create(&c, 21, &src), LK_OK);
    assert_int_equal(lk_model_create(&c, 22, &dst), LK_OK);
    /* write the base under PEFT's wrapped names for every linear */
    size_t n = lk_model_param_count(src);
    lk_tensor *ts = calloc(n, sizeof *ts);
    char (*names)[96] = calloc(n, sizeof *names);
    lk_model_tensors(src, ts);
    for (size_t i = 0; i < n; i++) {
        const char *nm = ts[i].name;
        size_t len = strlen(nm);
        const char *suffix = len > 7 && !strcmp(nm + len - 7, ".weight") ? ".weight" : ".bias";
        size_t sl = strlen(suffix);
        if (strstr(nm, "attn.") || strstr(nm, "ff.net."))
            snprintf(names[i], sizeof names[i], "%.*s.base_layer%s", (int)(len - sl), nm, suffix);
        else
            snprintf(names[i], sizeof names[i], "%s", nm);
        ts[i].name = names[i];
    }
    assert_int_equal(lk_st_save(path, ts, n, NULL, 0), LK_OK);
    /* into the plain model (its own alias lookup) */
    assert_int_equal(lk_model_load_weights(dst, path), LK_OK);
    assert_memory_equal(lk_model_params(dst), lk_model_params(src), lk_model_num_floats(src) * 4);
    /* and into a LoRA-wrapped model through the training API's loader */
    lk_model *dst2;
    assert_int_equal(lk_model_create(&c, 23, &dst2), LK_OK);
    const char *t[] = {"to_q", "ff.net.2"};
    lk_lora_config l = lora_cfg(2, 2, t, 2);
    lk_model_lora *ml;
    assert_int_equal(lk_model_lora_attach(dst2, &l, 1, &ml), LK_OK);
    lk_status st = lk_lora_model_load_base(lk_model_lora_get(ml), path, NULL);
    if (st) fprintf(stderr, "%s\n", lk_last_error());
    assert_int_equal(st, LK_OK);
    assert_memory_equal(lk_model_params(dst2), lk_model_params(src),
                        lk_model_num_floats(src) * 4);
    lk_model_lora_detach(dst2, ml);
    lk_model_free(dst2);
    free(ts);
    free(names);
    lk_model_free(src);
    lk_model_free(dst);
    tu_rmtree(dir);
    free(path);
    free(dir);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_default_targets_match_the_reference_list),
        cmocka_unit_test(test_lora_gradcheck_frozen_base),
        cmocka_unit_test(test_hooks_equal_merged_and_offline_fuse),
        cmocka_unit_test(test_base_loads_through_aliases),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
