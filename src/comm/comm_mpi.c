/* comm_mpi.c — the MPI backend of lk_comm (built only when MPI is found).
 *
 * lk_comm_from_mpi duplicates the caller's communicator, so lorakit's
 * messages never mix with the host program's, and sets MPI_ERRORS_RETURN on
 * the duplicate so a transport failure becomes LK_ERR_COMM instead of an
 * abort. MPI counts are int: every operation is split into rounds of at most
 * `chunk` bytes (1 GiB; LORAKIT_COMM_CHUNK overrides it, read once at
 * creation and agreed over the ranks, so tests can exercise the splitting
 * with small buffers).
 *
 * Every collective is non-blocking (MPI_Ibcast, MPI_Iallreduce, ...) and
 * completed by wait_req: MPI_Test, then a sleep that grows (lk_comm_wait),
 * because Open MPI's blocking collectives and MPI_Wait busy-poll a core for
 * as long as a rank waits, and a blocking call cannot time out. On the
 * communicator's timeout the waiting rank asks every other rank where it is
 * (point-to-point on a second duplicate, `ctl`, so the questions never mix
 * with the collectives): ranks waiting in a collective answer from their
 * wait loop with its number, so the report names the ranks that never came
 * (no answer: stalled, or busy outside lorakit's collectives) and those
 * that were waiting too. Nothing of this runs while collectives complete. */
#include "lorakit/comm_mpi.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm/backend.h"
#include "core/clock.h"
#include "core/text.h"
#include "lorakit/alloc.h"
#include "lorakit/log.h"

/* A question (asked: the asker's collective number) or its answer (seq and
 * op: the collective the answering rank is waiting in). */
typedef struct ctl_msg {
    uint64_t asked;
    uint64_t seq;
    char op[48];
} ctl_msg;
/* TAG_GIVEUP: a rank whose collective timed out for good tells every
 * other rank, so that each rank still waiting reports its own view before
 * the job is aborted (rather than being ended by the abort unheard). */
enum { TAG_ASK = 1, TAG_ANSWER = 2, TAG_GIVEUP = 3 };

typedef struct mpi_impl {
    MPI_Comm comm;
    MPI_Comm ctl;      /* timeout questions and answers only */
    size_t chunk;      /* max bytes per MPI call, <= INT_MAX */
    int finalize;      /* lk_comm_world initialized MPI: finalize on free */
    int nsend;         /* ctl sends in flight at most: 2 per rank */
    MPI_Request *sreq; /* [nsend] */
    ctl_msg *sbuf;     /* [nsend]: their bytes */
    void *stage;       /* [STAGE_BYTES]: small operations move through it */
} mpi_impl;

/* An operation of at most STAGE_BYTES (the agreements, the hashes, an
 * allgather of a word per rank) moves through the communicator's own stage
 * rather than the caller's memory, often a stack frame: a timed-out
 * operation cannot be cancelled, and the transport may write its receive
 * buffer whenever the missing ranks arrive, so after a timeout the stage is
 * left to it for good (quarantine: never freed or reused). Copying a few
 * bytes costs nothing next to a collective. */
#define STAGE_BYTES 4096
static void *g_quarantine[64]; /* reachable, so leak checkers see no leak */
static int g_n_quarantine;

/* After a timeout in an operation using the stage. */
static void quarantine(mpi_impl *m) {
    int i = __atomic_fetch_add(&g_n_quarantine, 1, __ATOMIC_RELAXED);
    if (i < 64) g_quarantine[i] = m->stage;
    m->stage = NULL; /* the communicator is unusable from now on (comm.h) */
}

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
    for (int i = 0; !finalized && i < m->nsend; i++)
        if (m->sreq[i] != MPI_REQUEST_NULL) { /* an answer never received: its bytes go with m */
            MPI_Cancel(&m->sreq[i]);
            MPI_Wait(&m->sreq[i], MPI_STATUS_IGNORE);
        }
    if (!finalized && m->ctl != MPI_COMM_NULL) MPI_Comm_free(&m->ctl);
    if (!finalized && m->comm != MPI_COMM_NULL) MPI_Comm_free(&m->comm);
    if (!finalized && m->finalize) MPI_Finalize();
    lk_free(m->sreq);
    lk_free(m->sbuf);
    lk_free(m->stage);
    lk_free(m);
}

