/* mpi_comm.c — the MPI communicator and mesh at any rank count (ctest runs
 * it at 1..4 ranks). LORAKIT_COMM_CHUNK=1000 forces every operation bigger
 * than 1000 bytes through the backend's split-into-rounds path. Expected
 * values are closed forms written here: sums of (r+1)*i are
 * i*size*(size+1)/2 (exact in f32 at these sizes), min/max of base+r are
 * base and base+size-1 (beyond 2^53, so a double-based reduction would be
 * caught). A failing assert aborts (CMOCKA_TEST_ABORT), so mpirun stops every
 * rank rather than leaving the others in a collective. */
#include "mpi_testutil.h"
#include "comm/comm.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static lk_comm *g_world;
static int R, N;

static void test_bcast_chunked(void **state) {
    (void)state;
    size_t n = 3001; /* 4 rounds of <= 1000 bytes */
    unsigned char *b = malloc(n);
    int root = N - 1;
    for (size_t i = 0; i < n; i++) b[i] = R == root ? (unsigned char)(i * 31 + 7) : 0;
    assert_int_equal(lk_comm_bcast(g_world, b, n, root), LK_OK);
    for (size_t i = 0; i < n; i++) assert_int_equal(b[i], (unsigned char)(i * 31 + 7));
    assert_int_equal(lk_comm_bcast(g_world, b, 0, 0), LK_OK);
    free(b);
}

/* Vectored broadcast: 300 segments, mostly of lengths 0..2500 (more than
 * one hindexed round of 256 pieces, and rounds of <= 1000 bytes that split
 * segments), three of at least 1 MiB (each sent alone as contiguous bytes:
 * the first, one between small ones, the last), laid out differently on
 * each rank (a rank-dependent gap between segments) but with the same
 * lengths: every rank ends up with the root's bytes, i*31+7 of the stream
 * offset, and the gaps untouched. */
static size_t seg_len(int i) {
    if (i == 0 || i == 150 || i == 299) return ((size_t)1 << 20) + (size_t)i * 7;
    return (size_t)(i * 37 % 2501);
}

static void test_bcastv(void **state) {
    (void)state;
    enum { NS = 300 };
    lk_comm_seg seg[NS];
    size_t total = 0, gap = (size_t)R + 1, span = 0;
    for (int i = 0; i < NS; i++) span += seg_len(i) + gap;
    unsigned char *mem = malloc(span);
    memset(mem, 0xee, span);
    size_t at = 0;
    for (int i = 0; i < NS; i++) {
        size_t len = seg_len(i);
        seg[i] = (lk_comm_seg){mem + at, len};
        at += len + gap;
        total += len;
    }
    for (int root = 0; root < N; root++) {
        size_t pos = 0;
        for (int i = 0; i < NS; i++)
            for (size_t j = 0; j < seg[i].n; j++, pos++)
                ((unsigned char *)seg[i].p)[j] = R == root ? (unsigned char)(pos * 31 + 7) : 0;
        assert_int_equal(lk_comm_bcastv(g_world, seg, NS, root), LK_OK);
        pos = 0;
        for (int i = 0; i < NS; i++) {
            for (size_t j = 0; j < seg[i].n; j++, pos++)
                assert_int_equal(((unsigned char *)seg[i].p)[j], (unsigned char)(pos * 31 + 7));
            for (size_t j = 0; j < gap; j++) assert_int_equal(((unsigned char *)seg[i].p)[seg[i].n + j], 0xee);
        }
        assert_int_equal(pos, total);
    }
    assert_int_equal(lk_comm_bcastv(g_world, seg, NS, N), LK_ERR_ARG);
    free(mem);
}

/* lk_comm_bcastv_ready (the tracker's overlap): the root's segments hold
 * nothing until its ready callback asks for them, and the callback fills
 * exactly [filled, upto) then. If the backend sent a byte before asking
 * for its segment, a receiver would see the root's 0 instead of
 * i*31+7 of the stream offset. The calls' upto must grow, end at the last
 * non-empty segment, and come on the root only. Same segments as
 * test_bcastv (large ones alone, small ones in split hindexed rounds). */
