/* test_convention.c — `--convention lorakit|comfyui|lycoris|peft` (issue 29):
 * every point where the tools disagree on what a file means, fused under each
 * convention, on F32, F16 and BF16 weights at strengths 1, 0.7 and -0.3.
 *
 * Oracle: for every point a float64 expectation written here from the tool's
 * own rule, computed from the stored values alone (no lorakit code):
 *  - DoRA (LoRA and LoHa with dora_scale on the output axis [out, 1], LoRA
 *    with dora_scale per input channel [1, in], a PEFT lora_magnitude_vector):
 *      lorakit  V = W + c D, f = m / (||V|| + 2^-52) (PEFT magnitude: eps 0),
 *               W + s (f V - W)
 *      comfyui  comfy/weight_adapter/base.py weight_decompose: on the output
 *               axis the norm of the ORIGINAL W's rows, else of V per input
 *               channel, + finfo(float32).eps = 2^-23; W + s (f V - W);
 *               a PEFT magnitude is not read (plain LoRA: W + s c D)
 *      lycoris  lycoris/functional/general.py _weight_decompose: the norm of V,
 *               + finfo(float32).eps; V (s (f - 1) + 1)  (PEFT magnitude:
 *               LyCORIS does not read it, lorakit's rule)
 *      peft     peft/tuners/lora/dora.py: V = W + s c D (the strength is its
 *               scaling multiplier), f = m / ||V||, f V
 *    The lycoris and peft formulas are checked against lycoris-lora 4.1.3's
 *    _weight_decompose and peft 0.21's DoRA merge, in float64, by
 *    tests/fixtures/conventions/check_dora_formulas.py (torch: not in CI).
 *  - set_weight R: ComfyUI's "set" patch copies R at any strength; the others
 *    W + s (R - W) (LyCORIS and PEFT have no set_weight: lorakit's rule).
 *  - .alpha = 0: LoHa and LoKr (comfy/weight_adapter/loha.py, lokr.py:
 *    alpha / rank; PEFT alpha / r) scale 0 under comfyui and peft, alpha = r
 *    under lorakit and lycoris (lycoris/modules/loha.py, lokr.py: "alpha = 0
 *    or None: rank"); LoRA: LyCORIS's LoCon reads 0 as r, the others scale 0.
 *  - alpha only in lora_adapter_metadata: ComfyUI and LyCORIS read only .alpha
 *    tensors (scale 1), lorakit and PEFT (diffusers' loader) read it.
 * A point whose scale is 0 leaves its tensor byte-identical; every tensor no
 * adapter touches is byte-identical under every convention. Every fused
 * element must be within 1 ulp of its dtype of the expectation. */
#include "adapter_ref.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lorakit/fuse.h"

#define g_dir ar_dir
static tu_rng g_rng = {2929};

enum { O = 8, I = 6, R = 2 };

static double val(const lk_tensor *t, size_t i) { return ar_get(t, i); }

/* dst (m x n) = B (m x r) @ A (r x n) from stored values, in double. */
static void mm(double *dst, const lk_tensor *B, const lk_tensor *A, size_t m, size_t r, size_t n) {
    for (size_t i = 0; i < m; i++)
        for (size_t j = 0; j < n; j++) {
            double s = 0;
            for (size_t k = 0; k < r; k++) s += val(B, i * r + k) * val(A, k * n + j);
            dst[i * n + j] = s;
        }
}

static lk_tensor *rnd(af_file *f, const char *name, lk_dtype dt, int64_t rows, int64_t cols, float lo, float hi) {
    return af_rand(f, name, dt, rows, cols, &g_rng, lo, hi);
}

/* The adapters and their deltas (D with scale 1, out x in, double). */
typedef struct fixture {
    af_file *ly, *pm, *md;       /* the LyCORIS-named file, a PEFT DoRA file, a metadata-alpha file */
    char *p_ly, *p_pm, *p_md;
    double D_out[O * I], D_in[O * I], D_hout[O * I], D_pm[O * I], D_md[O * I];
    double D_lh[O * I], D_lk[O * I], D_lr[O * I];
    const lk_tensor *m_out, *m_in, *m_hout, *m_pm, *set;
} fixture;

