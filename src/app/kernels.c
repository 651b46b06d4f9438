/* kernels.c — layer kernels of the small transformer (see kernels.h).
 *
 * Written for clarity first, as a reference implementation would be: plain
 * loops, one layer per pair of functions. The matmuls, which are nearly all
 * of the work, go through lk_sgemm, lorakit's one GEMM entry point (OpenBLAS
 * when it was found at build time, else a plain loop). Everything else is
 * small at the model sizes lorakit trains (T <= a few dozen). */
#include <math.h>
#include <string.h>

#include "app/kernels.h"

#include "lora/gemm.h"

void lk_k_embed_forward(float *out, const int *inp, const float *wte, const float *wpe,
                        int B, int T, int C) {
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            float *o = out + ((size_t)b * T + t) * C;
            const float *we = wte + (size_t)inp[b * T + t] * C;
            const float *pe = wpe + (size_t)t * C;
            for (int i = 0; i < C; i++) o[i] = we[i] + pe[i];
        }
}

void lk_k_embed_backward(float *dwte, float *dwpe, const float *dout, const int *inp,
                         int B, int T, int C) {
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            const float *d = dout + ((size_t)b * T + t) * C;
            float *dwe = dwte + (size_t)inp[b * T + t] * C;
            float *dpe = dwpe + (size_t)t * C;
            for (int i = 0; i < C; i++) {
                dwe[i] += d[i];
                dpe[i] += d[i];
            }
        }
}

void lk_k_layernorm_forward(float *out, float *mean, float *rstd, const float *inp,
                            const float *w, const float *b, int N, int C) {
    const float eps = 1e-5f;
    for (int n = 0; n < N; n++) {
        const float *x = inp + (size_t)n * C;
        float m = 0.0f;
        for (int i = 0; i < C; i++) m += x[i];
        m /= (float)C;
        float v = 0.0f;
        for (int i = 0; i < C; i++) {
            float d = x[i] - m;
            v += d * d;
        }
        v /= (float)C;
        float s = 1.0f / sqrtf(v + eps);
        float *o = out + (size_t)n * C;
        for (int i = 0; i < C; i++) o[i] = (x[i] - m) * s * w[i] + b[i];
        mean[n] = m;
        rstd[n] = s;
    }
}

void lk_k_layernorm_backward(float *dinp, float *dw, float *db, const float *dout,
                             const float *inp, const float *w, const float *mean,
                             const float *rstd, int N, int C) {
    for (int n = 0; n < N; n++) {
        const float *d = dout + (size_t)n * C;
        const float *x = inp + (size_t)n * C;
        float *dx = dinp + (size_t)n * C;
        float m = mean[n], s = rstd[n];
        /* two reductions: mean of dnorm and of dnorm * norm */
        float dnorm_mean = 0.0f, dnorm_norm_mean = 0.0f;
        for (int i = 0; i < C; i++) {
            float norm = (x[i] - m) * s;
            float dnorm = w[i] * d[i];
            dnorm_mean += dnorm;
            dnorm_norm_mean += dnorm * norm;
        }
        dnorm_mean /= (float)C;
        dnorm_norm_mean /= (float)C;
        for (int i = 0; i < C; i++) {
            float norm = (x[i] - m) * s;
            float dnorm = w[i] * d[i];
            if (db) db[i] += d[i];
            if (dw) dw[i] += norm * d[i];
            dx[i] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
        }
    }
}

void lk_k_matmul_forward(float *out, const float *inp, const float *W, const float *b,
                         int N, int C, int OC) {
    /* out = inp W^T (+ b): the bias rows first, then one GEMM accumulating */
    if (b)
        for (int n = 0; n < N; n++) memcpy(out + (size_t)n * OC, b, (size_t)OC * sizeof(float));
    lk_sgemm(0, 1, N, OC, C, 1.0f, inp, C, W, C, b ? 1.0f : 0.0f, out, OC);
}

void lk_k_matmul_backward(float *dinp, float *dW, float *db, const float *dout,
                          const float *inp, const float *W, int N, int C, int OC) {
    if (dinp) lk_sgemm(0, 0, N, C, OC, 1.0f, dout, OC, W, C, 1.0f, dinp, C);  /* += dout W */
    if (dW) lk_sgemm(1, 0, OC, C, N, 1.0f, dout, OC, inp, C, 1.0f, dW, C);     /* += dout^T inp */
    if (db)
        for (int n = 0; n < N; n++) {
            const float *d = dout + (size_t)n * OC;
            for (int j = 0; j < OC; j++) db[j] += d[j];
        }
}

void lk_k_attention_forward(float *out, float *att, const float *q, const float *k,
                            const float *v, int B, int T, int C, int NH) {
    int hs = C / NH;
    float scale = 1.0f / sqrtf((float)hs);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++)
            for (int t = 0; t < T; t++) {
                const float *qt = q + ((size_t)b * T + t) * C + h * hs;
                float *a = att + (((size_t)b * NH + h) * T + t) * T;
                float maxv = -INFINITY;
                for (int t2 = 0; t2 <= t; t2++) {
                    const float *kt = k + ((size_t)b * T + t2) * C + h * hs;
                    float s = 0.0f;
                    for (int i = 0; i < hs; i++) s += qt[i] * kt[i];
                    s *= scale;
                    a[t2] = s;
                    if (s > maxv) maxv = s;
                }
                float sum = 0.0f;
                for (int t2 = 0; t2 <= t; t2++) {
                    a[t2] = expf(a[t2] - maxv);
                    sum += a[t2];
                }
                float inv = 1.0f / sum;
                for (int t2 = 0; t2 < T; t2++) a[t2] = t2 <= t ? a[t2] * inv : 0.0f;
                float *o = out + ((size_t)b * T + t) * C + h * hs;
                for (int i = 0; i < hs; i++) o[i] = 0.0f;
                for (int t2 = 0; t2 <= t; t2++) {
                    const float *vt = v + ((size_t)b * T + t2) * C + h * hs;
                    for (int i = 0; i < hs; i++) o[i] += a[t2] * vt[i];
                }
            }
}

