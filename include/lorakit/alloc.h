/* lorakit/alloc.h — the allocator every lorakit module uses.
 *
 * All library allocations go through lk_malloc/lk_calloc/lk_realloc/lk_free so
 * that tests can inject failures: lk_alloc_fail_at(k) makes the k-th
 * allocation from now fail (k >= 1), letting a test walk every allocation of
 * an operation and check for a clean LK_ERR_NOMEM with nothing changed. */
#ifndef LORAKIT_ALLOC_H
#define LORAKIT_ALLOC_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

void *lk_malloc(size_t n);
void *lk_calloc(size_t count, size_t size); /* overflow-checked */
void *lk_realloc(void *p, size_t n);
void lk_free(void *p);
char *lk_strdup(const char *s);
/* *out = a*b; returns 1 when it fits in size_t, 0 on overflow. */
int lk_checked_mul(size_t a, size_t b, size_t *out);
/* *out = a+b; returns 1 when it fits, 0 on overflow. */
int lk_checked_add(size_t a, size_t b, size_t *out);

/* Test hook: the k-th allocation after this call fails (0 disables). */
void lk_alloc_fail_at(unsigned long k);
/* Allocations made since the last lk_alloc_fail_at call. */
unsigned long lk_alloc_count(void);

#ifdef __cplusplus
}
#endif
#endif
