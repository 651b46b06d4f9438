/* fuzz_family.c — libFuzzer target: model-family name tables (the
 * .lkmap format of data/families, also what `--map FILE` reads;
 * src/adapter/family.c).
 *
 * The input is a table's text, parsed from memory (not NUL-terminated). An
 * accepted table has at least one rule, valid patterns on both sides and
 * row fractions 0 <= a/b < c/d <= 1; a refusal is a clean error. One
 * accepted input in four is also written to a scratch file and used as a
 * --map table over a small fixed model (lk_layout_build), and a few names
 * are looked up: every hit must name a model key and carry fractions the
 * table allowed. */
#include "fuzz_common.h"
#include "adapter/layout.h"

static const char *const fz_family_keys[] = {"model.diffusion_model.double_blocks.0.img_attn.qkv.weight",
                                             "transformer_blocks.0.attn.to_q.weight", "blk.3.wqkv.weight",
                                             "input_blocks.1.1.proj_in.weight", "norm.scale"};

static int fz_frac_ok(const lk_frac *f) {
    return f->d0 >= 1 && f->d1 >= 1 && f->n0 >= 0 && f->n0 <= f->d0 && f->n1 <= f->d1 && f->n0 * f->d1 < f->n1 * f->d0;
}

static void fz_family(const uint8_t *data, size_t size) {
    lk_family f;
    lk_status s = lk_family_parse((const char *)data, size, "fuzz.lkmap", 0, &f);
    if (s != LK_OK) {
        fz_clean_error(s);
        return;
    }
    FZ_CHECK(f.n_rules >= 1 && f.rules != NULL);
    for (size_t i = 0; i < f.n_rules; i++) {
        FZ_CHECK(f.rules[i].orig && f.rules[i].orig[0] && f.rules[i].diff && f.rules[i].diff[0]);
        FZ_CHECK(fz_frac_ok(&f.rules[i].orig_rows) && fz_frac_ok(&f.rules[i].diff_rows));
        FZ_CHECK(f.rules[i].line >= 1);
    }
    for (size_t i = 0; i < f.n_detect; i++) fz_touch(f.detect[i], strlen(f.detect[i]));
    lk_family_free(&f);
    if ((size & 3) != 0) return;
    const char *path = fz_write_tmp("map.lkmap", data, size);
    lk_tensor model[5];
    for (size_t i = 0; i < 5; i++)
        model[i] = (lk_tensor){.name = fz_family_keys[i], .dtype = LK_DTYPE_F32, .ndim = 2, .shape = {12, 4}};
    const char *maps[] = {path};
    lk_layout_opts o = {"none", maps, 1};
    lk_layout l;
    s = lk_layout_build(model, 5, &o, "fuzz", &l);
    if (s != LK_OK) {
        fz_clean_error(s);
        return;
    }
    static const char *const q[] = {"transformer_blocks.0.attn.to_q", "double_blocks.0.img_attn.qkv", "layers.3.q",
                                    "down_blocks.0.attentions.0.proj_in", "blk_3_wqkv"};
    for (size_t i = 0; i < 5; i++) {
        size_t hits[8];
        size_t n = lk_layout_find(&l, q[i], i == 4, LK_COMP_ANY, hits, 8);
        for (size_t k = 0; k < n && k < 8; k++) {
            const lk_alias *a = &l.al[hits[k]];
            FZ_CHECK(a->key < 5 && (a->level == 1 || a->level == 2));
            FZ_CHECK(fz_frac_ok(&a->w) && fz_frac_ok(&a->m));
        }
    }
    lk_layout_free(&l);
}

LK_FUZZ_MAIN(fz_family)
