/* comm_host.c — plugging a host program's own transport into lorakit
 * (lorakit/comm_host.h): the shape a C/C++ server with NCCL, UCC or gloo
 * would write. Here the "host transport" is MPI, called from the host's own
 * callbacks, so the example runs anywhere mpirun does and can check itself
 * against lorakit's built-in MPI backend:
 *
 *   mpirun -n 2 ./comm_host BASE.safetensors ADAPTER_A ADAPTER_B
 *
 * Each callback is one collective of the host's library over its group
 * (here MPI_Bcast, MPI_Allreduce, MPI_Allgather, MPI_Ibcast/Test/Wait);
 * lorakit does the rest (agreement before every data-sized collective,
 * packing small keys into rounds, splitting past max_bytes). With NCCL the
 * same callbacks would call ncclBroadcast/ncclAllReduce/ncclAllGather on a
 * stream and synchronise it (and a device-memory weights backend, which
 * lorakit does not have yet). The tracker swaps A, then A+B, then resets,
 * over the host communicator and over lk_comm_from_mpi; rank 0 prints both
 * digests per step, and the program fails if they differ. */
#include <limits.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lorakit/lorakit.h"
#include "lorakit/comm_mpi.h"

/* ---- the host's transport behind lk_comm_host_ops ---- */

static MPI_Comm group(void *ctx) { return *(MPI_Comm *)ctx; }

static lk_status done(int rc, const char *op) {
    return rc == MPI_SUCCESS ? LK_OK : lk_error(LK_ERR_COMM, "host transport: %s failed (MPI error %d)", op, rc);
}

static lk_status h_barrier(void *ctx) { return done(MPI_Barrier(group(ctx)), "barrier"); }

/* counts fit an int: max_bytes below is INT_MAX */
static lk_status h_bcast(void *ctx, void *buf, size_t n, int root) {
    return done(MPI_Bcast(buf, (int)n, MPI_BYTE, root, group(ctx)), "bcast");
}

static lk_status h_allreduce(void *ctx, void *buf, size_t n, lk_comm_dtype t, lk_reduce_op op) {
    MPI_Op o = op == LK_REDUCE_SUM ? MPI_SUM : op == LK_REDUCE_MIN ? MPI_MIN : MPI_MAX;
    MPI_Datatype d = t == LK_COMM_F32 ? MPI_FLOAT : MPI_UINT64_T;
    return done(MPI_Allreduce(MPI_IN_PLACE, buf, (int)n, d, o, group(ctx)), "allreduce");
}

static lk_status h_allgather(void *ctx, const void *send, size_t n, void *recv) {
    return done(MPI_Allgather(send, (int)n, MPI_BYTE, recv, (int)n, MPI_BYTE, group(ctx)), "allgather");
}

static lk_status h_ibcast(void *ctx, void *buf, size_t n, int root, void **req) {
    MPI_Request *r = malloc(sizeof *r);
    if (!r) return lk_error(LK_ERR_NOMEM, "host transport: out of memory");
    int rc = MPI_Ibcast(buf, (int)n, MPI_BYTE, root, group(ctx), r);
    if (rc != MPI_SUCCESS) {
        free(r);
        return done(rc, "ibcast");
    }
    *req = r;
    return LK_OK;
}

static lk_status h_test(void *ctx, void *req, int *flag) {
    (void)ctx;
    int rc = MPI_Test(req, flag, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS || *flag) free(req);
    return done(rc, "test");
}

static lk_status h_wait(void *ctx, void *req) {
    (void)ctx;
    int rc = MPI_Wait(req, MPI_STATUS_IGNORE);
    free(req);
    return done(rc, "wait");
}

static void h_destroy(void *ctx) {
    MPI_Comm_free((MPI_Comm *)ctx);
    free(ctx);
}

/* ---- the server ---- */

static int check(lk_status s, const char *what) {
    if (s) fprintf(stderr, "comm_host: %s: %s\n", what, lk_last_error());
    return s != LK_OK;
}

/* Runs the three steps over comm; digests[3] get the weights' digests. */
static int serve(lk_comm *comm, char **argv, char digests[3][LK_DIGEST_HEX]) {
    lk_weights *w = NULL;
    lk_tracker *t = NULL;
    lk_tracker_opts opts = LK_TRACKER_OPTS_DEFAULT;
    int err = 1;
    lk_fuse_input a[] = {{argv[2], 1.0f, LK_FORMAT_AUTO}};
    lk_fuse_input ab[] = {{argv[2], 0.6f, LK_FORMAT_AUTO}, {argv[3], 0.8f, LK_FORMAT_AUTO}};
    if (check(lk_comm_agree(comm, lk_weights_load(argv[1], &w)), "load weights") ||
        check(lk_tracker_create(comm, w, &opts, &t), "tracker") ||
        check(lk_tracker_apply(t, a, 1, NULL), "apply A") || check(lk_weights_digest(w, digests[0]), "digest") ||
        check(lk_tracker_apply(t, ab, 2, NULL), "apply A+B") || check(lk_weights_digest(w, digests[1]), "digest") ||
        check(lk_tracker_reset(t, NULL), "reset") || check(lk_weights_digest(w, digests[2]), "digest"))
        goto out;
    err = 0;
out:
    lk_tracker_free(t);
    lk_weights_free(w);
    return err;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, size, err = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (argc != 4) {
        if (rank == 0) fprintf(stderr, "usage: mpirun -n K %s BASE.safetensors ADAPTER_A ADAPTER_B\n", argv[0]);
        MPI_Finalize();
        return 2;
    }
    /* the host's group: its own duplicate, released by h_destroy */
    MPI_Comm *mine = malloc(sizeof *mine);
    MPI_Comm_dup(MPI_COMM_WORLD, mine);
    lk_comm_host_ops ops = {
        .barrier = h_barrier, .bcast = h_bcast, .allreduce = h_allreduce, .allgather = h_allgather,
        .ibcast = h_ibcast, .test = h_test, .wait = h_wait, /* optional: overlap fuse and broadcast */
        .destroy = h_destroy, .max_bytes = INT_MAX,
    };
    lk_comm *host = NULL, *mpi = NULL;
    char via_host[3][LK_DIGEST_HEX], via_mpi[3][LK_DIGEST_HEX];
    if (check(lk_comm_from_host(&ops, mine, rank, size, &host), "host communicator") ||
        check(lk_comm_from_mpi(MPI_COMM_WORLD, &mpi), "MPI communicator") || serve(host, argv, via_host) ||
        serve(mpi, argv, via_mpi))
        goto out;
    const char *step[3] = {"A", "A+B", "reset"};
    err = 0;
    for (int i = 0; i < 3; i++) {
        int same = !memcmp(via_host[i], via_mpi[i], LK_DIGEST_HEX);
        err |= !same;
        if (rank == 0)
            printf("%-6s host %s  mpi %s  %s\n", step[i], via_host[i], via_mpi[i], same ? "same" : "DIFFERENT");
    }
out:
    lk_comm_free(host); /* calls h_destroy (lk_comm_from_host did on failure) */
    lk_comm_free(mpi);
    MPI_Finalize();
    return err;
}
