/* lorakit/alloc.h — the allocator every lorakit module uses.
 *
 * All library allocations go through lk_malloc/lk_calloc/lk_realloc/lk_free,
 * so that lorakit's own tests can make any one of them fail (the hook is in
 * the internal header src/core/alloc.h, not part of the API). Memory a
 * lorakit function hands to the caller is released with lk_free. */
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

#ifdef __cplusplus
}
#endif
#endif
