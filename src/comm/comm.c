/* comm.c — lk_comm dispatch, argument checks, agreement, and the `self`
 * backend.
 *
 * Every distributed feature talks through lk_comm so that the whole library
 * (tracker at one rank, `lorakit swap` without mpirun, training in one
 * process) builds and runs with no MPI at all: the `self` backend is a
 * one-rank communicator whose collectives are copies or no-ops. The MPI
 * backend lives in comm_mpi.c, compiled only when MPI is found. Arguments are
 * checked here once, so backends only move bytes. */
#include "comm/backend.h"
#include "lorakit/comm_nccl.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/clock.h"
#include "lorakit/alloc.h"

lk_status lk_comm_new(const lk_comm_ops *ops, int rank, int size, void *impl, lk_comm **out) {
    lk_comm *c = lk_calloc(1, sizeof *c);
    if (!c) return lk_error(LK_ERR_NOMEM, "comm: out of memory creating a %s communicator", ops->name);
    c->ops = ops;
    c->rank = rank;
    c->size = size;
    c->impl = impl;
    c->timeout = LK_COMM_TIMEOUT_DEFAULT;
    *out = c;
    return LK_OK;
}

void lk_comm_free(lk_comm *c) {
    if (!c) return;
    if (c->ops->destroy) c->ops->destroy(c);
    lk_free(c);
}

int lk_comm_rank(const lk_comm *c) { return c ? c->rank : 0; }
int lk_comm_size(const lk_comm *c) { return c ? c->size : 1; }
const char *lk_comm_backend(const lk_comm *c) { return c ? c->ops->name : "none"; }
int lk_comm_takes_cuda(const lk_comm *c) { return c ? c->cuda_buffers : 0; }

lk_status lk_comm_set_timeout(lk_comm *c, double seconds) {
    if (!c) return lk_error(LK_ERR_ARG, "comm timeout: communicator is NULL");
    if (!isfinite(seconds) || seconds < 0)
        return lk_error(LK_ERR_ARG, "comm timeout: %g seconds is not a finite value >= 0 (0 = none)", seconds);
    c->timeout = seconds;
    if (c->ops->timeout_changed) c->ops->timeout_changed(c);
    return LK_OK;
}

double lk_comm_timeout(const lk_comm *c) { return c ? c->timeout : 0; }

lk_status lk_comm_abort(lk_comm *c, int code) {
    if (!c) return lk_error(LK_ERR_ARG, "comm abort: communicator is NULL");
    if (!c->ops->abort) return lk_error(LK_ERR_UNSUPPORTED, "comm abort: the %s backend cannot end the group", c->ops->name);
    c->ops->abort(c, code);
    return lk_error(LK_ERR_COMM, "comm abort: the %s backend returned", c->ops->name);
}

/* ---- waiting (comm/backend.h) ---- */

void lk_comm_wait_start(lk_comm_wait *w) {
    w->t0 = lk_now_s();
    w->pause = 0;
}

void lk_comm_wait_pause(lk_comm_wait *w) {
    const double cap = lk_now_s() - w->t0 < 1.0 ? 1e-3 : 10e-3;
    w->pause = w->pause ? w->pause * 2 : 50e-6;
    if (w->pause > cap) w->pause = cap;
    struct timespec ts = {0, (long)(w->pause * 1e9)};
    while (nanosleep(&ts, &ts) && errno == EINTR) {
    }
}

int lk_comm_wait_expired(const lk_comm *c, const lk_comm_wait *w) {
    return c->timeout > 0 && lk_now_s() - w->t0 >= c->timeout;
}

lk_status lk_comm_timeout_error(const lk_comm *c, const lk_comm_wait *w, const char *detail) {
    return lk_error(LK_ERR_TIMEOUT, "comm %s %s (collective #%llu on this communicator): timed out (not complete "
                    "after %.1f s; timeout %g s)%s", c->ops->name, c->op ? c->op : "collective",
                    (unsigned long long)c->seq, lk_now_s() - w->t0, c->timeout, detail ? detail : "");
}

