/* average_cuda.cu — the gradient average's division for CUDA: a __global__
 * wrapper around the per-thread body in average_dev.h (the same source the
 * emul device runs as C), compiled with the build's -prec-div=true. */
#include "lora/average_dev.h"

__global__ void lk_avg_div_kernel(lk_avg_div_args a) { lk_avg_div_thread(&a, blockIdx.x, threadIdx.x, blockDim.x, gridDim.x); }

/* The kernel's address for lk_kernel.cuda (average_dev.c). */
extern "C" const void *lk_avg_div_cuda(void) { return (const void *)lk_avg_div_kernel; }
