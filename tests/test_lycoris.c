/* test_lycoris.c — the algorithms beyond plain linear LoRA (issue 18):
 * conv LoRA (LoCon, Tucker lora_mid, linear <-> 1x1), LoHa, LoKr, dense
 * diffs (diff, diff_b, set_weight), LyCORIS norm (w_norm, b_norm) and
 * kohya / LyCORIS DoRA (dora_scale), fused through lk_fuse_tensors.
 *
 * Oracles, each written here, not taken from lorakit:
 *  - a float64 reference of every delta from the stored factor values (the
 *    formulas of LyCORIS's functional code: rebuild_tucker's einsum, the
 *    Hadamard and Kronecker products, weight_decompose), and the fused
 *    value within 1 ulp of W + s * c * delta (the worst is printed);
 *  - for LoHa, LoKr and dense terms an independent scalar replay of the
 *    canonical chain that src/fuse/terms.c documents, which must give the
 *    same bytes (what lorakit guarantees beyond 1 ulp);
 *  - conv LoRA must give the bytes of a plain LoRA fuse of the reshaped
 *    factors (it is the LoRA kernel);
 *  - thread counts 1 and 3 give the same bytes; malformed shapes are
 *    refused naming the key and both shapes; unknown algorithms by name. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

#include "adapter_ref.h"
#include "fuse/fuse.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define g_dir ar_dir
static tu_rng g_rng = {1818};

/* ---- small helpers ---- */

static lk_tensor *shape_as(lk_tensor *t, int nd, const int64_t *dims) {
    size_t n = 1;
    for (int d = 0; d < nd; d++) n *= (size_t)dims[d];
    assert_int_equal(n, lk_tensor_numel(t));
    t->ndim = nd;
    for (int d = 0; d < LK_MAX_DIMS; d++) t->shape[d] = d < nd ? dims[d] : 0;
    return t;
}
#define SHAPE(t, ...) shape_as((t), (int)(sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)), (int64_t[]){__VA_ARGS__})

/* A tensor of numel values in [lo, hi) with the given shape. */
static lk_tensor *rnd(af_file *f, const char *name, lk_dtype dt, float lo, float hi, int nd, const int64_t *dims) {
    int64_t n = 1;
    for (int d = 0; d < nd; d++) n *= dims[d];
    return shape_as(af_rand(f, name, dt, 1, n, &g_rng, lo, hi), nd, dims);
}
#define RND(f, name, dt, ...) \
    rnd((f), (name), (dt), -0.5f, 0.5f, (int)(sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)), (int64_t[]){__VA_ARGS__})

static double val(const lk_tensor *t, size_t i) { return ar_get(t, i); }

/* dst (m x n) = B (m x r) @ A (r x n), in double, from stored values. */
static void mm(double *dst, const lk_tensor *B, const lk_tensor *A, size_t m, size_t r, size_t n) {
    for (size_t i = 0; i < m; i++)
        for (size_t j = 0; j < n; j++) {
            double s = 0;
            for (size_t k = 0; k < r; k++) s += val(B, i * r + k) * (A ? val(A, k * n + j) : (k == j));
            dst[i * n + j] = A ? s : val(B, i * n + j);
        }
}

/* rebuild_tucker(t, wa, wb)[p, q, h] = sum_{i,j} t[i, j, h] wa[i, p] wb[j, q] (LyCORIS general.py). */
static void tucker(double *dst, const lk_tensor *t, const lk_tensor *wa, const lk_tensor *wb) {
    size_t R1 = (size_t)t->shape[0], R2 = (size_t)t->shape[1], K = lk_tensor_numel(t) / (R1 * R2);
    size_t P = (size_t)wa->shape[1], Q = (size_t)wb->shape[1];
    for (size_t p = 0; p < P; p++)
        for (size_t q = 0; q < Q; q++)
            for (size_t h = 0; h < K; h++) {
                double s = 0;
                for (size_t i = 0; i < R1; i++)
                    for (size_t j = 0; j < R2; j++)
                        s += val(t, (i * R2 + j) * K + h) * val(wa, i * P + p) * val(wb, j * Q + q);
                dst[(p * Q + q) * K + h] = s;
            }
}

/* The model: tensors in memory (an af_file's views) and a copy of their
 * bytes before fusing. */
typedef struct model {
    af_file *f;
    void *orig[AF_MAX];
} model;

static void snap(model *m) {
    for (size_t i = 0; i < m->f->n; i++) {
        free(m->orig[i]);
        m->orig[i] = malloc(m->f->t[i].nbytes);
        memcpy(m->orig[i], m->f->t[i].data, m->f->t[i].nbytes);
    }
}

static void model_free(model *m) {
    for (size_t i = 0; i < m->f->n; i++) free(m->orig[i]);
    af_free(m->f);
}

static size_t idx_of(const model *m, const char *name) {
    for (size_t i = 0; i < m->f->n; i++)
        if (!strcmp(m->f->t[i].name, name)) return i;
    fail_msg("no model tensor %s", name);
    return 0;
}

static void restore(model *m) {
    for (size_t i = 0; i < m->f->n; i++) memcpy(m->f->t[i].data, m->orig[i], m->f->t[i].nbytes);
}

static char *save_adapter(af_file *a, const char *name) {
    char *p = tu_path(g_dir, name);
    af_save(a, p, NULL, 0);
    return p;
}

static lk_status fuse(model *m, const char *const *paths, const float *s, size_t n, int threads) {
    lk_fuse_input in[4];
    for (size_t i = 0; i < n; i++) in[i] = (lk_fuse_input){paths[i], s[i], LK_FORMAT_AUTO};
    lk_fuse_file_opts o = {.fuse = {.threads = threads}};
    return lk_fuse_tensors(m->f->t, m->f->n, in, n, &o, NULL);
}

static lk_status fuse1(model *m, const char *path, float s) { return fuse(m, &path, &s, 1, 1); }

/* Worst distance in ulps of tensor `name` from W + coef * delta (delta in
 * double, numel values); every element must be within 1 ulp. */
static double check_ulp(const model *m, const char *name, const double *delta, double coef) {
    size_t i = idx_of(m, name);
    const lk_tensor *t = &m->f->t[i];
    lk_tensor w0 = *t;
    w0.data = m->orig[i];
    double worst = 0;
    for (size_t e = 0; e < lk_tensor_numel(t); e++) {
        double ref = val(&w0, e) + coef * delta[e], got = val(t, e);
        double u = fabs(got - ref) / ar_ulp(t->dtype, ref);
        if (u > worst) worst = u;
        if (u > 1.0) fail_msg("%s element %zu (%s): got %.9g, reference %.9g (%.3f ulp)", name, e,
                              lk_dtype_name(t->dtype), got, ref, u);
    }
    printf("  %-24s %-5s worst %.3f ulp\n", name, lk_dtype_name(t->dtype), worst);
    return worst;
}

/* Bytes of tensor name equal to the bytes in want. */
static void same_bytes(const model *m, const char *name, const void *want) {
    const lk_tensor *t = &m->f->t[idx_of(m, name)];
    assert_memory_equal(t->data, want, t->nbytes);
}

/* The canonical finish (kernel.c step 4) of one element: w + d, d in the
 * accumulator (f32 narrow, f64 for F32 weights), into the weight's bytes. */
