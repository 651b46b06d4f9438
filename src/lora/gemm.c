/* gemm.c — the one matrix-multiply entry point (gemm.h): the LoRA layers
 * and the demo transformer's kernels.
 * OpenBLAS sgemm when LK_HAVE_BLAS; otherwise a plain loop nest (correct,
 * slow: it exists so the library still builds and tests without BLAS). */
#include "lora/gemm.h"

#include <stddef.h>

#ifdef LK_HAVE_BLAS
#include <cblas.h>
#endif

void lk_sgemm(int transA, int transB, int M, int N, int K, float alpha, const float *A, int lda,
              const float *B, int ldb, float beta, float *C, int ldc) {
    if (M <= 0 || N <= 0) return;
#ifdef LK_HAVE_BLAS
    if (K > 0) {
        cblas_sgemm(CblasRowMajor, transA ? CblasTrans : CblasNoTrans,
                    transB ? CblasTrans : CblasNoTrans, M, N, K, alpha, A, lda, B, ldb, beta, C,
                    ldc);
        return;
    }
#endif
    for (int i = 0; i < M; i++) {
        float *c = C + (size_t)i * ldc;
        for (int j = 0; j < N; j++) {
            float acc = 0.0f;
            for (int k = 0; k < K; k++) {
                float a = transA ? A[(size_t)k * lda + i] : A[(size_t)i * lda + k];
                float b = transB ? B[(size_t)j * ldb + k] : B[(size_t)k * ldb + j];
                acc += a * b;
            }
            c[j] = alpha * acc + (beta == 0.0f ? 0.0f : beta * c[j]);
        }
    }
}
