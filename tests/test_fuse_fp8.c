/* test_fuse_fp8.c — lk_fuse_file on FP8 weights: plain, <m>.weight_scale
 * (F32 [], BF16 [out, 1], F16 [out], F32 [1]), ComfyUI <m>.scale_weight with
 * the scaled_fp8 marker; nearest and stochastic rounding; rescale and keep;
 * overflow; refused layouts; a weight and its scale in different shards.
 *
 * Oracle: a double-precision reference written here (tests/util/fp8_ref.h
 * for FP8 decode/encode): delta = strength * sum_k B[o,k] A[k,j] in double,
 * v = code * scale + delta, the new scale by LTX-2's formula
 * (quantize_weight_to_fp8_per_tensor: s = 448 / amax in float32, stored
 * 1 / s in float32, then the scale tensor's dtype), q = RNE(v / scale).
 * Two kinds of data:
 *  - "exact": factor values k/8 and k/16 with small k, so the canonical fp32
 *    delta equals the exact one; then lorakit and the reference perform the
 *    same double operations and must agree bit for bit (codes and scales);
 *  - "random": float factors; the fp32 delta differs from the exact one by
 *    a few fp32 ulps, which moves v across an FP8 rounding boundary only
 *    when v lies within that distance of one: such elements may differ by
 *    1 FP8 ulp (we allow it and require it to be rare, < 0.5%).
 * Stochastic: identical bytes at 1, 2 and all threads (the MPI tests check
 * ranks), other bytes for another seed, and unbiased: the mean of
 * (decoded - v) / ulp over 65536 elements is within 5 standard deviations
 * (sd <= 0.5 / sqrt(N)) of 0. */
#include "adapter_ref.h"
#include "fp8_ref.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define OUT 24
#define IN 40
#define R 4

#define g_dir ar_dir /* the group's temporary folder (ar_setup_dir) */

typedef struct ten {
    char name[96];
    lk_dtype dt;
    int ndim;
    int64_t shape[2];
    unsigned char *data;
    size_t nbytes;
} ten;

typedef struct file {
    ten t[16];
    int n;
} file;

static ten *add(file *f, const char *name, lk_dtype dt, int ndim, int64_t d0, int64_t d1) {
    ten *t = &f->t[f->n++];
    snprintf(t->name, sizeof t->name, "%s", name);
    t->dt = dt;
    t->ndim = ndim;
    t->shape[0] = d0;
    t->shape[1] = d1;
    size_t numel = ndim == 0 ? 1 : ndim == 1 ? (size_t)d0 : (size_t)(d0 * d1);
    t->nbytes = numel * lk_dtype_size(dt);
    t->data = calloc(1, t->nbytes ? t->nbytes : 1);
    return t;
}

static void save(const file *f, const char *path) {
    lk_tensor v[16];
    for (int i = 0; i < f->n; i++)
        v[i] = (lk_tensor){.name = f->t[i].name, .dtype = f->t[i].dt, .ndim = f->t[i].ndim,
                           .shape = {f->t[i].shape[0], f->t[i].shape[1]}, .nbytes = f->t[i].nbytes,
                           .data = f->t[i].data};
    assert_int_equal(lk_st_save(path, v, (size_t)f->n, NULL, 0), LK_OK);
}

static void file_free(file *f) {
    for (int i = 0; i < f->n; i++) free(f->t[i].data);
    f->n = 0;
}

/* Random finite FP8 codes with |value| <= lim (as a multiple of the max). */
static void fill_codes(ten *t, tu_rng *r, double lim) {
    for (size_t i = 0; i < t->nbytes; i++) {
        uint8_t c;
        do c = (uint8_t)tu_next(r);
        while (isnan(ref_decode(ref_fmt_of(t->dt), c)) || isinf(ref_decode(ref_fmt_of(t->dt), c)) ||
               fabs(ref_decode(ref_fmt_of(t->dt), c)) > lim * lk_fp8_max(t->dt));
        t->data[i] = c;
    }
}

