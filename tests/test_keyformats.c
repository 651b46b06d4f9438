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
 * refiner's lora_te_, Qwen-Image (and Qwen Image 2.1's fused img_mlp.gate_up
 * halves), HiDream, AuraFlow, PixArt (attn.qkv thirds, cross_attn.kv_linear
 * halves), Krea 2, HunyuanDiT (base_model.model., lora_te1_ on its BERT),
 * ACE-Step and Omnigen 2; the BFL Flux control LoRA, refused by name; and
 * names the tables must not place; a file mixing PEFT-style and kohya-style
 * keys, read key by key under the comfyui convention only.
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
        char name[128], lora[256], base[256], exp[256], conv[32] = "lorakit", lp[512], bp[512], ep[512], out[512];
        double s;
        if (line[0] == '#') continue;
        if (sscanf(line, "%127s %lf %255s %255s %255s %31s", name, &s, lora, base, exp, conv) < 5)
            fail_msg("cases.txt: %s", line);
        lk_fuse_file_opts fo = {0};
        if (lk_convention_parse(conv, &fo.fuse.convention)) fail_msg("cases.txt: %s: %s", line, lk_last_error());
        snprintf(lp, sizeof lp, FX "/%s", lora);
        snprintf(bp, sizeof bp, FX "/%s", base);
        snprintf(ep, sizeof ep, FX "/%s", exp);
        snprintf(out, sizeof out, "%s/%s", ar_dir, base);
        lk_fuse_input in = {lp, s, LK_FORMAT_AUTO};
        lk_fuse_stats st;
        if (lk_fuse_file(bp, &in, 1, out, &fo, &st)) fail_msg("%s on %s: %s", lora, base, lk_last_error());
        size_t changed;
        double worst = ar_check_expected(base, "ComfyUI's mapping in float64", bp, out, ep, &changed);
        assert_int_equal(st.tensors_fused, changed);
        assert_int_equal(st.modules_unmatched, 0);
        print_message("%-24s on %-44s %2zu tensors fused, worst %.3f ulp\n", name, base, changed, worst);
        remove(out);
        n_cases++;
    }
    fclose(fp);
    assert_true(n_cases >= 68);
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

/* A file mixing PEFT-style and kohya-style keys: lorakit's own convention
 * refuses the mix naming a key of each (and says how ComfyUI reads it), so
 * does lycoris, and nothing is written; comfyui reads each key alone
 * (test_cases: flux_mixed_comfyui, against ComfyUI's per-key mapping). */
static void test_mixed_refused_by_default(void **state) {
    (void)state;
    static const lk_convention refuse[] = {LK_CONVENTION_LORAKIT, LK_CONVENTION_LYCORIS, LK_CONVENTION_PEFT};
    for (size_t i = 0; i < sizeof refuse / sizeof refuse[0]; i++) {
        char *o = tu_path(ar_dir, "mixed_fused.safetensors");
        lk_fuse_file_opts fo = {.fuse = {.convention = refuse[i]}};
        lk_fuse_input in = {FX "/flux_mixed_comfyui_lora.safetensors", 0.7, LK_FORMAT_AUTO};
        assert_int_equal(lk_fuse_file(FX "/flux_mixed_comfyui_original.safetensors", &in, 1, o, &fo, NULL),
                         LK_ERR_FORMAT);
        tu_assert_contains(lk_last_error(), "mixes PEFT/diffusers keys ('diffusion_model.double_blocks.0.txt_attn.qkv"
                                            ".lora_A.weight') and kohya keys ('lora_unet_double_blocks_0_img_attn_proj");
        tu_assert_contains(lk_last_error(), "--convention comfyui reads each key alone, as ComfyUI does");
        FILE *fo_ = fopen(o, "rb");
        assert_null(fo_);
        free(o);
    }
}

/* Names the family tables must not place (README "Key formats ComfyUI
 * reads"): each is refused as matching no weight of the fixture it is fused
 * onto, and nothing is written. The expectation comes from ComfyUI's maps
 * (comfy/utils.py pixart_to_diffusers, auraflow_to_diffusers,
 * krea2_to_diffusers; comfy/lora.py for Qwen Image 2.1's gate_up halves;
 * diffusers' convert_lumina2_to_diffusers for Lumina 2's 3:1:1 qkv; its
 * convert_flux2_transformer_checkpoint_to_diffusers for Flux 2, whose linear1 is
 * diffusers' to_qkv_mlp_proj whole): none of them has these names for these
 * checkpoints. cols 0 means H = 8. */
