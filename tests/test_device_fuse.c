/* test_device_fuse.c — the fuse kernel on device weights (lorakit/fuse_device.h)
 * gives exactly the CPU kernel's bytes, for every term kind x weight dtype x
 * shape, on the emul device (always: it runs the CUDA kernel's own body as
 * C) and on cuda:0 when a GPU is present (else skipped, saying "no CUDA
 * device").
 *
 * The expectation of every case is the CPU path (lk_fuse_tensor,
 * lk_fuse_key_apply, lk_fuse_fp8) on a host copy of the same weight: the
 * bytes on success, the status and the whole message on failure. The CPU
 * kernel itself is checked against independent float64 references in
 * test_fuse_kernel.c / test_lycoris.c; here each case also asserts that the
 * fuse changed the weight (so equal bytes cannot come from doing nothing)
 * and which path (device kernel or host fallback) the stats report.
 * Weights hold the values that make rounding hard: -0, subnormals, NaN with
 * payloads, Inf, huge values, and exact ties. */
#include "testutil.h"
#include "lorakit/fuse_device.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static lk_device g_dev;
static lk_fuse_dev_scratch *g_scratch; /* the "one scratch" group: every key and FP8 case fuses through it */

/* ---- data ---- */

typedef struct tens {
    lk_tensor t;
    unsigned char *buf;
} tens;

static void tens_make(tens *x, const char *name, lk_dtype dt, int ndim, const int64_t *shape) {
    memset(x, 0, sizeof *x);
    x->t.name = name;
    x->t.dtype = dt;
    x->t.ndim = ndim;
    size_t n = 1;
    for (int i = 0; i < ndim; i++) {
        x->t.shape[i] = shape[i];
        n *= (size_t)shape[i];
    }
    x->t.nbytes = n * lk_dtype_size(dt);
    x->buf = calloc(1, x->t.nbytes + 1);
    x->t.data = x->buf;
}

static void tens_free(tens *x) { free(x->buf); }

static float rnd_normalish(tu_rng *r) { return tu_uniform(r, -1.f, 1.f) + tu_uniform(r, -1.f, 1.f); }

/* Values in f32, stored in the tensor's dtype. special: sprinkle the hard
 * values (a weight's). */
static void fill(tu_rng *r, tens *x, float scale, int special) {
    const size_t n = lk_tensor_numel(&x->t);
    for (size_t i = 0; i < n; i++) {
        float v = rnd_normalish(r) * scale;
        if (special) {
            const uint64_t k = tu_next(r) % 23;
            if (k == 0) v = -0.0f;
            else if (k == 1) v = 0.0f;
            else if (k == 2) v = ldexpf(rnd_normalish(r), -130); /* f32 subnormal (0 in F16/BF16 mostly) */
            else if (k == 3) v = ldexpf(rnd_normalish(r), -18);  /* an f16 subnormal */
            else if (k == 4) v = (tu_next(r) & 1) ? INFINITY : -INFINITY;
            else if (k == 5) {
                uint32_t u = 0x7f800000u | (uint32_t)(tu_next(r) & 0x7fffffu) | 0x10000u; /* NaN, with payload */
                memcpy(&v, &u, 4);
            } else if (k == 6) v = ldexpf(1.0f + (float)(tu_next(r) % 8) / 8.0f, 6); /* coarse values: ties */
        }
        lk_from_f32((char *)x->buf + i * lk_dtype_size(x->t.dtype), &v, x->t.dtype, 1);
    }
}

static lk_dtype dt_of(uint64_t k) {
    static const lk_dtype d[] = {LK_DTYPE_F32, LK_DTYPE_F16, LK_DTYPE_BF16};
    return d[k % 3];
}

/* ---- running one case on the CPU and on the device ---- */

typedef enum { FN_TENSOR, FN_KEY, FN_FP8 } fn_kind;

typedef struct dcase {
    fn_kind fn;
    const lk_fuse_term *terms;
    size_t n;
    const lk_fuse_key *key;
    tens *scale; /* FP8 */
    int scale_host; /* FP8: the scale stays in host memory beside the device weight */
    lk_fuse_opts opts;
    int want_fallback; /* 1: the host path, 0: the device kernel */
    int want_change;   /* the fuse changes the weight's bytes */
    lk_status want_err; /* the CPU's status, when it is an error */
} dcase;

static lk_status run_cpu(const dcase *c, lk_tensor *w, void *scale_host) {
    const int64_t out = w->ndim ? w->shape[0] : 1, in = (int64_t)(lk_tensor_numel(w) / (size_t)out);
    if (c->fn == FN_TENSOR) return lk_fuse_tensor(w->data, w->data, w->dtype, out, in, c->terms, c->n, &c->opts, w->name);
    if (c->fn == FN_KEY) return lk_fuse_key_apply(w->data, w->data, w, c->key, c->terms, &c->opts);
    return lk_fuse_fp8(w->data, w->dtype, out, in, scale_host, c->scale ? c->scale->t.dtype : LK_DTYPE_F32,
                       c->scale ? (int64_t)lk_tensor_numel(&c->scale->t) : 0, c->terms, c->n, &c->opts, w->name);
}

/* Uploads w0 (and the FP8 scale), fuses on g_dev, downloads; compares with
 * the CPU on a host copy. */
