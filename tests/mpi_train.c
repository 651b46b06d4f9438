/* mpi_train.c — data-parallel training gives the same result at any rank
 * count (ctest runs this at 1..4 ranks).
 *
 * Every rank runs lk_train_run (what `lorakit train` runs) on the world with
 * the same config; rank 0 then runs the same config alone on a one-process
 * communicator. The expectation is that single-process run: after 20 steps
 * every saved tensor (LoRA adapter, and in a second case the full model) must
 * equal it within 1e-4 relative to the tensor's largest magnitude (the only
 * differences allowed are float summation order in the gradient average).
 * The replicas must also be bit-identical (lk_lora_check_replicas, reported
 * in the result), and the adapter must actually have moved from its init. */
#include <mpi.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"
#include "lorakit/comm_mpi.h"

static lk_comm *g_world;
static int R, N;
static char g_dir[512];

static void write_cfg(const char *path, const char *out, int lora) {
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fprintf(f,
            "%s\n"
            "task: reverse\n"
            "digits: 4\n"
            "steps: 20\n"
            "global_batch: 12\n"
            "lr: 0.01\n"
            "weight_decay: 0.01\n"
            "seed: 5\n"
            "eval_examples: 24\n"
            "output: %s\n",
            lora ? "base: base.safetensors" : "model: {d_model: 16, n_layers: 2, n_heads: 2}",
            out);
    if (lora)
        fprintf(f, "models:\n  student:\n    lora: {enable: true, rank: 4, alpha: 8, "
                   "target_modules: [to_q, to_v, to_out, ff.net.2]}\n");
    fclose(f);
}

/* max |a - b| over each tensor <= 1e-4 * max |b| + floor */
static void compare_files(const char *pa, const char *pb, size_t expect_tensors, double floor) {
    lk_st *a, *b;
    assert_int_equal(lk_st_open(pa, &a), LK_OK);
    assert_int_equal(lk_st_open(pb, &b), LK_OK);
    assert_int_equal(lk_st_count(a), lk_st_count(b));
    assert_int_equal(lk_st_count(a), expect_tensors);
    double worst = 0;
    for (size_t i = 0; i < lk_st_count(b); i++) {
        const lk_tensor *tb = lk_st_tensor(b, i);
        long j = lk_st_find(a, tb->name);
        assert_true(j >= 0);
        const lk_tensor *ta = lk_st_tensor(a, (size_t)j);
        assert_int_equal(ta->nbytes, tb->nbytes);
        const float *x = ta->data, *y = tb->data;
        size_t n = tb->nbytes / 4;
        double mx = 0, diff = 0;
        for (size_t k = 0; k < n; k++) {
            mx = fmax(mx, fabs(y[k]));
            diff = fmax(diff, fabs((double)x[k] - y[k]));
        }
        double rel = diff / (mx + floor / 1e-4);
        if (rel > worst) worst = rel;
        if (rel > 1e-4) fprintf(stderr, "%s: max diff %.3g, max |x| %.3g\n", tb->name, diff, mx);
        assert_true(rel <= 1e-4);
    }
    fprintf(stderr, "%d ranks vs 1: worst relative difference %.3g over %zu tensors\n", N, worst,
            lk_st_count(b));
    lk_st_close(a);
    lk_st_close(b);
}

