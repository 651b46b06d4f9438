/* lora/params.h — internals shared by the src/lora files (not installed).
 * The parameter-set internals that the model, sync, optimizer and PEFT files
 * all read (and lk_sgemm, the one GEMM entry point, from gemm.h). */
#ifndef LK_LORA_PARAMS_H
#define LK_LORA_PARAMS_H

#include <stddef.h>
#include <stdint.h>
#include "lorakit/lora.h"

#include "lora/gemm.h" /* lk_sgemm, the one GEMM entry point */

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
