/* mpi_tracker_device.c — the hot-swap tracker on device weights (ctest
 * runs it at 1..4 ranks): on `emul` everywhere (CI has no GPU), and on
 * cuda:N over NCCL where a GPU per rank exists (skipped here: "no CUDA
 * device").
 * Expectations as in mpi_tracker.c, independent of the tracker: after every
 * step every rank's digest (of its device memory, read back) equals an
 * offline lk_fuse_file of the same set on the host (rank 0, broadcast); the
 * reset state equals the base file's digest; bytes broadcast and backup
 * bytes are sums of the touched weights' sizes from the fixture's layout.
 * Memory accounting: beyond device backups (exactly the touched keys this
 * rank owns, with backup = device) the tracker holds on the device the
 * fingerprint's partial sums (an eighth of the largest key: 1.5 MiB / 8,
 * by hand from src/device/fingerprint.h's 8 words per thread, 8 bytes per
 * sum) and the fuse's grow-only scratch of factors, together within the
 * issue's bound (staging + largest key); pinned host memory is the host
 * backups plus, at more than one rank, one broadcast round (device keys
 * are hashed on the device: no host scratch for them). LoRA terms on F32 weights run
 * on the device kernel (none on its host path), and the digests still
 * equal the CPU's offline fuse. A failing step changes no rank's
 * device bytes. */
#include "mpi_testutil.h"
#include "swap_fixture.h"
#include "lorakit/comm_nccl.h"
#include "lorakit/device.h"
#include "serve/tracker.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const swap_model M = {2, 256, 1536, 1}; /* the largest keys: F32 1536x256 = 1.5 MiB */
static const uint64_t LARGEST = (uint64_t)1536 * 256 * 4;
static lk_comm *W;
static int R, N;
static char g_dir[1024];
static char *g_base, *g_a, *g_b, *g_huge;
static char g_base_digest[LK_DIGEST_HEX];
enum { S_A, S_AB, S_B, N_SETS };
static char g_want[N_SETS][LK_DIGEST_HEX];

static int setup(void **state) {
    (void)state;
    tu_mpi_tmpdir(W, g_dir, sizeof g_dir);
    g_base = tu_path(g_dir, "base.safetensors");
    g_a = tu_path(g_dir, "a.safetensors");
    g_b = tu_path(g_dir, "b.safetensors");
    g_huge = tu_path(g_dir, "huge.safetensors");
    if (R == 0) {
        if (swap_write_base(g_base, &M, 21) || swap_write_adapter(g_a, &M, SWAP_ATTN, 4, 8.0f, 0.05f, 0, 22) ||
            swap_write_adapter(g_b, &M, SWAP_FF, 2, 2.0f, 0.05f, 0, 23) ||
            swap_write_adapter(g_huge, &M, SWAP_FF, 1, 1.0f, 1e19f, 0, 24))
            tu_mpi_die("fixtures");
        char *out = tu_path(g_dir, "offline.safetensors");
        lk_fuse_input a1[] = {{g_a, 1.0, LK_FORMAT_AUTO}};
        lk_fuse_input ab[] = {{g_a, 0.7, LK_FORMAT_AUTO}, {g_b, -0.5, LK_FORMAT_AUTO}};
        lk_fuse_input b1[] = {{g_b, 1.3, LK_FORMAT_AUTO}};
        if (swap_offline_digest(g_base, a1, 1, out, g_want[S_A]) || swap_offline_digest(g_base, ab, 2, out, g_want[S_AB]) ||
            swap_offline_digest(g_base, b1, 1, out, g_want[S_B]))
            tu_mpi_die("offline fuse");
        free(out);
        if (tu_file_digest(g_base, g_base_digest)) tu_mpi_die("base digest");
    }
    lk_comm_bcast(W, g_want, sizeof g_want, 0);
    lk_comm_bcast(W, g_base_digest, sizeof g_base_digest, 0);
    return 0;
}

static int teardown(void **state) {
    (void)state;
    lk_comm_barrier(W);
    if (R == 0) tu_rmtree(g_dir);
    free(g_base); free(g_a); free(g_b); free(g_huge);
    return 0;
}

static lk_weights *load_on(lk_device d) {
    lk_weights *w = NULL;
    assert_int_equal(lk_weights_load(g_base, &w), LK_OK);
    assert_int_equal(lk_weights_to_device(w, d), LK_OK);
    assert_true(lk_device_equal(lk_weights_device(w), d));
    assert_true(lk_device_equal(lk_weights_tensor(w, 0)->device, d));
    return w;
}

