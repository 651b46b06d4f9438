/* test_lora_linear.c — the LoRA linear kernels and the per-layer calls.
 *
 * Expectations, all independent of the code under test:
 *  - forward and every gradient against a double-precision reference written
 *    here as explicit sums over the definition y = x W^T + b + c (x A^T) B^T;
 *  - a central finite-difference check of dA, dB and dx through the float
 *    forward of the library itself (loss = sum(y * G), so dy = G);
 *  - the layer API (full and delta-only) against the kernels and against
 *    "full = base + delta". */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

typedef struct {
    int n, in, out, r;
    float scale;
    float *x, *W, *b, *A, *B, *dy;
} prob;

static float *rnd(tu_rng *g, size_t n, float amp) {
    float *p = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) p[i] = tu_uniform(g, -amp, amp);
    return p;
}

static prob make(int n, int in, int out, int r, float scale, uint64_t seed) {
    tu_rng g = {seed};
    prob p = {n, in, out, r, scale, NULL, NULL, NULL, NULL, NULL, NULL};
    p.x = rnd(&g, (size_t)n * in, 1.0f);
    p.W = rnd(&g, (size_t)out * in, 0.5f);
    p.b = rnd(&g, (size_t)out, 0.5f);
    p.A = rnd(&g, (size_t)r * in, 0.5f);
    p.B = rnd(&g, (size_t)out * r, 0.5f);
    p.dy = rnd(&g, (size_t)n * out, 1.0f);
    return p;
}

static void drop(prob *p) {
    free(p->x); free(p->W); free(p->b); free(p->A); free(p->B); free(p->dy);
}

/* The definition, in double. */
static double ref_y(const prob *p, int t, int o) {
    double acc = p->b[o];
    for (int i = 0; i < p->in; i++) acc += (double)p->x[t * p->in + i] * p->W[o * p->in + i];
    for (int k = 0; k < p->r; k++) {
        double h = 0;
        for (int i = 0; i < p->in; i++) h += (double)p->x[t * p->in + i] * p->A[k * p->in + i];
        acc += (double)p->scale * h * p->B[o * p->r + k];
    }
    return acc;
}

/* dL/dA[k,i] = c sum_t sum_o dy[t,o] B[o,k] x[t,i] */
static double ref_dA(const prob *p, int k, int i) {
    double acc = 0;
    for (int t = 0; t < p->n; t++)
        for (int o = 0; o < p->out; o++)
            acc += (double)p->dy[t * p->out + o] * p->B[o * p->r + k] * p->x[t * p->in + i];
    return p->scale * acc;
}

/* dL/dB[o,k] = c sum_t dy[t,o] h[t,k], h[t,k] = sum_i x[t,i] A[k,i] */
static double ref_dB(const prob *p, int o, int k) {
    double acc = 0;
    for (int t = 0; t < p->n; t++) {
        double h = 0;
        for (int i = 0; i < p->in; i++) h += (double)p->x[t * p->in + i] * p->A[k * p->in + i];
        acc += (double)p->dy[t * p->out + o] * h;
    }
    return p->scale * acc;
}

/* dL/dx[t,i] = sum_o dy[t,o] (W[o,i] + c sum_k B[o,k] A[k,i]) */
static double ref_dx(const prob *p, int t, int i, int with_base) {
    double acc = 0;
    for (int o = 0; o < p->out; o++) {
        double w = with_base ? p->W[o * p->in + i] : 0.0;
        for (int k = 0; k < p->r; k++) w += (double)p->scale * p->B[o * p->r + k] * p->A[k * p->in + i];
        acc += (double)p->dy[t * p->out + o] * w;
    }
    return acc;
}

static void close_to(double got, double want, double rtol, const char *what, int idx) {
    double tol = rtol * (1.0 + fabs(want));
    if (fabs(got - want) > tol) {
        print_error("%s[%d]: got %.9g, want %.9g (tol %.3g)\n", what, idx, got, want, tol);
        fail();
    }
}

