/* test_fuzz_regress.c — replays the fuzz corpora and every past crash
 * through the real parsers, in the ordinary (gcc, and ASan) test builds.
 *
 * The fuzz targets in tests/fuzz/fuzz_<name>.c are #included here, so each
 * input runs through exactly the function libFuzzer ran, with the same
 * invariant checks (FZ_CHECK becomes a cmocka assertion). For every target:
 *   - each file of tests/fuzz/corpus/<name>/ (real-shaped seeds) and of
 *     tests/fuzz/regress/<name>/ (minimised crashes, kept forever) must give
 *     a clean result: accepted with valid invariants, or a status + message;
 *   - each seed is replayed again with the k-th allocation failing, for every
 *     k up to the number of allocations the input needs: every run must end
 *     with a clean status (LK_ERR_NOMEM or the input's own error), never a
 *     crash, and under `make test-asan` never a leak (LSan checks at exit).
 * The expectation is independent of the parsers' code: it is the format's
 * rules (written in the targets) and "no crash, no leak, a message". */
#include <dirent.h>
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include "testutil.h"

/* Invariant failures fail the test (with the expression) instead of abort. */
#define FZ_CHECK(cond) assert_true(cond)
#include "fuzz/fuzz_safetensors.c"
#include "fuzz/fuzz_yaml.c"
#include "fuzz/fuzz_adapter.c"
#include "fuzz/fuzz_adapter_config.c"
#include "fuzz/fuzz_plan.c"
#include "fuzz/fuzz_ckpt_index.c"
#include "fuzz/fuzz_family.c"
#include "fuzz/fuzz_out_record.c"

typedef void (*fz_fn)(const uint8_t *, size_t);

typedef struct {
    const char *name;
    fz_fn fn;
} fz_target;

static const fz_target g_targets[] = {
    {"safetensors", fz_safetensors},
    {"yaml", fz_yaml},
    {"adapter", fz_adapter},
    {"adapter_config", fz_adapter_config},
    {"plan", fz_plan},
    {"ckpt_index", fz_ckpt_index},
    {"family", fz_family},
    {"out_record", fz_out_record},
};

/* Calls cb(path) for every regular file of dir (sorted); returns the count.
 * A missing directory counts as empty (a target may have no crashes yet). */
static size_t for_each_file(const char *dir, void (*cb)(const fz_target *, const char *),
                            const fz_target *t) {
    struct dirent **list = NULL;
    int n = scandir(dir, &list, NULL, alphasort);
    if (n < 0) return 0;
    size_t count = 0;
    for (int i = 0; i < n; i++) {
        if (list[i]->d_name[0] != '.') {
            char *p = tu_path(dir, list[i]->d_name);
            struct stat sb;
            if (stat(p, &sb) == 0 && S_ISREG(sb.st_mode)) {
                cb(t, p);
                count++;
            }
            free(p);
        }
        free(list[i]);
    }
    free(list);
    return count;
}

static void replay(const fz_target *t, const char *path) {
    size_t n;
    uint8_t *data = tu_read_file(path, &n);
    assert_non_null(data);
    lk_alloc_fail_at(0);
    t->fn(data, n);
    free(data);
}

/* Replays path with allocation k failing, for k = 1, 2, ... until a run
 * makes fewer than k allocations (then every allocation has been failed). */
static unsigned long g_injected; /* failures injected by replay_nomem */

static void replay_nomem(const fz_target *t, const char *path) {
    size_t n;
    uint8_t *data = tu_read_file(path, &n);
    assert_non_null(data);
    for (unsigned long k = 1;; k++) {
        lk_alloc_fail_at(k);
        t->fn(data, n);
        unsigned long made = lk_alloc_count();
        lk_alloc_fail_at(0);
        if (made < k) break;
        g_injected++;
        assert_true(k < 100000); /* a parse of a seed never needs this many */
    }
    free(data);
}

static char *target_dir(const char *kind, const char *name) {
    char *base = tu_path(LK_TEST_SRC_DIR "/tests/fuzz", kind);
    char *d = tu_path(base, name);
    free(base);
    return d;
}

static void test_corpus_and_regress(void **state) {
    (void)state;
    for (size_t i = 0; i < sizeof g_targets / sizeof g_targets[0]; i++) {
        char *corpus = target_dir("corpus", g_targets[i].name);
        char *regress = target_dir("regress", g_targets[i].name);
        size_t seeds = for_each_file(corpus, replay, &g_targets[i]);
        size_t crashes = for_each_file(regress, replay, &g_targets[i]);
        /* A target without seeds means the corpus went missing. */
        assert_true(seeds > 0);
        print_message("fuzz regress %s: %zu seeds, %zu regression inputs clean\n",
                      g_targets[i].name, seeds, crashes);
        free(corpus);
        free(regress);
    }
}

/* The allocation-failure walk is quadratic in a seed's allocations: every
 * adapter resolve loads every shipped family table (about 500 rules, ~1000
 * allocations), so an adapter seed made ~9000 allocations and its walk ~9000
 * runs of ~9000 allocations (75 s Release, over 300 s ASan). The walk runs
 * with LORAKIT_FAMILIES_DIR set to a folder holding one shipped table: every
 * allocation of the adapter reader, the resolver and the table loader is
 * still failed once; the parser of the other tables' lines is the same code,
 * and its own failure walk is the family target's (tests/fuzz/corpus/family),
 * while test_corpus_and_regress above replays every seed with all tables. */
static char *one_table_dir(void) {
    char *dir = tu_mkdtemp();
    char *src = tu_path(LK_TEST_SRC_DIR "/data/families", "openclip.lkmap");
    char *dst = tu_path(dir, "openclip.lkmap");
    size_t n;
    void *text = tu_read_file(src, &n);
    assert_non_null(text);
    assert_int_equal(tu_write_file(dst, text, n), 0);
    free(text);
    free(src);
    free(dst);
    return dir;
}

static void test_seeds_under_allocation_failure(void **state) {
    (void)state;
    char *tables = one_table_dir();
    assert_int_equal(setenv("LORAKIT_FAMILIES_DIR", tables, 1), 0);
    for (size_t i = 0; i < sizeof g_targets / sizeof g_targets[0]; i++) {
        char *corpus = target_dir("corpus", g_targets[i].name);
        char *regress = target_dir("regress", g_targets[i].name);
        g_injected = 0;
        for_each_file(corpus, replay_nomem, &g_targets[i]);
        for_each_file(regress, replay_nomem, &g_targets[i]);
        print_message("fuzz regress %s: %lu injected allocation failures, all clean\n",
                      g_targets[i].name, g_injected);
        free(corpus);
        free(regress);
    }
    unsetenv("LORAKIT_FAMILIES_DIR");
    tu_rmtree(tables);
    free(tables);
}

int main(void) {
    lk_log_set_level(LK_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_corpus_and_regress),
        cmocka_unit_test(test_seeds_under_allocation_failure),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
