/* test_model.c — the small transformer (lorakit/model.h).
 *
 * Expectations are independent of the code under test:
 *  - gradients: central finite differences of the model's own forward loss
 *    (which does not share code with the backward), every parameter element;
 *  - a linear hook's gradient likewise, and a frozen base gets no gradient;
 *  - a hand-built 1-layer case where the exact logits are computed in double
 *    in the test from the weights (embedding, LayerNorm, attention over a
 *    single position, GELU MLP, head);
 *  - greedy decoding against an argmax over a separate forward;
 *  - training from scratch on `copy` lowers the loss (first vs last steps);
 *  - set_tensors: aliases, dtypes, shape errors leave the model unchanged. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"
#include "app/model.h"
#include "app/task.h"

static lk_model_config tiny_cfg(void) {
    lk_model_config c = {.vocab = 11, .max_seq = 8, .d_model = 8, .n_layers = 2, .n_heads = 2,
                         .d_ff = 16};
    return c;
}

static void rand_batch(tu_rng *r, int *in, int *tg, int n, int V) {
    for (int i = 0; i < n; i++) {
        in[i] = (int)(tu_next(r) % (uint64_t)V);
        tg[i] = (i % 3 == 0) ? -1 : (int)(tu_next(r) % (uint64_t)V);
    }
}

/* Perturbs every weight a little so LayerNorm gains/biases and zero biases
 * are not at special values where some gradients vanish. */
static void jitter(lk_model *m, uint64_t seed, float amp) {
    tu_rng r = {seed};
    float *p = lk_model_params(m);
    for (size_t i = 0; i < lk_model_num_floats(m); i++) p[i] += tu_uniform(&r, -amp, amp);
}

/* Compares analytic gradient g with central differences of the loss over
 * every element; returns the max normalised error. */
static double fd_check(lk_model *m, float *param, const float *g, size_t n, const int *in,
                       const int *tg, int B, int T, double eps, const char *what) {
    double worst = 0.0;
    for (size_t i = 0; i < n; i++) {
        float orig = param[i];
        float lp, lm;
        param[i] = orig + (float)eps;
        assert_int_equal(lk_model_forward(m, in, tg, B, T, &lp), LK_OK);
        param[i] = orig - (float)eps;
        assert_int_equal(lk_model_forward(m, in, tg, B, T, &lm), LK_OK);
        param[i] = orig;
        double fd = ((double)lp - (double)lm) / (2.0 * eps);
        double err = fabs(fd - g[i]) / (fabs(fd) + fabs(g[i]) + 1e-2);
        if (err > worst) worst = err;
        if (err > 0.05) {
            fprintf(stderr, "%s[%zu]: analytic %.6g, finite difference %.6g\n", what, i, g[i], fd);
        }
    }
    return worst;
}

static void test_gradcheck_full_model(void **state) {
    (void)state;
    lk_model_config c = tiny_cfg();
    lk_model *m;
    assert_int_equal(lk_model_create(&c, 7, &m), LK_OK);
    jitter(m, 11, 0.05f);
    int B = 3, T = 8;
    int in[24], tg[24];
    tu_rng r = {42};
    rand_batch(&r, in, tg, B * T, c.vocab);
    float loss;
    assert_int_equal(lk_model_forward(m, in, tg, B, T, &loss), LK_OK);
    assert_true(loss > 1.5f && loss < 4.0f);
    lk_model_zero_grad(m);
    assert_int_equal(lk_model_backward(m), LK_OK);
    size_t nf = lk_model_num_floats(m);
    float *g = malloc(nf * sizeof *g);
    memcpy(g, lk_model_grads(m), nf * sizeof *g);
    double worst = 0.0;
    for (size_t i = 0; i < lk_model_param_count(m); i++) {
        const lk_model_param *p = lk_model_param_at(m, i);
        double w = fd_check(m, lk_model_params(m) + p->offset, g + p->offset, p->numel, in, tg,
                            B, T, 3e-3, p->name);
        if (w > worst) worst = w;
        /* every parameter tensor gets some gradient (none disconnected) */
        double s = 0;
        for (size_t k = 0; k < p->numel; k++) s += fabs(g[p->offset + k]);
        if (strcmp(p->name, "pos_emb.weight")) assert_true(s > 0.0);
    }
    fprintf(stderr, "gradcheck: %zu floats, worst normalised error %.3g\n", nf, worst);
    assert_true(worst < 0.02); /* measured 0.005 at eps 3e-3 */
    free(g);
    lk_model_free(m);
}

