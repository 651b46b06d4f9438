/* test_oft_paths.c — OFT and BOFT give the same bytes on every CPU path
 * (LORAKIT_KERNEL=avx512bf16|avx512|avx2|portable) and at every thread
 * count, for F32, F16 and BF16 weights, with and without a rescale, under
 * the lycoris and comfyui rules, on shapes that are not multiples of any
 * tile (odd block sizes, column counts around the tile widths), and on
 * weights holding every special case of the rounding: NaN (quiet and
 * signalling), +-Inf, +-0, subnormals, values near the dtype's largest
 * finite one (rotated into overflow), and exact ties (the rotation of a
 * weight that is 0 in every other row of its block).
 *
 * Oracle: the portable path, the plain scalar code of src/fuse/oft.c
 * (kernel_scalar.h's per-element rules: the canonical arithmetic written
 * in oft.c's header); the vector paths must equal it bit for bit, and a
 * non-finite result from a finite weight must be reported at the same
 * element on every path. Accuracy against float64 references of LyCORIS's
 * and ComfyUI's formulas is test_oft.c's (fixtures written by lycoris-lora).
 * OFT_PATHS_DUMP=FILE writes one digest line per case, for comparing two
 * builds by hand. The AVX-512 paths fuse OFT on BF16 / F16 weights with an
 * fp32 chain and a certified rounding (oft.c, oblock_narrow): these
 * comparisons are what shows that certificate and its redo give step 3's
 * bytes; test_adversarial adds rotations far from I, blocks of 64 and 128
 * and near-cancellation rows, against a long-double oracle (<= 1 ulp);
 * test_boft_lycoris_layout runs BOFT in LyCORIS's own layout (one group
 * of all the rows, the widened tiles) against a long-double oracle. */
#include "adapter_ref.h"
#include "fuse/fuse.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lorakit/dtype.h"
#include "lorakit/fuse.h"

#define N_PATHS 4
static const char *const PATHS[N_PATHS] = {"portable", "avx512bf16", "avx512", "avx2"};
static const lk_dtype DTS[3] = {LK_DTYPE_F32, LK_DTYPE_F16, LK_DTYPE_BF16};

typedef struct pcase {
    const char *name;
    int64_t m, nb, b, in; /* m = 0: OFT [nb, b, b]; else BOFT [m, nb, b, b] */
    int rescale;
    double strength, alpha;
    lk_convention conv;
} pcase;

static const pcase CASES[] = {
    {"oft16", 0, 6, 16, 600, 0, 1.0, 0.0, LK_CONVENTION_LYCORIS},
    {"oft16_rho_s07", 0, 6, 16, 77, 1, 0.7, 0.0, LK_CONVENTION_LYCORIS},
    {"oft5_comfy", 0, 7, 5, 1031, 0, -0.3, 0.0, LK_CONVENTION_COMFYUI},
    {"oft3_rho_constraint", 0, 9, 3, 33, 1, 1.0, 1e-3, LK_CONVENTION_LYCORIS},
    {"oft1", 0, 13, 1, 19, 0, 0.7, 0.0, LK_CONVENTION_LYCORIS},
    {"oft32", 0, 2, 32, 129, 0, 1.0, 0.0, LK_CONVENTION_LYCORIS},
    {"boft4x4", 4, 16, 4, 300, 0, 1.0, 0.0, LK_CONVENTION_LYCORIS},
    {"boft_rho_s07", 3, 8, 6, 67, 1, 0.7, 0.0, LK_CONVENTION_LYCORIS},
    {"boft_comfy", 2, 6, 2, 45, 1, -0.3, 0.0, LK_CONVENTION_COMFYUI},
    {"boft1", 1, 5, 8, 513, 0, 1.0, 0.0, LK_CONVENTION_LYCORIS},
    /* LyCORIS's own layout (its butterfly_factor: n = 2^p blocks, m = p + 1 stages, so one group of all the rows):
     * groups of 256 and 128 rows, taller than BOFT_TILE's columns allow, column counts off the tile width */
    {"boft_lycoris_m7", 7, 64, 4, 200, 0, 1.0, 0.0, LK_CONVENTION_LYCORIS},
    {"boft_lycoris_m5_rho_comfy", 5, 16, 8, 131, 1, 0.7, 0.0, LK_CONVENTION_COMFYUI},
};
#define NCASES (sizeof CASES / sizeof CASES[0])

