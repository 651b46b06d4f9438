/* device/fingerprint.h — the device fingerprint's per-thread bodies,
 * written once and compiled twice (as the fuse kernel is: fuse/kernel_dev.h):
 * by nvcc inside the __global__ functions of device/fingerprint_cuda.cu for
 * cuda devices, and as C (device.c) for emul, whose launch runs these same
 * bodies over the grid. Integer arithmetic only. Internal.
 *
 * The fingerprint of n bytes at p (lorakit/device.h, lk_device_fingerprint):
 *   w_i  the i-th 8-byte little-endian word of the bytes, the last one
 *        zero-padded (i = 0 .. ceil(n / 8) - 1);
 *   h_i  = mix64(w_i ^ mix64(i ^ LK_FP_SEED));
 *   S    = sum of h_i mod 2^64;
 *   F    = mix64(S ^ mix64(n ^ LK_FP_LEN_SEED)).
 * mix64 is splitmix64's finaliser (Steele, Lea and Flood's SplitMix64; the
 * constants of Stafford's "Mix13"), a bijection of 64-bit words. So, for
 * one word index, a change of the word changes h_i, and with every other
 * term unchanged S and F change: ANY change confined to one word (any one
 * bit flip, any one element of up to 8 bytes) is always seen, not just
 * with high probability; other changes are missed with probability about
 * 2^-64 (the per-index mask mix64(i ^ seed) makes a swap of two unequal
 * words a different sum). The sum mod 2^64 is exactly associative and
 * commutative, so F does not depend on how the words are split between
 * threads: any grid gives the same value.
 *
 * Work split: pass 1, thread g of T (= gridDim.x * blockDim.x) sums the
 * words g, g + T, g + 2T, ... into part[g] (no atomics, no shared memory);
 * the reduction passes (lk_fp_sum_thread), thread x of X sums part[x],
 * part[x + X], ... back into part[x] (only thread x reads those slots and
 * writes slot x, so in place is safe), with X = blockDim.x then X = 1;
 * the host copies part[0] (8 bytes) and applies the length mix. */
#ifndef LK_DEVICE_FINGERPRINT_H
#define LK_DEVICE_FINGERPRINT_H

#include <stdint.h>
#include "core/hd.h"

#define LK_FP_SEED 0x6c6f72616b697466ull     /* "lorakitf" */
#define LK_FP_LEN_SEED 0x9e3779b97f4a7c15ull /* 2^64 / golden ratio */
#define LK_FP_BLOCK 256u                     /* threads per block, every pass */
#define LK_FP_MAX_BLOCKS 512u                /* pass 1's grid at most: the scratch's partial sums */
#define LK_FP_MIN_WORDS 8u                   /* words per thread at least (smaller buffers: fewer threads) */

typedef struct lk_fp_args {
    const unsigned char *p; /* the bytes (device memory) */
    unsigned long long n;   /* their length */
    unsigned long long *part; /* pass 1: one slot per thread; reductions: n_part slots in, X out */
    unsigned long long n_part;
} lk_fp_args;

LK_HD uint64_t lk_fp_mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Word i of the bytes, little-endian, zero-padded past n: one 8-byte load
 * when aligned and whole, else byte by byte. */
LK_HD uint64_t lk_fp_word(const unsigned char *p, uint64_t n, uint64_t i) {
    const uint64_t at = 8 * i;
    if (at + 8 <= n && !(((uintptr_t)(p + at)) & 7u)) return *(const uint64_t *)(const void *)(p + at);
    uint64_t w = 0;
    for (uint64_t b = 0; b < 8 && at + b < n; b++) w |= (uint64_t)p[at + b] << (8 * b);
    return w;
}

/* Pass 1: thread g of T. */
LK_HD void lk_fp_words_thread(const lk_fp_args *a, uint64_t g, uint64_t T) {
    const uint64_t nw = (a->n + 7) / 8;
    uint64_t s = 0;
    for (uint64_t i = g; i < nw; i += T) s += lk_fp_mix64(lk_fp_word(a->p, a->n, i) ^ lk_fp_mix64(i ^ LK_FP_SEED));
    a->part[g] = s;
}

/* A reduction pass: thread x of X. */
LK_HD void lk_fp_sum_thread(const lk_fp_args *a, uint64_t x, uint64_t X) {
    uint64_t s = 0;
    for (uint64_t i = x; i < a->n_part; i += X) s += a->part[i];
    a->part[x] = s;
}

/* F from S and n (the host's last step). */
LK_HD uint64_t lk_fp_final(uint64_t S, uint64_t n) { return lk_fp_mix64(S ^ lk_fp_mix64(n ^ LK_FP_LEN_SEED)); }

#endif
