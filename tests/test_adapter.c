/* test_adapter.c — adapter loading: every format, format detection and
 * --format forcing, adapter_config.json (r, lora_alpha, use_rslora,
 * rank_pattern / alpha_pattern with PEFT's dot-boundary rule), resolution
 * against model keys (kohya included), and every validation error with its
 * message. Expected ranks, alphas and scales are hand-computed from the
 * values each test writes (scale = alpha / r, or alpha / sqrt(r)). */
#include "adapter_ref.h"
#include "adapter/config.h"
#include "lorakit/alloc.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define IN 10
#define OUT 12

#define g_dir ar_dir /* the group's temporary folder (ar_setup_dir) */
static tu_rng g_rng = {1234};

/* The model: five linear weights and a norm, all F32. */
static af_file *model(void) {
    af_file *m = af_new();
    const char *names[] = {"blocks.0.attn.to_q.weight", "blocks.0.attn.to_k.weight", "blocks.0.attn.my_to_k.weight",
                           "blocks.1.attn.to_q.weight", "blocks.1.attn.to_k.weight"};
    for (int i = 0; i < 5; i++) af_rand(m, names[i], LK_DTYPE_F32, OUT, IN, &g_rng, -1, 1);
    af_rand(m, "norm.weight", LK_DTYPE_F32, 1, IN, &g_rng, -1, 1);
    return m;
}

/* Adds A (r x IN) and B (OUT x r) under "<stem><sa>" and "<stem><sb>". */
static void pair(af_file *f, const char *stem, const char *sa, const char *sb, int r, lk_dtype dt) {
    char a[512], b[512];
    snprintf(a, sizeof a, "%s%s", stem, sa);
    snprintf(b, sizeof b, "%s%s", stem, sb);
    af_rand(f, a, dt, r, IN, &g_rng, -1, 1);
    af_rand(f, b, dt, OUT, r, &g_rng, -1, 1);
}

static char *save(af_file *f, const char *name) {
    char *p = tu_path(g_dir, name);
    af_save(f, p, NULL, 0);
    return p;
}

static const lk_lora_module *find_module(lk_adapter *a, const char *name) {
    for (size_t i = 0; i < lk_adapter_count(a); i++)
        if (!strcmp(lk_adapter_module(a, i)->module, name)) return lk_adapter_module(a, i);
    fail_msg("module %s not found", name);
    return NULL;
}

static void check_module(lk_adapter *a, const char *name, int rank, double alpha, double scale, const char *target) {
    const lk_lora_module *m = find_module(a, name);
    assert_int_equal(m->rank, rank);
    assert_true(fabs(m->alpha - alpha) < 1e-6);
    if (fabs(m->scale - scale) > 1e-6 * fabs(scale)) fail_msg("%s: scale %g, expected %g", name, m->scale, scale);
    if (target) assert_string_equal(m->target, target);
}

/* Opens path, expects status s and a message containing msg. */
/* The last WARN line logged (a log sink). */
static char g_warned[4096];
static void warn_sink(void *ctx, lk_log_level level, const char *msg) {
    (void)ctx;
    if (level == LK_LOG_WARN) snprintf(g_warned, sizeof g_warned, "%s", msg);
}

static void expect_open_error(const char *path, lk_adapter_format fmt, lk_status s, const char *msg) {
    lk_adapter *a = NULL;
    lk_status got = lk_adapter_open(path, fmt, &a);
    if (got != s) fail_msg("%s: expected %s, got %s (%s)", path, lk_status_str(s), lk_status_str(got), lk_last_error());
    assert_null(a);
    tu_assert_contains(lk_last_error(), msg);
}

static lk_adapter *open_ok(const char *path, lk_adapter_format fmt) {
    lk_adapter *a = NULL;
    if (lk_adapter_open(path, fmt, &a)) fail_msg("open %s: %s", path, lk_last_error());
    return a;
}

static void resolve_ok(lk_adapter *a, af_file *m) {
    if (lk_adapter_resolve(a, m->t, m->n, 0, NULL)) fail_msg("resolve: %s", lk_last_error());
}

static char *peft_folder(const char *name, const char *config, af_file *f) {
    char *dir = tu_path(g_dir, name);
    assert_int_equal(mkdir(dir, 0755), 0);
    char *st = tu_path(dir, "adapter_model.safetensors");
    af_save(f, st, NULL, 0);
    free(st);
    if (config) af_write_text(dir, "adapter_config.json", config);
    return dir;
}

/* PEFT folder: r = 4, lora_alpha = 8; rank_pattern {"to_k": 2} hits
 * blocks.*.attn.to_k at a dot boundary but not my_to_k; alpha_pattern
 * {"blocks.1.attn.to_q": 3}. Scales: 8/4 = 2, 8/2 = 4, 3/4 = 0.75. */
static void test_peft_folder_patterns(void **state) {
    (void)state;
    af_file *m = model(), *f = af_new();
    pair(f, "base_model.model.blocks.0.attn.to_q", ".lora_A.weight", ".lora_B.weight", 4, LK_DTYPE_BF16);
    pair(f, "base_model.model.blocks.0.attn.to_k", ".lora_A.weight", ".lora_B.weight", 2, LK_DTYPE_BF16);
    pair(f, "base_model.model.blocks.0.attn.my_to_k", ".lora_A.default.weight", ".lora_B.default.weight", 4,
         LK_DTYPE_F16);
    pair(f, "base_model.model.blocks.1.attn.to_q", ".lora_A.weight", ".lora_B.weight", 4, LK_DTYPE_F32);
    char *dir = peft_folder("peft1", "{\"peft_type\": \"LORA\", \"r\": 4, \"lora_alpha\": 8, "
                                     "\"rank_pattern\": {\"to_k\": 2}, \"alpha_pattern\": {\"blocks.1.attn.to_q\": 3}, "
                                     "\"target_modules\": [\"to_q\", \"to_k\", \"my_to_k\"], \"fan_in_fan_out\": false}",
                            f);
    lk_adapter *a = open_ok(dir, LK_FORMAT_AUTO);
    assert_int_equal(lk_adapter_get_format(a), LK_FORMAT_PEFT);
    assert_int_equal(lk_adapter_count(a), 4);
    assert_int_equal(lk_adapter_has_config(a), 1);
    assert_int_equal(lk_adapter_untargeted(a), 0);
    resolve_ok(a, m);
    check_module(a, "blocks.0.attn.to_q", 4, 8, 2, "blocks.0.attn.to_q.weight");
    check_module(a, "blocks.0.attn.to_k", 2, 8, 4, "blocks.0.attn.to_k.weight");
    check_module(a, "blocks.0.attn.my_to_k", 4, 8, 2, "blocks.0.attn.my_to_k.weight");
    check_module(a, "blocks.1.attn.to_q", 4, 3, 0.75, "blocks.1.attn.to_q.weight");
    const lk_lora_module *t = lk_adapter_find_target(a, "blocks.0.attn.to_k.weight");
    assert_non_null(t);
    assert_string_equal(t->module, "blocks.0.attn.to_k");
    assert_null(lk_adapter_find_target(a, "norm.weight"));
    lk_adapter_free(a);
    /* First matching pattern wins: {"attn.to_q": 5, "to_q": 6} gives 5 for
     * both to_q modules; rsLoRA: scale = alpha / sqrt(r) = 5 / 2. */
    af_file *g = af_new();
    pair(g, "base_model.model.blocks.0.attn.to_q", ".lora_A.weight", ".lora_B.weight", 4, LK_DTYPE_BF16);
    pair(g, "base_model.model.blocks.1.attn.to_q", ".lora_A.weight", ".lora_B.weight", 4, LK_DTYPE_BF16);
    char *dir2 = peft_folder("peft2", "{\"r\": 4, \"lora_alpha\": 1, \"use_rslora\": true, "
                                      "\"alpha_pattern\": {\"attn.to_q\": 5, \"to_q\": 6}}",
                             g);
    a = open_ok(dir2, LK_FORMAT_AUTO);
    assert_int_equal(lk_adapter_rslora(a), 1);
    check_module(a, "blocks.0.attn.to_q", 4, 5, 2.5, NULL);
    check_module(a, "blocks.1.attn.to_q", 4, 5, 2.5, NULL);
    lk_adapter_free(a);
    af_free(g);
    free(dir2);
    free(dir);
    af_free(f);
    af_free(m);
}

