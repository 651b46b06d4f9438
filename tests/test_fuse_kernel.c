/* test_fuse_kernel.c — lk_fuse_tensor against an independent double
 * reference (tests/util/adapter_ref.c: plain double loops over the stored
 * values; 1 ulp for F16/BF16 weights, 1 ulp + the fp32 summation bound for
 * F32 weights), plus byte-level invariants:
 * the same bytes for any thread count, in place or not; strength 0 leaves
 * bytes untouched; non-finite results and bad arguments are errors. */
#include "adapter_ref.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static const lk_dtype DTS[3] = {LK_DTYPE_F32, LK_DTYPE_F16, LK_DTYPE_BF16};

static void *dup_bytes(const lk_tensor *t) {
    void *p = malloc(t->nbytes);
    memcpy(p, t->data, t->nbytes);
    return p;
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
                terms[t] = (lk_fuse_term){&A[t].t, &B[t].t, scales[t]};
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

/* Thread counts 1, 2, 3, 5, 8, 0 (all) give identical bytes; big enough for
 * many row chunks and several column tiles (R = 130 -> narrow tiles). */
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
    lk_fuse_term terms[2] = {{&A1.t, &B1.t, 1.5f}, {&A2.t, &B2.t, -0.5f}};
    void *first = malloc(W.t.nbytes), *res = malloc(W.t.nbytes);
    const int th[6] = {1, 2, 3, 5, 8, 0};
    for (int i = 0; i < 6; i++) {
        lk_fuse_opts o = {.threads = th[i]};
        assert_int_equal(lk_fuse_tensor(i ? res : first, W.t.data, LK_DTYPE_BF16, out, in, terms, 2, &o, "w"),
                         LK_OK);
        if (i) assert_memory_equal(res, first, W.t.nbytes);
    }
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

/* The documented arithmetic, emulated element by element in fp32: with
 * Bs_t = (float)(scale_t * B_t) and the terms' ranks concatenated in order,
 * s = Bs[o,0]*A[0,j], then s = s + Bs[o,k]*A[k,j] for k = 1.., then
 * round(float(W) + s) once into W's dtype. The kernel must give exactly
 * these bits (whatever its blocking or vector width) for every dtype, on
 * shapes with row and column tails. */
static void test_bit_exact_order(void **state) {
    (void)state;
    tu_rng rng = {5};
    const int64_t out = 23, in = 100; /* 23 = 5 x 4 + 3 rows, 100 = 3 x 32 + 4 columns */
    for (int d = 0; d < 3; d++) {
        ar_tensor W, A[2], B[2];
        ar_tensor_rand(&W, "w", DTS[d], out, in, &rng, -1, 1);
        const int rk[2] = {5, 3};
        const float sc[2] = {0.3f, -1.7f};
        lk_fuse_term terms[2];
        for (int t = 0; t < 2; t++) {
            ar_tensor_rand(&A[t], "A", DTS[(d + t) % 3], rk[t], in, &rng, -1, 1);
            ar_tensor_rand(&B[t], "B", DTS[(d + 2 * t) % 3], out, rk[t], &rng, -1, 1);
            terms[t] = (lk_fuse_term){&A[t].t, &B[t].t, sc[t]};
        }
        char *res = malloc(W.t.nbytes), *want = malloc(W.t.nbytes);
        lk_fuse_opts o = {.threads = 2};
        assert_int_equal(lk_fuse_tensor(res, W.t.data, DTS[d], out, in, terms, 2, &o, "w"), LK_OK);
        size_t esz = lk_dtype_size(DTS[d]);
        for (int64_t i = 0; i < out; i++)
            for (int64_t j = 0; j < in; j++) {
                volatile float s = 0; /* volatile: no contraction, no reassociation */
                int first = 1;
                for (int t = 0; t < 2; t++)
                    for (int k = 0; k < rk[t]; k++) {
                        volatile float bs = sc[t] * (float)ar_get(&B[t].t, (size_t)(i * rk[t] + k));
                        volatile float p = bs * (float)ar_get(&A[t].t, (size_t)(k * in + j));
                        s = first ? p : s + p;
                        first = 0;
                    }
                float r = (float)ar_get(&W.t, (size_t)(i * in + j)) + s;
                lk_from_f32(want + (size_t)(i * in + j) * esz, &r, DTS[d], 1);
            }
        assert_memory_equal(res, want, W.t.nbytes);
        free(res);
        free(want);
        ar_tensor_free(&W);
        for (int t = 0; t < 2; t++) {
            ar_tensor_free(&A[t]);
            ar_tensor_free(&B[t]);
        }
    }
}

/* Weights straight from a safetensors mmap need not be aligned to their
 * element size: an F32 weight at an address = 2 mod 4 and a BF16 one at an
 * odd address give the same bytes as aligned copies (UBSan would flag a
 * misaligned access in the sanitizer build). */
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
        lk_fuse_term t = {&A.t, &B.t, 0.5f};
        char *raw = malloc(W.t.nbytes + 8);
        memcpy(raw + shift[d], W.t.data, W.t.nbytes);
        void *ref = malloc(W.t.nbytes), *res = malloc(W.t.nbytes);
        assert_int_equal(lk_fuse_tensor(ref, W.t.data, dts[d], 9, 70, &t, 1, NULL, "w"), LK_OK);
        assert_int_equal(lk_fuse_tensor(res, raw + shift[d], dts[d], 9, 70, &t, 1, NULL, "w"), LK_OK);
        assert_memory_equal(res, ref, W.t.nbytes);
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
    lk_fuse_term t = {&A.t, &B.t, 0.0f};
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
    lk_fuse_term t = {&A, &B, 0.5f};
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
    lk_fuse_term t = {&A, &B, 1.0f};
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

/* The same through the BF16 register-block path: a non-finite result inside
 * a full 4 x 32 block sends that block down the checked path, which names
 * the first element; with allow_nonfinite the block is written like any
 * other (Inf there, every other element as the emulated fp32 sum). */
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
    lk_fuse_term t = {&A, &B, 1.0f};
    uint16_t res[9 * 70];
    assert_int_equal(lk_fuse_tensor(res, W.t.data, LK_DTYPE_BF16, out, in, &t, 1, NULL, "blk"), LK_ERR_NONFINITE);
    tu_assert_contains(lk_last_error(), "blk: fusion made element [5, 40] non-finite");
    lk_fuse_opts o = {.allow_nonfinite = 1};
    assert_int_equal(lk_fuse_tensor(res, W.t.data, LK_DTYPE_BF16, out, in, &t, 1, &o, "blk"), LK_OK);
    for (int i = 0; i < out; i++)
        for (int j = 0; j < in; j++) {
            float r = lk_bf16_to_f32(((uint16_t *)W.t.data)[i * in + j]) + b[i] * a[j];
            assert_int_equal(res[i * in + j], lk_f32_to_bf16(r));
        }
    assert_int_equal(res[5 * in + 40], 0x7f80);
    ar_tensor_free(&W);
}

