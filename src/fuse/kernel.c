/* kernel.c — the one fusion kernel: W_out = W_in + sum_t scale_t * (B_t @ A_t).
 *
 * Shapes: W out x in (F32/F16/BF16), A_t r_t x in, B_t out x r_t (any mix of
 * F32/F16/BF16). Every caller (lk_fuse_file, the hot-swap tracker, adapter
 * export) goes through lk_fuse_tensor (tensor.c), which sends LoRA terms
 * here (lk_fuse_tensor_lora), so speed and determinism live here.
 *
 * THE CANONICAL ARITHMETIC (the same bits on every path and every machine):
 *  1. The terms with a non-zero scale, in the order given (callers pass the
 *     canonical order of lk_fuse_canonical_order), are stacked: k = 0 .. R-1
 *     runs over term 0's ranks, then term 1's, ..., R = sum of r_t.
 *  2. Scaled B. Narrow accumulator (BF16 and F16 weights; FP8 weights use
 *     the same chain through lk_fuse_delta_f32): B'[o,k] =
 *     (float)(scale_t * (double)B_t[o,k']), the product formed in f64 (the
 *     term's scale is a double: strength x alpha/r, as PEFT's Python float)
 *     and then rounded to f32. Wide accumulator (F32 weights): B'[o,k] =
 *     scale_t * (double)B_t[o,k'], rounded once in f64.
 *  3. The delta, per element, an FMA chain with k ascending, starting from
 *     the first product (not from 0): d = fl(B'[o,0] * A[0,j]), then
 *     d = fma(B'[o,k], A[k,j], d) for k = 1 .. R-1, in f32 (narrow: fmaf)
 *     or f64 (wide: fma). A's values are its stored values (exact in f32).
 *  4. W + d rounded ONCE into W's dtype: s = W + d is rounded to odd in the
 *     accumulator's format (round to nearest, exact error by TwoSum, and if
 *     inexact with an even last bit, one step toward the exact sum), then
 *     rounded to nearest-even into W's dtype. The accumulator has at least
 *     two more significant bits than W's dtype (24 vs 8/11; 53 vs 24), so
 *     this is the correctly rounded value of the exact W + d.
 *  5. NaN: a NaN weight stays that NaN with its quiet bit set; a NaN made
 *     from a non-NaN weight (Inf - Inf) is the positive quiet NaN. A finite
 *     weight that becomes Inf or NaN is an error unless allow_nonfinite.
 *  6. The FP environment does not matter: the kernel runs in the default
 *     one (round to nearest, no flush-to-zero) and restores the caller's.
 * FMA is correctly rounded, so AVX-512, AVX2, the portable fmaf fallback
 * (and NEON, CUDA later) give identical bytes; the work split (row chunks
 * to threads, column tiles, panel blocking) never changes what is computed
 * for an element, only who computes it and when.
 *
 * How (speed): the factors are small, so they are converted once per call:
 * B' (out x R) and A packed into zero-padded panels of 64 f32 (32 f64)
 * columns, [panel][k][column], so a block's k loop streams contiguous
 * memory (the panels start on a cache line). Threads take chunks of 24
 * rows; within a chunk, for each column tile (A's slice kept near 24 KB, so
 * it stays in L1 while all the chunk's rows use it), blocks of 6 rows x 1
 * panel get their delta in registers (each A vector serves 6 rows) and are
 * added to W, rounded and stored at once (kernel_avx512.c; kernel_avx2.c
 * does each 6 x 64 block as four 6 x 16 ones in 12 ymm; kernel_generic.c
 * is the portable C). W is read once and written once; no
 * out x in delta is ever materialised. The path is picked at run time from
 * the CPU's features (LORAKIT_KERNEL=avx512bf16|avx512|avx2|portable forces
 * one; avx512bf16 is the avx512 block with AVX512_BF16 in its BF16
 * epilogue). */
/* No FMA contraction: the build compiles the fuse layer with
 * -ffp-contract=off (CMakeLists.txt), so each operation above is one
 * rounding as written. */

#include "lorakit/fuse.h"
#include "lorakit/alloc.h"
#include "core/alloc.h"
#include "lorakit/log.h"
#include "fuse/fuse.h"
#include "fuse/kernel_scalar.h"

#include <fenv.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#ifdef LK_KERNEL_X86
#include <cpuid.h>
#endif

#define ROWS_PER_CHUNK (4 * LK_KMR)
#define WORK_PER_THREAD ((size_t)1 << 20)

float lk_fuse_add_odd_f32(float w, float d) { return scalar_add_odd_f32(w, d); }
double lk_fuse_add_odd_f64(double w, double d) { return scalar_add_odd_f64(w, d); }
float lk_fuse_round_f32(float w, float d) { return scalar_round_f32(w, d); }
uint32_t lk_fuse_round_f64_to_f32(uint32_t w_bits, double d) { return scalar_round_f64_to_f32(w_bits, d); }

/* ---- path selection ---- */

#ifdef LK_KERNEL_X86
/* F16C from CPUID leaf 1 (ECX bit 29): clang before 16 has no "f16c" for
 * __builtin_cpu_supports, and the fuzz build uses clang. */
static int cpu_has_f16c(void) {
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
}
/* AVX512_BF16: CPUID.(EAX=7, ECX=1):EAX bit 5. */
static int cpu_has_avx512bf16(void) {
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5));
}
#endif