/* Python `re` syntax through PCRE2: \d, (?:...), {m,n}, Python's {,n},
 * lookahead. Scales hand-computed: r = 4, lora_alpha = 8. */
static void test_python_patterns(void **state) {
    (void)state;
    /* the translation itself (Python's documented differences from PCRE2 10.42) */
    static const char *const tr[][2] = {
        {"a{,2}", "a{0,2}"}, {"a{,}", "a{0,}"}, {"[{,2}]", "[{,2}]"}, {"a\\{,2}", "a\\{,2}"},
        {"a{,x}", "a{,x}"},  {"x\\Z", "x\\z"},  {"[\\Z]", "[\\Z]"},   {"[]{,2}]{,3}", "[]{,2}]{0,3}"},
    };
    for (size_t i = 0; i < sizeof tr / sizeof tr[0]; i++) {
        char *o = lk_py_regex_to_pcre2(tr[i][0]);
        assert_string_equal(o, tr[i][1]);
        lk_free(o);
    }
    af_file *m = model(), *f = af_new();
    pair(f, "base_model.model.blocks.0.attn.to_q", ".lora_A.weight", ".lora_B.weight", 4, LK_DTYPE_F32);
    pair(f, "base_model.model.blocks.1.attn.to_q", ".lora_A.weight", ".lora_B.weight", 4, LK_DTYPE_F32);
    pair(f, "base_model.model.blocks.0.attn.to_k", ".lora_A.weight", ".lora_B.weight", 2, LK_DTYPE_F32);
    pair(f, "base_model.model.blocks.1.attn.to_k", ".lora_A.weight", ".lora_B.weight", 4, LK_DTYPE_F32);
    /* \d (POSIX ERE would read a literal 'd'), {,1} = {0,1}, a lookahead,
     * and a regex target_modules with (?:...) and {m,n} */
    char *d = peft_folder("pyre", "{\"r\": 4, \"lora_alpha\": 8, "
                                  "\"rank_pattern\": {\"blocks\\\\.0\\\\.attn\\\\.to_k\": 2}, "
                                  "\"alpha_pattern\": {\"blocks\\\\.\\\\d\\\\.attn\\\\.to_q{,1}\": 3, "
                                  "\"(?=blocks\\\\.1)blocks\\\\.\\\\d\\\\.attn\\\\.to_k\": 6}, "
                                  "\"target_modules\": \"blocks\\\\.[0-9]{1,2}\\\\.attn\\\\.(?:to_q|to_k)\"}",
                          f);
    lk_adapter *a = open_ok(d, LK_FORMAT_AUTO);
    assert_int_equal(lk_adapter_untargeted(a), 0);
    check_module(a, "blocks.0.attn.to_q", 4, 3, 0.75, NULL);
    check_module(a, "blocks.1.attn.to_q", 4, 3, 0.75, NULL);
    check_module(a, "blocks.0.attn.to_k", 2, 8, 4, NULL);
    check_module(a, "blocks.1.attn.to_k", 4, 6, 1.5, NULL);
    assert_string_equal(find_module(a, "blocks.1.attn.to_k")->alpha_source,
                        "alpha_pattern \"(?=blocks\\.1)blocks\\.\\d\\.attn\\.to_k\"");
    assert_string_equal(find_module(a, "blocks.0.attn.to_k")->alpha_source, "config");
    lk_adapter_free(a);
    /* PEFT 0.14's rule (recorded version): re.match(".*\.key$"), so
     * "to_k|to_q" reads as ".*\.to_k" (no end anchor) or "to_q$" from the
     * start: the to_k modules match, the to_q ones do not (checked with
     * Python's re); the current rule (.*\.)?(to_k|to_q)$ matches all four. */
    char *d14 = peft_folder("pyre14", "{\"r\": 4, \"lora_alpha\": 8, \"peft_version\": \"0.14.0\", "
                                      "\"rank_pattern\": {\"blocks.0.attn.to_k\": 2}, \"alpha_pattern\": {\"to_k|to_q\": 2}}",
                            f);
    a = open_ok(d14, LK_FORMAT_AUTO);
    check_module(a, "blocks.0.attn.to_q", 4, 8, 2, NULL);
    check_module(a, "blocks.1.attn.to_k", 4, 2, 0.5, NULL);
    check_module(a, "blocks.0.attn.to_k", 2, 2, 1, NULL);
    lk_adapter_free(a);
    char *d21 = peft_folder("pyre21", "{\"r\": 4, \"lora_alpha\": 8, \"peft_version\": \"0.21.2\", "
                                      "\"rank_pattern\": {\"blocks.0.attn.to_k\": 2}, \"alpha_pattern\": {\"to_k|to_q\": 2}}",
                            f);
    a = open_ok(d21, LK_FORMAT_AUTO);
    check_module(a, "blocks.0.attn.to_q", 4, 2, 0.5, NULL);
    check_module(a, "blocks.0.attn.to_k", 2, 2, 1, NULL);
    lk_adapter_free(a);
    free(d);
    free(d14);
    free(d21);
    af_free(f);
    af_free(m);
}

/* Catastrophic backtracking on a long module name: (a+)+$ and friends
 * finish in bounded time (PCRE2's match limit; the ctest timeout here),
 * with an error naming key and module, or a result; a repetition whose
 * compiled form would be huge is refused at compile time ("too large"). Oracle: PCRE2's
 * documented match/depth limits. */
static void test_hostile_patterns(void **state) {
    (void)state;
    af_file *f = af_new();
    char stem[200];
    memset(stem, 'a', sizeof stem);
    memcpy(stem, "base_model.model.x.", 19);
    stem[sizeof stem - 2] = 'b';
    stem[sizeof stem - 1] = '\0';
    pair(f, stem, ".lora_A.weight", ".lora_B.weight", 4, LK_DTYPE_F32);
    static const char *const bombs[] = {"(a+)+$", "(a|aa)+$", "(a|a)*b?c", "((a*)*)*$", "(?:a+){1,65535}c"};
    for (size_t i = 0; i < sizeof bombs / sizeof bombs[0]; i++) {
        char cfg[256], name[32];
        snprintf(cfg, sizeof cfg, "{\"r\": 4, \"lora_alpha\": 4, \"alpha_pattern\": {\"%s\": 2}}", bombs[i]);
        snprintf(name, sizeof name, "bomb%zu", i);
        char *d = peft_folder(name, cfg, f);
        lk_adapter *a = NULL;
        lk_status s = lk_adapter_open(d, LK_FORMAT_AUTO, &a);
        print_message("%-20s -> %s%s%s\n", bombs[i], lk_status_str(s), s ? ": " : "", s ? lk_last_error() : "");
        if (s) {
            assert_int_equal(s, LK_ERR_CONFIG);
            tu_assert_contains(lk_last_error(), bombs[i]);
            if (!strstr(lk_last_error(), "within lorakit's limits") && !strstr(lk_last_error(), "too large"))
                fail_msg("unexpected error: %s", lk_last_error());
        }
        lk_adapter_free(a);
        free(d);
    }
    af_free(f);
}

