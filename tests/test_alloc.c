/* test_alloc.c — the carve (core/alloc.h): one allocation laid out into
 * arrays. Expected offsets are hand-computed from the rule "each part at
 * the end of the block so far, rounded up to its alignment"; the overflow
 * cases are sizes chosen so that a product, a padding or a sum passes
 * SIZE_MAX. */
#include "testutil.h"

#include <stdalign.h>
#include <stdint.h>
#include <string.h>

/* Hand-computed layout: 3 chars at 0 (bytes 3), 2 doubles at 8 (3 rounded
 * up to 8; bytes 24), 5 bytes at 24 (align 1; bytes 29), 1 uint32 at 32
 * (29 up to 4; bytes 36), 0 uint64 at 40 (36 up to 8; bytes 40), 1 byte
 * aligned to 64 at 64 (bytes 65). */
static void test_offsets(void **state) {
    (void)state;
    lk_carve c = {0};
    assert_true(LK_CARVE(&c, 3, char) == 0 && c.bytes == 3);
    assert_true(lk_carve_part(&c, 2, 8, 8) == 8 && c.bytes == 24);
    assert_true(lk_carve_part(&c, 5, 1, 1) == 24 && c.bytes == 29);
    assert_true(lk_carve_part(&c, 1, 4, 4) == 32 && c.bytes == 36);
    assert_true(lk_carve_part(&c, 0, 8, 8) == 40 && c.bytes == 40); /* empty: aligned, no bytes */
    assert_true(lk_carve_part(&c, 1, 1, 64) == 64 && c.bytes == 65);
    assert_false(c.overflow);
}

/* A mixed layout by type: every offset a multiple of its type's alignment,
 * parts in order without overlap, and the block usable for every part. */
typedef struct { char c; double d; } padded;
static void test_typed_block(void **state) {
    (void)state;
    lk_carve c = {0};
    const size_t o_a = LK_CARVE(&c, 7, unsigned char), o_b = LK_CARVE(&c, 3, padded), o_c = LK_CARVE(&c, 5, uint16_t),
                 o_d = LK_CARVE(&c, 9, void *), o_e = LK_CARVE(&c, 1, max_align_t);
    assert_true(o_a == 0);
    assert_true(o_b % alignof(padded) == 0 && o_b >= o_a + 7);
    assert_true(o_c % alignof(uint16_t) == 0 && o_c >= o_b + 3 * sizeof(padded));
    assert_true(o_d % alignof(void *) == 0 && o_d >= o_c + 5 * sizeof(uint16_t));
    assert_true(o_e % alignof(max_align_t) == 0 && o_e >= o_d + 9 * sizeof(void *));
    assert_true(c.bytes == o_e + sizeof(max_align_t));
    lk_alloc_fail_at(0);
    unsigned char *b = lk_carve_alloc(&c);
    assert_non_null(b);
    assert_true(lk_alloc_count() == 1); /* one allocation */
    for (size_t i = 0; i < c.bytes; i++) assert_int_equal(b[i], 0); /* zeroed */
    padded *p = (padded *)(b + o_b);
    void **v = (void **)(b + o_d);
    assert_true((uintptr_t)p % alignof(padded) == 0 && (uintptr_t)v % alignof(void *) == 0);
    assert_true((uintptr_t)(b + o_e) % alignof(max_align_t) == 0);
    memset(b, 0xab, c.bytes); /* every byte is the block's (ASan checks) */
    lk_free(b);
}

/* Overflow: the product, the padding and the sum, each refused, sticky,
 * and nothing allocated. */
