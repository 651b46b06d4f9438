/* mpi_testutil.h — what every tests/mpi_*.c program shares: start-up and
 * shut-down around MPI_COMM_WORLD, aborting every rank on a setup failure, a
 * scratch directory all ranks see, and the "every rank holds this digest"
 * check. Header-only (static inline) because lktestutil is also linked into
 * the non-MPI tests, which must build where MPI is missing. */
#ifndef LK_TESTS_MPI_TESTUTIL_H
#define LK_TESTS_MPI_TESTUTIL_H

#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "testutil.h"
#include "lorakit/comm_mpi.h"

/* Prints what failed (with lk_last_error()) and stops every rank: a rank
 * that returned instead would leave the others waiting in a collective. */
static inline void tu_mpi_die(const char *what) {
    int rank = -1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    fprintf(stderr, "rank %d: %s: %s\n", rank, what, lk_last_error());
    MPI_Abort(MPI_COMM_WORLD, 1);
}

/* MPI_Init and the world communicator. A failing assert aborts
 * (CMOCKA_TEST_ABORT), so mpirun stops all ranks instead of leaving the
 * others waiting in a collective. */
static inline lk_comm *tu_mpi_init(int *argc, char ***argv) {
    MPI_Init(argc, argv);
    setenv("CMOCKA_TEST_ABORT", "1", 1);
    lk_comm *world = NULL;
    if (lk_comm_from_mpi(MPI_COMM_WORLD, &world) != LK_OK) tu_mpi_die("lk_comm_from_mpi");
    return world;
}

/* Seconds on clock id (CLOCK_MONOTONIC for wall time,
 * CLOCK_THREAD_CPUTIME_ID for this thread's CPU time: a waiting rank's). */
static inline double tu_clock(clockid_t id) {
    struct timespec ts;
    clock_gettime(id, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* "rank A" or "ranks A, B, ..." for the ranks 0..n-1 except skip1 and
 * skip2, as lorakit's timeout reports list them. */
static inline void tu_rank_list(char *buf, size_t cap, int n, int skip1, int skip2) {
    int count = 0, len = 0;
    for (int r = 0; r < n; r++) count += r != skip1 && r != skip2;
    len = snprintf(buf, cap, "%s", count > 1 ? "ranks " : "rank ");
    for (int r = 0, k = 0; r < n && len > 0 && (size_t)len < cap; r++)
        if (r != skip1 && r != skip2) len += snprintf(buf + len, cap - (size_t)len, "%s%d", k++ ? ", " : "", r);
}

/* Frees the world communicator, finalizes MPI and passes rc through. */
static inline int tu_mpi_finish(lk_comm *world, int rc) {
    lk_comm_free(world);
    MPI_Finalize();
    return rc;
}

/* A fresh temporary directory made by rank 0, its path broadcast into
 * dir[cap] on every rank (the ranks share one file system). */
static inline void tu_mpi_tmpdir(lk_comm *world, char *dir, size_t cap) {
    if (lk_comm_rank(world) == 0) {
        char *d = tu_mkdtemp();
        snprintf(dir, cap, "%s", d);
        free(d);
    }
    if (lk_comm_bcast(world, dir, cap, 0) != LK_OK) tu_mpi_die("broadcast the temp dir");
}

/* cmocka group setup/teardown for the tests that need only a shared
 * temporary folder: tu_mpi_dir on every rank, made in the world
 * tu_mpi_world (set it first), removed by rank 0 after a barrier. */
__attribute__((unused)) static lk_comm *tu_mpi_world;
__attribute__((unused)) static char tu_mpi_dir[512];
static inline int tu_mpi_setup_dir(void **state) {
    (void)state;
    tu_mpi_tmpdir(tu_mpi_world, tu_mpi_dir, sizeof tu_mpi_dir);
    return 0;
}
static inline int tu_mpi_teardown_dir(void **state) {
    (void)state;
    lk_comm_barrier(tu_mpi_world);
    if (lk_comm_rank(tu_mpi_world) == 0) tu_rmtree(tu_mpi_dir);
    return 0;
}

/* Asserts that every rank's weights digest to want, naming the first rank
 * that does not. */
static inline void tu_mpi_check_digest(lk_comm *world, const lk_weights *w, const char *want) {
    int n = lk_comm_size(world);
    char hex[LK_DIGEST_HEX], *all = malloc((size_t)n * LK_DIGEST_HEX);
    assert_non_null(all);
    assert_int_equal(lk_weights_digest(w, hex), LK_OK);
    assert_int_equal(lk_comm_allgather(world, hex, LK_DIGEST_HEX, all), LK_OK);
    for (int r = 0; r < n; r++) {
        if (strcmp(all + (size_t)r * LK_DIGEST_HEX, want) != 0)
            fail_msg("rank %d holds digest %s, want %s", r, all + (size_t)r * LK_DIGEST_HEX, want);
    }
    free(all);
}

#endif
