/* test_device.c — the device layer (lorakit/device.h): names, the emul
 * device's memory rules, copies, events, the launch grid, the plain
 * message for cuda without a driver, and allocation failures.
 *
 * Expectations are hand-written: the names and messages the header
 * promises, the bytes a copy must move, and for the launch grid the index
 * formula CUDA defines (blockIdx * blockDim + threadIdx per axis); for
 * the device fingerprint a plain restatement of its definition
 * (lorakit/device.h: splitmix64's finaliser over the words, summed mod
 * 2^64, mixed with the length), one word after another on the host. */
#include "testutil.h"
#include "lorakit/device.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static void test_parse(void **state) {
    (void)state;
    lk_device d;
    char buf[LK_DEVICE_STR_MAX];
    assert_int_equal(lk_device_parse("cpu", &d), LK_OK);
    assert_int_equal(d.kind, LK_DEVICE_CPU);
    assert_int_equal(lk_device_parse("emul", &d), LK_OK);
    assert_int_equal(d.kind, LK_DEVICE_EMUL);
    assert_string_equal(lk_device_str(d, buf), "emul");
    assert_int_equal(lk_device_parse("cuda", &d), LK_OK);
    assert_int_equal(d.kind, LK_DEVICE_CUDA);
    assert_int_equal(d.index, 0);
    assert_string_equal(lk_device_str(d, buf), "cuda:0");
    assert_int_equal(lk_device_parse("cuda:7", &d), LK_OK);
    assert_int_equal(d.index, 7);
    assert_string_equal(lk_device_str(d, buf), "cuda:7");
    assert_int_equal(lk_device_parse("cuda:1023", &d), LK_OK);
    assert_int_equal(d.index, 1023);
    static const char *const bad[] = {"", "gpu", "cuda:", "cuda:-1", "cuda:1024", "cuda:01", "cuda:1x",
                                      "cuda:99999999999999999999", "CPU", "emul:0", " cpu"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(lk_device_parse(bad[i], &d), LK_ERR_ARG);
        assert_non_null(strstr(lk_last_error(), "expected cpu, cuda, cuda:N"));
    }
    assert_true(lk_device_equal((lk_device){LK_DEVICE_CUDA, 1}, (lk_device){LK_DEVICE_CUDA, 1}));
    assert_false(lk_device_equal((lk_device){LK_DEVICE_CUDA, 1}, (lk_device){LK_DEVICE_CUDA, 0}));
    assert_false(lk_device_equal((lk_device){LK_DEVICE_EMUL, 0}, (lk_device){LK_DEVICE_CPU, 0}));
}

/* Without a GPU (CI, this machine kind) cuda must fail with the plain
 * message; with one it must pass. Either way the message contract holds. */
static void test_cuda_check(void **state) {
    (void)state;
    const lk_device d = {LK_DEVICE_CUDA, 0};
    const int n = lk_device_cuda_count();
    if (n > 0) {
        assert_int_equal(lk_device_check(d), LK_OK);
        assert_int_equal(lk_device_check((lk_device){LK_DEVICE_CUDA, n}), LK_ERR_UNSUPPORTED);
        assert_non_null(strstr(lk_last_error(), "no CUDA driver or device is available"));
        return;
    }
    assert_int_equal(lk_device_check(d), LK_ERR_UNSUPPORTED);
    assert_non_null(strstr(lk_last_error(), "cuda:0: no CUDA driver or device is available ("));
    void *p = (void *)1;
    assert_int_equal(lk_device_alloc(d, 64, &p), LK_ERR_UNSUPPORTED);
    assert_null(p);
    assert_non_null(strstr(lk_last_error(), "no CUDA driver or device is available"));
    assert_int_equal(lk_device_check((lk_device){LK_DEVICE_CPU, 0}), LK_OK);
    assert_int_equal(lk_device_check((lk_device){LK_DEVICE_EMUL, 0}), LK_OK);
}

