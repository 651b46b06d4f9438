/* comm_mpi.c — the MPI backend of lk_comm (built only when MPI is found).
 *
 * lk_comm_from_mpi duplicates the caller's communicator, so lorakit's
 * messages never mix with the host program's, and sets MPI_ERRORS_RETURN on
 * the duplicate so a transport failure becomes LK_ERR_COMM instead of an
 * abort. MPI counts are int: every operation is split into rounds of at most
 * `chunk` bytes (1 GiB; LORAKIT_COMM_CHUNK overrides it, read once at
 * creation and agreed over the ranks, so tests can exercise the splitting
 * with small buffers). */
#include "lorakit/comm_mpi.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/comm_impl.h"
#include "lorakit/alloc.h"
#include "lorakit/log.h"

typedef struct mpi_impl {
    MPI_Comm comm;
    size_t chunk;  /* max bytes per MPI call, <= INT_MAX */
    int finalize;  /* lk_comm_world initialized MPI: finalize on free */
} mpi_impl;

static MPI_Comm mc(const lk_comm *c) { return ((const mpi_impl *)c->impl)->comm; }
static size_t chunk_of(const lk_comm *c) { return ((const mpi_impl *)c->impl)->chunk; }

static lk_status mpi_fail(int rc, const char *op) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS) snprintf(msg, sizeof msg, "code %d", rc);
    return lk_error(LK_ERR_COMM, "comm mpi %s: %s", op, msg);
}

static void mpi_destroy(lk_comm *c) {
    mpi_impl *m = c->impl;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && m->comm != MPI_COMM_NULL) MPI_Comm_free(&m->comm);
    if (!finalized && m->finalize) MPI_Finalize();
    lk_free(m);
}

static lk_status mpi_barrier(lk_comm *c) {
    int rc = MPI_Barrier(mc(c));
    return rc == MPI_SUCCESS ? LK_OK : mpi_fail(rc, "barrier");
}

static lk_status mpi_bcast(lk_comm *c, void *buf, size_t n, int root) {
    size_t step = chunk_of(c);
    for (size_t off = 0; off < n; off += step) {
        size_t k = n - off < step ? n - off : step;
        int rc = MPI_Bcast((char *)buf + off, (int)k, MPI_BYTE, root, mc(c));
        if (rc != MPI_SUCCESS) return mpi_fail(rc, "bcast");
    }
    return LK_OK;
}

/* A segment of at least BCASTV_CONTIG bytes is broadcast by itself as
 * contiguous bytes (mpi_bcast): Open MPI moves a contiguous buffer without
 * packing, while an hindexed datatype goes through its convertor (4 ranks
 * on the shared 2-vCPU development VM, hindexed rounds over the time of the
 * same pieces as contiguous broadcasts: 160 MiB in 8 MiB pieces 0.94-1.9x,
 * median 1.3x, six runs; 176 MiB in 2 MiB pieces 0.74-1.6x, four runs).
 * Smaller segments are
 * gathered, in order, into rounds of at most `chunk` bytes and
 * SEGS_PER_ROUND pieces, each one MPI_Bcast of an hindexed datatype over
 * the pieces' absolute addresses (one collective for many small keys).
 * Both choices depend only on the segment lengths, which every rank passes
 * alike, so every rank makes the same calls. On the root, `ready` (if any)
 * is called before each MPI_Bcast with the segments it reads, so a caller
 * still writing later segments (the tracker's fuse) overlaps this one. */
#define SEGS_PER_ROUND 256
#define BCASTV_CONTIG ((size_t)1 << 20)

/* With an idle callback (lk_comm_bcastv_ready), the same operations go
 * out as MPI_Ibcast, at most BCASTV_WINDOW in flight; while the oldest is
 * not complete the caller's idle work runs (the tracker fuses its next
 * key) between MPI_Test calls, and MPI_Wait only when there is none. A
 * root's bytes then move while it computes (Open MPI's receivers pull a
 * large message themselves), and a receiver computes between receives.
 * Every rank posts the same operations in the same order. */
