/* test_keyformats.c — the LoRA key formats ComfyUI reads (comfy/lora.py
 * model_lora_keys_unet / model_lora_keys_clip, comfy/lora_convert.py
 * convert_lora) that lorakit once refused, each on the checkpoint namings it
 * lands on (README "Key formats"): Flux's linear1_qkv slice and USO's names,
 * OneTrainer's Flux T5 as lora_te2_ (and lora_te3_; on SD3's three encoders
 * lora_te2_ is CLIP-G), SD3's base_model.model., SD 1.x's ".processor.to_q"
 * and lycoris_ names, diffusion-pipe's, diffusers' and ComfyUI's own
 * HunyuanVideo names, Wan Fun's lora_unet__, Stable Cascade's lora_prior_unet_
 * and lora_prior_te_, Z-Image's diffusers / ComfyUI / lycoris_ names,
 * Kandinsky 5, ComfyUI's text_encoders.<clip>.transformer. names and the SDXL
 * refiner's lora_te_; and the BFL Flux control LoRA, refused by name.
 *
 * Oracle: tests/fixtures/keyformats/, made by make_keyformat_fixtures.py:
 * tiny checkpoints with each model's real key names, a LoRA with the
 * format's real key names, and per checkpoint the fused weights in float64
 * written from ComfyUI's mapping as facts (module -> rows of one original
 * weight; on a diffusers-named checkpoint the same rows through the
 * published row layout of the fused weight), not from lorakit's tables.
 * Every fused tensor within 1 ulp of it, every other tensor byte-identical,
 * as many tensors fused as the expectation names, no module unmatched. */
#include "adapter_ref.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lorakit/fuse.h"

#define FX LK_TEST_SRC_DIR "/tests/fixtures/keyformats"

static void test_cases(void **state) {
    (void)state;
    FILE *fp = fopen(FX "/cases.txt", "r");
    assert_non_null(fp);
    char line[1024];
    size_t n_cases = 0;
    while (fgets(line, sizeof line, fp)) {
        char name[128], lora[256], base[256], exp[256], lp[512], bp[512], ep[512], out[512];
        double s;
        if (line[0] == '#') continue;
        if (sscanf(line, "%127s %lf %255s %255s %255s", name, &s, lora, base, exp) != 5) fail_msg("cases.txt: %s", line);
        snprintf(lp, sizeof lp, FX "/%s", lora);
        snprintf(bp, sizeof bp, FX "/%s", base);
        snprintf(ep, sizeof ep, FX "/%s", exp);
        snprintf(out, sizeof out, "%s/%s", ar_dir, base);
        lk_fuse_input in = {lp, s, LK_FORMAT_AUTO};
        lk_fuse_stats st;
        if (lk_fuse_file(bp, &in, 1, out, NULL, &st)) fail_msg("%s on %s: %s", lora, base, lk_last_error());
        size_t changed;
        double worst = ar_check_expected(base, "ComfyUI's mapping in float64", bp, out, ep, &changed);
        assert_int_equal(st.tensors_fused, changed);
        assert_int_equal(st.modules_unmatched, 0);
        print_message("%-24s on %-44s %2zu tensors fused, worst %.3f ulp\n", name, base, changed, worst);
        remove(out);
        n_cases++;
    }
    fclose(fp);
    assert_true(n_cases >= 38);
}

/* BFL's Flux Canny / Depth LoRA: ComfyUI (convert_lora_bfl_control) widens
 * img_in.weight with zero columns to the LoRA's input and sets the q/k norm
 * scales; lorakit keeps every weight's shape, so the file is refused naming
 * the key and why, and nothing is written. */
static void test_bfl_control_refused(void **state) {
    (void)state;
    tu_rng rng = {29};
    af_file *f = af_new();
    af_rand(f, "img_in.lora_A.weight", LK_DTYPE_BF16, 4, 128, &rng, -1, 1);
    af_rand(f, "img_in.lora_B.weight", LK_DTYPE_BF16, 8, 4, &rng, -1, 1);
    af_rand(f, "single_blocks.0.norm.key_norm.scale", LK_DTYPE_BF16, 1, 8, &rng, -1, 1);
    char *p = tu_path(ar_dir, "flux1-canny-dev-lora.safetensors");
    af_save(f, p, NULL, 0);
    lk_adapter *a = NULL;
    assert_int_equal(lk_adapter_open(p, LK_FORMAT_AUTO, &a), LK_ERR_UNSUPPORTED);
    tu_assert_contains(lk_last_error(), "key 'single_blocks.0.norm.key_norm.scale' is a BFL Flux control LoRA's norm "
                                        "scale (ComfyUI replaces the norms and widens img_in.weight");
    char *o = tu_path(ar_dir, "fused.safetensors");
    lk_fuse_input in = {p, 1.0, LK_FORMAT_AUTO};
    assert_int_equal(lk_fuse_file(FX "/flux_uso_original.safetensors", &in, 1, o, NULL, NULL), LK_ERR_UNSUPPORTED);
    FILE *fo = fopen(o, "rb");
    assert_null(fo);
    free(o);
    free(p);
    af_free(f);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_cases), cmocka_unit_test(test_bfl_control_refused)};
    return cmocka_run_group_tests(tests, ar_setup_dir, ar_teardown_dir);
}