static void finish(void *dst, const void *w, lk_dtype dt, size_t e, double d) {
    const size_t es = lk_dtype_size(dt);
    if (dt == LK_DTYPE_F32) {
        uint32_t wb, r;
        memcpy(&wb, (const char *)w + e * 4, 4);
        r = lk_fuse_round_f64_to_f32(wb, d);
        memcpy((char *)dst + e * 4, &r, 4);
    } else {
        float wf, r;
        lk_to_f32(&wf, (const char *)w + e * es, dt, 1);
        r = lk_fuse_round_f32(wf, (float)d);
        lk_from_f32((char *)dst + e * es, &r, dt, 1);
    }
}

/* kernel.c's chain of one LoRA term at element (o, j): narrow or wide. */
static double chain(int wide, double sc, const lk_tensor *B, const lk_tensor *A, size_t o, size_t j, size_t r,
                    size_t n) {
    if (wide) {
        double d = (sc * val(B, o * r)) * val(A, j);
        for (size_t k = 1; k < r; k++) d = fma(sc * val(B, o * r + k), val(A, k * n + j), d);
        return d;
    }
    float d = (float)(sc * val(B, o * r)) * (float)val(A, j);
    for (size_t k = 1; k < r; k++) d = fmaf((float)(sc * val(B, o * r + k)), (float)val(A, k * n + j), d);
    return d;
}

/* ---- conv LoRA ---- */

static void test_conv_lora(void **state) {
    (void)state;
    const lk_dtype dts[3] = {LK_DTYPE_BF16, LK_DTYPE_F16, LK_DTYPE_F32};
    for (int di = 0; di < 3; di++) {
        lk_dtype dt = dts[di];
        model m = {af_new(), {0}};
        RND(m.f, "conv.weight", dt, 8, 4, 3, 3);
        RND(m.f, "pw.weight", dt, 8, 4, 1, 1);  /* 1x1 conv: linear factors land on it */
        RND(m.f, "lin.weight", dt, 8, 4);       /* linear: 1x1 conv factors land on it */
        RND(m.f, "tk.weight", dt, 6, 4, 3, 3);  /* Tucker LoCon */
        snap(&m);
        af_file *a = af_new();
        lk_tensor *cd = RND(a, "lora_unet_conv.lora_down.weight", LK_DTYPE_F32, 2, 4, 3, 3);
        lk_tensor *cu = RND(a, "lora_unet_conv.lora_up.weight", LK_DTYPE_BF16, 8, 2, 1, 1);
        af_scalar(a, "lora_unet_conv.alpha", LK_DTYPE_F32, 1.0);
        lk_tensor *pd = RND(a, "lora_unet_pw.lora_down.weight", LK_DTYPE_F32, 3, 4);
        lk_tensor *pu = RND(a, "lora_unet_pw.lora_up.weight", LK_DTYPE_F32, 8, 3);
        lk_tensor *ld = RND(a, "lora_unet_lin.lora_down.weight", LK_DTYPE_F16, 2, 4, 1, 1);
        lk_tensor *lu = RND(a, "lora_unet_lin.lora_up.weight", LK_DTYPE_F16, 8, 2, 1, 1);
        af_scalar(a, "lora_unet_lin.alpha", LK_DTYPE_F32, 4.0);
        lk_tensor *td = RND(a, "lora_unet_tk.lora_down.weight", LK_DTYPE_F32, 2, 4, 1, 1);
        lk_tensor *tm = RND(a, "lora_unet_tk.lora_mid.weight", LK_DTYPE_F32, 3, 2, 3, 3);
        lk_tensor *tu = RND(a, "lora_unet_tk.lora_up.weight", LK_DTYPE_F32, 6, 3, 1, 1);
        char *p = save_adapter(a, "conv.safetensors");
        printf("conv LoRA, %s weights\n", lk_dtype_name(dt));
        assert_int_equal(fuse1(&m, p, 0.7f), LK_OK);
        double d[8 * 36], mid[6 * 36];
        mm(d, cu, cd, 8, 2, 36);
        check_ulp(&m, "conv.weight", d, (double)0.7f * 0.5);
        mm(d, pu, pd, 8, 3, 4);
        check_ulp(&m, "pw.weight", d, (double)0.7f);
        mm(d, lu, ld, 8, 2, 4);
        check_ulp(&m, "lin.weight", d, (double)0.7f * 2.0);
        /* Tucker: up[o, p] mid[p, q, h] down[q, i] = up @ rebuild of (mid, I, down) */
        lk_tensor down2 = *td;
        SHAPE(&down2, 2, 4);
        ar_tensor eye;
        ar_tensor_rand(&eye, "eye", LK_DTYPE_F32, 3, 3, &g_rng, 0, 0);
        for (int q = 0; q < 3; q++) ((float *)eye.t.data)[q * 4] = 1.0f;
        tucker(mid, tm, &eye.t, &down2); /* [p, i, h] */
        for (size_t o = 0; o < 6; o++)
            for (size_t e = 0; e < 36; e++) {
                double s = 0;
                for (size_t q = 0; q < 3; q++) s += val(tu, o * 3 + q) * mid[q * 36 + e];
                d[o * 36 + e] = s;
            }
        check_ulp(&m, "tk.weight", d, (double)0.7f);
        ar_tensor_free(&eye);
        /* conv LoRA is the LoRA kernel: the bytes of a plain 2-D fuse */
        lk_tensor A2 = *cd, B2 = *cu, W = m.f->t[idx_of(&m, "conv.weight")];
        SHAPE(&A2, 2, 36);
        SHAPE(&B2, 8, 2);
        void *buf = malloc(W.nbytes);
        lk_fuse_term t = {.A = &A2, .B = &B2, .scale = (double)0.7f * 0.5};
        assert_int_equal(lk_fuse_tensor(buf, m.orig[idx_of(&m, "conv.weight")], dt, 8, 36, &t, 1, NULL, "w"), LK_OK);
        same_bytes(&m, "conv.weight", buf);
        free(buf);
        free(p);
        af_free(a);
        model_free(&m);
    }
}

/* ---- LoHa ---- */

/* LoHa's replay (terms.c): P1 with the scale, P2 without, d = +0 + P1 * P2. */
static void loha_replay(void *dst, const void *w, lk_dtype dt, double sc, const lk_tensor *w1a, const lk_tensor *w1b,
                        const lk_tensor *w2a, const lk_tensor *w2b, size_t out, size_t in, size_t r) {
    int wide = dt == LK_DTYPE_F32;
    for (size_t o = 0; o < out; o++)
        for (size_t j = 0; j < in; j++) {
            double p1 = chain(wide, sc, w1a, w1b, o, j, r, in), p2 = chain(wide, 1.0, w2a, w2b, o, j, r, in);
            double d = wide ? 0.0 + p1 * p2 : (double)(0.0f + (float)p1 * (float)p2);
            finish(dst, w, dt, o * in + j, d);
        }
}

