/* test_train.c — `lorakit train`'s library side: the config file and
 * lk_train_run in one process.
 *
 * Expectations: config errors are checked against the exact messages the
 * docs promise (file, line, key, valid keys); training from scratch on
 * `copy` must lower the loss from chance (ln 10 = 2.30 on the answer digits)
 * and reach a held-out accuracy that an untrained model cannot (the answers
 * are 5 random digits: chance is 1e-5); a LoRA run on a frozen base must
 * leave the base file's bytes untouched and write the PEFT files. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"
#include "app/model.h"

static char *write_cfg(const char *dir, const char *name, const char *text) {
    char *p = tu_path(dir, name);
    assert_int_equal(tu_write_file(p, text, strlen(text)), 0);
    return p;
}

/* writes the config and loads it; it must be valid */
static void load_cfg(const char *dir, const char *name, const char *text, lk_train_config *c) {
    char *p = write_cfg(dir, name, text);
    lk_status st = lk_train_config_load(p, NULL, c);
    if (st) fprintf(stderr, "%s\n", lk_last_error());
    assert_int_equal(st, LK_OK);
    free(p);
}

/* a valid config whose run must fail with `code` and a message containing `msg` */
static void expect_run_error(const char *dir, lk_comm *comm, const char *text, lk_status code,
                             const char *msg) {
    lk_train_config c;
    load_cfg(dir, "run.yaml", text, &c);
    assert_int_equal(lk_train_run(&c, comm, NULL, NULL, NULL), code);
    tu_assert_contains(lk_last_error(), msg);
    lk_train_config_clear(&c);
}

static void expect_error(const char *dir, const char *text, lk_status code, const char *msg) {
    char *p = write_cfg(dir, "bad.yaml", text);
    lk_train_config c;
    assert_int_equal(lk_train_config_load(p, NULL, &c), code);
    tu_assert_contains(lk_last_error(), msg);
    free(p);
}

static void test_config(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    lk_train_config c;
    load_cfg(dir, "ok.yaml",
             "model: {d_model: 32, n_layers: 1, n_heads: 2}\n"
             "task: sort\ndigits: 4\nsteps: 10\nglobal_batch: 8\nlr: 0.001\n"
             "schedule: constant\nseed: 9\noutput: out/x\n",
             &c);
    assert_int_equal(c.task, LK_TASK_SORT);
    assert_int_equal(c.model.d_model, 32);
    assert_int_equal(c.model.d_ff, 128);           /* 4 * d_model */
    assert_int_equal(c.model.max_seq, 8);          /* 2 * digits */
    assert_int_equal(c.model.vocab, LK_TASK_VOCAB);
    assert_int_equal(c.cosine, 0);
    assert_true(c.clip == 1.0f);                   /* default */
    assert_int_equal(c.lora.configured, 0);        /* no models block: full model */
    char want[1100];
    snprintf(want, sizeof want, "%s/out/x", dir);  /* relative to the config */
    assert_string_equal(c.output, want);
    lk_train_config_clear(&c);

    expect_error(dir, "task: copy\nsteps: 1\nglobal_batch: 1\nlr: 0.1\noutput: o\nbatch: 3\n"
                      "model: {d_model: 8}\n",
                 LK_ERR_CONFIG, "bad.yaml:6: batch: unknown key (valid: model, base, task,");
    expect_error(dir, "task: copy\nsteps: 0\n", LK_ERR_CONFIG,
                 "bad.yaml:2: steps: expected an integer in 1..100000000, got \"0\"");
    expect_error(dir, "task: rotate\n", LK_ERR_CONFIG,
                 "bad.yaml:1: task: unknown task \"rotate\" (valid: copy, reverse, sort, increment)");
    expect_error(dir, "task: copy\nsteps: 1\nglobal_batch: 1\nlr: 0.1\nmodel: {d_model: 8}\n",
                 LK_ERR_CONFIG, "bad.yaml: output is required");
    expect_error(dir, "task: copy\nsteps: 1\nglobal_batch: 1\nlr: 0.1\noutput: o\n"
                      "model: {d_model: 8, n_heads: 3}\n",
                 LK_ERR_CONFIG, "n_heads = 3 does not divide d_model = 8");
    expect_error(dir, "model: {d_model: 8, width: 2}\n", LK_ERR_CONFIG,
                 "bad.yaml:1: model.width: unknown key (valid: d_model, n_layers, n_heads, d_ff)");
    expect_error(dir, "task: [copy\n", LK_ERR_FORMAT, "bad.yaml:");
    /* LoRA enabled needs a base to train on */
    expect_error(dir,
                 "task: copy\nsteps: 1\nglobal_batch: 1\nlr: 0.1\noutput: o\nmodel: {d_model: 8}\n"
                 "models:\n  student:\n    lora: {enable: true, rank: 4}\n",
                 LK_ERR_CONFIG, "models.student.lora is enabled but no base checkpoint is given");
    /* the lora block's own rules come from the config module */
    expect_error(dir,
                 "task: copy\nsteps: 1\nglobal_batch: 1\nlr: 0.1\noutput: o\nbase: b\n"
                 "models:\n  student:\n    lora: {enable: true, rank: 0}\n",
                 LK_ERR_CONFIG, "rank");
    /* a repeated key is an error, not "last one wins" */
    expect_error(dir, "task: copy\nsteps: 1\nglobal_batch: 1\nsteps: 2\n", LK_ERR_CONFIG,
                 "bad.yaml:4: steps: duplicate key (first at line 2)");
    expect_error(dir, "model: {d_model: 8,\n  d_model: 16}\n", LK_ERR_CONFIG,
                 "bad.yaml:2: model.d_model: duplicate key (first at line 1)");
    /* a malformed models block is an error, not "LoRA not configured" */
    expect_error(dir, "task: copy\nsteps: 1\nglobal_batch: 1\nlr: 0.1\noutput: o\n"
                      "model: {d_model: 8}\nmodels: 5\n",
                 LK_ERR_CONFIG, "bad.yaml:7: models: must be a mapping of roles");
    assert_int_equal(lk_train_config_load("/nonexistent/x.yaml", NULL, &c), LK_ERR_IO);
    tu_rmtree(dir);
    free(dir);
}

