/* names.h — a hash table of borrowed strings (src/adapter internal), for
 * name matching in time linear in the names' length: exact lookups, and
 * lookups of every suffix of a name that starts after a '.' (PEFT's "name
 * equals the key or ends with '.' + key", a checkpoint key ending in
 * ".<module>.weight") with one rolling hash per name, not one pass over all
 * keys per name.
 *
 * The hash is a polynomial over the bytes read from the end, modulo the
 * prime 2^61 - 1, with a base drawn at random per table, so the suffixes of
 * one name hash incrementally (h(c S) = c * B^|S| + h(S)) and crafted keys
 * cannot make every lookup collide. Equal hashes are confirmed by comparing
 * the bytes, so a collision costs time, never a wrong answer. */
#ifndef LK_ADAPTER_NAMES_H
#define LK_ADAPTER_NAMES_H

#include <stddef.h>
#include <stdint.h>

typedef struct lk_names_entry {
    uint64_t h;
    const char *s; /* borrowed; NULL: empty slot */
    size_t len;
    size_t id;
} lk_names_entry;

typedef struct lk_names {
    lk_names_entry *slot;
    size_t cap, n; /* cap: a power of two */
    uint64_t base; /* in [2^20, 2^61 - 2] */
} lk_names;

#define LK_NAMES_MOD ((UINT64_C(1) << 61) - 1)

static inline uint64_t lk_names_mulmod(uint64_t a, uint64_t b) {
    unsigned __int128 p = (unsigned __int128)a * b;
    uint64_t r = (uint64_t)(p & LK_NAMES_MOD) + (uint64_t)(p >> 61);
    return r >= LK_NAMES_MOD ? r - LK_NAMES_MOD : r;
}

/* One step of the rolling hash: *h, *pw (B^|S|, start at 1) for S, then
 * for c S. */
static inline void lk_names_roll(const lk_names *t, uint64_t *h, uint64_t *pw, unsigned char c) {
    uint64_t x = *h + lk_names_mulmod((uint64_t)c + 1, *pw);
    *h = x >= LK_NAMES_MOD ? x - LK_NAMES_MOD : x;
    *pw = lk_names_mulmod(*pw, t->base);
}

/* An empty table sized for about n strings; 0, or -1 when out of memory. */
int lk_names_init(lk_names *t, size_t n);
void lk_names_free(lk_names *t);
uint64_t lk_names_hash(const lk_names *t, const char *s, size_t len);
/* Adds s[0..len) (borrowed: it must outlive the table) with id; when an
 * equal string is already there, keeps that one and sets *first to its id
 * (else to id). 0, or -1 when out of memory. */
int lk_names_add(lk_names *t, const char *s, size_t len, size_t id, size_t *first);
/* The id of the string equal to s[0..len) whose hash is h; SIZE_MAX when
 * absent. */
size_t lk_names_get_h(const lk_names *t, uint64_t h, const char *s, size_t len);
static inline size_t lk_names_get(const lk_names *t, const char *s, size_t len) {
    return lk_names_get_h(t, lk_names_hash(t, s, len), s, len);
}

#endif