#define BCASTV_WINDOW 4
typedef struct bqueue {
    MPI_Request req[BCASTV_WINDOW];
    int head, n;
    lk_comm_idle_fn idle; /* NULL: blocking MPI_Bcast, no queue */
    void *arg;
} bqueue;

/* Completes the oldest operation in flight, running idle work meanwhile. */
static int bq_retire(bqueue *q) {
    MPI_Request *r = &q->req[q->head];
    for (;;) {
        int done = 0, rc = MPI_Test(r, &done, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS) return rc;
        if (done) break;
        if (!q->idle(q->arg)) {
            rc = MPI_Wait(r, MPI_STATUS_IGNORE);
            if (rc != MPI_SUCCESS) return rc;
            break;
        }
    }
    q->head = (q->head + 1) % BCASTV_WINDOW;
    q->n--;
    return MPI_SUCCESS;
}

/* One operation: MPI_Bcast, or an MPI_Ibcast queued in q. */
static int bq_bcast(lk_comm *c, bqueue *q, void *buf, int count, MPI_Datatype t, int root) {
    if (!q->idle) return MPI_Bcast(buf, count, t, root, mc(c));
    if (q->n == BCASTV_WINDOW) {
        int rc = bq_retire(q);
        if (rc != MPI_SUCCESS) return rc;
    }
    int rc = MPI_Ibcast(buf, count, t, root, mc(c), &q->req[(q->head + q->n) % BCASTV_WINDOW]);
    if (rc == MPI_SUCCESS) q->n++;
    return rc;
}

static lk_status bcast_small(lk_comm *c, const lk_comm_seg *seg, size_t nseg, int root, lk_comm_ready_fn ready,
                             void *arg, size_t base, bqueue *q) {
    const size_t step = chunk_of(c);
    int lens[SEGS_PER_ROUND];
    MPI_Aint disp[SEGS_PER_ROUND];
    size_t i = 0, off = 0;
    while (i < nseg) {
        int k = 0;
        size_t bytes = 0;
        while (i < nseg && k < SEGS_PER_ROUND && bytes < step) {
            size_t take = seg[i].n - off < step - bytes ? seg[i].n - off : step - bytes;
            if (take) {
                lens[k] = (int)take;
                MPI_Get_address((char *)seg[i].p + off, &disp[k]);
                k++;
                bytes += take;
            }
            off += take;
            if (off == seg[i].n) {
                i++;
                off = 0;
            }
        }
        if (!k) continue;
        if (ready) ready(arg, base + i + (off != 0)); /* this round reads segments [0, i] or [0, i) */
        MPI_Datatype t;
        int rc = MPI_Type_create_hindexed(k, lens, disp, MPI_BYTE, &t);
        if (rc == MPI_SUCCESS && (rc = MPI_Type_commit(&t)) != MPI_SUCCESS) MPI_Type_free(&t);
        if (rc != MPI_SUCCESS) return mpi_fail(rc, "bcastv datatype");
        rc = bq_bcast(c, q, MPI_BOTTOM, 1, t, root);
        MPI_Type_free(&t); /* an operation in flight keeps its datatype */
        if (rc != MPI_SUCCESS) return mpi_fail(rc, "bcastv");
    }
    return LK_OK;
}

