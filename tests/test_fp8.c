/* test_fp8.c — FP8 (F8_E4M3 = e4m3fn, F8_E5M2) decoding and rounding.
 *
 * Oracle: a double-precision reference (tests/util/fp8_ref.h), by bit manipulation
 * and by a different algorithm than src/core/dtype.c: decode takes the
 * sign/exponent/mantissa fields apart by the formats' definitions (OCP FP8:
 * e4m3fn has no Inf and S.1111.111 as its only NaN; e5m2 is IEEE-like);
 * encode lists every finite non-negative value in order and picks, for |x|,
 * the nearer of its two neighbours, ties to the even code (mantissa LSB 0),
 * with one value past the largest finite (the next binade step: 480 for
 * e4m3fn, 65536 for e5m2) standing for overflow. Checked on all 256 codes
 * and on a million random values drawn to hit ties, subnormals, the
 * largest values and overflow. */
#include "testutil.h"
#include "fp8_ref.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void check_decode(const ref_fmt *f) {
    for (unsigned c = 0; c < 256; c++) {
        double want = ref_decode(f, c);
        float got = lk_fp8_to_f32((uint8_t)c, f->dt);
        if (isnan(want)) {
            assert_true(isnan(got));
        } else {
            if ((double)got != want) fail_msg("%s code 0x%02x: got %.9g want %.9g", lk_dtype_name(f->dt), c, got, want);
            assert_int_equal(signbit(got) != 0, (c & 0x80u) != 0);
        }
        /* bulk decode agrees */
        uint8_t b = (uint8_t)c;
        float bulk;
        lk_to_f32(&bulk, &b, f->dt, 1);
        assert_memory_equal(&bulk, &got, 4);
    }
    assert_true(ref_decode(f, f->has_inf ? 0x7b : 0x7e) == lk_fp8_max(f->dt));
}

static void test_decode_all_codes(void **state) {
    (void)state;
    check_decode(&E4M3);
    check_decode(&E5M2);
    /* spot values from the OCP FP8 spec */
    assert_true(lk_fp8_to_f32(0x7e, LK_DTYPE_F8_E4M3) == 448.0f);
    assert_true(lk_fp8_to_f32(0x01, LK_DTYPE_F8_E4M3) == 0x1p-9f);
    assert_true(isnan(lk_fp8_to_f32(0x7f, LK_DTYPE_F8_E4M3)));
    assert_true(lk_fp8_to_f32(0x78, LK_DTYPE_F8_E4M3) == 256.0f); /* no Inf in e4m3fn */
    assert_true(lk_fp8_to_f32(0x7b, LK_DTYPE_F8_E5M2) == 57344.0f);
    assert_true(isinf(lk_fp8_to_f32(0x7c, LK_DTYPE_F8_E5M2)));
    assert_true(lk_fp8_to_f32(0x01, LK_DTYPE_F8_E5M2) == 0x1p-16f);
}

static void check_one(const ref_fmt *f, double x) {
    unsigned want;
    int wov = ref_encode(f, x, &want);
    uint8_t got;
    int gov = lk_fp8_from_double(x, f->dt, 0, 0, &got);
    if (gov != wov || got != want)
        fail_msg("%s: x = %.17g: got 0x%02x overflow %d, want 0x%02x overflow %d", lk_dtype_name(f->dt), x, got, gov,
                 want, wov);
}

/* A million values per format: uniform exponents over the whole range and
 * past it, exact midpoints between neighbours (ties), subnormals, values
 * next to the largest finite and its overflow threshold. */
