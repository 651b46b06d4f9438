/* testutil.h — helpers shared by the tests: temp dirs, files, a seeded RNG,
 * running the CLI. Include after <cmocka.h>'s prerequisites. */
#ifndef LK_TESTS_TESTUTIL_H
#define LK_TESTS_TESTUTIL_H

#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include "lorakit/lorakit.h"
#include "core/alloc.h" /* lk_alloc_fail_at, lk_alloc_count */
#include "app/model.h"
#include "app/task.h"

/* The digest of a safetensors file (lk_digest_st of its tensors); LK_OK or
 * the open/digest status. */
lk_status tu_file_digest(const char *path, char hex[LK_DIGEST_HEX]);

/* A fresh directory under $TMPDIR (or /tmp); removed by tu_rmtree. */
char *tu_mkdtemp(void);
void tu_rmtree(const char *dir);
/* Joins dir and name into a static-free malloc'd string. */
char *tu_path(const char *dir, const char *name);
int tu_write_file(const char *path, const void *data, size_t n);
/* Reads a whole file (malloc'd); NULL on error. */
void *tu_read_file(const char *path, size_t *n);
int tu_exists(const char *path);

/* splitmix64: deterministic test data. */
typedef struct { uint64_t s; } tu_rng;
uint64_t tu_next(tu_rng *r);
/* Uniform in [lo, hi). */
float tu_uniform(tu_rng *r, float lo, float hi);

/* Runs `$LORAKIT_BIN args...` through /bin/sh, capturing stdout and stderr
 * (malloc'd, may be NULL). Returns the exit code. */
int tu_run_cli(char **out, char **err, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* tu_run_cli, then asserts the exit code is want, that stdout holds in_out
 * and stderr in_err (each NULL: not checked), and that stderr lacks absent
 * (NULL: nothing). */
void tu_cli_expect(int want, const char *in_out, const char *in_err, const char *absent, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

/* Asserts that haystack contains needle, printing both when it does not. */
#define tu_assert_contains(hay, needle) \
    tu_assert_contains_((hay), (needle), __FILE__, __LINE__)
void tu_assert_contains_(const char *hay, const char *needle, const char *file, int line);

#endif
