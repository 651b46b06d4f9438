/* bench_fuse.c — `lorakit bench fuse`: how close the fusion kernel gets to
 * the memory system, and how it compares with the naive method.
 *
 * In one run:
 *  (a) bandwidth, two figures, each with 1 thread and with all threads:
 *      "cache": in-place read-modify-write of one dim x dim BF16 weight
 *      (32 MiB at the default dim, which may sit in a large L3), and
 *      "dram": the same pass over a buffer at least twice the last-level
 *      cache (its size read from sysfs; default at least 1 GiB), which is
 *      the honest ceiling for fusing a whole model;
 *  (b) lorakit, model scope: lk_fuse_tensor in place on every dim x dim
 *      tensor of that DRAM-sized buffer in turn (as the tracker and the
 *      offline fuse do: one call per weight), at r = 8, 16, 64, 128 with 1
 *      thread and with all; GB/s counts W traffic (read + write = 2 x W
 *      bytes); ratio_to_dram divides by (a)'s DRAM figure at the same
 *      thread count;
 *  (c) lorakit, tensor scope, and (d) naive (materialise delta = B @ A in
 *      fp32, then W = round(W + delta) in a second pass) on one tensor;
 *  (e) FP8 (lk_fuse_fp8) on one dim x dim F8_E4M3 weight at rank 16, plain
 *      and scaled (F32 [] scale, rescaled: two passes), nearest and
 *      stochastic, with GB/s and ratio_to_dram as for BF16;
 *  (f) the FMA peak (below), and on every BF16 row fma_fraction, the share
 *      of it the row used, and fma_fraction_at_dram, the share a run at the
 *      DRAM pass's speed would need.
 * Each figure is the best of --repeat runs (first run excluded), with the
 * process CPU time of that run (on a shared host, cpu < threads x seconds
 * means the run did not get all its cores). Figures are printed, never
 * asserted. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli_util.h"
#include "lorakit/lorakit.h"
#include "bench_util.h"

static const char *const FUSE_BENCH_USAGE =
    "usage: lorakit bench fuse [--json] [--dim N] [--dram-mb N] [--repeat N] [--threads N]\n"
    "       lorakit bench fuse --device cuda[:N]|emul [--json] [--dim N] [--model-mb N] [--repeat N]\n\n"
    "With --device (not cpu): the device kernel on a model of dim x dim BF16\n"
    "weights in device memory (--model-mb, default 8192 on cuda, 16 on emul),\n"
    "r = 16, in place, against a device-to-device copy of the same bytes in the\n"
    "same run (the HBM roofline): GB/s of W traffic (read + write), kernel time\n"
    "alone and end to end (factor upload and launch included).\n\n"
    "Measures (a) in-place read-modify-write bandwidth over one dim x dim BF16\n"
    "weight (cache) and over a buffer of at least twice the last-level cache\n"
    "(dram), (b) lk_fuse_tensor on every dim x dim tensor of that buffer (a\n"
    "whole model's worth), (c) on one tensor, (d) the naive method (fp32\n"
    "delta, then add), at rank 8, 16, 64, 128 with 1 thread and all threads,\n"
    "(e) FP8 e4m3fn weights at rank 16: plain / scaled x nearest / stochastic,\n"
    "(f) the FMA peak: a register-only FMA loop's single-precision lanes/s,\n"
    "(g) rank 16 through the per-key plan: linear LoRA, conv LoRA (a [dim,\n"
    "dim/16, 4, 4] weight), LoHa, LoKr (lokr_w1 8 x 8), a dense diff, OFT\n"
    "(16 x 16 blocks) and BOFT (4 stages of 4 x 4 blocks), with\n"
    "ratio_to_lora (GB/s over the LoRA row's at the same threads; then LoRA,\n"
    "OFT and BOFT again on an F32 weight of the same values, against the F32\n"
    "LoRA row), and (h) a\n"
    "dense diff on every weight of the DRAM buffer (model scope).\n"
    "(g) and (h) also give the median of the --repeat runs ((g): of the\n"
    "process CPU time too, with ratio_to_lora_cpu_median), and for dense\n"
    "ratio_to_dram_bytes: every byte moved (the diff's read too) over (a).\n"
    "GB/s of W traffic (read + write); ratio_to_dram against (a)'s DRAM pass\n"
    "at the same thread count; fma_fraction = rank x elements / s over (f)'s\n"
    "figure, and fma_fraction_at_dram the fraction a run at the DRAM pass's\n"
    "speed would need (so ratio_to_dram t needs t x that).\n\n"
    "options:\n"
    "  --json        one JSON object per line on stdout\n"
    "  --dim N       weights are N x N (default 4096)\n"
    "  --dram-mb N   the DRAM buffer in MiB (default: 2 x the last-level\n"
    "                cache from sysfs, at least 1024)\n"
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

/* (f) the compute ceiling: single-precision FMA lanes per second of a
 * loop that keeps 24 (AVX-512) or 12 (AVX2) independent accumulators in
 * registers and touches no memory, with the widest ISA the CPU runs. The
 * fuse kernel needs rank x elements FMA lanes (one fma per term, in a fixed
 * order), so fma_fraction = rank x elements / seconds / this figure says
 * how much of the machine's arithmetic a row used. */
