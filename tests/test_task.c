/* test_task.c — the generated digit tasks (lorakit/task.h).
 *
 * Expectations: each task's answer is recomputed here from the prompt digits
 * by its definition (reverse order, counting sort, +1 mod 10); the batch
 * layout and masks are checked against the example tokens; determinism and
 * split-invariance (what data-parallel training relies on) by comparing
 * batches drawn whole and in pieces; evaluation against a model whose output
 * is known (a model trained nowhere scores ~0 on sort; an "oracle" is not
 * possible without training, so exactness is checked via answers[]). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"
#include "app/task.h"

static void test_names(void **state) {
    (void)state;
    lk_task_kind k;
    assert_int_equal(lk_task_from_name("sort", &k), LK_OK);
    assert_int_equal(k, LK_TASK_SORT);
    assert_int_equal(lk_task_from_name("increment", &k), LK_OK);
    assert_int_equal(k, LK_TASK_INCREMENT);
    assert_string_equal(lk_task_name(LK_TASK_REVERSE), "reverse");
    assert_int_equal(lk_task_from_name("Sort", &k), LK_ERR_CONFIG);
    tu_assert_contains(lk_last_error(), "unknown task \"Sort\" (valid: copy, reverse, sort, increment)");
}

static void test_answers_follow_definitions(void **state) {
    (void)state;
    int n = 6;
    int tok[13];
    int seen_digit[10] = {0};
    for (uint64_t i = 0; i < 500; i++) {
        for (int k = 0; k < LK_TASK_COUNT; k++) {
            lk_task_example((lk_task_kind)k, n, 123, i, tok);
            assert_int_equal(tok[n], LK_TASK_SEP);
            int want[6];
            for (int j = 0; j < n; j++) {
                assert_in_range(tok[j], 0, 9);
                seen_digit[tok[j]]++;
            }
            switch (k) {
            case LK_TASK_COPY: memcpy(want, tok, sizeof want); break;
            case LK_TASK_REVERSE:
                for (int j = 0; j < n; j++) want[j] = tok[n - 1 - j];
                break;
            case LK_TASK_SORT: /* insertion sort of the prompt */
                memcpy(want, tok, sizeof want);
                for (int a = 1; a < n; a++)
                    for (int b = a; b > 0 && want[b - 1] > want[b]; b--) {
                        int t = want[b];
                        want[b] = want[b - 1];
                        want[b - 1] = t;
                    }
                break;
            default:
                for (int j = 0; j < n; j++) want[j] = tok[j] == 9 ? 0 : tok[j] + 1;
            }
            assert_memory_equal(tok + n + 1, want, sizeof want);
        }
    }
    /* digits roughly uniform: 12000 draws, 1200 expected each */
    for (int d = 0; d < 10; d++) assert_in_range(seen_digit[d], 1000, 1400);
    /* the prompt depends on (seed, index) only, not on the task */
    int a[13], b[13];
    lk_task_example(LK_TASK_COPY, n, 5, 77, a);
    lk_task_example(LK_TASK_SORT, n, 5, 77, b);
    assert_memory_equal(a, b, 6 * sizeof(int));
    lk_task_example(LK_TASK_COPY, n, 6, 77, b);
    assert_true(memcmp(a, b, 6 * sizeof(int)) != 0);
}

static void test_format(void **state) {
    (void)state;
    int t[11] = {3, 1, 4, 1, 5, 10, 5, 1, 4, 1, 3};
    char buf[64];
    lk_task_format(t, 11, buf, sizeof buf);
    assert_string_equal(buf, "3 1 4 1 5 | 5 1 4 1 3");
    lk_task_format(t, 11, buf, 6); /* truncated, still terminated */
    assert_string_equal(buf, "3 1");
}

static void test_batch_layout_and_split(void **state) {
    (void)state;
    int n = 5, T = lk_task_train_len(n), B = 8;
    assert_int_equal(T, 10);
    int in[80], tg[80], in2[80], tg2[80], tok[11];
    assert_int_equal(lk_task_batch(LK_TASK_REVERSE, n, 9, 100, B, in, tg), LK_OK);
    for (int b = 0; b < B; b++) {
        lk_task_example(LK_TASK_REVERSE, n, 9, 100 + (uint64_t)b, tok);
        for (int t = 0; t < T; t++) {
            assert_int_equal(in[b * T + t], tok[t]);
            /* positions 0..n-1 (predicting prompt digits / the separator): ignored */
            assert_int_equal(tg[b * T + t], t < n ? -1 : tok[t + 1]);
        }
    }
    /* a batch split over 2 or 4 "ranks" is the same rows */
    for (int ranks = 2; ranks <= 4; ranks *= 2) {
        int per = B / ranks;
        for (int r = 0; r < ranks; r++)
            assert_int_equal(lk_task_batch(LK_TASK_REVERSE, n, 9, 100 + (uint64_t)(r * per), per,
                                           in2 + r * per * T, tg2 + r * per * T), LK_OK);
        assert_memory_equal(in, in2, sizeof in);
        assert_memory_equal(tg, tg2, sizeof tg);
    }
    assert_int_equal(lk_task_batch(LK_TASK_COPY, 0, 1, 0, 1, in, tg), LK_ERR_ARG);
    assert_int_equal(lk_task_batch(LK_TASK_COPY, LK_TASK_MAX_DIGITS + 1, 1, 0, 1, in, tg),
                     LK_ERR_ARG);
}

static void test_evaluate_scores_exact_matches(void **state) {
    (void)state;
    int n = 4;
    lk_model_config c = {.vocab = LK_TASK_VOCAB, .max_seq = lk_task_train_len(n), .d_model = 8,
                         .n_layers = 1, .n_heads = 2, .d_ff = 0};
    lk_model *m;
    assert_int_equal(lk_model_create(&c, 3, &m), LK_OK);
    /* bias the head towards always answering "7": every answer is 7 7 7 7 */
    long hi = lk_model_find_param(m, "lm_head.weight");
    float *W = lk_model_params(m) + lk_model_param_at(m, (size_t)hi)->offset;
    long bi = lk_model_find_param(m, "norm_out.bias");
    float *nb = lk_model_params(m) + lk_model_param_at(m, (size_t)bi)->offset;
    for (int i = 0; i < 8; i++) {
        nb[i] = 10.0f;      /* the final norm's output is ~10 in every channel */
        W[7 * 8 + i] = 1.0f; /* so token 7 wins by a wide margin */
    }
    int count = 300;
    int *ans = malloc(sizeof(int) * count * n);
    lk_task_eval ev;
    assert_int_equal(lk_task_evaluate(m, LK_TASK_COPY, n, 4, 0, count, 64, &ev, ans), LK_OK);
    int expect = 0, tok[9];
    for (int i = 0; i < count; i++) {
        for (int j = 0; j < n; j++) assert_int_equal(ans[i * n + j], 7);
        lk_task_example(LK_TASK_COPY, n, 4, (uint64_t)i, tok);
        expect += tok[0] == 7 && tok[1] == 7 && tok[2] == 7 && tok[3] == 7;
    }
    assert_int_equal(ev.total, count);
    assert_int_equal(ev.correct, expect);
    assert_true(ev.accuracy == (double)expect / count);
    free(ans);
    lk_model_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_names),
        cmocka_unit_test(test_answers_follow_definitions),
        cmocka_unit_test(test_format),
        cmocka_unit_test(test_batch_layout_and_split),
        cmocka_unit_test(test_evaluate_scores_exact_matches),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
