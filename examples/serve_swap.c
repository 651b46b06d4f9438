/* serve_swap.c — the smallest host program of the hot-swap tracker: what a
 * C/C++ inference server running one model copy per MPI rank would write.
 *
 *   mpirun -n 2 ./serve_swap BASE.safetensors ADAPTER_A ADAPTER_B
 *
 * The server owns MPI (init/finalize) and its weights; lorakit borrows
 * both. Every lk_tracker_* call is collective: all ranks call it together,
 * so a local step that can fail on one rank only (loading the weights) is
 * followed by lk_comm_agree: every rank then stops, none waits in
 * lk_tracker_create for a rank that has left.
 * Prints the weights' digest after each step (rank 0). */
#include <mpi.h>
#include <stdio.h>

#include "lorakit/lorakit.h"
#include "app/model.h"
#include "app/task.h"
#include "lorakit/comm_mpi.h"

static int check(lk_status s, const char *what) {
    if (s) fprintf(stderr, "serve_swap: %s: %s\n", what, lk_last_error());
    return s != LK_OK;
}

static void show(int rank, const char *step, const lk_weights *w, const lk_tracker_stats *st) {
    char hex[LK_DIGEST_HEX];
    if (lk_weights_digest(w, hex) == LK_OK && rank == 0)
        printf("%-8s digest %s  fused %zu  restored %zu  broadcast %llu bytes\n", step, hex, st->keys_fused,
               st->keys_restored, (unsigned long long)st->bytes_broadcast);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, err = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (argc != 4) {
        if (rank == 0) fprintf(stderr, "usage: mpirun -n K %s BASE.safetensors ADAPTER_A ADAPTER_B\n", argv[0]);
        MPI_Finalize();
        return 2;
    }
    lk_comm *comm = NULL;
    lk_weights *w = NULL;
    lk_tracker *t = NULL;
    lk_tracker_stats st;
    lk_tracker_opts opts = LK_TRACKER_OPTS_DEFAULT; /* 64 MiB staging buffer */

    if (check(lk_comm_from_mpi(MPI_COMM_WORLD, &comm), "communicator") ||
        check(lk_comm_agree(comm, lk_weights_load(argv[1], &w)), "load weights") || /* or lk_weights_wrap */
        check(lk_tracker_create(comm, w, &opts, &t), "tracker"))
        goto out;

    lk_fuse_input style[] = {{argv[2], 1.0f, LK_FORMAT_AUTO}};
    if (check(lk_tracker_apply(t, style, 1, &st), "apply A")) goto out;
    show(rank, "A", w, &st);

    lk_fuse_input mix[] = {{argv[2], 0.6, LK_FORMAT_AUTO}, {argv[3], 0.8, LK_FORMAT_AUTO}};
    if (check(lk_tracker_apply(t, mix, 2, &st), "apply A+B")) goto out;
    show(rank, "A+B", w, &st);

    if (check(lk_tracker_reset(t, &st), "reset")) goto out;
    show(rank, "reset", w, &st);
    err = 0;
out:
    lk_tracker_free(t);
    lk_weights_free(w);
    lk_comm_free(comm);
    MPI_Finalize();
    return err;
}