static float A[R * IN], B[OUT * R];

/* exact: A = k/8, B = k/16 with |k| <= 7 (products and sums exact in fp32) */
static void make_factors(tu_rng *r, int exact) {
    for (int i = 0; i < R * IN; i++)
        A[i] = exact ? (float)((int)(tu_next(r) % 15) - 7) / 8.0f : tu_uniform(r, -1, 1);
    for (int i = 0; i < OUT * R; i++)
        B[i] = exact ? (float)((int)(tu_next(r) % 15) - 7) / 16.0f : tu_uniform(r, -1, 1);
}

/* A diffusers-format adapter on "<m>" with the factors above, alpha = r. */
static char *save_adapter(const char *m, float scale_factors) {
    char na[128], nb[128];
    snprintf(na, sizeof na, "%s.lora_A.weight", m);
    snprintf(nb, sizeof nb, "%s.lora_B.weight", m);
    float a2[R * IN], b2[OUT * R];
    for (int i = 0; i < R * IN; i++) a2[i] = A[i];
    for (int i = 0; i < OUT * R; i++) b2[i] = B[i] * scale_factors;
    lk_tensor t[2] = {
        {.name = na, .dtype = LK_DTYPE_F32, .ndim = 2, .shape = {R, IN}, .nbytes = sizeof a2, .data = a2},
        {.name = nb, .dtype = LK_DTYPE_F32, .ndim = 2, .shape = {OUT, R}, .nbytes = sizeof b2, .data = b2},
    };
    char *p = tu_path(g_dir, "adapter.safetensors");
    assert_int_equal(lk_st_save(p, t, 2, NULL, 0), LK_OK);
    return p;
}

static double ref_delta(int o, int j, double strength, float bscale) {
    double d = 0;
    for (int k = 0; k < R; k++) d += (double)(B[o * R + k] * bscale) * (double)A[k * IN + j];
    return strength * d;
}

static double scale_val(const ten *s, size_t i) {
    float f;
    lk_to_f32(&f, s->data + i * lk_dtype_size(s->dt), s->dt, 1);
    return f;
}

/* The reference's new scale: LTX-2's two float32 roundings, then the
 * dtype. LTX-2 uses e4m3fn's 448; for e5m2 the format's 57344. */
static double ltx_scale(float amax, lk_dtype wdt, lk_dtype sdt, unsigned char *store) {
    float s = (wdt == LK_DTYPE_F8_E5M2 ? 57344.0f : 448.0f) / amax;
    float inv = 1.0f / s;
    lk_from_f32(store, &inv, sdt, 1);
    float back;
    lk_to_f32(&back, store, sdt, 1);
    return back;
}

typedef struct expect {
    uint8_t codes[OUT * IN];
    unsigned char scale[OUT * 4];
    int overflow;
} expect;

/* The reference result for weight w (codes) with scale sc (may be NULL). */
static void reference(const ten *w, const ten *sc, int rescale, double strength, float bscale, expect *e) {
    const ref_fmt *f = ref_fmt_of(w->dt);
    int per_row = sc && sc->nbytes / lk_dtype_size(sc->dt) == OUT;
    double v[OUT * IN], s_old[OUT], s_new[OUT];
    for (int o = 0; o < OUT; o++) s_old[o] = s_new[o] = sc ? scale_val(sc, per_row ? (size_t)o : 0) : 1.0;
    for (int o = 0; o < OUT; o++)
        for (int j = 0; j < IN; j++)
            v[o * IN + j] = ref_decode(f, w->data[o * IN + j]) * s_old[o] + ref_delta(o, j, strength, bscale);
    if (sc) memcpy(e->scale, sc->data, sc->nbytes);
    if (rescale && sc) {
        float amax[OUT] = {0};
        for (int o = 0; o < OUT; o++)
            for (int j = 0; j < IN; j++) {
                float a = fabsf((float)v[o * IN + j]);
                if (a > amax[per_row ? o : 0]) amax[per_row ? o : 0] = a;
            }
        for (int o = 0; o < (per_row ? OUT : 1); o++)
            s_new[o] = ltx_scale(amax[o], w->dt, sc->dt, e->scale + (size_t)o * lk_dtype_size(sc->dt));
        if (!per_row)
            for (int o = 1; o < OUT; o++) s_new[o] = s_new[0];
    }
    e->overflow = 0;
    for (int o = 0; o < OUT; o++)
        for (int j = 0; j < IN; j++) {
            unsigned c;
            e->overflow += ref_encode(f, v[o * IN + j] / s_new[o], &c);
            e->codes[o * IN + j] = (uint8_t)c;
        }
}

