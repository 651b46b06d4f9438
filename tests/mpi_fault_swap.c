/* mpi_fault_swap.c — the hot-swap tracker under faults (ctest runs it at 1..4
 * ranks): an adapter file that differs between ranks' reads, an adapter
 * deleted mid-plan, a NaN inside an adapter, every allocation of a swap
 * step failing in turn on each rank, and a cancel (lorakit/cancel.h) on one
 * rank at each of its cancellation points in turn.
 *
 * The promise under test (tracker.h): a failed apply fails on every rank
 * with the same status and leaves every rank's weights exactly as they were;
 * the tracker stays usable. Expected digests are independent of the tracker:
 * an offline lk_fuse_file of the same set (inputs in sorted path order) on
 * rank 0, broadcast, and the base file's own digest. A failing assert aborts
 * (CMOCKA_TEST_ABORT) so mpirun stops every rank instead of leaving the
 * others waiting in a collective. Fixtures come from tests/util/swap_fixture
 * (the tracker tests' DiT-like model and diffusers adapters). */
#include "mpi_testutil.h"
#include "serve/tracker.h"
#include "swap_fixture.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const swap_model M = {1, 48, 96, 1}; /* small: the sweeps run every allocation */
static lk_comm *W;
static int R, N;
static char g_dir[1024];
static char *g_base, *g_a, *g_b, *g_nan;
static char g_d_base[LK_DIGEST_HEX], g_d_a[LK_DIGEST_HEX], g_d_ab[LK_DIGEST_HEX],
    g_d_b[LK_DIGEST_HEX];

static char *join(const char *name) { return tu_path(g_dir, name); }

#define die tu_mpi_die

/* Offline digest of in[0..n) (sorted by path), on rank 0 only. */
static void offline_digest(const lk_fuse_input *in, size_t n, char hex[LK_DIGEST_HEX]) {
    char *out = join("offline.safetensors");
    if (swap_offline_digest(g_base, in, n, out, hex)) die("offline fuse");
    free(out);
}

/* Copies adapter src to dst, each tensor passed to poison first (which
 * returns how many it changed); dies unless `want` were changed. */
static void write_poisoned_copy(const char *src, const char *dst, int (*poison)(lk_tensor *, const void *),
                                const void *arg, int want) {
    lk_st *st;
    if (lk_st_open(src, &st)) die("open adapter");
    size_t n = lk_st_count(st);
    lk_tensor *t = calloc(n, sizeof *t);
    int changed = 0;
    for (size_t i = 0; i < n; i++) {
        t[i] = *lk_st_tensor(st, i);
        t[i].data = malloc(t[i].nbytes ? t[i].nbytes : 1);
        memcpy(t[i].data, lk_st_tensor(st, i)->data, t[i].nbytes);
        changed += poison(&t[i], arg);
    }
    if (changed != want || lk_st_save(dst, t, n, NULL, 0)) die("write poisoned adapter");
    for (size_t i = 0; i < n; i++) free(t[i].data);
    free(t);
    lk_st_close(st);
}

/* lora_B[0] of the first module set to NaN. */
static int first_b_nan(lk_tensor *t, const void *arg) {
    int *done = (int *)arg;
    if (*done || !strstr(t->name, "lora_B") || t->dtype != LK_DTYPE_F32) return 0;
    ((float *)t->data)[0] = NAN;
    return *done = 1;
}

static void write_nan_copy(const char *src, const char *dst) {
    int done = 0;
    write_poisoned_copy(src, dst, first_b_nan, &done, 1);
}

/* The base file's own digest, on rank 0. */
static void file_digest(const char *path, char hex[LK_DIGEST_HEX]) {
    if (tu_file_digest(path, hex)) die("open base");
}

