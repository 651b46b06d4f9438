/* lorakit/fuse.h — the fusion kernel and the offline fuse of a whole file.
 *
 * One kernel: W_out = W_in + sum_i scale_i * (B_i @ A_i), for any mix of
 * F32/F16/BF16 weights and factors: an FMA chain over the terms in the order
 * given (fp32 for F16/BF16 weights, fp64 for F32 weights), then W + delta
 * rounded once into the weight's dtype (the canonical arithmetic: the full
 * statement is at the top of src/fuse/kernel.c and in the README). W is read
 * once and written once, tile by tile; no out x in delta is ever
 * materialised. The result bytes do not depend on the thread count or on
 * the CPU path (LORAKIT_KERNEL=avx512bf16|avx512|avx2|portable forces one). */
#ifndef LORAKIT_FUSE_H
#define LORAKIT_FUSE_H

#include <stddef.h>
#include "lorakit/status.h"
#include "lorakit/cancel.h"
#include "lorakit/tensor.h"
#include "lorakit/adapter.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What a term adds (the canonical chain of each is at the top of
 * src/fuse/terms.c and in the README). LoRA is the default (0), so a term
 * written {A, B, scale} is a LoRA term. */
typedef enum lk_term_kind {
    LK_TERM_LORA = 0,  /* scale * B @ A (A r x in, B out x r); A NULL: a 1-D vector term scale * B */
    LK_TERM_DENSE,     /* scale * B, B holding out x in values (any shape of that many elements) */
    LK_TERM_HADA,      /* scale * (B @ A) * (B2 @ A2), elementwise (LoHa) */
    LK_TERM_KRON,      /* scale * kron(w1, w2): w1 = B @ A (A NULL: w1 = B, a x b), w2 = B2 @ A2
                          (A2 NULL: w2 = B2, c x D); out = a c, in = b D (LoKr) */
    LK_TERM_OFT,       /* a rotation of W's rows (LyCORIS diag-oft / boft): B = oft_blocks [n, b, b] (OFT) or
                          [m, n, b, b] (BOFT) with n b = out, A2 = rescale (out values) or NULL, scale = the
                          strength, alpha = the file's alpha (the constraint); the convention decides the rest
                          (src/fuse/oft.c). The only live term of its weight. */
    LK_TERM_WLORA      /* scale * W @ B @ A with W the weight itself (GLoRA's W a1 a2): B in x r, A r x in */
} lk_term_kind;

typedef struct lk_fuse_term {
    const lk_tensor *A; /* r x in */
    const lk_tensor *B; /* out x r, or rows x r for a row slice */
    double scale;       /* strength * the module's alpha-derived scale, both doubles */
    int64_t slice;      /* 0: B covers the weight (out x r); k > 0: a row slice, B's rows land on the weight's
                           rows [k - 1, k - 1 + B rows) (a module on part of a fused q,k,v weight) */
    lk_term_kind kind;
    const lk_tensor *A2, *B2; /* the second product (HADA, KRON); A2: OFT's rescale */
    double alpha;             /* OFT: the file's alpha (the rotation's constraint) */
    const lk_oft_peft *peft;  /* OFT: non-NULL for PEFT's OFT / BOFT: B = oft_R.weight [n, b (b - 1) / 2] or boft_R
                                 [1, n, b, b] (A2 = boft_s), a rotation of W's columns (the input axis), these
                                 options (src/fuse/oft.c's PEFT section) */
} lk_fuse_term;
/* The term scale is consumed as a double on every path; it is never rounded
 * to float by itself. F32 weights: B' = scale * B in f64 (one f64 rounding),
 * the chain in f64. BF16/F16/FP8 weights: B' = (float)(scale * (double)B),
 * the product formed in f64 and then rounded to f32, so the scaled factor is
 * within an f32 rounding (relative 2^-24) of the product with the double
 * scale, as any f32 factor is; a float scale would add a second error of its
 * own (0.7f is 0.7 - 1.2e-8, relative 1.7e-8) before that rounding. A scaled
 * factor beyond the f32 range is Inf and the fuse fails as non-finite. */

/* FP8 weights (lk_fuse_fp8): how the fused value is rounded into FP8 and
 * what happens to the weight's scale. All zero = the defaults. */
