/* fp8.c — fusing LoRA terms into FP8 weights (lk_fuse_fp8) and finding
 * an FP8 weight's scale (lk_fp8_scale_of).
 *
 * The arithmetic, per element, in one chain whatever the thread or rank
 * count:
 *   1. the delta d = sum_t s_t * (B_t @ A_t) is the canonical narrow fp32
 *      chain (lk_fuse_delta_f32, fuse/fuse.h), the one BF16 and F16
 *      weights use;
 *   2. the real weight is decoded exactly: w = code * scale (an FP8 value
 *      has 4 significant bits, a scale 24, so the product is exact in
 *      double), and v = w + d in double;
 *   3. rescale: per tensor (scale [] or [1]) or per output row (scale [out]
 *      or [out,1]), amax = max |(float)v| and the new scale is exactly
 *      LTX-2's quantize_weight_to_fp8_per_tensor (ltx_core/quantization/
 *      fp8_scaled_mm.py): scale = fp8_max / amax in float32, stored as its
 *      float32 reciprocal: two roundings, reproduced bit for bit here, then
 *      rounded once (RNE) into the scale tensor's own dtype. A row or tensor
 *      whose amax is 0 keeps its scale (LTX would store 0);
 *   4. q = v / scale in double (the stored scale, new or kept), rounded once
 *      into FP8 (lk_fp8_from_double): to nearest-even, or stochastically
 *      with 32 random bits from a counter-based generator keyed by (seed,
 *      tensor name, element index): SplitMix64's finaliser over
 *      XXH3(name) ^ seed-mix + index, so the bytes do not depend on how rows
 *      are split over threads or ranks, nor on the run.
 * Steps 2 and 4 round twice in double (2^-53 relative each) before the one
 * FP8 rounding: the result is the correct FP8 rounding of the fp32-delta
 * value except when that value lies within ~2^-52 (relative) of an FP8
 * rounding boundary.
 * Overflow (lk_fp8_from_double's rule) under --fp8-scale keep or for plain
 * FP8 is LK_ERR_NONFINITE naming the tensor and the count of elements, or
 * clamps to +-max with saturate.
 * How: the factors are converted once (lk_fuse_delta_prepare); threads
 * take blocks of rows; a block's delta is computed by one
 * lk_fuse_delta_rows call into a per-thread F32 buffer (~1 MiB, so a weight
 * of any size is fused in bounded memory and the buffer stays in L2), then
 * steps 2-4 run row by row on it: 8 double lanes with AVX-512
 * (fp8_avx512.c) when lk_fuse_kernel_path is avx512, else branch-free C in
 * groups of 64 (round_generic below; compiled for AVX2 on the avx2 path,
 * where GCC vectorises it), both falling back to the per-element
 * definition (lk_fp8_round_portable) for rare lanes: the same bits. A per-row rescale takes the row's amax and rounds it in the
 * same pass; a per-tensor rescale needs the whole tensor's amax first, so
 * its delta is computed twice (once for the amax, once to round). */
#include "lorakit/fuse.h"
#include "lorakit/alloc.h"
#include "core/alloc.h"
#include "fuse/fuse.h"
#include "fuse/fp8.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <xxhash.h>

#define BLOCK_FLOATS ((size_t)1 << 18) /* a block of rows: ~1 MiB of f32 delta, per thread */

#define LK_FP8_AI static inline __attribute__((always_inline))

uint64_t lk_fp8_stream_key(uint64_t seed, const char *name) {
    return fp8_mix64(XXH3_64bits(name, strlen(name)) ^ fp8_mix64(seed + 0x9e3779b97f4a7c15ull));
}

uint32_t lk_fp8_random_bits(uint64_t key, uint64_t index) { return fp8_random_bits(key, index); }

double lk_fp8_scale_value(const void *p, lk_dtype d, size_t i) {
    float f;
    lk_to_f32(&f, (const unsigned char *)p + i * lk_dtype_size(d), d, 1);
    return (double)f;
}

/* Stores f into element i of a scale of dtype d (RNE) and returns the
 * stored value. */
static double scale_put(void *p, lk_dtype d, size_t i, float f) {
    unsigned char *b = (unsigned char *)p + i * lk_dtype_size(d);
    lk_from_f32(b, &f, d, 1);
    return lk_fp8_scale_value(p, d, i);
}