static int setup(void **state) {
    (void)state;
    tu_mpi_tmpdir(W, g_dir, sizeof g_dir);
    g_base = join("base.safetensors");
    g_a = join("a.safetensors");
    g_b = join("b.safetensors");
    g_nan = join("nan.safetensors");
    if (R == 0) {
        if (swap_write_base(g_base, &M, 21) || swap_write_adapter(g_a, &M, SWAP_ATTN, 4, 8.0f, 0.05f, 0, 22) ||
            swap_write_adapter(g_b, &M, SWAP_FF | SWAP_ATTN, 2, 2.0f, 0.05f, 0, 23))
            die("fixtures");
        write_nan_copy(g_a, g_nan);
        lk_fuse_input a1[] = {{g_a, 1.0f, LK_FORMAT_AUTO}};
        lk_fuse_input ab[] = {{g_a, 0.5f, LK_FORMAT_AUTO}, {g_b, 1.0f, LK_FORMAT_AUTO}};
        lk_fuse_input b1[] = {{g_b, 1.0f, LK_FORMAT_AUTO}};
        offline_digest(a1, 1, g_d_a);
        offline_digest(ab, 2, g_d_ab);
        offline_digest(b1, 1, g_d_b);
        file_digest(g_base, g_d_base);
    }
    lk_comm_bcast(W, g_d_base, sizeof g_d_base, 0);
    lk_comm_bcast(W, g_d_a, sizeof g_d_a, 0);
    lk_comm_bcast(W, g_d_ab, sizeof g_d_ab, 0);
    lk_comm_bcast(W, g_d_b, sizeof g_d_b, 0);
    return 0;
}

static int teardown(void **state) {
    (void)state;
    lk_comm_barrier(W);
    if (R == 0) tu_rmtree(g_dir);
    free(g_base);
    free(g_a);
    free(g_b);
    free(g_nan);
    return 0;
}

/* Every rank's weights digest to want. */
static void check_digest(const lk_weights *w, const char *want) { tu_mpi_check_digest(W, w, want); }

/* Every rank got the same status s (not OK) and a message. */
static void check_all_failed(lk_status s, lk_status want) {
    uint64_t mine = (uint64_t)s, lo = mine, hi = mine;
    assert_int_equal(lk_comm_allreduce_u64(W, &lo, 1, LK_REDUCE_MIN), LK_OK);
    assert_int_equal(lk_comm_allreduce_u64(W, &hi, 1, LK_REDUCE_MAX), LK_OK);
    if (lo != hi) fail_msg("ranks returned different statuses (%s on rank %d)", lk_status_str(s), R);
    if (s != want)
        fail_msg("rank %d: want %s, got %s: %s", R, lk_status_str(want), lk_status_str(s), lk_last_error());
    assert_true(lk_last_error()[0] != '\0');
}

/* mode: lk_tracker_create_ex's (0: the tracker picks the overlap by spare cores) */
static lk_tracker *make_ex(lk_weights *w, int allow_nonfinite, int mode) {
    lk_tracker_opts o = LK_TRACKER_OPTS_DEFAULT;
    o.bucket_bytes = (size_t)1 << 20;
    o.threads = 1;
    o.allow_nonfinite = allow_nonfinite;
    lk_tracker *t;
    if (lk_tracker_create_ex(W, w, &o, mode, &t) != LK_OK) die("tracker create");
    return t;
}

static lk_tracker *make(lk_weights *w) { return make_ex(w, 0, 0); }

/* The same relative path names a different file on rank 0 than on the
 * others (same modules and shapes, other values): as if the file changed
 * between the ranks' reads. Fusing both would give weights that no offline
 * fuse of either file gives. */
static void test_file_differs_between_ranks(void **state) {
    (void)state;
    if (N == 1) skip();
    char name[32], cwd[4096];
    snprintf(name, sizeof name, "r%d", R);
    char *rd = join(name), *mine = tu_path(rd, "ad.safetensors");
    mkdir(rd, 0700);
    if (swap_write_adapter(mine, &M, SWAP_ATTN, 4, 8.0f, 0.05f, 0, R == 0 ? 22 : 99)) die("per-rank adapter");
    lk_weights *w;
    assert_int_equal(lk_weights_load(g_base, &w), LK_OK);
    lk_tracker *t = make(w);
    assert_non_null(getcwd(cwd, sizeof cwd));
    assert_int_equal(chdir(rd), 0);
    lk_fuse_input in[1] = {{"ad.safetensors", 1.0f, LK_FORMAT_AUTO}};
    lk_status s = lk_tracker_apply(t, in, 1, NULL);
    assert_int_equal(chdir(cwd), 0);
    /* (Until f5b5ca0 the tracker agreed on paths, not bytes, and this
     * apply succeeded with weights matching no offline fuse.) */
    if (s == LK_OK) {
        char hex[LK_DIGEST_HEX];
        lk_weights_digest(w, hex);
        fail_msg("rank %d: apply accepted an adapter whose bytes differ between ranks; weights now %s "
                 "(offline fuse of rank 0's file: %s)", R, hex, g_d_a);
    }
    check_all_failed(s, LK_ERR_MISMATCH);
    check_digest(w, g_d_base);
    lk_tracker_free(t);
    lk_weights_free(w);
    free(mine);
    free(rd);
}