typedef enum lk_fp8_rounding {
    LK_FP8_NEAREST = 0,    /* round to nearest, ties to even */
    LK_FP8_STOCHASTIC = 1  /* reproducible: bits keyed by (seed, tensor name, element index) */
} lk_fp8_rounding;
typedef enum lk_fp8_scale_mode {
    LK_FP8_RESCALE = 0,    /* recompute the scale from the fused values (LTX-2's formula) */
    LK_FP8_KEEP = 1        /* keep the scale; values beyond it overflow */
} lk_fp8_scale_mode;
typedef struct lk_fp8_opts {
    lk_fp8_rounding rounding;
    uint64_t seed;         /* stochastic rounding's seed */
    lk_fp8_scale_mode scale;
    int saturate;          /* clamp overflowing values to +-max instead of failing */
} lk_fp8_opts;

/* "nearest" | "stochastic" and "rescale" | "keep" (LK_ERR_ARG naming the
 * value and the valid ones). */
lk_status lk_fp8_rounding_parse(const char *s, lk_fp8_rounding *out);
lk_status lk_fp8_scale_parse(const char *s, lk_fp8_scale_mode *out);

typedef struct lk_fuse_opts {
    int threads;          /* 0 = all cores */
    int allow_nonfinite;  /* else a non-finite result from finite input is LK_ERR_NONFINITE */
    lk_fp8_opts fp8;      /* FP8 weights only */
    lk_convention convention; /* whose rules where the tools disagree (adapter.h); 0 = lorakit */
    const lk_cancel *cancel;  /* NULL, or checked at the call's cancellation points (lorakit/cancel.h):
                                 LK_ERR_CANCELLED, with what each call promises on failure */
} lk_fuse_opts;

/* w_out may equal w_in (in place); both are out x in of dtype `dtype`.
 * Row-sliced terms (slice > 0) add only to their rows: the weight
 * is cut into bands of rows with the same terms, each fused as a weight of
 * its own, so every element is still W + the chain of exactly its terms in
 * the order given, rounded once (FP8 weights refuse row slices).
 * `name` is used in error messages. On LK_ERR_NONFINITE w_out may have been
 * partly written: callers fusing in place keep a copy to restore. */
lk_status lk_fuse_tensor(void *w_out, const void *w_in, lk_dtype dtype, int64_t out,
                         int64_t in, const lk_fuse_term *terms, size_t n_terms,
                         const lk_fuse_opts *opts, const char *name);

/* Fuses terms into an FP8 weight w (out x in codes of dtype F8_E4M3 or
 * F8_E5M2, in place) whose real value is code x scale: scale (may be NULL:
 * plain FP8, scale 1) holds n_scale values (1, or one per row) of sdtype
 * F32/BF16/F16 and is rewritten in place under LK_FP8_RESCALE. The delta is
 * lk_fuse_tensor's canonical fp32 chain; code x scale + delta is divided by
 * the (new or kept) scale and rounded once into FP8 (src/fuse/fp8.c says
 * exactly how). Overflow beyond the format's largest finite value is
 * LK_ERR_NONFINITE naming the tensor and the element count, unless
 * opts->fp8.saturate. The bytes do not depend on the thread count. On error
 * w and scale may be partly written (callers keep a copy). */
lk_status lk_fuse_fp8(uint8_t *w, lk_dtype dtype, int64_t out, int64_t in, void *scale, lk_dtype sdtype,
                      int64_t n_scale, const lk_fuse_term *terms, size_t n_terms, const lk_fuse_opts *opts,
                      const char *name);

/* The scale tensor of FP8 weight model[wi] among model[0..n): *scale = its
 * index, or -1 for plain FP8. Recognised: "<m>.weight_scale" (F32/BF16/F16
 * of shape [], [1], [out] or [out, 1]) and ComfyUI's "<m>.scale_weight"
 * when the file holds the "scaled_fp8" marker tensor. "<m>.input_scale" and
 * "<m>.scale_input" are activation scales (left alone). Any other sibling
 * "<m>.<...scale...>" (block-wise "weight_scale_inv", NVFP4's
 * "weight_scale_2", ...) or another shape is LK_ERR_UNSUPPORTED naming it:
 * never fused as if plain. */
lk_status lk_fp8_scale_of(const lk_tensor *model, size_t n, size_t wi, long *scale);

