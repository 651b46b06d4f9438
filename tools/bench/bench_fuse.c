/* bench_fuse.c — `lorakit bench fuse`: how close the fusion kernel gets to
 * the memory system, and how it compares with the naive method.
 *
 * In one run, on a dim x dim BF16 weight (default 4096):
 *  (a) bandwidth: in-place read-modify-write of a buffer of the same size
 *      (every 64-bit word read, changed, written back), the better of 1
 *      thread and all threads — the ceiling for any in-place fuse, since
 *      fusing must read and write W;
 *  (b) lorakit: lk_fuse_tensor in place at r = 8, 16, 64, 128 with 1 thread
 *      and with all threads; GB/s counts W traffic only (read + write =
 *      2 x W bytes) and is also given as a ratio to (a);
 *  (c) naive: materialise delta = B @ A in fp32 (dim x dim floats), then
 *      W = round(W + delta) in a second pass, same threads, same data.
 * Each figure is the best of --repeat runs (first touch excluded), with the
 * process CPU time of that run (on a shared host, cpu < threads x seconds
 * means the run did not get all its cores). Figures are printed, never
 * asserted. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "bench_util.h"

static const char *const FUSE_BENCH_USAGE =
    "usage: lorakit bench fuse [--json] [--dim N] [--repeat N] [--threads N]\n\n"
    "Measures (a) in-place read-modify-write bandwidth over a buffer the size\n"
    "of a dim x dim BF16 weight, (b) lk_fuse_tensor on that weight at rank\n"
    "8, 16, 64, 128 with 1 thread and all threads (GB/s of W traffic, read +\n"
    "write, and the ratio to (a)), (c) the naive method (fp32 delta, then add).\n\n"
    "options:\n"
    "  --json        one JSON object per line on stdout\n"
    "  --dim N       weight is N x N (default 4096)\n"
    "  --repeat N    timed runs per case, best taken (default 3)\n"
    "  --threads N   the 'all threads' count (default: online CPUs)\n"
    "  -h, --help    this text\n";

/* ---- a tiny fork/join over row ranges, for (a) and (c) ---- */

typedef struct par {
    void (*fn)(void *ctx, size_t lo, size_t hi);
    void *ctx;
    size_t lo, hi;
} par;

static void *par_main(void *p) {
    par *q = p;
    q->fn(q->ctx, q->lo, q->hi);
    return NULL;
}

static void par_for(int threads, size_t n, void (*fn)(void *, size_t, size_t), void *ctx) {
    par parts[256];
    pthread_t tid[256];
    if (threads > 256) threads = 256;
    if (threads < 1) threads = 1;
    int ok[256] = {0};
    for (int t = 0; t < threads; t++)
        parts[t] = (par){fn, ctx, n * (size_t)t / (size_t)threads, n * (size_t)(t + 1) / (size_t)threads};
    for (int t = 1; t < threads; t++) ok[t] = pthread_create(&tid[t], NULL, par_main, &parts[t]) == 0;
    fn(ctx, parts[0].lo, parts[0].hi);
    for (int t = 1; t < threads; t++) { /* a thread that did not start: its share runs here */
        if (ok[t]) pthread_join(tid[t], NULL);
        else fn(ctx, parts[t].lo, parts[t].hi);
    }
}

/* (a): every word read, xor'ed, written back. */
static void rmw_range(void *ctx, size_t lo, size_t hi) {
    uint64_t *w = ctx;
    for (size_t i = lo; i < hi; i++) w[i] ^= 0x0001000100010001ull;
}

/* (c) naive: delta rows, then the add pass; built for the same ISAs as
 * the kernel so the comparison is about the method, not the instructions. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(LK_NO_CLONES)
#define BENCH_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define BENCH_CLONES
#endif
typedef struct naive_ctx {
    uint16_t *w;
    const float *A, *B; /* r x dim, dim x r */
    float *delta;       /* dim x dim */
    size_t dim, r;
} naive_ctx;

BENCH_CLONES static void naive_delta(void *p, size_t lo, size_t hi) {
    naive_ctx *c = p;
    for (size_t o = lo; o < hi; o++) {
        float *d = c->delta + o * c->dim;
        for (size_t j = 0; j < c->dim; j++) d[j] = 0.0f;
        for (size_t k = 0; k < c->r; k++) {
            float b = c->B[o * c->r + k];
            const float *a = c->A + k * c->dim;
            for (size_t j = 0; j < c->dim; j++) d[j] += b * a[j];
        }
    }
}