/* A plan step fuses a; the file is then deleted; the next step asks for a
 * and b: every rank fails, weights stay at step 1. Dropping a afterwards
 * must still work (restoring needs the backup, not the file). */
static void test_adapter_deleted_mid_plan(void **state) {
    (void)state;
    char *gone = join("gone.safetensors");
    if (R == 0 && swap_write_adapter(gone, &M, SWAP_ATTN, 4, 8.0f, 0.05f, 0, 22)) die("adapter");
    lk_comm_barrier(W);
    lk_weights *w;
    assert_int_equal(lk_weights_load(g_base, &w), LK_OK);
    lk_tracker *t = make(w);
    lk_fuse_input step1[1] = {{gone, 1.0f, LK_FORMAT_AUTO}};
    assert_int_equal(lk_tracker_apply(t, step1, 1, NULL), LK_OK);
    check_digest(w, g_d_a); /* gone.safetensors has a.safetensors' bytes */
    lk_comm_barrier(W);
    if (R == 0) assert_int_equal(remove(gone), 0);
    lk_comm_barrier(W);
    lk_fuse_input step2[2] = {{gone, 0.5f, LK_FORMAT_AUTO}, {g_b, 1.0f, LK_FORMAT_AUTO}};
    lk_status s = lk_tracker_apply(t, step2, 2, NULL);
    check_all_failed(s, LK_ERR_IO);
    tu_assert_contains(lk_last_error(), "gone.safetensors");
    check_digest(w, g_d_a);
    lk_fuse_input step3[1] = {{g_b, 1.0f, LK_FORMAT_AUTO}};
    assert_int_equal(lk_tracker_apply(t, step3, 1, NULL), LK_OK);
    check_digest(w, g_d_b);
    assert_int_equal(lk_tracker_reset(t, NULL), LK_OK);
    check_digest(w, g_d_base);
    lk_tracker_free(t);
    lk_weights_free(w);
    free(gone);
}

/* A NaN in one lora_B: refused with LK_ERR_NONFINITE on every rank, from
 * the clean state and on top of a fused set; nothing changes. With
 * allow_nonfinite the same set is applied and equals the offline fuse made
 * with allow_nonfinite (NaN bytes included). */
static void test_nan_adapter(void **state) {
    (void)state;
    lk_weights *w;
    assert_int_equal(lk_weights_load(g_base, &w), LK_OK);
    lk_tracker *t = make(w);
    lk_fuse_input nan1[1] = {{g_nan, 1.0f, LK_FORMAT_AUTO}};
    check_all_failed(lk_tracker_apply(t, nan1, 1, NULL), LK_ERR_NONFINITE);
    check_digest(w, g_d_base);
    lk_fuse_input b1[1] = {{g_b, 1.0f, LK_FORMAT_AUTO}};
    assert_int_equal(lk_tracker_apply(t, b1, 1, NULL), LK_OK);
    lk_fuse_input bn[2] = {{g_b, 1.0f, LK_FORMAT_AUTO}, {g_nan, 0.5f, LK_FORMAT_AUTO}};
    check_all_failed(lk_tracker_apply(t, bn, 2, NULL), LK_ERR_NONFINITE);
    check_digest(w, g_d_b);
    lk_tracker_free(t);
    lk_weights_free(w);

    char want[LK_DIGEST_HEX] = {0};
    if (R == 0) {
        char *out = join("nan_offline.safetensors");
        lk_fuse_file_opts fo = {.fuse = {.allow_nonfinite = 1}};
        lk_st *st;
        if (lk_fuse_file(g_base, bn, 2, out, &fo, NULL) || lk_st_open(out, &st)) die("offline NaN fuse");
        lk_digest_st(st, want);
        lk_st_close(st);
        remove(out);
        free(out);
    }
    lk_comm_bcast(W, want, sizeof want, 0);
    assert_int_equal(lk_weights_load(g_base, &w), LK_OK);
    t = make_ex(w, 1, 0);
    assert_int_equal(lk_tracker_apply(t, bn, 2, NULL), LK_OK);
    check_digest(w, want);
    assert_int_equal(lk_tracker_reset(t, NULL), LK_OK);
    check_digest(w, g_d_base);
    lk_tracker_free(t);
    lk_weights_free(w);
}