static uint64_t fnv(const void *p, size_t n) {
    const unsigned char *c = p;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ c[i]) * 1099511628211ull;
    return h;
}

/* Overwrites some elements of a weight with the rounding's special cases
 * (bit patterns of the dtype), and makes one block's rows ties: every
 * other row 0, so a rotation gives sums of few terms. */
static void sprinkle(lk_tensor *w, tu_rng *rng, int64_t b) {
    const lk_dtype dt = w->dtype;
    const size_t n = lk_tensor_numel(w), in = (size_t)w->shape[1];
    static const uint32_t f32s[] = {0x7fc00000u, 0x7fa00001u, 0xffc00123u, 0x7f800000u, 0xff800000u, 0x00000000u,
                                    0x80000000u, 0x00000001u, 0x807fffffu, 0x7f7fffffu, 0xff7ffffeu, 0x00800000u};
    static const uint16_t f16s[] = {0x7e00u, 0x7d01u, 0xfe05u, 0x7c00u, 0xfc00u, 0x0000u,
                                    0x8000u, 0x0001u, 0x83ffu, 0x7bffu, 0xfbfeu, 0x0400u};
    static const uint16_t bf16s[] = {0x7fc0u, 0x7fa1u, 0xffc3u, 0x7f80u, 0xff80u, 0x0000u,
                                     0x8000u, 0x0001u, 0x807fu, 0x7f7fu, 0xff7eu, 0x0080u};
    for (size_t k = 0; k < 12 && n > 40; k++) {
        const size_t i = (size_t)(tu_next(rng) % n), v = (size_t)(tu_next(rng) % 12);
        if (dt == LK_DTYPE_F32) memcpy((char *)w->data + 4 * i, &f32s[v], 4);
        else memcpy((char *)w->data + 2 * i, dt == LK_DTYPE_F16 ? &f16s[v] : &bf16s[v], 2);
    }
    /* block 1 (rows b .. 2b - 1): every other row 0 over the first columns */
    for (int64_t r = b; r < 2 * b && r < w->shape[0]; r += 2)
        memset((char *)w->data + (size_t)r * in * lk_dtype_size(dt), 0, (in < 40 ? in : 40) * lk_dtype_size(dt));
}

typedef struct pinput {
    ar_tensor W, X, rho;
    lk_fuse_term term;
} pinput;

static void make_input(pinput *pi, const pcase *c, lk_dtype dt, tu_rng *rng) {
    const int64_t out = c->nb * c->b;
    ar_tensor_rand(&pi->W, "w", dt, out, c->in, rng, -2, 2);
    sprinkle(&pi->W.t, rng, c->b);
    const int64_t lead = c->m ? c->m * c->nb : c->nb;
    ar_tensor_rand(&pi->X, "oft_blocks", LK_DTYPE_F32, lead * c->b, c->b, rng, -0.2f, 0.2f);
    if (c->m) {
        pi->X.t.ndim = 4;
        pi->X.t.shape[0] = c->m, pi->X.t.shape[1] = c->nb, pi->X.t.shape[2] = c->b, pi->X.t.shape[3] = c->b;
    } else {
        pi->X.t.ndim = 3;
        pi->X.t.shape[0] = c->nb, pi->X.t.shape[1] = c->b, pi->X.t.shape[2] = c->b;
    }
    if (c->rescale) ar_tensor_rand(&pi->rho, "rescale", LK_DTYPE_F32, out, 1, rng, 0.5f, 1.5f);
    pi->term = (lk_fuse_term){.B = &pi->X.t, .A2 = c->rescale ? &pi->rho.t : NULL, .scale = c->strength,
                              .alpha = c->alpha, .kind = LK_TERM_OFT};
}

static void free_input(pinput *pi, const pcase *c) {
    ar_tensor_free(&pi->W);
    ar_tensor_free(&pi->X);
    if (c->rescale) ar_tensor_free(&pi->rho);
}

/* Fuses under path at threads; returns the status, the bytes in res. */
static lk_status fuse_on(const char *path, int threads, int allow, const pcase *c, const pinput *pi, void *res) {
    setenv("LORAKIT_KERNEL", path, 1);
    assert_string_equal(lk_fuse_kernel_path(), path);
    lk_fuse_opts o = {.threads = threads, .allow_nonfinite = allow, .convention = c->conv};
    lk_status s = lk_fuse_tensor(res, pi->W.t.data, pi->W.t.dtype, pi->W.t.shape[0], pi->W.t.shape[1], &pi->term, 1,
                                 &o, "w");
    unsetenv("LORAKIT_KERNEL");
    return s;
}