#define FMA_ITERS 40000000L
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define FMA_X86 1
#define FMA_ACC(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
__attribute__((target("avx512f,fma"), noinline)) static float fma_loop_avx512(long n) {
    const __m512 b = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(1e-7f);
#define D512(i) __m512 x##i = _mm512_set1_ps((float)i), y##i = _mm512_set1_ps((float)i + 0.5f);
#define F512(i) x##i = _mm512_fmadd_ps(x##i, b, c); y##i = _mm512_fmadd_ps(y##i, b, c);
#define S512(i) s = _mm512_add_ps(s, _mm512_add_ps(x##i, y##i));
    FMA_ACC(D512)
    for (long k = 0; k < n; k++) { FMA_ACC(F512) }
    __m512 s = _mm512_setzero_ps();
    FMA_ACC(S512)
    return _mm512_reduce_add_ps(s);
}
__attribute__((target("avx2,fma"), noinline)) static float fma_loop_avx2(long n) {
    const __m256 b = _mm256_set1_ps(0.999f), c = _mm256_set1_ps(1e-7f);
#define D256(i) __m256 x##i = _mm256_set1_ps((float)i);
#define F256(i) x##i = _mm256_fmadd_ps(x##i, b, c);
#define S256(i) s = _mm256_add_ps(s, x##i);
    FMA_ACC(D256)
    for (long k = 0; k < n; k++) { FMA_ACC(F256) }
    __m256 s = _mm256_setzero_ps();
    FMA_ACC(S256)
    float v[8];
    _mm256_storeu_ps(v, s);
    return v[0] + v[1] + v[2] + v[3] + v[4] + v[5] + v[6] + v[7];
}
#endif
static float fma_loop_scalar(long n) {
    float x[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    for (long k = 0; k < n; k++)
        for (int i = 0; i < 8; i++) x[i] = fmaf(x[i], 0.999f, 1e-7f);
    return x[0] + x[1] + x[2] + x[3] + x[4] + x[5] + x[6] + x[7];
}
typedef struct fma_ctx {
    int isa; /* 2 avx512, 1 avx2, 0 scalar */
    volatile float sink;
} fma_ctx;
static const char *const FMA_ISA[3] = {"scalar", "avx2", "avx512"};
static const double FMA_LANES[3] = {8.0, 12.0 * 8, 24.0 * 16}; /* lanes per iteration */
static void fma_range(void *p, size_t lo, size_t hi) {
    fma_ctx *c = p;
    for (size_t i = lo; i < hi; i++) {
#ifdef FMA_X86
        if (c->isa == 2) { c->sink = fma_loop_avx512(FMA_ITERS / 4); continue; }
        if (c->isa == 1) { c->sink = fma_loop_avx2(FMA_ITERS / 2); continue; }
#endif
        c->sink = fma_loop_scalar(FMA_ITERS / 8);
    }
}
static const long FMA_DIV[3] = {8, 2, 4};
/* G lanes/s over th threads, best of repeat (one work unit per thread). */
static double fma_peak(int th, long repeat, int *isa) {
    fma_ctx c = {0, 0};
#ifdef FMA_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma")) c.isa = 2;
    else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) c.isa = 1;
#endif
    *isa = c.isa;
    double best = 1e30;
    for (long r = 0; r <= repeat; r++) {
        double t0 = lk_now_s();
        par_for(th, (size_t)th, fma_range, &c);
        double t = lk_now_s() - t0;
        if (r && t < best) best = t;
    }
    return (double)th * (double)(FMA_ITERS / FMA_DIV[c.isa]) * FMA_LANES[c.isa] / best / 1e9;
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

/* The largest cache size in sysfs (the last level), or 0. */
static size_t llc_bytes(void) {
    size_t best = 0;
    for (int i = 0; i < 16; i++) {
        char path[128], buf[64];
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/size", i);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        if (fgets(buf, sizeof buf, f)) {
            char *end;
            unsigned long long v = strtoull(buf, &end, 10);
            if (*end == 'K') v <<= 10;
            else if (*end == 'M') v <<= 20;
            else if (*end == 'G') v <<= 30;
            if (v > best) best = (size_t)v;
        }
        fclose(f);
    }
    return best;
}

/* Best-of-repeat in-place RMW over n bytes with th threads: GB/s (r + w). */
static double rmw_gbps(uint64_t *buf, size_t bytes, int th, long repeat) {
    double best = 1e30;
    for (long r = 0; r <= repeat; r++) {
        double t0 = lk_now_s();
        par_for(th, bytes / 8, rmw_range, buf);
        double t = lk_now_s() - t0;
        if (r && t < best) best = t; /* run 0 warms up */
    }
    return 2.0 * (double)bytes / best / 1e9;
}

