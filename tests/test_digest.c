/* test_digest.c — the content digest (DESIGN.md "Digest").
 *
 * Expectation: the byte stream the design defines (name, NUL, dtype, NUL,
 * shape as LE i64s, raw bytes; tensors in byte-wise name order) assembled by
 * hand in one buffer and hashed with a single one-shot XXH3_128bits call,
 * printed high 64 bits first. Then, through files and the CLI: equal tensors
 * in a different layout with different metadata give the same digest, and
 * one changed byte gives a different one. */
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

static size_t put(unsigned char *b, size_t o, const void *p, size_t n) {
    memcpy(b + o, p, n);
    return o + n;
}

static size_t put_i64(unsigned char *b, size_t o, int64_t v) {
    for (int i = 0; i < 8; i++) b[o + (size_t)i] = (unsigned char)((uint64_t)v >> (8 * i));
    return o + 8;
}

static void hex128(XXH128_hash_t h, char *out) {
    snprintf(out, 33, "%016llx%016llx", (unsigned long long)h.high64, (unsigned long long)h.low64);
}

static float g_w[6] = {1, 2, 3, 4, 5, 6};
static uint16_t g_h[3] = {0x3c00, 0x4000, 0xbc00};
static int64_t g_s = 7;

/* Three tensors given out of name order: "w" F32 [2,3], "b.h" F16 [3],
 * "B" I64 scalar ("B" < "b.h" < "w" byte-wise). */
static void make_views(lk_tensor t[3]) {
    memset(t, 0, 3 * sizeof *t);
    t[0] = (lk_tensor){.name = "w", .dtype = LK_DTYPE_F32, .ndim = 2, .shape = {2, 3}, .nbytes = 24, .data = g_w};
    t[1] = (lk_tensor){.name = "b.h", .dtype = LK_DTYPE_F16, .ndim = 1, .shape = {3}, .nbytes = 6, .data = g_h};
    t[2] = (lk_tensor){.name = "B", .dtype = LK_DTYPE_I64, .ndim = 0, .nbytes = 8, .data = &g_s};
}

static void expected_hex(char *out) {
    unsigned char b[256];
    size_t o = 0;
    o = put(b, o, "B\0I64\0", 6);
    o = put(b, o, &g_s, 8);
    o = put(b, o, "b.h\0F16\0", 8);
    o = put_i64(b, o, 3);
    o = put(b, o, g_h, 6);
    o = put(b, o, "w\0F32\0", 6);
    o = put_i64(b, o, 2);
    o = put_i64(b, o, 3);
    o = put(b, o, g_w, 24);
    hex128(XXH3_128bits(b, o), out);
}

static void test_definition(void **state) {
    (void)state;
    lk_tensor t[3];
    make_views(t);
    char want[33], got[LK_DIGEST_HEX];
    expected_hex(want);
    assert_int_equal(lk_digest_tensors(t, 3, got), LK_OK);
    assert_string_equal(got, want);
    assert_int_equal(strlen(got), 32);
    for (int i = 0; i < 32; i++) assert_true((got[i] >= '0' && got[i] <= '9') || (got[i] >= 'a' && got[i] <= 'f'));
    /* Any input order gives the same digest. */
    lk_tensor r[3] = {t[2], t[0], t[1]};
    assert_int_equal(lk_digest_tensors(r, 3, got), LK_OK);
    assert_string_equal(got, want);
    /* The empty set: XXH3-128 of no bytes. */
    hex128(XXH3_128bits("", 0), want);
    assert_int_equal(lk_digest_tensors(NULL, 0, got), LK_OK);
    assert_string_equal(got, want);
    /* Duplicate names are refused (the order would be ambiguous). */
    lk_tensor d[2] = {t[0], t[0]};
    assert_int_equal(lk_digest_tensors(d, 2, got), LK_ERR_ARG);
    tu_assert_contains(lk_last_error(), "w: tensor name appears twice");
}

/* File A from the writer (layout by dtype then name, metadata m1); file B
 * by hand in another layout (w first, then B, then b.h), other metadata. */
static void write_b(const char *path, int flip) {
    const char *hdr = "{\"__metadata__\":{\"other\":\"metadata\"},"
                      "\"w\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]},"
                      "\"B\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[24,32]},"
                      "\"b.h\":{\"dtype\":\"F16\",\"shape\":[3],\"data_offsets\":[32,38]}}";
    size_t hl = strlen(hdr), len = 8 + hl + 38;
    unsigned char *b = calloc(1, len);
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)((uint64_t)hl >> (8 * i));
    memcpy(b + 8, hdr, hl);
    memcpy(b + 8 + hl, g_w, 24);
    memcpy(b + 8 + hl + 24, &g_s, 8);
    memcpy(b + 8 + hl + 32, g_h, 6);
    if (flip) b[8 + hl + 36] ^= 0x01; /* one byte of b.h */
    assert_int_equal(tu_write_file(path, b, len), 0);
    free(b);
}

static void test_files_and_cli(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    char *pa = tu_path(dir, "a.safetensors"), *pb = tu_path(dir, "b.safetensors"), *pc = tu_path(dir, "c.safetensors");
    lk_tensor t[3];
    make_views(t);
    const char *meta[] = {"format", "pt"};
    assert_int_equal(lk_st_save(pa, t, 3, meta, 1), LK_OK);
    write_b(pb, 0);
    write_b(pc, 1);
    char want[33], ha[LK_DIGEST_HEX], hb[LK_DIGEST_HEX], hc[LK_DIGEST_HEX];
    expected_hex(want);
    lk_st *a, *b, *c;
    assert_int_equal(lk_st_open(pa, &a), LK_OK);
    assert_int_equal(lk_st_open(pb, &b), LK_OK);
    assert_int_equal(lk_st_open(pc, &c), LK_OK);
    assert_string_not_equal(lk_st_tensor(a, 0)->name, lk_st_tensor(b, 0)->name); /* layouts differ */
    assert_int_equal(lk_digest_st(a, ha), LK_OK);
    assert_int_equal(lk_digest_st(b, hb), LK_OK);
    assert_int_equal(lk_digest_st(c, hc), LK_OK);
    assert_string_equal(ha, want);
    assert_string_equal(hb, want);
    assert_string_not_equal(hc, want);
    lk_st_close(a);
    lk_st_close(b);
    lk_st_close(c);

    char *out, *err, line[40];
    snprintf(line, sizeof line, "%s\n", want);
    assert_int_equal(tu_run_cli(&out, &err, "digest '%s'", pa), 0);
    assert_string_equal(out, line);
    free(out); free(err);
    assert_int_equal(tu_run_cli(&out, &err, "digest '%s'", pb), 0);
    assert_string_equal(out, line);
    free(out); free(err);
    assert_int_equal(tu_run_cli(&out, &err, "digest '%s'", pc), 0);
    assert_string_not_equal(out, line);
    assert_int_equal(strlen(out), 33);
    free(out); free(err);
    /* Errors and usage. */
    assert_int_equal(tu_run_cli(&out, &err, "digest '%s/missing.safetensors'", dir), 1);
    tu_assert_contains(err, "missing.safetensors: cannot open");
    free(out); free(err);
    assert_int_equal(tu_run_cli(&out, &err, "digest"), 2);
    free(out); free(err);
    assert_int_equal(tu_run_cli(&out, &err, "digest --help"), 0);
    tu_assert_contains(out, "usage: lorakit digest FILE");
    free(out); free(err);
    tu_rmtree(dir);
    free(dir);
    free(pa); free(pb); free(pc);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_definition),
        cmocka_unit_test(test_files_and_cli),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
