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
 * are the same. Mixed term lists (dense, LoHa, LoKr beside LoRA) are
 * prepared by terms.c's lk_fuse_delta_prepare, whose buffers
 * (lk_fuse_delta_parts) the kernel chains over. The device memory of one
 * launch is one block (the non-finite slot, then every uploaded part):
 * the caller's grow-only scratch when it gives one (lk_fuse_dev_scratch:
 * the tracker keeps one across its keys and calls, so a swap allocates no
 * device memory per key), else an allocation freed before returning.
 *
 * Keys on plan.c's double path (replacements, vector terms, DoRA) run the
 * key kernel (kernel_dev.h) on the same uploads; DoRA in two passes with
 * the factors made between them on the host by plan.c's function.
 *
 * FP8 weights run the FP8 kernel (kernel_dev.h) on terms.c's narrow
 * preparation, with fp8.c's own checks, scale reading, rescale rule and
 * verdict around it (lk_fp8_check_args, lk_fp8_scale_value, lk_fp8_rescale,
 * lk_fp8_verdict): a rescale's amax kernels, the new scales on the host,
 * the judge pass, then (the verdict passed) the write pass; the stream key
 * is made here.
 *
 * The host path (OFT / BOFT, GLoRA, FP8 weights included; a replacement,
 * vector term or DoRA magnitude in another dtype than F32/F16/BF16): the
 * key is copied into pinned host memory, fused there by the CPU code and
 * copied back only when that succeeded. */
#include "lorakit/fuse_device.h"
#include "lorakit/alloc.h"
#include "core/alloc.h"
#include "core/clock.h"
#include "fuse/fuse.h"
#include "fuse/kernel_dev.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef LK_HAVE_CUDA
const void *lk_kdev_cuda_kernel(int which); /* kernel_cuda.cu */
#define KDEV_CUDA(which) lk_kdev_cuda_kernel(which)
#else
#define KDEV_CUDA(which) NULL
#endif

/* kernel_cuda.cu's // LK_AUDIT lines, the fma counts the source writes per kernel */
_Static_assert(LK_KDEV_CHAINS * LK_KDEV_RPT == 12,
               "the LK_AUDIT lines of lk_kdev_fuse/key/normrows/fp8/fp8amax_kernel (f32)");
_Static_assert(LK_KDEV_CHAINS * LK_KDEV_RPT + LK_KDEV_RPT == 16, "the LK_AUDIT lines of lk_kdev_key/normrows_kernel (f64)");
_Static_assert(LK_KDEV_CHAINS == 3, "the LK_AUDIT line of lk_kdev_normcols_kernel");