/* The memory figures of one call (see the header). */
static void check_memory(const lk_tracker_stats *st, int backup_device, uint64_t my_backup, uint64_t staging) {
    assert_true(st->backup_bytes == my_backup);
    const uint64_t extra = st->device_bytes - (backup_device ? my_backup : 0);
    if (st->device_bytes < (backup_device ? my_backup : 0) || extra < LARGEST / 8 || extra > staging + LARGEST)
        fail_msg("rank %d: device bytes %llu: beyond the backups %llu, want the fingerprint's %llu and at most %llu",
                 R, (unsigned long long)st->device_bytes, (unsigned long long)extra, (unsigned long long)(LARGEST / 8),
                 (unsigned long long)(staging + LARGEST));
    const uint64_t pinned = (backup_device ? 0 : my_backup) + staging;
    if (st->pinned_bytes < pinned || st->pinned_bytes >= pinned + 64) /* the scratch is carved at 64-byte grain */
        fail_msg("rank %d: pinned bytes %llu, want %llu", R, (unsigned long long)st->pinned_bytes,
                 (unsigned long long)pinned);
}

/* apply A, A+B, B, reset, each against its offline digest, on comm c over
 * weights on d. */
static void run_sequence(lk_comm *c, lk_device d, size_t bucket, int backup_device, int mode) {
    lk_weights *w = load_on(d);
    lk_tracker_opts o = LK_TRACKER_OPTS_DEFAULT;
    o.bucket_bytes = bucket;
    o.threads = 1;
    o.backup = backup_device ? LK_TRACKER_BACKUP_DEVICE : LK_TRACKER_BACKUP_HOST;
    lk_tracker *t = NULL;
    assert_int_equal(lk_tracker_create_ex(c, w, &o, mode, &t), LK_OK);
    const uint64_t attn = swap_touched_bytes(w, SWAP_ATTN, NULL, 0), ff = swap_touched_bytes(w, SWAP_FF, NULL, 0);
    const uint64_t my_attn = swap_touched_bytes(w, SWAP_ATTN, t, R), my_ff = swap_touched_bytes(w, SWAP_FF, t, R);
    const uint64_t sent = N > 1, total = lk_weights_nbytes(w);
    const uint64_t staging = N > 1 ? (bucket < total ? bucket : total) : 0;
    const int staged = !(d.kind == LK_DEVICE_CUDA && lk_comm_takes_cuda(c));
    lk_tracker_stats st;
    lk_fuse_input a1[] = {{g_a, 1.0, LK_FORMAT_AUTO}};
    assert_int_equal(lk_tracker_apply(t, a1, 1, &st), LK_OK);
    tu_mpi_check_digest(W, w, g_want[S_A]);
    assert_true(st.bytes_broadcast == sent * attn);
    assert_int_equal(st.keys_fused_on_host, 0); /* LoRA on F32: every key by the device kernel */
    check_memory(&st, backup_device, my_attn, staged ? staging : 0);
    lk_fuse_input ab[] = {{g_b, -0.5, LK_FORMAT_AUTO}, {g_a, 0.7, LK_FORMAT_AUTO}};
    assert_int_equal(lk_tracker_apply(t, ab, 2, &st), LK_OK);
    tu_mpi_check_digest(W, w, g_want[S_AB]);
    assert_true(st.bytes_broadcast == sent * (attn + ff));
    check_memory(&st, backup_device, my_attn + my_ff, staged ? staging : 0);
    lk_fuse_input b1[] = {{g_b, 1.3, LK_FORMAT_AUTO}};
    assert_int_equal(lk_tracker_apply(t, b1, 1, &st), LK_OK);
    tu_mpi_check_digest(W, w, g_want[S_B]);
    assert_int_equal(lk_tracker_reset(t, &st), LK_OK);
    tu_mpi_check_digest(W, w, g_base_digest);
    assert_true(st.bytes_broadcast == sent * ff); /* delta-aware: only B's keys were dirty */
    assert_int_equal(st.keys_fused, 0);
    lk_tracker_free(t);
    lk_weights_free(w);
}

static void test_emul_sequences(void **state) {
    (void)state;
    const lk_device emul = {LK_DEVICE_EMUL, 0};
    run_sequence(W, emul, (size_t)64 << 10, 0, 0);                 /* every large key over several rounds */
    run_sequence(W, emul, (size_t)1 << 20, 1, 0);                  /* backup = device */
    run_sequence(W, emul, (size_t)1024 << 20, 0, LK_TRACKER_SERIAL); /* one round, no overlap */
}

/* A fuse failing on one owner (a non-finite result): every rank returns it
 * with its device bytes as they were; then the tracker works on. */
