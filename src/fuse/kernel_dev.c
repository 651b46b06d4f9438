/* kernel_dev.c — the fuse kernel on device weights (lorakit/fuse_device.h):
 * the host side of kernel_dev.h's device kernel, and the host path for
 * what the device kernel does not do.
 *
 * The device kernel does steps 3-5 of the canonical arithmetic (kernel.c's
 * header) on the device; steps 1-2 (stacking the live terms, B' = the
 * scaled B in the accumulator's precision, A converted) are done here by
 * the CPU kernel's own preparation (lk_kdelta_prepare: the same buffers
 * the CPU blocks read) and uploaded, so the factors the device chains over
 * are the CPU's, bit for bit. Row-sliced terms are cut into bands by the
 * CPU kernel's own cutter (lk_fuse_bands) and each band is one launch;
 * validation is the CPU's (lk_fuse_delta_prepare's checks), so the errors
 * are the same. The device memory of one call is one allocation (the
 * non-finite slot, A, B', the dense deltas), freed before returning.
 *
 * The host path (LoHa, LoKr, DoRA, replacements, vector terms, FP8): the
 * key is copied into pinned host memory, fused there by the CPU code and
 * copied back only when that succeeded. */
#include "lorakit/fuse_device.h"
#include "lorakit/alloc.h"
#include "core/alloc.h"
#include "core/clock.h"
#include "fuse/fuse.h"
#include "fuse/kernel_dev.h"

#include <stdint.h>
#include <string.h>

#ifdef LK_HAVE_CUDA
const void *lk_kdev_fuse_cuda(void); /* kernel_cuda.cu */
#define KDEV_CUDA lk_kdev_fuse_cuda()
#else
#define KDEV_CUDA NULL
#endif

/* emul: the CUDA kernel's body for one thread (kernel_dev.h). */
static void fuse_emul(const void *args, const lk_thread_idx *t) {
    lk_kdev_fuse_thread((const lk_kdev_args *)args, t->block_idx.x, t->block_idx.y, t->thread_idx.x, t->block_dim.x,
                        t->grid_dim.y);
}

/* ---- the host path ---- */

typedef lk_status (*host_fn)(void *ctx, lk_tensor *h);

/* w's bytes into pinned memory, fn on that host copy, and back when fn
 * succeeded: the device weight changes only on success. */
static lk_status host_path(lk_tensor *w, host_fn fn, void *ctx, lk_stream *s, lk_fuse_dev_stats *stats) {
    const lk_device d = w->device;
    void *h = NULL;
    lk_status st = lk_device_host_alloc(d, w->nbytes, &h);
    if (st) return lk_error_prefix(st, "%s: staging the host path", w->name);
    st = lk_device_copy(d, h, w->data, w->nbytes, LK_COPY_D2H, s);
    if (!st) st = lk_stream_sync(d, s);
    lk_tensor ht = *w;
    ht.data = h;
    ht.device = (lk_device){LK_DEVICE_CPU, 0};
    if (!st) st = fn(ctx, &ht);
    if (!st) st = lk_device_copy(d, w->data, h, w->nbytes, LK_COPY_H2D, s);
    if (!st) st = lk_stream_sync(d, s);
    lk_device_host_free(d, h);
    if (!st && stats) {
        stats->keys_host_fallback++;
        stats->bytes_staged += 2 * (uint64_t)w->nbytes;
    }
    return st;
}

/* ---- the device kernel ---- */

/* One launch's inputs: a weight (or band) of rows x in at w (device), its
 * LoRA terms (any scale: zero ones are skipped by the preparation) and its
 * live dense terms. */
typedef struct dev_call {
    lk_tensor *w;
    lk_stream *s;
    const lk_fuse_opts *opts;
    int64_t in;
    int wide;
    lk_fuse_dev_stats *stats;
} dev_call;

static size_t align256(size_t n) { return (n + 255u) & ~(size_t)255u; }

/* The verdict of a launch: *bad (downloaded) names the first element made
 * non-finite; its old bits are in the key, its new value on the device. */
