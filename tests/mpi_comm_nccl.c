/* mpi_comm_nccl.c — the nccl communicator (lorakit/comm_nccl.h) at 1..4
 * ranks, bootstrapped over the MPI world.
 *
 * Without a CUDA device (CI, the development VM: no driver) every rank must
 * get the same refusal, from the lowest rank, saying plainly that there is
 * no CUDA device: the bootstrap agrees before the NCCL init, so no rank is
 * left waiting; the collective checks then skip ("no CUDA device"). With a
 * device per rank, the host-memory collectives (staged through the device)
 * are checked against closed forms as in mpi_comm.c: the bcast of i*31+7,
 * min/max of base+r (base above 2^53), f32 sums of (r+1)*i, an allgather of
 * each rank's words and a split by parity. */
#include "mpi_testutil.h"
#include "lorakit/comm_nccl.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static lk_comm *g_world;
static int R, N;

/* The launcher's local rank modulo the device count; the variables are
 * read in the documented order. Expectations computed by hand. */
static void test_local_device(void **state) {
    (void)state;
    static const char *const vars[] = {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "LOCAL_RANK"};
    char *saved[4];
    for (int i = 0; i < 4; i++) {
        const char *v = getenv(vars[i]);
        saved[i] = v ? strdup(v) : NULL;
        unsetenv(vars[i]);
    }
    if (lk_comm_nccl_built()) {
        assert_int_equal(lk_comm_nccl_local_device(4), 0); /* no launcher: device 0 */
        setenv("LOCAL_RANK", "6", 1);
        assert_int_equal(lk_comm_nccl_local_device(4), 2); /* 6 mod 4 */
        setenv("OMPI_COMM_WORLD_LOCAL_RANK", "5", 1);     /* Open MPI's comes first */
        assert_int_equal(lk_comm_nccl_local_device(4), 1);
        assert_int_equal(lk_comm_nccl_local_device(5), 0);
        assert_int_equal(lk_comm_nccl_local_device(8), 5);
    }
    for (int i = 0; i < 4; i++) {
        if (saved[i]) setenv(vars[i], saved[i], 1);
        else unsetenv(vars[i]);
        free(saved[i]);
    }
    assert_int_equal(lk_comm_takes_cuda(g_world), 0); /* MPI: host memory only */
    assert_int_equal(lk_comm_nccl_device(g_world), -1);
    assert_int_equal(lk_comm_nccl_set_stream(g_world, NULL), lk_comm_nccl_built() ? LK_ERR_ARG : LK_ERR_UNSUPPORTED);
}

/* The collectives on host memory over an NCCL communicator. */
static void check_collectives(lk_comm *c) {
    assert_string_equal(lk_comm_backend(c), "nccl");
    assert_int_equal(lk_comm_takes_cuda(c), 1);
    assert_int_equal(lk_comm_rank(c), R);
    assert_int_equal(lk_comm_size(c), N);
    size_t n = ((size_t)3 << 20) + 17; /* past the 1 MiB stage: four rounds */
    unsigned char *b = malloc(n);
    for (size_t i = 0; i < n; i++) b[i] = R == N - 1 ? (unsigned char)(i * 31 + 7) : 0;
    assert_int_equal(lk_comm_bcast(c, b, n, N - 1), LK_OK);
    for (size_t i = 0; i < n; i++) assert_int_equal(b[i], (unsigned char)(i * 31 + 7));
    free(b);
    const uint64_t base = ((uint64_t)1 << 60) + 3;
    uint64_t lo = base + (uint64_t)R, hi = base + (uint64_t)R;
    assert_int_equal(lk_comm_allreduce_u64(c, &lo, 1, LK_REDUCE_MIN), LK_OK);
    assert_int_equal(lk_comm_allreduce_u64(c, &hi, 1, LK_REDUCE_MAX), LK_OK);
    assert_true(lo == base && hi == base + (uint64_t)N - 1);
    float f[1000];
    for (int i = 0; i < 1000; i++) f[i] = (float)((R + 1) * i);
    assert_int_equal(lk_comm_allreduce_f32_sum(c, f, 1000), LK_OK);
    for (int i = 0; i < 1000; i++) assert_true(f[i] == (float)(i * N * (N + 1) / 2));
    uint32_t mine[3] = {(uint32_t)R, (uint32_t)R * 7u, 0xabcd0000u + (uint32_t)R}, all[12];
    assert_int_equal(lk_comm_allgather(c, mine, sizeof mine, all), LK_OK);
    for (int r = 0; r < N; r++)
        assert_true(all[3 * r] == (uint32_t)r && all[3 * r + 1] == (uint32_t)r * 7u && all[3 * r + 2] == 0xabcd0000u + (uint32_t)r);
    assert_int_equal(lk_comm_agree(c, LK_OK), LK_OK);
    assert_int_equal(lk_comm_barrier(c), LK_OK);
    lk_comm *half = NULL;
    assert_int_equal(lk_comm_split(c, R % 2, R, &half), LK_OK);
    assert_non_null(half);
    assert_int_equal(lk_comm_size(half), (N - R % 2 + 1) / 2);
    assert_int_equal(lk_comm_rank(half), R / 2);
    lk_comm_free(half);
}

static void test_create(void **state) {
    (void)state;
    lk_comm *c = NULL;
    lk_status s = lk_comm_nccl_create(g_world, -1, &c);
    /* the same status on every rank (the bootstrap's agreement) */
    uint64_t v[2] = {(uint64_t)s, ~(uint64_t)s};
    assert_int_equal(lk_comm_allreduce_u64(g_world, v, 2, LK_REDUCE_MIN), LK_OK);
    assert_true(v[0] == ~v[1] && v[0] == (uint64_t)s);
    if (!lk_comm_nccl_built()) {
        assert_int_equal(s, LK_ERR_UNSUPPORTED);
        assert_non_null(strstr(lk_last_error(), "built without NCCL"));
        if (R == 0) printf("skip: NCCL collectives (this lorakit was built without NCCL)\n");
        return;
    }
    if (s) {
        const char *e = lk_last_error();
        if (N > 1) assert_true(!strncmp(e, "rank 0: ", 8)); /* the lowest failing rank's message, on every rank */
        if (s == LK_ERR_UNSUPPORTED && !strstr(e, "cannot be loaded")) assert_non_null(strstr(e, "no CUDA device"));
        assert_null(c);
        if (R == 0) printf("skip: NCCL collectives: no CUDA device (%s)\n", e);
        return;
    }
    check_collectives(c);
    lk_comm_free(c);
}

int main(int argc, char **argv) {
    g_world = tu_mpi_init(&argc, &argv);
    R = lk_comm_rank(g_world);
    N = lk_comm_size(g_world);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_local_device),
        cmocka_unit_test(test_create),
    };
    return tu_mpi_finish(g_world, cmocka_run_group_tests(tests, NULL, NULL));
}