/* Where alpha comes from without an adapter_config.json beside the file:
 * the config beside a file counts as the folder's; diffusers'
 * lora_adapter_metadata (plain and packed per component); else r (kohya's
 * ss_network_alpha only with LK_ALPHA_METADATA, test_alpha.c). */
static void test_alpha_sources(void **state) {
    (void)state;
    af_file *f = af_new();
    pair(f, "base_model.model.blocks.0.attn.to_q", ".lora_A.weight", ".lora_B.weight", 4, LK_DTYPE_F32);
    char *d = peft_folder("side", "{\"r\": 4, \"lora_alpha\": 12}", f);
    char *file = tu_path(d, "adapter_model.safetensors");
    lk_adapter *a = open_ok(file, LK_FORMAT_AUTO); /* the file, not the folder */
    assert_int_equal(lk_adapter_has_config(a), 1);
    check_module(a, "blocks.0.attn.to_q", 4, 12, 3, NULL);
    assert_string_equal(find_module(a, "blocks.0.attn.to_q")->alpha_source, "config");
    lk_adapter_free(a);
    char *p = save(f, "peft_nocfg.safetensors");
    a = open_ok(p, LK_FORMAT_AUTO);
    assert_string_equal(find_module(a, "blocks.0.attn.to_q")->alpha_source, "default r");
    lk_adapter_free(a);
    free(p);
    af_file *g = af_new();
    pair(g, "transformer.blocks.0.attn.to_q", ".lora_A.weight", ".lora_B.weight", 4, LK_DTYPE_F32);
    pair(g, "transformer.blocks.1.attn.to_q", ".lora_A.weight", ".lora_B.weight", 4, LK_DTYPE_F32);
    const char *plain[] = {"lora_adapter_metadata",
                           "{\"r\": 4, \"lora_alpha\": 2, \"alpha_pattern\": {\"blocks\\\\.1\\\\.attn\\\\.to_q\": 6}}"};
    p = tu_path(g_dir, "diff_meta.safetensors");
    af_save(g, p, plain, 1);
    a = open_ok(p, LK_FORMAT_AUTO);
    check_module(a, "blocks.0.attn.to_q", 4, 2, 0.5, NULL);
    check_module(a, "blocks.1.attn.to_q", 4, 6, 1.5, NULL);
    assert_string_equal(find_module(a, "blocks.0.attn.to_q")->alpha_source, "metadata lora_adapter_metadata");
    assert_string_equal(find_module(a, "blocks.1.attn.to_q")->alpha_source,
                        "metadata alpha_pattern \"blocks\\.1\\.attn\\.to_q\"");
    lk_adapter_free(a);
    free(p);
    const char *packed[] = {"lora_adapter_metadata", "{\"transformer.r\": 4, \"transformer.lora_alpha\": 1}"};
    p = tu_path(g_dir, "diff_meta_packed.safetensors");
    af_save(g, p, packed, 1);
    a = open_ok(p, LK_FORMAT_AUTO);
    check_module(a, "blocks.1.attn.to_q", 4, 1, 0.25, NULL);
    lk_adapter_free(a);
    free(p);
    /* one object per component (QA: {"transformer": {...}} was ignored without a word, alpha = r): read as
     * the packed form; both forms for one component are refused; a key that is neither is warned about */
    const char *nested[] = {"lora_adapter_metadata",
                            "{\"transformer\": {\"r\": 4, \"lora_alpha\": 2, \"alpha_pattern\": {\"blocks.1.attn.to_q\": 12}},"
                            " \"note\": 3}"};
    p = tu_path(g_dir, "diff_meta_nested.safetensors");
    af_save(g, p, nested, 1);
    g_warned[0] = '\0';
    lk_log_set_sink(warn_sink, NULL);
    a = open_ok(p, LK_FORMAT_AUTO);
    lk_log_set_sink(NULL, NULL);
    check_module(a, "blocks.0.attn.to_q", 4, 2, 0.5, NULL);
    check_module(a, "blocks.1.attn.to_q", 4, 12, 3, NULL);
    assert_string_equal(find_module(a, "blocks.1.attn.to_q")->alpha_source,
                        "metadata alpha_pattern \"blocks.1.attn.to_q\"");
    tu_assert_contains(g_warned, "metadata lora_adapter_metadata: key \"note\" is neither a LoraConfig field of a "
                                 "component (\"component.r\") nor a component's config object; ignored");
    lk_adapter_free(a);
    free(p);
    const char *both[] = {"lora_adapter_metadata", "{\"transformer\": {\"r\": 4}, \"transformer.lora_alpha\": 2}"};
    p = tu_path(g_dir, "diff_meta_both.safetensors");
    af_save(g, p, both, 1);
    expect_open_error(p, LK_FORMAT_AUTO, LK_ERR_CONFIG,
                      "metadata lora_adapter_metadata: component \"transformer\" is given both as an object and as "
                      "packed keys (\"transformer.lora_alpha\"); keep one");
    free(p);
    const char *wrong_r[] = {"lora_adapter_metadata", "{\"r\": 8, \"lora_alpha\": 1}"};
    p = tu_path(g_dir, "diff_meta_r.safetensors");
    af_save(g, p, wrong_r, 1);
    expect_open_error(p, LK_FORMAT_AUTO, LK_ERR_SHAPE, "metadata lora_adapter_metadata says r = 8");
    free(p);
    af_file *k = af_new();
    pair(k, "lora_unet_blocks_0_attn_to_q", ".lora_down.weight", ".lora_up.weight", 4, LK_DTYPE_F32);
    pair(k, "lora_unet_blocks_1_attn_to_q", ".lora_down.weight", ".lora_up.weight", 4, LK_DTYPE_F32);
    af_scalar(k, "lora_unet_blocks_1_attn_to_q.alpha", LK_DTYPE_F32, 3);
    const char *ss[] = {"ss_network_alpha", "2.0", "ss_network_dim", "4"};
    p = tu_path(g_dir, "kohya_ss.safetensors");
    af_save(k, p, ss, 2);
    a = open_ok(p, LK_FORMAT_AUTO); /* no .alpha: r, as diffusers, ComfyUI and A1111 (test_alpha.c) */
    check_module(a, "lora_unet_blocks_0_attn_to_q", 4, 4, 1, NULL);
    check_module(a, "lora_unet_blocks_1_attn_to_q", 4, 3, 0.75, NULL);
    assert_string_equal(find_module(a, "lora_unet_blocks_0_attn_to_q")->alpha_source, "default r");
    assert_string_equal(find_module(a, "lora_unet_blocks_1_attn_to_q")->alpha_source, ".alpha tensor");
    lk_adapter_free(a);
    free(p);
    af_free(k);
    af_free(g);
    free(file);
    free(d);
    af_free(f);
}

/* Adds a 1-D F32 vector of n values named name. */
static void vec(af_file *f, const char *name, int64_t n) {
    lk_tensor *t = af_rand(f, name, LK_DTYPE_F32, 1, n, &g_rng, -1, 1);
    t->ndim = 1;
    t->shape[0] = n;
}

/* The tensors PEFT saves besides the factors, read by the config's rules,
 * and each inconsistency refused naming the key and the config field. */