static lk_status dev_verdict(const dev_call *c, unsigned long long bad, const char *wband, uint64_t row_base) {
    if (bad == ~0ull) return LK_OK;
    const size_t idx = (size_t)(bad >> 32), esz = lk_dtype_size(c->w->dtype);
    const uint32_t old = (uint32_t)(bad & 0xffffffffu);
    uint32_t now = 0;
    const size_t local = idx - (size_t)row_base * (size_t)c->in;
    lk_status st = lk_device_copy(c->w->device, &now, wband + local * esz, esz, LK_COPY_D2H, c->s);
    if (!st) st = lk_stream_sync(c->w->device, c->s);
    if (st) return st;
    float wv, rv;
    if (c->w->dtype == LK_DTYPE_F32) {
        wv = lk_u2f(old);
        rv = lk_u2f(now);
    } else {
        const uint16_t o16 = (uint16_t)old, n16 = (uint16_t)now;
        lk_to_f32(&wv, &o16, c->w->dtype, 1);
        lk_to_f32(&rv, &n16, c->w->dtype, 1);
    }
    return lk_fuse_nonfinite(c->w->name, idx, (size_t)c->in, wv, rv, c->opts);
}

/* Uploads the prepared factors and dense deltas into one device block,
 * launches, and judges. rows x in from row row_base of the weight. */
static lk_status dev_launch(const dev_call *c, uint64_t row_base, int64_t rows, const lk_kdelta *kp,
                            const lk_fuse_term *const *dense, size_t nd) {
    const lk_device d = c->w->device;
    const size_t vsz = c->wide ? sizeof(double) : sizeof(float), I = (size_t)c->in, esz = lk_dtype_size(c->w->dtype);
    const void *A = NULL, *bs = NULL;
    size_t pw = 0;
    const size_t R = kp ? lk_kdelta_factors(kp, &A, &bs, &pw) : 0;
    const size_t npan = R ? (I + pw - 1) / pw : 0;
    size_t a_bytes = 0, b_bytes = 0, at[LK_KDEV_MAX_DENSE + 2], tot = 256;
    int ovf = R && (!lk_checked_mul(npan * pw, R, &a_bytes) || !lk_checked_mul(a_bytes, vsz, &a_bytes) ||
                    !lk_checked_mul((size_t)rows, R, &b_bytes) || !lk_checked_mul(b_bytes, vsz, &b_bytes));
    at[0] = tot;
    ovf |= !lk_checked_add(tot, align256(a_bytes), &tot);
    at[1] = tot;
    ovf |= !lk_checked_add(tot, align256(b_bytes), &tot);
    for (size_t t = 0; t < nd; t++) {
        at[2 + t] = tot;
        ovf |= !lk_checked_add(tot, align256(dense[t]->B->nbytes), &tot);
    }
    if (ovf) return lk_error(LK_ERR_SHAPE, "%s: factors too large for the device", c->w->name);
    unsigned char *m = NULL;
    lk_status st = lk_device_alloc(d, tot, (void **)&m);
    if (st) return lk_error_prefix(st, "%s: device memory for the factors", c->w->name);
    unsigned long long bad = ~0ull;
    char *wband = (char *)c->w->data + (size_t)row_base * I * esz;
    lk_kdev_args a = {.w_out = wband, .w_in = wband, .A = m + at[0], .bs = m + at[1], .bad = (unsigned long long *)m,
                      .rows = (uint64_t)rows, .in = I, .R = R, .pw = pw, .pw_shift = -1, .row_base = row_base,
                      .dt = (int)c->w->dtype, .wide = c->wide, .n_dense = (int)nd};
    for (int sh = 0; sh < 63 && pw && !(pw & (pw - 1)); sh++)
        if (((size_t)1 << sh) == pw) a.pw_shift = sh;
    st = lk_device_copy(d, m, &bad, sizeof bad, LK_COPY_H2D, c->s);
    if (!st && R) st = lk_device_copy(d, m + at[0], A, a_bytes, LK_COPY_H2D, c->s);
    if (!st && R) st = lk_device_copy(d, m + at[1], bs, b_bytes, LK_COPY_H2D, c->s);
    for (size_t t = 0; t < nd && !st; t++) {
        a.dense[t] = (lk_kdev_dense){.D = m + at[2 + t], .scale = dense[t]->scale, .dt = (int)dense[t]->B->dtype};
        st = lk_device_copy(d, m + at[2 + t], dense[t]->B->data, dense[t]->B->nbytes, LK_COPY_H2D, c->s);
    }
    const uint64_t groups = ((uint64_t)rows + LK_KDEV_RPT - 1) / LK_KDEV_RPT;
    const lk_dim3 grid = {(unsigned)((I + LK_KDEV_BLOCK - 1) / LK_KDEV_BLOCK), groups < 65535 ? (unsigned)groups : 65535u, 1};
    const lk_kernel k = {"lk_kdev_fuse", KDEV_CUDA, fuse_emul};
    const double t0 = lk_now_s();
    if (!st) st = lk_device_launch(d, &k, grid, (lk_dim3){LK_KDEV_BLOCK, 1, 1}, &a, sizeof a, c->s);
    if (!st && c->s) st = lk_stream_sync(d, c->s);
    if (!st && c->stats) c->stats->seconds_kernel += lk_now_s() - t0;
    if (!st) st = lk_device_copy(d, &bad, m, sizeof bad, LK_COPY_D2H, c->s);
    if (!st) st = lk_stream_sync(d, c->s);
    lk_device_free(d, m);
    if (st) return lk_error_prefix(st, "%s", c->w->name);
    if (c->stats) c->stats->bytes_uploaded += tot - 256 + sizeof bad;
    return dev_verdict(c, bad, wband, row_base);
}

