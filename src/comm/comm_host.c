/* comm_host.c — the `host` backend of lk_comm: collectives supplied by the
 * embedding program as function pointers (lorakit/comm_host.h).
 *
 * Why it is built this way:
 * - The host moves bytes; everything that makes lorakit safe over a group
 *   (agreement before data-sized collectives, the failing rank's message on
 *   every rank) lives above the backend vtable in comm.c, the tracker and
 *   the sync, exactly as for MPI. So this file only adapts shapes: it splits
 *   operations past the host's max_bytes and implements the vectored
 *   broadcast the tracker uses.
 * - A host transport has no derived datatypes, and each of its calls may
 *   cost tens of microseconds (torch.distributed from Python), so the
 *   vectored broadcast packs runs of small segments into staging rounds
 *   (one host broadcast per round instead of one per key) and sends large
 *   segments straight from/into the caller's memory. The choice depends on
 *   the segment lengths only, which every rank passes alike, so every rank
 *   makes the same calls.
 * - With the host's optional non-blocking broadcast (ibcast/test/wait), up
 *   to HOST_WINDOW operations are in flight and the caller's idle work (the
 *   tracker fuses its next key) runs between tests; a receiver unpacks a
 *   staged round when it completes. Without them, every broadcast blocks:
 *   the same bytes in the same order, no overlap.
 * - Staging buffers are allocated once, when the communicator is created (a
 *   collective that agrees on success), never inside a collective where a
 *   failure on one rank would leave the others waiting. */
#include "lorakit/comm_host.h"

#include <stdlib.h>
#include <string.h>

#include "comm/backend.h"
#include "lorakit/alloc.h"

#define HOST_WINDOW 4
#define HOST_STAGE ((size_t)1 << 20)   /* bytes per staged round */
#define HOST_CONTIG ((size_t)256 << 10) /* a segment this large goes unstaged */

typedef struct host_impl {
    lk_comm_host_ops ops;
    void *ctx;
    size_t step;   /* bytes per callback (max_bytes, or SIZE_MAX) */
    size_t stage_n; /* bytes per staging buffer */
    int nstage;     /* HOST_WINDOW with ibcast, else 1 */
    unsigned char *stage; /* nstage * stage_n bytes */
} host_impl;

static host_impl *hi(const lk_comm *c) { return c->impl; }

/* A callback failed (its message in lk_last_error()). */
/* A host callback failed with s: LK_ERR_COMM naming op, except that a
 * host's timeout (LK_ERR_TIMEOUT, set_timeout) stays one. */
static lk_status host_fail(lk_status s, const char *op) {
    return lk_error_prefix(s == LK_ERR_TIMEOUT ? s : LK_ERR_COMM, "%s", op);
}

static void host_timeout_changed(lk_comm *c) {
    host_impl *h = hi(c);
    if (h->ops.set_timeout) h->ops.set_timeout(h->ctx, c->timeout);
}

static void host_destroy(lk_comm *c) {
    host_impl *h = hi(c);
    if (h->ops.destroy) h->ops.destroy(h->ctx);
    lk_free(h->stage);
    lk_free(h);
}

static lk_status host_barrier(lk_comm *c) {
    lk_status s = hi(c)->ops.barrier(hi(c)->ctx);
    return s ? host_fail(s, "comm host barrier") : LK_OK;
}

static lk_status host_bcast(lk_comm *c, void *buf, size_t n, int root) {
    host_impl *h = hi(c);
    for (size_t off = 0; off < n; off += h->step) {
        size_t k = n - off < h->step ? n - off : h->step;
        lk_status s = h->ops.bcast(h->ctx, (char *)buf + off, k, root);
        if (s) return host_fail(s, "comm host bcast");
    }
    return LK_OK;
}

static lk_status host_reduce(lk_comm *c, void *buf, size_t n, size_t esize, lk_comm_dtype t, lk_reduce_op op,
                             const char *name) {
    host_impl *h = hi(c);
    size_t step = h->step / esize ? h->step / esize : 1;
    for (size_t off = 0; off < n; off += step) {
        size_t k = n - off < step ? n - off : step;
        lk_status s = h->ops.allreduce(h->ctx, (char *)buf + off * esize, k, t, op);
        if (s) return host_fail(s, name);
    }
    return LK_OK;
}