static void check_case(const dcase *c, const tens *w0) {
    const size_t nb = w0->t.nbytes;
    unsigned char *cpu = malloc(nb), *back = malloc(nb), *scale_cpu = NULL, *scale_back = NULL;
    memcpy(cpu, w0->buf, nb);
    lk_tensor wc = w0->t;
    wc.data = cpu;
    if (c->scale) {
        scale_cpu = malloc(c->scale->t.nbytes);
        scale_back = malloc(c->scale->t.nbytes);
        memcpy(scale_cpu, c->scale->buf, c->scale->t.nbytes);
    }
    const lk_status want = run_cpu(c, &wc, scale_cpu);
    if (c->want_err) assert_int_equal(want, c->want_err);
    char want_msg[512];
    snprintf(want_msg, sizeof want_msg, "%s", want ? lk_last_error() : "");

    void *dw = NULL, *ds = NULL, *hs = NULL;
    assert_int_equal(lk_device_alloc(g_dev, nb, &dw), LK_OK);
    assert_int_equal(lk_device_copy(g_dev, dw, w0->buf, nb, LK_COPY_H2D, NULL), LK_OK);
    lk_tensor wd = w0->t;
    wd.data = dw;
    wd.device = g_dev;
    lk_tensor sd;
    if (c->scale && c->scale_host) {
        hs = malloc(c->scale->t.nbytes);
        memcpy(hs, c->scale->buf, c->scale->t.nbytes);
        sd = c->scale->t;
        sd.data = hs;
    } else if (c->scale) {
        assert_int_equal(lk_device_alloc(g_dev, c->scale->t.nbytes, &ds), LK_OK);
        assert_int_equal(lk_device_copy(g_dev, ds, c->scale->buf, c->scale->t.nbytes, LK_COPY_H2D, NULL), LK_OK);
        sd = c->scale->t;
        sd.data = ds;
        sd.device = g_dev;
    }
    lk_fuse_dev_stats stats = {0};
    lk_status got = c->fn == FN_TENSOR ? lk_fuse_tensor_dev(&wd, c->terms, c->n, &c->opts, NULL, &stats)
                    : c->fn == FN_KEY  ? lk_fuse_key_apply_dev_in(&wd, c->key, c->terms, &c->opts, NULL, g_scratch, &stats)
                                       : lk_fuse_fp8_dev_in(&wd, c->scale ? &sd : NULL, c->terms, c->n, &c->opts, NULL,
                                                            g_scratch, &stats);
    if (got != want || (want && strcmp(lk_last_error(), want_msg)))
        fail_msg("%s: CPU gave %d '%s', the device %d '%s'", w0->t.name, want, want_msg, got, got ? lk_last_error() : "");
    assert_int_equal(lk_device_copy(g_dev, back, dw, nb, LK_COPY_D2H, NULL), LK_OK);
    if (c->scale && hs) memcpy(scale_back, hs, c->scale->t.nbytes);
    else if (c->scale)
        assert_int_equal(lk_device_copy(g_dev, scale_back, ds, c->scale->t.nbytes, LK_COPY_D2H, NULL), LK_OK);
    if (want && c->fn == FN_FP8) { /* a failed FP8 fuse changes nothing: the weight's and the scale's bytes as before */
        if (memcmp(back, w0->buf, nb)) fail_msg("%s: the failed FP8 fuse changed the device weight", w0->t.name);
        if (c->scale && memcmp(scale_back, c->scale->buf, c->scale->t.nbytes))
            fail_msg("%s: the failed FP8 fuse changed the scale (%s)", w0->t.name, hs ? "host" : "device");
    }
    if (!want) {
        if (memcmp(back, cpu, nb)) {
            const size_t esz = lk_dtype_size(w0->t.dtype);
            for (size_t i = 0; i < nb / esz; i++)
                if (memcmp(back + i * esz, cpu + i * esz, esz)) {
                    uint32_t a = 0, b = 0, o = 0;
                    memcpy(&a, cpu + i * esz, esz);
                    memcpy(&b, back + i * esz, esz);
                    memcpy(&o, w0->buf + i * esz, esz);
                    fail_msg("%s (%s): element %zu: CPU 0x%x, device 0x%x (weight 0x%x)", w0->t.name,
                             lk_dtype_name(w0->t.dtype), i, a, b, o);
                }
        }
        if (c->want_change) assert_true(memcmp(cpu, w0->buf, nb) != 0);
        assert_int_equal(stats.keys_host_fallback, (size_t)(c->want_fallback != 0));
        assert_int_equal(stats.keys_device, (size_t)(c->want_fallback == 0));
        if (c->scale) assert_memory_equal(scale_back, scale_cpu, c->scale->t.nbytes);
    }
    lk_device_free(g_dev, dw);
    lk_device_free(g_dev, ds);
    free(hs);
    free(cpu);
    free(back);
    free(scale_cpu);
    free(scale_back);
}

/* ---- LoRA terms: dtypes x shapes x ranks ---- */

typedef struct lora_set {
    tens A[3], B[3];
    lk_fuse_term t[3];
    size_t n;
} lora_set;

/* n LoRA terms of rank r each (term 1 a zero scale when n == 3: skipped). */
static void lora_make(lora_set *s, tu_rng *r, int64_t out, int64_t in, int64_t rank, size_t n, float fscale) {
    memset(s, 0, sizeof *s);
    s->n = n;
    for (size_t i = 0; i < n; i++) {
        tens_make(&s->A[i], "A", dt_of(tu_next(r)), 2, (int64_t[]){rank, in});
        tens_make(&s->B[i], "B", dt_of(tu_next(r)), 2, (int64_t[]){out, rank});
        fill(r, &s->A[i], 1.0f, 0);
        fill(r, &s->B[i], fscale, 0);
        s->t[i] = (lk_fuse_term){.A = &s->A[i].t, .B = &s->B[i].t, .scale = i == 1 && n == 3 ? 0.0 : 0.7 * (1.0 + i)};
    }
}

static void fp8_weight(tu_rng *r, tens *w, const char *name, lk_dtype dt, int64_t out, int64_t in, int specials);
static void fp8_scale(tu_rng *r, tens *sc, lk_dtype dt, int64_t n, int per_tensor_0d);

static void lora_free(lora_set *s) {
    for (size_t i = 0; i < s->n; i++) {
        tens_free(&s->A[i]);
        tens_free(&s->B[i]);
    }
}

static void test_lora_shapes(void **state) {
    (void)state;
    static const int64_t shapes[][2] = {{1, 1}, {1, 300}, {300, 1}, {37, 129}, {130, 70}, {5, 257}};
    static const int64_t ranks[] = {1, 2, 7, 16, 64, 128};
    tu_rng r = {42};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
        for (size_t ri = 0; ri < sizeof ranks / sizeof ranks[0]; ri++)
            for (int d = 0; d < 3; d++) {
                const int64_t out = shapes[si][0], in = shapes[si][1], rank = ranks[ri];
                if (rank > 16 && out * in > 5000) continue; /* large ranks on the smaller shapes: emul's time */
                tens w;
                tens_make(&w, "blocks.0.attn.to_q.weight", dt_of((uint64_t)d), 2, (int64_t[]){out, in});
                fill(&r, &w, 1.0f, 1);
                lora_set s;
                lora_make(&s, &r, out, in, rank, 1 + (ri % 3), 0.5f);
                dcase c = {.fn = FN_TENSOR, .terms = s.t, .n = s.n, .opts = {.allow_nonfinite = 1},
                           .want_change = out * in >= 16}; /* a tiny weight may be all NaN / Inf */
                check_case(&c, &w);
                lora_free(&s);
                tens_free(&w);
            }
}

/* A conv weight [out, in, kh, kw] is out x in*kh*kw. */
static void test_conv(void **state) {
    (void)state;
    tu_rng r = {7};
    for (int d = 0; d < 3; d++) {
        tens w;
        tens_make(&w, "down.conv.weight", dt_of((uint64_t)d), 4, (int64_t[]){9, 5, 3, 3});
        fill(&r, &w, 0.3f, 1);
        lora_set s;
        lora_make(&s, &r, 9, 45, 4, 2, 0.2f);
        dcase c = {.fn = FN_TENSOR, .terms = s.t, .n = s.n, .opts = {.allow_nonfinite = 1}, .want_change = 1};
        check_case(&c, &w);
        lora_free(&s);
        tens_free(&w);
    }
}

/* q, k, v modules on row slices of one fused weight, plus a whole-weight
 * term, and rows no term covers (left as they are, -0 included). */
static void test_row_slices(void **state) {
    (void)state;
    tu_rng r = {99};
    for (int d = 0; d < 3; d++) {
        const int64_t out = 3 * 11 + 5, in = 133;
        tens w, A[4], B[4];
        tens_make(&w, "attn.qkv.weight", dt_of((uint64_t)d), 2, (int64_t[]){out, in});
        fill(&r, &w, 1.0f, 1);
        lk_fuse_term t[4];
        for (int i = 0; i < 3; i++) {
            tens_make(&A[i], "A", dt_of(tu_next(&r)), 2, (int64_t[]){3 + i, in});
            tens_make(&B[i], "B", dt_of(tu_next(&r)), 2, (int64_t[]){11, 3 + i});
            fill(&r, &A[i], 1.0f, 0);
            fill(&r, &B[i], 0.3f, 0);
            t[i] = (lk_fuse_term){.A = &A[i].t, .B = &B[i].t, .scale = 0.5 + i, .slice = 1 + 11 * i};
        }
        /* the 4th: rows 2 .. 2+20, overlapping q and k */
        tens_make(&A[3], "A", LK_DTYPE_F32, 2, (int64_t[]){2, in});
        tens_make(&B[3], "B", LK_DTYPE_BF16, 2, (int64_t[]){20, 2});
        fill(&r, &A[3], 1.0f, 0);
        fill(&r, &B[3], 0.3f, 0);
        t[3] = (lk_fuse_term){.A = &A[3].t, .B = &B[3].t, .scale = 1.25, .slice = 3};
        dcase c = {.fn = FN_TENSOR, .terms = t, .n = 4, .opts = {.allow_nonfinite = 1}, .want_change = 1};
        check_case(&c, &w);
        for (int i = 0; i < 4; i++) {
            tens_free(&A[i]);
            tens_free(&B[i]);
        }
        tens_free(&w);
    }
}