/* rows [r0, r0 + rows) with LoRA terms lt (their B covering exactly these
 * rows) and live dense terms: the CPU's preparation, then one launch. */
static lk_status dev_whole(const dev_call *c, int64_t r0, int64_t rows, const lk_fuse_term *lt, size_t nl,
                           const lk_fuse_term *const *dense, size_t nd) {
    lk_kdelta *kp = NULL;
    lk_status st = nl ? lk_kdelta_prepare(c->wide, rows, c->in, 0, rows, lt, nl, c->w->name, &kp) : LK_OK;
    if (st) return st;
    const void *A, *bs;
    size_t pw;
    if ((!kp || !lk_kdelta_factors(kp, &A, &bs, &pw)) && !nd) { /* nothing live: the bytes stay as they are */
        lk_kdelta_free(kp);
        return LK_OK;
    }
    st = dev_launch(c, (uint64_t)r0, rows, kp, dense, nd);
    lk_kdelta_free(kp);
    return st;
}

static lk_status dev_band(void *ctx, int64_t r0, int64_t r1, const lk_fuse_term *bt, size_t nb) {
    return nb ? dev_whole(ctx, r0, r1 - r0, bt, nb, NULL, 0) : LK_OK;
}

typedef struct tensor_ctx {
    const lk_fuse_term *terms;
    size_t n;
    const lk_fuse_opts *opts;
    int64_t out, in;
} tensor_ctx;

static lk_status host_tensor(void *ctx, lk_tensor *h) {
    const tensor_ctx *t = ctx;
    return lk_fuse_tensor(h->data, h->data, h->dtype, t->out, t->in, t->terms, t->n, t->opts, h->name);
}

/* The terms without row slices on the device: LoRA and dense terms only
 * (else the host path), validated as the CPU's terms path validates. */
static lk_status dev_terms(const dev_call *c, int64_t out, const lk_fuse_term *terms, size_t n) {
    size_t nl = 0, nd = 0, nd_all = 0, other = 0;
    for (size_t t = 0; t < n; t++) {
        nl += terms[t].kind == LK_TERM_LORA;
        nd += terms[t].kind == LK_TERM_DENSE && terms[t].scale != 0.0;
        nd_all += terms[t].kind == LK_TERM_DENSE;
        other += terms[t].kind != LK_TERM_LORA && terms[t].kind != LK_TERM_DENSE;
    }
    if (other || nd > LK_KDEV_MAX_DENSE) {
        tensor_ctx tc = {terms, n, c->opts, out, c->in};
        return host_path(c->w, host_tensor, &tc, c->s, c->stats);
    }
    lk_status st;
    if (nd_all) { /* the terms path's checks, every kind (lk_fuse_tensor_terms' errors) */
        lk_delta_prep *p;
        if ((st = lk_fuse_delta_prepare(c->wide, out, c->in, 0, 0, terms, n, c->w->name, &p))) return st;
        lk_fuse_delta_free(p);
    }
    /* the LoRA terms and the live dense ones, each in the given order: one carve */
    lk_carve cv = {0};
    const size_t o_l = LK_CARVE(&cv, nl ? nl : 1, lk_fuse_term), o_d = LK_CARVE(&cv, nd ? nd : 1, const lk_fuse_term *);
    unsigned char *mem = lk_carve_alloc(&cv);
    if (!mem) return lk_error(LK_ERR_NOMEM, "%s: out of memory", c->w->name);
    lk_fuse_term *lt = (lk_fuse_term *)(void *)(mem + o_l);
    const lk_fuse_term **dt = (const lk_fuse_term **)(void *)(mem + o_d);
    size_t il = 0, id = 0;
    for (size_t t = 0; t < n; t++) {
        if (terms[t].kind == LK_TERM_LORA) lt[il++] = terms[t];
        else if (terms[t].scale != 0.0) dt[id++] = &terms[t];
    }
    st = dev_whole(c, 0, out, lt, nl, dt, nd);
    lk_free(mem);
    return st;
}