BENCH_CLONES static void naive_add(void *p, size_t lo, size_t hi) {
    naive_ctx *c = p;
    float tmp[1024];
    for (size_t o = lo; o < hi; o++)
        for (size_t j0 = 0; j0 < c->dim; j0 += 1024) {
            size_t n = c->dim - j0 < 1024 ? c->dim - j0 : 1024;
            uint16_t *w = c->w + o * c->dim + j0;
            const float *d = c->delta + o * c->dim + j0;
            lk_to_f32(tmp, w, LK_DTYPE_BF16, n);
            for (size_t j = 0; j < n; j++) tmp[j] += d[j];
            lk_from_f32(w, tmp, LK_DTYPE_BF16, n);
        }
}

static void emit(int json, const char *method, long rank, int threads, double secs, double cpu, double gbps,
                 double bw, double naive_s) {
    if (json) {
        printf("{\"bench\":\"fuse\",\"method\":\"%s\",\"dtype\":\"bf16\",\"rank\":%ld,\"threads\":%d,"
               "\"seconds\":%.6f,\"gbps\":%.3f,\"ratio_to_bandwidth\":%.3f,\"cpu_seconds\":%.6f",
               method, rank, threads, secs, gbps, gbps / bw, cpu);
        if (naive_s > 0) printf(",\"speedup_vs_naive\":%.2f", naive_s / secs);
        printf("}\n");
    } else {
        printf("%-8s rank %4ld  threads %3d  %9.3f ms (cpu %9.3f ms)  %8.2f GB/s  %5.2f x bandwidth", method, rank,
               threads, secs * 1e3, cpu * 1e3, gbps, gbps / bw);
        if (naive_s > 0) printf("  %5.2f x naive", naive_s / secs);
        printf("\n");
    }
}

