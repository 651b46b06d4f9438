/* test_device.c — the device layer (lorakit/device.h): names, the emul
 * device's memory rules, copies, events, the launch grid, the plain
 * message for cuda without a driver, and allocation failures.
 *
 * Expectations are hand-written: the names and messages the header
 * promises, the bytes a copy must move, and for the launch grid the index
 * formula CUDA defines (blockIdx * blockDim + threadIdx per axis). */
#include "testutil.h"
#include "lorakit/device.h"

#include <stdint.h>
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

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse),          cmocka_unit_test(test_cuda_check),
        cmocka_unit_test(test_emul_copies),    cmocka_unit_test(test_tensor_copy),
        cmocka_unit_test(test_streams_events), cmocka_unit_test(test_launch_grid),
        cmocka_unit_test(test_alloc_fail),     cmocka_unit_test(test_mem_stats),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