/* FP8 codes' distance in representable steps (same sign assumed). */
static int code_dist(uint8_t a, uint8_t b) { return abs((int)(a & 0x7f) - (int)(b & 0x7f)) + ((a ^ b) & 0x80 ? 256 : 0); }

typedef struct layout {
    const char *what;
    lk_dtype wdt;
    const char *scale_name; /* NULL: plain */
    lk_dtype sdt;
    int sndim;
    int64_t s0, s1;
    int marker; /* the scaled_fp8 tensor */
} layout;

static const layout LAYOUTS[] = {
    {"plain e4m3", LK_DTYPE_F8_E4M3, NULL, 0, 0, 0, 0, 0},
    {"plain e5m2", LK_DTYPE_F8_E5M2, NULL, 0, 0, 0, 0, 0},
    {"LTX F32 []", LK_DTYPE_F8_E4M3, "weight_scale", LK_DTYPE_F32, 0, 0, 0, 0},
    {"TRT F32 [1]", LK_DTYPE_F8_E4M3, "weight_scale", LK_DTYPE_F32, 1, 1, 0, 0},
    {"vLLM BF16 [out,1]", LK_DTYPE_F8_E4M3, "weight_scale", LK_DTYPE_BF16, 2, OUT, 1, 0},
    {"F16 [out]", LK_DTYPE_F8_E4M3, "weight_scale", LK_DTYPE_F16, 1, OUT, 0, 0},
    {"ComfyUI scale_weight", LK_DTYPE_F8_E4M3, "scale_weight", LK_DTYPE_F32, 0, 0, 0, 1},
    {"e5m2 F32 []", LK_DTYPE_F8_E5M2, "weight_scale", LK_DTYPE_F32, 0, 0, 0, 0},
};

/* Base: blocks.0.attn.to_q.weight in layout L, its scale, an input_scale,
 * an untouched BF16 weight; fused with the adapter at strength st. */
static void build_base(const layout *L, file *f, tu_rng *r, ten **w, ten **sc) {
    *w = add(f, "blocks.0.attn.to_q.weight", L->wdt, 2, OUT, IN);
    fill_codes(*w, r, L->scale_name ? 0.9 : 0.05); /* plain: room for the delta */
    *sc = NULL;
    if (L->scale_name) {
        char nm[96];
        snprintf(nm, sizeof nm, "blocks.0.attn.to_q.%s", L->scale_name);
        *sc = add(f, nm, L->sdt, L->sndim, L->s0, L->s1);
        size_t ns = (*sc)->nbytes / lk_dtype_size(L->sdt);
        for (size_t i = 0; i < ns; i++) {
            float v = 0.002f + 0.0001f * (float)(i % 7);
            lk_from_f32((*sc)->data + i * lk_dtype_size(L->sdt), &v, L->sdt, 1);
        }
    }
    ten *is = add(f, "blocks.0.attn.to_q.input_scale", LK_DTYPE_F32, 0, 0, 0);
    float one = 0.5f;
    memcpy(is->data, &one, 4);
    if (L->marker) add(f, "scaled_fp8", LK_DTYPE_F8_E4M3, 1, 2, 0);
    ten *o = add(f, "blocks.0.ff.weight", LK_DTYPE_BF16, 2, 8, 8);
    for (size_t i = 0; i < o->nbytes; i++) o->data[i] = (unsigned char)tu_next(r);
}