static void check_rne(const ref_fmt *f) {
    tu_rng r = {f->dt * 7919u + 1};
    double val[128];
    unsigned code[128];
    int n = ref_table(f, val, code);
    int emin = 1 - f->bias - f->mbits - 2, emax = (int)log2(val[n - 1]) + 3;
    for (int i = 0; i < 1000000; i++) {
        uint64_t u = tu_next(&r);
        double x;
        switch (u % 5) {
        case 0: /* a random double in the format's range and past it */
            x = ldexp(1.0 + (double)(u >> 11) * 0x1p-53, emin + (int)((u >> 3) % (unsigned)(emax - emin)));
            break;
        case 1: { /* an exact tie between neighbours */
            int k = (int)((u >> 8) % (unsigned)(n - 1));
            x = (val[k] + val[k + 1]) / 2;
            break;
        }
        case 2: { /* a tie nudged by one double ulp either way */
            int k = (int)((u >> 8) % (unsigned)(n - 1));
            x = (val[k] + val[k + 1]) / 2;
            x = nextafter(x, (u >> 40) & 1 ? INFINITY : 0);
            break;
        }
        case 3: /* subnormal range */
            x = ldexp((double)(u >> 11) * 0x1p-53, 1 - f->bias);
            break;
        default: { /* around the largest finite and the overflow threshold */
            double top = val[n - 1], step = top - val[n - 2];
            x = top + step * ((double)(u >> 11) * 0x1p-53 * 2.0 - 0.5);
            break;
        }
        }
        if ((u >> 63) & 1) x = -x;
        check_one(f, x);
    }
    /* the thresholds named in dtype.h */
    uint8_t c;
    if (f->dt == LK_DTYPE_F8_E4M3) {
        assert_int_equal(lk_fp8_from_double(464.0, f->dt, 0, 0, &c), 0);
        assert_int_equal(c, 0x7e);
        assert_int_equal(lk_fp8_from_double(nextafter(464.0, 1e9), f->dt, 0, 0, &c), 1);
    } else {
        assert_int_equal(lk_fp8_from_double(nextafter(61440.0, 0), f->dt, 0, 0, &c), 0);
        assert_int_equal(lk_fp8_from_double(61440.0, f->dt, 0, 0, &c), 1);
    }
    assert_int_equal(lk_fp8_from_double(-INFINITY, f->dt, 0, 0, &c), 1);
    assert_int_equal(c, 0xffu & (0x80u | (f->dt == LK_DTYPE_F8_E4M3 ? 0x7eu : 0x7bu)));
    assert_int_equal(lk_fp8_from_double(NAN, f->dt, 0, 0, &c), 0);
    assert_true(isnan(lk_fp8_to_f32(c, f->dt)));
    assert_int_equal(lk_fp8_from_double(-0.0, f->dt, 0, 0, &c), 0);
    assert_int_equal(c, 0x80);
    /* far below the smallest subnormal, double subnormals included */
    const double tiny[] = {1e-30, -1e-300, 4.9406564584124654e-324, ldexp(1.0, 1 - f->bias - f->mbits - 1)};
    for (int i = 0; i < 4; i++) check_one(f, tiny[i]);
    assert_int_equal(lk_fp8_from_double(1e-30, f->dt, 1, 0, &c), 0);
    assert_int_equal(c, 0x01); /* stochastic: up with probability ~1e-30 / quantum, here rbits = 0 */
    assert_int_equal(lk_fp8_from_double(1e-30, f->dt, 1, 1, &c), 0);
    assert_int_equal(c, 0x00);
}

static void test_round_nearest_even(void **state) {
    (void)state;
    check_rne(&E4M3);
    check_rne(&E5M2);
}

/* Stochastic: rounds up iff rbits * 2^-32 < the fraction toward the next
 * value; never overflows below the largest finite. */
static void test_stochastic_rule(void **state) {
    (void)state;
    uint8_t c;
    /* 1.0 + 0.3 * ulp(1) in e4m3fn: ulp 0.125, fraction 0.3 */
    double x = 1.0 + 0.3 * 0.125;
    uint32_t thr = (uint32_t)(0.3 * 4294967296.0);
    assert_int_equal(lk_fp8_from_double(x, LK_DTYPE_F8_E4M3, 1, thr, &c), 0);
    assert_int_equal(c, 0x39); /* 1.125: rbits*2^-32 < 0.3 */
    assert_int_equal(lk_fp8_from_double(x, LK_DTYPE_F8_E4M3, 1, thr + 1, &c), 0);
    assert_int_equal(c, 0x38); /* 1.0 */
    /* exact values never move */
    assert_int_equal(lk_fp8_from_double(1.125, LK_DTYPE_F8_E4M3, 1, 0, &c), 0);
    assert_int_equal(c, 0x39);
    /* subnormal: 1.5 quanta of 2^-9 */
    assert_int_equal(lk_fp8_from_double(1.5 * 0x1p-9, LK_DTYPE_F8_E4M3, 1, 0, &c), 0);
    assert_int_equal(c, 0x02);
    assert_int_equal(lk_fp8_from_double(1.5 * 0x1p-9, LK_DTYPE_F8_E4M3, 1, 0xffffffffu, &c), 0);
    assert_int_equal(c, 0x01);
    /* past max: overflow whatever the bits */
    assert_int_equal(lk_fp8_from_double(449.0, LK_DTYPE_F8_E4M3, 1, 0xffffffffu, &c), 1);
    assert_int_equal(lk_fp8_from_double(448.0, LK_DTYPE_F8_E4M3, 1, 0, &c), 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_decode_all_codes),
        cmocka_unit_test(test_round_nearest_even),
        cmocka_unit_test(test_stochastic_rule),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