static void test_paths(void **state) {
    (void)state;
    FILE *dump = getenv("OFT_PATHS_DUMP") ? fopen(getenv("OFT_PATHS_DUMP"), "w") : NULL;
    tu_rng rng = {2029};
    size_t compared = 0;
    for (size_t ci = 0; ci < NCASES; ci++)
        for (int di = 0; di < 3; di++) {
            const pcase *c = &CASES[ci];
            pinput pi;
            make_input(&pi, c, DTS[di], &rng);
            const size_t nbytes = pi.W.t.nbytes;
            unsigned char *ref = malloc(nbytes), *res = malloc(nbytes);
            assert_non_null(ref);
            assert_non_null(res);
            assert_int_equal(fuse_on("portable", 1, 1, c, &pi, ref), LK_OK);
            /* the weight changed: the rotation is not a no-op */
            assert_memory_not_equal(ref, pi.W.t.data, nbytes);
            char err_ref[512];
            const lk_status s_ref = fuse_on("portable", 1, 0, c, &pi, res);
            snprintf(err_ref, sizeof err_ref, "%s", s_ref ? lk_last_error() : "");
            if (dump)
                fprintf(dump, "%s %s %016llx %d %s\n", c->name, lk_dtype_name(DTS[di]),
                        (unsigned long long)fnv(ref, nbytes), (int)s_ref, err_ref);
            for (int p = 0; p < N_PATHS; p++) {
                if (!lk_fuse_kernel_supported(PATHS[p])) continue;
                const int th[3] = {1, 3, 0};
                for (int t = 0; t < 3; t++) {
                    memset(res, 0xa5, nbytes);
                    assert_int_equal(fuse_on(PATHS[p], th[t], 1, c, &pi, res), LK_OK);
                    if (memcmp(res, ref, nbytes)) {
                        size_t at = 0;
                        while (res[at] == ref[at]) at++;
                        fail_msg("%s %s on %s at %d threads: byte %zu differs from the portable path", c->name,
                                 lk_dtype_name(DTS[di]), PATHS[p], th[t], at);
                    }
                    compared++;
                    /* the same non-finite report (the same first element) */
                    const lk_status s = fuse_on(PATHS[p], th[t], 0, c, &pi, res);
                    assert_int_equal(s, s_ref);
                    if (s) assert_string_equal(lk_last_error(), err_ref);
                }
            }
            /* in place: the same bytes */
            memcpy(res, pi.W.t.data, nbytes);
            lk_fuse_opts o = {.threads = 2, .allow_nonfinite = 1, .convention = c->conv};
            assert_int_equal(lk_fuse_tensor(res, res, DTS[di], pi.W.t.shape[0], c->in, &pi.term, 1, &o, "w"), LK_OK);
            assert_memory_equal(res, ref, nbytes);
            free(ref);
            free(res);
            free_input(&pi, c);
        }
    if (dump) fclose(dump);
    printf("oft paths: %zu fuses compared bit for bit with the portable path\n", compared);
}

/* The rounding's hard cases, crafted (a rotation of random data almost
 * never makes them): x + d exactly on a midpoint of the dtype's grid, or
 * off it by less than f64 or f32 can hold (d = h + eps with eps below the
 * f64 sum's unit, or below f32's: the rounded sum is the midpoint, the
 * exact one is not), on
 * both sides, around values of every binade the dtype has (subnormal,
 * normal, the largest finite: overflow by rounding), both signs, plus
 * NaN, Inf and zeros. Every vector path must give the portable path's
 * bytes and the same non-finite report (lk_oft_round_row). */
