/* fuzz_adapter_config.c — libFuzzer target: adapter_config.json parsing.
 *
 * The input is the text of adapter_config.json inside a PEFT folder whose
 * adapter_model.safetensors is fixed (rank-4 to_q and to_v factors of two
 * blocks of the toy model in fuzz_adapter_model.h). There is no in-memory entry
 * point for the config, so the folder lives in the scratch directory and
 * lk_adapter_open reads it like a user's download. Accepted configs must
 * leave modules with consistent rank/alpha/scale (rank_pattern cannot make
 * a module's rank disagree with its tensors) and must resolve like any
 * adapter; refusals are clean errors. Inputs starting with "re:" go to the
 * PCRE2 pattern path alone (fz_patterns). */
#include "fuzz_adapter_model.h"
#include "adapter/config.h"
#include "lorakit/alloc.h"

#include <jansson.h>

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

/* The PCRE2 path on its own: the input (as UTF-8 text) becomes every kind
 * of pattern PEFT has (rank/alpha_pattern key, target_modules and
 * exclude_modules strings, layers_pattern, modules_to_save), each compiled
 * with its template and matched against module names, one of them long, so
 * a catastrophic pattern runs into the match limits. Compiling and matching
 * either works or is a clean error. */
static void fz_patterns(const uint8_t *data, size_t size) {
    char *tr_in = malloc(size + 1);
    if (!tr_in) return;
    memcpy(tr_in, data, size);
    tr_in[size] = '\0';
    char *tr = lk_py_regex_to_pcre2(tr_in);
    if (tr) FZ_CHECK(strlen(tr) <= 2 * strlen(tr_in));
    lk_free(tr);
    free(tr_in);
    json_t *key = json_stringn((const char *)data, size); /* NULL: not UTF-8 */
    if (!key) return;
    const char *k = json_string_value(key);
    json_t *cfg = json_pack("{s:i, s:i, s:{s:i}, s:{s:f}, s:O, s:O, s:[i], s:O, s:[O]}", "r", 4, "lora_alpha", 8,
                            "rank_pattern", k, 4, "alpha_pattern", k, 2.0, "target_modules", key, "exclude_modules",
                            key, "layers_to_transform", 1, "layers_pattern", key, "modules_to_save", key);
    char *txt = cfg ? json_dumps(cfg, JSON_COMPACT) : NULL;
    json_decref(cfg);
    json_decref(key);
    if (!txt) return;
    lk_peft_config c;
    lk_status s = lk_peft_config_parse(txt, strlen(txt), "fuzz", &c);
    free(txt);
    if (s) {
        fz_clean_error(s);
        return;
    }
    static char long_name[400];
    if (!long_name[0]) {
        memset(long_name, 'a', sizeof long_name - 1);
        memcpy(long_name, "blocks.0.attn.", 14);
        long_name[sizeof long_name - 2] = 'b';
    }
    const char *names[] = {"blocks.0.attn.to_q", "blocks.12.mlp.fc1", "to_q", "", long_name};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        const lk_pattern *p;
        int hit;
        for (int w = 0; w < 2; w++) {
            s = lk_peft_pattern_find(&c, w, names[i], &p);
            if (s) fz_clean_error(s);
            else FZ_CHECK(!p || p == (w ? c.alpha_pat : c.rank_pat));
        }
        if ((s = lk_peft_targets(&c, names[i], &hit))) fz_clean_error(s);
        else FZ_CHECK(hit == 0 || hit == 1);
        (void)lk_peft_saved_module(&c, names[i]);
    }
    lk_peft_config_free(&c);
}

static void fz_adapter_config(const uint8_t *data, size_t size) {
    /* inputs starting with "re:" fuzz the pattern path alone */
    if (size >= 3 && !memcmp(data, "re:", 3)) {
        fz_patterns(data + 3, size - 3);
        return;
    }
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
    size_t warned = 0;
    lk_status r = fz_resolve_counting(a, 1, &unmatched, &warned);
    if (r != LK_OK) fz_clean_error(r);
    else fz_adapter_check_resolved(a, 1, unmatched, warned);
    lk_adapter_free(a);
}

LK_FUZZ_MAIN(fz_adapter_config)