typedef struct lazy_root {
    lk_comm_seg *seg;
    size_t filled, calls;
} lazy_root;

static void fill_upto(void *arg, size_t upto) {
    lazy_root *z = arg;
    if (R != lk_comm_size(g_world) - 1) fail_msg("rank %d: ready called on a receiver", R);
    if (upto < z->filled || upto > 300) fail_msg("ready(%zu) after %zu segments were asked for", upto, z->filled);
    size_t pos = 0;
    for (size_t i = 0; i < z->filled; i++) pos += z->seg[i].n;
    for (; z->filled < upto; z->filled++)
        for (size_t j = 0; j < z->seg[z->filled].n; j++, pos++)
            ((unsigned char *)z->seg[z->filled].p)[j] = (unsigned char)(pos * 31 + 7);
    z->calls++;
}

/* idle work for the non-blocking variant: 50 units, then none */
static int idle_unit(void *arg) {
    size_t *units = arg;
    if (*units >= 50) return 0;
    ++*units;
    return 1;
}

typedef struct lazy_idle {
    lazy_root root; /* first: fill_upto takes the whole struct as a lazy_root */
    size_t units;
} lazy_idle;

static int idle_of(void *arg) { return idle_unit(&((lazy_idle *)arg)->units); }

static void test_bcastv_ready(void **state) {
    (void)state;
    enum { NS = 300 };
    lk_comm_seg seg[NS];
    size_t span = 0, at = 0;
    for (int i = 0; i < NS; i++) span += seg_len(i);
    unsigned char *mem = malloc(span);
    for (int i = 0; i < NS; i++) {
        seg[i] = (lk_comm_seg){mem + at, seg_len(i)};
        at += seg_len(i);
    }
    const int root = N - 1;
    for (int nonblocking = 0; nonblocking < 2; nonblocking++) { /* idle NULL, then idle work (MPI_Ibcast) */
        memset(mem, 0, span);
        lazy_idle z = {{seg, 0, 0}, 0};
        assert_int_equal(lk_comm_bcastv_ready(g_world, seg, NS, root, fill_upto, nonblocking ? idle_of : NULL, &z),
                         LK_OK);
        if (R == root) {
            assert_int_equal(z.root.filled, NS); /* the last segment is non-empty */
            assert_true(z.root.calls > 3);        /* one per operation, not one up front */
        } else assert_int_equal(z.root.calls, 0);
        size_t pos = 0;
        for (int i = 0; i < NS; i++)
            for (size_t j = 0; j < seg[i].n; j++, pos++)
                if (((unsigned char *)seg[i].p)[j] != (unsigned char)(pos * 31 + 7))
                    fail_msg("rank %d (%s): segment %d byte %zu: %u, want %u", R,
                             nonblocking ? "non-blocking" : "blocking", i, j, ((unsigned char *)seg[i].p)[j],
                             (unsigned char)(pos * 31 + 7));
    }
    free(mem);
}

static void test_allreduce(void **state) {
    (void)state;
    size_t n = 1000; /* 4000 bytes: 4 rounds */
    float *f = malloc(n * sizeof *f);
    for (size_t i = 0; i < n; i++) f[i] = (float)((R + 1) * (int)i);
    assert_int_equal(lk_comm_allreduce_f32_sum(g_world, f, n), LK_OK);
    for (size_t i = 0; i < n; i++) assert_true(f[i] == (float)(i * (size_t)N * (N + 1) / 2));
    free(f);

    const uint64_t base = 0xF000000000000001ull;
    uint64_t u[300];
    for (int op = 0; op < 2; op++) {
        for (size_t i = 0; i < 300; i++) u[i] = base + (uint64_t)R + i;
        assert_int_equal(lk_comm_allreduce_u64(g_world, u, 300, op ? LK_REDUCE_MAX : LK_REDUCE_MIN), LK_OK);
        for (size_t i = 0; i < 300; i++) assert_true(u[i] == base + i + (op ? (uint64_t)N - 1 : 0));
    }
    uint64_t s = (uint64_t)R + 1;
    assert_int_equal(lk_comm_allreduce_u64(g_world, &s, 1, LK_REDUCE_SUM), LK_OK);
    assert_true(s == (uint64_t)N * (N + 1) / 2);
}

