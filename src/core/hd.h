/* hd.h — the qualifier of code that runs on the host and on a device.
 *
 * A few per-element functions (the bit casts, the F16/BF16 conversions,
 * the fuse kernel's rounding rules) are written once and compiled twice:
 * as C for every CPU path and the emulated device, and by nvcc for the
 * CUDA kernels (src/fuse/kernel_cuda.cu). LK_HD marks them: plain
 * `static inline` in C, `static inline __host__ __device__` under nvcc.
 * Internal, not installed. */
#ifndef LK_CORE_HD_H
#define LK_CORE_HD_H

#ifdef __CUDACC__
#define LK_HD static inline __host__ __device__
#else
#define LK_HD static inline
#endif

#endif
