/* test_dtype.c — F32/F16/BF16 conversions against an independent reference.
 *
 * The reference below rounds with double arithmetic (frexp, ldexp, rint in the
 * default round-to-nearest-even mode) and encodes the bits field by field;
 * it shares nothing with the bit tricks in src/core/dtype.c. Checked:
 *  - all 65,536 bf16 and f16 patterns: to f32 equals the ldexp formula, and
 *    back to bf16/f16 gives the same bits (NaN payloads included);
 *  - over a million f32 values (random bit patterns, exact ties in the normal
 *    and subnormal ranges, f32 subnormals, overflow boundaries, Inf, NaN):
 *    f32 -> bf16/f16 equals the reference, through the scalar functions and
 *    through the bulk lk_from_f32 / lk_to_f32 paths (odd lengths and
 *    offsets, so vector bodies and tails are both used). */
#include "testutil.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int mant;  /* stored mantissa bits */
    int bias;
} fmt16;

static const fmt16 BF16 = {7, 127};
static const fmt16 F16 = {10, 15};

static uint32_t f2u(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static float u2f(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Value of a 16-bit pattern (finite or Inf), by the definition of the format. */
static double ref_decode(uint16_t h, fmt16 f) {
    int ebits = 15 - f.mant;
    uint32_t emax = (1u << ebits) - 1;
    uint32_t e = (h >> f.mant) & emax, m = h & ((1u << f.mant) - 1);
    double s = (h & 0x8000) ? -1.0 : 1.0;
    if (e == emax) return m ? NAN : s * INFINITY;
    if (e == 0) return s * ldexp((double)m, 1 - f.bias - f.mant);
    return s * ldexp(1.0 + ldexp((double)m, -f.mant), (int)e - f.bias);
}

/* Round a finite or infinite f32 value to the format (RNE), encode the bits. */
static uint16_t ref_encode(float x, fmt16 f) {
    int ebits = 15 - f.mant;
    uint16_t emax = (uint16_t)((1u << ebits) - 1);
    uint16_t sign = (f2u(x) >> 16) & 0x8000;
    uint16_t inf = (uint16_t)(sign | (emax << f.mant));
    double a = fabs((double)x);
    if (isinf(a)) return inf;
    if (a == 0) return sign;
    int emin = 1 - f.bias;
    int e;
    frexp(a, &e);                       /* a = m * 2^e, m in [0.5, 1) */
    int E = e - 1 > emin ? e - 1 : emin; /* exponent of the leading bit, clamped for subnormals */
    double ulp = ldexp(1.0, E - f.mant);
    double r = rint(a / ulp) * ulp;      /* exact: a/ulp is a power-of-2 scaling */
    double maxfin = ldexp(2.0 - ldexp(1.0, -f.mant), f.bias);
    if (r > maxfin) return inf;
    if (r == 0) return sign;
    frexp(r, &e);
    E = e - 1;
    if (E < emin) return (uint16_t)(sign | (uint16_t)(r / ldexp(1.0, emin - f.mant)));
    uint16_t m = (uint16_t)(r / ldexp(1.0, E - f.mant) - ldexp(1.0, f.mant));
    return (uint16_t)(sign | ((uint16_t)(E + f.bias) << f.mant) | m);
}

/* Checks one conversion result; for NaN: NaN, same sign, top payload bits
 * kept (the quiet bit may be added so a NaN never turns into Inf). */
static void check_one(float x, uint16_t got, fmt16 f, const char *what) {
    uint32_t u = f2u(x);
    if (isnan(x)) {
        uint16_t expo = (uint16_t)(((1u << (15 - f.mant)) - 1) << f.mant);
        uint16_t mmask = (uint16_t)((1u << f.mant) - 1), quiet = (uint16_t)(1u << (f.mant - 1));
        uint16_t top = (uint16_t)((u >> (23 - f.mant)) & mmask);
        if ((got & expo) != expo || (got & mmask) == 0 || (got & 0x8000) != ((u >> 16) & 0x8000) ||
            ((got & mmask) | quiet) != (top | quiet)) {
            print_error("%s: NaN 0x%08x -> 0x%04x\n", what, u, got);
            fail();
        }
        return;
    }
    uint16_t want = ref_encode(x, f);
    if (got != want) {
        print_error("%s: f32 0x%08x (%.9g) -> 0x%04x, reference 0x%04x\n", what, u, (double)x, got, want);
        fail();
    }
}

/* Sanity of the reference itself on hand-computed values. */
static void test_reference_known(void **state) {
    (void)state;
    assert_int_equal(ref_encode(1.0f, F16), 0x3c00);
    assert_int_equal(ref_encode(65504.0f, F16), 0x7bff);
    assert_int_equal(ref_encode(65519.996f, F16), 0x7bff);
    assert_int_equal(ref_encode(65520.0f, F16), 0x7c00);      /* tie to even -> Inf */
    assert_int_equal(ref_encode(ldexpf(1, -24), F16), 0x0001); /* smallest subnormal */
    assert_int_equal(ref_encode(ldexpf(1, -25), F16), 0x0000); /* tie to even -> 0 */
    assert_int_equal(ref_encode(ldexpf(3, -25), F16), 0x0002); /* 1.5 ulp -> 2 */
    assert_int_equal(ref_encode(-2.0f, F16), 0xc000);
    assert_int_equal(ref_encode(1.0f, BF16), 0x3f80);
    assert_int_equal(ref_encode(u2f(0x3f808000u), BF16), 0x3f80); /* tie, even below */
    assert_int_equal(ref_encode(u2f(0x3f818000u), BF16), 0x3f82); /* tie, even above */
    assert_int_equal(ref_encode(u2f(0x7f7fffffu), BF16), 0x7f80); /* FLT_MAX -> Inf */
    assert_int_equal(ref_encode(u2f(0x00000001u), BF16), 0x0000);
    assert_int_equal(ref_encode(u2f(0x00008000u), BF16), 0x0000); /* tie -> even 0 */
    assert_int_equal(ref_encode(u2f(0x00018000u), BF16), 0x0002);
    assert_true(ref_decode(0x3c00, F16) == 1.0);
    assert_true(ref_decode(0x0001, F16) == ldexp(1, -24));
    assert_true(ref_decode(0x7f7f, BF16) == ldexp(255.0 / 128.0, 127));
}

static void all_patterns(fmt16 f, float (*to32)(uint16_t), uint16_t (*from32)(float), lk_dtype dt) {
    uint16_t *h = malloc(65536 * 2), *back = malloc(65536 * 2);
    float *v = malloc(65536 * 4);
    for (uint32_t i = 0; i < 65536; i++) h[i] = (uint16_t)i;
    lk_to_f32(v, h, dt, 65536);
    lk_from_f32(back, v, dt, 65536);
    for (uint32_t i = 0; i < 65536; i++) {
        float s = to32((uint16_t)i);
        double want = ref_decode((uint16_t)i, f);
        if (isnan(want)) {
            assert_true(isnan(s) && isnan(v[i]));
            assert_int_equal(f2u(s) >> 31, i >> 15); /* sign kept */
        } else {
            if ((double)s != want || f2u(s) != f2u(v[i]) || (signbit(s) != 0) != ((i & 0x8000) != 0)) {
                print_error("pattern 0x%04x -> %.9g (bulk %.9g), want %.9g\n", i, (double)s, (double)v[i], want);
                fail();
            }
        }
        /* Back unchanged, scalar and bulk, NaN included. */
        if (from32(s) != i || back[i] != i) {
            print_error("pattern 0x%04x -> f32 0x%08x -> 0x%04x (bulk 0x%04x)\n", i, f2u(s), from32(s), back[i]);
            fail();
        }
    }
    free(h);
    free(back);
    free(v);
}

static void test_bf16_all_patterns(void **state) {
    (void)state;
    all_patterns(BF16, lk_bf16_to_f32, lk_f32_to_bf16, LK_DTYPE_BF16);
}

static void test_f16_all_patterns(void **state) {
    (void)state;
    all_patterns(F16, lk_f16_to_f32, lk_f32_to_f16, LK_DTYPE_F16);
}

/* Test values: 8 kinds in turn, each stressing a different region. */
static float gen_value(tu_rng *r, size_t i) {
    uint32_t x = (uint32_t)tu_next(r);
    uint32_t sign = x & 0x80000000u;
    switch (i % 8) {
    case 0: return u2f(x); /* any pattern: NaN, Inf, subnormals, all exponents */
    case 1: return u2f((x & 0xffff0000u) | 0x8000u); /* exact bf16 ties */
    case 2: /* exact f16 ties in the f16 normal range: exponent 113..142 */
        return u2f(sign | ((113u + (x >> 8) % 30u) << 23) | (x & 0x7fe000u) | 0x1000u);
    case 3: /* f16 subnormal range 2^-26 .. 2^-14, including exact ties k*2^-25 */
        if (x & 1) return u2f(sign) + ldexpf((float)((x >> 1) % 4096u), -25) * (sign ? -1.0f : 1.0f);
        return u2f(sign | ((101u + (x >> 8) % 13u) << 23) | (x & 0x7fffffu));
    case 4: return u2f(sign | (x & 0x007fffffu)); /* f32 subnormals */
    case 5: /* near the f16 overflow boundary 65504 .. 65536 */
        return u2f(sign | (0x477fe000u + (x >> 8) % 0x3000u));
    case 6: /* near the bf16/f32 top: exponent 254, Inf and NaN */
        return u2f(sign | 0x7f000000u | (x & 0x00ffffffu));
    default: return tu_uniform(r, -4.0f, 4.0f); /* ordinary values */
    }
}

static void random_values(fmt16 f, uint16_t (*from32)(float), lk_dtype dt, uint64_t seed) {
    enum { N = 1 << 20, CH = 4099 };
    tu_rng r = {seed};
    float *v = malloc((N + 8) * sizeof *v);
    uint16_t *bulk = malloc((N + 8) * 2);
    for (size_t i = 0; i < N; i++) v[i] = gen_value(&r, i);
    /* Bulk in odd-sized chunks at odd offsets (unaligned vector starts, tails). */
    for (size_t off = 0; off < N; off += CH) {
        size_t n = N - off < CH ? N - off : CH;
        lk_from_f32(bulk + off, v + off, dt, n);
    }
    for (size_t i = 0; i < N; i++) {
        check_one(v[i], from32(v[i]), f, dt == LK_DTYPE_F16 ? "f16 scalar" : "bf16 scalar");
        check_one(v[i], bulk[i], f, dt == LK_DTYPE_F16 ? "f16 bulk" : "bf16 bulk");
    }
    free(v);
    free(bulk);
}

static void test_bf16_random(void **state) {
    (void)state;
    random_values(BF16, lk_f32_to_bf16, LK_DTYPE_BF16, 1234);
}

static void test_f16_random(void **state) {
    (void)state;
    random_values(F16, lk_f32_to_f16, LK_DTYPE_F16, 5678);
}

/* F32 bulk is a copy; the dtype table matches the safetensors names/sizes. */
static void test_table_and_f32(void **state) {
    (void)state;
    static const struct { const char *n; size_t sz; } want[] = {
        {"BOOL", 1}, {"U8", 1}, {"I8", 1}, {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"I16", 2}, {"U16", 2},
        {"F16", 2}, {"BF16", 2}, {"I32", 4}, {"U32", 4}, {"F32", 4}, {"F64", 8}, {"I64", 8}, {"U64", 8}};
    for (int d = 1; d < LK_DTYPE_COUNT; d++) {
        assert_string_equal(lk_dtype_name((lk_dtype)d), want[d - 1].n);
        assert_int_equal(lk_dtype_size((lk_dtype)d), want[d - 1].sz);
        assert_int_equal(lk_dtype_from_name(want[d - 1].n, strlen(want[d - 1].n)), d);
    }
    assert_int_equal(lk_dtype_from_name("F3", 2), LK_DTYPE_INVALID);
    assert_int_equal(lk_dtype_from_name("F32 ", 4), LK_DTYPE_INVALID);
    assert_int_equal(lk_dtype_size(LK_DTYPE_INVALID), 0);
    float a[5] = {1, -0.0f, NAN, INFINITY, 3.5f}, b[5];
    lk_from_f32(b, a, LK_DTYPE_F32, 5);
    assert_memory_equal(a, b, sizeof a);
    assert_true(lk_dtype_is_fusable(LK_DTYPE_BF16) && !lk_dtype_is_fusable(LK_DTYPE_F64));
}

/* Bulk conversion from and to an odd address (a tensor in a file whose
 * header length is odd), over more elements than one internal chunk.
 * Expectation by hand: small integers are exact in F16 and BF16, so the
 * round trip is the identity; 1.0 is F16 0x3c00 / BF16 0x3f80 and -2.0 is
 * 0xc000 in both (IEEE 754 binary16 and the top half of binary32). */
static void test_unaligned(void **state) {
    (void)state;
    enum { N = 1500 };
    static float src[N], back[N];
    static unsigned char raw[2 * N + 1];
    for (int i = 0; i < N; i++) src[i] = (float)(i % 256 - 128);
    src[0] = 1.0f;
    src[N - 1] = -2.0f;
    const lk_dtype dts[2] = {LK_DTYPE_F16, LK_DTYPE_BF16};
    const unsigned one[2] = {0x3c00, 0x3f80};
    for (int k = 0; k < 2; k++) {
        unsigned char *odd = raw + 1;
        lk_from_f32(odd, src, dts[k], N);
        assert_int_equal(odd[0] | odd[1] << 8, one[k]);
        assert_int_equal(odd[2 * N - 2] | odd[2 * N - 1] << 8, 0xc000);
        memset(back, 0, sizeof back);
        lk_to_f32(back, odd, dts[k], N);
        assert_memory_equal(back, src, sizeof src);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_unaligned),
        cmocka_unit_test(test_reference_known),
        cmocka_unit_test(test_table_and_f32),
        cmocka_unit_test(test_bf16_all_patterns),
        cmocka_unit_test(test_f16_all_patterns),
        cmocka_unit_test(test_bf16_random),
        cmocka_unit_test(test_f16_random),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
