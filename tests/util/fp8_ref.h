/* fp8_ref.h — the tests' own FP8 reference (double precision, bit
 * fields and a sorted value table; written independently of
 * src/core/dtype.c): decode by the formats' definitions, round to nearest
 * with ties to the even code and overflow past the largest finite. Used by
 * test_fp8.c (checked on every code and a million values) and by the FP8
 * fuse tests as their oracle. Header-only. */
#ifndef LK_TESTS_FP8_REF_H
#define LK_TESTS_FP8_REF_H

#include <math.h>
#include "lorakit/dtype.h"

typedef struct {
    lk_dtype dt;
    int ebits, mbits, bias;
    int has_inf;
} ref_fmt;

static const ref_fmt E4M3 = {LK_DTYPE_F8_E4M3, 4, 3, 7, 0};
static const ref_fmt E5M2 = {LK_DTYPE_F8_E5M2, 5, 2, 15, 1};

/* Decoded value of code c (NAN for NaN codes). */
static inline double ref_decode(const ref_fmt *f, unsigned c) {
    unsigned s = c >> 7, e = (c >> f->mbits) & ((1u << f->ebits) - 1u), m = c & ((1u << f->mbits) - 1u);
    unsigned emax = (1u << f->ebits) - 1u;
    double v;
    if (f->has_inf && e == emax) v = m ? NAN : INFINITY;
    else if (!f->has_inf && e == emax && m == (1u << f->mbits) - 1u) v = NAN;
    else if (e == 0) v = ldexp((double)m, 1 - f->bias - f->mbits);
    else v = ldexp(1.0 + ldexp((double)m, -f->mbits), (int)e - f->bias);
    return s ? -v : v;
}

/* The finite non-negative values in increasing order, codes 0.. up to the
 * largest finite; returns their count. */
static inline int ref_table(const ref_fmt *f, double *val, unsigned *code) {
    int n = 0;
    for (unsigned c = 0; c < 128; c++) {
        double v = ref_decode(f, c);
        if (isnan(v) || isinf(v)) break;
        val[n] = v;
        code[n++] = c;
    }
    return n;
}

/* Reference RNE of x: *code, returns 1 on overflow (code = +-max). */
static inline int ref_encode(const ref_fmt *f, double x, unsigned *out) {
    static double val[2][128];
    static unsigned code[2][128];
    static int n[2];
    int w = f == &E5M2;
    if (!n[w]) n[w] = ref_table(f, val[w], code[w]);
    unsigned sign = signbit(x) ? 0x80u : 0u;
    double a = fabs(x);
    int cnt = n[w];
    double top = val[w][cnt - 1];
    /* the step past the largest finite: the next value of its binade */
    double next = top + (top - val[w][cnt - 2]);
    unsigned next_code = code[w][cnt - 1] + 1; /* its would-be code (parity only) */
    if (a >= next) {
        *out = sign | code[w][cnt - 1];
        return 1;
    }
    if (a > top) { /* between max and the virtual next value */
        double dl = a - top, dh = next - a;
        int up = dh < dl || (dh == dl && (next_code & 1u) == 0);
        *out = sign | code[w][cnt - 1];
        return up;
    }
    int lo = 0, hi = cnt - 1; /* largest index with val <= a */
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (val[w][mid] <= a) lo = mid;
        else hi = mid - 1;
    }
    if (val[w][lo] == a || lo == cnt - 1) {
        *out = sign | code[w][lo];
        return 0;
    }
    double dl = a - val[w][lo], dh = val[w][lo + 1] - a;
    int up = dh < dl || (dh == dl && (code[w][lo + 1] & 1u) == 0);
    *out = sign | code[w][lo + up];
    return 0;
}


static inline const ref_fmt *ref_fmt_of(lk_dtype d) { return d == LK_DTYPE_F8_E5M2 ? &E5M2 : &E4M3; }

#endif