static void test_loha(void **state) {
    (void)state;
    const lk_dtype dts[3] = {LK_DTYPE_BF16, LK_DTYPE_F16, LK_DTYPE_F32};
    for (int di = 0; di < 3; di++) {
        lk_dtype dt = dts[di];
        model m = {af_new(), {0}};
        RND(m.f, "lin.weight", dt, 40, 72);
        RND(m.f, "conv.weight", dt, 6, 4, 3, 3);
        snap(&m);
        af_file *a = af_new();
        lk_tensor *w1a = RND(a, "lycoris_lin.hada_w1_a", LK_DTYPE_F32, 40, 4);
        lk_tensor *w1b = RND(a, "lycoris_lin.hada_w1_b", LK_DTYPE_BF16, 4, 72);
        lk_tensor *w2a = RND(a, "lycoris_lin.hada_w2_a", LK_DTYPE_F32, 40, 4);
        lk_tensor *w2b = RND(a, "lycoris_lin.hada_w2_b", LK_DTYPE_F16, 4, 72);
        af_scalar(a, "lycoris_lin.alpha", LK_DTYPE_F32, 2.0);
        /* conv, Tucker: hada_t [r, r, kh, kw], hada_w_a [r, out], hada_w_b [r, in] */
        lk_tensor *t1 = RND(a, "lycoris_conv.hada_t1", LK_DTYPE_F32, 2, 2, 3, 3);
        lk_tensor *c1a = RND(a, "lycoris_conv.hada_w1_a", LK_DTYPE_F32, 2, 6);
        lk_tensor *c1b = RND(a, "lycoris_conv.hada_w1_b", LK_DTYPE_F32, 2, 4);
        lk_tensor *t2 = RND(a, "lycoris_conv.hada_t2", LK_DTYPE_F32, 2, 2, 3, 3);
        lk_tensor *c2a = RND(a, "lycoris_conv.hada_w2_a", LK_DTYPE_F32, 2, 6);
        lk_tensor *c2b = RND(a, "lycoris_conv.hada_w2_b", LK_DTYPE_F32, 2, 4);
        char *p = save_adapter(a, "loha.safetensors");
        printf("LoHa, %s weights\n", lk_dtype_name(dt));
        assert_int_equal(fuse1(&m, p, 0.8f), LK_OK);
        double *d = calloc(40 * 72, sizeof *d), *x = calloc(40 * 72, sizeof *x);
        mm(d, w1a, w1b, 40, 4, 72);
        mm(x, w2a, w2b, 40, 4, 72);
        for (size_t e = 0; e < 40 * 72; e++) d[e] *= x[e];
        check_ulp(&m, "lin.weight", d, (double)0.8f * 0.5);
        /* the canonical chain, bit for bit */
        size_t li = idx_of(&m, "lin.weight");
        void *want = malloc(m.f->t[li].nbytes);
        loha_replay(want, m.orig[li], dt, (double)0.8f * 0.5, w1a, w1b, w2a, w2b, 40, 72, 4);
        same_bytes(&m, "lin.weight", want);
        tucker(d, t1, c1a, c1b);
        tucker(x, t2, c2a, c2b);
        for (size_t e = 0; e < 6 * 36; e++) d[e] *= x[e];
        check_ulp(&m, "conv.weight", d, (double)0.8f); /* no alpha: scale 1 */
        /* threads do not change the bytes */
        void *one = malloc(m.f->t[li].nbytes);
        memcpy(one, m.f->t[li].data, m.f->t[li].nbytes);
        restore(&m);
        assert_int_equal(fuse(&m, (const char *const *)&p, (float[]){0.8f}, 1, 3), LK_OK);
        same_bytes(&m, "lin.weight", one);
        free(one);
        free(want);
        free(d);
        free(x);
        free(p);
        af_free(a);
        model_free(&m);
    }
}

/* ---- LoKr ---- */

static void test_lokr(void **state) {
    (void)state;
    const lk_dtype dts[3] = {LK_DTYPE_BF16, LK_DTYPE_F16, LK_DTYPE_F32};
    for (int di = 0; di < 3; di++) {
        lk_dtype dt = dts[di];
        model m = {af_new(), {0}};
        RND(m.f, "a.weight", dt, 8, 12);        /* w1 full [2, 3], w2 = w2a @ w2b [4, 4] */
        RND(m.f, "b.weight", dt, 8, 12);        /* both full: scale 1 whatever alpha says */
        RND(m.f, "c.weight", dt, 8, 4, 3, 3);   /* conv, w2 full [4, 2, 3, 3] */
        RND(m.f, "d.weight", dt, 8, 4, 3, 3);   /* conv, Tucker t2 */
        RND(m.f, "e.weight", dt, 8, 12);        /* both decomposed */
        snap(&m);
        af_file *a = af_new();
        lk_tensor *aw1 = RND(a, "lycoris_a.lokr_w1", LK_DTYPE_F32, 2, 3);
        lk_tensor *aw2a = RND(a, "lycoris_a.lokr_w2_a", LK_DTYPE_F32, 4, 2);
        lk_tensor *aw2b = RND(a, "lycoris_a.lokr_w2_b", LK_DTYPE_BF16, 2, 4);
        af_scalar(a, "lycoris_a.alpha", LK_DTYPE_F32, 1.0);
        lk_tensor *bw1 = RND(a, "lycoris_b.lokr_w1", LK_DTYPE_F32, 2, 2);
        lk_tensor *bw2 = RND(a, "lycoris_b.lokr_w2", LK_DTYPE_F32, 4, 6);
        af_scalar(a, "lycoris_b.alpha", LK_DTYPE_F32, 3.0);
        lk_tensor *cw1 = RND(a, "lycoris_c.lokr_w1", LK_DTYPE_F32, 2, 2);
        lk_tensor *cw2 = RND(a, "lycoris_c.lokr_w2", LK_DTYPE_F32, 4, 2, 3, 3);
        lk_tensor *dw1 = RND(a, "lycoris_d.lokr_w1", LK_DTYPE_F32, 2, 2);
        lk_tensor *dt2 = RND(a, "lycoris_d.lokr_t2", LK_DTYPE_F32, 3, 3, 3, 3);
        lk_tensor *dw2a = RND(a, "lycoris_d.lokr_w2_a", LK_DTYPE_F32, 3, 4);
        lk_tensor *dw2b = RND(a, "lycoris_d.lokr_w2_b", LK_DTYPE_F32, 3, 2);
        af_scalar(a, "lycoris_d.alpha", LK_DTYPE_F32, 6.0);
        lk_tensor *ew1a = RND(a, "lycoris_e.lokr_w1_a", LK_DTYPE_F32, 2, 2);
        lk_tensor *ew1b = RND(a, "lycoris_e.lokr_w1_b", LK_DTYPE_F32, 2, 3);
        lk_tensor *ew2a = RND(a, "lycoris_e.lokr_w2_a", LK_DTYPE_F32, 4, 2);
        lk_tensor *ew2b = RND(a, "lycoris_e.lokr_w2_b", LK_DTYPE_F32, 2, 4);
        af_scalar(a, "lycoris_e.alpha", LK_DTYPE_F32, 8.0);
        char *p = save_adapter(a, "lokr.safetensors");
        printf("LoKr, %s weights\n", lk_dtype_name(dt));
        const float s = 0.9f;
        assert_int_equal(fuse1(&m, p, s), LK_OK);
        double w1[64], w2[96], d[8 * 36];
        /* kron(w1 [a, b], w2 [c, D]): [(i c + k), (q D + n)] = w1[i, q] w2[k, n] */
#define KRON(A_, B_, C_, D_)                                                                                  \
    for (size_t i = 0; i < (A_); i++)                                                                          \
        for (size_t k = 0; k < (C_); k++)                                                                      \
            for (size_t q = 0; q < (B_); q++)                                                                  \
                for (size_t n = 0; n < (D_); n++) d[(i * (C_) + k) * ((B_) * (D_)) + q * (D_) + n] = w1[i * (B_) + q] * w2[k * (D_) + n];
        mm(w1, aw1, NULL, 2, 3, 3);
        mm(w2, aw2a, aw2b, 4, 2, 4);
        KRON(2, 3, 4, 4);
        check_ulp(&m, "a.weight", d, (double)s * 0.5);
        /* replay of the canonical chain for a: W1s = acc(s c W1), W2 = acc(W2), x = W1s W2, d = +0 + x */
        size_t ai = idx_of(&m, "a.weight");
        void *want = malloc(m.f->t[ai].nbytes);
        for (size_t e = 0; e < 96; e++) {
            size_t o = e / 12, j = e % 12, i = o / 4, k = o % 4, q = j / 4, n = j % 4;
            double W1 = val(aw1, i * 3 + q);
            double W2 = val(aw2a, k * 2) * val(aw2b, n);
            W2 = fma(val(aw2a, k * 2 + 1), val(aw2b, 4 + n), W2);
            double dd = dt == LK_DTYPE_F32 ? 0.0 + ((double)s * 0.5 * W1) * W2
                                            : (double)(0.0f + (float)((double)s * 0.5 * W1) * (float)W2);
            finish(want, m.orig[ai], dt, e, dd);
        }
        same_bytes(&m, "a.weight", want);
        free(want);
        mm(w1, bw1, NULL, 2, 2, 2);
        mm(w2, bw2, NULL, 4, 6, 6);
        KRON(2, 2, 4, 6);
        check_ulp(&m, "b.weight", d, (double)s); /* both full: scale 1 */
        mm(w1, cw1, NULL, 2, 2, 2);
        mm(w2, cw2, NULL, 4, 18, 18);
        KRON(2, 2, 4, 18);
        check_ulp(&m, "c.weight", d, (double)s);
        mm(w1, dw1, NULL, 2, 2, 2);
        tucker(w2, dt2, dw2a, dw2b);
        KRON(2, 2, 4, 18);
        check_ulp(&m, "d.weight", d, (double)s * 2.0); /* alpha 6 / r 3 */
        mm(w1, ew1a, ew1b, 2, 2, 3);
        mm(w2, ew2a, ew2b, 4, 2, 4);
        KRON(2, 3, 4, 4);
        check_ulp(&m, "e.weight", d, (double)s * 4.0);
#undef KRON
        free(p);
        af_free(a);
        model_free(&m);
    }
}

