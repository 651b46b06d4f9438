/* mpi_oft_swap.c — the hot-swap tracker on the OFT, BOFT and GLoRA files
 * written by lycoris-lora (tests/fixtures/oft) at 1-4 ranks, under the
 * lycoris and comfyui conventions, on the BF16, F32 and FP8 bases.
 *
 * Oracle: the offline lk_fuse_file of the same request under the same
 * convention (swap_offline_digest_opts), whose bytes test_oft checks within
 * 1 ulp of each convention's float64 reference. Every step (one adapter at
 * strength 1 or 0.7, then OFT and GLoRA on their different weights in one
 * request, then BOFT alone again) must leave every rank with the offline
 * digest; a reset gives back the base's digest. The same with the weights
 * on the emulated device, where these keys take the device kernel's host
 * path (pinned copy, CPU kernel, copy back): the same bytes, and counted
 * (keys_fused_on_host > 0 on every step that fused on this rank). */
#include "mpi_testutil.h"
#include "swap_fixture.h"

#include <stdio.h>
#include <string.h>

#include "lorakit/lorakit.h"

#define FX LK_TEST_SRC_DIR "/tests/fixtures/oft"

static lk_comm *W;
#define g_dir tu_mpi_dir
static int g_steps;
static size_t g_on_host, g_fused_here; /* this rank: keys fused on the host path / fused at all */

static void step(lk_tracker *tr, const lk_weights *w, const char *base, const lk_fuse_input *in, size_t n,
                 lk_convention conv) {
    char want[LK_DIGEST_HEX], scratch[600];
    snprintf(scratch, sizeof scratch, "%s/offline.safetensors", g_dir);
    lk_fuse_file_opts fo = {.fuse = {.convention = conv}};
    int ok = 1;
    if (lk_comm_rank(W) == 0) ok = swap_offline_digest_opts(base, in, n, &fo, scratch, want) == 0;
    if (!ok) fail_msg("offline %s on %s: %s", in[0].path, base, lk_last_error());
    assert_int_equal(lk_comm_bcast(W, want, sizeof want, 0), LK_OK);
    lk_tracker_stats st;
    if (lk_tracker_apply(tr, in, n, &st)) fail_msg("apply %s (+%zu): %s", in[0].path, n - 1, lk_last_error());
    g_on_host += st.keys_fused_on_host;
    g_fused_here += st.keys_fused;
    char got[LK_DIGEST_HEX];
    assert_int_equal(lk_weights_digest(w, got), LK_OK);
    if (strcmp(got, want))
        fail_msg("%s (+%zu) on %s --convention %s: rank %d holds %s, the offline fuse gives %s", in[0].path, n - 1,
                 base, lk_convention_name(conv), lk_comm_rank(W), got, want);
    tu_mpi_check_digest(W, w, want);
    g_steps++;
}

static void run_swaps(lk_device dev) {
    g_steps = 0;
    g_on_host = g_fused_here = 0;
    static const char *const bases[] = {"base_bf16.safetensors", "base_f32.safetensors", "base_fp8.safetensors"};
    static const lk_convention convs[] = {LK_CONVENTION_LYCORIS, LK_CONVENTION_COMFYUI};
    char oft[512], boft[512], glora[512];
    snprintf(oft, sizeof oft, FX "/oft.safetensors");
    snprintf(boft, sizeof boft, FX "/boft.safetensors");
    snprintf(glora, sizeof glora, FX "/glora.safetensors");
    for (size_t b = 0; b < sizeof bases / sizeof bases[0]; b++)
        for (size_t c = 0; c < 2; c++) {
            lk_tracker_opts o = LK_TRACKER_OPTS_DEFAULT;
            o.convention = convs[c]; /* every rank the same: they agree on it */
            o.bucket_bytes = (size_t)1 << 9; /* several buckets even on this small model */
            char base[512], clean[LK_DIGEST_HEX];
            snprintf(base, sizeof base, FX "/%s", bases[b]);
            lk_weights *w;
            if (lk_weights_load(base, &w)) fail_msg("%s", lk_last_error());
            if (dev.kind != LK_DEVICE_CPU && lk_weights_to_device(w, dev)) fail_msg("%s", lk_last_error());
            assert_int_equal(lk_weights_digest(w, clean), LK_OK);
            lk_tracker *tr;
            if (lk_tracker_create(W, w, &o, &tr)) fail_msg("%s", lk_last_error());
            lk_fuse_input one[1] = {{oft, 1.0, LK_FORMAT_AUTO}};
            step(tr, w, base, one, 1, convs[c]);
            one[0] = (lk_fuse_input){boft, 0.7, LK_FORMAT_AUTO};
            step(tr, w, base, one, 1, convs[c]);
            lk_fuse_input two[2] = {{glora, 0.7, LK_FORMAT_AUTO}, {oft, 0.7, LK_FORMAT_AUTO}};
            step(tr, w, base, two, 2, convs[c]);
            one[0] = (lk_fuse_input){boft, 1.0, LK_FORMAT_AUTO};
            step(tr, w, base, one, 1, convs[c]);
            assert_int_equal(lk_tracker_reset(tr, NULL), LK_OK);
            tu_mpi_check_digest(W, w, clean);
            lk_tracker_free(tr);
            lk_weights_free(w);
        }
    if (lk_comm_rank(W) == 0) print_message("%d tracker steps equal to the offline fuse\n", g_steps);
    assert_int_equal(g_steps, 3 * 2 * 4);
    if (dev.kind == LK_DEVICE_CPU) assert_true(g_on_host == 0);
    else if (g_on_host != g_fused_here) /* OFT, BOFT and GLoRA all take the host path on a device */
        fail_msg("rank %d: %zu of %zu fused keys counted on the host path", lk_comm_rank(W), g_on_host, g_fused_here);
}

static void test_oft_swap(void **state) {
    (void)state;
    run_swaps((lk_device){LK_DEVICE_CPU, 0});
}

static void test_oft_swap_emul(void **state) {
    (void)state;
    run_swaps((lk_device){LK_DEVICE_EMUL, 0});
}

int main(int argc, char **argv) {
    W = tu_mpi_world = tu_mpi_init(&argc, &argv);
    lk_log_set_level(LK_LOG_ERROR);
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_oft_swap), cmocka_unit_test(test_oft_swap_emul)};
    return tu_mpi_finish(W, cmocka_run_group_tests(tests, tu_mpi_setup_dir, tu_mpi_teardown_dir));
}