/* w's rows and columns as the kernel sees them: out x (the rest). */
static lk_status geometry(const lk_tensor *w, int64_t *out, int64_t *in) {
    if (w->ndim < 2 || w->shape[0] <= 0)
        return lk_error(LK_ERR_SHAPE, "%s: a %d-D tensor is not a weight matrix", w->name, w->ndim);
    *out = w->shape[0];
    *in = (int64_t)(lk_tensor_numel(w) / (size_t)w->shape[0]);
    return LK_OK;
}

static lk_status device_ready(const lk_tensor *w) {
    lk_status st = lk_device_check(w->device);
    return st ? lk_error_prefix(st, "%s", w->name ? w->name : "(tensor)") : LK_OK;
}

lk_status lk_fuse_tensor_dev(lk_tensor *w, const lk_fuse_term *terms, size_t n_terms, const lk_fuse_opts *opts,
                             lk_stream *stream, lk_fuse_dev_stats *stats) {
    if (!w) return lk_error(LK_ERR_ARG, "fuse on device: NULL weight");
    int64_t out = 0, in = 0;
    lk_status st = geometry(w, &out, &in);
    if (st) return st;
    if (lk_tensor_on_host(w)) return lk_fuse_tensor(w->data, w->data, w->dtype, out, in, terms, n_terms, opts, w->name);
    const char *name = w->name ? w->name : "(tensor)";
    if ((st = device_ready(w)) || (st = lk_fuse_check_weight(w->data, w->data, w->dtype, out, in, name))) return st;
    if (n_terms && !terms) return lk_error(LK_ERR_ARG, "%s: NULL terms", name);
    const dev_call c = {.w = w, .s = stream, .opts = opts, .in = in, .wide = w->dtype == LK_DTYPE_F32, .stats = stats};
    const size_t before = stats ? stats->keys_host_fallback : 0;
    int sliced = 0;
    for (size_t t = 0; t < n_terms; t++) sliced |= lk_fuse_term_sliced(&terms[t]);
    st = sliced ? lk_fuse_bands(out, terms, n_terms, name, dev_band, (void *)&c) : dev_terms(&c, out, terms, n_terms);
    if (!st && stats && stats->keys_host_fallback == before) stats->keys_device++;
    return st;
}

typedef struct key_ctx {
    const lk_fuse_key *k;
    const lk_fuse_term *terms;
    const lk_fuse_opts *opts;
} key_ctx;

static lk_status host_key(void *ctx, lk_tensor *h) {
    const key_ctx *kc = ctx;
    return lk_fuse_key_apply(h->data, h->data, h, kc->k, kc->terms, kc->opts);
}

lk_status lk_fuse_key_apply_dev(lk_tensor *w, const lk_fuse_key *k, const lk_fuse_term *terms,
                                const lk_fuse_opts *opts, lk_stream *stream, lk_fuse_dev_stats *stats) {
    if (!w || !k) return lk_error(LK_ERR_ARG, "fuse on device: NULL weight or plan");
    if (lk_tensor_on_host(w)) return lk_fuse_key_apply(w->data, w->data, w, k, terms, opts);
    if (!lk_fuse_key_touches(k)) return LK_OK;
    lk_status st = device_ready(w);
    if (st) return st;
    /* what lk_fuse_key_apply sends to lk_fuse_tensor: terms alone on a 2-D (or conv) weight */
    if (!k->replace && !k->dora && k->n_terms && w->ndim >= 2 && lk_dtype_is_fusable(w->dtype))
        return lk_fuse_tensor_dev(w, terms, k->n_terms, opts, stream, stats);
    key_ctx kc = {k, terms, opts};
    return host_path(w, host_key, &kc, stream, stats);
}

