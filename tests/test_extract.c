/* test_extract.c — lk_extract on hand-checkable pairs (F32, integer-valued,
 * so every difference is exact):
 *
 * - D = a b^T with a = (1, 2, 2), b = (2, 1, 2): ||D||_F = |a| |b| = 9, the one
 *   singular value 9, u = a / 3, v = b / 3; at rank 1 (alpha 1, so c = 1)
 *   the factors are sqrt(9) u = (1, 2, 2) and sqrt(9) v = (2, 1, 2) with the
 *   canonical sign (B's largest entry positive): the bytes are checked.
 * - An exactly rank-2 integer D of 40 x 30 (randomized path: sketch 10 of
 *   30 columns) is recovered to the F32 floor; its norm is the direct sum.
 * - --threads 1 and 2 write the same bytes; --include / --exclude choose
 *   by regex and list what they left out; an unchanged weight, a bias and
 *   names in one file only are listed, not dropped.
 * - Every CPU path of the products (LORAKIT_KERNEL=portable|avx2|avx512,
 *   where the CPU has it) writes the bytes of the portable path (the
 *   oracle: plain C with 16-byte vectors), on a BF16 pair of 300 x 1030
 *   (two row chunks, a remainder row, three column blocks, a j remainder)
 *   at rank 21 (29 sketch columns: padded panels), with power 0, 1, 2.
 * - A shape mismatch is refused naming the key and both shapes, with no
 *   output; every allocation failing in turn gives LK_ERR_NOMEM and no
 *   output file. */
#include <jansson.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "testutil.h"
#include "core/alloc.h"
#include "fuse/fuse.h"
#include "lorakit/lorakit.h"

typedef struct pair {
    char *dir, *base, *tuned, *out;
} pair;

static lk_tensor f32t(const char *name, float *v, int nd, int64_t a, int64_t b) {
    lk_tensor t;
    memset(&t, 0, sizeof t);
    t.name = name, t.dtype = LK_DTYPE_F32, t.ndim = nd, t.shape[0] = a, t.shape[1] = b;
    t.nbytes = (uint64_t)(a * (nd > 1 ? b : 1)) * 4, t.data = v;
    return t;
}

/* base / tuned: "x.small.weight" 3 x 3 (D = a b^T), "x.big.weight" 40 x 30 (D rank 2),
 * "x.attn.to_k.weight" 8 x 6 (D random integers), "x.same.weight" (unchanged),
 * "x.small.bias" (changed), "only_base.weight" / "only_tuned.weight". */
static void make_pair(pair *p, int bad_shape) {
    static float b1[9], t1[9], b2[1200], t2[1200], b3[48], t3[48], s[4] = {1, 2, 3, 4}, bb[3] = {1, 1, 1}, tb[3] = {2, 1, 1};
    const float a[3] = {1, 2, 2}, bv[3] = {2, 1, 2};
    tu_rng g = {7};
    for (int i = 0; i < 9; i++) b1[i] = (float)(i % 5) - 2, t1[i] = b1[i] + a[i / 3] * bv[i % 3];
    float u[2][40], v[2][30];
    for (int k = 0; k < 2; k++) {
        for (int i = 0; i < 40; i++) u[k][i] = floorf(tu_uniform(&g, -4, 5));
        for (int j = 0; j < 30; j++) v[k][j] = floorf(tu_uniform(&g, -4, 5));
    }
    for (int i = 0; i < 40; i++)
        for (int j = 0; j < 30; j++)
            b2[i * 30 + j] = floorf(tu_uniform(&g, -8, 8)), t2[i * 30 + j] = b2[i * 30 + j] + u[0][i] * v[0][j] + u[1][i] * v[1][j];
    for (int i = 0; i < 48; i++) b3[i] = floorf(tu_uniform(&g, -8, 8)), t3[i] = b3[i] + floorf(tu_uniform(&g, -3, 4));
    lk_tensor tb_[6] = {f32t("x.small.weight", b1, 2, 3, 3), f32t("x.big.weight", b2, 2, 40, 30),
                        f32t("x.attn.to_k.weight", b3, 2, 8, 6), f32t("x.same.weight", s, 2, 2, 2),
                        f32t("x.small.bias", bb, 1, 3, 0), f32t("only_base.weight", s, 2, 2, 2)};
    lk_tensor tt_[6] = {f32t("x.small.weight", t1, 2, 3, 3), f32t("x.big.weight", t2, 2, 40, 30),
                        bad_shape ? f32t("x.attn.to_k.weight", t3, 2, 6, 8) : f32t("x.attn.to_k.weight", t3, 2, 8, 6),
                        f32t("x.same.weight", s, 2, 2, 2), f32t("x.small.bias", tb, 1, 3, 0),
                        f32t("only_tuned.weight", s, 2, 2, 2)};
    p->dir = tu_mkdtemp();
    p->base = tu_path(p->dir, "base.safetensors");
    p->tuned = tu_path(p->dir, "tuned.safetensors");
    p->out = tu_path(p->dir, "out.safetensors");
    assert_int_equal(lk_st_save(p->base, tb_, 6, NULL, 0), LK_OK);
    assert_int_equal(lk_st_save(p->tuned, tt_, 6, NULL, 0), LK_OK);
}