static void test_peft_saved_tensors(void **state) {
    (void)state;
    af_file *m = model();
    vec(m, "blocks.0.attn.to_q.bias", OUT);
    vec(m, "blocks.1.attn.to_k.bias", OUT);
    /* bias = "lora_only" in PEFT < 0.7's layout: <m>.bias of a LoRA module */
    af_file *f = af_new();
    pair(f, "base_model.model.blocks.0.attn.to_q", ".lora_A.weight", ".lora_B.weight", 4, LK_DTYPE_F32);
    vec(f, "base_model.model.blocks.0.attn.to_q.bias", OUT);
    char *d = peft_folder("lo_old", "{\"r\": 4, \"bias\": \"lora_only\"}", f);
    lk_adapter *a = open_ok(d, LK_FORMAT_AUTO);
    assert_int_equal(lk_adapter_replacement_count(a), 1);
    resolve_ok(a, m);
    assert_string_equal(lk_adapter_replacement(a, 0)->target, "blocks.0.attn.to_q.bias");
    assert_string_equal(lk_adapter_replacement(a, 0)->why, "bias");
    assert_non_null(lk_adapter_find_replacement(a, "blocks.0.attn.to_q.bias"));
    lk_adapter_free(a);
    free(d);
    af_free(f);
    /* a factor pair plus one more key, refused naming the key and the config field */
    static const struct {
        const char *module, *extra, *config, *msg;
        int vector;
        lk_status s;
    } bad[] = {
        {"blocks.0.attn.to_q", "blocks.0.attn.to_q.bias", "{\"r\": 4, \"bias\": \"none\"}",
         "key 'base_model.model.blocks.0.attn.to_q.bias' is a saved bias, but", 1, LK_ERR_FORMAT},
        {"blocks.0.attn.to_q", "blocks.1.attn.to_k.bias", "{\"r\": 4, \"bias\": \"lora_only\"}",
         "with bias = \"lora_only\" PEFT saves only the biases of LoRA modules", 1, LK_ERR_FORMAT},
        {"blocks.0.attn.to_k", "blocks.0.attn.to_k.lora_B.bias", "{\"r\": 4}", "is a lora_B bias but", 1,
         LK_ERR_FORMAT},
        {"blocks.0.attn.to_q", "blocks.0.attn.to_q.lora_magnitude_vector", "{\"r\": 4}", "is a DoRA magnitude but", 1,
         LK_ERR_FORMAT},
        {"blocks.0.attn.to_q", "blocks.0.attn.to_q.weight", "{\"r\": 4, \"modules_to_save\": [\"to_q\"]}",
         "is saved whole (modules_to_save) but blocks.0.attn.to_q also has LoRA factors", 0, LK_ERR_FORMAT},
        {"blocks.0.attn.to_q", "embed.hada_w1_a", "{\"r\": 4}",
         "embed: LoHa needs hada_w1_a, hada_w1_b, hada_w2_a and hada_w2_b; hada_w1_b is missing", 0, LK_ERR_FORMAT},
        {"blocks.0.attn.to_q", "embed.oft_r", "{\"r\": 4}",
         "is an OFT factor (PEFT OFT) other than oft_R.weight: lorakit recognises that algorithm but does not fuse it", 0, LK_ERR_UNSUPPORTED},
        /* PEFT's save_embedding_layers: a replacement of the LoRA layer's own base weight only */
        {"blocks.0.attn.to_q", "blocks.0.attn.to_k.base_layer.weight", "{\"r\": 4}",
         "is a LoRA layer's base weight, but blocks.0.attn.to_k has no LoRA factors", 0, LK_ERR_FORMAT},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char stem[128], extra[128], name[16];
        snprintf(stem, sizeof stem, "base_model.model.%s", bad[i].module);
        snprintf(extra, sizeof extra, "base_model.model.%s", bad[i].extra);
        snprintf(name, sizeof name, "saved%zu", i);
        f = af_new();
        pair(f, stem, ".lora_A.weight", ".lora_B.weight", 4, LK_DTYPE_F32);
        if (bad[i].vector) vec(f, extra, OUT);
        else af_rand(f, extra, LK_DTYPE_F32, OUT, IN, &g_rng, -1, 1);
        d = peft_folder(name, bad[i].config, f);
        expect_open_error(d, LK_FORMAT_AUTO, bad[i].s, bad[i].msg);
        free(d);
        af_free(f);
    }
    /* lora_B.bias with lora_bias = true needs the layer's own bias in the model */
    f = af_new();
    pair(f, "base_model.model.blocks.0.attn.to_k", ".lora_A.weight", ".lora_B.weight", 4, LK_DTYPE_F32);
    vec(f, "base_model.model.blocks.0.attn.to_k.lora_B.bias", OUT);
    d = peft_folder("lb_on", "{\"r\": 4, \"lora_bias\": true}", f);
    a = open_ok(d, LK_FORMAT_AUTO);
    assert_int_equal(lk_adapter_resolve(a, m->t, m->n, 0, NULL), LK_ERR_UNMATCHED);
    tu_assert_contains(lk_last_error(), "has a bias delta ('base_model.model.blocks.0.attn.to_k.lora_B.bias') but the "
                       "model has no blocks.0.attn.to_k.bias");
    lk_adapter_free(a);
    free(d);
    af_free(f);
    /* fan_in_fan_out: a weight stored in x out (Conv1D) gets the factors
     * transposed (B' = A^T, A' = B^T); an out x in (nn.Linear) weight keeps
     * them, as PEFT turns fan_in_fan_out off for Linear layers */
    f = af_new();
    pair(f, "base_model.model.blocks.0.attn.to_q", ".lora_A.weight", ".lora_B.weight", 4, LK_DTYPE_F32);
    d = peft_folder("fifo", "{\"r\": 4, \"fan_in_fan_out\": true}", f);
    for (int conv = 0; conv < 2; conv++) {
        af_file *mm = af_new();
        af_rand(mm, "blocks.0.attn.to_q.weight", LK_DTYPE_F32, conv ? IN : OUT, conv ? OUT : IN, &g_rng, -1, 1);
        a = open_ok(d, LK_FORMAT_AUTO);
        resolve_ok(a, mm);
        const lk_lora_module *q = find_module(a, "blocks.0.attn.to_q");
        assert_int_equal(q->B.shape[0], conv ? IN : OUT);
        assert_int_equal(q->A.shape[1], conv ? OUT : IN);
        if (conv) { /* B'[i][k] = A[k][i] */
            const lk_tensor *fa = af_get(f, "base_model.model.blocks.0.attn.to_q.lora_A.weight");
            for (int i = 0; i < IN; i++)
                for (int k = 0; k < 4; k++) assert_true(ar_get(&q->B, (size_t)(i * 4 + k)) == ar_get(fa, (size_t)(k * IN + i)));
        }
        lk_adapter_free(a);
        af_free(mm);
    }
    free(d);
    af_free(f);
    /* a DoRA magnitude with use_dora = true */
    f = af_new();
    pair(f, "base_model.model.blocks.0.attn.to_q", ".lora_A.weight", ".lora_B.weight", 4, LK_DTYPE_F32);
    vec(f, "base_model.model.blocks.0.attn.to_q.lora_magnitude_vector", OUT);
    d = peft_folder("dora_on", "{\"r\": 4, \"use_dora\": true}", f);
    a = open_ok(d, LK_FORMAT_AUTO);
    assert_int_equal(lk_adapter_dora(a), 1);
    lk_adapter_free(a);
    free(d);
    af_free(f);
    af_free(m);
}

/* The PEFT file alone: alpha = r, scale 1. */
static void test_peft_file_alone(void **state) {
    (void)state;
    af_file *m = model(), *f = af_new();
    pair(f, "base_model.model.blocks.0.attn.to_q", ".lora_A.weight", ".lora_B.weight", 3, LK_DTYPE_F32);
    char *p = save(f, "peft_alone.safetensors");
    lk_adapter *a = open_ok(p, LK_FORMAT_AUTO);
    assert_int_equal(lk_adapter_get_format(a), LK_FORMAT_PEFT);
    resolve_ok(a, m);
    check_module(a, "blocks.0.attn.to_q", 3, 3, 1, "blocks.0.attn.to_q.weight");
    assert_int_equal(lk_adapter_looks_like(p), 1);
    lk_adapter_free(a);
    free(p);
    af_free(f);
    af_free(m);
}

