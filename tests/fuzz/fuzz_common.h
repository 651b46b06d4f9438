/* fuzz_common.h — shared plumbing of the libFuzzer targets in tests/fuzz/.
 *
 * Each target is one file fuzz_<name>.c defining
 *     static void fz_<name>(const uint8_t *data, size_t size);
 * and ending with LK_FUZZ_MAIN(fz_<name>). Built by tests/fuzz/CMakeLists.txt
 * (clang, LK_FUZZ_ENTRY defined) it becomes a libFuzzer binary; the ctest
 * tests/test_fuzz_regress.c #includes the same files (gcc, no LK_FUZZ_ENTRY)
 * and replays the corpora and every past crash through the same function, so
 * a regression input exercises exactly the code the fuzzer ran.
 *
 * FZ_CHECK states an invariant of a parser's result (a tensor lies inside
 * the file, a module's shapes agree, ...): a violation aborts, which
 * libFuzzer records as a crash; the regression test overrides it with a
 * cmocka assertion. fz_clean_error checks that a refused input came with a
 * real status and a message, which is the promise to users.
 *
 * Parsers that only take a path are fed through fz_write_tmp: one private
 * directory per process (in /dev/shm when present: no disk traffic), removed
 * at exit. */
#ifndef LK_FUZZ_COMMON_H
#define LK_FUZZ_COMMON_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include "lorakit/lorakit.h"
#include "core/alloc.h"
#include "app/model.h"
#include "app/task.h"

#ifndef FZ_CHECK
#define FZ_CHECK(cond)                                                              \
    do {                                                                            \
        if (!(cond)) {                                                              \
            fprintf(stderr, "fuzz invariant failed: %s (%s:%d)\n", #cond, __FILE__, \
                    __LINE__);                                                      \
            abort();                                                                \
        }                                                                           \
    } while (0)
#endif

/* LK_FUZZ_VERBOSE=1 prints every refusal (to see what seeds hit). */
static inline int fz_verbose(void) {
    static int v = -1;
    if (v < 0) v = getenv("LK_FUZZ_VERBOSE") != NULL;
    return v;
}

/* A refusal must be a real error code with a message saying why. */
static inline void fz_clean_error(lk_status s) {
    if (fz_verbose()) fprintf(stderr, "refused: %s: %s\n", lk_status_str(s), lk_last_error());
    FZ_CHECK(s > LK_OK && s < LK_STATUS_COUNT);
    FZ_CHECK(lk_last_error() != NULL && lk_last_error()[0] != '\0');
}

/* Reads every byte of a view so ASan proves it lies inside live memory.
 * The empty asm consumes the result so the loop is not optimised away. */
static inline void fz_touch(const void *p, size_t n) {
    const uint8_t *b = p;
    uint8_t acc = 0;
    for (size_t i = 0; i < n; i++) acc ^= b[i];
    __asm__ volatile("" : : "r"(acc));
}

static char fz_dir[256];

static int fz_rm_cb(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb;
    (void)flag;
    (void)ftw;
    return remove(p);
}

static void fz_cleanup(void) {
    if (fz_dir[0]) nftw(fz_dir, fz_rm_cb, 8, FTW_DEPTH | FTW_PHYS);
}

/* The process's scratch directory (created on first use). */
static inline const char *fz_tmpdir(void) {
    if (!fz_dir[0]) {
        struct stat sb;
        const char *base = getenv("TMPDIR");
        if (!base || !*base) base = stat("/dev/shm", &sb) == 0 ? "/dev/shm" : "/tmp";
        snprintf(fz_dir, sizeof fz_dir, "%s/lkfuzz.XXXXXX", base);
        if (!mkdtemp(fz_dir)) {
            perror("fuzz: mkdtemp");
            abort();
        }
        atexit(fz_cleanup);
    }
    return fz_dir;
}

/* Writes data to <scratch>/<name> (replacing it); returns the path in a
 * static buffer slot (two slots, so two paths can be live at once). */
static inline const char *fz_write_tmp(const char *name, const void *data, size_t n) {
    static char paths[2][512];
    static int slot;
    char *p = paths[slot++ & 1];
    snprintf(p, sizeof paths[0], "%s/%s", fz_tmpdir(), name);
    FILE *f = fopen(p, "wb");
    if (!f || (n && fwrite(data, 1, n, f) != n) || fclose(f) != 0) {
        perror("fuzz: write scratch file");
        abort();
    }
    return p;
}

/* Makes <scratch>/<name>/ (a folder input such as a PEFT adapter). */
static inline const char *fz_mkdir_tmp(const char *name) {
    static char p[512];
    snprintf(p, sizeof p, "%s/%s", fz_tmpdir(), name);
    if (mkdir(p, 0755) != 0 && access(p, F_OK) != 0) {
        perror("fuzz: mkdir scratch");
        abort();
    }
    return p;
}

#ifdef LK_FUZZ_ENTRY
int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
#define LK_FUZZ_MAIN(fn)                                             \
    int LLVMFuzzerInitialize(int *argc, char ***argv) {              \
        (void)argc;                                                  \
        (void)argv;                                                  \
        if (!getenv("LORAKIT_LOG")) lk_log_set_level(LK_LOG_ERROR);  \
        return 0;                                                    \
    }                                                                \
    int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {   \
        fn(data, size);                                              \
        return 0;                                                    \
    }
#else
#define LK_FUZZ_MAIN(fn)
#endif

#endif