static void test_allgather(void **state) {
    (void)state;
    size_t sizes[2] = {5, 1500}; /* direct and per-rank broadcast paths */
    for (int k = 0; k < 2; k++) {
        size_t n = sizes[k];
        unsigned char *send = malloc(n), *recv = malloc(n * N);
        for (size_t j = 0; j < n; j++) send[j] = (unsigned char)(R * 10 + j);
        assert_int_equal(lk_comm_allgather(g_world, send, n, recv), LK_OK);
        for (int r = 0; r < N; r++)
            for (size_t j = 0; j < n; j++) assert_int_equal(recv[r * n + j], (unsigned char)(r * 10 + j));
        /* in place: this rank's block already sits in recv */
        memset(recv, 0xEE, n * N);
        memcpy(recv + R * n, send, n);
        assert_int_equal(lk_comm_allgather(g_world, recv + R * n, n, recv), LK_OK);
        for (int r = 0; r < N; r++) assert_int_equal(recv[r * n + n - 1], (unsigned char)(r * 10 + n - 1));
        free(send);
        free(recv);
    }
}

static void test_split(void **state) {
    (void)state;
    lk_comm *s = NULL;
    /* parity groups, ordered by descending world rank */
    assert_int_equal(lk_comm_split(g_world, R % 2, -R, &s), LK_OK);
    assert_non_null(s);
    int members = 0, pos = 0;
    for (int r = 0; r < N; r++)
        if (r % 2 == R % 2) {
            members++;
            if (r > R) pos++;
        }
    assert_int_equal(lk_comm_size(s), members);
    assert_int_equal(lk_comm_rank(s), pos);
    uint64_t sum = (uint64_t)R, expect = 0;
    for (int r = R % 2; r < N; r += 2) expect += (uint64_t)r;
    assert_int_equal(lk_comm_allreduce_u64(s, &sum, 1, LK_REDUCE_SUM), LK_OK);
    assert_true(sum == expect);
    lk_comm_free(s);
    /* rank 0 opts out */
    s = NULL;
    assert_int_equal(lk_comm_split(g_world, R == 0 ? -1 : 1, 0, &s), LK_OK);
    if (R == 0) assert_null(s);
    else assert_int_equal(lk_comm_size(s), N - 1);
    lk_comm_free(s);
}

static void test_agree(void **state) {
    (void)state;
    assert_int_equal(lk_comm_agree(g_world, LK_OK), LK_OK);
    /* ranks >= 1 fail (rank 0 alone when N == 1): the lowest failing one wins */
    int fails = N == 1 || R >= 1;
    if (fails) lk_error(LK_ERR_IO, "disk on fire %d", R);
    lk_status st = lk_comm_agree(g_world, fails ? LK_ERR_IO : LK_OK);
    assert_int_equal(st, LK_ERR_IO);
    char want[64]; /* one rank: its own message, unprefixed */
    if (N == 1) snprintf(want, sizeof want, "disk on fire 0");
    else snprintf(want, sizeof want, "rank 1: disk on fire 1");
    assert_string_equal(lk_last_error(), want);
    /* lk_comm_agree_min: the same agreement and element-wise minima (closed
     * forms: min of 7+R is 7, min of 1000-R is 1000-(N-1)), with and without
     * a failure; values beyond 7 are refused */
    uint64_t v[2] = {7 + (uint64_t)R, 1000 - (uint64_t)R};
    assert_int_equal(lk_comm_agree_min(g_world, LK_OK, v, 2), LK_OK);
    assert_true(v[0] == 7 && v[1] == 1000 - (uint64_t)(N - 1));
    v[0] = 7 + (uint64_t)R;
    if (R == N - 1) lk_error(LK_ERR_SHAPE, "bent %d", R);
    assert_int_equal(lk_comm_agree_min(g_world, R == N - 1 ? LK_ERR_SHAPE : LK_OK, v, 1), LK_ERR_SHAPE);
    assert_true(v[0] == 7);
    if (N > 1) {
        snprintf(want, sizeof want, "rank %d: bent %d", N - 1, N - 1);
        assert_string_equal(lk_last_error(), want);
    }
    uint64_t many[8] = {0};
    assert_int_equal(lk_comm_agree_min(g_world, LK_OK, many, 8), LK_ERR_ARG);
}