/* A test hook: y += x D^T, D [out, in] owned by the test. */
typedef struct { float *D, *dD; int in, out; } delta_hook;
static lk_status dh_fwd(void *ctx, float *out, const float *inp, int n) {
    delta_hook *h = ctx;
    for (int r = 0; r < n; r++)
        for (int j = 0; j < h->out; j++) {
            float s = 0;
            for (int i = 0; i < h->in; i++) s += inp[r * h->in + i] * h->D[j * h->in + i];
            out[r * h->out + j] += s;
        }
    return LK_OK;
}
static lk_status dh_bwd(void *ctx, float *dinp, const float *dout, const float *inp, int n) {
    delta_hook *h = ctx;
    for (int r = 0; r < n; r++)
        for (int j = 0; j < h->out; j++)
            for (int i = 0; i < h->in; i++) {
                h->dD[j * h->in + i] += dout[r * h->out + j] * inp[r * h->in + i];
                dinp[r * h->in + i] += dout[r * h->out + j] * h->D[j * h->in + i];
            }
    return LK_OK;
}

static void test_gradcheck_hook_frozen_base(void **state) {
    (void)state;
    lk_model_config c = tiny_cfg();
    lk_model *m;
    assert_int_equal(lk_model_create(&c, 3, &m), LK_OK);
    jitter(m, 5, 0.05f);
    long li = lk_model_find_linear(m, "blocks.0.ff.net.0.proj");
    assert_true(li >= 0);
    assert_int_equal(lk_model_find_linear(m, "blocks.0.ff.net.0.proj.base_layer"), li);
    int in_f, out_f;
    lk_model_linear_info(m, (size_t)li, &in_f, &out_f, NULL, NULL);
    assert_int_equal(in_f, 8);
    assert_int_equal(out_f, 16);
    delta_hook h = {calloc(128, 4), calloc(128, 4), in_f, out_f};
    tu_rng r = {9};
    for (int i = 0; i < 128; i++) h.D[i] = tu_uniform(&r, -0.3f, 0.3f);
    lk_model_linear_hook hk = {dh_fwd, dh_bwd};
    lk_model_set_linear_hook(m, (size_t)li, &hk, &h);
    lk_model_set_train_base(m, 0);
    int B = 2, T = 8, in[16], tg[16];
    rand_batch(&r, in, tg, B * T, c.vocab);
    float loss;
    assert_int_equal(lk_model_forward(m, in, tg, B, T, &loss), LK_OK);
    lk_model_zero_grad(m);
    assert_int_equal(lk_model_backward(m), LK_OK);
    /* the frozen base got nothing */
    for (size_t i = 0; i < lk_model_num_floats(m); i++) assert_true(lk_model_grads(m)[i] == 0.0f);
    float g[128];
    memcpy(g, h.dD, sizeof g);
    double worst = fd_check(m, h.D, g, 128, in, tg, B, T, 1e-2, "hook.D");
    fprintf(stderr, "hook gradcheck: worst normalised error %.3g\n", worst);
    assert_true(worst < 0.03);
    /* detaching restores the plain model */
    float l2;
    lk_model_set_linear_hook(m, (size_t)li, NULL, NULL);
    memset(h.D, 0, 128 * 4);
    lk_model_set_linear_hook(m, (size_t)li, &hk, &h);
    assert_int_equal(lk_model_forward(m, in, tg, B, T, &l2), LK_OK);
    lk_model_set_linear_hook(m, (size_t)li, NULL, NULL);
    float l3;
    assert_int_equal(lk_model_forward(m, in, tg, B, T, &l3), LK_OK);
    assert_true(l2 == l3);
    free(h.D);
    free(h.dD);
    lk_model_free(m);
}

/* Exact logits of a 1-layer model on a length-1 sequence, in double:
 * attention over one position is the identity on v. */
