/* test_family_fixtures.c — the SD3, Wan, HunyuanVideo and LTX family tables
 * (data/families/{sd3,wan,hunyuan-video,ltx}.lkmap) on tiny real models
 * (LTX-Video and LTX-2 both with the ltx table).
 *
 * Oracle: tests/fixtures/families/, made by make_family_fixtures.py from
 * diffusers 0.42 and peft 0.21: per family a random-init diffusers
 * transformer saved in diffusers layout and under its original single-file
 * names (fused q,k,v and HunyuanVideo's linear1 concatenated by rows; checked
 * there by running diffusers' own single-file converter on it, which must
 * give the diffusers weights back exactly), a LoRA saved by the pipeline's
 * save_lora_weights, and float64 expectations from diffusers' own LoRA load
 * on a float64 copy of the model followed by PEFT's merge, written under both
 * namings; for Wan and HunyuanVideo also a LoRA on the original module
 * names (HunyuanVideo's on the fused img_attn_qkv / linear1; for Wan also
 * musubi-tuner's kohya names) in the formats diffusers' own non-diffusers
 * LoRA converters read, with expectations from that load. F_rows.txt says which rows of each original weight are which
 * rows of a diffusers weight.
 *
 * Checks, per family:
 *  - each LoRA fused into each layout: every changed tensor
 *    within 1 ulp of the float64 expectation, every other tensor
 *    byte-identical (ar_check_expected), and the fuse counts as many fused
 *    tensors as the expectation has;
 *  - the single-file fuse equals the diffusers-layout fuse byte for byte on
 *    every row pair of F_rows.txt (fused q,k,v slices = the split fuse);
 *  - the tables detected from the keys of the layout the LoRA does not name
 *    (the original layout for the diffusers LoRA, the diffusers layout for
 *    the original-named one) are this family's and no other shipped table's
 *    (the one known exception is written out below); diffusers modules land
 *    on their row slice of a fused weight, and an original module trained on
 *    a fused weight is split over the diffusers weights by rows of B, both
 *    through this family's table. */
#include "adapter_ref.h"
#include "adapter/layout.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lorakit/fuse.h"
#include "lorakit/weights.h"

#define FX LK_TEST_SRC_DIR "/tests/fixtures/families"

typedef struct fam {
    const char *name;  /* the fixtures' */
    const char *table; /* its family table */
    /* lk_adapter_family where a table is needed: the family's own table alone */
    const char *detected;
    /* the diffusers LoRA on the original layout: an original weight that
     * several diffusers modules share (or NULL), and how many land on it */
    const char *fused;
    int n_fused;
    /* the LoRAs on original names (FX/<name>_lora_<kind>, "original" or
     * "kohya"; NULL-terminated) on the diffusers layout: a diffusers weight
     * they reach through the table, and the first rows of the original
     * module's B that land there */
    const char *kinds[3];
    const char *split;
    int64_t split_b_row0;
} fam;

static const fam g_fams[] = {
    {"sd3", "sd3", "sd3", "model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight", 3, {NULL}, NULL, 0},
    {"wan", "wan", "wan", NULL, 0, {"original", "kohya", NULL}, "blocks.0.attn2.add_k_proj.weight", 0},
    {"hunyuan-video", "hunyuan-video", "hunyuan-video", "double_blocks.0.img_attn_qkv.weight", 3,
     {"original", NULL}, "transformer_blocks.0.attn.to_k.weight", 16},
    {"ltx", "ltx", "ltx", NULL, 0, {NULL}, NULL, 0},
    {"ltx2", "ltx", "ltx", NULL, 0, {NULL}, NULL, 0},
};

static const char *fx(char *buf, size_t n, const char *pre, const char *name, const char *post) {
    snprintf(buf, n, FX "/%s%s%s", pre, name, post);
    return buf;
}

/* Fuses FX/<fam>_lora_<kind> into the <layout> base, checks it against
 * expected_<fam>_lora_<kind>_<layout>; out gets the fused file's path. */
