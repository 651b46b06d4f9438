/* mpi_lora_sync.c — gradient sync, init agreement and replica checks of the
 * LoRA parameters under MPI (ctest runs it at 1, 2, 3 and 4 ranks; the 2 x 2
 * mesh case runs at 4).
 *
 * Expectations are computed in the test, independently of the sync code:
 * every rank's gradient is a deterministic function of (rank, index) or of a
 * backward on rank-seeded inputs, so each rank regenerates ALL ranks'
 * contributions locally and averages them in double. A rank that skips a
 * layer contributes zeros there; the test finishing at all shows that no
 * rank hung. A failing assert aborts (CMOCKA_TEST_ABORT), so mpirun stops
 * every rank instead of leaving the others waiting in a collective. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mpi_testutil.h"

static lk_comm *g_world;
static int R, N;

static const lk_lora_param_spec g_specs[] = {
    {"blocks.0.attn.to_q.lora_A", 4, 40}, {"blocks.0.attn.to_q.lora_B", 40, 4},
    {"blocks.0.attn.to_k.lora_A", 4, 40}, {"blocks.0.attn.to_k.lora_B", 40, 4},
    {"blocks.1.ff.net.0.proj.lora_A", 4, 40}, {"blocks.1.ff.net.0.proj.lora_B", 97, 4},
    {"proj_out.lora_A", 4, 97},
};
#define N_SPECS 7

/* Rank r's gradient element i of parameter name: fixed, in [-1, 1). */
static float grad_of(int r, const char *name, size_t i) {
    tu_rng g = {(uint64_t)r * 1000003u + i * 7919u + strlen(name) * 131u + (uint64_t)name[strlen(name) - 1]};
    return tu_uniform(&g, -1.0f, 1.0f);
}

static lk_lora_params *make_params(void) {
    lk_lora_params *p;
    assert_int_equal(lk_lora_params_create(g_specs, N_SPECS, &p), LK_OK);
    return p;
}

/* skipf(r, k): whether rank r leaves parameter k's gradient untouched. */
typedef int (*skip_fn)(int r, size_t k);
static int skip_none(int r, size_t k) { (void)r; (void)k; return 0; }
static int skip_some(int r, size_t k) { return r % 2 == 1 && k % 3 == (size_t)r % 3; }

static void fill(lk_lora_params *p, int r, skip_fn skipf) {
    lk_lora_params_zero_grad(p);
    float *g = lk_lora_params_grad(p);
    for (size_t k = 0; k < lk_lora_params_count(p); k++) {
        if (skipf(r, k)) continue;
        int64_t rows, cols;
        lk_lora_params_shape(p, k, &rows, &cols);
        const char *nm = lk_lora_params_name(p, k);
        size_t off = lk_lora_params_offset(p, k);
        for (size_t i = 0; i < (size_t)(rows * cols); i++) g[off + i] = grad_of(r, nm, i);
    }
}

/* Mean over every rank, in double, from the generator. */
static void expect_mean(lk_lora_params *p, skip_fn skipf) {
    const float *g = lk_lora_params_grad(p);
    for (size_t k = 0; k < lk_lora_params_count(p); k++) {
        int64_t rows, cols;
        lk_lora_params_shape(p, k, &rows, &cols);
        const char *nm = lk_lora_params_name(p, k);
        size_t off = lk_lora_params_offset(p, k);
        for (size_t i = 0; i < (size_t)(rows * cols); i++) {
            double acc = 0;
            for (int r = 0; r < N; r++) acc += skipf(r, k) ? 0.0 : grad_of(r, nm, i);
            double want = acc / N;
            if (fabs(g[off + i] - want) > 1e-6) {
                print_error("rank %d: %s[%zu] = %.9g, mean of ranks %.9g\n", R, nm, i, g[off + i], want);
                fail();
            }
        }
    }
}

