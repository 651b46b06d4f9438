/* test_tracker.c — the hot-swap tracker at one rank (`self` communicator,
 * no MPI): the same operations the MPI test runs at 1..4 ranks, plus
 * injected allocation failures, a double-precision check of one fused
 * element, and a NaN adapter refused by default and kept with
 * allow_nonfinite.
 * Expectations: the digest of an offline lk_fuse_file of the same set, its
 * inputs written here in sorted (path) order, and the base file's own digest
 * for the reset state; key and byte counts are derived by hand from the
 * fixture's layout (2 blocks x 4 attention + 2 feed-forward weights). */
#include "testutil.h"
#include "swap_fixture.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const swap_model M = {2, 96, 192, 1};
static char *g_dir, *g_base, *g_a, *g_b, *g_huge, *g_shape, *g_corrupt, *g_missing;
static char g_base_digest[LK_DIGEST_HEX];

static int setup(void **state) {
    (void)state;
    g_dir = tu_mkdtemp();
    g_base = tu_path(g_dir, "base.safetensors");
    g_a = tu_path(g_dir, "a.safetensors");
    g_b = tu_path(g_dir, "b.safetensors");
    g_huge = tu_path(g_dir, "huge.safetensors");
    g_shape = tu_path(g_dir, "shape.safetensors");
    g_corrupt = tu_path(g_dir, "corrupt.safetensors");
    g_missing = tu_path(g_dir, "missing.safetensors");
    if (swap_write_base(g_base, &M, 1) || swap_write_adapter(g_a, &M, SWAP_ATTN, 4, 8.0f, 0.05f, 0, 2) ||
        swap_write_adapter(g_b, &M, SWAP_FF, 2, 2.0f, 0.05f, 0, 3) ||
        swap_write_adapter(g_huge, &M, SWAP_FF, 1, 1.0f, 1e19f, 0, 4) ||
        swap_write_adapter(g_shape, &M, SWAP_ATTN, 2, 2.0f, 0.05f, 1, 5))
        return -1;
    size_t n;
    char *bytes = tu_read_file(g_a, &n);
    memset(bytes + n / 2, 0xFF, 64); /* the header survives, the data does not match the header? keep header: */
    memcpy(bytes, "\xff\xff\xff\xff\xff\xff\xff\x7f", 8); /* header length past the file */
    tu_write_file(g_corrupt, bytes, n);
    free(bytes);
    lk_st *st;
    if (lk_st_open(g_base, &st)) return -1;
    lk_digest_st(st, g_base_digest);
    lk_st_close(st);
    return 0;
}

static int teardown(void **state) {
    (void)state;
    tu_rmtree(g_dir);
    free(g_dir); free(g_base); free(g_a); free(g_b); free(g_huge); free(g_shape); free(g_corrupt); free(g_missing);
    return 0;
}

/* Digest of the offline fuse of in[0..n) (given already in sorted order). */
static void offline_digest(const lk_fuse_input *in, size_t n, char hex[LK_DIGEST_HEX]) {
    char *out = tu_path(g_dir, "offline.safetensors");
    if (swap_offline_digest(g_base, in, n, out, hex)) fail_msg("offline fuse: %s", lk_last_error());
    free(out);
}

static void digest_of(const lk_weights *w, char hex[LK_DIGEST_HEX]) {
    assert_int_equal(lk_weights_digest(w, hex), LK_OK);
}

typedef struct fixture {
    lk_comm *c;
    lk_weights *w;
    lk_tracker *t;
} fixture;

static void open_fixture(fixture *f, long bucket_mb, int no_lora_swap) {
    assert_int_equal(lk_comm_self(&f->c), LK_OK);
    assert_int_equal(lk_weights_load(g_base, &f->w), LK_OK);
    lk_tracker_opts o = LK_TRACKER_OPTS_DEFAULT;
    o.bucket_bytes = (size_t)bucket_mb << 20;
    o.no_lora_swap = no_lora_swap;
    o.threads = 1;
    assert_int_equal(lk_tracker_create(f->c, f->w, &o, &f->t), LK_OK);
}