static int count_steps(void *ctx, const lk_train_progress *p) {
    long *n = ctx;
    assert_int_equal(p->step, *n + 1);
    assert_true(p->tokens_per_s > 0);
    (*n)++;
    return 0;
}

static void test_full_training_lowers_loss_then_lora(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    lk_train_config c;
    load_cfg(dir, "base.yaml",
             "model: {d_model: 32, n_layers: 2, n_heads: 4}\n"
             "task: copy\ndigits: 4\nsteps: 120\nglobal_batch: 32\nlr: 0.003\n"
             "weight_decay: 1.0\nseed: 1\neval_examples: 200\noutput: base\n",
             &c);
    lk_comm *self;
    assert_int_equal(lk_comm_self(&self), LK_OK);
    lk_train_result r;
    long seen = 0;
    assert_int_equal(lk_train_run(&c, self, count_steps, &seen, &r), LK_OK);
    fprintf(stderr, "full model: loss %.3f -> %.3f, copy accuracy %.3f, %.2fs\n", r.first_loss,
            r.final_loss, r.accuracy, r.seconds);
    assert_int_equal(seen, 120);
    assert_int_equal(r.lora_layers, 0);
    assert_true(r.first_loss > 2.0f);
    assert_true(r.final_loss < 0.3f * r.first_loss);
    assert_true(r.accuracy > 0.5);
    assert_true(r.replicas_agree);
    lk_train_config_clear(&c);

    /* a LoRA adapter for increment on that (frozen) base */
    char *bpath = tu_path(dir, "base/model.safetensors");
    size_t blen;
    void *before = tu_read_file(bpath, &blen);
    assert_non_null(before);
    load_cfg(dir, "inc.yaml",
             "base: base/model.safetensors\ntask: increment\ndigits: 4\nsteps: 60\n"
             "global_batch: 32\nlr: 0.01\nseed: 2\neval_examples: 200\noutput: inc\n"
             "models:\n  student:\n    lora: {enable: true, rank: 4, alpha: 8,\n"
             "      target_modules: [to_v, to_out, ff.net.0.proj, ff.net.2]}\n",
             &c);
    assert_string_equal(c.role, "student");
    assert_int_equal(c.lora.rank, 4);
    assert_int_equal(lk_train_run(&c, self, NULL, NULL, &r), LK_OK);
    fprintf(stderr, "lora: loss %.3f -> %.3f, increment accuracy %.3f, %.2fs\n", r.first_loss,
            r.final_loss, r.accuracy, r.seconds);
    assert_int_equal(r.lora_layers, 8);
    assert_int_equal(r.trainable, 2 * (4 * 32 + 32 * 4) + 2 * (4 * 32 + 32 * 4) +
                                      2 * (4 * 32 + 128 * 4) + 2 * (4 * 128 + 32 * 4));
    assert_true(r.final_loss < 0.5f * r.first_loss);
    size_t alen;
    void *after = tu_read_file(bpath, &alen);
    assert_int_equal(alen, blen);
    assert_memory_equal(before, after, blen);
    char *f1 = tu_path(dir, "inc/adapter_model.safetensors"), *f2 = tu_path(dir, "inc/adapter_config.json");
    assert_true(tu_exists(f1) && tu_exists(f2));
    free(f1);
    free(f2);
    free(before);
    free(after);
    free(bpath);
    lk_train_config_clear(&c);
    lk_comm_free(self);
    tu_rmtree(dir);
    free(dir);
}