static void ln_d(double *o, const double *x, const float *w, const float *b, int C) {
    double mu = 0, var = 0;
    for (int i = 0; i < C; i++) mu += x[i];
    mu /= C;
    for (int i = 0; i < C; i++) var += (x[i] - mu) * (x[i] - mu);
    var /= C;
    for (int i = 0; i < C; i++) o[i] = (x[i] - mu) / sqrt(var + 1e-5) * w[i] + b[i];
}
static void lin_d(double *o, const double *x, const float *W, const float *b, int in, int out) {
    for (int j = 0; j < out; j++) {
        double s = b ? b[j] : 0;
        for (int i = 0; i < in; i++) s += (double)W[j * in + i] * x[i];
        o[j] = s;
    }
}
static const float *P(lk_model *m, const char *name) {
    long i = lk_model_find_param(m, name);
    assert_true(i >= 0);
    return lk_model_params(m) + lk_model_param_at(m, (size_t)i)->offset;
}

static void test_forward_matches_double_reference(void **state) {
    (void)state;
    lk_model_config c = {.vocab = 11, .max_seq = 4, .d_model = 8, .n_layers = 1, .n_heads = 2,
                         .d_ff = 0};
    lk_model *m;
    assert_int_equal(lk_model_create(&c, 1, &m), LK_OK);
    assert_int_equal(lk_model_get_config(m)->d_ff, 32);
    jitter(m, 2, 0.2f);
    int tok = 7;
    assert_int_equal(lk_model_forward(m, &tok, NULL, 1, 1, NULL), LK_OK);
    const float *lg = lk_model_logits(m);
    double x[8], h[8], q[8], o[8], f[32], y[8], logits[11];
    for (int i = 0; i < 8; i++) x[i] = (double)P(m, "tok_emb.weight")[7 * 8 + i] + P(m, "pos_emb.weight")[i];
    ln_d(h, x, P(m, "blocks.0.norm1.weight"), P(m, "blocks.0.norm1.bias"), 8);
    lin_d(q, h, P(m, "blocks.0.attn.to_v.weight"), P(m, "blocks.0.attn.to_v.bias"), 8, 8);
    lin_d(o, q, P(m, "blocks.0.attn.to_out.0.weight"), P(m, "blocks.0.attn.to_out.0.bias"), 8, 8);
    for (int i = 0; i < 8; i++) x[i] += o[i];
    ln_d(h, x, P(m, "blocks.0.norm2.weight"), P(m, "blocks.0.norm2.bias"), 8);
    lin_d(f, h, P(m, "blocks.0.ff.net.0.proj.weight"), P(m, "blocks.0.ff.net.0.proj.bias"), 8, 32);
    for (int i = 0; i < 32; i++)
        f[i] = 0.5 * f[i] * (1 + tanh(sqrt(2 / M_PI) * (f[i] + 0.044715 * f[i] * f[i] * f[i])));
    lin_d(y, f, P(m, "blocks.0.ff.net.2.weight"), P(m, "blocks.0.ff.net.2.bias"), 32, 8);
    for (int i = 0; i < 8; i++) x[i] += y[i];
    ln_d(h, x, P(m, "norm_out.weight"), P(m, "norm_out.bias"), 8);
    lin_d(logits, h, P(m, "lm_head.weight"), NULL, 8, 11);
    for (int v = 0; v < 11; v++) assert_float_equal(lg[v], logits[v], 1e-5);
    /* loss against a target, from the double logits */
    int tg = 3;
    float loss;
    assert_int_equal(lk_model_forward(m, &tok, &tg, 1, 1, &loss), LK_OK);
    double mx = logits[0], se = 0;
    for (int v = 1; v < 11; v++) mx = fmax(mx, logits[v]);
    for (int v = 0; v < 11; v++) se += exp(logits[v] - mx);
    assert_float_equal(loss, log(se) + mx - logits[3], 1e-5);
    lk_model_free(m);
}