/* Every rank holds bit-identical bytes (checked with an allgather of a hash). */
static void expect_identical(const float *v, size_t n) {
    uint64_t h = 1469598103934665603ull;
    const unsigned char *b = (const unsigned char *)v;
    for (size_t i = 0; i < n * sizeof(float); i++) h = (h ^ b[i]) * 1099511628211ull;
    uint64_t *all = malloc(sizeof(uint64_t) * N);
    assert_int_equal(lk_comm_allgather(g_world, &h, sizeof h, all), LK_OK);
    for (int r = 0; r < N; r++) assert_true(all[r] == all[0]);
    free(all);
}

static void run_sync(int replicate, int shard, skip_fn skipf, size_t bucket_bytes, int per_param) {
    lk_mesh *mesh;
    assert_int_equal(lk_mesh_create(g_world, replicate, shard, &mesh), LK_OK);
    lk_lora_params *p = make_params();
    fill(p, R, skipf);
    lk_lora_sync_opts o = {.bucket_bytes = bucket_bytes, .per_param = per_param};
    size_t synced = 99, calls = 99;
    assert_int_equal(lk_lora_sync_grads_ex(p, mesh, &o, &synced, &calls), LK_OK);
    expect_mean(p, skipf);
    expect_identical(lk_lora_params_grad(p), lk_lora_params_numel(p));
    /* counts: every dim of size > 1 syncs; buckets or one call per parameter */
    int dims = (replicate > 1) + (shard > 1);
    size_t numel = lk_lora_params_numel(p);
    size_t per_dim = per_param ? N_SPECS
                               : (numel + bucket_bytes / sizeof(float) - 1) / (bucket_bytes / sizeof(float));
    assert_int_equal(synced, dims ? N_SPECS : 0);
    assert_int_equal(calls, (size_t)dims * per_dim);
    lk_lora_params_free(p);
    lk_mesh_free(mesh);
}

static void test_sync_mean_1d(void **state) {
    (void)state;
    run_sync(N, 1, skip_none, 1000, 0);       /* many small buckets */
    run_sync(N, 1, skip_none, 1 << 20, 0);    /* one bucket */
    run_sync(N, 1, skip_none, 1 << 20, 1);    /* one allreduce per parameter */
    run_sync(1, N, skip_none, 4096, 0);       /* the replicated "shard" dim */
    /* the plain entry point on a 1-D mesh */
    lk_mesh *mesh;
    assert_int_equal(lk_mesh_create(g_world, N, 1, &mesh), LK_OK);
    lk_lora_params *p = make_params();
    fill(p, R, skip_none);
    size_t synced;
    assert_int_equal(lk_lora_sync_grads(p, mesh, &synced), LK_OK);
    assert_int_equal(synced, N > 1 ? N_SPECS : 0);
    expect_mean(p, skip_none);
    /* NULL mesh: a no-op */
    assert_int_equal(lk_lora_sync_grads(p, NULL, &synced), LK_OK);
    assert_int_equal(synced, 0);
    lk_lora_params_free(p);
    lk_mesh_free(mesh);
}

static void test_skipped_layers(void **state) {
    (void)state;
    run_sync(N, 1, skip_some, 1000, 0);
    run_sync(N, 1, skip_some, 1 << 20, 1);
}

static void test_mesh_2x2(void **state) {
    (void)state;
    if (N != 4) skip();
    run_sync(2, 2, skip_none, 1000, 0);
    run_sync(2, 2, skip_some, 1 << 20, 0);
    run_sync(2, 2, skip_some, 1 << 20, 1);
    run_sync(4, 1, skip_some, 2048, 0);
}

/* A model-level case: each rank runs the LoRA backward on its own inputs and
 * skips one layer; the expected mean comes from running every rank's
 * backward locally on a second, identically initialised model. */
#define L_IN 12
#define L_OUT 10
#define TOK 3
static const char *const g_layers[] = {"b.0.to_q", "b.0.to_k", "b.1.to_q", "b.1.to_k"};

