/* test_algebra.c — the adapter algebra's failure paths and its kernels.
 *
 * - Every allocation of lk_resize / lk_merge failing in turn gives
 *   LK_ERR_NOMEM and no output file (SQLite's discipline); the walk ends
 *   when the call succeeds.
 * - Hostile shapes: a LoHa whose rank product r1 r2 exceeds the core limit
 *   is refused by name, not allocated.
 * - The Jacobi SVD against a hand-computed case: [[3, 0], [4, 5]] has
 *   singular values sqrt(45) and sqrt(5) (its Gram matrix [[25, 20], [20,
 *   25]] has eigenvalues 45 and 5), and U diag(s) W^T rebuilds it.
 * - QR: R^T R = U^T U for a random tall panel (f64, to 1e-13). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "testutil.h"
#include "algebra/linalg.h"
#include "core/alloc.h"
#include "lorakit/lorakit.h"

#define FX LK_TEST_SRC_DIR "/tests/fixtures/lycoris/"

static void test_alloc_walk(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    char *out = tu_path(dir, "o.safetensors");
    lk_algebra_opts o = {.rank = 2, .threads = 2};
    for (int merge = 0; merge < 2; merge++) {
        int ok = 0;
        for (unsigned long k = 1; k < 5000 && !ok; k++) {
            char *rep = NULL;
            lk_algebra_input in[2] = {{FX "loha.safetensors", 0.5}, {FX "lokr.safetensors", 1.0}};
            lk_alloc_fail_at(k);
            lk_status s = merge ? lk_merge(in, 2, out, &o, &rep) : lk_resize(FX "locon_tucker.safetensors", out, &o, &rep);
            lk_alloc_fail_at(0);
            if (s == LK_OK) {
                ok = 1;
                assert_non_null(rep);
                assert_non_null(strstr(rep, "\"rel_fro\""));
            } else {
                if (s != LK_ERR_NOMEM) fail_msg("allocation %lu: %s: %s", k, lk_status_str(s), lk_last_error());
                assert_false(tu_exists(out));
                assert_null(rep);
            }
            lk_free(rep);
            if (ok) remove(out);
        }
        assert_true(ok);
    }
    free(out);
    tu_rmtree(dir);
    free(dir);
}

/* A LoHa of rank 200 x 200 on an 8 x 8 delta: refused before the 40000^2 core. */
static void test_rank_product_refused(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    char *in = tu_path(dir, "big.safetensors"), *out = tu_path(dir, "o.safetensors");
    float *z = calloc(8 * 200, sizeof *z);
    lk_tensor t[4];
    static const char *const names[4] = {"lora_unet_x.hada_w1_a", "lora_unet_x.hada_w1_b", "lora_unet_x.hada_w2_a",
                                         "lora_unet_x.hada_w2_b"};
    for (int i = 0; i < 4; i++) {
        memset(&t[i], 0, sizeof t[i]);
        t[i].name = names[i];
        t[i].dtype = LK_DTYPE_F32;
        t[i].ndim = 2;
        t[i].shape[0] = i % 2 ? 200 : 8;
        t[i].shape[1] = i % 2 ? 8 : 200;
        t[i].nbytes = 8 * 200 * 4;
        t[i].data = z;
    }
    assert_int_equal(lk_st_save(in, t, 4, NULL, 0), LK_OK);
    lk_algebra_opts o = {.rank = 2};
    assert_int_equal(lk_resize(in, out, &o, NULL), LK_ERR_UNSUPPORTED);
    assert_non_null(strstr(lk_last_error(), "lora_unet_x"));
    assert_non_null(strstr(lk_last_error(), "40000"));
    assert_false(tu_exists(out));
    free(z);
    free(in);
    free(out);
    tu_rmtree(dir);
    free(dir);
}

static void test_jacobi_2x2(void **state) {
    (void)state;
    /* panel (column-major) of [[3, 0], [4, 5]] */
    const double c[4] = {3, 4, 0, 5};
    double s[2], x[4], w[4], work[2 * 4 + 2];
    lk_la_svd(c, 2, s, x, w, work);
    assert_true(fabs(s[0] - sqrt(45.0)) < 1e-14);
    assert_true(fabs(s[1] - sqrt(5.0)) < 1e-14);
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++) {
            double v = x[0 * 2 + i] * s[0] * w[0 * 2 + j] + x[1 * 2 + i] * s[1] * w[1 * 2 + j];
            assert_true(fabs(v - c[j * 2 + i]) < 1e-14);
        }
}

static void test_qr_gram(void **state) {
    (void)state;
    const size_t m = 37, k = 9;
    double a[37 * 9], u[37 * 9], tau[9], r[9 * 9];
    tu_rng g = {42};
    for (size_t i = 0; i < m * k; i++) a[i] = u[i] = tu_uniform(&g, -1, 1);
    lk_la_qr(a, m, k, tau);
    lk_la_qr_r(a, m, k, r);
    for (size_t i = 0; i < k; i++)
        for (size_t j = 0; j < k; j++) {
            double rr = 0, uu = 0;
            for (size_t q = 0; q < k; q++) rr += r[q * k + i] * r[q * k + j];
            for (size_t q = 0; q < m; q++) uu += u[i * m + q] * u[j * m + q];
            assert_true(fabs(rr - uu) < 1e-13 * (1 + fabs(uu)));
        }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_alloc_walk),
        cmocka_unit_test(test_rank_product_refused),
        cmocka_unit_test(test_jacobi_2x2),
        cmocka_unit_test(test_qr_gram),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
