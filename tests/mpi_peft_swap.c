/* mpi_peft_swap.c — the hot-swap tracker on adapters written by the real
 * `peft` package (tests/fixtures/peft): DoRA, modules_to_save, a saved bias
 * set, lora_bias, next to plain LoRA adapters, in one plan, at 1-4 ranks,
 * on BF16 and F32 bases.
 *
 * Oracle: the offline lk_fuse_file of the same set (swap_offline_digest),
 * whose bytes test_peft_parity checks against PEFT's own merge_and_unload.
 * Every step must leave every rank with that digest; a reset returns the
 * base's digest; a DoRA adapter next to another one is refused on every rank
 * with the weights unchanged. */
#include "mpi_testutil.h"
#include "swap_fixture.h"

#include "lorakit/lorakit.h"

#define FX LK_TEST_SRC_DIR "/tests/fixtures/peft"

static lk_comm *W;
#define g_dir tu_mpi_dir /* the group's shared temporary folder */

static void step(lk_tracker *tr, const lk_weights *w, const char *base, const lk_fuse_input *in, size_t n) {
    lk_tracker_stats st;
    if (lk_tracker_apply(tr, in, n, &st)) fail_msg("apply: %s", lk_last_error());
    char want[LK_DIGEST_HEX], scratch[600];
    snprintf(scratch, sizeof scratch, "%s/offline_r%d.safetensors", g_dir, lk_comm_rank(W));
    if (swap_offline_digest(base, in, n, scratch, want)) fail_msg("offline fuse: %s", lk_last_error());
    tu_mpi_check_digest(W, w, want);
}

static void test_peft_plan(void **state) {
    (void)state;
    static const char *const bases[2] = {FX "/base_bf16.safetensors", FX "/base_f32.safetensors"};
    for (int b = 0; b < 2; b++) {
        lk_weights *w;
        if (lk_weights_load(bases[b], &w)) fail_msg("%s", lk_last_error());
        char clean[LK_DIGEST_HEX];
        assert_int_equal(lk_weights_digest(w, clean), LK_OK);
        lk_tracker_opts o = LK_TRACKER_OPTS_DEFAULT;
        o.bucket_bytes = (size_t)1 << 20;
        lk_tracker *tr;
        if (lk_tracker_create(W, w, &o, &tr)) fail_msg("%s", lk_last_error());
        lk_fuse_input dora1 = {FX "/dora", 1.0f, LK_FORMAT_AUTO}, dora05 = {FX "/dora", 0.5f, LK_FORMAT_AUTO};
        lk_fuse_input mts[2] = {{FX "/modules_to_save", 1.0f, LK_FORMAT_AUTO}, {FX "/lora_bias", 0.5f, LK_FORMAT_AUTO}};
        lk_fuse_input ball[2] = {{FX "/bias_all", 0.7, LK_FORMAT_AUTO}, {FX "/patterns", 0.25f, LK_FORMAT_AUTO}};
        step(tr, w, bases[b], &dora1, 1);
        step(tr, w, bases[b], mts, 2);
        step(tr, w, bases[b], &dora05, 1);
        step(tr, w, bases[b], ball, 2);
        /* DoRA with another adapter: refused everywhere, nothing changed */
        char before[LK_DIGEST_HEX];
        assert_int_equal(lk_weights_digest(w, before), LK_OK);
        lk_fuse_input bad[2] = {dora1, mts[1]};
        assert_int_equal(lk_tracker_apply(tr, bad, 2, NULL), LK_ERR_ARG);
        tu_assert_contains(lk_last_error(), "a DoRA adapter must be the only adapter in its request");
        tu_mpi_check_digest(W, w, before);
        /* two adapters replacing pooler.dense.bias (bias = "all" saves it too): refused, both named */
        lk_fuse_input two[2] = {{FX "/bias_all", 1.0f, LK_FORMAT_AUTO}, mts[0]};
        assert_int_equal(lk_tracker_apply(tr, two, 2, NULL), LK_ERR_ARG);
        tu_assert_contains(lk_last_error(), FX "/bias_all and " FX "/modules_to_save both replace pooler.dense.bias");
        tu_mpi_check_digest(W, w, before);
        assert_int_equal(lk_tracker_reset(tr, NULL), LK_OK);
        tu_mpi_check_digest(W, w, clean);
        lk_tracker_free(tr);
        lk_weights_free(w);
    }
}

int main(int argc, char **argv) {
    W = tu_mpi_world = tu_mpi_init(&argc, &argv);
    lk_log_set_level(LK_LOG_ERROR);
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_peft_plan)};
    return tu_mpi_finish(W, cmocka_run_group_tests(tests, tu_mpi_setup_dir, tu_mpi_teardown_dir));
}
