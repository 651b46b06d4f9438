/* test_fuse_fp8_paths.c — lk_fuse_fp8's epilogue paths (plain C, AVX-512;
 * forced by LORAKIT_KERNEL) give identical bytes, at 1, 2 and 3 threads.
 *
 * The cases are chosen to reach every branch of the vector path and of its
 * scalar fallback: all 256 codes of each format as weights (NaN, Inf,
 * subnormal, +-0, the largest finite), rows whose delta is 0, rounding ties
 * (dyadic factors), values beyond the largest finite (saturated, and as an
 * error: same status and message on every path), results that are 0 or far
 * below the smallest subnormal (a per-row scale of 2^30), per-row scales
 * that are 1 (no division) and not, rows whose length is not a multiple of
 * 8 (scalar tails); nearest and stochastic; keep and rescale; F32 and BF16
 * scales; e4m3fn and e5m2.
 *
 * Oracles: (1) the portable path at 1 thread for the byte identity of the
 * other paths and thread counts (the AVX-512 path is separate code, with
 * intrinsics; the portable and avx2 paths share branch-free C, and all
 * hand rare lanes to the per-element definition in src/fuse/fp8.c);
 * (2) independently, on every path, in the nearest/keep case with dyadic factors
 * (the fp32 delta is then exact), the test's own double reference
 * (tests/util/fp8_ref.h): code = RNE((decode(c) * s + d) / s), NaN weights
 * staying NaN with their sign, overflow saturating to +-max. */
#include "adapter_ref.h"
#include "fp8_ref.h"
#include "fuse/fuse.h" /* lk_fuse_kernel_path, _supported */

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define OUT 19
#define IN 85 /* 10 vectors of 8 and a tail of 5 */
#define RK 3

static const char *const PATHS[3] = {"portable", "avx2", "avx512"};

static uint64_t rng_next(uint64_t *s) {
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return *s >> 11;
}

typedef struct fixture {
    lk_dtype dt;
    uint8_t w[OUT * IN];
    float a[RK * IN], b[OUT * RK];
    float scale[OUT]; /* per row; [0] for a per-tensor scale */
} fixture;

/* Weights: every code, shuffled by row; factors: dyadic (k/16, k/8) or
 * random floats; some rows of B zero (delta 0), some large (overflow). */
static void make(fixture *f, lk_dtype dt, int dyadic, uint64_t seed) {
    uint64_t s = seed;
    f->dt = dt;
    for (int o = 0; o < OUT; o++)
        for (int j = 0; j < IN; j++) f->w[o * IN + j] = (uint8_t)((o * 97 + j * 3 + (int)(rng_next(&s) % 7)) & 0xff);
    for (int i = 0; i < RK * IN; i++) {
        long k = (long)(rng_next(&s) % 33) - 16;
        f->a[i] = dyadic ? (float)k / 16.0f : (float)((double)rng_next(&s) / 9007199254740992.0 - 0.5);
    }
    for (int o = 0; o < OUT; o++)
        for (int k = 0; k < RK; k++) {
            long v = (long)(rng_next(&s) % 33) - 16;
            float x = dyadic ? (float)v / 8.0f : (float)((double)rng_next(&s) / 9007199254740992.0 - 0.5);
            if (o % 5 == 2) x = 0.0f;          /* delta 0: the weight's own code back */
            if (o == 7) x *= dt == LK_DTYPE_F8_E4M3 ? 256.0f : 65536.0f; /* overflows */
            f->b[o * RK + k] = x;
        }
    for (int o = 0; o < OUT; o++) /* 1 (no division), 1/448, 0.75, 2^30 (q far below the subnormals) */
        f->scale[o] = o % 4 == 0 ? 1.0f : o % 4 == 1 ? 1.0f / 448.0f : o % 4 == 2 ? 0.75f : 1073741824.0f;
}

typedef struct result {
    lk_status st;
    char msg[512];
    uint8_t w[OUT * IN];
    unsigned char scale[OUT * 4];
} result;