static lk_status mpi_bcastv(lk_comm *c, const lk_comm_seg *seg, size_t nseg, int root, lk_comm_ready_fn ready,
                            lk_comm_idle_fn idle, void *arg) {
    bqueue q = {.idle = idle, .arg = arg};
    size_t i = 0;
    lk_status s = LK_OK;
    while (i < nseg && !s) {
        size_t j = i; /* [i, j): a run of small segments */
        while (j < nseg && seg[j].n < BCASTV_CONTIG) j++;
        s = j > i ? bcast_small(c, seg + i, j - i, root, ready, arg, i, &q) : LK_OK;
        if (!s && j < nseg && ready) ready(arg, j + 1);
        const size_t step = chunk_of(c); /* a large segment: contiguous, in chunks */
        for (size_t off = 0; !s && j < nseg && off < seg[j].n; off += step) {
            size_t k = seg[j].n - off < step ? seg[j].n - off : step;
            int rc = bq_bcast(c, &q, (char *)seg[j].p + off, (int)k, MPI_BYTE, root);
            if (rc != MPI_SUCCESS) s = mpi_fail(rc, "bcastv");
        }
        i = j + 1;
    }
    while (q.n) { /* on a failure too: nothing may stay in flight over the caller's memory */
        int rc = bq_retire(&q);
        if (rc != MPI_SUCCESS) {
            if (!s) s = mpi_fail(rc, "bcastv");
            break;
        }
    }
    return s;
}

static lk_status allreduce(lk_comm *c, void *buf, size_t n, size_t esize, MPI_Datatype t,
                           MPI_Op op, const char *name) {
    size_t step = chunk_of(c) / esize;
    if (step == 0) step = 1;
    for (size_t off = 0; off < n; off += step) {
        size_t k = n - off < step ? n - off : step;
        int rc = MPI_Allreduce(MPI_IN_PLACE, (char *)buf + off * esize, (int)k, t, op, mc(c));
        if (rc != MPI_SUCCESS) return mpi_fail(rc, name);
    }
    return LK_OK;
}

static lk_status mpi_sum(lk_comm *c, float *buf, size_t n) {
    return allreduce(c, buf, n, sizeof(float), MPI_FLOAT, MPI_SUM, "allreduce_f32_sum");
}

static lk_status mpi_u64(lk_comm *c, uint64_t *buf, size_t n, lk_reduce_op op) {
    MPI_Op o = op == LK_REDUCE_SUM ? MPI_SUM : op == LK_REDUCE_MIN ? MPI_MIN : MPI_MAX;
    return allreduce(c, buf, n, sizeof(uint64_t), MPI_UINT64_T, o, "allreduce_u64");
}

static lk_status mpi_allgather(lk_comm *c, const void *send, size_t n, void *recv) {
    char *mine = (char *)recv + (size_t)c->rank * n;
    if (n <= chunk_of(c)) {
        const void *s = send == mine ? MPI_IN_PLACE : send;
        int rc = MPI_Allgather(s, (int)n, MPI_BYTE, recv, (int)n, MPI_BYTE, mc(c));
        return rc == MPI_SUCCESS ? LK_OK : mpi_fail(rc, "allgather");
    }
    /* Past one chunk per rank, each rank's block is broadcast from its owner
     * (chunked): rare, and simpler than derived datatypes. */
    if (send != mine) memmove(mine, send, n);
    for (int r = 0; r < c->size; r++) {
        lk_status st = mpi_bcast(c, (char *)recv + (size_t)r * n, n, r);
        if (st) return st;
    }
    return LK_OK;
}

static lk_status wrap(MPI_Comm comm, size_t chunk, lk_comm **out);

static lk_status mpi_split(lk_comm *c, int color, int key, lk_comm **out) {
    MPI_Comm nc = MPI_COMM_NULL;
    int rc = MPI_Comm_split(mc(c), color < 0 ? MPI_UNDEFINED : color, key, &nc);
    if (rc != MPI_SUCCESS) return mpi_fail(rc, "split");
    if (nc == MPI_COMM_NULL) return LK_OK;
    lk_status st = wrap(nc, chunk_of(c), out);
    if (st) MPI_Comm_free(&nc);
    return st;
}

static const lk_comm_ops g_mpi_ops = {
    .name = "mpi",
    .destroy = mpi_destroy,
    .barrier = mpi_barrier,
    .bcast = mpi_bcast,
    .bcastv = mpi_bcastv,
    .allreduce_f32_sum = mpi_sum,
    .allreduce_u64 = mpi_u64,
    .allgather = mpi_allgather,
    .split = mpi_split,
};