static lk_lora_model *model_on(float *w) {
    lk_lora_model *m;
    assert_int_equal(lk_lora_model_create(&m), LK_OK);
    tu_rng g = {5};
    for (size_t i = 0; i < 4 * L_IN * L_OUT; i++) w[i] = tu_uniform(&g, -1, 1);
    for (int i = 0; i < 4; i++)
        assert_int_equal(lk_lora_model_add_linear(m, g_layers[i], L_IN, L_OUT, w + i * L_IN * L_OUT, NULL, NULL), LK_OK);
    const char *t[] = {"to_q", "to_k"};
    lk_lora_config c = {.configured = 1, .enable = 1, .rank = 2, .alpha = 4, .targets = (char **)t, .n_targets = 2};
    size_t count;
    assert_int_equal(lk_lora_enable(m, &c, NULL, 2024, &count), LK_OK);
    assert_int_equal(count, 4);
    /* B starts at zero, which would make dA zero: give it values (same on all ranks) */
    lk_lora_params *p = lk_lora_model_params(m);
    for (size_t k = 0; k < lk_lora_params_count(p); k++)
        if (strstr(lk_lora_params_name(p, k), "lora_B")) {
            int64_t rows, cols;
            lk_lora_params_shape(p, k, &rows, &cols);
            lk_lora_rand_uniform(lk_lora_params_data(p) + lk_lora_params_offset(p, k), (size_t)(rows * cols), 1,
                                 lk_lora_params_name(p, k), 0.3f);
        }
    return m;
}

static void rank_backward(lk_lora_model *m, int r) {
    float x[TOK * L_IN], dy[TOK * L_OUT];
    tu_rng g = {(uint64_t)r + 100};
    for (int i = 0; i < TOK * L_IN; i++) x[i] = tu_uniform(&g, -1, 1);
    for (int i = 0; i < TOK * L_OUT; i++) dy[i] = tu_uniform(&g, -1, 1);
    for (int i = 0; i < 4; i++) {
        if (i == r % 4) continue; /* this rank's loss never reached layer r % 4 */
        assert_int_equal(lk_lora_layer_backward(lk_lora_model_find(m, g_layers[i]), NULL, dy, x, TOK), LK_OK);
    }
}

static void test_model_skip_and_init(void **state) {
    (void)state;
    float *w1 = malloc(sizeof(float) * 4 * L_IN * L_OUT), *w2 = malloc(sizeof(float) * 4 * L_IN * L_OUT);
    lk_lora_model *m = model_on(w1), *ref = model_on(w2);
    lk_lora_params *p = lk_lora_model_params(m), *pr = lk_lora_model_params(ref);
    lk_mesh *mesh;
    assert_int_equal(lk_mesh_create(g_world, N, 1, &mesh), LK_OK);
    /* init identical on every rank, without any broadcast */
    expect_identical(lk_lora_params_data(p), lk_lora_params_numel(p));
    size_t drifted = 9;
    assert_int_equal(lk_lora_check_replicas(p, mesh, &drifted), LK_OK);
    assert_int_equal(drifted, 0);
    lk_lora_params_zero_grad(p);
    rank_backward(m, R);
    size_t synced;
    assert_int_equal(lk_lora_sync_grads(p, mesh, &synced), LK_OK);
    /* reference: every rank's backward, locally, then the mean */
    size_t n = lk_lora_params_numel(p);
    double *acc = calloc(n, sizeof(double));
    for (int r = 0; r < N; r++) {
        lk_lora_params_zero_grad(pr);
        rank_backward(ref, r);
        for (size_t i = 0; i < n; i++) acc[i] += lk_lora_params_grad(pr)[i];
    }
    for (size_t i = 0; i < n; i++) assert_float_equal(lk_lora_params_grad(p)[i], acc[i] / N, 1e-5);
    expect_identical(lk_lora_params_grad(p), n);
    /* one identical optimizer step everywhere keeps the replicas in agreement */
    lk_adamw_opts o = {.lr = 1e-2f};
    lk_adamw *opt;
    assert_int_equal(lk_adamw_create(p, &o, &opt), LK_OK);
    float norm;
    assert_int_equal(lk_lora_clip_grad_norm(p, 0.5f, &norm), LK_OK);
    assert_int_equal(lk_adamw_step(opt, p), LK_OK);
    assert_int_equal(lk_lora_check_replicas(p, mesh, &drifted), LK_OK);
    lk_adamw_free(opt);
    free(acc);
    lk_mesh_free(mesh);
    lk_lora_model_free(m);
    lk_lora_model_free(ref);
    free(w1);
    free(w2);
}