static void test_emul_failure(void **state) {
    (void)state;
    lk_weights *w = load_on((lk_device){LK_DEVICE_EMUL, 0});
    lk_tracker_opts o = LK_TRACKER_OPTS_DEFAULT;
    o.bucket_bytes = (size_t)1 << 20;
    o.threads = 1;
    lk_tracker *t = NULL;
    assert_int_equal(lk_tracker_create(W, w, &o, &t), LK_OK);
    lk_fuse_input a1[] = {{g_a, 1.0, LK_FORMAT_AUTO}};
    assert_int_equal(lk_tracker_apply(t, a1, 1, NULL), LK_OK);
    lk_fuse_input bad[] = {{g_a, 0.9, LK_FORMAT_AUTO}, {g_huge, 1.0, LK_FORMAT_AUTO}};
    lk_status s = lk_tracker_apply(t, bad, 2, NULL);
    assert_int_equal(s, LK_ERR_NONFINITE);
    tu_assert_contains(lk_last_error(), "blocks.");
    tu_mpi_check_digest(W, w, g_want[S_A]); /* unchanged everywhere */
    lk_fuse_input b1[] = {{g_b, 1.3, LK_FORMAT_AUTO}};
    assert_int_equal(lk_tracker_apply(t, b1, 1, NULL), LK_OK);
    tu_mpi_check_digest(W, w, g_want[S_B]);
    lk_tracker_free(t);
    lk_weights_free(w);
}

/* A fuse failing on keys the call touches first (a fresh tracker, A and
 * the huge adapter: every key backed up in this call, the first fuses
 * starting on the weight itself with no restore, since it holds its
 * backup's bytes): every rank returns the error and every byte of every
 * tensor, read back from the device, equals the base file's (oracle: the
 * file read on the host); the device kernel did run (launches counted on
 * the emul device, every rank's summed). Then A applies from those bytes
 * and equals the offline fuse. */
static void test_emul_failure_first_touch(void **state) {
    (void)state;
    lk_weights *w = load_on((lk_device){LK_DEVICE_EMUL, 0}), *base = NULL;
    assert_int_equal(lk_weights_load(g_base, &base), LK_OK);
    lk_tracker_opts o = LK_TRACKER_OPTS_DEFAULT;
    o.bucket_bytes = (size_t)1 << 20;
    o.threads = 1;
    lk_tracker *t = NULL;
    assert_int_equal(lk_tracker_create(W, w, &o, &t), LK_OK);
    lk_device_counts k0, k1;
    lk_device_emul_counts(&k0);
    lk_fuse_input bad[] = {{g_a, 1.0, LK_FORMAT_AUTO}, {g_huge, 1.0, LK_FORMAT_AUTO}};
    assert_int_equal(lk_tracker_apply(t, bad, 2, NULL), LK_ERR_NONFINITE);
    lk_device_emul_counts(&k1);
    uint64_t launches = k1.launches - k0.launches;
    assert_int_equal(lk_comm_allreduce_u64(W, &launches, 1, LK_REDUCE_SUM), LK_OK);
    assert_true(launches > 0);
    for (size_t i = 0; i < lk_weights_count(w); i++) {
        const lk_tensor *d = lk_weights_tensor(w, i);
        const long hi = lk_weights_find(base, d->name);
        assert_true(hi >= 0);
        const lk_tensor *h = lk_weights_tensor(base, (size_t)hi);
        assert_true(h->nbytes == d->nbytes);
        unsigned char *back = malloc(d->nbytes ? d->nbytes : 1);
        assert_non_null(back);
        assert_int_equal(lk_device_copy(d->device, back, d->data, d->nbytes, LK_COPY_D2H, NULL), LK_OK);
        if (memcmp(back, h->data, d->nbytes)) fail_msg("rank %d: %s differs from the base after the rollback", R, d->name);
        free(back);
    }
    lk_fuse_input a1[] = {{g_a, 1.0, LK_FORMAT_AUTO}};
    assert_int_equal(lk_tracker_apply(t, a1, 1, NULL), LK_OK);
    tu_mpi_check_digest(W, w, g_want[S_A]);
    lk_tracker_free(t);
    lk_weights_free(w);
    lk_weights_free(base);
}

/* One byte of a device tensor changed in place (read down, edited, written up). */
static void poke(lk_weights *w, size_t i) {
    const lk_tensor *d = lk_weights_tensor(w, i);
    unsigned char b = 0;
    assert_int_equal(lk_device_copy(d->device, &b, (const unsigned char *)d->data + 5, 1, LK_COPY_D2H, NULL), LK_OK);
    b ^= 0x10;
    assert_int_equal(lk_device_copy(d->device, (unsigned char *)d->data + 5, &b, 1, LK_COPY_H2D, NULL), LK_OK);
}