static void fuse_layout(const fam *f, const char *kind, const char *layout, char *out, size_t n_out) {
    char base[512], lora[512], exp[512], tag[128];
    snprintf(tag, sizeof tag, "%s_%s.safetensors", f->name, layout);
    fx(base, sizeof base, "", tag, "");
    snprintf(tag, sizeof tag, "%s_lora_%s", f->name, kind);
    fx(lora, sizeof lora, "", tag, ".safetensors");
    fx(exp, sizeof exp, "expected_", tag, "_");
    strncat(exp, layout, sizeof exp - strlen(exp) - 1);
    strncat(exp, ".safetensors", sizeof exp - strlen(exp) - 1);
    snprintf(out, n_out, "%s/%s_%s_out.safetensors", ar_dir, tag, layout);
    lk_fuse_input in = {lora, 1.0f, LK_FORMAT_AUTO};
    lk_fuse_stats st;
    if (lk_fuse_file(base, &in, 1, out, NULL, &st)) fail_msg("%s on %s: %s", lora, base, lk_last_error());
    char label[160];
    snprintf(label, sizeof label, "%s on the %s layout", tag, layout);
    size_t changed;
    double worst = ar_check_expected(label, "diffusers' LoRA load + PEFT merge in float64", base, out, exp, &changed);
    assert_int_equal(st.tensors_fused, changed);
    assert_int_equal(st.modules_unmatched, 0);
    print_message("%-28s on the %-9s layout: %2zu tensors fused, worst %.3f ulp\n", tag, layout, changed, worst);
}

static const lk_tensor *get(const lk_weights *w, const char *name, const char *file) {
    long i = lk_weights_find(w, name);
    if (i < 0) fail_msg("%s: no tensor %s", file, name);
    return lk_weights_tensor(w, (size_t)i);
}

/* Every row pair of F_rows.txt: the fused original rows equal the fused diffusers rows. */
static void check_rows(const fam *f, const char *out_d, const char *out_o) {
    char path[512], line[1024];
    lk_weights *wd, *wo;
    assert_int_equal(lk_weights_load(out_d, &wd), LK_OK);
    assert_int_equal(lk_weights_load(out_o, &wo), LK_OK);
    FILE *fp = fopen(fx(path, sizeof path, "", f->name, "_rows.txt"), "r");
    assert_non_null(fp);
    size_t pairs = 0, sliced = 0;
    while (fgets(line, sizeof line, fp)) {
        char ok[400], dk[400];
        long long r0, n, d0;
        if (line[0] == '#') continue;
        if (sscanf(line, "%399s %lld %lld %399s %lld", ok, &r0, &n, dk, &d0) != 5) fail_msg("%s: bad line %s", path, line);
        const lk_tensor *o = get(wo, ok, out_o), *d = get(wd, dk, out_d);
        assert_int_equal(o->dtype, d->dtype);
        assert_true(o->ndim == 2 && d->ndim == 2 && o->shape[1] == d->shape[1]);
        assert_true(r0 + n <= o->shape[0] && d0 + n <= d->shape[0]);
        size_t rb = (size_t)o->shape[1] * lk_dtype_size(o->dtype);
        if (memcmp((const char *)o->data + (size_t)r0 * rb, (const char *)d->data + (size_t)d0 * rb, (size_t)n * rb))
            fail_msg("%s: rows %lld..%lld of the fused %s differ from rows %lld.. of the fused %s", f->name, r0, r0 + n,
                     ok, d0, dk);
        pairs++;
        sliced += n != o->shape[0];
    }
    fclose(fp);
    assert_true(pairs > 10);
    if (f->fused) assert_true(sliced > 0);
    print_message("%-14s %zu row pairs equal (%zu of them slices of a fused or swapped weight)\n", f->name, pairs, sliced);
    lk_weights_free(wd);
    lk_weights_free(wo);
}

/* Resolves FX/<fam>_lora_<kind> against the <layout> base: the tables
 * picked from its keys, and the placements on one weight (target) that must
 * come from this family's table: n of them (n_fused), or one starting at
 * B row b_row0 (n_fused < 0). */