/* The paths this CPU runs, as bits, found once: CPUID traps to the
 * hypervisor in a virtual machine (microseconds a call), and every fuse
 * call asks. Two threads racing here store the same value. */
enum { CPU_KNOWN = 1, CPU_AVX2 = 2, CPU_AVX512 = 4, CPU_AVX512BF16 = 8 };
static int cpu_paths(void) {
    static atomic_int paths;
    int v = atomic_load_explicit(&paths, memory_order_relaxed);
    if (v) return v;
    v = CPU_KNOWN;
#ifdef LK_KERNEL_X86
    __builtin_cpu_init();
    const int f16c = cpu_has_f16c();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c) v |= CPU_AVX2;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma") &&
        f16c) {
        v |= CPU_AVX512;
        if (cpu_has_avx512bf16()) v |= CPU_AVX512BF16;
    }
#endif
    atomic_store_explicit(&paths, v, memory_order_relaxed);
    return v;
}

int lk_fuse_kernel_supported(const char *name) {
    const int v = cpu_paths();
    if (!strcmp(name, "portable")) return 1;
    if (!strcmp(name, "avx2")) return (v & CPU_AVX2) != 0;
    if (!strcmp(name, "avx512")) return (v & CPU_AVX512) != 0;
    if (!strcmp(name, "avx512bf16")) return (v & CPU_AVX512BF16) != 0;
    return 0;
}

const char *lk_fuse_kernel_path(void) {
    const char *want = getenv("LORAKIT_KERNEL");
    if (want && *want && strcmp(want, "auto")) {
        static const char *const names[] = {"avx512bf16", "avx512", "avx2", "portable"};
        for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
            if (!strcmp(want, names[i]) && lk_fuse_kernel_supported(want)) return names[i];
        lk_log(LK_LOG_WARN,
               "LORAKIT_KERNEL=%s: not a path this CPU runs (avx512bf16, avx512, avx2, portable); choosing by CPU",
               want);
    }
    if (lk_fuse_kernel_supported("avx512bf16")) return "avx512bf16";
    if (lk_fuse_kernel_supported("avx512")) return "avx512";
    if (lk_fuse_kernel_supported("avx2")) return "avx2";
    return "portable";
}

static lk_kblock_fn path_block(const char *path) {
#ifdef LK_KERNEL_X86
    if (!strcmp(path, "avx512bf16")) return lk_kblock_avx512bf16;
    if (!strcmp(path, "avx512")) return lk_kblock_avx512;
    if (!strcmp(path, "avx2")) return lk_kblock_avx2;
#endif
    (void)path;
    return lk_kblock_portable;
}

/* ---- the work split ---- */

typedef struct kshared {
    lk_kjob job;
    atomic_size_t next;
    const lk_cancel *cancel; /* checked before each chunk (lorakit/cancel.h) */
    atomic_int cancelled;    /* a worker saw it: every worker stops taking chunks */
} kshared;

typedef struct kthread {
    kshared *sh;
    lk_kworker wk;
} kthread;

static void run_worker(kthread *t) {
    const lk_kjob *jb = &t->sh->job;
    for (;;) {
        if (atomic_load_explicit(&t->sh->cancelled, memory_order_relaxed)) break;
        if (lk_cancel_requested(t->sh->cancel)) { /* a cancellation point per chunk of rows */
            atomic_store_explicit(&t->sh->cancelled, 1, memory_order_relaxed);
            break;
        }
        size_t c = atomic_fetch_add_explicit(&t->sh->next, 1, memory_order_relaxed);
        if (c >= jb->n_chunks) break;
        size_t o0 = c * jb->rows_per_chunk;
        size_t o1 = o0 + jb->rows_per_chunk < jb->out ? o0 + jb->rows_per_chunk : jb->out;
        for (size_t pt = 0; pt < jb->npan; pt += jb->pan_tile) {
            size_t pe = pt + jb->pan_tile < jb->npan ? pt + jb->pan_tile : jb->npan;
            for (size_t o = o0; o < o1; o += LK_KMR) {
                int mr = o1 - o < LK_KMR ? (int)(o1 - o) : LK_KMR;
                jb->block(jb, &t->wk, o, mr, pt, pe);
            }
        }
    }
}

static void *thread_main(void *arg) {
    fesetenv(FE_DFL_ENV);
    run_worker(arg);
    return NULL;
}

int lk_fuse_default_threads(void) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    if (n < 1) n = 1;
    if (n > LK_FUSE_MAX_THREADS) n = LK_FUSE_MAX_THREADS;
    return (int)n;
}

/* ---- validation and factor preparation ---- */

lk_status lk_fuse_check_factor(const lk_tensor *t, const char *what, const char *name, size_t ti) {
    if (!t) return lk_error(LK_ERR_ARG, "%s: term %zu: %s is NULL", name, ti, what);
    if (!lk_dtype_is_fusable(t->dtype) && !(t->dtype == LK_DTYPE_F64 && (what[0] == 'A' || what[0] == 'B')))
        return lk_error(LK_ERR_DTYPE, "%s: term %zu: %s has dtype %s; only F32, F16 and BF16 can be fused",
                        name, ti, what, lk_dtype_name(t->dtype));
    if (t->ndim != 2)
        return lk_error(LK_ERR_SHAPE, "%s: term %zu: %s has %d dimensions, expected 2", name, ti, what, t->ndim);
    if (t->shape[0] <= 0 || t->shape[1] <= 0)
        return lk_error(LK_ERR_SHAPE, "%s: term %zu: %s is %lldx%lld", name, ti, what,
                        (long long)t->shape[0], (long long)t->shape[1]);
    if (!t->data) return lk_error(LK_ERR_ARG, "%s: term %zu: %s has no data", name, ti, what);
    return LK_OK;
}

