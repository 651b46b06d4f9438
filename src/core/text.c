/* text.c — lk_appendf (core/text.h). */
#include "core/text.h"

#include <stdarg.h>
#include <stdio.h>

void lk_appendf(char *buf, size_t cap, size_t *len, const char *fmt, ...) {
    if (!cap || *len >= cap - 1) return;
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(buf + *len, cap - *len, fmt, ap);
    va_end(ap);
    if (k < 0) buf[*len] = '\0';
    else *len = *len + (size_t)k < cap - 1 ? *len + (size_t)k : cap - 1;
}