static void load_out(const char *path, file *got) {
    lk_st *st;
    assert_int_equal(lk_st_open(path, &st), LK_OK);
    got->n = 0;
    for (size_t i = 0; i < lk_st_count(st); i++) {
        const lk_tensor *t = lk_st_tensor(st, i);
        ten *x = add(got, t->name, t->dtype, t->ndim, t->shape[0], t->shape[1]);
        memcpy(x->data, t->data, t->nbytes);
    }
    lk_st_close(st);
}

static const ten *find(const file *f, const char *name) {
    for (int i = 0; i < f->n; i++)
        if (!strcmp(f->t[i].name, name)) return &f->t[i];
    return NULL;
}

static void run_layout(const layout *L, int exact, int rescale) {
    tu_rng r = {1234 + (uint64_t)(L - LAYOUTS) * 17 + (uint64_t)exact * 3 + (uint64_t)rescale};
    file base = {0};
    ten *w, *sc;
    build_base(L, &base, &r, &w, &sc);
    char *bp = tu_path(g_dir, "base.safetensors"), *op = tu_path(g_dir, "out.safetensors");
    save(&base, bp);
    make_factors(&r, exact);
    /* the delta in units of the weights: scaled layouts ~ the scale, plain ~ small */
    float bscale = L->scale_name ? 0.004f * (exact ? 1.0f : 1.0f) : 1.0f;
    if (exact && L->scale_name) bscale = 1.0f / 256.0f;
    char *ad = save_adapter("blocks.0.attn.to_q", bscale);
    const double strength = 1.0; /* exact: a power of two keeps the chain exact */
    lk_fuse_input in = {.path = ad, .strength = (float)strength};
    lk_fuse_file_opts fo = {0};
    fo.fuse.fp8.scale = rescale ? LK_FP8_RESCALE : LK_FP8_KEEP;
    fo.fuse.fp8.saturate = 1; /* keep may overflow here; counted below */
    expect e;
    reference(w, sc, rescale, strength, bscale, &e);
    lk_status s = lk_fuse_file(bp, &in, 1, op, &fo, NULL);
    if (s) fail_msg("%s: %s", L->what, lk_last_error());
    file got = {0};
    load_out(op, &got);
    const ten *gw = find(&got, w->name);
    int diff = 0;
    for (int i = 0; i < OUT * IN; i++) {
        if (gw->data[i] == e.codes[i]) continue;
        if (exact || code_dist(gw->data[i], e.codes[i]) > 1)
            fail_msg("%s (%s, %s): element %d: got 0x%02x want 0x%02x", L->what, exact ? "exact" : "random",
                     rescale ? "rescale" : "keep", i, gw->data[i], e.codes[i]);
        diff++;
    }
    assert_true(diff * 200 < OUT * IN); /* 1-ulp differences are rare (< 0.5%) */
    if (sc) {
        const ten *gs = find(&got, sc->name);
        if (exact || rescale) assert_memory_equal(gs->data, e.scale, sc->nbytes); /* LTX-2's scale, bit for bit */
        if (!rescale) assert_memory_equal(gs->data, sc->data, sc->nbytes);
    }
    /* companions and untouched tensors are copied byte for byte */
    for (int i = 0; i < base.n; i++) {
        if (&base.t[i] == w || &base.t[i] == sc) continue;
        const ten *g = find(&got, base.t[i].name);
        assert_non_null(g);
        assert_memory_equal(g->data, base.t[i].data, base.t[i].nbytes);
    }
    file_free(&got);
    file_free(&base);
    unlink(op);
    free(ad);
    free(bp);
    free(op);
}

static void test_layouts_nearest(void **state) {
    (void)state;
    for (size_t l = 0; l < sizeof LAYOUTS / sizeof LAYOUTS[0]; l++)
        for (int exact = 0; exact < 2; exact++)
            for (int rescale = 0; rescale < 2; rescale++) run_layout(&LAYOUTS[l], exact, rescale);
}