/* emul memory: aligned, separate, every copy explicit and checked. */
static void test_emul_copies(void **state) {
    (void)state;
    const lk_device d = {LK_DEVICE_EMUL, 0};
    unsigned char host[1000], back[1000];
    for (int i = 0; i < 1000; i++) host[i] = (unsigned char)(i * 7 + 3);
    void *a, *b;
    assert_int_equal(lk_device_alloc(d, 1000, &a), LK_OK);
    assert_int_equal(lk_device_alloc(d, 1000, &b), LK_OK);
    assert_int_equal((uintptr_t)a % 256, 0);
    assert_true(lk_device_owns(d, a, 1000));
    assert_false(lk_device_owns(d, a, 1001));
    assert_false(lk_device_owns(d, host, 1));
    assert_int_equal(lk_device_copy(d, a, host, 1000, LK_COPY_H2D, NULL), LK_OK);
    assert_int_equal(lk_device_copy(d, b, a, 1000, LK_COPY_D2D, NULL), LK_OK);
    memset(back, 0, sizeof back);
    assert_int_equal(lk_device_copy(d, back, b, 1000, LK_COPY_D2H, NULL), LK_OK);
    assert_memory_equal(back, host, 1000);
    /* a host pointer where the device side belongs, a range past the end, an overlap */
    assert_int_equal(lk_device_copy(d, back, host, 10, LK_COPY_H2D, NULL), LK_ERR_ARG);
    assert_non_null(strstr(lk_last_error(), "not inside an emul allocation"));
    assert_int_equal(lk_device_copy(d, back, host, 10, LK_COPY_D2H, NULL), LK_ERR_ARG);
    assert_int_equal(lk_device_copy(d, (char *)a + 500, host, 501, LK_COPY_H2D, NULL), LK_ERR_ARG);
    assert_int_equal(lk_device_copy(d, (char *)a + 10, a, 100, LK_COPY_D2D, NULL), LK_ERR_ARG);
    assert_non_null(strstr(lk_last_error(), "overlap"));
    assert_int_equal(lk_device_memset(d, a, 0xab, 1000, NULL), LK_OK);
    assert_int_equal(lk_device_copy(d, back, a, 1000, LK_COPY_D2H, NULL), LK_OK);
    for (int i = 0; i < 1000; i++) assert_int_equal(back[i], 0xab);
    assert_int_equal(lk_device_memset(d, host, 0, 4, NULL), LK_ERR_ARG);
    lk_device_free(d, a);
    assert_false(lk_device_owns(d, a, 1)); /* freed: no longer device memory */
    lk_device_free(d, b);
    lk_device_free(d, NULL);
}

static void test_tensor_copy(void **state) {
    (void)state;
    const lk_device d = {LK_DEVICE_EMUL, 0};
    float v[6] = {1, 2, 3, 4, 5, 6}, w[6] = {0};
    void *dv;
    assert_int_equal(lk_device_alloc(d, sizeof v, &dv), LK_OK);
    lk_tensor h = {.name = "t", .dtype = LK_DTYPE_F32, .ndim = 2, .shape = {2, 3}, .nbytes = sizeof v, .data = v};
    lk_tensor g = h;
    g.data = dv;
    g.device = d;
    lk_tensor o = h;
    o.data = w;
    assert_int_equal(lk_tensor_copy(&g, &h, NULL), LK_OK);
    assert_int_equal(lk_tensor_copy(&o, &g, NULL), LK_OK);
    assert_memory_equal(w, v, sizeof v);
    o.shape[1] = 2;
    assert_int_equal(lk_tensor_copy(&o, &g, NULL), LK_ERR_SHAPE);
    assert_non_null(strstr(lk_last_error(), "t: copy from F32 [2, 3] into F32 [2, 2]"));
    lk_device_free(d, dv);
}