/* ---- dense: diff, diff_b, set_weight, norm ---- */

static void test_dense(void **state) {
    (void)state;
    const lk_dtype dts[3] = {LK_DTYPE_BF16, LK_DTYPE_F16, LK_DTYPE_F32};
    for (int di = 0; di < 3; di++) {
        lk_dtype dt = dts[di];
        model m = {af_new(), {0}};
        RND(m.f, "lin.weight", dt, 16, 24);
        RND(m.f, "lin.bias", dt, 16);
        RND(m.f, "conv.weight", dt, 6, 4, 3, 3);
        RND(m.f, "norm.weight", dt, 24);
        RND(m.f, "norm.bias", dt, 24);
        RND(m.f, "set.weight", dt, 6, 5);
        snap(&m);
        af_file *a = af_new();
        lk_tensor *diff = RND(a, "diffusion_model.lin.diff", LK_DTYPE_BF16, 16, 24);
        lk_tensor *diffb = RND(a, "diffusion_model.lin.diff_b", LK_DTYPE_F32, 16);
        lk_tensor *cdiff = RND(a, "diffusion_model.conv.diff", LK_DTYPE_F32, 6, 4, 3, 3);
        lk_tensor *wn = RND(a, "diffusion_model.norm.w_norm", LK_DTYPE_F32, 24);
        lk_tensor *bn = RND(a, "diffusion_model.norm.b_norm", LK_DTYPE_F32, 24);
        lk_tensor *sw = RND(a, "diffusion_model.set.set_weight", LK_DTYPE_F32, 6, 5);
        char *p = save_adapter(a, "dense.safetensors");
        printf("dense, %s weights\n", lk_dtype_name(dt));
        const float s = 0.6f;
        assert_int_equal(fuse1(&m, p, s), LK_OK);
        double d[16 * 24];
        for (size_t e = 0; e < 16 * 24; e++) d[e] = val(diff, e);
        check_ulp(&m, "lin.weight", d, (double)s);
        size_t li = idx_of(&m, "lin.weight");
        void *want = malloc(m.f->t[li].nbytes);
        for (size_t e = 0; e < 16 * 24; e++) /* replay: x = acc(s D), d = +0 + x */
            finish(want, m.orig[li], dt, e,
                   dt == LK_DTYPE_F32 ? 0.0 + (double)s * val(diff, e) : (double)(0.0f + (float)((double)s * val(diff, e))));
        same_bytes(&m, "lin.weight", want);
        free(want);
        for (size_t e = 0; e < 16; e++) d[e] = val(diffb, e);
        check_ulp(&m, "lin.bias", d, (double)s);
        for (size_t e = 0; e < 6 * 36; e++) d[e] = val(cdiff, e);
        check_ulp(&m, "conv.weight", d, (double)s);
        for (size_t e = 0; e < 24; e++) d[e] = val(wn, e);
        check_ulp(&m, "norm.weight", d, (double)s);
        for (size_t e = 0; e < 24; e++) d[e] = val(bn, e);
        check_ulp(&m, "norm.bias", d, (double)s);
        /* set_weight: W + s (W' - W), as a delta of W' - W */
        size_t si = idx_of(&m, "set.weight");
        lk_tensor w0 = m.f->t[si];
        w0.data = m.orig[si];
        for (size_t e = 0; e < 30; e++) d[e] = val(sw, e) - val(&w0, e);
        check_ulp(&m, "set.weight", d, (double)s);
        free(p);
        af_free(a);
        model_free(&m);
    }
    /* set_weight for a weight the model lacks: an error naming it, even with allow_unmatched */
    model m = {af_new(), {0}};
    RND(m.f, "lin.weight", LK_DTYPE_F32, 4, 4);
    snap(&m);
    af_file *a = af_new();
    RND(a, "other.set_weight", LK_DTYPE_F32, 4, 4);
    char *p = save_adapter(a, "set_missing.safetensors");
    lk_fuse_input in = {p, 1.0f, LK_FORMAT_AUTO};
    lk_fuse_file_opts o = {.allow_unmatched = 1};
    assert_int_equal(lk_fuse_tensors(m.f->t, m.f->n, &in, 1, &o, NULL), LK_ERR_UNMATCHED);
    tu_assert_contains(lk_last_error(), "'other.set_weight' replaces a weight the model does not have (no other.weight)");
    same_bytes(&m, "lin.weight", m.orig[0]);
    free(p);
    af_free(a);
    model_free(&m);
}

