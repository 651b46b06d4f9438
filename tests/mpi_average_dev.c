/* mpi_average_dev.c — lk_lora_average_dev (the gradient average on device
 * buffers, lorakit/lora.h) on the emul device at 1-4 ranks (ctest).
 *
 * Oracles, computed here: (1) the host average lk_comm_average_f32 of the
 * same values (the bytes must be equal: same collectives, same bucket
 * boundaries, the same float division), itself tested against a double
 * mean in mpi_lora_sync.c; (2) the mean of every rank's values, which each
 * rank regenerates locally and averages in double (within 2^-20). Buffers
 * are ragged (an empty one, 1, 5, 1000 and 2049 floats) and buckets small
 * (256 floats), so buckets lie inside buffers and span them. Both moves
 * are run: the allreduce on the emul memory itself (comm_takes_device: MPI
 * reads it, emul memory being the process's) and through the pinned host
 * stage. Failures: ranks holding different layouts all get
 * LK_ERR_MISMATCH with nothing changed; a host pointer passed as emul
 * memory is LK_ERR_ARG on every rank, before any bucket moves. */
#include <math.h>
#include <string.h>

#include "mpi_testutil.h"
#include "lorakit/device.h"
#include "lorakit/lora.h"

static lk_comm *g_world;
static int R, N;
static const lk_device EMUL = {LK_DEVICE_EMUL, 0};

#define NB 6
static const size_t g_counts[NB] = {5, 0, 1000, 1, 3, 2049};

static float value_of(int r, size_t b, size_t i) {
    tu_rng g = {(uint64_t)r * 7777u + b * 1000003u + i * 31u + 1u};
    return tu_uniform(&g, -1.0f, 1.0f);
}

/* NB emul buffers holding rank r's values, and host copies of them. */
static void make(float **dev, float **host, int r) {
    for (size_t b = 0; b < NB; b++) {
        host[b] = malloc((g_counts[b] ? g_counts[b] : 1) * sizeof(float));
        for (size_t i = 0; i < g_counts[b]; i++) host[b][i] = value_of(r, b, i);
        dev[b] = NULL;
        assert_int_equal(lk_device_alloc(EMUL, g_counts[b] * sizeof(float), (void **)&dev[b]), LK_OK);
        assert_int_equal(lk_device_copy(EMUL, dev[b], host[b], g_counts[b] * sizeof(float), LK_COPY_H2D, NULL), LK_OK);
    }
}

static void drop(float **dev, float **host) {
    for (size_t b = 0; b < NB; b++) {
        lk_device_free(EMUL, dev[b]);
        free(host[b]);
    }
}

static void run(int direct) {
    float *dev[NB], *host[NB];
    make(dev, host, R);
    lk_stream *s = NULL;
    assert_int_equal(lk_stream_create(EMUL, &s), LK_OK);
    const lk_lora_average_dev_opts o = {256 * sizeof(float), s, direct};
    size_t calls_dev = 0, calls_host = 0;
    lk_device_counts c0, c1;
    lk_device_emul_counts(&c0);
    assert_int_equal(lk_lora_average_dev(g_world, EMUL, dev, g_counts, NB, &o, &calls_dev), LK_OK);
    lk_device_emul_counts(&c1);
    assert_int_equal(lk_comm_average_f32(g_world, host, g_counts, NB, 256 * sizeof(float), &calls_host), LK_OK);
    assert_int_equal(calls_dev, calls_host);
    if (N > 1) { /* the division ran on the device, once per bucket; the staged path moved every float down and up */
        assert_int_equal(c1.launches - c0.launches, calls_dev);
        assert_int_equal(c1.bytes[LK_COPY_D2H] - c0.bytes[LK_COPY_D2H], direct ? 0 : 3058 * sizeof(float));
    }
    for (size_t b = 0; b < NB; b++) {
        float *got = malloc((g_counts[b] ? g_counts[b] : 1) * sizeof(float));
        assert_int_equal(lk_device_copy(EMUL, got, dev[b], g_counts[b] * sizeof(float), LK_COPY_D2H, NULL), LK_OK);
        assert_memory_equal(got, host[b], g_counts[b] * sizeof(float));
        for (size_t i = 0; i < g_counts[b]; i++) {
            double mean = 0;
            for (int r = 0; r < N; r++) mean += value_of(r, b, i);
            mean /= N;
            assert_true(fabs((double)got[i] - mean) <= 0x1p-20);
        }
        free(got);
    }
    lk_stream_free(s);
    drop(dev, host);
}

static void test_direct(void **st) { (void)st; run(1); }
static void test_staged(void **st) { (void)st; run(0); }

static void test_layout_mismatch(void **st) {
    (void)st;
    if (N == 1) return;
    float *dev[NB], *host[NB];
    make(dev, host, R);
    size_t counts[NB];
    memcpy(counts, g_counts, sizeof counts);
    if (R == N - 1) counts[5] = 2048; /* one rank holds a different set */
    const lk_lora_average_dev_opts o = {256 * sizeof(float), NULL, 1};
    assert_int_equal(lk_lora_average_dev(g_world, EMUL, dev, counts, NB, &o, NULL), LK_ERR_MISMATCH);
    for (size_t b = 0; b < NB; b++) { /* nothing changed */
        float *got = malloc((g_counts[b] ? g_counts[b] : 1) * sizeof(float));
        lk_device_copy(EMUL, got, dev[b], g_counts[b] * sizeof(float), LK_COPY_D2H, NULL);
        assert_memory_equal(got, host[b], g_counts[b] * sizeof(float));
        free(got);
    }
    drop(dev, host);
}

static void test_host_pointer_refused_everywhere(void **st) {
    (void)st;
    if (N == 1) return;
    float *dev[NB], *host[NB];
    make(dev, host, R);
    float *bufs[NB];
    memcpy(bufs, dev, sizeof bufs);
    if (R == 0) bufs[2] = host[2]; /* host memory where emul memory belongs */
    lk_status s = lk_lora_average_dev(g_world, EMUL, bufs, g_counts, NB, NULL, NULL);
    assert_int_equal(s, LK_ERR_ARG);
    assert_non_null(strstr(lk_last_error(), "buffer 2 (1000 floats) is not emul memory"));
    drop(dev, host);
}

int main(int argc, char **argv) {
    g_world = tu_mpi_init(&argc, &argv);
    R = lk_comm_rank(g_world);
    N = lk_comm_size(g_world);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_direct),
        cmocka_unit_test(test_staged),
        cmocka_unit_test(test_layout_mismatch),
        cmocka_unit_test(test_host_pointer_refused_everywhere),
    };
    return tu_mpi_finish(g_world, cmocka_run_group_tests(tests, NULL, NULL));
}