typedef struct fp8_ctx {
    lk_tensor *scale;
    void *scale_host;
    const lk_fuse_term *terms;
    size_t n;
    const lk_fuse_opts *opts;
} fp8_ctx;

static lk_status host_fp8(void *ctx, lk_tensor *h) {
    const fp8_ctx *f = ctx;
    const lk_tensor *sc = f->scale;
    return lk_fuse_fp8(h->data, h->dtype, h->shape[0], (int64_t)(lk_tensor_numel(h) / (size_t)h->shape[0]),
                       f->scale_host, sc ? sc->dtype : LK_DTYPE_F32, sc ? (int64_t)lk_tensor_numel(sc) : 0, f->terms,
                       f->n, f->opts, h->name);
}

lk_status lk_fuse_fp8_dev(lk_tensor *w, lk_tensor *scale, const lk_fuse_term *terms, size_t n_terms,
                          const lk_fuse_opts *opts, lk_stream *stream, lk_fuse_dev_stats *stats) {
    if (!w) return lk_error(LK_ERR_ARG, "fuse on device: NULL weight");
    int64_t out = 0, in = 0;
    lk_status st = geometry(w, &out, &in);
    if (st) return st;
    const int scale_dev = scale && !lk_tensor_on_host(scale);
    if (lk_tensor_on_host(w) && !scale_dev)
        return lk_fuse_fp8(w->data, w->dtype, out, in, scale ? scale->data : NULL, scale ? scale->dtype : LK_DTYPE_F32,
                           scale ? (int64_t)lk_tensor_numel(scale) : 0, terms, n_terms, opts, w->name);
    if (lk_tensor_on_host(w) || (scale_dev && !lk_device_equal(scale->device, w->device)))
        return lk_error(LK_ERR_ARG, "%s: the FP8 weight and its scale must be on the same device", w->name);
    if ((st = device_ready(w))) return st;
    /* the scale (a few bytes) staged beside the weight, written back after it */
    fp8_ctx f = {scale, scale ? scale->data : NULL, terms, n_terms, opts};
    void *sh = NULL;
    if (scale_dev) {
        if ((st = lk_device_host_alloc(w->device, scale->nbytes, &sh))) return st;
        st = lk_device_copy(w->device, sh, scale->data, scale->nbytes, LK_COPY_D2H, stream);
        if (!st) st = lk_stream_sync(w->device, stream);
        f.scale_host = sh;
    }
    if (!st) st = host_path(w, host_fp8, &f, stream, stats);
    if (!st && scale_dev) st = lk_device_copy(w->device, scale->data, sh, scale->nbytes, LK_COPY_H2D, stream);
    if (!st && scale_dev) st = lk_stream_sync(w->device, stream);
    lk_device_host_free(w->device, sh);
    return st;
}

lk_status lk_fuse_key_staged(lk_device dev, const lk_tensor *t, void *w, const lk_tensor *sc, void *sd,
                             const lk_fuse_key *plan, const lk_fuse_term *terms, const lk_fuse_opts *fo,
                             lk_fuse_dev_stats *stats) {
    void *dw = NULL, *ds = NULL;
    lk_status st = lk_device_alloc(dev, t->nbytes, &dw);
    if (!st && sc) st = lk_device_alloc(dev, sc->nbytes, &ds);
    if (!st) st = lk_device_copy(dev, dw, w, t->nbytes, LK_COPY_H2D, NULL);
    if (!st && sc) st = lk_device_copy(dev, ds, sd, sc->nbytes, LK_COPY_H2D, NULL);
    lk_tensor wd = *t, sdt = sc ? *sc : (lk_tensor){0};
    wd.data = dw;
    wd.device = dev;
    sdt.data = ds;
    sdt.device = dev;
    if (!st)
        st = lk_dtype_is_fp8(t->dtype) ? lk_fuse_fp8_dev(&wd, sc ? &sdt : NULL, terms, plan->n_terms, fo, NULL, stats)
                                       : lk_fuse_key_apply_dev(&wd, plan, terms, fo, NULL, stats);
    if (!st) st = lk_device_copy(dev, w, dw, t->nbytes, LK_COPY_D2H, NULL);
    if (!st && sc) st = lk_device_copy(dev, sd, ds, sc->nbytes, LK_COPY_D2H, NULL);
    lk_device_free(dev, dw);
    lk_device_free(dev, ds);
    return st;
}