/* n_scale: 0 plain, 1 per tensor, OUT per row. */
static void run(const fixture *f, int n_scale, lk_dtype sdt, const lk_fuse_opts *o, result *r) {
    lk_tensor A = {.name = "a", .dtype = LK_DTYPE_F32, .ndim = 2, .shape = {RK, IN}, .nbytes = sizeof f->a,
                   .data = (void *)f->a};
    lk_tensor B = {.name = "b", .dtype = LK_DTYPE_F32, .ndim = 2, .shape = {OUT, RK}, .nbytes = sizeof f->b,
                   .data = (void *)f->b};
    lk_fuse_term t = {.A = &A, .B = &B, .scale = 1.0f};
    memcpy(r->w, f->w, sizeof r->w);
    memset(r->scale, 0, sizeof r->scale);
    if (n_scale) lk_from_f32(r->scale, f->scale, sdt, (size_t)n_scale);
    r->st = lk_fuse_fp8(r->w, f->dt, OUT, IN, n_scale ? r->scale : NULL, sdt, n_scale, &t, 1, o, "blk.w");
    snprintf(r->msg, sizeof r->msg, "%s", r->st ? lk_last_error() : "");
}

static void test_paths_identical(void **state) {
    (void)state;
    static fixture f;
    static result want, got;
    const lk_dtype dts[2] = {LK_DTYPE_F8_E4M3, LK_DTYPE_F8_E5M2};
    const int nscales[3] = {0, 1, OUT};
    int compared = 0, failed_runs = 0;
    for (int di = 0; di < 2; di++)
        for (int dy = 0; dy < 2; dy++) {
            make(&f, dts[di], dy, 1234 + (uint64_t)(di * 2 + dy));
            for (int ni = 0; ni < 3; ni++)
                for (int sdi = 0; sdi < (nscales[ni] ? 2 : 1); sdi++)
                    for (int mode = 0; mode < 8; mode++) {
                        lk_fuse_opts o = {0};
                        o.fp8.rounding = mode & 1 ? LK_FP8_STOCHASTIC : LK_FP8_NEAREST;
                        o.fp8.scale = mode & 2 ? LK_FP8_KEEP : LK_FP8_RESCALE;
                        o.fp8.saturate = !(mode & 4);
                        o.fp8.seed = 7;
                        const lk_dtype sdt = sdi ? LK_DTYPE_BF16 : LK_DTYPE_F32;
                        setenv("LORAKIT_KERNEL", "portable", 1);
                        o.threads = 1;
                        run(&f, nscales[ni], sdt, &o, &want);
                        failed_runs += want.st != LK_OK;
                        for (int p = 0; p < 3; p++) {
                            if (!lk_fuse_kernel_supported(PATHS[p])) continue;
                            setenv("LORAKIT_KERNEL", PATHS[p], 1);
                            assert_string_equal(lk_fuse_kernel_path(), PATHS[p]);
                            for (int th = 1; th <= 3; th++) {
                                o.threads = th;
                                run(&f, nscales[ni], sdt, &o, &got);
                                if (got.st != want.st || strcmp(got.msg, want.msg) ||
                                    memcmp(got.w, want.w, sizeof got.w) || memcmp(got.scale, want.scale, sizeof got.scale))
                                    fail_msg("%s dyadic %d n_scale %d %s mode %d path %s threads %d: status %d/%d "
                                             "'%s' / '%s'", lk_dtype_name(f.dt), dy, nscales[ni],
                                             lk_dtype_name(sdt), mode, PATHS[p], th, got.st, want.st, got.msg,
                                             want.msg);
                                compared++;
                            }
                        }
                    }
        }
    unsetenv("LORAKIT_KERNEL");
    assert_true(compared >= 2 * 2 * 5 * 8 * 3 * 1); /* the portable path at least */
    assert_true(failed_runs > 0);                  /* the overflow error path was reached */
}

/* The nearest/keep results against the test's own reference, per-row
 * scales, dyadic factors (exact delta), on every path. */
