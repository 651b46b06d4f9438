/* test_strength.c — a strength is the double typed, end to end (issue 20,
 * item 1): lk_fuse_file, lk_fuse_tensors, the tracker and the CLI fuse F32
 * weights that partly cancel the delta with strength 0.7 (and 0.7 / -0.3,
 * and a three-adapter mix at 0.3) to the correctly rounded value of the
 * exact W + sum s * B A with s the double 0.7. The reference is a
 * double-double evaluation written here (TwoSum / TwoProd, then a correct
 * rounding to f32 against the two neighbouring midpoints), independent of
 * the kernel's round-to-odd; the same reference with the float 0.7f differs
 * on almost every element, so the test fails if any path rounds the
 * strength to float. Plus the strength text rules (lk_fuse_strength_parse,
 * the CLI's -l ADAPTER:STRENGTH split, plans), the shortest decimal in
 * messages and JSON (lk_num_str), and a product with the module
 * scale that overflows. */
#include "adapter_ref.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define OUT 48
#define IN 40
#define MAXT 3

static tu_rng g_rng = {20201};

/* ---- the double-double reference ---- */
typedef struct dd {
    double hi, lo;
} dd;

static dd two_sum(double a, double b) {
    double s = a + b, bb = s - a;
    return (dd){s, (a - (s - bb)) + (b - bb)};
}
static dd renorm(double hi, double lo) {
    double s = hi + lo;
    return (dd){s, lo - (s - hi)};
}
static dd dd_mul(dd x, double y) {
    double p = x.hi * y, e = fma(x.hi, y, -p);
    return renorm(p, e + x.lo * y);
}
static dd dd_add(dd x, dd y) {
    dd s = two_sum(x.hi, y.hi);
    return renorm(s.hi, s.lo + x.lo + y.lo);
}

/* x rounded to nearest-even f32; *tie_close = 1 when x lies within tol of a
 * midpoint (the kernel's own f64 chain may then land on either side). */
static float dd_to_f32(dd x, double tol, int *tie_close) {
    float f = (float)x.hi;
    for (int step = 0; step < 2; step++) {
        float up = nextafterf(f, INFINITY), dn = nextafterf(f, -INFINITY);
        double mu = ((double)f + (double)up) / 2, md = ((double)f + (double)dn) / 2;
        double ru = (x.hi - mu) + x.lo, rd = (x.hi - md) + x.lo; /* x - midpoint */
        if (fabs(ru) <= tol || fabs(rd) <= tol) *tie_close = 1;
        if (ru > 0) f = up;
        else if (rd < 0) f = dn;
        else break;
    }
    return f;
}

/* ---- fixtures ---- */
typedef struct term {
    float A[IN], B[OUT]; /* rank 1: B is OUT x 1, A is 1 x IN */
    double s;            /* the strength */
} term;

/* W that partly cancels the delta: W = -(sum s B A) (1 + u), |u| < 2^-12,
 * rounded to f32, so W + delta is about 2^-13 of either. */
static void make_w(float *w, const term *t, size_t nt) {
    for (int o = 0; o < OUT; o++)
        for (int j = 0; j < IN; j++) {
            double d = 0;
            for (size_t k = 0; k < nt; k++) d += t[k].s * t[k].B[o] * t[k].A[j];
            w[o * IN + j] = (float)(-d * (1.0 + tu_uniform(&g_rng, -1.0f / 4096, 1.0f / 4096)));
        }
}

/* The correctly rounded W + sum s_k B A with the strengths as given (or
 * each rounded to float); returns the elements too close to a midpoint to
 * judge (the kernel's f64 chain carries a few 2^-53 of sum |s B A|). */
static size_t reference(float *ref, unsigned char *amb, const float *w, const term *t, size_t nt,
                        int float_strength) {
    size_t close = 0;
    for (int o = 0; o < OUT; o++)
        for (int j = 0; j < IN; j++) {
            dd x = {w[o * IN + j], 0};
            double mag = 0;
            for (size_t k = 0; k < nt; k++) {
                double s = float_strength ? (double)(float)t[k].s : t[k].s;
                x = dd_add(x, dd_mul(dd_mul((dd){s, 0}, t[k].B[o]), t[k].A[j]));
                mag += fabs(s * t[k].B[o] * t[k].A[j]);
            }
            int tc = 0;
            ref[o * IN + j] = dd_to_f32(x, 8 * ldexp(mag, -53), &tc);
            amb[o * IN + j] = (unsigned char)tc;
            close += (size_t)tc;
        }
    return close;
}