/* LTX-2's new scale for amax m: s = fp8_max / m (float32), stored as the
 * float32 1 / s, then in the scale's dtype (element i of scale): sets *sc
 * to the stored value. A zero or non-finite amax (or stored value) keeps
 * the scale (LTX would store 0). */
void lk_fp8_rescale(void *scale, lk_dtype sdtype, size_t i, float fmax, float m, double *sc) {
    if (!(m > 0.0f) || !isfinite(m)) return;
    float inv = fmax / m;
    float stored = 1.0f / inv;
    if (!(stored > 0.0f) || !isfinite(stored)) return;
    *sc = scale_put(scale, sdtype, i, stored);
}

/* ---- row blocks, shared by the threads ----
 * Threads take blocks of rows from an atomic counter; what an element gets
 * does not depend on who computes it: the delta is per element, the amax a
 * max (order-free), the stochastic bits keyed by the element's index. */

typedef struct fjob {
    uint8_t *w;
    lk_dtype dtype;
    size_t O, I, rb, n_blocks;
    int per_row, pass;
    const lk_delta_prep *prep; /* the factors, converted once for every block */
    const double *s0;      /* the stored scales (per row, or [0]) */
    double *sc;            /* the divide-by scales: kept or new */
    void *scale;           /* pass 2 with row_rescale: rewritten row by row */
    lk_dtype sdtype;
    float fmax;
    int row_rescale;       /* per-row scales, rescaled in the rounding pass */
    const char *name;
    lk_fp8_ctx x;
    lk_fp8_amax_fn amax;
    lk_fp8_round_fn round;
    atomic_size_t next;
} fjob;

typedef struct fworker {
    fjob *job;
    float *blk;
    void *scratch;      /* lk_fuse_delta_rows' (LoHa terms) */
    float amax;         /* pass 1, per-tensor scale */
    lk_fp8_stats stats; /* pass 2 */
} fworker;

/* ---- the same epilogue, branch-free plain C (the avx2 and portable
 * paths): groups of 8 elements computed lane by lane with selects instead
 * of branches (so the compiler vectorises the group loop), exactly
 * fp8_avx512.c's method in C; the lanes it does not cover (an Inf/NaN
 * code, a non-finite v, |q| beyond max, in stochastic mode a q below 2^-63
 * quanta) are redone by lk_fp8_round_portable. */

#define GRP 64

LK_FP8_AI void round_group(const lk_fp8_ctx *x, uint8_t *w, const float *d, double s_old, double s_new, size_t e0,
                           lk_fp8_stats *st, const int mb, const int bias, const int special, const double fmax,
                           const int stoch, const int divide) {
    const int64_t emin = 1 - bias;
    const double quantum = lk_u2d((uint64_t)(1023 + 1 - bias - mb) << 52);
    uint8_t out[GRP];
    int rare[GRP];
    for (int i = 0; i < GRP; i++) {
        const uint64_t c = w[i], mag = c & 0x7f, is_sub = -(uint64_t)(mag < (1u << mb));
        /* decode: a normal code's fields rebiased; a subnormal's integer
         * times the quantum (both exact); selected by mask, not branch */
        const uint64_t nb = (mag << (52 - mb)) + ((uint64_t)(1023 - bias) << 52);
        const uint64_t sb = lk_d2u((double)(int32_t)mag * quantum);
        const double v = lk_u2d((sb & is_sub) | (nb & ~is_sub) | (c & 0x80) << 56) * s_old + (double)d[i];
        const double q = divide ? v / s_new : v;
        const uint64_t u = lk_d2u(q);
        const int64_t e = (int64_t)((u >> 52) & 0x7ff) - 1023;
        const uint64_t m = (u & 0xfffffffffffffull) | 1ull << 52;
        const int64_t ec = e < emin ? emin : e;
        const int64_t sh = ec - e + 52 - mb;
        rare[i] = (mag >= (uint64_t)special) | !(fabs(v) <= 1.7976931348623157e308) | !(fabs(q) <= fmax) |
                  (stoch & (sh > 63));
        const uint64_t shu = (uint64_t)(sh > 63 ? 63 : sh); /* nearest: as in fp8_avx512.c */
        const uint64_t r = m >> shu, rem = m - (r << shu);
        uint64_t up;
        if (stoch) {
            const uint64_t rb = fp8_random_bits(x->key, e0 + (size_t)i);
            up = (rb << (shu - 32)) < rem;
        } else {
            /* the dropped bits moved to the top (shu is 49..63): half is 2^63 */
            const uint64_t t = rem << (64 - shu), half = 1ull << 63;
            up = (t > half) | ((t == half) & r);
        }
        out[i] = (uint8_t)((((uint64_t)(ec + bias - 1) << mb) + r + (up & 1)) | (u >> 56 & 0x80));
    }
    for (int i = 0; i < GRP; i++)
        if (rare[i]) lk_fp8_round_portable(x, w + i, d + i, 1, s_old, s_new, e0 + (size_t)i, st);
        else w[i] = out[i];
}

