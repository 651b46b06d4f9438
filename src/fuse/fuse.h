/* fuse/fuse.h — shared between the files of src/fuse, and the internal
 * API other modules use to reproduce the fuse kernel's arithmetic exactly
 * (DoRA's row norms, FP8 weights). Not installed, not public.
 *
 * The canonical arithmetic (the full statement is at the top of kernel.c
 * and in the README): for a weight element W[o, j] and the terms t in the
 * order given, with ranks r_t stacked into k = 0 .. R-1,
 *   narrow (BF16, F16, FP8 weights):  B'[o,k] = fl32(scale_t * B_t[o,k'])
 *       d = fl32(B'[o,0] * A[0,j]);  d = fmaf(B'[o,k], A[k,j], d), k = 1 .. R-1
 *   wide (F32 weights):               B'[o,k] = (double)scale_t * B_t[o,k'] (exact)
 *       d = fl64(B'[o,0] * A[0,j]);  d = fma (B'[o,k], A[k,j], d), k = 1 .. R-1
 * then W + d is rounded once into the weight's dtype: the sum is rounded
 * to odd in the accumulator's format (lk_fuse_add_odd_f32/_f64 below), and
 * that value is rounded to nearest-even into the weight's dtype. Because
 * the accumulator has at least two more bits than the weight's dtype, this
 * equals the correctly rounded value of the exact W + d. */
#ifndef LK_FUSE_FUSE_H
#define LK_FUSE_FUSE_H

#include <stddef.h>
#include <stdint.h>
#include "lorakit/fuse.h"
#include "lorakit/fuse_device.h"

#define LK_FUSE_MAX_THREADS 256

/* Online CPUs, clamped to [1, LK_FUSE_MAX_THREADS]. */
int lk_fuse_default_threads(void);

/* The canonical delta of rows [row0, row0 + rows) of an out x in weight:
 * delta[i * ld + j] = d for element (row0 + i, j), with d the narrow chain
 * above (lk_fuse_delta_f32: what BF16/F16/FP8 weights use) or the wide one
 * (lk_fuse_delta_f64: what F32 weights use). Terms with scale 0 are
 * skipped, exactly as lk_fuse_tensor skips them; the order of `terms` is
 * the summation order (callers pass the canonical order). Rows with no
 * non-zero term get d = +0. The factors are validated as lk_fuse_tensor
 * validates them (same errors, naming `name`); A is converted once per
 * call, so call with many rows at a time, not one. Thread-free.
 *
 * Byte-for-byte agreement with lk_fuse_tensor, for a BF16 or F16 weight w:
 *   lk_from_f32(out, &(float){lk_fuse_round_f32(w_as_f32, d)}, dtype, 1)
 * and for an F32 weight: lk_fuse_round_f64_to_f32(w, d). */
/* 1 if the term is a row slice (slice > 0). */
int lk_fuse_term_sliced(const lk_fuse_term *t);

lk_status lk_fuse_delta_f32(float *delta, size_t ld, int64_t out, int64_t in, int64_t row0, int64_t rows,
                            const lk_fuse_term *terms, size_t n_terms, const char *name);
lk_status lk_fuse_delta_f64(double *delta, size_t ld, int64_t out, int64_t in, int64_t row0, int64_t rows,
                            const lk_fuse_term *terms, size_t n_terms, const char *name);

/* The same in two steps, for callers that take many row ranges of one
 * weight (FP8 workers): lk_fuse_delta_prepare validates as above and
 * converts the factors once (B' of rows [row0, row0 + rows), A packed for
 * the kernel path); lk_fuse_delta_rows then writes the delta of rows
 * [row, row + n) (inside the prepared ones) and may run on many threads
 * at once; lk_fuse_delta_free releases it. wide: the f64 chain. */
/* Terms of every kind (terms.c): the LoRA terms' stacked chain first, then
 * each other term's delta added in term order (terms.c says how). A call
 * needs lk_fuse_delta_scratch(p, n) bytes of scratch (0 for LoRA terms
 * alone, when scratch may be NULL); each concurrent caller passes its own. */
