/* bench.h — the benchmarks of `lorakit bench` as a library the CLI calls
 * (tools/bench/, below tools/: the benches include cli_util.h, never the
 * CLI's own headers). */
#ifndef LK_TOOLS_BENCH_BENCH_H
#define LK_TOOLS_BENCH_BENCH_H

/* `lorakit bench <name> [options]`: argv[0] is "bench", argv[1] the
 * benchmark's name (benches.def); returns the exit code. */
int lk_bench_main(int argc, char **argv);

#endif
