/* test_safetensors_malformed.c — hostile safetensors files.
 *
 * One file per defect that the reference implementation (the Rust
 * `safetensors` crate, safetensors/src/tensor.rs: read_metadata + validate)
 * rejects, plus the stricter checks lorakit adds (duplicate keys,
 * __metadata__ strictly string -> string, at most LK_MAX_DIMS dims). Each is
 * rejected by lk_st_open (LK_ERR_FORMAT, message naming the file and the
 * tensor) and by `lorakit inspect` (exit 1, the same message on stderr, no
 * sanitizer report). The expectations are the defects themselves, built by
 * hand below. A few valid edge cases must still be accepted. */
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const char *what;     /* the defect */
    const char *header;   /* JSON header text (NULL: raw bytes below) */
    size_t data_len;      /* bytes of data buffer after the header */
    const char *raw;      /* raw file bytes when header is NULL */
    size_t raw_len;
    long long n_override; /* header length field if >= 0 (else strlen(header)) */
    const char *msg;      /* expected message fragment */
} bad_case;

#define T(name, dt, sh, off) "\"" name "\":{\"dtype\":\"" dt "\",\"shape\":" sh ",\"data_offsets\":" off "}"

static const bad_case g_bad[] = {
    {"empty file", NULL, 0, "", 0, -1, "file is 0 bytes, shorter than the 8-byte header length"},
    {"7 bytes", NULL, 0, "\x10\0\0\0\0\0\0", 7, -1, "file is 7 bytes, shorter than the 8-byte header length"},
    {"header length over 100,000,000", "{}", 0, NULL, 0, 100000001LL, "header length 100000001 exceeds the limit"},
    {"header length 2^64-1 (8+N overflows)", "{}", 0, NULL, 0, -2, "header length 18446744073709551615 exceeds the limit"},
    {"header length past the end of the file", "{}", 0, NULL, 0, 100, "header length 100 runs past the end of the 10-byte file"},
    {"header not UTF-8", "{\"a\xff\":{}}", 0, NULL, 0, -1, "header is not valid UTF-8"},
    {"header truncated JSON", "{\"a\":{\"dtype\":", 0, NULL, 0, -1, "header is not valid JSON"},
    {"header is an array", "[1,2]", 0, NULL, 0, -1, "header is an array, expected a JSON object"},
    {"header is a string", "\"hello\"", 0, NULL, 0, -1, "header is a string, expected a JSON object"},
    {"duplicate tensor name", "{" T("w", "F32", "[1]", "[0,4]") "," T("w", "F32", "[1]", "[4,8]") "}", 8, NULL, 0, -1,
     "duplicate object key"},
    {"tensor entry not an object", "{\"w\":[1,2]}", 0, NULL, 0, -1, "w: tensor entry is an array, expected an object"},
    {"missing dtype", "{\"w\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4, NULL, 0, -1, "w: missing \"dtype\""},
    {"missing shape", "{\"w\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", 4, NULL, 0, -1, "w: missing \"shape\""},
    {"missing data_offsets", "{\"w\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4, NULL, 0, -1, "w: missing \"data_offsets\""},
    {"unknown dtype", "{" T("w", "F33", "[1]", "[0,4]") "}", 4, NULL, 0, -1, "w: unknown dtype \"F33\""},
    {"dtype not a string", "{\"w\":{\"dtype\":4,\"shape\":[1],\"data_offsets\":[0,4]}}", 4, NULL, 0, -1,
     "w: dtype is an integer, expected a string"},
    {"shape not an array", "{\"w\":{\"dtype\":\"F32\",\"shape\":1,\"data_offsets\":[0,4]}}", 4, NULL, 0, -1,
     "w: shape is an integer, expected an array"},
    {"negative dimension", "{" T("w", "F32", "[2,-1]", "[0,4]") "}", 4, NULL, 0, -1,
     "w: shape[1] is a negative integer, expected a non-negative integer"},
    {"non-integer dimension", "{" T("w", "F32", "[2.0]", "[0,8]") "}", 8, NULL, 0, -1,
     "w: shape[0] is a non-integer number"},
    {"dimension beyond int64", "{" T("w", "F32", "[100000000000000000000]", "[0,8]") "}", 8, NULL, 0, -1,
     "header is not valid JSON"},
    {"too many dimensions", "{" T("w", "U8", "[1,1,1,1,1,1,1,1,1]", "[0,1]") "}", 1, NULL, 0, -1,
     "w: shape has 9 dimensions"},
    {"data_offsets not a pair", "{" T("w", "F32", "[1]", "[0,4,8]") "}", 4, NULL, 0, -1,
     "w: data_offsets must be an array [begin, end]"},
    {"data_offsets negative", "{" T("w", "F32", "[1]", "[-4,0]") "}", 4, NULL, 0, -1,
     "w: data_offsets[0] is a negative integer"},
    {"data_offsets begin > end", "{" T("w", "F32", "[0]", "[4,0]") "}", 4, NULL, 0, -1, "w: data_offsets begin 4 > end 0"},
    {"element count overflows", "{" T("w", "F32", "[4294967296,4294967296,2]", "[0,4]") "}", 4, NULL, 0, -1,
     "w: element count of the shape overflows"},
    {"byte size overflows", "{" T("w", "F32", "[4611686018427387904]", "[0,4]") "}", 4, NULL, 0, -1,
     "w: byte size of the shape overflows"},
    {"size differs from offsets", "{" T("w", "F32", "[2,2]", "[0,12]") "}", 12, NULL, 0, -1,
     "w: shape and dtype give 16 bytes but data_offsets [0, 12] span 12"},
    {"gap at the start", "{" T("w", "F32", "[1]", "[4,8]") "}", 8, NULL, 0, -1,
     "w: data_offsets begin 4 leaves a gap after byte 0"},
    {"gap between tensors", "{" T("a", "F32", "[1]", "[0,4]") "," T("b", "F32", "[1]", "[8,12]") "}", 12, NULL, 0, -1,
     "b: data_offsets begin 8 leaves a gap after byte 4"},
    {"overlapping tensors", "{" T("a", "F32", "[2]", "[0,8]") "," T("b", "F32", "[1]", "[4,8]") "}", 8, NULL, 0, -1,
     "b: data_offsets [4, 8] overlap a, which ends at 8"},
    {"data past the end of the file", "{" T("w", "F32", "[4]", "[0,16]") "}", 8, NULL, 0, -1,
     "w: data_offsets end 16 is past the end of the 8-byte data buffer"},
    {"trailing bytes after the last tensor", "{" T("w", "F32", "[1]", "[0,4]") "}", 6, NULL, 0, -1,
     "the tensors cover 4 bytes but the data buffer has 6"},
    {"__metadata__ not an object", "{\"__metadata__\":\"x\"}", 0, NULL, 0, -1, "__metadata__ is a string, expected an object"},
    {"__metadata__ value not a string", "{\"__metadata__\":{\"k\":1}}", 0, NULL, 0, -1,
     "__metadata__: value of \"k\" is an integer, expected a string"},
    {"duplicate metadata key", "{\"__metadata__\":{\"k\":\"a\",\"k\":\"b\"}}", 0, NULL, 0, -1, "duplicate object key"},
    {"NUL in a string", "{\"__metadata__\":{\"k\":\"a\\u0000b\"}}", 0, NULL, 0, -1, "header is not valid JSON"},
    /* the header is read by a scanner handing each value to jansson (not one DOM): the same refusals */
    {"duplicate name, one spelled with an escape", "{" T("t", "F32", "[1]", "[0,4]") "," T("\\u0074", "F32", "[1]", "[4,8]") "}",
     8, NULL, 0, -1, "duplicate object key"},
    {"__metadata__ twice, one escaped", "{\"__metadata__\":{},\"\\u005f_metadata__\":{}}", 0, NULL, 0, -1,
     "duplicate object key"},
    {"escaped __metadata__ is the metadata", "{\"\\u005f_metadata__\":{\"k\":1}}", 0, NULL, 0, -1,
     "__metadata__: value of \"k\" is an integer, expected a string"},
    {"NUL escape in a name", "{" T("a\\u0000", "F32", "[1]", "[0,4]") "}", 4, NULL, 0, -1, "header is not valid JSON"},
    {"lone surrogate in a name", "{" T("\\ud800", "F32", "[1]", "[0,4]") "}", 4, NULL, 0, -1, "header is not valid JSON"},
    {"control character in a name", "{" T("a\x01", "F32", "[1]", "[0,4]") "}", 4, NULL, 0, -1, "header is not valid JSON"},
    {"trailing comma", "{" T("w", "F32", "[1]", "[0,4]") ",}", 4, NULL, 0, -1, "header is not valid JSON"},
    {"text after the object", "{" T("w", "F32", "[1]", "[0,4]") "} x", 4, NULL, 0, -1, "header is not valid JSON"},
    {"missing colon", "{\"w\" {}}", 0, NULL, 0, -1, "header is not valid JSON"},
    {"bad number in an extra field", "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"x\":01}}", 4,
     NULL, 0, -1, "header is not valid JSON"},
    {"duplicate key in an extra field", "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"x\":{\"a\":1,\"a\":2}}}",
     4, NULL, 0, -1, "duplicate object key"},
    {"unterminated name", "{\"w", 0, NULL, 0, -1, "header is not valid JSON"},
    {"array with a trailing comma", "[1,]", 0, NULL, 0, -1, "header is not valid JSON"},
    {"empty header", "   ", 0, NULL, 0, -1, "header is not valid JSON"},
};

