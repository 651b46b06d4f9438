/* bench_fuse_dev.c — `lorakit bench fuse --device cuda[:N]|emul`: the device
 * fuse kernel against the device's own memory roofline, in one run.
 *
 * A model of n dim x dim BF16 weights (--model-mb in all) is allocated in
 * device memory, with a second buffer of the same size for the roofline:
 *   d2d_copy:    one device-to-device copy of the whole model (read + write);
 *   fuse_kernel: lk_fuse_tensor_dev on every weight in turn, r = 16, in
 *                place (as the tracker does, one call per key): GB/s of W
 *                traffic (2 x W bytes) over the kernel's own time and end to
 *                end (the factors' preparation and upload, the launch, the
 *                non-finite verdict included); ratio_to_copy over d2d_copy.
 * Best of --repeat runs after a warm-up; printed, never asserted. The torch
 * rows of issue 27 (W.add_(s * (B @ A)) and the FP32 rule) come from
 * python/bench/fuse_torch.py, run by tools/device/check.sh. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli_util.h"
#include "lorakit/lorakit.h"
#include "bench_util.h"

typedef struct dev_model {
    lk_device dev;
    void *w, *copy;
    size_t dim, n, bytes;
} dev_model;

static int dev_fail(const char *what) {
    fprintf(stderr, "lorakit: bench fuse: %s: %s\n", what, lk_last_error());
    return LK_EXIT_FAIL;
}

/* The best d2d copy of the model's bytes, in seconds. */
static int copy_best(const dev_model *m, long repeat, double *best) {
    *best = 1e300;
    for (long r = 0; r <= repeat; r++) {
        const double t0 = lk_now_s();
        if (lk_device_copy(m->dev, m->copy, m->w, m->bytes, LK_COPY_D2D, NULL) || lk_device_sync(m->dev))
            return dev_fail("device copy");
        const double t = lk_now_s() - t0;
        if (r && t < *best) *best = t; /* run 0 warms up */
    }
    return 0;
}

/* The best pass of lk_fuse_tensor_dev over every weight: end to end and the kernel alone. */
static int fuse_best(const dev_model *m, const lk_fuse_term *term, long repeat, double *best, double *best_k) {
    *best = *best_k = 1e300;
    const size_t N = m->dim * m->dim;
    for (long r = 0; r <= repeat; r++) {
        lk_fuse_dev_stats st = {0};
        const double t0 = lk_now_s();
        for (size_t t = 0; t < m->n; t++) {
            lk_tensor w = {.name = "bench", .dtype = LK_DTYPE_BF16, .ndim = 2, .shape = {(int64_t)m->dim, (int64_t)m->dim},
                           .nbytes = N * 2, .data = (char *)m->w + t * N * 2, .device = m->dev};
            if (lk_fuse_tensor_dev(&w, term, 1, &(lk_fuse_opts){.allow_nonfinite = 1}, NULL, &st))
                return dev_fail("fuse on the device");
        }
        const double t = lk_now_s() - t0;
        if (r && t < *best) *best = t;
        if (r && st.seconds_kernel < *best_k) *best_k = st.seconds_kernel;
    }
    return 0;
}

static int parse(int argc, char **argv, lk_device *dev, int *json, long *dim, long *model_mb, long *repeat) {
    for (int i = 1; i < argc; i++) {
        long *dst = NULL;
        int d;
        if (!strcmp(argv[i], "--json")) { *json = 1; continue; }
        if ((d = lk_cli_device_option("bench fuse", argc, argv, &i, dev)) != 0) {
            if (d < 0) return LK_EXIT_USAGE;
            continue;
        }
        if (!strcmp(argv[i], "--dim")) dst = dim;
        else if (!strcmp(argv[i], "--model-mb")) dst = model_mb;
        else if (!strcmp(argv[i], "--repeat")) dst = repeat;
        else return lk_cli_usage("bench fuse", "unknown option '%s' (with --device)", argv[i]);
        if (i + 1 >= argc || !lk_cli_parse_int(argv[i + 1], dst) || *dst < 1 || *dst > 1 << 20)
            return lk_cli_usage("bench fuse", "%s needs a number from 1 to 1048576", argv[i]);
        i++;
    }
    return 0;
}