static void test_streams_events(void **state) {
    (void)state;
    const lk_device d = {LK_DEVICE_EMUL, 0};
    lk_stream *s;
    lk_event *e0, *e1;
    assert_int_equal(lk_stream_create(d, &s), LK_OK);
    assert_int_equal(lk_event_create(d, &e0), LK_OK);
    assert_int_equal(lk_event_create(d, &e1), LK_OK);
    assert_int_equal(lk_event_sync(e0), LK_ERR_STATE); /* never recorded */
    assert_int_equal(lk_event_record(e0, s), LK_OK);
    assert_int_equal(lk_stream_wait_event(s, e0), LK_OK);
    assert_int_equal(lk_event_record(e1, s), LK_OK);
    assert_int_equal(lk_event_sync(e1), LK_OK);
    double sec = -1;
    assert_int_equal(lk_event_elapsed(e0, e1, &sec), LK_OK);
    assert_true(sec >= 0 && sec < 10);
    assert_int_equal(lk_stream_sync(d, s), LK_OK);
    /* a stream used with another device is refused, naming both */
    assert_int_equal(lk_stream_sync((lk_device){LK_DEVICE_CPU, 0}, s), LK_ERR_ARG);
    assert_non_null(strstr(lk_last_error(), "on cpu: the stream belongs to emul"));
    lk_event_free(e0);
    lk_event_free(e1);
    lk_stream_free(s);
}

/* A kernel with only an emul body: every thread of the grid writes its
 * global index once (CUDA's formula), so the launch visits each exactly
 * once, with the right coordinates. */
typedef struct grid_args {
    uint32_t *hits;
    uint32_t nx, ny;
} grid_args;

static void grid_body(const void *pa, const lk_thread_idx *t) {
    const grid_args *a = pa;
    const uint32_t x = t->block_idx.x * t->block_dim.x + t->thread_idx.x;
    const uint32_t y = t->block_idx.y * t->block_dim.y + t->thread_idx.y;
    if (x < a->nx && y < a->ny) a->hits[y * a->nx + x] += 1 + x + 1000 * y;
}

static void test_launch_grid(void **state) {
    (void)state;
    const lk_device d = {LK_DEVICE_EMUL, 0};
    const lk_kernel k = {"grid", NULL, grid_body};
    enum { NX = 37, NY = 5 };
    uint32_t *hits;
    assert_int_equal(lk_device_alloc(d, NX * NY * 4, (void **)&hits), LK_OK);
    assert_int_equal(lk_device_memset(d, hits, 0, NX * NY * 4, NULL), LK_OK);
    grid_args a = {hits, NX, NY};
    assert_int_equal(lk_device_launch(d, &k, (lk_dim3){3, 3, 1}, (lk_dim3){16, 2, 1}, &a, sizeof a, NULL), LK_OK);
    uint32_t back[NX * NY];
    assert_int_equal(lk_device_copy(d, back, hits, sizeof back, LK_COPY_D2H, NULL), LK_OK);
    for (uint32_t y = 0; y < NY; y++)
        for (uint32_t x = 0; x < NX; x++) assert_int_equal(back[y * NX + x], 1 + x + 1000 * y);
    /* CUDA's limits and the cpu device */
    assert_int_equal(lk_device_launch(d, &k, (lk_dim3){1, 1, 1}, (lk_dim3){1025, 1, 1}, &a, sizeof a, NULL), LK_ERR_ARG);
    assert_int_equal(lk_device_launch(d, &k, (lk_dim3){0, 1, 1}, (lk_dim3){1, 1, 1}, &a, sizeof a, NULL), LK_ERR_ARG);
    assert_int_equal(lk_device_launch((lk_device){LK_DEVICE_CPU, 0}, &k, (lk_dim3){1, 1, 1}, (lk_dim3){1, 1, 1}, &a,
                                      sizeof a, NULL),
                     LK_ERR_ARG);
    lk_device_free(d, hits);
}

/* Every allocation of the emul device and of its streams and events fails
 * cleanly: LK_ERR_NOMEM, nothing handed out, nothing leaked (ASan). */
