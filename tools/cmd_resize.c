/* cmd_resize.c — `lorakit resize IN -o OUT [--rank K | --err E | ...]`: a
 * front-end over lk_resize (merge of one input at strength 1). */
#include <stdio.h>
#include <string.h>

#include "algebra_cli.h"
#include "cli.h"

static const char *const RESIZE_USAGE =
    "usage: lorakit resize IN -o OUT [--rank K | --err E | --fro F | --ratio R] [options]\n\n"
    "Writes IN at another rank: each module the Eckart-Young optimum at its rank,\n"
    "from the exact thin SVD of its delta (QR of both factors, Jacobi SVD of the\n"
    "r x r core, f64; never a dense matrix). LoHa, LoKr, Tucker and conv modules\n"
    "are taken in exact low-rank form first; DoRA, dense diffs and biases are\n"
    "refused by name. No rank option: the same adapter, alpha made explicit. The\n"
    "report (--json, --report) gives rel_fro of the file as written (dtype and\n"
    "alpha included), rel_fro_opt and rel_spec, per module and in total.\n\n"
    "options:\n"
    LK_ALG_CLI_HELP;

int lk_cmd_resize(int argc, char **argv) {
    if (lk_cli_wants_help(argc, argv)) {
        fputs(RESIZE_USAGE, stdout);
        return LK_EXIT_OK;
    }
    lk_alg_cli c = {0};
    const char *in = NULL;
    int r;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if ((r = lk_alg_cli_option("resize", argc, argv, &i, &c)) != 0) {
            if (r < 0) return LK_EXIT_USAGE;
        } else if (a[0] == '-' && a[1]) {
            return lk_cli_usage("resize", "unknown option '%s'", a);
        } else if (in) {
            return lk_cli_usage("resize", "one IN expected, got '%s' and '%s'", in, a);
        } else {
            in = a;
        }
    }
    if (!in) return lk_cli_usage("resize", "missing IN");
    if (!c.out) return lk_cli_usage("resize", "missing -o OUT");
    lk_alg_cli_progress(&c);
    char *report = NULL;
    lk_status s = lk_resize(in, c.out, &c.o, &report);
    return lk_alg_cli_finish(&c, s, report);
}