static void check_detect(const fam *f, const char *kind, const char *layout, const char *target, int n_fused,
                         int64_t b_row0) {
    char base[512], lora[512], tag[128];
    snprintf(tag, sizeof tag, "%s_%s.safetensors", f->name, layout);
    fx(base, sizeof base, "", tag, "");
    snprintf(tag, sizeof tag, "%s_lora_%s.safetensors", f->name, kind);
    fx(lora, sizeof lora, "", tag, "");
    lk_weights *w;
    assert_int_equal(lk_weights_load(base, &w), LK_OK);
    lk_adapter *a;
    assert_int_equal(lk_adapter_open(lora, LK_FORMAT_AUTO, &a), LK_OK);
    lk_resolve_opts ro = {0};
    if (lk_adapter_resolve_opts(a, lk_weights_tensors(w), lk_weights_count(w), &ro, NULL))
        fail_msg("%s: %s", base, lk_last_error());
    const char *got = lk_adapter_family(a);
    if (!got || strcmp(got, f->detected))
        fail_msg("%s: family tables %s detected, expected %s", base, got ? got : "(none)", f->detected);
    const lk_adapter_placement *p;
    size_t n = target ? lk_adapter_placements(a, target, &p) : 0;
    char want[64];
    snprintf(want, sizeof want, "family %s (", f->table);
    if (!target) {
        /* (a whole-name family: only the detection) */
    } else if (n_fused > 0) {
        assert_int_equal(n, n_fused);
        for (size_t i = 0; i < n; i++) {
            assert_false(p[i].whole);
            assert_true(p[i].rows > 0 && p[i].rows < get(w, target, base)->shape[0]);
            tu_assert_contains(p[i].rule, want);
        }
    } else {
        assert_int_equal(n, 1);
        assert_int_equal(p[0].b_row0, b_row0);
        assert_int_equal(p[0].rows, get(w, target, base)->shape[0]);
        tu_assert_contains(p[0].rule, want);
    }
    lk_adapter_free(a);
    lk_weights_free(w);
}

/* One LoRA on both layouts: the expectations, the same rows, the placements. */
static void check_lora(const fam *f, const char *kind) {
    char out_d[512], out_o[512];
    fuse_layout(f, kind, "diffusers", out_d, sizeof out_d);
    fuse_layout(f, kind, "original", out_o, sizeof out_o);
    check_rows(f, out_d, out_o);
    remove(out_d);
    remove(out_o);
}

static void test_family(void **state) {
    const fam *f = *state;
    check_lora(f, "diffusers");
    check_detect(f, "diffusers", "original", f->fused, f->n_fused, 0);
    for (int k = 0; f->kinds[k]; k++) {
        check_lora(f, f->kinds[k]);
        check_detect(f, f->kinds[k], "diffusers", f->split, -1, f->split_b_row0);
    }
}

/* The tables every shipped table's detect keys pick for each base fixture
 * here and in tests/fixtures/layouts (lk_layout_build, as resolve calls it):
 * each family's tables match its own fixtures in both layouts and no other
 * family's. */
