/* test_cancel.c — the cancellation point (lorakit/cancel.h, issue 28):
 * lk_fuse_file, lk_fuse_tensors and the tracker's apply/reset stopped at
 * every one of their cancellation points in turn, and from a second thread
 * in the middle of a large fuse.
 *
 * The walk is the fault tests' pattern (test_fault_fuse.c): a poll that
 * counts the checks of an uncancelled run (N), then one run per k = 1..N
 * whose poll cancels at the k-th check. Oracles, independent of the code
 * under test: the file system (no output, no temporary, an existing OUT
 * byte-identical to what was there), the weights byte-identical to a copy
 * taken before the call (memcmp), and the status LK_ERR_CANCELLED with
 * "cancelled" in the message; the uncancelled result equals the digest of
 * the offline fuse of the same set (swap_offline_digest), so a cancelled
 * walk that stopped nothing would be caught by k = N giving LK_OK. */
#include "swap_fixture.h"
#include "testutil.h"

#include <dirent.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static char *g_dir, *g_base, *g_a, *g_b;
static const swap_model M = {2, 32, 64, 1}; /* BF16, F16 and F32 weights, two blocks */

/* The counting poll: cancels at check number `at` (0: never). */
typedef struct counter {
    atomic_long n;
    long at;
} counter;

static int count_poll(void *ctx) {
    counter *c = ctx;
    long k = atomic_fetch_add(&c->n, 1) + 1;
    return c->at && k >= c->at;
}

static lk_cancel counting(counter *c, long at) {
    atomic_init(&c->n, 0);
    c->at = at;
    lk_cancel cn = LK_CANCEL_INIT;
    cn.poll = count_poll;
    cn.poll_ctx = c;
    return cn;
}

/* Entries of g_dir other than the fixture files and `keep`. */
static int stray_files(const char *keep) {
    DIR *d = opendir(g_dir);
    assert_non_null(d);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        const char *x = e->d_name;
        if (!strcmp(x, ".") || !strcmp(x, "..") || !strcmp(x, "base.safetensors") || !strcmp(x, "a.safetensors") ||
            !strcmp(x, "b.safetensors") || (keep && !strcmp(x, keep)))
            continue;
        fprintf(stderr, "stray: %s\n", x);
        n++;
    }
    closedir(d);
    return n;
}

/* lk_fuse_file cancelled at every check: LK_ERR_CANCELLED, no temporary,
 * OUT (a file already there) byte for byte as it was; past the last check
 * the fuse completes and equals the offline digest. */
static void test_fuse_file_every_point(void **state) {
    (void)state;
    lk_fuse_input in[2] = {{.path = g_a, .strength = 0.75}, {.path = g_b, .strength = -0.5}};
    char want[LK_DIGEST_HEX], got[LK_DIGEST_HEX];
    char *scratch = tu_path(g_dir, "offline.safetensors"), *out = tu_path(g_dir, "out.safetensors");
    assert_int_equal(swap_offline_digest(g_base, in, 2, scratch, want), 0);
    counter c;
    lk_fuse_file_opts o = {0};
    o.fuse.threads = 1;
    lk_cancel cn = counting(&c, 0);
    o.fuse.cancel = &cn;
    assert_int_equal(lk_fuse_file(g_base, in, 2, out, &o, NULL), LK_OK);
    const long n = atomic_load(&c.n);
    assert_true(n > 10); /* per adapter, per tensor, per kernel chunk */
    static const char old[] = "the output as it was before";
    for (long k = 1; k <= n; k++) {
        assert_int_equal(tu_write_file(out, old, sizeof old), 0);
        cn = counting(&c, k);
        lk_status s = lk_fuse_file(g_base, in, 2, out, &o, NULL);
        if (s != LK_ERR_CANCELLED) fail_msg("check %ld of %ld: %s (%s)", k, n, lk_status_str(s), lk_last_error());
        tu_assert_contains(lk_last_error(), "cancelled");
        size_t len;
        char *now = tu_read_file(out, &len);
        assert_non_null(now);
        assert_int_equal(len, sizeof old);
        assert_memory_equal(now, old, sizeof old);
        free(now);
        assert_int_equal(stray_files("out.safetensors"), 0);
    }
    cn = counting(&c, n + 1);
    assert_int_equal(lk_fuse_file(g_base, in, 2, out, &o, NULL), LK_OK);
    assert_int_equal(tu_file_digest(out, got), LK_OK);
    assert_string_equal(got, want);
    /* a flag set before the call: nothing is even created */
    unlink(out);
    lk_cancel pre = LK_CANCEL_INIT;
    lk_cancel_request(&pre);
    o.fuse.cancel = &pre;
    assert_int_equal(lk_fuse_file(g_base, in, 2, out, &o, NULL), LK_ERR_CANCELLED);
    assert_false(tu_exists(out));
    assert_int_equal(stray_files(NULL), 0);
    free(scratch);
    free(out);
}

