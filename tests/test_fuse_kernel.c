/* test_fuse_kernel.c — lk_fuse_tensor against two independent oracles:
 * (1) the canonical arithmetic (kernel.c's header) replayed here from its
 * statement, sharing no code with src/fuse (widening by hand, C's
 * fmaf/fma chain, the single rounding of W + d by TwoSum in double and a
 * tie broken by the error's sign): identical bytes on every fixture, every
 * kernel path the CPU runs (forced by LORAKIT_KERNEL), 1-3 threads, in
 * place or not; (2) a plain double reference (tests/util/adapter_ref.c):
 * within 1 ulp (F32: plus the double sums' own error bound), including
 * F32 near-cancellation. Plus hand-computed cases and invariants: strength
 * 0 leaves bytes untouched; non-finite results and bad arguments are errors. */
#include "adapter_ref.h"
#include "fuse/fuse.h"

#include <float.h>

#include <math.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

static const lk_dtype DTS[3] = {LK_DTYPE_F32, LK_DTYPE_F16, LK_DTYPE_BF16};

static void *dup_bytes(const lk_tensor *t) {
    void *p = malloc(t->nbytes);
    memcpy(p, t->data, t->nbytes);
    return p;
}

/* ---- the specification, replayed independently ----
 * The canonical arithmetic (kernel.c's header), written again here from
 * its statement with nothing from src/fuse: widening by hand, the chain
 * with C's fmaf/fma, and the single rounding of W + d by a different
 * method than the kernel's (the kernel rounds to odd; this takes the
 * exact sum as the double pair S + err from TwoSum, rounds S by scaling
 * to the target's ulp, and breaks an exact tie of S by err's sign). */