/* Dense deltas alone (scale 1 and not), next to LoRA terms, a zero-scale one. */
static void test_dense(void **state) {
    (void)state;
    tu_rng r = {5};
    for (int d = 0; d < 3; d++)
        for (int mix = 0; mix < 3; mix++) {
            const int64_t out = 23, in = 141;
            tens w, D[2];
            tens_make(&w, "ff.net.0.proj.weight", dt_of((uint64_t)d), 2, (int64_t[]){out, in});
            fill(&r, &w, 1.0f, 1);
            lora_set s;
            lora_make(&s, &r, out, in, 3, 1, 0.4f);
            lk_fuse_term t[4];
            size_t n = 0;
            for (int i = 0; i < 2; i++) {
                tens_make(&D[i], "diff", dt_of(tu_next(&r)), 2, (int64_t[]){out, in});
                fill(&r, &D[i], 0.2f, 0);
            }
            if (mix >= 1) t[n++] = s.t[0];
            t[n++] = (lk_fuse_term){.B = &D[0].t, .scale = mix == 2 ? 1.0 : 0.35, .kind = LK_TERM_DENSE};
            t[n++] = (lk_fuse_term){.B = &D[1].t, .scale = mix == 1 ? 0.0 : 1.0, .kind = LK_TERM_DENSE};
            dcase c = {.fn = FN_TENSOR, .terms = t, .n = n, .opts = {.allow_nonfinite = 1}, .want_change = 1};
            check_case(&c, &w);
            for (int i = 0; i < 2; i++) tens_free(&D[i]);
            lora_free(&s);
            tens_free(&w);
        }
}

/* LoHa: w1a (out x r1, B) @ w1b (r1 x in, A) times w2a @ w2b, elementwise. */
typedef struct hada_set {
    tens f[4];
    lk_fuse_term t;
} hada_set;

static void hada_make(hada_set *h, tu_rng *r, int64_t out, int64_t in, int64_t r1, int64_t r2, double scale) {
    tens_make(&h->f[0], "hada_w1_b", dt_of(tu_next(r)), 2, (int64_t[]){r1, in});
    tens_make(&h->f[1], "hada_w1_a", dt_of(tu_next(r)), 2, (int64_t[]){out, r1});
    tens_make(&h->f[2], "hada_w2_b", dt_of(tu_next(r)), 2, (int64_t[]){r2, in});
    tens_make(&h->f[3], "hada_w2_a", dt_of(tu_next(r)), 2, (int64_t[]){out, r2});
    for (int i = 0; i < 4; i++) fill(r, &h->f[i], 0.5f, 0);
    h->t = (lk_fuse_term){.A = &h->f[0].t, .B = &h->f[1].t, .A2 = &h->f[2].t, .B2 = &h->f[3].t, .scale = scale,
                          .kind = LK_TERM_HADA};
}

/* LoKr: kron(w1, w2) on (a c) x (b D); factored: w1 = w1a (a x r) @ w1b
 * (r x b) and w2 = w2a (c x r) @ w2b (r x D), else full (r = 0). */
typedef struct kron_set {
    tens f[4];
    lk_fuse_term t;
} kron_set;

static void kron_make(kron_set *k, tu_rng *r, int64_t a, int64_t b, int64_t c, int64_t D, int64_t r1, int64_t r2,
                      double scale) {
    memset(k, 0, sizeof *k);
    if (r1) {
        tens_make(&k->f[0], "lokr_w1_b", dt_of(tu_next(r)), 2, (int64_t[]){r1, b});
        tens_make(&k->f[1], "lokr_w1_a", dt_of(tu_next(r)), 2, (int64_t[]){a, r1});
    } else tens_make(&k->f[1], "lokr_w1", dt_of(tu_next(r)), 2, (int64_t[]){a, b});
    if (r2) {
        tens_make(&k->f[2], "lokr_w2_b", dt_of(tu_next(r)), 2, (int64_t[]){r2, D});
        tens_make(&k->f[3], "lokr_w2_a", dt_of(tu_next(r)), 2, (int64_t[]){c, r2});
    } else tens_make(&k->f[3], "lokr_w2", dt_of(tu_next(r)), 2, (int64_t[]){c, D});
    for (int i = 0; i < 4; i++)
        if (k->f[i].buf) fill(r, &k->f[i], 0.5f, 0);
    k->t = (lk_fuse_term){.A = r1 ? &k->f[0].t : NULL, .B = &k->f[1].t, .A2 = r2 ? &k->f[2].t : NULL,
                          .B2 = &k->f[3].t, .scale = scale, .kind = LK_TERM_KRON};
}

static void set4_free(tens *f) {
    for (int i = 0; i < 4; i++) tens_free(&f[i]);
}

/* LoHa and LoKr on the device kernel: dtypes x shapes (1-row, 1-column,
 * ragged tiles) x ranks 1..128; the same bytes as the CPU's row driver. */
static void test_hada_kron(void **state) {
    (void)state;
    static const int64_t shapes[][2] = {{1, 1}, {1, 300}, {300, 1}, {37, 129}, {6, 70}};
    static const int64_t ranks[][2] = {{1, 1}, {3, 8}, {16, 2}, {128, 64}};
    tu_rng r = {11};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
        for (size_t ri = 0; ri < sizeof ranks / sizeof ranks[0]; ri++)
            for (int d = 0; d < 3; d++) {
                const int64_t out = shapes[si][0], in = shapes[si][1];
                if (ranks[ri][0] > 16 && out * in > 1000) continue; /* emul's time */
                tens w;
                tens_make(&w, "hada.weight", dt_of((uint64_t)d), 2, (int64_t[]){out, in});
                fill(&r, &w, 1.0f, 1);
                hada_set h;
                hada_make(&h, &r, out, in, ranks[ri][0], ranks[ri][1], 0.8);
                dcase c = {.fn = FN_TENSOR, .terms = &h.t, .n = 1, .opts = {.allow_nonfinite = 1},
                           .want_change = out * in >= 16};
                check_case(&c, &w);
                set4_free(h.f);
                tens_free(&w);
            }
    /* LoKr: (a, b, c, D, r1, r2): factored, full, mixed; 1-row, 1-column, ragged */
    static const int64_t kr[][6] = {{1, 1, 1, 1, 0, 0},  {3, 5, 4, 6, 0, 2},   {1, 3, 1, 100, 2, 0},
                                    {3, 1, 100, 1, 0, 0}, {37, 3, 1, 43, 5, 7}, {4, 16, 8, 8, 1, 128}};
    for (size_t ki = 0; ki < sizeof kr / sizeof kr[0]; ki++)
        for (int d = 0; d < 3; d++) {
            const int64_t *g = kr[ki], out = g[0] * g[2], in = g[1] * g[3];
            tens w;
            tens_make(&w, "lokr.weight", dt_of((uint64_t)d), 2, (int64_t[]){out, in});
            fill(&r, &w, 1.0f, 1);
            kron_set k;
            kron_make(&k, &r, g[0], g[1], g[2], g[3], g[4], g[5], 0.6);
            dcase c = {.fn = FN_TENSOR, .terms = &k.t, .n = 1, .opts = {.allow_nonfinite = 1},
                       .want_change = out * in >= 16};
            check_case(&c, &w);
            set4_free(k.f);
            tens_free(&w);
        }
}

