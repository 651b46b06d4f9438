/* fingerprint_cuda.cu — the device fingerprint's kernels for CUDA:
 * __global__ wrappers around device/fingerprint.h's per-thread bodies (the
 * source emul runs as C). Integer only; tests/device_ptx.sh audits the PTX
 * (no float instruction at all, so no fma): */
#include "device/fingerprint.h"

// LK_AUDIT lk_fp_words_kernel 0 0
__global__ void lk_fp_words_kernel(lk_fp_args a) {
    lk_fp_words_thread(&a, (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x,
                       (unsigned long long)gridDim.x * blockDim.x);
}

// LK_AUDIT lk_fp_sum_kernel 0 0
__global__ void lk_fp_sum_kernel(lk_fp_args a) { lk_fp_sum_thread(&a, threadIdx.x, blockDim.x); }

/* The kernels' addresses for lk_kernel.cuda (device.c): 0 words, 1 sums. */
extern "C" const void *lk_fp_cuda_kernel(int which) {
    return which == 0 ? (const void *)lk_fp_words_kernel : (const void *)lk_fp_sum_kernel;
}