static void craft(lk_dtype dt, double *x, double *d, size_t *n, size_t cap) {
    /* base values of dt: 1, 1.5, 2^-10, 3 x 2^-20, small normals, subnormals, the largest finite */
    const double f32max = 3.4028234663852886e38, f16max = 65504.0, bfmax = 3.3895313892515355e38;
    const int mant = dt == LK_DTYPE_F32 ? 24 : dt == LK_DTYPE_F16 ? 11 : 8;
    const int emin = dt == LK_DTYPE_F16 ? -14 : -126;
    const double mx = dt == LK_DTYPE_F32 ? f32max : dt == LK_DTYPE_F16 ? f16max : bfmax;
    const double bases[] = {1.0, 1.5, ldexp(1, -10), 3 * ldexp(1, -20), ldexp(1, emin), ldexp(1.25, emin + 1),
                            ldexp(1, emin - 3), ldexp(3, emin - mant + 1), mx, mx / 2, 0.0};
    const double epss[] = {0, 0x1p-60, -0x1p-60, 0x1p-40, -0x1p-40, 0x1p-30, -0x1p-30, 0x1p-26, -0x1p-26};
    *n = 0;
    for (size_t bi = 0; bi < sizeof bases / sizeof bases[0]; bi++)
        for (int sg = -1; sg <= 1; sg += 2) {
            const double b = sg * bases[bi];
            int e;
            frexp(b == 0 ? ldexp(1, emin) : b, &e);
            if (e - 1 < emin) e = emin + 1;
            const double half = ldexp(1, e - 1 - mant); /* half a unit of dt at b */
            for (int k = -3; k <= 3; k++)
                for (size_t ei = 0; ei < sizeof epss / sizeof epss[0] && *n < cap; ei++) {
                    x[*n] = b;
                    /* eps relative to b: 2^-60 is below b's f64 unit (lost in the f64 sum, kept in d),
                     * 2^-40 .. 2^-26 below f32's (lost in f = RN32(s)) */
                    d[*n] = k * half + epss[ei] * (b == 0 ? ldexp(1, emin) : fabs(b));
                    (*n)++;
                    if (*n < cap) { /* the same offset made in f64 itself */
                        x[*n] = b;
                        d[*n] = (k * half) * (1 + epss[ei]);
                        (*n)++;
                    }
                }
        }
    const double sp[] = {NAN, -NAN, INFINITY, -INFINITY, 0.0, -0.0};
    for (size_t i = 0; i < 6; i++)
        for (size_t j = 0; j < 6 && *n + 1 < cap; j++) {
            x[*n] = sp[i], d[*n] = sp[j], (*n)++;
            x[*n] = sp[i], d[*n] = j == 5 ? 1e300 : 1.0, (*n)++;
        }
}

static void test_round_cases(void **state) {
    (void)state;
    enum { CAP = 4096 };
    static double x[CAP], d[CAP];
    static unsigned char ref[CAP * 4], res[CAP * 4];
    size_t n, slow = 0;
    for (int di = 0; di < 3; di++) {
        craft(DTS[di], x, d, &n, CAP);
        for (size_t i = 0; i < n; i++) { /* x must be a value of the dtype */
            float f = (float)x[i];
            unsigned char one[4];
            lk_from_f32(one, &f, DTS[di], 1);
            lk_to_f32(&f, one, DTS[di], 1);
            if (!isnan(x[i])) assert_true((double)f == x[i]);
        }
        /* in the crafted order: a vector group holds cases of one base value, so
         * one rare lane does not send the others of a binade to the exact path */
        const size_t esz = lk_dtype_size(DTS[di]);
        setenv("LORAKIT_KERNEL", "portable", 1);
        const size_t bad_ref = lk_oft_round_row(DTS[di], x, d, ref, n);
        for (int p = 1; p < N_PATHS; p++) {
            if (!lk_fuse_kernel_supported(PATHS[p])) continue;
            setenv("LORAKIT_KERNEL", PATHS[p], 1);
            memset(res, 0x5a, sizeof res);
            const size_t bad = lk_oft_round_row(DTS[di], x, d, res, n);
            for (size_t i = 0; i < n; i++)
                if (memcmp(res + i * esz, ref + i * esz, esz))
                    fail_msg("%s on %s: x = %a, d = %a: not the portable path's bits", lk_dtype_name(DTS[di]),
                             PATHS[p], x[i], d[i]);
            assert_int_equal(bad, bad_ref);
            slow++;
        }
        unsetenv("LORAKIT_KERNEL");
    }
    assert_true(slow > 0);
}


/* ---- adversarial rotations against a long-double oracle ----
 * R far from I (Q entries up to +-3 or +-1), blocks of 16, 64 and 128,
 * strengths 1 and 0.7, and near-cancellation rows: at s = 1 each column
 * of a block is W = RN(R v) with v's entry at row j mod b scaled by 2^-8,
 * so that element of R^T W is ~2^-8 of its inputs (and the BF16 / F16
 * fast paths' fp32 bound is loose there: many lanes are redone). Oracle:
 * this file's own Cayley transform and product in long double (64-bit
 * significand) from the blocks' values: every element within 1 ulp of
 * its dtype (the rule's claim), and every path and thread count gives the
 * portable path's bytes. */