/* diffusers / ComfyUI / LTX: each prefix and none; .alpha when present
 * (alpha 2 at r 4 -> 0.5), else alpha = r. */
static void test_diffusers_prefixes(void **state) {
    (void)state;
    af_file *m = model();
    const char *prefixes[] = {"transformer.", "unet.", "diffusion_model.", ""};
    for (int i = 0; i < 4; i++) {
        af_file *f = af_new();
        char stem[128], name[64];
        snprintf(stem, sizeof stem, "%sblocks.0.attn.to_q", prefixes[i]);
        pair(f, stem, ".lora_A.weight", ".lora_B.weight", 4, LK_DTYPE_BF16);
        snprintf(stem, sizeof stem, "%sblocks.0.attn.to_q.alpha", prefixes[i]);
        af_scalar(f, stem, i == 3 ? LK_DTYPE_F64 : LK_DTYPE_F32, 2.0);
        snprintf(stem, sizeof stem, "%sblocks.1.attn.to_k", prefixes[i]);
        pair(f, stem, ".lora_A.weight", ".lora_B.weight", 2, LK_DTYPE_F16);
        snprintf(name, sizeof name, "diff%d.safetensors", i);
        char *p = save(f, name);
        lk_adapter *a = open_ok(p, LK_FORMAT_AUTO);
        assert_int_equal(lk_adapter_get_format(a), LK_FORMAT_DIFFUSERS);
        assert_int_equal(lk_adapter_count(a), 2);
        resolve_ok(a, m);
        check_module(a, "blocks.0.attn.to_q", 4, 2, 0.5, "blocks.0.attn.to_q.weight");
        check_module(a, "blocks.1.attn.to_k", 2, 2, 1, "blocks.1.attn.to_k.weight");
        lk_adapter_free(a);
        free(p);
        af_free(f);
    }
    af_free(m);
}

/* kohya: lora_unet_<m with _>, lora_down/lora_up/alpha (alpha 1 at r 4 ->
 * 0.25), resolved against the model's keys. */
static void test_kohya(void **state) {
    (void)state;
    af_file *m = model(), *f = af_new();
    pair(f, "lora_unet_blocks_0_attn_my_to_k", ".lora_down.weight", ".lora_up.weight", 4, LK_DTYPE_F16);
    af_scalar(f, "lora_unet_blocks_0_attn_my_to_k.alpha", LK_DTYPE_BF16, 1.0);
    pair(f, "lora_unet_blocks_1_attn_to_q", ".lora_down.weight", ".lora_up.weight", 8, LK_DTYPE_F32);
    char *p = save(f, "kohya.safetensors");
    lk_adapter *a = open_ok(p, LK_FORMAT_AUTO);
    assert_int_equal(lk_adapter_get_format(a), LK_FORMAT_KOHYA);
    resolve_ok(a, m);
    check_module(a, "lora_unet_blocks_0_attn_my_to_k", 4, 1, 0.25, "blocks.0.attn.my_to_k.weight");
    check_module(a, "lora_unet_blocks_1_attn_to_q", 8, 8, 1, "blocks.1.attn.to_q.weight");
    lk_adapter_free(a);
    /* Ambiguity: a.b_c and a_b.c both become a_b_c. */
    af_file *amb = af_new();
    af_rand(amb, "a.b_c.weight", LK_DTYPE_F32, OUT, IN, &g_rng, -1, 1);
    af_rand(amb, "a_b.c.weight", LK_DTYPE_F32, OUT, IN, &g_rng, -1, 1);
    af_file *g = af_new();
    pair(g, "lora_unet_a_b_c", ".lora_down.weight", ".lora_up.weight", 2, LK_DTYPE_F32);
    char *p2 = save(g, "kohya_amb.safetensors");
    a = open_ok(p2, LK_FORMAT_AUTO);
    assert_int_equal(lk_adapter_resolve(a, amb->t, amb->n, 0, NULL), LK_ERR_FORMAT);
    tu_assert_contains(lk_last_error(), "lora_unet_a_b_c: ambiguous: matches both model weights a.b_c.weight and a_b.c.weight");
    lk_adapter_free(a);
    free(p2);
    af_free(g);
    af_free(amb);
    free(p);
    af_free(f);
    af_free(m);
}

/* A checkpoint saved with a wrapper prefix (ComfyUI's
 * "model.diffusion_model."): the one key ending in ".<m>.weight" is the
 * target; two such keys are an ambiguity error. */
static void test_prefixed_model(void **state) {
    (void)state;
    af_file *m = af_new();
    af_rand(m, "model.diffusion_model.blocks.0.attn.to_q.weight", LK_DTYPE_BF16, OUT, IN, &g_rng, -1, 1);
    af_rand(m, "model.diffusion_model.blocks.1.attn.to_q.weight", LK_DTYPE_BF16, OUT, IN, &g_rng, -1, 1);
    af_rand(m, "first.x.weight", LK_DTYPE_BF16, OUT, IN, &g_rng, -1, 1);
    af_rand(m, "second.x.weight", LK_DTYPE_BF16, OUT, IN, &g_rng, -1, 1);
    af_file *f = af_new();
    pair(f, "transformer.blocks.1.attn.to_q", ".lora_A.weight", ".lora_B.weight", 2, LK_DTYPE_F32);
    char *p = save(f, "prefixed.safetensors");
    lk_adapter *a = open_ok(p, LK_FORMAT_AUTO);
    resolve_ok(a, m);
    check_module(a, "blocks.1.attn.to_q", 2, 2, 1, "model.diffusion_model.blocks.1.attn.to_q.weight");
    lk_adapter_free(a);
    af_file *g = af_new();
    pair(g, "x", ".lora_A", ".lora_B", 2, LK_DTYPE_F32);
    char *p2 = save(g, "amb_suffix.safetensors");
    a = open_ok(p2, LK_FORMAT_AUTO);
    assert_int_equal(lk_adapter_resolve(a, m->t, m->n, 0, NULL), LK_ERR_FORMAT);
    tu_assert_contains(lk_last_error(), "amb_suffix.safetensors: x: ambiguous: matches both model weights first.x.weight and second.x.weight");
    lk_adapter_free(a);
    free(p);
    free(p2);
    af_free(f);
    af_free(g);
    af_free(m);
}

/* FastVideo legacy: <m>.lora_A / <m>.lora_B, alpha = r. */
static void test_fastvideo(void **state) {
    (void)state;
    af_file *m = model(), *f = af_new();
    pair(f, "blocks.1.attn.to_k", ".lora_A", ".lora_B", 6, LK_DTYPE_BF16);
    char *p = save(f, "fv.safetensors");
    lk_adapter *a = open_ok(p, LK_FORMAT_AUTO);
    assert_int_equal(lk_adapter_get_format(a), LK_FORMAT_FASTVIDEO);
    resolve_ok(a, m);
    check_module(a, "blocks.1.attn.to_k", 6, 6, 1, "blocks.1.attn.to_k.weight");
    lk_adapter_free(a);
    free(p);
    af_free(f);
    af_free(m);
}

/* --format forces a reading: a PEFT-prefixed file read as diffusers keeps
 * "base_model.model." in the module name (so it matches nothing); a
 * diffusers file cannot be read as kohya. */