/* lk_fuse_tensors cancelled at every check: every tensor's bytes as before. */
static void test_fuse_tensors_every_point(void **state) {
    (void)state;
    lk_weights *w;
    assert_int_equal(lk_weights_load(g_base, &w), LK_OK);
    const size_t nt = lk_weights_count(w);
    lk_tensor *t = malloc(nt * sizeof *t);
    memcpy(t, lk_weights_tensors(w), nt * sizeof *t);
    size_t total = 0;
    for (size_t i = 0; i < nt; i++) total += t[i].nbytes;
    char *before = malloc(total), *now = malloc(total);
    for (size_t i = 0, off = 0; i < nt; off += t[i++].nbytes) memcpy(before + off, t[i].data, t[i].nbytes);
    lk_fuse_input in[2] = {{.path = g_a, .strength = 1.0}, {.path = g_b, .strength = 0.25}};
    counter c;
    lk_fuse_file_opts o = {0};
    o.fuse.threads = 1;
    lk_cancel cn = counting(&c, 0);
    o.fuse.cancel = &cn;
    assert_int_equal(lk_fuse_tensors(t, nt, in, 2, &o, NULL), LK_OK);
    const long n = atomic_load(&c.n);
    for (size_t i = 0, off = 0; i < nt; off += t[i++].nbytes) memcpy(t[i].data, before + off, t[i].nbytes);
    for (long k = 1; k <= n; k++) {
        cn = counting(&c, k);
        lk_status s = lk_fuse_tensors(t, nt, in, 2, &o, NULL);
        if (s != LK_ERR_CANCELLED) fail_msg("check %ld of %ld: %s (%s)", k, n, lk_status_str(s), lk_last_error());
        for (size_t i = 0, off = 0; i < nt; off += t[i++].nbytes) memcpy(now + off, t[i].data, t[i].nbytes);
        if (memcmp(now, before, total)) fail_msg("check %ld of %ld: the tensors changed", k, n);
    }
    free(before);
    free(now);
    free(t);
    lk_weights_free(w);
}

/* The tracker (one rank: the same agreements, each a no-op) cancelled at
 * every check of an apply that changes the set and of a reset: every
 * weight as it was after the previous step; then the step completes and
 * equals the offline fuse. */