LK_FP8_AI void round_generic(const lk_fp8_ctx *x, uint8_t *w, const float *d, size_t n, double s_old,
                             double s_new, size_t e0, lk_fp8_stats *st) {
    /* one instance per format x rounding x division (a constant each, so
     * the group loop has no branch left) */
    const int sel = (x->fmt->mbits == 3) * 4 + x->stoch * 2 + (s_new != 1.0);
    size_t c = 0;
#define GROUP(mb, bias, special, fmax, sto, dv) \
    round_group(x, w + c, d + c, s_old, s_new, e0 + c, st, mb, bias, special, fmax, sto, dv)
    for (; c + GRP <= n; c += GRP) switch (sel) {
        case 7: GROUP(3, 7, 0x7f, 448.0, 1, 1); break;
        case 6: GROUP(3, 7, 0x7f, 448.0, 1, 0); break;
        case 5: GROUP(3, 7, 0x7f, 448.0, 0, 1); break;
        case 4: GROUP(3, 7, 0x7f, 448.0, 0, 0); break;
        case 3: GROUP(2, 15, 0x7c, 57344.0, 1, 1); break;
        case 2: GROUP(2, 15, 0x7c, 57344.0, 1, 0); break;
        case 1: GROUP(2, 15, 0x7c, 57344.0, 0, 1); break;
        default: GROUP(2, 15, 0x7c, 57344.0, 0, 0); break;
        }
#undef GROUP
    lk_fp8_round_portable(x, w + c, d + c, n - c, s_old, s_new, e0 + c, st);
}

static void round_generic_base(const lk_fp8_ctx *x, uint8_t *w, const float *d, size_t n, double s_old,
                               double s_new, size_t e0, lk_fp8_stats *st) {
    round_generic(x, w, d, n, s_old, s_new, e0, st);
}
#ifdef LK_FP8_X86
__attribute__((target("avx2,fma"))) static void round_generic_avx2(const lk_fp8_ctx *x, uint8_t *w, const float *d,
                                                                  size_t n, double s_old, double s_new, size_t e0,
                                                                  lk_fp8_stats *st) {
    round_generic(x, w, d, n, s_old, s_new, e0, st);
}
#endif

static void fp8_block(fworker *wk, size_t b) {
    fjob *j = wk->job;
    size_t r0 = b * j->rb, rows = j->O - r0 < j->rb ? j->O - r0 : j->rb, I = j->I;
    lk_fuse_delta_rows(j->prep, wk->blk, I, r0, rows, wk->scratch);
    for (size_t r = 0; r < rows; r++) {
        size_t row = r0 + r, si = j->per_row ? row : 0;
        uint8_t *wr = j->w + row * I;
        const float *d = wk->blk + r * I;
        if (j->pass == 1) {
            wk->amax = j->amax(&j->x, wr, d, I, j->s0[si], wk->amax);
            continue;
        }
        if (j->row_rescale) /* this row's amax, from the delta still in cache */
            lk_fp8_rescale(j->scale, j->sdtype, row, j->fmax, j->amax(&j->x, wr, d, I, j->s0[si], 0.0f), &j->sc[si]);
        j->round(&j->x, wr, d, I, j->s0[si], j->sc[si], row * I, &wk->stats);
    }
}

static void *fp8_worker(void *arg) {
    fworker *wk = arg;
    for (;;) {
        size_t b = atomic_fetch_add(&wk->job->next, 1);
        if (b >= wk->job->n_blocks) break;
        fp8_block(wk, b);
    }
    return NULL;
}

