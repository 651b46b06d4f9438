/* rand.c — see rand.h. One definition of the stream, so extract's test
 * matrix and the training init can never drift apart. */
#include "core/rand.h"

#include <string.h>
#include <xxhash.h>

static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

void lk_rand_uniform_at(float *dst, size_t first, size_t n, uint64_t seed, const char *name, float bound) {
    uint64_t key = XXH3_64bits_withSeed(name, strlen(name), seed);
    for (size_t k = 0; k < n; k++) {
        uint64_t z = mix64(key + (uint64_t)(first + k + 1) * 0x9E3779B97F4A7C15ull);
        float u = (float)(z >> 40) * (1.0f / 16777216.0f); /* [0, 1), exact in f32 */
        dst[k] = bound * (2.0f * u - 1.0f);
    }
}