typedef struct lk_delta_prep lk_delta_prep;
typedef struct lk_kdelta lk_kdelta; /* the LoRA terms' chain (kernel.c), below */
lk_status lk_fuse_delta_prepare(int wide, int64_t out, int64_t in, int64_t row0, int64_t rows,
                                const lk_fuse_term *terms, size_t n_terms, const char *name, lk_delta_prep **p);
size_t lk_fuse_delta_scratch(const lk_delta_prep *p, size_t n);
void lk_fuse_delta_rows(const lk_delta_prep *p, void *delta, size_t ld, size_t row, size_t n, void *scratch);
void lk_fuse_delta_free(lk_delta_prep *p);
/* What a preparation holds, for the device kernels (kernel_dev.c), which
 * chain over these very buffers: returns the LoRA terms' stacked chain
 * (NULL: none), *nx the other live terms, and the first max of them into
 * x, in term order: a dense delta (scale, D), LoHa's two prepared products
 * (p1 with the term's scale, p2 with 1) or LoKr's acc(s W1) (a x b) and
 * acc(W2) (c x D), f32 narrow / f64 wide. */
typedef struct lk_delta_xpart {
    lk_term_kind kind;
    double scale;
    const lk_tensor *dense;
    const lk_kdelta *p1, *p2;
    const void *w1, *w2;
    size_t a, b, c, D;
} lk_delta_xpart;
const lk_kdelta *lk_fuse_delta_parts(const lk_delta_prep *p, lk_delta_xpart *x, size_t max, size_t *nx);
/* The same for LoRA terms only (kernel.c), what lk_fuse_delta_* build on. */

lk_status lk_kdelta_prepare(int wide, int64_t out, int64_t in, int64_t row0, int64_t rows,
                            const lk_fuse_term *terms, size_t n_terms, const char *name, lk_kdelta **p);
void lk_kdelta_rows(const lk_kdelta *p, void *delta, size_t ld, size_t row, size_t n);
void lk_kdelta_free(lk_kdelta *p);
/* The prepared factors whatever their layout, for the device kernels:
 * returns R (0: no live term); *bs B' of the prepared rows (rows x R, f32
 * narrow / f64 wide), *A A's values: element (k, j) at
 * ((j / pw) * R + k) * pw + j % pw, where pw is LK_PW32 / LK_PW64 in
 * panels (zero past column in) or in when A is plain R x in. */
size_t lk_kdelta_factors(const lk_kdelta *p, const void **A, const void **bs, size_t *pw);
/* The prepared factors when they are in panels (an AVX-512 path): *ap the
 * panels of A (LK_PW32 f32 columns narrow, LK_PW64 f64 wide), *bs B' of
 * the prepared rows, *R the rank; returns 0 (and sets nothing) otherwise. */
int lk_kdelta_panels(const lk_kdelta *p, const void **ap, const void **bs, size_t *R);

/* The FP8 fuse's pieces (fp8.c) that the device path (kernel_dev.c) runs
 * around its kernel, so both give the same checks, scales and errors:
 * lk_fuse_fp8's argument checks (w is only tested for NULL; scale holds
 * the values, on the host); element i of a scale as a double; LTX-2's new
 * scale for amax m stored into element i (*sc: the stored value; a zero or
 * non-finite amax keeps it); the verdict on the overflow count and the
 * first element made non-finite (bad_e, SIZE_MAX: none; bad_v its value). */
lk_status lk_fp8_check_args(const void *w, lk_dtype dtype, int64_t out, int64_t in, const void *scale, lk_dtype sdtype,
                            int64_t n_scale, const lk_fuse_term *terms, size_t k, const char *name);
double lk_fp8_scale_value(const void *p, lk_dtype d, size_t i);
void lk_fp8_rescale(void *scale, lk_dtype sdtype, size_t i, float fmax, float m, double *sc);
lk_status lk_fp8_verdict(const char *name, lk_dtype dtype, size_t O, size_t I, size_t over, size_t bad_e, double bad_v,
                         int rescale, int scaled, const lk_fuse_opts *opts);

/* The error for the first element (bad_at = o * in + j, SIZE_MAX: none) a
 * fuse made non-finite from weight w to r, unless opts allow it. */