/* One pass over every block on nw workers (worker 0 is this thread; a
 * thread that does not start leaves its blocks to the others). */
static void fp8_pass(fjob *j, fworker *wk, int nw, int pass) {
    j->pass = pass;
    atomic_store(&j->next, 0);
    pthread_t tid[LK_FUSE_MAX_THREADS];
    int started[LK_FUSE_MAX_THREADS] = {0};
    for (int t = 1; t < nw; t++) started[t] = pthread_create(&tid[t], NULL, fp8_worker, &wk[t]) == 0;
    fp8_worker(&wk[0]);
    for (int t = 1; t < nw; t++)
        if (started[t]) pthread_join(tid[t], NULL);
}

/* lk_fuse_fp8's arguments, checked before anything is touched: a bad scale
 * is refused, not fused. */
lk_status lk_fp8_check_args(const void *w, lk_dtype dtype, int64_t out, int64_t in, const void *scale, lk_dtype sdtype,
                            int64_t n_scale, const lk_fuse_term *terms, size_t k, const char *name) {
    if (!w) return lk_error(LK_ERR_ARG, "%s: NULL weight buffer", name);
    if (!lk_dtype_is_fp8(dtype))
        return lk_error(LK_ERR_DTYPE, "%s: lk_fuse_fp8 on a %s weight", name, lk_dtype_name(dtype));
    if (out <= 0 || in <= 0)
        return lk_error(LK_ERR_SHAPE, "%s: weight shape %lldx%lld", name, (long long)out, (long long)in);
    if (scale && sdtype != LK_DTYPE_F32 && sdtype != LK_DTYPE_BF16 && sdtype != LK_DTYPE_F16)
        return lk_error(LK_ERR_DTYPE, "%s: scale dtype %s (expected F32, BF16 or F16)", name, lk_dtype_name(sdtype));
    if (scale && n_scale != 1 && n_scale != out)
        return lk_error(LK_ERR_SHAPE, "%s: %lld scale values for %lld rows (expected 1 or one per row)", name,
                        (long long)n_scale, (long long)out);
    if (k && !terms) return lk_error(LK_ERR_ARG, "%s: NULL terms", name);
    for (size_t t = 0; t < k; t++)
        if (lk_fuse_term_sliced(&terms[t]))
            return lk_error(LK_ERR_UNSUPPORTED, "%s: a LoRA module on a row slice (part of a fused projection) of an "
                            "FP8 weight is not supported", name);
    if (!scale) return LK_OK;
    char label[512];
    snprintf(label, sizeof label, "%s's scale", name);
    return lk_fp8_scale_values_check(label, scale, sdtype, n_scale);
}

/* One lk_fuse_fp8 call: its split, the factors, and the one allocation that
 * the scales, the workers, their delta blocks and their scratch are carved
 * from (the job and the workers live here while the passes run). */
typedef struct fcall {
    size_t O, I, rb, n_blocks, NS; /* NS: scale values used (O per row, else 1) */
    int nw, per_row, rescale;
    lk_delta_prep *prep;
    unsigned char *mem;            /* lk_free */
    double *s0;                    /* the stored scales, then (NS on) the divide-by ones */
    float *blks;                   /* per worker rb x I of delta */
    unsigned char *scr;            /* per worker sb bytes of lk_fuse_delta_rows scratch */
    size_t sb;
    fworker *wk;
    fjob job;
    float dec[256];                /* every code's value */
} fcall;

/* The split: nw workers over blocks of rb rows, ~BLOCK_FLOATS each, at
 * least 4 per thread when the tensor has the rows for it, never under 16
 * rows (or the whole). */
static void fcall_plan(fcall *f, int64_t out, int64_t in, const void *scale, int64_t n_scale, const lk_fuse_opts *opts) {
    f->O = (size_t)out;
    f->I = (size_t)in;
    f->per_row = scale && n_scale == out && out > 1;
    f->rescale = scale && opts->fp8.scale == LK_FP8_RESCALE;
    f->NS = f->per_row ? f->O : 1;
    int nw = opts->threads > 0 ? opts->threads : lk_fuse_default_threads();
    if (nw > LK_FUSE_MAX_THREADS) nw = LK_FUSE_MAX_THREADS;
    size_t rb = BLOCK_FLOATS / f->I, per = (f->O + 4 * (size_t)nw - 1) / (4 * (size_t)nw);
    if (rb > per) rb = per;
    if (rb < 16) rb = 16;
    if (rb > f->O) rb = f->O;
    f->rb = rb;
    f->n_blocks = (f->O + rb - 1) / rb;
    if ((size_t)nw > f->n_blocks) nw = (int)f->n_blocks;
    f->nw = nw;
}

