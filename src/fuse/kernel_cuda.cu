/* kernel_cuda.cu — the device fuse kernel for CUDA: a __global__ wrapper
 * around the per-thread body in kernel_dev.h (the same source the emul
 * device runs as C), compiled with the build's --fmad=false -prec-div=true
 * -prec-sqrt=true -ftz=false (CMakeLists.txt). Nothing else lives here, so
 * the arithmetic exists once; tests/test_device_ptx.c compiles this file to
 * PTX and audits its float instructions. */
#include "fuse/kernel_dev.h"

__global__ void lk_kdev_fuse_kernel(lk_kdev_args a) {
    lk_kdev_fuse_thread(&a, blockIdx.x, blockIdx.y, threadIdx.x, blockDim.x, gridDim.y);
}

/* The kernel's address for lk_kernel.cuda (kernel_dev.c). */
extern "C" const void *lk_kdev_fuse_cuda(void) { return (const void *)lk_kdev_fuse_kernel; }