static void write_base(const char *path, const float *w) {
    af_file *f = af_new();
    lk_tensor *t = af_rand(f, "blk.w.weight", LK_DTYPE_F32, OUT, IN, &g_rng, 0, 1);
    memcpy(t->data, w, sizeof(float) * OUT * IN);
    af_rand(f, "blk.other.weight", LK_DTYPE_F32, 4, 4, &g_rng, -1, 1);
    af_save(f, path, NULL, 0);
    af_free(f);
}

/* A diffusers-form rank-1 adapter on blk.w (alpha = r: module scale 1). */
static void write_adapter(const char *path, const term *t) {
    af_file *f = af_new();
    memcpy(af_rand(f, "blk.w.lora_A.weight", LK_DTYPE_F32, 1, IN, &g_rng, 0, 1)->data, t->A, sizeof t->A);
    memcpy(af_rand(f, "blk.w.lora_B.weight", LK_DTYPE_F32, OUT, 1, &g_rng, 0, 1)->data, t->B, sizeof t->B);
    af_save(f, path, NULL, 0);
    af_free(f);
}

/* Elements of got (f32) that are not ref, skipping none: the count. */
static size_t count_diff(const float *got, const float *ref) {
    size_t n = 0;
    for (int i = 0; i < OUT * IN; i++) n += memcmp(&got[i], &ref[i], 4) != 0;
    return n;
}

static const float *tensor_in(lk_st *st, const char *name) {
    long k = lk_st_find(st, name);
    assert_true(k >= 0);
    return lk_st_tensor(st, (size_t)k)->data;
}