/* Every factor of module arg (its "transformer.<mod>.lora_A/B.weight")
 * set to 1e20: finite factors whose product (4 x 1e40 x alpha/rank)
 * overflows any weight dtype to Inf, on that key only. */
static int module_huge(lk_tensor *t, const void *arg) {
    const char *mod = arg;
    const char *p = t->name, *pre = "transformer.";
    size_t lp = strlen(pre), lm = strlen(mod);
    if (strncmp(p, pre, lp) || strncmp(p + lp, mod, lm) ||
        (strcmp(p + lp + lm, ".lora_A.weight") && strcmp(p + lp + lm, ".lora_B.weight")))
        return 0;
    for (size_t k = 0; k < lk_tensor_numel(t); k++) ((float *)t->data)[k] = 1e20f;
    return 1;
}

/* Every tensor's bytes (the oracle for "weights exactly as they were"). */
static void **snapshot(const lk_weights *w) {
    size_t n = lk_weights_count(w);
    void **snap = calloc(n, sizeof *snap);
    for (size_t i = 0; i < n; i++) {
        const lk_tensor *x = lk_weights_tensor(w, i);
        snap[i] = malloc(x->nbytes ? x->nbytes : 1);
        memcpy(snap[i], x->data, x->nbytes);
    }
    return snap;
}

/* Every rank's tensors are byte-identical to its snapshot (then freed). */
static void check_snapshot(const lk_weights *w, void **snap) {
    uint64_t bad = 0;
    for (size_t i = 0; i < lk_weights_count(w); i++) {
        const lk_tensor *x = lk_weights_tensor(w, i);
        if (memcmp(snap[i], x->data, x->nbytes)) {
            fprintf(stderr, "rank %d: %s differs from its bytes before the failed apply\n", R, x->name);
            bad++;
        }
        free(snap[i]);
    }
    free(snap);
    assert_int_equal(lk_comm_allreduce_u64(W, &bad, 1, LK_REDUCE_SUM), LK_OK);
    if (bad) fail_msg("%llu tensors differ after the failed apply (summed over ranks)", (unsigned long long)bad);
}

/* With the overlap (tracker.c), the fuse runs while the broadcast sends,
 * so a key that turns Inf can be found after receivers have taken other
 * keys' new bytes. The failing
 * key is owned by the last rank (sent last) and is its last BF16/F32 key
 * in name order, rounds are 4 KiB (keys split over many rounds): every
 * other owner's rounds, and the last rank's earlier ones, are on the
 * receivers before the failure is known. Every rank must still end with
 * its bytes from before the call (oracle: a memcpy snapshot taken here),
 * from a fused set and from clean, and the error must name the key; a
 * valid apply afterwards must equal an offline lk_fuse_file (rank 0).
 * In each of the tracker's modes. */