static void test_format_forcing(void **state) {
    (void)state;
    af_file *m = model(), *f = af_new();
    pair(f, "base_model.model.blocks.0.attn.to_q", ".lora_A.weight", ".lora_B.weight", 2, LK_DTYPE_F32);
    char *p = save(f, "force.safetensors");
    lk_adapter *a = open_ok(p, LK_FORMAT_DIFFUSERS);
    assert_int_equal(lk_adapter_get_format(a), LK_FORMAT_DIFFUSERS);
    assert_string_equal(lk_adapter_module(a, 0)->module, "base_model.model.blocks.0.attn.to_q");
    lk_adapter_free(a);
    expect_open_error(p, LK_FORMAT_KOHYA, LK_ERR_FORMAT,
                      "key 'base_model.model.blocks.0.attn.to_q.lora_A.weight' is not a kohya adapter key");
    lk_adapter_format fmt;
    assert_int_equal(lk_adapter_format_parse("kohya", &fmt), LK_OK);
    assert_int_equal(fmt, LK_FORMAT_KOHYA);
    assert_int_equal(lk_adapter_format_parse("lycoris", &fmt), LK_ERR_ARG);
    tu_assert_contains(lk_last_error(), "unknown adapter format 'lycoris' (valid: auto, peft, diffusers, kohya, fastvideo)");
    free(p);
    af_free(f);
    af_free(m);
}

/* Unmatched modules: an error naming the first; allowed, a count. */
static void test_unmatched(void **state) {
    (void)state;
    af_file *m = model(), *f = af_new();
    pair(f, "transformer.blocks.0.attn.to_q", ".lora_A.weight", ".lora_B.weight", 2, LK_DTYPE_F32);
    pair(f, "transformer.blocks.7.attn.to_q", ".lora_A.weight", ".lora_B.weight", 2, LK_DTYPE_F32);
    pair(f, "transformer.blocks.8.attn.to_q", ".lora_A.weight", ".lora_B.weight", 2, LK_DTYPE_F32);
    char *p = save(f, "unmatched.safetensors");
    lk_adapter *a = open_ok(p, LK_FORMAT_AUTO);
    assert_int_equal(lk_adapter_resolve(a, m->t, m->n, 0, NULL), LK_ERR_UNMATCHED);
    tu_assert_contains(lk_last_error(), "unmatched.safetensors: blocks.7.attn.to_q matches no model weight (looked for blocks.7.attn.to_q.weight)");
    assert_null(lk_adapter_module(a, 0)->target); /* failed resolve changed nothing */
    size_t un = 99;
    assert_int_equal(lk_adapter_resolve(a, m->t, m->n, 1, &un), LK_OK);
    assert_int_equal(un, 2);
    assert_string_equal(find_module(a, "blocks.0.attn.to_q")->target, "blocks.0.attn.to_q.weight");
    assert_null(find_module(a, "blocks.8.attn.to_q")->target);
    lk_adapter_free(a);
    /* kohya unmatched */
    af_file *g = af_new();
    pair(g, "lora_unet_blocks_9_ff", ".lora_down.weight", ".lora_up.weight", 2, LK_DTYPE_F32);
    char *p2 = save(g, "kohya_un.safetensors");
    a = open_ok(p2, LK_FORMAT_AUTO);
    assert_int_equal(lk_adapter_resolve(a, m->t, m->n, 0, NULL), LK_ERR_UNMATCHED);
    tu_assert_contains(lk_last_error(), "kohya_un.safetensors: lora_unet_blocks_9_ff matches no model weight");
    lk_adapter_free(a);
    free(p2);
    af_free(g);
    free(p);
    af_free(f);
    af_free(m);
}