/* One mix of strengths through every path. */
static void check_mix(const double *s, size_t nt) {
    term t[MAXT];
    char *ad[MAXT];
    lk_fuse_input in[MAXT];
    for (size_t k = 0; k < nt; k++) {
        for (int j = 0; j < IN; j++) t[k].A[j] = tu_uniform(&g_rng, -1, 1);
        for (int o = 0; o < OUT; o++) t[k].B[o] = tu_uniform(&g_rng, -1, 1);
        t[k].s = s[k];
        char name[48];
        snprintf(name, sizeof name, "ad%zu.safetensors", k);
        ad[k] = tu_path(ar_dir, name);
        write_adapter(ad[k], &t[k]);
        in[k] = (lk_fuse_input){ad[k], s[k], LK_FORMAT_AUTO};
    }
    static float w[OUT * IN], ref[OUT * IN], ref_f[OUT * IN];
    static unsigned char amb[OUT * IN], amb_f[OUT * IN];
    make_w(w, t, nt);
    size_t close = reference(ref, amb, w, t, nt, 0);
    reference(ref_f, amb_f, w, t, nt, 1);
    assert_true(close * 100 < OUT * IN); /* the skip below is rare */
    /* the test can fail: the float strength gives other bytes nearly everywhere */
    size_t fdiff = count_diff(ref_f, ref);
    assert_true(fdiff * 10 > OUT * IN * 9);
    double worst = 0;
    for (int i = 0; i < OUT * IN; i++) {
        double u = fabs((double)ref_f[i] - ref[i]) / (nextafterf(fabsf(ref[i]), INFINITY) - fabsf(ref[i]));
        if (u > worst) worst = u;
    }
    char *base = tu_path(ar_dir, "base.safetensors"), *out = tu_path(ar_dir, "out.safetensors");
    write_base(base, w);
    /* every element not too close to a midpoint is the correctly rounded value */
#define CHECK_ALL(got, what)                                                                               \
    do {                                                                                                   \
        size_t bad_ = 0;                                                                                   \
        for (int i_ = 0; i_ < OUT * IN; i_++) bad_ += !amb[i_] && memcmp(&(got)[i_], &ref[i_], 4) != 0;    \
        if (bad_) fail_msg("%s: %zu of %d elements are not the correctly rounded value", what, bad_, OUT * IN); \
    } while (0)
    /* lk_fuse_file */
    if (lk_fuse_file(base, in, nt, out, NULL, NULL)) fail_msg("fuse: %s", lk_last_error());
    lk_st *st;
    assert_int_equal(lk_st_open(out, &st), LK_OK);
    CHECK_ALL(tensor_in(st, "blk.w.weight"), "lk_fuse_file");
    /* the record holds the strengths used, as the shortest decimals */
    json_t *rec = json_loads(lk_st_metadata_get(st, "lorakit.fused"), 0, NULL);
    assert_non_null(rec);
    for (size_t k = 0; k < nt; k++) {
        int found = 0;
        for (size_t i = 0; i < json_array_size(rec); i++)
            if (!strcmp(json_string_value(json_object_get(json_array_get(rec, i), "path")), ad[k]))
                found = json_real_value(json_object_get(json_array_get(rec, i), "strength")) == s[k];
        assert_true(found);
    }
    json_decref(rec);
    lk_st_close(st);
    /* lk_fuse_tensors, in place */
    lk_weights *lw;
    assert_int_equal(lk_weights_load(base, &lw), LK_OK);
    size_t n = lk_weights_count(lw);
    lk_tensor *tv = calloc(n, sizeof *tv);
    for (size_t i = 0; i < n; i++) tv[i] = *lk_weights_tensor(lw, i);
    if (lk_fuse_tensors(tv, n, in, nt, NULL, NULL)) fail_msg("fuse_tensors: %s", lk_last_error());
    CHECK_ALL((const float *)tv[lk_weights_find(lw, "blk.w.weight")].data, "lk_fuse_tensors");
    free(tv);
    lk_weights_free(lw);
    /* the tracker (one process) */
    lk_comm *c;
    lk_tracker *tr;
    assert_int_equal(lk_comm_self(&c), LK_OK);
    assert_int_equal(lk_weights_load(base, &lw), LK_OK);
    lk_tracker_opts o = LK_TRACKER_OPTS_DEFAULT;
    assert_int_equal(lk_tracker_create(c, lw, &o, &tr), LK_OK);
    if (lk_tracker_apply(tr, in, nt, NULL)) fail_msg("tracker: %s", lk_last_error());
    CHECK_ALL((const float *)lk_weights_tensor(lw, (size_t)lk_weights_find(lw, "blk.w.weight"))->data, "tracker");
    lk_tracker_free(tr);
    lk_weights_free(lw);
    lk_comm_free(c);
    /* the CLI: -l PATH:STRENGTH as typed, --json records it */
    char cmd[4096], sb[LK_NUM_STR_MAX];
    int len = snprintf(cmd, sizeof cmd, "fuse '%s' -o '%s' --json", base, out);
    for (size_t k = 0; k < nt; k++) {
        lk_num_str(s[k], sb);
        len += snprintf(cmd + len, sizeof cmd - (size_t)len, " -l '%s:%s'", ad[k], sb);
    }
    unlink(out);
    char *so = NULL, *se = NULL;
    int rc = tu_run_cli(&so, &se, "%s", cmd);
    if (rc) fail_msg("lorakit %s: exit %d: %s", cmd, rc, se ? se : "");
    assert_int_equal(lk_st_open(out, &st), LK_OK);
    CHECK_ALL(tensor_in(st, "blk.w.weight"), "lorakit fuse");
    lk_st_close(st);
    json_t *sum = json_loads(so, 0, NULL);
    assert_non_null(sum);
    for (size_t k = 0; k < nt; k++) {
        json_t *e = json_array_get(json_object_get(sum, "adapters"), k);
        assert_true(json_real_value(json_object_get(e, "strength")) == s[k]);
    }
    json_decref(sum);
    free(so);
    free(se);
#undef CHECK_ALL
    print_message("%zu adapter(s): the float strength would move %zu of %d elements, by up to %.0f ulp; %zu too "
                  "close to a midpoint to judge\n", nt, fdiff, OUT * IN, worst, close);
    for (size_t k = 0; k < nt; k++) free(ad[k]);
    free(base);
    free(out);
}

static void test_cancel_07(void **state) {
    (void)state;
    const double s[] = {0.7};
    check_mix(s, 1);
}

static void test_cancel_07_m03(void **state) {
    (void)state;
    const double s[] = {0.7, -0.3};
    check_mix(s, 2);
}

static void test_cancel_three(void **state) {
    (void)state;
    const double s[] = {0.3, 1.1, -0.45};
    check_mix(s, 3);
}