static lk_status host_sum(lk_comm *c, float *buf, size_t n) {
    return host_reduce(c, buf, n, sizeof(float), LK_COMM_F32, LK_REDUCE_SUM, "comm host allreduce_f32_sum");
}

static lk_status host_u64(lk_comm *c, uint64_t *buf, size_t n, lk_reduce_op op) {
    return host_reduce(c, buf, n, sizeof(uint64_t), LK_COMM_U64, op, "comm host allreduce_u64");
}

static lk_status host_allgather(lk_comm *c, const void *send, size_t n, void *recv) {
    host_impl *h = hi(c);
    char *mine = (char *)recv + (size_t)c->rank * n;
    if (n == 0) return LK_OK; /* n is the same on every rank: no call anywhere */
    if (n <= h->step / (size_t)c->size) {
        lk_status s = h->ops.allgather(h->ctx, send, n, recv);
        return s ? host_fail(s, "comm host allgather") : LK_OK;
    }
    /* past the host's limit: each rank's block broadcast from its owner */
    if (send != mine) memmove(mine, send, n);
    for (int r = 0; r < c->size; r++) {
        lk_status s = host_bcast(c, (char *)recv + (size_t)r * n, n, r);
        if (s) return s;
    }
    return LK_OK;
}

static lk_status host_split(lk_comm *c, int color, int key, lk_comm **out) {
    host_impl *h = hi(c);
    if (!h->ops.split) /* agreed at creation: every rank refuses alike */
        return lk_error(LK_ERR_UNSUPPORTED, "comm host: this host communicator offers no split (a mesh needs one); "
                        "give lk_comm_host_ops.split");
    lk_status s = h->ops.split(h->ctx, color, key, out);
    return s ? host_fail(s, "comm host split") : LK_OK;
}

/* ---- the vectored broadcast ---- */

/* One operation in flight: a staged round (stage >= 0, to unpack on a
 * receiver from segment first/off, bytes long) or a direct piece. */
typedef struct hop {
    void *req;
    int stage;
    size_t first, off, bytes;
} hop;

typedef struct hqueue {
    lk_comm *c;
    const lk_comm_seg *seg;
    int root, async;
    lk_comm_idle_fn idle;
    void *arg;
    hop op[HOST_WINDOW];
    int head, n;
} hqueue;

/* Copies a staged round's bytes (root: from the segments; receiver: into
 * them), starting at segment first, offset off. */
static void stage_copy(const lk_comm_seg *seg, size_t first, size_t off, unsigned char *stage, size_t bytes,
                       int to_stage) {
    size_t done = 0;
    for (size_t i = first; done < bytes; i++, off = 0) {
        size_t take = seg[i].n - off < bytes - done ? seg[i].n - off : bytes - done;
        if (to_stage) memcpy(stage + done, (char *)seg[i].p + off, take);
        else memcpy((char *)seg[i].p + off, stage + done, take);
        done += take;
    }
}

static unsigned char *stage_of(hqueue *q, int slot) {
    host_impl *h = hi(q->c);
    return h->stage + (size_t)slot * h->stage_n;
}

/* Completes the oldest operation, running idle work while it moves. */
static lk_status hq_retire(hqueue *q) {
    host_impl *h = hi(q->c);
    hop *o = &q->op[q->head];
    lk_status s = LK_OK;
    for (;;) {
        int done = 0;
        if ((s = h->ops.test(h->ctx, o->req, &done)) || done) break;
        if (!q->idle || !q->idle(q->arg)) {
            s = h->ops.wait(h->ctx, o->req);
            break;
        }
    }
    if (!s && o->stage >= 0 && q->c->rank != q->root) stage_copy(q->seg, o->first, o->off, stage_of(q, o->stage), o->bytes, 0);
    q->head = (q->head + 1) % HOST_WINDOW;
    q->n--;
    return s ? host_fail(s, "comm host bcastv") : LK_OK;
}

/* Starts (or, blocking, runs) one broadcast of buf[0..n). For a staged
 * round, buf is the slot's stage (pass stage = the slot) and the root has
 * filled it already. */
