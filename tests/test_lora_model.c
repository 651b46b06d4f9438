/* test_lora_model.c — wrapping a host model's layers, init, parameter buffer,
 * base checkpoint loading with key aliases, clipping, AdamW, PEFT save/load.
 *
 * Expectations:
 *  - targeting/freezing/finalize: the reference's rules (substring target,
 *    substring exclude, error listing targets when nothing matched, finalize
 *    errors) applied by hand to the names registered here;
 *  - init: the documented generator re-implemented in this file (XXH3-64 of
 *    the name seeded with the seed, splitmix64 finaliser per counter), plus
 *    the distribution's bound, mean and variance, and order independence;
 *  - clipping and AdamW: torch.nn.utils.clip_grad_norm_ and torch.optim.AdamW
 *    formulas written here in double;
 *  - save/load: bit-identical round trips; the PEFT files parsed here with
 *    jansson and the safetensors reader. */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <xxhash.h>

#include "testutil.h"

/* A toy host model: 2 blocks x (to_q, to_k, to_out.0, ff.net.0.proj), a
 * proj_out, and a norm tensor. Weights in one host allocation. */
typedef struct {
    lk_lora_model *m;
    float *mem;
    size_t used;
} host;

#define D 8
#define F 12

static float *take(host *h, size_t n) {
    float *p = h->mem + h->used;
    h->used += n;
    return p;
}

static const char *const g_names[] = {
    "blocks.0.attn.to_q", "blocks.0.attn.to_k", "blocks.0.attn.to_out.0", "blocks.0.ff.net.0.proj",
    "blocks.1.attn.to_q", "blocks.1.attn.to_k", "blocks.1.attn.to_out.0", "blocks.1.ff.net.0.proj",
    "proj_out",
};
#define N_LAYERS 9

static int layer_in(int i) { return i == 8 ? F : D; }
static int layer_out(int i) { return (i % 4 == 3 && i < 8) ? F : D; }

/* Registers the layers in the order given by perm (NULL = natural). */
static host make_host(const int *perm, uint64_t wseed) {
    host h = {0};
    h.mem = calloc(20000, sizeof(float));
    assert_int_equal(lk_lora_model_create(&h.m), LK_OK);
    tu_rng g = {wseed};
    for (int j = 0; j < N_LAYERS; j++) {
        int i = perm ? perm[j] : j;
        float *W = take(&h, (size_t)layer_in(i) * layer_out(i));
        float *b = i == 8 ? NULL : take(&h, (size_t)layer_out(i));
        for (int k = 0; k < layer_in(i) * layer_out(i); k++) W[k] = tu_uniform(&g, -1, 1);
        for (int k = 0; b && k < layer_out(i); k++) b[k] = tu_uniform(&g, -1, 1);
        assert_int_equal(lk_lora_model_add_linear(h.m, g_names[i], layer_in(i), layer_out(i), W, b, NULL), LK_OK);
    }
    int64_t shape[1] = {D};
    float *nw = take(&h, D);
    for (int k = 0; k < D; k++) nw[k] = 1.0f + 0.1f * (float)k;
    assert_int_equal(lk_lora_model_add_tensor(h.m, "norm_out.weight", 1, shape, nw), LK_OK);
    return h;
}

static void free_host(host *h) {
    lk_lora_model_free(h->m);
    free(h->mem);
}

static lk_lora_config cfg_of(int rank, int alpha, const char **targets, size_t n) {
    lk_lora_config c = {.configured = 1, .enable = 1, .rank = rank, .alpha = alpha, .alpha_given = 1};
    c.targets = (char **)targets;
    c.n_targets = n;
    return c;
}

static void test_targeting_and_freezing(void **state) {
    (void)state;
    host h = make_host(NULL, 1);
    const char *t[] = {"to_q", "to_out"};
    lk_lora_config c = cfg_of(4, 8, t, 2);
    const char *exclude[] = {"blocks.1.", NULL};
    assert_true(lk_lora_model_is_trainable(h.m, "blocks.0.attn.to_q.weight")); /* before enable */
    size_t count = 99;
    assert_int_equal(lk_lora_enable(h.m, &c, exclude, 0, &count), LK_OK);
    /* by hand: to_q and to_out.0 of block 0 only */
    assert_int_equal(count, 2);
    for (int i = 0; i < N_LAYERS; i++)
        assert_int_equal(lk_lora_layer_wrapped(lk_lora_model_find(h.m, g_names[i])), i == 0 || i == 2);
    assert_false(lk_lora_model_is_trainable(h.m, "blocks.0.attn.to_q.weight"));
    assert_false(lk_lora_model_is_trainable(h.m, "blocks.0.attn.to_q.base_layer.weight"));
    assert_false(lk_lora_model_is_trainable(h.m, "norm_out.weight"));
    assert_true(lk_lora_model_is_trainable(h.m, "blocks.0.attn.to_q.lora_A"));
    assert_true(lk_lora_model_is_trainable(h.m, "blocks.0.attn.to_out.0.lora_B"));
    assert_false(lk_lora_model_is_trainable(h.m, "blocks.1.attn.to_q.lora_A"));
    lk_lora_layer *q = lk_lora_model_find(h.m, "blocks.0.attn.to_q");
    assert_int_equal(lk_lora_layer_rank(q), 4);
    assert_float_equal(lk_lora_layer_scale(q), 2.0f, 0.0f);
    assert_int_equal(lk_lora_enable(h.m, &c, NULL, 0, NULL), LK_ERR_STATE);
    assert_int_equal(lk_lora_model_add_linear(h.m, "late", 2, 2, h.mem, NULL, NULL), LK_ERR_STATE);
    size_t fc;
    assert_int_equal(lk_lora_finalize(h.m, &fc), LK_OK);
    assert_int_equal(fc, 2);
    free_host(&h);

    /* defaults (the reference list) catch to_q, to_k and to_out.0 of both blocks */
    h = make_host(NULL, 1);
    lk_lora_config d = cfg_of(2, 2, NULL, 0);
    assert_int_equal(lk_lora_enable(h.m, &d, NULL, 0, &count), LK_OK);
    assert_int_equal(count, 6);
    free_host(&h);
}

