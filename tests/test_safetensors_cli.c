/* test_safetensors_cli.c — `lorakit inspect FILE [--json]` output.
 *
 * The file is written by hand (header text below), so the expected listing
 * (names in file order, dtypes, shapes, bytes, offsets, totals by dtype,
 * metadata) is read straight off that header, not from the reader. */
#include "testutil.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Data order in the file: big (F32 2x3 = 24 B at 0), s (I64 scalar, 8 B at
 * 24), e (BF16 [0,4], 0 B at 32), h (BF16 [2], 4 B at 32). */
static const char *HDR =
    "{\"__metadata__\":{\"format\":\"pt\",\"note\":\"hi there\"},"
    "\"h\":{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[32,36]},"
    "\"s\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[24,32]},"
    "\"e\":{\"dtype\":\"BF16\",\"shape\":[0,4],\"data_offsets\":[32,32]},"
    "\"big\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]}}";

static char *write_fixture(char *dir) {
    char *p = tu_path(dir, "fx.safetensors");
    size_t hl = strlen(HDR), len = 8 + hl + 36;
    unsigned char *b = calloc(1, len);
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)((uint64_t)hl >> (8 * i));
    memcpy(b + 8, HDR, hl);
    assert_int_equal(tu_write_file(p, b, len), 0);
    free(b);
    return p;
}

static void test_inspect_text(void **state) {
    (void)state;
    char *dir = tu_mkdtemp(), *p = write_fixture(dir);
    char *out, *err;
    assert_int_equal(tu_run_cli(&out, &err, "inspect '%s'", p), 0);
    assert_string_equal(err, "");
    tu_assert_contains(out, "4 tensors, 36 data bytes");
    tu_assert_contains(out, "metadata (2):\n  format: pt\n  note: hi there\n");
    /* One line per tensor in file order: big, s, e, h. */
    const char *order[] = {"  big ", "  s ", "  e ", "  h "};
    const char *pos = out;
    for (int i = 0; i < 4; i++) {
        const char *q = strstr(pos, order[i]);
        if (!q) print_error("%s not found in order in:\n%s\n", order[i], out);
        assert_non_null(q);
        pos = q + 1;
    }
    char *line = strstr(out, "  big ");
    tu_assert_contains(line, "F32");
    tu_assert_contains(line, "[2, 3]");
    tu_assert_contains(strstr(out, "  s "), "I64      []");
    tu_assert_contains(out, "totals by dtype:\n  BF16     2 tensors  4 bytes\n  F32      1 tensors  24 bytes\n"
                            "  I64      1 tensors  8 bytes\n  total    4 tensors  36 bytes\n");
    free(out); free(err);
    assert_int_equal(tu_run_cli(&out, &err, "inspect"), 2);
    tu_assert_contains(err, "missing FILE");
    free(out); free(err);
    assert_int_equal(tu_run_cli(&out, &err, "inspect '%s' extra", p), 2);
    free(out); free(err);
    assert_int_equal(tu_run_cli(&out, &err, "inspect --help"), 0);
    tu_assert_contains(out, "usage: lorakit inspect FILE|DIR [--json]");
    free(out); free(err);
    tu_rmtree(dir);
    free(dir);
    free(p);
}

static void test_inspect_json(void **state) {
    (void)state;
    char *dir = tu_mkdtemp(), *p = write_fixture(dir);
    char *out, *err;
    assert_int_equal(tu_run_cli(&out, &err, "inspect --json '%s'", p), 0);
    json_error_t je;
    json_t *o = json_loads(out, 0, &je);
    if (!o) print_error("bad JSON: %s\n%s\n", je.text, out);
    assert_non_null(o);
    size_t hl = strlen(HDR);
    assert_string_equal(json_string_value(json_object_get(o, "path")), p);
    assert_int_equal(json_integer_value(json_object_get(o, "header_bytes")), hl);
    assert_int_equal(json_integer_value(json_object_get(o, "file_bytes")), 8 + hl + 36);
    assert_int_equal(json_integer_value(json_object_get(o, "tensor_count")), 4);
    assert_int_equal(json_integer_value(json_object_get(o, "total_bytes")), 36);
    json_t *m = json_object_get(o, "metadata");
    assert_int_equal(json_object_size(m), 2);
    assert_string_equal(json_string_value(json_object_get(m, "note")), "hi there");
    json_t *ts = json_object_get(o, "tensors");
    assert_int_equal(json_array_size(ts), 4);
    static const struct { const char *n, *dt; int nd; int64_t sh[2]; long long bytes, off; } want[] = {
        {"big", "F32", 2, {2, 3}, 24, 0}, {"s", "I64", 0, {0}, 8, 24}, {"e", "BF16", 2, {0, 4}, 0, 32}, {"h", "BF16", 1, {2}, 4, 32}};
    for (size_t i = 0; i < 4; i++) {
        json_t *t = json_array_get(ts, i);
        assert_string_equal(json_string_value(json_object_get(t, "name")), want[i].n);
        assert_string_equal(json_string_value(json_object_get(t, "dtype")), want[i].dt);
        json_t *sh = json_object_get(t, "shape");
        assert_int_equal(json_array_size(sh), want[i].nd);
        for (int d = 0; d < want[i].nd; d++) assert_int_equal(json_integer_value(json_array_get(sh, (size_t)d)), want[i].sh[d]);
        assert_int_equal(json_integer_value(json_object_get(t, "bytes")), want[i].bytes);
        assert_int_equal(json_integer_value(json_object_get(t, "offset")), 8 + (long long)hl + want[i].off);
    }
    json_t *tot = json_object_get(o, "totals");
    assert_int_equal(json_integer_value(json_object_get(json_object_get(tot, "BF16"), "tensors")), 2);
    assert_int_equal(json_integer_value(json_object_get(json_object_get(tot, "BF16"), "bytes")), 4);
    assert_int_equal(json_integer_value(json_object_get(json_object_get(tot, "F32"), "bytes")), 24);
    assert_null(json_object_get(tot, "F16"));
    json_decref(o);
    free(out); free(err);
    tu_rmtree(dir);
    free(dir);
    free(p);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_inspect_text),
        cmocka_unit_test(test_inspect_json),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