/* Every collective passes through enter/leave: a communicator that timed
 * out refuses, each call gets its number (the same on every rank), and a
 * timeout makes the communicator unusable (the collective is still in
 * flight and cannot be cancelled). */
static lk_status enter(lk_comm *c, const char *op) {
    if (c->dead)
        return lk_error(LK_ERR_TIMEOUT, "comm %s: the communicator is unusable after an earlier timeout: %s", op,
                        c->dead_msg);
    c->seq++;
    c->op = op;
    return LK_OK;
}

static lk_status leave(lk_comm *c, lk_status st) {
    if (st == LK_ERR_TIMEOUT && !c->dead) {
        c->dead = 1;
        snprintf(c->dead_msg, sizeof c->dead_msg, "%s", lk_last_error());
    }
    c->op = NULL;
    return st;
}

static lk_status check(const lk_comm *c, const void *buf, size_t n, const char *op) {
    if (!c) return lk_error(LK_ERR_ARG, "comm %s: communicator is NULL", op);
    if (n && !buf) return lk_error(LK_ERR_ARG, "comm %s: NULL buffer for %zu elements", op, n);
    return LK_OK;
}

lk_status lk_comm_barrier(lk_comm *c) {
    lk_status st = check(c, NULL, 0, "barrier");
    if (!st) st = enter(c, "barrier");
    return st ? st : leave(c, c->ops->barrier(c));
}

lk_status lk_comm_bcast(lk_comm *c, void *buf, size_t n, int root) {
    lk_status st = check(c, buf, n, "bcast");
    if (st) return st;
    if (root < 0 || root >= c->size)
        return lk_error(LK_ERR_ARG, "comm bcast: root %d is not a rank of a %d-rank communicator",
                        root, c->size);
    if ((st = enter(c, "bcast"))) return st;
    return leave(c, c->ops->bcast(c, buf, n, root));
}

lk_status lk_comm_bcastv(lk_comm *c, const lk_comm_seg *seg, size_t nseg, int root) {
    return lk_comm_bcastv_ready(c, seg, nseg, root, NULL, NULL, NULL);
}

lk_status lk_comm_bcastv_ready(lk_comm *c, const lk_comm_seg *seg, size_t nseg, int root, lk_comm_ready_fn ready,
                               lk_comm_idle_fn idle, void *arg) {
    lk_status st = check(c, seg, nseg, "bcastv");
    if (st) return st;
    if (root < 0 || root >= c->size)
        return lk_error(LK_ERR_ARG, "comm bcastv: root %d is not a rank of a %d-rank communicator",
                        root, c->size);
    for (size_t i = 0; i < nseg; i++)
        if (seg[i].n && !seg[i].p) return lk_error(LK_ERR_ARG, "comm bcastv: segment %zu is NULL", i);
    if (c->rank != root) ready = NULL;
    if ((st = enter(c, "bcastv"))) return st;
    if (c->ops->bcastv) return leave(c, c->ops->bcastv(c, seg, nseg, root, ready, idle, arg));
    for (size_t i = 0; i < nseg && !st; i++) {
        if (!seg[i].n) continue;
        if (ready) ready(arg, i + 1);
        st = c->ops->bcast(c, seg[i].p, seg[i].n, root);
    }
    return leave(c, st);
}

lk_status lk_comm_allreduce_f32_sum(lk_comm *c, float *buf, size_t n) {
    lk_status st = check(c, buf, n, "allreduce_f32_sum");
    if (!st) st = enter(c, "allreduce_f32_sum");
    return st ? st : leave(c, c->ops->allreduce_f32_sum(c, buf, n));
}