static void test_late_overflow_after_rounds_were_sent(void **state) {
    (void)state;
    static const swap_model M2 = {2, 64, 128, 1};
    char *base = join("late_base.safetensors"), *good = join("late_good.safetensors");
    char *prev = join("late_prev.safetensors"), *bad = join("late_bad.safetensors");
    char d_good[LK_DIGEST_HEX] = {0}, d_prev[LK_DIGEST_HEX] = {0}, d_base[LK_DIGEST_HEX] = {0};
    if (R == 0) {
        if (swap_write_base(base, &M2, 31) || swap_write_adapter(good, &M2, SWAP_ATTN | SWAP_FF, 4, 8.0f, 0.05f, 0, 32) ||
            swap_write_adapter(prev, &M2, SWAP_ATTN, 2, 2.0f, 0.05f, 0, 33))
            die("fixtures");
        char *out = join("late_offline.safetensors");
        lk_fuse_input g1[1] = {{good, 1.0f, LK_FORMAT_AUTO}}, p1[1] = {{prev, 1.0f, LK_FORMAT_AUTO}};
        if (swap_offline_digest(base, g1, 1, out, d_good) || swap_offline_digest(base, p1, 1, out, d_prev))
            die("offline fuse");
        free(out);
        file_digest(base, d_base);
    }
    lk_comm_bcast(W, d_base, sizeof d_base, 0);
    lk_comm_bcast(W, d_good, sizeof d_good, 0);
    lk_comm_bcast(W, d_prev, sizeof d_prev, 0);
    lk_comm_barrier(W);
    lk_weights *w;
    assert_int_equal(lk_weights_load(base, &w), LK_OK);
    lk_tracker_opts o = LK_TRACKER_OPTS_DEFAULT;
    o.bucket_bytes = 4096;
    o.threads = 1;
    lk_tracker *t;
    assert_int_equal(lk_tracker_create_ex(W, w, &o, LK_TRACKER_OVERLAP, &t), LK_OK);
    /* the target: the last rank's last BF16/F32 linear in name order */
    const char *target = NULL;
    for (size_t i = 0; i < lk_weights_count(w); i++) {
        const lk_tensor *x = lk_weights_tensor(w, i);
        if (lk_tracker_owner(t, i) != N - 1 || x->ndim != 2 || (x->dtype != LK_DTYPE_BF16 && x->dtype != LK_DTYPE_F32))
            continue;
        if (!target || strcmp(x->name, target) > 0) target = x->name;
    }
    assert_non_null(target);
    char mod[128];
    snprintf(mod, sizeof mod, "%.*s", (int)(strlen(target) - strlen(".weight")), target);
    if (R == 0) write_poisoned_copy(good, bad, module_huge, mod, 2);
    lk_comm_barrier(W);
    const uint64_t all_linears = swap_touched_bytes(w, SWAP_ATTN | SWAP_FF, NULL, 0);
    lk_fuse_input p1[1] = {{prev, 1.0f, LK_FORMAT_AUTO}}, b1[1] = {{bad, 1.0f, LK_FORMAT_AUTO}},
                  g1[1] = {{good, 1.0f, LK_FORMAT_AUTO}};
    /* modes: the worker thread forced, the tracker's choice (non-blocking
     * broadcasts with the fuse in between, a worker where cores are
     * spare), then serial: the failure is known before anything is sent */
    static const int MODES[3] = {LK_TRACKER_OVERLAP, 0, LK_TRACKER_SERIAL};
    for (int pass = 0; pass < 6; pass++) {
        const int from_clean = pass & 1, serial = pass >= 4;
        if (pass == 2 || pass == 4) {
            lk_tracker_free(t);
            assert_int_equal(lk_tracker_create_ex(W, w, &o, MODES[pass / 2], &t), LK_OK);
        }
        if (!from_clean) assert_int_equal(lk_tracker_apply(t, p1, 1, NULL), LK_OK);
        check_digest(w, from_clean ? d_base : d_prev);
        void **snap = snapshot(w);
        lk_tracker_stats st;
        lk_status s = lk_tracker_apply(t, b1, 1, &st);
        check_all_failed(s, LK_ERR_NONFINITE);
        tu_assert_contains(lk_last_error(), target);
        if (N > 1) {
            char who[32];
            snprintf(who, sizeof who, "rank %d: ", N - 1);
            tu_assert_contains(lk_last_error(), who);
            /* overlap: every changed key went out once with the new bytes,
             * then again from the restored owners; serial: none went out */
            assert_true(st.bytes_broadcast == (serial ? 0 : 2 * all_linears));
        }
        check_snapshot(w, snap);
        assert_int_equal(lk_tracker_applied(t), from_clean ? 0 : 1);
        /* still usable: a valid apply equals the offline fuse */
        assert_int_equal(lk_tracker_apply(t, g1, 1, NULL), LK_OK);
        check_digest(w, d_good);
        assert_int_equal(lk_tracker_reset(t, NULL), LK_OK);
    }
    assert_int_equal(lk_tracker_apply(t, p1, 1, NULL), LK_OK);
    check_digest(w, d_prev);
    lk_tracker_free(t);
    lk_weights_free(w);
    free(base);
    free(good);
    free(prev);
    free(bad);
}

