/* cli_util.c — see cli_util.h. */
#include "cli_util.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "lorakit/status.h"

int lk_cli_fail(void) {
    fprintf(stderr, "lorakit: %s\n", lk_last_error()[0] ? lk_last_error() : "operation failed");
    return LK_EXIT_FAIL;
}

int lk_cli_usage(const char *cmd, const char *fmt, ...) {
    va_list ap;
    fputs("lorakit: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\n(see 'lorakit %s --help')\n", cmd ? cmd : "");
    return LK_EXIT_USAGE;
}

int lk_cli_wants_help(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--")) break;
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) return 1;
    }
    return 0;
}

int lk_cli_parse_int(const char *s, long *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end) return 0;
    *out = v;
    return 1;
}

int lk_cli_parse_double(const char *s, double *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end) return 0;
    *out = v;
    return 1;
}

int lk_cli_parse_timeout(const char *s, double *out) {
    double v;
    if (!lk_cli_parse_double(s, &v) || !lk_knob_in_range(LK_KNOB_TIMEOUT_S, v)) return 0;
    *out = v;
    return 1;
}

int lk_cli_timeout_abort(lk_comm *c) {
    if (lk_comm_size(c) > 1) fprintf(stderr, "lorakit: rank %d: %s; aborting the job\n", lk_comm_rank(c), lk_last_error());
    else fprintf(stderr, "lorakit: %s\n", lk_last_error());
    fflush(stderr);
    fflush(stdout);
    /* the other waiting ranks time out at about the same moment (within the
     * diagnosis' grace, at most 2 s): give their reports time to get out
     * before the abort ends every process */
    struct timespec ts = {2, 0};
    while (nanosleep(&ts, &ts) && errno == EINTR) {
    }
    lk_comm_abort(c, LK_EXIT_FAIL);
    return LK_EXIT_FAIL;
}

int lk_cli_device_option(const char *cmd, int argc, char **argv, int *i, lk_device *d) {
    if (strcmp(argv[*i], "--device")) return 0;
    if (*i + 1 >= argc) {
        lk_cli_usage(cmd, "--device needs cpu, cuda, cuda:N or emul");
        return -1;
    }
    if (lk_device_parse(argv[*i + 1], d)) {
        lk_cli_usage(cmd, "%s", lk_last_error());
        return -1;
    }
    (*i)++;
    return 1;
}

int lk_cli_fp8_option(const char *cmd, int argc, char **argv, int *i, lk_fp8_opts *o) {
    const char *a = argv[*i], *v = *i + 1 < argc ? argv[*i + 1] : NULL;
    if (!strcmp(a, "--fp8-saturate")) {
        o->saturate = 1;
        return 1;
    }
    int r = !strcmp(a, "--fp8-rounding"), sc = !strcmp(a, "--fp8-scale"), sd = !strcmp(a, "--fp8-seed");
    if (!r && !sc && !sd) return 0;
    if (!v) {
        lk_cli_usage(cmd, "%s needs a value", a);
        return -1;
    }
    if (r && lk_fp8_rounding_parse(v, &o->rounding)) {
        lk_cli_usage(cmd, "%s", lk_last_error());
        return -1;
    }
    if (sc && lk_fp8_scale_parse(v, &o->scale)) {
        lk_cli_usage(cmd, "%s", lk_last_error());
        return -1;
    }
    if (sd) {
        char *end;
        errno = 0;
        unsigned long long x = strtoull(v, &end, 10);
        if (errno || end == v || *end || v[0] == '-') {
            lk_cli_usage(cmd, "--fp8-seed needs a number from 0 to 2^64-1, got '%s'", v);
            return -1;
        }
        o->seed = (uint64_t)x;
    }
    (*i)++;
    return 1;
}