/* Checks the n values (dtype F32/BF16/F16) of the FP8 scale tensor `name`:
 * each must be finite and > 0 (NaN/Inf would turn every code into NaN, 0
 * erase the weight, a negative one flip it). LK_ERR_FORMAT naming the
 * tensor, the index and the value. lk_fuse_fp8 checks its scale the same
 * way before writing; callers check earlier, where they know the name. */
lk_status lk_fp8_scale_values_check(const char *name, const void *values, lk_dtype dtype, int64_t n);

/* Stochastic rounding's generator: the key of a tensor's stream and the 32
 * bits for its element index (SplitMix64's finaliser; counter-based, so
 * any split of the elements gives the same bits). */
uint64_t lk_fp8_stream_key(uint64_t seed, const char *name);
uint32_t lk_fp8_random_bits(uint64_t key, uint64_t index);

/* One adapter of a fuse request. */
typedef struct lk_fuse_input {
    const char *path;
    double strength;    /* exactly as typed (a double, as PEFT's, diffusers' and LyCORIS's); finite */
    lk_adapter_format format;
    int has_alpha;      /* 1: alpha is the caller's alpha for this adapter (lk_adapter_opts.has_alpha: it fills
                           in where the file gives none, and a file alpha that differs is LK_ERR_CONFIG) */
    double alpha;       /* finite; part of the adapter's identity (canonical order, the tracker's request) */
} lk_fuse_input;

/* Progress report: called after each tensor is written (from the calling
 * thread), with bytes of tensor data written so far and in total. */
typedef void (*lk_fuse_progress_fn)(void *ctx, uint64_t bytes_done, uint64_t bytes_total,
                                    size_t tensors_done, size_t tensors_total);

typedef struct lk_fuse_file_opts {
    lk_fuse_opts fuse;
    int allow_unmatched;
    lk_alpha_from alpha_from;        /* where each adapter's alpha comes from (adapter.h); 0 = auto */
    lk_fuse_progress_fn on_progress; /* may be NULL (the library never prints) */
    void *progress_ctx;
    const char *arch;          /* model family table (lk_resolve_opts.arch); NULL: recognised from the keys */
    const char *const *maps;   /* extra name tables (--map FILE) */
    size_t n_maps;
    const char *const *tied;   /* tied names: lk_resolve_opts.tied */
    size_t n_tied;
    const char *component;     /* set by lk_fuse_pipeline for each component (lk_resolve_opts.component) */
    lk_device device;          /* 0 = cpu; cuda:N / emul: each fused tensor is uploaded, fused there by the
                                  device kernel (lorakit/fuse_device.h) and downloaded: the same bytes */
    struct lk_stream *stream;  /* lk_fuse_tensors on device tensors: the stream the work is queued on
                                  (lorakit/device.h; NULL: the device's default stream) */
} lk_fuse_file_opts;

typedef struct lk_fuse_stats {
    size_t tensors_total;
    size_t tensors_fused;
    size_t modules_unmatched;
    double seconds;
    size_t keys_device;        /* with a device: tensors the device kernel fused */
    size_t keys_host_fallback; /* with a device: tensors fused on the host path (fuse_device.h) */
    lk_convention convention; /* the conventions the fuse followed (lk_fuse_opts.convention) */
} lk_fuse_stats;

/* A strength as typed (the CLI's -l ADAPTER:STRENGTH, a plan's strength):
 * the whole of text must be one number in strtod's syntax, finite, and not a
 * non-zero number so small that it reads as 0 (1e-400); a subnormal such as
 * 1e-320 is kept as read. LK_ERR_ARG naming the text as typed and why.
 * (Messages and JSON show a strength as lk_num_str does: the shortest
 * decimal that reads back as the double used.) */
lk_status lk_fuse_strength_parse(const char *text, double *out);

/* The canonical summation order of a request: order[] receives the indices
 * of in[] sorted by (path, byte-wise; strength, ascending; format; index). Anyone
 * fusing a set of adapters (lk_fuse_file, the hot-swap tracker) sums the
 * terms in this order, so the same set gives the same bytes everywhere. */
void lk_fuse_canonical_order(const lk_fuse_input *in, size_t n, size_t *order);