lk_status lk_fuse_nonfinite(const char *name, size_t bad_at, size_t in, double w, double r, const lk_fuse_opts *opts);
/* A weight of out x in rows and a row range [row0, row0 + rows) inside it. */
lk_status lk_fuse_check_rows(int64_t out, int64_t in, int64_t row0, int64_t rows, const char *name);
/* lk_fuse_file_src for one checkpoint (fuse_file.c): a single file, an index
 * or a folder holding one; lk_fuse_file_src (pipeline.c) sends pipeline
 * folders to lk_fuse_pipeline, which fuses each component with this. */
lk_status lk_fuse_checkpoint(const char *base, const lk_fuse_input *inputs, const lk_adapter_source *const *sources,
                             size_t n, const char *out, const lk_fuse_file_opts *opts, lk_fuse_stats *stats);
/* One fused tensor of lk_fuse_file on a device (lk_fuse_file_opts.device):
 * t's bytes at w (host; an FP8 weight's scale sc at sd) are uploaded to
 * dev, fused there (lk_fuse_key_apply_dev / lk_fuse_fp8_dev) and
 * downloaded into w (and sd) when that succeeded. */
lk_status lk_fuse_key_staged(lk_device dev, const lk_tensor *t, void *w, const lk_tensor *sc, void *sd,
                             const lk_fuse_key *plan, const lk_fuse_term *terms, const lk_fuse_opts *fo,
                             lk_fuse_dev_stats *stats);
/* DoRA on a key (plan.c's apply_dora, whose header states the rules per
 * convention): what is normed (per output row, or per input channel of K
 * elements per row), of W or V, eps, the strength and the finish
 * (LK_KEY_DORA_*, fuse/keyelem.h); lk_fuse_dora_term the term whose delta
 * makes V = W + c delta; lk_fuse_dora_factor m / (sqrt(ss) + eps), in
 * double on the host (the device kernel gets its values). */
typedef struct lk_dora_rule {
    int on_out, norm_w, wide; /* norm per output row; of W instead of V (comfyui) */
    int64_t in_ch, K;         /* per input channel: channels, elements per channel per row */
    double eps, sd, c;        /* c: the delta's scale in V */
    int finish;               /* LK_KEY_DORA_* */
    const lk_tensor *mag;
} lk_dora_rule;
lk_dora_rule lk_fuse_dora_rule(const lk_fuse_key *k, const lk_tensor *t, int64_t rows, int64_t cols);
lk_fuse_term lk_fuse_dora_term(const lk_fuse_key *k, const lk_tensor *t, const lk_dora_rule *r);
double lk_fuse_dora_factor(double m, double ss, double eps);
/* lk_fuse_key_apply's refusals before any work (a non-fusable dtype
 * other than replaced whole at strength 1, DoRA on a 1-D tensor), and its
 * error for a non-finite fused element j of value x (LK_OK when allowed). */
lk_status lk_fuse_key_check(const lk_tensor *t, const lk_fuse_key *k);
lk_status lk_fuse_key_nonfinite(double x, const char *name, size_t j, const lk_fuse_opts *o);
/* A factor's checks (dtype F32/F16/BF16, or F64 for an "A", 2-D, data). */
lk_status lk_fuse_check_factor(const lk_tensor *t, const char *what, const char *name, size_t ti);

/* Row-sliced LoRA terms cut into bands of rows with the same terms (what
 * lk_fuse_tensor does with them): validates the terms (LoRA only, each B's
 * rows inside the weight's out rows; errors as lk_fuse_tensor's), then
 * calls fn once per band [r0, r1), in row order, with the terms covering
 * it in the given order (slice 0, B viewed from row r0: a weight of r1 - r0
 * rows of its own) or none (nb = 0: the band is left as it is). Stops at
 * fn's first error. The CPU kernel and the device kernel both cut this way. */
typedef lk_status (*lk_fuse_band_fn)(void *ctx, int64_t r0, int64_t r1, const lk_fuse_term *bt, size_t nb);
lk_status lk_fuse_bands(int64_t out, const lk_fuse_term *terms, size_t n_terms, const char *name, lk_fuse_band_fn fn,
                        void *ctx);