int lk_bench_fuse_device(int argc, char **argv) {
    lk_device dev = {LK_DEVICE_CPU, 0};
    int json = 0;
    long dim = 4096, model_mb = 0, repeat = 3;
    int rc = parse(argc, argv, &dev, &json, &dim, &model_mb, &repeat);
    if (rc) return rc;
    if (lk_device_check(dev)) return lk_cli_fail();
    if (dev.kind == LK_DEVICE_EMUL && dim == 4096) dim = 1024;
    if (!model_mb) model_mb = dev.kind == LK_DEVICE_CUDA ? 8192 : 16;
    dev_model m = {.dev = dev, .dim = (size_t)dim};
    const size_t N = m.dim * m.dim;
    m.n = ((size_t)model_mb << 20) / (N * 2);
    if (!m.n) m.n = 1;
    m.bytes = m.n * N * 2;
    enum { R = 16 };
    uint16_t *a = malloc((size_t)R * m.dim * 2), *b = malloc(m.dim * R * 2), *host = malloc(N * 2);
    if (!a || !b || !host || lk_device_alloc(dev, m.bytes, &m.w) || lk_device_alloc(dev, m.bytes, &m.copy)) {
        rc = dev_fail("memory for the model");
        goto done;
    }
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (size_t i = 0; i < N; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        host[i] = (uint16_t)(0x3c00u | (x & 0x3ffu) | ((x >> 20) & 0x8000u)); /* BF16 values in [-2, -0.5] U [0.5, 2] */
        if (i < (size_t)R * m.dim) a[i] = (uint16_t)(0x3d00u | (x >> 30 & 0x7fu));
        if (i < m.dim * R) b[i] = (uint16_t)(0x3c00u | (x >> 40 & 0x7fu));
    }
    for (size_t t = 0; t < m.n && !rc; t++)
        if (lk_device_copy(dev, (char *)m.w + t * N * 2, host, N * 2, LK_COPY_H2D, NULL)) rc = dev_fail("upload");
    const lk_tensor At = {.name = "A", .dtype = LK_DTYPE_BF16, .ndim = 2, .shape = {R, dim}, .nbytes = (size_t)R * m.dim * 2, .data = a};
    const lk_tensor Bt = {.name = "B", .dtype = LK_DTYPE_BF16, .ndim = 2, .shape = {dim, R}, .nbytes = m.dim * R * 2, .data = b};
    const lk_fuse_term term = {.A = &At, .B = &Bt, .scale = 1e-3};
    double tc = 0, tf = 0, tk = 0;
    if (!rc) rc = copy_best(&m, repeat, &tc);
    if (!rc) rc = fuse_best(&m, &term, repeat, &tf, &tk);
    if (!rc) {
        char dn[LK_DEVICE_STR_MAX];
        const double gb = 2.0 * (double)m.bytes / 1e9;
        printf(json ? "{\"bench\": \"fuse\", \"device\": \"%s\", \"row\": \"d2d_copy\", \"bytes\": %zu, \"seconds\": %.6f, "
                      "\"gbps\": %.2f}\n"
                    : "fuse %s d2d_copy: %zu bytes in %.6f s = %.2f GB/s\n",
               lk_device_str(dev, dn), m.bytes, tc, gb / tc);
        printf(json ? "{\"bench\": \"fuse\", \"device\": \"%s\", \"row\": \"fuse_kernel\", \"dtype\": \"BF16\", \"rank\": %d, "
                      "\"dim\": %zu, \"tensors\": %zu, \"bytes\": %zu, \"seconds_kernel\": %.6f, \"seconds\": %.6f, "
                      "\"gbps_kernel\": %.2f, \"gbps\": %.2f, \"ratio_to_copy_kernel\": %.3f, \"ratio_to_copy\": %.3f}\n"
                    : "fuse %s fuse_kernel BF16 r=%d dim %zu x %zu tensors, %zu bytes: kernel %.6f s, end to end %.6f s: "
                      "%.2f / %.2f GB/s, ratio to copy %.3f / %.3f\n",
               dn, R, m.dim, m.n, m.bytes, tk, tf, gb / tk, gb / tf, tc / tk, tc / tf);
    }
done:
    lk_device_free(dev, m.w);
    lk_device_free(dev, m.copy);
    free(a);
    free(b);
    free(host);
    return rc;
}
