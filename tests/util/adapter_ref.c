/* adapter_ref.c — see adapter_ref.h. The reference is plain double loops,
 * written independently of src/fuse (no tiling, no fp32 anywhere). */
#include "adapter_ref.h"
#include "fp8_ref.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void ar_tensor_rand(ar_tensor *at, const char *name, lk_dtype dt, int64_t rows, int64_t cols,
                    tu_rng *rng, float lo, float hi) {
    memset(at, 0, sizeof *at);
    snprintf(at->name, sizeof at->name, "%s", name);
    at->t.name = at->name;
    at->t.dtype = dt;
    at->t.ndim = 2;
    at->t.shape[0] = rows;
    at->t.shape[1] = cols;
    size_t n = (size_t)rows * (size_t)cols;
    at->t.nbytes = n * lk_dtype_size(dt);
    at->t.data = malloc(at->t.nbytes ? at->t.nbytes : 1);
    float *tmp = malloc((n ? n : 1) * sizeof(float));
    for (size_t i = 0; i < n; i++) tmp[i] = tu_uniform(rng, lo, hi);
    lk_from_f32(at->t.data, tmp, dt, n);
    free(tmp);
}

void ar_tensor_scalar(ar_tensor *at, const char *name, lk_dtype dt, double v) {
    memset(at, 0, sizeof *at);
    snprintf(at->name, sizeof at->name, "%s", name);
    at->t.name = at->name;
    at->t.dtype = dt;
    at->t.ndim = 0;
    at->t.nbytes = lk_dtype_size(dt);
    at->t.data = malloc(8);
    if (dt == LK_DTYPE_F64) {
        memcpy(at->t.data, &v, 8);
    } else {
        float f = (float)v;
        lk_from_f32(at->t.data, &f, dt, 1);
    }
}

void ar_tensor_free(ar_tensor *at) {
    free(at->t.data);
    at->t.data = NULL;
}

double ar_get(const lk_tensor *t, size_t i) {
    if (t->dtype == LK_DTYPE_F64) { /* float64 expectations (fixture files) */
        double v;
        memcpy(&v, (const char *)t->data + 8 * i, 8);
        return v;
    }
    float f;
    lk_to_f32(&f, (const char *)t->data + i * lk_dtype_size(t->dtype), t->dtype, 1);
    return f;
}

double ar_ulp(lk_dtype dt, double v) {
    int mant = dt == LK_DTYPE_F32 ? 23 : dt == LK_DTYPE_BF16 ? 7 : 10;
    int emin = dt == LK_DTYPE_F16 ? -14 : -126;
    v = fabs(v);
    int e = v > 0 ? ilogb(v) : emin; /* exact, unlike floor(log2(v)) just below a power of two */
    if (e < emin) e = emin;
    return ldexp(1.0, e - mant);
}

size_t ar_check_fused(const void *fused, const void *w, lk_dtype dt, int64_t out, int64_t in,
                      const ar_term *terms, size_t n_terms) {
    size_t bad = 0, R = 0;
    for (size_t t = 0; t < n_terms; t++) R += (size_t)terms[t].A->shape[0];
    lk_tensor W = {.dtype = dt, .ndim = 2, .shape = {out, in}, .data = (void *)w};
    lk_tensor F = W;
    F.data = (void *)fused;
    for (int64_t o = 0; o < out; o++)
        for (int64_t j = 0; j < in; j++) {
            size_t idx = (size_t)o * (size_t)in + (size_t)j;
            double ref = ar_get(&W, idx), mag = 0;
            for (size_t t = 0; t < n_terms; t++) {
                int64_t r = terms[t].A->shape[0];
                for (int64_t k = 0; k < r; k++) {
                    double p = terms[t].scale * ar_get(terms[t].B, (size_t)(o * r + k)) *
                               ar_get(terms[t].A, (size_t)(k * in + j));
                    ref += p;
                    mag += fabs(p);
                }
            }
            double got = ar_get(&F, idx);
            /* F16/BF16: strictly 1 ulp. F32: 1 ulp plus the rounding error
             * of double sums of 2R products, this reference's and the
             * kernel's f64 chain alike: (2R + 2) * 2^-53 * sum |terms|. */
            double tol = ar_ulp(dt, ref) + (dt == LK_DTYPE_F32 ? (double)(2 * R + 2) * ldexp(mag, -53) : 0.0);
            int ok = (isnan(ref) && isnan(got)) || (isinf(ref) && got == ref) || fabs(got - ref) <= tol;
            if (!ok && bad++ < 5)
                fprintf(stderr, "element [%lld, %lld] (%s): got %.9g, reference %.9g, tolerance %.3g\n",
                        (long long)o, (long long)j, lk_dtype_name(dt), got, ref, tol);
        }
    return bad;
}

