/* cmd_merge.c — `lorakit merge -l A[:S] -l B[:S] ... -o OUT`: a front-end
 * over lk_merge (argument parsing, progress, report). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "algebra_cli.h"
#include "cli.h"

static const char *const MERGE_USAGE =
    "usage: lorakit merge -l ADAPTER[:STRENGTH] [-l ...] -o OUT [options]\n\n"
    "Writes the adapter whose delta is sum_i strength_i scale_i B_i A_i over the\n"
    "union of the inputs' modules (matched by name). Default exact: the ranks\n"
    "concatenated, strengths and scales folded into B before its one rounding.\n"
    "With a rank option, each module is the Eckart-Young optimum at its rank: the\n"
    "exact thin SVD of the delta from its stacked factors (QR of both sides, Jacobi\n"
    "SVD of the R x R core, f64), never a dense matrix. LoHa, LoKr, Tucker and conv\n"
    "modules are taken in exact low-rank form; DoRA, dense diffs, biases and\n"
    "modules_to_save are refused by name. One alpha per file (--rank K: K), written\n"
    "explicitly; the report gives per module and in total rel_fro (the exact\n"
    "relative Frobenius error of the file as written, dtype and alpha included),\n"
    "rel_fro_opt (the optimum at that rank) and rel_spec (spectral). The bytes do\n"
    "not depend on the order of -l, --threads or the CPU.\n\n"
    "options:\n"
    "  -l, --lora ADAPTER[:STRENGTH]  an input (PEFT folder, kohya / diffusers /\n"
    "                         LyCORIS file); STRENGTH defaults to 1.0 (repeatable)\n"
    LK_ALG_CLI_HELP;

/* "path[:strength]" (the text after the last ':' is a strength when it parses
 * whole and the whole argument is not an existing path). 0: usage error printed. */
int lk_alg_cli_input(const char *cmd, char *arg, lk_algebra_input *in) {
    struct stat sb;
    in->path = arg;
    in->strength = 1.0;
    char *c = strrchr(arg, ':');
    double v;
    if (c && c != arg && !strchr(c, '/') && stat(arg, &sb) != 0) {
        if (lk_fuse_strength_parse(c + 1, &v) != LK_OK) {
            lk_cli_usage(cmd, "-l '%s': %s", arg, lk_last_error());
            return 0;
        }
        *c = '\0';
        in->strength = v;
    }
    if (!in->path[0]) {
        lk_cli_usage(cmd, "empty adapter path in '%s'", arg);
        return 0;
    }
    return 1;
}

int lk_cmd_merge(int argc, char **argv) {
    if (lk_cli_wants_help(argc, argv)) {
        fputs(MERGE_USAGE, stdout);
        return LK_EXIT_OK;
    }
    lk_alg_cli c = {0};
    lk_algebra_input *in = calloc((size_t)argc, sizeof *in);
    size_t n = 0;
    int rc = LK_EXIT_USAGE, r;
    if (!in) {
        fprintf(stderr, "lorakit: out of memory\n");
        return LK_EXIT_FAIL;
    }
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-l") || !strcmp(a, "--lora")) {
            if (i + 1 >= argc) {
                lk_cli_usage("merge", "%s needs ADAPTER[:STRENGTH]", a);
                goto done;
            }
            if (!lk_alg_cli_input("merge", argv[++i], &in[n++])) goto done;
        } else if ((r = lk_alg_cli_option("merge", argc, argv, &i, &c)) != 0) {
            if (r < 0) goto done;
        } else {
            lk_cli_usage("merge", "unexpected argument '%s' (inputs are given with -l)", a);
            goto done;
        }
    }
    if (!n) {
        lk_cli_usage("merge", "at least one -l ADAPTER[:STRENGTH] is needed");
        goto done;
    }
    if (!c.out) {
        lk_cli_usage("merge", "missing -o OUT");
        goto done;
    }
    lk_alg_cli_progress(&c);
    char *report = NULL;
    lk_status s = lk_merge(in, n, c.out, &c.o, &report);
    rc = lk_alg_cli_finish(&c, s, report);
done:
    free(in);
    return rc;
}