static void make_lora(af_file *f, const char *stem, const char *down, const char *up, double *D) {
    char a[96], b[96];
    snprintf(a, sizeof a, "%s%s", stem, down);
    snprintf(b, sizeof b, "%s%s", stem, up);
    const lk_tensor *A = rnd(f, a, LK_DTYPE_F32, R, I, -0.5f, 0.5f), *B = rnd(f, b, LK_DTYPE_BF16, O, R, -0.5f, 0.5f);
    mm(D, B, A, O, R, I);
}

/* LoHa factors stem.hada_w{1,2}_{a,b} (rank R); D = (w1a w1b) * (w2a w2b), elementwise. */
static void make_loha(af_file *f, const char *stem, double *D) {
    char n[4][96];
    static const char *const sfx[4] = {".hada_w1_a", ".hada_w1_b", ".hada_w2_a", ".hada_w2_b"};
    const lk_tensor *w[4];
    for (int k = 0; k < 4; k++) {
        snprintf(n[k], sizeof n[k], "%s%s", stem, sfx[k]);
        w[k] = rnd(f, n[k], LK_DTYPE_F32, k % 2 ? R : O, k % 2 ? I : R, -0.5f, 0.5f);
    }
    double x2[O * I];
    mm(D, w[0], w[1], O, R, I);
    mm(x2, w[2], w[3], O, R, I);
    for (size_t e = 0; e < O * I; e++) D[e] *= x2[e];
}

static void fixture_make(fixture *x) {
    memset(x, 0, sizeof *x);
    af_file *f = x->ly = af_new();
    /* LoRA + DoRA on the output axis (alpha 1, r 2: c = 0.5), and per input channel */
    make_lora(f, "lycoris_dout", ".lora_down.weight", ".lora_up.weight", x->D_out);
    af_scalar(f, "lycoris_dout.alpha", LK_DTYPE_F32, 1.0);
    x->m_out = rnd(f, "lycoris_dout.dora_scale", LK_DTYPE_F32, O, 1, 0.5f, 1.5f);
    make_lora(f, "lycoris_din", ".lora_down.weight", ".lora_up.weight", x->D_in);
    af_scalar(f, "lycoris_din.alpha", LK_DTYPE_F32, 1.0);
    x->m_in = rnd(f, "lycoris_din.dora_scale", LK_DTYPE_F32, 1, I, 0.5f, 1.5f);
    /* LoHa + DoRA on the output axis (alpha 4, r 2: c = 2) */
    make_loha(f, "lycoris_dloha", x->D_hout);
    af_scalar(f, "lycoris_dloha.alpha", LK_DTYPE_F32, 4.0);
    x->m_hout = rnd(f, "lycoris_dloha.dora_scale", LK_DTYPE_F32, O, 1, 0.5f, 1.5f);
    /* set_weight */
    x->set = rnd(f, "lycoris_sw.set_weight", LK_DTYPE_F32, O, I, -1.0f, 1.0f);
    /* LoHa with .alpha 0 */
    make_loha(f, "lycoris_lh", x->D_lh);
    af_scalar(f, "lycoris_lh.alpha", LK_DTYPE_F32, 0.0);
    /* LoKr with .alpha 0: w1 full 2 x 2, w2 = w2_a (4 x r) w2_b (r x 3); delta = kron(w1, w2) */
    {
        const lk_tensor *w1 = rnd(f, "lycoris_lk.lokr_w1", LK_DTYPE_F32, 2, 2, -1.0f, 1.0f);
        const lk_tensor *w2a = rnd(f, "lycoris_lk.lokr_w2_a", LK_DTYPE_F32, 4, R, -0.5f, 0.5f);
        const lk_tensor *w2b = rnd(f, "lycoris_lk.lokr_w2_b", LK_DTYPE_F32, R, 3, -0.5f, 0.5f);
        double w2[4 * 3];
        mm(w2, w2a, w2b, 4, R, 3);
        for (size_t a = 0; a < 2; a++)
            for (size_t b = 0; b < 2; b++)
                for (size_t c = 0; c < 4; c++)
                    for (size_t d = 0; d < 3; d++) x->D_lk[(a * 4 + c) * I + b * 3 + d] = val(w1, a * 2 + b) * w2[c * 3 + d];
        af_scalar(f, "lycoris_lk.alpha", LK_DTYPE_F32, 0.0);
    }
    /* LoRA with .alpha 0 */
    make_lora(f, "lycoris_lr", ".lora_down.weight", ".lora_up.weight", x->D_lr);
    af_scalar(f, "lycoris_lr.alpha", LK_DTYPE_F32, 0.0);
    x->p_ly = tu_path(g_dir, "conv_lycoris.safetensors");
    af_save(f, x->p_ly, NULL, 0);
    /* PEFT DoRA (diffusers names, alpha 1, r 2: c = 0.5) */
    f = x->pm = af_new();
    make_lora(f, "pm", ".lora_A.weight", ".lora_B.weight", x->D_pm);
    af_scalar(f, "pm.alpha", LK_DTYPE_F32, 1.0);
    lk_tensor *mg = rnd(f, "pm.lora_magnitude_vector.weight", LK_DTYPE_F32, O, 1, 0.5f, 1.5f);
    mg->ndim = 1; /* [out], as PEFT saves it */
    mg->shape[1] = 0;
    x->m_pm = mg;
    x->p_pm = tu_path(g_dir, "conv_peft_dora.safetensors");
    af_save(f, x->p_pm, NULL, 0);
    /* alpha only in lora_adapter_metadata: r 2, lora_alpha 6 (scale 3) */
    f = x->md = af_new();
    make_lora(f, "md", ".lora_A.weight", ".lora_B.weight", x->D_md);
    const char *meta[] = {"lora_adapter_metadata", "{\"r\": 2, \"lora_alpha\": 6}"};
    x->p_md = tu_path(g_dir, "conv_meta.safetensors");
    af_save(f, x->p_md, meta, 1);
}

