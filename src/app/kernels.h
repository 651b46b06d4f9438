/* kernels.h — the layer kernels of the small transformer (src/app/model.c).
 *
 * Paired forward/backward functions in the llm.c style: outputs first, then
 * inputs, then sizes; shapes in the comment of each; backward functions
 * ACCUMULATE (+=) into their gradient outputs, so a zeroed buffer is the
 * caller's job. A NULL weight-gradient pointer skips that gradient (used when
 * the base model is frozen and only the LoRA hooks train). */
#ifndef LK_APP_KERNELS_H
#define LK_APP_KERNELS_H

#include <stddef.h>

/* out [N, C] = wte[inp[n]] + wpe[n % T]; N = B*T. */
void lk_k_embed_forward(float *out, const int *inp, const float *wte, const float *wpe,
                        int B, int T, int C);
void lk_k_embed_backward(float *dwte, float *dwpe, const float *dout, const int *inp,
                         int B, int T, int C);

/* LayerNorm over the last dim: out, mean, rstd [N, C], [N], [N]. */
void lk_k_layernorm_forward(float *out, float *mean, float *rstd, const float *inp,
                            const float *w, const float *b, int N, int C);
void lk_k_layernorm_backward(float *dinp, float *dw, float *db, const float *dout,
                             const float *inp, const float *w, const float *mean,
                             const float *rstd, int N, int C);

/* out [N, OC] = inp [N, C] W^T [C, OC] + b [OC] (b may be NULL). */
void lk_k_matmul_forward(float *out, const float *inp, const float *W, const float *b,
                         int N, int C, int OC);
/* dinp [N, C] += dout W; dW [OC, C] += dout^T inp; db [OC] += sum dout. */
void lk_k_matmul_backward(float *dinp, float *dW, float *db, const float *dout,
                          const float *inp, const float *W, int N, int C, int OC);

/* Causal multi-head attention. q, k, v, out [B, T, C]; att [B, NH, T, T]
 * (softmax probabilities, zero above the diagonal). */
void lk_k_attention_forward(float *out, float *att, const float *q, const float *k,
                            const float *v, int B, int T, int C, int NH);
/* scratch: T floats. */
void lk_k_attention_backward(float *dq, float *dk, float *dv, float *scratch,
                             const float *dout, const float *att, const float *q,
                             const float *k, const float *v, int B, int T, int C, int NH);

/* GELU (tanh approximation), elementwise over n. */
void lk_k_gelu_forward(float *out, const float *inp, size_t n);
void lk_k_gelu_backward(float *dinp, const float *inp, const float *dout, size_t n);

/* out = a + b, elementwise. */
void lk_k_residual_forward(float *out, const float *a, const float *b, size_t n);

/* Softmax cross-entropy. logits, probs [N, V]; losses [N]; targets [N]
 * (negative = ignored, loss 0). Returns the number of counted positions. */
int lk_k_crossentropy_forward(float *probs, float *losses, const float *logits,
                              const int *targets, int N, int V);
/* dlogits [N, V] = (probs - onehot) * scale at counted positions, 0 elsewhere. */
void lk_k_crossentropy_backward(float *dlogits, const float *probs, const int *targets,
                                float scale, int N, int V);

#endif