typedef struct row {
    const char *method, *scope;
    long rank;
    int threads;
    size_t tensors, bytes;
    double secs, cpu, dram, cache, naive_s, peak; /* peak: fma_peak's G lanes/s, same threads */
} row;

static void emit(int json, const row *r) {
    const double gbps = 2.0 * (double)r->bytes / r->secs / 1e9;
    const double fma_frac = (double)r->rank * (double)(r->bytes / 2) / r->secs / 1e9 / r->peak;
    if (json) {
        printf("{\"bench\":\"fuse\",\"method\":\"%s\",\"scope\":\"%s\",\"dtype\":\"bf16\",\"rank\":%ld,"
               "\"threads\":%d,\"tensors\":%zu,\"bytes\":%zu,\"seconds\":%.6f,\"gbps\":%.3f,\"ratio_to_dram\":%.3f,"
               "\"ratio_to_cache\":%.3f,\"cpu_seconds\":%.6f",
               r->method, r->scope, r->rank, r->threads, r->tensors, r->bytes, r->secs, gbps, gbps / r->dram,
               gbps / r->cache, r->cpu);
        if (r->naive_s > 0) printf(",\"speedup_vs_naive\":%.2f", r->naive_s / r->secs);
        printf(",\"fma_fraction\":%.3f,\"fma_fraction_at_dram\":%.3f}\n", fma_frac,
               (double)r->rank * r->dram / 4.0 / r->peak);
    } else {
        printf("%-8s %-6s rank %4ld  threads %3d  %9.3f ms (cpu %9.3f ms)  %8.2f GB/s  %5.2f x dram  %5.2f x cache",
               r->method, r->scope, r->rank, r->threads, r->secs * 1e3, r->cpu * 1e3, gbps, gbps / r->dram,
               gbps / r->cache);
        if (r->naive_s > 0) printf("  %5.2f x naive", r->naive_s / r->secs);
        printf("  %4.0f%% of FMA peak\n", 100 * fma_frac);
    }
}

/* (e) FP8: lk_fuse_fp8 in place on one dim x dim F8_E4M3 weight, plain
 * (scale 1, saturating) or with an F32 [] weight_scale (rescaled: two
 * passes over W), nearest or stochastic; GB/s counts W traffic of one pass
 * (read + write = 2 x W bytes), ratio_to_dram against (a) as for BF16. */
static int fp8_rows(int json, uint8_t *w8, size_t D, long r, const lk_fuse_term *term, const int *tcount, int nth,
                    const double *dram_bw, const double *cache_bw, long repeat) {
    const size_t bytes = D * D;
    for (int scaled = 0; scaled < 2; scaled++)
        for (int sto = 0; sto < 2; sto++)
            for (int ti = 0; ti < nth; ti++) {
                lk_fuse_opts o = {.threads = tcount[ti], .allow_nonfinite = 1};
                o.fp8.rounding = sto ? LK_FP8_STOCHASTIC : LK_FP8_NEAREST;
                o.fp8.saturate = 1;
                float scale = 1.0f / 448.0f;
                double best = 1e30, cpu = 0;
                for (long k = 0; k <= repeat; k++) {
                    double t0 = lk_now_s(), c0 = lk_bench_cpu();
                    if (lk_fuse_fp8(w8, LK_DTYPE_F8_E4M3, (int64_t)D, (int64_t)D, scaled ? &scale : NULL, LK_DTYPE_F32,
                                    1, term, 1, &o, "bench") != LK_OK)
                        return -1;
                    double t = lk_now_s() - t0;
                    if (k && t < best) {
                        best = t;
                        cpu = lk_bench_cpu() - c0;
                    }
                }
                const double gbps = 2.0 * (double)bytes / best / 1e9;
                const char *layout = scaled ? "scaled" : "plain", *rnd = sto ? "stochastic" : "nearest";
                if (json)
                    printf("{\"bench\":\"fuse\",\"method\":\"lorakit\",\"scope\":\"tensor\",\"dtype\":\"f8_e4m3\","
                           "\"layout\":\"%s\",\"rounding\":\"%s\",\"rank\":%ld,\"threads\":%d,\"tensors\":1,"
                           "\"bytes\":%zu,\"seconds\":%.6f,\"gbps\":%.3f,\"ratio_to_dram\":%.3f,\"ratio_to_cache\":%.3f,"
                           "\"cpu_seconds\":%.6f}\n",
                           layout, rnd, r, tcount[ti], bytes, best, gbps, gbps / dram_bw[ti], gbps / cache_bw[ti], cpu);
                else
                    printf("lorakit  fp8 %-6s %-10s rank %4ld  threads %3d  %9.3f ms (cpu %9.3f ms)  %8.2f GB/s  %5.2f x "
                           "dram  %5.2f x cache\n",
                           layout, rnd, r, tcount[ti], best * 1e3, cpu * 1e3, gbps, gbps / dram_bw[ti],
                           gbps / cache_bw[ti]);
            }
    return 0;
}