static void close_fixture(fixture *f) {
    lk_tracker_free(f->t);
    lk_weights_free(f->w);
    lk_comm_free(f->c);
}

static void test_sequence(void **state) {
    (void)state;
    fixture f;
    open_fixture(&f, 1, 0);
    const size_t attn = swap_touched_bytes(f.w, SWAP_ATTN, NULL, 0), ff = swap_touched_bytes(f.w, SWAP_FF, NULL, 0);
    char got[LK_DIGEST_HEX], want[LK_DIGEST_HEX];
    lk_tracker_stats st;
    digest_of(f.w, got);
    assert_string_equal(got, g_base_digest);

    /* 1: A */
    lk_fuse_input a1[] = {{g_a, 1.0f, LK_FORMAT_AUTO}};
    assert_int_equal(lk_tracker_apply(f.t, a1, 1, &st), LK_OK);
    offline_digest(a1, 1, want);
    digest_of(f.w, got);
    assert_string_equal(got, want);
    assert_int_equal(st.keys_fused, 8);
    assert_int_equal(st.keys_restored, 0);
    assert_int_equal(st.bytes_broadcast, 0); /* one rank: nothing to send */
    assert_int_equal(st.backup_bytes, attn);

    /* 2: A+B at other strengths, given out of order */
    lk_fuse_input ab_req[] = {{g_b, -0.5f, LK_FORMAT_AUTO}, {g_a, 0.7, LK_FORMAT_DIFFUSERS}};
    lk_fuse_input ab_sorted[] = {{g_a, 0.7, LK_FORMAT_DIFFUSERS}, {g_b, -0.5f, LK_FORMAT_AUTO}};
    assert_int_equal(lk_tracker_apply(f.t, ab_req, 2, &st), LK_OK);
    offline_digest(ab_sorted, 2, want);
    digest_of(f.w, got);
    assert_string_equal(got, want);
    assert_int_equal(st.keys_fused, 12);
    assert_int_equal(st.backup_bytes, attn + ff);

    /* the same set in the other order is a skip */
    assert_int_equal(lk_tracker_apply(f.t, ab_sorted, 2, &st), LK_OK);
    assert_int_equal(st.skipped, 1);
    assert_int_equal(st.keys_fused + st.keys_restored, 0);

    /* 3: B alone: attention restored, feed-forward refused at the new strength */
    lk_fuse_input b1[] = {{g_b, 1.3, LK_FORMAT_AUTO}};
    assert_int_equal(lk_tracker_apply(f.t, b1, 1, &st), LK_OK);
    offline_digest(b1, 1, want);
    digest_of(f.w, got);
    assert_string_equal(got, want);
    assert_int_equal(st.keys_fused, 4);
    assert_int_equal(st.keys_restored, 8);

    /* 4: reset, and a second reset is a no-op */
    assert_int_equal(lk_tracker_reset(f.t, &st), LK_OK);
    digest_of(f.w, got);
    assert_string_equal(got, g_base_digest);
    assert_int_equal(st.keys_restored, 4);
    assert_int_equal(lk_tracker_applied(f.t), 0);
    assert_int_equal(lk_tracker_reset(f.t, &st), LK_OK);
    assert_int_equal(st.skipped, 1);

    /* 5: A again; then A plus a strength-0 entry (dropped: a skip, not even opened) */
    assert_int_equal(lk_tracker_apply(f.t, a1, 1, &st), LK_OK);
    offline_digest(a1, 1, want);
    digest_of(f.w, got);
    assert_string_equal(got, want);
    lk_fuse_input a_zero[] = {{g_missing, 0.0f, LK_FORMAT_AUTO}, {g_a, 1.0f, LK_FORMAT_AUTO}};
    assert_int_equal(lk_tracker_apply(f.t, a_zero, 2, &st), LK_OK);
    assert_int_equal(st.skipped, 1);
    /* every strength 0 means reset */
    lk_fuse_input a0[] = {{g_a, 0.0f, LK_FORMAT_AUTO}};
    assert_int_equal(lk_tracker_apply(f.t, a0, 1, &st), LK_OK);
    digest_of(f.w, got);
    assert_string_equal(got, g_base_digest);
    close_fixture(&f);
}