/* Overflow: plain and keep fail naming tensor and count (no output);
 * saturate clamps to the largest finite. */
static void test_overflow(void **state) {
    (void)state;
    tu_rng r = {77};
    file base = {0};
    ten *w = add(&base, "m.weight", LK_DTYPE_F8_E4M3, 2, OUT, IN);
    for (size_t i = 0; i < w->nbytes; i++) w->data[i] = 0x7e; /* 448 */
    char *bp = tu_path(g_dir, "ovf.safetensors"), *op = tu_path(g_dir, "ovf_out.safetensors");
    save(&base, bp);
    for (int i = 0; i < R * IN; i++) A[i] = 1.0f;
    for (int i = 0; i < OUT * R; i++) B[i] = 8.0f; /* delta = 32 per element: 480 > 464 */
    char *ad = save_adapter("m", 1.0f);
    lk_fuse_input in = {.path = ad, .strength = 1.0f};
    assert_int_equal(lk_fuse_file(bp, &in, 1, op, NULL, NULL), LK_ERR_NONFINITE);
    tu_assert_contains(lk_last_error(), "m.weight");
    char cnt[64];
    snprintf(cnt, sizeof cnt, "%d of %d elements overflow F8_E4M3", OUT * IN, OUT * IN);
    tu_assert_contains(lk_last_error(), cnt);
    assert_false(tu_exists(op));
    lk_fuse_file_opts fo = {0};
    fo.fuse.fp8.saturate = 1;
    assert_int_equal(lk_fuse_file(bp, &in, 1, op, &fo, NULL), LK_OK);
    file got = {0};
    load_out(op, &got);
    for (int i = 0; i < OUT * IN; i++) assert_int_equal(find(&got, "m.weight")->data[i], 0x7e);
    file_free(&got);
    file_free(&base);
    (void)r;
    unlink(op);
    free(ad);
    free(bp);
    free(op);
}

/* Block-wise and unknown scale siblings are refused by name; no output. */
static void test_refused_layouts(void **state) {
    (void)state;
    static const struct {
        const char *sib;
        int ndim;
        int64_t d0, d1;
        const char *need;
    } cases[] = {
        {"weight_scale_inv", 2, 1, 1, "m.weight_scale_inv"},
        {"weight_scale_2", 0, 0, 0, "m.weight_scale_2"},
        {"weight_scale", 2, 2, 2, "block-wise"},
        {"scale_weight", 0, 0, 0, "m.scale_weight"}, /* no scaled_fp8 marker */
    };
    tu_rng r = {5};
    make_factors(&r, 1);
    char *ad = save_adapter("m", 1.0f / 64);
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        file base = {0};
        ten *w = add(&base, "m.weight", LK_DTYPE_F8_E4M3, 2, OUT, IN);
        fill_codes(w, &r, 0.1);
        char nm[64];
        snprintf(nm, sizeof nm, "m.%s", cases[c].sib);
        ten *s = add(&base, nm, LK_DTYPE_F32, cases[c].ndim, cases[c].d0, cases[c].d1);
        float one = 1.0f;
        for (size_t i = 0; i < s->nbytes / 4; i++) memcpy(s->data + 4 * i, &one, 4);
        char *bp = tu_path(g_dir, "bad.safetensors"), *op = tu_path(g_dir, "bad_out.safetensors");
        save(&base, bp);
        lk_fuse_input in = {.path = ad, .strength = 1.0f};
        assert_int_equal(lk_fuse_file(bp, &in, 1, op, NULL, NULL), LK_ERR_UNSUPPORTED);
        tu_assert_contains(lk_last_error(), "m.weight");
        tu_assert_contains(lk_last_error(), cases[c].need);
        assert_false(tu_exists(op));
        file_free(&base);
        free(bp);
        free(op);
    }
    free(ad);
}

