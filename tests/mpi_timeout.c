/* mpi_timeout.c — a stalled rank under the collective timeout (comm.h), in
 * the two places that wait on other ranks: a tracker apply and the LoRA
 * gradient sync (ctest runs it at 1..4 ranks; at 1 nothing can stall).
 *
 * The last rank sleeps 2.5 s before the call while the others, on a
 * communicator with a 1 s timeout, wait in it. Expectations from comm.h's
 * contract: every waiting rank returns LK_ERR_TIMEOUT after at least the
 * timeout and within it plus the diagnosis' grace (0.5 s at 1 s) and
 * scheduling slack, naming the phase (the tracker's "agreeing on the
 * request", the sync's "LoRA gradient sync"), the collective, and the
 * stalled rank as waited for (no answer), with the other waiting ranks as
 * waiting too; its thread used under a quarter of the wall time (a
 * busy-polling wait uses all of it, or its share of the cores). The late
 * rank then finds the others gone: its first collective may still complete
 * against the operations the others left in flight (LK_OK, the sync's one
 * allreduce), else LK_ERR_TIMEOUT within two timeouts and graces naming
 * the others as waited for. Each case runs on its own communicator, which is
 * unusable afterwards; the test communicator stays usable. ctest's own
 * TIMEOUT bounds the whole program, so a hang fails instead of waiting. */
#include "mpi_testutil.h"
#include "swap_fixture.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static lk_comm *W;
static int R, N;
/* Gradients a timed-out sync was reducing in place: comm.h, "the transport
 * may still write the timed-out collective's receive buffers should the
 * missing ranks arrive", so they stay allocated until MPI is finalized
 * (freeing them at the test's end let the late rank's data land in freed
 * memory during the next test's MPI_Comm_dup, an ASan report at 3 ranks). */
static lk_lora_params *g_in_flight;
static const swap_model M = {1, 64, 128, 1};

/* A communicator of its own with a 1 s timeout. */
static lk_comm *fresh(void) {
    lk_comm *c = NULL;
    assert_int_equal(lk_comm_from_mpi(MPI_COMM_WORLD, &c), LK_OK);
    assert_int_equal(lk_comm_set_timeout(c, 1.0), LK_OK);
    return c;
}

typedef struct timed {
    lk_status st;
    double wall, cpu;
    char msg[2048];
} timed;

/* Checks one rank's outcome against the contract above. */
static void check(const timed *t, const char *phase, const char *op) {
    fprintf(stderr, "rank %d: %s after %.2f s wall, %.3f s CPU: %s\n", R, lk_status_str(t->st), t->wall, t->cpu,
            t->msg);
    char want[160];
    if (R != N - 1) {
        assert_int_equal(t->st, LK_ERR_TIMEOUT);
        assert_true(t->wall >= 1.0 && t->wall < 3.5);
        assert_true(t->cpu < 0.25 * t->wall);
        tu_assert_contains(t->msg, phase);
        tu_assert_contains(t->msg, op);
        snprintf(want, sizeof want, "waiting for rank %d (no answer", N - 1);
        tu_assert_contains(t->msg, want);
        if (N >= 3) {
            char list[64];
            tu_rank_list(list, sizeof list, N, R, N - 1);
            snprintf(want, sizeof want, "waiting in it too: %s", list);
            tu_assert_contains(t->msg, want);
        }
    } else if (t->st != LK_OK) {
        /* late: its first collective may still complete against the ones
         * the others left in flight (LK_OK), the next finds nobody */
        assert_int_equal(t->st, LK_ERR_TIMEOUT);
        assert_true(t->wall < 2 * 1.5 + 2.0);
        snprintf(want, sizeof want, "waiting for rank%s 0", N > 2 ? "s" : "");
        tu_assert_contains(t->msg, want);
    }
}

static void test_tracker_stall(void **state) {
    (void)state;
    if (N == 1) skip();
    char dir[1024];
    tu_mpi_tmpdir(W, dir, sizeof dir);
    char *base = tu_path(dir, "base.safetensors"), *ad = tu_path(dir, "a.safetensors");
    if (R == 0 && (swap_write_base(base, &M, 5) || swap_write_adapter(ad, &M, SWAP_ATTN, 2, 2.0f, 0.05f, 0, 6)))
        tu_mpi_die("fixtures");
    assert_int_equal(lk_comm_barrier(W), LK_OK);
    lk_weights *w;
    assert_int_equal(lk_weights_load(base, &w), LK_OK);
    lk_comm *c = fresh();
    lk_tracker_opts o = LK_TRACKER_OPTS_DEFAULT;
    o.threads = 1;
    lk_tracker *t;
    assert_int_equal(lk_tracker_create(c, w, &o, &t), LK_OK);
    lk_fuse_input in[] = {{ad, 1.0f, LK_FORMAT_AUTO}};
    if (R == N - 1) usleep(2500000);
    timed r;
    double t0 = tu_clock(CLOCK_MONOTONIC), c0 = tu_clock(CLOCK_THREAD_CPUTIME_ID);
    r.st = lk_tracker_apply(t, in, 1, NULL);
    r.wall = tu_clock(CLOCK_MONOTONIC) - t0;
    r.cpu = tu_clock(CLOCK_THREAD_CPUTIME_ID) - c0;
    snprintf(r.msg, sizeof r.msg, "%s", lk_last_error());
    check(&r, "tracker apply: agreeing on the request: ", "comm mpi agree (collective #");
    /* the tracker refuses from now on (the late rank: once it timed out) */
    if (r.st) assert_int_equal(lk_tracker_apply(t, NULL, 0, NULL), LK_ERR_TIMEOUT);
    assert_int_equal(lk_comm_barrier(W), LK_OK);
    lk_tracker_free(t);
    lk_comm_free(c);
    lk_weights_free(w);
    if (R == 0) tu_rmtree(dir);
    free(base);
    free(ad);
}