/* Validates the terms against an out x in weight; *R = total rank of the
 * terms with a non-zero scale. */
static lk_status check_terms(int64_t out, int64_t in, const lk_fuse_term *terms, size_t n_terms, const char *name,
                             size_t *R) {
    if (n_terms && !terms) return lk_error(LK_ERR_ARG, "%s: NULL terms", name);
    *R = 0;
    for (size_t t = 0; t < n_terms; t++) {
        lk_status s;
        if (terms[t].kind != LK_TERM_LORA)
            return lk_error(LK_ERR_ARG, "%s: term %zu is not a LoRA term (kind %d)", name, t, (int)terms[t].kind);
        if ((s = lk_fuse_check_factor(terms[t].A, "A", name, t)) ||
            (s = lk_fuse_check_factor(terms[t].B, "B", name, t)))
            return s;
        const lk_tensor *A = terms[t].A, *B = terms[t].B;
        if (A->shape[1] != in || B->shape[0] != out || B->shape[1] != A->shape[0])
            return lk_error(LK_ERR_SHAPE, "%s: term %zu: A is %lldx%lld and B is %lldx%lld but the weight is %lldx%lld",
                            name, t, (long long)A->shape[0], (long long)A->shape[1], (long long)B->shape[0],
                            (long long)B->shape[1], (long long)out, (long long)in);
        if (!isfinite(terms[t].scale))
            return lk_error(LK_ERR_NONFINITE, "%s: term %zu: scale is %g", name, t, (double)terms[t].scale);
        if (terms[t].scale != 0.0 && !lk_checked_add(*R, (size_t)A->shape[0], R))
            return lk_error(LK_ERR_SHAPE, "%s: total rank overflows", name);
    }
    return LK_OK;
}

/* B' of rows [row0, row0 + rows), rows x R: narrow (f32) or wide (f64). */
static void make_bs(void *bs, int wide, size_t R, size_t row0, size_t rows, const lk_fuse_term *terms, size_t n_terms,
                    float *tmp) {
    size_t koff = 0;
    for (size_t t = 0; t < n_terms; t++) {
        if (terms[t].scale == 0.0) continue;
        const lk_tensor *B = terms[t].B;
        const size_t r = (size_t)B->shape[1], besz = lk_dtype_size(B->dtype);
        const double sc = terms[t].scale;
        for (size_t i = 0; i < rows; i++) {
            /* an F64 B (GLoRA's W a1, oft.c): its values as they are */
            const double *b64 = B->dtype == LK_DTYPE_F64 ? (const double *)B->data + (row0 + i) * r : NULL;
            if (!b64) lk_to_f32(tmp, (const char *)B->data + (row0 + i) * r * besz, B->dtype, r);
            if (wide) {
                double *row = (double *)bs + i * R + koff;
                for (size_t k = 0; k < r; k++) row[k] = sc * (b64 ? b64[k] : (double)tmp[k]);
            } else {
                float *row = (float *)bs + i * R + koff;
                for (size_t k = 0; k < r; k++) row[k] = (float)(sc * (b64 ? b64[k] : (double)tmp[k]));
            }
        }
        koff += r;
    }
}

/* A packed into zero-padded panels of pw columns: ap[(p*R + k)*pw + c] =
 * A[k, p*pw + c] (f32 or f64), zero past column in. Rows go through tmp. */
static void make_panels(void *ap, int wide, size_t pw, size_t R, size_t in, const lk_fuse_term *terms,
                        size_t n_terms, float *tmp) {
    const size_t npan = (in + pw - 1) / pw;
    size_t k = 0;
    for (size_t t = 0; t < n_terms; t++) {
        if (terms[t].scale == 0.0) continue;
        const lk_tensor *A = terms[t].A;
        const size_t r = (size_t)A->shape[0], aesz = lk_dtype_size(A->dtype);
        for (size_t i = 0; i < r; i++, k++) {
            const double *a64 = A->dtype == LK_DTYPE_F64 ? (const double *)A->data + i * in : NULL;
            if (!a64) lk_to_f32(tmp, (const char *)A->data + i * in * aesz, A->dtype, in);
            for (size_t p = 0; p < npan; p++) {
                const size_t c0 = p * pw, n = in - c0 < pw ? in - c0 : pw;
                if (wide) {
                    double *dst = (double *)ap + (p * R + k) * pw;
                    for (size_t c = 0; c < n; c++) dst[c] = a64 ? a64[c0 + c] : tmp[c0 + c];
                    for (size_t c = n; c < pw; c++) dst[c] = 0.0;
                } else {
                    float *dst = (float *)ap + (p * R + k) * pw;
                    if (a64) /* a Tucker-folded A (F64): rounded once to f32 */
                        for (size_t c = 0; c < n; c++) dst[c] = (float)a64[c0 + c];
                    else memcpy(dst, tmp + c0, n * sizeof(float));
                    for (size_t c = n; c < pw; c++) dst[c] = 0.0f;
                }
            }
        }
    }
}

static lk_status fuse_whole(void *w_out, const void *w_in, lk_dtype dtype, int64_t out, int64_t in,
                            const lk_fuse_term *terms, size_t n_terms, const lk_fuse_opts *opts, const char *name);