/* The checks that compare hashes, on device weights (where the hash is the
 * device fingerprint, computed on the device): a byte of a key the tracker
 * wrote, changed behind it, is refused at the next call naming the key and
 * the hash's kind; at more than one rank, a rank whose base differs in one
 * byte of one tensor is refused at create, naming that tensor (the first
 * in name order) and each rank's fingerprint. */
static void test_emul_hash_checks(void **state) {
    (void)state;
    lk_weights *w = load_on((lk_device){LK_DEVICE_EMUL, 0});
    lk_tracker_opts o = LK_TRACKER_OPTS_DEFAULT;
    o.threads = 1;
    lk_tracker *t = NULL;
    assert_int_equal(lk_tracker_create(W, w, &o, &t), LK_OK);
    lk_fuse_input a1[] = {{g_a, 1.0, LK_FORMAT_AUTO}};
    assert_int_equal(lk_tracker_apply(t, a1, 1, NULL), LK_OK);
    const long q = lk_weights_find(w, "blocks.0.attn.to_q.weight");
    assert_true(q >= 0);
    poke(w, (size_t)q);
    assert_int_equal(lk_tracker_apply(t, NULL, 0, NULL), LK_ERR_STATE);
    tu_assert_contains(lk_last_error(), "blocks.0.attn.to_q.weight holds device fingerprint ");
    lk_tracker_free(t);
    lk_weights_free(w);
    if (N == 1) return;
    w = load_on((lk_device){LK_DEVICE_EMUL, 0});
    const long v = lk_weights_find(w, "blocks.0.attn.to_v.weight");
    assert_true(v >= 0);
    if (R == N - 1) poke(w, (size_t)v);
    assert_int_equal(lk_tracker_create(W, w, &o, &t), LK_ERR_MISMATCH);
    char want[160];
    snprintf(want, sizeof want, "1 of %zu tensors differ; the first in byte-wise name order is "
             "blocks.0.attn.to_v.weight: rank%s 0", lk_weights_count(w), N > 2 ? "s" : "");
    tu_assert_contains(lk_last_error(), want);
    snprintf(want, sizeof want, "rank %d holds device fingerprint ", N - 1);
    tu_assert_contains(lk_last_error(), want);
    assert_null(t);
    lk_weights_free(w);
}

/* lk_tracker_set_stream: every copy and launch of a call on this rank is
 * queued on the stream given (oracle: the emul device's record of each
 * one's stream, the handle lk_stream_wrap was given), the bytes are the
 * offline fuse's; a stream of another device is refused naming both. */
static void test_emul_on_stream(void **state) {
    (void)state;
    const lk_device emul = {LK_DEVICE_EMUL, 0};
    lk_weights *w = load_on(emul);
    lk_tracker_opts o = LK_TRACKER_OPTS_DEFAULT;
    o.bucket_bytes = (size_t)64 << 10;
    o.threads = 2;
    lk_tracker *t = NULL;
    assert_int_equal(lk_tracker_create(W, w, &o, &t), LK_OK);
    lk_stream *s = NULL, *other = NULL;
    assert_int_equal(lk_stream_wrap(emul, (void *)(uintptr_t)0x5EED0, &s), LK_OK);
    assert_int_equal(lk_stream_wrap((lk_device){LK_DEVICE_CPU, 0}, NULL, &other), LK_OK);
    assert_int_equal(lk_tracker_set_stream(t, other), LK_ERR_ARG);
    tu_assert_contains(lk_last_error(), "the stream belongs to cpu, the weights are on emul");
    assert_int_equal(lk_tracker_set_stream(t, s), LK_OK);
    lk_fuse_input ab[] = {{g_b, -0.5, LK_FORMAT_AUTO}, {g_a, 0.7, LK_FORMAT_AUTO}};
    for (int call = 0; call < 2; call++) {
        lk_device_counts c0, c1;
        lk_device_emul_counts(&c0);
        assert_int_equal(call ? lk_tracker_reset(t, NULL) : lk_tracker_apply(t, ab, 2, NULL), LK_OK);
        lk_device_emul_counts(&c1);
        assert_true(c1.on_stream > c0.on_stream);
        assert_true(c1.on_default == c0.on_default);
        assert_true(c1.last_tag == 0x5EED0);
        assert_true(call || c1.launches > c0.launches); /* the fuse kernel, on s */
        tu_mpi_check_digest(W, w, call ? g_base_digest : g_want[S_AB]);
    }
    assert_int_equal(lk_tracker_set_stream(t, NULL), LK_OK);
    lk_tracker_free(t);
    lk_stream_free(s);
    lk_stream_free(other);
    lk_weights_free(w);
}

