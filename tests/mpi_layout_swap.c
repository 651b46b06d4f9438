/* mpi_layout_swap.c — the hot-swap tracker across checkpoint layouts
 * (issue 19): adapters written by diffusers and lycoris-lora
 * (tests/fixtures/layouts, make_layout_fixtures.py) onto original-named
 * single files (Flux's BFL file: diffusers to_q/to_k/to_v/proj_mlp land on
 * row slices of the fused qkv and linear1 weights; an SD 1.x LDM file), at
 * 1-4 ranks, with the family table recognised from the keys, named (arch),
 * turned off (arch "none") and given as a --map file instead.
 *
 * Oracle: the offline lk_fuse_file of the same request with the same arch
 * and maps, on rank 0 (test_layouts checks those bytes against diffusers'
 * own load + fuse in float64): every rank must hold its digest after the
 * step; where the offline fuse refuses (arch "none": the diffusers names are
 * not in the BFL file), the tracker refuses on every rank and every rank
 * keeps its bytes. A reset gives the base's digest back. Tables that do not
 * exist fail the tracker's creation on every rank, naming them; ranks
 * asking for different tables are a mismatch. */
#include "mpi_testutil.h"
#include "swap_fixture.h"

#include <stdio.h>
#include <string.h>

#include "lorakit/lorakit.h"

#define FX LK_TEST_SRC_DIR "/tests/fixtures/layouts"
#define FLUX_MAP LK_TEST_SRC_DIR "/data/families/flux.lkmap"

static lk_comm *W;
#define g_dir tu_mpi_dir

typedef struct req {
    const char *ad[2];
    double st[2];
} req;

/* One tracker step of r: the offline digest on every rank, or a refusal by
 * both with every rank's bytes unchanged. Returns 1 when fused. */
static int step(lk_tracker *tr, const lk_weights *w, const char *base, const req *r, const char *arch,
                const char *const *maps, size_t n_maps) {
    char paths[2][512], want[LK_DIGEST_HEX + 1], before[LK_DIGEST_HEX], scratch[600], offline_err[400] = "";
    lk_fuse_input in[2];
    size_t n = 0;
    for (; n < 2 && r->ad[n]; n++) {
        snprintf(paths[n], sizeof paths[n], FX "/%s", r->ad[n]);
        in[n] = (lk_fuse_input){paths[n], r->st[n], LK_FORMAT_AUTO};
    }
    snprintf(scratch, sizeof scratch, "%s/offline.safetensors", g_dir);
    assert_int_equal(lk_weights_digest(w, before), LK_OK);
    if (lk_comm_rank(W) == 0) {
        lk_fuse_file_opts fo = {.arch = arch, .maps = maps, .n_maps = n_maps};
        want[LK_DIGEST_HEX] = (char)(swap_offline_digest_opts(base, in, n, &fo, scratch, want) == 0);
        if (!want[LK_DIGEST_HEX]) snprintf(offline_err, sizeof offline_err, "%s", lk_last_error());
    }
    assert_int_equal(lk_comm_bcast(W, want, sizeof want, 0), LK_OK);
    assert_int_equal(lk_comm_bcast(W, offline_err, sizeof offline_err, 0), LK_OK);
    lk_status s = lk_tracker_apply(tr, in, n, NULL);
    if (!want[LK_DIGEST_HEX]) {
        if (s == LK_OK) fail_msg("%s on %s (arch %s): the tracker fused what the offline fuse refuses (%s)", in[0].path,
                                 base, arch ? arch : "auto", offline_err);
        tu_mpi_check_digest(W, w, before);
        return 0;
    }
    if (s) fail_msg("%s (+%zu) on %s (arch %s): %s", in[0].path, n - 1, base, arch ? arch : "auto", lk_last_error());
    if (!strcmp(want, before)) fail_msg("%s on %s: the offline fuse changed nothing", in[0].path, base);
    tu_mpi_check_digest(W, w, want);
    return 1;
}

/* A tracker over base with arch/maps, the requests in turn, then a reset. */
static int run(const char *base_name, const char *arch, const char *const *maps, size_t n_maps, const req *reqs,
               size_t n_reqs) {
    char base[512];
    snprintf(base, sizeof base, FX "/%s", base_name);
    lk_weights *w;
    if (lk_weights_load(base, &w)) fail_msg("%s", lk_last_error());
    char clean[LK_DIGEST_HEX];
    assert_int_equal(lk_weights_digest(w, clean), LK_OK);
    lk_tracker_opts o = LK_TRACKER_OPTS_DEFAULT;
    o.bucket_bytes = (size_t)1 << 13; /* several rounds even on these small models */
    o.arch = arch;
    o.maps = maps;
    o.n_maps = n_maps;
    lk_tracker *tr;
    if (lk_tracker_create(W, w, &o, &tr)) fail_msg("%s (arch %s): %s", base, arch ? arch : "auto", lk_last_error());
    int fused = 0;
    for (size_t i = 0; i < n_reqs; i++) fused += step(tr, w, base, &reqs[i], arch, maps, n_maps);
    assert_int_equal(lk_tracker_reset(tr, NULL), LK_OK);
    tu_mpi_check_digest(W, w, clean);
    lk_tracker_free(tr);
    lk_weights_free(w);
    return fused;
}