static lk_status hq_bcast(hqueue *q, void *buf, size_t n, int stage, size_t first, size_t off) {
    host_impl *h = hi(q->c);
    if (!q->async) {
        lk_status s = h->ops.bcast(h->ctx, buf, n, q->root);
        if (s) return host_fail(s, "comm host bcastv");
        if (stage >= 0 && q->c->rank != q->root) stage_copy(q->seg, first, off, buf, n, 0);
        return LK_OK;
    }
    hop *o = &q->op[(q->head + q->n) % HOST_WINDOW];
    *o = (hop){NULL, stage, first, off, n};
    lk_status s = h->ops.ibcast(h->ctx, buf, n, q->root, &o->req);
    if (s) return host_fail(s, "comm host bcastv");
    q->n++;
    return LK_OK;
}

/* The slot the next operation will take, retiring the oldest if all are
 * in flight (its staging buffer is then free). */
static lk_status hq_slot(hqueue *q, int *slot) {
    if (!q->async) {
        *slot = 0;
        return LK_OK;
    }
    lk_status s = q->n == HOST_WINDOW ? hq_retire(q) : LK_OK;
    *slot = (q->head + q->n) % HOST_WINDOW;
    return s;
}

static lk_status host_bcastv(lk_comm *c, const lk_comm_seg *seg, size_t nseg, int root, lk_comm_ready_fn ready,
                             lk_comm_idle_fn idle, void *arg) {
    host_impl *h = hi(c);
    hqueue q = {.c = c, .seg = seg, .root = root, .async = idle && h->ops.ibcast, .idle = idle, .arg = arg};
    lk_status s = LK_OK;
    size_t i = 0, off = 0; /* the next byte to send: seg[i] at off */
    while (!s) {
        while (i < nseg && seg[i].n == 0) i++;
        if (i == nseg) break;
        int slot;
        if (seg[i].n >= HOST_CONTIG) { /* straight from/into the segment (off is 0: never staged) */
            if (ready) ready(arg, i + 1);
            for (size_t o = 0; !s && o < seg[i].n; o += h->step) {
                size_t k = seg[i].n - o < h->step ? seg[i].n - o : h->step;
                if (!(s = hq_slot(&q, &slot))) s = hq_bcast(&q, (char *)seg[i].p + o, k, -1, 0, 0);
            }
            i++;
            continue;
        }
        /* a staged round: small segments from (i, off), at most stage_n
         * bytes; a segment may continue into the next round */
        size_t first = i, foff = off, bytes = 0;
        while (i < nseg && seg[i].n < HOST_CONTIG && bytes < h->stage_n) {
            size_t take = seg[i].n - off < h->stage_n - bytes ? seg[i].n - off : h->stage_n - bytes;
            bytes += take;
            off += take;
            if (off == seg[i].n) i++, off = 0;
        }
        if ((s = hq_slot(&q, &slot))) break;
        unsigned char *st = stage_of(&q, slot);
        if (c->rank == root) {
            if (ready) ready(arg, i + (off != 0)); /* this round reads segments [first, i] or [first, i) */
            stage_copy(seg, first, foff, st, bytes, 1);
        }
        s = hq_bcast(&q, st, bytes, slot, first, foff);
    }
    /* on a failure too, nothing stays in flight over the caller's memory,
     * except after a timeout: the rest cannot complete either (comm.h) */
    while (q.n && s != LK_ERR_TIMEOUT) {
        lk_status r = hq_retire(&q);
        if (r && (!s || r == LK_ERR_TIMEOUT)) s = r;
    }
    return s;
}

static const lk_comm_ops g_host_ops = {
    .name = "host",
    .destroy = host_destroy,
    .barrier = host_barrier,
    .bcast = host_bcast,
    .bcastv = host_bcastv,
    .allreduce_f32_sum = host_sum,
    .allreduce_u64 = host_u64,
    .allgather = host_allgather,
    .split = host_split,
    .timeout_changed = host_timeout_changed,
};

void *lk_comm_host_ctx(const lk_comm *c) { return c && c->ops == &g_host_ops ? hi(c)->ctx : NULL; }