static void test_errors(void **state) {
    (void)state;
    float w[6] = {0}, res[6], a[6] = {0}, b[6] = {0};
    int8_t i8[6] = {0};
    lk_tensor A = {.dtype = LK_DTYPE_F32, .ndim = 2, .shape = {2, 3}, .nbytes = 24, .data = a};
    lk_tensor B = {.dtype = LK_DTYPE_F32, .ndim = 2, .shape = {2, 2}, .nbytes = 16, .data = b};
    lk_fuse_term t = {&A, &B, 1.0f};
    /* weight 2x3: A 2x3 ok, B 2x2 ok -> fine */
    assert_int_equal(lk_fuse_tensor(res, w, LK_DTYPE_F32, 2, 3, &t, 1, NULL, "x"), LK_OK);
    assert_int_equal(lk_fuse_tensor(res, w, LK_DTYPE_F32, 3, 2, &t, 1, NULL, "x"), LK_ERR_SHAPE);
    tu_assert_contains(lk_last_error(), "x: term 0: A is 2x3 and B is 2x2 but the weight is 3x2");
    assert_int_equal(lk_fuse_tensor(res, w, LK_DTYPE_I32, 2, 3, &t, 1, NULL, "x"), LK_ERR_DTYPE);
    tu_assert_contains(lk_last_error(), "x: weight dtype I32 cannot be fused");
    lk_tensor Ai = A;
    Ai.dtype = LK_DTYPE_I8;
    Ai.data = i8;
    lk_fuse_term ti = {&Ai, &B, 1.0f};
    assert_int_equal(lk_fuse_tensor(res, w, LK_DTYPE_F32, 2, 3, &ti, 1, NULL, "x"), LK_ERR_DTYPE);
    tu_assert_contains(lk_last_error(), "x: term 0: A has dtype I8");
    lk_fuse_term tn = {&A, &B, NAN};
    assert_int_equal(lk_fuse_tensor(res, w, LK_DTYPE_F32, 2, 3, &tn, 1, NULL, "x"), LK_ERR_NONFINITE);
    tu_assert_contains(lk_last_error(), "x: term 0: scale is nan");
    /* Allocation failure: clean error, output untouched. */
    memset(res, 0x55, sizeof res);
    lk_alloc_fail_at(1);
    assert_int_equal(lk_fuse_tensor(res, w, LK_DTYPE_F32, 2, 3, &t, 1, NULL, "x"), LK_ERR_NOMEM);
    lk_alloc_fail_at(0);
    for (size_t i = 0; i < sizeof res; i++) assert_int_equal(((unsigned char *)res)[i], 0x55);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_matches_reference), cmocka_unit_test(test_thread_invariance),
        cmocka_unit_test(test_zero_strength_identity), cmocka_unit_test(test_hand_computed),
        cmocka_unit_test(test_nonfinite), cmocka_unit_test(test_errors),
        cmocka_unit_test(test_misaligned_weight), cmocka_unit_test(test_bit_exact_order),
        cmocka_unit_test(test_nonfinite_bf16_block),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
