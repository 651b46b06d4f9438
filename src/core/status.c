/* status.c — status names and the thread-local error message.
 * The message lives in a fixed thread-local buffer so recording an error can
 * never itself fail (it is used on the out-of-memory path too). */
#include "lorakit/status.h"
#include "core/msg.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* 8 KiB: with every name over LK_MSG_ARG_MAX shortened (core/msg.h), a
 * message keeps its reason; a longer one loses its middle, not its end. */
#define LK_ERRBUF 8192
static _Thread_local char g_err[LK_ERRBUF];
/* where: shortened like the message's names when longer (never an error) */
#define LK_WHEREBUF 1024
static _Thread_local char g_err_path[LK_WHEREBUF], g_err_key[LK_WHEREBUF];

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
    [LK_ERR_CANCELLED] = "LK_ERR_CANCELLED",
};

const char *lk_status_str(lk_status s) {
    if ((int)s < 0 || s >= LK_STATUS_COUNT) return "LK_ERR_UNKNOWN";
    return g_names[s];
}

const char *lk_last_error(void) { return g_err; }

void lk_error_clear(void) { g_err[0] = g_err_path[0] = g_err_key[0] = '\0'; }

const char *lk_last_error_path(void) { return g_err_path; }

const char *lk_last_error_key(void) { return g_err_key; }

static void set_where(char *dst, const char *v) {
    if (!v || !*v || dst[0]) return;
    lk_msg_fit(dst, LK_WHEREBUF, v, strlen(v));
}

lk_status lk_error_at(lk_status s, const char *path, const char *key) {
    set_where(g_err_path, path);
    set_where(g_err_key, key);
    return s;
}

lk_status lk_verror(lk_status s, const char *fmt, va_list ap) {
    g_err_path[0] = g_err_key[0] = '\0'; /* a new failure: where the last one was no longer applies */
    char big[4 * LK_ERRBUF]; /* formatted apart: an argument may be lk_last_error() itself */
    size_t n = lk_msg_vformat(big, sizeof big, fmt, ap);
    lk_msg_fit(g_err, sizeof g_err, big, n);
    return s;
}

lk_status lk_error(lk_status s, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    lk_verror(s, fmt, ap);
    va_end(ap);
    return s;
}

lk_status lk_error_prefix(lk_status s, const char *fmt, ...) {
    char big[5 * LK_ERRBUF];
    va_list ap;
    va_start(ap, fmt);
    size_t pl = lk_msg_vformat(big, LK_ERRBUF, fmt, ap);
    va_end(ap);
    size_t ol = strlen(g_err); /* < LK_ERRBUF: the whole old message fits after the prefix */
    memcpy(big + pl, ": ", 2);
    memcpy(big + pl + 2, g_err, ol + 1);
    lk_msg_fit(g_err, sizeof g_err, big, pl + 2 + ol);
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
    /* the exponent as short as it reads: 1e308, 1e-5 (printf's 1e+308, 1e-05) */
    char *e = strchr(buf, 'e');
    if (e) {
        char *d = e + 1, *q = d;
        if (*q == '+') q++;
        else if (*q == '-') d++, q++;
        while (q[0] == '0' && q[1]) q++;
        memmove(d, q, strlen(q) + 1);
    }
    return buf;
}