static void test_tracker_every_point(void **state) {
    (void)state;
    lk_comm *cm;
    lk_weights *w;
    lk_tracker *tr;
    counter c;
    lk_cancel cn = counting(&c, 0);
    assert_int_equal(lk_comm_self(&cm), LK_OK);
    assert_int_equal(lk_weights_load(g_base, &w), LK_OK);
    lk_tracker_opts o = LK_TRACKER_OPTS_DEFAULT;
    o.threads = 1;
    o.cancel = &cn;
    assert_int_equal(lk_tracker_create(cm, w, &o, &tr), LK_OK);
    lk_fuse_input a = {.path = g_a, .strength = 1.0}, ab[2] = {{.path = g_a, .strength = 1.0}, {.path = g_b, .strength = 0.5}};
    char want_a[LK_DIGEST_HEX], want_ab[LK_DIGEST_HEX], d[LK_DIGEST_HEX];
    char *scratch = tu_path(g_dir, "offline.safetensors");
    assert_int_equal(swap_offline_digest(g_base, &a, 1, scratch, want_a), 0);
    assert_int_equal(swap_offline_digest(g_base, ab, 2, scratch, want_ab), 0);
    assert_int_equal(lk_tracker_apply(tr, &a, 1, NULL), LK_OK);
    cn = counting(&c, 0);
    assert_int_equal(lk_tracker_apply(tr, ab, 2, NULL), LK_OK); /* counts the checks of this change */
    const long n = atomic_load(&c.n);
    assert_int_equal(lk_tracker_apply(tr, &a, 1, NULL), LK_OK);
    assert_true(n > 3);
    for (long k = 1; k <= n; k++) {
        cn = counting(&c, k);
        lk_status s = lk_tracker_apply(tr, ab, 2, NULL);
        if (s != LK_ERR_CANCELLED) fail_msg("check %ld of %ld: %s (%s)", k, n, lk_status_str(s), lk_last_error());
        tu_assert_contains(lk_last_error(), "cancelled");
        assert_int_equal(lk_weights_digest(w, d), LK_OK);
        if (strcmp(d, want_a)) fail_msg("check %ld of %ld: weights %s, not %s", k, n, d, want_a);
    }
    cn = counting(&c, 0);
    assert_int_equal(lk_tracker_apply(tr, ab, 2, NULL), LK_OK);
    assert_int_equal(lk_weights_digest(w, d), LK_OK);
    assert_string_equal(d, want_ab);
    /* reset, cancelled at its first check, then done */
    cn = counting(&c, 1);
    assert_int_equal(lk_tracker_reset(tr, NULL), LK_ERR_CANCELLED);
    assert_int_equal(lk_weights_digest(w, d), LK_OK);
    assert_string_equal(d, want_ab);
    cn = counting(&c, 0);
    assert_int_equal(lk_tracker_reset(tr, NULL), LK_OK);
    lk_weights *clean;
    char dc[LK_DIGEST_HEX];
    assert_int_equal(lk_weights_load(g_base, &clean), LK_OK);
    assert_int_equal(lk_weights_digest(clean, dc), LK_OK);
    assert_int_equal(lk_weights_digest(w, d), LK_OK);
    assert_string_equal(d, dc);
    lk_weights_free(clean);
    lk_tracker_free(tr);
    lk_weights_free(w);
    lk_comm_free(cm);
    free(scratch);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

typedef struct canceller {
    lk_cancel *cn;
    double delay, at;
} canceller;

static void *cancel_later(void *arg) {
    canceller *k = arg;
    struct timespec ts = {0, (long)(k->delay * 1e9)};
    nanosleep(&ts, NULL);
    k->at = now_s();
    lk_cancel_request(k->cn);
    return NULL;
}

/* A second thread cancels one large F32 weight's fuse (4096 x 4096, rank
 * 256: 0.5 s of kernel work on one AVX-512 thread) 30 ms in: the kernel
 * stops at its next chunk of rows, well under 0.2 s after the request. */
static void test_cancel_from_thread(void **state) {
    (void)state;
    const int64_t O = 4096, I = 4096, r = 256;
    float *w = malloc((size_t)(O * I) * sizeof *w), *A = malloc((size_t)(r * I) * sizeof *A),
          *B = malloc((size_t)(O * r) * sizeof *B);
    tu_rng g = {5};
    for (int64_t i = 0; i < O * I; i++) w[i] = tu_uniform(&g, -1, 1);
    for (int64_t i = 0; i < r * I; i++) A[i] = tu_uniform(&g, -1, 1);
    for (int64_t i = 0; i < O * r; i++) B[i] = tu_uniform(&g, -1, 1);
    int64_t sa[2] = {r, I}, sb[2] = {O, r};
    lk_tensor ta = {.name = "A", .dtype = LK_DTYPE_F32, .ndim = 2, .data = A, .nbytes = (size_t)(r * I) * 4},
              tb = {.name = "B", .dtype = LK_DTYPE_F32, .ndim = 2, .data = B, .nbytes = (size_t)(O * r) * 4};
    memcpy(ta.shape, sa, sizeof sa);
    memcpy(tb.shape, sb, sizeof sb);
    lk_fuse_term term = {.A = &ta, .B = &tb, .scale = 0.5};
    lk_cancel cn = LK_CANCEL_INIT;
    lk_fuse_opts fo = {.threads = 1, .cancel = &cn};
    canceller k = {&cn, 0.03, 0};
    pthread_t tid;
    double t0 = now_s();
    assert_int_equal(pthread_create(&tid, NULL, cancel_later, &k), 0);
    lk_status s = lk_fuse_tensor(w, w, LK_DTYPE_F32, O, I, &term, 1, &fo, "big.weight");
    double t1 = now_s();
    pthread_join(tid, NULL);
    assert_int_equal(s, LK_ERR_CANCELLED);
    tu_assert_contains(lk_last_error(), "big.weight: cancelled");
    printf("cancelled %.1f ms after the request (%.1f ms into the fuse)\n", (t1 - k.at) * 1e3, (t1 - t0) * 1e3);
    assert_true(t1 - k.at < 0.2);
    /* the same fuse uncancelled takes longer than the cancelled one did */
    lk_cancel_clear(&cn);
    double t2 = now_s();
    assert_int_equal(lk_fuse_tensor(w, w, LK_DTYPE_F32, O, I, &term, 1, &fo, "big.weight"), LK_OK);
    printf("uncancelled: %.1f ms\n", (now_s() - t2) * 1e3);
    assert_true(now_s() - t2 > t1 - t0);
    free(w);
    free(A);
    free(B);
}

static int setup(void **state) {
    (void)state;
    g_dir = tu_mkdtemp();
    g_base = tu_path(g_dir, "base.safetensors");
    g_a = tu_path(g_dir, "a.safetensors");
    g_b = tu_path(g_dir, "b.safetensors");
    if (swap_write_base(g_base, &M, 11) || swap_write_adapter(g_a, &M, SWAP_ATTN | SWAP_FF, 4, 8, 0.5f, 0, 12) ||
        swap_write_adapter(g_b, &M, SWAP_ATTN, 8, 4, 0.5f, 0, 13))
        return -1;
    return 0;
}

static int teardown(void **state) {
    (void)state;
    tu_rmtree(g_dir);
    free(g_dir);
    free(g_base);
    free(g_a);
    free(g_b);
    return 0;
}

int main(void) {
    lk_log_set_level(LK_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fuse_file_every_point),
        cmocka_unit_test(test_fuse_tensors_every_point),
        cmocka_unit_test(test_tracker_every_point),
        cmocka_unit_test(test_cancel_from_thread),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
