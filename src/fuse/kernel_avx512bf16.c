/* kernel_avx512bf16.c — the AVX-512 block function again, built with
 * AVX512_BF16 as lk_kblock_avx512bf16 (the path "avx512bf16"): only the
 * BF16 epilogue differs (round_bf16 in
 * kernel_avx512.c), and its bytes equal every other path's. */
#include "fuse/fuse.h"

#ifdef LK_KERNEL_X86
#define LK_K512_NAME lk_kblock_avx512bf16
#define LK_K512_TARGET "avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx512bf16"
#define LK_K512_BF16ISA 1
#define LK_X512_NAME lk_xrows_avx512bf16
#include "kernel_avx512.c"
#endif
