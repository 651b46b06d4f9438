/* algebra_cli.h — what merge, resize (and later extract, convert) share:
 * the rank, format, dtype and output options, the report and progress. */
#ifndef LK_TOOLS_ALGEBRA_CLI_H
#define LK_TOOLS_ALGEBRA_CLI_H

#include "lorakit/algebra.h"

typedef struct lk_alg_cli {
    lk_algebra_opts o;
    const char *out, *report;
    int json;
    int bar_last; /* last drawn permille */
} lk_alg_cli;

/* The common option at argv[*i] into c: 1 taken (value too: *i advanced),
 * 0 not one of them, -1 after printing a usage error. */
int lk_alg_cli_option(const char *cmd, int argc, char **argv, int *i, lk_alg_cli *c);
/* -l's "path[:strength]" into *in (arg is modified); 0 after a usage error. */
int lk_alg_cli_input(const char *cmd, char *arg, lk_algebra_input *in);
/* Runs after parsing: progress on a terminal; then, given the report,
 * writes --report, prints --json or a summary line. Returns the exit code. */
void lk_alg_cli_progress(lk_alg_cli *c);
int lk_alg_cli_finish(const lk_alg_cli *c, lk_status s, char *report);

#define LK_ALG_CLI_HELP                                                                      \
    "  -o, --out OUT          output: a .safetensors file (kohya, diffusers), a folder\n"   \
    "                         (PEFT: adapter_model.safetensors + adapter_config.json)\n"    \
    "  --rank K               keep the K largest singular values of every module\n"         \
    "  --err E                the least rank whose relative Frobenius error is <= E\n"      \
    "  --fro F                the least rank keeping a fraction >= F of ||delta||_F\n"      \
    "  --ratio R              keep singular values >= R x the module's largest\n"           \
    "  --max-rank K           cap for --err, --fro and --ratio\n"                           \
    "  --conv-rank K          the rank (cap) of conv modules (kernel > 1x1)\n"              \
    "                         none of these: exact (ranks concatenated)\n"                  \
    "  --format F             output naming: kohya, peft, diffusers (default: the first\n"  \
    "                         input's)\n"                                                   \
    "  --dtype D              F32, F16 or BF16 (default: the widest input factor dtype)\n"  \
    "  --threads N            threads (default 0 = all cores); the bytes do not depend\n"   \
    "                         on it\n"                                                      \
    "  --report FILE.json     write the report (JSON) to FILE.json\n"                       \
    "  --json                 print the report on stdout\n"                                 \
    "  -h, --help             this text\n"

#endif