/* Every kind on one weight, in one order: LoRA, LoHa, dense, LoKr, a
 * zero-scale LoHa, a second LoRA (stacked with the first); then 20 more
 * dense terms (24 live non-LoRA terms: the device kernel, which took 8
 * before its term list moved into device memory), on the F32/F16/BF16
 * weight and on an FP8 one (E4M3, per-row scale, rescaled); the same
 * bytes as the CPU. */
static void test_mixed_kinds(void **state) {
    (void)state;
    tu_rng r = {19};
    for (int d = 0; d < 3; d++) {
        const int64_t out = 12, in = 30;
        tens w, D[21];
        tens_make(&w, "mix.weight", dt_of((uint64_t)d), 2, (int64_t[]){out, in});
        fill(&r, &w, 1.0f, 1);
        lora_set s;
        lora_make(&s, &r, out, in, 3, 2, 0.3f);
        hada_set h, h0;
        hada_make(&h, &r, out, in, 4, 2, 0.7);
        hada_make(&h0, &r, out, in, 2, 2, 0.0);
        kron_set k;
        kron_make(&k, &r, 3, 5, 4, 6, 2, 0, 1.3);
        for (int i = 0; i < 21; i++) {
            tens_make(&D[i], "diff", dt_of(tu_next(&r)), 2, (int64_t[]){out, in});
            fill(&r, &D[i], 0.2f, 0);
        }
        lk_fuse_term t[26] = {s.t[0], h.t, {.B = &D[0].t, .scale = 0.35, .kind = LK_TERM_DENSE}, k.t, h0.t, s.t[1]};
        dcase c = {.fn = FN_TENSOR, .terms = t, .n = 6, .opts = {.allow_nonfinite = 1}, .want_change = 1};
        check_case(&c, &w);
        for (int i = 1; i < 21; i++) t[5 + i] = (lk_fuse_term){.B = &D[i].t, .scale = 0.05 * i, .kind = LK_TERM_DENSE};
        c.n = 26; /* 24 live non-LoRA terms */
        check_case(&c, &w);
        tens w8, sc;
        fp8_weight(&r, &w8, "mix8.weight", LK_DTYPE_F8_E4M3, out, in, 0);
        fp8_scale(&r, &sc, LK_DTYPE_F32, out, 0);
        dcase c8 = {.fn = FN_FP8, .terms = t, .n = 26, .scale = &sc, .want_change = 1};
        c8.opts.fp8 = (lk_fp8_opts){.saturate = 1, .scale = LK_FP8_RESCALE};
        check_case(&c8, &w8);
        tens_free(&sc);
        tens_free(&w8);
        for (int i = 0; i < 21; i++) tens_free(&D[i]);
        set4_free(k.f);
        set4_free(h0.f);
        set4_free(h.f);
        lora_free(&s);
        tens_free(&w);
    }
}

/* The per-key plan's double path (plan.c, fuse/keyelem.h) on the key
 * kernel: a replacement at strength 0.5 and 1 with and without LoRA terms,
 * LoRA terms alone (the fuse kernel), 1-D vector terms (a bias) with and
 * without a replacement, a non-fusable tensor replaced whole; weights with
 * the hard values (NaN payloads, Inf, -0) where non-finite results are
 * allowed, so the NaN rule is compared too; 1-row and 1-column weights. */
static void test_keys(void **state) {
    (void)state;
    static const int64_t shapes[][2] = {{17, 40}, {1, 33}, {29, 1}, {37, 129}};
    tu_rng r = {13};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
        for (int d = 0; d < 3; d++) {
            const int64_t out = shapes[si][0], in = shapes[si][1];
            tens w, rep, bias, v1, v2;
            tens_make(&w, "proj.weight", dt_of((uint64_t)d), 2, (int64_t[]){out, in});
            tens_make(&rep, "proj.weight(saved)", dt_of((uint64_t)d + 1), 2, (int64_t[]){out, in});
            fill(&r, &w, 1.0f, 1);
            fill(&r, &rep, 1.0f, 0);
            lora_set s;
            lora_make(&s, &r, out, in, 2, 1, 0.3f);
            lk_fuse_key k = {.replace = &rep.t, .replace_strength = 0.5, .n_terms = 1};
            dcase c = {.fn = FN_KEY, .terms = s.t, .key = &k, .opts = {.allow_nonfinite = 1}, .want_change = 1};
            check_case(&c, &w);
            k.n_terms = 0;
            k.replace_strength = 1.0;
            check_case(&c, &w);
            lk_fuse_key kl = {.n_terms = 1};
            dcase cl = {.fn = FN_KEY, .terms = s.t, .key = &kl, .opts = {.allow_nonfinite = 1}, .want_change = 1};
            check_case(&cl, &w);
            tens_make(&bias, "proj.bias", dt_of((uint64_t)d), 1, (int64_t[]){out});
            tens_make(&v1, "lora_B.bias", LK_DTYPE_F32, 1, (int64_t[]){out});
            tens_make(&v2, "diff_b", LK_DTYPE_BF16, 1, (int64_t[]){out});
            fill(&r, &bias, 1.0f, 1);
            fill(&r, &v1, 0.5f, 0);
            fill(&r, &v2, 0.5f, 0);
            lk_fuse_term vt[2] = {{.B = &v1.t, .scale = 0.7}, {.B = &v2.t, .scale = 1.5}};
            lk_fuse_key kv = {.n_terms = 2};
            dcase cv = {.fn = FN_KEY, .terms = vt, .key = &kv, .opts = {.allow_nonfinite = 1}, .want_change = 1};
            check_case(&cv, &bias);
            kv.replace = &v2.t; /* a saved bias (modules_to_save) at 0.25 plus the vector terms */
            kv.replace_strength = 0.25;
            check_case(&cv, &bias);
            tens_free(&bias);
            tens_free(&v1);
            tens_free(&v2);
            lora_free(&s);
            tens_free(&rep);
            tens_free(&w);
        }
    /* an I64 tensor replaced whole (one upload) */
    tens iw, ir;
    tens_make(&iw, "pos_ids", LK_DTYPE_I64, 1, (int64_t[]){9});
    tens_make(&ir, "pos_ids(saved)", LK_DTYPE_I64, 1, (int64_t[]){9});
    for (int i = 0; i < 9; i++) ((int64_t *)ir.buf)[i] = 3 * i + 1;
    lk_fuse_key ki = {.replace = &ir.t, .replace_strength = 1.0};
    dcase ci = {.fn = FN_KEY, .key = &ki, .want_change = 1};
    check_case(&ci, &iw);
    ki.replace_strength = 0.5; /* refused: the CPU's message */
    ci.want_err = LK_ERR_DTYPE;
    check_case(&ci, &iw);
    tens_free(&ir);
    tens_free(&iw);
}

/* Many terms on the key kernel (which took 8 before its lists moved into
 * device memory): 20 vector terms on a bias, and a replacement at
 * strength 0.5 beside 20 dense terms on a 2-D weight. Oracle: the CPU's
 * lk_fuse_key_apply on a host copy; the stats say the device kernel. */
