/* mpi_tracker.c — the hot-swap tracker over MPI (ctest runs it at 1..4
 * ranks).
 * Expectations: after every step, every rank's digest equals the digest of
 * an offline lk_fuse_file of the same set (inputs written here in sorted
 * path order), computed on rank 0 and broadcast, and the reset state equals
 * the base file's digest; bytes broadcast and backup bytes are the sums of
 * the touched weights' sizes (all of them, resp. this rank's own), derived
 * from the fixture's layout, not from the tracker. Failures must reach every
 * rank with the same status and leave every digest as it was. A failing
 * assert aborts (CMOCKA_TEST_ABORT), so mpirun stops all ranks instead of
 * leaving the others waiting in a collective. */
#include "mpi_testutil.h"
#include "swap_fixture.h"
#include "serve/tracker.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* block 0's ff.net.2 and block 1's ff.net.0.proj are F32 1536x256 = 1.5 MiB:
 * larger than a 1 MiB bucket, so they cross several rounds */
static const swap_model M = {2, 256, 1536, 1};
static lk_comm *W;
static int R, N;
static char g_dir[1024];
static char *g_base, *g_a, *g_b, *g_huge, *g_shape, *g_corrupt;
static char g_base_digest[LK_DIGEST_HEX];

enum { S_A, S_AB, S_B, S_A2, N_SETS };
static char g_want[N_SETS][LK_DIGEST_HEX];

static char *join(const char *name) { return tu_path(g_dir, name); }

/* Offline digest of in[0..n) (already sorted), on rank 0 only. */
static void offline_digest(const lk_fuse_input *in, size_t n, char hex[LK_DIGEST_HEX]) {
    char *out = join("offline.safetensors");
    if (swap_offline_digest(g_base, in, n, out, hex)) tu_mpi_die("offline fuse");
    free(out);
}

static int setup(void **state) {
    (void)state;
    tu_mpi_tmpdir(W, g_dir, sizeof g_dir);
    g_base = join("base.safetensors");
    g_a = join("a.safetensors");
    g_b = join("b.safetensors");
    g_huge = join("huge.safetensors");
    g_shape = join("shape.safetensors");
    g_corrupt = join("corrupt.safetensors");
    if (R == 0) {
        char *only = join("r0/only.safetensors"), *r0 = join("r0");
        mkdir(r0, 0700);
        if (swap_write_base(g_base, &M, 11) || swap_write_adapter(g_a, &M, SWAP_ATTN, 4, 8.0f, 0.05f, 0, 12) ||
            swap_write_adapter(g_b, &M, SWAP_FF, 2, 2.0f, 0.05f, 0, 13) ||
            swap_write_adapter(g_huge, &M, SWAP_FF, 1, 1.0f, 1e19f, 0, 14) ||
            swap_write_adapter(g_shape, &M, SWAP_ATTN, 2, 2.0f, 0.05f, 1, 15) ||
            swap_write_adapter(only, &M, SWAP_FF, 2, 2.0f, 0.05f, 0, 16))
            tu_mpi_die("fixtures");
        const char junk[] = "{\"not\": \"a safetensors file\"}";
        tu_write_file(g_corrupt, junk, sizeof junk);
        lk_fuse_input a1[] = {{g_a, 1.0f, LK_FORMAT_AUTO}};
        lk_fuse_input ab[] = {{g_a, 0.7, LK_FORMAT_AUTO}, {g_b, -0.5f, LK_FORMAT_AUTO}};
        lk_fuse_input b1[] = {{g_b, 1.3, LK_FORMAT_AUTO}};
        offline_digest(a1, 1, g_want[S_A]);
        offline_digest(ab, 2, g_want[S_AB]);
        offline_digest(b1, 1, g_want[S_B]);
        memcpy(g_want[S_A2], g_want[S_A], LK_DIGEST_HEX);
        if (tu_file_digest(g_base, g_base_digest)) tu_mpi_die("base digest");
        free(only);
        free(r0);
    } else {
        char name[32];
        snprintf(name, sizeof name, "r%d", R);
        char *rd = join(name);
        mkdir(rd, 0700);
        free(rd);
    }
    lk_comm_bcast(W, g_want, sizeof g_want, 0);
    lk_comm_bcast(W, g_base_digest, sizeof g_base_digest, 0);
    return 0;
}