lk_status lk_comm_allreduce_u64(lk_comm *c, uint64_t *buf, size_t n, lk_reduce_op op) {
    lk_status st = check(c, buf, n, "allreduce_u64");
    if (st) return st;
    if (op != LK_REDUCE_SUM && op != LK_REDUCE_MIN && op != LK_REDUCE_MAX)
        return lk_error(LK_ERR_ARG, "comm allreduce_u64: unknown reduce op %d", (int)op);
    if ((st = enter(c, "allreduce_u64"))) return st;
    return leave(c, c->ops->allreduce_u64(c, buf, n, op));
}

lk_status lk_comm_allgather(lk_comm *c, const void *send, size_t n, void *recv) {
    lk_status st = check(c, send, n, "allgather");
    if (st) return st;
    size_t total;
    if (!lk_checked_mul(n, (size_t)c->size, &total))
        return lk_error(LK_ERR_ARG, "comm allgather: %zu bytes x %d ranks overflows", n, c->size);
    if (n && !recv) return lk_error(LK_ERR_ARG, "comm allgather: NULL receive buffer");
    if ((st = enter(c, "allgather"))) return st;
    return leave(c, c->ops->allgather(c, send, n, recv));
}

lk_status lk_comm_split(lk_comm *c, int color, int key, lk_comm **out) {
    if (!c || !out) return lk_error(LK_ERR_ARG, "comm split: NULL argument");
    *out = NULL;
    lk_status st = enter(c, "split");
    if (!st) st = leave(c, c->ops->split(c, color, key, out));
    if (!st && *out) lk_comm_set_timeout(*out, c->timeout);
    return st;
}

/* The failing rank's status and message travel in one fixed-size record, so
 * the broadcast has the same size on every rank whatever the message. */
typedef struct agree_msg {
    int32_t status;
    char text[1024];
} agree_msg;

lk_status lk_comm_agree(lk_comm *c, lk_status local) { return lk_comm_agree_min(c, local, NULL, 0); }

lk_status lk_comm_agree_min(lk_comm *c, lk_status local, uint64_t *v, size_t n) {
    if (!c) return lk_error(LK_ERR_ARG, "comm agree: communicator is NULL");
    if (n > 7 || (n && !v)) return lk_error(LK_ERR_ARG, "comm agree: %zu values (at most 7)", n);
    if (c->size == 1) return local; /* nothing to agree on; keep the message as it is */
    uint64_t buf[8] = {local != LK_OK ? (uint64_t)c->rank : UINT64_MAX};
    if (n) memcpy(buf + 1, v, n * sizeof *v);
    lk_status s = enter(c, "agree");
    if (s) return s;
    if ((s = leave(c, c->ops->allreduce_u64(c, buf, n + 1, LK_REDUCE_MIN))))
        return s == LK_ERR_TIMEOUT ? s : lk_error_prefix(LK_ERR_COMM, "comm agree"); /* a timeout names "agree" */
    if (n) memcpy(v, buf + 1, n * sizeof *v);
    const uint64_t first = buf[0];
    if (first == UINT64_MAX) return LK_OK;
    if (first >= (uint64_t)c->size) /* a transport that broke mid-way (a rank that came after a timeout) */
        return lk_error(LK_ERR_COMM, "comm agree: the agreement came back corrupt (failing rank %llu of %d)",
                        (unsigned long long)first, c->size);
    agree_msg m;
    memset(&m, 0, sizeof m);
    if (first == (uint64_t)c->rank) {
        m.status = (int32_t)local;
        strncpy(m.text, lk_last_error(), sizeof m.text - 1);
    }
    if ((s = enter(c, "agree (the failing rank's message)"))) return s;
    if ((s = leave(c, c->ops->bcast(c, &m, sizeof m, (int)first))))
        return s == LK_ERR_TIMEOUT ? s : lk_error_prefix(LK_ERR_COMM, "comm agree");
    m.text[sizeof m.text - 1] = '\0';
    lk_status st = (m.status > 0 && m.status < LK_STATUS_COUNT) ? (lk_status)m.status : LK_ERR_COMM;
    return lk_error(st, "rank %d: %s", (int)first, m.text);
}