lk_status lk_comm_from_host(const lk_comm_host_ops *ops, void *ctx, int rank, int size, lk_comm **out) {
    if (out) *out = NULL;
    /* Without the required callbacks there is no collective to agree
     * through: a local error (the host's programming error). */
    if (!ops || !out || !ops->barrier || !ops->bcast || !ops->allreduce || !ops->allgather) {
        if (ops && ops->destroy) ops->destroy(ctx);
        return lk_error(LK_ERR_ARG, "comm host: NULL %s", !ops ? "ops" : !out ? "output"
                        : "required callback (barrier, bcast, allreduce and allgather are required)");
    }
    lk_status local = LK_OK;
    int nb = (ops->ibcast != NULL) + (ops->test != NULL) + (ops->wait != NULL);
    if (size < 1 || rank < 0 || rank >= size)
        local = lk_error(LK_ERR_ARG, "comm host: rank %d is not a rank of a %d-rank group", rank, size);
    else if (nb != 0 && nb != 3)
        local = lk_error(LK_ERR_ARG, "comm host: ibcast, test and wait come together (%d of 3 given)", nb);
    host_impl *h = local ? NULL : lk_calloc(1, sizeof *h);
    if (!local && !h) local = lk_error(LK_ERR_NOMEM, "comm host: out of memory");
    if (h) {
        h->ops = *ops;
        h->ctx = ctx;
        h->step = ops->max_bytes ? ops->max_bytes : SIZE_MAX;
        h->stage_n = HOST_STAGE < h->step ? HOST_STAGE : h->step;
        h->nstage = nb ? HOST_WINDOW : 1;
        if (!(h->stage = lk_malloc((size_t)h->nstage * h->stage_n)))
            local = lk_error(LK_ERR_NOMEM, "comm host: out of memory for %d staging buffers of %zu bytes", h->nstage,
                             h->stage_n);
    }
    /* Agree on success and on what shapes every later call: the rank
     * count, max_bytes, the optional callbacks (max of x and ~x: min and
     * max in one collective). */
    uint64_t v[8] = {local != LK_OK, 0, (uint64_t)size, ~(uint64_t)size, (uint64_t)ops->max_bytes,
                     ~(uint64_t)ops->max_bytes, (uint64_t)(nb != 0) << 1 | (ops->split != NULL),
                     ~((uint64_t)(nb != 0) << 1 | (ops->split != NULL))};
    lk_status s = ops->allreduce(ctx, v, 8, LK_COMM_U64, LK_REDUCE_MAX);
    if (s) {
        s = lk_error_prefix(LK_ERR_COMM, "comm host: agreeing on the group");
    } else if (local) {
        s = local;
    } else if (v[0]) {
        s = lk_error(LK_ERR_ARG, "comm host: another rank's arguments are invalid");
    } else if (v[2] != ~v[3] || v[4] != ~v[5] || v[6] != ~v[7]) {
        s = lk_error(LK_ERR_MISMATCH, "comm host: the ranks disagree on the group (this rank: size %d, max_bytes "
                     "%zu, non-blocking broadcast %s, split %s; sizes across ranks %llu..%llu)", size, ops->max_bytes,
                     nb ? "yes" : "no", ops->split ? "yes" : "no", (unsigned long long)~v[3], (unsigned long long)v[2]);
    }
    if (!s) { /* every rank claims its own rank: the same verdict everywhere from one allgather */
        int32_t *ranks = lk_malloc((size_t)size * sizeof *ranks), me = rank; /* size agreed: same on every rank */
        uint64_t bad = !ranks;
        if (ops->allreduce(ctx, &bad, 1, LK_COMM_U64, LK_REDUCE_MAX)) {
            s = lk_error_prefix(LK_ERR_COMM, "comm host: agreeing on the group");
        } else if (bad) {
            s = lk_error(LK_ERR_NOMEM, "comm host: out of memory for %d ranks", size);
        } else if (ops->allgather(ctx, &me, sizeof me, ranks)) {
            s = lk_error_prefix(LK_ERR_COMM, "comm host: gathering the ranks");
        } else {
            for (int r = 0; r < size && !s; r++)
                if (ranks[r] != r)
                    s = lk_error(LK_ERR_MISMATCH, "comm host: the process at position %d of the group says it is "
                                 "rank %d (every rank must pass its own position in the group)", r, (int)ranks[r]);
        }
        lk_free(ranks);
    }
    if (!s) s = lk_comm_new(&g_host_ops, rank, size, h, out);
    if (!s) host_timeout_changed(*out); /* the default */
    if (s) {
        if (h) lk_free(h->stage);
        lk_free(h);
        if (ops->destroy) ops->destroy(ctx);
    }
    return s;
}