static int teardown(void **state) {
    (void)state;
    lk_comm_barrier(W);
    if (R == 0) tu_rmtree(g_dir);
    free(g_base); free(g_a); free(g_b); free(g_huge); free(g_shape); free(g_corrupt);
    return 0;
}

/* Asserts that every rank's weights digest to want. */
static void check_digest(const lk_weights *w, const char *want) { tu_mpi_check_digest(W, w, want); }

static lk_tracker *make(lk_weights *w, long bucket_mb, int no_lora_swap) {
    lk_tracker_opts o = LK_TRACKER_OPTS_DEFAULT;
    o.bucket_bytes = (size_t)bucket_mb << 20;
    o.no_lora_swap = no_lora_swap;
    o.threads = 1;
    lk_tracker *t = NULL;
    assert_int_equal(lk_tracker_create(W, w, &o, &t), LK_OK);
    return t;
}

static const lk_weights *g_sort_w; /* for by_size_desc */

static int by_size_desc(const void *a, const void *b) {
    const lk_tensor *x = lk_weights_tensor(g_sort_w, *(const size_t *)a);
    const lk_tensor *y = lk_weights_tensor(g_sort_w, *(const size_t *)b);
    if (x->nbytes != y->nbytes) return x->nbytes > y->nbytes ? -1 : 1;
    return strcmp(x->name, y->name);
}

/* Ownership against a reference written here from DESIGN.md, not taken
 * from the tracker: keys largest first (ties by name), each onto the least
 * loaded rank (the lowest on ties). The byte counts below rely on it. */
static void test_ownership(void **state) {
    (void)state;
    lk_weights *w;
    assert_int_equal(lk_weights_load(g_base, &w), LK_OK);
    lk_tracker *t = make(w, 64, 0);
    size_t n = lk_weights_count(w), *idx = malloc(n * sizeof *idx);
    uint64_t *load = calloc((size_t)N, sizeof *load);
    assert_true(idx && load);
    for (size_t i = 0; i < n; i++) idx[i] = i;
    g_sort_w = w;
    qsort(idx, n, sizeof *idx, by_size_desc);
    for (size_t c = 0; c < n; c++) {
        int best = 0;
        for (int r = 1; r < N; r++)
            if (load[r] < load[best]) best = r;
        assert_int_equal(lk_tracker_owner(t, idx[c]), best);
        load[best] += lk_weights_tensor(w, idx[c])->nbytes;
    }
    free(idx);
    free(load);
    lk_tracker_free(t);
    lk_weights_free(w);
}