static void test_generate_is_greedy(void **state) {
    (void)state;
    lk_model_config c = tiny_cfg();
    lk_model *m;
    assert_int_equal(lk_model_create(&c, 5, &m), LK_OK);
    jitter(m, 8, 0.5f);
    int prompt[2 * 4] = {1, 2, 3, 10, 4, 4, 0, 10};
    int out[2 * 4];
    assert_int_equal(lk_model_generate(m, prompt, 2, 4, 4, out), LK_OK);
    /* rebuild each row token by token with separate forwards on prefixes */
    for (int b = 0; b < 2; b++) {
        int row[8];
        memcpy(row, prompt + 4 * b, 4 * sizeof(int));
        for (int g = 0; g < 4; g++) {
            int len = 4 + g;
            assert_int_equal(lk_model_forward(m, row, NULL, 1, len, NULL), LK_OK);
            const float *lg = lk_model_logits(m) + (size_t)(len - 1) * 11;
            int best = 0;
            for (int v = 1; v < 11; v++)
                if (lg[v] > lg[best]) best = v;
            assert_int_equal(out[b * 4 + g], best);
            row[len] = best;
        }
    }
    /* limits */
    assert_int_equal(lk_model_generate(m, prompt, 1, 4, 6, out), LK_ERR_ARG);
    int bad = 11;
    assert_int_equal(lk_model_forward(m, &bad, NULL, 1, 1, NULL), LK_ERR_ARG);
    lk_model_free(m);
}

/* Adam written out here (torch defaults) so the test does not depend on the
 * optimizer under test elsewhere. */
static void adam(float *p, const float *g, float *mm, float *vv, size_t n, int t, float lr) {
    float b1 = 0.9f, b2 = 0.999f;
    float c1 = 1.0f - powf(b1, (float)t), c2 = 1.0f - powf(b2, (float)t);
    for (size_t i = 0; i < n; i++) {
        mm[i] = b1 * mm[i] + (1 - b1) * g[i];
        vv[i] = b2 * vv[i] + (1 - b2) * g[i] * g[i];
        p[i] -= lr * (mm[i] / c1) / (sqrtf(vv[i] / c2) + 1e-8f);
    }
}

static void test_training_lowers_loss(void **state) {
    (void)state;
    int n = 4, B = 32, steps = 120;
    lk_model_config c = {.vocab = LK_TASK_VOCAB, .max_seq = lk_task_train_len(n), .d_model = 32,
                         .n_layers = 2, .n_heads = 4, .d_ff = 0};
    lk_model *m;
    assert_int_equal(lk_model_create(&c, 1, &m), LK_OK);
    size_t nf = lk_model_num_floats(m);
    float *mm = calloc(nf, 4), *vv = calloc(nf, 4);
    int T = lk_task_train_len(n);
    int *in = malloc(sizeof(int) * B * T), *tg = malloc(sizeof(int) * B * T);
    double first = 0, last = 0;
    for (int s = 0; s < steps; s++) {
        assert_int_equal(lk_task_batch(LK_TASK_COPY, n, 1, (uint64_t)s * B, B, in, tg), LK_OK);
        float loss;
        assert_int_equal(lk_model_forward(m, in, tg, B, T, &loss), LK_OK);
        lk_model_zero_grad(m);
        assert_int_equal(lk_model_backward(m), LK_OK);
        adam(lk_model_params(m), lk_model_grads(m), mm, vv, nf, s + 1, 3e-3f);
        if (s < 10) first += loss / 10;
        if (s >= steps - 10) last += loss / 10;
    }
    fprintf(stderr, "copy training: loss %.3f (first 10 steps) -> %.3f (last 10)\n", first, last);
    /* chance is ln(10) = 2.30 on the answer digits */
    assert_true(first > 2.0);
    assert_true(last < 0.5 * first);
    free(mm);
    free(vv);
    free(in);
    free(tg);
    lk_model_free(m);
}