static void test_matches_reference(void **state) {
    (void)state;
    static fixture f;
    static result got;
    const lk_dtype dts[2] = {LK_DTYPE_F8_E4M3, LK_DTYPE_F8_E5M2};
    for (int di = 0; di < 2; di++) {
        make(&f, dts[di], 1, 99 + (uint64_t)di);
        const ref_fmt *rf = ref_fmt_of(f.dt);
        for (int p = 0; p < 3; p++) {
            if (!lk_fuse_kernel_supported(PATHS[p])) continue;
            setenv("LORAKIT_KERNEL", PATHS[p], 1);
            lk_fuse_opts o = {0};
            o.fp8.scale = LK_FP8_KEEP;
            o.fp8.saturate = 1;
            o.threads = 2;
            run(&f, OUT, LK_DTYPE_F32, &o, &got);
            assert_int_equal(got.st, LK_OK);
            const unsigned nan_code = f.dt == LK_DTYPE_F8_E4M3 ? 0x7f : 0x7e;
            int ties = 0;
            for (int o2 = 0; o2 < OUT; o2++)
                for (int j = 0; j < IN; j++) {
                    double d = 0; /* exact: dyadic factors of few bits */
                    for (int k = 0; k < RK; k++) d += (double)f.b[o2 * RK + k] * (double)f.a[k * IN + j];
                    const uint8_t c = f.w[o2 * IN + j];
                    const double s = (double)f.scale[o2], v = ref_decode(rf, c) * s + d, q = v / s;
                    unsigned want;
                    if (isnan(q)) want = (c & 0x80u) | nan_code;
                    else ref_encode(rf, q, &want);
                    if (!isnan(q) && fabs(q) < 448.0) { /* a tie: its two neighbours round apart */
                        unsigned lo, hi;
                        ref_encode(rf, nextafter(q, 0.0), &lo);
                        ref_encode(rf, nextafter(q, q < 0 ? -INFINITY : INFINITY), &hi);
                        ties += lo != hi;
                    }
                    if (got.w[o2 * IN + j] != want)
                        fail_msg("%s path %s [%d, %d]: code 0x%02x, d %g, scale %g: got 0x%02x, want 0x%02x",
                                 lk_dtype_name(f.dt), PATHS[p], o2, j, c, d, s, got.w[o2 * IN + j], want);
                }
            assert_true(ties > 0); /* some values sit on a rounding boundary */
        }
    }
    unsetenv("LORAKIT_KERNEL");
}

/* Stochastic rounding of q = 0 and of q far below the smallest subnormal
 * (where the vector path hands the lanes to the scalar code): 0 stays 0
 * exactly (the oracle: any rounding of 0 is 0, signed as IEEE's sum of
 * zeros), and every path gives the
 * portable path's bytes. 16384 elements each, so a path that rounded
 * these up with probability ~2^-11 would be caught. */
static void test_stochastic_tiny(void **state) {
    (void)state;
    enum { W = 4096, H = 4 };
    static uint8_t w[H * W], want[H * W];
    static float a[W], b[H], sc[H];
    lk_tensor A = {.name = "a", .dtype = LK_DTYPE_F32, .ndim = 2, .shape = {1, W}, .nbytes = sizeof a, .data = a};
    lk_tensor B = {.name = "b", .dtype = LK_DTYPE_F32, .ndim = 2, .shape = {H, 1}, .nbytes = sizeof b, .data = b};
    lk_fuse_term t = {.A = &A, .B = &B, .scale = 1.0f};
    for (int tiny = 0; tiny < 2; tiny++) {
        for (int j = 0; j < W; j++) a[j] = (float)(j % 13) - 6.0f;
        for (int o = 0; o < H; o++) {
            b[o] = tiny ? 1e-3f : 0.0f;
            sc[o] = tiny ? 1073741824.0f : 1.0f; /* q = d / 2^30: far below 2^-9 (e4m3's quantum) */
        }
        for (int i = 0; i < H * W; i++) w[i] = i & 1 ? 0x80 : 0x00; /* +-0 */
        for (int p = 0; p < 3; p++) {
            if (!lk_fuse_kernel_supported(PATHS[p])) continue;
            setenv("LORAKIT_KERNEL", PATHS[p], 1);
            static uint8_t got[H * W];
            float s2[H];
            memcpy(s2, sc, sizeof s2);
            for (int i = 0; i < H * W; i++) got[i] = i & 1 ? 0x80 : 0x00;
            lk_fuse_opts o = {0};
            o.fp8.rounding = LK_FP8_STOCHASTIC;
            o.fp8.scale = LK_FP8_KEEP;
            o.fp8.seed = 3;
            o.threads = 2;
            assert_int_equal(lk_fuse_fp8(got, LK_DTYPE_F8_E4M3, H, W, s2, LK_DTYPE_F32, H, &t, 1, &o, "t"), LK_OK);
            if (p == 0) memcpy(want, got, sizeof want);
            else assert_memory_equal(got, want, sizeof want);
            if (!tiny) /* IEEE: w0 + d is -0 only when both are -0 (d = +0 * a[j]: a[j]'s sign) */
                for (int i = 0; i < H * W; i++)
                    assert_int_equal(got[i], (w[i] == 0x80 && a[i % W] < 0.0f) ? 0x80 : 0x00);
        }
    }
    unsetenv("LORAKIT_KERNEL");
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_paths_identical), cmocka_unit_test(test_matches_reference),
                                       cmocka_unit_test(test_stochastic_tiny)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