/* Stochastic rounding: thread-count independent, seed dependent, unbiased. */
static void test_stochastic(void **state) {
    (void)state;
    enum { SO = 256, SI = 256 };
    file base = {0};
    ten *w = add(&base, "s.weight", LK_DTYPE_F8_E4M3, 2, SO, SI);
    for (size_t i = 0; i < w->nbytes; i++) w->data[i] = 0x38; /* 1.0: ulp 0.125 on [1, 2) */
    char *bp = tu_path(g_dir, "sto.safetensors");
    save(&base, bp);
    /* rank 1: delta[o][j] = b[o] * a[j], in [0, 0.75): stays in [1, 2) */
    static float a1[SI], b1[SO];
    tu_rng r = {31};
    for (int j = 0; j < SI; j++) a1[j] = tu_uniform(&r, 0, 1);
    for (int o = 0; o < SO; o++) b1[o] = tu_uniform(&r, 0, 0.75f);
    lk_tensor t[2] = {
        {.name = "s.lora_A.weight", .dtype = LK_DTYPE_F32, .ndim = 2, .shape = {1, SI}, .nbytes = sizeof a1, .data = a1},
        {.name = "s.lora_B.weight", .dtype = LK_DTYPE_F32, .ndim = 2, .shape = {SO, 1}, .nbytes = sizeof b1, .data = b1},
    };
    char *ad = tu_path(g_dir, "sto_ad.safetensors");
    assert_int_equal(lk_st_save(ad, t, 2, NULL, 0), LK_OK);
    lk_fuse_input in = {.path = ad, .strength = 1.0f};
    char hex[4][LK_DIGEST_HEX];
    const int threads[3] = {1, 2, 0};
    char *op = tu_path(g_dir, "sto_out.safetensors");
    for (int k = 0; k < 4; k++) {
        lk_fuse_file_opts fo = {0};
        fo.fuse.threads = k < 3 ? threads[k] : 1;
        fo.fuse.fp8.rounding = LK_FP8_STOCHASTIC;
        fo.fuse.fp8.seed = k < 3 ? 42 : 43;
        assert_int_equal(lk_fuse_file(bp, &in, 1, op, &fo, NULL), LK_OK);
        lk_st *st;
        assert_int_equal(lk_st_open(op, &st), LK_OK);
        assert_int_equal(lk_digest_st(st, hex[k]), LK_OK);
        if (k == 0) {
            /* unbiased: mean of (decoded - v) / ulp over N elements */
            const uint8_t *c = lk_st_tensor(st, 0)->data;
            double sum = 0;
            int moved = 0;
            for (int o = 0; o < SO; o++)
                for (int j = 0; j < SI; j++) {
                    double v = 1.0 + (double)b1[o] * (double)a1[j];
                    double d = ref_decode(&E4M3, c[o * SI + j]);
                    assert_true(fabs(d - v) < 0.125); /* one of the two neighbours */
                    sum += (d - v) / 0.125;
                    moved += c[o * SI + j] != 0x38;
                }
            double mean = sum / (SO * SI), sd = 0.5 / sqrt((double)SO * SI);
            if (fabs(mean) > 5 * sd) fail_msg("stochastic mean error %.5f ulp, tolerance %.5f", mean, 5 * sd);
            assert_true(moved > 0);
        }
        lk_st_close(st);
    }
    assert_string_equal(hex[0], hex[1]);
    assert_string_equal(hex[0], hex[2]);
    assert_string_not_equal(hex[0], hex[3]);
    /* the CLI options reach the same bytes; a bad value is a usage error */
    char *o = NULL, *e = NULL;
    assert_int_equal(tu_run_cli(&o, &e, "fuse '%s' -l '%s' -o '%s' --threads 2 --fp8-rounding stochastic --fp8-seed 42",
                                bp, ad, op), 0);
    free(o);
    free(e);
    assert_int_equal(tu_run_cli(&o, NULL, "digest '%s'", op), 0);
    tu_assert_contains(o, hex[0]);
    free(o);
    assert_int_equal(tu_run_cli(NULL, &e, "fuse '%s' -l '%s' -o '%s' --fp8-rounding up", bp, ad, op), 2);
    tu_assert_contains(e, "valid: nearest, stochastic");
    free(e);
    assert_int_equal(tu_run_cli(NULL, &e, "fuse '%s' -l '%s' -o '%s' --fp8-scale x", bp, ad, op), 2);
    tu_assert_contains(e, "valid: rescale, keep");
    free(e);
    file_free(&base);
    unlink(op);
    free(op);
    free(ad);
    free(bp);
}