/* emul: the CUDA kernels' bodies for one thread (kernel_dev.h). */
static void fuse_emul(const void *args, const lk_thread_idx *t) {
    lk_kdev_fuse_thread((const lk_kdev_args *)args, t->block_idx.x, t->block_idx.y, t->thread_idx.x, t->block_dim.x,
                        t->grid_dim.y);
}
static void key_emul(const void *args, const lk_thread_idx *t) {
    lk_kdev_key_thread((const lk_kdev_key *)args, t->block_idx.x, t->block_idx.y, t->thread_idx.x, t->block_dim.x,
                       t->grid_dim.y);
}
static void normrows_emul(const void *args, const lk_thread_idx *t) {
    lk_kdev_normrows_thread((const lk_kdev_key *)args, (uint64_t)t->block_idx.x * t->block_dim.x + t->thread_idx.x);
}
static void normcols_emul(const void *args, const lk_thread_idx *t) {
    lk_kdev_normcols_thread((const lk_kdev_key *)args, (uint64_t)t->block_idx.x * t->block_dim.x + t->thread_idx.x);
}
static void fp8_emul(const void *args, const lk_thread_idx *t) {
    lk_kdev_fp8_thread((const lk_kdev_fp8 *)args, t->block_idx.x, t->block_idx.y, t->thread_idx.x, t->block_dim.x,
                       t->grid_dim.y);
}
static void fp8amax_emul(const void *args, const lk_thread_idx *t) {
    lk_kdev_fp8amax_thread((const lk_kdev_fp8 *)args, t->block_idx.x, t->block_idx.y, t->thread_idx.x, t->block_dim.x,
                           t->grid_dim.y);
}
static void fp8red_emul(const void *args, const lk_thread_idx *t) {
    lk_kdev_fp8red_thread((const lk_kdev_fp8 *)args, (uint64_t)t->block_idx.x * t->block_dim.x + t->thread_idx.x);
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

/* One launch's inputs: a weight (or band) of rows x in at w (device). */
typedef struct dev_call {
    lk_tensor *w;
    lk_stream *s;
    const lk_fuse_opts *opts;
    int64_t in;
    int wide;
    lk_fuse_dev_stats *stats;
    lk_fuse_dev_scratch *scr; /* the caller's grow-only block (NULL: one allocation per launch) */
} dev_call;

static size_t align256(size_t n) { return (n + 255u) & ~(size_t)255u; }

/* The uploads of one launch, carved from one device block after the
 * non-finite slot: each part's host bytes and the field (a kernel
 * argument's, or one of a host array that is itself a later part) that
 * gets its device address; as many parts as the terms need (up_free). */
typedef struct dev_part {
    const void *src;
    const void **fix;
    size_t n, at;
} dev_part;
typedef struct dev_up {
    dev_part *p;
    size_t np, cap, tot;
    int ovf, nomem;
} dev_up;

static void up_add(dev_up *u, const void *src, size_t n, const void **fix) {
    if (u->np == u->cap) {
        const size_t cap = u->cap ? 2 * u->cap : 16;
        dev_part *q = u->nomem ? NULL : lk_realloc(u->p, cap * sizeof *q);
        if (!q) {
            u->nomem = 1;
            return;
        }
        u->p = q;
        u->cap = cap;
    }
    u->p[u->np++] = (dev_part){src, fix, n, u->tot};
    u->ovf |= !lk_checked_add(u->tot, align256(n), &u->tot);
}

static void up_free(dev_up *u) {
    lk_free(u->p);
    *u = (dev_up){0};
}

/* A prepared chain (NULL: none) of rows x I as the kernel reads it. */
static void up_chain(dev_up *u, const lk_kdelta *kp, size_t rows, size_t I, size_t vsz, lk_kdev_chain *c) {
    const void *A = NULL, *bs = NULL;
    size_t pw = 0;
    const size_t R = kp ? lk_kdelta_factors(kp, &A, &bs, &pw) : 0;
    *c = (lk_kdev_chain){.R = R, .pw = pw, .pw_shift = -1};
    if (!R) return;
    size_t a_bytes = 0, b_bytes = 0;
    u->ovf |= !lk_checked_mul((I + pw - 1) / pw * pw, R, &a_bytes) || !lk_checked_mul(a_bytes, vsz, &a_bytes) ||
              !lk_checked_mul(rows, R, &b_bytes) || !lk_checked_mul(b_bytes, vsz, &b_bytes);
    for (int sh = 0; sh < 63 && !(pw & (pw - 1)); sh++)
        if (((size_t)1 << sh) == pw) c->pw_shift = sh;
    up_add(u, A, a_bytes, &c->A);
    up_add(u, bs, b_bytes, &c->bs);
}

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

void lk_fuse_dev_scratch_free(lk_fuse_dev_scratch *s) {
    if (!s) return;
    lk_device_free(s->dev, s->p);
    *s = (lk_fuse_dev_scratch){0};
}

/* A device block of tot bytes for one launch: the caller's scratch (grown
 * to tot if smaller: freed and allocated again, never shrunk) or a new
 * allocation (up_close frees it). */
static lk_status up_block(const dev_call *c, size_t tot, unsigned char **m) {
    const lk_device d = c->w->device;
    lk_fuse_dev_scratch *sc = c->scr;
    if (!sc) return lk_device_alloc(d, tot, (void **)m);
    if (sc->p && (sc->bytes < tot || !lk_device_equal(sc->dev, d))) lk_fuse_dev_scratch_free(sc);
    if (!sc->p) {
        lk_status st = lk_device_alloc(d, tot, &sc->p);
        if (st) return st;
        sc->dev = d;
        sc->bytes = tot;
    }
    *m = sc->p;
    return LK_OK;
}

static void up_close(const dev_call *c, unsigned char *m) {
    if (!c->scr || m != c->scr->p) lk_device_free(c->w->device, m);
}

/* Uploads u's parts into one device block *m (their addresses into the
 * kernel arguments' fields; a part with no source is an output, not
 * copied), after the non-finite slot (~0: none yet). */
static lk_status up_open(const dev_call *c, dev_up *u, unsigned char **m) {
    const lk_device d = c->w->device;
    size_t tot = 0;
    *m = NULL;
    if (u->nomem) return lk_error(LK_ERR_NOMEM, "%s: out of memory for the list of uploads", c->w->name);
    if (u->ovf || !lk_checked_add(u->tot, 256, &tot))
        return lk_error(LK_ERR_SHAPE, "%s: factors too large for the device", c->w->name);
    lk_status st = up_block(c, tot, m);
    if (st) return lk_error_prefix(st, "%s: device memory for the factors", c->w->name);
    const unsigned long long none = ~0ull;
    st = lk_device_copy(d, *m, &none, sizeof none, LK_COPY_H2D, c->s);
    for (size_t i = 0; i < u->np; i++) *u->p[i].fix = *m + 256 + u->p[i].at; /* every address first: a part */
    for (size_t i = 0; i < u->np && !st; i++)                                   /* may hold others' */
        if (u->p[i].src) st = lk_device_copy(d, *m + 256 + u->p[i].at, u->p[i].src, u->p[i].n, LK_COPY_H2D, c->s);
    if (!st && c->stats) c->stats->bytes_uploaded += u->tot + sizeof none;
    if (st) {
        up_close(c, *m);
        *m = NULL;
    }
    return st;
}

/* One launch until done (its time in the stats). */
typedef void (*emul_fn)(const void *args, const lk_thread_idx *t);
static lk_status dev_run(const dev_call *c, int which, emul_fn emul, lk_dim3 grid, const void *args, size_t size) {
    const lk_device d = c->w->device;
    static const char *const names[] = {"lk_kdev_fuse", "lk_kdev_key", "lk_kdev_normrows", "lk_kdev_normcols",
                                        "lk_kdev_fp8", "lk_kdev_fp8amax", "lk_kdev_fp8red"};
    const lk_kernel k = {names[which], KDEV_CUDA(which), emul};
    const double t0 = lk_now_s();
    lk_status st = lk_device_launch(d, &k, grid, (lk_dim3){LK_KDEV_BLOCK, 1, 1}, args, size, c->s);
    if (!st) st = lk_stream_sync(d, c->s);
    if (!st && c->stats) c->stats->seconds_kernel += lk_now_s() - t0;
    return st;
}

static lk_status dev_get(const dev_call *c, void *dst, const void *src, size_t n) {
    lk_status st = lk_device_copy(c->w->device, dst, src, n, LK_COPY_D2H, c->s);
    return st ? st : lk_stream_sync(c->w->device, c->s);
}

/* The grid of the element kernels: columns in blocks, row groups capped at 65535. */
static lk_dim3 elem_grid(uint64_t rows, uint64_t in) {
    const uint64_t groups = (rows + LK_KDEV_RPT - 1) / LK_KDEV_RPT;
    return (lk_dim3){(unsigned)((in + LK_KDEV_BLOCK - 1) / LK_KDEV_BLOCK), groups < 65535 ? (unsigned)groups : 65535u, 1};
}

/* The weight's fields of a, rows x in from row row_base. */
static void args_weight(const dev_call *c, lk_kdev_args *a, uint64_t row_base, int64_t rows, unsigned char *m) {
    char *wband = (char *)c->w->data + (size_t)row_base * (size_t)c->in * lk_dtype_size(c->w->dtype);
    a->w_out = wband;
    a->w_in = wband;
    a->bad = (unsigned long long *)m;
    a->rows = (uint64_t)rows;
    a->in = (uint64_t)c->in;
    a->row_base = row_base;
    a->dt = (int)c->w->dtype;
    a->wide = c->wide;
}

/* Uploads u, launches the fuse kernel a on rows x in from row row_base of
 * the weight, and judges. */
static lk_status dev_launch(const dev_call *c, uint64_t row_base, int64_t rows, lk_kdev_args *a, dev_up *u) {
    unsigned char *m;
    lk_status st = up_open(c, u, &m);
    if (st) return st;
    args_weight(c, a, row_base, rows, m);
    unsigned long long bad = ~0ull;
    st = dev_run(c, 0, fuse_emul, elem_grid((uint64_t)rows, a->in), a, sizeof *a);
    if (!st) st = dev_get(c, &bad, m, sizeof bad);
    up_close(c, m);
    if (st) return lk_error_prefix(st, "%s", c->w->name);
    return dev_verdict(c, bad, (const char *)a->w_in, row_base);
}

/* rows [r0, r0 + rows) with LoRA terms lt only (their B covering exactly
 * these rows): the CPU's preparation, then one launch. */
static lk_status dev_whole(const dev_call *c, int64_t r0, int64_t rows, const lk_fuse_term *lt, size_t nl) {
    lk_kdelta *kp = NULL;
    lk_status st = lk_kdelta_prepare(c->wide, rows, c->in, 0, rows, lt, nl, c->w->name, &kp);
    if (st) return st;
    lk_kdev_args a = {0};
    dev_up u = {0};
    up_chain(&u, kp, (size_t)rows, (size_t)c->in, c->wide ? sizeof(double) : sizeof(float), &a.lora);
    if (a.lora.R) st = dev_launch(c, (uint64_t)r0, rows, &a, &u); /* nothing live: the bytes stay as they are */
    up_free(&u);
    lk_kdelta_free(kp);
    return st;
}

static lk_status dev_band(void *ctx, int64_t r0, int64_t r1, const lk_fuse_term *bt, size_t nb) {
    return nb ? dev_whole(ctx, r0, r1 - r0, bt, nb) : LK_OK;
}

/* LoKr's index tables for an out x in weight: per row (o / c) b, (o % c) D,
 * per column j / D, j % D, into tab (2 out + 2 in values). */
static void kron_tables(uint64_t *tab, const lk_delta_xpart *x, size_t out, size_t in) {
    for (size_t o = 0; o < out; o++) {
        tab[2 * o] = (o / x->c) * x->b;
        tab[2 * o + 1] = (o % x->c) * x->D;
    }
    for (size_t j = 0; j < in; j++) {
        tab[2 * out + 2 * j] = j / x->D;
        tab[2 * out + 2 * j + 1] = j % x->D;
    }
}

/* A preparation of the row driver (terms.c) as kernel arguments: its
 * LoRA chain into a, its other terms (any number) as a host array of
 * lk_kdev_x that is itself uploaded (a->x its device address), their
 * buffers into u; the array and LoKr's index tables live in *keep
 * (lk_free; NULL when there are no other terms). */
static lk_status up_delta(const dev_call *c, const lk_delta_prep *p, size_t O, dev_up *u, lk_kdev_args *a,
                          void **keep) {
    const size_t vsz = c->wide ? sizeof(double) : sizeof(float), I = (size_t)c->in;
    size_t nx = 0, nkron = 0, xbytes = 0, tbytes = 0, tot = 0;
    const lk_kdelta *lora = lk_fuse_delta_parts(p, NULL, 0, &nx);
    *keep = NULL;
    up_chain(u, lora, O, I, vsz, &a->lora);
    a->n_x = 0;
    if (!nx) return LK_OK;
    lk_delta_xpart *xp = nx < SIZE_MAX / sizeof *xp ? lk_malloc(nx * sizeof *xp) : NULL;
    if (!xp) return lk_error(LK_ERR_NOMEM, "%s: out of memory for the terms' list", c->w->name);
    lk_fuse_delta_parts(p, xp, nx, &nx);
    for (size_t t = 0; t < nx; t++) nkron += xp[t].kind == LK_TERM_KRON;
    if (nx > 0x7fffffff || !lk_checked_mul(nx, sizeof(lk_kdev_x), &xbytes) || !lk_checked_add(O, I, &tbytes) ||
        !lk_checked_mul(tbytes, 2 * sizeof(uint64_t), &tbytes) || !lk_checked_mul(tbytes, nkron, &tbytes) ||
        !lk_checked_add(xbytes, tbytes, &tot) || !(*keep = lk_calloc(1, tot))) {
        lk_free(xp);
        return lk_error(LK_ERR_NOMEM, "%s: out of memory for the terms' device arguments", c->w->name);
    }
    lk_kdev_x *xs = *keep;
    uint64_t *tabs = (uint64_t *)(void *)((unsigned char *)*keep + xbytes);
    for (size_t t = 0, kt = 0; t < nx; t++) {
        lk_kdev_x *x = &xs[t];
        const lk_delta_xpart *q = &xp[t];
        if (q->kind == LK_TERM_DENSE) {
            *x = (lk_kdev_x){.kind = LK_KDEV_X_DENSE, .dt = (int)q->dense->dtype, .scale = q->scale};
            up_add(u, q->dense->data, q->dense->nbytes, &x->D);
        } else if (q->kind == LK_TERM_HADA) {
            x->kind = LK_KDEV_X_HADA;
            up_chain(u, q->p1, O, I, vsz, &x->p1);
            up_chain(u, q->p2, O, I, vsz, &x->p2);
        } else {
            uint64_t *tab = tabs + (kt++) * 2 * (O + I);
            kron_tables(tab, q, O, I);
            x->kind = LK_KDEV_X_KRON;
            up_add(u, q->w1, q->a * q->b * vsz, &x->w1);
            up_add(u, q->w2, q->c * q->D * vsz, &x->w2);
            up_add(u, tab, 2 * O * sizeof *tab, (const void **)&x->rtab);
            up_add(u, tab + 2 * O, 2 * I * sizeof *tab, (const void **)&x->ctab);
        }
    }
    up_add(u, xs, xbytes, (const void **)(void *)&a->x); /* after its fields' parts: up_open fixes them first */
    a->n_x = (int)nx;
    lk_free(xp);
    return LK_OK;
}

/* Every kind the row driver takes (LoRA, dense, LoHa, LoKr; any number)
 * on the whole weight, from terms.c's own preparation (its checks, its
 * errors). */
static lk_status dev_mixed(const dev_call *c, int64_t out, const lk_fuse_term *terms, size_t n) {
    lk_delta_prep *p;
    lk_status st = lk_fuse_delta_prepare(c->wide, out, c->in, 0, out, terms, n, c->w->name, &p);
    if (st) return st;
    lk_kdev_args a = {0};
    dev_up u = {0};
    void *keep = NULL;
    st = up_delta(c, p, (size_t)out, &u, &a, &keep);
    if (!st && (a.lora.R || a.n_x)) st = dev_launch(c, 0, out, &a, &u); /* nothing live: unchanged */
    up_free(&u);
    lk_free(keep);
    lk_fuse_delta_free(p);
    return st;
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

/* The terms without row slices on the device: LoRA terms alone through
 * the kernel's preparation, any mix with dense / LoHa / LoKr terms through
 * the row driver's (the CPU's dispatch and checks, lk_fuse_tensor's); OFT
 * / BOFT and GLoRA (terms that read the weight) take the host path. */
static lk_status dev_terms(const dev_call *c, int64_t out, const lk_fuse_term *terms, size_t n) {
    int lora_only = 1, host = lk_fuse_wterms(terms, n) != 0;
    for (size_t t = 0; t < n; t++) lora_only &= terms[t].kind == LK_TERM_LORA;
    lk_status st = LK_OK;
    if (!host) st = lora_only ? dev_whole(c, 0, out, terms, n) : dev_mixed(c, out, terms, n);
    if (st || !host) return st;
    tensor_ctx tc = {terms, n, c->opts, out, c->in};
    return host_path(c->w, host_tensor, &tc, c->s, c->stats);
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

static lk_status tensor_dev(lk_tensor *w, const lk_fuse_term *terms, size_t n_terms, const lk_fuse_opts *opts,
                            lk_stream *stream, lk_fuse_dev_scratch *scr, lk_fuse_dev_stats *stats) {
    if (!w) return lk_error(LK_ERR_ARG, "fuse on device: NULL weight");
    int64_t out = 0, in = 0;
    lk_status st = geometry(w, &out, &in);
    if (st) return st;
    if (lk_tensor_on_host(w)) return lk_fuse_tensor(w->data, w->data, w->dtype, out, in, terms, n_terms, opts, w->name);
    const char *name = w->name ? w->name : "(tensor)";
    if ((st = device_ready(w)) || (st = lk_fuse_check_weight(w->data, w->data, w->dtype, out, in, name))) return st;
    if (n_terms && !terms) return lk_error(LK_ERR_ARG, "%s: NULL terms", name);
    const dev_call c = {.w = w, .s = stream, .opts = opts, .in = in, .wide = w->dtype == LK_DTYPE_F32, .stats = stats,
                        .scr = scr};
    const size_t before = stats ? stats->keys_host_fallback : 0;
    int sliced = 0;
    for (size_t t = 0; t < n_terms; t++) sliced |= lk_fuse_term_sliced(&terms[t]);
    st = sliced ? lk_fuse_bands(out, terms, n_terms, name, dev_band, (void *)&c) : dev_terms(&c, out, terms, n_terms);
    if (!st && stats && stats->keys_host_fallback == before) stats->keys_device++;
    return st;
}

lk_status lk_fuse_tensor_dev(lk_tensor *w, const lk_fuse_term *terms, size_t n_terms, const lk_fuse_opts *opts,
                             lk_stream *stream, lk_fuse_dev_stats *stats) {
    return tensor_dev(w, terms, n_terms, opts, stream, NULL, stats);
}

/* ---- plan.c's double path on the device (the key kernel) ---- */

typedef struct key_call {
    dev_call c;
    lk_kdev_key k;
    dev_up u;
    lk_delta_prep *p;
    void *keep;         /* up_delta's host arrays */
    lk_dora_rule dr;
    int64_t rows, cols;
    size_t n_norm, n_f; /* DoRA: sums per row or channel, factors per row or column */
} key_call;

static int elem_dtype(lk_dtype d) { return d == LK_DTYPE_F32 || d == LK_DTYPE_F16 || d == LK_DTYPE_BF16; }

/* DoRA's kernel arguments: its term's delta (terms.c's preparation), the
 * rule, the sums and factors as device outputs / inputs. */
static lk_status key_dora(key_call *kc, const lk_fuse_key *k, int *host) {
    const lk_tensor *t = kc->c.w;
    lk_kdev_key *kk = &kc->k;
    kc->dr = lk_fuse_dora_rule(k, t, kc->rows, kc->cols);
    const lk_dora_rule *r = &kc->dr;
    *host |= !elem_dtype(r->mag->dtype);
    const lk_fuse_term lt = lk_fuse_dora_term(k, t, r);
    lk_status st = lk_fuse_delta_prepare(kc->c.wide, kc->rows, kc->cols, 0, kc->rows, &lt, 1, t->name, &kc->p);
    if (st) return st;
    kk->dora = 1;
    kk->finish = r->finish;
    kk->sd = r->sd;
    kk->norm_w = r->norm_w;
    kk->f_per_row = r->on_out;
    kk->K = (uint64_t)r->K;
    kk->n_ch = (uint64_t)r->in_ch;
    kc->n_norm = r->on_out ? (size_t)kc->rows : (size_t)r->in_ch;
    kc->n_f = r->on_out ? (size_t)kc->rows : (size_t)kc->cols;
    up_add(&kc->u, NULL, kc->n_norm * sizeof(double), (const void **)&kk->norm);
    up_add(&kc->u, NULL, kc->n_f * sizeof(double), (const void **)&kk->f);
    return LK_OK;
}

/* The key's inputs as kernel arguments: a replacement, the terms (2-D:
 * their delta; 1-D: vector terms, their descriptions an uploaded host
 * array in kc->keep) or DoRA. *host: what the key kernel does not take
 * (dtypes other than F32/F16/BF16). */
static lk_status key_setup(key_call *kc, const lk_fuse_key *k, const lk_fuse_term *terms, int *host) {
    const lk_tensor *t = kc->c.w;
    lk_kdev_key *kk = &kc->k;
    lk_status st = LK_OK;
    if (k->dora) st = key_dora(kc, k, host);
    else if (k->n_terms && t->ndim >= 2) {
        st = lk_fuse_delta_prepare(kc->c.wide, kc->rows, kc->cols, 0, kc->rows, terms, k->n_terms, t->name, &kc->p);
        kk->two_d = 1;
    } else if (k->n_terms) {
        lk_kdev_vec *v = k->n_terms <= 0x7fffffff ? lk_calloc(k->n_terms, sizeof *v) : NULL;
        if (!v) return lk_error(LK_ERR_NOMEM, "%s: out of memory for the vector terms' list", t->name);
        kc->keep = v;
        for (size_t i = 0; i < k->n_terms && !*host; i++) {
            *host |= !elem_dtype(terms[i].B->dtype);
            v[i] = (lk_kdev_vec){.scale = terms[i].scale, .dt = (int)terms[i].B->dtype};
            up_add(&kc->u, terms[i].B->data, terms[i].B->nbytes, &v[i].v);
        }
        up_add(&kc->u, v, k->n_terms * sizeof *v, (const void **)(void *)&kk->vec); /* after its fields' parts */
        kk->n_vec = (int)k->n_terms;
    }
    if (!st && kc->p) {
        st = up_delta(&kc->c, kc->p, (size_t)kc->rows, &kc->u, &kk->d, &kc->keep);
    }
    if (!st && k->replace) {
        *host |= !elem_dtype(k->replace->dtype);
        kk->rep_dt = (int)k->replace->dtype;
        kk->sr = (double)k->replace_strength;
        up_add(&kc->u, k->replace->data, k->replace->nbytes, &kk->rep);
    }
    return st;
}

/* DoRA's first pass: the sums on the device, the factors m / (sqrt + eps)
 * on the host (plan.c's function), uploaded for the second. */
static lk_status key_dora_factors(key_call *kc) {
    lk_kdev_key *kk = &kc->k;
    const lk_dora_rule *r = &kc->dr;
    const uint64_t groups = r->on_out ? ((uint64_t)kc->rows + LK_KDEV_RPT - 1) / LK_KDEV_RPT : (uint64_t)r->in_ch;
    const lk_dim3 grid = {(unsigned)((groups + LK_KDEV_BLOCK - 1) / LK_KDEV_BLOCK), 1, 1};
    lk_status st = dev_run(&kc->c, r->on_out ? 2 : 3, r->on_out ? normrows_emul : normcols_emul, grid, kk, sizeof *kk);
    double *h = st ? NULL : lk_malloc((kc->n_norm + kc->n_f) * sizeof *h);
    if (!st && !h) st = lk_error(LK_ERR_NOMEM, "%s: out of memory for DoRA's norms", kc->c.w->name);
    if (!st) st = dev_get(&kc->c, h, kk->norm, kc->n_norm * sizeof *h);
    double *f = h ? h + kc->n_norm : NULL;
    for (size_t i = 0; !st && i < kc->n_f; i++) {
        const size_t ch = r->on_out ? i : i / (size_t)r->K;
        f[i] = lk_fuse_dora_factor((double)lk_key_load(r->mag->data, (int)r->mag->dtype, ch), h[ch], r->eps);
    }
    if (!st) st = lk_device_copy(kc->c.w->device, (void *)kk->f, f, kc->n_f * sizeof *f, LK_COPY_H2D, kc->c.s);
    lk_free(h);
    return st;
}

/* Uploads, runs (DoRA: both passes) and judges: a non-finite element is
 * the CPU's error, its value from the noted class. */
static lk_status key_run(key_call *kc, const lk_fuse_opts *opts) {
    unsigned char *m;
    lk_status st = up_open(&kc->c, &kc->u, &m);
    if (st) return st;
    args_weight(&kc->c, &kc->k.d, 0, kc->rows, m);
    if (kc->k.dora) st = key_dora_factors(kc);
    unsigned long long bad = ~0ull;
    if (!st) st = dev_run(&kc->c, 1, key_emul, elem_grid((uint64_t)kc->rows, (uint64_t)kc->cols), &kc->k, sizeof kc->k);
    if (!st) st = dev_get(&kc->c, &bad, m, sizeof bad);
    up_close(&kc->c, m);
    if (st) return lk_error_prefix(st, "%s", kc->c.w->name);
    if (bad == ~0ull) return LK_OK;
    const unsigned cls = (unsigned)(bad & 3u);
    const double x = cls == 0 ? INFINITY : cls == 1 ? -INFINITY : NAN;
    return lk_fuse_key_nonfinite(x, kc->c.w->name, (size_t)(bad >> 2), opts);
}

/* A key with a replacement, DoRA or vector terms on the device; *host:
 * nothing done, the caller takes the host path. */
static lk_status dev_key(lk_tensor *w, const lk_fuse_key *k, const lk_fuse_term *terms, const lk_fuse_opts *opts,
                         lk_stream *stream, lk_fuse_dev_scratch *scr, lk_fuse_dev_stats *stats, int *host) {
    key_call kc = {.c = {.w = w, .s = stream, .opts = opts, .wide = w->dtype == LK_DTYPE_F32, .stats = stats, .scr = scr}};
    kc.rows = w->ndim < 2 ? 1 : w->shape[0];
    kc.cols = (int64_t)(lk_tensor_numel(w) / (size_t)kc.rows);
    kc.c.in = kc.cols;
    lk_status st = key_setup(&kc, k, terms, host);
    if (!st && !*host) st = key_run(&kc, opts);
    up_free(&kc.u);
    lk_free(kc.keep);
    lk_fuse_delta_free(kc.p);
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
    return lk_fuse_key_apply_dev_in(w, k, terms, opts, stream, NULL, stats);
}

lk_status lk_fuse_key_apply_dev_in(lk_tensor *w, const lk_fuse_key *k, const lk_fuse_term *terms,
                                   const lk_fuse_opts *opts, lk_stream *stream, lk_fuse_dev_scratch *scratch,
                                   lk_fuse_dev_stats *stats) {
    if (!w || !k) return lk_error(LK_ERR_ARG, "fuse on device: NULL weight or plan");
    if (lk_tensor_on_host(w)) return lk_fuse_key_apply(w->data, w->data, w, k, terms, opts);
    if (!lk_fuse_key_touches(k)) return LK_OK;
    lk_status st = device_ready(w);
    if (st) return st;
    /* what lk_fuse_key_apply sends to lk_fuse_tensor: terms alone on a 2-D (or conv) weight */
    if (!k->replace && !k->dora && k->n_terms && w->ndim >= 2 && lk_dtype_is_fusable(w->dtype))
        return tensor_dev(w, terms, k->n_terms, opts, stream, scratch, stats);
    if ((st = lk_fuse_key_check(w, k))) return st;
    if (!lk_dtype_is_fusable(w->dtype)) { /* replaced whole at strength 1: one upload */
        st = lk_device_copy(w->device, w->data, k->replace->data, w->nbytes, LK_COPY_H2D, stream);
        if (!st) st = lk_stream_sync(w->device, stream);
        if (!st && stats) stats->keys_device++;
        return st;
    }
    int host = 0;
    if ((st = dev_key(w, k, terms, opts, stream, scratch, stats, &host))) return st;
    if (!host) {
        if (stats) stats->keys_device++;
        return LK_OK;
    }
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

/* ---- FP8 weights on the device kernel (kernel_dev.h's FP8 passes) ---- */

typedef struct fp8_call {
    dev_call c;
    lk_kdev_fp8 f;
    dev_up u;
    lk_delta_prep *p;
    void *keep;         /* up_delta's host arrays */
    size_t NS;          /* scale values used: O per row, else 1 */
    int rescale;
    unsigned char *hb;  /* host: s_old, s_new (NS doubles each), the overflow count, O amax (lk_free) */
} fp8_call;

/* The scales (fp8.c's reading of them) and zeroed counter on the host,
 * as uploads, and a rescale's amax slots and rows (device outputs); the
 * format, rounding and stream key as fp8.c's job takes them. */
static lk_status fp8_setup(fp8_call *fc, void *sh, lk_dtype sdt, int64_t n_scale) {
    const lk_tensor *w = fc->c.w;
    const lk_fuse_opts *opts = fc->c.opts;
    const size_t O = (size_t)w->shape[0], I = (size_t)fc->c.in;
    lk_kdev_fp8 *f = &fc->f;
    f->per_row = sh && n_scale == (int64_t)O && O > 1;
    fc->rescale = sh && opts->fp8.scale == LK_FP8_RESCALE;
    fc->NS = f->per_row ? O : 1;
    size_t hbn = 0;
    if (!lk_checked_mul(2 * fc->NS + 1, sizeof(double), &hbn) || !lk_checked_add(hbn, O * sizeof(unsigned), &hbn) ||
        !(fc->hb = lk_calloc(1, hbn)))
        return lk_error(LK_ERR_NOMEM, "%s: out of memory for the FP8 scales", w->name);
    double *s0 = (double *)(void *)fc->hb, *sn = s0 + fc->NS;
    unsigned long long *over = (unsigned long long *)(void *)(sn + fc->NS);
    for (size_t r = 0; r < fc->NS; r++) s0[r] = sn[r] = sh ? lk_fp8_scale_value(sh, sdt, r) : 1.0;
    f->fmt = w->dtype == LK_DTYPE_F8_E5M2 ? LK_FP8_E5M2_FMT : LK_FP8_E4M3_FMT;
    f->stoch = opts->fp8.rounding == LK_FP8_STOCHASTIC;
    f->key = lk_fp8_stream_key(opts->fp8.seed, w->name);
    up_add(&fc->u, s0, fc->NS * sizeof *s0, (const void **)(void *)&f->s_old);
    up_add(&fc->u, sn, fc->NS * sizeof *sn, (const void **)(void *)&f->s_new);
    up_add(&fc->u, over, sizeof *over, (const void **)(void *)&f->over);
    if (fc->rescale) {
        size_t part = 0;
        f->n_part = (I + LK_KDEV_AMAX_COLS - 1) / LK_KDEV_AMAX_COLS;
        fc->u.ovf |= !lk_checked_mul((size_t)f->n_part, O, &part) || !lk_checked_mul(part, sizeof(unsigned), &part);
        up_add(&fc->u, NULL, part, (const void **)(void *)&f->part);
        up_add(&fc->u, NULL, O * sizeof(unsigned), (const void **)(void *)&f->amax);
    }
    return LK_OK;
}

/* A rescale's amax: the slots' and the rows' kernels on the device, the
 * new scales on the host (fp8.c's rule, written into the scale's host
 * copy sh), uploaded. */
static lk_status fp8_rescale_pass(fp8_call *fc, lk_dim3 grid, void *sh, lk_dtype sdt) {
    lk_kdev_fp8 *f = &fc->f;
    const size_t O = (size_t)fc->c.w->shape[0];
    double *sn = (double *)(void *)fc->hb + fc->NS;
    unsigned *amax = (unsigned *)(void *)(sn + fc->NS + 1);
    const lk_dim3 gslots = {(unsigned)((f->n_part + LK_KDEV_BLOCK - 1) / LK_KDEV_BLOCK), grid.y, 1},
                  grows = {(unsigned)((O + LK_KDEV_BLOCK - 1) / LK_KDEV_BLOCK), 1, 1};
    lk_status st = dev_run(&fc->c, 5, fp8amax_emul, gslots, f, sizeof *f);
    if (!st) st = dev_run(&fc->c, 6, fp8red_emul, grows, f, sizeof *f);
    if (!st) st = dev_get(&fc->c, amax, f->amax, O * sizeof *amax);
    if (st) return st;
    if (!f->per_row) /* a per-tensor scale: the max of the rows' maxima */
        for (size_t r = 1; r < O; r++) amax[0] = amax[r] > amax[0] ? amax[r] : amax[0];
    const float fmax = (float)lk_fp8_max(fc->c.w->dtype);
    for (size_t r = 0; r < fc->NS; r++) lk_fp8_rescale(sh, sdt, r, fmax, lk_u2f(amax[r]), &sn[r]);
    return lk_device_copy(fc->c.w->device, (void *)f->s_new, sn, fc->NS * sizeof *sn, LK_COPY_H2D, fc->c.s);
}

/* Uploads, runs the passes (amax, judge) and judges as fp8.c does; the
 * write pass only after a passing verdict, so a failure leaves the weight
 * as it was (the judge is skipped when nothing can fail it: saturating
 * and non-finite allowed). */
static lk_status fp8_run(fp8_call *fc, void *sh, lk_dtype sdt) {
    const lk_tensor *w = fc->c.w;
    const lk_fuse_opts *opts = fc->c.opts;
    unsigned char *m;
    lk_status st = up_open(&fc->c, &fc->u, &m);
    if (st) return st;
    const uint64_t O = (uint64_t)w->shape[0], I = (uint64_t)fc->c.in;
    args_weight(&fc->c, &fc->f.d, 0, (int64_t)O, m);
    const lk_dim3 grid = elem_grid(O, I);
    if (fc->rescale) st = fp8_rescale_pass(fc, grid, sh, sdt);
    unsigned long long bad = ~0ull, over = 0;
    if (!st && !(opts->fp8.saturate && opts->allow_nonfinite)) {
        fc->f.pass = 2;
        st = dev_run(&fc->c, 4, fp8_emul, grid, &fc->f, sizeof fc->f);
        if (!st) st = dev_get(&fc->c, &over, fc->f.over, sizeof over);
        if (!st) st = dev_get(&fc->c, &bad, m, sizeof bad);
        if (!st) {
            const unsigned cls = (unsigned)(bad & 3u);
            const double bad_v = cls == 0 ? INFINITY : cls == 1 ? -INFINITY : cls == 2 ? NAN : -NAN;
            st = lk_fp8_verdict(w->name, w->dtype, (size_t)O, (size_t)I, (size_t)over,
                                bad == ~0ull ? SIZE_MAX : (size_t)(bad >> 2), bad_v, fc->rescale, sh != NULL, opts);
            if (st) {
                up_close(&fc->c, m);
                return st;
            }
        }
    }
    fc->f.pass = 3;
    if (!st) st = dev_run(&fc->c, 4, fp8_emul, grid, &fc->f, sizeof fc->f);
    up_close(&fc->c, m);
    return st ? lk_error_prefix(st, "%s", w->name) : LK_OK;
}

/* lk_fuse_fp8 on the device: its checks (sh: the scale's values on the
 * host), terms.c's narrow preparation uploaded, the passes. */
static lk_status dev_fp8(lk_tensor *w, int64_t out, int64_t in, const lk_tensor *scale, void *sh,
                         const lk_fuse_term *terms, size_t n, const lk_fuse_opts *opts, lk_stream *s,
                         lk_fuse_dev_scratch *scr, lk_fuse_dev_stats *stats) {
    const lk_dtype sdt = scale ? scale->dtype : LK_DTYPE_F32;
    const int64_t n_scale = scale ? (int64_t)lk_tensor_numel(scale) : 0;
    lk_status st = lk_cancel_check(opts->cancel, w->name);
    if (!st) st = lk_fp8_check_args(w->data, w->dtype, out, in, sh, sdt, n_scale, terms, n, w->name);
    if (st) return st;
    fp8_call fc = {.c = {.w = w, .s = s, .opts = opts, .in = in, .wide = 0, .stats = stats, .scr = scr}};
    st = lk_fuse_delta_prepare(0, out, in, 0, out, terms, n, w->name, &fc.p);
    if (!st) st = up_delta(&fc.c, fc.p, (size_t)out, &fc.u, &fc.f.d, &fc.keep);
    if (!st) st = fp8_setup(&fc, sh, sdt, n_scale);
    if (!st) st = fp8_run(&fc, sh, sdt);
    if (!st && stats) stats->keys_device++;
    up_free(&fc.u);
    lk_free(fc.hb);
    lk_free(fc.keep);
    lk_fuse_delta_free(fc.p);
    return st;
}

lk_status lk_fuse_fp8_dev(lk_tensor *w, lk_tensor *scale, const lk_fuse_term *terms, size_t n_terms,
                          const lk_fuse_opts *opts, lk_stream *stream, lk_fuse_dev_stats *stats) {
    return lk_fuse_fp8_dev_in(w, scale, terms, n_terms, opts, stream, NULL, stats);
}

lk_status lk_fuse_fp8_dev_in(lk_tensor *w, lk_tensor *scale, const lk_fuse_term *terms, size_t n_terms,
                             const lk_fuse_opts *opts, lk_stream *stream, lk_fuse_dev_scratch *scratch,
                             lk_fuse_dev_stats *stats) {
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
    /* the scale (a few bytes) copied to the host, rescaled there, and written back (to the device or the host
     * scale) only after the weight succeeded: a failure changes neither */
    fp8_ctx f = {scale, NULL, terms, n_terms, opts};
    void *sh = NULL;
    if (scale) {
        if ((st = lk_device_host_alloc(w->device, scale->nbytes, &sh))) return st;
        if (!scale_dev) memcpy(sh, scale->data, scale->nbytes);
        else st = lk_device_copy(w->device, sh, scale->data, scale->nbytes, LK_COPY_D2H, stream);
        if (!st && scale_dev) st = lk_stream_sync(w->device, stream);
        f.scale_host = sh;
    }
    /* the device kernel, but for terms that read the weight (OFT / BOFT, GLoRA: fp8.c dequantises the
     * whole weight for them): the host path */
    static const lk_fuse_opts defaults;
    const int host = lk_fuse_wterms(terms, n_terms) != 0;
    if (!st && !host) {
        lk_tensor named = *w;
        named.name = w->name ? w->name : "(tensor)";
        st = dev_fp8(&named, out, in, scale, f.scale_host, terms, n_terms, opts ? opts : &defaults, stream, scratch,
                     stats);
    }
    if (!st && host) st = host_path(w, host_fp8, &f, stream, stats);
    if (!st && scale && !scale_dev) memcpy(scale->data, sh, scale->nbytes);
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