/* The per-key plan shared by lk_fuse_file and the hot-swap tracker: what
 * one model tensor becomes under opened, resolved adapters ad[0..n) (in the
 * canonical order, strength[i] for ad[i]). terms (capacity n * LK_ADAPTER_MAX_SLICES:
 * a fused weight gets one term per module on a row slice of it) receives the
 * LoRA terms of a 2-D weight (scale = strength * module scale, both doubles,
 * the one place the product is formed; a product that is not finite is
 * LK_ERR_ARG naming the adapter, module, strength and scale) or,
 * for a layer's 1-D bias, its lora_B bias terms (A = NULL, B = the bias
 * vector). A replacement (modules_to_save, a saved bias) or a DoRA module
 * is noted in the plan. Two adapters replacing one tensor, or a DoRA
 * module with anything else on the same key, is LK_ERR_ARG naming both. */
typedef struct lk_fuse_key {
    const lk_tensor *replace;    /* tensor replacing the key whole, or NULL */
    double replace_strength;
    const lk_lora_module *dora;  /* DoRA module on the key, or NULL */
    double dora_strength;
    size_t n_terms;
    lk_convention dora_convention; /* the DoRA adapter's convention (its norm, epsilon and strength rule) */
} lk_fuse_key;

lk_status lk_fuse_key_plan(lk_adapter *const *ad, const double *strength, size_t n, const lk_tensor *t,
                           lk_fuse_term *terms, lk_fuse_key *out);
/* 1 if the plan changes the key. */
int lk_fuse_key_touches(const lk_fuse_key *k);
/* Applies a plan to tensor t: w_out (may equal w_in) = what the plan makes
 * of w_in. Plain LoRA terms go through lk_fuse_tensor; replacements, DoRA
 * (W + s (m / ||W + c B A||_row (W + c B A) - W)) and bias terms are
 * computed in double and rounded once. On error w_out may be partly
 * written. */
lk_status lk_fuse_key_apply(void *w_out, const void *w_in, const lk_tensor *t, const lk_fuse_key *k,
                            const lk_fuse_term *terms, const lk_fuse_opts *opts);

/* Where the conventions (lorakit, comfyui, lycoris, peft) would give
 * different weights for adapter (opened with ao, its convention ignored),
 * and by how much (`lorakit inspect`'s "conventions"; src/fuse/conventions.c
 * says exactly what is computed): with base (a checkpoint; NULL: none) each
 * weight the adapter touches is fused under every convention at strengths 1
 * and `strength` (finite, != 0) and the results compared; without, the
 * modules' scales. *out (lk_free it): {base, strengths, modules_differ,
 * modules: [{module, weight, points: [text], needs_base, at: [{strength,
 * groups: [[convention, ...], ...], pairs: [{a, b, max_abs, rel_fro[,
 * elements]}]}]}], not_compared: [FP8 weights], computed: text}; a module
 * where they all agree is not listed. */
lk_status lk_fuse_conventions_json(const char *adapter, const char *base, const lk_resolve_opts *ro,
                                   const lk_adapter_opts *ao, double strength, char **out);

/* Fuses the inputs into base and writes out (atomically; on any error no
 * file exists at out). Refuses out equal to base or to an adapter file (same
 * st_dev/st_ino, whatever the path). Every adapter is opened, resolved and
 * checked before the output is created. Terms are summed in the canonical
 * order of lk_fuse_canonical_order, so the bytes do not depend on the order
 * of `inputs`. A term's scale is strength * module scale, a product of two
 * doubles formed once (lk_fuse_key_plan) and kept a double
 * (lk_fuse_term.scale); the kernel forms scale * B[o,k] in double and
 * rounds it to f32 only for BF16, F16 and FP8 weights (kernel.c's header).
 * Tensors no module targets, and all non-float tensors, are copied byte for
 * byte; the base's metadata is kept and "lorakit.fused" records the
 * adapters (a JSON array of {"path", "strength", "format"}, appended to the
 * base's own record when it has one). Peak memory: one tensor buffer (the
 * largest fused tensor, at least min(8 MiB, the largest copied tensor))
 * plus the adapters' factors (held in memory from open) and the f32 factors
 * of one tensor. The base's tensor bytes are read with pread, never through
 * its mmap: a base truncated or rewritten by another process during the fuse
 * is LK_ERR_IO naming the file and tensor ("changed on disk while being
 * read"), with no output left. */
lk_status lk_fuse_file(const char *base, const lk_fuse_input *inputs, size_t n,
                       const char *out, const lk_fuse_file_opts *opts, lk_fuse_stats *stats);