static double rf_get(const lk_tensor *t, size_t i) {
    const unsigned char *p = (const unsigned char *)t->data + i * lk_dtype_size(t->dtype);
    if (t->dtype == LK_DTYPE_F32) {
        float f;
        memcpy(&f, p, 4);
        return f;
    }
    uint16_t h;
    memcpy(&h, p, 2);
    if (t->dtype == LK_DTYPE_BF16) {
        uint32_t u = (uint32_t)h << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    int e = (h >> 10) & 31, m = h & 1023;
    double v = e == 31 ? (m ? NAN : INFINITY) : e == 0 ? ldexp(m, -24) : ldexp(1024 + m, e - 25);
    return (h & 0x8000) ? -v : v;
}

/* The correctly rounded value of S + err (S = RN64(S + err)) in dt's bits. */
static uint32_t rf_encode(lk_dtype dt, double S, double err) {
    const int p = dt == LK_DTYPE_F32 ? 24 : dt == LK_DTYPE_BF16 ? 8 : 11;
    const int emin = dt == LK_DTYPE_F16 ? -14 : -126;
    const double maxv = dt == LK_DTYPE_F32 ? (double)FLT_MAX : dt == LK_DTYPE_BF16 ? ldexp(255, 120) : 65504.0;
    const int neg = signbit(S) != 0;
    const double a = fabs(S), e = neg ? -err : err;
    double v;
    if (isinf(a) || a == 0) {
        v = a;
    } else {
        int ex;
        frexp(a, &ex);
        int lead = ex - 1 < emin ? emin : ex - 1;
        double ulp = ldexp(1.0, lead - (p - 1)), x = a / ulp, fl = floor(x), fr = x - fl;
        int up = fr > 0.5 || (fr == 0.5 && (e > 0 || (e == 0 && fmod(fl, 2.0) == 1.0)));
        v = (fl + up) * ulp;
        if (v > maxv) v = INFINITY;
    }
    uint32_t bits;
    if (dt == LK_DTYPE_F16) {
        if (isinf(v)) bits = 0x7c00;
        else if (v == 0) bits = 0;
        else {
            int ex;
            frexp(v, &ex);
            if (ex - 1 < -14) bits = (uint32_t)(v / ldexp(1.0, -24));
            else bits = (uint32_t)(ex - 1 + 15) << 10 | (uint32_t)(v / ldexp(1.0, ex - 1 - 10) - 1024);
        }
        return bits | (neg ? 0x8000u : 0u);
    }
    float f = (float)(neg ? -v : v); /* exact: v is a value of dt (or Inf) */
    memcpy(&bits, &f, 4);
    return dt == LK_DTYPE_BF16 ? bits >> 16 : bits;
}

/* One element: w's stored bits, its value, the delta. */
static uint32_t rf_element(lk_dtype dt, uint32_t wbits, double w, double d) {
    const uint32_t quiet = dt == LK_DTYPE_F32 ? 0x00400000u : dt == LK_DTYPE_BF16 ? 0x0040u : 0x0200u;
    const uint32_t qnan = dt == LK_DTYPE_F32 ? 0x7fc00000u : dt == LK_DTYPE_BF16 ? 0x7fc0u : 0x7e00u;
    if (isnan(w)) return wbits | quiet;
    double S = w + d, bb = S - w, err = (w - (S - bb)) + (d - bb);
    if (isnan(S)) return qnan;
    if (isinf(S)) err = 0;
    return rf_encode(dt, S, err);
}

typedef struct rf_term {
    const lk_tensor *A, *B;
    double scale;
} rf_term;

/* The delta of element (o, j): narrow (f32, fmaf) or wide (f64, fma). */
static double rf_delta(int wide, const rf_term *t, size_t nt, size_t o, size_t j, size_t in) {
    int first = 1;
    volatile float df = 0;
    double dd = 0;
    for (size_t i = 0; i < nt; i++) {
        if (t[i].scale == 0.0) continue;
        const size_t r = (size_t)t[i].A->shape[0];
        for (size_t k = 0; k < r; k++) {
            const double b = rf_get(t[i].B, o * r + k), a = rf_get(t[i].A, k * in + j);
            if (wide) {
                double bp = t[i].scale * b;
                dd = first ? bp * a : fma(bp, a, dd);
            } else {
                volatile float bp = (float)(t[i].scale * b);
                volatile float pr = bp * (float)a;
                df = first ? pr : fmaf(bp, (float)a, df);
            }
            first = 0;
        }
    }
    return wide ? dd : (double)df;
}

/* The whole weight as the specification says: into want (dt's bytes). */
static void rf_fuse(void *want, const lk_tensor *W, const rf_term *t, size_t nt) {
    const lk_dtype dt = W->dtype;
    const size_t out = (size_t)W->shape[0], in = (size_t)W->shape[1], esz = lk_dtype_size(dt);
    for (size_t o = 0; o < out; o++)
        for (size_t j = 0; j < in; j++) {
            size_t i = o * in + j;
            uint32_t wb = 0;
            memcpy(&wb, (const char *)W->data + i * esz, esz);
            uint32_t r = rf_element(dt, wb, rf_get(W, i), rf_delta(dt == LK_DTYPE_F32, t, nt, o, j, in));
            memcpy((char *)want + i * esz, &r, esz);
        }
}

#define N_PATHS 4
static const char *const PATHS[N_PATHS] = {"avx512bf16", "avx512", "avx2", "portable"};

/* Sets LORAKIT_KERNEL to path; 0 if the CPU cannot run it (skipped). */
static int force_path(const char *path) {
    if (!lk_fuse_kernel_supported(path)) return 0;
    setenv("LORAKIT_KERNEL", path, 1);
    assert_string_equal(lk_fuse_kernel_path(), path);
    return 1;
}

/* Every weight dtype x every factor dtype, three terms of different ranks
 * (one negative scale), shapes not multiples of any tile. */
static void test_matches_reference(void **state) {
    (void)state;
    tu_rng rng = {42};
    const int64_t out = 37, in = 83;
    const int ranks[3] = {1, 8, 5};
    const float scales[3] = {0.75f, -1.25f, 2.0f};
    for (int wd = 0; wd < 3; wd++)
        for (int ad = 0; ad < 3; ad++) {
            ar_tensor W, A[3], B[3];
            ar_tensor_rand(&W, "w", DTS[wd], out, in, &rng, -1, 1);
            lk_fuse_term terms[3];
            ar_term ref[3];
            for (int t = 0; t < 3; t++) {
                /* mix factor dtypes across terms too */
                lk_dtype fd = DTS[(ad + t) % 3];
                ar_tensor_rand(&A[t], "A", fd, ranks[t], in, &rng, -0.5f, 0.5f);
                ar_tensor_rand(&B[t], "B", DTS[ad], out, ranks[t], &rng, -0.5f, 0.5f);
                terms[t] = (lk_fuse_term){.A = &A[t].t, .B = &B[t].t, .scale = scales[t]};
                ref[t] = (ar_term){&A[t].t, &B[t].t, scales[t]};
            }
            void *res = malloc(W.t.nbytes);
            lk_fuse_opts o = {.threads = 3};
            assert_int_equal(lk_fuse_tensor(res, W.t.data, DTS[wd], out, in, terms, 3, &o, "w"), LK_OK);
            assert_int_equal(ar_check_fused(res, W.t.data, DTS[wd], out, in, ref, 3), 0);
            /* In place gives the same bytes. */
            void *inpl = dup_bytes(&W.t);
            assert_int_equal(lk_fuse_tensor(inpl, inpl, DTS[wd], out, in, terms, 3, &o, "w"), LK_OK);
            assert_memory_equal(inpl, res, W.t.nbytes);
            free(inpl);
            free(res);
            ar_tensor_free(&W);
            for (int t = 0; t < 3; t++) {
                ar_tensor_free(&A[t]);
                ar_tensor_free(&B[t]);
            }
        }
}

/* Thread counts 1, 2, 3, 5, 8, 0 (all) on every kernel path give identical
 * bytes; big enough for many row chunks and several column tiles (R = 130). */
static void test_thread_invariance(void **state) {
    (void)state;
    tu_rng rng = {7};
    const int64_t out = 203, in = 517;
    ar_tensor W, A1, B1, A2, B2;
    ar_tensor_rand(&W, "w", LK_DTYPE_BF16, out, in, &rng, -1, 1);
    ar_tensor_rand(&A1, "A", LK_DTYPE_F32, 64, in, &rng, -0.1f, 0.1f);
    ar_tensor_rand(&B1, "B", LK_DTYPE_BF16, out, 64, &rng, -0.1f, 0.1f);
    ar_tensor_rand(&A2, "A", LK_DTYPE_F16, 66, in, &rng, -0.1f, 0.1f);
    ar_tensor_rand(&B2, "B", LK_DTYPE_F32, out, 66, &rng, -0.1f, 0.1f);
    lk_fuse_term terms[2] = {{.A = &A1.t, .B = &B1.t, .scale = 1.5f}, {.A = &A2.t, .B = &B2.t, .scale = -0.5f}};
    void *first = malloc(W.t.nbytes), *res = malloc(W.t.nbytes);
    const int th[6] = {1, 2, 3, 5, 8, 0};
    for (int pth = 0; pth < N_PATHS; pth++) {
        if (!force_path(PATHS[pth])) continue;
        for (int i = 0; i < 6; i++) {
            lk_fuse_opts o = {.threads = th[i]};
            int is_first = pth == 0 && i == 0;
            assert_int_equal(
                lk_fuse_tensor(is_first ? first : res, W.t.data, LK_DTYPE_BF16, out, in, terms, 2, &o, "w"), LK_OK);
            if (!is_first) assert_memory_equal(res, first, W.t.nbytes);
        }
    }
    unsetenv("LORAKIT_KERNEL");
    ar_term ref[2] = {{&A1.t, &B1.t, 1.5}, {&A2.t, &B2.t, -0.5}};
    assert_int_equal(ar_check_fused(first, W.t.data, LK_DTYPE_BF16, out, in, ref, 2), 0);
    free(first);
    free(res);
    ar_tensor_free(&W);
    ar_tensor_free(&A1);
    ar_tensor_free(&B1);
    ar_tensor_free(&A2);
    ar_tensor_free(&B2);
}

/* Every fixture, every weight dtype, factor dtypes mixed, in place and not,
 * 1..3 threads, every kernel path the CPU runs: the kernel's bytes equal
 * the replayed specification's. Shapes with row and column tails, panel
 * widths exactly, ranks 1..64, several terms, a zero-scale term (skipped),
 * and special weights (+-0, NaN with payload, Inf, subnormal). */
static void test_canonical_bytes(void **state) {
    (void)state;
    typedef struct fx {
        int64_t out, in;
        int nt, rk[3];
        float sc[3];
    } fx;
    const fx cases[] = {
        {1, 1, 1, {1}, {1.0f}},
        {3, 5, 2, {2, 1}, {0.5f, -2.0f}},
        {37, 83, 3, {1, 8, 5}, {0.75f, -1.25f, 2.0f}},
        {23, 100, 2, {5, 3}, {0.3f, -1.7f}},
        {64, 64, 1, {64}, {0.125f}},
        {65, 129, 3, {16, 3, 7}, {1.0f, 0.0f, -0.8f}},
        {9, 257, 1, {33}, {-0.37f}},
        {130, 70, 1, {2}, {1.5f}},
        {5, 32, 2, {4, 12}, {0.9f, 0.1f}},
        {14, 200, 1, {128}, {0.05f}},            /* R = 128, 2-row and 8-column tails */
        {7, 97, 1, {1}, {1.5f}},                 /* R = 1 */
        {12, 16, 2, {3, 2}, {0.7f, -0.2f}},      /* one AVX2 sub-block wide */
        {6, 24, 1, {9}, {1.1f}},
        {25, 300, 3, {40, 1, 23}, {0.2f, 3.0f, -0.6f}}, /* R = 64 over 3 terms, a row chunk + 1 */
    };
    tu_rng rng = {2026};
    unsigned long checked = 0;
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
        for (int wd = 0; wd < 3; wd++) {
            const fx *f = &cases[c];
            const lk_dtype dt = DTS[wd];
            ar_tensor W, A[3], B[3];
            ar_tensor_rand(&W, "w", dt, f->out, f->in, &rng, -1, 1);
            const size_t n = (size_t)(f->out * f->in), esz = lk_dtype_size(dt);
            if (n >= 8) { /* special weights */
                const uint32_t sp[3][5] = {{0x80000000u, 0x7f812345u, 0x7f800000u, 0x00000005u, 0x3f800000u},
                                           {0x8000u, 0x7c2au, 0x7c00u, 0x0003u, 0x3c00u},
                                           {0x8000u, 0x7f91u, 0xff80u, 0x0021u, 0x3f80u}};
                for (int i = 0; i < 5; i++) memcpy((char *)W.t.data + (size_t)(i * 3) % n * esz, &sp[wd][i], esz);
            }
            lk_fuse_term terms[3];
            rf_term rt[3];
            for (int t = 0; t < f->nt; t++) {
                ar_tensor_rand(&A[t], "A", DTS[(wd + t + (int)c) % 3], f->rk[t], f->in, &rng, -1, 1);
                ar_tensor_rand(&B[t], "B", DTS[(wd + 2 * t + (int)c + 1) % 3], f->out, f->rk[t], &rng, -1, 1);
                terms[t] = (lk_fuse_term){.A = &A[t].t, .B = &B[t].t, .scale = f->sc[t]};
                rt[t] = (rf_term){&A[t].t, &B[t].t, f->sc[t]};
            }
            char *want = malloc(W.t.nbytes), *res = malloc(W.t.nbytes);
            rf_fuse(want, &W.t, rt, (size_t)f->nt);
            for (int pth = 0; pth < N_PATHS; pth++) {
                if (!force_path(PATHS[pth])) continue;
                for (int th = 1; th <= 3; th++) {
                    lk_fuse_opts o = {.threads = th, .allow_nonfinite = 1};
                    memset(res, 0xa5, W.t.nbytes);
                    assert_int_equal(lk_fuse_tensor(res, W.t.data, dt, f->out, f->in, terms, (size_t)f->nt, &o, "w"),
                                     LK_OK);
                    if (memcmp(res, want, W.t.nbytes)) {
                        for (size_t i = 0; i < n; i++)
                            if (memcmp(res + i * esz, want + i * esz, esz))
                                fail_msg("case %zu %s path %s threads %d: element %zu differs from the specification",
                                         c, lk_dtype_name(dt), PATHS[pth], th, i);
                    }
                    checked++;
                }
                /* in place */
                memcpy(res, W.t.data, W.t.nbytes);
                lk_fuse_opts o = {.threads = 2, .allow_nonfinite = 1};
                assert_int_equal(lk_fuse_tensor(res, res, dt, f->out, f->in, terms, (size_t)f->nt, &o, "w"), LK_OK);
                assert_memory_equal(res, want, W.t.nbytes);
            }
            unsetenv("LORAKIT_KERNEL");
            free(want);
            free(res);
            ar_tensor_free(&W);
            for (int t = 0; t < f->nt; t++) {
                ar_tensor_free(&A[t]);
                ar_tensor_free(&B[t]);
            }
        }
    assert_true(checked >= 9 * 3 * 3); /* at least the portable path ran everything */
}

/* Rounding ties inside full vector blocks (and tails) on every path: W =
 * +-2^e (1 + k ulp) and a rank-2 delta 2^e (c0 h + c1 h 2^-x), h half an
 * ulp of W's dtype at 1, c0, c1 in {-1, 0, 1}, x = 22 (BF16/F16: exact in
 * f32) or 40 (F32: exact in f64): where c0 is not 0, W + d is a midpoint of
 * W's dtype (c1 = 0: an exact tie, to even) or just beside one, closer than
 * the accumulator resolves (its rounded sum is the midpoint; only the
 * exact sum's side decides), so a vector path that rounds twice, or breaks
 * a tie wrongly, differs. Plus NaN and Inf weights
 * inside blocks. Oracle: the replayed specification (rf_fuse); 13 x 150
 * gives row tails of 1 (blocks of 6) and column tails of 22 and 6. */
static void test_ties_in_blocks(void **state) {
    (void)state;
    const int64_t out = 13, in = 150;
    for (int wd = 0; wd < 3; wd++) {
        const lk_dtype dt = DTS[wd];
        const int p = dt == LK_DTYPE_F32 ? 24 : dt == LK_DTYPE_F16 ? 11 : 8; /* significand bits */
        const float h = ldexpf(1, -p), ulp = ldexpf(1, 1 - p);
        float *a = malloc(2 * (size_t)in * sizeof *a), *b = malloc(2 * (size_t)out * sizeof *b);
        float *wf = malloc((size_t)(out * in) * sizeof *wf);
        for (int64_t j = 0; j < in; j++) {
            a[j] = h * (float)(j % 3 - 1);
            a[in + j] = ldexpf(h, dt == LK_DTYPE_F32 ? -40 : -22) * (float)((j / 3) % 3 - 1);
        }
        for (int64_t o = 0; o < out; o++) {
            const float sc = ldexpf(1, (int)(o % 5) - 2);
            b[2 * o] = b[2 * o + 1] = sc;
            for (int64_t j = 0; j < in; j++)
                wf[o * in + j] = ((o + j / 9) % 2 ? -sc : sc) * (1.0f + (float)((j * 7 + o) % 100) * ulp);
        }
        wf[2 * in + 5] = NAN;
        wf[3 * in + 70] = -INFINITY;
        lk_tensor A = {.dtype = LK_DTYPE_F32, .ndim = 2, .shape = {2, in}, .nbytes = 8 * (size_t)in, .data = a};
        lk_tensor B = {.dtype = LK_DTYPE_F32, .ndim = 2, .shape = {out, 2}, .nbytes = 8 * (size_t)out, .data = b};
        const size_t esz = lk_dtype_size(dt), nb = (size_t)(out * in) * esz;
        lk_tensor W = {.dtype = dt, .ndim = 2, .shape = {out, in}, .nbytes = nb, .data = malloc(nb)};
        for (int64_t i = 0; i < out * in; i++) { /* every value is exact in dt */
            uint32_t u;
            memcpy(&u, &wf[i], 4);
            uint16_t v = dt == LK_DTYPE_BF16 ? (uint16_t)(u >> 16) : lk_f32_to_f16(wf[i]);
            if (dt == LK_DTYPE_F32) memcpy((char *)W.data + (size_t)i * 4, &u, 4);
            else memcpy((char *)W.data + (size_t)i * 2, &v, 2);
        }
        lk_fuse_term t = {.A = &A, .B = &B, .scale = 1.0};
        rf_term rt = {&A, &B, 1.0};
        char *want = malloc(nb), *res = malloc(nb);
        rf_fuse(want, &W, &rt, 1);
        for (int pth = 0; pth < N_PATHS; pth++) {
            if (!force_path(PATHS[pth])) continue;
            for (int th = 1; th <= 3; th += 2) {
                lk_fuse_opts o = {.threads = th, .allow_nonfinite = 1};
                memset(res, 0xa5, nb);
                assert_int_equal(lk_fuse_tensor(res, W.data, dt, out, in, &t, 1, &o, "w"), LK_OK);
                for (size_t i = 0; i < (size_t)(out * in); i++)
                    if (memcmp(res + i * esz, want + i * esz, esz))
                        fail_msg("%s path %s threads %d: element [%zu, %zu] differs from the specification",
                                 lk_dtype_name(dt), PATHS[pth], th, i / (size_t)in, i % (size_t)in);
            }
            memcpy(res, W.data, nb); /* in place */
            lk_fuse_opts o = {.threads = 2, .allow_nonfinite = 1};
            assert_int_equal(lk_fuse_tensor(res, res, dt, out, in, &t, 1, &o, "w"), LK_OK);
            assert_memory_equal(res, want, nb);
        }
        unsetenv("LORAKIT_KERNEL");
        free(want);
        free(res);
        free(W.data);
        free(wf);
        free(a);
        free(b);
    }
}

/* Hand-computed cases where rounding W + d twice (to the accumulator's
 * format, then to W's) gives the wrong answer and rounding once does not:
 *  BF16: 1 + (2^-8 + 2^-30): the f32 sum is the BF16 midpoint 1 + 2^-8,
 *        whose tie goes to 1.0; the exact sum is above it: 1 + 2^-7 (0x3f81);
 *        and one just below a midpoint whose tie would go up.
 *  F16:  1 + (2^-11 + 2^-34): likewise, 1 + 2^-10 (0x3c01), not 1.0.
 *  F32:  1 + (2^-24 + 2^-60), two rank terms: an f32 chain loses 2^-60 and
 *        ties to 1.0; the f64 chain keeps it: 1 + 2^-23 (0x3f800001). */
static void test_single_rounding_hand(void **state) {
    (void)state;
    for (int pth = 0; pth < N_PATHS; pth++) {
        if (!force_path(PATHS[pth])) continue;
        float a1[1] = {1.0f}, b1[1] = {ldexpf(1, -8) + ldexpf(1, -30)};
        lk_tensor A = {.dtype = LK_DTYPE_F32, .ndim = 2, .shape = {1, 1}, .nbytes = 4, .data = a1};
        lk_tensor B = {.dtype = LK_DTYPE_F32, .ndim = 2, .shape = {1, 1}, .nbytes = 4, .data = b1};
        lk_fuse_term t = {.A = &A, .B = &B, .scale = 1.0f};
        uint16_t w16 = 0x3f80, r16;
        assert_int_equal(lk_fuse_tensor(&r16, &w16, LK_DTYPE_BF16, 1, 1, &t, 1, NULL, "w"), LK_OK);
        assert_int_equal(r16, 0x3f81);
        /* below a midpoint whose even neighbour is the upper one:
         * (1 + 2^-6) - (2^-8 + 2^-30) = 1 + 2^-7 + 2^-8 - 2^-30 -> 0x3f81 */
        b1[0] = -(ldexpf(1, -8) + ldexpf(1, -30));
        w16 = 0x3f82;
        assert_int_equal(lk_fuse_tensor(&r16, &w16, LK_DTYPE_BF16, 1, 1, &t, 1, NULL, "w"), LK_OK);
        assert_int_equal(r16, 0x3f81);
        b1[0] = ldexpf(1, -11) + ldexpf(1, -34);
        w16 = 0x3c00;
        assert_int_equal(lk_fuse_tensor(&r16, &w16, LK_DTYPE_F16, 1, 1, &t, 1, NULL, "w"), LK_OK);
        assert_int_equal(r16, 0x3c01);
        float a2[2] = {ldexpf(1, -24), ldexpf(1, -60)}, b2[2] = {1.0f, 1.0f}, w32 = 1.0f, r32;
        lk_tensor A2 = {.dtype = LK_DTYPE_F32, .ndim = 2, .shape = {2, 1}, .nbytes = 8, .data = a2};
        lk_tensor B2 = {.dtype = LK_DTYPE_F32, .ndim = 2, .shape = {1, 2}, .nbytes = 8, .data = b2};
        lk_fuse_term t2 = {.A = &A2, .B = &B2, .scale = 1.0f};
        assert_int_equal(lk_fuse_tensor(&r32, &w32, LK_DTYPE_F32, 1, 1, &t2, 1, NULL, "w"), LK_OK);
        uint32_t u;
        memcpy(&u, &r32, 4);
        assert_int_equal(u, 0x3f800001u);
    }
    unsetenv("LORAKIT_KERNEL");
}

/* F32 weights where W + delta nearly cancels (W = -delta rounded to f32,
 * plus a few ulps): within 1 ulp of the double reference (plus the double
 * sums' own error bound, ar_check_fused), which an f32 accumulator misses
 * by up to ~2^29 ulp. The test checks it really built cancellations. */
static void test_f32_cancellation(void **state) {
    (void)state;
    tu_rng rng = {99};
    const int64_t out = 24, in = 70;
    ar_tensor A, B, W;
    ar_tensor_rand(&A, "A", LK_DTYPE_F32, 8, in, &rng, -1, 1);
    ar_tensor_rand(&B, "B", LK_DTYPE_BF16, out, 8, &rng, -1, 1);
    ar_tensor_rand(&W, "w", LK_DTYPE_F32, out, in, &rng, -1, 1);
    const double sc = 4.0 / 3.0; /* PEFT alpha 8, r 6: not a float (a float scale fails this test) */
    float *w = W.t.data;
    size_t near = 0;
    for (int64_t o = 0; o < out; o++)
        for (int64_t j = 0; j < in; j++) {
            double d = 0;
            for (int k = 0; k < 8; k++) d += (double)sc * rf_get(&B.t, (size_t)(o * 8 + k)) * rf_get(&A.t, (size_t)(k * in + j));
            float x = (float)-d;
            for (int64_t s = (o * in + j) % 5; s > 0; s--) x = nextafterf(x, 0.0f);
            w[o * in + j] = x;
        }
    lk_fuse_term t = {.A = &A.t, .B = &B.t, .scale = sc};
    ar_term rt = {&A.t, &B.t, sc};
    float *res = malloc(W.t.nbytes);
    for (int pth = 0; pth < N_PATHS; pth++) {
        if (!force_path(PATHS[pth])) continue;
        assert_int_equal(lk_fuse_tensor(res, w, LK_DTYPE_F32, out, in, &t, 1, NULL, "w"), LK_OK);
        assert_int_equal(ar_check_fused(res, w, LK_DTYPE_F32, out, in, &rt, 1), 0);
    }
    unsetenv("LORAKIT_KERNEL");
    for (int64_t i = 0; i < out * in; i++) near += fabsf(res[i]) < 1e-6f * (fabsf(w[i]) + 1e-30f);
    assert_true(near > (size_t)(out * in) / 2);
    free(res);
    ar_tensor_free(&A);
    ar_tensor_free(&B);
    ar_tensor_free(&W);
}

/* The internal delta API (fuse/fuse.h) for DoRA and FP8 weights: rows
 * [row0, row0 + rows) equal the replayed chain bit for bit, and rounding
 * them with lk_fuse_round_* gives lk_fuse_tensor's bytes, on every path;
 * the prepared form (lk_fuse_delta_prepare/_rows) gives the same rows. */
static void test_delta_api(void **state) {
    (void)state;
    tu_rng rng = {31};
    const int64_t out = 23, in = 100, row0 = 5, rows = 9;
    for (int wd = 0; wd < 3; wd++) {
        const lk_dtype dt = DTS[wd];
        ar_tensor W, A[2], B[2];
        ar_tensor_rand(&W, "w", dt, out, in, &rng, -1, 1);
        lk_fuse_term terms[2];
        rf_term rt[2];
        const int rk[2] = {6, 11};
        const float sc[2] = {-0.4f, 1.3f};
        for (int t = 0; t < 2; t++) {
            ar_tensor_rand(&A[t], "A", DTS[(wd + t) % 3], rk[t], in, &rng, -1, 1);
            ar_tensor_rand(&B[t], "B", DTS[(wd + t + 1) % 3], out, rk[t], &rng, -1, 1);
            terms[t] = (lk_fuse_term){.A = &A[t].t, .B = &B[t].t, .scale = sc[t]};
            rt[t] = (rf_term){&A[t].t, &B[t].t, sc[t]};
        }
        const size_t ld = (size_t)in + 3, esz = lk_dtype_size(dt);
        char *fused = malloc(W.t.nbytes);
        assert_int_equal(lk_fuse_tensor(fused, W.t.data, dt, out, in, terms, 2, NULL, "w"), LK_OK);
        if (dt == LK_DTYPE_F32) for (int pth = 0; pth < N_PATHS; pth++) {
            if (!force_path(PATHS[pth])) continue;
            double *d = malloc((size_t)rows * ld * sizeof *d);
            assert_int_equal(lk_fuse_delta_f64(d, ld, out, in, row0, rows, terms, 2, "w"), LK_OK);
            for (int64_t i = 0; i < rows; i++)
                for (int64_t j = 0; j < in; j++) {
                    double want = rf_delta(1, rt, 2, (size_t)(row0 + i), (size_t)j, (size_t)in);
                    assert_memory_equal(&d[i * (int64_t)ld + j], &want, 8);
                    uint32_t wb, got;
                    size_t e = (size_t)((row0 + i) * in + j);
                    memcpy(&wb, (char *)W.t.data + e * 4, 4);
                    got = lk_fuse_round_f64_to_f32(wb, d[i * (int64_t)ld + j]);
                    assert_memory_equal(&got, fused + e * 4, 4);
                }
            free(d);
        } else for (int pth = 0; pth < N_PATHS; pth++) {
            if (!force_path(PATHS[pth])) continue;
            float *d = malloc((size_t)rows * ld * sizeof *d), *d2 = calloc((size_t)rows * ld, sizeof *d2);
            assert_int_equal(lk_fuse_delta_f32(d, ld, out, in, row0, rows, terms, 2, "w"), LK_OK);
            /* prepared once, then two row ranges (as FP8 workers take them) */
            lk_delta_prep *pp;
            assert_int_equal(lk_fuse_delta_prepare(0, out, in, row0, rows, terms, 2, "w", &pp), LK_OK);
            lk_fuse_delta_rows(pp, d2 + 4 * ld, ld, (size_t)row0 + 4, (size_t)rows - 4, NULL);
            lk_fuse_delta_rows(pp, d2, ld, (size_t)row0, 4, NULL);
            lk_fuse_delta_free(pp);
            for (int64_t i = 0; i < rows; i++) assert_memory_equal(d2 + i * (int64_t)ld, d + i * (int64_t)ld, (size_t)in * 4);
            free(d2);
            for (int64_t i = 0; i < rows; i++)
                for (int64_t j = 0; j < in; j++) {
                    float want = (float)rf_delta(0, rt, 2, (size_t)(row0 + i), (size_t)j, (size_t)in);
                    assert_memory_equal(&d[i * (int64_t)ld + j], &want, 4);
                    size_t e = (size_t)((row0 + i) * in + j);
                    float wv, r;
                    uint16_t got;
                    lk_to_f32(&wv, (char *)W.t.data + e * esz, dt, 1);
                    r = lk_fuse_round_f32(wv, d[i * (int64_t)ld + j]);
                    lk_from_f32(&got, &r, dt, 1);
                    assert_memory_equal(&got, fused + e * esz, esz);
                }
            free(d);
        }
        unsetenv("LORAKIT_KERNEL");
        float dummy[4];
        assert_int_equal(lk_fuse_delta_f32(dummy, (size_t)in, out, in, 20, 4, terms, 2, "w"), LK_ERR_ARG);
        tu_assert_contains(lk_last_error(), "w: rows [20, 24) outside a weight of 23 rows");
        free(fused);
        ar_tensor_free(&W);
        for (int t = 0; t < 2; t++) {
            ar_tensor_free(&A[t]);
            ar_tensor_free(&B[t]);
        }
    }
}

/* Round to odd, by hand: 1 + 2^-30 in f32 is inexact; RN gives 1.0 (even
 * last bit), so odd rounding steps up to 1 + 2^-23; 1 - 2^-30 steps down
 * from 1.0 to the float below it; exact sums are untouched. */
static void test_add_odd_hand(void **state) {
    (void)state;
    assert_true(lk_fuse_add_odd_f32(1.0f, ldexpf(1, -30)) == 1.0f + ldexpf(1, -23));
    assert_true(lk_fuse_add_odd_f32(1.0f, -ldexpf(1, -30)) == nextafterf(1.0f, 0.0f));
    assert_true(lk_fuse_add_odd_f32(1.0f, 0.5f) == 1.5f);
    assert_true(lk_fuse_add_odd_f64(1.0, ldexp(1, -80)) == 1.0 + ldexp(1, -52));
    assert_true(lk_fuse_add_odd_f64(-1.0, -ldexp(1, -80)) == -1.0 - ldexp(1, -52));
}

/* Weights straight from a safetensors mmap need not be aligned to their
 * element size: an F32 weight at an address = 2 mod 4 and a BF16 one at an
 * odd address give the same bytes as aligned copies, on every path (UBSan
 * would flag a misaligned access in the sanitizer build). */
static void test_misaligned_weight(void **state) {
    (void)state;
    tu_rng rng = {11};
    const lk_dtype dts[2] = {LK_DTYPE_F32, LK_DTYPE_BF16};
    const size_t shift[2] = {2, 1};
    for (int d = 0; d < 2; d++) {
        ar_tensor W, A, B;
        ar_tensor_rand(&W, "w", dts[d], 9, 70, &rng, -1, 1);
        ar_tensor_rand(&A, "A", LK_DTYPE_F32, 3, 70, &rng, -1, 1);
        ar_tensor_rand(&B, "B", LK_DTYPE_F32, 9, 3, &rng, -1, 1);
        lk_fuse_term t = {.A = &A.t, .B = &B.t, .scale = 0.5f};
        char *raw = malloc(W.t.nbytes + 8);
        memcpy(raw + shift[d], W.t.data, W.t.nbytes);
        void *ref = malloc(W.t.nbytes), *res = malloc(W.t.nbytes);
        for (int pth = 0; pth < N_PATHS; pth++) {
            if (!force_path(PATHS[pth])) continue;
            assert_int_equal(lk_fuse_tensor(ref, W.t.data, dts[d], 9, 70, &t, 1, NULL, "w"), LK_OK);
            assert_int_equal(lk_fuse_tensor(res, raw + shift[d], dts[d], 9, 70, &t, 1, NULL, "w"), LK_OK);
            assert_memory_equal(res, ref, W.t.nbytes);
        }
        unsetenv("LORAKIT_KERNEL");
        free(raw);
        free(ref);
        free(res);
        ar_tensor_free(&W);
        ar_tensor_free(&A);
        ar_tensor_free(&B);
    }
}

/* Scale 0 and no terms: the output bytes equal the input bytes, even -0.0
 * and NaN payloads. */
static void test_zero_strength_identity(void **state) {
    (void)state;
    tu_rng rng = {3};
    ar_tensor W, A, B;
    ar_tensor_rand(&W, "w", LK_DTYPE_F16, 4, 6, &rng, -1, 1);
    ((uint16_t *)W.t.data)[0] = 0x8000; /* -0.0 */
    ((uint16_t *)W.t.data)[1] = 0x7e01; /* NaN with payload */
    ar_tensor_rand(&A, "A", LK_DTYPE_F32, 2, 6, &rng, -1, 1);
    ar_tensor_rand(&B, "B", LK_DTYPE_F32, 4, 2, &rng, -1, 1);
    lk_fuse_term t = {.A = &A.t, .B = &B.t, .scale = 0.0f};
    void *res = malloc(W.t.nbytes);
    assert_int_equal(lk_fuse_tensor(res, W.t.data, LK_DTYPE_F16, 4, 6, &t, 1, NULL, "w"), LK_OK);
    assert_memory_equal(res, W.t.data, W.t.nbytes);
    memset(res, 0, W.t.nbytes);
    assert_int_equal(lk_fuse_tensor(res, W.t.data, LK_DTYPE_F16, 4, 6, NULL, 0, NULL, "w"), LK_OK);
    assert_memory_equal(res, W.t.data, W.t.nbytes);
    free(res);
    ar_tensor_free(&W);
    ar_tensor_free(&A);
    ar_tensor_free(&B);
}

/* Hand-computed: W = [[1, 2]], A = [[1, 1]], B = [[3]], scale 0.5:
 * W + 0.5 * 3 * [1, 1] = [2.5, 3.5]. */
static void test_hand_computed(void **state) {
    (void)state;
    float w[2] = {1, 2}, a[2] = {1, 1}, b[1] = {3}, res[2];
    lk_tensor A = {.dtype = LK_DTYPE_F32, .ndim = 2, .shape = {1, 2}, .nbytes = 8, .data = a};
    lk_tensor B = {.dtype = LK_DTYPE_F32, .ndim = 2, .shape = {1, 1}, .nbytes = 4, .data = b};
    lk_fuse_term t = {.A = &A, .B = &B, .scale = 0.5f};
    assert_int_equal(lk_fuse_tensor(res, w, LK_DTYPE_F32, 1, 2, &t, 1, NULL, "w"), LK_OK);
    assert_true(res[0] == 2.5f && res[1] == 3.5f);
}

/* F16 max is 65504: 64992 (exact in F16) + 1000 overflows to Inf -> error naming the
 * tensor and the element; a NaN already in W is not an error and stays NaN. */
static void test_nonfinite(void **state) {
    (void)state;
    uint16_t w[3] = {lk_f32_to_f16(1.0f), lk_f32_to_f16(64992.0f), 0x7e00};
    float a[3] = {1, 1, 1}, b[1] = {1000}; /* delta = 1000 everywhere */
    uint16_t res[3];
    lk_tensor A = {.dtype = LK_DTYPE_F32, .ndim = 2, .shape = {1, 3}, .nbytes = 12, .data = a};
    lk_tensor B = {.dtype = LK_DTYPE_F32, .ndim = 2, .shape = {1, 1}, .nbytes = 4, .data = b};
    lk_fuse_term t = {.A = &A, .B = &B, .scale = 1.0f};
    assert_int_equal(lk_fuse_tensor(res, w, LK_DTYPE_F16, 1, 3, &t, 1, NULL, "blk.0.w"), LK_ERR_NONFINITE);
    tu_assert_contains(lk_last_error(), "blk.0.w: fusion made element [0, 1] non-finite (weight 64992 became inf)");
    lk_fuse_opts o = {.allow_nonfinite = 1};
    assert_int_equal(lk_fuse_tensor(res, w, LK_DTYPE_F16, 1, 3, &t, 1, &o, "blk.0.w"), LK_OK);
    assert_int_equal(res[0], lk_f32_to_f16(1001.0f));
    assert_int_equal(res[1], 0x7c00);
    assert_true((res[2] & 0x7c00) == 0x7c00 && (res[2] & 0x3ff) != 0);
    /* Without the override but only the NaN: fine. */
    w[1] = lk_f32_to_f16(1.0f);
    assert_int_equal(lk_fuse_tensor(res, w, LK_DTYPE_F16, 1, 3, &t, 1, NULL, "blk.0.w"), LK_OK);
}

/* The same inside a full vector block: the first non-finite element is
 * named; with allow_nonfinite the block is written like any other (Inf
 * there, every element as the replayed specification says). */
static void test_nonfinite_bf16_block(void **state) {
    (void)state;
    tu_rng rng = {17};
    const int64_t out = 9, in = 70;
    ar_tensor W;
    ar_tensor_rand(&W, "w", LK_DTYPE_BF16, out, in, &rng, -1, 1);
    ((uint16_t *)W.t.data)[5 * in + 40] = lk_f32_to_bf16(3.0e38f);
    float a[70], b[9];
    for (int j = 0; j < in; j++) a[j] = 1.0f;
    for (int i = 0; i < out; i++) b[i] = i == 5 ? 1.0e38f : 0.001f;
    lk_tensor A = {.dtype = LK_DTYPE_F32, .ndim = 2, .shape = {1, in}, .nbytes = sizeof a, .data = a};
    lk_tensor B = {.dtype = LK_DTYPE_F32, .ndim = 2, .shape = {out, 1}, .nbytes = sizeof b, .data = b};
    lk_fuse_term t = {.A = &A, .B = &B, .scale = 1.0f};
    uint16_t res[9 * 70];
    assert_int_equal(lk_fuse_tensor(res, W.t.data, LK_DTYPE_BF16, out, in, &t, 1, NULL, "blk"), LK_ERR_NONFINITE);
    tu_assert_contains(lk_last_error(), "blk: fusion made element [5, 40] non-finite");
    lk_fuse_opts o = {.allow_nonfinite = 1};
    assert_int_equal(lk_fuse_tensor(res, W.t.data, LK_DTYPE_BF16, out, in, &t, 1, &o, "blk"), LK_OK);
    uint16_t want[9 * 70];
    rf_term rt = {&A, &B, 1.0f};
    rf_fuse(want, &W.t, &rt, 1);
    assert_memory_equal(res, want, sizeof want);
    assert_int_equal(res[5 * in + 40], 0x7f80);
    ar_tensor_free(&W);
}

/* The vector epilogues' edge lanes, inside whole 64-column panels and in a
 * column tail, on every path: R = 1, A = 1, so d = B'[o] * 1 = b exactly and
 * each lane is a hand-picked (w, d). The cases: the f32 sum s a denormal
 * (an instruction that flushes denormals would give 0), s exactly +-0, an
 * exact BF16/F16 tie (ties to even) and an inexact one (rounded once),
 * magnitudes >= 2^121, a finite sum that rounds to Inf, NaN and Inf
 * weights. Expected bytes: rf_fuse, the independent replay above. Each row
 * shifts the lanes so every case lands in every vector of a panel. */
static void test_epilogue_edges(void **state) {
    (void)state;
    const int64_t out = 8, in = 64 * 2 + 37;
    typedef struct edge {
        float w, d;
    } edge;
    const edge bf[] = {
        {ldexpf(1, -133), ldexpf(1, -140)},                  /* s denormal */
        {ldexpf(1, -126), -ldexpf(1, -127) - ldexpf(1, -141)}, /* s denormal, from a normal w */
        {-ldexpf(1, -130), ldexpf(1, -131)},                 /* s denormal, negative */
        {1.0f, -1.0f},                                       /* s = +0 */
        {-0.0f, -0.0f},                                      /* s = -0 */
        {1.0f, ldexpf(1, -8)},                               /* exact tie: to even, 1.0 */
        {1.0f, 3 * ldexpf(1, -8)},                           /* exact tie: to even, up */
        {1.0f, ldexpf(1, -8) + ldexpf(1, -30)},              /* inexact near-tie: up */
        {ldexpf(1, 121), ldexpf(1, 110)},                    /* an FP16 NaN pattern in BF16 */
        {-ldexpf(255, 119), -ldexpf(1, 112)},                /* large negative */
        {ldexpf(255, 120), ldexpf(1, 119) + ldexpf(1, 105)}, /* s finite in f32, rounds to +Inf */
        {-ldexpf(255, 120), -ldexpf(1, 120)},                /* s = -Inf in f32 already */
        {NAN, 1.0f},
        {-INFINITY, 1.0f},
        {INFINITY, -INFINITY},                               /* Inf - Inf: NaN */
    };
    const edge h16[] = {
        {ldexpf(1, -24), ldexpf(1, -26)},          /* F16 subnormal range */
        {ldexpf(3, -25), -ldexpf(1, -40)},         /* just below a subnormal tie */
        {ldexpf(1, -24), ldexpf(1, -25)},          /* exact subnormal tie: to even */
        {1.0f, -1.0f},
        {1.0f, ldexpf(1, -11)},                    /* exact tie */
        {1.0f, ldexpf(1, -11) + ldexpf(1, -35)},   /* inexact near-tie */
        {65504.0f, 16.0f},                         /* stays finite */
        {65504.0f, 16.0f + ldexpf(1, -7)},         /* rounds to +Inf */
        {NAN, 1.0f},
        {-INFINITY, 1.0f},
    };
    const lk_dtype dts[2] = {LK_DTYPE_BF16, LK_DTYPE_F16};
    for (int di = 0; di < 2; di++) {
        const lk_dtype dt = dts[di];
        const edge *E = di ? h16 : bf;
        const size_t ne = di ? sizeof h16 / sizeof h16[0] : sizeof bf / sizeof bf[0];
        tu_rng rng = {5};
        ar_tensor W;
        ar_tensor_rand(&W, "w", dt, out, in, &rng, -1, 1);
        /* the delta varies by column: A[0, j] = d, B = 1 */
        float *a = malloc((size_t)in * sizeof(float)), b[8];
        for (int64_t j = 0; j < in; j++) a[j] = tu_uniform(&rng, -0.005f, 0.005f);
        for (int o = 0; o < out; o++) b[o] = 1.0f;
        uint16_t *w = W.t.data;
        /* the edge lanes sit in the same columns on every row (d is per
         * column); the weights of other rows there stay random */
        for (size_t e = 0; e < ne; e++)
            for (int rep = 0; rep < 3; rep++) {
                const int64_t j = (int64_t)(rep * 64 + e * 3 + rep * 17) % in;
                a[j] = E[e].d;
                for (int o = 0; o < out; o++)
                    if ((o + rep) % 2 == 0) w[o * in + j] = dt == LK_DTYPE_BF16 ? lk_f32_to_bf16(E[e].w) : lk_f32_to_f16(E[e].w);
            }
        lk_tensor A = {.dtype = LK_DTYPE_F32, .ndim = 2, .shape = {1, in}, .nbytes = (size_t)in * 4, .data = a};
        lk_tensor B = {.dtype = LK_DTYPE_F32, .ndim = 2, .shape = {out, 1}, .nbytes = sizeof b, .data = b};
        lk_fuse_term t = {.A = &A, .B = &B, .scale = 1.0};
        rf_term rt = {&A, &B, 1.0};
        uint16_t *want = malloc(W.t.nbytes), *res = malloc(W.t.nbytes);
        rf_fuse(want, &W.t, &rt, 1);
        const uint16_t em = dt == LK_DTYPE_BF16 ? 0x7f80 : 0x7c00;
        int64_t first_bad = -1;
        for (int64_t i = 0; i < out * in && first_bad < 0; i++)
            if ((w[i] & em) != em && (want[i] & em) == em) first_bad = i;
        assert_true(first_bad >= 0); /* the fixture has a sum that rounds to Inf */
        for (int pth = 0; pth < N_PATHS; pth++) {
            if (!force_path(PATHS[pth])) continue;
            lk_fuse_opts o = {.allow_nonfinite = 1, .threads = 1};
            assert_int_equal(lk_fuse_tensor(res, W.t.data, dt, out, in, &t, 1, &o, "edge"), LK_OK);
            for (int64_t i = 0; i < out * in; i++)
                if (res[i] != want[i])
                    fail_msg("%s path %s: element [%lld, %lld] is 0x%04x, the specification says 0x%04x",
                             lk_dtype_name(dt), PATHS[pth], (long long)(i / in), (long long)(i % in), res[i], want[i]);
            /* without allow_nonfinite, the first finite weight the spec
             * turns into Inf or NaN (a sum that rounds to Inf) is the error */
            o.allow_nonfinite = 0;
            assert_int_equal(lk_fuse_tensor(res, W.t.data, dt, out, in, &t, 1, &o, "edge"), LK_ERR_NONFINITE);
            char where[64];
            snprintf(where, sizeof where, "element [%lld, %lld]", (long long)(first_bad / in), (long long)(first_bad % in));
            tu_assert_contains(lk_last_error(), where);
        }
        unsetenv("LORAKIT_KERNEL");
        free(a);
        free(want);
        free(res);
        ar_tensor_free(&W);
    }
    /* The same overflow alone in its 64-lane row segment (no other special
     * lane to send the segment to the slow path): a finite f32 sum above
     * the largest BF16's half-way point, not a tie, must still be found. */
    uint16_t w1[6 * 64], r1[6 * 64];
    float a1[64], b1[6] = {1, 1, 1, 1, 1, 1};
    for (int j = 0; j < 64; j++) a1[j] = 0.001f * (float)(j - 30);
    for (int i = 0; i < 6 * 64; i++) w1[i] = lk_f32_to_bf16(0.01f * (float)(i % 17) - 0.08f);
    a1[37] = ldexpf(1, 119) + ldexpf(1, 105);
    w1[4 * 64 + 37] = 0x7f7f;
    lk_tensor A1 = {.dtype = LK_DTYPE_F32, .ndim = 2, .shape = {1, 64}, .nbytes = sizeof a1, .data = a1};
    lk_tensor B1 = {.dtype = LK_DTYPE_F32, .ndim = 2, .shape = {6, 1}, .nbytes = sizeof b1, .data = b1};
    lk_fuse_term t1 = {.A = &A1, .B = &B1, .scale = 1.0};
    for (int i = 0; i < 6; i++) w1[i * 64 + 37] = i == 4 ? 0x7f7f : 0; /* other rows: 0 + huge, finite */
    for (int pth = 0; pth < N_PATHS; pth++) {
        if (!force_path(PATHS[pth])) continue;
        assert_int_equal(lk_fuse_tensor(r1, w1, LK_DTYPE_BF16, 6, 64, &t1, 1, NULL, "ovf"), LK_ERR_NONFINITE);
        tu_assert_contains(lk_last_error(), "ovf: fusion made element [4, 37] non-finite");
    }
    /* A NaN factor whose sum is the f32 NaN 0x7fffffff (an integer RNE
     * shift would wrap it to 0x8000, -0): the spec's positive quiet NaN
     * 0x7fc0 (with allow_nonfinite), and the error without it. */
    const uint32_t qnan_bits = 0x7fffffffu;
    memcpy(&a1[37], &qnan_bits, 4);
    for (int i = 0; i < 6 * 64; i++) w1[i] = lk_f32_to_bf16(0.01f * (float)(i % 17) - 0.08f);
    for (int pth = 0; pth < N_PATHS; pth++) {
        if (!force_path(PATHS[pth])) continue;
        lk_fuse_opts o = {.allow_nonfinite = 1};
        assert_int_equal(lk_fuse_tensor(r1, w1, LK_DTYPE_BF16, 6, 64, &t1, 1, &o, "nan"), LK_OK);
        for (int i = 0; i < 6; i++) assert_int_equal(r1[i * 64 + 37], 0x7fc0);
        assert_int_equal(lk_fuse_tensor(r1, w1, LK_DTYPE_BF16, 6, 64, &t1, 1, NULL, "nan"), LK_ERR_NONFINITE);
        tu_assert_contains(lk_last_error(), "nan: fusion made element [0, 37] non-finite");
    }
    unsetenv("LORAKIT_KERNEL");
}

static void test_errors(void **state) {
    (void)state;
    float w[6] = {0}, res[6], a[6] = {0}, b[6] = {0};
    int8_t i8[6] = {0};
    lk_tensor A = {.dtype = LK_DTYPE_F32, .ndim = 2, .shape = {2, 3}, .nbytes = 24, .data = a};
    lk_tensor B = {.dtype = LK_DTYPE_F32, .ndim = 2, .shape = {2, 2}, .nbytes = 16, .data = b};
    lk_fuse_term t = {.A = &A, .B = &B, .scale = 1.0f};
    /* weight 2x3: A 2x3 ok, B 2x2 ok -> fine */
    assert_int_equal(lk_fuse_tensor(res, w, LK_DTYPE_F32, 2, 3, &t, 1, NULL, "x"), LK_OK);
    assert_int_equal(lk_fuse_tensor(res, w, LK_DTYPE_F32, 3, 2, &t, 1, NULL, "x"), LK_ERR_SHAPE);
    tu_assert_contains(lk_last_error(), "x: term 0: A is 2x3 and B is 2x2 but the weight is 3x2");
    assert_int_equal(lk_fuse_tensor(res, w, LK_DTYPE_I32, 2, 3, &t, 1, NULL, "x"), LK_ERR_DTYPE);
    tu_assert_contains(lk_last_error(), "x: weight dtype I32 cannot be fused");
    lk_tensor Ai = A;
    Ai.dtype = LK_DTYPE_I8;
    Ai.data = i8;
    lk_fuse_term ti = {.A = &Ai, .B = &B, .scale = 1.0f};
    assert_int_equal(lk_fuse_tensor(res, w, LK_DTYPE_F32, 2, 3, &ti, 1, NULL, "x"), LK_ERR_DTYPE);
    tu_assert_contains(lk_last_error(), "x: term 0: A has dtype I8");
    lk_fuse_term tn = {.A = &A, .B = &B, .scale = NAN};
    assert_int_equal(lk_fuse_tensor(res, w, LK_DTYPE_F32, 2, 3, &tn, 1, NULL, "x"), LK_ERR_NONFINITE);
    tu_assert_contains(lk_last_error(), "x: term 0: scale is nan");
    /* Allocation failure: clean error, output untouched. */
    memset(res, 0x55, sizeof res);
    lk_alloc_fail_at(1);
    assert_int_equal(lk_fuse_tensor(res, w, LK_DTYPE_F32, 2, 3, &t, 1, NULL, "x"), LK_ERR_NOMEM);
    lk_alloc_fail_at(0);
    for (size_t i = 0; i < sizeof res; i++) assert_int_equal(((unsigned char *)res)[i], 0x55);
}

/* ---- LoHa, LoKr and dense terms (terms.c) on every path ----
 * The canonical arithmetic of terms.c's header, replayed here from its
 * statement: d0 = the LoRA chain (rf_delta) or +0, then d = acc(d0 + x)
 * with x the term's delta (dense: acc(s D); LoHa: acc(P1 P2), P1 the
 * chain with s in B', P2 without; LoKr: acc(acc(s W1) acc(W2)), W1 and W2
 * f64 chains), then rf_element's single rounding. The AVX-512 paths fuse
 * one term alone in registers (kernel_avx512.c's fused rows), a mix of
 * terms through the staged rows, the AVX2 and portable paths always staged:
 * every one must give these bytes, at 1-3 threads, in place or not. */

/* W1 or W2 of a Kronecker term at [i, q]: B @ A as a f64 chain, or B. */
static double tx_factor(const lk_tensor *B, const lk_tensor *A, size_t i, size_t q) {
    if (!A) return rf_get(B, i * (size_t)B->shape[1] + q);
    const rf_term t = {A, B, 1.0};
    return rf_delta(1, &t, 1, i, q, (size_t)A->shape[1]);
}

/* d of element (o, j) for terms t (LoRA terms first, as callers order them). */
static double tx_delta(int wide, const lk_fuse_term *t, size_t nt, size_t o, size_t j, size_t in) {
    rf_term lr[4];
    size_t nl = 0;
    for (size_t i = 0; i < nt; i++)
        if (t[i].kind == LK_TERM_LORA) lr[nl++] = (rf_term){t[i].A, t[i].B, t[i].scale};
    double d = nl ? rf_delta(wide, lr, nl, o, j, in) : 0.0;
    volatile float df = (float)d;
    for (size_t i = 0; i < nt; i++) {
        const lk_fuse_term *x = &t[i];
        if (x->kind == LK_TERM_LORA || x->scale == 0.0) continue;
        double xv;
        if (x->kind == LK_TERM_DENSE) {
            const double v = rf_get(x->B, o * in + j);
            xv = wide ? x->scale * v : (double)(float)(x->scale * v);
        } else if (x->kind == LK_TERM_HADA) {
            const rf_term t1 = {x->A, x->B, x->scale}, t2 = {x->A2, x->B2, 1.0};
            const double p1 = rf_delta(wide, &t1, 1, o, j, in), p2 = rf_delta(wide, &t2, 1, o, j, in);
            volatile float pf = (float)p1 * (float)p2;
            xv = wide ? p1 * p2 : (double)pf;
        } else {
            const size_t c = (size_t)x->B2->shape[0];
            const size_t D = (size_t)(x->A2 ? x->A2->shape[1] : x->B2->shape[1]);
            const double w1 = x->scale * tx_factor(x->B, x->A, o / c, j / D), w2 = tx_factor(x->B2, x->A2, o % c, j % D);
            volatile float pf = (float)w1 * (float)w2;
            xv = wide ? w1 * w2 : (double)pf;
        }
        if (wide) d = d + xv;
        else df = df + (float)xv;
    }
    return wide ? d : (double)df;
}

static void tx_set(const lk_tensor *t, size_t i, float v) {
    lk_from_f32((char *)t->data + i * lk_dtype_size(t->dtype), &v, t->dtype, 1);
}

static void test_terms_paths(void **state) {
    (void)state;
    typedef struct tcase {
        int64_t out, in;
        int kind;           /* 0 dense, 1 LoHa, 2 LoKr (w1 full, w2 = w2a @ w2b), 3 LoKr (w1 = w1a @ w1b, w2 full), 4 LoRA + LoHa */
        int64_t a, b, c, D; /* LoKr: w1 a x b, w2 c x D; LoHa: the two ranks in a, b */
        float scale;
        int ddt;            /* dense: the delta's dtype (index into DTS) */
    } tcase;
    const tcase cases[] = {
        {13, 150, 0, 0, 0, 0, 0, 1.0f, 2},  /* BF16 delta, scale 1: ties on BF16 weights */
        {13, 150, 0, 0, 0, 0, 0, -0.37f, 0},
        {7, 37, 0, 0, 0, 0, 0, 1.0f, 1},
        {13, 150, 1, 3, 5, 0, 0, 0.8f, 0},   /* row tail of the 3-row block, column tails */
        {5, 64, 1, 1, 1, 0, 0, -1.5f, 0},    /* ranks 1: x = -0 at [0, 0] (below) */
        {11, 200, 1, 16, 7, 0, 0, 0.25f, 1},
        {14, 150, 2, 2, 3, 7, 50, 0.6f, 0},  /* D = 50: masked groups inside each row */
        {10, 140, 3, 2, 2, 5, 70, 1.0f, 0},  /* D = 70: two segments per q */
        {13, 150, 4, 3, 4, 0, 0, 0.9f, 0},   /* LoRA + LoHa: the staged rows */
    };
    tu_rng rng = {1818};
    unsigned long checked = 0;
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
        for (int wd = 0; wd < 3; wd++) {
            const tcase *f = &cases[c];
            const lk_dtype dt = DTS[wd];
            const size_t n = (size_t)(f->out * f->in), esz = lk_dtype_size(dt);
            ar_tensor W, T[6];
            int nt = 0;
            ar_tensor_rand(&W, "w", dt, f->out, f->in, &rng, -1, 1);
            const uint32_t sp[3][5] = {{0x80000000u, 0x7f812345u, 0x7f800000u, 0x00000005u, 0x3f800000u},
                                       {0x8000u, 0x7c2au, 0x7c00u, 0x0003u, 0x3c00u},
                                       {0x8000u, 0x7f91u, 0xff80u, 0x0021u, 0x3f80u}};
            for (int i = 0; i < 5; i++) memcpy((char *)W.t.data + (size_t)(i * 7) % n * esz, &sp[wd][i], esz);
            lk_fuse_term terms[2];
            size_t n_terms = 1;
#define RT(rows, cols, fd) (ar_tensor_rand(&T[nt], "f", DTS[(fd) % 3], (rows), (cols), &rng, -1, 1), &T[nt++].t)
            if (f->kind == 0) {
                lk_tensor *D = RT(f->out, f->in, f->ddt);
                if (f->ddt != 0) { /* special deltas: -0, Inf, a value that overflows */
                    const uint16_t dsp[3] = {0x8000u, f->ddt == 1 ? 0x7c00u : 0x7f80u, f->ddt == 1 ? 0x7bffu : 0x7f7fu};
                    for (int i = 0; i < 3; i++) memcpy((char *)D->data + (size_t)(i * 11) % n * 2, &dsp[i], 2);
                }
                terms[0] = (lk_fuse_term){.B = D, .scale = f->scale, .kind = LK_TERM_DENSE};
            } else if (f->kind == 1 || f->kind == 4) {
                lk_tensor *B1 = RT(f->out, f->a, wd + 1), *A1 = RT(f->a, f->in, wd + 2);
                lk_tensor *B2 = RT(f->out, f->b, wd), *A2 = RT(f->b, f->in, wd + 1);
                terms[0] = (lk_fuse_term){.A = A1, .B = B1, .A2 = A2, .B2 = B2, .scale = f->scale, .kind = LK_TERM_HADA};
                if (f->a == 1 && f->b == 1) { /* P1[0,0] = (-1.5 * +0) * 1 = -0, P2 = 1: x = -0 on W = -0 */
                    tx_set(B1, 0, 0.0f);
                    tx_set(A1, 0, 1.0f);
                    tx_set(B2, 0, 1.0f);
                    tx_set(A2, 0, 1.0f);
                }
                if (f->kind == 4) {
                    lk_tensor *LB = RT(f->out, 2, wd), *LA = RT(2, f->in, wd + 2);
                    terms[1] = terms[0];
                    terms[0] = (lk_fuse_term){.A = LA, .B = LB, .scale = -0.7};
                    n_terms = 2;
                }
            } else if (f->kind == 2) {
                lk_tensor *w1 = RT(f->a, f->b, wd), *w2b = RT(f->c, 3, wd + 1), *w2a = RT(3, f->D, wd + 2);
                terms[0] = (lk_fuse_term){.B = w1, .A2 = w2a, .B2 = w2b, .scale = f->scale, .kind = LK_TERM_KRON};
                /* W1s[0,0] = +0, W2[0,0] = -1 (+ 0 * ...): x = -0 on W = -0 */
                tx_set(w1, 0, 0.0f);
                tx_set(w2b, 0, -1.0f);
                tx_set(w2b, 1, 0.0f);
                tx_set(w2b, 2, 0.0f);
                tx_set(w2a, 0, 1.0f);
            } else {
                lk_tensor *w1b = RT(f->a, 2, wd), *w1a = RT(2, f->b, wd + 1), *w2 = RT(f->c, f->D, wd + 2);
                terms[0] = (lk_fuse_term){.A = w1a, .B = w1b, .B2 = w2, .scale = f->scale, .kind = LK_TERM_KRON};
            }
#undef RT
            char *want = malloc(W.t.nbytes), *res = malloc(W.t.nbytes);
            for (size_t i = 0; i < n; i++) {
                uint32_t wb = 0, r;
                memcpy(&wb, (const char *)W.t.data + i * esz, esz);
                r = rf_element(dt, wb, rf_get(&W.t, i),
                               tx_delta(dt == LK_DTYPE_F32, terms, n_terms, i / (size_t)f->in, i % (size_t)f->in,
                                        (size_t)f->in));
                memcpy(want + i * esz, &r, esz);
            }
            for (int pth = 0; pth < N_PATHS; pth++) {
                if (!force_path(PATHS[pth])) continue;
                for (int th = 1; th <= 3; th++) {
                    lk_fuse_opts o = {.threads = th, .allow_nonfinite = 1};
                    memset(res, 0xa5, W.t.nbytes);
                    if (th == 3) memcpy(res, W.t.data, W.t.nbytes); /* in place */
                    assert_int_equal(lk_fuse_tensor(res, th == 3 ? res : W.t.data, dt, f->out, f->in, terms, n_terms,
                                                    &o, "w"),
                                     LK_OK);
                    for (size_t i = 0; i < n; i++)
                        if (memcmp(res + i * esz, want + i * esz, esz))
                            fail_msg("case %zu %s path %s threads %d: element %zu differs from the specification", c,
                                     lk_dtype_name(dt), PATHS[pth], th, i);
                    checked++;
                }
            }
            unsetenv("LORAKIT_KERNEL");
            free(want);
            free(res);
            ar_tensor_free(&W);
            for (int i = 0; i < nt; i++) ar_tensor_free(&T[i]);
        }
    assert_true(checked >= 8 * 3 * 3);
}

/* A LoHa term big enough for several threads and row blocks (2^19
 * elements, BF16): every path and thread count gives the bytes of the
 * portable path at one thread, which test_terms_paths ties to the
 * specification. */
static void test_terms_threads(void **state) {
    (void)state;
    tu_rng rng = {99};
    const int64_t out = 515, in = 1030;
    ar_tensor W, A1, B1, A2, B2;
    ar_tensor_rand(&W, "w", LK_DTYPE_BF16, out, in, &rng, -1, 1);
    ar_tensor_rand(&A1, "A", LK_DTYPE_BF16, 8, in, &rng, -0.5f, 0.5f);
    ar_tensor_rand(&B1, "B", LK_DTYPE_F32, out, 8, &rng, -0.5f, 0.5f);
    ar_tensor_rand(&A2, "A", LK_DTYPE_F16, 4, in, &rng, -0.5f, 0.5f);
    ar_tensor_rand(&B2, "B", LK_DTYPE_BF16, out, 4, &rng, -0.5f, 0.5f);
    lk_fuse_term t = {.A = &A1.t, .B = &B1.t, .A2 = &A2.t, .B2 = &B2.t, .scale = 0.3, .kind = LK_TERM_HADA};
    void *first = malloc(W.t.nbytes), *res = malloc(W.t.nbytes);
    assert_true(force_path("portable"));
    lk_fuse_opts o1 = {.threads = 1};
    assert_int_equal(lk_fuse_tensor(first, W.t.data, LK_DTYPE_BF16, out, in, &t, 1, &o1, "w"), LK_OK);
    const int th[3] = {1, 2, 3};
    for (int pth = 0; pth < N_PATHS; pth++) {
        if (!force_path(PATHS[pth])) continue;
        for (int i = 0; i < 3; i++) {
            lk_fuse_opts o = {.threads = th[i]};
            memset(res, 0, W.t.nbytes);
            assert_int_equal(lk_fuse_tensor(res, W.t.data, LK_DTYPE_BF16, out, in, &t, 1, &o, "w"), LK_OK);
            assert_memory_equal(res, first, W.t.nbytes);
        }
    }
    unsetenv("LORAKIT_KERNEL");
    free(first);
    free(res);
    ar_tensor_free(&W);
    ar_tensor_free(&A1);
    ar_tensor_free(&B1);
    ar_tensor_free(&A2);
    ar_tensor_free(&B2);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_matches_reference), cmocka_unit_test(test_thread_invariance),
        cmocka_unit_test(test_zero_strength_identity), cmocka_unit_test(test_hand_computed),
        cmocka_unit_test(test_nonfinite), cmocka_unit_test(test_errors),
        cmocka_unit_test(test_misaligned_weight), cmocka_unit_test(test_canonical_bytes),
        cmocka_unit_test(test_nonfinite_bf16_block), cmocka_unit_test(test_single_rounding_hand),
        cmocka_unit_test(test_f32_cancellation), cmocka_unit_test(test_delta_api),
        cmocka_unit_test(test_add_odd_hand), cmocka_unit_test(test_ties_in_blocks),
        cmocka_unit_test(test_epilogue_edges), cmocka_unit_test(test_terms_paths),
        cmocka_unit_test(test_terms_threads),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