static void fixture_free(fixture *x) {
    af_free(x->ly);
    af_free(x->pm);
    af_free(x->md);
    free(x->p_ly);
    free(x->p_pm);
    free(x->p_md);
}

/* DoRA's expectation under convention cv (see the top of the file): W the
 * base (out x in), D the delta at scale 1, c the module scale, m the
 * magnitude (per row when on_out, else per column), peft_mag: a PEFT
 * lora_magnitude_vector. */
static void dora_ref(double *ref, const double *W, const double *D, double c, const lk_tensor *m, int on_out,
                     int peft_mag, lk_convention cv, double s) {
    double V[O * I], n[O > I ? O : I];
    if (cv == LK_CONVENTION_COMFYUI && peft_mag) { /* not read: the plain LoRA */
        for (size_t e = 0; e < O * I; e++) ref[e] = W[e] + s * c * D[e];
        return;
    }
    if (cv == LK_CONVENTION_LYCORIS && peft_mag) cv = LK_CONVENTION_LORAKIT;
    const double cs = cv == LK_CONVENTION_PEFT ? s * c : c;
    for (size_t e = 0; e < O * I; e++) V[e] = W[e] + cs * D[e];
    const double eps = cv == LK_CONVENTION_PEFT ? 0.0
                       : cv == LK_CONVENTION_LORAKIT ? (peft_mag ? 0.0 : 0x1p-52)
                                                    : 0x1p-23;
    const double *X = cv == LK_CONVENTION_COMFYUI && on_out ? W : V;
    for (size_t k = 0; k < (on_out ? (size_t)O : (size_t)I); k++) {
        double ss = 0;
        for (size_t l = 0; l < (on_out ? (size_t)I : (size_t)O); l++) {
            double v = on_out ? X[k * I + l] : X[l * I + k];
            ss += v * v;
        }
        n[k] = sqrt(ss);
    }
    for (size_t o = 0; o < O; o++)
        for (size_t j = 0; j < I; j++) {
            size_t e = o * I + j, k = on_out ? o : j;
            double f = val(m, k) / (n[k] + eps);
            if (cv == LK_CONVENTION_PEFT) ref[e] = f * V[e];
            else if (cv == LK_CONVENTION_LYCORIS) ref[e] = V[e] * (s * (f - 1.0) + 1.0);
            else ref[e] = W[e] + s * (f * V[e] - W[e]);
        }
}

