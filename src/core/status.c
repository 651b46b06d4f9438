/* status.c — status names and the thread-local error message.
 * The message lives in a fixed thread-local buffer so recording an error can
 * never itself fail (it is used on the out-of-memory path too). */
#include "lorakit/status.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define LK_ERRBUF 2048
static _Thread_local char g_err[LK_ERRBUF];

static const char *const g_names[LK_STATUS_COUNT] = {
    [LK_OK] = "LK_OK",
    [LK_ERR_ARG] = "LK_ERR_ARG",
    [LK_ERR_IO] = "LK_ERR_IO",
    [LK_ERR_FORMAT] = "LK_ERR_FORMAT",
    [LK_ERR_NOMEM] = "LK_ERR_NOMEM",
    [LK_ERR_SHAPE] = "LK_ERR_SHAPE",
    [LK_ERR_DTYPE] = "LK_ERR_DTYPE",
    [LK_ERR_UNMATCHED] = "LK_ERR_UNMATCHED",
    [LK_ERR_NONFINITE] = "LK_ERR_NONFINITE",
    [LK_ERR_MISMATCH] = "LK_ERR_MISMATCH",
    [LK_ERR_STATE] = "LK_ERR_STATE",
    [LK_ERR_COMM] = "LK_ERR_COMM",
    [LK_ERR_UNSUPPORTED] = "LK_ERR_UNSUPPORTED",
    [LK_ERR_CONFIG] = "LK_ERR_CONFIG",
    [LK_ERR_TIMEOUT] = "LK_ERR_TIMEOUT",
};

const char *lk_status_str(lk_status s) {
    if ((int)s < 0 || s >= LK_STATUS_COUNT) return "LK_ERR_UNKNOWN";
    return g_names[s];
}

const char *lk_last_error(void) { return g_err; }

void lk_error_clear(void) { g_err[0] = '\0'; }

lk_status lk_error(lk_status s, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_err, sizeof g_err, fmt, ap);
    va_end(ap);
    return s;
}

lk_status lk_error_prefix(lk_status s, const char *fmt, ...) {
    char old[LK_ERRBUF];
    char pre[512];
    memcpy(old, g_err, sizeof old);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(pre, sizeof pre, fmt, ap);
    va_end(ap);
    /* Composed by hand (not snprintf "%s: %s") so the truncation is explicit
     * and GCC's -Wformat-truncation stays quiet at -O0. */
    size_t pl = strlen(pre); /* < sizeof pre, which is < sizeof g_err - 3 */
    size_t ol = strnlen(old, sizeof g_err - 3 - pl);
    memcpy(g_err, pre, pl);
    g_err[pl] = ':';
    g_err[pl + 1] = ' ';
    memcpy(g_err + pl + 2, old, ol);
    g_err[pl + 2 + ol] = '\0';
    return s;
}

const char *lk_num_str(double v, char *buf) {
    int p = 1;
    for (; p < 17; p++) { /* 17 significant digits always read back */
        snprintf(buf, LK_NUM_STR_MAX, "%.*g", p, v);
        if (strtod(buf, NULL) == v) break;
    }
    /* a whole number below 1e17 in plain digits (10, not 1e+01): more digits
     * of the correctly rounded decimal are at least as close, so they read
     * back as v too */
    int e10 = v != 0 && isfinite(v) ? (int)floor(log10(fabs(v))) : 0;
    snprintf(buf, LK_NUM_STR_MAX, "%.*g", e10 >= p && e10 < 17 ? e10 + 1 : p, v);
    return buf;
}