static unsigned long g_absorbed; /* failed allocations after which the step still succeeded */

/* Brings the tracker to `from` (digest d_from), then makes the k-th
 * allocation of the step to `to` fail on rank `victim`, for k = 1, 2, ...
 * until the step needs fewer than k allocations there. Every failing run:
 * LK_ERR_NOMEM on every rank, digests still d_from. The final run: d_to. */
static unsigned long sweep_step(lk_tracker *t, lk_weights *w, const lk_fuse_input *from, size_t n_from,
                                const char *d_from, const lk_fuse_input *to, size_t n_to, const char *d_to,
                                int victim) {
    unsigned long k;
    for (k = 1;; k++) {
        assert_int_equal(lk_tracker_apply(t, from, n_from, NULL), LK_OK);
        if (R == victim) lk_alloc_fail_at(k);
        lk_status s = lk_tracker_apply(t, to, n_to, NULL);
        uint64_t done = 0;
        if (R == victim) {
            done = lk_alloc_count() < k;
            lk_alloc_fail_at(0);
        }
        assert_int_equal(lk_comm_bcast(W, &done, sizeof done, victim), LK_OK);
        if (done) {
            if (s != LK_OK) fail_msg("rank %d: step failed with no injected failure: %s", R, lk_last_error());
            check_digest(w, d_to);
            return k - 1;
        }
        if (s != LK_ERR_NOMEM && s != LK_OK)
            fail_msg("rank %d: allocation %lu on rank %d failed: want LK_ERR_NOMEM, got %s: %s", R, k, victim,
                     lk_status_str(s), lk_last_error());
        uint64_t ok = s == LK_OK, all_ok = ok;
        assert_int_equal(lk_comm_allreduce_u64(W, &all_ok, 1, LK_REDUCE_MIN), LK_OK);
        if (all_ok) { /* an optional allocation was absorbed: the result must be right */
            check_digest(w, d_to);
            g_absorbed++;
            continue;
        }
        check_all_failed(s, LK_ERR_NOMEM);
        check_digest(w, d_from);
    }
}

static void test_every_allocation_fails_in_a_swap_step(void **state) {
    (void)state;
    lk_weights *w;
    assert_int_equal(lk_weights_load(g_base, &w), LK_OK);
    /* the overlap forced: allocations on the worker thread fail too, and a
     * failure after the broadcast must restore every receiver */
    lk_tracker *t = make_ex(w, 0, LK_TRACKER_OVERLAP);
    lk_fuse_input a1[1] = {{g_a, 1.0f, LK_FORMAT_AUTO}};
    lk_fuse_input ab[2] = {{g_a, 0.5f, LK_FORMAT_AUTO}, {g_b, 1.0f, LK_FORMAT_AUTO}};
    unsigned long change = 0, reset = 0, first = 0;
    /* The first and the last rank: at 2+ ranks, one owner that sends and one
     * that receives first (every rank at ASan speed costs too much). */
    for (int victim = 0; victim < N; victim = victim == N - 1 ? N : N - 1) {
        /* change a -> {a 0.5, b}: restore, fuse, broadcast */
        change += sweep_step(t, w, a1, 1, g_d_a, ab, 2, g_d_ab, victim);
        /* {a 0.5, b} -> reset */
        reset += sweep_step(t, w, ab, 2, g_d_ab, NULL, 0, g_d_base, victim);
        /* clean -> a: first backups */
        first += sweep_step(t, w, NULL, 0, g_d_base, a1, 1, g_d_a, victim);
    }
    if (R == 0)
        print_message("swap at %d ranks: allocations failed in turn on ranks 0 and %d: change %lu, reset %lu, "
                      "first apply %lu; all clean LK_ERR_NOMEM with weights unchanged except %lu absorbed "
                      "(step succeeded, result checked)\n",
                      N, N - 1, change, reset, first, g_absorbed);
    assert_true(change > 0 && first > 0);
    lk_tracker_free(t);
    lk_weights_free(w);
}

