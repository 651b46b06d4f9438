/* names.c — the string hash table of names.h. */
#include "adapter/names.h"
#include "lorakit/alloc.h"

#include <string.h>
#include <sys/random.h>
#include <time.h>

int lk_names_init(lk_names *t, size_t n) {
    memset(t, 0, sizeof *t);
    size_t cap = 4; /* a power of two; many tiny tables (one per key shape) stay small */
    while (cap < n * 2) {
        if (cap > SIZE_MAX / 4 / sizeof *t->slot) return -1;
        cap *= 2;
    }
    if (!(t->slot = lk_calloc(cap, sizeof *t->slot))) return -1;
    t->cap = cap;
    uint64_t r = 0;
    if (getrandom(&r, sizeof r, GRND_NONBLOCK) != (ssize_t)sizeof r) /* no entropy yet: the clock */
        r = (uint64_t)time(NULL) * UINT64_C(0x9e3779b97f4a7c15) ^ (uint64_t)(uintptr_t)t;
    t->base = (UINT64_C(1) << 20) + r % (LK_NAMES_MOD - 2 - (UINT64_C(1) << 20));
    return 0;
}

void lk_names_free(lk_names *t) {
    lk_free(t->slot);
    memset(t, 0, sizeof *t);
}

uint64_t lk_names_hash(const lk_names *t, const char *s, size_t len) {
    uint64_t h = 0, pw = 1;
    for (size_t i = len; i-- > 0;) lk_names_roll(t, &h, &pw, (unsigned char)s[i]);
    return h;
}

/* The slot index to start probing at: the hash's bits mixed (it is a value
 * below 2^61, so its low bits alone are fine, but cheap to spread). */
static size_t home(const lk_names *t, uint64_t h) {
    h ^= h >> 29;
    h *= UINT64_C(0xbf58476d1ce4e5b9);
    h ^= h >> 32;
    return (size_t)h & (t->cap - 1);
}

size_t lk_names_get_h(const lk_names *t, uint64_t h, const char *s, size_t len) {
    if (!t->cap) return SIZE_MAX;
    for (size_t i = home(t, h);; i = (i + 1) & (t->cap - 1)) {
        const lk_names_entry *e = &t->slot[i];
        if (!e->s) return SIZE_MAX;
        if (e->h == h && e->len == len && !memcmp(e->s, s, len)) return e->id;
    }
}

static int grow(lk_names *t) {
    if (t->cap > SIZE_MAX / 4 / sizeof *t->slot) return -1;
    lk_names_entry *old = t->slot;
    size_t oc = t->cap;
    if (!(t->slot = lk_calloc(oc * 2, sizeof *t->slot))) {
        t->slot = old;
        return -1;
    }
    t->cap = oc * 2;
    for (size_t k = 0; k < oc; k++) {
        if (!old[k].s) continue;
        size_t i = home(t, old[k].h);
        while (t->slot[i].s) i = (i + 1) & (t->cap - 1);
        t->slot[i] = old[k];
    }
    lk_free(old);
    return 0;
}

int lk_names_add(lk_names *t, const char *s, size_t len, size_t id, size_t *first) {
    if ((t->n + 1) * 2 > t->cap && grow(t)) return -1;
    uint64_t h = lk_names_hash(t, s, len);
    size_t i = home(t, h);
    for (; t->slot[i].s; i = (i + 1) & (t->cap - 1)) {
        const lk_names_entry *e = &t->slot[i];
        if (e->h == h && e->len == len && !memcmp(e->s, s, len)) {
            if (first) *first = e->id;
            return 0;
        }
    }
    t->slot[i] = (lk_names_entry){h, s, len, id};
    t->n++;
    if (first) *first = id;
    return 0;
}