/* ---- DoRA (dora_scale) ---- */

/* LyCORIS weight_decompose at strength s with lorakit's W + s (W' - W):
 * V = W + c delta, W' = V m / (||V|| + eps), the norm per row (on_out) or
 * per input channel. ref[e] receives W'' - W as a delta (coef 1). */
static void dora_ref(double *ref, const lk_tensor *w0, const double *delta, double c, const lk_tensor *mag, int on_out,
                     double s, size_t out, size_t in, size_t K) {
    size_t N = in * K;
    double eps = 0x1p-52; /* torch.finfo(float64).eps: LyCORIS's weight_decompose computed in float64 */
    double *V = malloc(out * N * sizeof *V), norm[64] = {0};
    for (size_t e = 0; e < out * N; e++) V[e] = val(w0, e) + c * delta[e];
    for (size_t o = 0; o < out; o++)
        for (size_t j = 0; j < N; j++) norm[on_out ? o : j / K] += V[o * N + j] * V[o * N + j];
    for (size_t o = 0; o < out; o++)
        for (size_t j = 0; j < N; j++) {
            size_t g = on_out ? o : j / K;
            double wp = V[o * N + j] * (val(mag, g) / (sqrt(norm[g]) + eps));
            ref[o * N + j] = s * (wp - val(w0, o * N + j));
        }
    free(V);
}

static void test_dora_scale(void **state) {
    (void)state;
    const lk_dtype dts[2] = {LK_DTYPE_BF16, LK_DTYPE_F32};
    const float ss[2] = {1.0f, 0.6f};
    for (int di = 0; di < 2; di++)
        for (int si = 0; si < 2; si++) {
            lk_dtype dt = dts[di];
            model m = {af_new(), {0}};
            RND(m.f, "lo.weight", dt, 8, 6);
            RND(m.f, "li.weight", dt, 8, 6);
            RND(m.f, "kr.weight", dt, 8, 4, 3, 3);
            snap(&m);
            af_file *a = af_new();
            lk_tensor *od = RND(a, "lora_unet_lo.lora_down.weight", LK_DTYPE_F32, 2, 6);
            lk_tensor *ou = RND(a, "lora_unet_lo.lora_up.weight", LK_DTYPE_F32, 8, 2);
            lk_tensor *om = rnd(a, "lora_unet_lo.dora_scale", LK_DTYPE_F32, 1.0f, 2.0f, 2, (int64_t[]){8, 1});
            lk_tensor *id = RND(a, "lora_unet_li.lora_down.weight", LK_DTYPE_F32, 2, 6);
            lk_tensor *iu = RND(a, "lora_unet_li.lora_up.weight", LK_DTYPE_F32, 8, 2);
            lk_tensor *im = rnd(a, "lora_unet_li.dora_scale", LK_DTYPE_BF16, 1.0f, 2.0f, 2, (int64_t[]){1, 6});
            af_scalar(a, "lora_unet_li.alpha", LK_DTYPE_F32, 1.0);
            lk_tensor *kw1 = RND(a, "lora_unet_kr.lokr_w1", LK_DTYPE_F32, 2, 2);
            lk_tensor *kw2 = RND(a, "lora_unet_kr.lokr_w2", LK_DTYPE_F32, 4, 2, 3, 3);
            lk_tensor *km = rnd(a, "lora_unet_kr.dora_scale", LK_DTYPE_F32, 1.0f, 2.0f, 4, (int64_t[]){1, 4, 1, 1});
            char *p = save_adapter(a, "dora.safetensors");
            printf("DoRA (dora_scale), %s weights, strength %g\n", lk_dtype_name(dt), (double)ss[si]);
            assert_int_equal(fuse1(&m, p, ss[si]), LK_OK);
            double d[8 * 36], r[8 * 36];
            lk_tensor w0 = m.f->t[idx_of(&m, "lo.weight")];
            w0.data = m.orig[idx_of(&m, "lo.weight")];
            mm(d, ou, od, 8, 2, 6);
            dora_ref(r, &w0, d, 1.0, om, 1, ss[si], 8, 6, 1);
            check_ulp(&m, "lo.weight", r, 1.0);
            w0 = m.f->t[idx_of(&m, "li.weight")];
            w0.data = m.orig[idx_of(&m, "li.weight")];
            mm(d, iu, id, 8, 2, 6);
            dora_ref(r, &w0, d, 0.5, im, 0, ss[si], 8, 6, 1);
            check_ulp(&m, "li.weight", r, 1.0);
            w0 = m.f->t[idx_of(&m, "kr.weight")];
            w0.data = m.orig[idx_of(&m, "kr.weight")];
            double w1[4], w2[72];
            mm(w1, kw1, NULL, 2, 2, 2);
            mm(w2, kw2, NULL, 4, 18, 18);
            for (size_t i = 0; i < 2; i++)
                for (size_t k = 0; k < 4; k++)
                    for (size_t q = 0; q < 2; q++)
                        for (size_t n = 0; n < 18; n++) d[(i * 4 + k) * 36 + q * 18 + n] = w1[i * 2 + q] * w2[k * 18 + n];
            dora_ref(r, &w0, d, 1.0, km, 0, ss[si], 8, 4, 9);
            check_ulp(&m, "kr.weight", r, 1.0);
            free(p);
            af_free(a);
            model_free(&m);
        }
}

/* ---- mixed files, two adapters on one weight ---- */

