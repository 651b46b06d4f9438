/* cmd_extract.c — `lorakit extract BASE TUNED -o OUT (--rank K | --err E)`:
 * a front-end over lk_extract (the common algebra options from
 * algebra_cli.c, extract's own here). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "algebra_cli.h"
#include "cli.h"

static const char *const EXTRACT_USAGE =
    "usage: lorakit extract BASE TUNED -o OUT (--rank K | --err E) [options]\n\n"
    "Writes a LoRA of TUNED - BASE (two safetensors checkpoints, single files,\n"
    "sharded indexes or folders): one module per changed 2-D or 4-D F32/F16/BF16\n"
    "weight \"<m>.weight\" (conv kernels as their [out, in kh kw] unfolding), the\n"
    "weights streamed from the files one at a time per thread. Each delta D is\n"
    "sketched by randomized subspace iteration (Halko-Martinsson-Tropp): Y = D Omega\n"
    "with Omega uniform from (--seed, weight name), QR after every product, --power\n"
    "iterations, then the exact f64 SVD of the small Q^T D. --err grows the sketch\n"
    "block by block until the exact residual meets E. The report (--json, --report)\n"
    "gives per module rel_fro of the file as written (exact, f64, dtype and alpha\n"
    "included), rel_fro_opt: a proven lower bound of the optimum at that rank\n"
    "(exact with --exact-svd), rel_fro_opt_upper, and lists the weights unchanged,\n"
    "excluded, not extractable (with the reason) and present in one file only.\n"
    "A weight whose shape or dtype differs between the files is an error. The\n"
    "bytes do not depend on --threads.\n\n"
    "options:\n"
    "  -o, --out OUT          a .safetensors file (diffusers names unless --format),\n"
    "                         or a folder (PEFT: adapter_model.safetensors +\n"
    "                         adapter_config.json; the default for a name without\n"
    "                         .safetensors)\n"
    "  --rank K               rank K for every module (the file's alpha: K)\n"
    "  --err E                per module, the least rank with relative Frobenius error\n"
    "                         <= E (alpha: --max-rank, else 1)\n"
    "  --max-rank K           cap for --err\n"
    "  --conv-rank K          the rank (cap) of conv modules (kernel > 1x1)\n"
    "  --include RE           extract only weights whose name matches RE (PCRE2,\n"
    "                         searched anywhere; repeatable: any of them)\n"
    "  --exclude RE           leave out weights whose name matches RE (repeatable)\n"
    "  --seed N               the test matrix's seed (default 0)\n"
    "  --oversample P         sketch columns beyond the rank (default 8); --err grows\n"
    "                         the sketch in blocks of 2P\n"
    "  --power T              power iterations (default 2)\n"
    "  --exact-svd            the exact f64 SVD of every delta (slow: small weights,\n"
    "                         checks)\n"
    "  --format F             output naming: kohya, peft, diffusers\n"
    "  --dtype D              F32, F16 or BF16 (default: the weights' dtype)\n"
    "  --threads N            threads (default 0 = all cores)\n"
    "  --report FILE.json     write the report (JSON) to FILE.json\n"
    "  --json                 print the report on stdout\n"
    "  -h, --help             this text\n";

/* A pattern list option: appends v. */
static int add_pat(const char ***list, size_t *n, const char *v) {
    const char **p = realloc(*list, (*n + 1) * sizeof *p);
    if (!p) return 0;
    p[(*n)++] = v;
    *list = p;
    return 1;
}

/* Extract's own option at argv[*i]: 1 taken, 0 not one, -1 usage error printed. */
static int own_option(int argc, char **argv, int *i, lk_extract_opts *o, const char ***inc, const char ***exc) {
    const char *a = argv[*i];
    if (!strcmp(a, "--exact-svd")) return o->exact_svd = 1;
    int valued = !strcmp(a, "--include") || !strcmp(a, "--exclude") || !strcmp(a, "--seed") ||
                 !strcmp(a, "--oversample") || !strcmp(a, "--power");
    if (!valued) return 0;
    if (*i + 1 >= argc) return lk_cli_usage("extract", "%s needs a value", a), -1;
    const char *v = argv[++*i];
    if (!strcmp(a, "--include")) return add_pat(inc, &o->n_include, v) ? 1 : (lk_cli_usage("extract", "out of memory"), -1);
    if (!strcmp(a, "--exclude")) return add_pat(exc, &o->n_exclude, v) ? 1 : (lk_cli_usage("extract", "out of memory"), -1);
    if (!strcmp(a, "--seed")) {
        char *end;
        errno = 0;
        unsigned long long x = strtoull(v, &end, 10);
        if (!*v || *end || errno || v[0] == '-') return lk_cli_usage("extract", "--seed needs a whole number >= 0, got '%s'", v), -1;
        o->seed = (uint64_t)x;
        return 1;
    }
    long x;
    long hi = !strcmp(a, "--power") ? 64 : 4096, lo = !strcmp(a, "--power") ? 0 : 1;
    if (!lk_cli_parse_int(v, &x) || x < lo || x > hi)
        return lk_cli_usage("extract", "%s needs a whole number from %ld to %ld, got '%s'", a, lo, hi, v), -1;
    if (!strcmp(a, "--power")) o->power = (int)x;
    else o->oversample = (int)x;
    return 1;
}

int lk_cmd_extract(int argc, char **argv) {
    if (lk_cli_wants_help(argc, argv)) return fputs(EXTRACT_USAGE, stdout), LK_EXIT_OK;
    lk_alg_cli c = {0};
    lk_extract_opts o = {.power = -1};
    const char **inc = NULL, **exc = NULL, *pos[2] = {NULL, NULL};
    int np = 0, r, rc = LK_EXIT_USAGE;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if ((r = lk_alg_cli_option("extract", argc, argv, &i, &c)) != 0 || (r = own_option(argc, argv, &i, &o, &inc, &exc)) != 0) {
            if (r < 0) goto out;
        } else if (a[0] == '-' && a[1]) {
            lk_cli_usage("extract", "unknown option '%s'", a);
            goto out;
        } else if (np == 2) {
            lk_cli_usage("extract", "BASE and TUNED expected, got a third '%s'", a);
            goto out;
        } else {
            pos[np++] = a;
        }
    }
    if (np < 2) {
        lk_cli_usage("extract", "missing %s", np ? "TUNED" : "BASE and TUNED");
        goto out;
    }
    if (!c.out) {
        lk_cli_usage("extract", "missing -o OUT");
        goto out;
    }
    lk_alg_cli_progress(&c);
    o.alg = c.o;
    o.include = inc, o.exclude = exc;
    char *report = NULL;
    lk_status s = lk_extract(pos[0], pos[1], c.out, &o, &report);
    rc = lk_alg_cli_finish(&c, s, report);
out:
    free(inc);
    free(exc);
    return rc;
}