static void test_keys_many(void **state) {
    (void)state;
    tu_rng r = {14};
    tens bias, v[20], w2, rep, D[20];
    tens_make(&bias, "norm.bias", LK_DTYPE_BF16, 1, (int64_t[]){21});
    fill(&r, &bias, 1.0f, 0);
    tens_make(&w2, "proj.weight", LK_DTYPE_F16, 2, (int64_t[]){6, 21});
    fill(&r, &w2, 1.0f, 1);
    tens_make(&rep, "proj.weight(saved)", LK_DTYPE_F32, 2, (int64_t[]){6, 21});
    fill(&r, &rep, 1.0f, 0);
    lk_fuse_term vt[20], dt[20];
    for (int i = 0; i < 20; i++) {
        tens_make(&v[i], "diff_b", dt_of((uint64_t)i), 1, (int64_t[]){21});
        fill(&r, &v[i], 0.5f, 0);
        vt[i] = (lk_fuse_term){.B = &v[i].t, .scale = 0.1 * (i + 1)};
        tens_make(&D[i], "diff", dt_of(tu_next(&r)), 2, (int64_t[]){6, 21});
        fill(&r, &D[i], 0.2f, 0);
        dt[i] = (lk_fuse_term){.B = &D[i].t, .scale = 0.05 * (i + 1), .kind = LK_TERM_DENSE};
    }
    lk_fuse_key kv = {.n_terms = 20};
    dcase cv = {.fn = FN_KEY, .terms = vt, .key = &kv, .want_change = 1};
    check_case(&cv, &bias);
    lk_fuse_key kr = {.replace = &rep.t, .replace_strength = 0.5, .n_terms = 20};
    dcase cr = {.fn = FN_KEY, .terms = dt, .key = &kr, .want_change = 1};
    check_case(&cr, &w2);
    for (int i = 0; i < 20; i++) {
        tens_free(&v[i]);
        tens_free(&D[i]);
    }
    tens_free(&rep);
    tens_free(&w2);
    tens_free(&bias);
}

/* A replacement at strength 2 where the weight is Inf (element 23: Inf +
 * 2 (1 - Inf) is NaN in double): the CPU's error naming the element and
 * the value ("element 23 of the fused tensor is nan"); at element 30 the
 * double is finite but past the dtype's range (stored as -Inf, no error,
 * as on the CPU). With allow_nonfinite the same bytes (the NaN rule). */
static void test_keys_nonfinite(void **state) {
    (void)state;
    for (int d = 0; d < 3; d++) {
        tens w, rep;
        tens_make(&w, "head.weight", dt_of((uint64_t)d), 2, (int64_t[]){5, 7});
        tens_make(&rep, "head.weight(saved)", LK_DTYPE_F32, 2, (int64_t[]){5, 7});
        const float big = d == 1 ? 60000.0f : 3.0e38f;
        for (int i = 0; i < 35; i++) {
            const float x = i == 23 ? INFINITY : i == 30 ? big : 0.25f * i, y = i == 30 ? -big : 1.0f;
            lk_from_f32(w.buf + (size_t)i * lk_dtype_size(w.t.dtype), &x, w.t.dtype, 1);
            ((float *)rep.buf)[i] = y;
        }
        lk_fuse_key k = {.replace = &rep.t, .replace_strength = 2.0};
        dcase c = {.fn = FN_KEY, .key = &k, .want_err = LK_ERR_NONFINITE};
        check_case(&c, &w);
        tu_assert_contains(lk_last_error(), "head.weight: element 23 of the fused tensor is nan");
        c.want_err = LK_OK;
        c.opts.allow_nonfinite = 1;
        c.want_change = 1;
        check_case(&c, &w);
        tens_free(&rep);
        tens_free(&w);
    }
}

/* DoRA: the two passes (sums in double on the device in plan.c's order,
 * factors on the host, the scaled write) under every convention and at
 * strengths 1 and 0.6: PEFT's magnitude (per row), dora_scale [out, 1]
 * (per row), [1, in] (per input channel) and a conv weight's [1, in, 1, 1]
 * (per channel of 9 elements per row); LoRA and LoHa deltas. */
static void test_dora(void **state) {
    (void)state;
    tu_rng r = {29};
    static const lk_convention convs[] = {LK_CONVENTION_LORAKIT, LK_CONVENTION_COMFYUI, LK_CONVENTION_LYCORIS,
                                          LK_CONVENTION_PEFT};
    for (int d = 0; d < 3; d++)
        for (int form = 0; form < 5; form++) {
            const int conv = form == 3;
            const int64_t out = form == 4 ? 1 : 13, in = conv ? 6 : form == 4 ? 40 : 37, cols = conv ? in * 9 : in;
            tens w, mag;
            if (conv) tens_make(&w, "down.conv.weight", dt_of((uint64_t)d), 4, (int64_t[]){out, in, 3, 3});
            else tens_make(&w, "attn.to_k.weight", dt_of((uint64_t)d), 2, (int64_t[]){out, in});
            fill(&r, &w, 1.0f, 0);
            if (form == 0 || form == 4) tens_make(&mag, "lora_magnitude_vector", dt_of(tu_next(&r)), 1, (int64_t[]){out});
            else if (form == 1) tens_make(&mag, "dora_scale", LK_DTYPE_F32, 2, (int64_t[]){out, 1});
            else if (form == 2) tens_make(&mag, "dora_scale", LK_DTYPE_BF16, 2, (int64_t[]){1, in});
            else tens_make(&mag, "dora_scale", LK_DTYPE_F16, 4, (int64_t[]){1, in, 1, 1});
            fill(&r, &mag, 2.0f, 0);
            lora_set s;
            lora_make(&s, &r, out, cols, 3, 1, 0.3f);
            hada_set h;
            hada_make(&h, &r, out, cols, 2, 3, 1.0);
            for (int hada = 0; hada < 2; hada++)
                for (size_t ci = 0; ci < 4; ci++)
                    for (int st = 0; st < 2; st++) {
                        lk_lora_module m = {.module = "attn", .rank = 3, .alpha = 6.0, .scale = 2.0,
                                            .algo = hada ? LK_ALGO_LOHA : LK_ALGO_LORA};
                        if (hada) {
                            for (int i = 0; i < 4; i++) m.k[i] = h.f[i].t;
                        } else {
                            m.k[0] = s.A[0].t;
                            m.k[1] = s.B[0].t;
                        }
                        if (form == 0 || form == 4) m.magnitude = mag.t;
                        else m.dora_scale = mag.t;
                        lk_fuse_key k = {.dora = &m, .dora_strength = st ? 0.6 : 1.0, .dora_convention = convs[ci]};
                        dcase c = {.fn = FN_KEY, .key = &k, .opts = {.allow_nonfinite = 1}, .want_change = 1};
                        check_case(&c, &w);
                    }
            set4_free(h.f);
            lora_free(&s);
            tens_free(&mag);
            tens_free(&w);
        }
}

/* FP8 weights on the device kernel (kernel_dev.h's FP8 passes): E4M3 and
 * E5M2 x plain / per-tensor ([1]) / per-row ([out]) scale in F32 or BF16,
 * kept or rescaled (LTX-2's amax rule) x nearest / keyed stochastic x
 * ragged shapes (1 x 1, 1-row, 1-column, odd sizes) x ranks 1..128, LoRA
 * alone or beside a dense delta. Oracle: the CPU's lk_fuse_fp8 on a host
 * copy (itself checked against float64 references and hand-computed codes
 * in test_fuse_fp8.c / test_fp8.c): the same codes, the same rewritten
 * scale, and the stats say the device kernel, not the host path. */