/* A sharded base whose FP8 weight and scale sit in different shards gives
 * the digest of the single-file fuse. */
static void test_sharded_scale(void **state) {
    (void)state;
    tu_rng r = {99};
    file s1 = {0}, s2 = {0}, all = {0};
    ten *w = add(&s1, "blocks.0.attn.to_q.weight", LK_DTYPE_F8_E4M3, 2, OUT, IN);
    fill_codes(w, &r, 0.9);
    ten *sc = add(&s2, "blocks.0.attn.to_q.weight_scale", LK_DTYPE_F32, 0, 0, 0);
    float v = 0.003f;
    memcpy(sc->data, &v, 4);
    char *d = tu_path(g_dir, "fp8sharded");
    assert_int_equal(mkdir(d, 0777), 0);
    char *p1 = tu_path(d, "m-00001-of-00002.safetensors"), *p2 = tu_path(d, "m-00002-of-00002.safetensors");
    save(&s1, p1);
    save(&s2, p2);
    const char *idx = "{\"metadata\": {}, \"weight_map\": {\"blocks.0.attn.to_q.weight\": \"m-00001-of-00002.safetensors\","
                      " \"blocks.0.attn.to_q.weight_scale\": \"m-00002-of-00002.safetensors\"}}";
    char *ip = tu_path(d, "m.safetensors.index.json");
    assert_int_equal(tu_write_file(ip, idx, strlen(idx)), 0);
    all.t[0] = s1.t[0];
    all.t[1] = s2.t[0];
    all.n = 2;
    char *single = tu_path(g_dir, "fp8single.safetensors");
    save(&all, single);
    make_factors(&r, 0);
    char *ad = save_adapter("blocks.0.attn.to_q", 0.004f);
    lk_fuse_input in = {.path = ad, .strength = 1.0f};
    char *o1 = tu_path(g_dir, "fp8sharded_out"), *o2 = tu_path(g_dir, "fp8single_out.safetensors");
    assert_int_equal(lk_fuse_file(d, &in, 1, o1, NULL, NULL), LK_OK);
    assert_int_equal(lk_fuse_file(single, &in, 1, o2, NULL, NULL), LK_OK);
    char a[LK_DIGEST_HEX], b[LK_DIGEST_HEX];
    lk_ckpt *ck;
    assert_int_equal(lk_ckpt_open(o1, &ck), LK_OK);
    assert_int_equal(lk_digest_ckpt(ck, a), LK_OK);
    lk_ckpt_close(ck);
    assert_int_equal(lk_ckpt_open(o2, &ck), LK_OK);
    assert_int_equal(lk_digest_ckpt(ck, b), LK_OK);
    lk_ckpt_close(ck);
    assert_string_equal(a, b);
    /* the scale was rewritten (rescale is the default) */
    file got = {0};
    char *g2 = tu_path(o1, "m-00002-of-00002.safetensors");
    load_out(g2, &got);
    assert_memory_not_equal(got.t[0].data, &v, 4);
    file_free(&got);
    free(g2);
    file_free(&s1);
    file_free(&s2);
    free(d);
    free(p1);
    free(p2);
    free(ip);
    free(single);
    free(ad);
    free(o1);
    free(o2);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_layouts_nearest), cmocka_unit_test(test_overflow),
        cmocka_unit_test(test_refused_layouts), cmocka_unit_test(test_stochastic),
        cmocka_unit_test(test_sharded_scale),
    };
    return cmocka_run_group_tests(tests, ar_setup_dir, ar_teardown_dir);
}
