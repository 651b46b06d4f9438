/* kernel_cuda.cu — the device fuse kernel for CUDA: a __global__ wrapper
 * around the per-thread body in kernel_dev.h (the same source the emul
 * device runs as C), compiled with the build's --fmad=false -prec-div=true
 * -prec-sqrt=true -ftz=false (CMakeLists.txt). Nothing else lives here, so
 * the arithmetic exists once; tests/device_ptx.sh audits nvcc's PTX
 * of this file (its float instructions, kernel by kernel). */
#include "fuse/kernel_dev.h"

/* The chain at LK_KDEV_CHAINS places, LK_KDEV_RPT rows each, per precision
 * (kernel_dev.h; kernel_dev.c asserts the product), for tests/device_ptx.sh: */
// LK_AUDIT lk_kdev_fuse_kernel 12 12
__global__ void lk_kdev_fuse_kernel(lk_kdev_args a) {
    lk_kdev_fuse_thread(&a, blockIdx.x, blockIdx.y, threadIdx.x, blockDim.x, gridDim.y);
}

/* The key kernel: the delta (both precisions) plus the vector terms' fma
 * (one per row, RPT rows): */
// LK_AUDIT lk_kdev_key_kernel 12 16
__global__ void lk_kdev_key_kernel(lk_kdev_key k) {
    lk_kdev_key_thread(&k, blockIdx.x, blockIdx.y, threadIdx.x, blockDim.x, gridDim.y);
}

/* DoRA's row sums: the delta plus one fma per row (RPT rows): */
// LK_AUDIT lk_kdev_normrows_kernel 12 16
__global__ void lk_kdev_normrows_kernel(lk_kdev_key k) {
    lk_kdev_normrows_thread(&k, (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x);
}

/* DoRA's channel sums: one lane of the delta (every lane is the same row)
 * plus one fma: */
// LK_AUDIT lk_kdev_normcols_kernel 3 4
__global__ void lk_kdev_normcols_kernel(lk_kdev_key k) {
    lk_kdev_normcols_thread(&k, (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x);
}

/* FP8 weights (the judge and write passes): the narrow delta's chains
 * only, the FP8 element rule (fuse/fp8elem.h) writes no fma: */
// LK_AUDIT lk_kdev_fp8_kernel 12 0
__global__ void lk_kdev_fp8_kernel(lk_kdev_fp8 f) {
    lk_kdev_fp8_thread(&f, blockIdx.x, blockIdx.y, threadIdx.x, blockDim.x, gridDim.y);
}

/* An FP8 rescale's amax, per slot and row: the same chains, |w0 + d|
 * with no fma: */
// LK_AUDIT lk_kdev_fp8amax_kernel 12 0
__global__ void lk_kdev_fp8amax_kernel(lk_kdev_fp8 f) {
    lk_kdev_fp8amax_thread(&f, blockIdx.x, blockIdx.y, threadIdx.x, blockDim.x, gridDim.y);
}

/* ... and its per-row reduction of the slots (integer max only): */
// LK_AUDIT lk_kdev_fp8red_kernel 0 0
__global__ void lk_kdev_fp8red_kernel(lk_kdev_fp8 f) {
    lk_kdev_fp8red_thread(&f, (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x);
}

/* The kernels' addresses for lk_kernel.cuda (kernel_dev.c): 0 fuse, 1 key,
 * 2 DoRA row sums, 3 DoRA channel sums, 4 FP8, 5 FP8 amax slots, 6 FP8
 * amax rows. */
extern "C" const void *lk_kdev_cuda_kernel(int which) {
    switch (which) {
    case 0: return (const void *)lk_kdev_fuse_kernel;
    case 1: return (const void *)lk_kdev_key_kernel;
    case 2: return (const void *)lk_kdev_normrows_kernel;
    case 3: return (const void *)lk_kdev_normcols_kernel;
    case 4: return (const void *)lk_kdev_fp8_kernel;
    case 5: return (const void *)lk_kdev_fp8amax_kernel;
    default: return (const void *)lk_kdev_fp8red_kernel;
    }
}