static void fp8_weight(tu_rng *r, tens *w, const char *name, lk_dtype dt, int64_t out, int64_t in, int specials) {
    tens_make(w, name, dt, 2, (int64_t[]){out, in});
    for (size_t i = 0; i < w->t.nbytes; i++) {
        uint8_t v = (uint8_t)tu_next(r);
        w->buf[i] = specials || (v & 0x7f) < 0x7c ? v : (uint8_t)(v & 0x83); /* specials: NaN / Inf codes too */
    }
}

static void fp8_scale(tu_rng *r, tens *sc, lk_dtype dt, int64_t n, int per_tensor_0d) {
    tens_make(sc, "fp8.weight_scale", dt, per_tensor_0d ? 0 : 1, (int64_t[]){n});
    for (int64_t i = 0; i < n; i++) {
        const float v = 0.002f * (float)(1 + tu_next(r) % 50);
        lk_from_f32(sc->buf + (size_t)i * lk_dtype_size(dt), &v, dt, 1);
    }
}

static void test_fp8(void **state) {
    (void)state;
    static const int64_t shapes[][2] = {{1, 1}, {1, 77}, {45, 1}, {9, 50}, {33, 129}};
    static const int64_t ranks[] = {1, 3, 16, 128};
    tu_rng r = {17};
    int n = 0;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
        for (int fmt = 0; fmt < 2; fmt++)
            for (int sm = 0; sm < 5; sm++) /* plain, [1] keep, [1] rescale, [out] keep, [out] rescale */
                for (int stoch = 0; stoch < 2; stoch++, n++) {
                    const int64_t out = shapes[si][0], in = shapes[si][1], rank = ranks[n % 4];
                    tens w, sc, D;
                    fp8_weight(&r, &w, "blocks.1.ff.weight", fmt ? LK_DTYPE_F8_E5M2 : LK_DTYPE_F8_E4M3, out, in, n % 3 == 0);
                    fp8_scale(&r, &sc, n & 1 ? LK_DTYPE_BF16 : LK_DTYPE_F32, sm >= 3 ? out : 1, sm == 1 && (n & 2));
                    lora_set s;
                    lora_make(&s, &r, out, in, rank, 1, sm ? 0.05f : 2.0f);
                    tens_make(&D, "D", LK_DTYPE_BF16, 2, (int64_t[]){out, in});
                    fill(&r, &D, 0.01f, 0);
                    lk_fuse_term t[2] = {s.t[0], {.B = &D.t, .scale = 0.5, .kind = LK_TERM_DENSE}};
                    dcase c = {.fn = FN_FP8, .terms = t, .n = 1 + (n % 5 == 0), .scale = sm ? &sc : NULL,
                               .want_change = out * in > 8};
                    c.opts.fp8 = (lk_fp8_opts){.rounding = stoch ? LK_FP8_STOCHASTIC : LK_FP8_NEAREST,
                                               .seed = 1234 + (uint64_t)n, .saturate = 1,
                                               .scale = sm == 2 || sm == 4 ? LK_FP8_RESCALE : LK_FP8_KEEP};
                    check_case(&c, &w);
                    lora_free(&s);
                    tens_free(&D);
                    tens_free(&sc);
                    tens_free(&w);
                }
}

/* FP8 failures on the device: overflow without --fp8-saturate (plain and
 * kept scale: the same count and message as the CPU), a delta that
 * overflows f32 (the first element made non-finite, by name), the same in
 * row 0 of a per-row rescale whose other rows get new scales (the scale in
 * device memory, k = 4, and in host memory beside the device weight, k =
 * 5). Oracle: the CPU's status and whole message; and nothing changed
 * (check_case: the weight's and the scale's bytes as uploaded, though the
 * CPU's in-place fuse has written both). */
static void test_fp8_errors(void **state) {
    (void)state;
    tu_rng r = {23};
    for (int k = 0; k < 6; k++) {
        const int64_t out = 7, in = 31;
        tens w, sc;
        fp8_weight(&r, &w, "fp8.weight", k & 1 ? LK_DTYPE_F8_E5M2 : LK_DTYPE_F8_E4M3, out, in, 0);
        fp8_scale(&r, &sc, LK_DTYPE_F32, out, 0);
        lora_set s;
        lora_make(&s, &r, out, in, 2, 1, k < 2 ? 5000.0f : 3.0e38f);
        if (k >= 2) { /* every product overflows f32: 0.7 x B = 2.1e38, times A's 4 */
            tens_free(&s.A[0]);
            tens_free(&s.B[0]);
            tens_make(&s.A[0], "A", LK_DTYPE_F32, 2, (int64_t[]){2, in});
            tens_make(&s.B[0], "B", LK_DTYPE_F32, 2, (int64_t[]){out, 2});
            for (int64_t j = 0; j < 2 * in; j++) ((float *)s.A[0].buf)[j] = 4.0f;
            for (int64_t o = 0; o < 2 * out; o++) ((float *)s.B[0].buf)[o] = k < 4 || o < 2 ? 3.0e38f : 0.1f;
            s.t[0].A = &s.A[0].t;
            s.t[0].B = &s.B[0].t;
        }
        dcase c = {.fn = FN_FP8, .terms = s.t, .n = 1, .scale = k == 1 || k >= 4 ? &sc : NULL,
                   .scale_host = k == 5, .want_err = LK_ERR_NONFINITE};
        c.opts.fp8.scale = k >= 4 ? LK_FP8_RESCALE : LK_FP8_KEEP; /* a kept scale: the overflow stays */
        check_case(&c, &w);
        lora_free(&s);
        tens_free(&sc);
        tens_free(&w);
    }
}

/* A rescale's amax over more than one block of slots (in > 128 x
 * LK_KDEV_AMAX_COLS columns) and several row groups, per tensor and per
 * row, the judge pass run or skipped (saturating, non-finite allowed),
 * the scale on the device or the host. Oracle: the CPU's lk_fuse_fp8 on
 * a host copy (codes and rewritten scale). */
static void test_fp8_wide(void **state) {
    (void)state;
    static const int64_t shapes[][2] = {{9, 4100}, {2, 8200}};
    tu_rng r = {41};
    for (int n = 0; n < 8; n++) {
        const int64_t out = shapes[n & 1][0], in = shapes[n & 1][1];
        const int per_row = (n >> 1) & 1;
        tens w, sc;
        fp8_weight(&r, &w, "wide.weight", n & 4 ? LK_DTYPE_F8_E5M2 : LK_DTYPE_F8_E4M3, out, in, n == 3);
        fp8_scale(&r, &sc, n & 4 ? LK_DTYPE_BF16 : LK_DTYPE_F32, per_row ? out : 1, 0);
        /* each row's largest code in the last amax slot (column P - 1, P = ceil(in / 32) slots: past the
         * first block of 128), so the amax is wrong when any slot or block is missed */
        const int64_t last_slot = (in + 31) / 32 - 1;
        for (int64_t o = 0; o < out; o++) w.buf[o * in + last_slot] = (uint8_t)((n & 4 ? 0x7b : 0x7e) | (o & 1) << 7);
        lora_set s;
        lora_make(&s, &r, out, in, 1 + n, 1, 0.05f);
        dcase c = {.fn = FN_FP8, .terms = s.t, .n = 1, .scale = &sc, .scale_host = n >= 6, .want_change = 1};
        c.opts.fp8 = (lk_fp8_opts){.rounding = n & 1 ? LK_FP8_STOCHASTIC : LK_FP8_NEAREST, .seed = 99, .saturate = 1,
                                   .scale = LK_FP8_RESCALE};
        c.opts.allow_nonfinite = n >= 4;
        check_case(&c, &w);
        lora_free(&s);
        tens_free(&sc);
        tens_free(&w);
    }
}