/* f->mem, carved (each part on a cache line) into s0 (2 NS doubles), the
 * nw workers, their delta blocks and their scratch (sized by f->prep). */
static lk_status fcall_alloc(fcall *f, const char *name) {
    const size_t nw = (size_t)f->nw;
    size_t blk = 0, scr = 0;
    f->sb = lk_fuse_delta_scratch(f->prep, f->rb);
    /* the parts on cache lines from a start on one (lk_carve_alloc_aligned,
     * not zeroed: every part is written before it is read, and zeroing MBs
     * per call would cost) */
    lk_carve cv = {.overflow = !lk_checked_mul(f->rb, f->I, &blk) || !lk_checked_mul(blk, nw, &blk) ||
                               !lk_checked_mul(f->sb, nw, &scr)};
    const size_t at_s0 = lk_carve_part(&cv, 2 * f->NS, sizeof(double), 64),
                 at_wk = lk_carve_part(&cv, nw, sizeof(fworker), 64), at_blk = lk_carve_part(&cv, blk, sizeof(float), 64),
                 at_scr = lk_carve_part(&cv, scr, 1, 64);
    if (!(f->mem = lk_carve_alloc_aligned(&cv, 64)))
        return lk_error(LK_ERR_NOMEM, "%s: out of memory for the FP8 fuse", name);
    f->s0 = (double *)(void *)(f->mem + at_s0);
    f->wk = (fworker *)(void *)(f->mem + at_wk);
    f->blks = (float *)(void *)(f->mem + at_blk);
    f->scr = f->sb ? f->mem + at_scr : NULL;
    return LK_OK;
}

/* The job the workers share: the scales read once (both copies), the code
 * table of dtype, the rounding (stream key of the tensor's name), and the
 * amax and round functions of the kernel path in use; every worker fresh. */
static void fcall_job(fcall *f, uint8_t *w, lk_dtype dtype, void *scale, lk_dtype sdtype, const lk_fp8_opts *fo,
                      const char *name) {
    double *sc = f->s0 + f->NS;
    for (size_t r = 0; r < f->NS; r++) f->s0[r] = sc[r] = scale ? lk_fp8_scale_value(scale, sdtype, r) : 1.0;
    const fp8fmt *fmt = dtype == LK_DTYPE_F8_E5M2 ? &LK_FP8_E5M2_FMT : &LK_FP8_E4M3_FMT;
    for (int c = 0; c < 256; c++) f->dec[c] = fp8_to_f32((uint8_t)c, fmt);
    f->job = (fjob){.w = w, .dtype = dtype, .O = f->O, .I = f->I, .rb = f->rb, .n_blocks = f->n_blocks,
                    .per_row = f->per_row, .prep = f->prep, .s0 = f->s0, .sc = sc, .name = name,
                    .scale = scale, .sdtype = sdtype, .fmax = (float)lk_fp8_max(dtype),
                    .row_rescale = f->rescale && f->per_row,
                    .x = {.fmt = fmt, .stoch = fo->rounding == LK_FP8_STOCHASTIC,
                          .key = lk_fp8_stream_key(fo->seed, name), .dec = f->dec},
                    .amax = lk_fp8_amax_portable, .round = round_generic_base};
#ifdef LK_FP8_X86
    const char *path = lk_fuse_kernel_path();
    if (!strncmp(path, "avx512", 6)) { /* avx512 or avx512bf16 */
        f->job.amax = lk_fp8_amax_avx512;
        f->job.round = lk_fp8_round_avx512;
    } else if (!strcmp(path, "avx2")) {
        f->job.round = round_generic_avx2;
    }
#endif
    for (int t = 0; t < f->nw; t++)
        f->wk[t] = (fworker){.job = &f->job, .blk = f->blks + (size_t)t * f->rb * f->I,
                             .scratch = f->scr ? f->scr + (size_t)t * f->sb : NULL, .stats = {.bad_e = SIZE_MAX}};
}