static void test_mixed(void **state) {
    (void)state;
    model m = {af_new(), {0}};
    RND(m.f, "l1.weight", LK_DTYPE_BF16, 8, 6);
    RND(m.f, "l2.weight", LK_DTYPE_BF16, 8, 6);
    RND(m.f, "l3.weight", LK_DTYPE_BF16, 8, 6);
    snap(&m);
    af_file *a = af_new(), *b = af_new();
    lk_tensor *d1 = RND(a, "lora_unet_l1.lora_down.weight", LK_DTYPE_F32, 2, 6);
    lk_tensor *u1 = RND(a, "lora_unet_l1.lora_up.weight", LK_DTYPE_F32, 8, 2);
    lk_tensor *w1 = RND(a, "lora_unet_l2.lokr_w1", LK_DTYPE_F32, 2, 2);
    lk_tensor *w2 = RND(a, "lora_unet_l2.lokr_w2", LK_DTYPE_F32, 4, 3);
    RND(a, "lora_unet_l3.hada_w1_a", LK_DTYPE_F32, 8, 2);
    RND(a, "lora_unet_l3.hada_w1_b", LK_DTYPE_F32, 2, 6);
    RND(a, "lora_unet_l3.hada_w2_a", LK_DTYPE_F32, 8, 2);
    RND(a, "lora_unet_l3.hada_w2_b", LK_DTYPE_F32, 2, 6);
    rnd(a, "lora_unet_l3.dora_scale", LK_DTYPE_F32, 1.0f, 2.0f, 2, (int64_t[]){8, 1});
    lk_tensor *h1a = RND(b, "l1.hada_w1_a", LK_DTYPE_F32, 8, 3);
    lk_tensor *h1b = RND(b, "l1.hada_w1_b", LK_DTYPE_F32, 3, 6);
    lk_tensor *h2a = RND(b, "l1.hada_w2_a", LK_DTYPE_F32, 8, 3);
    lk_tensor *h2b = RND(b, "l1.hada_w2_b", LK_DTYPE_F32, 3, 6);
    char *pa = save_adapter(a, "mixed.safetensors"), *pb = save_adapter(b, "loha_l1.safetensors");
    printf("mixed file + a second adapter on l1\n");
    const char *paths[2] = {pb, pa};
    const float s[2] = {0.5f, 1.0f};
    assert_int_equal(fuse(&m, paths, s, 2, 1), LK_OK);
    double d[48], x[48], w1d[4], w2d[12];
    mm(d, u1, d1, 8, 2, 6);
    mm(x, h1a, h1b, 8, 3, 6);
    double y[48];
    mm(y, h2a, h2b, 8, 3, 6);
    for (size_t e = 0; e < 48; e++) d[e] += 0.5 * x[e] * y[e];
    check_ulp(&m, "l1.weight", d, 1.0);
    mm(w1d, w1, NULL, 2, 2, 2);
    mm(w2d, w2, NULL, 4, 3, 3);
    for (size_t i = 0; i < 2; i++)
        for (size_t k = 0; k < 4; k++)
            for (size_t q = 0; q < 2; q++)
                for (size_t n = 0; n < 3; n++) d[(i * 4 + k) * 6 + q * 3 + n] = w1d[i * 2 + q] * w2d[k * 3 + n];
    check_ulp(&m, "l2.weight", d, 1.0);
    /* the same set in the other order: the same bytes (canonical order) */
    void *l1 = malloc(m.f->t[0].nbytes);
    memcpy(l1, m.f->t[0].data, m.f->t[0].nbytes);
    restore(&m);
    const char *rev[2] = {pa, pb};
    const float srev[2] = {1.0f, 0.5f};
    assert_int_equal(fuse(&m, rev, srev, 2, 2), LK_OK);
    same_bytes(&m, "l1.weight", l1);
    free(l1);
    /* DoRA stays exclusive: a second adapter on the DoRA weight is refused, naming both */
    restore(&m);
    af_file *c = af_new();
    RND(c, "l3.diff", LK_DTYPE_F32, 8, 6);
    char *pc = save_adapter(c, "diff_l3.safetensors");
    const char *two[2] = {pa, pc};
    assert_int_equal(fuse(&m, two, s, 2, 1), LK_ERR_ARG);
    tu_assert_contains(lk_last_error(), "mixed.safetensors: a DoRA adapter must be the only adapter in its request");
    tu_assert_contains(lk_last_error(), "diff_l3.safetensors also changes l3.weight");
    for (size_t i = 0; i < m.f->n; i++) same_bytes(&m, m.f->t[i].name, m.orig[i]);
    free(pa);
    free(pb);
    free(pc);
    af_free(a);
    af_free(b);
    af_free(c);
    model_free(&m);
}

/* ---- refusals ---- */

typedef struct bad_case {
    const char *file, *want;
    lk_status s;
} bad_case;

static void expect_refused(model *m, af_file *a, const char *file, lk_status s, const char *want) {
    char *p = save_adapter(a, file);
    assert_int_equal(fuse1(m, p, 1.0f), s);
    tu_assert_contains(lk_last_error(), want);
    for (size_t i = 0; i < m->f->n; i++) same_bytes(m, m->f->t[i].name, m->orig[i]);
    free(p);
    af_free(a);
}

