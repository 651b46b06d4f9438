/* core/rand.h — the counter-based generator behind LoRA's seeded init
 * (lk_lora_rand_uniform, _lorakit.rand_uniform) and extract's test matrices:
 * value i of the stream (seed, name) is a pure function of the three, so any
 * layer, thread or process draws the same numbers in any order. Internal. */
#ifndef LK_CORE_RAND_H
#define LK_CORE_RAND_H

#include <stddef.h>
#include <stdint.h>

/* dst[k] = bound * (2u - 1) for stream index i = first + k: key =
 * XXH3-64(name) seeded with seed, u = top 24 bits of splitmix64(key + (i + 1)
 * * 0x9E3779B97F4A7C15) / 2^24 (exact in f32). */
void lk_rand_uniform_at(float *dst, size_t first, size_t n, uint64_t seed, const char *name, float bound);

#endif