/* Builds the file image of a case; returns malloc'd bytes and their count. */
static unsigned char *build(const bad_case *c, size_t *len) {
    if (!c->header) {
        unsigned char *b = malloc(c->raw_len + 1);
        memcpy(b, c->raw, c->raw_len);
        *len = c->raw_len;
        return b;
    }
    size_t hl = strlen(c->header);
    *len = 8 + hl + c->data_len;
    unsigned char *b = calloc(1, *len);
    uint64_t n = c->n_override == -2 ? UINT64_MAX : c->n_override >= 0 ? (uint64_t)c->n_override : hl;
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)(n >> (8 * i));
    memcpy(b + 8, c->header, hl);
    return b;
}

static void test_library_rejects(void **state) {
    (void)state;
    size_t nc = sizeof g_bad / sizeof g_bad[0];
    assert_true(nc >= 25);
    char *dir = tu_mkdtemp();
    for (size_t i = 0; i < nc; i++) {
        size_t len;
        unsigned char *b = build(&g_bad[i], &len);
        char name[32];
        snprintf(name, sizeof name, "bad%02zu.safetensors", i);
        char *p = tu_path(dir, name);
        assert_int_equal(tu_write_file(p, b, len), 0);
        lk_st *st = (lk_st *)&st; /* must be reset to NULL */
        lk_status s = lk_st_open(p, &st);
        if (s != LK_ERR_FORMAT) print_error("case '%s': status %s\n", g_bad[i].what, lk_status_str(s));
        assert_int_equal(s, LK_ERR_FORMAT);
        assert_null(st);
        tu_assert_contains(lk_last_error(), g_bad[i].msg);
        tu_assert_contains(lk_last_error(), p); /* names the file */
        /* The in-memory path gives the same verdict. */
        assert_int_equal(lk_st_open_mem(b, len, "mem", &st), LK_ERR_FORMAT);
        tu_assert_contains(lk_last_error(), g_bad[i].msg);
        free(p);
        free(b);
    }
    tu_rmtree(dir);
    free(dir);
}