/* A finite weight made Inf: the same error (element, values) on both. */
static void test_nonfinite(void **state) {
    (void)state;
    tu_rng r = {3};
    for (int d = 0; d < 3; d++) {
        tens w;
        tens_make(&w, "big.weight", dt_of((uint64_t)d), 2, (int64_t[]){6, 70});
        fill(&r, &w, 1.0f, 0);
        const float big = d == 0 ? 3.0e38f : d == 1 ? 65000.0f : 3.0e38f;
        lk_from_f32(w.buf + (3 * 70 + 17) * lk_dtype_size(w.t.dtype), &big, w.t.dtype, 1);
        lk_from_f32(w.buf + (4 * 70 + 2) * lk_dtype_size(w.t.dtype), &big, w.t.dtype, 1);
        tens A, B;
        tens_make(&A, "A", LK_DTYPE_F32, 2, (int64_t[]){1, 70});
        tens_make(&B, "B", LK_DTYPE_F32, 2, (int64_t[]){6, 1});
        for (int j = 0; j < 70; j++) ((float *)A.buf)[j] = 1.0f;
        for (int o = 0; o < 6; o++) ((float *)B.buf)[o] = big;
        lk_fuse_term t = {.A = &A.t, .B = &B.t, .scale = 1.0};
        dcase c = {.fn = FN_TENSOR, .terms = &t, .n = 1};
        check_case(&c, &w); /* LK_ERR_NONFINITE naming element [3, 17] */
        c.opts.allow_nonfinite = 1;
        c.want_change = 1;
        check_case(&c, &w);
        tens_free(&A);
        tens_free(&B);
        tens_free(&w);
    }
}

/* Hand-computed: W = 1 plus d = 2^-(p+1) + 2^-30 (p the weight's mantissa
 * bits; 2^-60 for F32) lies just above the tie between 1 and 1 + 2^-p; a
 * plain round-to-nearest sum in the accumulator lands on the tie and rounds
 * down to 1, the single correct rounding is 1 + 2^-p: 0x3f81 (BF16),
 * 0x3c01 (F16), 0x3f800001 (F32). The chain makes d from two rank terms:
 * B = [2^-(p+1), tiny], A = [1; 1]. */
static void test_ties(void **state) {
    (void)state;
    static const struct {
        lk_dtype dt;
        int p, tiny;
        uint32_t want;
    } cases[] = {{LK_DTYPE_BF16, 7, -30, 0x3f81}, {LK_DTYPE_F16, 10, -30, 0x3c01}, {LK_DTYPE_F32, 23, -60, 0x3f800001}};
    for (size_t i = 0; i < 3; i++) {
        tens w, A, B;
        tens_make(&w, "tie.weight", cases[i].dt, 2, (int64_t[]){3, 5});
        const float one = 1.0f;
        for (int e = 0; e < 15; e++) lk_from_f32(w.buf + (size_t)e * lk_dtype_size(cases[i].dt), &one, cases[i].dt, 1);
        tens_make(&A, "A", LK_DTYPE_F32, 2, (int64_t[]){2, 5});
        tens_make(&B, "B", LK_DTYPE_F32, 2, (int64_t[]){3, 2});
        for (int e = 0; e < 10; e++) ((float *)A.buf)[e] = 1.0f;
        for (int o = 0; o < 3; o++) {
            ((float *)B.buf)[2 * o] = ldexpf(1.0f, -(cases[i].p + 1));
            ((float *)B.buf)[2 * o + 1] = ldexpf(1.0f, cases[i].tiny);
        }
        lk_fuse_term t = {.A = &A.t, .B = &B.t, .scale = 1.0};
        dcase c = {.fn = FN_TENSOR, .terms = &t, .n = 1, .want_change = 1};
        check_case(&c, &w); /* the device equals the CPU ... */
        void *dw;
        assert_int_equal(lk_device_alloc(g_dev, w.t.nbytes, &dw), LK_OK);
        assert_int_equal(lk_device_copy(g_dev, dw, w.buf, w.t.nbytes, LK_COPY_H2D, NULL), LK_OK);
        lk_tensor wd = w.t;
        wd.data = dw;
        wd.device = g_dev;
        assert_int_equal(lk_fuse_tensor_dev(&wd, &t, 1, NULL, NULL, NULL), LK_OK);
        assert_int_equal(lk_device_copy(g_dev, w.buf, dw, w.t.nbytes, LK_COPY_D2H, NULL), LK_OK);
        for (int e = 0; e < 15; e++) { /* ... and both equal the hand-computed bits */
            uint32_t got = 0;
            memcpy(&got, w.buf + (size_t)e * lk_dtype_size(cases[i].dt), lk_dtype_size(cases[i].dt));
            assert_int_equal(got, cases[i].want);
        }
        lk_device_free(g_dev, dw);
        tens_free(&A);
        tens_free(&B);
        tens_free(&w);
    }
}

/* Bad input is refused with the CPU's own message, nothing written. */
static void test_errors(void **state) {
    (void)state;
    tu_rng r = {23};
    tens w;
    tens_make(&w, "x.weight", LK_DTYPE_BF16, 2, (int64_t[]){8, 16});
    fill(&r, &w, 1.0f, 0);
    lora_set s;
    lora_make(&s, &r, 8, 15, 2, 1, 0.3f); /* A is 2 x 15: the weight has 16 columns */
    dcase c = {.fn = FN_TENSOR, .terms = s.t, .n = 1};
    check_case(&c, &w);
    lora_free(&s);
    tens D;
    tens_make(&D, "diff", LK_DTYPE_F32, 2, (int64_t[]){8, 15});
    lk_fuse_term dt[2] = {{.B = &D.t, .scale = 0.0, .kind = LK_TERM_DENSE}};
    c.terms = dt; /* a dense delta of the wrong size, even at scale 0 */
    check_case(&c, &w);
    tens_free(&D);
    /* a 1-D tensor is no weight matrix */
    lk_tensor v = {.name = "v", .dtype = LK_DTYPE_F32, .ndim = 1, .shape = {4}, .nbytes = 16, .device = g_dev};
    assert_int_equal(lk_fuse_tensor_dev(&v, NULL, 0, NULL, NULL, NULL), LK_ERR_SHAPE);
    tens_free(&w);
}

/* Every allocation the device path makes fails cleanly: LK_ERR_NOMEM and
 * the device weight's bytes unchanged (emul: its allocations are lk_malloc's). */