static void test_mesh(void **state) {
    (void)state;
    int shapes[3][2] = {{N, 1}, {1, N}, {N % 2 == 0 ? 2 : 1, N % 2 == 0 ? N / 2 : N}};
    for (int k = 0; k < 3; k++) {
        int rep = shapes[k][0], sh = shapes[k][1];
        lk_mesh *m = NULL;
        assert_int_equal(lk_mesh_create(g_world, rep, sh, &m), LK_OK);
        assert_int_equal(lk_mesh_ndim(m), sh == 1 ? 1 : 2);
        assert_int_equal(lk_mesh_dim_size(m, LK_MESH_REPLICATE), rep);
        assert_int_equal(lk_mesh_dim_size(m, LK_MESH_SHARD), sh);
        assert_int_equal(lk_comm_size(lk_mesh_dim_comm(m, LK_MESH_REPLICATE)), rep);
        assert_int_equal(lk_comm_size(lk_mesh_dim_comm(m, LK_MESH_SHARD)), sh);
        /* rank r sits at (r / shard, r % shard) */
        assert_int_equal(lk_mesh_coord(m, LK_MESH_REPLICATE), R / sh);
        assert_int_equal(lk_mesh_coord(m, LK_MESH_SHARD), R % sh);
        /* the replicate dim groups equal shard indices: sum of their world ranks */
        uint64_t v = (uint64_t)R, expect = 0;
        for (int i = 0; i < rep; i++) expect += (uint64_t)(i * sh + R % sh);
        assert_int_equal(lk_comm_allreduce_u64(lk_mesh_dim_comm(m, LK_MESH_REPLICATE), &v, 1, LK_REDUCE_SUM), LK_OK);
        assert_true(v == expect);
        lk_mesh_free(m);
    }
    lk_mesh *m = NULL;
    assert_int_equal(lk_mesh_create(g_world, N + 1, 1, &m), LK_ERR_ARG);
    assert_null(m);
    if (N > 1) { /* ranks disagree: every rank fails, none hangs */
        lk_status st = R == 0 ? lk_mesh_create(g_world, N, 1, &m) : lk_mesh_create(g_world, 1, N, &m);
        assert_int_equal(st, LK_ERR_MISMATCH);
        assert_null(m);
    }
}

/* Every allocation of lk_mesh_create failing in turn on the last rank: every
 * rank gets LK_ERR_NOMEM and no mesh (lk_comm_agree), and none is left
 * waiting in a split the failing rank skipped (the test would time out). */
static void test_mesh_alloc_fails_on_one_rank(void **state) {
    (void)state;
    int rep = N % 2 == 0 ? 2 : 1, sh = N / rep;
    unsigned long k = 1;
    for (;; k++) {
        lk_mesh *m = NULL;
        if (R == N - 1) lk_alloc_fail_at(k);
        lk_status st = lk_mesh_create(g_world, rep, sh, &m);
        lk_alloc_fail_at(0);
        if (st == LK_OK) {
            assert_non_null(m);
            lk_mesh_free(m);
            break;
        }
        assert_int_equal(st, LK_ERR_NOMEM);
        assert_null(m);
    }
    assert_true(k > 3); /* the mesh and both sub-communicators allocate */
}