static void mpi_abort(lk_comm *c, int code) { MPI_Abort(mc(c), code); }

/* ---- waiting, and the timeout's diagnosis ---- */

/* Sends msg to dest on ctl without blocking, from a free slot of the ring
 * (its bytes stay there until sent); dropped when every slot is busy. */
static void ctl_send(mpi_impl *m, const ctl_msg *msg, int dest, int tag) {
    for (int i = 0; i < m->nsend; i++) {
        int done = 1;
        if (m->sreq[i] != MPI_REQUEST_NULL && (MPI_Test(&m->sreq[i], &done, MPI_STATUS_IGNORE) != MPI_SUCCESS || !done))
            continue;
        m->sbuf[i] = *msg;
        if (MPI_Isend(&m->sbuf[i], (int)sizeof *msg, MPI_BYTE, dest, tag, m->ctl, &m->sreq[i]) != MPI_SUCCESS)
            m->sreq[i] = MPI_REQUEST_NULL;
        return;
    }
}

/* Answers every pending question of a timing-out rank with the collective
 * this rank is waiting in. */
static void ctl_answer(lk_comm *c) {
    mpi_impl *m = c->impl;
    for (;;) {
        int flag = 0;
        MPI_Status st;
        if (MPI_Iprobe(MPI_ANY_SOURCE, TAG_ASK, m->ctl, &flag, &st) != MPI_SUCCESS || !flag) return;
        ctl_msg q, a;
        if (MPI_Recv(&q, (int)sizeof q, MPI_BYTE, st.MPI_SOURCE, TAG_ASK, m->ctl, MPI_STATUS_IGNORE) != MPI_SUCCESS)
            return;
        memset(&a, 0, sizeof a);
        a.asked = q.asked;
        a.seq = c->seq;
        snprintf(a.op, sizeof a.op, "%s", c->op ? c->op : "?");
        ctl_send(m, &a, st.MPI_SOURCE, TAG_ANSWER);
    }
}

/* Where an answering rank stood, seen from the collective this rank
 * waits in: no answer (seq 0); in another collective (an earlier one, or
 * the same number but another operation: the ranks called different
 * collectives); waiting in it too; already past it. */
enum { SILENT, ELSEWHERE, WITH_US, PAST, KINDS };
static int kind_of(const lk_comm *c, const ctl_msg *a) {
    if (a->seq == 0) return SILENT;
    if (a->seq < c->seq || (a->seq == c->seq && strncmp(a->op, c->op ? c->op : "?", sizeof a->op))) return ELSEWHERE;
    return a->seq == c->seq ? WITH_US : PAST;
}

/* The detail of a timeout from the answers (ans[p] for every other rank
 * p): "; waiting for rank 3 (no answer: ...); waiting in it too: ranks 0, 1". */
static void describe(const lk_comm *c, const ctl_msg *ans, char *buf, size_t cap) {
    static const char *const head[KINDS] = {"; waiting for ", "; waiting for ", "; waiting in it too: ",
                                            "; already past it: "};
    int total[KINDS] = {0};
    for (int p = 0; p < c->size; p++)
        if (p != c->rank) total[kind_of(c, &ans[p])]++;
    size_t len = 0;
    for (int kind = 0; kind < KINDS; kind++) {
        if (!total[kind]) continue;
        const int joined = kind == ELSEWHERE && total[SILENT]; /* one "waiting for" list */
        lk_appendf(buf, cap, &len, "%s%s", joined ? ", " : head[kind], total[kind] > 1 ? "ranks " : "rank ");
        int listed = 0;
        for (int p = 0; p < c->size && listed < 16; p++) {
            if (p == c->rank || kind_of(c, &ans[p]) != kind) continue;
            lk_appendf(buf, cap, &len, "%s%d", listed++ ? ", " : "", p);
            if (kind == ELSEWHERE || kind == PAST)
                lk_appendf(buf, cap, &len, " (in collective #%llu, %.*s)", (unsigned long long)ans[p].seq,
                           (int)sizeof ans[p].op, ans[p].op);
        }
        if (total[kind] > listed) lk_appendf(buf, cap, &len, " and %d more", total[kind] - listed);
        if (kind == SILENT) lk_appendf(buf, cap, &len, " (no answer: stalled, or busy outside lorakit's collectives)");
    }
}

