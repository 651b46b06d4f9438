/* core/alloc.h — the failure-injection hook of lorakit/alloc.h (internal:
 * for lorakit's tests and fuzz targets, not installed). lk_alloc_fail_at(k)
 * makes the k-th allocation from now fail (k >= 1), so a test can walk every
 * allocation of an operation and check for a clean LK_ERR_NOMEM with nothing
 * changed. */
#ifndef LK_CORE_ALLOC_H
#define LK_CORE_ALLOC_H

/* Hidden in the shared liblorakit (not part of its ABI); tests link the
 * static library, where the symbols are ordinary. */
#define LK_TEST_HOOK __attribute__((visibility("hidden")))

/* The k-th allocation after this call fails (0 disables). */
LK_TEST_HOOK void lk_alloc_fail_at(unsigned long k);
/* Allocations made since the last lk_alloc_fail_at call. */
LK_TEST_HOOK unsigned long lk_alloc_count(void);

#endif
