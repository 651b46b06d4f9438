/* test_tracker_stale.c — the tracker never keeps a silently wrong model
 * (issue 28, items 2 and 3).
 *
 * Item 2: an adapter file rewritten at the same path (the train -> save ->
 * apply loop) is read again on the next apply of the same set and fused
 * with its new bytes (stats.adapters_changed = 1, not skipped); an apply
 * of a set whose files read the same is still skipped.
 * Item 3: a key the tracker wrote, changed behind its back (the caller's
 * load_state_dict into the same memory), fails the next apply and reset
 * with LK_ERR_STATE naming the key, and nothing changes.
 *
 * Oracle: the float64 reference W + s * (alpha / r) * B @ A of the factors
 * as rewritten (ar_check_fused), from the base's own values; "nothing
 * changes" is the weights' digest before and after. */
#include "adapter_ref.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#define IN 12
#define OUT 8
#define R 4

static char *g_base;
static af_file *g_model;
static const char *const W = "blocks.0.attn.to_q.weight", *const W2 = "blocks.0.attn.to_k.weight";

/* A diffusers adapter on to_q (rank R, alpha 8: scale 2) from seed. */
static void write_adapter(const char *p, uint64_t seed) {
    tu_rng r = {seed};
    af_file *f = af_new();
    af_rand(f, "transformer.blocks.0.attn.to_q.lora_A.weight", LK_DTYPE_F32, R, IN, &r, -1, 1);
    af_rand(f, "transformer.blocks.0.attn.to_q.lora_B.weight", LK_DTYPE_F32, OUT, R, &r, -1, 1);
    af_scalar(f, "transformer.blocks.0.attn.to_q.alpha", LK_DTYPE_F32, 8);
    af_save(f, p, NULL, 0);
    af_free(f);
}

/* w's to_q against the reference with adapter p's factors at scale s * 2. */
static void check_q(const lk_weights *w, const char *p, double s) {
    lk_st *sa;
    assert_int_equal(lk_st_open(p, &sa), LK_OK);
    ar_term t = {lk_st_tensor(sa, (size_t)lk_st_find(sa, "transformer.blocks.0.attn.to_q.lora_A.weight")),
                 lk_st_tensor(sa, (size_t)lk_st_find(sa, "transformer.blocks.0.attn.to_q.lora_B.weight")), s * 8 / R};
    const lk_tensor *q = NULL;
    for (size_t i = 0; i < lk_weights_count(w); i++)
        if (!strcmp(lk_weights_tensor(w, i)->name, W)) q = lk_weights_tensor(w, i);
    assert_non_null(q);
    assert_int_equal(ar_check_fused(q->data, af_get(g_model, W)->data, LK_DTYPE_F32, OUT, IN, &t, 1), 0);
    lk_st_close(sa);
}

static float *weight(lk_weights *w, const char *name) {
    for (size_t i = 0; i < lk_weights_count(w); i++)
        if (!strcmp(lk_weights_tensor(w, i)->name, name)) return (float *)lk_weights_tensor(w, i)->data;
    fail_msg("no %s", name);
    return NULL;
}

typedef struct fixture {
    lk_comm *c;
    lk_weights *w;
    lk_tracker *t;
} fixture;

static void open_fixture(fixture *f) {
    assert_int_equal(lk_comm_self(&f->c), LK_OK);
    assert_int_equal(lk_weights_load(g_base, &f->w), LK_OK);
    lk_tracker_opts o = LK_TRACKER_OPTS_DEFAULT;
    assert_int_equal(lk_tracker_create(f->c, f->w, &o, &f->t), LK_OK);
}

static void close_fixture(fixture *f) {
    lk_tracker_free(f->t);
    lk_weights_free(f->w);
    lk_comm_free(f->c);
}

