/* fuzz_adapter_config.c — libFuzzer target: adapter_config.json parsing.
 *
 * The input is the text of adapter_config.json inside a PEFT folder whose
 * adapter_model.safetensors is fixed (rank-4 to_q and to_v factors of two
 * blocks of the toy model in fuzz_adapter_model.h). There is no in-memory entry
 * point for the config, so the folder lives in the scratch directory and
 * lk_adapter_open reads it like a user's download. Accepted configs must
 * leave modules with consistent rank/alpha/scale (rank_pattern cannot make
 * a module's rank disagree with its tensors) and must resolve like any
 * adapter; refusals are clean errors. */
#include "fuzz_adapter_model.h"

#define FZ_R 4
#define FZ_H 16

static const char *fz_peft_dir(void) {
    static int made;
    const char *dir = fz_mkdir_tmp("peft");
    if (!made) {
        static float a[FZ_R * FZ_H], b[FZ_H * FZ_R];
        for (int i = 0; i < FZ_R * FZ_H; i++) a[i] = b[i] = (float)(i % 7) * 0.125f - 0.375f;
        static const char *names[8] = {
            "base_model.model.blocks.0.attn.to_q.lora_A.weight", "base_model.model.blocks.0.attn.to_q.lora_B.weight",
            "base_model.model.blocks.0.attn.to_v.lora_A.weight", "base_model.model.blocks.0.attn.to_v.lora_B.weight",
            "base_model.model.blocks.1.attn.to_q.lora_A.weight", "base_model.model.blocks.1.attn.to_q.lora_B.weight",
            "base_model.model.blocks.1.attn.to_v.lora_A.weight", "base_model.model.blocks.1.attn.to_v.lora_B.weight"};
        lk_tensor t[8];
        for (int i = 0; i < 8; i++) {
            int is_a = i % 2 == 0;
            t[i] = (lk_tensor){.name = names[i], .dtype = LK_DTYPE_F32, .ndim = 2,
                               .shape = {is_a ? FZ_R : FZ_H, is_a ? FZ_H : FZ_R},
                               .nbytes = sizeof a, .data = is_a ? (void *)a : (void *)b};
        }
        char path[600];
        snprintf(path, sizeof path, "%s/adapter_model.safetensors", dir);
        lk_alloc_fail_at(0); /* the fixture itself is not under test */
        if (lk_st_save(path, t, 8, NULL, 0) != LK_OK) {
            fprintf(stderr, "fuzz: cannot write the PEFT fixture: %s\n", lk_last_error());
            abort();
        }
        made = 1;
    }
    return dir;
}

static void fz_adapter_config(const uint8_t *data, size_t size) {
    const char *dir = fz_peft_dir();
    fz_write_tmp("peft/adapter_config.json", data, size);
    lk_adapter *a = NULL;
    lk_status s = lk_adapter_open(dir, LK_FORMAT_AUTO, &a);
    if (s != LK_OK) {
        fz_clean_error(s);
        FZ_CHECK(a == NULL);
        return;
    }
    FZ_CHECK(lk_adapter_has_config(a));
    FZ_CHECK(lk_adapter_count(a) == 4);
    fz_adapter_check_open(a, LK_FORMAT_AUTO);
    size_t unmatched = 0;
    lk_status r = lk_adapter_resolve(a, fz_model(), FZ_NMODEL, 1, &unmatched);
    if (r != LK_OK) fz_clean_error(r);
    else fz_adapter_check_resolved(a, 1, unmatched);
    lk_adapter_free(a);
}

LK_FUZZ_MAIN(fz_adapter_config)