static void test_alloc_fail(void **state) {
    (void)state;
    const lk_device d = {LK_DEVICE_EMUL, 0};
    for (unsigned long k = 1; k <= 2; k++) {
        void *p = (void *)1;
        lk_alloc_fail_at(k);
        lk_status st = lk_device_alloc(d, 100, &p);
        lk_alloc_fail_at(0);
        assert_int_equal(st, LK_ERR_NOMEM); /* the block, then the table's first growth */
        assert_null(p);
    }
    lk_stream *s = (lk_stream *)1;
    lk_alloc_fail_at(1);
    assert_int_equal(lk_stream_create(d, &s), LK_ERR_NOMEM);
    lk_alloc_fail_at(0);
    assert_null(s);
    lk_event *e = (lk_event *)1;
    lk_alloc_fail_at(1);
    assert_int_equal(lk_event_create(d, &e), LK_ERR_NOMEM);
    lk_alloc_fail_at(0);
    assert_null(e);
    void *h = (void *)1;
    lk_alloc_fail_at(1);
    assert_int_equal(lk_device_host_alloc(d, 64, &h), LK_ERR_NOMEM);
    lk_alloc_fail_at(0);
    assert_null(h);
}

/* The allocation registry's counts (lk_device_mem_stats): by hand, bytes
 * in use are the sum of live blocks and the peak their running maximum. */
static void test_mem_stats(void **state) {
    (void)state;
    const lk_device d = {LK_DEVICE_EMUL, 0}, cpu = {LK_DEVICE_CPU, 0};
    uint64_t u0, p0, u, p;
    lk_device_mem_stats(d, &u0, &p0);
    void *a, *b;
    assert_int_equal(lk_device_alloc(d, 1000, &a), LK_OK);
    assert_int_equal(lk_device_alloc(d, 24, &b), LK_OK);
    lk_device_mem_stats(d, &u, &p);
    assert_true(u == u0 + 1024 && p >= u);
    lk_device_free(d, a);
    lk_device_mem_stats(d, &u, &p);
    assert_true(u == u0 + 24 && p >= u0 + 1024);
    lk_device_mem_peak_reset(d);
    lk_device_mem_stats(d, NULL, &p);
    assert_true(p == u0 + 24);
    lk_device_free(d, b);
    lk_device_free(d, (void *)&u); /* not a block of emul's: ignored, counts unchanged */
    lk_device_mem_stats(d, &u, &p);
    assert_true(u == u0 && p == u0 + 24);
    lk_device_mem_stats(cpu, &u, &p); /* the cpu is not counted */
    assert_true(u == 0 && p == 0);
}

/* The fingerprint's definition restated, sequentially: the oracle. */
static uint64_t ref_mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static uint64_t ref_fingerprint(const unsigned char *p, size_t n) {
    uint64_t S = 0;
    for (size_t i = 0; 8 * i < n; i++) {
        uint64_t w = 0;
        for (size_t b = 0; b < 8 && 8 * i + b < n; b++) w |= (uint64_t)p[8 * i + b] << (8 * b);
        S += ref_mix(w ^ ref_mix((uint64_t)i ^ 0x6c6f72616b697466ull));
    }
    return ref_mix(S ^ ref_mix((uint64_t)n ^ 0x9e3779b97f4a7c15ull));
}

/* On emul (the kernels' own bodies) and cpu: the definition's value for
 * lengths around the word and block sizes, at every alignment; the same
 * for every first-pass grid (1 .. 512 blocks); a refused scratch. */
