/* log.c — the only place the library writes to stderr. */
#include "lorakit/log.h"
#include "core/msg.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int g_level = -1; /* -1: not yet read from LORAKIT_LOG */
static int g_rank = 0, g_size = 1;
static lk_log_sink g_sink; /* NULL: stderr */
static void *g_sink_ctx;

void lk_log_set_sink(lk_log_sink fn, void *ctx) {
    g_sink_ctx = ctx;
    g_sink = fn;
}

lk_log_level lk_log_get_level(void) {
    if (g_level < 0) {
        const char *e = getenv("LORAKIT_LOG");
        g_level = LK_LOG_WARN;
        if (e) {
            if (!strcmp(e, "error")) g_level = LK_LOG_ERROR;
            else if (!strcmp(e, "warn")) g_level = LK_LOG_WARN;
            else if (!strcmp(e, "info")) g_level = LK_LOG_INFO;
            else if (!strcmp(e, "debug")) g_level = LK_LOG_DEBUG;
        }
    }
    return (lk_log_level)g_level;
}

void lk_log_set_level(lk_log_level level) { g_level = (int)level; }

void lk_log_set_rank(int rank, int size) {
    g_rank = rank;
    g_size = size;
}

void lk_log(lk_log_level level, const char *fmt, ...) {
    if ((int)level > (int)lk_log_get_level()) return;
    static const char *const tag[] = {"error", "warn", "info", "debug"};
    char msg[8192];
    va_list ap;
    va_start(ap, fmt);
    lk_msg_vformat(msg, sizeof msg, fmt, ap); /* long names shortened in their middle (core/msg.h) */
    va_end(ap);
    if (g_sink) {
        g_sink(g_sink_ctx, level, msg);
        return;
    }
    /* One fprintf per line so lines from several ranks do not interleave mid-line. */
    if (g_size > 1)
        fprintf(stderr, "[rank %d] lorakit %s: %s\n", g_rank, tag[level], msg);
    else
        fprintf(stderr, "lorakit %s: %s\n", tag[level], msg);
}