/* The in-memory form of lk_fuse_file: fuses the inputs into the caller's
 * tensors in place (data must be writable). Same validation, strictness
 * (allow_unmatched), canonical term order and kernel as lk_fuse_file, so the
 * bytes equal those of an offline fuse of a file holding these tensors.
 * Every adapter is opened and resolved before anything is written; the
 * touched tensors are copied into one backup allocation first (peak extra
 * memory: their bytes), and any failure restores them, so on error every
 * tensor holds its old bytes. on_progress is not called. */
lk_status lk_fuse_tensors(lk_tensor *tensors, size_t n_tensors, const lk_fuse_input *inputs, size_t n,
                          const lk_fuse_file_opts *opts, lk_fuse_stats *stats);

/* Device tensors (lk_tensor.device cuda:N or emul, every tensor on the
 * same device, else LK_ERR_ARG naming a key on each): lk_fuse_tensors works
 * on them in place, on opts->stream: the backup of the touched tensors is
 * one device allocation (device-to-device copies), each key is fused by the
 * device kernel (lorakit/fuse_device.h; the kinds it does not run take its
 * pinned host path, counted in stats->keys_host_fallback) and a failure
 * restores the backup on the device. The same bytes as on the host. An FP8
 * scale's values are read to the host for the check (a few bytes). */

/* Adapters held in memory: lk_fuse_file and lk_fuse_tensors with sources
 * (may be NULL) beside inputs: sources[i] non-NULL reads input i from
 * memory (lk_adapter_open_mem; inputs[i].path is its label and names it in
 * errors and the summary). Everything else is as above. */
lk_status lk_fuse_file_src(const char *base, const lk_fuse_input *inputs, const lk_adapter_source *const *sources,
                           size_t n, const char *out, const lk_fuse_file_opts *opts, lk_fuse_stats *stats);
lk_status lk_fuse_tensors_src(lk_tensor *tensors, size_t n_tensors, const lk_fuse_input *inputs,
                              const lk_adapter_source *const *sources, size_t n, const lk_fuse_file_opts *opts,
                              lk_fuse_stats *stats);
/* A diffusers pipeline folder (model_index.json) as the base of
 * lk_fuse_file: each component folder holding a checkpoint (unet,
 * transformer, text_encoder, text_encoder_2, text_encoder_3) is fused with
 * the adapter modules for it (component prefixes unet., transformer.,
 * text_encoder[_2|_3]., lora_unet_, lora_te[12]_, ...; unprefixed modules
 * wherever they match), into OUT, a new pipeline folder of the same layout:
 * fused components keep their file or shard layout, every other file and
 * folder (model_index.json, scheduler/, tokenizer/, vae/, untouched
 * components) is copied. Every adapter is resolved against every component
 * first: a module that lands in no component is LK_ERR_UNMATCHED (unless
 * allow_unmatched), one that lands in two is LK_ERR_FORMAT naming both. OUT
 * must not exist (or be an empty folder); it is built in a temporary folder
 * beside it and renamed into place only when complete. */
int lk_fuse_is_pipeline(const char *base);
lk_status lk_fuse_pipeline(const char *base, const lk_fuse_input *inputs, const lk_adapter_source *const *sources,
                           size_t n, const char *out, const lk_fuse_file_opts *opts, lk_fuse_stats *stats);

/* Opens the adapter of one input with opts (its format field is used as
 * given; in->has_alpha sets its alpha fields): its file or folder, or src
 * (non-NULL) labelled by in->path. */
lk_status lk_fuse_input_open(const lk_fuse_input *in, const lk_adapter_source *src, const lk_adapter_opts *opts,
                             lk_adapter **out);

/* The one-object JSON summary of a fuse (`lorakit fuse --json`): {base, out,
 * adapters: [{path, strength}], tensors_total, tensors_fused,
 * modules_unmatched, seconds}; base and out are left out when NULL (an
 * in-memory fuse). Returns an lk_malloc'd string to lk_free, or NULL when it
 * cannot be built (out of memory, or a path that is not UTF-8). */
char *lk_fuse_summary_json(const char *base, const char *out, const lk_fuse_input *inputs, size_t n,
                           const lk_fuse_stats *stats);

#ifdef __cplusplus
}
#endif
#endif
