/* msg.c — see msg.h: messages that keep their end whatever their names'
 * length. A small printf driver: each conversion is handed to snprintf on
 * its own, with its argument taken at the type its length modifier says,
 * so a long %s argument can be shortened before it is printed. */
#include "core/msg.h"
#include "lorakit/alloc.h"

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>

char *lk_msg_dup(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    char *r = n < 0 ? NULL : lk_malloc((size_t)n + 1);
    if (!r) return NULL;
    va_start(ap, fmt);
    vsnprintf(r, (size_t)n + 1, fmt, ap);
    va_end(ap);
    return r;
}

size_t lk_msg_fit(char *buf, size_t cap, const char *s, size_t len) {
    if (!cap) return 0;
    if (len < cap) {
        memcpy(buf, s, len);
        buf[len] = '\0';
        return len;
    }
    char mark[64];
    int ml = snprintf(mark, sizeof mark, "...(%zu bytes elided)...", len);
    size_t room = cap - 1 > (size_t)ml ? cap - 1 - (size_t)ml : 0, head = room / 2, tail = room - head;
    if (!room) {
        memcpy(buf, s, cap - 1);
        buf[cap - 1] = '\0';
        return cap - 1;
    }
    snprintf(mark, sizeof mark, "...(%zu bytes elided)...", len - room);
    ml = (int)strlen(mark);
    if ((size_t)ml > cap - 1 - room) { /* the count got shorter: never longer */
        room = cap - 1 - (size_t)ml;
        head = room / 2;
        tail = room - head;
    }
    memcpy(buf, s, head);
    memcpy(buf + head, mark, (size_t)ml);
    memcpy(buf + head + (size_t)ml, s + len - tail, tail);
    buf[head + (size_t)ml + tail] = '\0';
    return head + (size_t)ml + tail;
}

/* One conversion of a format, as snprintf takes it: the spec ("%...c",
 * any '*' replaced by its int argument), its length modifier and letter. */
typedef struct {
    /* read_spec's longest spec: '%', 39 flags, an 11-character width ('*'
     * as -2147483647), '.', a 10-character precision ('*' as 2147483647),
     * 2 length letters, the letter and the NUL: 66 bytes. */
    char spec[80];
    char len[3];
    char conv;
    int has_prec;
} msg_spec;

/* Reads the conversion at p (a '%' not followed by '%') into sp, taking the
 * int argument of each '*' from ap; returns the format after it. */
static const char *read_spec(const char *p, va_list *ap, msg_spec *sp) {
    char *spec = sp->spec;
    size_t sl = 0;
    sp->has_prec = 0;
    spec[sl++] = *p++;
    while (*p && strchr("-+ #0", *p) && sl < 40) spec[sl++] = *p++;
    for (int part = 0; part < 2; part++) { /* the width, then the precision */
        if (part == 1) {
            if (*p != '.') break;
            sp->has_prec = 1;
            spec[sl++] = *p++;
        }
        if (*p == '*') {
            int v = va_arg(*ap, int);
            p++;
            if (part == 1 && v < 0) { /* a negative precision is as if none (C11 7.21.6.1p5) */
                sp->has_prec = 0;
                sl--; /* the '.' */
                continue;
            }
            sl += (size_t)snprintf(spec + sl, sizeof sp->spec - sl, "%d", v);
        } else {
            while (*p >= '0' && *p <= '9' && sl < 50) spec[sl++] = *p++;
        }
    }
    size_t ll = 0;
    while (*p && strchr("hlzjtL", *p) && ll < 2) sp->len[ll++] = *p, spec[sl++] = *p++;
    sp->len[ll] = '\0';
    sp->conv = *p ? *p++ : 's';
    spec[sl++] = sp->conv;
    spec[sl] = '\0';
    return p;
}