int lk_bench_fuse(int argc, char **argv) {
    if (lk_cli_wants_help(argc, argv)) {
        fputs(FUSE_BENCH_USAGE, stdout);
        return LK_EXIT_OK;
    }
    int json = 0;
    long dim = 4096, repeat = 3, all = 0;
    for (int i = 1; i < argc; i++) {
        long *dst = NULL;
        if (!strcmp(argv[i], "--json")) { json = 1; continue; }
        if (!strcmp(argv[i], "--dim")) dst = &dim;
        else if (!strcmp(argv[i], "--repeat")) dst = &repeat;
        else if (!strcmp(argv[i], "--threads")) dst = &all;
        else return lk_cli_usage("bench fuse", "unknown option '%s'", argv[i]);
        if (i + 1 >= argc || !lk_cli_parse_int(argv[i + 1], dst) || *dst < 1 || *dst > 65536)
            return lk_cli_usage("bench fuse", "%s needs a number from 1 to 65536", argv[i]);
        i++;
    }
    if (!all) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        all = n > 0 ? n : 1;
    }
    if (all > 256) all = 256;
    const size_t D = (size_t)dim, N = D * D, wbytes = N * 2;
    const long ranks[4] = {8, 16, 64, 128};
    const size_t rmax = 128;
    uint16_t *w = malloc(wbytes), *a16 = malloc(rmax * D * 2), *b16 = malloc(D * rmax * 2);
    float *delta = malloc(N * sizeof(float)), *af = malloc(rmax * D * 4), *bf = malloc(D * rmax * 4);
    uint64_t *buf = malloc(wbytes);
    if (!w || !a16 || !b16 || !delta || !af || !bf || !buf) {
        free(w); free(a16); free(b16); free(delta); free(af); free(bf); free(buf);
        lk_error(LK_ERR_NOMEM, "bench fuse: out of memory for a %ldx%ld weight", dim, dim);
        return lk_cli_fail();
    }
    /* Deterministic data: W in [-1, 1), factors small so no overflow. */
    uint64_t s = 0x9e3779b97f4a7c15ull;
    for (size_t i = 0; i < N; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        w[i] = lk_f32_to_bf16((float)((double)(s >> 11) / 9007199254740992.0 * 2 - 1));
    }
    for (size_t i = 0; i < rmax * D; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        a16[i] = lk_f32_to_bf16((float)((double)(s >> 11) / 9007199254740992.0 * 0.02 - 0.01));
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        b16[i] = lk_f32_to_bf16((float)((double)(s >> 11) / 9007199254740992.0 * 0.02 - 0.01));
    }
    lk_to_f32(af, a16, LK_DTYPE_BF16, rmax * D);
    lk_to_f32(bf, b16, LK_DTYPE_BF16, rmax * D);
    memcpy(buf, w, wbytes);
    memset(delta, 0, N * sizeof(float));

    /* (a): with 1 thread and with all; the machine's figure is the better
     * of the two (on a shared host "all threads" can lose to one). */
    double best[2] = {1e30, 1e30};
    for (int ti = 0; ti < 2; ti++)
        for (long r = 0; r <= repeat; r++) {
            double t0 = lk_bench_now();
            par_for(ti ? (int)all : 1, wbytes / 8, rmw_range, buf);
            double t = lk_bench_now() - t0;
            if (r && t < best[ti]) best[ti] = t; /* run 0 warms up */
        }
    const double bw1 = 2.0 * (double)wbytes / best[0] / 1e9, bwn = 2.0 * (double)wbytes / best[1] / 1e9;
    const double bw = bw1 > bwn ? bw1 : bwn;
    if (json)
        printf("{\"bench\":\"bandwidth\",\"bytes\":%zu,\"threads\":%ld,\"gbps\":%.3f,\"gbps_1_thread\":%.3f,"
               "\"gbps_all_threads\":%.3f}\n",
               wbytes, all, bw, bw1, bwn);
    else
        printf("bandwidth (in-place read-modify-write, %zu MB): %.2f GB/s (1 thread %.2f, %ld threads %.2f)\n",
               wbytes >> 20, bw, bw1, all, bwn);

    const int tcount[2] = {1, (int)all};
    for (int ri = 0; ri < 4; ri++) {
        const size_t r = (size_t)ranks[ri];
        lk_tensor A = {.dtype = LK_DTYPE_BF16, .ndim = 2, .shape = {(int64_t)r, dim}, .nbytes = r * D * 2, .data = a16};
        /* B is dim x r: use the first dim*r values of b16 laid out as dim x r. */
        lk_tensor B = {.dtype = LK_DTYPE_BF16, .ndim = 2, .shape = {dim, (int64_t)r}, .nbytes = r * D * 2, .data = b16};
        lk_fuse_term term = {&A, &B, 1.0f};
        naive_ctx nc = {.w = w, .A = af, .B = bf, .delta = delta, .dim = D, .r = r};
        for (int ti = 0; ti < (all > 1 ? 2 : 1); ti++) {
            const int th = tcount[ti];
            /* naive first, so the lorakit line can report the speedup */
            double nbest = 1e30, ncpu = 0;
            for (long k = 0; k <= repeat; k++) {
                double t0 = lk_bench_now(), c0 = lk_bench_cpu();
                par_for(th, D, naive_delta, &nc);
                par_for(th, D, naive_add, &nc);
                double t = lk_bench_now() - t0;
                if (k && t < nbest) {
                    nbest = t;
                    ncpu = lk_bench_cpu() - c0;
                }
            }
            lk_fuse_opts o = {.threads = th, .allow_nonfinite = 1};
            double fbest = 1e30, fcpu = 0;
            for (long k = 0; k <= repeat; k++) {
                double t0 = lk_bench_now(), c0 = lk_bench_cpu();
                if (lk_fuse_tensor(w, w, LK_DTYPE_BF16, dim, dim, &term, 1, &o, "bench") != LK_OK) {
                    free(w); free(a16); free(b16); free(delta); free(af); free(bf); free(buf);
                    return lk_cli_fail();
                }
                double t = lk_bench_now() - t0;
                if (k && t < fbest) {
                    fbest = t;
                    fcpu = lk_bench_cpu() - c0;
                }
            }
            emit(json, "naive", (long)r, th, nbest, ncpu, 2.0 * (double)wbytes / nbest / 1e9, bw, 0);
            emit(json, "lorakit", (long)r, th, fbest, fcpu, 2.0 * (double)wbytes / fbest / 1e9, bw, nbest);
        }
    }
    free(w); free(a16); free(b16); free(delta); free(af); free(bf); free(buf);
    return LK_EXIT_OK;
}
