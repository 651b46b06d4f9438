/* test_pipeline_out.c — what a pipeline fuse (a diffusers pipeline folder as
 * the base, lk_fuse_pipeline) may write its output folder over (issue 19):
 * a new or empty folder, or an earlier lorakit pipeline output (its
 * .lorakit-output names every file and folder in it), replaced whole; never
 * a folder with anything of the user's in it, the base folder, a folder
 * holding it, or one inside it. A fuse that fails in its second component
 * (the first one already written into the temporary folder) leaves no output
 * and no temporary, and an earlier output as it was.
 *
 * Expectations are the rules above and bytes read back: the pipeline is
 * synthetic (F32 8x8 weights); a failing adapter has finite factors of 1e20
 * on the text encoder's weight, so W + B A overflows F32 while that
 * component is fused (LK_ERR_NONFINITE), after unet/ was fused. */
#include "adapter_ref.h"
#include "testutil.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define D 8
#define R 2

static tu_rng g_rng = {42};
static char *g_pipe, *g_good, *g_bad;

static char *at(const char *a, const char *b) { return tu_path(a, b); }

static void mkdirs(const char *root, const char *rel) {
    char *p = at(root, rel);
    assert_int_equal(mkdir(p, 0755), 0);
    free(p);
}

static int setup(void **state) {
    ar_setup_dir(state);
    g_pipe = at(ar_dir, "pipe");
    assert_int_equal(mkdir(g_pipe, 0755), 0);
    mkdirs(g_pipe, "unet");
    mkdirs(g_pipe, "text_encoder");
    mkdirs(g_pipe, "tokenizer");
    mkdirs(g_pipe, "tokenizer/extra");
    af_file *u = af_new(), *t = af_new(), *good = af_new(), *bad = af_new();
    af_rand(u, "down_blocks.0.attentions.0.proj_in.weight", LK_DTYPE_F32, D, D, &g_rng, -1, 1);
    af_rand(u, "mid_block.attentions.0.proj_out.weight", LK_DTYPE_F32, D, D, &g_rng, -1, 1);
    af_rand(t, "text_model.encoder.layers.0.self_attn.q_proj.weight", LK_DTYPE_F32, D, D, &g_rng, -1, 1);
    char *p = at(g_pipe, "unet/diffusion_pytorch_model.safetensors");
    af_save(u, p, NULL, 0);
    free(p);
    p = at(g_pipe, "text_encoder/model.safetensors");
    af_save(t, p, NULL, 0);
    free(p);
    af_write_text(g_pipe, "model_index.json", "{\"_class_name\": \"StableDiffusionPipeline\"}\n");
    af_write_text(g_pipe, "tokenizer/vocab.json", "{\"a\": 1}\n");
    char *tx = at(g_pipe, "tokenizer/extra");
    af_write_text(tx, "merges.txt", "a b\n");
    free(tx);
    /* good: a module in each component; bad: the same, the text encoder's overflowing */
    const char *mods[2] = {"unet.down_blocks.0.attentions.0.proj_in", "text_encoder.text_model.encoder.layers.0.self_attn.q_proj"};
    for (int m = 0; m < 2; m++) {
        char k[256];
        snprintf(k, sizeof k, "%s.lora_A.weight", mods[m]);
        af_rand(good, k, LK_DTYPE_F32, R, D, &g_rng, -1, 1);
        af_rand(bad, k, LK_DTYPE_F32, R, D, &g_rng, m ? 1e20f : -1, m ? 1.0001e20f : 1);
        snprintf(k, sizeof k, "%s.lora_B.weight", mods[m]);
        af_rand(good, k, LK_DTYPE_F32, D, R, &g_rng, -1, 1);
        af_rand(bad, k, LK_DTYPE_F32, D, R, &g_rng, m ? 1e20f : -1, m ? 1.0001e20f : 1);
    }
    g_good = at(ar_dir, "good.safetensors");
    g_bad = at(ar_dir, "bad.safetensors");
    af_save(good, g_good, NULL, 0);
    af_save(bad, g_bad, NULL, 0);
    af_free(u);
    af_free(t);
    af_free(good);
    af_free(bad);
    return 0;
}

static int teardown(void **state) {
    free(g_pipe);
    free(g_good);
    free(g_bad);
    return ar_teardown_dir(state);
}

static lk_status fuse(const char *ad, double strength, const char *out) {
    lk_fuse_input in = {ad, strength, LK_FORMAT_AUTO};
    return lk_fuse_file(g_pipe, &in, 1, out, NULL, NULL);
}

/* Digest of out/rel. */
static void digest(const char *out, const char *rel, char hex[LK_DIGEST_HEX]) {
    char *p = at(out, rel);
    lk_st *st;
    if (lk_st_open(p, &st)) fail_msg("%s", lk_last_error());
    assert_int_equal(lk_digest_st(st, hex), LK_OK);
    lk_st_close(st);
    free(p);
}

/* No temporary of anyone's output left in ar_dir. */
static void no_temporaries(void) {
    DIR *d = opendir(ar_dir);
    assert_non_null(d);
    for (struct dirent *e; (e = readdir(d));)
        if (strstr(e->d_name, "lorakit-tmp") || strstr(e->d_name, ".tmp.")) fail_msg("left behind: %s", e->d_name);
    closedir(d);
}