static void test_fingerprint_value(void **state) {
    (void)state;
    const lk_device emul = {LK_DEVICE_EMUL, 0}, cpu = {LK_DEVICE_CPU, 0};
    enum { CAP = 70000 };
    unsigned char *h = malloc(CAP + 8), *d = NULL;
    assert_non_null(h);
    for (size_t i = 0; i < CAP + 8; i++) h[i] = (unsigned char)(i * 2654435761u >> 13);
    assert_int_equal(lk_device_alloc(emul, CAP + 8, (void **)&d), LK_OK);
    assert_int_equal(lk_device_copy(emul, d, h, CAP + 8, LK_COPY_H2D, NULL), LK_OK);
    static const size_t lens[] = {0, 1, 7, 8, 9, 15, 16, 17, 2047, 2048, 2049, 16383, 16385, 65537, CAP};
    for (size_t k = 0; k < sizeof lens / sizeof lens[0]; k++)
        for (size_t off = 0; off < 8; off++) {
            const uint64_t want = ref_fingerprint(h + off, lens[k]);
            uint64_t got = 0, on_cpu = 0;
            assert_int_equal(lk_device_fingerprint(emul, d + off, lens[k], NULL, NULL, &got), LK_OK);
            assert_int_equal(lk_device_fingerprint(cpu, h + off, lens[k], NULL, NULL, &on_cpu), LK_OK);
            if (got != want || on_cpu != want)
                fail_msg("%zu bytes at +%zu: emul %016llx, cpu %016llx, the definition %016llx", lens[k], off,
                         (unsigned long long)got, (unsigned long long)on_cpu, (unsigned long long)want);
        }
    /* the grid: any split of the words gives the one sum */
    const uint64_t want = ref_fingerprint(h + 3, CAP);
    static const unsigned grids[] = {1, 2, 3, 7, 33, 64, 100, 512};
    void *scratch = NULL;
    assert_int_equal(lk_device_alloc(emul, 512 * 256 * 8, &scratch), LK_OK);
    for (size_t g = 0; g < sizeof grids / sizeof grids[0]; g++) {
        uint64_t got = 0;
        assert_int_equal(lk_device_fingerprint_grid(emul, d + 3, CAP, grids[g], scratch, NULL, &got), LK_OK);
        if (got != want) fail_msg("grid %u: %016llx, want %016llx", grids[g], (unsigned long long)got,
                                  (unsigned long long)want);
    }
    uint64_t x;
    unsigned long long host_scratch[256];
    assert_int_equal(lk_device_fingerprint(emul, d, 100, host_scratch, NULL, &x), LK_ERR_ARG);
    assert_non_null(strstr(lk_last_error(), "scratch"));
    assert_int_equal(lk_device_fingerprint(emul, h, 100, NULL, NULL, &x), LK_ERR_ARG); /* host bytes on emul */
    assert_non_null(strstr(lk_last_error(), "not inside an emul allocation"));
    assert_int_equal(lk_device_fingerprint_grid(emul, d, 100, 0, NULL, NULL, &x), LK_ERR_ARG);
    lk_device_free(emul, scratch);
    lk_device_free(emul, d);
    free(h);
}

/* Sensitivity on emul: every single bit flip of a buffer of odd length
 * changes the fingerprint (always: a change within one word), and so does
 * swapping two unequal words, or the length with zero bytes appended. */