/* (g) the algorithms beyond linear LoRA, at rank 16 on one dim x dim BF16
 * weight, each through the real per-key path (an adapter written to a
 * temporary file, opened, resolved, lk_fuse_key_plan, then
 * lk_fuse_key_apply timed in place): linear LoRA (the reference), conv LoRA
 * (lora_A [16, dim/16, 4, 4] on a [dim, dim/16, 4, 4] weight: the same
 * elements), LoHa (two rank-16 products), LoKr (lokr_w1 [8, 8], lokr_w2_a /
 * _b of rank 16), a dense diff (BF16 [dim, dim]), OFT (oft_blocks [dim/16,
 * 16, 16]: 16 products per element, as the rank-16 LoRA) and BOFT (4 stages
 * of [dim/4, 4, 4]: 16 too). GB/s counts W traffic;
 * ratio_to_lora divides by the LoRA row's GB/s at the same thread count,
 * ratio_to_dram by (a)'s DRAM pass. */
typedef struct algo_case {
    const char *algo, *target;
    lk_tensor t[5]; /* the factors, then (alpha-scaled kinds) the module's F32 .alpha */
    size_t n;
} algo_case;

static int algo_rows(int json, lk_dtype wdt, void *w, size_t D, const uint16_t *a16, const uint16_t *b16,
                     const uint16_t *dd, const int *tcount, int nth, const double *dram_bw, long repeat) {
    const size_t esz = lk_dtype_size(wdt);
    const char *dtn = wdt == LK_DTYPE_F32 ? "f32" : wdt == LK_DTYPE_F16 ? "f16" : "bf16";
    const int64_t d = (int64_t)D, r = 16;
    const size_t fb = (size_t)r * D * 2;
#define T2(nm, p, d0, d1) ((lk_tensor){.name = nm, .dtype = LK_DTYPE_BF16, .ndim = 2, .shape = {d0, d1}, \
                                      .nbytes = (size_t)(d0) * (size_t)(d1) * 2, .data = (void *)(p)})
    algo_case cs[7] = {
        {"lora", "lin", {T2("lin.lora_A.weight", a16, r, d), T2("lin.lora_B.weight", b16, d, r)}, 2},
        {"conv_lora", "conv", {T2("conv.lora_A.weight", a16, r, d), T2("conv.lora_B.weight", b16, d, r)}, 2},
        {"loha", "lin", {T2("lin.hada_w1_a", b16, d, r), T2("lin.hada_w1_b", a16, r, d),
                         T2("lin.hada_w2_a", a16, d, r), T2("lin.hada_w2_b", b16, r, d)}, 4},
        {"lokr", "lin", {T2("lin.lokr_w1", a16, 8, 8), T2("lin.lokr_w2_a", b16, d / 8, r),
                         T2("lin.lokr_w2_b", a16, r, d / 8)}, 3},
        {"dense", "lin", {T2("lin.diff", dd, d, d)}, 1},
        /* OFT: dim/16 blocks of 16 (16 products per element, as rank-16 LoRA); BOFT: 4 stages of dim/4
         * blocks of 4 (also 16 per element); both as many factor values as lora_A */
        {"oft", "lin", {T2("lin.oft_blocks", a16, r, d)}, 1},  /* 16 d values, reshaped below */
        {"boft", "lin", {T2("lin.oft_blocks", a16, r, d)}, 1},
    };
    cs[5].t[0].ndim = 3, cs[5].t[0].shape[0] = d / 16, cs[5].t[0].shape[1] = 16, cs[5].t[0].shape[2] = 16;
    cs[6].t[0].ndim = 4, cs[6].t[0].shape[0] = 4, cs[6].t[0].shape[1] = d / 4, cs[6].t[0].shape[2] = 4, cs[6].t[0].shape[3] = 4;