/* lk_fuse_tensor (tensor.c) for LoRA terms only, or terms on row slices
 * (kernel.c: bands of rows covered by the same terms, each fused whole). */
lk_status lk_fuse_tensor_lora(void *w_out, const void *w_in, lk_dtype dtype, int64_t out, int64_t in,
                              const lk_fuse_term *terms, size_t n_terms, const lk_fuse_opts *opts, const char *name);
/* The weight's checks (buffers, a fusable dtype, a positive shape whose
 * bytes fit in size_t), as the kernel makes them (kernel.c). */
lk_status lk_fuse_check_weight(const void *w_out, const void *w_in, lk_dtype dtype, int64_t out, int64_t in,
                               const char *name);
/* lk_fuse_tensor for a term list with LoHa / LoKr / dense terms (terms.c;
 * called by lk_fuse_tensor once the buffers, dtype and shape are checked):
 * threads take blocks of rows, each block's delta from lk_fuse_delta_rows,
 * then W + d rounded once, exactly as the kernel rounds. */
lk_status lk_fuse_tensor_terms(void *w_out, const void *w_in, lk_dtype dtype, int64_t out, int64_t in,
                               const lk_fuse_term *terms, size_t n_terms, const lk_fuse_opts *opts, const char *name);

/* OFT / BOFT terms (oft.c): lk_fuse_tensor for a weight whose only live
 * term is `term` (LK_TERM_OFT); lk_oft_check validates one against a
 * weight of out rows (errors name the key and the shapes); lk_oft_prepare
 * builds the rotation under a convention, lk_oft_delta_f32 writes the
 * delta of an out x in f32 weight w (FP8 weights, dequantised) rounded
 * to f32. lk_wlora_product: wb (out x r, f64) = w (out x in, f32 values) @
 * a1 (in x r), GLoRA's W a1, fma chains over the input index ascending. */
typedef struct lk_oft lk_oft;
lk_status lk_oft_check(const lk_fuse_term *term, int64_t out, size_t ti, const char *name);
lk_status lk_oft_prepare(const lk_fuse_term *term, int64_t out, lk_convention conv, const char *name, lk_oft **p);
lk_status lk_oft_delta_f32(const lk_oft *p, const float *w, float *delta, size_t in, const char *name);
void lk_oft_free(lk_oft *p);
/* OFT's last step on its own (tests): dst (n elements of dtype dt) =
 * x + d rounded once by the row rounding of the current kernel path
 * (lk_fuse_kernel_path); x holds values of dt. Returns the first element
 * a finite x made non-finite, or SIZE_MAX. */
size_t lk_oft_round_row(lk_dtype dt, const double *x, const double *d, void *dst, size_t n);
lk_status lk_fuse_tensor_oft(void *w_out, const void *w_in, lk_dtype dtype, int64_t out, int64_t in,
                             const lk_fuse_term *term, const lk_fuse_opts *opts, const char *name);
lk_status lk_wlora_product(double *wb, const float *w, size_t out, size_t in, const lk_tensor *a1, const char *name);
/* The terms with every LK_TERM_WLORA turned into a LoRA term on weight w
 * (f32 values, out x in): *xt (n terms) and *mem (free both with lk_free)
 * hold them; *xt = terms and *mem = NULL when there is none. An OFT term
 * must be the only live term (LK_ERR_UNSUPPORTED otherwise). */
lk_status lk_fuse_expand_wterms(const float *w, int64_t out, int64_t in, const lk_fuse_term *terms, size_t n,
                                const lk_fuse_term **xt, void **mem, const char *name);
/* Runs fn on workers[0 .. nw) (each `size` bytes): workers 1.. on their
 * own threads (one that cannot start is skipped: fn takes work from a
 * shared counter), worker 0 on the caller's; the caller's floating-point
 * environment is restored after. */