static void test_overflow(void **state) {
    (void)state;
    lk_carve c = {0};
    LK_CARVE(&c, 1, char);
    assert_true(lk_carve_part(&c, SIZE_MAX / 2 + 1, 2, 1) == 0 && c.overflow); /* count * size */
    assert_true(c.bytes == SIZE_MAX);
    assert_true(lk_carve_part(&c, 1, 1, 1) == 0 && c.overflow); /* sticky */
    lk_alloc_fail_at(0);
    assert_null(lk_carve_alloc(&c));
    assert_true(lk_alloc_count() == 0); /* refused without allocating */

    c = (lk_carve){.bytes = SIZE_MAX - 2};
    assert_true(lk_carve_part(&c, 0, 1, 8) == 0 && c.overflow); /* padding up to 8 passes SIZE_MAX */
    c = (lk_carve){.bytes = SIZE_MAX - 15}; /* 2^64 - 16, a multiple of 8 */
    assert_true(lk_carve_part(&c, 15, 1, 8) == SIZE_MAX - 15 && !c.overflow && c.bytes == SIZE_MAX); /* fits exactly */
    c = (lk_carve){.bytes = SIZE_MAX - 15};
    assert_true(lk_carve_part(&c, 2, 8, 8) == 0 && c.overflow); /* the sum: 2^64 */
    c = (lk_carve){.bytes = 16};
    assert_true(lk_carve_part(&c, 1, 1, 3) == 0 && c.overflow); /* not a power of two */
    c = (lk_carve){.bytes = 16};
    assert_true(lk_carve_part(&c, 1, 1, 0) == 0 && c.overflow);
    c = (lk_carve){.overflow = 1}; /* a size worked out beforehand did not fit */
    assert_true(LK_CARVE(&c, 1, int) == 0);
    lk_alloc_fail_at(0);
    assert_null(lk_carve_alloc(&c));
    assert_true(lk_alloc_count() == 0);
}

/* An empty layout still allocates (one byte), and an injected failure is
 * NULL. */
static void test_alloc(void **state) {
    (void)state;
    lk_carve c = {0};
    LK_CARVE(&c, 0, double);
    assert_true(c.bytes == 0 && !c.overflow);
    void *b = lk_carve_alloc(&c);
    assert_non_null(b);
    lk_free(b);
    LK_CARVE(&c, 4, double);
    lk_alloc_fail_at(1);
    assert_null(lk_carve_alloc(&c));
    lk_alloc_fail_at(0);
}

/* The over-aligned block: its start on a 64-byte line, so parts carved at
 * align 64 are on lines too (hand-computed: 3 floats at 0, 1 double at 64,
 * bytes 72); one allocation; refused without allocating when the layout
 * overflowed, align is not a power of two or is under max_align_t's, or
 * the size rounded up to align passes SIZE_MAX. */
static void test_alloc_aligned(void **state) {
    (void)state;
    lk_carve c = {0};
    assert_true(lk_carve_part(&c, 3, sizeof(float), 64) == 0 && lk_carve_part(&c, 1, sizeof(double), 64) == 64);
    assert_true(c.bytes == 72);
    for (int k = 0; k < 4; k++) { /* several, so a start malloc would put off a line shows */
        lk_alloc_fail_at(0);
        unsigned char *b = lk_carve_alloc_aligned(&c, 64);
        assert_non_null(b);
        assert_true(lk_alloc_count() == 1);
        assert_true((uintptr_t)b % 64 == 0 && (uintptr_t)(b + 64) % 64 == 0);
        memset(b, 0xab, c.bytes); /* every byte is the block's (ASan checks) */
        lk_free(b);
    }
    lk_alloc_fail_at(0);
    assert_null(lk_carve_alloc_aligned(&c, 48));                  /* not a power of two */
    assert_null(lk_carve_alloc_aligned(&c, alignof(max_align_t) / 2)); /* under max_align_t's */
    lk_carve big = {.bytes = SIZE_MAX - 10};
    assert_null(lk_carve_alloc_aligned(&big, 64)); /* rounded up to 64 it passes SIZE_MAX */
    lk_carve bad = {.overflow = 1};
    assert_null(lk_carve_alloc_aligned(&bad, 64));
    assert_true(lk_alloc_count() == 0); /* none of them allocated */
    lk_carve empty = {0};
    void *e = lk_carve_alloc_aligned(&empty, 64); /* an empty layout still allocates */
    assert_non_null(e);
    lk_free(e);
    lk_alloc_fail_at(1);
    assert_null(lk_carve_alloc_aligned(&c, 64)); /* an injected failure */
    lk_alloc_fail_at(0);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_offsets), cmocka_unit_test(test_typed_block),
                                       cmocka_unit_test(test_overflow), cmocka_unit_test(test_alloc),
                                       cmocka_unit_test(test_alloc_aligned)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
