/* fuzz_yaml.c — libFuzzer target: the YAML LoRA config parser
 * (models.<role>.lora, include/lorakit/lora.h).
 *
 * The input is the YAML text. It is parsed from memory (not NUL-terminated,
 * so an over-read shows) for the fixed role "transformer" and for each role
 * lk_lora_config_roles finds in the same text written to a scratch file, and
 * the first role is also loaded through the file API, which must agree with
 * the in-memory parse. An accepted block must obey the reference's rules as
 * lora.h states them: enabled means rank > 0, alpha defaults to rank, there
 * is always a non-empty list of non-empty targets; a refused one is a clean
 * error that leaves the output zeroed.
 *
 * Reading a config file allocates the 16 MiB size limit up front, ~4 ms per
 * call under ASan: the file path (roles, load) runs only when the text is a
 * well-formed config for "transformer" or for one input in eight. */
#include "fuzz_common.h"

static void fz_lora_check(const lk_lora_config *c, lk_status s) {
    if (s != LK_OK) {
        fz_clean_error(s);
        FZ_CHECK(!c->configured && !c->enable && c->targets == NULL && c->n_targets == 0);
        return;
    }
    if (!c->configured) FZ_CHECK(!c->enable);
    if (c->enable) FZ_CHECK(c->rank > 0);
    if (c->configured && !c->alpha_given) FZ_CHECK(c->alpha == c->rank);
    if (c->configured) FZ_CHECK(c->n_targets > 0 && c->targets != NULL);
    for (size_t i = 0; i < c->n_targets; i++) {
        FZ_CHECK(c->targets[i] != NULL && c->targets[i][0] != '\0');
        fz_touch(c->targets[i], strlen(c->targets[i]));
    }
    FZ_CHECK(memchr(c->warning, '\0', sizeof c->warning) != NULL);
    FZ_CHECK(memchr(c->info, '\0', sizeof c->info) != NULL);
    char small[16], big[1024];
    int n = lk_lora_config_describe(c, small, sizeof small);
    FZ_CHECK(n >= 0 && memchr(small, '\0', sizeof small) != NULL);
    int m = lk_lora_config_describe(c, big, sizeof big);
    FZ_CHECK(m == n);
}

static int fz_lora_equal(const lk_lora_config *a, const lk_lora_config *b) {
    if (a->configured != b->configured || a->enable != b->enable || a->rank != b->rank ||
        a->alpha != b->alpha || a->n_targets != b->n_targets)
        return 0;
    for (size_t i = 0; i < a->n_targets; i++)
        if (strcmp(a->targets[i], b->targets[i]) != 0) return 0;
    return 1;
}

static void fz_yaml(const uint8_t *data, size_t size) {
    const char *text = (const char *)data;
    lk_lora_config cfg;
    lk_status s = lk_lora_config_parse(text, size, "fuzz.yaml", "transformer", &cfg);
    fz_lora_check(&cfg, s);
    lk_lora_config_clear(&cfg);
    if (s != LK_OK && (size & 7) != 0) return;

    const char *path = fz_write_tmp("config.yaml", data, size);
    char **roles = NULL;
    size_t n_roles = 0;
    s = lk_lora_config_roles(path, &roles, &n_roles);
    if (s != LK_OK) {
        fz_clean_error(s);
        FZ_CHECK(roles == NULL && n_roles == 0);
        return;
    }
    for (size_t i = 0; i < n_roles && i < 8; i++) {
        FZ_CHECK(roles[i] != NULL);
        if (!roles[i][0]) continue; /* an empty role name is refused as an argument */
        s = lk_lora_config_parse(text, size, "fuzz.yaml", roles[i], &cfg);
        fz_lora_check(&cfg, s);
        if (i == 0) {
            lk_lora_config fromfile;
            lk_status s2 = lk_lora_config_load(path, roles[i], &fromfile);
            fz_lora_check(&fromfile, s2);
            if (s != LK_ERR_NOMEM && s2 != LK_ERR_NOMEM) {
                FZ_CHECK(s2 == s);
                if (s == LK_OK) FZ_CHECK(fz_lora_equal(&cfg, &fromfile));
            }
            lk_lora_config_clear(&fromfile);
        }
        lk_lora_config_clear(&cfg);
    }
    lk_lora_roles_free(roles, n_roles);
}

LK_FUZZ_MAIN(fz_yaml)