static void test_drift_detected(void **state) {
    (void)state;
    lk_mesh *mesh;
    assert_int_equal(lk_mesh_create(g_world, N, 1, &mesh), LK_OK);
    lk_lora_params *p = make_params();
    for (size_t i = 0; i < lk_lora_params_numel(p); i++) lk_lora_params_data(p)[i] = (float)i * 0.001f;
    size_t drifted = 9;
    assert_int_equal(lk_lora_check_replicas(p, mesh, &drifted), LK_OK);
    assert_int_equal(drifted, 0);
    /* the last rank drifts by one ulp in one element of proj_out.lora_A */
    long k = lk_lora_params_find(p, "proj_out.lora_A");
    float *v = lk_lora_params_data(p) + lk_lora_params_offset(p, (size_t)k) + 17;
    float keep = *v;
    if (R == N - 1 && N > 1) *v = nextafterf(*v, 1.0f);
    lk_status s = lk_lora_check_replicas(p, mesh, &drifted);
    if (N > 1) {
        assert_int_equal(s, LK_ERR_MISMATCH); /* on every rank */
        assert_int_equal(drifted, 1);
        char want[96];
        snprintf(want, sizeof want, "first: proj_out.lora_A (ranks differing from rank 0: %d)", N - 1);
        tu_assert_contains(lk_last_error(), want);
        tu_assert_contains(lk_last_error(), "1 of 7 parameters differ");
    } else {
        assert_int_equal(s, LK_OK);
    }
    *v = keep;
    assert_int_equal(lk_lora_check_replicas(p, mesh, &drifted), LK_OK);
    lk_lora_params_free(p);
    lk_mesh_free(mesh);
}

/* Ranks holding different parameter sets fail together, never hang. */
static void test_layout_mismatch(void **state) {
    (void)state;
    if (N == 1) skip();
    lk_mesh *mesh;
    assert_int_equal(lk_mesh_create(g_world, N, 1, &mesh), LK_OK);
    lk_lora_params *p;
    assert_int_equal(lk_lora_params_create(g_specs, R == 0 ? N_SPECS - 1 : N_SPECS, &p), LK_OK);
    size_t synced = 5;
    assert_int_equal(lk_lora_sync_grads(p, mesh, &synced), LK_ERR_MISMATCH);
    tu_assert_contains(lk_last_error(), "the ranks hold different LoRA parameter sets");
    assert_int_equal(synced, 0);
    assert_int_equal(lk_lora_check_replicas(p, mesh, NULL), LK_ERR_MISMATCH);
    lk_lora_params_free(p);
    lk_mesh_free(mesh);
}

int main(int argc, char **argv) {
    g_world = tu_mpi_init(&argc, &argv);
    R = lk_comm_rank(g_world);
    N = lk_comm_size(g_world);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sync_mean_1d),        cmocka_unit_test(test_skipped_layers),
        cmocka_unit_test(test_mesh_2x2),            cmocka_unit_test(test_model_skip_and_init),
        cmocka_unit_test(test_drift_detected),      cmocka_unit_test(test_layout_mismatch),
    };
    return tu_mpi_finish(g_world, cmocka_run_group_tests(tests, NULL, NULL));
}