af_file *af_new(void) { return calloc(1, sizeof(af_file)); }

void af_free(af_file *f) {
    if (!f) return;
    for (size_t i = 0; i < f->n; i++) ar_tensor_free(&f->own[i]);
    free(f);
}

static lk_tensor *af_push(af_file *f) {
    assert_true(f->n < AF_MAX);
    size_t i = f->n++;
    f->t[i] = f->own[i].t;
    f->t[i].name = f->own[i].name;
    return &f->t[i];
}

lk_tensor *af_rand(af_file *f, const char *name, lk_dtype dt, int64_t rows, int64_t cols, tu_rng *rng,
                   float lo, float hi) {
    ar_tensor_rand(&f->own[f->n], name, dt, rows, cols, rng, lo, hi);
    return af_push(f);
}

lk_tensor *af_scalar(af_file *f, const char *name, lk_dtype dt, double v) {
    ar_tensor_scalar(&f->own[f->n], name, dt, v);
    return af_push(f);
}

lk_tensor *af_get(af_file *f, const char *name) {
    for (size_t i = 0; i < f->n; i++)
        if (!strcmp(f->t[i].name, name)) return &f->t[i];
    fail_msg("no tensor %s in the fixture", name);
    return NULL;
}

void af_save(const af_file *f, const char *path, const char *const *meta_kv, size_t n_meta) {
    lk_status s = lk_st_save(path, f->t, f->n, meta_kv, n_meta);
    if (s) fail_msg("lk_st_save %s: %s", path, lk_last_error());
}

void af_write_text(const char *dir, const char *name, const char *text) {
    char *p = tu_path(dir, name);
    assert_int_equal(tu_write_file(p, text, strlen(text)), 0);
    free(p);
}

char *ar_dir;

int ar_setup_dir(void **state) {
    (void)state;
    ar_dir = tu_mkdtemp();
    return ar_dir ? 0 : -1;
}

int ar_teardown_dir(void **state) {
    (void)state;
    tu_rmtree(ar_dir);
    free(ar_dir);
    ar_dir = NULL;
    return 0;
}

static double fp8_ulp(double q) { /* e4m3fn: 3 mantissa bits, normal exponents from -6 */
    int e = q == 0 ? -6 : ilogb(q);
    if (e < -6) e = -6;
    return ldexp(1.0, e - 3);
}

/* "<m>.weight_scale" for "<m>.weight" (name must end in "weight"). */
static void scale_name(char *dst, size_t n, const char *weight) {
    snprintf(dst, n, "%.*sweight_scale", (int)(strlen(weight) - strlen("weight")), weight);
}

/* FP8 tensor o of the output file st against float64 expectation e. */
static double check_fp8(const char *label, const char *who, const lk_st *st, const lk_tensor *o,
                        const lk_tensor *e) {
    char sname[512];
    scale_name(sname, sizeof sname, o->name);
    long si = lk_st_find(st, sname);
    const lk_tensor *sc = si >= 0 ? lk_st_tensor(st, (size_t)si) : NULL;
    size_t n = lk_tensor_numel(o), rows = (size_t)o->shape[0], per_row = n / rows;
    size_t nscale = sc ? lk_tensor_numel(sc) : 1;
    assert_true(nscale == 1 || nscale == rows);
    double worst = 0;
    for (size_t g = 0; g < nscale; g++) { /* per scale group: values, then the scale */
        double s = sc ? ar_get(sc, g) : 1.0, amax = 0;
        size_t j0 = nscale == 1 ? 0 : g * per_row, j1 = nscale == 1 ? n : (g + 1) * per_row;
        for (size_t j = j0; j < j1; j++) {
            unsigned code = ((const unsigned char *)o->data)[j];
            double x = ar_get(e, j), got = ref_decode(&E4M3, code) * s, u = fp8_ulp(fabs(x) / s) * s;
            if (!(fabs(got - x) <= u))
                fail_msg("%s: %s[%zu] = %.9g (FP8 code 0x%02x x scale %.9g), %s gives %.17g (off %.3g FP8 ulp)",
                         label, o->name, j, got, code, s, who, x, fabs(got - x) / u);
            if (fabs(got - x) / u > worst) worst = fabs(got - x) / u;
            if (fabs(x) > amax) amax = fabs(x);
        }
        if (sc) { /* rescaled: s = 448 / amax in float32, stored as its float32 reciprocal */
            float inv = 448.0f / (float)amax, want = 1.0f / inv;
            if (!(fabs(s - want) <= 1e-6 * want))
                fail_msg("%s: %s[%zu] = %.9g, LTX-2's formula on the expected amax %.9g gives %.9g", label, sname, g,
                         s, amax, (double)want);
        }
    }
    return worst;
}