#undef T2
    (void)fb;
    /* conv factors: [16, dim/16, 4, 4] and [dim, 16, 1, 1] */
    cs[1].t[0].ndim = 4;
    cs[1].t[0].shape[1] = d / 16, cs[1].t[0].shape[2] = 4, cs[1].t[0].shape[3] = 4;
    cs[1].t[1].ndim = 4;
    cs[1].t[1].shape[2] = 1, cs[1].t[1].shape[3] = 1;
    /* alpha = r written beside the alpha-scaled kinds (scale 1, as without one, but no "alpha defaults to r"
     * warning on every run); OFT / BOFT read alpha as a constraint, so theirs stay without */
    static const float alpha_r = 16.0f;
    for (size_t c = 0; c < 4; c++)
        cs[c].t[cs[c].n++] = (lk_tensor){.name = c == 1 ? "conv.alpha" : "lin.alpha", .dtype = LK_DTYPE_F32,
                                         .ndim = 0, .nbytes = 4, .data = (void *)&alpha_r};
    char dir[] = "/tmp/lorakit-bench-XXXXXX";
    if (!mkdtemp(dir)) {
        lk_error(LK_ERR_IO, "bench fuse: cannot make a temporary folder");
        return -1;
    }
    double lora_gbps[2] = {0, 0}, lora_med[2] = {0, 0}, lora_cpu[2] = {0, 0};
    double *times = malloc(2 * (size_t)repeat * sizeof *times), *cpus = times ? times + repeat : NULL;
    int rc = times ? 0 : -1;
    for (size_t c = 0; c < 7 && !rc; c++) {
        if (((c == 1 || c == 5) && D % 16) || (c == 6 && D % 32)) continue; /* BOFT: stage 3 pairs 8 blocks */
        if (wdt != LK_DTYPE_BF16 && c != 0 && c != 5 && c != 6) continue; /* other dtypes: LoRA, OFT, BOFT */
        char path[256];
        snprintf(path, sizeof path, "%s/%s.safetensors", dir, cs[c].algo);
        lk_tensor wt = {.name = c == 1 ? "conv.weight" : "lin.weight", .dtype = wdt, .ndim = 2,
                        .shape = {d, d}, .nbytes = D * D * esz, .data = w};
        if (c == 1) wt.ndim = 4, wt.shape[1] = d / 16, wt.shape[2] = 4, wt.shape[3] = 4;
        lk_adapter *ad = NULL;
        lk_fuse_term terms[LK_ADAPTER_MAX_SLICES];
        lk_fuse_key k;
        const double one = 1.0;
        if (lk_st_save(path, cs[c].t, cs[c].n, NULL, 0) || lk_adapter_open(path, LK_FORMAT_AUTO, &ad) ||
            lk_adapter_resolve(ad, &wt, 1, 0, NULL) || lk_fuse_key_plan(&ad, &one, 1, &wt, terms, &k)) {
            lk_adapter_free(ad);
            rc = -1;
            break;
        }
        for (int ti = 0; ti < nth && !rc; ti++) {
            lk_fuse_opts o = {.threads = tcount[ti], .allow_nonfinite = 1};
            double best = 1e30, cpu = 0;
            for (long rep = 0; rep <= repeat && !rc; rep++) {
                double t0 = lk_now_s(), c0 = lk_bench_cpu();
                if (lk_fuse_key_apply(w, w, &wt, &k, terms, &o) != LK_OK) rc = -1;
                double t = lk_now_s() - t0, tc = lk_bench_cpu() - c0;
                if (rep) times[rep - 1] = t, cpus[rep - 1] = tc;
                if (rep && t < best) {
                    best = t;
                    cpu = tc;
                }
            }
            /* the median CPU time: robust on a shared host at 1 thread
             * (time off the CPU is not counted) */
            const double med = lk_bench_median(times, (int)repeat), cmed = lk_bench_median(cpus, (int)repeat);
            if (c == 0) lora_cpu[ti] = cmed;
            const double gbps = 2.0 * (double)(D * D * esz) / best / 1e9, gmed = 2.0 * (double)(D * D * esz) / med / 1e9;
            if (c == 0) lora_gbps[ti] = gbps, lora_med[ti] = gmed;
            /* bytes moved: W read and written, plus the dense diff read once */
            const double moved = c == 4 ? 1.5 : 1.0;
            if (json)
                printf("{\"bench\":\"fuse\",\"method\":\"lorakit\",\"scope\":\"tensor\",\"algo\":\"%s\",\"dtype\":\"%s\","
                       "\"rank\":16,\"threads\":%d,\"bytes\":%zu,\"seconds\":%.6f,\"gbps\":%.3f,\"ratio_to_lora\":%.3f,"
                       "\"ratio_to_dram\":%.3f,\"seconds_median\":%.6f,\"ratio_to_lora_median\":%.3f,"
                       "\"ratio_to_dram_median\":%.3f,\"ratio_to_dram_bytes_median\":%.3f,\"cpu_seconds\":%.6f,"
                       "\"cpu_seconds_median\":%.6f,\"ratio_to_lora_cpu_median\":%.3f}\n",
                       cs[c].algo, dtn, tcount[ti], D * D * esz, best, gbps, gbps / lora_gbps[ti], gbps / dram_bw[ti], med,
                       gmed / lora_med[ti], gmed / dram_bw[ti], moved * gmed / dram_bw[ti], cpu, cmed,
                       lora_cpu[ti] / cmed);
            else
                printf("lorakit  %-9s %-4s rank 16  threads %3d  %9.3f ms (cpu %9.3f ms)  %8.2f GB/s  %5.2f x lora  %5.2f x "
                       "dram  | median %9.3f ms  %5.2f x lora  %5.2f x dram  %5.2f x dram (all bytes)  | median cpu "
                       "%9.3f ms  %5.2f x lora\n",
                       cs[c].algo, dtn, tcount[ti], best * 1e3, cpu * 1e3, gbps, gbps / lora_gbps[ti], gbps / dram_bw[ti],
                       med * 1e3, gmed / lora_med[ti], gmed / dram_bw[ti], moved * gmed / dram_bw[ti], cmed * 1e3,
                       lora_cpu[ti] / cmed);
        }
        lk_adapter_free(ad);
        remove(path);
    }
    rmdir(dir);
    free(times);
    return rc;
}