static void test_sequence_buckets(void **state) {
    (void)state;
    /* bucket sizes 64 KiB (every key split over rounds: the overlap waits
     * on partial keys) .. larger than the model, and the fuse/broadcast
     * overlap forced off and on (0 lets the tracker choose by spare cores).
     * (The reference-like `full` baseline is the benchmark's own now, and
     * `lorakit bench swap` checks its bytes against this tracker's.) */
    const struct {
        size_t bucket;
        int mode;
    } cfg[] = {{(size_t)1 << 20, 0},  {(size_t)2 << 20, 0},    {(size_t)1024 << 20, 0},
               {(size_t)64 << 10, LK_TRACKER_OVERLAP},
               {(size_t)64 << 10, LK_TRACKER_SERIAL}, {(size_t)1 << 20, LK_TRACKER_OVERLAP}};
    for (size_t ci = 0; ci < sizeof cfg / sizeof cfg[0]; ci++) {
        lk_weights *w;
        assert_int_equal(lk_weights_load(g_base, &w), LK_OK);
        lk_tracker_opts o = LK_TRACKER_OPTS_DEFAULT;
        o.bucket_bytes = cfg[ci].bucket;
        o.threads = 1;
        lk_tracker *t = NULL;
        assert_int_equal(lk_tracker_create_ex(W, w, &o, cfg[ci].mode, &t), LK_OK);
        const uint64_t attn = swap_touched_bytes(w, SWAP_ATTN, NULL, 0), ff = swap_touched_bytes(w, SWAP_FF, NULL, 0);
        const uint64_t my_attn = swap_touched_bytes(w, SWAP_ATTN, t, R), my_ff = swap_touched_bytes(w, SWAP_FF, t, R);
        const uint64_t sent = N > 1; /* nothing crosses a one-rank group */
        lk_tracker_stats st;

        lk_fuse_input a1[] = {{g_a, 1.0f, LK_FORMAT_AUTO}};
        assert_int_equal(lk_tracker_apply(t, a1, 1, &st), LK_OK);
        check_digest(w, g_want[S_A]);
        assert_true(st.bytes_broadcast == sent * attn);
        assert_int_equal(st.keys_broadcast, sent * 8);
        /* only what this rank owns and A touched */
        assert_true(st.backup_bytes == (my_attn));

        lk_fuse_input ab[] = {{g_b, -0.5f, LK_FORMAT_AUTO}, {g_a, 0.7, LK_FORMAT_AUTO}};
        assert_int_equal(lk_tracker_apply(t, ab, 2, &st), LK_OK);
        check_digest(w, g_want[S_AB]);
        assert_true(st.bytes_broadcast == sent * (attn + ff));
        assert_true(st.backup_bytes == (my_attn + my_ff));

        lk_fuse_input ba[] = {{g_a, 0.7, LK_FORMAT_AUTO}, {g_b, -0.5f, LK_FORMAT_AUTO}};
        assert_int_equal(lk_tracker_apply(t, ba, 2, &st), LK_OK);
        assert_int_equal(st.skipped, 1);
        assert_true(st.bytes_broadcast == 0);

        lk_fuse_input b1[] = {{g_b, 1.3, LK_FORMAT_AUTO}};
        assert_int_equal(lk_tracker_apply(t, b1, 1, &st), LK_OK);
        check_digest(w, g_want[S_B]);
        assert_true(st.bytes_broadcast == sent * (attn + ff));

        assert_int_equal(lk_tracker_reset(t, &st), LK_OK);
        check_digest(w, g_base_digest);
        assert_true(st.bytes_broadcast == sent * ff); /* delta: only B's keys were dirty */
        assert_true(st.backup_bytes == (my_attn + my_ff));

        assert_int_equal(lk_tracker_apply(t, a1, 1, &st), LK_OK);
        check_digest(w, g_want[S_A2]);
        lk_tracker_free(t);
        lk_weights_free(w);
    }
}

static void expect_failure(lk_tracker *t, const lk_weights *w, const lk_fuse_input *in, size_t n, lk_status want,
                           const char *needle) {
    char before[LK_DIGEST_HEX];
    assert_int_equal(lk_weights_digest(w, before), LK_OK);
    lk_status s = lk_tracker_apply(t, in, n, NULL);
    if (s != want) fprintf(stderr, "rank %d: got %s: %s\n", R, lk_status_str(s), lk_last_error());
    assert_int_equal(s, want);
    tu_assert_contains(lk_last_error(), needle);
    check_digest(w, before); /* unchanged, on every rank */
    assert_int_equal(lk_tracker_applied(t), 1);
}