static void test_layout_swap(void **state) {
    (void)state;
    static const req flux[] = {
        {{"flux_lora_diffusers.safetensors"}, {1.0}},
        {{"flux_lora_diffusers.safetensors", "flux_lora_kohya.safetensors"}, {1.0, 0.5}},
        {{"flux_lora_diffusers.safetensors"}, {-0.75}},
    };
    static const req sd1[] = {
        {{"sd1_lora_diffusers.safetensors"}, {1.0}},
        {{"sd1_lora_kohya.safetensors", "sd1_lora_diffusers.safetensors"}, {0.7, 1.0}},
    };
    const char *const fmap[] = {FLUX_MAP};
    /* the requests land on the fused weights by row slices: the case this test is about */
    if (lk_comm_rank(W) == 0) {
        lk_weights *w;
        lk_adapter *a;
        assert_int_equal(lk_weights_load(FX "/flux_bfl.safetensors", &w), LK_OK);
        assert_int_equal(lk_adapter_open(FX "/flux_lora_diffusers.safetensors", LK_FORMAT_AUTO, &a), LK_OK);
        assert_int_equal(lk_adapter_resolve(a, lk_weights_tensors(w), lk_weights_count(w), 0, NULL), LK_OK);
        size_t sliced = 0;
        for (size_t i = 0; i < lk_adapter_placement_count(a); i++)
            sliced += !lk_adapter_placement_at(a, i)->whole &&
                      strstr(lk_adapter_placement_at(a, i)->target, "single_blocks.0.linear1");
        assert_true(sliced == 4); /* to_q, to_k, to_v, proj_mlp on linear1 (layout_map.txt) */
        lk_adapter_free(a);
        lk_weights_free(w);
    }
    int fused = run("flux_bfl.safetensors", NULL, NULL, 0, flux, 3);
    fused += run("flux_bfl.safetensors", "flux", NULL, 0, flux + 1, 1);
    fused += run("flux_bfl.safetensors", "none", fmap, 1, flux, 1); /* the table as a --map file */
    assert_int_equal(run("flux_bfl.safetensors", "none", NULL, 0, flux, 1), 0); /* no table: refused by both */
    fused += run("sd1_single.safetensors", NULL, NULL, 0, sd1, 2);
    assert_int_equal(fused, 3 + 1 + 1 + 2);
}

/* Tables that cannot be read fail the creation on every rank, naming them;
 * ranks naming different tables are a mismatch. */
static void test_layout_swap_bad_tables(void **state) {
    (void)state;
    lk_weights *w;
    assert_int_equal(lk_weights_load(FX "/flux_bfl.safetensors", &w), LK_OK);
    lk_tracker_opts o = LK_TRACKER_OPTS_DEFAULT;
    lk_tracker *tr = NULL;
    char missing[600];
    snprintf(missing, sizeof missing, "%s/no-such.lkmap", g_dir);
    const char *const maps[] = {missing};
    o.maps = maps;
    o.n_maps = 1;
    assert_int_not_equal(lk_tracker_create(W, w, &o, &tr), LK_OK);
    tu_assert_contains(lk_last_error(), "no-such.lkmap");
    assert_null(tr);
    o.maps = NULL;
    o.n_maps = 0;
    o.arch = "nope";
    assert_int_not_equal(lk_tracker_create(W, w, &o, &tr), LK_OK);
    tu_assert_contains(lk_last_error(), "--arch nope");
    assert_null(tr);
    if (lk_comm_size(W) > 1) {
        o.arch = lk_comm_rank(W) == 1 ? "flux" : NULL;
        assert_int_equal(lk_tracker_create(W, w, &o, &tr), LK_ERR_MISMATCH);
        tu_assert_contains(lk_last_error(), "arch");
        assert_null(tr);
    }
    lk_weights_free(w);
}

int main(int argc, char **argv) {
    W = tu_mpi_world = tu_mpi_init(&argc, &argv);
    lk_log_set_level(LK_LOG_ERROR);
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_layout_swap), cmocka_unit_test(test_layout_swap_bad_tables)};
    return tu_mpi_finish(W, cmocka_run_group_tests(tests, tu_mpi_setup_dir, tu_mpi_teardown_dir));
}
