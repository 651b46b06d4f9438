/* core/alloc.h — the internal side of lorakit/alloc.h (not installed): the
 * failure-injection hook for lorakit's tests and fuzz targets, and the
 * carve, one allocation laid out into several arrays, for every layer.
 *
 * lk_alloc_fail_at(k) makes the k-th allocation from now fail (k >= 1), so
 * a test can walk every allocation of an operation and check for a clean
 * LK_ERR_NOMEM with nothing changed. */
#ifndef LK_CORE_ALLOC_H
#define LK_CORE_ALLOC_H

#include <stddef.h>

/* Hidden in the shared liblorakit (not part of its ABI); tests link the
 * static library, where the symbols are ordinary. */
#define LK_TEST_HOOK __attribute__((visibility("hidden")))

/* The k-th allocation after this call fails (0 disables). */
LK_TEST_HOOK void lk_alloc_fail_at(unsigned long k);
/* Allocations made since the last lk_alloc_fail_at call. */
LK_TEST_HOOK unsigned long lk_alloc_count(void);

/* The carve: the arrays of one operation from one allocation (as llm.c
 * carves its buffers). A first pass lays the parts out, each at the end of
 * the block so far, its offset rounded up to its alignment, every sum and
 * product checked; then one zeroed allocation of the whole; then each array
 * is the block plus its offset:
 *
 *     lk_carve c = {0};
 *     const size_t o_a = LK_CARVE(&c, n, double), o_b = LK_CARVE(&c, m, size_t);
 *     char *b = lk_carve_alloc(&c);            (one allocation, zeroed)
 *     if (!b) return <LK_ERR_NOMEM>;           (no memory, or c overflowed)
 *     double *a = (double *)(b + o_a);  ...    (lk_free(b) frees them all)
 *
 * Start from {0} (or {.overflow = 1} when a size worked out beforehand did
 * not fit: nothing is then allocated). Offsets are from the block's start,
 * which lk_calloc aligns for any type, so each part is aligned for its
 * own. Parts on cache lines or SIMD widths (an align over
 * alignof(max_align_t)) take lk_carve_alloc_aligned's block instead. */
typedef struct lk_carve {
    size_t bytes; /* the block's size so far (parts and their padding) */
    int overflow; /* a size did not fit in size_t or an alignment was bad: lk_carve_alloc refuses */
} lk_carve;

/* Reserves count elements of size bytes each at the end of c, at an offset
 * rounded up to align (a power of two, at most alignof(max_align_t), or at
 * most lk_carve_alloc_aligned's align, for the pointer to be aligned); returns that offset and advances c->bytes past
 * the part. count or size 0 reserves nothing (the offset is still aligned).
 * When count * size, the padding or the new total does not fit in size_t,
 * or align is not a power of two, sets c->overflow, which stays set: this
 * and every later part return 0, c->bytes becomes SIZE_MAX, and
 * lk_carve_alloc refuses. */
size_t lk_carve_part(lk_carve *c, size_t count, size_t size, size_t align);
/* lk_carve_part for count elements of type. */
#define LK_CARVE(c, count, type) lk_carve_part((c), (count), sizeof(type), _Alignof(type))
/* The block for c, zeroed (one lk_calloc of c->bytes, at least 1 byte;
 * freed with lk_free), or NULL when it has no memory; NULL without
 * allocating anything when c overflowed. */
void *lk_carve_alloc(const lk_carve *c);
/* The block for c, its start aligned to align (a power of two, at least
 * alignof(max_align_t); 64 puts it on a cache line), NOT zeroed: for a
 * block whose every part is written before it is read, where clearing
 * MBs per call would cost. One allocation (counted by lk_alloc_fail_at's
 * hook), at least align bytes, freed with lk_free; NULL when it has no
 * memory, and NULL without allocating anything when c overflowed, align
 * is bad, or c->bytes rounded up to align does not fit. */
void *lk_carve_alloc_aligned(const lk_carve *c, size_t align);

#endif