/* A bad LORAKIT_COMM_CHUNK on one rank only: every rank fails (that one
 * naming the value), and nobody is left waiting in the collective
 * MPI_Comm_dup (the test would time out). Differing valid values agree on
 * the smallest, so every rank splits an operation into the same rounds. */
static void test_bad_chunk_on_one_rank(void **state) {
    (void)state;
    if (R == N - 1) setenv("LORAKIT_COMM_CHUNK", "0", 1);
    lk_comm *c = NULL;
    lk_status st = lk_comm_from_mpi(MPI_COMM_WORLD, &c);
    setenv("LORAKIT_COMM_CHUNK", "1000", 1);
    if (R == N - 1) {
        assert_int_equal(st, LK_ERR_CONFIG);
        assert_null(c);
        tu_assert_contains(lk_last_error(), "LORAKIT_COMM_CHUNK=0");
    } else {
        assert_int_equal(st, LK_ERR_CONFIG);
        assert_null(c);
        tu_assert_contains(lk_last_error(), "invalid on another rank");
    }
    /* chunks of 1000 and 7 bytes: a 100-byte broadcast must still arrive */
    if (R == N - 1) setenv("LORAKIT_COMM_CHUNK", "7", 1);
    assert_int_equal(lk_comm_from_mpi(MPI_COMM_WORLD, &c), LK_OK);
    setenv("LORAKIT_COMM_CHUNK", "1000", 1);
    unsigned char b[100];
    for (int i = 0; i < 100; i++) b[i] = R == 0 ? (unsigned char)(i * 3 + 1) : 0;
    assert_int_equal(lk_comm_bcast(c, b, sizeof b, 0), LK_OK);
    for (int i = 0; i < 100; i++) assert_int_equal(b[i], (unsigned char)(i * 3 + 1));
    lk_comm_free(c);
}

/* lk_comm_average_f32 over scattered buffers (one empty) with a 7-float
 * bucket, so buffers span buckets and buckets span buffers. Oracle: rank r
 * holds r * 1000 + 10 * i + j, so the mean is (N - 1) * 500 + 10 * i + j,
 * exact in float for these sizes. Then a layout mismatch on the last rank:
 * LK_ERR_MISMATCH on every rank, buffers unchanged. */
static void test_average_f32(void **state) {
    (void)state;
    const size_t counts[4] = {5, 0, 13, 3};
    float b0[5], b2[13], b3[3];
    float *bufs[4] = {b0, NULL, b2, b3};
    for (size_t i = 0; i < 4; i++)
        for (size_t j = 0; j < counts[i]; j++) bufs[i][j] = (float)(R * 1000 + 10 * (int)i + (int)j);
    size_t calls = 0;
    assert_int_equal(lk_comm_average_f32(g_world, bufs, counts, 4, 7 * sizeof(float), &calls), LK_OK);
    for (size_t i = 0; i < 4; i++)
        for (size_t j = 0; j < counts[i]; j++)
            assert_true(bufs[i][j] == (float)((N - 1) * 500.0 + 10.0 * (double)i + (double)j));
    assert_int_equal(calls, N > 1 ? 3 : 0); /* 21 floats in 7-float buckets */
    if (N == 1) return;
    size_t bad[4] = {5, 0, 13, R == N - 1 ? 2 : 3};
    float before = b3[0];
    assert_int_equal(lk_comm_average_f32(g_world, bufs, bad, 4, 0, NULL), LK_ERR_MISMATCH);
    tu_assert_contains(lk_last_error(), "different buffer sets");
    assert_true(b3[0] == before);
}

/* lk_comm_average_f32 with one 30-float buffer and 8-float buckets: every
 * bucket lies inside the buffer, so it is reduced there (no staging); the
 * oracle and bucket count as above (30 floats: 4 buckets). */