/* The timeout passed while waiting for *r: asks every other rank where it
 * is, collects answers for a short grace (answering others meanwhile),
 * and returns LK_ERR_TIMEOUT describing them; or LK_OK if *r completes
 * within the grace after all. */
static lk_status expire(lk_comm *c, MPI_Request *r, const lk_comm_wait *w, double grace_cap, const char *lead) {
    mpi_impl *m = c->impl;
    ctl_msg *ans = lk_calloc((size_t)c->size, sizeof *ans);
    char detail[1024] = "";
    size_t dl = 0;
    if (lead) lk_appendf(detail, sizeof detail, &dl, "%s", lead);
    if (ans) {
        ctl_msg q;
        memset(&q, 0, sizeof q);
        q.asked = c->seq;
        for (int p = 0; p < c->size; p++)
            if (p != c->rank) ctl_send(m, &q, p, TAG_ASK);
        double grace = c->timeout / 2 < 0.25 ? 0.25 : c->timeout / 2 > 2 ? 2 : c->timeout / 2;
        if (grace > grace_cap) grace = grace_cap;
        const double end = lk_now_s() + grace;
        int answered = 0;
        while (answered < c->size - 1 && lk_now_s() < end) {
            int done = 0;
            if (MPI_Test(r, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && done) { /* came late after all */
                lk_free(ans);
                return LK_OK;
            }
            ctl_answer(c);
            for (;;) {
                int flag = 0;
                MPI_Status st;
                ctl_msg a;
                if (MPI_Iprobe(MPI_ANY_SOURCE, TAG_ANSWER, m->ctl, &flag, &st) != MPI_SUCCESS || !flag) break;
                if (MPI_Recv(&a, (int)sizeof a, MPI_BYTE, st.MPI_SOURCE, TAG_ANSWER, m->ctl, MPI_STATUS_IGNORE) != MPI_SUCCESS)
                    break;
                if (a.asked == c->seq && ans[st.MPI_SOURCE].seq == 0 && a.seq) {
                    ans[st.MPI_SOURCE] = a;
                    answered++;
                }
            }
            struct timespec ts = {0, 1000000};
            nanosleep(&ts, NULL);
        }
        describe(c, ans, detail + dl, sizeof detail - dl);
        lk_free(ans);
    }
    ctl_msg g; /* for good: tell the others, who may still be waiting without knowing */
    memset(&g, 0, sizeof g);
    g.asked = c->seq;
    g.seq = c->seq;
    snprintf(g.op, sizeof g.op, "%s", c->op ? c->op : "?");
    for (int p = 0; p < c->size; p++)
        if (p != c->rank) ctl_send(m, &g, p, TAG_GIVEUP);
    return lk_comm_timeout_error(c, w, detail);
}

/* Whether another rank gave up for good (TAG_GIVEUP); *lead gets what to
 * say about it. */
static int gave_up(lk_comm *c, char *lead, size_t cap) {
    mpi_impl *m = c->impl;
    int flag = 0;
    MPI_Status st;
    if (MPI_Iprobe(MPI_ANY_SOURCE, TAG_GIVEUP, m->ctl, &flag, &st) != MPI_SUCCESS || !flag) return 0;
    ctl_msg g;
    if (MPI_Recv(&g, (int)sizeof g, MPI_BYTE, st.MPI_SOURCE, TAG_GIVEUP, m->ctl, MPI_STATUS_IGNORE) != MPI_SUCCESS)
        return 0;
    snprintf(lead, cap, "; rank %d timed out in collective #%llu (%.*s), so this one cannot complete and the job is "
             "ending", st.MPI_SOURCE, (unsigned long long)g.seq, (int)sizeof g.op, g.op);
    return 1;
}

/* Completes *r (started when w started): MPI_Test, answering questions and
 * sleeping between tests (lk_comm_wait_pause), until done or the timeout. */
static lk_status wait_req(lk_comm *c, MPI_Request *r, lk_comm_wait *w, const char *op) {
    for (;;) {
        int done = 0, rc = MPI_Test(r, &done, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS) return mpi_fail(rc, op);
        if (done) return LK_OK;
        if (lk_comm_wait_expired(c, w)) return expire(c, r, w, 2.0, NULL);
        if (c->size > 1) {
            char lead[256];
            ctl_answer(c);
            /* another rank gave up: report now (a short look at the others first), before its abort ends us */
            if (gave_up(c, lead, sizeof lead)) return expire(c, r, w, 0.5, lead);
        }
        lk_comm_wait_pause(w);
    }
}

/* Starts nothing: completes an operation just started with return code rc
 * into *r. */
static lk_status finish(lk_comm *c, int rc, MPI_Request *r, lk_comm_wait *w, const char *op) {
    return rc == MPI_SUCCESS ? wait_req(c, r, w, op) : mpi_fail(rc, op);
}

static lk_status mpi_barrier(lk_comm *c) {
    MPI_Request r;
    lk_comm_wait w;
    lk_comm_wait_start(&w);
    return finish(c, MPI_Ibarrier(mc(c), &r), &r, &w, "barrier");
}

static lk_status mpi_bcast(lk_comm *c, void *buf, size_t n, int root) {
    mpi_impl *m = c->impl;
    if (n && n <= STAGE_BYTES && m->stage) { /* small: through the stage */
        if (c->rank == root) memcpy(m->stage, buf, n);
        MPI_Request r;
        lk_comm_wait w;
        lk_comm_wait_start(&w);
        lk_status s = finish(c, MPI_Ibcast(m->stage, (int)n, MPI_BYTE, root, mc(c), &r), &r, &w, "bcast");
        if (s == LK_ERR_TIMEOUT) quarantine(m);
        else if (!s) memcpy(buf, m->stage, n);
        return s;
    }
    size_t step = chunk_of(c);
    for (size_t off = 0; off < n; off += step) {
        size_t k = n - off < step ? n - off : step;
        MPI_Request r;
        lk_comm_wait w;
        lk_comm_wait_start(&w);
        lk_status s = finish(c, MPI_Ibcast((char *)buf + off, (int)k, MPI_BYTE, root, mc(c), &r), &r, &w, "bcast");
        if (s) return s;
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
    lk_comm *c;
    MPI_Request req[BCASTV_WINDOW];
    lk_comm_wait w[BCASTV_WINDOW]; /* each one's clock, from its start */
    int head, n;
    lk_comm_idle_fn idle; /* NULL: each operation completes before the next starts */
    void *arg;
} bqueue;

/* Completes the oldest operation in flight, running idle work meanwhile. */
static lk_status bq_retire(bqueue *q) {
    MPI_Request *r = &q->req[q->head];
    for (;;) {
        int done = 0, rc = MPI_Test(r, &done, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS) return mpi_fail(rc, "bcastv");
        if (done) break;
        if (!q->idle(q->arg)) {
            lk_status s = wait_req(q->c, r, &q->w[q->head], "bcastv");
            if (s) return s;
            break;
        }
    }
    q->head = (q->head + 1) % BCASTV_WINDOW;
    q->n--;
    return LK_OK;
}

/* One operation, queued in q (completed at once without idle work). */
static lk_status bq_bcast(bqueue *q, void *buf, int count, MPI_Datatype t, int root) {
    if (q->n == BCASTV_WINDOW) {
        lk_status s = bq_retire(q);
        if (s) return s;
    }
    int slot = (q->head + q->n) % BCASTV_WINDOW;
    lk_comm_wait_start(&q->w[slot]);
    int rc = MPI_Ibcast(buf, count, t, root, mc(q->c), &q->req[slot]);
    if (rc != MPI_SUCCESS) return mpi_fail(rc, "bcastv");
    if (!q->idle) return wait_req(q->c, &q->req[slot], &q->w[slot], "bcastv");
    q->n++;
    return LK_OK;
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
        lk_status s = bq_bcast(q, MPI_BOTTOM, 1, t, root);
        MPI_Type_free(&t); /* an operation in flight keeps its datatype */
        if (s) return s;
    }
    return LK_OK;
}

static lk_status mpi_bcastv(lk_comm *c, const lk_comm_seg *seg, size_t nseg, int root, lk_comm_ready_fn ready,
                            lk_comm_idle_fn idle, void *arg) {
    bqueue q = {.c = c, .idle = idle, .arg = arg};
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
            s = bq_bcast(&q, (char *)seg[j].p + off, (int)k, MPI_BYTE, root);
        }
        i = j + 1;
    }
    /* on a failure too, nothing may stay in flight over the caller's
     * memory, except after a timeout: those operations cannot complete (the
     * communicator is unusable from now on, comm.h) */
    while (q.n && s != LK_ERR_TIMEOUT) {
        lk_status r = bq_retire(&q);
        if (r) {
            if (!s || r == LK_ERR_TIMEOUT) s = r;
            break;
        }
    }
    return s;
}