void lk_fuse_run_threads(int nw, void *(*fn)(void *), void *workers, size_t size);
/* The row drivers' workers (terms.c, oft.c), one piece of code:
 * lk_fuse_thread_count: opts->threads (0: every core), at most
 * LK_FUSE_MAX_THREADS, at most cap (>= 1: the caller's bound from the
 * work's size) and at most n_items (0: no bound). lk_fuse_workers: one
 * allocation (*workers, lk_free it) of nw workers of wsize bytes (zeroed)
 * then nw buffers of per bytes, each on a cache line (*bufs: buffer 0;
 * buffer t at *bufs + t * per); LK_ERR_NOMEM naming `what` when it does
 * not fit. lk_fuse_workers_verdict:
 * the earliest non-finite element over the workers (an lk_kworker at
 * byte `at` of each, stride bytes apart), as lk_fuse_nonfinite reports it. */
int lk_fuse_thread_count(const lk_fuse_opts *opts, size_t cap, size_t n_items);
lk_status lk_fuse_workers(int nw, size_t wsize, size_t per, void **workers, unsigned char **bufs, const char *name,
                          const char *what);
lk_status lk_fuse_workers_verdict(const void *workers, int nw, size_t stride, size_t at, size_t in,
                                  const lk_fuse_opts *opts, const char *name);
/* 1 if a live term is LK_TERM_WLORA (needs the weight's values), 2 if one is LK_TERM_OFT. */
int lk_fuse_wterms(const lk_fuse_term *terms, size_t n);

/* w + d rounded to odd (round toward zero, then set the last bit if the
 * sum was inexact): a value that, rounded to nearest-even into any format
 * with at least two fewer significant bits (BF16, F16, FP8 from f32; F32
 * from f64), gives the correctly rounded w + d. Inf and NaN sums are
 * returned as the plain w + d. */
float lk_fuse_add_odd_f32(float w, float d);
double lk_fuse_add_odd_f64(double w, double d);

/* One element as the kernel writes it, before the final narrowing:
 * lk_fuse_add_odd_f32 plus the NaN rule: a NaN weight stays that NaN with
 * its quiet bit set; a NaN made from a non-NaN weight (Inf - Inf) is the
 * positive quiet NaN 0x7fc00000. Narrow with lk_from_f32 (RNE). */
float lk_fuse_round_f32(float w, float d);
/* An F32 weight's element, final bits: w + d (d from the wide chain)
 * rounded once to f32 with the same NaN rule. */
uint32_t lk_fuse_round_f64_to_f32(uint32_t w_bits, double d);

/* The kernel path lk_fuse_tensor uses now: "avx512bf16", "avx512", "avx2"
 * or "portable". Chosen from the CPU's features; the environment variable
 * LORAKIT_KERNEL (same names) forces a path the CPU supports (tests use it
 * to check that every path gives the same bytes). */
const char *lk_fuse_kernel_path(void);
/* 1 when the CPU can run path `name`. */
int lk_fuse_kernel_supported(const char *name);

/* ---- between kernel.c and its per-ISA block functions ---- */

#define LK_PW32 64 /* columns per packed panel, f32 accumulator */
#define LK_PW64 32 /* columns per packed panel, f64 accumulator */
/* A column tile: the panels of A a block's rows share, kept near this size (L1) */
#define LK_TILE_BYTES (24u * 1024u)

typedef struct lk_kjob lk_kjob;
typedef struct lk_kworker {
    const lk_kjob *job;
    size_t bad_at; /* first element o*in+j that became non-finite, or SIZE_MAX */
    double bad_w, bad_r;
} lk_kworker;

/* Rows per register block: the AVX-512 block keeps LK_KMR x 4 vectors of
 * the delta in registers (24 of the 32 zmm), so each A load serves 6 rows. */
#define LK_KMR 6

/* CALL(M) with the row count mr (1..LK_KMR) as a compile-time constant M,
 * so a block function instantiated per M keeps its accumulators in
 * registers. */
#define LK_KMR_SWITCH(mr, CALL)                                                                            \
    switch (mr) {                                                                                          \
    case 6: CALL(6); break;                                                                                \
    case 5: CALL(5); break;                                                                                \
    case 4: CALL(4); break;                                                                                \
    case 3: CALL(3); break;                                                                                \
    case 2: CALL(2); break;                                                                                \
    default: CALL(1); break;                                                                               \
    }
