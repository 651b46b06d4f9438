/* train_impl.h — internals shared by the src/lora files (not installed).
 * One GEMM entry point so every kernel goes through the same BLAS call (or
 * the plain-C fallback when OpenBLAS is absent), and the parameter-set
 * internals that the model, sync, optimizer and PEFT files all read. */
#ifndef LK_LORA_TRAIN_IMPL_H
#define LK_LORA_TRAIN_IMPL_H

#include <stddef.h>
#include <stdint.h>
#include "lorakit/lora.h"

/* Row-major C[M,N] = alpha * op(A)[M,K] @ op(B)[K,N] + beta * C, where
 * op(X) = X^T when transX. lda/ldb/ldc are the row strides of the stored
 * matrices. With beta == 0, C is overwritten (never read). */
void lk_train_sgemm(int transA, int transB, int M, int N, int K, float alpha, const float *A,
                    int lda, const float *B, int ldb, float beta, float *C, int ldc);

struct lk_lora_params {
    size_t count;     /* parameter tensors, sorted by name */
    char **names;
    size_t *offset;   /* in floats */
    int64_t *rows, *cols;
    size_t numel;
    float *data;      /* one allocation */
    float *grad;      /* one allocation, same layout */
    const void *agreed_world; /* the world comm whose ranks agreed on this layout */
};

/* Checks (once per world, cached) that every rank holds the same layout, so
 * bucketed collectives pair up; LK_ERR_MISMATCH on every rank otherwise. */
lk_status lk_lora_params_agree(lk_lora_params *p, lk_comm *world);
/* XXH3-64 of the names, shapes and order of p. */
uint64_t lk_lora_params_layout_hash(const lk_lora_params *p);

/* The model's LoRA rank (0 before enable) and alpha (for peft.c). */
int lk_lora_model_rank_alpha(const lk_lora_model *m, int *alpha);

#endif
