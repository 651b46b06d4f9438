/* cli_util.h — what every lorakit program shares, the subcommands in tools/
 * and the benchmarks in tools/bench/ alike: exit codes, error and usage
 * reporting, strict number parsing. It sits below both, so neither includes
 * the other's headers: tools/ -> tools/bench/ -> tools/util/, no cycle.
 * Exit codes: 0 success, 1 the operation failed, 2 bad usage. Every error is
 * printed once, as "lorakit: <message>" on stderr. */
#ifndef LK_TOOLS_UTIL_CLI_UTIL_H
#define LK_TOOLS_UTIL_CLI_UTIL_H

#define LK_EXIT_OK 0
#define LK_EXIT_FAIL 1
#define LK_EXIT_USAGE 2

/* Prints "lorakit: <lk_last_error()>" and returns LK_EXIT_FAIL. */
int lk_cli_fail(void);
/* Prints "lorakit: <msg>" plus a hint to --help; returns LK_EXIT_USAGE. */
int lk_cli_usage(const char *cmd, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* 1 if argv holds -h or --help. */
int lk_cli_wants_help(int argc, char **argv);
/* Parses a strictly decimal int / double; returns 0 on failure. */
int lk_cli_parse_int(const char *s, long *out);
int lk_cli_parse_double(const char *s, double *out);

#include "lorakit/comm.h"
/* --timeout SECONDS: a number within LK_KNOB_TIMEOUT_S's bounds (0 = none);
 * returns 0 on failure. */
int lk_cli_parse_timeout(const char *s, double *out);
/* A printf format piece: one %d, LK_KNOB_TIMEOUT_S_DEFAULT. */
#define LK_CLI_TIMEOUT_HELP                                                              \
    "  --timeout S     seconds a collective may wait for the other ranks (default\n"    \
    "                  %d; 0 = none); on expiry every waiting rank prints which\n"     \
    "                  collective and which ranks it waited for, and the job is\n"      \
    "                  aborted (MPI_Abort: a collective cannot be cancelled)\n"
/* After LK_ERR_TIMEOUT (lk_last_error() holds the report): prints
 * "lorakit: rank R: <report>" on this rank (every rank that can act does),
 * waits 2 s (the other waiting ranks' reports get out), then ends the
 * whole job with exit code 1 (lk_comm_abort); returns LK_EXIT_FAIL only
 * where the backend cannot abort. */
int lk_cli_timeout_abort(lk_comm *c);

#include "lorakit/fuse.h"
#include "lorakit/device.h"
/* --device cpu|cuda[:N]|emul at argv[*i]: 1 when taken (*i advanced, *d
 * set), 0 when argv[*i] is not --device, -1 after a usage error. Whether
 * the device is there is checked later (exit 1, not usage). */
int lk_cli_device_option(const char *cmd, int argc, char **argv, int *i, lk_device *d);
#define LK_CLI_DEVICE_HELP                                                               \
    "  --device D             cpu (default), cuda, cuda:N or emul (the emulated\n"       \
    "                         device: the CUDA kernel's own code run on the CPU);\n"     \
    "                         the same bytes on every device\n"
/* The FP8 options of fuse at argv[*i]: --fp8-rounding nearest|stochastic,
 * --fp8-seed N, --fp8-scale rescale|keep, --fp8-saturate. Returns 1 when it
 * took the option (and its value: *i advanced), 0 when argv[*i] is not one,
 * -1 after printing a usage error. */
int lk_cli_fp8_option(const char *cmd, int argc, char **argv, int *i, lk_fp8_opts *o);
/* Their --help lines. */
#define LK_CLI_FP8_HELP                                                                  \
    "  --fp8-rounding R       FP8 weights: nearest (default; ties to even) or\n"         \
    "                         stochastic (reproducible: seeded per tensor/element)\n"    \
    "  --fp8-seed N           stochastic rounding's seed (default 0)\n"                 \
    "  --fp8-scale M          rescale (default: new scale from the fused values,\n"     \
    "                         LTX-2's formula) or keep the weight's scale\n"            \
    "  --fp8-saturate         clamp values beyond the FP8 range instead of failing\n"
/* --alpha-from's --help lines (fuse, swap, inspect). */
#define LK_CLI_ALPHA_FROM_HELP                                                             \
    "  --alpha-from S         where a file's alpha comes from when it holds more than\n" \
    "                         one source: tensors (the .alpha tensors, else r) or\n"     \
    "                         metadata (lora_adapter_metadata, else kohya's\n"           \
    "                         ss_network_alpha, else .alpha, else r). Default: .alpha,\n" \
    "                         else lora_adapter_metadata, else r; .alpha tensors and\n"  \
    "                         lora_adapter_metadata that disagree are an error\n"

/* --convention, shared by fuse, swap and inspect. */
#define LK_CLI_CONVENTION_HELP                                                              \
    "  --convention C         whose rules decide where the tools disagree (DoRA's norm,\n"  \
    "                         epsilon and strength, set_weight at strength != 1, alpha 0,\n" \
    "                         alpha in metadata; README \"Conventions\"): lorakit\n"        \
    "                         (default), comfyui (ComfyUI's loader), lycoris (LyCORIS's\n"  \
    "                         forward) or peft (PEFT's merge)\n"

#endif
