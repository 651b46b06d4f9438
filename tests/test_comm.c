/* test_comm.c — the `self` communicator and a 1x1 mesh, without MPI.
 * Expectations are hand-derived: one rank, so every collective is the
 * identity (allgather copies its one block), and agreement reports rank 0. */
#include "testutil.h"

#include <stdlib.h>
#include <string.h>

static void test_self_collectives(void **state) {
    (void)state;
    lk_comm *c = NULL;
    assert_int_equal(lk_comm_self(&c), LK_OK);
    assert_int_equal(lk_comm_rank(c), 0);
    assert_int_equal(lk_comm_size(c), 1);
    assert_string_equal(lk_comm_backend(c), "self");
    assert_int_equal(lk_comm_barrier(c), LK_OK);

    unsigned char b[5] = {1, 2, 3, 4, 5};
    assert_int_equal(lk_comm_bcast(c, b, sizeof b, 0), LK_OK);
    assert_int_equal(b[4], 5);
    assert_int_equal(lk_comm_bcast(c, b, sizeof b, 1), LK_ERR_ARG);
    tu_assert_contains(lk_last_error(), "root 1");

    float f[3] = {1.5f, -2.0f, 0.25f};
    assert_int_equal(lk_comm_allreduce_f32_sum(c, f, 3), LK_OK);
    assert_true(f[0] == 1.5f && f[1] == -2.0f && f[2] == 0.25f);
    uint64_t u[2] = {UINT64_MAX, 7};
    assert_int_equal(lk_comm_allreduce_u64(c, u, 2, LK_REDUCE_MIN), LK_OK);
    assert_true(u[0] == UINT64_MAX && u[1] == 7);
    assert_int_equal(lk_comm_allreduce_u64(c, u, 2, (lk_reduce_op)9), LK_ERR_ARG);
    assert_int_equal(lk_comm_allreduce_u64(c, NULL, 2, LK_REDUCE_MAX), LK_ERR_ARG);

    unsigned char g[5] = {0};
    assert_int_equal(lk_comm_allgather(c, b, 5, g), LK_OK);
    assert_memory_equal(g, b, 5);

    lk_comm *s = NULL;
    assert_int_equal(lk_comm_split(c, 3, 0, &s), LK_OK);
    assert_non_null(s);
    assert_int_equal(lk_comm_size(s), 1);
    lk_comm_free(s);
    s = (lk_comm *)1;
    assert_int_equal(lk_comm_split(c, -1, 0, &s), LK_OK);
    assert_null(s);
    lk_comm_free(c);
}

/* The timeout setting on the self backend (comm.h): default, validation,
 * inheritance by split; a self communicator cannot end a group. */
static void test_self_timeout(void **state) {
    (void)state;
    lk_comm *c = NULL, *d = NULL;
    assert_int_equal(lk_comm_self(&c), LK_OK);
    assert_true(lk_comm_timeout(c) == LK_COMM_TIMEOUT_DEFAULT);
    assert_int_equal(lk_comm_set_timeout(c, -0.5), LK_ERR_ARG);
    tu_assert_contains(lk_last_error(), "-0.5");
    assert_int_equal(lk_comm_set_timeout(c, 1.0 / 0.0), LK_ERR_ARG);
    assert_int_equal(lk_comm_set_timeout(NULL, 1), LK_ERR_ARG);
    assert_int_equal(lk_comm_set_timeout(c, 2.5), LK_OK);
    assert_int_equal(lk_comm_split(c, 0, 0, &d), LK_OK);
    assert_true(lk_comm_timeout(d) == 2.5);
    assert_int_equal(lk_comm_abort(c, 1), LK_ERR_UNSUPPORTED);
    uint64_t v = 5;
    assert_int_equal(lk_comm_allreduce_u64(c, &v, 1, LK_REDUCE_MAX), LK_OK); /* nothing to wait for */
    assert_true(v == 5);
    lk_comm_free(d);
    lk_comm_free(c);
}