typedef struct acase {
    int64_t nb, b, in;
    float xr; /* the blocks' values in [-xr, xr] */
    double s;
    int cancel;
} acase;

/* R = (I + Q)(I - Q)^-1 in long double (Gauss-Jordan, partial pivoting). */
static void ref_cayley(long double *R, const float *x, int64_t b) {
    long double *a = malloc(sizeof(long double) * (size_t)(3 * b * b)), *inv = a + b * b, *q = inv + b * b;
    assert_non_null(a);
    for (int64_t i = 0; i < b; i++)
        for (int64_t j = 0; j < b; j++) {
            q[i * b + j] = (long double)x[i * b + j] - (long double)x[j * b + i];
            a[i * b + j] = (i == j) - q[i * b + j];
            inv[i * b + j] = i == j;
        }
    for (int64_t c = 0; c < b; c++) {
        int64_t pv = c;
        for (int64_t r = c + 1; r < b; r++)
            if (fabsl(a[r * b + c]) > fabsl(a[pv * b + c])) pv = r;
        for (int64_t j = 0; j < b; j++) {
            long double t = a[c * b + j];
            a[c * b + j] = a[pv * b + j], a[pv * b + j] = t;
            t = inv[c * b + j], inv[c * b + j] = inv[pv * b + j], inv[pv * b + j] = t;
        }
        const long double piv = a[c * b + c];
        for (int64_t j = 0; j < b; j++) a[c * b + j] /= piv, inv[c * b + j] /= piv;
        for (int64_t r = 0; r < b; r++) {
            if (r == c) continue;
            const long double f = a[r * b + c];
            for (int64_t j = 0; j < b; j++) a[r * b + j] -= f * a[c * b + j], inv[r * b + j] -= f * inv[c * b + j];
        }
    }
    for (int64_t i = 0; i < b; i++)
        for (int64_t j = 0; j < b; j++) {
            long double acc = 0;
            for (int64_t u = 0; u < b; u++) acc += ((i == u) + q[i * b + u]) * inv[u * b + j];
            R[i * b + j] = acc;
        }
    free(a);
}

static void put(lk_tensor *w, size_t i, long double v) {
    float f = (float)v;
    if (w->dtype == LK_DTYPE_F32) ((float *)w->data)[i] = f;
    else lk_from_f32((char *)w->data + 2 * i, &f, w->dtype, 1);
}

/* Block k of an adversarial case: its R (long double), the crafted
 * columns of W when c->cancel, and the oracle's rotated rows into ref. */
static void adv_block(const acase *c, pinput *pi, int64_t k, long double *Rk, long double *col, double *ref,
                      tu_rng *rng) {
    const int64_t b = c->b, in = c->in;
    ref_cayley(Rk, (const float *)pi->X.t.data + k * b * b, b);
    for (int64_t j = 0; j < in && c->cancel; j++) { /* W = RN(R v): R^T W ~ v */
        for (int64_t u = 0; u < b; u++) col[u] = tu_uniform(rng, -1, 1) * (u == j % b ? 0x1p-8f : 1.0f);
        for (int64_t t = 0; t < b; t++) {
            long double acc = 0;
            for (int64_t u = 0; u < b; u++) acc += Rk[t * b + u] * col[u];
            put(&pi->W.t, (size_t)((k * b + t) * in + j), acc);
        }
    }
    for (int64_t t = 0; t < b; t++) /* W'_t = sum_u (I + s (R^T - I))_tu W_u */
        for (int64_t j = 0; j < in; j++) {
            long double acc = 0;
            for (int64_t u = 0; u < b; u++)
                acc += ((t == u) + (long double)c->s * (Rk[u * b + t] - (t == u))) *
                       (long double)ar_get(&pi->W.t, (size_t)((k * b + u) * in + j));
            ref[(k * b + t) * in + j] = (double)acc;
        }
}