/* (h) dense diffs at model scope: every dim x dim BF16 weight of the DRAM
 * buffer (a) measured (model) with a BF16 diff of its own (diffs, the same
 * size), lk_fuse_tensor in place on each in turn, as a whole-model fuse
 * does. ratio_to_dram counts W traffic (read + write) as every other row;
 * ratio_to_dram_bytes counts every byte moved (the diff's read too: 1.5 x
 * W traffic) against the same pass, so 1.0 is the memory system's limit.
 * Median of --repeat runs (the best too). */
static int dense_model_rows(int json, uint16_t *model, const uint16_t *diffs, size_t D, size_t n_model,
                            const int *tcount, int nth, const double *dram_bw, long repeat) {
    const size_t N = D * D;
    double *times = malloc((size_t)repeat * sizeof *times);
    if (!times) return -1;
    lk_tensor dt = {.name = "diff", .dtype = LK_DTYPE_BF16, .ndim = 2, .shape = {(int64_t)D, (int64_t)D},
                    .nbytes = N * 2};
    for (int ti = 0; ti < nth; ti++) {
        lk_fuse_opts o = {.threads = tcount[ti], .allow_nonfinite = 1};
        double best = 1e30;
        for (long rep = 0; rep <= repeat; rep++) {
            double t0 = lk_now_s();
            for (size_t t = 0; t < n_model; t++) {
                dt.data = (void *)(diffs + t * N);
                lk_fuse_term term = {.B = &dt, .scale = 1.0, .kind = LK_TERM_DENSE};
                if (lk_fuse_tensor(model + t * N, model + t * N, LK_DTYPE_BF16, (int64_t)D, (int64_t)D, &term, 1, &o,
                                   "bench") != LK_OK) {
                    free(times);
                    return -1;
                }
            }
            double t = lk_now_s() - t0;
            if (rep) times[rep - 1] = t;
            if (rep && t < best) best = t;
        }
        const double med = lk_bench_median(times, (int)repeat), wb = 2.0 * (double)(n_model * N * 2);
        const double gbps = wb / best / 1e9, gmed = wb / med / 1e9;
        if (json)
            printf("{\"bench\":\"fuse\",\"method\":\"lorakit\",\"scope\":\"model\",\"algo\":\"dense\",\"dtype\":\"bf16\","
                   "\"threads\":%d,\"tensors\":%zu,\"bytes\":%zu,\"seconds\":%.6f,\"gbps\":%.3f,\"ratio_to_dram\":%.3f,"
                   "\"seconds_median\":%.6f,\"ratio_to_dram_median\":%.3f,\"ratio_to_dram_bytes_median\":%.3f}\n",
                   tcount[ti], n_model, n_model * N * 2, best, gbps, gbps / dram_bw[ti], med, gmed / dram_bw[ti],
                   1.5 * gmed / dram_bw[ti]);
        else
            printf("lorakit  dense     model   threads %3d  %9.3f ms  %8.2f GB/s  %5.2f x dram  | median %9.3f ms  "
                   "%5.2f x dram  %5.2f x dram (all bytes)\n",
                   tcount[ti], best * 1e3, gbps, gbps / dram_bw[ti], med * 1e3, gmed / dram_bw[ti],
                   1.5 * gmed / dram_bw[ti]);
    }
    free(times);
    return 0;
}

static void free_all(void **p, int n) {
    for (int i = 0; i < n; i++) free(p[i]);
}