/* failures name what is wrong, on the run's side */
static void test_run_errors(void **state) {
    (void)state;
    char *dir = tu_mkdtemp();
    lk_comm *self;
    assert_int_equal(lk_comm_self(&self), LK_OK);
    expect_run_error(dir, self,
                     "base: nothere.safetensors\ntask: copy\nsteps: 2\nglobal_batch: 2\n"
                     "lr: 0.01\noutput: o\nmodels:\n  s:\n    lora: {enable: true, rank: 2}\n",
                     LK_ERR_IO, "nothere.safetensors: cannot open");

    /* a base too short for the task's sequences */
    lk_model_config mc = {.vocab = LK_TASK_VOCAB, .max_seq = 6, .d_model = 8, .n_layers = 1,
                          .n_heads = 2, .d_ff = 0};
    lk_model *m;
    char *bp = tu_path(dir, "short.safetensors");
    assert_int_equal(lk_model_create(&mc, 1, &m), LK_OK);
    assert_int_equal(lk_model_save(m, bp), LK_OK);
    lk_model_free(m);
    expect_run_error(dir, self,
                     "base: short.safetensors\ntask: copy\ndigits: 5\nsteps: 2\nglobal_batch: 2\n"
                     "lr: 0.01\noutput: o\nmodels:\n  s:\n    lora: {enable: true, rank: 2}\n",
                     LK_ERR_CONFIG,
                     "short.safetensors: the model has vocab 11 and max_seq 6; the task needs 11 and 10");

    /* targets that match no layer: the training API's error */
    expect_run_error(dir, self,
                     "base: short.safetensors\ntask: copy\ndigits: 3\nsteps: 2\nglobal_batch: 2\n"
                     "lr: 0.01\noutput: o\nmodels:\n  s:\n    lora: {enable: true, rank: 2, "
                     "target_modules: [q_proj]}\n",
                     LK_ERR_CONFIG, "q_proj");
    free(bp);
    lk_comm_free(self);
    tu_rmtree(dir);
    free(dir);
}

/* the shipped examples stay valid configs */
static void test_examples_parse(void **state) {
    (void)state;
    const char *ex[] = {"train_base_copy.yaml", "train_reverse_lora.yaml", "train_sort_lora.yaml"};
    for (int i = 0; i < 3; i++) {
        char p[1024];
        snprintf(p, sizeof p, "%s/examples/%s", LK_TEST_SRC_DIR, ex[i]);
        lk_train_config c;
        lk_status st = lk_train_config_load(p, NULL, &c);
        if (st) fprintf(stderr, "%s\n", lk_last_error());
        assert_int_equal(st, LK_OK);
        assert_int_equal(c.digits, 5);
        assert_int_equal(c.lora.enable, i > 0);
        if (i) assert_int_equal(c.lora.rank, 8);
        lk_train_config_clear(&c);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_config),
        cmocka_unit_test(test_full_training_lowers_loss_then_lora),
        cmocka_unit_test(test_examples_parse),
        cmocka_unit_test(test_run_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