static void test_failures(void **state) {
    (void)state;
    lk_weights *w;
    assert_int_equal(lk_weights_load(g_base, &w), LK_OK);
    lk_tracker *t = make(w, 1, 0);
    lk_fuse_input a1[] = {{g_a, 1.0f, LK_FORMAT_AUTO}};
    assert_int_equal(lk_tracker_apply(t, a1, 1, NULL), LK_OK);
    char *missing = join("missing.safetensors");
    lk_fuse_input in[2] = {{g_a, 0.9, LK_FORMAT_AUTO}, {missing, 1.0f, LK_FORMAT_AUTO}};
    expect_failure(t, w, in, 2, LK_ERR_IO, "missing.safetensors");
    if (N > 1) tu_assert_contains(lk_last_error(), "rank 0: "); /* every rank fails; the lowest speaks */
    in[1].path = g_corrupt;
    expect_failure(t, w, in, 2, LK_ERR_FORMAT, "corrupt.safetensors");
    in[1].path = g_shape;
    expect_failure(t, w, in, 2, LK_ERR_SHAPE, "lora_A is 2x257 but the model weight is 256x256");
    /* fails in the fusion phase, on the owner of the first ff key only;
     * every owner rolls its rewritten attention keys back */
    in[1].path = g_huge;
    char who[32];
    snprintf(who, sizeof who, "rank %d: ", lk_tracker_owner(t, (size_t)lk_weights_find(w, "blocks.0.ff.net.0.proj.weight")));
    expect_failure(t, w, in, 2, LK_ERR_NONFINITE, N > 1 ? who : "blocks.0.ff.net.0.proj.weight");
    if (N > 1) {
        /* the same relative path names a file only rank 0's folder has */
        char name[32];
        snprintf(name, sizeof name, "r%d", R);
        char *rd = join(name), cwd[4096];
        assert_non_null(getcwd(cwd, sizeof cwd));
        assert_int_equal(chdir(rd), 0);
        in[1].path = "only.safetensors";
        expect_failure(t, w, in, 2, LK_ERR_IO, "rank 1: only.safetensors");
        assert_int_equal(chdir(cwd), 0);
        free(rd);
        /* ranks asking for different strengths, then different counts */
        lk_fuse_input mine[2] = {{g_a, R == 0 ? 0.5f : 0.25f, LK_FORMAT_AUTO}, {g_b, 1.0f, LK_FORMAT_AUTO}};
        expect_failure(t, w, mine, 2, LK_ERR_MISMATCH, "ranks disagree on the adapter request");
        /* every rank names rank 0's request and the first differing rank's (the test's own requests) */
        char want[2][2048];
        snprintf(want[0], sizeof want[0], "rank 0 asked for 2 adapters: %s@0.5, %s@1;", g_a, g_b);
        snprintf(want[1], sizeof want[1], "rank 1 asked for 2 adapters: %s@0.25, %s@1 (this is rank %d)", g_a, g_b, R);
        tu_assert_contains(lk_last_error(), want[0]);
        tu_assert_contains(lk_last_error(), want[1]);
        /* only the last rank differs: it is the one named */
        lk_fuse_input last[1] = {{g_a, R == N - 1 ? 0.75f : 0.5f, LK_FORMAT_AUTO}};
        expect_failure(t, w, last, 1, LK_ERR_MISMATCH, "ranks disagree on the adapter request");
        snprintf(want[1], sizeof want[1], "rank %d asked for 1 adapter: %s@0.75 (this is rank %d)", N - 1, g_a, R);
        tu_assert_contains(lk_last_error(), want[1]);
        expect_failure(t, w, mine, R == 0 ? 1 : 2, LK_ERR_MISMATCH, "ranks disagree");
        /* apply on some ranks, reset on others: also a mismatch, no hang */
        expect_failure(t, w, mine, R == 0 ? 0 : 2, LK_ERR_MISMATCH, "ranks disagree");
    }
    /* still usable afterwards */
    lk_fuse_input b1[] = {{g_b, 1.3, LK_FORMAT_AUTO}};
    assert_int_equal(lk_tracker_apply(t, b1, 1, NULL), LK_OK);
    check_digest(w, g_want[S_B]);
    free(missing);
    lk_tracker_free(t);
    lk_weights_free(w);
}

static void test_no_lora_swap(void **state) {
    (void)state;
    lk_weights *w;
    assert_int_equal(lk_weights_load(g_base, &w), LK_OK);
    lk_tracker *t = make(w, 1, 1);
    lk_tracker_stats st;
    lk_fuse_input a1[] = {{g_a, 1.0f, LK_FORMAT_AUTO}}, b1[] = {{g_b, 1.3, LK_FORMAT_AUTO}};
    assert_int_equal(lk_tracker_apply(t, a1, 1, &st), LK_OK);
    check_digest(w, g_want[S_A]);
    assert_true(st.backup_bytes == 0);
    assert_int_equal(lk_tracker_apply(t, b1, 1, &st), LK_ERR_STATE);
    check_digest(w, g_want[S_A]);
    assert_int_equal(lk_tracker_reset(t, &st), LK_ERR_STATE);
    check_digest(w, g_want[S_A]);
    lk_tracker_free(t);
    lk_weights_free(w);
}