/* The passes: for a per-tensor rescale, pass 1 takes the amax of the fused
 * values (as float32, over the whole tensor) and sets the new scale; pass
 * 2 (per-row rescale and) rounds once into FP8, in place. */
static void fcall_run(fcall *f) {
    if (f->rescale && !f->per_row) {
        fp8_pass(&f->job, f->wk, f->nw, 1);
        float amax = 0.0f;
        for (int t = 0; t < f->nw; t++) amax = fmaxf(amax, f->wk[t].amax);
        lk_fp8_rescale(f->job.scale, f->job.sdtype, 0, f->job.fmax, amax, &f->job.sc[0]);
    }
    fp8_pass(&f->job, f->wk, f->nw, 2);
}

/* The workers' findings: the first element that became non-finite from
 * finite inputs (unless allowed), then the overflow count (unless
 * saturated), as errors naming the tensor. */
static lk_status fcall_verdict(const fcall *f, const lk_fuse_opts *opts, const char *name) {
    size_t over = 0, bad_e = SIZE_MAX;
    double bad_v = 0;
    for (int t = 0; t < f->nw; t++) {
        over += f->wk[t].stats.over;
        if (f->wk[t].stats.bad_e < bad_e) {
            bad_e = f->wk[t].stats.bad_e;
            bad_v = f->wk[t].stats.bad_v;
        }
    }
    return lk_fp8_verdict(name, f->job.dtype, f->O, f->I, over, bad_e, bad_v, f->rescale, f->job.scale != NULL, opts);
}

lk_status lk_fp8_verdict(const char *name, lk_dtype dtype, size_t O, size_t I, size_t over, size_t bad_e, double bad_v,
                         int rescale, int scaled, const lk_fuse_opts *opts) {
    if (bad_e != SIZE_MAX && !opts->allow_nonfinite)
        return lk_error(LK_ERR_NONFINITE, "%s: element [%zu, %zu] becomes %g from finite inputs", name, bad_e / I,
                        bad_e % I, bad_v);
    if (over && !opts->fp8.saturate)
        return lk_error(LK_ERR_NONFINITE, "%s: %zu of %zu elements overflow %s (beyond +-%g after dividing by the %s "
                        "scale); --fp8-saturate clamps them%s", name, over, O * I, lk_dtype_name(dtype),
                        lk_fp8_max(dtype), rescale ? "new" : scaled ? "kept" : "(plain, 1)",
                        scaled && !rescale ? ", --fp8-scale rescale recomputes the scale" : "");
    return LK_OK;
}

/* Terms that read the weight (oft.c) on an FP8 weight: the weight's real
 * values w = code x scale (rounded to f32), then an OFT rotation's delta
 * d (f64, rounded to f32) becomes the dense term {d, scale 1} (acc(1 d) is d
 * itself), GLoRA's W a1 a2 the LoRA term of W a1; *xt the terms to fuse,
 * *mem (lk_free) what holds them. */
