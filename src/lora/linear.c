/* linear.c — the LoRA linear forward and backward kernels.
 *
 *   y  = x W^T + b + c h B^T,   h = x A^T          (h is kept for backward)
 *   dh = c dy B
 *   dB += c dy^T h,  dA += dh^T x,  dx += dy W + dh A
 *
 * Shapes: x [n, in], W [out, in], b [out], A [r, in], B [out, r], y [n, out],
 * h, dh [n, r]. Every product is one sgemm (lk_sgemm), so the LoRA
 * overhead is two thin GEMMs forward and four backward next to the base
 * GEMM; no out x in delta is ever formed. */
#include "lora/params.h"

void lk_lora_linear_forward(float *y, float *h, const float *x, const float *W, const float *b,
                            const float *A, const float *B, float scale, int n, int in, int out,
                            int r) {
    if (n <= 0 || out <= 0) return;
    lk_sgemm(0, 1, n, out, in, 1.0f, x, in, W, in, 0.0f, y, out);
    if (b)
        for (int t = 0; t < n; t++) {
            float *yt = y + (size_t)t * out;
            for (int o = 0; o < out; o++) yt[o] += b[o];
        }
    if (r > 0) {
        lk_sgemm(0, 1, n, r, in, 1.0f, x, in, A, in, 0.0f, h, r);
        lk_sgemm(0, 1, n, out, r, scale, h, r, B, r, 1.0f, y, out);
    }
}

void lk_lora_linear_backward(float *dx, float *dA, float *dB, float *dh, const float *dy,
                             const float *x, const float *h, const float *W, const float *A,
                             const float *B, float scale, int n, int in, int out, int r) {
    if (n <= 0) return;
    if (r > 0) {
        lk_sgemm(0, 0, n, r, out, scale, dy, out, B, r, 0.0f, dh, r);
        lk_sgemm(1, 0, out, r, n, scale, dy, out, h, r, 1.0f, dB, r);
        lk_sgemm(1, 0, r, in, n, 1.0f, dh, r, x, in, 1.0f, dA, in);
    }
    if (dx) {
        if (W) lk_sgemm(0, 0, n, in, out, 1.0f, dy, out, W, in, 1.0f, dx, in);
        if (r > 0) lk_sgemm(0, 0, n, in, r, 1.0f, dh, r, A, in, 1.0f, dx, in);
    }
}