/* Takes ownership of comm on success. */
static lk_status wrap(MPI_Comm comm, size_t chunk, lk_comm **out) {
    int rank = 0, size = 1;
    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
    mpi_impl *m = lk_malloc(sizeof *m);
    if (!m) return lk_error(LK_ERR_NOMEM, "comm mpi: out of memory");
    m->comm = comm;
    m->chunk = chunk;
    m->finalize = 0;
    lk_status st = lk_comm_new(&g_mpi_ops, rank, size, m, out);
    if (st) lk_free(m);
    return st;
}

lk_status lk_comm_from_mpi(MPI_Comm c, lk_comm **out) {
    if (!out) return lk_error(LK_ERR_ARG, "comm mpi: NULL output");
    *out = NULL;
    int init = 0, fin = 0;
    MPI_Initialized(&init);
    MPI_Finalized(&fin);
    if (!init || fin)
        return lk_error(LK_ERR_STATE, "comm mpi: MPI is %s (the host program owns MPI_Init/MPI_Finalize)",
                        fin ? "already finalized" : "not initialized");
    if (c == MPI_COMM_NULL) return lk_error(LK_ERR_ARG, "comm mpi: MPI_COMM_NULL");
    /* The dup is collective: every rank makes it before anything local (the
     * environment may differ between ranks) can fail. */
    MPI_Comm dup;
    int rc = MPI_Comm_dup(c, &dup);
    if (rc != MPI_SUCCESS) return mpi_fail(rc, "dup");
    size_t chunk = (size_t)1 << 30;
    lk_status st = LK_OK;
    const char *e = getenv("LORAKIT_COMM_CHUNK");
    if (e && *e) {
        char *end;
        unsigned long long v = strtoull(e, &end, 10);
        if (*end || v == 0 || v > INT_MAX)
            st = lk_error(LK_ERR_CONFIG, "comm mpi: LORAKIT_COMM_CHUNK=%s is not in 1..%d", e, INT_MAX);
        else chunk = (size_t)v;
    }
    /* Every rank must split an operation into the same rounds: agree on the
     * smallest chunk, and fail everywhere if any rank's value is bad. */
    uint64_t v[2] = {st != LK_OK, ~(uint64_t)chunk}; /* max of ~chunk = ~(min chunk) */
    rc = MPI_Allreduce(MPI_IN_PLACE, v, 2, MPI_UINT64_T, MPI_MAX, dup);
    if (rc != MPI_SUCCESS) st = mpi_fail(rc, "agree on the chunk size");
    else if (!st && v[0]) st = lk_error(LK_ERR_CONFIG, "comm mpi: LORAKIT_COMM_CHUNK is invalid on another rank");
    chunk = (size_t)~v[1];
    if (!st) st = wrap(dup, chunk, out);
    if (st) MPI_Comm_free(&dup);
    return st;
}

lk_status lk_comm_world(int *argc, char ***argv, lk_comm **out) {
    if (!out) return lk_error(LK_ERR_ARG, "comm world: NULL output");
    *out = NULL;
    int init = 0, fin = 0;
    MPI_Initialized(&init);
    MPI_Finalized(&fin);
    if (fin) return lk_error(LK_ERR_STATE, "comm world: MPI is already finalized");
    if (!init && !lk_comm_launcher_size()) return lk_comm_self(out); /* no launcher: no MPI singleton */
    if (!init && MPI_Init(argc, argv) != MPI_SUCCESS)
        return lk_error(LK_ERR_COMM, "comm world: MPI_Init failed");
    lk_status s = lk_comm_from_mpi(MPI_COMM_WORLD, out);
    if (s) {
        if (!init) MPI_Finalize();
        return s;
    }
    ((mpi_impl *)(*out)->impl)->finalize = !init;
    lk_log_set_rank(lk_comm_rank(*out), lk_comm_size(*out));
    return LK_OK;
}
