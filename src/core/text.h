/* text.h — building a message piece by piece into a fixed buffer (internal,
 * not installed). */
#ifndef LK_CORE_TEXT_H
#define LK_CORE_TEXT_H

#include <stddef.h>

/* Appends printf-style text to buf[cap] at *len, truncating at the end of
 * the buffer (*len stays <= cap - 1; buf stays terminated). */
void lk_appendf(char *buf, size_t cap, size_t *len, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 4, 5)))
#endif
    ;

#endif