static void test_create_mismatch(void **state) {
    (void)state;
    if (N == 1) skip();
    lk_weights *w;
    assert_int_equal(lk_weights_load(g_base, &w), LK_OK);
    lk_tracker_opts o = LK_TRACKER_OPTS_DEFAULT;
    o.bucket_bytes = (size_t)(R == 0 ? 1 : 2) << 20; /* the rounds would not line up */
    lk_tracker *t = (lk_tracker *)1;
    assert_int_equal(lk_tracker_create(W, w, &o, &t), LK_ERR_MISMATCH);
    assert_null(t);
    o.bucket_bytes = (size_t)1 << 20;
    /* another convention on one rank: the same adapters would mean other weights (issue 29) */
    o.convention = R == N - 1 ? LK_CONVENTION_COMFYUI : LK_CONVENTION_LORAKIT;
    assert_int_equal(lk_tracker_create(W, w, &o, &t), LK_ERR_MISMATCH);
    assert_null(t);
    tu_assert_contains(lk_last_error(), R == N - 1 ? "convention comfyui" : "convention lorakit");
    o.convention = LK_CONVENTION_LORAKIT;
    /* serial on one rank: its agreement on the fuse would sit elsewhere among the collectives */
    assert_int_equal(lk_tracker_create_ex(W, w, &o, R == 0 ? LK_TRACKER_SERIAL : 0, &t), LK_ERR_MISMATCH);
    tu_assert_contains(lk_last_error(), "mode");
    assert_int_equal(lk_tracker_create_ex(W, w, &o, LK_TRACKER_SERIAL | LK_TRACKER_OVERLAP, &t), LK_ERR_ARG);
    o.threads = R == N - 1 ? -1 : 1; /* invalid on one rank: every rank hears */
    assert_int_equal(lk_tracker_create(W, w, &o, &t), LK_ERR_ARG);
    char want[32];
    snprintf(want, sizeof want, "rank %d: ", N - 1);
    tu_assert_contains(lk_last_error(), want);
    lk_weights_free(w);
}

/* Flips one bit of the first byte of weight `name` in w (found by name). */
static void flip(lk_weights *w, const char *name) {
    for (size_t i = 0; i < lk_weights_count(w); i++)
        if (!strcmp(lk_weights_tensor(w, i)->name, name)) {
            ((unsigned char *)lk_weights_tensor(w, i)->data)[0] ^= 0x10;
            return;
        }
    tu_mpi_die("flip: no such weight");
}

/* Ranks that loaded different base bytes (same names, dtypes and shapes)
 * must not start a tracker: every rank gets LK_ERR_MISMATCH naming the
 * first differing tensor in byte-wise name order, how many differ, and
 * which ranks hold which bytes. Expectations from the edits made here: the
 * last rank flips a bit of blocks.1.ff.net.2.weight (1 of the base's
 * tensors differs; it alone holds other bytes); then, at 3+ ranks, rank 1
 * also flips blocks.0.attn.to_q.weight, which sorts first ("blocks.0." <
 * "blocks.1."), held differently by rank 1 alone. Equal bases pass. */