static void check_kernels(int n, int in, int out, int r, float scale, uint64_t seed) {
    prob p = make(n, in, out, r, scale, seed);
    float *y = malloc(sizeof(float) * n * out), *h = malloc(sizeof(float) * n * (r ? r : 1));
    float *dh = malloc(sizeof(float) * n * (r ? r : 1));
    lk_lora_linear_forward(y, h, p.x, p.W, p.b, p.A, p.B, scale, n, in, out, r);
    for (int t = 0; t < n; t++)
        for (int o = 0; o < out; o++) close_to(y[t * out + o], ref_y(&p, t, o), 1e-5, "y", t * out + o);
    /* gradients accumulate: start from known non-zero values */
    float *dA = malloc(sizeof(float) * (r ? r : 1) * in), *dB = malloc(sizeof(float) * out * (r ? r : 1));
    float *dx = malloc(sizeof(float) * n * in);
    for (int i = 0; i < r * in; i++) dA[i] = 0.25f;
    for (int i = 0; i < out * r; i++) dB[i] = -0.5f;
    for (int i = 0; i < n * in; i++) dx[i] = 1.0f;
    lk_lora_linear_backward(dx, dA, dB, dh, p.dy, p.x, h, p.W, p.A, p.B, scale, n, in, out, r);
    for (int k = 0; k < r; k++)
        for (int i = 0; i < in; i++) close_to(dA[k * in + i], 0.25 + ref_dA(&p, k, i), 1e-5, "dA", k * in + i);
    for (int o = 0; o < out; o++)
        for (int k = 0; k < r; k++) close_to(dB[o * r + k], -0.5 + ref_dB(&p, o, k), 1e-5, "dB", o * r + k);
    for (int t = 0; t < n; t++)
        for (int i = 0; i < in; i++) close_to(dx[t * in + i], 1.0 + ref_dx(&p, t, i, 1), 1e-5, "dx", t * in + i);
    free(y); free(h); free(dh); free(dA); free(dB); free(dx);
    drop(&p);
}

static void test_forward_backward_reference(void **state) {
    (void)state;
    check_kernels(5, 7, 6, 3, 1.7f, 1);
    check_kernels(1, 1, 1, 1, 2.0f, 2);
    check_kernels(33, 96, 80, 8, 0.5f, 3);   /* BLAS-sized */
    check_kernels(4, 9, 5, 0, 1.0f, 4);      /* r = 0: the plain linear */
}

/* Loss = sum(y * G) in double, through the library's float forward. */
static double loss(const prob *p, float *y, float *h) {
    lk_lora_linear_forward(y, h, p->x, p->W, p->b, p->A, p->B, p->scale, p->n, p->in, p->out, p->r);
    double L = 0;
    for (int i = 0; i < p->n * p->out; i++) L += (double)y[i] * p->dy[i];
    return L;
}

static void fd_check(float *v, size_t n, const float *grad, prob *p, float *y, float *h, const char *what) {
    const float eps = 1e-2f;
    for (size_t i = 0; i < n; i++) {
        float keep = v[i];
        v[i] = keep + eps;
        double lp = loss(p, y, h);
        v[i] = keep - eps;
        double lm = loss(p, y, h);
        v[i] = keep;
        double fd = (lp - lm) / (2.0 * eps);
        /* float forward: error ~ 1e-7 * |y| * out / eps */
        if (fabs(fd - grad[i]) > 2e-3 * (1.0 + fabs(fd))) {
            print_error("%s[%zu]: analytic %.7g, finite difference %.7g\n", what, i, grad[i], fd);
            fail();
        }
    }
}

static void test_finite_differences(void **state) {
    (void)state;
    prob p = make(4, 6, 5, 3, 1.25f, 11);
    int n = p.n, in = p.in, out = p.out, r = p.r;
    float *y = malloc(sizeof(float) * n * out), *h = malloc(sizeof(float) * n * r), *dh = malloc(sizeof(float) * n * r);
    float *dA = calloc((size_t)r * in, sizeof(float)), *dB = calloc((size_t)out * r, sizeof(float));
    float *dx = calloc((size_t)n * in, sizeof(float));
    loss(&p, y, h);
    lk_lora_linear_backward(dx, dA, dB, dh, p.dy, p.x, h, p.W, p.A, p.B, p.scale, n, in, out, r);
    fd_check(p.A, (size_t)r * in, dA, &p, y, h, "dA");
    fd_check(p.B, (size_t)out * r, dB, &p, y, h, "dB");
    fd_check(p.x, (size_t)n * in, dx, &p, y, h, "dx");
    free(y); free(h); free(dh); free(dA); free(dB); free(dx);
    drop(&p);
}