static void test_names_not_placed(void **state) {
    (void)state;
    static const struct {
        const char *base, *module;
        int64_t rows, cols;
    } neg[] = {
        /* PixArt's self-attention is attn1.to_q / to_k / to_v, never a fused to_qkv */
        {"pixart_diffusers_names_original.safetensors", "transformer.transformer_blocks.0.attn1.to_qkv", 24},
        /* the cross-attention's kv_linear has diffusers pieces to_k and to_v only (no to_kv) */
        {"pixart_diffusers_names_original.safetensors", "transformer.transformer_blocks.0.attn2.to_kv", 16},
        /* AuraFlow's single blocks have no text stream (add_q_proj is a joint block's w1q) */
        {"auraflow_diffusers_names_original.safetensors", "transformer.single_transformer_blocks.0.attn.add_q_proj", 8},
        /* a block number the checkpoint does not have */
        {"auraflow_diffusers_names_original.safetensors", "transformer.single_transformer_blocks.1.attn.to_q", 8},
        /* Qwen Image 2.1's gate_up halves are gate_layer and proj only */
        {"qwen21_halves_original.safetensors", "transformer_blocks.0.img_mlp.gate_proj", 32},
        /* Z-Image's diffusers names cut attention.qkv in thirds; Lumina 2's is 3:1:1 (its own table) */
        {"lumina2_diffusers_names_original.safetensors", "transformer.layers.0.attention.to_k", 4},
        /* Krea 2's text fusion refiner blocks are not in this checkpoint */
        {"krea2_diffusers_names_original.safetensors", "transformer.text_fusion.refiner_blocks.0.attn.to_q", 8},
        /* Flux's names on Flux 2's BFL checkpoint (H 14, linear1 126 rows = q, k, v, gated MLP): Flux's table
         * would put to_k on rows 18..36, proj_mlp on 54..126, linear1_qkv on 0..54 (its sevenths), none of
         * them Flux 2's q/k/v rows; the flux table's detect line excludes Flux 2, so they are refused */
        {"flux2_bfl_original.safetensors", "transformer.single_transformer_blocks.0.attn.to_k", 18, 14},
        {"flux2_bfl_original.safetensors", "transformer.single_transformer_blocks.0.proj_mlp", 72, 14},
        {"flux2_bfl_original.safetensors", "diffusion_model.single_blocks.0.linear1_qkv", 54, 14},
    };
    for (size_t i = 0; i < sizeof neg / sizeof neg[0]; i++) {
        tu_rng rng = {(uint64_t)(7 + i)};
        af_file *f = af_new();
        char a[256], b[256], base[512];
        snprintf(a, sizeof a, "%s.lora_A.weight", neg[i].module);
        snprintf(b, sizeof b, "%s.lora_B.weight", neg[i].module);
        af_rand(f, a, LK_DTYPE_F32, 2, neg[i].cols ? neg[i].cols : 8, &rng, -1, 1);
        af_rand(f, b, LK_DTYPE_F32, neg[i].rows, 2, &rng, -1, 1);
        char *p = tu_path(ar_dir, "negative.safetensors"), *o = tu_path(ar_dir, "negative_fused.safetensors");
        af_save(f, p, NULL, 0);
        snprintf(base, sizeof base, FX "/%s", neg[i].base);
        lk_fuse_input in = {p, 1.0, LK_FORMAT_AUTO};
        if (lk_fuse_file(base, &in, 1, o, NULL, NULL) == LK_OK) fail_msg("%s on %s was placed", neg[i].module, neg[i].base);
        const char *bare = neg[i].module; /* the error names the module without its wrapper prefix */
        if (!strncmp(bare, "transformer.", 12)) bare += 12;
        else if (!strncmp(bare, "diffusion_model.", 16)) bare += 16;
        tu_assert_contains(lk_last_error(), bare);
        tu_assert_contains(lk_last_error(), "matches no model weight");
        FILE *fo = fopen(o, "rb");
        assert_null(fo);
        print_message("refused: %-58s on %s\n", neg[i].module, neg[i].base);
        remove(p);
        free(o);
        free(p);
        af_free(f);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_cases), cmocka_unit_test(test_bfl_control_refused),
                                       cmocka_unit_test(test_names_not_placed),
                                       cmocka_unit_test(test_mixed_refused_by_default)};
    return cmocka_run_group_tests(tests, ar_setup_dir, ar_teardown_dir);
}
