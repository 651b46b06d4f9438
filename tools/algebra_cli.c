/* algebra_cli.c — see algebra_cli.h. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "algebra_cli.h"
#include "cli.h"

static int need(const char *cmd, int argc, int i, const char *what) {
    if (i + 1 < argc) return 1;
    lk_cli_usage(cmd, "%s needs %s", what, "a value");
    return 0;
}

static int int_opt(const char *cmd, const char *name, const char *v, int *out) {
    long x;
    if (!lk_cli_parse_int(v, &x) || x < 1 || x > 1000000) {
        lk_cli_usage(cmd, "%s needs a whole number from 1 to 1000000, got '%s'", name, v);
        return -1;
    }
    *out = (int)x;
    return 1;
}

static int frac_opt(const char *cmd, const char *name, const char *v, double *out, double hi) {
    double x;
    if (!lk_cli_parse_double(v, &x) || !(x > 0) || x > hi) {
        lk_cli_usage(cmd, "%s needs a number in (0, %g], got '%s'", name, hi, v);
        return -1;
    }
    *out = x;
    return 1;
}

int lk_alg_cli_option(const char *cmd, int argc, char **argv, int *i, lk_alg_cli *c) {
    const char *a = argv[*i];
    static const char *const valued[] = {"-o", "--out", "--rank", "--err", "--fro", "--ratio", "--max-rank",
                                         "--conv-rank", "--format", "--dtype", "--threads", "--report"};
    int is_valued = 0;
    for (size_t k = 0; k < sizeof valued / sizeof *valued; k++) is_valued |= !strcmp(a, valued[k]);
    if (!strcmp(a, "--json")) return c->json = 1;
    if (!is_valued) return 0;
    if (!need(cmd, argc, *i, a)) return -1;
    const char *v = argv[++*i];
    if (!strcmp(a, "-o") || !strcmp(a, "--out")) return c->out = v, 1;
    if (!strcmp(a, "--report")) return c->report = v, 1;
    if (!strcmp(a, "--rank")) return int_opt(cmd, a, v, &c->o.rank);
    if (!strcmp(a, "--max-rank")) return int_opt(cmd, a, v, &c->o.max_rank);
    if (!strcmp(a, "--conv-rank")) return int_opt(cmd, a, v, &c->o.conv_rank);
    if (!strcmp(a, "--err")) return frac_opt(cmd, a, v, &c->o.err, 1e300);
    if (!strcmp(a, "--fro")) return frac_opt(cmd, a, v, &c->o.fro, 1.0);
    if (!strcmp(a, "--ratio")) return frac_opt(cmd, a, v, &c->o.ratio, 1.0);
    if (!strcmp(a, "--threads")) {
        long t;
        if (!lk_cli_parse_int(v, &t) || !lk_knob_in_range(LK_KNOB_THREADS, (double)t)) {
            lk_cli_usage(cmd, "--threads needs a number from %d to %d", LK_KNOB_THREADS_MIN, LK_KNOB_THREADS_MAX);
            return -1;
        }
        c->o.threads = (int)t;
        return 1;
    }
    if (!strcmp(a, "--format")) {
        if (lk_algebra_format_parse(v, &c->o.format) != LK_OK) return lk_cli_usage(cmd, "%s", lk_last_error()), -1;
        return 1;
    }
    lk_dtype d = lk_dtype_from_name(v, strlen(v));
    if (d != LK_DTYPE_F32 && d != LK_DTYPE_F16 && d != LK_DTYPE_BF16) {
        lk_cli_usage(cmd, "--dtype needs F32, F16 or BF16, got '%s'", v);
        return -1;
    }
    c->o.dtype = d;
    return 1;
}

static void draw(void *ctx, size_t done, size_t total) {
    lk_alg_cli *c = ctx;
    int pm = total ? (int)(done * 1000 / total) : 1000;
    if (pm == c->bar_last && done != total) return;
    c->bar_last = pm;
    fprintf(stderr, "\rmodules %zu/%zu (%d%%)", done, total, pm / 10);
    if (done == total) fputc('\n', stderr);
    fflush(stderr);
}

void lk_alg_cli_progress(lk_alg_cli *c) {
    c->bar_last = -1;
    if (isatty(STDERR_FILENO)) {
        c->o.on_progress = draw;
        c->o.progress_ctx = c;
    }
}

int lk_alg_cli_finish(const lk_alg_cli *c, lk_status s, char *report) {
    if (s) return lk_cli_fail();
    int rc = LK_EXIT_OK;
    if (c->report) {
        FILE *f = fopen(c->report, "w");
        if (!f || fprintf(f, "%s\n", report) < 0 || fclose(f) != 0) {
            fprintf(stderr, "lorakit: %s written, but the report %s could not be written\n", c->out, c->report);
            rc = LK_EXIT_FAIL;
        }
    }
    if (c->json) {
        printf("%s\n", report);
    } else {
        json_error_t e;
        json_t *j = json_loads(report, 0, &e);
        printf("wrote %s: %zu modules, rel_fro %.6g (optimum %.6g), rel_spec %.6g, %.3f s\n", c->out,
               json_array_size(json_object_get(j, "modules")), json_real_value(json_object_get(j, "rel_fro")),
               json_real_value(json_object_get(j, "rel_fro_opt")), json_real_value(json_object_get(j, "rel_spec")),
               json_real_value(json_object_get(j, "seconds")));
        json_decref(j);
    }
    lk_free(report);
    return rc;
}
