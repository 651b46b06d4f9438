/* test_family_fixtures.c — the SD3, Wan, HunyuanVideo and LTX family tables
 * (data/families/{sd3,wan,hunyuan-video,ltx}.lkmap) on tiny real models.
 *
 * Oracle: tests/fixtures/families/, made by make_family_fixtures.py from
 * diffusers 0.42 and peft 0.21: per family a random-init diffusers
 * transformer saved in diffusers layout and under its original single-file
 * names (fused q,k,v and HunyuanVideo's linear1 concatenated by rows; checked
 * there by running diffusers' own single-file converter on it, which must
 * give the diffusers weights back exactly), a LoRA saved by the pipeline's
 * save_lora_weights, and float64 expectations from diffusers' own LoRA load
 * on a float64 copy of the model followed by PEFT's merge, written under both
 * namings. F_rows.txt says which rows of each original weight are which rows
 * of a diffusers weight.
 *
 * Checks, per family:
 *  - the LoRA (diffusers names) fused into each layout: every changed tensor
 *    within 1 ulp of the float64 expectation, every other tensor
 *    byte-identical (ar_check_expected), and the fuse counts as many fused
 *    tensors as the expectation has;
 *  - the single-file fuse equals the diffusers-layout fuse byte for byte on
 *    every row pair of F_rows.txt (fused q,k,v slices = the split fuse);
 *  - the family detected from the original layout's keys is this family's
 *    table and no other shipped table's detect key matches (the one known
 *    exception is written out below), and a module landing on a fused weight
 *    does so through this family's table on its row slice. */
#include "adapter_ref.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lorakit/fuse.h"
#include "lorakit/weights.h"

#define FX LK_TEST_SRC_DIR "/tests/fixtures/families"

typedef struct fam {
    const char *name;
    /* lk_adapter_family on each layout: the family's own table; for
     * HunyuanVideo also flux, whose detect keys single_blocks.0.linear1.weight
     * and single_transformer_blocks.0.proj_mlp.weight HunyuanVideo has too
     * (both tables place those modules identically, so the fuse is the same:
     * single_blocks.0.linear1 gets q, k, v, proj_mlp through flux's rules) */
    const char *detected;
    const char *fused; /* an original weight that several diffusers modules share, or NULL */
    int n_fused;       /* how many modules of the LoRA land on it */
} fam;

static const fam g_fams[] = {
    {"sd3", "sd3", "model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight", 3},
    {"wan", "wan", NULL, 0},
    {"hunyuan-video", "flux,hunyuan-video", "double_blocks.0.img_attn_qkv.weight", 3},
    {"ltx", "ltx", NULL, 0},
};

static const char *fx(char *buf, size_t n, const char *pre, const char *name, const char *post) {
    snprintf(buf, n, FX "/%s%s%s", pre, name, post);
    return buf;
}

static void fuse_layout(const fam *f, const char *layout, char *out, size_t n_out) {
    char base[512], lora[512], exp[512], label[128];
    fx(base, sizeof base, "", f->name, layout[0] == 'd' ? "_diffusers.safetensors" : "_original.safetensors");
    fx(lora, sizeof lora, "", f->name, "_lora.safetensors");
    snprintf(label, sizeof label, "expected_%s_%s.safetensors", f->name, layout);
    fx(exp, sizeof exp, "", label, "");
    snprintf(out, n_out, "%s/%s_%s_out.safetensors", ar_dir, f->name, layout);
    lk_fuse_input in = {lora, 1.0f, LK_FORMAT_AUTO};
    lk_fuse_stats st;
    if (lk_fuse_file(base, &in, 1, out, NULL, &st)) fail_msg("%s on %s: %s", lora, base, lk_last_error());
    snprintf(label, sizeof label, "%s LoRA on the %s layout", f->name, layout);
    size_t changed;
    double worst = ar_check_expected(label, "diffusers' LoRA load + PEFT merge in float64", base, out, exp, &changed);
    assert_int_equal(st.tensors_fused, changed);
    assert_int_equal(st.modules_unmatched, 0);
    print_message("%-14s %-9s layout: %2zu tensors fused, worst %.3f ulp\n", f->name, layout, changed, worst);
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

/* Which tables the resolver picks from each layout's keys, and where the
 * modules of a fused weight land. */
static void check_detect(const fam *f) {
    /* (the diffusers LoRA on the diffusers layout matches by name: no table is consulted) */
    static const char *const layouts[] = {"_original.safetensors"};
    char base[512], lora[512];
    fx(lora, sizeof lora, "", f->name, "_lora.safetensors");
    for (int l = 0; l < 1; l++) {
        lk_weights *w;
        assert_int_equal(lk_weights_load(fx(base, sizeof base, "", f->name, layouts[l]), &w), LK_OK);
        lk_adapter *a;
        assert_int_equal(lk_adapter_open(lora, LK_FORMAT_AUTO, &a), LK_OK);
        lk_resolve_opts ro = {0};
        if (lk_adapter_resolve_opts(a, lk_weights_tensors(w), lk_weights_count(w), &ro, NULL))
            fail_msg("%s: %s", base, lk_last_error());
        const char *got = lk_adapter_family(a);
        if (!got || strcmp(got, f->detected))
            fail_msg("%s: family tables %s detected, expected %s", base, got ? got : "(none)", f->detected);
        if (f->fused) {
            const lk_adapter_placement *p;
            size_t n = lk_adapter_placements(a, f->fused, &p);
            assert_int_equal(n, f->n_fused);
            for (size_t i = 0; i < n; i++) {
                assert_false(p[i].whole);
                assert_true(p[i].rows > 0 && p[i].rows < get(w, f->fused, base)->shape[0]);
                char want[64];
                snprintf(want, sizeof want, "family %s (", f->name);
                tu_assert_contains(p[i].rule, want);
            }
        }
        lk_adapter_free(a);
        lk_weights_free(w);
    }
}

static void test_family(void **state) {
    const fam *f = *state;
    char out_d[512], out_o[512];
    fuse_layout(f, "diffusers", out_d, sizeof out_d);
    fuse_layout(f, "original", out_o, sizeof out_o);
    check_rows(f, out_d, out_o);
    check_detect(f);
    remove(out_d);
    remove(out_o);
}

#define FAM_TEST(i) cmocka_unit_test_prestate(test_family, (void *)&g_fams[i])

int main(void) {
    const struct CMUnitTest tests[] = {FAM_TEST(0), FAM_TEST(1), FAM_TEST(2), FAM_TEST(3)};
    return cmocka_run_group_tests(tests, ar_setup_dir, ar_teardown_dir);
}