static void test_no_match_is_error(void **state) {
    (void)state;
    host h = make_host(NULL, 1);
    const char *t[] = {"q_proj", "v_proj"};
    lk_lora_config c = cfg_of(4, 4, t, 2);
    size_t count = 7;
    assert_int_equal(lk_lora_enable(h.m, &c, NULL, 0, &count), LK_ERR_CONFIG);
    tu_assert_contains(lk_last_error(), "no LoRA-compatible layers were found for the requested target modules [q_proj, v_proj]");
    assert_int_equal(count, 0);
    /* everything matched is excluded: also nothing */
    const char *t2[] = {"to_q"};
    lk_lora_config c2 = cfg_of(4, 4, t2, 1);
    const char *ex[] = {"attn", NULL};
    assert_int_equal(lk_lora_enable(h.m, &c2, ex, 0, NULL), LK_ERR_CONFIG);
    tu_assert_contains(lk_last_error(), "(excluded: [attn]");
    /* the model is unchanged: finalize finds no wrappers, enable still works */
    assert_int_equal(lk_lora_finalize(h.m, NULL), LK_ERR_STATE);
    tu_assert_contains(lk_last_error(), "no training LoRA wrappers were found after checkpoint loading");
    assert_null(lk_lora_model_params(h.m));
    assert_int_equal(lk_lora_enable(h.m, &c2, NULL, 0, &count), LK_OK);
    assert_int_equal(count, 2);
    /* rank <= 0 refused even if a caller builds the config by hand */
    free_host(&h);
    h = make_host(NULL, 1);
    lk_lora_config c3 = cfg_of(0, 4, t2, 1);
    assert_int_equal(lk_lora_enable(h.m, &c3, NULL, 0, NULL), LK_ERR_CONFIG);
    free_host(&h);
}