static void test_fingerprint_sensitive(void **state) {
    (void)state;
    const lk_device emul = {LK_DEVICE_EMUL, 0};
    enum { N = 1001 };
    unsigned char h[N + 8];
    for (size_t i = 0; i < sizeof h; i++) h[i] = (unsigned char)(i * 40503u >> 5);
    memset(h + N, 0, 8);
    unsigned char *d = NULL;
    void *scratch = NULL;
    assert_int_equal(lk_device_alloc(emul, N + 8, (void **)&d), LK_OK);
    assert_int_equal(lk_device_alloc(emul, lk_device_fingerprint_scratch(N + 8), &scratch), LK_OK);
    assert_int_equal(lk_device_copy(emul, d, h, N + 8, LK_COPY_H2D, NULL), LK_OK);
    uint64_t base = 0, f = 0;
    assert_int_equal(lk_device_fingerprint(emul, d, N, scratch, NULL, &base), LK_OK);
    for (size_t bit = 0; bit < 8 * N; bit++) {
        unsigned char b = h[bit / 8] ^ (unsigned char)(1u << (bit % 8));
        assert_int_equal(lk_device_copy(emul, d + bit / 8, &b, 1, LK_COPY_H2D, NULL), LK_OK);
        assert_int_equal(lk_device_fingerprint(emul, d, N, scratch, NULL, &f), LK_OK);
        if (f == base) fail_msg("flipping bit %zu of %d bytes left the fingerprint %016llx", bit, N,
                                (unsigned long long)base);
        assert_int_equal(lk_device_copy(emul, d + bit / 8, &h[bit / 8], 1, LK_COPY_H2D, NULL), LK_OK);
    }
    unsigned char sw[N];
    memcpy(sw, h, N);
    for (int k = 0; k < 8; k++) { /* words 3 and 17 swapped (they differ) */
        sw[24 + k] = h[136 + k];
        sw[136 + k] = h[24 + k];
    }
    assert_true(memcmp(sw, h, N) != 0);
    assert_int_equal(lk_device_copy(emul, d, sw, N, LK_COPY_H2D, NULL), LK_OK);
    assert_int_equal(lk_device_fingerprint(emul, d, N, scratch, NULL, &f), LK_OK);
    assert_true(f != base);
    assert_int_equal(lk_device_copy(emul, d, h, N, LK_COPY_H2D, NULL), LK_OK);
    assert_int_equal(lk_device_fingerprint(emul, d, N + 3, scratch, NULL, &f), LK_OK); /* + 3 zero bytes */
    assert_true(f != base);
    lk_device_free(emul, scratch);
    lk_device_free(emul, d);
}

/* lk_device_counts_of: emul's are lk_device_emul_counts', a copy adds its
 * bytes to its kind; the cpu and cuda:16 count nothing. */
static void test_counts_of(void **state) {
    (void)state;
    const lk_device emul = {LK_DEVICE_EMUL, 0};
    lk_device_counts a, b, z;
    unsigned char h[100] = {1}, *d = NULL;
    assert_int_equal(lk_device_alloc(emul, sizeof h, (void **)&d), LK_OK);
    lk_device_counts_of(emul, &a);
    assert_int_equal(lk_device_copy(emul, d, h, 100, LK_COPY_H2D, NULL), LK_OK);
    assert_int_equal(lk_device_copy(emul, h, d, 60, LK_COPY_D2H, NULL), LK_OK);
    lk_device_counts_of(emul, &b);
    assert_true(b.bytes[LK_COPY_H2D] - a.bytes[LK_COPY_H2D] == 100 && b.bytes[LK_COPY_D2H] - a.bytes[LK_COPY_D2H] == 60);
    assert_true(b.copies[LK_COPY_H2D] - a.copies[LK_COPY_H2D] == 1 && b.bytes[LK_COPY_D2D] == a.bytes[LK_COPY_D2D]);
    lk_device_emul_counts(&a);
    assert_true(a.bytes[LK_COPY_H2D] == b.bytes[LK_COPY_H2D]);
    lk_device_counts_of((lk_device){LK_DEVICE_CPU, 0}, &z);
    assert_true(z.bytes[LK_COPY_H2D] == 0 && z.copies[LK_COPY_D2H] == 0);
    lk_device_counts_of((lk_device){LK_DEVICE_CUDA, 16}, &z);
    assert_true(z.bytes[LK_COPY_H2D] == 0 && z.launches == 0);
    lk_device_free(emul, d);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse),          cmocka_unit_test(test_cuda_check),
        cmocka_unit_test(test_emul_copies),    cmocka_unit_test(test_tensor_copy),
        cmocka_unit_test(test_streams_events), cmocka_unit_test(test_launch_grid),
        cmocka_unit_test(test_alloc_fail),     cmocka_unit_test(test_mem_stats),
        cmocka_unit_test(test_fingerprint_value), cmocka_unit_test(test_fingerprint_sensitive),
        cmocka_unit_test(test_counts_of),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