/* One adapter file per broken case; each message is checked. */
static void test_file_errors(void **state) {
    (void)state;
    af_file *f;
    char *p;
#define CASE(fname, body, status, message)   \
    do {                                      \
        f = af_new();                         \
        body;                                 \
        p = save(f, fname);                   \
        expect_open_error(p, LK_FORMAT_AUTO, status, message); \
        free(p);                              \
        af_free(f);                           \
    } while (0)
    CASE("a_only.safetensors", af_rand(f, "x.lora_A.weight", LK_DTYPE_F32, 2, IN, &g_rng, -1, 1), LK_ERR_FORMAT,
         "a_only.safetensors: x: lora_A without lora_B");
    CASE("b_only.safetensors", af_rand(f, "x.lora_B.weight", LK_DTYPE_F32, OUT, 2, &g_rng, -1, 1), LK_ERR_FORMAT,
         "b_only.safetensors: x: lora_B without lora_A");
    CASE("down_only.safetensors",
         af_rand(f, "lora_unet_x.lora_down.weight", LK_DTYPE_F32, 2, IN, &g_rng, -1, 1), LK_ERR_FORMAT,
         "lora_unet_x: lora_down without lora_up");
    CASE("alpha_only.safetensors",
         (pair(f, "y", ".lora_A.weight", ".lora_B.weight", 2, LK_DTYPE_F32), af_scalar(f, "x.alpha", LK_DTYPE_F32, 1)),
         LK_ERR_FORMAT, "alpha_only.safetensors: x: 'x.alpha' without lora_A and lora_B");
    CASE("ranks.safetensors",
         (af_rand(f, "x.lora_A.weight", LK_DTYPE_F32, 4, IN, &g_rng, -1, 1),
          af_rand(f, "x.lora_B.weight", LK_DTYPE_F32, OUT, 3, &g_rng, -1, 1)),
         LK_ERR_SHAPE, "ranks.safetensors: x: lora_A is 4x10 but lora_B is 12x3 (ranks differ)");
    CASE("rank0.safetensors",
         (af_rand(f, "x.lora_A.weight", LK_DTYPE_F32, 0, IN, &g_rng, -1, 1),
          af_rand(f, "x.lora_B.weight", LK_DTYPE_F32, OUT, 0, &g_rng, -1, 1)),
         LK_ERR_SHAPE, "rank0.safetensors: x: lora_A is 0x10 and lora_B is 12x0: rank must be > 0");
    CASE("int.safetensors",
         (af_rand(f, "x.lora_A.weight", LK_DTYPE_F32, 2, IN, &g_rng, -1, 1),
          f->t[f->n - 1].dtype = LK_DTYPE_I32,
          af_rand(f, "x.lora_B.weight", LK_DTYPE_F32, OUT, 2, &g_rng, -1, 1)),
         LK_ERR_DTYPE, "int.safetensors: x: lora_A has dtype I32; adapter factors must be F32, F16 or BF16");
    CASE("alpha_inf.safetensors",
         (pair(f, "x", ".lora_A.weight", ".lora_B.weight", 2, LK_DTYPE_F32),
          af_scalar(f, "x.alpha", LK_DTYPE_F32, INFINITY)),
         LK_ERR_NONFINITE, "alpha_inf.safetensors: x.alpha: alpha is inf");
    CASE("alpha_nan.safetensors",
         (pair(f, "lora_unet_x", ".lora_down.weight", ".lora_up.weight", 2, LK_DTYPE_F32),
          af_scalar(f, "lora_unet_x.alpha", LK_DTYPE_F16, NAN)),
         LK_ERR_NONFINITE, "alpha_nan.safetensors: lora_unet_x.alpha: alpha is nan");
    /* integers are read as their value (test_alpha_given); a bool is no alpha */
    CASE("alpha_bool.safetensors",
         (pair(f, "x", ".lora_A.weight", ".lora_B.weight", 2, LK_DTYPE_F32),
          af_scalar(f, "x.alpha", LK_DTYPE_F32, 1), f->t[f->n - 1].dtype = LK_DTYPE_BOOL,
          f->t[f->n - 1].nbytes = 1),
         LK_ERR_DTYPE, "alpha_bool.safetensors: x.alpha: alpha has dtype BOOL; expected a float or an integer");
    CASE("conv.safetensors",
         (af_rand(f, "x.lora_A.weight", LK_DTYPE_F32, 2, IN, &g_rng, -1, 1), f->t[f->n - 1].ndim = 4,
          f->t[f->n - 1].shape[2] = 1, f->t[f->n - 1].shape[3] = 1,
          af_rand(f, "x.lora_B.weight", LK_DTYPE_F32, OUT, 6, &g_rng, -1, 1), f->t[f->n - 1].ndim = 4,
          f->t[f->n - 1].shape[1] = 2, f->t[f->n - 1].shape[2] = 3, f->t[f->n - 1].shape[3] = 1),
         LK_ERR_SHAPE, "conv.safetensors: x: lora_B is [12, 2, 3, 1]: a convolution's up factor must be [out, r, 1, 1]");
    CASE("unknown.safetensors",
         (pair(f, "x", ".lora_A.weight", ".lora_B.weight", 2, LK_DTYPE_F32),
          af_rand(f, "x.on_input", LK_DTYPE_F32, 1, IN, &g_rng, -1, 1)),
         LK_ERR_UNSUPPORTED, "unknown.safetensors: key 'x.on_input' is an IA3 vector (LyCORIS ia3): "
         "lorakit recognises that algorithm but does not fuse it");
    CASE("two_algos.safetensors", /* an OFT block beside LoRA factors: two algorithms in one module */
         (pair(f, "x", ".lora_A.weight", ".lora_B.weight", 2, LK_DTYPE_F32),
          af_rand(f, "x.oft_blocks", LK_DTYPE_F32, 1, IN, &g_rng, -1, 1)),
         LK_ERR_FORMAT, "two_algos.safetensors: x: 'x.lora_A.weight' (lora) and 'x.oft_blocks' (oft) in one module");
    CASE("unknown2.safetensors",
         (pair(f, "x", ".lora_A.weight", ".lora_B.weight", 2, LK_DTYPE_F32),
          af_rand(f, "x.something", LK_DTYPE_F32, 1, IN, &g_rng, -1, 1)),
         LK_ERR_FORMAT, "unknown2.safetensors: key 'x.something' belongs to no adapter algorithm lorakit knows");
    CASE("peft_saved_nocfg.safetensors",
         (pair(f, "base_model.model.x", ".lora_A.weight", ".lora_B.weight", 2, LK_DTYPE_F32),
          af_rand(f, "base_model.model.pooler.dense.weight", LK_DTYPE_F32, 1, IN, &g_rng, -1, 1)),
         LK_ERR_FORMAT, "key 'base_model.model.pooler.dense.weight' is not a LoRA factor; PEFT saves such tensors for "
         "modules_to_save or bias, which need the adapter_config.json that is not beside the file");
    CASE("mixed.safetensors",
         (pair(f, "x", ".lora_A.weight", ".lora_B.weight", 2, LK_DTYPE_F32),
          pair(f, "lora_unet_y", ".lora_down.weight", ".lora_up.weight", 2, LK_DTYPE_F32)),
         LK_ERR_FORMAT, "mixed.safetensors: mixes PEFT/diffusers keys ('x.lora_A.weight') and kohya keys ('lora_unet_y.lora_down.weight')");
    CASE("dup.safetensors",
         (pair(f, "x", ".lora_A.weight", ".lora_B.weight", 2, LK_DTYPE_F32),
          pair(f, "transformer.x", ".lora_A.weight", ".lora_B.weight", 2, LK_DTYPE_F32)),
         LK_ERR_FORMAT, "dup.safetensors: 'transformer.x' and 'x' are the same module x");
    CASE("empty.safetensors", af_rand(f, "blocks.0.weight", LK_DTYPE_F32, 2, 2, &g_rng, -1, 1), LK_ERR_FORMAT,
         "empty.safetensors: key 'blocks.0.weight' belongs to no adapter algorithm lorakit knows");
#undef CASE
    char *missing = tu_path(g_dir, "nope.safetensors");
    expect_open_error(missing, LK_FORMAT_AUTO, LK_ERR_IO, "nope.safetensors: no such file or directory");
    free(missing);
}