_Static_assert(LK_KMR == 6, "LK_KMR_SWITCH instantiates rows 1..6");
/* A path's block entry point: WIDE(M) for an F32 weight (f64 chain), else
 * NARROW(M), with M the row count as a constant. */
#define LK_KMR_DISPATCH(wide, mr, WIDE, NARROW)                                                            \
    do {                                                                                                   \
        if (wide) {                                                                                        \
            LK_KMR_SWITCH(mr, WIDE);                                                                       \
        } else {                                                                                           \
            LK_KMR_SWITCH(mr, NARROW);                                                                     \
        }                                                                                                  \
    } while (0)

/* Rows [o, o + mr) (mr 1..LK_KMR) x panels [p0, p1) of the job: the delta block
 * in registers, then W rounded once and written. */
typedef void (*lk_kblock_fn)(const lk_kjob *jb, lk_kworker *wk, size_t o, int mr, size_t p0, size_t p1);

struct lk_kjob {
    void *w_out;
    const void *w_in;
    int dt;           /* lk_dtype of W */
    int wide;         /* f64 accumulator (F32 weights) */
    size_t out, in, R, npan, pan_tile, n_chunks, rows_per_chunk;
    const float *Ap32, *Bs32;  /* narrow: panels [p][k][LK_PW32], B' out x R */
    const double *Ap64, *Bs64; /* wide:   panels [p][k][LK_PW64], B' out x R */
    lk_kblock_fn block;
};

/* terms.c's fused rows (the AVX-512 paths): one LoHa, LoKr or dense term
 * alone on a weight, its delta made in registers and rounded by the LoRA
 * block's epilogue, with terms.c's canonical arithmetic (d = +0 + x). k
 * holds what the epilogue and lk_kernel_finish_slow read (w_out, w_in, dt,
 * wide, out, in) and, for LoHa, npan and pan_tile (the column tiling). */
typedef struct lk_xjob {
    lk_kjob k;
    int kind;               /* lk_term_kind: LK_TERM_DENSE, _HADA or _KRON */
    const void *dense;      /* dense: D (out x in, dtype ddt), x = acc(scale * D) */
    int ddt;
    double scale;
    const void *ap1, *bs1;  /* LoHa: P1's panels and B' (all rows), rank R1 */
    const void *ap2, *bs2;  /* P2's, rank R2 (f32 narrow, f64 wide; LK_PW32 / LK_PW64 panels) */
    size_t R1, R2;
    const void *w1, *w2;    /* LoKr: acc(s W1) (a x b) and acc(W2) (c x D) */
    size_t b, c, D;
} lk_xjob;
/* Rows [o0, o1) of an lk_xjob (wk->job is &jb->k). */
typedef void (*lk_xrows_fn)(const lk_xjob *jb, lk_kworker *wk, size_t o0, size_t o1);

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define LK_KERNEL_X86 1
void lk_xrows_avx512(const lk_xjob *jb, lk_kworker *wk, size_t o0, size_t o1);
void lk_xrows_avx512bf16(const lk_xjob *jb, lk_kworker *wk, size_t o0, size_t o1);
/* The f64 chain alone, from A in LK_PW64 panels and B' rows x R. */
void lk_kdelta64_avx512(double *d, size_t ld, const double *ap, const double *bs, size_t R, size_t in, size_t rows);
void lk_kblock_avx512(const lk_kjob *jb, lk_kworker *wk, size_t o, int mr, size_t p0, size_t p1);
void lk_kblock_avx512bf16(const lk_kjob *jb, lk_kworker *wk, size_t o, int mr, size_t p0, size_t p1);
/* The f32 chain alone into d (rows x in, row stride ld) from A in LK_PW32
 * panels and B' rows x R: the AVX-512 block with a plain store. */
void lk_kdelta32_avx512(float *d, size_t ld, const float *ap, const float *bs, size_t R, size_t in, size_t rows);
void lk_kblock_avx2(const lk_kjob *jb, lk_kworker *wk, size_t o, int mr, size_t p0, size_t p1);
#endif
void lk_kblock_portable(const lk_kjob *jb, lk_kworker *wk, size_t o, int mr, size_t p0, size_t p1);

#endif