static lk_status fp8_wterms(const uint8_t *w, lk_dtype dtype, int64_t out, int64_t in, const void *scale,
                            lk_dtype sdtype, int64_t n_scale, const lk_fuse_term *terms, size_t k,
                            const lk_fuse_opts *opts, const char *name, const lk_fuse_term **xt, size_t *nk,
                            void **mem) {
    const size_t O = (size_t)out, I = (size_t)in, numel = O * I;
    lk_carve cv = {0};
    const size_t o_w = LK_CARVE(&cv, numel, float), o_d = LK_CARVE(&cv, numel, float),
                 o_t = LK_CARVE(&cv, 1, lk_fuse_term), o_v = LK_CARVE(&cv, 1, lk_tensor);
    unsigned char *m = cv.overflow ? NULL : lk_carve_alloc(&cv);
    if (!m) return lk_error(LK_ERR_NOMEM, "%s: out of memory for the FP8 weight's values", name);
    float *wv = (float *)(void *)(m + o_w), *dv = (float *)(void *)(m + o_d);
    lk_to_f32(wv, w, dtype, numel);
    for (size_t o = 0; scale && o < O; o++) {
        const double sc = lk_fp8_scale_value(scale, sdtype, n_scale == 1 ? 0 : o);
        for (size_t j = 0; j < I; j++) wv[o * I + j] = (float)((double)wv[o * I + j] * sc);
    }
    const lk_fuse_term *oft = NULL;
    for (size_t t = 0; t < k; t++)
        if (terms[t].scale != 0.0 && terms[t].kind == LK_TERM_OFT) oft = &terms[t];
    void *xm = NULL;
    lk_status s = lk_fuse_expand_wterms(wv, out, in, terms, k, xt, &xm, name);
    if (s || !oft) { /* GLoRA: the expanded terms no longer need the values */
        lk_free(m);
        *mem = xm;
        return s;
    }
    lk_oft *p; /* an OFT term is alone (lk_fuse_expand_wterms checked): xm is NULL */
    s = lk_oft_prepare(oft, out, opts->convention, name, &p);
    if (!s) s = lk_oft_delta_f32(p, wv, dv, I, name);
    lk_oft_free(p);
    if (s) {
        lk_free(m);
        return s;
    }
    lk_tensor *v = (lk_tensor *)(void *)(m + o_v);
    lk_fuse_term *dt = (lk_fuse_term *)(void *)(m + o_t);
    *v = (lk_tensor){.name = oft->B->name, .dtype = LK_DTYPE_F32, .ndim = 2, .shape = {out, in},
                     .nbytes = numel * sizeof(float), .data = dv};
    *dt = (lk_fuse_term){.B = v, .scale = 1.0, .kind = LK_TERM_DENSE};
    *xt = dt;
    *nk = 1;
    *mem = m;
    return LK_OK;
}

/* Check, split, convert the factors (lk_fuse_delta_prepare: validated
 * once, the message this thread's), allocate, build the job, run the
 * passes, report. The weight and its scale are written only by the run. */
lk_status lk_fuse_fp8(uint8_t *w, lk_dtype dtype, int64_t out, int64_t in, void *scale, lk_dtype sdtype,
                      int64_t n_scale, const lk_fuse_term *terms, size_t k, const lk_fuse_opts *opts,
                      const char *name) {
    if (!name) name = "(tensor)";
    lk_status s = lk_cancel_check(opts ? opts->cancel : NULL, name);
    if (s) return s;
    s = lk_fp8_check_args(w, dtype, out, in, scale, sdtype, n_scale, terms, k, name);
    if (s) return s;
    static const lk_fuse_opts defaults;
    if (!opts) opts = &defaults;
    const lk_fuse_term *xt = terms;
    void *xmem = NULL;
    if (lk_fuse_wterms(terms, k) &&
        (s = fp8_wterms(w, dtype, out, in, scale, sdtype, n_scale, terms, k, opts, name, &xt, &k, &xmem)))
        return s;
    fcall f;
    memset(&f, 0, sizeof f);
    fcall_plan(&f, out, in, scale, n_scale, opts);
    if (!(s = lk_fuse_delta_prepare(0, out, in, 0, out, xt, k, name, &f.prep)) && !(s = fcall_alloc(&f, name))) {
        fcall_job(&f, w, dtype, scale, sdtype, &opts->fp8, name);
        fcall_run(&f);
        s = fcall_verdict(&f, opts, name);
    }
    lk_fuse_delta_free(f.prep);
    lk_free(f.mem);
    lk_free(xmem);
    return s;
}

/* "scale" anywhere in s (ASCII case-insensitive). */
static int mentions_scale(const char *s) {
    for (; *s; s++)
        if ((s[0] | 32) == 's' && (s[1] | 32) == 'c' && (s[2] | 32) == 'a' && (s[3] | 32) == 'l' &&
            (s[4] | 32) == 'e')
            return 1;
    return 0;
}

