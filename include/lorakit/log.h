/* lorakit/log.h — the logger. Level from LORAKIT_LOG (error|warn|info|debug,
 * default warn); lines go to stderr, prefixed with "[rank R] " when the
 * process is one of several ranks. The library prints only through here. */
#ifndef LORAKIT_LOG_H
#define LORAKIT_LOG_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum lk_log_level {
    LK_LOG_ERROR = 0,
    LK_LOG_WARN = 1,
    LK_LOG_INFO = 2,
    LK_LOG_DEBUG = 3
} lk_log_level;

void lk_log(lk_log_level level, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* Current level (reads LORAKIT_LOG on first use). */
lk_log_level lk_log_get_level(void);
void lk_log_set_level(lk_log_level level);
/* Sets the rank prefix; size <= 1 removes it. */
void lk_log_set_rank(int rank, int size);

/* Where lines go instead of stderr (a host's own logging: the Python
 * package forwards them to the `lorakit` logger). fn gets the level and the
 * message (no tag, no rank prefix, no newline); it may be called from any
 * thread that logs. NULL restores stderr. Set it before work starts. */
typedef void (*lk_log_sink)(void *ctx, lk_log_level level, const char *msg);
void lk_log_set_sink(lk_log_sink fn, void *ctx);

#ifdef __cplusplus
}
#endif
#endif
