/* fuzz_yaml.c — libFuzzer target: the YAML front-end (src/io/yaml_doc.h)
 * and, on top of it, the LoRA config block (models.<role>.lora,
 * include/lorakit/lora.h).
 *
 * The input is the YAML text. The front-end's tree must hold its promises:
 * every node reached from the root has a line and a bounded path, typed
 * scalars agree with their text (bool 0/1, ints that fit are exact), no
 * mapping holds two equal keys, a refusal is a clean error. Then the text is
 * parsed from memory (not NUL-terminated, so an over-read shows) for the
 * fixed role "transformer" and for each role
 * lk_lora_config_roles finds in the same text written to a scratch file, and
 * the first role is also loaded through the file API, which must agree with
 * the in-memory parse. An accepted block must obey the reference's rules as
 * lora.h states them: enabled means rank > 0, alpha defaults to rank, there
 * is always a non-empty list of non-empty targets; a refused one is a clean
 * error that leaves the output zeroed.
 *
 * The file path (roles, load) runs only when the text is a well-formed
 * config for "transformer" or for one input in eight, so the parser itself
 * gets the throughput. */
#include <limits.h>

#include "fuzz_common.h"
#include "io/yaml_doc.h"

/* Walks at most 4096 nodes of the tree (aliases may make it a DAG or a
 * cycle: a node is checked each time it is reached, the walk is bounded). */
static void fz_ydoc_check(const lk_ydoc *d) {
    const lk_ynode *stack[4096];
    size_t top = 0, seen = 0;
    if (lk_ydoc_root(d)) stack[top++] = lk_ydoc_root(d);
    while (top && seen++ < 4096) {
        const lk_ynode *n = stack[--top];
        char path[96], repr[64];
        FZ_CHECK(n->line >= 1);
        lk_ynode_path(n, path, sizeof path);
        FZ_CHECK(memchr(path, '\0', sizeof path) != NULL);
        lk_ynode_repr(n, repr, sizeof repr);
        FZ_CHECK(memchr(repr, '\0', sizeof repr) != NULL);
        if (n->type == LK_Y_BOOL) FZ_CHECK(n->b == 0 || n->b == 1);
        if (n->type == LK_Y_INT && n->int_ok) {
            long long x = 0;
            FZ_CHECK(lk_ytext_int(n->text, n->len, LLONG_MIN, LLONG_MAX, &x) == (n->len <= 20));
            if (n->len <= 20) FZ_CHECK(x == n->i);
        }
        if (n->type != LK_Y_SEQ && n->type != LK_Y_MAP) fz_touch(n->text, n->len + 1);
        size_t cnt = n->type == LK_Y_SEQ ? n->n : n->type == LK_Y_MAP ? 2 * n->n : 0;
        for (size_t i = 0; n->type == LK_Y_MAP && n->n <= 64 && i < n->n; i++)
            for (size_t j = i + 1; j < n->n; j++) {
                const lk_ynode *a = lk_ymap_key(n, i), *b = lk_ymap_key(n, j);
                if (a->type == LK_Y_SEQ || a->type == LK_Y_MAP || b->type == LK_Y_SEQ || b->type == LK_Y_MAP) continue;
                FZ_CHECK(a->len != b->len || memcmp(a->text, b->text, a->len) != 0);
            }
        for (size_t i = 0; i < cnt && top < sizeof stack / sizeof stack[0]; i++) stack[top++] = n->kids[i];
    }
}

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
    lk_ydoc *doc = NULL;
    lk_status sd = lk_ydoc_parse(text, size, "fuzz.yaml", &doc);
    if (sd != LK_OK) {
        fz_clean_error(sd);
        FZ_CHECK(doc == NULL);
    } else {
        fz_ydoc_check(doc);
        lk_ydoc_free(doc);
    }
    lk_lora_config cfg;
    lk_status s = lk_lora_config_parse(text, size, "fuzz.yaml", "transformer", &cfg);
    /* the lora block reads the same tree: a refused document is refused */
    if (sd != LK_OK && sd != LK_ERR_NOMEM && s != LK_ERR_NOMEM) FZ_CHECK(s == sd);
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