static void test_average_f32_in_place(void **state) {
    (void)state;
    float b[30], *bufs[1] = {b};
    const size_t count = 30;
    for (int j = 0; j < 30; j++) b[j] = (float)(R * 1000 + j);
    size_t calls = 0;
    assert_int_equal(lk_comm_average_f32(g_world, bufs, &count, 1, 8 * sizeof(float), &calls), LK_OK);
    for (int j = 0; j < 30; j++) assert_true(b[j] == (float)((N - 1) * 500.0 + j));
    assert_int_equal(calls, N > 1 ? 4 : 0);
}

/* lk_comm_same_bytes: three 8-byte items; item 1 differs on every odd rank,
 * so (hand-counted) 1 item differs at N >= 2, first = 1, and the ranks
 * listed are the odd ones; rank 0's items come back. Then a failure on the
 * last rank: every rank returns it, "rank N-1: ...". */
static void test_same_bytes(void **state) {
    (void)state;
    uint64_t mine[3] = {7, R % 2 ? 100 + (uint64_t)R : 8, 9}, r0[3] = {0};
    lk_comm_same same;
    assert_int_equal(lk_comm_same_bytes(g_world, LK_OK, mine, sizeof *mine, 3, r0, &same), LK_OK);
    assert_int_equal(same.n_differ, N > 1 ? 1 : 0);
    assert_int_equal(same.first, N > 1 ? 1 : 3);
    assert_string_equal(same.ranks, N == 1 ? "" : N < 4 ? "1" : "1, 3");
    assert_true(r0[0] == 7 && r0[1] == 8 && r0[2] == 9);
    lk_status local = R == N - 1 ? lk_error(LK_ERR_IO, "digest failed here") : LK_OK;
    assert_int_equal(lk_comm_same_bytes(g_world, local, mine, sizeof *mine, 3, NULL, &same), LK_ERR_IO);
    tu_assert_contains(lk_last_error(), "digest failed here");
}

/* The collective timeout (comm.h): on a fresh communicator with a 1 s
 * timeout, the last rank never joins one collective (it goes on to a
 * barrier of the world communicator, as a rank stuck elsewhere would).
 * Every other rank must return LK_ERR_TIMEOUT within the timeout plus the
 * diagnosis' grace (0.5 s for 1 s) and scheduling slack, naming the
 * operation, its number (#1: the first collective on the communicator), the
 * stalled rank as waited for, and (3+ ranks) the other waiting ranks; its
 * thread must have used under a quarter of the wall time meanwhile (a
 * busy-polling wait uses all of it, or its share of the 2 cores here); the
 * communicator then refuses every call at once. Expectations come from
 * comm.h's contract, not from the implementation's figures. `big` selects
 * a 64 KiB broadcast from the stalled rank (chunked by LORAKIT_COMM_CHUNK=1000,
 * straight into the caller's buffer, static: the transport may still write
 * it) instead of a
 * 3-word allreduce (through the communicator's stage). */