/* Appends one conversion (spec: "%...c") of the next argument to buf at *o. */
#define PUT(val)                                                                         \
    do {                                                                                 \
        int n_ = *o < cap ? snprintf(buf + *o, cap - *o, spec, val) : 0;                 \
        if (n_ > 0) *o = *o + (size_t)n_ < cap ? *o + (size_t)n_ : cap - 1;             \
    } while (0)

/* A %s argument at *o: one longer than LK_MSG_ARG_MAX (and printed without
 * a precision) shown as its head and tail; NULL as "(null)". */
static void put_str(char *buf, size_t cap, size_t *o, const msg_spec *sp, const char *s) {
    const char *spec = sp->spec;
    if (!s) s = "(null)";
    size_t n = sp->has_prec ? strnlen(s, LK_MSG_ARG_MAX + 1) : strlen(s);
    if (!sp->has_prec && n > LK_MSG_ARG_MAX) { /* a long name: its head and tail */
        char shortened[LK_MSG_ARG_MAX + 1];
        lk_msg_fit(shortened, sizeof shortened, s, n);
        PUT(shortened);
    } else {
        PUT(s);
    }
}

/* Appends the conversion sp of the next argument of ap to buf at *o, taken
 * at the type its length modifier says; never past buf[cap - 1]. */
static void put_arg(char *buf, size_t cap, size_t *o, const msg_spec *sp, va_list *ap) {
    const char *spec = sp->spec, *len = sp->len;
    switch (sp->conv) {
    case 'd': case 'i':
        if (!strcmp(len, "l")) PUT(va_arg(*ap, long));
        else if (!strcmp(len, "ll")) PUT(va_arg(*ap, long long));
        else if (!strcmp(len, "z")) PUT(va_arg(*ap, ssize_t));
        else if (!strcmp(len, "j")) PUT(va_arg(*ap, intmax_t));
        else if (!strcmp(len, "t")) PUT(va_arg(*ap, ptrdiff_t));
        else PUT(va_arg(*ap, int));
        break;
    case 'u': case 'o': case 'x': case 'X':
        if (!strcmp(len, "l")) PUT(va_arg(*ap, unsigned long));
        else if (!strcmp(len, "ll")) PUT(va_arg(*ap, unsigned long long));
        else if (!strcmp(len, "z")) PUT(va_arg(*ap, size_t));
        else if (!strcmp(len, "j")) PUT(va_arg(*ap, uintmax_t));
        else if (!strcmp(len, "t")) PUT(va_arg(*ap, ptrdiff_t));
        else PUT(va_arg(*ap, unsigned));
        break;
    case 'c': PUT(va_arg(*ap, int)); break;
    case 'p': PUT(va_arg(*ap, void *)); break;
    case 'f': case 'F': case 'e': case 'E': case 'g': case 'G': case 'a': case 'A':
        if (!strcmp(len, "L")) PUT(va_arg(*ap, long double));
        else PUT(va_arg(*ap, double));
        break;
    case 's': put_str(buf, cap, o, sp, va_arg(*ap, const char *)); break;
    default: { /* not a conversion lorakit uses: the spec shown as written */
        size_t n = strlen(spec) < cap - 1 - *o ? strlen(spec) : cap - 1 - *o;
        memcpy(buf + *o, spec, n);
        *o += n;
        buf[*o] = '\0';
        break;
    }
    }
}

size_t lk_msg_vformat(char *buf, size_t cap, const char *fmt, va_list ap) {
    if (!cap) return 0;
    size_t o = 0;
    va_list aq; /* the steps take the arguments through a pointer to it */
    va_copy(aq, ap);
    buf[0] = '\0';
    for (const char *p = fmt; *p && o + 1 < cap;) {
        if (*p != '%' || p[1] == '%') { /* a character as it is; %% as % */
            buf[o++] = *p;
            buf[o] = '\0';
            p += *p == '%' ? 2 : 1;
            continue;
        }
        msg_spec sp;
        p = read_spec(p, &aq, &sp);
        put_arg(buf, cap, &o, &sp, &aq);
    }
    va_end(aq);
    return o;
}