/* Ranks whose weights live on different kinds of memory would broadcast
 * in rounds of different shapes: refused on every rank at create. */
static void test_mixed_kinds(void **state) {
    (void)state;
    if (N == 1) skip();
    lk_weights *w = load_on(R == N - 1 ? (lk_device){LK_DEVICE_EMUL, 0} : (lk_device){LK_DEVICE_CPU, 0});
    lk_tracker_opts o = LK_TRACKER_OPTS_DEFAULT;
    lk_tracker *t = NULL;
    assert_int_equal(lk_tracker_create(W, w, &o, &t), LK_ERR_MISMATCH);
    tu_assert_contains(lk_last_error(), "device kind");
    assert_null(t);
    lk_weights_free(w);
}

/* Local refusals: weights over two devices (naming both tensors), a
 * device that is not there (nothing moved), an unknown backup place. */
static void test_refusals(void **state) {
    (void)state;
    float x = 1.0f, y = 2.0f;
    lk_tensor t2[2] = {{.name = "a.weight", .dtype = LK_DTYPE_F32, .ndim = 1, .shape = {1}, .nbytes = 4, .data = &x},
                       {.name = "b.weight", .dtype = LK_DTYPE_F32, .ndim = 1, .shape = {1}, .nbytes = 4, .data = &y,
                        .device = {LK_DEVICE_EMUL, 0}}};
    lk_weights *w = NULL;
    assert_int_equal(lk_weights_wrap(t2, 2, &w), LK_ERR_ARG);
    tu_assert_contains(lk_last_error(), "a.weight is on cpu, b.weight on emul");
    assert_int_equal(lk_weights_load(g_base, &w), LK_OK);
    if (lk_device_cuda_count() == 0) {
        assert_int_equal(lk_weights_to_device(w, (lk_device){LK_DEVICE_CUDA, 0}), LK_ERR_UNSUPPORTED);
        tu_assert_contains(lk_last_error(), "no CUDA driver or device is available");
        assert_true(lk_device_equal(lk_weights_device(w), (lk_device){LK_DEVICE_CPU, 0}));
        char hex[LK_DIGEST_HEX];
        assert_int_equal(lk_weights_digest(w, hex), LK_OK);
        assert_string_equal(hex, g_base_digest);
    }
    lk_tracker_opts o = LK_TRACKER_OPTS_DEFAULT;
    o.backup = (lk_tracker_backup)7;
    lk_tracker *t = NULL;
    assert_int_equal(lk_tracker_create(W, w, &o, &t), LK_ERR_ARG);
    tu_assert_contains(lk_last_error(), "backup");
    lk_weights_free(w);
}

/* On GPUs: one per rank, over NCCL (the broadcast straight between the
 * device weights) and over MPI (through the pinned stage). */
static void test_cuda(void **state) {
    (void)state;
    uint64_t have = lk_device_cuda_count() > 0, all = have;
    assert_int_equal(lk_comm_allreduce_u64(W, &all, 1, LK_REDUCE_MIN), LK_OK);
    if (!all) {
        if (R == 0) printf("skip: the tracker on cuda: no CUDA device\n");
        skip();
    }
    const lk_device d = {LK_DEVICE_CUDA, lk_comm_nccl_local_device(lk_device_cuda_count())};
    run_sequence(W, d, (size_t)1 << 20, 0, 0);
    lk_comm *nc = NULL;
    if (lk_comm_nccl_create(W, d.index, &nc) == LK_OK) {
        run_sequence(nc, d, (size_t)1 << 20, 0, 0);
        run_sequence(nc, d, (size_t)64 << 10, 1, 0);
        lk_comm_free(nc);
    } else if (R == 0)
        printf("skip: the tracker over NCCL: %s\n", lk_last_error());
}

int main(int argc, char **argv) {
    W = tu_mpi_init(&argc, &argv);
    R = lk_comm_rank(W);
    N = lk_comm_size(W);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_emul_sequences), cmocka_unit_test(test_emul_failure),
        cmocka_unit_test(test_emul_failure_first_touch), cmocka_unit_test(test_emul_hash_checks),
        cmocka_unit_test(test_mixed_kinds),    cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_emul_on_stream), cmocka_unit_test(test_cuda),
    };
    return tu_mpi_finish(W, cmocka_run_group_tests(tests, setup, teardown));
}
