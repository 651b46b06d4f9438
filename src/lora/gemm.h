/* gemm.h — the one matrix-multiply entry point of lorakit (internal, not
 * installed): the LoRA layers (src/lora) and the demo transformer's kernels
 * (src/app) both call it, so every product goes through the same BLAS call,
 * or the same plain-C fallback when OpenBLAS is absent. */
#ifndef LK_LORA_GEMM_H
#define LK_LORA_GEMM_H

#include "lorakit/status.h"

/* Loads OpenBLAS if this build uses it and it is not loaded yet (once per
 * process; see gemm.c): LK_ERR_NOMEM naming the address space it needs
 * when the process cannot map it. Training calls it before its first
 * product; lk_sgemm calls it too and falls back to plain loops. A library
 * that cannot be found is a warning and the plain loops, not an error. */
lk_status lk_gemm_prepare(void);

/* Row-major C[M,N] = alpha * op(A)[M,K] @ op(B)[K,N] + beta * C, where
 * op(X) = X^T when transX. lda/ldb/ldc are the row strides of the stored
 * matrices. With beta == 0, C is overwritten (never read). */
void lk_sgemm(int transA, int transB, int M, int N, int K, float alpha, const float *A, int lda,
              const float *B, int ldb, float beta, float *C, int ldc);

#endif