void lk_k_attention_backward(float *dq, float *dk, float *dv, float *scratch,
                             const float *dout, const float *att, const float *q,
                             const float *k, const float *v, int B, int T, int C, int NH) {
    int hs = C / NH;
    float scale = 1.0f / sqrtf((float)hs);
    float *datt = scratch;
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++)
            for (int t = 0; t < T; t++) {
                const float *a = att + (((size_t)b * NH + h) * T + t) * T;
                const float *d = dout + ((size_t)b * T + t) * C + h * hs;
                /* through out = att @ v */
                for (int t2 = 0; t2 <= t; t2++) {
                    const float *vt = v + ((size_t)b * T + t2) * C + h * hs;
                    float *dvt = dv + ((size_t)b * T + t2) * C + h * hs;
                    float s = 0.0f;
                    for (int i = 0; i < hs; i++) {
                        s += vt[i] * d[i];
                        dvt[i] += a[t2] * d[i];
                    }
                    datt[t2] = s;
                }
                /* through the softmax: dpre = a * (datt - sum(a * datt)) */
                float dot = 0.0f;
                for (int t2 = 0; t2 <= t; t2++) dot += a[t2] * datt[t2];
                const float *qt = q + ((size_t)b * T + t) * C + h * hs;
                float *dqt = dq + ((size_t)b * T + t) * C + h * hs;
                for (int t2 = 0; t2 <= t; t2++) {
                    float dpre = a[t2] * (datt[t2] - dot) * scale;
                    const float *kt = k + ((size_t)b * T + t2) * C + h * hs;
                    float *dkt = dk + ((size_t)b * T + t2) * C + h * hs;
                    for (int i = 0; i < hs; i++) {
                        dqt[i] += dpre * kt[i];
                        dkt[i] += dpre * qt[i];
                    }
                }
            }
}

#define LK_GELU_S 0.7978845608028654f /* sqrt(2/pi) */

/* GELU, tanh approximation: 0.5 x (1 + tanh(u)), u = S (x + 0.044715 x^3).
 * Written with the identity 0.5 (1 + tanh(u)) = sigmoid(2u) = 1 / (1 + e^-2u)
 * because expf is several times cheaper than tanhf, and GELU was most of a
 * training step's time; for large |u| it saturates to exactly 0 or x. */
void lk_k_gelu_forward(float *out, const float *inp, size_t n) {
    for (size_t i = 0; i < n; i++) {
        float x = inp[i];
        float u = LK_GELU_S * (x + 0.044715f * x * x * x);
        out[i] = x / (1.0f + expf(-2.0f * u));
    }
}

void lk_k_gelu_backward(float *dinp, const float *inp, const float *dout, size_t n) {
    for (size_t i = 0; i < n; i++) {
        float x = inp[i];
        float u = LK_GELU_S * (x + 0.044715f * x * x * x);
        float s = 1.0f / (1.0f + expf(-2.0f * u)); /* 0.5 (1 + tanh u) */
        /* d/dx [x s] = s + x s (1 - s) * 2 du/dx, since d tanh = 4 s (1 - s) / 2 */
        float du = LK_GELU_S * (1.0f + 3.0f * 0.044715f * x * x);
        float g = s + 2.0f * x * s * (1.0f - s) * du;
        dinp[i] += g * dout[i];
    }
}

void lk_k_residual_forward(float *out, const float *a, const float *b, size_t n) {
    for (size_t i = 0; i < n; i++) out[i] = a[i] + b[i];
}

int lk_k_crossentropy_forward(float *probs, float *losses, const float *logits,
                              const int *targets, int N, int V) {
    int count = 0;
    for (int n = 0; n < N; n++) {
        const float *l = logits + (size_t)n * V;
        float *p = probs + (size_t)n * V;
        float maxv = l[0];
        for (int i = 1; i < V; i++)
            if (l[i] > maxv) maxv = l[i];
        float sum = 0.0f;
        for (int i = 0; i < V; i++) {
            p[i] = expf(l[i] - maxv);
            sum += p[i];
        }
        for (int i = 0; i < V; i++) p[i] /= sum;
        int tg = targets ? targets[n] : -1;
        if (tg >= 0) {
            /* log-sum-exp form: exact even when p[tg] underflows */
            losses[n] = logf(sum) + maxv - l[tg];
            count++;
        } else {
            losses[n] = 0.0f;
        }
    }
    return count;
}

void lk_k_crossentropy_backward(float *dlogits, const float *probs, const int *targets,
                                float scale, int N, int V) {
    for (int n = 0; n < N; n++) {
        float *d = dlogits + (size_t)n * V;
        const float *p = probs + (size_t)n * V;
        int tg = targets[n];
        if (tg < 0) {
            memset(d, 0, (size_t)V * sizeof(float));
            continue;
        }
        for (int i = 0; i < V; i++) d[i] = (p[i] - (i == tg ? 1.0f : 0.0f)) * scale;
    }
}