/* Every element of t within 1 ulp of ref; returns the worst distance. */
static double check(const lk_tensor *t, const double *ref, const char *what, lk_convention cv, double s) {
    double worst = 0;
    for (size_t e = 0; e < lk_tensor_numel(t); e++) {
        double got = val(t, e), u = fabs(got - ref[e]) / ar_ulp(t->dtype, ref[e]);
        if (u > worst) worst = u;
        if (!(u <= 1.0))
            fail_msg("%s (%s, %s, s %g) element %zu: got %.9g, expected %.9g (%.3f ulp)", what, lk_dtype_name(t->dtype),
                     lk_convention_name(cv), s, e, got, ref[e], u);
    }
    return worst;
}

static const char *const g_keys[] = {"dout.weight", "din.weight", "dloha.weight", "sw.weight", "lh.weight",
                                     "lk.weight",   "lr.weight",  "pm.weight",    "md.weight", "keep.weight"};
#define NKEYS (sizeof g_keys / sizeof g_keys[0])

/* Fuses the adapters at strength s under cv into a fresh model of
 * dtype dt and checks every key against its expectation. */
static double fuse_and_check(const fixture *x, lk_dtype dt, lk_convention cv, double s) {
    af_file *m = af_new();
    for (size_t k = 0; k < NKEYS; k++) rnd(m, g_keys[k], dt, O, I, -1.0f, 1.0f);
    void *orig[NKEYS];
    double W[NKEYS][O * I];
    for (size_t k = 0; k < NKEYS; k++) {
        orig[k] = malloc(m->t[k].nbytes);
        memcpy(orig[k], m->t[k].data, m->t[k].nbytes);
        for (size_t e = 0; e < O * I; e++) W[k][e] = val(&m->t[k], e);
    }
    /* a PEFT DoRA adapter is fused alone (lorakit's rule): a second call, on other keys */
    lk_fuse_input in[2] = {{x->p_ly, s, LK_FORMAT_AUTO}, {x->p_md, s, LK_FORMAT_AUTO}};
    lk_fuse_input pin = {x->p_pm, s, LK_FORMAT_AUTO};
    lk_fuse_file_opts o = {.fuse = {.threads = 1, .convention = cv}};
    if (lk_fuse_tensors(m->t, m->n, in, 2, &o, NULL) || lk_fuse_tensors(m->t, m->n, &pin, 1, &o, NULL))
        fail_msg("%s: %s", lk_convention_name(cv), lk_last_error());
    double ref[O * I], worst = 0;
    const int comfy = cv == LK_CONVENTION_COMFYUI, peft = cv == LK_CONVENTION_PEFT, lyco = cv == LK_CONVENTION_LYCORIS;
    dora_ref(ref, W[0], x->D_out, 0.5, x->m_out, 1, 0, cv, s);
    worst = fmax(worst, check(&m->t[0], ref, "LoRA DoRA on the output axis", cv, s));
    dora_ref(ref, W[1], x->D_in, 0.5, x->m_in, 0, 0, cv, s);
    worst = fmax(worst, check(&m->t[1], ref, "LoRA DoRA per input channel", cv, s));
    dora_ref(ref, W[2], x->D_hout, 2.0, x->m_hout, 1, 0, cv, s);
    worst = fmax(worst, check(&m->t[2], ref, "LoHa DoRA on the output axis", cv, s));
    for (size_t e = 0; e < O * I; e++) ref[e] = comfy ? val(x->set, e) : W[3][e] + s * (val(x->set, e) - W[3][e]);
    worst = fmax(worst, check(&m->t[3], ref, "set_weight", cv, s));
    /* alpha 0: scale 0 leaves the bytes as they were */
    if (comfy || peft) {
        assert_memory_equal(m->t[4].data, orig[4], m->t[4].nbytes);
        assert_memory_equal(m->t[5].data, orig[5], m->t[5].nbytes);
    } else {
        for (size_t e = 0; e < O * I; e++) ref[e] = W[4][e] + s * x->D_lh[e];
        worst = fmax(worst, check(&m->t[4], ref, "LoHa .alpha 0", cv, s));
        for (size_t e = 0; e < O * I; e++) ref[e] = W[5][e] + s * x->D_lk[e];
        worst = fmax(worst, check(&m->t[5], ref, "LoKr .alpha 0", cv, s));
    }
    if (!lyco) assert_memory_equal(m->t[6].data, orig[6], m->t[6].nbytes);
    else {
        for (size_t e = 0; e < O * I; e++) ref[e] = W[6][e] + s * x->D_lr[e];
        worst = fmax(worst, check(&m->t[6], ref, "LoRA .alpha 0", cv, s));
    }
    dora_ref(ref, W[7], x->D_pm, 0.5, x->m_pm, 1, 1, cv, s);
    worst = fmax(worst, check(&m->t[7], ref, "PEFT DoRA (lora_magnitude_vector)", cv, s));
    const double cm = comfy || lyco ? 1.0 : 3.0;
    for (size_t e = 0; e < O * I; e++) ref[e] = W[8][e] + s * cm * x->D_md[e];
    worst = fmax(worst, check(&m->t[8], ref, "alpha in lora_adapter_metadata", cv, s));
    assert_memory_equal(m->t[9].data, orig[9], m->t[9].nbytes); /* untouched */
    for (size_t k = 0; k < NKEYS; k++) free(orig[k]);
    af_free(m);
    return worst;
}