static void run_case(int lora) {
    char cfg[600], out_world[600], out_one[600], rel_world[32];
    snprintf(rel_world, sizeof rel_world, "world%d", lora);
    snprintf(cfg, sizeof cfg, "%s/cfg%d.yaml", g_dir, lora);
    if (R == 0) write_cfg(cfg, rel_world, lora);
    MPI_Barrier(MPI_COMM_WORLD);
    lk_train_config c;
    assert_int_equal(lk_train_config_load(cfg, NULL, &c), LK_OK);
    assert_int_equal(c.lora.enable, lora);
    lk_train_result res;
    lk_status st = lk_train_run(&c, g_world, NULL, NULL, &res);
    if (st) fprintf(stderr, "rank %d: %s\n", R, lk_last_error());
    assert_int_equal(st, LK_OK);
    assert_true(res.replicas_agree);
    assert_int_equal(res.steps, 20);
    assert_true(res.final_loss < res.first_loss);
    assert_int_equal(res.lora_layers, lora ? 8 : 0);
    if (R == 0) {
        /* the reference: the same config in one process */
        lk_comm *self;
        assert_int_equal(lk_comm_self(&self), LK_OK);
        snprintf(c.output, sizeof c.output, "%s/one%d", g_dir, lora);
        lk_train_result r1;
        assert_int_equal(lk_train_run(&c, self, NULL, NULL, &r1), LK_OK);
        lk_comm_free(self);
        assert_float_equal(r1.final_loss, res.final_loss, 1e-4 * fabsf(r1.final_loss) + 1e-6);
        if (lora) {
            snprintf(out_world, sizeof out_world, "%s/%s/adapter_model.safetensors", g_dir,
                     rel_world);
            snprintf(out_one, sizeof out_one, "%s/one%d/adapter_model.safetensors", g_dir, lora);
            compare_files(out_world, out_one, 16, 0.0);
            /* B starts at zero: it must have been trained */
            lk_st *a;
            assert_int_equal(lk_st_open(out_one, &a), LK_OK);
            long j = lk_st_find(a, "base_model.model.blocks.1.attn.to_v.lora_B.weight");
            assert_true(j >= 0);
            const lk_tensor *t = lk_st_tensor(a, (size_t)j);
            double s = 0;
            for (size_t k = 0; k < t->nbytes / 4; k++) s += fabs(((const float *)t->data)[k]);
            assert_true(s > 1e-3);
            lk_st_close(a);
        } else {
            snprintf(out_world, sizeof out_world, "%s/%s/model.safetensors", g_dir, rel_world);
            snprintf(out_one, sizeof out_one, "%s/one%d/model.safetensors", g_dir, lora);
            /* key biases have an exactly zero true gradient (softmax is
             * shift-invariant), so they receive only round-off, which Adam
             * turns into steps of random sign: an absolute floor of 1e-4
             * covers them; every other weight meets 1e-4 relative */
            compare_files(out_world, out_one, 37, 1e-4);
        }
    }
    lk_train_config_clear(&c);
    MPI_Barrier(MPI_COMM_WORLD);
}

static void test_lora_same_at_any_rank_count(void **state) {
    (void)state;
    run_case(1);
}

static void test_full_model_same_at_any_rank_count(void **state) {
    (void)state;
    run_case(0);
}

static void test_batch_must_split(void **state) {
    (void)state;
    lk_train_config c;
    char cfg[600];
    snprintf(cfg, sizeof cfg, "%s/cfg1.yaml", g_dir);
    assert_int_equal(lk_train_config_load(cfg, NULL, &c), LK_OK);
    c.global_batch = 13;
    lk_status st = lk_train_run(&c, g_world, NULL, NULL, NULL);
    if (N == 1) {
        assert_int_equal(st, LK_OK);
    } else {
        assert_int_equal(st, LK_ERR_CONFIG);
        char want[80];
        snprintf(want, sizeof want, "global_batch 13 does not split evenly over %d ranks", N);
        tu_assert_contains(lk_last_error(), want);
    }
    lk_train_config_clear(&c);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    setenv("CMOCKA_TEST_ABORT", "1", 1);
    if (lk_comm_from_mpi(MPI_COMM_WORLD, &g_world) != LK_OK) {
        fprintf(stderr, "lk_comm_from_mpi: %s\n", lk_last_error());
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    R = lk_comm_rank(g_world);
    N = lk_comm_size(g_world);
    /* rank 0 makes the directory and a small base checkpoint */
    if (R == 0) {
        char *d = tu_mkdtemp();
        snprintf(g_dir, sizeof g_dir, "%s", d);
        free(d);
        lk_model_config mc = {.vocab = LK_TASK_VOCAB, .max_seq = 8, .d_model = 16,
                              .n_layers = 2, .n_heads = 2, .d_ff = 32};
        lk_model *m;
        char p[600];
        snprintf(p, sizeof p, "%s/base.safetensors", g_dir);
        if (lk_model_create(&mc, 3, &m) || lk_model_save(m, p)) {
            fprintf(stderr, "base: %s\n", lk_last_error());
            MPI_Abort(MPI_COMM_WORLD, 1);
        }
        lk_model_free(m);
    }
    MPI_Bcast(g_dir, sizeof g_dir, MPI_CHAR, 0, MPI_COMM_WORLD);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_lora_same_at_any_rank_count),
        cmocka_unit_test(test_full_model_same_at_any_rank_count),
        cmocka_unit_test(test_batch_must_split),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    MPI_Barrier(MPI_COMM_WORLD);
    if (R == 0) tu_rmtree(g_dir);
    lk_comm_free(g_world);
    MPI_Finalize();
    return rc;
}