/* ---- the self backend: one rank, collectives are copies ---- */

static lk_status self_barrier(lk_comm *c) {
    (void)c;
    return LK_OK;
}

static lk_status self_bcast(lk_comm *c, void *buf, size_t n, int root) {
    (void)c; (void)buf; (void)n; (void)root;
    return LK_OK;
}

static lk_status self_sum(lk_comm *c, float *buf, size_t n) {
    (void)c; (void)buf; (void)n;
    return LK_OK;
}

static lk_status self_u64(lk_comm *c, uint64_t *buf, size_t n, lk_reduce_op op) {
    (void)c; (void)buf; (void)n; (void)op;
    return LK_OK;
}

static lk_status self_allgather(lk_comm *c, const void *send, size_t n, void *recv) {
    (void)c;
    if (n && send != recv) memmove(recv, send, n);
    return LK_OK;
}

static lk_status self_split(lk_comm *c, int color, int key, lk_comm **out) {
    (void)c; (void)key;
    if (color < 0) return LK_OK;
    return lk_comm_self(out);
}

static const lk_comm_ops g_self_ops = {
    .name = "self",
    .destroy = NULL,
    .barrier = self_barrier,
    .bcast = self_bcast,
    .allreduce_f32_sum = self_sum,
    .allreduce_u64 = self_u64,
    .allgather = self_allgather,
    .split = self_split,
};

lk_status lk_comm_self(lk_comm **out) {
    if (!out) return lk_error(LK_ERR_ARG, "comm self: NULL output");
    return lk_comm_new(&g_self_ops, 0, 1, NULL, out);
}

int lk_comm_launcher_size(void) {
    /* Open MPI's mpirun, then PMI-1/PMI-2 (MPICH, Slurm) and PMIx launchers */
    static const char *const vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MPI_LOCALNRANKS", NULL};
    for (int i = 0; vars[i]; i++) {
        const char *v = getenv(vars[i]);
        if (v && atoi(v) > 0) return atoi(v);
    }
    /* launchers that export a rank but not the size */
    return getenv("PMIX_RANK") || getenv("PMI_RANK") ? 1 : 0;
}

#ifndef LK_HAVE_MPI
lk_status lk_comm_world(int *argc, char ***argv, lk_comm **out) {
    (void)argc;
    (void)argv;
    if (!out) return lk_error(LK_ERR_ARG, "comm world: NULL output");
    *out = NULL;
    int n = lk_comm_launcher_size();
    if (n > 1)
        return lk_error(LK_ERR_UNSUPPORTED, "started as one of %d MPI ranks, but this lorakit was built "
                        "without MPI (install Open MPI and rebuild)", n);
    return lk_comm_self(out);
}
#endif

#ifndef LK_HAVE_NCCL
/* Built without NCCL (comm_nccl.c not compiled). */
static lk_status no_nccl(void) {
    return lk_error(LK_ERR_UNSUPPORTED, "comm nccl: this lorakit was built without NCCL (install NCCL and the CUDA "
                    "toolkit and rebuild)");
}
int lk_comm_nccl_built(void) { return 0; }
int lk_comm_nccl_local_device(int n_devices) {
    (void)n_devices;
    return 0;
}
lk_status lk_comm_nccl_create(lk_comm *boot, int device, lk_comm **out) {
    (void)boot, (void)device;
    if (out) *out = NULL;
    return no_nccl();
}
lk_status lk_comm_from_nccl(struct ncclComm *comm, int device, void *stream, lk_comm **out) {
    (void)comm, (void)device, (void)stream;
    if (out) *out = NULL;
    return no_nccl();
}
lk_status lk_comm_nccl_set_stream(lk_comm *c, void *stream) {
    (void)c, (void)stream;
    return no_nccl();
}
int lk_comm_nccl_device(const lk_comm *c) {
    (void)c;
    return -1;
}
#endif
