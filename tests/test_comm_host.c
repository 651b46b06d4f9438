/* test_comm_host.c — the `host` lk_comm backend (lorakit/comm_host.h) over
 * a transport written here: N threads of one process are the ranks (N = 1..4),
 * and each collective is a rendezvous on a pthread barrier (publish the
 * buffer pointers, copy/reduce, rendezvous again). The non-blocking
 * broadcast completes on its second test, so the idle path runs.
 *
 * Expectations: closed forms written here (sums of (r+1)*i are
 * i*N*(N+1)/2, exact in f32 at these sizes; min/max of base+r with the top
 * bit set, so a signed or double reduction would be caught), the root's
 * byte pattern i*31+7 after broadcasts, and for the tracker the digest of an
 * offline lk_fuse_file of the same set (swap_fixture.h). Agreement failures:
 * every rank must get the same status, nothing changed, no hang (a hang
 * fails by the ctest timeout).
 *
 * Threads cannot use cmocka's asserts (they longjmp), so rank bodies count
 * failures with CHECK and the test asserts the count on the main thread. */
#include "testutil.h"
#include "swap_fixture.h"
#include "comm/comm.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static atomic_int g_fails;
#define CHECK(cond)                                                                                                    \
    do {                                                                                                               \
        if (!(cond)) {                                                                                                 \
            fprintf(stderr, "%s:%d: rank %d: CHECK(%s) failed (last error: %s)\n", __FILE__, __LINE__, me->rank,     \
                    #cond, lk_last_error());                                                                           \
            atomic_fetch_add(&g_fails, 1);                                                                             \
        }                                                                                                              \
    } while (0)

/* ---- the transport: threads meeting on a barrier ---- */

typedef struct tgroup {
    int size;
    pthread_barrier_t bar;
    void *ptr[4];
    atomic_long calls; /* host callbacks made, all ranks together */
} tgroup;

typedef struct rank_ctx {
    tgroup *g;
    int rank;
    int fail_bcast_at; /* 1-based: this rank's k-th bcast reports a failure (after moving the bytes), 0 never */
    int bcasts;
    int tests;         /* ibcast test calls */
    double timeout;    /* told by set_timeout */
    int timeout_bcast_at; /* as fail_bcast_at, reporting LK_ERR_TIMEOUT */
} rank_ctx;

static void meet(tgroup *g) { pthread_barrier_wait(&g->bar); }

static lk_status t_barrier(void *ctx) {
    rank_ctx *r = ctx;
    atomic_fetch_add(&r->g->calls, 1);
    meet(r->g);
    return LK_OK;
}

static lk_status t_bcast(void *ctx, void *buf, size_t n, int root) {
    rank_ctx *r = ctx;
    tgroup *g = r->g;
    atomic_fetch_add(&g->calls, 1);
    g->ptr[r->rank] = buf;
    meet(g);
    if (r->rank != root) memcpy(buf, g->ptr[root], n);
    meet(g);
    r->bcasts++;
    if (r->fail_bcast_at && r->bcasts == r->fail_bcast_at)
        return lk_error(LK_ERR_IO, "test transport: injected failure at broadcast %d", r->bcasts);
    if (r->timeout_bcast_at && r->bcasts == r->timeout_bcast_at)
        return lk_error(LK_ERR_TIMEOUT, "test transport: broadcast %d not complete after %g s", r->bcasts, r->timeout);
    return LK_OK;
}

static void t_set_timeout(void *ctx, double seconds) { ((rank_ctx *)ctx)->timeout = seconds; }

static lk_status t_allreduce(void *ctx, void *buf, size_t n, lk_comm_dtype t, lk_reduce_op op) {
    rank_ctx *r = ctx;
    tgroup *g = r->g;
    atomic_fetch_add(&g->calls, 1);
    size_t es = t == LK_COMM_F32 ? 4 : 8;
    void *tmp = malloc(n * es + 1);
    g->ptr[r->rank] = buf;
    meet(g);
    for (size_t i = 0; i < n; i++) { /* every rank reduces in rank order: identical results */
        if (t == LK_COMM_F32) {
            float acc = 0;
            for (int k = 0; k < g->size; k++) acc += ((float *)g->ptr[k])[i];
            ((float *)tmp)[i] = acc;
        } else {
            uint64_t acc = ((uint64_t *)g->ptr[0])[i];
            for (int k = 1; k < g->size; k++) {
                uint64_t v = ((uint64_t *)g->ptr[k])[i];
                acc = op == LK_REDUCE_SUM ? acc + v : op == LK_REDUCE_MIN ? (v < acc ? v : acc) : (v > acc ? v : acc);
            }
            ((uint64_t *)tmp)[i] = acc;
        }
    }
    meet(g);
    memcpy(buf, tmp, n * es);
    free(tmp);
    return LK_OK;
}

static lk_status t_allgather(void *ctx, const void *send, size_t n, void *recv) {
    rank_ctx *r = ctx;
    tgroup *g = r->g;
    atomic_fetch_add(&g->calls, 1);
    g->ptr[r->rank] = (void *)send;
    meet(g);
    for (int k = 0; k < g->size; k++)
        if ((char *)recv + (size_t)k * n != g->ptr[k]) memmove((char *)recv + (size_t)k * n, g->ptr[k], n);
    meet(g);
    return LK_OK;
}

/* Non-blocking broadcast: the bytes move at ibcast (a rendezvous); the
 * request reports done on its second test, so the caller's idle work runs
 * once per operation. */
typedef struct treq {
    int tests;
} treq;

static lk_status t_ibcast(void *ctx, void *buf, size_t n, int root, void **req) {
    lk_status s = t_bcast(ctx, buf, n, root);
    treq *q = calloc(1, sizeof *q);
    *req = q;
    return s;
}

static lk_status t_test(void *ctx, void *req, int *done) {
    rank_ctx *r = ctx;
    r->tests++;
    treq *q = req;
    *done = ++q->tests >= 2;
    if (*done) free(q);
    return LK_OK;
}

static lk_status t_wait(void *ctx, void *req) {
    (void)ctx;
    free(req);
    return LK_OK;
}

static lk_comm_host_ops host_ops(int nonblocking, size_t max_bytes) {
    lk_comm_host_ops o = {.barrier = t_barrier, .bcast = t_bcast, .allreduce = t_allreduce, .allgather = t_allgather,
                          .max_bytes = max_bytes, .set_timeout = t_set_timeout};
    if (nonblocking) {
        o.ibcast = t_ibcast;
        o.test = t_test;
        o.wait = t_wait;
    }
    return o;
}

/* ---- running a body on N thread-ranks ---- */

typedef void (*body_fn)(rank_ctx *me, lk_comm *c);

typedef struct run_arg {
    rank_ctx ctx;
    body_fn body;
    lk_comm_host_ops ops;
    int raw; /* 1: body gets c = NULL and makes its own communicator */
} run_arg;

static void *run_rank(void *p) {
    run_arg *a = p;
    rank_ctx *me = &a->ctx;
    lk_comm *c = NULL;
    if (!a->raw) {
        lk_status s = lk_comm_from_host(&a->ops, me, me->rank, me->g->size, &c);
        CHECK(s == LK_OK);
        if (s) return NULL;
        CHECK(strcmp(lk_comm_backend(c), "host") == 0);
        CHECK(lk_comm_rank(c) == me->rank && lk_comm_size(c) == me->g->size);
        CHECK(lk_comm_host_ctx(c) == me);
    }
    a->body(me, c);
    lk_comm_free(c);
    return NULL;
}

static void run_on(int n, body_fn body, int nonblocking, size_t max_bytes, int raw) {
    atomic_store(&g_fails, 0);
    tgroup g = {.size = n};
    pthread_barrier_init(&g.bar, NULL, (unsigned)n);
    run_arg a[4];
    pthread_t th[4];
    for (int r = 0; r < n; r++) {
        a[r] = (run_arg){.ctx = {.g = &g, .rank = r}, .body = body, .ops = host_ops(nonblocking, max_bytes), .raw = raw};
        assert_int_equal(pthread_create(&th[r], NULL, run_rank, &a[r]), 0);
    }
    for (int r = 0; r < n; r++) pthread_join(th[r], NULL);
    pthread_barrier_destroy(&g.bar);
    assert_int_equal(atomic_load(&g_fails), 0);
}

static void run_all(body_fn body, int raw) {
    for (int n = 1; n <= 4; n++)
        for (int nb = 0; nb < 2; nb++) run_on(n, body, nb, nb ? 0 : 1000, raw);
}

/* ---- collectives ---- */

static void body_bcast_reduce_gather(rank_ctx *me, lk_comm *c) {
    int R = me->rank, N = me->g->size;
    size_t n = 3001; /* more than one 1000-byte round (max_bytes) */
    unsigned char *b = malloc(n);
    for (int root = 0; root < N; root++) {
        for (size_t i = 0; i < n; i++) b[i] = R == root ? (unsigned char)(i * 31 + 7 + root) : 0;
        CHECK(lk_comm_bcast(c, b, n, root) == LK_OK);
        for (size_t i = 0; i < n; i++) CHECK(b[i] == (unsigned char)(i * 31 + 7 + root));
    }
    free(b);
    float f[700];
    for (int i = 0; i < 700; i++) f[i] = (float)((R + 1) * i);
    CHECK(lk_comm_allreduce_f32_sum(c, f, 700) == LK_OK);
    for (int i = 0; i < 700; i++) CHECK(f[i] == (float)(i * N * (N + 1) / 2));
    const uint64_t base = 0x8000000000000123ull; /* top bit set: unsigned order */
    uint64_t u[300];
    for (int op = 0; op < 3; op++) {
        for (int i = 0; i < 300; i++) u[i] = base + (uint64_t)R + (uint64_t)i;
        CHECK(lk_comm_allreduce_u64(c, u, 300, (lk_reduce_op)op) == LK_OK);
        for (int i = 0; i < 300; i++) {
            uint64_t want = op == LK_REDUCE_MIN ? base + (uint64_t)i : op == LK_REDUCE_MAX ? base + (uint64_t)(N - 1 + i)
                                                                  : (base + (uint64_t)i) * (uint64_t)N + (uint64_t)(N * (N - 1) / 2);
            CHECK(u[i] == want);
        }
    }
    /* allgather: 600 bytes per rank (past max_bytes / N at 2..4 ranks: the broadcast path) and 8 */
    for (size_t per = 8; per <= 600; per += 592) {
        unsigned char *send = malloc(per), *recv = malloc(per * (size_t)N);
        for (size_t i = 0; i < per; i++) send[i] = (unsigned char)(R * 13 + i);
        CHECK(lk_comm_allgather(c, send, per, recv) == LK_OK);
        for (int k = 0; k < N; k++)
            for (size_t i = 0; i < per; i++) CHECK(recv[(size_t)k * per + i] == (unsigned char)(k * 13 + i));
        free(send);
        free(recv);
    }
    CHECK(lk_comm_barrier(c) == LK_OK);
}

static void test_collectives(void **state) {
    (void)state;
    run_all(body_bcast_reduce_gather, 0);
}

/* Vectored broadcast: 200 segments of 0..2500 bytes (several staged rounds;
 * with max_bytes 1000 a round is 1000 bytes and segments split across
 * rounds) and three of at least 256 KiB (sent straight, in steps), laid out
 * differently on every rank; with ready (root: all bytes it reads are
 * written by then, checked in ready) and idle. */
static size_t seg_len(int i) {
    if (i == 0 || i == 100 || i == 199) return ((size_t)256 << 10) + (size_t)i * 7;
    return (size_t)(i * 37 % 2501);
}

typedef struct ready_state {
    lk_comm_seg *seg;
    size_t filled, nseg;
    int idle_calls;
} ready_state;

/* Root: fills segments up to `upto` only when asked (as the tracker fuses
 * keys only when a broadcast needs them). */
static void fill_upto(void *arg, size_t upto) {
    ready_state *rs = arg;
    size_t pos = 0;
    for (size_t i = 0; i < rs->nseg; i++) {
        if (i >= rs->filled && i < upto)
            for (size_t k = 0; k < rs->seg[i].n; k++) ((unsigned char *)rs->seg[i].p)[k] = (unsigned char)((pos + k) * 31 + 7);
        pos += rs->seg[i].n;
    }
    if (upto > rs->filled) rs->filled = upto;
}

static int idle_one(void *arg) {
    ready_state *rs = arg;
    return rs->idle_calls++ < 1000;
}

static void body_bcastv(rank_ctx *me, lk_comm *c) {
    int R = me->rank, N = me->g->size;
    enum { NS = 200 };
    lk_comm_seg seg[NS];
    size_t gap = (size_t)R + 1, span = 0;
    for (int i = 0; i < NS; i++) span += seg_len(i) + gap;
    unsigned char *mem = malloc(span);
    for (int mode = 0; mode < 2; mode++) {
        for (int root = 0; root < N; root++) {
            memset(mem, 0xee, span);
            size_t at = 0;
            for (int i = 0; i < NS; i++) {
                seg[i] = (lk_comm_seg){mem + at, seg_len(i)};
                at += seg_len(i) + gap;
            }
            ready_state rs = {seg, 0, NS, 0};
            if (R == root && mode == 0) fill_upto(&rs, NS);
            lk_status s = mode == 0 ? lk_comm_bcastv(c, seg, NS, root)
                                    : lk_comm_bcastv_ready(c, seg, NS, root, fill_upto, idle_one, &rs);
            CHECK(s == LK_OK);
            size_t pos = 0, bad = 0;
            for (int i = 0; i < NS; i++) {
                for (size_t k = 0; k < seg[i].n; k++) bad += ((unsigned char *)seg[i].p)[k] != (unsigned char)((pos + k) * 31 + 7);
                pos += seg[i].n;
                for (size_t k = 0; k < gap; k++) bad += ((unsigned char *)seg[i].p)[seg[i].n + k] != 0xee;
            }
            CHECK(bad == 0);
            if (mode == 1 && N > 1 && me->tests) CHECK(rs.idle_calls > 0); /* the idle path ran (non-blocking host) */
        }
    }
    free(mem);
}

static void test_bcastv(void **state) {
    (void)state;
    run_all(body_bcastv, 0);
}

/* ---- agreement ---- */

static void body_agree(rank_ctx *me, lk_comm *c) {
    int R = me->rank, N = me->g->size;
    /* the highest rank fails: every rank gets its status and message */
    lk_status local = R == N - 1 ? lk_error(LK_ERR_SHAPE, "bad shape on rank %d", R) : LK_OK;
    lk_status s = lk_comm_agree(c, local);
    CHECK(s == LK_ERR_SHAPE);
    char want[64];
    snprintf(want, sizeof want, N > 1 ? "rank %d: bad shape on rank %d" : "bad shape on rank %d", N - 1, N - 1);
    CHECK(strstr(lk_last_error(), want) != NULL);
    CHECK(lk_comm_agree(c, LK_OK) == LK_OK);
    /* average: ranks holding different layouts all get LK_ERR_MISMATCH, buffers unchanged */
    float a[10], b[6];
    for (int i = 0; i < 10; i++) a[i] = (float)(R + i);
    for (int i = 0; i < 6; i++) b[i] = (float)(R * 2 + i);
    float *bufs[2] = {a, b};
    size_t counts[2] = {10, R == 0 ? 6 : 5};
    s = lk_comm_average_f32(c, bufs, counts, 2, 16, NULL);
    CHECK(s == (N > 1 ? LK_ERR_MISMATCH : LK_OK));
    if (N > 1)
        for (int i = 0; i < 10; i++) CHECK(a[i] == (float)(R + i));
    counts[1] = 6;
    size_t calls = 0;
    for (int i = 0; i < 10; i++) a[i] = (float)(R + i);
    CHECK(lk_comm_average_f32(c, bufs, counts, 2, 16, &calls) == LK_OK); /* 16 bytes: 4 floats per bucket */
    for (int i = 0; i < 10; i++) CHECK(a[i] == (float)((N - 1) / 2.0 + i)); /* exact: halves */
    for (int i = 0; i < 6; i++) CHECK(b[i] == (float)((N - 1) + i));
    CHECK(calls == (N > 1 ? 4u : 0u));
    /* split: not offered, so refused on every rank (no collective left half-made) */
    lk_comm *sub = NULL;
    CHECK(lk_comm_split(c, R % 2, R, &sub) == LK_ERR_UNSUPPORTED && sub == NULL);
    CHECK(lk_comm_barrier(c) == LK_OK);
}

static void test_agreement(void **state) {
    (void)state;
    run_all(body_agree, 0);
}

/* A transport failure inside a collective is LK_ERR_COMM naming the
 * operation and carrying the host's message. */
static void body_transport_failure(rank_ctx *me, lk_comm *c) {
    me->fail_bcast_at = me->bcasts + 1; /* every rank: the next broadcast reports a failure */
    char b[16] = {0};
    lk_status s = lk_comm_bcast(c, b, sizeof b, 0);
    CHECK(s == LK_ERR_COMM);
    CHECK(strstr(lk_last_error(), "comm host bcast: test transport: injected failure") != NULL);
    me->fail_bcast_at = 0;
    CHECK(lk_comm_bcast(c, b, sizeof b, 0) == LK_OK);
}

static void test_transport_failure(void **state) {
    (void)state;
    run_all(body_transport_failure, 0);
}

/* The communicator's timeout reaches the host (set_timeout: the default
 * at creation, then every change), and a host collective that gives up
 * with LK_ERR_TIMEOUT stays LK_ERR_TIMEOUT naming the operation (not
 * LK_ERR_COMM); the communicator then refuses every call without calling
 * the host (comm.h). */
static void body_timeout(rank_ctx *me, lk_comm *c) {
    CHECK(me->timeout == LK_COMM_TIMEOUT_DEFAULT);
    CHECK(lk_comm_set_timeout(c, 2.5) == LK_OK && me->timeout == 2.5);
    CHECK(lk_comm_set_timeout(c, -1) == LK_ERR_ARG && me->timeout == 2.5);
    me->timeout_bcast_at = me->bcasts + 1;
    char b[16] = {0};
    CHECK(lk_comm_bcast(c, b, sizeof b, 0) == LK_ERR_TIMEOUT);
    CHECK(strstr(lk_last_error(), "comm host bcast: test transport: broadcast") != NULL);
    CHECK(strstr(lk_last_error(), "not complete after 2.5 s") != NULL);
    me->timeout_bcast_at = 0;
    int before = me->bcasts;
    CHECK(lk_comm_bcast(c, b, sizeof b, 0) == LK_ERR_TIMEOUT);
    CHECK(strstr(lk_last_error(), "unusable after an earlier timeout") != NULL);
    CHECK(me->bcasts == before);
}

static void test_timeout(void **state) {
    (void)state;
    run_all(body_timeout, 0);
}

/* Creation: ranks disagreeing on the group, a rank with bad arguments, two
 * ranks claiming one rank, optional callbacks given on some ranks only:
 * every rank fails, none hangs. */
static int g_case;

static void body_create(rank_ctx *me, lk_comm *unused) {
    (void)unused;
    int R = me->rank, N = me->g->size;
    lk_comm_host_ops o = host_ops(0, 0);
    int rank = R, size = N;
    lk_status want = LK_ERR_MISMATCH;
    switch (g_case) {
    case 0: size = R == 0 ? N + 1 : N; break;          /* rank 0 thinks the group is larger */
    case 1: o.max_bytes = R == N - 1 ? 512 : 0; break; /* different round sizes */
    case 2: rank = R == 1 ? 0 : R; break;              /* two ranks say rank 0 */
    case 3: if (R == 1) o.split = NULL, o.ibcast = t_ibcast, o.test = t_test, o.wait = t_wait; break;
    case 4: if (R == N - 1) o.ibcast = t_ibcast; want = LK_ERR_ARG; break; /* 1 of 3: invalid there */
    }
    lk_comm *c = (lk_comm *)1;
    lk_status s = lk_comm_from_host(&o, me, rank, size, &c);
    CHECK(s == want);
    CHECK(c == NULL);
    if (g_case == 4 && R != N - 1) CHECK(strstr(lk_last_error(), "another rank's arguments are invalid") != NULL);
    if (g_case == 2) CHECK(strstr(lk_last_error(), "says it is rank 0") != NULL);
    /* NULL required callback: a local error, no collective */
    o = host_ops(0, 0);
    o.allgather = NULL;
    CHECK(lk_comm_from_host(&o, me, R, N, &c) == LK_ERR_ARG);
}

static void test_create_mismatch(void **state) {
    (void)state;
    for (g_case = 0; g_case < 5; g_case++)
        for (int n = 2; n <= 4; n++) run_on(n, body_create, 0, 0, 1);
}

/* ---- the tracker over the host backend ---- */

static const swap_model M = {2, 96, 640, 1};
static char *g_dir, *g_base, *g_a, *g_b, *g_missing;
static char g_want_a[LK_DIGEST_HEX], g_want_ab[LK_DIGEST_HEX], g_base_digest[LK_DIGEST_HEX];

static int setup(void **state) {
    (void)state;
    g_dir = tu_mkdtemp();
    g_base = tu_path(g_dir, "base.safetensors");
    g_a = tu_path(g_dir, "a.safetensors");
    g_b = tu_path(g_dir, "b.safetensors");
    g_missing = tu_path(g_dir, "missing.safetensors");
    if (swap_write_base(g_base, &M, 21) || swap_write_adapter(g_a, &M, SWAP_ATTN, 4, 8.0f, 0.05f, 0, 22) ||
        swap_write_adapter(g_b, &M, SWAP_FF, 2, 2.0f, 0.05f, 0, 23))
        return -1;
    char *out = tu_path(g_dir, "offline.safetensors");
    lk_fuse_input a1[] = {{g_a, 1.0f, LK_FORMAT_AUTO}};
    lk_fuse_input ab[] = {{g_a, 0.7f, LK_FORMAT_AUTO}, {g_b, -0.5f, LK_FORMAT_AUTO}};
    int rc = swap_offline_digest(g_base, a1, 1, out, g_want_a) || swap_offline_digest(g_base, ab, 2, out, g_want_ab);
    free(out);
    return rc || tu_file_digest(g_base, g_base_digest) ? -1 : 0;
}

static int teardown(void **state) {
    (void)state;
    tu_rmtree(g_dir);
    free(g_dir); free(g_base); free(g_a); free(g_b); free(g_missing);
    return 0;
}

static int digest_is(const lk_weights *w, const char *want) {
    char hex[LK_DIGEST_HEX];
    return lk_weights_digest(w, hex) == LK_OK && memcmp(hex, want, LK_DIGEST_HEX) == 0;
}

static void body_tracker(rank_ctx *me, lk_comm *c) {
    int R = me->rank, N = me->g->size;
    lk_weights *w = NULL;
    CHECK(lk_weights_load(g_base, &w) == LK_OK);
    lk_tracker_opts o = LK_TRACKER_OPTS_DEFAULT;
    o.bucket_bytes = (size_t)1 << 20;
    o.threads = 1;
    lk_tracker *t = NULL;
    CHECK(lk_tracker_create(c, w, &o, &t) == LK_OK);
    lk_fuse_input a1[] = {{g_a, 1.0f, LK_FORMAT_AUTO}};
    lk_fuse_input ab[] = {{g_b, -0.5f, LK_FORMAT_AUTO}, {g_a, 0.7f, LK_FORMAT_AUTO}};
    CHECK(lk_tracker_apply(t, a1, 1, NULL) == LK_OK);
    CHECK(digest_is(w, g_want_a));
    CHECK(lk_tracker_apply(t, ab, 2, NULL) == LK_OK);
    CHECK(digest_is(w, g_want_ab));
    /* failures: nothing changes on any rank, every rank gets the status */
    lk_fuse_input bad[] = {{g_a, 1.0f, LK_FORMAT_AUTO}, {R == N - 1 ? g_missing : g_b, 1.0f, LK_FORMAT_AUTO}};
    CHECK(lk_tracker_apply(t, bad, 2, NULL) == (N > 1 ? LK_ERR_MISMATCH : LK_ERR_IO)); /* paths differ: the request */
    CHECK(digest_is(w, g_want_ab));
    lk_fuse_input miss[] = {{g_missing, 1.0f, LK_FORMAT_AUTO}};
    CHECK(lk_tracker_apply(t, miss, 1, NULL) == LK_ERR_IO);
    CHECK(strstr(lk_last_error(), "missing.safetensors") != NULL);
    CHECK(digest_is(w, g_want_ab));
    if (N > 1) {
        lk_fuse_input mine[] = {{g_a, R == 0 ? 0.5f : 0.25f, LK_FORMAT_AUTO}};
        CHECK(lk_tracker_apply(t, mine, 1, NULL) == LK_ERR_MISMATCH);
        CHECK(strstr(lk_last_error(), "ranks disagree on the adapter request") != NULL);
        char want[2][2048]; /* both requests named, on every rank (the test's own requests) */
        snprintf(want[0], sizeof want[0], "rank 0 asked for 1 adapter: %s@0.5;", g_a);
        snprintf(want[1], sizeof want[1], "rank 1 asked for 1 adapter: %s@0.25 (this is rank %d)", g_a, R);
        CHECK(strstr(lk_last_error(), want[0]) != NULL && strstr(lk_last_error(), want[1]) != NULL);
        CHECK(lk_tracker_apply(t, a1, R == 0 ? 0 : 1, NULL) == LK_ERR_MISMATCH); /* reset on rank 0 only */
        CHECK(digest_is(w, g_want_ab));
    }
    CHECK(lk_tracker_reset(t, NULL) == LK_OK);
    CHECK(digest_is(w, g_base_digest));
    CHECK(lk_tracker_apply(t, a1, 1, NULL) == LK_OK);
    CHECK(digest_is(w, g_want_a));
    lk_tracker_free(t);
    lk_weights_free(w);
}

static void test_tracker(void **state) {
    (void)state;
    run_all(body_tracker, 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_collectives),
        cmocka_unit_test(test_bcastv),
        cmocka_unit_test(test_agreement),
        cmocka_unit_test(test_transport_failure),
        cmocka_unit_test(test_timeout),
        cmocka_unit_test(test_create_mismatch),
        cmocka_unit_test(test_tracker),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