lk_status lk_fp8_scale_of(const lk_tensor *model, size_t n, size_t wi, long *scale) {
    *scale = -1;
    const lk_tensor *w = &model[wi];
    size_t nl = strlen(w->name), ml = nl;
    if (nl > 7 && !strcmp(w->name + nl - 7, ".weight")) ml = nl - 7; /* the module "<m>" of "<m>.weight" */
    int marker = 0;
    long ws = -1, sw = -1;
    for (size_t i = 0; i < n; i++)
        if (!strcmp(model[i].name, "scaled_fp8")) marker = 1;
    for (size_t i = 0; i < n; i++) {
        const char *nm = model[i].name;
        if (i == wi || strncmp(nm, w->name, ml) || nm[ml] != '.') continue;
        const char *rest = nm + ml + 1;
        if (strchr(rest, '.') || !mentions_scale(rest)) continue; /* not a direct sibling about scales */
        if (!strcmp(rest, "input_scale") || !strcmp(rest, "scale_input")) continue; /* activations: copied */
        if (!strcmp(rest, "weight_scale")) ws = (long)i;
        else if (!strcmp(rest, "scale_weight") && marker) sw = (long)i;
        else
            return lk_error(LK_ERR_UNSUPPORTED, "%s: FP8 weight with a scale tensor %s that lorakit does not know "
                            "(block-wise or another layout); refusing to fuse it as if plain", w->name, nm);
    }
    if (ws >= 0 && sw >= 0)
        return lk_error(LK_ERR_UNSUPPORTED, "%s: FP8 weight with both %s and %s", w->name, model[ws].name,
                        model[sw].name);
    long si = ws >= 0 ? ws : sw;
    if (si < 0) return LK_OK;
    const lk_tensor *s = &model[si];
    if (s->dtype != LK_DTYPE_F32 && s->dtype != LK_DTYPE_BF16 && s->dtype != LK_DTYPE_F16)
        return lk_error(LK_ERR_UNSUPPORTED, "%s: scale %s is %s (expected F32, BF16 or F16)", w->name, s->name,
                        lk_dtype_name(s->dtype));
    int64_t out = w->ndim >= 2 ? w->shape[0] : -1; /* a conv weight [out, in, kh, kw] too */
    int ok = s->ndim == 0 || (s->ndim == 1 && (s->shape[0] == 1 || s->shape[0] == out)) ||
             (s->ndim == 2 && s->shape[0] == out && s->shape[1] == 1);
    if (!ok) {
        char sh[96], wsh[96];
        lk_shape_str(s, sh, sizeof sh);
        lk_shape_str(w, wsh, sizeof wsh);
        return lk_error(LK_ERR_UNSUPPORTED, "%s: scale %s has shape %s; for a %s weight lorakit fuses per-tensor "
                        "([], [1]) and per-channel ([out], [out, 1]) scales, not block-wise ones", w->name, s->name,
                        sh, wsh);
    }
    *scale = si;
    return LK_OK;
}

lk_status lk_fp8_scale_values_check(const char *name, const void *values, lk_dtype dtype, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        float v;
        lk_to_f32(&v, (const char *)values + (size_t)i * lk_dtype_size(dtype), dtype, 1);
        if (isfinite(v) && v > 0.0f) continue;
        char vb[LK_NUM_STR_MAX], at[48] = "";
        if (n > 1) snprintf(at, sizeof at, " at [%lld]", (long long)i);
        return lk_error(LK_ERR_FORMAT, "%s: FP8 scale%s is %s; a scale must be finite and > 0 (the weight is code x "
                        "scale: %s)", name, at, lk_num_str(v, vb),
                        isnan(v) ? "NaN would make every code NaN" : isinf(v) ? "Inf would make every code Inf or NaN"
                        : v == 0.0f ? "0 would erase the weight" : "a negative scale flips the weight's sign");
    }
    return LK_OK;
}

lk_status lk_fp8_rounding_parse(const char *s, lk_fp8_rounding *out) {
    if (s && !strcmp(s, "nearest")) *out = LK_FP8_NEAREST;
    else if (s && !strcmp(s, "stochastic")) *out = LK_FP8_STOCHASTIC;
    else return lk_error(LK_ERR_ARG, "FP8 rounding '%s' (valid: nearest, stochastic)", s ? s : "");
    return LK_OK;
}

lk_status lk_fp8_scale_parse(const char *s, lk_fp8_scale_mode *out) {
    if (s && !strcmp(s, "rescale")) *out = LK_FP8_RESCALE;
    else if (s && !strcmp(s, "keep")) *out = LK_FP8_KEEP;
    else return lk_error(LK_ERR_ARG, "FP8 scale mode '%s' (valid: rescale, keep)", s ? s : "");
    return LK_OK;
}