/* The counting poll of one rank: cancels at its check number `at` (0: never). */
typedef struct cancel_count {
    long n, at;
    pthread_mutex_t mu; /* the fuse worker thread checks too */
} cancel_count;

static int count_poll(void *ctx) {
    cancel_count *c = ctx;
    pthread_mutex_lock(&c->mu);
    long k = ++c->n;
    pthread_mutex_unlock(&c->mu);
    return c->at && k >= c->at;
}

/* A cancel on rank `who` alone, at each of its checks in turn of a swap
 * step a -> a + b, serial and overlapped: every rank returns
 * LK_ERR_CANCELLED (agreed: no rank hangs in a collective the others
 * left) and every rank's weights still digest to the offline fuse of a;
 * uncancelled, the step gives the offline fuse of a + b. */
static void cancel_walk(int who, int mode) {
    cancel_count cc = {0, 0, PTHREAD_MUTEX_INITIALIZER};
    lk_cancel cn = LK_CANCEL_INIT;
    if (R == who) {
        cn.poll = count_poll;
        cn.poll_ctx = &cc;
    }
    lk_weights *w;
    assert_int_equal(lk_weights_load(g_base, &w), LK_OK);
    lk_tracker_opts o = LK_TRACKER_OPTS_DEFAULT;
    o.bucket_bytes = (size_t)1 << 14; /* several rounds */
    o.threads = 1;
    o.cancel = &cn;
    lk_tracker *t;
    if (lk_tracker_create_ex(W, w, &o, mode, &t) != LK_OK) die("tracker create");
    lk_fuse_input a1[] = {{g_a, 1.0f, LK_FORMAT_AUTO}};
    lk_fuse_input ab[] = {{g_a, 0.5f, LK_FORMAT_AUTO}, {g_b, 1.0f, LK_FORMAT_AUTO}};
    assert_int_equal(lk_tracker_apply(t, a1, 1, NULL), LK_OK);
    cc.n = 0;
    assert_int_equal(lk_tracker_apply(t, ab, 2, NULL), LK_OK); /* counts rank who's checks */
    check_digest(w, g_d_ab);
    uint64_t n = (uint64_t)cc.n;
    assert_int_equal(lk_comm_bcast(W, &n, sizeof n, who), LK_OK);
    assert_int_equal(lk_tracker_apply(t, a1, 1, NULL), LK_OK);
    assert_true(n > 3);
    for (uint64_t k = 1; k <= n; k++) {
        cc.n = 0;
        cc.at = (long)k;
        lk_status s = lk_tracker_apply(t, ab, 2, NULL);
        check_all_failed(s, LK_ERR_CANCELLED);
        tu_assert_contains(lk_last_error(), "cancelled");
        check_digest(w, g_d_a);
    }
    cc.at = 0;
    assert_int_equal(lk_tracker_apply(t, ab, 2, NULL), LK_OK);
    check_digest(w, g_d_ab);
    if (R == 0) print_message("cancel on rank %d of %d (mode %d): %lu points, each LK_ERR_CANCELLED on every rank, "
                              "weights unchanged\n", who, N, mode, (unsigned long)n);
    lk_tracker_free(t);
    lk_weights_free(w);
}

static void test_cancel_on_one_rank(void **state) {
    (void)state;
    cancel_walk(N - 1, LK_TRACKER_SERIAL);
    cancel_walk(0, LK_TRACKER_OVERLAP);
    if (N > 1) cancel_walk(N - 1, LK_TRACKER_OVERLAP);
}

int main(int argc, char **argv) {
    W = tu_mpi_init(&argc, &argv);
    R = lk_comm_rank(W);
    N = lk_comm_size(W);
    lk_log_set_level(LK_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_file_differs_between_ranks),
        cmocka_unit_test(test_adapter_deleted_mid_plan),
        cmocka_unit_test(test_nan_adapter),
        cmocka_unit_test(test_late_overflow_after_rounds_were_sent),
        cmocka_unit_test(test_every_allocation_fails_in_a_swap_step),
        cmocka_unit_test(test_cancel_on_one_rank),
    };
    return tu_mpi_finish(W, cmocka_run_group_tests(tests, setup, teardown));
}
