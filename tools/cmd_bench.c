/* cmd_bench.c — `lorakit bench <name> [options]`: the benchmarks live in
 * tools/bench/ (bench.h), a library below the CLI. */
#include "cli.h"
#include "bench/bench.h"

int lk_cmd_bench(int argc, char **argv) { return lk_bench_main(argc, argv); }
