/* adapter_ref.h — test helpers for adapters and fusion: building tensors
 * from doubles, and the independent double-precision reference of
 * W + sum_t scale_t * (B_t @ A_t) with its tolerance check. */
#ifndef LK_TESTS_ADAPTER_REF_H
#define LK_TESTS_ADAPTER_REF_H

#include <stddef.h>
#include <stdint.h>
#include "lorakit/lorakit.h"
#include "testutil.h"

/* A tensor owning its bytes (free with ar_tensor_free). */
typedef struct ar_tensor {
    lk_tensor t;
    char name[256];
} ar_tensor;

/* rows x cols (ndim 2) of dtype, filled with uniform values in [lo, hi). */
void ar_tensor_rand(ar_tensor *at, const char *name, lk_dtype dt, int64_t rows, int64_t cols,
                    tu_rng *rng, float lo, float hi);
/* 0-d scalar of dtype holding v (F32/F16/BF16/F64). */
void ar_tensor_scalar(ar_tensor *at, const char *name, lk_dtype dt, double v);
void ar_tensor_free(ar_tensor *at);
/* Stored value i of a fusable (or F64) tensor, as a double. */
double ar_get(const lk_tensor *t, size_t i);
/* One unit in the last place of v in dtype (F32/F16/BF16), for |v| >= 0. */
double ar_ulp(lk_dtype dt, double v);

typedef struct ar_term {
    const lk_tensor *A, *B;
    double scale; /* the scale the kernel gets: (double)strength * alpha / r */
} ar_term;

/* Checks every element of fused (dtype dt, out x in) against the double
 * reference W + sum_t scale_t * sum_k B[o,k] A[k,j] computed from the stored
 * values of w, allowing 1 ulp of the result's dtype (F16, BF16); for F32
 * weights 1 ulp plus the error bound of double sums of 2R products
 * ((2R + 2) * 2^-53 * sum |terms|: this reference is itself a double sum).
 * Returns the number of elements out of tolerance (and prints the first few). */
size_t ar_check_fused(const void *fused, const void *w, lk_dtype dt, int64_t out, int64_t in,
                      const ar_term *terms, size_t n_terms);

#endif

/* A set of named tensors to save as a safetensors file (a model or an
 * adapter). Up to AF_MAX tensors; allocate with af_new. */
#define AF_MAX 64
typedef struct af_file {
    ar_tensor own[AF_MAX];
    lk_tensor t[AF_MAX]; /* views, in insertion order */
    size_t n;
} af_file;
af_file *af_new(void);
void af_free(af_file *f);
/* Adds rows x cols random values in [lo, hi); returns the view. */
lk_tensor *af_rand(af_file *f, const char *name, lk_dtype dt, int64_t rows, int64_t cols, tu_rng *rng,
                   float lo, float hi);
lk_tensor *af_scalar(af_file *f, const char *name, lk_dtype dt, double v);
/* The view of the tensor called name (asserts it exists). */
lk_tensor *af_get(af_file *f, const char *name);
/* Writes the file with lk_st_save (metadata as key/value pairs); asserts success. */
void af_save(const af_file *f, const char *path, const char *const *meta_kv, size_t n_meta);
/* cmocka group setup/teardown: a fresh temporary folder in ar_dir, removed
 * afterwards. */
extern char *ar_dir;
int ar_setup_dir(void **state);
int ar_teardown_dir(void **state);

/* Compares the fused checkpoint out with its base and a file of float64
 * expectations (written by a fixture generator from the real tool): every
 * tensor named in expected must be within 1 ulp of its dtype of the
 * expectation (F8_E4M3 weights: the code times the output's
 * "<m>.weight_scale", within 1 FP8 ulp at that scale, the rescaled scale
 * being LTX-2's formula on the expectation's amax to a relative 1e-6), every
 * other tensor byte-identical to base (but the scale of an expected FP8
 * weight). label prefixes failure messages; who names the oracle in them.
 * Returns the worst error in ulps; *changed gets the count of expected
 * tensors (all of which must exist in base). */
double ar_check_expected(const char *label, const char *who, const char *base, const char *out,
                         const char *expected, size_t *changed);

/* lk_fuse_tensors of in[0..n) on base's tensors in place (opts; stats may
 * be NULL) must give the digest of the fused file out (the in-place form
 * equals the file fuse); fails naming label otherwise. */
void ar_check_in_place(const char *label, const char *base, const char *out, const lk_fuse_input *in, size_t n,
                       const lk_fuse_file_opts *opts, lk_fuse_stats *stats);

/* Writes text to dir/name. */
void af_write_text(const char *dir, const char *name, const char *text);