static void test_replace_and_refuse(void **state) {
    (void)state;
    char *out = at(ar_dir, "out");
    char first[LK_DIGEST_HEX], second[LK_DIGEST_HEX], te[LK_DIGEST_HEX], clean[LK_DIGEST_HEX];
    digest(g_pipe, "unet/diffusion_pytorch_model.safetensors", clean);
    if (fuse(g_good, 1.0, out)) fail_msg("%s", lk_last_error());
    digest(out, "unet/diffusion_pytorch_model.safetensors", first);
    assert_string_not_equal(first, clean);
    char *rec = at(out, ".lorakit-output"), *text = tu_read_file(rec, NULL);
    assert_non_null(text); /* every file and folder, by relative path */
    tu_assert_contains(text, "\"tokenizer/extra/merges.txt\"");
    tu_assert_contains(text, "\"unet/diffusion_pytorch_model.safetensors\"");
    tu_assert_contains(text, "\"tokenizer/extra\"");
    free(text);
    /* an earlier lorakit output: replaced whole */
    if (fuse(g_good, 0.5, out)) fail_msg("replacing an earlier pipeline output: %s", lk_last_error());
    digest(out, "unet/diffusion_pytorch_model.safetensors", second);
    digest(out, "text_encoder/model.safetensors", te);
    assert_string_not_equal(second, first);
    no_temporaries();
    /* the second component fails after the first was written: nothing changes, nothing is left */
    assert_int_equal(fuse(g_bad, 1.0, out), LK_ERR_NONFINITE);
    tu_assert_contains(lk_last_error(), "text_model.encoder.layers.0.self_attn.q_proj.weight");
    char now[LK_DIGEST_HEX];
    digest(out, "unet/diffusion_pytorch_model.safetensors", now);
    assert_string_equal(now, second);
    digest(out, "text_encoder/model.safetensors", now);
    assert_string_equal(now, te);
    no_temporaries();
    char *fresh = at(ar_dir, "fresh");
    assert_int_equal(fuse(g_bad, 1.0, fresh), LK_ERR_NONFINITE);
    assert_false(tu_exists(fresh));
    no_temporaries();
    /* anything of the user's in it: refused by name, nothing changed */
    char *sched = at(out, "tokenizer");
    af_write_text(sched, "mine.txt", "x\n");
    assert_int_equal(fuse(g_good, 1.0, out), LK_ERR_ARG);
    tu_assert_contains(lk_last_error(), "holds tokenizer/mine.txt, which lorakit did not write there");
    char *mine = at(sched, "mine.txt");
    assert_int_equal(unlink(mine), 0);
    char *dir = at(out, "unet/mine");
    assert_int_equal(mkdir(dir, 0755), 0);
    assert_int_equal(fuse(g_good, 1.0, out), LK_ERR_ARG);
    tu_assert_contains(lk_last_error(), "holds the folder unet/mine, which lorakit did not make there");
    assert_int_equal(rmdir(dir), 0);
    digest(out, "unet/diffusion_pytorch_model.safetensors", now);
    assert_string_equal(now, second);
    /* a folder lorakit did not write; an empty one is fine */
    char *user = at(ar_dir, "user");
    assert_int_equal(mkdir(user, 0755), 0);
    af_write_text(user, "notes.txt", "mine\n");
    assert_int_equal(fuse(g_good, 1.0, user), LK_ERR_ARG);
    tu_assert_contains(lk_last_error(), "was not written by lorakit");
    char *empty = at(ar_dir, "empty");
    assert_int_equal(mkdir(empty, 0755), 0);
    if (fuse(g_good, 1.0, empty)) fail_msg("an empty folder: %s", lk_last_error());
    digest(empty, "unet/diffusion_pytorch_model.safetensors", now);
    assert_string_equal(now, first);
    /* the base itself, a folder holding it, one inside it: refused, the base untouched */
    assert_int_equal(fuse(g_good, 1.0, g_pipe), LK_ERR_ARG);
    tu_assert_contains(lk_last_error(), "is the input pipeline folder");
    char slash[600];
    snprintf(slash, sizeof slash, "%s/", g_pipe);
    assert_int_equal(fuse(g_good, 1.0, slash), LK_ERR_ARG);
    tu_assert_contains(lk_last_error(), "is the input pipeline folder");
    assert_int_equal(fuse(g_good, 1.0, ar_dir), LK_ERR_ARG);
    tu_assert_contains(lk_last_error(), "holds the input pipeline folder");
    char *inside = at(g_pipe, "fused");
    assert_int_equal(fuse(g_good, 1.0, inside), LK_ERR_ARG);
    tu_assert_contains(lk_last_error(), "is inside the input pipeline folder");
    assert_false(tu_exists(inside));
    digest(g_pipe, "unet/diffusion_pytorch_model.safetensors", now);
    assert_string_equal(now, clean);
    /* a link to a folder is not followed */
    char *link = at(ar_dir, "link");
    assert_int_equal(symlink(out, link), 0);
    assert_int_equal(fuse(g_good, 1.0, link), LK_ERR_ARG);
    tu_assert_contains(lk_last_error(), "symbolic link");
    no_temporaries();
    free(link);
    free(inside);
    free(empty);
    free(user);
    free(dir);
    free(mine);
    free(sched);
    free(fresh);
    free(rec);
    free(out);
}

int main(void) {
    lk_log_set_level(LK_LOG_ERROR);
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_replace_and_refuse)};
    return cmocka_run_group_tests(tests, setup, teardown);
}