static void test_base_differs(void **state) {
    (void)state;
    if (N == 1) skip();
    lk_weights *w;
    assert_int_equal(lk_weights_load(g_base, &w), LK_OK);
    const size_t n = lk_weights_count(w);
    lk_tracker_opts o = LK_TRACKER_OPTS_DEFAULT;
    o.threads = 1;
    lk_tracker *t = NULL;
    assert_int_equal(lk_tracker_create(W, w, &o, &t), LK_OK); /* equal bases */
    lk_tracker_free(t);
    if (R == N - 1) flip(w, "blocks.1.ff.net.2.weight");
    t = (lk_tracker *)1;
    assert_int_equal(lk_tracker_create(W, w, &o, &t), LK_ERR_MISMATCH);
    assert_null(t);
    char want[256];
    snprintf(want, sizeof want, "1 of %zu tensors differ; the first in byte-wise name order is "
             "blocks.1.ff.net.2.weight: %s0", n, N > 2 ? "ranks " : "rank ");
    tu_assert_contains(lk_last_error(), want);
    snprintf(want, sizeof want, "; rank %d holds XXH3-64 ", N - 1);
    tu_assert_contains(lk_last_error(), want);
    /* every allocation of that create failed in turn on the last rank:
     * LK_ERR_NOMEM on every rank and no tracker, until none is left to fail
     * and the mismatch is found again; the last allocation to fail is the
     * gather of every rank's hashes (the tracker's own message) */
    char last[256] = "";
    unsigned long k = 1;
    for (;; k++) {
        if (R == N - 1) lk_alloc_fail_at(k);
        lk_status s = lk_tracker_create(W, w, &o, &t);
        lk_alloc_fail_at(0);
        assert_null(t);
        if (s == LK_ERR_MISMATCH) break;
        if (s != LK_ERR_NOMEM) fail_msg("rank %d: allocation %lu: got %s: %s", R, k, lk_status_str(s), lk_last_error());
        snprintf(last, sizeof last, "%s", lk_last_error());
    }
    assert_true(k > 3);
    tu_assert_contains(lk_last_error(), "1 of ");
    if (R == N - 1) tu_assert_contains(last, "tracker: out of memory comparing ");
    if (N > 2) {
        if (R == 1) flip(w, "blocks.0.attn.to_q.weight");
        assert_int_equal(lk_tracker_create(W, w, &o, &t), LK_ERR_MISMATCH);
        snprintf(want, sizeof want, "2 of %zu tensors differ; the first in byte-wise name order is "
                 "blocks.0.attn.to_q.weight: ranks 0, ", n);
        tu_assert_contains(lk_last_error(), want);
        tu_assert_contains(lk_last_error(), "; rank 1 holds XXH3-64 ");
        if (R == 1) flip(w, "blocks.0.attn.to_q.weight"); /* back */
    }
    if (R == N - 1) flip(w, "blocks.1.ff.net.2.weight"); /* equal again: starts */
    assert_int_equal(lk_tracker_create(W, w, &o, &t), LK_OK);
    lk_tracker_free(t);
    lk_weights_free(w);
}

/* Writes the base as a sharded set in <g_dir>/sharded/ (3 shards, tensors
 * dealt round-robin, an index like transformers'); rank 0. */
static void write_sharded_base(const char *dir) {
    lk_st *st;
    if (lk_st_open(g_base, &st)) tu_mpi_die("open base");
    size_t n = lk_st_count(st);
    lk_tensor *t = malloc(n * sizeof *t);
    char *idx = malloc(64 + n * 160);
    if (!t || !idx) tu_mpi_die("malloc");
    size_t o = (size_t)sprintf(idx, "{\"metadata\": {\"total_size\": 1}, \"weight_map\": {");
    for (int j = 0; j < 3; j++) {
        size_t k = 0;
        char name[64];
        snprintf(name, sizeof name, "model-%05d-of-00003.safetensors", j + 1);
        for (size_t i = (size_t)j; i < n; i += 3) {
            t[k++] = *lk_st_tensor(st, i);
            o += (size_t)sprintf(idx + o, "%s\"%s\": \"%s\"", o > 50 ? ", " : "", lk_st_tensor(st, i)->name, name);
        }
        char *p = tu_path(dir, name);
        if (lk_st_save(p, t, k, NULL, 0)) tu_mpi_die("save shard");
        free(p);
    }
    sprintf(idx + o, "}}");
    char *ip = tu_path(dir, "model.safetensors.index.json");
    tu_write_file(ip, idx, strlen(idx));
    free(ip);
    free(idx);
    free(t);
    lk_st_close(st);
}

/* A swap over a sharded base (every rank loads the index) equals the
 * offline fuse of the single file by digest (the digest is layout-free),
 * and so does the offline fuse of the sharded base; reset gives the base. */