/* adapter_config.json problems, each refused with its message. */
static void test_config_errors(void **state) {
    (void)state;
    static const struct {
        const char *json;
        lk_status s;
        const char *msg;
    } cases[] = {
        {"{\"r\": 0, \"lora_alpha\": 8}", LK_ERR_CONFIG, "adapter_config.json: r = 0: the rank must be a whole number from 1 to 1000000000"},
        {"{\"r\": -4}", LK_ERR_CONFIG, "adapter_config.json: r = -4: the rank must be a whole number from 1 to 1000000000"},
        {"{\"r\": 4, \"rank_pattern\": {\"to_q\": 0}}", LK_ERR_CONFIG,
         "adapter_config.json: rank_pattern[\"to_q\"] = 0: a rank must be a whole number from 1 to 1000000000"},
        {"{\"r\": 4, \"lora_alpha\": \"8\"}", LK_ERR_CONFIG, "adapter_config.json: lora_alpha must be a finite number"},
        {"{\"r\": 4, \"lora_alpha\": NaN}", LK_ERR_CONFIG, "adapter_config.json: invalid JSON"},
        {"{\"peft_type\": \"LOHA\"}", LK_ERR_UNSUPPORTED, "peft_type = \"LOHA\"; only LORA, OFT and BOFT adapters can be fused"},
        {"{\"r\": 4, \"use_qalora\": true}", LK_ERR_UNSUPPORTED, "use_qalora = true: QA-LoRA"},
        {"{\"r\": 4, \"alora_invocation_tokens\": [1, 2]}", LK_ERR_UNSUPPORTED, "alora_invocation_tokens = [1,2]"},
        {"{\"r\": 4, \"layer_replication\": [[0, 1]]}", LK_ERR_UNSUPPORTED, "layer_replication = [[0,1]]"},
        {"{\"r\": 4, \"target_parameters\": [\"experts.w\"]}", LK_ERR_UNSUPPORTED, "target_parameters = [\"experts.w\"]"},
        {"{\"r\": 4, \"trainable_token_indices\": [3]}", LK_ERR_UNSUPPORTED, "trainable_token_indices = [3]"},
        {"{\"r\": 4, \"loftq_config\": {\"loftq_bits\": 4}}", LK_ERR_UNSUPPORTED, "loftq_config = {\"loftq_bits\":4}"},
        {"{\"r\": 4, \"init_lora_weights\": \"pissa_niter_4\"}", LK_ERR_UNSUPPORTED,
         "init_lora_weights = \"pissa_niter_4\": this initialisation changes the base weights"},
        {"{\"r\": 4, \"bias\": \"ia3_only\"}", LK_ERR_UNSUPPORTED, "bias = \"ia3_only\""},
        {"{\"r\": 4, \"alpha_pattern\": {\"(\": 1}}", LK_ERR_CONFIG,
         "alpha_pattern: \"(\" is not a valid pattern (PCRE2: missing closing parenthesis)"},
        {"{\"r\": 4, \"target_modules\": 5}", LK_ERR_CONFIG, "target_modules must be a list or a string"},
        {"{\"r\": 4, \"layers_to_transform\": \"0\"}", LK_ERR_CONFIG, "layers_to_transform must be an integer"},
        {"[1, 2]", LK_ERR_CONFIG, "adapter_config.json: not a JSON object"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        af_file *f = af_new();
        pair(f, "base_model.model.blocks.0.attn.to_q", ".lora_A.weight", ".lora_B.weight", 4, LK_DTYPE_F32);
        char name[32];
        snprintf(name, sizeof name, "cfg%zu", i);
        char *dir = peft_folder(name, cases[i].json, f);
        expect_open_error(dir, LK_FORMAT_AUTO, cases[i].s, cases[i].msg);
        free(dir);
        af_free(f);
    }
    /* Config ranks versus tensor ranks. */
    af_file *f = af_new();
    pair(f, "base_model.model.blocks.0.attn.to_q", ".lora_A.weight", ".lora_B.weight", 4, LK_DTYPE_F32);
    char *d1 = peft_folder("cfg_r", "{\"r\": 8, \"lora_alpha\": 8}", f);
    expect_open_error(d1, LK_FORMAT_AUTO, LK_ERR_SHAPE,
                      "/adapter_config.json says r = 8");
    char *d2 = peft_folder("cfg_rp", "{\"r\": 4, \"rank_pattern\": {\"to_q\": 16}}", f);
    expect_open_error(d2, LK_FORMAT_AUTO, LK_ERR_SHAPE,
                      "/adapter_config.json says 16 (rank_pattern \"to_q\")");
    /* A pattern must match at a dot boundary: "q" does not match "to_q". */
    char *d3 = peft_folder("cfg_dot", "{\"r\": 4, \"rank_pattern\": {\"q\": 16}}", f);
    lk_adapter *a = open_ok(d3, LK_FORMAT_AUTO);
    assert_int_equal(lk_adapter_module(a, 0)->rank, 4);
    lk_adapter_free(a);
    /* A little regex is fine: "(attn\\.)?to_q" matches blocks.0.attn.to_q. */
    char *d6 = peft_folder("cfg_re", "{\"r\": 4, \"rank_pattern\": {\"(attn\\\\.)?to_q\": 4}, "
                                     "\"alpha_pattern\": {\"blocks\\\\.[0-9]\\\\.attn\\\\.to_.\": 2}}",
                           f);
    a = open_ok(d6, LK_FORMAT_AUTO);
    assert_true(lk_adapter_module(a, 0)->alpha == 2.0f);
    lk_adapter_free(a);
    free(d6);
    /* target_modules not covering a module: loaded, counted. */
    char *d4 = peft_folder("cfg_tm", "{\"r\": 4, \"target_modules\": [\"to_k\"]}", f);
    a = open_ok(d4, LK_FORMAT_AUTO);
    assert_int_equal(lk_adapter_untargeted(a), 1);
    lk_adapter_free(a);
    free(d1);
    free(d2);
    free(d3);
    free(d4);
    af_free(f);
    /* A folder without safetensors but with a pickle. */
    char *d5 = tu_path(g_dir, "pickle");
    assert_int_equal(mkdir(d5, 0755), 0);
    af_write_text(d5, "adapter_model.bin", "x");
    expect_open_error(d5, LK_FORMAT_AUTO, LK_ERR_UNSUPPORTED, "adapter_model.bin (pickle) is not supported");
    free(d5);
}

/* Shape and dtype checks against the model. */
static void test_resolve_errors(void **state) {
    (void)state;
    af_file *m = model();
    af_file *f = af_new();
    af_rand(f, "blocks.0.attn.to_q.lora_A.weight", LK_DTYPE_F32, 2, IN, &g_rng, -1, 1);
    af_rand(f, "blocks.0.attn.to_q.lora_B.weight", LK_DTYPE_F32, OUT + 1, 2, &g_rng, -1, 1);
    char *p = save(f, "shape.safetensors");
    lk_adapter *a = open_ok(p, LK_FORMAT_AUTO);
    assert_int_equal(lk_adapter_resolve(a, m->t, m->n, 0, NULL), LK_ERR_SHAPE);
    tu_assert_contains(lk_last_error(), "shape.safetensors: blocks.0.attn.to_q: lora_B is 13x2 but the model weight is 12x10");
    lk_adapter_free(a);
    af_free(f);
    free(p);
    f = af_new();
    af_rand(f, "blocks.0.attn.to_q.lora_A.weight", LK_DTYPE_F32, 2, IN + 2, &g_rng, -1, 1);
    af_rand(f, "blocks.0.attn.to_q.lora_B.weight", LK_DTYPE_F32, OUT, 2, &g_rng, -1, 1);
    p = save(f, "shape2.safetensors");
    a = open_ok(p, LK_FORMAT_AUTO);
    assert_int_equal(lk_adapter_resolve(a, m->t, m->n, 0, NULL), LK_ERR_SHAPE);
    tu_assert_contains(lk_last_error(), "blocks.0.attn.to_q: lora_A is 2x12 but the model weight is 12x10");
    /* A quantised model weight cannot be fused. */
    af_get(m, "blocks.0.attn.to_q.weight")->dtype = LK_DTYPE_I8;
    lk_adapter_free(a);
    af_free(f);
    free(p);
    f = af_new();
    pair(f, "blocks.0.attn.to_q", ".lora_A.weight", ".lora_B.weight", 2, LK_DTYPE_F32);
    p = save(f, "qweight.safetensors");
    a = open_ok(p, LK_FORMAT_AUTO);
    assert_int_equal(lk_adapter_resolve(a, m->t, m->n, 0, NULL), LK_ERR_DTYPE);
    tu_assert_contains(lk_last_error(), "blocks.0.attn.to_q: the model weight blocks.0.attn.to_q.weight is I8; only F32, F16, BF16 and FP8 can be fused");
    lk_adapter_free(a);
    af_free(f);
    free(p);
    af_free(m);
}

/* Allocation failures while opening and resolving: a clean LK_ERR_NOMEM
 * (or success) at every point, never a crash or leak (ASan checks). */
static void test_alloc_failures(void **state) {
    (void)state;
    af_file *m = model(), *f = af_new();
    pair(f, "base_model.model.blocks.0.attn.to_q", ".lora_A.weight", ".lora_B.weight", 4, LK_DTYPE_BF16);
    pair(f, "base_model.model.blocks.0.attn.to_k", ".lora_A.weight", ".lora_B.weight", 2, LK_DTYPE_BF16);
    char *dir = peft_folder("peft_alloc", "{\"r\": 4, \"rank_pattern\": {\"to_k\": 2}}", f);
    int ok = 0;
    for (unsigned long k = 1; k < 200 && !ok; k++) {
        lk_adapter *a = NULL;
        lk_alloc_fail_at(k);
        lk_status s = lk_adapter_open(dir, LK_FORMAT_AUTO, &a);
        if (s == LK_OK) s = lk_adapter_resolve(a, m->t, m->n, 0, NULL);
        lk_alloc_fail_at(0);
        if (s == LK_OK) ok = 1;
        else assert_int_equal(s, LK_ERR_NOMEM);
        lk_adapter_free(a);
    }
    assert_true(ok);
    free(dir);
    af_free(f);
    af_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_peft_folder_patterns), cmocka_unit_test(test_python_patterns),
        cmocka_unit_test(test_hostile_patterns), cmocka_unit_test(test_alpha_sources),
        cmocka_unit_test(test_peft_saved_tensors), cmocka_unit_test(test_peft_file_alone),
        cmocka_unit_test(test_diffusers_prefixes),   cmocka_unit_test(test_kohya),
        cmocka_unit_test(test_fastvideo),            cmocka_unit_test(test_format_forcing),
        cmocka_unit_test(test_prefixed_model),
        cmocka_unit_test(test_unmatched),            cmocka_unit_test(test_file_errors),
        cmocka_unit_test(test_config_errors),        cmocka_unit_test(test_resolve_errors),
        cmocka_unit_test(test_alloc_failures),
    };
    return cmocka_run_group_tests(tests, ar_setup_dir, ar_teardown_dir);
}
