/* fp8.c — fusing LoRA terms into FP8 weights (lk_fuse_fp8) and finding
 * an FP8 weight's scale (lk_fp8_scale_of).
 *
 * The arithmetic, per element, in one chain whatever the thread or rank
 * count:
 *   1. the delta d = sum_t s_t * (B_t @ A_t) is the canonical narrow fp32
 *      chain (lk_fuse_delta_f32, fuse_internal.h), the one BF16 and F16
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
 * clamps to +-max with saturate. Memory: one F32 block of at most ~4 MiB of
 * rows at a time, so a weight of any size is fused in bounded memory; with
 * rescale the delta is computed twice (once for the amax, once to round). */
#include "lorakit/fuse.h"
#include "lorakit/alloc.h"
#include "fuse/fuse_internal.h"

#include <math.h>
#include <stdio.h>
#include <string.h>
#include <xxhash.h>

#define BLOCK_FLOATS ((size_t)1 << 20)

static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

uint64_t lk_fp8_stream_key(uint64_t seed, const char *name) {
    return mix64(XXH3_64bits(name, strlen(name)) ^ mix64(seed + 0x9e3779b97f4a7c15ull));
}

uint32_t lk_fp8_random_bits(uint64_t key, uint64_t index) {
    return (uint32_t)(mix64(key + (index + 1) * 0x9e3779b97f4a7c15ull) >> 32);
}

static double scale_get(const void *p, lk_dtype d, size_t i) {
    float f;
    lk_to_f32(&f, (const unsigned char *)p + i * lk_dtype_size(d), d, 1);
    return (double)f;
}

/* Stores f into element i of a scale of dtype d (RNE) and returns the
 * stored value. */
static double scale_put(void *p, lk_dtype d, size_t i, float f) {
    unsigned char *b = (unsigned char *)p + i * lk_dtype_size(d);
    lk_from_f32(b, &f, d, 1);
    return scale_get(p, d, i);
}

/* The canonical narrow delta of rows [r0, r0 + rows) into blk (rows x in). */
static lk_status block_delta(float *blk, size_t r0, size_t rows, int64_t out, int64_t in, const lk_fuse_term *terms,
                             size_t k, const char *name) {
    return lk_fuse_delta_f32(blk, (size_t)in, out, in, (int64_t)r0, (int64_t)rows, terms, k, name);
}

lk_status lk_fuse_fp8(uint8_t *w, lk_dtype dtype, int64_t out, int64_t in, void *scale, lk_dtype sdtype,
                      int64_t n_scale, const lk_fuse_term *terms, size_t k, const lk_fuse_opts *opts,
                      const char *name) {
    if (!name) name = "(tensor)";
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
    static const lk_fuse_opts defaults;
    if (!opts) opts = &defaults;
    const lk_fp8_opts *fo = &opts->fp8;
    const size_t O = (size_t)out, I = (size_t)in;
    const int per_row = scale && n_scale == out && out > 1;
    const int rescale = scale && fo->scale == LK_FP8_RESCALE;
    size_t rb = BLOCK_FLOATS / I;
    if (rb < 1) rb = 1;
    if (rb > O) rb = O;
    float *blk = lk_malloc(rb * I * sizeof *blk);
    const size_t NS = per_row ? O : 1;
    double *s0 = lk_malloc(2 * NS * sizeof *s0); /* the scale each row was stored with */
    double *sc = s0 ? s0 + NS : NULL;            /* the scale each row divides by */
    float *amax = rescale ? lk_calloc(per_row ? O : 1, sizeof *amax) : NULL;
    lk_status s = LK_OK;
    if (!blk || !s0 || (rescale && !amax)) {
        s = lk_error(LK_ERR_NOMEM, "%s: out of memory for the FP8 fuse", name);
        goto done;
    }
    for (size_t r = 0; r < NS; r++) s0[r] = sc[r] = scale ? scale_get(scale, sdtype, r) : 1.0;
    if (rescale) { /* pass 1: amax of the fused values, as float32 */
        for (size_t r0 = 0; r0 < O && !s; r0 += rb) {
            size_t rows = O - r0 < rb ? O - r0 : rb;
            if ((s = block_delta(blk, r0, rows, out, in, terms, k, name))) break;
            for (size_t r = 0; r < rows; r++) {
                size_t row = r0 + r;
                double s_old = s0[per_row ? row : 0];
                float m = amax[per_row ? row : 0];
                for (size_t j = 0; j < I; j++) {
                    double v = (double)lk_fp8_to_f32(w[row * I + j], dtype) * s_old + (double)blk[r * I + j];
                    m = fmaxf(m, fabsf((float)v));
                }
                amax[per_row ? row : 0] = m;
            }
        }
        if (s) goto done;
        /* LTX-2: scale = fp8_max / amax (float32); stored: 1 / scale (float32) */
        const float fmax = (float)lk_fp8_max(dtype);
        for (size_t r = 0; r < NS; r++) {
            if (!(amax[r] > 0.0f) || !isfinite(amax[r])) continue; /* all zero (or NaN): keep */
            float inv = fmax / amax[r];
            float stored = 1.0f / inv;
            if (!(stored > 0.0f) || !isfinite(stored)) continue;
            sc[r] = scale_put(scale, sdtype, per_row ? r : 0, stored);
        }
    }
    /* pass 2: round once into FP8, in place */
    uint64_t key = lk_fp8_stream_key(fo->seed, name);
    int stoch = fo->rounding == LK_FP8_STOCHASTIC;
    size_t over = 0;
    for (size_t r0 = 0; r0 < O && !s; r0 += rb) {
        size_t rows = O - r0 < rb ? O - r0 : rb;
        if ((s = block_delta(blk, r0, rows, out, in, terms, k, name))) break;
        for (size_t r = 0; r < rows; r++) {
            size_t row = r0 + r;
            double s_old = s0[per_row ? row : 0], s_new = sc[per_row ? row : 0];
            for (size_t j = 0; j < I; j++) {
                size_t e = row * I + j;
                double w0 = (double)lk_fp8_to_f32(w[e], dtype) * s_old;
                double v = w0 + (double)blk[r * I + j];
                if (!isfinite(v) && isfinite(w0) && !opts->allow_nonfinite) {
                    s = lk_error(LK_ERR_NONFINITE, "%s: element [%zu, %zu] becomes %g from finite inputs", name, row, j,
                                 v);
                    goto done;
                }
                uint8_t c;
                over += (size_t)lk_fp8_from_double(v / s_new, dtype, stoch, stoch ? lk_fp8_random_bits(key, e) : 0, &c);
                w[e] = c;
            }
        }
    }
    if (!s && over && !fo->saturate)
        s = lk_error(LK_ERR_NONFINITE, "%s: %zu of %zu elements overflow %s (beyond +-%g after dividing by the %s "
                     "scale); --fp8-saturate clamps them%s", name, over, O * I, lk_dtype_name(dtype),
                     lk_fp8_max(dtype), rescale ? "new" : scale ? "kept" : "(plain, 1)",
                     scale && !rescale ? ", --fp8-scale rescale recomputes the scale" : "");
done:
    lk_free(blk);
    lk_free(s0);
    lk_free(amax);
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
    int64_t out = w->ndim == 2 ? w->shape[0] : -1;
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