/* One fused element against W + s * alpha/r * sum_k B[o][k] A[k][i] in double. */
static void test_element_reference(void **state) {
    (void)state;
    fixture f;
    open_fixture(&f, 64, 0);
    const float s = 0.7f;
    lk_fuse_input in[] = {{g_a, s, LK_FORMAT_AUTO}};
    assert_int_equal(lk_tracker_apply(f.t, in, 1, NULL), LK_OK);
    lk_st *base, *ad;
    assert_int_equal(lk_st_open(g_base, &base), LK_OK);
    assert_int_equal(lk_st_open(g_a, &ad), LK_OK);
    int checked = 0;
    for (size_t i = 0; i < lk_weights_count(f.w); i++) {
        const lk_tensor *w = lk_weights_tensor(f.w, i);
        if (w->dtype != LK_DTYPE_F32 || !strstr(w->name, ".attn.")) continue;
        char mod[160], key[200];
        snprintf(mod, sizeof mod, "%.*s", (int)(strlen(w->name) - 7), w->name); /* drop ".weight" */
        snprintf(key, sizeof key, "transformer.%s.lora_A.weight", mod);
        const lk_tensor *A = lk_st_tensor(ad, (size_t)lk_st_find(ad, key));
        snprintf(key, sizeof key, "transformer.%s.lora_B.weight", mod);
        const lk_tensor *B = lk_st_tensor(ad, (size_t)lk_st_find(ad, key));
        const lk_tensor *W0 = lk_st_tensor(base, (size_t)lk_st_find(base, w->name));
        int64_t r = A->shape[0], n_in = A->shape[1];
        for (int64_t o = 0; o < w->shape[0]; o += 17)
            for (int64_t c = 0; c < n_in; c += 13) {
                double d = 0;
                for (int64_t k = 0; k < r; k++)
                    d += (double)((const float *)B->data)[o * r + k] * (double)((const float *)A->data)[k * n_in + c];
                double want = (double)((const float *)W0->data)[o * n_in + c] + (double)s * (8.0 / (double)r) * d;
                double got = (double)((const float *)w->data)[o * n_in + c];
                assert_true(fabs(got - want) <= 1e-6 * (1.0 + fabs(want)));
                checked++;
            }
    }
    assert_true(checked > 0);
    lk_st_close(base);
    lk_st_close(ad);
    close_fixture(&f);
}

