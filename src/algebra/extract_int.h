/* algebra/extract_int.h — one weight of lk_extract (extract_weight.c),
 * shared with the driver (extract.c). Internal. */
#ifndef LK_ALGEBRA_EXTRACT_INT_H
#define LK_ALGEBRA_EXTRACT_INT_H

#include <stddef.h>
#include <stdint.h>

#include "algebra/algebra_int.h"
#include "lorakit/checkpoint.h"

/* The delta D = TUNED - BASE of one weight, m x n row-major (a conv kernel
 * [out, in, kh, kw] as [out, in kh kw]), read in row chunks from the two
 * checkpoints at each pass: never the whole weight in memory. */
typedef struct lk_x_src {
    const lk_ckpt *base, *tuned;
    size_t ib, it;  /* the tensor's index in each */
    lk_dtype dtype; /* both sides' (checked equal) */
    size_t m, n;
} lk_x_src;

/* What every weight of a run uses. */
typedef struct lk_x_run {
    const lk_extract_opts *o;
    lk_alg_run run;     /* dtype, alpha, o = &o->alg */
    int power;          /* resolved (default 2) */
    int oversample;     /* resolved (default 8) */
} lk_x_run;

/* Extra results of one weight beside lk_alg_module's. */
typedef struct lk_x_result {
    double opt_up2;  /* an upper bound of the optimum's squared error: the sketch's own */
    size_t sketch;   /* the sketch's columns */
    int unchanged;   /* D == 0: nothing extracted */
} lk_x_result;

/* Extracts one weight into x (rank, b_bytes, a_bytes, norm2, err2, opt2 =
 * the lower bound, spec, err_spec) and r. Thread-safe; touches only x, r. */
lk_status lk_x_weight(const lk_x_run *xr, const lk_x_src *src, lk_alg_module *x, lk_x_result *r);

#endif