static void pair_free(pair *p) {
    tu_rmtree(p->dir);
    free(p->dir), free(p->base), free(p->tuned), free(p->out);
}

static json_t *module(json_t *rep, const char *name) {
    json_t *m;
    size_t i;
    json_array_foreach(json_object_get(rep, "modules"), i, m) if (!strcmp(json_string_value(json_object_get(m, "name")), name)) return m;
    fail_msg("module %s not in the report", name);
    return NULL;
}

static double num(json_t *m, const char *k) { return json_real_value(json_object_get(m, k)); }

static void test_hand_cases(void **state) {
    (void)state;
    pair p;
    make_pair(&p, 0);
    lk_extract_opts o = {.alg = {.rank = 2, .dtype = LK_DTYPE_F32, .threads = 1}, .power = -1};
    char *rep = NULL;
    assert_int_equal(lk_extract(p.base, p.tuned, p.out, &o, &rep), LK_OK);
    json_t *j = json_loads(rep, 0, NULL);
    assert_non_null(j);
    /* 3 x 3 a b^T: norm 9, rank 1 kept (the one non-zero singular value) and exact */
    json_t *sm = module(j, "x.small");
    assert_true(fabs(num(sm, "norm") - 9.0) < 1e-12);
    assert_int_equal(json_integer_value(json_object_get(sm, "rank")), 1);
    assert_true(num(sm, "rel_fro") < 1e-7);
    /* 40 x 30 exactly rank 2: recovered to the F32 floor; its norm is the direct sum over D */
    json_t *big = module(j, "x.big");
    assert_int_equal(json_integer_value(json_object_get(big, "rank")), 2);
    assert_true(num(big, "rel_fro") < 1e-6);
    assert_true(num(big, "rel_fro_opt") <= 1e-7);
    json_t *lists = json_pack("[s]", "x.same.weight");
    assert_true(json_equal(json_object_get(j, "unchanged"), lists));
    json_decref(lists);
    assert_string_equal(json_string_value(json_object_get(json_array_get(json_object_get(j, "not_extracted"), 0), "name")),
                        "x.small.bias");
    assert_string_equal(json_string_value(json_array_get(json_object_get(j, "only_in_base"), 0)), "only_base.weight");
    assert_string_equal(json_string_value(json_array_get(json_object_get(j, "only_in_tuned"), 0)), "only_tuned.weight");
    json_decref(j);
    lk_free(rep);
    /* rank 1 of the small one: B = (1, 2, 2), A = (2, 1, 2) (alpha 1) */
    o.alg.rank = 1;
    const char *inc[1] = {"small"};
    o.include = inc, o.n_include = 1;
    assert_int_equal(lk_extract(p.base, p.tuned, p.out, &o, NULL), LK_OK);
    lk_st *st;
    assert_int_equal(lk_st_open(p.out, &st), LK_OK);
    long A = lk_st_find(st, "x.small.lora_A.weight"), B = lk_st_find(st, "x.small.lora_B.weight");
    assert_true(A >= 0 && B >= 0);
    float av[3], bv[3];
    assert_int_equal(lk_st_read(st, (size_t)A, 0, av, 12), LK_OK);
    assert_int_equal(lk_st_read(st, (size_t)B, 0, bv, 12), LK_OK);
    const float wa[3] = {2, 1, 2}, wb[3] = {1, 2, 2};
    for (int i = 0; i < 3; i++) {
        assert_true(fabsf(av[i] - wa[i]) <= 4e-7f * 2);
        assert_true(fabsf(bv[i] - wb[i]) <= 4e-7f * 2);
    }
    lk_st_close(st);
    pair_free(&p);
}

static void test_threads_and_filters(void **state) {
    (void)state;
    pair p;
    make_pair(&p, 0);
    char *o2 = tu_path(p.dir, "o2.safetensors");
    const char *exc[1] = {"to_k\\.weight$|small"};
    lk_extract_opts o = {.alg = {.rank = 1, .threads = 1}, .power = 1, .exclude = exc, .n_exclude = 1};
    char *rep = NULL;
    assert_int_equal(lk_extract(p.base, p.tuned, p.out, &o, &rep), LK_OK);
    o.alg.threads = 2;
    assert_int_equal(lk_extract(p.base, p.tuned, o2, &o, NULL), LK_OK);
    size_t n1, n2;
    char *f1 = tu_read_file(p.out, &n1), *f2 = tu_read_file(o2, &n2);
    assert_true(n1 == n2 && !memcmp(f1, f2, n1));
    free(f1), free(f2);
    json_t *j = json_loads(rep, 0, NULL);
    assert_int_equal(json_array_size(json_object_get(j, "modules")), 1); /* x.big only */
    json_t *want = json_pack("[s, s, s]", "x.attn.to_k.weight", "x.small.bias", "x.small.weight");
    assert_true(json_equal(json_object_get(j, "excluded"), want));
    json_decref(want);
    json_decref(j);
    lk_free(rep);
    free(o2);
    pair_free(&p);
}