static void test_set_tensors(void **state) {
    (void)state;
    lk_model_config c = tiny_cfg();
    lk_model *m, *m2;
    assert_int_equal(lk_model_create(&c, 1, &m), LK_OK);
    assert_int_equal(lk_model_create(&c, 2, &m2), LK_OK);
    size_t np = lk_model_param_count(m), nf = lk_model_num_floats(m);
    assert_int_equal(np, 2 + 2 * 16 + 3);
    /* sizes: V*C + T*C + L*(4*(C*C+C) + 2*(F*C) + F + C + 4*C) + 2*C + V*C */
    assert_int_equal(nf, 88 + 64 + 2 * (4 * 72 + 2 * 128 + 16 + 8 + 32) + 16 + 88);
    lk_tensor *ts = calloc(np, sizeof *ts);
    lk_model_tensors(m2, ts);
    float *before = malloc(nf * 4);
    memcpy(before, lk_model_params(m), nf * 4);

    /* a wrong shape anywhere: error naming the key, nothing written */
    ts[np - 1].shape[0] = 12;
    assert_int_equal(lk_model_set_tensors(m, ts, np, "x.safetensors", 0), LK_ERR_SHAPE);
    tu_assert_contains(lk_last_error(), "x.safetensors: lm_head.weight is [12, 8]");
    assert_memory_equal(before, lk_model_params(m), nf * 4);
    ts[np - 1].shape[0] = 11;
    /* missing one */
    assert_int_equal(lk_model_set_tensors(m, ts, np - 1, "x", 0), LK_ERR_FORMAT);
    tu_assert_contains(lk_last_error(), "lm_head.weight is missing");
    assert_memory_equal(before, lk_model_params(m), nf * 4);
    /* unknown */
    const char *keep = ts[0].name;
    ts[0].name = "nope.weight";
    assert_int_equal(lk_model_set_tensors(m, ts, np, "x", 0), LK_ERR_UNMATCHED);
    ts[0].name = keep;
    assert_memory_equal(before, lk_model_params(m), nf * 4);

    /* aliases: <m>.base_layer.weight loads into <m>.weight */
    long qi = lk_model_find_param(m, "blocks.1.attn.to_q.weight");
    assert_true(qi >= 0);
    assert_int_equal(lk_model_find_param(m, "blocks.1.attn.to_q.base_layer.weight"), qi);
    assert_int_equal(lk_model_find_param(m, "blocks.1.attn.to_q.base_layer.bias"), qi + 1);
    ts[qi].name = "blocks.1.attn.to_q.base_layer.weight";
    assert_int_equal(lk_model_set_tensors(m, ts, np, "x", 0), LK_OK);
    assert_memory_equal(lk_model_params(m), lk_model_params(m2), nf * 4);
    /* both names for one weight: refused */
    lk_tensor two[2] = {ts[qi], ts[qi]};
    two[1].name = "blocks.1.attn.to_q.weight";
    assert_int_equal(lk_model_set_tensors(m, two, 2, "x", 1), LK_ERR_FORMAT);

    /* BF16 input is converted (values exactly representable) */
    uint16_t bf[8];
    for (int i = 0; i < 8; i++) bf[i] = lk_f32_to_bf16(0.25f * (float)i);
    lk_tensor t = {.name = "norm_out.weight", .dtype = LK_DTYPE_BF16, .ndim = 1, .shape = {8},
                   .nbytes = 16, .data = bf};
    assert_int_equal(lk_model_set_tensors(m, &t, 1, "x", 1), LK_OK);
    assert_float_equal(P(m, "norm_out.weight")[5], 1.25, 0);
    free(ts);
    free(before);
    lk_model_free(m);
    lk_model_free(m2);
}

