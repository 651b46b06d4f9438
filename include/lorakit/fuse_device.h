/* lorakit/fuse_device.h — the fuse kernel on weights in device memory
 * (cuda:N or emul; lorakit/device.h), in place, with exactly the CPU's
 * bytes.
 *
 * Each function takes the weight as a tensor whose device field says where
 * its data is, and dispatches on it: a host tensor goes to the CPU kernel
 * (lk_fuse_tensor, lk_fuse_key_apply, lk_fuse_fp8) unchanged. On a device:
 *   - LoRA terms (conv LoRA as its 2-D factors, terms on row slices of a
 *     fused weight), LoHa, LoKr and dense terms (any mix, any number)
 *     on F32 / F16 / BF16 weights run
 *     the device kernel (src/fuse/kernel_dev.h): the factors are prepared
 *     on the host by the CPU's own code (B' and A in the accumulator's
 *     precision, LoHa's two chains, LoKr's two factors), uploaded, and
 *     each element gets the CPU's FMA chain and single rounding;
 *   - replacements (modules_to_save, set_weight, saved biases), 1-D vector
 *     terms (lora_B bias, diff_b, norm weights) and DoRA (its norms in
 *     double: the sums on the device in the CPU's fixed order, the factor
 *     m / (norm + eps) on the host, then the scaled write) run the key
 *     kernel: plan.c's double path, element by element from the rules of
 *     src/fuse/keyelem.h that plan.c itself uses; a non-fusable tensor
 *     replaced whole at strength 1 is one upload;
 *   - FP8 weights (plain, per-tensor or per-row scaled; kept or rescaled;
 *     nearest or stochastic) run the FP8 kernel: the narrow delta chain,
 *     then src/fuse/fp8elem.h's per-element rule, the one the CPU uses;
 *     a rescale's amax is reduced on the device, its new scale made on
 *     the host by fp8.c's function; a judge pass gives the verdict before
 *     anything is written, so a failed FP8 fuse changes neither the
 *     weight nor its scale;
 *   - the rest (OFT / BOFT, GLoRA, on any weight; a replacement, vector
 *     term or DoRA magnitude in another dtype) takes the host path: the key's
 *     bytes are copied to pinned host memory, fused there by the CPU
 *     kernel and copied back. The same bytes; counted in the stats.
 * Factor tensors are in host memory (the adapter's). Work is queued on
 * `stream` (NULL: the device's default stream); each call returns when the
 * key is done (the non-finite verdict needs the kernel's result). Errors
 * are the CPU kernel's (same checks, same messages, naming the tensor); a
 * non-finite result is LK_ERR_NONFINITE naming the first element, with the
 * weight partly written, as on the CPU (callers fusing in place keep a
 * copy), but for FP8 weights (above); on the host path a failure leaves
 * the device weight unchanged. */
#ifndef LORAKIT_FUSE_DEVICE_H
#define LORAKIT_FUSE_DEVICE_H

#include "lorakit/device.h"
#include "lorakit/fuse.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Counters a caller sums over its keys (zero it first). */
typedef struct lk_fuse_dev_stats {
    size_t keys_device;          /* keys fused by the device kernel */
    size_t keys_host_fallback;   /* keys fused on the host (pinned copy, CPU kernel, copy back) */
    uint64_t bytes_uploaded;     /* factors and dense deltas copied to the device */
    uint64_t bytes_staged;       /* weight bytes copied down and back up by the host path */
    double seconds_kernel;       /* wall time of the device kernel's launches, each until done */
} lk_fuse_dev_stats;

/* lk_fuse_tensor on w in place: w is out x (the rest) (a conv weight
 * [out, in, kh, kw] is out x in*kh*kw), at least 2-D. stats may be NULL. */
lk_status lk_fuse_tensor_dev(lk_tensor *w, const lk_fuse_term *terms, size_t n_terms, const lk_fuse_opts *opts,
                             lk_stream *stream, lk_fuse_dev_stats *stats);

/* lk_fuse_key_apply on w in place (the per-key plan of lk_fuse_key_plan,
 * made against a tensor of w's name, dtype and shape). */
lk_status lk_fuse_key_apply_dev(lk_tensor *w, const lk_fuse_key *k, const lk_fuse_term *terms,
                                const lk_fuse_opts *opts, lk_stream *stream, lk_fuse_dev_stats *stats);

/* lk_fuse_fp8 on an FP8 weight w (out x in codes) in place, with its scale
 * tensor (NULL: plain FP8) on the same device or on the host; the device
 * kernel (terms that read the weight: the host path, both copied down,
 * fused, copied back). */
lk_status lk_fuse_fp8_dev(lk_tensor *w, lk_tensor *scale, const lk_fuse_term *terms, size_t n_terms,
                          const lk_fuse_opts *opts, lk_stream *stream, lk_fuse_dev_stats *stats);

/* A grow-only block of device memory a caller keeps across calls (zeroed
 * at first): each launch's uploads (the non-finite slot and the factors)
 * go into it, grown (freed and allocated again) only when a key needs
 * more, instead of an allocation and a free per key (cudaMalloc and
 * cudaFree synchronise the GPU). One thread and one stream at a time;
 * lk_fuse_dev_scratch_free releases it. The tracker keeps one for its
 * lifetime: its device memory is the largest key's factors. */
typedef struct lk_fuse_dev_scratch {
    lk_device dev;
    void *p;
    size_t bytes;
} lk_fuse_dev_scratch;
void lk_fuse_dev_scratch_free(lk_fuse_dev_scratch *s);

/* lk_fuse_key_apply_dev and lk_fuse_fp8_dev with the uploads in scratch
 * (NULL: as those, an allocation per launch). */
lk_status lk_fuse_key_apply_dev_in(lk_tensor *w, const lk_fuse_key *k, const lk_fuse_term *terms,
                                   const lk_fuse_opts *opts, lk_stream *stream, lk_fuse_dev_scratch *scratch,
                                   lk_fuse_dev_stats *stats);
lk_status lk_fuse_fp8_dev_in(lk_tensor *w, lk_tensor *scale, const lk_fuse_term *terms, size_t n_terms,
                             const lk_fuse_opts *opts, lk_stream *stream, lk_fuse_dev_scratch *scratch,
                             lk_fuse_dev_stats *stats);

#ifdef __cplusplus
}
#endif
#endif