static void test_adversarial(void **state) {
    (void)state;
    static const acase AC[] = {
        {4, 16, 70, 1.5f, 1.0, 1}, {3, 64, 45, 0.5f, 1.0, 1}, {2, 128, 33, 0.25f, 1.0, 1},
        {4, 16, 70, 1.5f, 0.7, 0}, {2, 128, 40, 0.25f, -0.3, 0},
    };
    tu_rng rng = {977};
    double worst[3] = {0, 0, 0};
    for (size_t ci = 0; ci < sizeof AC / sizeof AC[0]; ci++)
        for (int di = 0; di < 3; di++) {
            const acase *c = &AC[ci];
            const int64_t b = c->b, out = c->nb * b, in = c->in;
            pinput pi = {0};
            ar_tensor_rand(&pi.X, "oft_blocks", LK_DTYPE_F32, c->nb * b, b, &rng, -c->xr, c->xr);
            pi.X.t.ndim = 3, pi.X.t.shape[0] = c->nb, pi.X.t.shape[1] = b, pi.X.t.shape[2] = b;
            ar_tensor_rand(&pi.W, "w", DTS[di], out, in, &rng, -1, 1);
            pi.term = (lk_fuse_term){.B = &pi.X.t, .scale = c->s, .kind = LK_TERM_OFT};
            long double *R = malloc(sizeof(long double) * (size_t)(c->nb * b * b)), *col = malloc(sizeof(long double) * (size_t)b);
            double *ref = malloc(sizeof(double) * (size_t)(out * in));
            assert_non_null(R);
            assert_non_null(col);
            assert_non_null(ref);
            for (int64_t k = 0; k < c->nb; k++) adv_block(c, &pi, k, R + k * b * b, col, ref, &rng);
            const size_t nbytes = pi.W.t.nbytes;
            unsigned char *base = malloc(nbytes), *res = malloc(nbytes);
            assert_non_null(base);
            assert_non_null(res);
            const pcase pc = {"adversarial", 0, c->nb, b, in, 0, c->s, 0.0, LK_CONVENTION_LYCORIS};
            assert_int_equal(fuse_on("portable", 1, 1, &pc, &pi, base), LK_OK);
            for (int p = 0; p < N_PATHS; p++) {
                if (!lk_fuse_kernel_supported(PATHS[p])) continue;
                const int th[2] = {1, 3};
                for (int t = 0; t < 2; t++) {
                    memset(res, 0xa5, nbytes);
                    assert_int_equal(fuse_on(PATHS[p], th[t], 1, &pc, &pi, res), LK_OK);
                    if (memcmp(res, base, nbytes))
                        fail_msg("adversarial b=%lld s=%g %s on %s at %d threads: not the portable path's bytes",
                                 (long long)b, c->s, lk_dtype_name(DTS[di]), PATHS[p], th[t]);
                    lk_tensor got = pi.W.t;
                    got.data = res;
                    for (size_t i = 0; i < (size_t)(out * in); i++) {
                        const double e = fabs(ar_get(&got, i) - ref[i]) / ar_ulp(DTS[di], ref[i]);
                        if (!(e <= 1.0))
                            fail_msg("adversarial b=%lld s=%g %s on %s: element %zu = %.9g, the long-double "
                                     "oracle %.17g (%.3g ulp)", (long long)b, c->s, lk_dtype_name(DTS[di]),
                                     PATHS[p], i, ar_get(&got, i), ref[i], e);
                        if (e > worst[di]) worst[di] = e;
                    }
                }
            }
            free(base);
            free(res);
            free(R);
            free(col);
            free(ref);
            ar_tensor_free(&pi.W);
            ar_tensor_free(&pi.X);
        }
    printf("oft adversarial: worst %.3f / %.3f / %.3f ulp (F32 / F16 / BF16) against long double\n", worst[0],
           worst[1], worst[2]);
}

/* ---- LyCORIS's own BOFT layout against a long-double oracle ----
 * LyCORIS's butterfly_factor writes 2^p blocks and p + 1 stages: one
 * group of all the rows, taller than a BOFT tile's columns allow (oft.c
 * widens such tiles to BOFT_MIN_COLS). Oracle: the stages as the header's
 * formula states them (stage i, k = 2^i b / 2: permuted position (c, j, g)
 * holds row (c, g, j); each block of b permuted rows times R_i, not
 * transposed; LyCORIS at s = 1: W' = Y), each R_i by ref_cayley, all in
 * long double: every element within 1 ulp of its dtype, every path and
 * thread count the portable path's bytes; column counts off the tile. */