static void test_malformed(void **state) {
    (void)state;
    model m = {af_new(), {0}};
    RND(m.f, "lin.weight", LK_DTYPE_BF16, 8, 6);
    RND(m.f, "conv.weight", LK_DTYPE_BF16, 8, 4, 3, 3);
    snap(&m);
    af_file *a = af_new(); /* LoHa halves that do not multiply out alike */
    RND(a, "lycoris_lin.hada_w1_a", LK_DTYPE_F32, 8, 2);
    RND(a, "lycoris_lin.hada_w1_b", LK_DTYPE_F32, 2, 6);
    RND(a, "lycoris_lin.hada_w2_a", LK_DTYPE_F32, 8, 2);
    RND(a, "lycoris_lin.hada_w2_b", LK_DTYPE_F32, 3, 6);
    expect_refused(&m, a, "m1.safetensors", LK_ERR_SHAPE,
                   "lycoris_lin: ranks differ: 'lycoris_lin.hada_w2_a' is [8, 2] and 'lycoris_lin.hada_w2_b' is [3, 6]");
    a = af_new(); /* a LoHa that does not land on the weight */
    RND(a, "lycoris_lin.hada_w1_a", LK_DTYPE_F32, 8, 2);
    RND(a, "lycoris_lin.hada_w1_b", LK_DTYPE_F32, 2, 5);
    RND(a, "lycoris_lin.hada_w2_a", LK_DTYPE_F32, 8, 2);
    RND(a, "lycoris_lin.hada_w2_b", LK_DTYPE_F32, 2, 5);
    expect_refused(&m, a, "m2.safetensors", LK_ERR_SHAPE,
                   "'lycoris_lin.hada_w1_b' is [2, 5], a delta of [8, 5], but the model weight lin.weight is [8, 6]");
    a = af_new(); /* Tucker core of the wrong rank */
    RND(a, "lycoris_conv.hada_t1", LK_DTYPE_F32, 3, 2, 3, 3);
    RND(a, "lycoris_conv.hada_w1_a", LK_DTYPE_F32, 2, 8);
    RND(a, "lycoris_conv.hada_w1_b", LK_DTYPE_F32, 2, 4);
    RND(a, "lycoris_conv.hada_t2", LK_DTYPE_F32, 2, 2, 3, 3);
    RND(a, "lycoris_conv.hada_w2_a", LK_DTYPE_F32, 2, 8);
    RND(a, "lycoris_conv.hada_w2_b", LK_DTYPE_F32, 2, 4);
    expect_refused(&m, a, "m3.safetensors", LK_ERR_SHAPE,
                   "Tucker core 'lycoris_conv.hada_t1' is [3, 2, 3, 3] but 'lycoris_conv.hada_w1_a' is [2, 8]");
    a = af_new(); /* LoCon Tucker core of the wrong rank */
    RND(a, "lora_unet_conv.lora_down.weight", LK_DTYPE_F32, 2, 4, 1, 1);
    RND(a, "lora_unet_conv.lora_mid.weight", LK_DTYPE_F32, 2, 3, 3, 3);
    RND(a, "lora_unet_conv.lora_up.weight", LK_DTYPE_F32, 8, 2, 1, 1);
    expect_refused(&m, a, "m4.safetensors", LK_ERR_SHAPE, "Tucker core lora_mid is [2, 3, 3, 3] but lora_up is "
                   "[8, 2, 1, 1] and lora_down is [2, 4, 1, 1]");
    a = af_new(); /* a Kronecker product of the wrong shape */
    RND(a, "lycoris_lin.lokr_w1", LK_DTYPE_F32, 2, 2);
    RND(a, "lycoris_lin.lokr_w2", LK_DTYPE_F32, 4, 4);
    expect_refused(&m, a, "m5.safetensors", LK_ERR_SHAPE,
                   "kron('lycoris_lin.lokr_w1' [2, 2], 'lycoris_lin.lokr_w2' [4, 4]) is [8, 8] (a = 2 rows of w1) but "
                   "the model weight lin.weight is [8, 6]");
    a = af_new(); /* conv factors that do not match the conv weight */
    RND(a, "lora_unet_conv.lora_down.weight", LK_DTYPE_F32, 2, 4, 1, 3);
    RND(a, "lora_unet_conv.lora_up.weight", LK_DTYPE_F32, 8, 2, 1, 1);
    expect_refused(&m, a, "m6.safetensors", LK_ERR_SHAPE,
                   "'lora_unet_conv.lora_down.weight' is [2, 4, 1, 3], a delta of [8, 4, 1, 3], but the model weight "
                   "conv.weight is [8, 4, 3, 3]");
    a = af_new(); /* dora_scale of neither shape */
    RND(a, "lora_unet_lin.lora_down.weight", LK_DTYPE_F32, 2, 6);
    RND(a, "lora_unet_lin.lora_up.weight", LK_DTYPE_F32, 8, 2);
    RND(a, "lora_unet_lin.dora_scale", LK_DTYPE_F32, 1, 7);
    expect_refused(&m, a, "m7.safetensors", LK_ERR_SHAPE, "'lora_unet_lin.dora_scale' is [1, 7]; for the model "
                   "weight lin.weight [8, 6] DoRA needs [8, 1, ...] (per output row) or [1, 6, ...]");
    /* an empty dimension in a LyCORIS factor (each divided by zero, SIGFPE, before the check) */
    a = af_new(); /* LoKr: a full lokr_w2 with no rows */
    RND(a, "lycoris_lin.lokr_w1", LK_DTYPE_F32, 2, 2);
    RND(a, "lycoris_lin.lokr_w2", LK_DTYPE_F32, 0, 3);
    expect_refused(&m, a, "z1.safetensors", LK_ERR_SHAPE,
                   "lycoris_lin: lycoris_lin.lokr_w2 is [0, 3]: every dimension must be > 0");
    a = af_new(); /* LoHa: a rank-0 half */
    RND(a, "lycoris_lin.hada_w1_a", LK_DTYPE_F32, 8, 0);
    RND(a, "lycoris_lin.hada_w1_b", LK_DTYPE_F32, 0, 6);
    RND(a, "lycoris_lin.hada_w2_a", LK_DTYPE_F32, 8, 2);
    RND(a, "lycoris_lin.hada_w2_b", LK_DTYPE_F32, 2, 6);
    expect_refused(&m, a, "z2.safetensors", LK_ERR_SHAPE,
                   "lycoris_lin.hada_w1_a is [8, 0]: every dimension must be > 0");
    a = af_new(); /* LoHa Tucker: an empty core and up factor */
    RND(a, "lycoris_conv.hada_t1", LK_DTYPE_F32, 0, 2, 3, 3);
    RND(a, "lycoris_conv.hada_w1_a", LK_DTYPE_F32, 0, 8);
    RND(a, "lycoris_conv.hada_w1_b", LK_DTYPE_F32, 2, 4);
    RND(a, "lycoris_conv.hada_t2", LK_DTYPE_F32, 2, 2, 3, 3);
    RND(a, "lycoris_conv.hada_w2_a", LK_DTYPE_F32, 2, 8);
    RND(a, "lycoris_conv.hada_w2_b", LK_DTYPE_F32, 2, 4);
    expect_refused(&m, a, "z3.safetensors", LK_ERR_SHAPE,
                   "lycoris_conv.hada_w1_a is [0, 8]: every dimension must be > 0");
    a = af_new(); /* LoCon Tucker: an empty lora_mid between an empty up rank */
    RND(a, "lora_unet_conv.lora_down.weight", LK_DTYPE_F32, 2, 4, 1, 1);
    RND(a, "lora_unet_conv.lora_mid.weight", LK_DTYPE_F32, 0, 2, 3, 3);
    RND(a, "lora_unet_conv.lora_up.weight", LK_DTYPE_F32, 8, 0, 1, 1);
    expect_refused(&m, a, "z4.safetensors", LK_ERR_SHAPE,
                   "lora_unet_conv: lora_mid is [0, 2, 3, 3]: every dimension must be > 0");
    a = af_new(); /* two algorithms in one module */
    RND(a, "lycoris_lin.lokr_w1", LK_DTYPE_F32, 2, 2);
    RND(a, "lycoris_lin.hada_w1_a", LK_DTYPE_F32, 8, 2);
    expect_refused(&m, a, "m8.safetensors", LK_ERR_FORMAT,
                   "'lycoris_lin.hada_w1_a' (loha) and 'lycoris_lin.lokr_w1' (lokr) in one module");
    /* still refused, each by its algorithm */
    static const struct {
        const char *key, *what;
    } algo[] = {
        {"lycoris_lin.bm.weight", "a GLoRA Tucker core (LyCORIS glora with use_tucker)"},
        {"lycoris_lin.on_input", "an IA3 vector (LyCORIS ia3)"},
        {"lycoris_lin.q_layer.weight", "a T-LoRA factor (LyCORIS tlora)"},
        {"lycoris_lin.lambda_layer", "a T-LoRA vector (LyCORIS tlora)"},
        {"lycoris_lin.what_is_this", "belongs to no adapter algorithm lorakit knows"},
    };
    for (size_t i = 0; i < sizeof algo / sizeof algo[0]; i++) {
        a = af_new();
        RND(a, "lycoris_lin.lokr_w1", LK_DTYPE_F32, 2, 2);
        RND(a, "lycoris_lin.lokr_w2", LK_DTYPE_F32, 4, 3);
        RND(a, algo[i].key, LK_DTYPE_F32, 2, 2);
        char want[256];
        snprintf(want, sizeof want, "key '%s' %s%s", algo[i].key, i < 4 ? "is " : "", algo[i].what);
        expect_refused(&m, a, "refused.safetensors", i < 4 ? LK_ERR_UNSUPPORTED : LK_ERR_FORMAT, want);
    }
    model_free(&m);
}

/* ---- FP8 weights: LoKr and conv LoRA ---- */

/* One e4m3 unit in the last place at |v|. */
static double ulp_e4m3(double v) {
    int e = v != 0 ? (int)floor(log2(fabs(v))) : -6;
    if (e < -6) e = -6;
    return ldexp(1.0, e - 3);
}