int lk_fuse_term_sliced(const lk_fuse_term *t) { return t->slice != 0; }

static int i64_cmp(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Row-sliced terms: bands of rows covered by the same terms, each handed
 * to fn as a weight of its own with the terms (in the given order) that
 * cover it, B viewed from the band's first row (fuse/fuse.h). */
lk_status lk_fuse_bands(int64_t out, const lk_fuse_term *terms, size_t n_terms, const char *name, lk_fuse_band_fn fn,
                        void *ctx) {
    for (size_t t = 0; t < n_terms; t++) {
        if (terms[t].kind != LK_TERM_LORA)
            return lk_error(LK_ERR_UNSUPPORTED, "%s: a LoHa, LoKr or dense delta together with modules on row slices "
                            "of the same weight is not supported", name);
        lk_status s = lk_fuse_check_factor(terms[t].B, "B", name, t);
        if (s) return s;
        int64_t r0 = terms[t].slice ? terms[t].slice - 1 : 0;
        if (r0 < 0 || terms[t].B->shape[0] > out - r0)
            return lk_error(LK_ERR_SHAPE, "%s: term %zu: rows %lld..%lld are outside the weight's %lld rows", name, t,
                            (long long)r0, (long long)(r0 + terms[t].B->shape[0]), (long long)out);
    }
    /* the cuts, and per band its terms and their B row views: one allocation */
    lk_carve cv = {0};
    const size_t o_cut = LK_CARVE(&cv, 2 * n_terms + 2, int64_t), o_bt = LK_CARVE(&cv, n_terms, lk_fuse_term),
                 o_bv = LK_CARVE(&cv, n_terms, lk_tensor);
    unsigned char *mem = lk_carve_alloc(&cv);
    if (!mem) return lk_error(LK_ERR_NOMEM, "%s: out of memory", name);
    int64_t *cut = (int64_t *)(void *)(mem + o_cut);
    lk_fuse_term *bt = (lk_fuse_term *)(void *)(mem + o_bt);
    lk_tensor *bv = (lk_tensor *)(void *)(mem + o_bv);
    size_t nc = 0;
    cut[nc++] = 0;
    cut[nc++] = out;
    for (size_t t = 0; t < n_terms; t++) {
        int64_t r0 = terms[t].slice ? terms[t].slice - 1 : 0;
        cut[nc++] = r0;
        cut[nc++] = r0 + terms[t].B->shape[0];
    }
    qsort(cut, nc, sizeof *cut, i64_cmp);
    lk_status s = LK_OK;
    for (size_t c = 0; c + 1 < nc && !s; c++) {
        int64_t r0 = cut[c], r1 = cut[c + 1];
        if (r0 == r1) continue;
        size_t nb = 0;
        for (size_t t = 0; t < n_terms; t++) {
            const lk_fuse_term *tt = &terms[t];
            int64_t t0 = tt->slice ? tt->slice - 1 : 0;
            if (t0 > r0 || t0 + tt->B->shape[0] <= r0) continue;
            bv[nb] = *tt->B;
            size_t be = lk_dtype_size(tt->B->dtype);
            bv[nb].data = (char *)tt->B->data + (size_t)(r0 - t0) * (size_t)tt->B->shape[1] * be;
            bv[nb].shape[0] = r1 - r0;
            bv[nb].nbytes = (size_t)(r1 - r0) * (size_t)tt->B->shape[1] * be;
            bt[nb] = (lk_fuse_term){.A = tt->A, .B = &bv[nb], .scale = tt->scale};
            nb++;
        }
        s = fn(ctx, r0, r1, bt, nb);
    }
    lk_free(mem);
    return s;
}

typedef struct band_ctx {
    void *w_out;
    const void *w_in;
    lk_dtype dtype;
    int64_t in;
    const lk_fuse_opts *opts;
    const char *name;
} band_ctx;

/* One band on the CPU: fused whole, or copied when no term covers it. */
static lk_status fuse_band(void *ctx, int64_t r0, int64_t r1, const lk_fuse_term *bt, size_t nb) {
    const band_ctx *b = ctx;
    const size_t rowb = (size_t)b->in * lk_dtype_size(b->dtype);
    char *wo = (char *)b->w_out + (size_t)r0 * rowb;
    const char *wi = (const char *)b->w_in + (size_t)r0 * rowb;
    if (nb) return fuse_whole(wo, wi, b->dtype, r1 - r0, b->in, bt, nb, b->opts, b->name);
    if (wo != wi) memmove(wo, wi, (size_t)(r1 - r0) * rowb);
    return LK_OK;
}

lk_status lk_fuse_tensor_lora(void *w_out, const void *w_in, lk_dtype dtype, int64_t out, int64_t in,
                              const lk_fuse_term *terms, size_t n_terms, const lk_fuse_opts *opts, const char *name) {
    int sliced = 0;
    for (size_t t = 0; terms && t < n_terms && !sliced; t++) sliced = lk_fuse_term_sliced(&terms[t]);
    if (sliced && w_out && w_in && lk_dtype_is_fusable(dtype) && out > 0 && in > 0)
        return lk_fuse_bands(out, terms, n_terms, name, fuse_band,
                             &(band_ctx){w_out, w_in, dtype, in, opts, name});
    return fuse_whole(w_out, w_in, dtype, out, in, terms, n_terms, opts, name);
}

lk_status lk_fuse_check_weight(const void *w_out, const void *w_in, lk_dtype dtype, int64_t out, int64_t in,
                               const char *name) {
    if (!w_out || !w_in) return lk_error(LK_ERR_ARG, "%s: NULL weight buffer", name);
    if (!lk_dtype_is_fusable(dtype))
        return lk_error(LK_ERR_DTYPE, "%s: weight dtype %s cannot be fused (only F32, F16, BF16)", name,
                        lk_dtype_name(dtype));
    if (out <= 0 || in <= 0)
        return lk_error(LK_ERR_SHAPE, "%s: weight shape %lldx%lld", name, (long long)out, (long long)in);
    const size_t esz = lk_dtype_size(dtype), O = (size_t)out, I = (size_t)in;
    size_t numel, wbytes;
    if ((uint64_t)out > SIZE_MAX || (uint64_t)in > SIZE_MAX || !lk_checked_mul(O, I, &numel) ||
        !lk_checked_mul(numel, esz, &wbytes))
        return lk_error(LK_ERR_SHAPE, "%s: weight %lldx%lld is too large", name, (long long)out, (long long)in);
    return LK_OK;
}

/* One fuse_whole call: its sizes, its thread count and its one allocation. */
typedef struct kcall {
    size_t O, I, R;      /* the weight out x in, the total rank */
    int wide;            /* F32 weight: f64 accumulator */
    size_t pw, vsz, npan, n_chunks;
    int threads;
    unsigned char *mem;  /* the one allocation (lk_free) that the rest is carved from */
    void *ap, *bs;       /* A's panels (npan x R x pw) and B' (O x R), on cache lines */
    float *tmp;          /* a row of A or B, for the conversions */
    kshared *sh;         /* the job and its chunk counter */
    kthread *ths;        /* per thread: its worker */
    pthread_t *tids;
} kcall;

/* The sizes and the thread count: opts->threads (0: every core), at most
 * one per chunk of rows, and each thread at least WORK_PER_THREAD fma lanes
 * (a few tens of microseconds of work, as a thread costs tens of
 * microseconds to start), so a small weight runs on the calling thread
 * alone. The bytes do not depend on the split. */
static void kcall_plan(kcall *k, int64_t out, int64_t in, size_t R, lk_dtype dtype, const lk_fuse_opts *opts) {
    k->O = (size_t)out;
    k->I = (size_t)in;
    k->R = R;
    k->wide = dtype == LK_DTYPE_F32;
    k->pw = k->wide ? LK_PW64 : LK_PW32;
    k->vsz = k->wide ? sizeof(double) : sizeof(float);
    k->npan = (k->I + k->pw - 1) / k->pw;
    k->n_chunks = (k->O + ROWS_PER_CHUNK - 1) / ROWS_PER_CHUNK;
    int threads = opts && opts->threads > 0 ? opts->threads : lk_fuse_default_threads();
    if (threads > LK_FUSE_MAX_THREADS) threads = LK_FUSE_MAX_THREADS;
    if ((size_t)threads > k->n_chunks) threads = (int)k->n_chunks;
    const size_t numel = k->O * k->I, work = numel > SIZE_MAX / R ? SIZE_MAX : numel * R;
    if ((size_t)threads > work / WORK_PER_THREAD) threads = work / WORK_PER_THREAD > 1 ? (int)(work / WORK_PER_THREAD) : 1;
    k->threads = threads;
}

/* The factors' part of a kernel block, carved into cv from its start (on
 * a cache line: lk_carve_alloc_aligned): A's npan panels of pw columns
 * (pw * R values each) at *at_a, then B' (rows x R values) right after at
 * *at_b, then a conversion row of max(I, R) floats and 32 floats of slack
 * at *at_tmp. The panels on a cache line keep every zmm load of A within
 * one; with panels a_n * vsz is a multiple of 256, so B' is on one too.
 * Returns the factors' bytes; cv overflowed when they do not fit. */
static size_t lay_out_factors(lk_carve *cv, size_t npan, size_t pw, size_t rows, size_t R, size_t I, size_t vsz,
                            size_t *at_a, size_t *at_b, size_t *at_tmp) {
    size_t a_n = 0, b_n = 0;
    cv->overflow |= !lk_checked_mul(npan * pw, R, &a_n) || !lk_checked_mul(rows, R, &b_n);
    *at_a = lk_carve_part(cv, a_n, vsz, 64);
    *at_b = lk_carve_part(cv, b_n, vsz, vsz);
    *at_tmp = lk_carve_part(cv, (I > R ? I : R) + 32, sizeof(float), _Alignof(float));
    return cv->bytes;
}

/* k->mem, one allocation carved into the factors (lay_out_factors), then
 * (each on its own cache line) the shared job and the threads' workers and
 * ids. Not zeroed (lk_carve_alloc_aligned): every part is written before
 * it is read, and zeroing the factors on every call would cost. A failure
 * allocates nothing and names the factors' bytes. */
static lk_status kcall_alloc(kcall *k, const char *name) {
    const size_t nt = (size_t)k->threads;
    size_t at_a, at_b, at_tmp;
    lk_carve cv = {0};
    const size_t tot = lay_out_factors(&cv, k->npan, k->pw, k->O, k->R, k->I, k->vsz, &at_a, &at_b, &at_tmp);
    if (cv.overflow) return lk_error(LK_ERR_SHAPE, "%s: factors too large", name);
    const size_t sh_at = lk_carve_part(&cv, 1, sizeof(kshared), 64), ths_at = lk_carve_part(&cv, nt, sizeof(kthread), 64),
                 tids_at = lk_carve_part(&cv, nt, sizeof(pthread_t), 64);
    if (!(k->mem = lk_carve_alloc_aligned(&cv, 64)))
        return lk_error(LK_ERR_NOMEM, "%s: out of memory for the fusion factors (%zu bytes)", name, tot);
    k->ap = k->mem + at_a;
    k->bs = k->mem + at_b;
    k->tmp = (float *)(void *)(k->mem + at_tmp);
    k->sh = (kshared *)(void *)(k->mem + sh_at);
    k->ths = (kthread *)(void *)(k->mem + ths_at);
    k->tids = (pthread_t *)(void *)(k->mem + tids_at);
    return LK_OK;
}

/* The job: B' and A's panels made from the terms (steps 2 and 3 of the
 * header), the column tile keeping A's slice near LK_TILE_BYTES, the
 * block function of the path in use; every worker fresh. */
static void kcall_job(kcall *k, void *w_out, const void *w_in, lk_dtype dtype, const lk_fuse_term *terms,
                      size_t n_terms, const lk_cancel *cancel) {
    make_bs(k->bs, k->wide, k->R, 0, k->O, terms, n_terms, k->tmp);
    make_panels(k->ap, k->wide, k->pw, k->R, k->I, terms, n_terms, k->tmp);
    size_t pan_tile = LK_TILE_BYTES / (k->R * k->pw * k->vsz);
    if (pan_tile < 1) pan_tile = 1;
    kshared *sh = k->sh;
    memset(sh, 0, sizeof *sh);
    sh->job = (lk_kjob){.w_out = w_out, .w_in = w_in, .dt = (int)dtype, .wide = k->wide, .out = k->O, .in = k->I,
                        .R = k->R, .npan = k->npan, .pan_tile = pan_tile, .n_chunks = k->n_chunks,
                        .rows_per_chunk = ROWS_PER_CHUNK, .block = path_block(lk_fuse_kernel_path())};
    if (k->wide) {
        sh->job.Ap64 = k->ap;
        sh->job.Bs64 = k->bs;
    } else {
        sh->job.Ap32 = k->ap;
        sh->job.Bs32 = k->bs;
    }
    atomic_init(&sh->next, 0);
    sh->cancel = cancel;
    atomic_init(&sh->cancelled, 0);
    for (int t = 0; t < k->threads; t++) k->ths[t] = (kthread){.sh = sh, .wk = {.job = &sh->job, .bad_at = SIZE_MAX}};
}

/* Runs the job on k->threads workers, worker 0 this thread, in the default
 * FP environment (the caller's is restored after). A thread that fails to
 * start leaves its share to the others. Returns how many workers ran. */
static int kcall_run(kcall *k) {
    fenv_t saved;
    fegetenv(&saved);
    fesetenv(FE_DFL_ENV);
    int started = 0;
    for (int t = 1; t < k->threads; t++) {
        if (pthread_create(&k->tids[t], NULL, thread_main, &k->ths[t]) != 0) break;
        started = t;
    }
    run_worker(&k->ths[0]);
    for (int t = 1; t <= started; t++) pthread_join(k->tids[t], NULL);
    fesetenv(&saved);
    return started + 1;
}

/* The first element (lowest index) that a worker saw become non-finite,
 * reported by lk_fuse_nonfinite (LK_OK when none, or when allowed). */
static lk_status kcall_verdict(const kcall *k, int ran, const lk_fuse_opts *opts, const char *name) {
    size_t bad_at = SIZE_MAX;
    double bw = 0, br = 0;
    for (int t = 0; t < ran; t++)
        if (k->ths[t].wk.bad_at < bad_at) {
            bad_at = k->ths[t].wk.bad_at;
            bw = k->ths[t].wk.bad_w;
            br = k->ths[t].wk.bad_r;
        }
    return lk_fuse_nonfinite(name, bad_at, k->I, bw, br, opts);
}

/* Check, plan, allocate, build the job, run it, report: the weight's bytes
 * are written only by the run; a check or allocation failure leaves them
 * as they were. */
static lk_status fuse_whole(void *w_out, const void *w_in, lk_dtype dtype, int64_t out, int64_t in,
                            const lk_fuse_term *terms, size_t n_terms, const lk_fuse_opts *opts, const char *name) {
    lk_status st = lk_fuse_check_weight(w_out, w_in, dtype, out, in, name);
    if (st) return st;
    size_t R;
    if ((st = check_terms(out, in, terms, n_terms, name, &R))) return st;
    if (R == 0) { /* nothing to add: the bytes stay exactly as they are */
        if (w_out != w_in) memmove(w_out, w_in, (size_t)out * (size_t)in * lk_dtype_size(dtype));
        return LK_OK;
    }
    kcall k = {0};
    kcall_plan(&k, out, in, R, dtype, opts);
    if ((st = kcall_alloc(&k, name))) return st;
    kcall_job(&k, w_out, w_in, dtype, terms, n_terms, opts ? opts->cancel : NULL);
    st = kcall_verdict(&k, kcall_run(&k), opts, name);
    if (!st && atomic_load(&k.sh->cancelled)) st = lk_error(LK_ERR_CANCELLED, "%s: cancelled", name); /* partly written */
    lk_free(k.mem);
    return st;
}

lk_status lk_fuse_nonfinite(const char *name, size_t bad_at, size_t in, double w, double r, const lk_fuse_opts *opts) {
    if (bad_at == SIZE_MAX || (opts && opts->allow_nonfinite)) return LK_OK;
    return lk_error(LK_ERR_NONFINITE,
                    "%s: fusion made element [%zu, %zu] non-finite (weight %g became %g); "
                    "allow_nonfinite (--allow-nonfinite) keeps it",
                    name, bad_at / in, bad_at % in, w, r);
}

/* ---- the delta alone (fuse/fuse.h) ---- */

#define LK_AI static inline __attribute__((always_inline))

/* d[i*ld + j] = the chain of step 3 for rows i < rows: one row of d is
 * built in place, k ascending, so the inner loop is a plain vector fma. */
LK_AI void delta_rows32(float *d, size_t ld, const float *A, const float *bs, size_t R, size_t in, size_t rows) {
    for (size_t i = 0; i < rows; i++) {
        float *row = d + i * ld;
        const float *b = bs + i * R;
        for (size_t j = 0; j < in; j++) row[j] = b[0] * A[j];
        for (size_t k = 1; k < R; k++) {
            const float bk = b[k], *a = A + k * in;
            for (size_t j = 0; j < in; j++) row[j] = fmaf(bk, a[j], row[j]);
        }
    }
}

LK_AI void delta_rows64(double *d, size_t ld, const double *A, const double *bs, size_t R, size_t in, size_t rows) {
    for (size_t i = 0; i < rows; i++) {
        double *row = d + i * ld;
        const double *b = bs + i * R;
        for (size_t j = 0; j < in; j++) row[j] = b[0] * A[j];
        for (size_t k = 1; k < R; k++) {
            const double bk = b[k], *a = A + k * in;
            for (size_t j = 0; j < in; j++) row[j] = fma(bk, a[j], row[j]);
        }
    }
}

static void delta32_portable(float *d, size_t ld, const float *A, const float *bs, size_t R, size_t in, size_t rows) {
    delta_rows32(d, ld, A, bs, R, in, rows);
}
static void delta64_portable(double *d, size_t ld, const double *A, const double *bs, size_t R, size_t in,
                             size_t rows) {
    delta_rows64(d, ld, A, bs, R, in, rows);
}
#ifdef LK_KERNEL_X86
__attribute__((target("avx2,fma"))) static void delta32_avx2(float *d, size_t ld, const float *A, const float *bs,
                                                            size_t R, size_t in, size_t rows) {
    delta_rows32(d, ld, A, bs, R, in, rows);
}
__attribute__((target("avx2,fma"))) static void delta64_avx2(double *d, size_t ld, const double *A, const double *bs,
                                                            size_t R, size_t in, size_t rows) {
    delta_rows64(d, ld, A, bs, R, in, rows);
}
#endif

struct lk_kdelta {
    int wide, panels; /* panels: A in LK_PW32 (wide: LK_PW64) column panels for the AVX-512 delta block, else plain R x in */
    size_t R, I, row0, rows;
    void *A, *bs;   /* A (packed), B' of rows [row0, row0 + rows) */
    int fast;       /* the path is not portable */
    unsigned char *mem;
};

lk_status lk_fuse_check_rows(int64_t out, int64_t in, int64_t row0, int64_t rows, const char *name) {
    if (out <= 0 || in <= 0)
        return lk_error(LK_ERR_SHAPE, "%s: weight shape %lldx%lld", name, (long long)out, (long long)in);
    if (row0 < 0 || rows < 0 || row0 > out || rows > out - row0)
        return lk_error(LK_ERR_ARG, "%s: rows [%lld, %lld) outside a weight of %lld rows", name, (long long)row0,
                        (long long)row0 + (long long)rows, (long long)out);
    return LK_OK;
}

lk_status lk_kdelta_prepare(int wide, int64_t out, int64_t in, int64_t row0, int64_t rows,
                            const lk_fuse_term *terms, size_t n_terms, const char *name, lk_kdelta **pp) {
    if (!name) name = "(tensor)";
    *pp = NULL;
    size_t R;
    lk_status st = lk_fuse_check_rows(out, in, row0, rows, name);
    if (st || (st = check_terms(out, in, terms, n_terms, name, &R))) return st;
    lk_kdelta *p = lk_calloc(1, sizeof *p);
    if (!p) return lk_error(LK_ERR_NOMEM, "%s: out of memory", name);
    const size_t I = (size_t)in, n = (size_t)rows, vsz = wide ? sizeof(double) : sizeof(float);
    const char *path = lk_fuse_kernel_path();
    *p = (lk_kdelta){.wide = wide, .R = R, .I = I, .row0 = (size_t)row0, .rows = n,
                         .fast = strcmp(path, "portable") != 0};
#ifdef LK_KERNEL_X86
    p->panels = !strncmp(path, "avx512", 6);
#endif
    if (R == 0) {
        *pp = p;
        return LK_OK;
    }
    const size_t pw = !p->panels ? I : wide ? LK_PW64 : LK_PW32, npan = (I + pw - 1) / pw;
    size_t at_a, at_b, at_tmp;
    lk_carve cv = {0};
    const size_t tot = lay_out_factors(&cv, npan, pw, n, R, I, vsz, &at_a, &at_b, &at_tmp);
    if (cv.overflow) {
        lk_free(p);
        return lk_error(LK_ERR_SHAPE, "%s: factors too large", name);
    }
    p->mem = lk_carve_alloc_aligned(&cv, 64); /* not zeroed: every part is written first */
    if (!p->mem) {
        lk_free(p);
        return lk_error(LK_ERR_NOMEM, "%s: out of memory for the fusion factors (%zu bytes)", name, tot);
    }
    p->A = p->mem + at_a;
    p->bs = p->mem + at_b;
    float *tmp = (float *)(void *)(p->mem + at_tmp);
    make_bs(p->bs, wide, R, (size_t)row0, n, terms, n_terms, tmp);
    make_panels(p->A, wide, pw, R, I, terms, n_terms, tmp);
    *pp = p;
    return LK_OK;
}

void lk_kdelta_rows(const lk_kdelta *p, void *delta, size_t ld, size_t row, size_t rows) {
    const size_t vsz = p->wide ? sizeof(double) : sizeof(float), I = p->I, R = p->R;
    if (R == 0) {
        for (size_t i = 0; i < rows; i++) memset((char *)delta + i * ld * vsz, 0, I * vsz);
        return;
    }
    const size_t r0 = row - p->row0; /* within the prepared rows */
    fenv_t saved;
    fegetenv(&saved);
    fesetenv(FE_DFL_ENV);
    if (p->wide) {
        const double *bs = (const double *)p->bs + r0 * R;
#ifdef LK_KERNEL_X86
        if (p->panels) lk_kdelta64_avx512(delta, ld, p->A, bs, R, I, rows);
        else if (p->fast) delta64_avx2(delta, ld, p->A, bs, R, I, rows);
        else
#endif
            delta64_portable(delta, ld, p->A, bs, R, I, rows);
    } else {
        const float *bs = (const float *)p->bs + r0 * R;
#ifdef LK_KERNEL_X86
        if (p->panels) lk_kdelta32_avx512(delta, ld, p->A, bs, R, I, rows);
        else if (p->fast) delta32_avx2(delta, ld, p->A, bs, R, I, rows);
        else
#endif
            delta32_portable(delta, ld, p->A, bs, R, I, rows);
    }
    fesetenv(&saved);
}

int lk_kdelta_panels(const lk_kdelta *p, const void **ap, const void **bs, size_t *R) {
    if (!p->panels || !p->R) return 0;
    *ap = p->A;
    *bs = p->bs;
    *R = p->R;
    return 1;
}

size_t lk_kdelta_factors(const lk_kdelta *p, const void **A, const void **bs, size_t *pw) {
    *A = p->A;
    *bs = p->bs;
    *pw = !p->R ? 0 : p->panels ? (p->wide ? LK_PW64 : LK_PW32) : p->I;
    return p->R;
}

void lk_kdelta_free(lk_kdelta *p) {
    if (!p) return;
    lk_free(p->mem);
    lk_free(p);
}

int lk_fuse_thread_count(const lk_fuse_opts *opts, size_t cap, size_t n_items) {
    int nw = opts && opts->threads > 0 ? opts->threads : lk_fuse_default_threads();
    if (nw > LK_FUSE_MAX_THREADS) nw = LK_FUSE_MAX_THREADS;
    if (cap < 1) cap = 1;
    if ((size_t)nw > cap) nw = (int)cap;
    if (n_items >= 1 && (size_t)nw > n_items) nw = (int)n_items;
    return nw;
}

lk_status lk_fuse_workers(int nw, size_t wsize, size_t per, void **workers, unsigned char **bufs, const char *name,
                          const char *what) {
    lk_carve cv = {0};
    const size_t o_wk = lk_carve_part(&cv, (size_t)nw, wsize, 64), o_buf = lk_carve_part(&cv, (size_t)nw, per, 64);
    unsigned char *block = cv.overflow ? NULL : lk_malloc(cv.bytes);
    *workers = block;
    if (!block) return lk_error(LK_ERR_NOMEM, "%s: out of memory for %d %s of %zu bytes", name, nw, what, per);
    memset(block + o_wk, 0, (size_t)nw * wsize);
    *bufs = block + o_buf;
    return LK_OK;
}

lk_status lk_fuse_workers_verdict(const void *workers, int nw, size_t stride, size_t at, size_t in,
                                  const lk_fuse_opts *opts, const char *name) {
    size_t bad_at = SIZE_MAX;
    double bw = 0, br = 0;
    for (int t = 0; t < nw; t++) {
        const lk_kworker *kw = (const lk_kworker *)(const void *)((const char *)workers + (size_t)t * stride + at);
        if (kw->bad_at < bad_at) bad_at = kw->bad_at, bw = kw->bad_w, br = kw->bad_r;
    }
    return lk_fuse_nonfinite(name, bad_at, in, bw, br, opts);
}

void lk_fuse_run_threads(int nw, void *(*fn)(void *), void *workers, size_t size) {
    pthread_t tid[LK_FUSE_MAX_THREADS];
    int started[LK_FUSE_MAX_THREADS] = {0};
    fenv_t saved;
    fegetenv(&saved);
    for (int t = 1; t < nw; t++)
        started[t] = pthread_create(&tid[t], NULL, fn, (char *)workers + (size_t)t * size) == 0;
    fn(workers);
    for (int t = 1; t < nw; t++)
        if (started[t]) pthread_join(tid[t], NULL);
    fesetenv(&saved);
}
