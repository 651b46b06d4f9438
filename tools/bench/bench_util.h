/* bench_util.h — timing helpers shared by the benchmarks in tools/bench/.
 * Header-only (static inline) because each benchmark is one file and they
 * are all linked into the one lorakit binary. */
#ifndef LK_TOOLS_BENCH_BENCH_UTIL_H
#define LK_TOOLS_BENCH_BENCH_UTIL_H

#include <stdlib.h>
#include <time.h>

#include "core/clock.h" /* lk_now_s: wall-clock seconds, monotonic */

/* CPU seconds of the whole process (all threads): next to wall time it shows
 * how much of a shared machine a run actually got. */
static inline double lk_bench_cpu(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static inline int lk_bench_cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Sorts v ascending and returns its median. */
static inline double lk_bench_median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, lk_bench_cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* `lorakit bench fuse --device D` (bench_fuse_dev.c): the device kernel
 * against a device-to-device copy, in one run. */
int lk_bench_fuse_device(int argc, char **argv);

#endif
