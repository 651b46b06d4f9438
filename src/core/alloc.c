/* alloc.c — allocation with an injectable failure for tests, and the carve
 * (one allocation laid out into arrays, core/alloc.h).
 * The counter is atomic so multi-threaded fuse code can share it; the hook
 * costs one relaxed atomic per allocation, negligible next to malloc. */
#include "lorakit/alloc.h"
#include "core/alloc.h"

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static atomic_ulong g_count;
static atomic_ulong g_fail_at;

void lk_alloc_fail_at(unsigned long k) {
    atomic_store(&g_count, 0);
    atomic_store(&g_fail_at, k);
}

unsigned long lk_alloc_count(void) { return atomic_load(&g_count); }

static int should_fail(void) {
    unsigned long n = atomic_fetch_add(&g_count, 1) + 1;
    unsigned long k = atomic_load_explicit(&g_fail_at, memory_order_relaxed);
    return k != 0 && n == k;
}

void *lk_malloc(size_t n) {
    if (should_fail()) return NULL;
    return malloc(n ? n : 1);
}

void *lk_calloc(size_t count, size_t size) {
    size_t total;
    if (!lk_checked_mul(count, size, &total)) return NULL;
    if (should_fail()) return NULL;
    return calloc(total ? total : 1, 1);
}

void *lk_realloc(void *p, size_t n) {
    if (should_fail()) return NULL;
    return realloc(p, n ? n : 1);
}

void lk_free(void *p) { free(p); }

char *lk_strdup(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = lk_malloc(n);
    if (d) memcpy(d, s, n);
    return d;
}

int lk_checked_mul(size_t a, size_t b, size_t *out) {
    if (a != 0 && b > SIZE_MAX / a) return 0;
    *out = a * b;
    return 1;
}

int lk_checked_add(size_t a, size_t b, size_t *out) {
    if (b > SIZE_MAX - a) return 0;
    *out = a + b;
    return 1;
}

size_t lk_carve_part(lk_carve *c, size_t count, size_t size, size_t align) {
    size_t at, len;
    if (c->overflow || !align || (align & (align - 1)) || !lk_checked_add(c->bytes, align - 1, &at) ||
        !lk_checked_mul(count, size, &len) || !lk_checked_add(at & ~(align - 1), len, &c->bytes)) {
        c->overflow = 1;
        c->bytes = SIZE_MAX;
        return 0;
    }
    return at & ~(align - 1);
}

void *lk_carve_alloc(const lk_carve *c) { return c->overflow ? NULL : lk_calloc(1, c->bytes); }

void *lk_carve_alloc_aligned(const lk_carve *c, size_t align) {
    size_t n;
    if (c->overflow || align < _Alignof(max_align_t) || (align & (align - 1)) ||
        !lk_checked_add(c->bytes ? c->bytes : 1, align - 1, &n))
        return NULL;
    if (should_fail()) return NULL;
    return aligned_alloc(align, n & ~(align - 1)); /* C11: the size a multiple of align; lk_free frees it */
}