double ar_check_expected(const char *label, const char *who, const char *base, const char *out,
                         const char *expected, size_t *changed) {
    lk_st *b, *o, *e;
    assert_int_equal(lk_st_open(base, &b), LK_OK);
    assert_int_equal(lk_st_open(out, &o), LK_OK);
    assert_int_equal(lk_st_open(expected, &e), LK_OK);
    assert_int_equal(lk_st_count(o), lk_st_count(b));
    size_t nchanged = 0;
    double worst = 0;
    for (size_t i = 0; i < lk_st_count(b); i++) {
        const lk_tensor *tb = lk_st_tensor(b, i);
        long oi = lk_st_find(o, tb->name), ei = lk_st_find(e, tb->name);
        if (oi < 0) fail_msg("%s: %s missing from the output", label, tb->name);
        const lk_tensor *to = lk_st_tensor(o, (size_t)oi);
        assert_int_equal(to->dtype, tb->dtype);
        assert_int_equal(to->nbytes, tb->nbytes);
        if (ei < 0) {
            size_t len = strlen(tb->name), sl = strlen(".weight_scale");
            if (len > sl && !strcmp(tb->name + len - sl, ".weight_scale")) { /* rescaled with its FP8 weight */
                char w[512];
                snprintf(w, sizeof w, "%.*s.weight", (int)(len - sl), tb->name);
                if (lk_st_find(e, w) >= 0) continue;
            }
            if (memcmp(to->data, tb->data, tb->nbytes))
                fail_msg("%s: %s changed, but the adapter does not touch it", label, tb->name);
            continue;
        }
        nchanged++;
        const lk_tensor *te = lk_st_tensor(e, (size_t)ei);
        size_t n = lk_tensor_numel(tb);
        assert_int_equal(lk_tensor_numel(te), n);
        if (tb->dtype == LK_DTYPE_F8_E4M3) {
            double w = check_fp8(label, who, o, to, te);
            if (w > worst) worst = w;
            continue;
        }
        for (size_t j = 0; j < n; j++) {
            double g = ar_get(to, j), x = ar_get(te, j), u = ar_ulp(tb->dtype, x);
            if (!(fabs(g - x) <= u))
                fail_msg("%s: %s[%zu] = %.9g, %s gives %.17g (off %.3g ulp)", label, tb->name, j, g, who, x,
                         fabs(g - x) / u);
            if (fabs(g - x) / u > worst) worst = fabs(g - x) / u;
        }
    }
    assert_int_equal(nchanged, lk_st_count(e)); /* every expected tensor exists in the base */
    lk_st_close(b);
    lk_st_close(o);
    lk_st_close(e);
    if (changed) *changed = nchanged;
    return worst;
}

void ar_check_in_place(const char *label, const char *base, const char *out, const lk_fuse_input *in, size_t n,
                       const lk_fuse_file_opts *opts, lk_fuse_stats *stats) {
    lk_st *fused;
    char want[LK_DIGEST_HEX], got[LK_DIGEST_HEX];
    assert_int_equal(lk_st_open(out, &fused), LK_OK);
    assert_int_equal(lk_digest_st(fused, want), LK_OK);
    lk_st_close(fused);
    lk_weights *w;
    assert_int_equal(lk_weights_load(base, &w), LK_OK);
    size_t nw = lk_weights_count(w);
    lk_tensor *views = calloc(nw, sizeof *views);
    assert_non_null(views);
    for (size_t i = 0; i < nw; i++) views[i] = *lk_weights_tensor(w, i);
    if (lk_fuse_tensors(views, nw, in, n, opts, stats)) fail_msg("%s: lk_fuse_tensors: %s", label, lk_last_error());
    assert_int_equal(lk_weights_digest(w, got), LK_OK);
    if (strcmp(got, want)) fail_msg("%s: lk_fuse_tensors gives digest %s, lk_fuse_file %s", label, got, want);
    free(views);
    lk_weights_free(w);
}
