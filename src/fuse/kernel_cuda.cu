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

/* The kernel's address for lk_kernel.cuda (kernel_dev.c). */
extern "C" const void *lk_kdev_fuse_cuda(void) { return (const void *)lk_kdev_fuse_kernel; }
