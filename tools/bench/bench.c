/* bench.c — dispatches `lorakit bench <name>` to the benchmark programs
 * listed in benches.def (one bench_<name>.c each), so a new benchmark is one
 * line there plus its file. */
#include "bench.h"

#include <stdio.h>
#include <string.h>

#include "cli_util.h"

#define LK_BENCH(name, summary) int lk_bench_##name(int argc, char **argv);
#include "benches.def"
#undef LK_BENCH

static const struct {
    const char *name;
    const char *summary;
    int (*fn)(int, char **);
} g_benches[] = {
#define LK_BENCH(name, summary) {#name, summary, lk_bench_##name},
#include "benches.def"
#undef LK_BENCH
};

static void bench_usage(FILE *f) {
    fprintf(f, "usage: lorakit bench <name> [--json] [options]\n\n"
               "Runs a benchmark; with --json, results are JSON lines on stdout.\n"
               "'lorakit bench <name> --help' lists a benchmark's options.\n\nbenchmarks:\n");
    for (size_t i = 0; i < sizeof g_benches / sizeof g_benches[0]; i++)
        fprintf(f, "  %-8s %s\n", g_benches[i].name, g_benches[i].summary);
}

int lk_bench_main(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help")) {
        bench_usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? LK_EXIT_USAGE : LK_EXIT_OK;
    }
    for (size_t i = 0; i < sizeof g_benches / sizeof g_benches[0]; i++)
        if (!strcmp(argv[1], g_benches[i].name)) return g_benches[i].fn(argc - 1, argv + 1);
    return lk_cli_usage("bench", "unknown benchmark '%s'", argv[1]);
}