static void test_fp8(void **state) {
    (void)state;
    model m = {af_new(), {0}};
    lk_tensor *kw = RND(m.f, "k.weight", LK_DTYPE_F32, 8, 12);
    lk_tensor *cw = RND(m.f, "c.weight", LK_DTYPE_F32, 8, 4, 3, 3);
    for (int i = 0; i < 2; i++) { /* re-encode as F8_E4M3 codes of the same values, rounded */
        lk_tensor *t = i ? cw : kw;
        size_t n = lk_tensor_numel(t);
        uint8_t *codes = malloc(n);
        lk_from_f32(codes, t->data, LK_DTYPE_F8_E4M3, n);
        memcpy(t->data, codes, n);
        free(codes);
        t->dtype = LK_DTYPE_F8_E4M3;
        t->nbytes = n;
    }
    snap(&m);
    af_file *a = af_new();
    lk_tensor *w1 = RND(a, "lycoris_k.lokr_w1", LK_DTYPE_F32, 2, 3);
    lk_tensor *w2a = RND(a, "lycoris_k.lokr_w2_a", LK_DTYPE_F32, 4, 2);
    lk_tensor *w2b = RND(a, "lycoris_k.lokr_w2_b", LK_DTYPE_F32, 2, 4);
    af_scalar(a, "lycoris_k.alpha", LK_DTYPE_F32, 2.0);
    lk_tensor *cd = RND(a, "lycoris_c.lora_down.weight", LK_DTYPE_F32, 2, 4, 3, 3);
    lk_tensor *cu = RND(a, "lycoris_c.lora_up.weight", LK_DTYPE_F32, 8, 2, 1, 1);
    char *p = save_adapter(a, "fp8.safetensors");
    assert_int_equal(fuse1(&m, p, 1.0f), LK_OK);
    double wd1[6], wd2[16], d[8 * 36];
    mm(wd1, w1, NULL, 2, 3, 3);
    mm(wd2, w2a, w2b, 4, 2, 4);
    for (size_t i = 0; i < 2; i++)
        for (size_t k = 0; k < 4; k++)
            for (size_t q = 0; q < 3; q++)
                for (size_t n = 0; n < 4; n++) d[(i * 4 + k) * 12 + q * 4 + n] = wd1[i * 3 + q] * wd2[k * 4 + n];
    double worst = 0;
    for (int c = 0; c < 2; c++) {
        size_t ti = c ? idx_of(&m, "c.weight") : idx_of(&m, "k.weight");
        if (c) mm(d, cu, cd, 8, 2, 36);
        const lk_tensor *t = &m.f->t[ti];
        size_t n = lk_tensor_numel(t);
        for (size_t e = 0; e < n; e++) {
            float w, got;
            lk_to_f32(&w, (const uint8_t *)m.orig[ti] + e, LK_DTYPE_F8_E4M3, 1);
            lk_to_f32(&got, (const uint8_t *)t->data + e, LK_DTYPE_F8_E4M3, 1);
            double ref = (double)w + d[e], u = fabs((double)got - ref) / ulp_e4m3(ref);
            if (u > worst) worst = u;
            if (u > 1.0) fail_msg("FP8 %s element %zu: got %g, reference %g", t->name, e, (double)got, ref);
        }
    }
    printf("FP8 e4m3: LoKr and conv LoRA, worst %.3f ulp\n", worst);
    free(p);
    af_free(a);
    model_free(&m);
}

/* ---- the row driver's vector epilogue on edge lanes ---- */

/* A dense term through lk_fuse_tensor (terms.c's row driver) on weights and
 * deltas full of special values: NaN weights, infinities, overflow, -0,
 * subnormals, exact ties; every byte equals the scalar definition (finish). */
static void test_epilogue_edges(void **state) {
    (void)state;
    const lk_dtype dts[3] = {LK_DTYPE_BF16, LK_DTYPE_F16, LK_DTYPE_F32};
    const float wsp[] = {NAN, -NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 1e-40f, -3e-39f, 3.0e38f, -3.0e38f, 65504.0f,
                         1.0f, 1.0f + 0x1p-8f, 1.0f + 0x1p-9f, 2.5f, -7.75f};
    const float dsp[] = {1.0f, 0.0f, -INFINITY, INFINITY, -0.0f, 0.0f, 1e-40f, 2e-45f, 3.0e38f, 1e30f, 32.0f,
                         0x1p-9f, 0x1p-9f, 0x1p-10f, -1e-8f, 1e-3f};
    const size_t out = 7, in = 37; /* rows of 37: four 8-lane blocks and a tail */
    for (int di = 0; di < 3; di++) {
        lk_dtype dt = dts[di];
        ar_tensor W, Dl;
        ar_tensor_rand(&W, "w", dt, (int64_t)out, (int64_t)in, &g_rng, -2, 2);
        ar_tensor_rand(&Dl, "d", LK_DTYPE_F32, (int64_t)out, (int64_t)in, &g_rng, -1, 1);
        for (size_t e = 0; e < out * in; e++) {
            if (e % 3 == 0) {
                float v = wsp[(e / 3) % 16];
                lk_from_f32((char *)W.t.data + e * lk_dtype_size(dt), &v, dt, 1);
            }
            if (e % 5 == 0) ((float *)Dl.t.data)[e] = dsp[(e / 5) % 16];
        }
        /* row 6: w = 1 and deltas at and next to the dtype's half ulp: exact
         * ties (to even) and inexact ones (the odd step decides) */
        const double hu = dt == LK_DTYPE_BF16 ? 0x1p-8 : dt == LK_DTYPE_F16 ? 0x1p-11 : 0x1p-24;
        const double lo = dt == LK_DTYPE_F32 ? 0x1p-40 : 0x1p-30; /* representable next to hu in f32 */
        const double tv[8] = {hu, -hu / 2, hu + lo, hu - lo, -(hu + lo), 3 * hu, 3 * hu + lo, 3 * hu - lo};
        for (size_t c = 0; c < 16; c++) {
            float one = 1.0f;
            lk_from_f32((char *)W.t.data + (6 * in + c) * lk_dtype_size(dt), &one, dt, 1);
            ((float *)Dl.t.data)[6 * in + c] = (float)tv[c % 8];
        }
        void *res = malloc(W.t.nbytes), *want = malloc(W.t.nbytes);
        lk_fuse_term t = {.B = &Dl.t, .scale = 1.0, .kind = LK_TERM_DENSE};
        lk_fuse_opts o = {.threads = 1, .allow_nonfinite = 1};
        assert_int_equal(lk_fuse_tensor(res, W.t.data, dt, (int64_t)out, (int64_t)in, &t, 1, &o, "edges"), LK_OK);
        for (size_t e = 0; e < out * in; e++) {
            double x = dt == LK_DTYPE_F32 ? 0.0 + (double)((float *)Dl.t.data)[e]
                                          : (double)(0.0f + (float)(double)((float *)Dl.t.data)[e]);
            finish(want, W.t.data, dt, e, x);
        }
        assert_memory_equal(res, want, W.t.nbytes);
        /* without allow_nonfinite the overflow is an error naming the tensor */
        o.allow_nonfinite = 0;
        assert_int_equal(lk_fuse_tensor(res, W.t.data, dt, (int64_t)out, (int64_t)in, &t, 1, &o, "edges"),
                         LK_ERR_NONFINITE);
        tu_assert_contains(lk_last_error(), "edges: fusion made element [");
        free(res);
        free(want);
        ar_tensor_free(&W);
        ar_tensor_free(&Dl);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_conv_lora), cmocka_unit_test(test_loha),   cmocka_unit_test(test_lokr),
        cmocka_unit_test(test_dense),     cmocka_unit_test(test_dora_scale), cmocka_unit_test(test_mixed),
        cmocka_unit_test(test_malformed), cmocka_unit_test(test_fp8), cmocka_unit_test(test_epilogue_edges),
    };
    return cmocka_run_group_tests(tests, ar_setup_dir, ar_teardown_dir);
}