static void test_cli_rejects(void **state) {
    (void)state;
    size_t nc = sizeof g_bad / sizeof g_bad[0];
    char *dir = tu_mkdtemp();
    for (size_t i = 0; i < nc; i++) {
        size_t len;
        unsigned char *b = build(&g_bad[i], &len);
        char name[32];
        snprintf(name, sizeof name, "bad%02zu.safetensors", i);
        char *p = tu_path(dir, name);
        assert_int_equal(tu_write_file(p, b, len), 0);
        char *out = NULL, *err = NULL;
        int rc = tu_run_cli(&out, &err, "inspect '%s'", p);
        if (rc != 1) print_error("case '%s': exit %d, stderr: %s\n", g_bad[i].what, rc, err ? err : "");
        assert_int_equal(rc, 1);
        assert_string_equal(out, "");
        tu_assert_contains(err, "lorakit: ");
        tu_assert_contains(err, p);
        tu_assert_contains(err, g_bad[i].msg);
        assert_null(strstr(err, "Sanitizer"));
        assert_null(strstr(err, "runtime error"));
        free(out);
        free(err);
        free(p);
        free(b);
    }
    tu_rmtree(dir);
    free(dir);
}

/* Valid edge cases: an empty file ({} padded), null metadata, unknown
 * extra fields in an entry (the reference ignores them), empty tensors
 * sharing an offset, a header padded with trailing spaces. */
static void test_valid_edges(void **state) {
    (void)state;
    static const char *ok[] = {
        "{}",
        "{}      ",
        "{\"__metadata__\":null}",
        "{\"__metadata__\":{}," T("w", "U8", "[2]", "[0,2]") "}",
        "{\"w\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2],\"extra\":true}}",
        "{" T("e1", "F32", "[0,3]", "[0,0]") "," T("w", "U8", "[2]", "[0,2]") "," T("e2", "F64", "[0]", "[2,2]") "}",
    };
    static const size_t data[] = {0, 0, 0, 2, 2, 2};
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        bad_case c = {"ok", ok[i], data[i], NULL, 0, -1, NULL};
        size_t len;
        unsigned char *b = build(&c, &len);
        lk_st *st;
        lk_status s = lk_st_open_mem(b, len, "ok", &st);
        if (s) print_error("valid case %zu rejected: %s\n", i, lk_last_error());
        assert_int_equal(s, LK_OK);
        if (i == 5) {
            assert_int_equal(lk_st_count(st), 3);
            assert_string_equal(lk_st_tensor(st, 0)->name, "e1"); /* offset order, then header order */
            assert_string_equal(lk_st_tensor(st, 1)->name, "w");
            assert_string_equal(lk_st_tensor(st, 2)->name, "e2");
            assert_int_equal(lk_st_tensor(st, 2)->nbytes, 0);
        }
        lk_st_close(st);
        free(b);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_library_rejects),
        cmocka_unit_test(test_valid_edges),
        cmocka_unit_test(test_cli_rejects),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
