/* test_knobs.c — the settings table (lorakit/knobs.h) and its one MiB ->
 * bytes conversion. Expected numbers are the documented defaults and
 * bounds (README: 64 MiB swap bucket, 4 MiB sync bucket, 300 s timeout,
 * threads 0..4096) and hand-computed byte counts (x 2^20, toward zero). */
#include "testutil.h"

#include <string.h>

#include "lorakit/comm.h"
#include "lorakit/tracker.h"

static void test_rows(void **state) {
    (void)state;
    const lk_knob *k = lk_knob_get(LK_KNOB_SWAP_BUCKET_MB);
    assert_string_equal(k->id, "SWAP_BUCKET_MB");
    assert_string_equal(k->name, "bucket_mb");
    assert_true(k->def == 64 && k->min == 1 && k->max == 1048576);
    assert_true(LK_TRACKER_BUCKET_DEFAULT == (size_t)64 << 20);
    assert_true(LK_COMM_AVERAGE_BUCKET_DEFAULT == (size_t)4 << 20);
    assert_true(LK_COMM_TIMEOUT_DEFAULT == 300.0);
    assert_null(lk_knob_get(LK_KNOB_COUNT));
    for (int i = 0; i < LK_KNOB_COUNT; i++) { /* every row well formed */
        k = lk_knob_get((lk_knob_id)i);
        assert_true(k->min <= k->def && k->def <= k->max);
        assert_true(*k->name && *k->unit && *k->layer && *k->what);
    }
    char r[64];
    assert_string_equal(lk_knob_range(LK_KNOB_TIMEOUT_S, r, sizeof r), "0..1e9");
    assert_string_equal(lk_knob_range(LK_KNOB_SWAP_BUCKET_MB, r, sizeof r), "1..1048576");
    assert_string_equal(lk_knob_range(LK_KNOB_THREADS, r, sizeof r), "0..4096");
    assert_true(lk_knob_in_range(LK_KNOB_TIMEOUT_S, 0.5) && !lk_knob_in_range(LK_KNOB_TIMEOUT_S, 1e9 + 1));
    assert_false(lk_knob_in_range(LK_KNOB_TIMEOUT_S, 0.0 / 0.0));
}

static void test_mib_bytes(void **state) {
    (void)state;
    size_t b = 1;
    assert_int_equal(lk_knob_mib_bytes(LK_KNOB_SWAP_BUCKET_MB, 64, &b), LK_OK);
    assert_true(b == (size_t)64 << 20);
    assert_int_equal(lk_knob_mib_bytes(LK_KNOB_SYNC_BUCKET_MB, 1.0 / 1024, &b), LK_OK);
    assert_true(b == 1024);
    assert_int_equal(lk_knob_mib_bytes(LK_KNOB_SYNC_BUCKET_MB, 1.5 / 1048576, &b), LK_OK);
    assert_true(b == 1); /* 1.5 bytes, toward zero */
    assert_int_equal(lk_knob_mib_bytes(LK_KNOB_SYNC_BUCKET_MB, 0.5 / 1048576, &b), LK_ERR_ARG);
    assert_true(b == 0);
    tu_assert_contains(lk_last_error(), "bucket_mb: 4.76837e-07 MiB rounds to 0 bytes");
    assert_int_equal(lk_knob_mib_bytes(LK_KNOB_SYNC_BUCKET_MB, 0, &b), LK_ERR_ARG);
    tu_assert_contains(lk_last_error(), "bucket_mb: 0 MiB rounds to 0 bytes");
    assert_int_equal(lk_knob_mib_bytes(LK_KNOB_SWAP_BUCKET_MB, 0, &b), LK_ERR_ARG);
    tu_assert_contains(lk_last_error(), "bucket_mb: 0 MiB is outside 1..1048576");
    assert_int_equal(lk_knob_mib_bytes(LK_KNOB_SWAP_BUCKET_MB, 1048577, &b), LK_ERR_ARG);
    tu_assert_contains(lk_last_error(), "outside 1..1048576");
    assert_int_equal(lk_knob_mib_bytes(LK_KNOB_COUNT, 1, &b), LK_ERR_ARG);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_rows), cmocka_unit_test(test_mib_bytes)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
