/* msg.h — formatting error and log messages so that they keep their end.
 * Internal to the library (status.c, log.c).
 *
 * A message names files, keys and module names, then says why; a name can
 * be arbitrarily long (a 5,000-byte module name), and cutting the message at
 * the buffer's end would cut the reason. So every %s argument longer than
 * LK_MSG_ARG_MAX bytes is shown as its head and tail around "...(N bytes
 * elided)...", and a message still longer than its buffer loses its middle,
 * never its end. */
#ifndef LK_CORE_MSG_H
#define LK_CORE_MSG_H

#include <stdarg.h>
#include <stddef.h>

#define LK_MSG_ARG_MAX 1024

/* vsnprintf(buf, cap, fmt, ap) under the rules above (fmt is a printf
 * format the compiler checked: flags, width and precision, including '*',
 * length modifiers hh h l ll z j t L, conversions d i u o x X c s p f F e E
 * g G a A and %%). Returns the length written (< cap). */
size_t lk_msg_vformat(char *buf, size_t cap, const char *fmt, va_list ap);
/* Copies s (len bytes) into buf (cap bytes, NUL-terminated), eliding its
 * middle when it does not fit. Returns the length written. */
size_t lk_msg_fit(char *buf, size_t cap, const char *s, size_t len);

/* lk_error with a va_list (status.c). */
#include "lorakit/status.h"
lk_status lk_verror(lk_status s, const char *fmt, va_list ap);

/* The whole of printf(fmt, ...), nothing elided, in an lk_malloc'd string
 * (NULL when out of memory): for labels such as "FILE: metadata KEY" that
 * messages then name as a %s argument (which lk_msg_vformat shortens in the
 * middle, with the length, only when it is over LK_MSG_ARG_MAX). */
char *lk_msg_dup(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#endif