static void test_boft_lycoris_layout(void **state) {
    (void)state;
    static const int64_t LC[][4] = {{7, 64, 4, 200}, {5, 16, 8, 131}}; /* m, nb, b, in */
    tu_rng rng = {4099};
    double worst = 0;
    for (size_t ci = 0; ci < sizeof LC / sizeof LC[0]; ci++)
        for (int di = 0; di < 3; di++) {
            const int64_t m = LC[ci][0], nb = LC[ci][1], b = LC[ci][2], in = LC[ci][3], out = nb * b;
            pinput pi = {0};
            ar_tensor_rand(&pi.X, "oft_blocks", LK_DTYPE_F32, m * nb * b, b, &rng, -0.3f, 0.3f);
            pi.X.t.ndim = 4, pi.X.t.shape[0] = m, pi.X.t.shape[1] = nb, pi.X.t.shape[2] = b, pi.X.t.shape[3] = b;
            ar_tensor_rand(&pi.W, "w", DTS[di], out, in, &rng, -1, 1);
            pi.term = (lk_fuse_term){.B = &pi.X.t, .scale = 1.0, .kind = LK_TERM_OFT};
            long double *R = malloc(sizeof(long double) * (size_t)(b * b)), *y = malloc(sizeof(long double) *
                                                                                        (size_t)(2 * out * in));
            assert_non_null(R);
            assert_non_null(y);
            long double *cur = y, *nxt = y + out * in;
            for (int64_t i = 0; i < out * in; i++) cur[i] = (long double)ar_get(&pi.W.t, (size_t)i);
            for (int64_t st = 0; st < m; st++) {
                const int64_t k = ((int64_t)1 << st) * (b / 2);
                for (int64_t kk = 0; kk < nb; kk++) {
                    ref_cayley(R, (const float *)pi.X.t.data + (st * nb + kk) * b * b, b);
                    int64_t rows[8];
                    for (int64_t u = 0; u < b; u++) {
                        const int64_t pp = kk * b + u, c = pp / (2 * k), rem = pp % (2 * k);
                        rows[u] = c * 2 * k + (rem % 2) * k + rem / 2;
                    }
                    for (int64_t t = 0; t < b; t++)
                        for (int64_t j = 0; j < in; j++) {
                            long double acc = 0;
                            for (int64_t u = 0; u < b; u++) acc += R[t * b + u] * cur[rows[u] * in + j];
                            nxt[rows[t] * in + j] = acc;
                        }
                }
                long double *sw = cur;
                cur = nxt, nxt = sw;
            }
            const size_t nbytes = pi.W.t.nbytes;
            unsigned char *base = malloc(nbytes), *res = malloc(nbytes);
            assert_non_null(base);
            assert_non_null(res);
            const pcase pc = {"boft_lycoris", m, nb, b, in, 0, 1.0, 0.0, LK_CONVENTION_LYCORIS};
            assert_int_equal(fuse_on("portable", 1, 1, &pc, &pi, base), LK_OK);
            for (int p = 0; p < N_PATHS; p++) {
                if (!lk_fuse_kernel_supported(PATHS[p])) continue;
                for (int t = 1; t <= 3; t += 2) {
                    memset(res, 0xa5, nbytes);
                    assert_int_equal(fuse_on(PATHS[p], t, 1, &pc, &pi, res), LK_OK);
                    if (memcmp(res, base, nbytes))
                        fail_msg("boft m=%lld b=%lld %s on %s at %d threads: not the portable path's bytes",
                                 (long long)m, (long long)b, lk_dtype_name(DTS[di]), PATHS[p], t);
                    lk_tensor got = pi.W.t;
                    got.data = res;
                    for (size_t i = 0; i < (size_t)(out * in); i++) {
                        const double e = fabs(ar_get(&got, i) - (double)cur[i]) / ar_ulp(DTS[di], (double)cur[i]);
                        if (!(e <= 1.0))
                            fail_msg("boft m=%lld b=%lld %s on %s: element %zu = %.9g, the long-double oracle %.17g "
                                     "(%.3g ulp)", (long long)m, (long long)b, lk_dtype_name(DTS[di]), PATHS[p], i,
                                     ar_get(&got, i), (double)cur[i], e);
                        if (e > worst) worst = e;
                    }
                }
            }
            free(base);
            free(res);
            free(R);
            free(y);
            ar_tensor_free(&pi.W);
            ar_tensor_free(&pi.X);
        }
    printf("boft, LyCORIS's layout: worst %.3f ulp against long double\n", worst);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_paths), cmocka_unit_test(test_round_cases),
                                       cmocka_unit_test(test_adversarial), cmocka_unit_test(test_boft_lycoris_layout)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
