/* gemm.h — the one matrix-multiply entry point of lorakit (internal, not
 * installed): the LoRA layers (src/lora) and the demo transformer's kernels
 * (src/app) both call it, so every product goes through the same BLAS call,
 * or the same plain-C fallback when OpenBLAS is absent. */
#ifndef LK_LORA_GEMM_H
#define LK_LORA_GEMM_H

/* Row-major C[M,N] = alpha * op(A)[M,K] @ op(B)[K,N] + beta * C, where
 * op(X) = X^T when transX. lda/ldb/ldc are the row strides of the stored
 * matrices. With beta == 0, C is overwritten (never read). */
void lk_sgemm(int transA, int transB, int M, int N, int K, float alpha, const float *A, int lda,
              const float *B, int ldb, float beta, float *C, int ldc);

#endif