int lk_bench_fuse(int argc, char **argv) {
    if (lk_cli_wants_help(argc, argv)) {
        fputs(FUSE_BENCH_USAGE, stdout);
        return LK_EXIT_OK;
    }
    for (int i = 1; i + 1 < argc; i++)
        if (!strcmp(argv[i], "--device") && strcmp(argv[i + 1], "cpu")) return lk_bench_fuse_device(argc, argv);
    int json = 0;
    long dim = 4096, repeat = 3, all = 0, dram_mb = 0;
    for (int i = 1; i < argc; i++) {
        long *dst = NULL;
        if (!strcmp(argv[i], "--device")) { i++; continue; } /* cpu: this bench */
        if (!strcmp(argv[i], "--json")) { json = 1; continue; }
        if (!strcmp(argv[i], "--dim")) dst = &dim;
        else if (!strcmp(argv[i], "--repeat")) dst = &repeat;
        else if (!strcmp(argv[i], "--threads")) dst = &all;
        else if (!strcmp(argv[i], "--dram-mb")) dst = &dram_mb;
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
    const size_t llc = llc_bytes();
    if (!dram_mb) {
        size_t want = 2 * llc > ((size_t)1 << 30) ? 2 * llc : (size_t)1 << 30;
        dram_mb = (long)((want + ((size_t)1 << 20) - 1) >> 20);
    }
    const size_t D = (size_t)dim, N = D * D, wbytes = N * 2;
    size_t n_model = ((size_t)dram_mb << 20) / wbytes;
    if (n_model < 1) n_model = 1;
    const size_t mbytes = n_model * wbytes;
    const long ranks[4] = {8, 16, 64, 128};
    const size_t rmax = 128;
    uint16_t *w = malloc(wbytes), *a16 = malloc(rmax * D * 2), *b16 = malloc(D * rmax * 2);
    float *delta = malloc(N * sizeof(float)), *af = malloc(rmax * D * 4), *bf = malloc(D * rmax * 4);
    uint64_t *buf = malloc(wbytes);
    uint16_t *model = malloc(mbytes);
    void *owned[8] = {w, a16, b16, delta, af, bf, buf, model};
    if (!w || !a16 || !b16 || !delta || !af || !bf || !buf || !model) {
        free_all(owned, 8);
        lk_error(LK_ERR_NOMEM, "bench fuse: out of memory for a %ldx%ld weight and a %zu MiB model", dim, dim,
                 mbytes >> 20);
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
    for (size_t t = 0; t < n_model; t++) memcpy(model + t * N, w, wbytes);
    memset(delta, 0, N * sizeof(float));

    /* (a): cache-sized and DRAM-sized, 1 thread and all. */
    const int tcount[2] = {1, (int)all};
    const int nth = all > 1 ? 2 : 1;
    double cache_bw[2], dram_bw[2];
    for (int ti = 0; ti < nth; ti++) {
        cache_bw[ti] = rmw_gbps(buf, wbytes, tcount[ti], repeat);
        dram_bw[ti] = rmw_gbps((uint64_t *)model, mbytes, tcount[ti], repeat);
    }
    if (nth == 1) {
        cache_bw[1] = cache_bw[0];
        dram_bw[1] = dram_bw[0];
    }
    for (int ti = 0; ti < nth; ti++) {
        if (json) {
            printf("{\"bench\":\"bandwidth\",\"kind\":\"cache\",\"bytes\":%zu,\"threads\":%d,\"gbps\":%.3f}\n", wbytes,
                   tcount[ti], cache_bw[ti]);
            printf("{\"bench\":\"bandwidth\",\"kind\":\"dram\",\"bytes\":%zu,\"llc_bytes\":%zu,\"threads\":%d,"
                   "\"gbps\":%.3f}\n",
                   mbytes, llc, tcount[ti], dram_bw[ti]);
        } else {
            printf("bandwidth, in-place read-modify-write, %d thread(s): cache (%zu MiB) %.2f GB/s, dram (%zu MiB, "
                   "LLC %zu MiB) %.2f GB/s\n",
                   tcount[ti], wbytes >> 20, cache_bw[ti], mbytes >> 20, llc >> 20, dram_bw[ti]);
        }
    }

    /* (f) */
    double peak[2];
    int isa = 0;
    for (int ti = 0; ti < nth; ti++) {
        peak[ti] = fma_peak(tcount[ti], repeat, &isa);
        if (json)
            printf("{\"bench\":\"fma_peak\",\"isa\":\"%s\",\"threads\":%d,\"glanes_per_s\":%.1f}\n", FMA_ISA[isa],
                   tcount[ti], peak[ti]);
        else
            printf("FMA peak (%s, registers only), %d thread(s): %.1f G single-precision lanes/s\n", FMA_ISA[isa],
                   tcount[ti], peak[ti]);
    }
    if (nth == 1) peak[1] = peak[0];

    for (int ri = 0; ri < 4; ri++) {
        const size_t r = (size_t)ranks[ri];
        lk_tensor A = {.dtype = LK_DTYPE_BF16, .ndim = 2, .shape = {(int64_t)r, dim}, .nbytes = r * D * 2, .data = a16};
        /* B is dim x r: use the first dim*r values of b16 laid out as dim x r. */
        lk_tensor B = {.dtype = LK_DTYPE_BF16, .ndim = 2, .shape = {dim, (int64_t)r}, .nbytes = r * D * 2, .data = b16};
        lk_fuse_term term = {.A = &A, .B = &B, .scale = 1.0f};
        naive_ctx nc = {.w = w, .A = af, .B = bf, .delta = delta, .dim = D, .r = r};
        for (int ti = 0; ti < nth; ti++) {
            const int th = tcount[ti];
            /* naive first, so the lorakit line can report the speedup */
            double nbest = 1e30, ncpu = 0;
            for (long k = 0; k <= repeat; k++) {
                double t0 = lk_now_s(), c0 = lk_bench_cpu();
                par_for(th, D, naive_delta, &nc);
                par_for(th, D, naive_add, &nc);
                double t = lk_now_s() - t0;
                if (k && t < nbest) {
                    nbest = t;
                    ncpu = lk_bench_cpu() - c0;
                }
            }
            lk_fuse_opts o = {.threads = th, .allow_nonfinite = 1};
            double fbest = 1e30, fcpu = 0, mbest = 1e30, mcpu = 0;
            for (long k = 0; k <= repeat; k++) {
                double t0 = lk_now_s(), c0 = lk_bench_cpu();
                if (lk_fuse_tensor(w, w, LK_DTYPE_BF16, dim, dim, &term, 1, &o, "bench") != LK_OK) {
                    free_all(owned, 8);
                    return lk_cli_fail();
                }
                double t = lk_now_s() - t0;
                if (k && t < fbest) {
                    fbest = t;
                    fcpu = lk_bench_cpu() - c0;
                }
            }
            for (long k = 0; k <= repeat; k++) {
                double t0 = lk_now_s(), c0 = lk_bench_cpu();
                for (size_t t = 0; t < n_model; t++)
                    if (lk_fuse_tensor(model + t * N, model + t * N, LK_DTYPE_BF16, dim, dim, &term, 1, &o, "bench") !=
                        LK_OK) {
                        free_all(owned, 8);
                        return lk_cli_fail();
                    }
                double t = lk_now_s() - t0;
                if (k && t < mbest) {
                    mbest = t;
                    mcpu = lk_bench_cpu() - c0;
                }
            }
            const double dr = dram_bw[ti], ca = cache_bw[ti], pk = peak[ti];
            emit(json, &(row){"naive", "tensor", (long)r, th, 1, wbytes, nbest, ncpu, dr, ca, 0, pk});
            emit(json, &(row){"lorakit", "tensor", (long)r, th, 1, wbytes, fbest, fcpu, dr, ca, nbest, pk});
            emit(json, &(row){"lorakit", "model", (long)r, th, n_model, mbytes, mbest, mcpu, dr, ca, 0, pk});
        }
        if (r == 16) { /* FP8 rows at rank 16: one e4m3fn weight, codes of values in [-1, 1) */
            uint8_t *w8 = malloc(N);
            if (!w8) {
                free_all(owned, 8);
                lk_error(LK_ERR_NOMEM, "bench fuse: out of memory for the FP8 weight");
                return lk_cli_fail();
            }
            for (size_t i = 0; i < N; i++) lk_fp8_from_double(lk_bf16_to_f32(w[i]), LK_DTYPE_F8_E4M3, 0, 0, &w8[i]);
            int bad = fp8_rows(json, w8, D, (long)r, &term, tcount, nth, dram_bw, cache_bw, repeat);
            free(w8);
            /* (g): the other algorithms; the dense diff's values are small, as the factors' */
            uint16_t *dd = bad ? NULL : malloc(wbytes);
            if (!bad && !dd) {
                free_all(owned, 8);
                lk_error(LK_ERR_NOMEM, "bench fuse: out of memory for the dense diff");
                return lk_cli_fail();
            }
            for (size_t i = 0; dd && i < N; i++) dd[i] = a16[i % (rmax * D)];
            if (!bad) bad = algo_rows(json, LK_DTYPE_BF16, w, D, a16, b16, dd, tcount, nth, dram_bw, repeat);
            /* (g) at F32 weights (the same values): LoRA, OFT, BOFT, each against the F32 LoRA row */
            float *w32 = bad ? NULL : malloc(N * sizeof(float));
            if (!bad && !w32) bad = lk_error(LK_ERR_NOMEM, "bench fuse: out of memory for the F32 weight") != 0;
            if (w32) lk_to_f32(w32, w, LK_DTYPE_BF16, N);
            if (!bad) bad = algo_rows(json, LK_DTYPE_F32, w32, D, a16, b16, dd, tcount, nth, dram_bw, repeat);
            free(w32);
            /* (h): the DRAM-sized buffer with a diff per weight */
            uint16_t *diffs = bad ? NULL : malloc(mbytes);
            if (!bad && !diffs) {
                free(dd);
                free_all(owned, 8);
                lk_error(LK_ERR_NOMEM, "bench fuse: out of memory for %zu MiB of dense diffs", mbytes >> 20);
                return lk_cli_fail();
            }
            for (size_t t = 0; diffs && t < n_model; t++) memcpy(diffs + t * N, dd, wbytes);
            if (!bad) bad = dense_model_rows(json, model, diffs, D, n_model, tcount, nth, dram_bw, repeat);
            free(diffs);
            free(dd);
            if (bad) {
                free_all(owned, 8);
                return lk_cli_fail();
            }
        }
    }
    free_all(owned, 8);
    return LK_EXIT_OK;
}