static lk_status allreduce(lk_comm *c, void *buf, size_t n, size_t esize, MPI_Datatype t,
                           MPI_Op op, const char *name) {
    mpi_impl *m = c->impl;
    if (n && n * esize <= STAGE_BYTES && m->stage) { /* small: through the stage */
        memcpy(m->stage, buf, n * esize);
        MPI_Request r;
        lk_comm_wait w;
        lk_comm_wait_start(&w);
        lk_status s = finish(c, MPI_Iallreduce(MPI_IN_PLACE, m->stage, (int)n, t, op, mc(c), &r), &r, &w, name);
        if (s == LK_ERR_TIMEOUT) quarantine(m);
        else if (!s) memcpy(buf, m->stage, n * esize);
        return s;
    }
    size_t step = chunk_of(c) / esize;
    if (step == 0) step = 1;
    for (size_t off = 0; off < n; off += step) {
        size_t k = n - off < step ? n - off : step;
        MPI_Request r;
        lk_comm_wait w;
        lk_comm_wait_start(&w);
        lk_status s = finish(c, MPI_Iallreduce(MPI_IN_PLACE, (char *)buf + off * esize, (int)k, t, op, mc(c), &r), &r,
                             &w, name);
        if (s) return s;
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
    mpi_impl *m = c->impl;
    if (n && n * (size_t)c->size <= STAGE_BYTES && m->stage) { /* small: through the stage */
        char *st = m->stage;
        memmove(st + (size_t)c->rank * n, send, n);
        MPI_Request r;
        lk_comm_wait w;
        lk_comm_wait_start(&w);
        lk_status s = finish(c, MPI_Iallgather(MPI_IN_PLACE, (int)n, MPI_BYTE, st, (int)n, MPI_BYTE, mc(c), &r), &r,
                             &w, "allgather");
        if (s == LK_ERR_TIMEOUT) quarantine(m);
        else if (!s) memcpy(recv, st, n * (size_t)c->size);
        return s;
    }
    if (n <= chunk_of(c)) {
        const void *s = send == mine ? MPI_IN_PLACE : send;
        MPI_Request r;
        lk_comm_wait w;
        lk_comm_wait_start(&w);
        return finish(c, MPI_Iallgather(s, (int)n, MPI_BYTE, recv, (int)n, MPI_BYTE, mc(c), &r), &r, &w, "allgather");
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
    .abort = mpi_abort,
};

/* Takes ownership of comm on success. Collective (it duplicates comm
 * for ctl). */
static lk_status wrap(MPI_Comm comm, size_t chunk, lk_comm **out) {
    int rank = 0, size = 1;
    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
    MPI_Comm ctl;
    int rc = MPI_Comm_dup(comm, &ctl);
    if (rc != MPI_SUCCESS) return mpi_fail(rc, "dup");
    MPI_Comm_set_errhandler(ctl, MPI_ERRORS_RETURN);
    mpi_impl *m = lk_calloc(1, sizeof *m);
    const int nsend = 2 * size;
    if (m) {
        m->sreq = lk_malloc((size_t)nsend * sizeof *m->sreq);
        m->sbuf = lk_calloc((size_t)nsend, sizeof *m->sbuf);
        m->stage = lk_malloc(STAGE_BYTES);
    }
    if (!m || !m->sreq || !m->sbuf || !m->stage) {
        if (m) {
            lk_free(m->sreq);
            lk_free(m->sbuf);
            lk_free(m->stage);
        }
        lk_free(m);
        MPI_Comm_free(&ctl);
        return lk_error(LK_ERR_NOMEM, "comm mpi: out of memory");
    }
    for (int i = 0; i < nsend; i++) m->sreq[i] = MPI_REQUEST_NULL;
    m->nsend = nsend;
    m->comm = comm;
    m->ctl = ctl;
    m->chunk = chunk;
    lk_status st = lk_comm_new(&g_mpi_ops, rank, size, m, out);
    if (st) {
        MPI_Comm_free(&ctl);
        lk_free(m->sreq);
        lk_free(m->sbuf);
        lk_free(m->stage);
        lk_free(m);
    }
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