/* The documented generator, re-implemented. */
static float ref_uniform(uint64_t seed, const char *name, size_t i, float bound) {
    uint64_t key = XXH3_64bits_withSeed(name, strlen(name), seed);
    uint64_t z = key + (uint64_t)(i + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    double u = (double)(z >> 40) / 16777216.0;
    return (float)(bound * (2.0 * u - 1.0));
}

static void test_init(void **state) {
    (void)state;
    host a = make_host(NULL, 1);
    int perm[N_LAYERS] = {8, 3, 7, 1, 0, 5, 2, 6, 4};
    host b = make_host(perm, 2); /* other order, other base weights */
    lk_lora_config c = cfg_of(3, 3, NULL, 0);
    assert_int_equal(lk_lora_enable(a.m, &c, NULL, 1234, NULL), LK_OK);
    assert_int_equal(lk_lora_enable(b.m, &c, NULL, 1234, NULL), LK_OK);
    lk_lora_params *pa = lk_lora_model_params(a.m), *pb = lk_lora_model_params(b.m);
    assert_int_equal(lk_lora_params_numel(pa), lk_lora_params_numel(pb));
    assert_memory_equal(lk_lora_params_data(pa), lk_lora_params_data(pb), lk_lora_params_numel(pa) * sizeof(float));
    /* values: the formula; A bound 1/sqrt(in), B zero */
    lk_lora_layer *q = lk_lora_model_find(a.m, "blocks.1.attn.to_q");
    float bound = 1.0f / sqrtf((float)D);
    for (size_t i = 0; i < 3 * D; i++)
        assert_float_equal(lk_lora_layer_A(q)[i], ref_uniform(1234, "blocks.1.attn.to_q.lora_A", i, bound), 0.0f);
    for (size_t i = 0; i < D * 3; i++) assert_float_equal(lk_lora_layer_B(q)[i], 0.0f, 0.0f);
    /* a different seed gives different values */
    host c2 = make_host(NULL, 1);
    assert_int_equal(lk_lora_enable(c2.m, &c, NULL, 1235, NULL), LK_OK);
    assert_memory_not_equal(lk_lora_layer_A(lk_lora_model_find(c2.m, "blocks.1.attn.to_q")), lk_lora_layer_A(q),
                            3 * D * sizeof(float));
    /* distribution: U(-b, b) has mean 0, variance b^2/3 */
    float big[40000];
    lk_lora_rand_uniform(big, 40000, 9, "x.lora_A", 0.5f);
    double mean = 0, var = 0, lo = 1, hi = -1;
    for (int i = 0; i < 40000; i++) {
        mean += big[i];
        lo = fmin(lo, big[i]);
        hi = fmax(hi, big[i]);
    }
    mean /= 40000;
    for (int i = 0; i < 40000; i++) var += (big[i] - mean) * (big[i] - mean);
    var /= 40000;
    assert_true(fabs(mean) < 0.01);
    assert_true(fabs(var - 0.25 / 3) < 0.003);
    assert_true(lo >= -0.5 && hi < 0.5 && lo < -0.49 && hi > 0.49);
    free_host(&a);
    free_host(&b);
    free_host(&c2);
}

static void test_params_layout(void **state) {
    (void)state;
    int perm[N_LAYERS] = {8, 3, 7, 1, 0, 5, 2, 6, 4};
    host h = make_host(perm, 1);
    lk_lora_config c = cfg_of(2, 4, NULL, 0);
    assert_int_equal(lk_lora_enable(h.m, &c, NULL, 0, NULL), LK_OK);
    lk_lora_params *p = lk_lora_model_params(h.m);
    assert_int_equal(lk_lora_params_count(p), 12);
    size_t off = 0;
    for (size_t i = 0; i < 12; i++) {
        if (i) assert_true(strcmp(lk_lora_params_name(p, i - 1), lk_lora_params_name(p, i)) < 0);
        assert_int_equal(lk_lora_params_offset(p, i), off);
        int64_t r, cc;
        lk_lora_params_shape(p, i, &r, &cc);
        off += (size_t)(r * cc);
        assert_int_equal(lk_lora_params_find(p, lk_lora_params_name(p, i)), (long)i);
    }
    assert_int_equal(off, lk_lora_params_numel(p));
    assert_string_equal(lk_lora_params_name(p, 0), "blocks.0.attn.to_k.lora_A");
    /* the layer pointers point into the one buffer */
    lk_lora_layer *k = lk_lora_model_find(h.m, "blocks.0.attn.to_k");
    assert_ptr_equal(lk_lora_layer_A(k), lk_lora_params_data(p));
    assert_ptr_equal(lk_lora_layer_dA(k), lk_lora_params_grad(p));
    assert_int_equal(lk_lora_params_find(p, "nope"), -1);
    /* standalone sets: duplicates and bad shapes refused */
    lk_lora_param_spec dup[2] = {{"a", 1, 2}, {"a", 2, 1}};
    lk_lora_params *q;
    assert_int_equal(lk_lora_params_create(dup, 2, &q), LK_ERR_ARG);
    lk_lora_param_spec bad[1] = {{"a", 0, 2}};
    assert_int_equal(lk_lora_params_create(bad, 1, &q), LK_ERR_SHAPE);
    free_host(&h);
}

/* A base checkpoint written by the test with plain "<m>.weight" names. */
static void write_base(const char *path, host *src, int with_lora_q, int alias_style) {
    lk_tensor t[40];
    char names[40][96];
    size_t n = 0;
    for (int i = 0; i < N_LAYERS; i++) {
        lk_lora_layer *l = lk_lora_model_find(src->m, g_names[i]);
        for (int part = 0; part < 2; part++) {
            if (part && !lk_lora_layer_bias(l)) continue;
            snprintf(names[n], sizeof names[n], "%s.%s%s", g_names[i],
                     alias_style && i == 0 ? "base_layer." : "", part ? "bias" : "weight");
            t[n] = (lk_tensor){.name = names[n], .dtype = LK_DTYPE_F32, .ndim = part ? 1 : 2,
                               .shape = {layer_out(i), layer_in(i)},
                               .nbytes = sizeof(float) * layer_out(i) * (part ? 1 : layer_in(i)),
                               .data = (void *)(part ? lk_lora_layer_bias(l) : lk_lora_layer_weight(l))};
            n++;
        }
    }
    static float nw[D];
    for (int k = 0; k < D; k++) nw[k] = -2.0f;
    t[n++] = (lk_tensor){.name = "norm_out.weight", .dtype = LK_DTYPE_F32, .ndim = 1, .shape = {D},
                         .nbytes = sizeof nw, .data = nw};
    static float qa[2 * D];
    for (int k = 0; k < 2 * D; k++) qa[k] = 0.125f * (float)k;
    if (with_lora_q)
        t[n++] = (lk_tensor){.name = "blocks.0.attn.to_q.lora_A", .dtype = LK_DTYPE_F32, .ndim = 2,
                             .shape = {2, D}, .nbytes = sizeof qa, .data = qa};
    assert_int_equal(lk_st_save(path, t, n, NULL, 0), LK_OK);
}

static void test_load_base_aliases(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    char *p1 = tu_path(dir, "base.safetensors"), *p2 = tu_path(dir, "base2.safetensors");
    host src = make_host(NULL, 77);
    write_base(p1, &src, 0, 0);
    write_base(p2, &src, 1, 1);
    host h = make_host(NULL, 1);
    const char *t[] = {"to_q"};
    lk_lora_config c = cfg_of(2, 2, t, 1);
    assert_int_equal(lk_lora_enable(h.m, &c, NULL, 42, NULL), LK_OK);
    lk_lora_params *p = lk_lora_model_params(h.m);
    float *init = malloc(lk_lora_params_numel(p) * sizeof(float));
    memcpy(init, lk_lora_params_data(p), lk_lora_params_numel(p) * sizeof(float));
    /* spoil the adapters: a load without them re-initialises from the seed */
    for (size_t i = 0; i < lk_lora_params_numel(p); i++) lk_lora_params_data(p)[i] = 9.0f;
    assert_int_equal(lk_lora_model_load_base(h.m, p1, NULL), LK_OK);
    for (int i = 0; i < N_LAYERS; i++) {
        lk_lora_layer *a = lk_lora_model_find(h.m, g_names[i]), *b = lk_lora_model_find(src.m, g_names[i]);
        assert_memory_equal(lk_lora_layer_weight(a), lk_lora_layer_weight(b),
                            sizeof(float) * layer_in(i) * layer_out(i));
    }
    assert_memory_equal(lk_lora_params_data(p), init, lk_lora_params_numel(p) * sizeof(float));
    /* the other spelling (<m>.base_layer.weight) and a stored lora_A load too */
    assert_int_equal(lk_lora_model_load_base(h.m, p2, NULL), LK_OK);
    lk_lora_layer *q0 = lk_lora_model_find(h.m, "blocks.0.attn.to_q");
    assert_float_equal(lk_lora_layer_A(q0)[5], 0.625f, 0.0f);
    assert_float_equal(lk_lora_layer_B(q0)[3], 0.0f, 0.0f); /* absent B: zero */
    /* errors leave every weight untouched */
    float before = lk_lora_layer_weight(q0)[0];
    lk_tensor bad = {.name = "blocks.0.attn.to_q.weight", .dtype = LK_DTYPE_F32, .ndim = 2, .shape = {D, D - 1},
                     .nbytes = sizeof(float) * D * (D - 1), .data = calloc(D * D, sizeof(float))};
    char *p3 = tu_path(dir, "bad.safetensors");
    assert_int_equal(lk_st_save(p3, &bad, 1, NULL, 0), LK_OK);
    assert_int_equal(lk_lora_model_load_base(h.m, p3, NULL), LK_ERR_SHAPE);
    tu_assert_contains(lk_last_error(), "blocks.0.attn.to_q.weight is [8, 7] but the model expects [8, 8]");
    assert_float_equal(lk_lora_layer_weight(q0)[0], before, 0.0f);
    bad.shape[1] = D;
    bad.nbytes = sizeof(float) * D * D;
    assert_int_equal(lk_st_save(p3, &bad, 1, NULL, 0), LK_OK);
    assert_int_equal(lk_lora_model_load_base(h.m, p3, NULL), LK_ERR_FORMAT); /* the rest is missing */
    tu_assert_contains(lk_last_error(), "missing tensor");
    assert_float_equal(lk_lora_layer_weight(q0)[0], before, 0.0f);
    lk_lora_load_opts partial = {.allow_missing = 1};
    assert_int_equal(lk_lora_model_load_base(h.m, p3, &partial), LK_OK);
    assert_float_equal(lk_lora_layer_weight(q0)[0], 0.0f, 0.0f);
    /* an unexpected tensor */
    lk_tensor extra = {.name = "mystery.weight", .dtype = LK_DTYPE_F32, .ndim = 1, .shape = {1}, .nbytes = 4,
                       .data = bad.data};
    assert_int_equal(lk_st_save(p3, &extra, 1, NULL, 0), LK_OK);
    assert_int_equal(lk_lora_model_load_base(h.m, p3, &partial), LK_ERR_UNMATCHED);
    tu_assert_contains(lk_last_error(), "'mystery.weight' matches nothing in the model");
    /* save_base writes the plain names: a fresh unwrapped model loads it */
    char *p4 = tu_path(dir, "saved.safetensors");
    assert_int_equal(lk_lora_model_save_base(h.m, p4), LK_OK);
    host fresh = make_host(NULL, 5);
    assert_int_equal(lk_lora_model_load_base(fresh.m, p4, NULL), LK_OK);
    assert_memory_equal(fresh.mem, h.mem, h.used * sizeof(float));
    free(bad.data);
    free(init);
    free_host(&h);
    free_host(&src);
    free_host(&fresh);
    tu_rmtree(dir);
    free(dir); free(p1); free(p2); free(p3); free(p4);
}

static void test_clip(void **state) {
    (void)state;
    lk_lora_param_spec s[2] = {{"b", 2, 3}, {"a", 1, 4}};
    lk_lora_params *p;
    assert_int_equal(lk_lora_params_create(s, 2, &p), LK_OK);
    float *g = lk_lora_params_grad(p);
    double ss = 0;
    for (int i = 0; i < 10; i++) {
        g[i] = (float)(i - 4) * 0.5f;
        ss += (double)g[i] * g[i];
    }
    float norm;
    assert_int_equal(lk_lora_clip_grad_norm(p, 100.0f, &norm), LK_OK);
    assert_float_equal(norm, sqrt(ss), 1e-5);
    assert_float_equal(g[0], -2.0f, 0.0f); /* below max: untouched */
    assert_int_equal(lk_lora_clip_grad_norm(p, 1.0f, &norm), LK_OK);
    double coef = 1.0 / (sqrt(ss) + 1e-6); /* torch: max_norm / (norm + 1e-6) */
    for (int i = 0; i < 10; i++) assert_float_equal(g[i], (i - 4) * 0.5 * coef, 1e-6);
    g[7] = NAN;
    float keep = g[1];
    assert_int_equal(lk_lora_clip_grad_norm(p, 1.0f, &norm), LK_ERR_NONFINITE);
    tu_assert_contains(lk_last_error(), "b: gradient element 3 is not finite");
    assert_float_equal(g[1], keep, 0.0f);
    lk_lora_params_free(p);
}

/* torch.optim.AdamW step (single tensor), in double. */
static void ref_adamw(double *w, double *m, double *v, const float *g, size_t n, int t, double lr, double b1,
                      double b2, double eps, double wd) {
    double bc1 = 1 - pow(b1, t), bc2 = 1 - pow(b2, t);
    for (size_t i = 0; i < n; i++) {
        w[i] *= 1 - lr * wd;
        m[i] = b1 * m[i] + (1 - b1) * g[i];
        v[i] = b2 * v[i] + (1 - b2) * (double)g[i] * g[i];
        w[i] -= lr / bc1 * m[i] / (sqrt(v[i]) / sqrt(bc2) + eps);
    }
}

static void test_adamw(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    lk_lora_param_spec s[2] = {{"x.lora_A", 2, 5}, {"x.lora_B", 3, 2}};
    lk_lora_params *p, *q;
    assert_int_equal(lk_lora_params_create(s, 2, &p), LK_OK);
    assert_int_equal(lk_lora_params_create(s, 2, &q), LK_OK);
    size_t n = lk_lora_params_numel(p);
    double w[16], m[16] = {0}, v[16] = {0};
    tu_rng r = {3};
    for (size_t i = 0; i < n; i++) w[i] = lk_lora_params_data(p)[i] = tu_uniform(&r, -1, 1);
    lk_adamw_opts o = {.lr = 0.01f, .weight_decay = 0.1f};
    lk_adamw *opt, *opt2;
    assert_int_equal(lk_adamw_create(p, &o, &opt), LK_OK);
    for (int t = 1; t <= 5; t++) {
        for (size_t i = 0; i < n; i++) lk_lora_params_grad(p)[i] = tu_uniform(&r, -1, 1);
        assert_int_equal(lk_adamw_step(opt, p), LK_OK);
        ref_adamw(w, m, v, lk_lora_params_grad(p), n, t, 0.01, 0.9, 0.999, 1e-8, 0.1);
        for (size_t i = 0; i < n; i++) assert_float_equal(lk_lora_params_data(p)[i], w[i], 2e-6);
        if (t == 3) { /* save here, resume a copy, and compare the next steps bit for bit */
            assert_int_equal(lk_adamw_save(opt, p, dir), LK_OK);
            memcpy(lk_lora_params_data(q), lk_lora_params_data(p), n * sizeof(float));
            assert_int_equal(lk_adamw_create(q, &o, &opt2), LK_OK);
            assert_int_equal(lk_adamw_load(opt2, q, dir), LK_OK);
            assert_int_equal(lk_adamw_steps(opt2), 3);
        }
        if (t > 3) {
            memcpy(lk_lora_params_grad(q), lk_lora_params_grad(p), n * sizeof(float));
            assert_int_equal(lk_adamw_step(opt2, q), LK_OK);
            assert_memory_equal(lk_lora_params_data(q), lk_lora_params_data(p), n * sizeof(float));
        }
    }
    /* a state for other parameters is refused, the state unchanged */
    lk_lora_param_spec s2[1] = {{"y.lora_A", 4, 4}};
    lk_lora_params *other;
    assert_int_equal(lk_lora_params_create(s2, 1, &other), LK_OK);
    lk_adamw *o3;
    assert_int_equal(lk_adamw_create(other, &o, &o3), LK_OK);
    assert_int_equal(lk_adamw_load(o3, other, dir), LK_ERR_FORMAT);
    tu_assert_contains(lk_last_error(), "missing optimizer state 'y.lora_A.exp_avg'");
    assert_int_equal(lk_adamw_steps(o3), 0);
    lk_adamw_opts badopt = {.lr = -1};
    lk_adamw *o4;
    assert_int_equal(lk_adamw_create(p, &badopt, &o4), LK_ERR_ARG);
    lk_adamw_free(o3);
    lk_lora_params_free(other);
    lk_adamw_free(opt);
    lk_adamw_free(opt2);
    lk_lora_params_free(p);
    lk_lora_params_free(q);
    tu_rmtree(dir);
    free(dir);
}

static void test_peft_roundtrip(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    char *ad = tu_path(dir, "adapter");
    host h = make_host(NULL, 1);
    const char *t[] = {"to_q", "to_out", "ff.net"};
    lk_lora_config c = cfg_of(3, 6, t, 3);
    const char *ex[] = {"blocks.1.ff", NULL};
    size_t count;
    assert_int_equal(lk_lora_enable(h.m, &c, ex, 7, &count), LK_OK);
    assert_int_equal(count, 5);
    lk_lora_params *p = lk_lora_model_params(h.m);
    tu_rng r = {8};
    for (size_t i = 0; i < lk_lora_params_numel(p); i++) lk_lora_params_data(p)[i] = tu_uniform(&r, -1, 1);
    assert_int_equal(lk_lora_save_peft(h.m, ad), LK_OK);

    /* the files, read independently */
    char *js = tu_path(ad, "adapter_config.json"), *st_path = tu_path(ad, "adapter_model.safetensors");
    json_error_t je;
    json_t *j = json_load_file(js, 0, &je);
    assert_non_null(j);
    assert_string_equal(json_string_value(json_object_get(j, "peft_type")), "LORA");
    assert_int_equal(json_integer_value(json_object_get(j, "r")), 3);
    assert_int_equal(json_integer_value(json_object_get(j, "lora_alpha")), 6);
    assert_true(json_is_false(json_object_get(j, "use_rslora")));
    assert_true(json_is_false(json_object_get(j, "fan_in_fan_out")));
    assert_string_equal(json_string_value(json_object_get(j, "bias")), "none");
    json_t *tm = json_object_get(j, "target_modules");
    assert_int_equal(json_array_size(tm), 5);
    assert_string_equal(json_string_value(json_array_get(tm, 0)), "blocks.0.attn.to_q");
    json_decref(j);
    lk_st *st;
    assert_int_equal(lk_st_open(st_path, &st), LK_OK);
    assert_int_equal(lk_st_count(st), 10);
    long ia = lk_st_find(st, "base_model.model.blocks.0.ff.net.0.proj.lora_A.weight");
    long ib = lk_st_find(st, "base_model.model.blocks.0.ff.net.0.proj.lora_B.weight");
    assert_true(ia >= 0 && ib >= 0);
    const lk_tensor *ta = lk_st_tensor(st, (size_t)ia), *tb = lk_st_tensor(st, (size_t)ib);
    assert_int_equal(ta->dtype, LK_DTYPE_F32);
    assert_int_equal(ta->shape[0], 3);
    assert_int_equal(ta->shape[1], D);
    assert_int_equal(tb->shape[0], F);
    assert_int_equal(tb->shape[1], 3);
    lk_lora_layer *ff = lk_lora_model_find(h.m, "blocks.0.ff.net.0.proj");
    assert_memory_equal(ta->data, lk_lora_layer_A(ff), ta->nbytes);
    assert_memory_equal(tb->data, lk_lora_layer_B(ff), tb->nbytes);
    lk_st_close(st);

    /* load into a fresh model (other registration order): bit-identical */
    int perm[N_LAYERS] = {8, 3, 7, 1, 0, 5, 2, 6, 4};
    host g = make_host(perm, 1);
    assert_int_equal(lk_lora_enable(g.m, &c, ex, 99, NULL), LK_OK);
    assert_int_equal(lk_lora_load_peft(g.m, ad), LK_OK);
    lk_lora_params *pg = lk_lora_model_params(g.m);
    assert_int_equal(lk_lora_params_numel(pg), lk_lora_params_numel(p));
    assert_memory_equal(lk_lora_params_data(pg), lk_lora_params_data(p), lk_lora_params_numel(p) * sizeof(float));
    assert_int_equal(lk_lora_finalize(g.m, &count), LK_OK);
    assert_int_equal(count, 5);

    /* every allocation of the load failed in turn (the paths, the config,
     * the checkpoint's, the match table, each key's name): a clean NOMEM and
     * the parameters as before; then the load goes through, as above */
    host g2 = make_host(perm, 1);
    assert_int_equal(lk_lora_enable(g2.m, &c, ex, 99, NULL), LK_OK);
    lk_lora_params *p2 = lk_lora_model_params(g2.m);
    const size_t nb2 = lk_lora_params_numel(p2) * sizeof(float);
    float *before2 = malloc(nb2);
    memcpy(before2, lk_lora_params_data(p2), nb2);
    unsigned long k_ok = 0;
    for (unsigned long kf = 1; kf < 500 && !k_ok; kf++) {
        lk_alloc_fail_at(kf);
        lk_status s = lk_lora_load_peft(g2.m, ad);
        lk_alloc_fail_at(0);
        if (s == LK_OK) {
            k_ok = kf;
        } else {
            assert_int_equal(s, LK_ERR_NOMEM);
            assert_memory_equal(lk_lora_params_data(p2), before2, nb2);
        }
    }
    assert_true(k_ok > 5); /* the walk failed some allocations before the load went through */
    assert_memory_equal(lk_lora_params_data(p2), lk_lora_params_data(p), nb2);
    free(before2);
    free_host(&g2);

    /* mismatches are refused and change nothing */
    host k = make_host(NULL, 1);
    lk_lora_config c4 = cfg_of(4, 6, t, 3);
    assert_int_equal(lk_lora_enable(k.m, &c4, ex, 1, NULL), LK_OK);
    lk_lora_params *pk = lk_lora_model_params(k.m);
    float first = lk_lora_params_data(pk)[0];
    assert_int_equal(lk_lora_load_peft(k.m, ad), LK_ERR_CONFIG);
    tu_assert_contains(lk_last_error(), "r=3 lora_alpha=6 but the model was enabled with rank=4 alpha=6");
    assert_float_equal(lk_lora_params_data(pk)[0], first, 0.0f);
    host k2 = make_host(NULL, 1);
    assert_int_equal(lk_lora_enable(k2.m, &c, NULL, 1, NULL), LK_OK); /* one more layer wrapped */
    assert_int_equal(lk_lora_load_peft(k2.m, ad), LK_ERR_FORMAT);
    tu_assert_contains(lk_last_error(), "missing 'base_model.model.blocks.1.ff.net.0.proj.lora_A.weight'");
    host k3 = make_host(NULL, 1);
    const char *ex2[] = {"ff.net", NULL};
    assert_int_equal(lk_lora_enable(k3.m, &c, ex2, 1, NULL), LK_OK); /* one fewer */
    assert_int_equal(lk_lora_load_peft(k3.m, ad), LK_ERR_UNMATCHED);
    tu_assert_contains(lk_last_error(), "'base_model.model.blocks.0.ff.net.0.proj.lora_A.weight' matches no wrapped layer");
    assert_int_equal(lk_lora_load_peft(k3.m, "/nonexistent/adapter"), LK_ERR_IO);

    free_host(&h); free_host(&g); free_host(&k); free_host(&k2); free_host(&k3);
    tu_rmtree(dir);
    free(dir); free(ad); free(js); free(st_path);
}

/* Every allocation of load_base failed in turn (the checkpoint's, the
 * match table's, the staging buffer's): a clean NOMEM, and the model's
 * weights and adapters exactly as before; then the load succeeds. */
static void test_load_base_alloc_failures(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    char *path = tu_path(dir, "base.safetensors");
    host src = make_host(NULL, 77);
    write_base(path, &src, 1, 1);
    host h = make_host(NULL, 1);
    const char *t[] = {"to_q"};
    lk_lora_config c = cfg_of(2, 2, t, 1);
    assert_int_equal(lk_lora_enable(h.m, &c, NULL, 42, NULL), LK_OK);
    lk_lora_params *p = lk_lora_model_params(h.m);
    lk_lora_layer *q0 = lk_lora_model_find(h.m, "blocks.0.attn.to_q");
    const size_t np = lk_lora_params_numel(p) * sizeof(float), nw = sizeof(float) * layer_in(0) * layer_out(0);
    float *pa = malloc(np), *wa = malloc(nw);
    memcpy(pa, lk_lora_params_data(p), np);
    memcpy(wa, lk_lora_layer_weight(q0), nw);
    int ok = 0;
    unsigned long k = 1;
    for (; k < 500 && !ok; k++) {
        lk_alloc_fail_at(k);
        lk_status s = lk_lora_model_load_base(h.m, path, NULL);
        lk_alloc_fail_at(0);
        if (s == LK_OK) {
            ok = 1;
        } else {
            assert_int_equal(s, LK_ERR_NOMEM);
            assert_memory_equal(lk_lora_params_data(p), pa, np);
            assert_memory_equal(lk_lora_layer_weight(q0), wa, nw);
        }
    }
    assert_true(ok);
    assert_true(k > 3); /* the walk failed some allocations before the load went through */
    assert_float_equal(lk_lora_layer_A(q0)[5], 0.625f, 0.0f); /* the stored lora_A, as in load_base_aliases */
    free(pa);
    free(wa);
    free_host(&h);
    free_host(&src);
    tu_rmtree(dir);
    free(path);
    free(dir);
}

/* Every allocation of enable failed in turn: clean NOMEM, model unchanged. */
static void test_enable_alloc_failures(void **state) {
    (void)state;
    int ok = 0;
    for (unsigned long k = 1; k < 300 && !ok; k++) {
        host h = make_host(NULL, 1);
        lk_lora_config c = cfg_of(2, 2, NULL, 0);
        size_t count = 5;
        lk_alloc_fail_at(k);
        lk_status s = lk_lora_enable(h.m, &c, NULL, 0, &count);
        lk_alloc_fail_at(0);
        if (s == LK_OK) {
            ok = 1;
            assert_int_equal(count, 6);
        } else {
            assert_int_equal(s, LK_ERR_NOMEM);
            assert_null(lk_lora_model_params(h.m));
            assert_int_equal(lk_lora_enable(h.m, &c, NULL, 0, &count), LK_OK);
        }
        free_host(&h);
    }
    assert_true(ok);
}

/* A save (fn(ctx)) with every allocation failed in turn: a clean
 * LK_ERR_NOMEM and no file at path; then the save writes the bytes of ref
 * (an unbroken save's). */
static void save_walk(lk_status (*fn)(void *), void *ctx, const char *path, const char *ref) {
    unsigned long k = 1;
    for (;; k++) {
        lk_alloc_fail_at(k);
        lk_status s = fn(ctx);
        lk_alloc_fail_at(0);
        if (s == LK_OK) break;
        assert_int_equal(s, LK_ERR_NOMEM);
        assert_false(tu_exists(path));
    }
    assert_true(k > 2);
    size_t na, nb;
    void *a = tu_read_file(path, &na), *b = tu_read_file(ref, &nb);
    assert_true(a && b && na == nb && !memcmp(a, b, na));
    free(a);
    free(b);
}

typedef struct save_args {
    lk_lora_model *m;
    lk_adamw *opt;
    const char *where;
} save_args;

static lk_status save_base(void *ctx) {
    save_args *a = ctx;
    return lk_lora_model_save_base(a->m, a->where);
}

static lk_status save_adamw(void *ctx) {
    save_args *a = ctx;
    return lk_adamw_save(a->opt, lk_lora_model_params(a->m), a->where);
}

/* Every allocation of lk_lora_model_save_base and of lk_adamw_save failed
 * in turn: see save_walk. (lk_lora_params_create's are walked through
 * lk_lora_enable by test_enable_alloc_failures.) */
static void test_save_alloc_failures(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    char *ref = tu_path(dir, "ref.safetensors"), *out = tu_path(dir, "out.safetensors");
    char *ref_opt = tu_path(dir, "ref_opt"), *out_opt = tu_path(dir, "out_opt");
    host h = make_host(NULL, 1);
    lk_lora_config c = cfg_of(2, 2, NULL, 0);
    assert_int_equal(lk_lora_enable(h.m, &c, NULL, 42, NULL), LK_OK);
    assert_int_equal(lk_lora_model_save_base(h.m, ref), LK_OK);
    save_args sa = {h.m, NULL, out};
    save_walk(save_base, &sa, out, ref);
    lk_lora_params *p = lk_lora_model_params(h.m);
    lk_adamw_opts o = {.lr = 0.1f};
    lk_adamw *opt;
    assert_int_equal(lk_adamw_create(p, &o, &opt), LK_OK);
    lk_lora_params_grad(p)[0] = 1;
    assert_int_equal(lk_adamw_step(opt, p), LK_OK);
    assert_int_equal(mkdir(ref_opt, 0777), 0);
    assert_int_equal(mkdir(out_opt, 0777), 0);
    assert_int_equal(lk_adamw_save(opt, p, ref_opt), LK_OK);
    char *ref_file = tu_path(ref_opt, "optimizer.safetensors"), *out_file = tu_path(out_opt, "optimizer.safetensors");
    sa = (save_args){h.m, opt, out_opt};
    save_walk(save_adamw, &sa, out_file, ref_file);
    lk_adamw_free(opt);
    free_host(&h);
    tu_rmtree(dir);
    free(dir); free(ref); free(out); free(ref_opt); free(out_opt); free(ref_file); free(out_file);
}

/* Names far longer than any fixed buffer: every path keeps them whole. */
static void test_long_names(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    char *base = tu_path(dir, "base.safetensors"), *ad = tu_path(dir, "adapter");
    char name[1600];
    memset(name, 'x', sizeof name);
    memcpy(name + 1500, ".attn.to_q", 11);
    float W[6] = {1, 2, 3, 4, 5, 6}, b[2] = {7, 8};
    lk_lora_model *m;
    assert_int_equal(lk_lora_model_create(&m), LK_OK);
    assert_int_equal(lk_lora_model_add_linear(m, name, 3, 2, W, b, NULL), LK_OK);
    lk_lora_config c = cfg_of(1, 1, NULL, 0);
    assert_int_equal(lk_lora_enable(m, &c, NULL, 3, NULL), LK_OK);
    lk_lora_layer *l = lk_lora_model_find(m, name);
    assert_int_equal(lk_lora_model_save_base(m, base), LK_OK);
    W[0] = -1;
    assert_int_equal(lk_lora_model_load_base(m, base, NULL), LK_OK); /* via the <m>.weight alias */
    assert_float_equal(W[0], 1.0f, 0.0f);
    lk_lora_layer_B(l)[1] = 0.5f;
    float a0 = lk_lora_layer_A(l)[2];
    assert_int_equal(lk_lora_save_peft(m, ad), LK_OK);
    lk_lora_layer_A(l)[2] = 0;
    lk_lora_layer_B(l)[1] = 0;
    assert_int_equal(lk_lora_load_peft(m, ad), LK_OK);
    assert_float_equal(lk_lora_layer_A(l)[2], a0, 0.0f);
    assert_float_equal(lk_lora_layer_B(l)[1], 0.5f, 0.0f);
    lk_lora_params *p = lk_lora_model_params(m);
    lk_adamw_opts o = {.lr = 0.1f};
    lk_adamw *opt;
    assert_int_equal(lk_adamw_create(p, &o, &opt), LK_OK);
    lk_lora_params_grad(p)[0] = 1;
    assert_int_equal(lk_adamw_step(opt, p), LK_OK);
    assert_int_equal(lk_adamw_save(opt, p, ad), LK_OK);
    assert_int_equal(lk_adamw_load(opt, p, ad), LK_OK);
    assert_int_equal(lk_adamw_steps(opt), 1);
    lk_adamw_free(opt);
    lk_lora_model_free(m);
    tu_rmtree(dir);
    free(dir); free(base); free(ad);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_targeting_and_freezing),
        cmocka_unit_test(test_no_match_is_error),
        cmocka_unit_test(test_init),
        cmocka_unit_test(test_params_layout),
        cmocka_unit_test(test_load_base_aliases),
        cmocka_unit_test(test_clip),
        cmocka_unit_test(test_adamw),
        cmocka_unit_test(test_peft_roundtrip),
        cmocka_unit_test(test_enable_alloc_failures),
        cmocka_unit_test(test_load_base_alloc_failures),
        cmocka_unit_test(test_save_alloc_failures),
        cmocka_unit_test(test_long_names),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