static void test_sync_stall(void **state) {
    (void)state;
    if (N == 1) skip();
    static const lk_lora_param_spec specs[] = {{"l.lora_A", 4, 300}, {"l.lora_B", 300, 4}};
    lk_lora_params *p;
    assert_int_equal(lk_lora_params_create(specs, 2, &p), LK_OK);
    lk_comm *c = fresh();
    lk_mesh *mesh;
    assert_int_equal(lk_mesh_create(c, N, 1, &mesh), LK_OK);
    assert_int_equal(lk_lora_sync_grads(p, mesh, NULL), LK_OK); /* agrees on the layout (cached) */
    if (R == N - 1) usleep(2500000);
    timed r;
    double t0 = tu_clock(CLOCK_MONOTONIC), c0 = tu_clock(CLOCK_THREAD_CPUTIME_ID);
    r.st = lk_lora_sync_grads(p, mesh, NULL);
    r.wall = tu_clock(CLOCK_MONOTONIC) - t0;
    r.cpu = tu_clock(CLOCK_THREAD_CPUTIME_ID) - c0;
    snprintf(r.msg, sizeof r.msg, "%s", lk_last_error());
    check(&r, "LoRA gradient sync (mesh dim 0): ", "comm mpi allreduce_f32_sum (collective #");
    assert_int_equal(lk_comm_barrier(W), LK_OK);
    lk_mesh_free(mesh);
    lk_comm_free(c);
    if (r.st == LK_ERR_TIMEOUT)
        g_in_flight = p; /* freed after MPI_Finalize (above) */
    else
        lk_lora_params_free(p);
}

/* A rank that gives up tells the others (issue 20 item 14, QA: only some
 * ranks printed their error before the abort): rank 0 waits at a 0.5 s
 * timeout, ranks 1..N-2 at 20 s, the last rank comes 2.5 s late. The
 * middle ranks must not wait on until it comes (the job is being aborted
 * under them): they return LK_ERR_TIMEOUT within 2 s (0.5 s + rank 0's
 * 0.25 s grace + their own 0.5 s look + slack), naming rank 0 as the one
 * that timed out and the late rank as waited for. Before, they completed
 * the barrier at 2.5 s (LK_OK). Needs a middle rank: 3 ranks or more. */
static void test_giveup_reaches_waiters(void **state) {
    (void)state;
    if (N < 3) skip();
    lk_comm *c = NULL;
    assert_int_equal(lk_comm_from_mpi(MPI_COMM_WORLD, &c), LK_OK);
    assert_int_equal(lk_comm_set_timeout(c, R == 0 ? 0.5 : 20.0), LK_OK);
    if (R == N - 1) usleep(2500000);
    timed r;
    double t0 = tu_clock(CLOCK_MONOTONIC);
    r.st = lk_comm_barrier(c);
    r.wall = tu_clock(CLOCK_MONOTONIC) - t0;
    snprintf(r.msg, sizeof r.msg, "%s", lk_last_error());
    fprintf(stderr, "rank %d: %s after %.2f s: %s\n", R, lk_status_str(r.st), r.wall, r.st ? r.msg : "");
    if (R == 0) {
        assert_int_equal(r.st, LK_ERR_TIMEOUT);
        assert_true(r.wall >= 0.5 && r.wall < 2.0);
    } else if (R < N - 1) {
        assert_int_equal(r.st, LK_ERR_TIMEOUT);
        assert_true(r.wall < 2.0);
        tu_assert_contains(r.msg, "rank 0 timed out in collective #1 (barrier), so this one cannot complete");
        char want[64]; /* rank 0, already gone, does not answer either */
        snprintf(want, sizeof want, "waiting for ranks 0, %d (no answer", N - 1);
        tu_assert_contains(r.msg, want);
    }
    assert_int_equal(lk_comm_barrier(W), LK_OK);
    lk_comm_free(c);
}

int main(int argc, char **argv) {
    W = tu_mpi_init(&argc, &argv);
    R = lk_comm_rank(W);
    N = lk_comm_size(W);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tracker_stall),
        cmocka_unit_test(test_sync_stall),
        cmocka_unit_test(test_giveup_reaches_waiters),
    };
    const int rc = tu_mpi_finish(W, cmocka_run_group_tests(tests, NULL, NULL));
    lk_lora_params_free(g_in_flight); /* no transport left to write it */
    return rc;
}