/* The layer calls: same numbers as the kernels; full = base + delta. */
static void test_layer_api(void **state) {
    (void)state;
    prob p = make(6, 10, 7, 4, 0.0f, 21);
    lk_lora_model *m;
    assert_int_equal(lk_lora_model_create(&m), LK_OK);
    lk_lora_layer *l, *plain;
    assert_int_equal(lk_lora_model_add_linear(m, "blk.attn.to_q", 10, 7, p.W, p.b, &l), LK_OK);
    assert_int_equal(lk_lora_model_add_linear(m, "blk.ff", 10, 7, p.W, NULL, &plain), LK_OK);
    lk_lora_config cfg = {.configured = 1, .enable = 1, .rank = 4, .alpha = 6};
    size_t count;
    assert_int_equal(lk_lora_enable(m, &cfg, NULL, 5, &count), LK_OK);
    assert_int_equal(count, 1);
    assert_true(lk_lora_layer_wrapped(l));
    assert_false(lk_lora_layer_wrapped(plain));
    assert_float_equal(lk_lora_layer_scale(l), 1.5f, 0.0f);
    memcpy(lk_lora_layer_A(l), p.A, sizeof(float) * 4 * 10);
    memcpy(lk_lora_layer_B(l), p.B, sizeof(float) * 7 * 4);
    p.scale = 1.5f;
    int n = p.n;
    float *y = malloc(sizeof(float) * n * 7), *yb = malloc(sizeof(float) * n * 7);
    assert_int_equal(lk_lora_layer_forward(l, y, p.x, n), LK_OK);
    for (int t = 0; t < n; t++)
        for (int o = 0; o < 7; o++) close_to(y[t * 7 + o], ref_y(&p, t, o), 1e-5, "layer y", t * 7 + o);
    /* delta only: y_base + delta == full */
    lk_lora_linear_forward(yb, NULL, p.x, p.W, p.b, NULL, NULL, 0.0f, n, 10, 7, 0);
    assert_int_equal(lk_lora_layer_delta_forward(l, yb, p.x, n), LK_OK);
    for (int i = 0; i < n * 7; i++) close_to(yb[i], y[i], 1e-6, "base+delta", i);
    /* backward: full */
    float *dx = calloc((size_t)n * 10, sizeof(float));
    lk_lora_params_zero_grad(lk_lora_model_params(m));
    assert_int_equal(lk_lora_layer_backward(l, dx, p.dy, p.x, n), LK_OK);
    for (int k = 0; k < 4; k++)
        for (int i = 0; i < 10; i++) close_to(lk_lora_layer_dA(l)[k * 10 + i], ref_dA(&p, k, i), 1e-5, "layer dA", k);
    for (int o = 0; o < 7; o++)
        for (int k = 0; k < 4; k++) close_to(lk_lora_layer_dB(l)[o * 4 + k], ref_dB(&p, o, k), 1e-5, "layer dB", o);
    for (int t = 0; t < n; t++)
        for (int i = 0; i < 10; i++) close_to(dx[t * 10 + i], ref_dx(&p, t, i, 1), 1e-5, "layer dx", t);
    /* delta backward: dx gets only the LoRA share; grads accumulate again */
    memset(dx, 0, sizeof(float) * n * 10);
    assert_int_equal(lk_lora_layer_delta_backward(l, dx, p.dy, p.x, n), LK_OK);
    for (int t = 0; t < n; t++)
        for (int i = 0; i < 10; i++) close_to(dx[t * 10 + i], ref_dx(&p, t, i, 0), 1e-5, "delta dx", t);
    for (int k = 0; k < 4; k++) close_to(lk_lora_layer_dA(l)[k * 10], 2 * ref_dA(&p, k, 0), 1e-5, "2x dA", k);
    /* an unwrapped layer: plain linear, delta is a no-op, dx = dy W */
    assert_int_equal(lk_lora_layer_forward(plain, y, p.x, n), LK_OK);
    for (int t = 0; t < n; t++) {
        double acc = 0;
        for (int i = 0; i < 10; i++) acc += (double)p.x[t * 10 + i] * p.W[i];
        close_to(y[t * 7], acc, 1e-5, "plain y", t);
    }
    memcpy(yb, y, sizeof(float) * n * 7);
    assert_int_equal(lk_lora_layer_delta_forward(plain, yb, p.x, n), LK_OK);
    assert_memory_equal(yb, y, sizeof(float) * n * 7);
    memset(dx, 0, sizeof(float) * n * 10);
    assert_int_equal(lk_lora_layer_backward(plain, dx, p.dy, p.x, n), LK_OK);
    p.r = 0;
    for (int t = 0; t < n; t++)
        for (int i = 0; i < 10; i++) close_to(dx[t * 10 + i], ref_dx(&p, t, i, 1), 1e-5, "plain dx", t);
    /* merged weight = W + c B A */
    float *Wm = malloc(sizeof(float) * 7 * 10);
    assert_int_equal(lk_lora_layer_merged(l, Wm), LK_OK);
    for (int o = 0; o < 7; o++)
        for (int i = 0; i < 10; i++) {
            double w = p.W[o * 10 + i];
            for (int k = 0; k < 4; k++) w += 1.5 * (double)p.B[o * 4 + k] * p.A[k * 10 + i];
            close_to(Wm[o * 10 + i], w, 1e-6, "merged", o * 10 + i);
        }
    /* bad calls */
    assert_int_equal(lk_lora_layer_forward(l, NULL, p.x, n), LK_ERR_ARG);
    assert_int_equal(lk_lora_layer_forward(l, y, p.x, -1), LK_ERR_ARG);
    /* scratch allocation failure is a clean NOMEM */
    lk_alloc_fail_at(1);
    lk_status s = lk_lora_layer_backward(l, dx, p.dy, p.x, 1000);
    lk_alloc_fail_at(0);
    assert_int_equal(s, LK_ERR_NOMEM);
    free(Wm); free(y); free(yb); free(dx);
    lk_lora_model_free(m);
    drop(&p);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_forward_backward_reference),
        cmocka_unit_test(test_finite_differences),
        cmocka_unit_test(test_layer_api),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