static void test_alloc_fail(void **state) {
    (void)state;
    if (g_dev.kind != LK_DEVICE_EMUL) skip();
    tu_rng r = {31};
    tens w;
    tens_make(&w, "a.weight", LK_DTYPE_BF16, 2, (int64_t[]){10, 20});
    fill(&r, &w, 1.0f, 0);
    lora_set s;
    lora_make(&s, &r, 10, 20, 3, 2, 0.3f);
    tens D;
    tens_make(&D, "diff", LK_DTYPE_F16, 2, (int64_t[]){10, 20});
    fill(&r, &D, 0.3f, 0);
    lk_fuse_term t[3] = {s.t[0], s.t[1], {.B = &D.t, .scale = 0.5, .kind = LK_TERM_DENSE}};
    void *dw;
    unsigned char back[400];
    assert_int_equal(lk_device_alloc(g_dev, w.t.nbytes, &dw), LK_OK);
    lk_tensor wd = w.t;
    wd.data = dw;
    wd.device = g_dev;
    int done = 0;
    for (unsigned long k = 1; k < 100 && !done; k++) {
        assert_int_equal(lk_device_copy(g_dev, dw, w.buf, w.t.nbytes, LK_COPY_H2D, NULL), LK_OK);
        lk_alloc_fail_at(k);
        lk_status st = lk_fuse_tensor_dev(&wd, t, 3, NULL, NULL, NULL);
        lk_alloc_fail_at(0);
        if (st == LK_OK) {
            done = 1;
            break;
        }
        assert_int_equal(st, LK_ERR_NOMEM);
        assert_int_equal(lk_device_copy(g_dev, back, dw, w.t.nbytes, LK_COPY_D2H, NULL), LK_OK);
        assert_memory_equal(back, w.buf, w.t.nbytes);
    }
    assert_true(done);
    lk_device_free(g_dev, dw);
    tens_free(&D);
    lora_free(&s);
    tens_free(&w);
}

/* The grow-only scratch (lk_fuse_dev_scratch): keys of decreasing and
 * then increasing size fused through one scratch give the bytes of the
 * fuse without it (oracle: the same call with NULL on a second copy); the
 * scratch is allocated at the first key, kept (same address, no device
 * memory taken or given back: the emul registry's count) for keys that
 * fit, grown only for a larger one, and freed by lk_fuse_dev_scratch_free. */
static void test_scratch(void **state) {
    (void)state;
    if (g_scratch) skip(); /* the group's own scratch: this test makes its own */
    static const int64_t rows[] = {64, 16, 40, 96};
    tu_rng r = {41};
    lk_fuse_dev_scratch sc = {0};
    void *first = NULL;
    size_t bytes_before = 0;
    for (size_t k = 0; k < sizeof rows / sizeof rows[0]; k++) {
        tens w;
        tens_make(&w, "k.weight", LK_DTYPE_BF16, 2, (int64_t[]){rows[k], 48});
        fill(&r, &w, 1.0f, 0);
        lora_set s;
        lora_make(&s, &r, rows[k], 48, 4, 2, 0.3f);
        lk_fuse_key key = {.n_terms = 2};
        void *d1 = NULL, *d2 = NULL;
        assert_int_equal(lk_device_alloc(g_dev, w.t.nbytes, &d1), LK_OK);
        assert_int_equal(lk_device_alloc(g_dev, w.t.nbytes, &d2), LK_OK);
        assert_int_equal(lk_device_copy(g_dev, d1, w.buf, w.t.nbytes, LK_COPY_H2D, NULL), LK_OK);
        assert_int_equal(lk_device_copy(g_dev, d2, w.buf, w.t.nbytes, LK_COPY_H2D, NULL), LK_OK);
        lk_tensor w1 = w.t, w2 = w.t;
        w1.data = d1;
        w2.data = d2;
        w1.device = w2.device = g_dev;
        uint64_t in_use0 = 0, in_use1 = 0;
        lk_device_mem_stats(g_dev, &in_use0, NULL);
        assert_int_equal(lk_fuse_key_apply_dev_in(&w1, &key, s.t, NULL, NULL, &sc, NULL), LK_OK);
        lk_device_mem_stats(g_dev, &in_use1, NULL);
        assert_int_equal(lk_fuse_key_apply_dev(&w2, &key, s.t, NULL, NULL, NULL), LK_OK);
        unsigned char *b1 = malloc(w.t.nbytes), *b2 = malloc(w.t.nbytes);
        assert_int_equal(lk_device_copy(g_dev, b1, d1, w.t.nbytes, LK_COPY_D2H, NULL), LK_OK);
        assert_int_equal(lk_device_copy(g_dev, b2, d2, w.t.nbytes, LK_COPY_D2H, NULL), LK_OK);
        assert_memory_equal(b1, b2, w.t.nbytes);
        assert_true(memcmp(b1, w.buf, w.t.nbytes) != 0);
        assert_non_null(sc.p);
        if (k == 0) {
            first = sc.p;
            assert_true(in_use1 - in_use0 == sc.bytes); /* allocated once, kept */
        } else if (k < 3) { /* smaller keys: the same block, nothing allocated */
            assert_ptr_equal(sc.p, first);
            assert_true(sc.bytes == bytes_before && in_use1 == in_use0);
        } else { /* the largest key: grown, the old block given back */
            assert_true(sc.bytes > bytes_before && in_use1 - in_use0 == sc.bytes - bytes_before);
        }
        bytes_before = sc.bytes;
        free(b1);
        free(b2);
        lk_device_free(g_dev, d1);
        lk_device_free(g_dev, d2);
        lora_free(&s);
        tens_free(&w);
    }
    uint64_t before = 0, after = 0;
    lk_device_mem_stats(g_dev, &before, NULL);
    lk_fuse_dev_scratch_free(&sc);
    lk_device_mem_stats(g_dev, &after, NULL);
    assert_true(before - after == bytes_before && !sc.p && !sc.bytes);
}

static int setup_emul(void **state) {
    (void)state;
    g_dev = (lk_device){LK_DEVICE_EMUL, 0};
    return 0;
}

static int setup_cuda(void **state) {
    (void)state;
    g_dev = (lk_device){LK_DEVICE_CUDA, 0};
    if (lk_device_cuda_count() > 0) return 0;
    printf("test_device_fuse: cuda:0 skipped: no CUDA device (%s)\n",
           lk_device_check(g_dev) ? lk_last_error() : "?");
    return -1;
}

#define DEVICE_TESTS                                                                                         \
    cmocka_unit_test(test_lora_shapes), cmocka_unit_test(test_conv), cmocka_unit_test(test_row_slices),     \
        cmocka_unit_test(test_dense), cmocka_unit_test(test_hada_kron), cmocka_unit_test(test_mixed_kinds), cmocka_unit_test(test_keys), cmocka_unit_test(test_keys_many),        \
        cmocka_unit_test(test_keys_nonfinite), cmocka_unit_test(test_dora),  \
        cmocka_unit_test(test_fp8), cmocka_unit_test(test_fp8_errors), cmocka_unit_test(test_fp8_wide), cmocka_unit_test(test_nonfinite), cmocka_unit_test(test_errors),       \
        cmocka_unit_test(test_ties),                                                                        \
        cmocka_unit_test(test_alloc_fail), cmocka_unit_test(test_scratch)

int main(void) {
    const struct CMUnitTest tests[] = {DEVICE_TESTS};
    int fails = cmocka_run_group_tests_name("emul", tests, setup_emul, NULL);
    /* again with A prepared plain (R x in) instead of in AVX-512 panels: the
     * kernel reads both layouts (the CPU bytes are the same on every path) */
    setenv("LORAKIT_KERNEL", "portable", 1);
    fails += cmocka_run_group_tests_name("emul, plain A", tests, setup_emul, NULL);
    unsetenv("LORAKIT_KERNEL");
    /* again with every key and FP8 fuse's uploads in one grow-only scratch kept across all the cases */
    lk_fuse_dev_scratch one = {0};
    g_scratch = &one;
    fails += cmocka_run_group_tests_name("emul, one scratch", tests, setup_emul, NULL);
    lk_fuse_dev_scratch_free(&one);
    g_scratch = NULL;
    if (lk_device_cuda_count() > 0) fails += cmocka_run_group_tests_name("cuda", tests, setup_cuda, NULL);
    else setup_cuda(NULL); /* prints the visible skip */
    return fails;
}
