/* average_dev.h — the per-thread body of the gradient average's division
 * on a device (src/lora/average_dev.c), written once: compiled by nvcc
 * inside a __global__ function (average_cuda.cu) and as C for the emul
 * device, whose launch runs this body for every thread of the grid.
 *
 * p[i] = p[i] / fs for i < n: one IEEE float division (correctly rounded:
 * -prec-div=true, no fast math), the very operation the host average
 * (src/comm/replicas.c) does, so the bytes agree. A grid-stride loop over
 * i = block * blockDim + thread, step gridDim * blockDim; threads are
 * independent (no shared memory, no barrier). */
#ifndef LK_LORA_AVERAGE_DEV_H
#define LK_LORA_AVERAGE_DEV_H

#include <stdint.h>
#include "core/hd.h"

typedef struct lk_avg_div_args {
    float *p;
    uint64_t n;
    float fs;
} lk_avg_div_args;

LK_HD void lk_avg_div_thread(const lk_avg_div_args *a, unsigned block, unsigned thread, unsigned block_dim,
                             unsigned grid_dim) {
    const uint64_t step = (uint64_t)grid_dim * block_dim;
    for (uint64_t i = (uint64_t)block * block_dim + thread; i < a->n; i += step) a->p[i] = a->p[i] / a->fs;
}

#endif