/* Each failure leaves the digest as it was and names the file. */
static void test_failures(void **state) {
    (void)state;
    fixture f;
    open_fixture(&f, 64, 0);
    lk_fuse_input a1[] = {{g_a, 1.0f, LK_FORMAT_AUTO}};
    assert_int_equal(lk_tracker_apply(f.t, a1, 1, NULL), LK_OK);
    char before[LK_DIGEST_HEX], got[LK_DIGEST_HEX];
    digest_of(f.w, before);
    lk_tracker_stats st;
    const struct {
        const char *path;
        lk_status want;
        const char *needle;
    } cases[] = {
        {g_missing, LK_ERR_IO, "missing.safetensors"},
        {g_corrupt, LK_ERR_FORMAT, "corrupt.safetensors"},
        {g_shape, LK_ERR_SHAPE, "blocks.0.attn.to_q"},
        /* finite inputs, infinite result: fails while fusing
         * blocks.0.ff.net.0.proj, after block 0's attention keys were
         * refused at the new strength; they are rolled back to A at 1.0 */
        {g_huge, LK_ERR_NONFINITE, "blocks.0.ff.net.0.proj.weight"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        lk_fuse_input in[] = {{g_a, 0.9, LK_FORMAT_AUTO}, {cases[k].path, 1.0f, LK_FORMAT_AUTO}};
        lk_status s = lk_tracker_apply(f.t, in, 2, &st);
        assert_int_equal(s, cases[k].want);
        tu_assert_contains(lk_last_error(), cases[k].needle);
        digest_of(f.w, got);
        assert_string_equal(got, before);
        assert_int_equal(lk_tracker_applied(f.t), 1);
        assert_int_equal(st.backup_bytes, swap_touched_bytes(f.w, SWAP_ATTN, NULL, 0));
    }
    /* bad arguments */
    lk_fuse_input nan_in[] = {{g_a, NAN, LK_FORMAT_AUTO}};
    assert_int_equal(lk_tracker_apply(f.t, nan_in, 1, NULL), LK_ERR_ARG);
    assert_int_equal(lk_tracker_apply(f.t, NULL, 1, NULL), LK_ERR_ARG);
    digest_of(f.w, got);
    assert_string_equal(got, before);
    close_fixture(&f);
}

static void test_no_lora_swap(void **state) {
    (void)state;
    fixture f;
    open_fixture(&f, 64, 1);
    lk_fuse_input a1[] = {{g_a, 1.0f, LK_FORMAT_AUTO}}, b1[] = {{g_b, 1.0f, LK_FORMAT_AUTO}};
    char got[LK_DIGEST_HEX], want[LK_DIGEST_HEX];
    lk_tracker_stats st;
    /* a failing first set changes nothing, even without a backup */
    lk_fuse_input bad[] = {{g_a, 1.0f, LK_FORMAT_AUTO}, {g_huge, 1.0f, LK_FORMAT_AUTO}};
    assert_int_equal(lk_tracker_apply(f.t, bad, 2, &st), LK_ERR_NONFINITE);
    digest_of(f.w, got);
    assert_string_equal(got, g_base_digest);
    assert_int_equal(lk_tracker_apply(f.t, a1, 1, &st), LK_OK);
    assert_int_equal(st.backup_bytes, 0);
    offline_digest(a1, 1, want);
    digest_of(f.w, got);
    assert_string_equal(got, want);
    assert_int_equal(lk_tracker_apply(f.t, a1, 1, &st), LK_OK); /* same set: fine */
    assert_int_equal(st.skipped, 1);
    assert_int_equal(lk_tracker_apply(f.t, b1, 1, &st), LK_ERR_STATE);
    tu_assert_contains(lk_last_error(), "no_lora_swap");
    assert_int_equal(lk_tracker_reset(f.t, &st), LK_ERR_STATE);
    digest_of(f.w, got);
    assert_string_equal(got, want);
    close_fixture(&f);
}

/* An adapter overwritten on disk between two applies (same path, same
 * modules, new bytes): keys it touches are recomputed from the new bytes,
 * not kept because path and strength did not change. */
static void test_adapter_rewritten(void **state) {
    (void)state;
    char *a2 = tu_path(g_dir, "a2.safetensors");
    assert_int_equal(swap_write_adapter(a2, &M, SWAP_ATTN, 4, 8.0f, 0.05f, 0, 2), 0);
    fixture f;
    open_fixture(&f, 64, 0);
    lk_fuse_input a1[] = {{a2, 1.0f, LK_FORMAT_AUTO}};
    assert_int_equal(lk_tracker_apply(f.t, a1, 1, NULL), LK_OK);
    assert_int_equal(swap_write_adapter(a2, &M, SWAP_ATTN, 4, 8.0f, 0.05f, 0, 77), 0); /* new values */
    lk_fuse_input ab[] = {{a2, 1.0f, LK_FORMAT_AUTO}, {g_b, 1.0f, LK_FORMAT_AUTO}};
    lk_tracker_stats st;
    assert_int_equal(lk_tracker_apply(f.t, ab, 2, &st), LK_OK);
    assert_int_equal(st.keys_fused, 12); /* 8 attention (new bytes) + 4 feed-forward */
    char got[LK_DIGEST_HEX], want[LK_DIGEST_HEX];
    offline_digest(ab, 2, want);
    digest_of(f.w, got);
    assert_string_equal(got, want);
    close_fixture(&f);
    remove(a2);
    free(a2);
}

/* An adapter with one NaN in a lora_A. Default: refused with
 * LK_ERR_NONFINITE naming the weight, weights unchanged. With
 * allow_nonfinite: applied; column c of that weight is NaN in every row
 * (B[o][0] * NaN), every other element equals W + s * alpha/r * B@A computed
 * here in double, and the bytes equal an offline fuse with allow_nonfinite. */
static void test_allow_nonfinite(void **state) {
    (void)state;
    char *np = tu_path(g_dir, "nan.safetensors");
    assert_int_equal(swap_write_adapter(np, &M, SWAP_ATTN, 4, 8.0f, 0.05f, 0, 11), 0);
    lk_st *base;
    assert_int_equal(lk_st_open(g_base, &base), LK_OK);
    /* the first F32 attention weight (the fixture cycles dtypes) */
    const lk_tensor *W0 = NULL;
    for (size_t i = 0; i < lk_st_count(base) && !W0; i++) {
        const lk_tensor *w = lk_st_tensor(base, i);
        if (w->dtype == LK_DTYPE_F32 && w->ndim == 2 && strstr(w->name, ".attn.")) W0 = w;
    }
    assert_non_null(W0);
    char mod[160], key[200];
    snprintf(mod, sizeof mod, "%.*s", (int)(strlen(W0->name) - 7), W0->name); /* drop ".weight" */
    const int64_t c = 5, n_in = W0->shape[1];
    { /* poke NaN into A[0][c] of that module, in the file's bytes */
        lk_st *ad;
        assert_int_equal(lk_st_open(np, &ad), LK_OK);
        snprintf(key, sizeof key, "transformer.%s.lora_A.weight", mod);
        long k = lk_st_find(ad, key);
        assert_true(k >= 0);
        uint64_t off = lk_st_file_offset(ad, (size_t)k) + (uint64_t)c * 4;
        lk_st_close(ad);
        size_t n;
        unsigned char *bytes = tu_read_file(np, &n);
        const float nan = NAN;
        memcpy(bytes + off, &nan, 4);
        assert_int_equal(tu_write_file(np, bytes, n), 0);
        free(bytes);
    }
    const float s = 0.5f;
    lk_fuse_input in[] = {{np, s, LK_FORMAT_AUTO}};
    char got[LK_DIGEST_HEX], want[LK_DIGEST_HEX];

    /* default: refused, nothing changed */
    fixture f;
    open_fixture(&f, 64, 0);
    assert_int_equal(lk_tracker_apply(f.t, in, 1, NULL), LK_ERR_NONFINITE);
    tu_assert_contains(lk_last_error(), "non-finite");
    tu_assert_contains(lk_last_error(), W0->name);
    digest_of(f.w, got);
    assert_string_equal(got, g_base_digest);
    assert_int_equal(lk_tracker_applied(f.t), 0);
    close_fixture(&f);

    /* allow_nonfinite */
    lk_tracker_opts o = LK_TRACKER_OPTS_DEFAULT;
    o.threads = 1;
    o.allow_nonfinite = 1;
    assert_int_equal(lk_comm_self(&f.c), LK_OK);
    assert_int_equal(lk_weights_load(g_base, &f.w), LK_OK);
    assert_int_equal(lk_tracker_create(f.c, f.w, &o, &f.t), LK_OK);
    assert_int_equal(lk_tracker_apply(f.t, in, 1, NULL), LK_OK);
    assert_int_equal(lk_tracker_applied(f.t), 1);
    lk_st *ad;
    assert_int_equal(lk_st_open(np, &ad), LK_OK);
    snprintf(key, sizeof key, "transformer.%s.lora_A.weight", mod);
    const float *A = lk_st_tensor(ad, (size_t)lk_st_find(ad, key))->data;
    snprintf(key, sizeof key, "transformer.%s.lora_B.weight", mod);
    const lk_tensor *Bt = lk_st_tensor(ad, (size_t)lk_st_find(ad, key));
    const float *B = Bt->data;
    const int64_t r = Bt->shape[1];
    const float *w = lk_weights_tensor(f.w, (size_t)lk_weights_find(f.w, W0->name))->data;
    const float *w0 = W0->data;
    size_t nans = 0;
    for (int64_t oo = 0; oo < W0->shape[0]; oo++)
        for (int64_t i = 0; i < n_in; i++) {
            double d = 0;
            for (int64_t k = 0; k < r; k++) d += (double)B[oo * r + k] * (double)A[k * n_in + i];
            double e = (double)w0[oo * n_in + i] + (double)s * (8.0 / (double)r) * d; /* NaN in column c */
            double g = w[oo * n_in + i];
            if (isnan(e)) {
                assert_true(i == c);
                assert_true(isnan(g));
                nans++;
            } else {
                assert_true(fabs(g - e) <= 1e-6 * (1.0 + fabs(e)));
            }
        }
    assert_int_equal(nans, (size_t)W0->shape[0]);
    /* the same bytes as the offline fuse allowed to keep non-finite values */
    char *out = tu_path(g_dir, "offline_nan.safetensors");
    lk_fuse_file_opts fo = {.fuse = {.threads = 1}};
    assert_int_equal(lk_fuse_file(g_base, in, 1, out, &fo, NULL), LK_ERR_NONFINITE);
    fo.fuse.allow_nonfinite = 1;
    assert_int_equal(lk_fuse_file(g_base, in, 1, out, &fo, NULL), LK_OK);
    lk_st *off_st;
    assert_int_equal(lk_st_open(out, &off_st), LK_OK);
    assert_int_equal(lk_digest_st(off_st, want), LK_OK);
    lk_st_close(off_st);
    digest_of(f.w, got);
    assert_string_equal(got, want);
    /* reset brings the clean bytes back */
    assert_int_equal(lk_tracker_reset(f.t, NULL), LK_OK);
    digest_of(f.w, got);
    assert_string_equal(got, g_base_digest);
    close_fixture(&f);
    lk_st_close(ad);
    lk_st_close(base);
    remove(out);
    remove(np);
    free(out);
    free(np);
}

static void test_create_args(void **state) {
    (void)state;
    lk_comm *c;
    lk_weights *w;
    lk_tracker *t = (lk_tracker *)1;
    assert_int_equal(lk_comm_self(&c), LK_OK);
    assert_int_equal(lk_weights_load(g_base, &w), LK_OK);
    lk_tracker_opts o = LK_TRACKER_OPTS_DEFAULT;
    o.threads = -1;
    assert_int_equal(lk_tracker_create(c, w, &o, &t), LK_ERR_ARG);
    assert_null(t);
    tu_assert_contains(lk_last_error(), "threads must be >= 0 (got -1)");
    o.threads = 0;
    /* one rank owns everything; no staging buffer at one rank (bucket 0 is the default size) */
    o.bucket_bytes = 0;
    assert_int_equal(lk_tracker_create(c, w, &o, &t), LK_OK);
    for (size_t i = 0; i < lk_weights_count(w); i++) assert_int_equal(lk_tracker_owner(t, i), 0);
    assert_int_equal(lk_tracker_staging_bytes(t), 0);
    lk_tracker_free(t);
    lk_weights_free(w);
    lk_comm_free(c);
}

/* Every allocation of an apply fails in turn: LK_ERR_NOMEM, weights and
 * backups as before; then the same apply succeeds. */
static void test_alloc_failures(void **state) {
    (void)state;
    fixture f;
    open_fixture(&f, 64, 0);
    lk_fuse_input a1[] = {{g_a, 1.0f, LK_FORMAT_AUTO}};
    lk_fuse_input ab[] = {{g_a, 1.0f, LK_FORMAT_AUTO}, {g_b, 0.5f, LK_FORMAT_AUTO}};
    assert_int_equal(lk_tracker_apply(f.t, a1, 1, NULL), LK_OK);
    char before[LK_DIGEST_HEX], got[LK_DIGEST_HEX], want[LK_DIGEST_HEX];
    digest_of(f.w, before);
    lk_tracker_stats st;
    unsigned long k;
    for (k = 1; k < 10000; k++) {
        lk_alloc_fail_at(k);
        lk_status s = lk_tracker_apply(f.t, ab, 2, &st);
        lk_alloc_fail_at(0);
        if (s == LK_OK) break;
        assert_int_equal(s, LK_ERR_NOMEM);
        digest_of(f.w, got);
        assert_string_equal(got, before);
        assert_int_equal(st.backup_bytes, swap_touched_bytes(f.w, SWAP_ATTN, NULL, 0));
    }
    assert_true(k > 1);
    offline_digest(ab, 2, want);
    digest_of(f.w, got);
    assert_string_equal(got, want);
    close_fixture(&f);
}

/* Every allocation of a create fails in turn (the tracker, the table
 * copies, the per-key arrays, the planning scratch, with a label and a
 * family): LK_ERR_NOMEM and no tracker; then the create succeeds. */
static void test_create_alloc_failures(void **state) {
    (void)state;
    lk_comm *c;
    lk_weights *w;
    assert_int_equal(lk_comm_self(&c), LK_OK);
    assert_int_equal(lk_weights_load(g_base, &w), LK_OK);
    lk_tracker_opts o = LK_TRACKER_OPTS_DEFAULT;
    o.threads = 1;
    o.base_label = "the base";
    unsigned long k;
    lk_tracker *t = NULL;
    for (k = 1; k < 1000; k++) {
        lk_alloc_fail_at(k);
        lk_status s = lk_tracker_create(c, w, &o, &t);
        lk_alloc_fail_at(0);
        if (s == LK_OK) break;
        assert_int_equal(s, LK_ERR_NOMEM);
        assert_null(t);
    }
    assert_true(k > 3);
    assert_int_equal(lk_tracker_apply(t, NULL, 0, NULL), LK_OK); /* usable */
    lk_tracker_free(t);
    lk_weights_free(w);
    lk_comm_free(c);
}

/* no_lora_swap has no backup: every allocation of its first apply before
 * the fuse proper (the request, the scratch, the trial fuse's buffer and
 * the trial's own) fails in turn, each on a new tracker: LK_ERR_NOMEM with
 * the base bytes untouched, no backup, nothing applied and the tracker
 * usable. The walk ends at the first failure in the fuse proper, after the
 * trial: with nothing to roll back to, that one leaves the tracker unusable
 * (and keys fused before it in place), as no_lora_swap's contract allows.
 * Then the apply on a clean base equals the offline fuse. */
static void count_sink(void *ctx, lk_log_level level, const char *msg) {
    if (level == LK_LOG_ERROR && strstr(msg, "could not be rolled back; the tracker is now unusable")) ++*(int *)ctx;
}

static void test_no_lora_swap_alloc_failures(void **state) {
    (void)state;
    int unusable = 0;
    fixture f;
    open_fixture(&f, 64, 1);
    lk_tracker_opts o = LK_TRACKER_OPTS_DEFAULT;
    o.bucket_bytes = (size_t)64 << 20;
    o.no_lora_swap = 1;
    o.threads = 1;
    lk_fuse_input ab[] = {{g_a, 1.0f, LK_FORMAT_AUTO}, {g_b, 0.5f, LK_FORMAT_AUTO}};
    char got[LK_DIGEST_HEX], want[LK_DIGEST_HEX];
    lk_tracker_stats st;
    unsigned long k;
    lk_log_set_sink(count_sink, &unusable); /* the fuse proper's failure logs that the tracker is unusable */
    for (k = 1; k < 10000; k++) {
        lk_alloc_fail_at(k);
        lk_status s = lk_tracker_apply(f.t, ab, 2, &st);
        lk_alloc_fail_at(0);
        assert_int_equal(s, LK_ERR_NOMEM); /* the fuse proper allocates: the walk ends before a success */
        if (lk_tracker_apply(f.t, NULL, 0, NULL) == LK_ERR_STATE) break; /* unusable: failed in the fuse proper */
        digest_of(f.w, got);
        assert_string_equal(got, g_base_digest);
        assert_int_equal(st.backup_bytes, 0);
        assert_int_equal(lk_tracker_applied(f.t), 0);
        lk_tracker_free(f.t);
        assert_int_equal(lk_tracker_create(f.c, f.w, &o, &f.t), LK_OK);
    }
    lk_log_set_sink(NULL, NULL);
    assert_int_equal(unusable, 1);
    assert_true(k > 3);
    close_fixture(&f);
    open_fixture(&f, 64, 1);
    assert_int_equal(lk_tracker_apply(f.t, ab, 2, &st), LK_OK);
    offline_digest(ab, 2, want);
    digest_of(f.w, got);
    assert_string_equal(got, want);
    close_fixture(&f);
}

static void test_weights_wrap(void **state) {
    (void)state;
    float data[6] = {1, 2, 3, 4, 5, 6};
    lk_tensor t[2] = {{.name = "x", .dtype = LK_DTYPE_F32, .ndim = 2, .shape = {2, 3}, .nbytes = 24, .data = data},
                      {.name = "y", .dtype = LK_DTYPE_F32, .ndim = 1, .shape = {2}, .nbytes = 8, .data = data}};
    lk_weights *w = NULL;
    assert_int_equal(lk_weights_wrap(t, 2, &w), LK_OK);
    assert_int_equal(lk_weights_find(w, "y"), 1);
    assert_int_equal(lk_weights_find(w, "z"), -1);
    assert_int_equal(lk_weights_nbytes(w), 32);
    assert_ptr_equal(lk_weights_tensor(w, 0)->data, data); /* borrowed, not copied */
    lk_weights_free(w);
    t[1].nbytes = 12; /* disagrees with F32 x [2] */
    assert_int_equal(lk_weights_wrap(t, 2, &w), LK_ERR_ARG);
    t[1].nbytes = 8;
    t[1].name = "x";
    assert_int_equal(lk_weights_wrap(t, 2, &w), LK_ERR_ARG);
    tu_assert_contains(lk_last_error(), "appears twice");
}

/* lk_tracker_summary_json, the one formatter of a summary: the expected
 * lines are written by hand from the field list in tracker.h (the bytes
 * `lorakit swap --json` printed before the summary became a struct). */
static void test_summary_json(void **state) {
    (void)state;
    lk_tracker_summary r = {.keys_fused = 3, .keys_restored = 1, .bytes_broadcast = 4096, .backup_bytes_max = 512,
                            .seconds = 0.5, .seconds_agree = 0.25, .seconds_load = 0.125, .seconds_fuse = 2,
                            .seconds_broadcast = 0, .has_digest = 1, .digests_agree = 1};
    memcpy(r.digest, "0123456789abcdef0123456789abcdef", LK_DIGEST_HEX);
    char *js = NULL;
    assert_int_equal(lk_tracker_summary_json(&r, 7, LK_OK, NULL, &js), LK_OK);
    assert_string_equal(js, "{\"step\":7,\"status\":\"ok\",\"keys_fused\":3,\"keys_restored\":1,\"bytes_broadcast\":4096,"
                            "\"seconds\":0.5,\"digest\":\"0123456789abcdef0123456789abcdef\",\"digests_agree\":true,"
                            "\"skipped\":false,\"adapters_changed\":0,\"backup_bytes_max\":512,\"phases\":{\"agree\":0.25,\"load\":0.125,"
                            "\"fuse\":2.0,\"broadcast\":0.0}}");
    lk_free(js);
    r.has_digest = 0;
    r.skipped = 1;
    assert_int_equal(lk_tracker_summary_json(&r, 0, LK_ERR_IO, "bad \xff path", &js), LK_OK);
    assert_string_equal(js, "{\"status\":\"error\",\"error\":\"(message is not UTF-8)\",\"keys_fused\":3,"
                            "\"keys_restored\":1,\"bytes_broadcast\":4096,\"seconds\":0.5,\"digest\":null,"
                            "\"digests_agree\":null,\"skipped\":true,\"adapters_changed\":0,\"backup_bytes_max\":512,\"phases\":{"
                            "\"agree\":0.25,\"load\":0.125,\"fuse\":2.0,\"broadcast\":0.0}}");
    lk_free(js);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sequence),    cmocka_unit_test(test_element_reference),
        cmocka_unit_test(test_failures),    cmocka_unit_test(test_no_lora_swap),
        cmocka_unit_test(test_create_args), cmocka_unit_test(test_alloc_failures),
        cmocka_unit_test(test_create_alloc_failures), cmocka_unit_test(test_no_lora_swap_alloc_failures),
        cmocka_unit_test(test_adapter_rewritten), cmocka_unit_test(test_allow_nonfinite),
        cmocka_unit_test(test_weights_wrap), cmocka_unit_test(test_summary_json),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