static void test_save_load_roundtrip(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    char *path = tu_path(dir, "base.safetensors");
    lk_model_config c = tiny_cfg();
    c.d_ff = 24;
    lk_model *m, *m2;
    assert_int_equal(lk_model_create(&c, 4, &m), LK_OK);
    assert_int_equal(lk_model_save(m, path), LK_OK);
    assert_int_equal(lk_model_load(path, &m2), LK_OK);
    assert_memory_equal(lk_model_get_config(m2), lk_model_get_config(m), sizeof c);
    assert_memory_equal(lk_model_params(m2), lk_model_params(m), lk_model_num_floats(m) * 4);
    /* the file is plain safetensors with the documented names and shapes */
    lk_st *st;
    assert_int_equal(lk_st_open(path, &st), LK_OK);
    long i = lk_st_find(st, "blocks.1.ff.net.0.proj.weight");
    assert_true(i >= 0);
    const lk_tensor *t = lk_st_tensor(st, (size_t)i);
    assert_int_equal(t->dtype, LK_DTYPE_F32);
    assert_int_equal(t->shape[0], 24);
    assert_int_equal(t->shape[1], 8);
    assert_string_equal(lk_st_metadata_get(st, "lorakit.model.d_ff"), "24");
    lk_st_close(st);
    /* load_weights into a model of another shape: error, unchanged */
    lk_model_config c3 = tiny_cfg();
    lk_model *m3;
    assert_int_equal(lk_model_create(&c3, 1, &m3), LK_OK);
    float first = lk_model_params(m3)[0];
    assert_int_equal(lk_model_load_weights(m3, path), LK_ERR_SHAPE);
    tu_assert_contains(lk_last_error(), "base.safetensors: blocks.0.ff.net.0.proj.bias is [24] but the model weight is [16]");
    assert_true(lk_model_params(m3)[0] == first);
    assert_int_equal(lk_model_load(dir, &m3), LK_ERR_IO);
    lk_model_free(m);
    lk_model_free(m2);
    lk_model_free(m3);
    tu_rmtree(dir);
    free(path);
    free(dir);
}

/* Every allocation of a first forward (activations, batch copies) failing
 * in turn: a clean LK_ERR_NOMEM, and the model still works afterwards with
 * the same result as a model that never failed. */
static void test_forward_allocation_failures(void **state) {
    (void)state;
    lk_model_config c = tiny_cfg();
    lk_model *m, *ref;
    assert_int_equal(lk_model_create(&c, 1, &m), LK_OK);
    assert_int_equal(lk_model_create(&c, 1, &ref), LK_OK);
    int in[16], tg[16];
    tu_rng r = {3};
    rand_batch(&r, in, tg, 16, c.vocab);
    float want, got;
    assert_int_equal(lk_model_forward(ref, in, tg, 2, 8, &want), LK_OK);
    int failures = 0;
    for (unsigned long k = 1; k < 20; k++) {
        lk_alloc_fail_at(k);
        lk_status st = lk_model_forward(m, in, tg, 2, 8, &got);
        lk_alloc_fail_at(0);
        if (st == LK_OK) break;
        assert_int_equal(st, LK_ERR_NOMEM);
        assert_null(lk_model_logits(m));
        assert_int_equal(lk_model_backward(m), LK_ERR_STATE);
        failures++;
    }
    assert_true(failures >= 2);
    assert_int_equal(lk_model_forward(m, in, tg, 2, 8, &got), LK_OK);
    assert_true(got == want);
    lk_model_free(m);
    lk_model_free(ref);
}

static void test_config_errors(void **state) {
    (void)state;
    lk_model *m = NULL;
    lk_model_config c = tiny_cfg();
    c.n_heads = 3;
    assert_int_equal(lk_model_create(&c, 1, &m), LK_ERR_CONFIG);
    tu_assert_contains(lk_last_error(), "n_heads = 3 does not divide d_model = 8");
    c = tiny_cfg();
    c.vocab = 0;
    assert_int_equal(lk_model_create(&c, 1, &m), LK_ERR_CONFIG);
    tu_assert_contains(lk_last_error(), "vocab = 0");
    assert_null(m);
    /* injected allocation failures: clean NOMEM every time */
    c = tiny_cfg();
    for (unsigned long k = 1; k < 8; k++) {
        lk_alloc_fail_at(k);
        lk_status st = lk_model_create(&c, 1, &m);
        lk_alloc_fail_at(0);
        if (st == LK_OK) {
            lk_model_free(m);
            break;
        }
        assert_int_equal(st, LK_ERR_NOMEM);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gradcheck_full_model),
        cmocka_unit_test(test_gradcheck_hook_frozen_base),
        cmocka_unit_test(test_forward_matches_double_reference),
        cmocka_unit_test(test_generate_is_greedy),
        cmocka_unit_test(test_training_lowers_loss),
        cmocka_unit_test(test_set_tensors),
        cmocka_unit_test(test_save_load_roundtrip),
        cmocka_unit_test(test_forward_allocation_failures),
        cmocka_unit_test(test_config_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