static void test_self_agree(void **state) {
    (void)state;
    lk_comm *c = NULL;
    assert_int_equal(lk_comm_self(&c), LK_OK);
    assert_int_equal(lk_comm_agree(c, LK_OK), LK_OK);
    lk_error(LK_ERR_IO, "x.safetensors: cannot open");
    assert_int_equal(lk_comm_agree(c, LK_ERR_IO), LK_ERR_IO);
    assert_string_equal(lk_last_error(), "x.safetensors: cannot open"); /* one rank: no prefix */
    lk_comm_free(c);
}

static void test_self_mesh(void **state) {
    (void)state;
    lk_comm *c = NULL;
    lk_mesh *m = NULL;
    assert_int_equal(lk_comm_self(&c), LK_OK);
    assert_int_equal(lk_mesh_create(c, 2, 1, &m), LK_ERR_ARG);
    assert_null(m);
    assert_int_equal(lk_mesh_create(c, 1, 1, &m), LK_OK);
    assert_int_equal(lk_mesh_ndim(m), 1);
    assert_int_equal(lk_mesh_dim_size(m, LK_MESH_REPLICATE), 1);
    assert_int_equal(lk_comm_size(lk_mesh_dim_comm(m, LK_MESH_SHARD)), 1);
    assert_int_equal(lk_mesh_coord(m, LK_MESH_REPLICATE), 0);
    assert_ptr_equal(lk_mesh_world(m), c);
    lk_mesh_free(m);
    lk_comm_free(c);
}

static void test_self_alloc_failure(void **state) {
    (void)state;
    lk_comm *c = NULL;
    lk_alloc_fail_at(1);
    assert_int_equal(lk_comm_self(&c), LK_ERR_NOMEM);
    assert_null(c);
    lk_alloc_fail_at(0);
    assert_int_equal(lk_comm_self(&c), LK_OK);
    for (unsigned long k = 1; k <= 3; k++) { /* every allocation of mesh_create */
        lk_mesh *m = NULL;
        lk_alloc_fail_at(k);
        lk_status st = lk_mesh_create(c, 1, 1, &m);
        lk_alloc_fail_at(0);
        if (st == LK_OK) { lk_mesh_free(m); continue; }
        assert_int_equal(st, LK_ERR_NOMEM);
        assert_null(m);
    }
    lk_comm_free(c);
}

/* lk_comm_world, the one start-up path of the CLI: a process no MPI launcher
 * started gets the self communicator (no MPI singleton start), whether or
 * not lorakit was built with MPI. Oracle: the launcher contract written in
 * comm.h. */
static void test_world_without_launcher(void **state) {
    (void)state;
    static const char *const vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MPI_LOCALNRANKS",
                                       "PMIX_RANK", "PMI_RANK", NULL};
    for (int i = 0; vars[i]; i++) unsetenv(vars[i]);
    lk_comm *c = NULL;
    assert_int_equal(lk_comm_world(NULL, NULL, &c), LK_OK);
    assert_string_equal(lk_comm_backend(c), "self");
    assert_int_equal(lk_comm_size(c), 1);
    lk_comm_free(c);
#ifndef LK_HAVE_MPI
    /* built without MPI but started as one of 3 ranks: refused, not 3 lone copies */
    setenv("OMPI_COMM_WORLD_SIZE", "3", 1);
    c = (lk_comm *)1;
    assert_int_equal(lk_comm_world(NULL, NULL, &c), LK_ERR_UNSUPPORTED);
    assert_null(c);
    tu_assert_contains(lk_last_error(), "one of 3 MPI ranks");
    unsetenv("OMPI_COMM_WORLD_SIZE");
#endif
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_world_without_launcher),
        cmocka_unit_test(test_self_collectives),
        cmocka_unit_test(test_self_agree),
        cmocka_unit_test(test_self_timeout),
        cmocka_unit_test(test_self_mesh),
        cmocka_unit_test(test_self_alloc_failure),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