/* Item 2: retrain, save to the same path, apply the same set. */
static void test_rewritten_same_set(void **state) {
    (void)state;
    char *p = tu_path(ar_dir, "a.safetensors");
    write_adapter(p, 1);
    fixture f;
    open_fixture(&f);
    lk_fuse_input in = {.path = p, .strength = 0.5};
    lk_tracker_stats st;
    assert_int_equal(lk_tracker_apply(f.t, &in, 1, &st), LK_OK);
    check_q(f.w, p, 0.5);
    assert_int_equal(lk_tracker_apply(f.t, &in, 1, &st), LK_OK); /* read again (just written), same bytes */
    assert_true(st.skipped);
    assert_int_equal(st.adapters_changed, 0);
    write_adapter(p, 2); /* the same size, path and (likely) second: new values */
    assert_int_equal(lk_tracker_apply(f.t, &in, 1, &st), LK_OK);
    assert_false(st.skipped);
    assert_int_equal(st.adapters_changed, 1);
    assert_int_equal(st.keys_fused, 1);
    check_q(f.w, p, 0.5);
    /* the mtime put back as it was: still found (ctime, and the read's time) */
    struct stat sb;
    assert_int_equal(stat(p, &sb), 0);
    write_adapter(p, 3);
    struct timespec ts[2] = {sb.st_atim, sb.st_mtim};
    assert_int_equal(utimensat(AT_FDCWD, p, ts, 0), 0);
    assert_int_equal(lk_tracker_apply(f.t, &in, 1, &st), LK_OK);
    assert_int_equal(st.adapters_changed, 1);
    check_q(f.w, p, 0.5);
    /* a file that vanished: the apply fails naming it, the weights stay */
    char before[LK_DIGEST_HEX], after[LK_DIGEST_HEX];
    assert_int_equal(lk_weights_digest(f.w, before), LK_OK);
    assert_int_equal(unlink(p), 0);
    assert_int_equal(lk_tracker_apply(f.t, &in, 1, &st), LK_ERR_IO);
    tu_assert_contains(lk_last_error(), "a.safetensors");
    assert_int_equal(lk_weights_digest(f.w, after), LK_OK);
    assert_string_equal(before, after);
    write_adapter(p, 3); /* back: the same content as fused */
    assert_int_equal(lk_tracker_apply(f.t, &in, 1, &st), LK_OK);
    assert_true(st.skipped);
    close_fixture(&f);
    free(p);
}

/* Item 3: the weights changed behind the tracker. */
static void test_weights_changed_outside(void **state) {
    (void)state;
    char *p = tu_path(ar_dir, "b.safetensors");
    write_adapter(p, 4);
    fixture f;
    open_fixture(&f);
    lk_fuse_input in = {.path = p, .strength = 1.0};
    assert_int_equal(lk_tracker_apply(f.t, &in, 1, NULL), LK_OK);
    float *k = weight(f.w, W2), *q = weight(f.w, W);
    k[0] += 1.0f; /* a key the tracker never wrote: not its business */
    assert_int_equal(lk_tracker_apply(f.t, &in, 1, NULL), LK_OK);
    const float kept = q[3];
    q[3] = kept + 1.0f; /* load_state_dict(new_base) into the same memory, say */
    char before[LK_DIGEST_HEX], after[LK_DIGEST_HEX];
    assert_int_equal(lk_weights_digest(f.w, before), LK_OK);
    lk_fuse_input half = {.path = p, .strength = 0.5};
    assert_int_equal(lk_tracker_apply(f.t, &half, 1, NULL), LK_ERR_STATE);
    tu_assert_contains(lk_last_error(), "the model's weights were changed outside the tracker: make a new Tracker "
                                        "(base weights: blocks.0.attn.to_q.weight holds XXH3-64 ");
    assert_int_equal(lk_tracker_reset(f.t, NULL), LK_ERR_STATE);
    assert_int_equal(lk_tracker_apply(f.t, &in, 1, NULL), LK_ERR_STATE); /* even the current set */
    assert_int_equal(lk_weights_digest(f.w, after), LK_OK);
    assert_string_equal(before, after); /* nothing changed */
    q[3] = kept; /* as the tracker left it: usable again */
    assert_int_equal(lk_tracker_reset(f.t, NULL), LK_OK);
    assert_true(weight(f.w, W)[3] == ((float *)af_get(g_model, W)->data)[3]);
    close_fixture(&f);
    free(p);
}

static int setup(void **state) {
    int r = ar_setup_dir(state);
    if (r) return r;
    tu_rng rng = {28};
    g_model = af_new();
    af_rand(g_model, W, LK_DTYPE_F32, OUT, IN, &rng, -1, 1);
    af_rand(g_model, W2, LK_DTYPE_F32, OUT, IN, &rng, -1, 1);
    g_base = tu_path(ar_dir, "base.safetensors");
    af_save(g_model, g_base, NULL, 0);
    return 0;
}

static int teardown(void **state) {
    free(g_base);
    af_free(g_model);
    return ar_teardown_dir(state);
}

int main(void) {
    lk_log_set_level(LK_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rewritten_same_set),
        cmocka_unit_test(test_weights_changed_outside),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