static void test_sharded_base(void **state) {
    (void)state;
    char *dir = join("sharded");
    if (R == 0) {
        mkdir(dir, 0700);
        write_sharded_base(dir);
        lk_fuse_input ab[] = {{g_a, 0.7, LK_FORMAT_AUTO}, {g_b, -0.5f, LK_FORMAT_AUTO}};
        char *out = join("sharded_out"), hex[LK_DIGEST_HEX];
        lk_ckpt *ck = NULL;
        assert_int_equal(lk_fuse_file(dir, ab, 2, out, NULL, NULL), LK_OK);
        assert_int_equal(lk_ckpt_open(out, &ck), LK_OK);
        assert_int_equal(lk_ckpt_shard_count(ck), 3);
        assert_int_equal(lk_digest_ckpt(ck, hex), LK_OK);
        assert_string_equal(hex, g_want[S_AB]);
        lk_ckpt_close(ck);
        free(out);
    }
    lk_comm_barrier(W);
    lk_weights *w;
    assert_int_equal(lk_comm_agree(W, lk_weights_load(dir, &w)), LK_OK);
    check_digest(w, g_base_digest);
    lk_tracker *t = make(w, 1, 0);
    lk_fuse_input a1[] = {{g_a, 1.0f, LK_FORMAT_AUTO}};
    lk_fuse_input ab[] = {{g_a, 0.7, LK_FORMAT_AUTO}, {g_b, -0.5f, LK_FORMAT_AUTO}};
    assert_int_equal(lk_tracker_apply(t, a1, 1, NULL), LK_OK);
    check_digest(w, g_want[S_A]);
    assert_int_equal(lk_tracker_apply(t, ab, 2, NULL), LK_OK);
    check_digest(w, g_want[S_AB]);
    assert_int_equal(lk_tracker_reset(t, NULL), LK_OK);
    check_digest(w, g_base_digest);
    lk_tracker_free(t);
    lk_weights_free(w);
    free(dir);
}

/* FP8 base: plain e4m3, e4m3 + F32 [] weight_scale, e4m3 + BF16 [out, 1]
 * weight_scale (per channel), e5m2 plain, and a BF16 weight; rank 0. */
#define F8O 48
#define F8I 64
static void write_fp8_fixtures(const char *base, const char *ad) {
    static uint8_t w[4][F8O * F8I];
    static uint16_t bf[F8O * F8I], sc_bf[F8O];
    static float A[4][4 * F8I], B[4][F8O * 4];
    float sc_f = 0.0025f;
    tu_rng r = {4242};
    for (int k = 0; k < 4; k++)
        for (int i = 0; i < F8O * F8I; i++) {
            uint8_t c = (uint8_t)(tu_next(&r) & 0xb7); /* finite, |x| < 256 (e4m3) / small (e5m2) */
            w[k][i] = c;
        }
    for (int i = 0; i < F8O * F8I; i++) bf[i] = lk_f32_to_bf16(tu_uniform(&r, -1, 1));
    for (int o = 0; o < F8O; o++) sc_bf[o] = lk_f32_to_bf16(0.001f * (float)(1 + o % 5));
    const char *mods[4] = {"blocks.0.attn.to_q", "blocks.0.attn.to_k", "blocks.0.attn.to_v", "blocks.1.attn.to_q"};
    lk_tensor t[8];
    char names[8][64];
    lk_dtype dts[4] = {LK_DTYPE_F8_E4M3, LK_DTYPE_F8_E4M3, LK_DTYPE_F8_E4M3, LK_DTYPE_F8_E5M2};
    for (int k = 0; k < 4; k++) {
        snprintf(names[k], sizeof names[k], "%s.weight", mods[k]);
        t[k] = (lk_tensor){.name = names[k], .dtype = dts[k], .ndim = 2, .shape = {F8O, F8I}, .nbytes = F8O * F8I,
                           .data = w[k]};
    }
    t[4] = (lk_tensor){.name = "blocks.0.attn.to_k.weight_scale", .dtype = LK_DTYPE_F32, .ndim = 0, .nbytes = 4,
                       .data = &sc_f};
    t[5] = (lk_tensor){.name = "blocks.0.attn.to_v.weight_scale", .dtype = LK_DTYPE_BF16, .ndim = 2,
                       .shape = {F8O, 1}, .nbytes = sizeof sc_bf, .data = sc_bf};
    t[6] = (lk_tensor){.name = "blocks.1.ff.weight", .dtype = LK_DTYPE_BF16, .ndim = 2, .shape = {F8O, F8I},
                       .nbytes = sizeof bf, .data = bf};
    if (lk_st_save(base, t, 7, NULL, 0)) tu_mpi_die("save fp8 base");
    lk_tensor at[8];
    char an[8][96];
    for (int k = 0; k < 4; k++) {
        for (int i = 0; i < 4 * F8I; i++) A[k][i] = tu_uniform(&r, -1, 1);
        for (int i = 0; i < F8O * 4; i++) B[k][i] = tu_uniform(&r, -0.01f, 0.01f);
        snprintf(an[2 * k], sizeof an[0], "%s.lora_A.weight", mods[k]);
        snprintf(an[2 * k + 1], sizeof an[0], "%s.lora_B.weight", mods[k]);
        at[2 * k] = (lk_tensor){.name = an[2 * k], .dtype = LK_DTYPE_F32, .ndim = 2, .shape = {4, F8I},
                                .nbytes = sizeof A[k], .data = A[k]};
        at[2 * k + 1] = (lk_tensor){.name = an[2 * k + 1], .dtype = LK_DTYPE_F32, .ndim = 2, .shape = {F8O, 4},
                                    .nbytes = sizeof B[k], .data = B[k]};
    }
    if (lk_st_save(ad, at, 8, NULL, 0)) tu_mpi_die("save fp8 adapter");
}