static void test_points(void **state) {
    (void)state;
    fixture x;
    fixture_make(&x);
    const lk_dtype dts[3] = {LK_DTYPE_F32, LK_DTYPE_F16, LK_DTYPE_BF16};
    const double ss[3] = {1.0, 0.7, -0.3};
    for (int c = 0; c < LK_CONVENTION_COUNT; c++)
        for (int d = 0; d < 3; d++) {
            double worst = 0;
            for (int k = 0; k < 3; k++) worst = fmax(worst, fuse_and_check(&x, dts[d], (lk_convention)c, ss[k]));
            printf("  %-8s %-5s worst %.3f ulp\n", lk_convention_name((lk_convention)c), lk_dtype_name(dts[d]), worst);
        }
    fixture_free(&x);
}

/* The names parse and print both ways; an unknown one is refused naming the valid ones. */
static void test_names(void **state) {
    (void)state;
    for (int c = 0; c < LK_CONVENTION_COUNT; c++) {
        lk_convention got;
        assert_int_equal(lk_convention_parse(lk_convention_name((lk_convention)c), &got), LK_OK);
        assert_int_equal(got, c);
    }
    lk_convention got;
    assert_int_equal(lk_convention_parse("a1111", &got), LK_ERR_ARG);
    tu_assert_contains(lk_last_error(), "unknown convention 'a1111' (valid: lorakit, comfyui, lycoris, peft)");
    lk_adapter *a = NULL;
    lk_adapter_opts ao = {.convention = LK_CONVENTION_COUNT};
    assert_int_equal(lk_adapter_open_opts("x.safetensors", &ao, &a), LK_ERR_ARG);
    tu_assert_contains(lk_last_error(), "invalid convention 4");
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_points), cmocka_unit_test(test_names)};
    return cmocka_run_group_tests(tests, ar_setup_dir, ar_teardown_dir);
}