/* The text of a strength (CLI, plans): all of it one finite number. */
static void test_parse(void **state) {
    (void)state;
    static const struct {
        const char *text;
        double want; /* when ok */
        const char *err;
    } cases[] = {
        {"0.7", 0.7, NULL},
        {"-0.3", -0.3, NULL},
        {"1e40", 1e40, NULL},       /* a double, not a float's Inf */
        {"1e-320", 1e-320, NULL},   /* subnormal, kept as read */
        {"0x1p-3", 0.125, NULL},
        {"0", 0.0, NULL},
        {"0e-999", 0.0, NULL},      /* zero typed as zero */
        {"1e400", 0, "strength '1e400' is not finite (beyond the range of a double)"},
        {"-1e400", 0, "strength '-1e400' is not finite (beyond the range of a double)"},
        {"inf", 0, "strength 'inf' is not finite"},
        {"NaN", 0, "strength 'NaN' is not finite"},
        {"1e-400", 0, "strength '1e-400' is too small: it reads as 0"},
        {"0.7x", 0, "strength '0.7x' is not a number"},
        {" 0.7", 0, "strength ' 0.7' is not a number"},
        {"", 0, "strength '' is not a number"},
        {"abc", 0, "strength 'abc' is not a number"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        double v = -99;
        lk_status s = lk_fuse_strength_parse(cases[i].text, &v);
        if (!cases[i].err) {
            if (s) fail_msg("'%s': %s", cases[i].text, lk_last_error());
            assert_true(v == cases[i].want);
        } else {
            assert_int_equal(s, LK_ERR_ARG);
            assert_true(v == -99);
            tu_assert_contains(lk_last_error(), cases[i].err);
        }
    }
    /* the shortest decimal that reads back as the same double */
    char b[LK_NUM_STR_MAX];
    assert_string_equal(lk_num_str(0.7, b), "0.7");
    assert_string_equal(lk_num_str(0.1 + 0.2, b), "0.30000000000000004");
    assert_string_equal(lk_num_str(2147483648.0, b), "2147483648"); /* not 2.14748e+09 */
    lk_num_str(1e40, b); /* the exponent as typed: no "+", no leading zeros (QA: :1e308 echoed as 1e+308) */
    assert_string_equal(b, "1e40");
    assert_string_equal(lk_num_str(1e308, b), "1e308");
    assert_string_equal(lk_num_str(-2.5e-5, b), "-2.5e-5");
    assert_string_equal(lk_num_str(1e100, b), "1e100");
    assert_true(strtod(lk_num_str(4.9e-324, b), NULL) == 4.9e-324);
    lk_num_str((double)0.7f, b);
    assert_string_equal(b, "0.699999988079071");
    lk_num_str(-1e-320, b);
    assert_true(strtod(b, NULL) == -1e-320);
    lk_num_str(10.0, b); /* whole numbers in plain digits */
    assert_string_equal(b, "10");
    lk_num_str(1e5, b);
    assert_string_equal(b, "100000");
}

/* JSON: the summary records each double exactly (0.1 + 0.2 is not 0.3). */
static void test_json(void **state) {
    (void)state;
    lk_fuse_input in[2] = {{"a", 0.1 + 0.2, LK_FORMAT_AUTO}, {"b", 0.7, LK_FORMAT_AUTO}};
    lk_fuse_stats st = {.tensors_total = 5, .tensors_fused = 1, .seconds = 0.25, .convention = LK_CONVENTION_PEFT};
    char *js = lk_fuse_summary_json(NULL, NULL, in, 2, &st);
    assert_non_null(js);
    tu_assert_contains(js, "\"strength\":0.30000000000000004");
    tu_assert_contains(js, "\"strength\":0.7}");
    tu_assert_contains(js, "\"convention\":\"peft\""); /* the convention the fuse followed (issue 29) */
    tu_assert_contains(js, "\"seconds\":0.25}");
    lk_free(js);
}

/* A strength whose product with the module scale overflows the double is
 * refused naming both (the kernel would only have seen "scale inf"). */
static void test_product_overflow(void **state) {
    (void)state;
    char *base = tu_path(ar_dir, "base.safetensors"), *ad = tu_path(ar_dir, "big.safetensors"),
         *out = tu_path(ar_dir, "out.safetensors");
    float w[OUT * IN] = {0};
    write_base(base, w);
    unlink(out);
    af_file *f = af_new();
    af_rand(f, "blk.w.lora_A.weight", LK_DTYPE_F32, 1, IN, &g_rng, -1, 1);
    af_rand(f, "blk.w.lora_B.weight", LK_DTYPE_F32, OUT, 1, &g_rng, -1, 1);
    af_scalar(f, "blk.w.alpha", LK_DTYPE_F64, 1e30); /* module scale 1e30 / 1 */
    af_save(f, ad, NULL, 0);
    af_free(f);
    lk_fuse_input in = {ad, 1e300, LK_FORMAT_AUTO};
    assert_int_equal(lk_fuse_file(base, &in, 1, out, NULL, NULL), LK_ERR_ARG);
    tu_assert_contains(lk_last_error(), "blk.w: strength 1e300 times the module's scale 1e30 (alpha 1e30, "
                                        "r 1) is not finite");
    assert_false(tu_exists(out));
    /* the CLI names what was typed when it does not parse */
    tu_cli_expect(2, NULL, "strength '1e400' is not finite", NULL, "fuse '%s' -l '%s:1e400' -o '%s'", base, ad, out);
    tu_cli_expect(2, NULL, "strength '1e-320x' is not a number", NULL, "fuse '%s' -l '%s:1e-320x' -o '%s'", base, ad,
               out);
    assert_false(tu_exists(out));
    free(base);
    free(ad);
    free(out);
}

/* -l ADAPTER:STRENGTH: a suffix that starts like a number must be one,
 * unless the whole argument exists ("a:2024.safetensors"); a suffix with a
 * '/' is part of the path. */
static void test_cli_split(void **state) {
    (void)state;
    term t;
    for (int j = 0; j < IN; j++) t.A[j] = tu_uniform(&g_rng, -1, 1);
    for (int o = 0; o < OUT; o++) t.B[o] = tu_uniform(&g_rng, -1, 1);
    char *base = tu_path(ar_dir, "base.safetensors"), *out = tu_path(ar_dir, "out.safetensors");
    float w[OUT * IN] = {0};
    write_base(base, w);
    char *colon = tu_path(ar_dir, "a:2024.safetensors"), *dir = tu_path(ar_dir, "run:1");
    write_adapter(colon, &t);
    mkdir(dir, 0755);
    char *indir = tu_path(dir, "ad.safetensors");
    write_adapter(indir, &t);
    /* the whole argument is a file: used as the path, strength 1 */
    tu_cli_expect(0, "a:2024.safetensors\",\"strength\":1.0}", NULL, NULL, "fuse '%s' -l '%s' -o '%s' --json", base,
                  colon, out);
    unlink(out);
    tu_cli_expect(0, "a:2024.safetensors\",\"strength\":0.7}", NULL, NULL, "fuse '%s' -l '%s:0.7' -o '%s' --json", base,
                  colon, out);
    unlink(out);
    /* a folder with ':' then a number: the suffix holds a '/', so it is a path */
    tu_cli_expect(0, "run:1/ad.safetensors\",\"strength\":-0.25}", NULL, NULL, "fuse '%s' -l '%s:-0.25' -o '%s' --json",
                  base, indir, out);
    unlink(out);
    /* a word after ':' that is not numeric-looking stays part of the path */
    tu_cli_expect(1, NULL, "ad.safetensors:abc", NULL, "fuse '%s' -l '%s:abc' -o '%s'", base, indir, out);
    free(base);
    free(out);
    free(colon);
    free(dir);
    free(indir);
}

/* Plans: the strength is the double read, 1e39 included (no float range). */
static void test_plan_double(void **state) {
    (void)state;
    const char *text = "steps:\n  - loras: [{path: a, strength: 0.7}, {path: b, strength: 1e39}]\n";
    lk_plan *p;
    assert_int_equal(lk_plan_parse(text, strlen(text), "plan.yaml", NULL, &p), LK_OK);
    assert_true(p->steps[0].loras[0].strength == 0.7);
    assert_true(p->steps[0].loras[0].strength != (double)0.7f);
    assert_true(p->steps[0].loras[1].strength == 1e39);
    lk_plan_free(p);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse),          cmocka_unit_test(test_json),
        cmocka_unit_test(test_cancel_07),      cmocka_unit_test(test_cancel_07_m03),
        cmocka_unit_test(test_cancel_three),   cmocka_unit_test(test_product_overflow),
        cmocka_unit_test(test_cli_split),      cmocka_unit_test(test_plan_double),
    };
    return cmocka_run_group_tests(tests, ar_setup_dir, ar_teardown_dir);
}