/* A swap over an FP8 base (nearest and seeded stochastic, saturating the
 * plain weights) equals the offline fuse with the same options by digest
 * at every rank count; reset restores the FP8 bytes and scales bit for bit. */
static void test_fp8_base(void **state) {
    (void)state;
    char *base = join("fp8_base.safetensors"), *ad = join("fp8_ad.safetensors");
    char want[2][2][LK_DIGEST_HEX], base_d[LK_DIGEST_HEX];
    const double strengths[2] = {1.0, -0.6};
    for (int mode = 0; mode < 2; mode++) {
        lk_fp8_opts f8 = {mode ? LK_FP8_STOCHASTIC : LK_FP8_NEAREST, 7, LK_FP8_RESCALE, 1};
        if (R == 0) {
            if (mode == 0) write_fp8_fixtures(base, ad);
            for (int k = 0; k < 2; k++) {
                lk_fuse_input in = {ad, strengths[k], LK_FORMAT_AUTO};
                lk_fuse_file_opts fo = {0};
                fo.fuse.fp8 = f8;
                char *out = join("fp8_off.safetensors");
                lk_st *st = NULL;
                if (lk_fuse_file(base, &in, 1, out, &fo, NULL) || lk_st_open(out, &st) ||
                    lk_digest_st(st, want[mode][k]))
                    tu_mpi_die("fp8 offline fuse");
                lk_st_close(st);
                remove(out);
                free(out);
            }
            lk_st *st = NULL;
            if (lk_st_open(base, &st) || lk_digest_st(st, base_d)) tu_mpi_die("fp8 base digest");
            lk_st_close(st);
        }
        lk_comm_bcast(W, want, sizeof want, 0);
        lk_comm_bcast(W, base_d, sizeof base_d, 0);
        lk_weights *w;
        assert_int_equal(lk_comm_agree(W, lk_weights_load(base, &w)), LK_OK);
        lk_tracker_opts o = LK_TRACKER_OPTS_DEFAULT;
        o.bucket_bytes = (size_t)1 << 20;
        o.threads = 1 + R % 2; /* thread counts differ between ranks */
        o.fp8 = f8;
        lk_tracker *t = NULL;
        assert_int_equal(lk_tracker_create(W, w, &o, &t), LK_OK);
        for (int k = 0; k < 2; k++) {
            lk_fuse_input in = {ad, strengths[k], LK_FORMAT_AUTO};
            assert_int_equal(lk_tracker_apply(t, &in, 1, NULL), LK_OK);
            check_digest(w, want[mode][k]);
        }
        assert_int_equal(lk_tracker_reset(t, NULL), LK_OK);
        check_digest(w, base_d);
        lk_tracker_free(t);
        lk_weights_free(w);
    }
    assert_string_not_equal(want[0][0], want[1][0]); /* stochastic rounded differently */
    free(base);
    free(ad);
}

int main(int argc, char **argv) {
    W = tu_mpi_init(&argc, &argv);
    R = lk_comm_rank(W);
    N = lk_comm_size(W);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ownership),
        cmocka_unit_test(test_sequence_buckets),
        cmocka_unit_test(test_failures),
        cmocka_unit_test(test_no_lora_swap),
        cmocka_unit_test(test_create_mismatch),
        cmocka_unit_test(test_base_differs),
        cmocka_unit_test(test_sharded_base),
        cmocka_unit_test(test_fp8_base),
    };
    return tu_mpi_finish(W, cmocka_run_group_tests(tests, setup, teardown));
}