static void test_kernel_paths(void **state) {
    (void)state;
    enum { M = 300, N = 1030 };
    static uint16_t hb[M * N], ht[M * N];
    tu_rng g = {11};
    for (size_t i = 0; i < (size_t)M * N; i++) {
        float b = tu_uniform(&g, -0.05f, 0.05f), d = 0.01f * sinf((float)(i % N) * 0.37f + (float)(i / N) * 0.11f);
        hb[i] = lk_f32_to_bf16(b), ht[i] = lk_f32_to_bf16(b + d + tu_uniform(&g, -1e-3f, 1e-3f));
    }
    lk_tensor t[2];
    memset(t, 0, sizeof t);
    for (int k = 0; k < 2; k++)
        t[k].name = "w.weight", t[k].dtype = LK_DTYPE_BF16, t[k].ndim = 2, t[k].shape[0] = M, t[k].shape[1] = N,
        t[k].nbytes = (uint64_t)M * N * 2, t[k].data = k ? ht : hb;
    char *dir = tu_mkdtemp(), *pb = tu_path(dir, "b.safetensors"), *pt = tu_path(dir, "t.safetensors");
    char *po = tu_path(dir, "o.safetensors");
    assert_int_equal(lk_st_save(pb, &t[0], 1, NULL, 0), LK_OK);
    assert_int_equal(lk_st_save(pt, &t[1], 1, NULL, 0), LK_OK);
    static const char *const paths[3] = {"portable", "avx2", "avx512"};
    for (int power = 0; power <= 2; power++) {
        char *ref = NULL;
        size_t nref = 0;
        for (int q = 0; q < 3; q++) {
            if (!lk_fuse_kernel_supported(paths[q])) continue;
            setenv("LORAKIT_KERNEL", paths[q], 1);
            lk_extract_opts o = {.alg = {.rank = 21, .threads = 1}, .power = power};
            assert_int_equal(lk_extract(pb, pt, po, &o, NULL), LK_OK);
            unsetenv("LORAKIT_KERNEL");
            size_t n;
            char *f = tu_read_file(po, &n);
            if (!ref) ref = f, nref = n;
            else {
                if (n != nref || memcmp(f, ref, n)) fail_msg("power %d: %s differs from the portable path", power, paths[q]);
                free(f);
            }
        }
        free(ref);
    }
    tu_rmtree(dir);
    free(dir), free(pb), free(pt), free(po);
}

static void test_mismatch_refused(void **state) {
    (void)state;
    pair p;
    make_pair(&p, 1);
    lk_extract_opts o = {.alg = {.rank = 2}, .power = -1};
    char *rep = NULL;
    assert_int_equal(lk_extract(p.base, p.tuned, p.out, &o, &rep), LK_ERR_SHAPE);
    const char *e = lk_last_error();
    assert_non_null(strstr(e, "x.attn.to_k.weight"));
    assert_non_null(strstr(e, "F32 [8, 6]"));
    assert_non_null(strstr(e, "F32 [6, 8]"));
    assert_null(rep);
    assert_false(tu_exists(p.out));
    pair_free(&p);
}

static void test_alloc_walk(void **state) {
    (void)state;
    pair p;
    make_pair(&p, 0);
    lk_extract_opts o = {.alg = {.err = 0.1, .threads = 2}, .power = 1};
    int ok = 0;
    for (unsigned long k = 1; k < 5000 && !ok; k++) {
        char *rep = NULL;
        lk_alloc_fail_at(k);
        lk_status s = lk_extract(p.base, p.tuned, p.out, &o, &rep);
        lk_alloc_fail_at(0);
        if (s == LK_OK) {
            ok = 1;
            assert_non_null(strstr(rep, "\"rel_fro\""));
        } else {
            if (s != LK_ERR_NOMEM) fail_msg("allocation %lu: %s: %s", k, lk_status_str(s), lk_last_error());
            assert_false(tu_exists(p.out));
            assert_null(rep);
        }
        lk_free(rep);
    }
    assert_true(ok);
    pair_free(&p);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hand_cases),
        cmocka_unit_test(test_threads_and_filters),
        cmocka_unit_test(test_kernel_paths),
        cmocka_unit_test(test_mismatch_refused),
        cmocka_unit_test(test_alloc_walk),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