static void test_detect_keys_do_not_clash(void **state) {
    (void)state;
    static const struct {
        const char *file, *families;
    } cases[] = {
        {"families/sd3_diffusers.safetensors", "sd3"},
        {"families/sd3_original.safetensors", "sd3"},
        {"families/wan_diffusers.safetensors", "wan"},
        {"families/wan_original.safetensors", "wan"},
        /* HunyuanVideo has Flux's single_blocks.0.linear1 and
         * single_transformer_blocks.0.proj_mlp too (flux.lkmap's detect lines
         * also need Flux's plain img_in / x_embedder and no token refiner;
         * before they did, these picked "flux,hunyuan-video") */
        {"families/hunyuan-video_diffusers.safetensors", "hunyuan-video"},
        {"families/hunyuan-video_original.safetensors", "hunyuan-video"},
        {"families/ltx_diffusers.safetensors", "ltx"},
        {"families/ltx_original.safetensors", "ltx"},
        {"families/ltx2_diffusers.safetensors", "ltx"},
        {"families/ltx2_original.safetensors", "ltx"},
        {"layouts/flux_diffusers.safetensors", "flux"},
        {"layouts/flux_bfl.safetensors", "flux"},
        {"layouts/sd1_unet.safetensors", "sd1"},
        {"layouts/sd1_single.safetensors", "sd1"},
        {"layouts/sdxl_single.safetensors", "openclip,sdxl"}, /* its UNet, and its OpenCLIP text encoder */
        {"layouts/sdxl_pipe/unet/diffusion_pytorch_model.safetensors", "sdxl"},
        {"layouts/sd2_single.safetensors", "openclip,sd1"},
        {"layouts/sd2_pipe/unet/diffusion_pytorch_model.safetensors", "sd1"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char path[512];
        snprintf(path, sizeof path, LK_TEST_SRC_DIR "/tests/fixtures/%s", cases[i].file);
        lk_weights *w;
        if (lk_weights_load(path, &w)) fail_msg("%s: %s", path, lk_last_error());
        lk_layout l;
        if (lk_layout_build(lk_weights_tensors(w), lk_weights_count(w), NULL, path, &l))
            fail_msg("%s: %s", path, lk_last_error());
        if (!l.family || strcmp(l.family, cases[i].families))
            fail_msg("%s: tables %s detected, expected %s", path, l.family ? l.family : "(none)", cases[i].families);
        lk_layout_free(&l);
        lk_weights_free(w);
    }
    /* A detect line holds only with every key present and every '!' key
     * absent: Flux's BFL keys without img_in.weight, or its diffusers keys
     * with HunyuanVideo's token refiner, are not Flux (the first are
     * ComfyUI's HunyuanVideo names, hunyuan-video.lkmap's third detect line). */
    static const struct {
        const char *keys[5], *families;
    } names[] = {
        {{"double_blocks.0.img_attn.qkv.weight", "double_blocks.0.img_attn.proj.weight", "img_in.weight"}, "flux"},
        /* with img_in.proj (a patch-embedding conv): ComfyUI's own HunyuanVideo names, not Flux */
        {{"double_blocks.0.img_attn.qkv.weight", "double_blocks.0.img_attn.proj.weight", "img_in.proj.weight"},
         "hunyuan-video"},
        {{"single_transformer_blocks.0.proj_mlp.weight", "x_embedder.weight"}, "flux"},
        {{"single_transformer_blocks.0.proj_mlp.weight", "x_embedder.weight",
          "context_embedder.token_refiner.refiner_blocks.0.attn.to_q.weight"},
         "hunyuan-video"},
        {{"model.diffusion_model.single_blocks.0.linear1.weight"}, NULL},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        lk_tensor t[5] = {0};
        size_t n = 0;
        for (; n < 5 && names[i].keys[n]; n++)
            t[n] = (lk_tensor){.name = names[i].keys[n], .dtype = LK_DTYPE_F32, .ndim = 2, .shape = {4, 4}};
        lk_layout l;
        if (lk_layout_build(t, n, NULL, "keys", &l)) fail_msg("%s", lk_last_error());
        const char *want = names[i].families;
        if (want ? !l.family || strcmp(l.family, want) : l.family != NULL)
            fail_msg("case %zu: tables %s detected, expected %s", i, l.family ? l.family : "(none)", want ? want : "(none)");
        lk_layout_free(&l);
    }
}

/* SD3's last joint block: its context norm (AdaLayerNormContinuous, halves
 * swapped) through sd3.lkmap's '#last' rules, the other blocks' through the
 * '#' rule. The values are checked by test_family (the LoRA targets
 * norm1_context.linear in both blocks; diffusers' load is the oracle); here
 * which rule and rows. */
static void test_sd3_last_block(void **state) {
    (void)state;
    lk_weights *w;
    assert_int_equal(lk_weights_load(FX "/sd3_original.safetensors", &w), LK_OK);
    lk_adapter *a;
    assert_int_equal(lk_adapter_open(FX "/sd3_lora_diffusers.safetensors", LK_FORMAT_AUTO, &a), LK_OK);
    if (lk_adapter_resolve(a, lk_weights_tensors(w), lk_weights_count(w), 0, NULL)) fail_msg("%s", lk_last_error());
    const lk_adapter_placement *p;
    const char *k0 = "model.diffusion_model.joint_blocks.0.context_block.adaLN_modulation.1.weight";
    const char *k1 = "model.diffusion_model.joint_blocks.1.context_block.adaLN_modulation.1.weight";
    assert_int_equal(lk_adapter_placements(a, k0, &p), 1);
    assert_true(p[0].whole);
    tu_assert_contains(p[0].rule, "sd3.lkmap:38)");
    assert_int_equal(lk_adapter_placements(a, k1, &p), 2);
    int64_t h = get(w, k1, "sd3_original")->shape[0] / 2;
    assert_true(p[0].row0 == 0 && p[0].b_row0 == h && p[0].rows == h);
    assert_true(p[1].row0 == h && p[1].b_row0 == 0 && p[1].rows == h);
    tu_assert_contains(p[0].rule, "sd3.lkmap:3");
    assert_null(strstr(p[0].rule, "sd3.lkmap:38)"));
    assert_null(strstr(p[1].rule, "sd3.lkmap:38)"));
    lk_adapter_free(a);
    lk_weights_free(w);
}

#define FAM_TEST(i) cmocka_unit_test_prestate(test_family, (void *)&g_fams[i])

int main(void) {
    const struct CMUnitTest tests[] = {FAM_TEST(0), FAM_TEST(1), FAM_TEST(2), FAM_TEST(3), FAM_TEST(4),
                                       cmocka_unit_test(test_detect_keys_do_not_clash),
                                       cmocka_unit_test(test_sd3_last_block)};
    return cmocka_run_group_tests(tests, ar_setup_dir, ar_teardown_dir);
}