static void timeout_case(int big) {
    static unsigned char bbuf[65536];
    lk_comm *c = NULL;
    assert_int_equal(lk_comm_from_mpi(MPI_COMM_WORLD, &c), LK_OK);
    assert_true(lk_comm_timeout(c) == LK_COMM_TIMEOUT_DEFAULT);
    assert_int_equal(lk_comm_set_timeout(c, 1.0), LK_OK);
    if (N == 1) { /* nobody to wait for: completes */
        uint64_t v[3] = {1, 2, 3};
        assert_int_equal(big ? lk_comm_bcast(c, bbuf, sizeof bbuf, 0) : lk_comm_allreduce_u64(c, v, 3, LK_REDUCE_MAX),
                         LK_OK);
        lk_comm_free(c);
        return;
    }
    if (R != N - 1) {
        uint64_t v[3] = {1, 2, 3};
        double t0 = tu_clock(CLOCK_MONOTONIC), c0 = tu_clock(CLOCK_THREAD_CPUTIME_ID);
        lk_status st = big ? lk_comm_bcast(c, bbuf, sizeof bbuf, N - 1) : lk_comm_allreduce_u64(c, v, 3, LK_REDUCE_MAX);
        double wall = tu_clock(CLOCK_MONOTONIC) - t0, cpu = tu_clock(CLOCK_THREAD_CPUTIME_ID) - c0;
        fprintf(stderr, "rank %d: timed out after %.2f s wall, %.3f s CPU: %s\n", R, wall, cpu, lk_last_error());
        assert_int_equal(st, LK_ERR_TIMEOUT);
        assert_true(wall >= 1.0 && wall < 3.5);
        assert_true(cpu < 0.25 * wall);
        const char *e = lk_last_error();
        tu_assert_contains(e, big ? "comm mpi bcast (collective #1 " : "comm mpi allreduce_u64 (collective #1 ");
        char want[160];
        snprintf(want, sizeof want, "waiting for rank %d (no answer", N - 1);
        tu_assert_contains(e, want);
        if (N >= 3) {
            char list[64];
            tu_rank_list(list, sizeof list, N, R, N - 1);
            snprintf(want, sizeof want, "waiting in it too: %s", list);
            tu_assert_contains(e, want);
        } else assert_null(strstr(e, "waiting in it too"));
        /* unusable from now on, at once */
        t0 = tu_clock(CLOCK_MONOTONIC);
        assert_int_equal(lk_comm_barrier(c), LK_ERR_TIMEOUT);
        assert_true(tu_clock(CLOCK_MONOTONIC) - t0 < 0.5);
        tu_assert_contains(lk_last_error(), "unusable after an earlier timeout");
    }
    assert_int_equal(lk_comm_barrier(g_world), LK_OK);
    lk_comm_free(c);
}

static void test_timeout_small(void **state) {
    (void)state;
    timeout_case(0);
}

static void test_timeout_big(void **state) {
    (void)state;
    timeout_case(1);
}

/* The setting: validated, inherited by split. */
static void test_timeout_setting(void **state) {
    (void)state;
    lk_comm *c = NULL, *d = NULL;
    assert_int_equal(lk_comm_from_mpi(MPI_COMM_WORLD, &c), LK_OK);
    assert_int_equal(lk_comm_set_timeout(c, -1), LK_ERR_ARG);
    assert_int_equal(lk_comm_set_timeout(c, NAN), LK_ERR_ARG);
    assert_int_equal(lk_comm_set_timeout(c, INFINITY), LK_ERR_ARG);
    assert_true(lk_comm_timeout(c) == LK_COMM_TIMEOUT_DEFAULT);
    assert_int_equal(lk_comm_set_timeout(c, 7.5), LK_OK);
    assert_int_equal(lk_comm_split(c, 0, R, &d), LK_OK);
    assert_true(lk_comm_timeout(d) == 7.5);
    assert_int_equal(lk_comm_set_timeout(d, 0), LK_OK);
    assert_true(lk_comm_timeout(d) == 0 && lk_comm_timeout(c) == 7.5);
    lk_comm_free(d);
    lk_comm_free(c);
}

int main(int argc, char **argv) {
    setenv("LORAKIT_COMM_CHUNK", "1000", 1);
    g_world = tu_mpi_init(&argc, &argv);
    R = lk_comm_rank(g_world);
    N = lk_comm_size(g_world);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bcast_chunked), cmocka_unit_test(test_bcastv), cmocka_unit_test(test_bcastv_ready),
        cmocka_unit_test(test_allreduce),
        cmocka_unit_test(test_allgather),     cmocka_unit_test(test_split),
        cmocka_unit_test(test_agree),         cmocka_unit_test(test_mesh),
        cmocka_unit_test(test_mesh_alloc_fails_on_one_rank), cmocka_unit_test(test_bad_chunk_on_one_rank),
        cmocka_unit_test(test_average_f32), cmocka_unit_test(test_average_f32_in_place),
        cmocka_unit_test(test_same_bytes),
        cmocka_unit_test(test_timeout_setting), cmocka_unit_test(test_timeout_small), cmocka_unit_test(test_timeout_big),
    };
    return tu_mpi_finish(g_world, cmocka_run_group_tests(tests, NULL, NULL));
}
