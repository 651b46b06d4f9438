/* test_layouts.c — one adapter on every checkpoint layout (README "Model
 * families and layouts"): wrapper prefixes on both sides, kohya's underscore
 * names under every prefix, ComfyUI / SimpleTuner (lycoris_) / diffusers
 * training-script / PEFT adapter-name layouts, the family tables (SD 1.x,
 * SDXL, Flux) with fused q,k,v row slices both ways, pipeline components,
 * and every error (ambiguity, overlapping table rows, unknown table keys,
 * unknown --arch).
 *
 * Oracles: the tiny models are written twice, in diffusers layout and in the
 * original (BFL / LDM) layout built from the same bytes by concatenating rows
 * as the published mapping says (diffusers' convert_flux_transformer_
 * checkpoint_to_diffusers: qkv = [q; k; v], linear1 = [q; k; v; mlp],
 * adaLN_modulation = [shift; scale] where diffusers has [scale; shift]);
 * the fused diffusers-layout weights are checked element by element against
 * ar_check_fused's double reference W + s (alpha / r) B A (1 ulp), and the
 * fused original-layout rows must equal the fused split weights byte for
 * byte. Targets are checked against names written here by hand. */
#include "adapter_ref.h"
#include "adapter/layout.h"
#include "core/file.h"
#include "lorakit/alloc.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define H 8   /* Flux hidden size */
#define R 4   /* LoRA rank */

#define g_dir ar_dir
static tu_rng g_rng = {4242};

static char *save(af_file *f, const char *name) {
    char *p = tu_path(g_dir, name);
    af_save(f, p, NULL, 0);
    return p;
}

/* ---- a tiny Flux in both layouts ---- */

typedef struct piece {
    const char *diff; /* diffusers name (without .weight) */
    int64_t rows, cols;
} piece;

/* Diffusers layout: one double block, one single block, norm_out. */
static const piece g_flux[] = {
    {"transformer_blocks.0.attn.to_q", H, H},        {"transformer_blocks.0.attn.to_k", H, H},
    {"transformer_blocks.0.attn.to_v", H, H},        {"transformer_blocks.0.attn.add_q_proj", H, H},
    {"transformer_blocks.0.attn.add_k_proj", H, H},  {"transformer_blocks.0.attn.add_v_proj", H, H},
    {"transformer_blocks.0.attn.to_out.0", H, H},    {"single_transformer_blocks.0.attn.to_q", H, H},
    {"single_transformer_blocks.0.attn.to_k", H, H}, {"single_transformer_blocks.0.attn.to_v", H, H},
    {"single_transformer_blocks.0.proj_mlp", 4 * H, H}, {"single_transformer_blocks.0.proj_out", H, 5 * H},
    {"norm_out.linear", 2 * H, H},
    {"x_embedder", H, H}, /* with the qkv / proj_mlp, what flux.lkmap's detect lines need */
};
#define N_FLUX (sizeof g_flux / sizeof g_flux[0])

/* The original (BFL) weights: name and its pieces' (index, rows from) in order. */
typedef struct fused {
    const char *orig;
    int parts[4];
    int64_t from[4]; /* rows of the diffusers piece taken (norm_out: halves swapped) */
    int64_t take[4];
    int n;
} fused;
static const fused g_bfl[] = {
    {"double_blocks.0.img_attn.qkv", {0, 1, 2}, {0, 0, 0}, {H, H, H}, 3},
    {"double_blocks.0.txt_attn.qkv", {3, 4, 5}, {0, 0, 0}, {H, H, H}, 3},
    {"double_blocks.0.img_attn.proj", {6}, {0}, {H}, 1},
    {"single_blocks.0.linear1", {7, 8, 9, 10}, {0, 0, 0, 0}, {H, H, H, 4 * H}, 4},
    {"single_blocks.0.linear2", {11}, {0}, {H}, 1},
    {"final_layer.adaLN_modulation.1", {12, 12}, {H, 0}, {H, H}, 2},
    {"img_in", {13}, {0}, {H}, 1},
};
#define N_BFL (sizeof g_bfl / sizeof g_bfl[0])

static char *wname(const char *prefix, const char *m) {
    static char buf[8][256];
    static int k;
    k = (k + 1) % 8;
    snprintf(buf[k], sizeof buf[k], "%s%s.weight", prefix, m);
    return buf[k];
}

/* "<pre><name with '.' as '_'>" (kohya's spelling), in one of four buffers. */
static const char *kohya(const char *pre, const char *name) {
    static char buf[4][256];
    static int k;
    k = (k + 1) % 4;
    snprintf(buf[k], sizeof buf[k], "%s%s", pre, name);
    for (char *c = buf[k] + strlen(pre); *c; c++)
        if (*c == '.') *c = '_';
    return buf[k];
}

static af_file *flux_diffusers(lk_dtype dt) {
    af_file *m = af_new();
    for (size_t i = 0; i < N_FLUX; i++)
        af_rand(m, wname("", g_flux[i].diff), dt, g_flux[i].rows, g_flux[i].cols, &g_rng, -1, 1);
    return m;
}

/* The same weights under BFL names (with ComfyUI's prefix). */
static af_file *flux_bfl(af_file *d, const char *prefix, lk_dtype dt) {
    af_file *m = af_new();
    size_t es = lk_dtype_size(dt);
    for (size_t f = 0; f < N_BFL; f++) {
        int64_t rows = 0, cols = g_flux[g_bfl[f].parts[0]].cols;
        for (int k = 0; k < g_bfl[f].n; k++) rows += g_bfl[f].take[k];
        lk_tensor *t = af_rand(m, wname(prefix, g_bfl[f].orig), dt, rows, cols, &g_rng, -1, 1);
        char *p = t->data;
        for (int k = 0; k < g_bfl[f].n; k++) {
            const lk_tensor *src = af_get(d, wname("", g_flux[g_bfl[f].parts[k]].diff));
            size_t rb = (size_t)cols * es;
            memcpy(p, (char *)src->data + (size_t)g_bfl[f].from[k] * rb, (size_t)g_bfl[f].take[k] * rb);
            p += (size_t)g_bfl[f].take[k] * rb;
        }
    }
    return m;
}

/* Copies of a file's tensors (fused in place, the original kept). */
static lk_tensor *copy_tensors(const af_file *f) {
    lk_tensor *t = calloc(f->n, sizeof *t);
    for (size_t i = 0; i < f->n; i++) {
        t[i] = f->t[i];
        t[i].data = malloc(t[i].nbytes);
        memcpy(t[i].data, f->t[i].data, t[i].nbytes);
    }
    return t;
}

static void free_tensors(lk_tensor *t, size_t n) {
    for (size_t i = 0; i < n; i++) free(t[i].data);
    free(t);
}

static lk_tensor *find(lk_tensor *t, size_t n, const char *name) {
    for (size_t i = 0; i < n; i++)
        if (!strcmp(t[i].name, name)) return &t[i];
    fail_msg("no tensor %s", name);
    return NULL;
}

/* Frees both layouts of a model and their fused copies. */
static void free_layouts(af_file *d, lk_tensor *D, af_file *o, lk_tensor *O) {
    free_tensors(D, d->n);
    free_tensors(O, o->n);
    af_free(d);
    af_free(o);
}

static void fuse_ok(lk_tensor *t, size_t n, const char *adapter, float strength) {
    lk_fuse_input in = {adapter, strength, LK_FORMAT_AUTO};
    lk_fuse_file_opts o = {.fuse.threads = 1};
    if (lk_fuse_tensors(t, n, &in, 1, &o, NULL)) fail_msg("fuse %s: %s", adapter, lk_last_error());
}

/* The fused original-layout rows equal the fused diffusers-layout pieces. */
static void check_same_rows(lk_tensor *D, size_t nd, lk_tensor *O, size_t no, const char *prefix) {
    for (size_t f = 0; f < N_BFL; f++) {
        const lk_tensor *o = find(O, no, wname(prefix, g_bfl[f].orig));
        size_t rb = (size_t)o->shape[1] * lk_dtype_size(o->dtype), at = 0;
        for (int k = 0; k < g_bfl[f].n; k++) {
            const lk_tensor *d = find(D, nd, wname("", g_flux[g_bfl[f].parts[k]].diff));
            size_t nb = (size_t)g_bfl[f].take[k] * rb;
            if (memcmp((char *)o->data + at, (char *)d->data + (size_t)g_bfl[f].from[k] * rb, nb))
                fail_msg("%s rows %zu.. differ from the fused %s", o->name, at / rb, d->name);
            at += nb;
        }
    }
}

/* A diffusers Flux LoRA on some of the split weights. */
static const char *const g_lora_mods[] = {"transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_v",
                                          "transformer_blocks.0.attn.add_k_proj",
                                          "single_transformer_blocks.0.attn.to_k",
                                          "single_transformer_blocks.0.proj_mlp", "single_transformer_blocks.0.proj_out",
                                          "norm_out.linear"};
#define N_LORA (sizeof g_lora_mods / sizeof g_lora_mods[0])

static const piece *flux_piece(const char *m) {
    for (size_t i = 0; i < N_FLUX; i++)
        if (!strcmp(g_flux[i].diff, m)) return &g_flux[i];
    return NULL;
}

/* Writes the LoRA with key names "<pre><m><sa>" / "<pre><m><sb>" (+ alpha). */
static af_file *flux_lora(const char *pre, const char *sa, const char *sb, const char *salpha, double alpha) {
    af_file *a = af_new();
    char k[512];
    for (size_t i = 0; i < N_LORA; i++) {
        const piece *p = flux_piece(g_lora_mods[i]);
        snprintf(k, sizeof k, "%s%s%s", pre, g_lora_mods[i], sa);
        af_rand(a, k, LK_DTYPE_F32, R, p->cols, &g_rng, -1, 1);
        snprintf(k, sizeof k, "%s%s%s", pre, g_lora_mods[i], sb);
        af_rand(a, k, LK_DTYPE_F32, p->rows, R, &g_rng, -1, 1);
        if (salpha) {
            snprintf(k, sizeof k, "%s%s%s", pre, g_lora_mods[i], salpha);
            af_scalar(a, k, LK_DTYPE_F32, alpha);
        }
    }
    return a;
}

/* Every fused diffusers weight against the double reference. */
static void check_reference(lk_tensor *D, size_t nd, const af_file *base, const af_file *lora, const char *pre,
                            const char *sa, const char *sb, double scale) {
    char ka[512], kb[512];
    for (size_t i = 0; i < N_LORA; i++) {
        snprintf(ka, sizeof ka, "%s%s%s", pre, g_lora_mods[i], sa);
        snprintf(kb, sizeof kb, "%s%s%s", pre, g_lora_mods[i], sb);
        ar_term t = {af_get((af_file *)lora, ka), af_get((af_file *)lora, kb), scale};
        const lk_tensor *d = find(D, nd, wname("", g_lora_mods[i]));
        const lk_tensor *w = af_get((af_file *)base, d->name);
        size_t bad = ar_check_fused(d->data, w->data, d->dtype, d->shape[0], d->shape[1], &t, 1);
        if (bad) fail_msg("%s: %zu elements off the reference", d->name, bad);
    }
}

/* diffusers LoRA (transformer.<m>.lora_A.weight, .alpha) onto a diffusers
 * Flux and onto the BFL single file (ComfyUI's prefix): q,k,v and the MLP
 * input land on rows of qkv / linear1, norm_out.linear on the swapped halves. */
static void test_flux_diffusers_lora(void **state) {
    (void)state;
    af_file *d = flux_diffusers(LK_DTYPE_BF16), *o = flux_bfl(d, "model.diffusion_model.", LK_DTYPE_BF16);
    af_file *l = flux_lora("transformer.", ".lora_A.weight", ".lora_B.weight", ".alpha", 2.0);
    char *lp = save(l, "flux_diffusers_lora.safetensors");
    lk_tensor *D = copy_tensors(d), *O = copy_tensors(o);
    fuse_ok(D, d->n, lp, 0.75f);
    fuse_ok(O, o->n, lp, 0.75f);
    check_reference(D, d->n, d, l, "transformer.", ".lora_A.weight", ".lora_B.weight", 0.75 * 2.0 / R);
    check_same_rows(D, d->n, O, o->n, "model.diffusion_model.");
    /* where each module landed, and by which rule */
    lk_adapter *a;
    assert_int_equal(lk_adapter_open(lp, LK_FORMAT_AUTO, &a), LK_OK);
    assert_int_equal(lk_adapter_resolve(a, o->t, o->n, 0, NULL), LK_OK);
    assert_string_equal(lk_adapter_family(a), "flux");
    const lk_adapter_placement *p;
    assert_int_equal(lk_adapter_placements(a, "model.diffusion_model.single_blocks.0.linear1.weight", &p), 2);
    assert_string_equal(p[0].module->module, "single_transformer_blocks.0.attn.to_k");
    assert_true(p[0].row0 == H && p[0].rows == H && !p[0].whole);
    assert_string_equal(p[1].module->module, "single_transformer_blocks.0.proj_mlp");
    assert_true(p[1].row0 == 3 * H && p[1].rows == 4 * H);
    tu_assert_contains(p[1].rule, "family flux (");
    assert_int_equal(lk_adapter_placements(a, "model.diffusion_model.final_layer.adaLN_modulation.1.weight", &p), 2);
    assert_true(p[0].row0 == 0 && p[0].b_row0 == H && p[1].row0 == H && p[1].b_row0 == 0);
    assert_null(lk_adapter_find_target(a, "model.diffusion_model.single_blocks.0.linear1.weight"));
    /* each allocation of that resolve failing in turn (all of them, an
     * early success does not end the walk): a clean LK_ERR_NOMEM with the
     * adapter still unresolved (no family, no placement), never a success
     * without the family's name (copied before the commit, which cannot
     * fail) nor another error (finding the tables' folder out of memory was
     * once "no tables", then LK_ERR_UNMATCHED) */
    lk_adapter *b;
    assert_int_equal(lk_adapter_open(lp, LK_FORMAT_AUTO, &b), LK_OK);
    lk_alloc_fail_at(0);
    assert_int_equal(lk_adapter_resolve(b, o->t, o->n, 0, NULL), LK_OK);
    const unsigned long n_alloc = lk_alloc_count();
    lk_adapter_free(b);
    unsigned long n_nomem = 0;
    for (unsigned long k = 1; k <= n_alloc; k++) {
        assert_int_equal(lk_adapter_open(lp, LK_FORMAT_AUTO, &b), LK_OK);
        lk_alloc_fail_at(k);
        lk_status s = lk_adapter_resolve(b, o->t, o->n, 0, NULL);
        lk_alloc_fail_at(0);
        if (s == LK_OK) {
            if (!lk_adapter_family(b)) fail_msg("allocation %lu failed, yet the resolve succeeded without a family", k);
            assert_string_equal(lk_adapter_family(b), "flux");
            assert_int_equal(lk_adapter_placement_count(b), lk_adapter_placement_count(a));
        } else {
            if (s != LK_ERR_NOMEM) fail_msg("allocation %lu: %s: %s", k, lk_status_str(s), lk_last_error());
            assert_null(lk_adapter_family(b));
            assert_int_equal(lk_adapter_placement_count(b), 0);
            n_nomem++;
        }
        lk_adapter_free(b);
    }
    assert_true(n_alloc > 100 && n_nomem == n_alloc);
    /* a tables' folder that is named but cannot be read is an error naming
     * it, with or without --arch; it was once a quiet resolve without the
     * tables, which here gave LK_ERR_UNMATCHED for the module names */
    char *nodir = tu_path(g_dir, "no_such_families_dir");
    lk_status st[2];
    char msg[2][512];
    int fam[2];
    assert_int_equal(setenv("LORAKIT_FAMILIES_DIR", nodir, 1), 0);
    for (int with_arch = 0; with_arch < 2; with_arch++) {
        assert_int_equal(lk_adapter_open(lp, LK_FORMAT_AUTO, &b), LK_OK);
        lk_resolve_opts ro = {.arch = with_arch ? "flux" : NULL};
        st[with_arch] = lk_adapter_resolve_opts(b, o->t, o->n, &ro, NULL);
        snprintf(msg[with_arch], sizeof msg[with_arch], "%s", lk_last_error());
        fam[with_arch] = lk_adapter_family(b) != NULL;
        lk_adapter_free(b);
    }
    unsetenv("LORAKIT_FAMILIES_DIR"); /* before any assert: the later tests use the shipped tables */
    for (int w = 0; w < 2; w++) {
        if (st[w] != LK_ERR_IO) fail_msg("arch %s: %s: %s", w ? "flux" : "NULL", lk_status_str(st[w]), msg[w]);
        tu_assert_contains(msg[w], "cannot read the family tables in ");
        tu_assert_contains(msg[w], "no_such_families_dir: No such file or directory");
        assert_false(fam[w]);
    }
    free(nodir);
    lk_adapter_free(a);
    free_layouts(d, D, o, O);
    af_free(l);
    free(lp);
}

/* A LoRA trained on the fused BFL weights (kohya names, as sd-scripts
 * writes for Flux) onto the diffusers layout: split by rows of B. The same
 * file on the BFL layout must give the same bytes. */
static void test_flux_fused_lora_on_split(void **state) {
    (void)state;
    af_file *d = flux_diffusers(LK_DTYPE_F32), *o = flux_bfl(d, "", LK_DTYPE_F32);
    af_file *l = af_new();
    char k[256];
    for (size_t f = 0; f < N_BFL; f++) {
        const lk_tensor *w = af_get(o, wname("", g_bfl[f].orig));
        const char *u = kohya("lora_unet_", g_bfl[f].orig);
        snprintf(k, sizeof k, "%s.lora_down.weight", u);
        af_rand(l, k, LK_DTYPE_F32, R, w->shape[1], &g_rng, -1, 1);
        snprintf(k, sizeof k, "%s.lora_up.weight", u);
        af_rand(l, k, LK_DTYPE_F32, w->shape[0], R, &g_rng, -1, 1);
        snprintf(k, sizeof k, "%s.alpha", u);
        af_scalar(l, k, LK_DTYPE_F32, 1.0);
    }
    char *lp = save(l, "flux_kohya_bfl.safetensors");
    lk_tensor *D = copy_tensors(d), *O = copy_tensors(o);
    fuse_ok(D, d->n, lp, 1.0f);
    fuse_ok(O, o->n, lp, 1.0f);
    check_same_rows(D, d->n, O, o->n, "");
    /* and the BFL layout itself against the reference */
    for (size_t f = 0; f < N_BFL; f++) {
        char ka[256], kb[256];
        snprintf(ka, sizeof ka, "%s.lora_down.weight", kohya("lora_unet_", g_bfl[f].orig));
        snprintf(kb, sizeof kb, "%s.lora_up.weight", kohya("lora_unet_", g_bfl[f].orig));
        ar_term t = {af_get(l, ka), af_get(l, kb), 1.0 / R};
        const lk_tensor *w = af_get(o, wname("", g_bfl[f].orig));
        const lk_tensor *fz = find(O, o->n, w->name);
        assert_int_equal(ar_check_fused(fz->data, w->data, w->dtype, w->shape[0], w->shape[1], &t, 1), 0);
    }
    free_layouts(d, D, o, O);
    af_free(l);
    free(lp);
}

/* The same LoRA in every adapter layout lands on the same weights with the
 * same bytes: PEFT with an adapter-name infix, SimpleTuner's lycoris_
 * names, ComfyUI's diffusion_model. + lora_down/lora_up/alpha, diffusers'
 * training-script names (lora.down / lora_linear_layer.down). */
static void test_flux_adapter_layouts(void **state) {
    (void)state;
    af_file *d = flux_diffusers(LK_DTYPE_F16), *o = flux_bfl(d, "model.diffusion_model.", LK_DTYPE_F16);
    af_file *ref = flux_lora("transformer.", ".lora_A.weight", ".lora_B.weight", ".alpha", 8.0);
    char *rp = save(ref, "layouts_ref.safetensors");
    lk_tensor *want = copy_tensors(d);
    fuse_ok(want, d->n, rp, 1.0f);
    check_reference(want, d->n, d, ref, "transformer.", ".lora_A.weight", ".lora_B.weight", 8.0 / R);
    static const struct {
        const char *pre, *sa, *sb, *salpha;
        int kohya;
    } lay[] = {
        {"base_model.model.", ".lora_A.my_adapter.weight", ".lora_B.my_adapter.weight", NULL, 0},
        {"lycoris_", ".lora_down.weight", ".lora_up.weight", ".alpha", 1},
        {"diffusion_model.", ".lora_down.weight", ".lora_up.weight", ".alpha", 0},
        {"transformer.", ".lora.down.weight", ".lora.up.weight", ".alpha", 0},
        {"transformer.", ".lora_linear_layer.down.weight", ".lora_linear_layer.up.weight", ".alpha", 0},
        {"lora_transformer_", ".lora_down.weight", ".lora_up.weight", ".alpha", 1},
    };
    for (size_t v = 0; v < sizeof lay / sizeof lay[0]; v++) {
        af_file *a = af_new();
        char k[512], m[256];
        for (size_t i = 0; i < ref->n; i++) { /* the reference's tensors renamed */
            const char *n = ref->t[i].name + strlen("transformer.");
            const char *suf = strstr(n, ".lora_A.weight") ? lay[v].sa : strstr(n, ".lora_B.weight") ? lay[v].sb
                                                                                                     : lay[v].salpha;
            if (!suf) continue; /* PEFT: alpha 8 = r 4 * 2 -> scale from the absent config: r; rescale below */
            size_t ml = (size_t)(strstr(n, ".lora_") ? strstr(n, ".lora_") - n : strstr(n, ".alpha") - n);
            snprintf(m, sizeof m, "%.*s", (int)ml, n);
            snprintf(k, sizeof k, "%s%s", lay[v].kohya ? kohya(lay[v].pre, m) : lay[v].pre, lay[v].kohya ? "" : m);
            strncat(k, suf, sizeof k - strlen(k) - 1);
            lk_tensor *t = af_rand(a, k, ref->t[i].dtype, ref->t[i].ndim ? ref->t[i].shape[0] : 1,
                                   ref->t[i].ndim ? ref->t[i].shape[1] : 1, &g_rng, 0, 1);
            t->ndim = ref->t[i].ndim;
            memcpy(t->data, ref->t[i].data, ref->t[i].nbytes);
        }
        char fn[64];
        snprintf(fn, sizeof fn, "layout%zu.safetensors", v);
        char *p = save(a, fn);
        for (int layout = 0; layout < 2; layout++) {
            af_file *base = layout ? o : d;
            lk_tensor *got = copy_tensors(base);
            /* PEFT without a config: alpha = r, so strength 2 gives the same scale 8 / 4 */
            fuse_ok(got, base->n, p, lay[v].salpha ? 1.0f : 2.0f);
            if (layout) check_same_rows(want, d->n, got, o->n, "model.diffusion_model.");
            else
                for (size_t i = 0; i < d->n; i++)
                    if (memcmp(got[i].data, want[i].data, got[i].nbytes))
                        fail_msg("%s: %s differs from the diffusers-format fuse", fn, got[i].name);
            free_tensors(got, base->n);
        }
        free(p);
        af_free(a);
    }
    free_tensors(want, d->n);
    free(rp);
    af_free(ref);
    af_free(d);
    af_free(o);
}

/* ---- SD 1.x / SDXL UNets and CLIP text encoders ---- */

static void expect_target(lk_adapter *a, const char *module, const char *target) {
    for (size_t i = 0; i < lk_adapter_count(a); i++) {
        const lk_lora_module *m = lk_adapter_module(a, i);
        if (strcmp(m->module, module)) continue;
        if (!m->target || strcmp(m->target, target))
            fail_msg("%s -> %s, expected %s", module, m->target ? m->target : "(none)", target);
        return;
    }
    fail_msg("module %s not found", module);
}

static void add_pair(af_file *a, const char *stem, const char *sa, const char *sb, int64_t out, int64_t in) {
    char k[512];
    snprintf(k, sizeof k, "%s%s", stem, sa);
    af_rand(a, k, LK_DTYPE_F32, R, in, &g_rng, -1, 1);
    snprintf(k, sizeof k, "%s%s", stem, sb);
    af_rand(a, k, LK_DTYPE_F32, out, R, &g_rng, -1, 1);
}

/* kohya, diffusers and ComfyUI SD LoRAs onto an LDM single file (UNet under
 * model.diffusion_model., CLIP under cond_stage_model.transformer.) and onto
 * the diffusers UNet: down_blocks.0.attentions.0 = input_blocks.1.1,
 * up_blocks.1.attentions.0 = output_blocks.3.1, mid_block.attentions.0 =
 * middle_block.1 (diffusers' convert_ldm_unet_checkpoint). */
static void test_sd1_layouts(void **state) {
    (void)state;
    static const char *const ldm[] = {"input_blocks.1.1.proj_in", "input_blocks.1.1.transformer_blocks.0.attn1.to_q",
                                      "output_blocks.3.1.proj_out", "middle_block.1.transformer_blocks.0.ff.net.2",
                                      "input_blocks.4.0.emb_layers.1"};
    static const char *const dif[] = {"down_blocks.0.attentions.0.proj_in",
                                      "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q",
                                      "up_blocks.1.attentions.0.proj_out", "mid_block.attentions.0.transformer_blocks.0.ff.net.2",
                                      "down_blocks.1.resnets.0.time_emb_proj"};
    af_file *single = af_new(), *unet = af_new();
    for (size_t i = 0; i < 5; i++) {
        char k[256];
        snprintf(k, sizeof k, "model.diffusion_model.%s.weight", ldm[i]);
        af_rand(single, k, LK_DTYPE_F16, 8, 8, &g_rng, -1, 1);
        af_rand(unet, wname("", dif[i]), LK_DTYPE_F16, 8, 8, &g_rng, -1, 1);
    }
    af_rand(single, "cond_stage_model.transformer.text_model.encoder.layers.0.self_attn.q_proj.weight", LK_DTYPE_F16,
            8, 8, &g_rng, -1, 1);
    char *sp = save(single, "sd1_single.safetensors");
    /* kohya */
    af_file *k = af_new();
    for (size_t i = 0; i < 5; i++) add_pair(k, kohya("lora_unet_", dif[i]), ".lora_down.weight", ".lora_up.weight", 8, 8);
    add_pair(k, "lora_te_text_model_encoder_layers_0_self_attn_q_proj", ".lora_down.weight", ".lora_up.weight", 8, 8);
    char *kp = save(k, "sd1_kohya.safetensors");
    lk_adapter *a;
    assert_int_equal(lk_adapter_open(kp, LK_FORMAT_AUTO, &a), LK_OK);
    assert_int_equal(lk_adapter_resolve(a, single->t, single->n, 0, NULL), LK_OK);
    for (size_t i = 0; i < 5; i++) expect_target(a, kohya("lora_unet_", dif[i]), wname("model.diffusion_model.", ldm[i]));
    expect_target(a, "lora_te_text_model_encoder_layers_0_self_attn_q_proj",
                  "cond_stage_model.transformer.text_model.encoder.layers.0.self_attn.q_proj.weight");
    assert_string_equal(lk_adapter_family(a), "sd1");
    /* the UNet alone: the text-encoder module is another component's (a warning, not an error) */
    size_t un = 99;
    assert_int_equal(lk_adapter_resolve(a, unet->t, unet->n, 0, &un), LK_OK);
    assert_int_equal(un, 1);
    expect_target(a, "lora_unet_down_blocks_0_attentions_0_proj_in", "down_blocks.0.attentions.0.proj_in.weight");
    lk_adapter_free(a);
    /* ComfyUI: diffusion_model.<LDM name>.lora_down / lora_up / alpha, on the diffusers UNet */
    af_file *c = af_new();
    for (size_t i = 0; i < 5; i++) {
        char s[256], al[300];
        snprintf(s, sizeof s, "diffusion_model.%s", ldm[i]);
        add_pair(c, s, ".lora_down.weight", ".lora_up.weight", 8, 8);
        snprintf(al, sizeof al, "%s.alpha", s);
        af_scalar(c, al, LK_DTYPE_F16, 2.0);
    }
    char *cp = save(c, "sd1_comfy.safetensors");
    assert_int_equal(lk_adapter_open(cp, LK_FORMAT_AUTO, &a), LK_OK);
    assert_int_equal(lk_adapter_get_format(a), LK_FORMAT_KOHYA);
    assert_int_equal(lk_adapter_resolve(a, unet->t, unet->n, 0, NULL), LK_OK);
    for (size_t i = 0; i < 5; i++) {
        char s[256];
        snprintf(s, sizeof s, "diffusion_model.%s", ldm[i]);
        expect_target(a, s, wname("", dif[i]));
    }
    assert_true(fabs(lk_adapter_module(a, 0)->scale - 2.0 / R) < 1e-12);
    assert_int_equal(lk_adapter_resolve(a, single->t, single->n, 0, NULL), LK_OK);
    expect_target(a, "diffusion_model.input_blocks.1.1.proj_in", "model.diffusion_model.input_blocks.1.1.proj_in.weight");
    lk_adapter_free(a);
    /* diffusers: unet.<m> and text_encoder.<m> onto the single file */
    af_file *df = af_new();
    for (size_t i = 0; i < 5; i++) {
        char s[256];
        snprintf(s, sizeof s, "unet.%s", dif[i]);
        add_pair(df, s, ".lora_A.weight", ".lora_B.weight", 8, 8);
    }
    add_pair(df, "text_encoder.text_model.encoder.layers.0.self_attn.q_proj", ".lora_A.weight", ".lora_B.weight", 8, 8);
    char *dp = save(df, "sd1_diffusers.safetensors");
    assert_int_equal(lk_adapter_open(dp, LK_FORMAT_AUTO, &a), LK_OK);
    assert_int_equal(lk_adapter_resolve(a, single->t, single->n, 0, NULL), LK_OK);
    expect_target(a, "text_encoder.text_model.encoder.layers.0.self_attn.q_proj",
                  "cond_stage_model.transformer.text_model.encoder.layers.0.self_attn.q_proj.weight");
    expect_target(a, dif[3], "model.diffusion_model.middle_block.1.transformer_blocks.0.ff.net.2.weight");
    lk_adapter_free(a);
    free(sp);
    free(kp);
    free(cp);
    free(dp);
    af_free(single);
    af_free(unet);
    af_free(k);
    af_free(c);
    af_free(df);
}

/* SDXL: no attention in down_blocks.0, so down_blocks.1.attentions.0 =
 * input_blocks.4.1 and up_blocks.0.attentions.0 = output_blocks.0.1; the
 * text encoders under conditioner.embedders.0 (lora_te1_). */
static void test_sdxl_layout(void **state) {
    (void)state;
    af_file *m = af_new();
    af_rand(m, "model.diffusion_model.label_emb.0.0.weight", LK_DTYPE_BF16, 8, 8, &g_rng, -1, 1);
    af_rand(m, "model.diffusion_model.input_blocks.4.1.transformer_blocks.1.attn2.to_k.weight", LK_DTYPE_BF16, 8, 8,
            &g_rng, -1, 1);
    af_rand(m, "model.diffusion_model.output_blocks.0.1.proj_out.weight", LK_DTYPE_BF16, 8, 8, &g_rng, -1, 1);
    af_rand(m, "conditioner.embedders.0.transformer.text_model.encoder.layers.0.mlp.fc1.weight", LK_DTYPE_BF16, 8, 8,
            &g_rng, -1, 1);
    /* the second text encoder in OpenCLIP's names: q, k, v fused in in_proj_weight */
    af_rand(m, "conditioner.embedders.1.model.transformer.resblocks.0.attn.in_proj_weight", LK_DTYPE_BF16, 24, 8, &g_rng,
            -1, 1);
    af_rand(m, "conditioner.embedders.1.model.transformer.resblocks.0.mlp.c_fc.weight", LK_DTYPE_BF16, 8, 8, &g_rng, -1,
            1);
    af_file *k = af_new();
    add_pair(k, "lora_unet_down_blocks_1_attentions_0_transformer_blocks_1_attn2_to_k", ".lora_down.weight",
             ".lora_up.weight", 8, 8);
    add_pair(k, "lora_unet_up_blocks_0_attentions_0_proj_out", ".lora_down.weight", ".lora_up.weight", 8, 8);
    add_pair(k, "lora_te1_text_model_encoder_layers_0_mlp_fc1", ".lora_down.weight", ".lora_up.weight", 8, 8);
    add_pair(k, "lora_te2_text_model_encoder_layers_0_mlp_fc1", ".lora_down.weight", ".lora_up.weight", 8, 8);
    add_pair(k, "lora_te2_text_model_encoder_layers_0_self_attn_k_proj", ".lora_down.weight", ".lora_up.weight", 8, 8);
    add_pair(k, "lora_te2_text_model_encoder_layers_0_self_attn_v_proj", ".lora_down.weight", ".lora_up.weight", 8, 8);
    char *kp = save(k, "sdxl_kohya.safetensors");
    lk_adapter *a;
    size_t un = 0;
    assert_int_equal(lk_adapter_open(kp, LK_FORMAT_AUTO, &a), LK_OK);
    assert_int_equal(lk_adapter_resolve(a, m->t, m->n, 0, &un), LK_OK);
    assert_string_equal(lk_adapter_family(a), "openclip,sdxl");
    expect_target(a, "lora_unet_down_blocks_1_attentions_0_transformer_blocks_1_attn2_to_k",
                  "model.diffusion_model.input_blocks.4.1.transformer_blocks.1.attn2.to_k.weight");
    expect_target(a, "lora_unet_up_blocks_0_attentions_0_proj_out",
                  "model.diffusion_model.output_blocks.0.1.proj_out.weight");
    expect_target(a, "lora_te1_text_model_encoder_layers_0_mlp_fc1",
                  "conditioner.embedders.0.transformer.text_model.encoder.layers.0.mlp.fc1.weight");
    assert_int_equal(un, 0);
    expect_target(a, "lora_te2_text_model_encoder_layers_0_mlp_fc1",
                  "conditioner.embedders.1.model.transformer.resblocks.0.mlp.c_fc.weight");
    const lk_adapter_placement *p;
    assert_int_equal(lk_adapter_placements(a, "conditioner.embedders.1.model.transformer.resblocks.0.attn.in_proj_weight",
                                           &p), 2);
    assert_string_equal(p[0].module->module, "lora_te2_text_model_encoder_layers_0_self_attn_k_proj");
    assert_true(p[0].row0 == 8 && p[0].rows == 8 && p[1].row0 == 16 && p[1].rows == 8);
    tu_assert_contains(p[1].rule, "kohya form, family openclip (");
    /* --arch picks a table by name; an unknown one names the folder and the tables */
    lk_resolve_opts ro = {.arch = "sd1"};
    assert_int_equal(lk_adapter_resolve_opts(a, m->t, m->n, &ro, NULL), LK_ERR_UNMATCHED);
    ro.arch = "no-such-family";
    assert_int_equal(lk_adapter_resolve_opts(a, m->t, m->n, &ro, NULL), LK_ERR_ARG);
    tu_assert_contains(lk_last_error(), "--arch no-such-family: no such family table in ");
    tu_assert_contains(lk_last_error(), "(available: ace-step15, auraflow, flux, flux2, hunyuan-video, krea2, ltx, lumina2, openclip, pixart, qwen-image, sd1, sd3, sdxl, stable-cascade, wan, z-image)");
    lk_adapter_free(a);
    free(kp);
    af_free(m);
    af_free(k);
}

/* ---- errors ---- */

/* Two weights with one kohya spelling, once a prefix is stripped. */
static void test_ambiguous_kohya(void **state) {
    (void)state;
    af_file *m = af_new();
    af_rand(m, "model.diffusion_model.blk.a_b.weight", LK_DTYPE_F32, 8, 8, &g_rng, -1, 1);
    af_rand(m, "model.diffusion_model.blk_a.b.weight", LK_DTYPE_F32, 8, 8, &g_rng, -1, 1);
    af_file *k = af_new();
    add_pair(k, "lora_unet_blk_a_b", ".lora_down.weight", ".lora_up.weight", 8, 8);
    char *kp = save(k, "ambiguous.safetensors");
    lk_adapter *a;
    assert_int_equal(lk_adapter_open(kp, LK_FORMAT_AUTO, &a), LK_OK);
    assert_int_equal(lk_adapter_resolve(a, m->t, m->n, 0, NULL), LK_ERR_FORMAT);
    tu_assert_contains(lk_last_error(), "ambiguous: matches both model weights model.diffusion_model.blk.a_b.weight "
                                        "and model.diffusion_model.blk_a.b.weight");
    lk_adapter_free(a);
    free(kp);
    af_free(m);
    af_free(k);
}

/* diffusers' old attention-processor LoRA format (LoRAAttnProcessor:
 * "<attn>.processor.to_q_lora.down.weight", no alpha): a UNet's to_q, to_k,
 * to_v, to_out_lora are to_q, to_k, to_v, to_out.0, a text encoder's
 * q_proj, k_proj, v_proj, out_proj (diffusers' UNET_TO_DIFFUSERS and
 * DIFFUSERS_OLD_TO_PEFT, ".processor." dropped). Expectation: W + B A, scale
 * 1 (alpha = rank), by the float64 formula. */
static void test_old_attn_processor_format(void **state) {
    (void)state;
    static const struct {
        const char *lora, *weight;
    } m[] = {
        {"unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.processor.to_q_lora",
         "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight"},
        {"unet.down_blocks.0.attentions.0.transformer_blocks.0.attn2.processor.to_v_lora",
         "down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_v.weight"},
        {"unet.mid_block.attentions.0.transformer_blocks.0.attn1.processor.to_out_lora",
         "mid_block.attentions.0.transformer_blocks.0.attn1.to_out.0.weight"},
        {"text_encoder.text_model.encoder.layers.0.self_attn.to_k_lora",
         "text_encoder.text_model.encoder.layers.0.self_attn.k_proj.weight"},
        {"text_encoder.text_model.encoder.layers.0.self_attn.to_out_lora",
         "text_encoder.text_model.encoder.layers.0.self_attn.out_proj.weight"},
    };
    enum { NM = sizeof m / sizeof m[0] };
    af_file *w = af_new(), *l = af_new();
    for (size_t i = 0; i < NM; i++) {
        af_rand(w, m[i].weight, LK_DTYPE_F32, 8, 8, &g_rng, -1, 1);
        add_pair(l, m[i].lora, ".down.weight", ".up.weight", 8, 8);
    }
    /* decoys the old names must not land on (the module is to_out.0, not to_out; q_proj, not to_k) */
    af_rand(w, "mid_block.attentions.0.transformer_blocks.0.attn1.to_out.weight", LK_DTYPE_F32, 8, 8, &g_rng, -1, 1);
    af_rand(w, "text_encoder.text_model.encoder.layers.0.self_attn.to_k.weight", LK_DTYPE_F32, 8, 8, &g_rng, -1, 1);
    char *lp = save(l, "old_attn.safetensors");
    lk_adapter *a;
    assert_int_equal(lk_adapter_open(lp, LK_FORMAT_AUTO, &a), LK_OK);
    assert_int_equal(lk_adapter_get_format(a), LK_FORMAT_DIFFUSERS);
    if (lk_adapter_resolve(a, w->t, w->n, 0, NULL)) fail_msg("%s", lk_last_error());
    lk_adapter_free(a);
    lk_tensor *F = copy_tensors(w);
    fuse_ok(F, w->n, lp, 1.0f);
    for (size_t i = 0; i < NM; i++) {
        char ka[256], kb[256];
        snprintf(ka, sizeof ka, "%s.down.weight", m[i].lora);
        snprintf(kb, sizeof kb, "%s.up.weight", m[i].lora);
        ar_term t = {af_get(l, ka), af_get(l, kb), 1.0};
        const lk_tensor *w0 = af_get(w, m[i].weight);
        assert_int_equal(ar_check_fused(find(F, w->n, m[i].weight)->data, w0->data, w0->dtype, 8, 8, &t, 1), 0);
    }
    for (size_t i = NM; i < w->n; i++) assert_memory_equal(F[i].data, w->t[i].data, w->t[i].nbytes);
    free_tensors(F, w->n);
    /* the same module in both namings: an error naming a key of each */
    add_pair(l, "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q", ".lora_A.weight", ".lora_B.weight", 8, 8);
    char *dp = save(l, "old_attn_dup.safetensors");
    assert_int_equal(lk_adapter_open(dp, LK_FORMAT_AUTO, &a), LK_ERR_FORMAT);
    tu_assert_contains(lk_last_error(), "attn1.processor.to_q_lora.down.weight'");
    tu_assert_contains(lk_last_error(), "attn1.to_q.lora_A.weight'");
    tu_assert_contains(lk_last_error(), "are the same module down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q");
    free(dp);
    free(lp);
    af_free(w);
    af_free(l);
}

/* A --map file: the user's own names, fused rows included; errors name
 * the file, line and key. */
static void test_map_file(void **state) {
    (void)state;
    af_write_text(g_dir, "mine.lkmap",
                  "lorakit-family 1\n# a user's model\nmap blk.#.wqkv layers.#.q 0/3:1/3 0/1:1/1\n"
                  "map blk.#.wqkv layers.#.k 1/3:2/3 0/1:1/1\nmap blk.#.wqkv layers.#.v 2/3:3/3 0/1:1/1\n");
    af_file *m = af_new();
    af_rand(m, "blk.3.wqkv.weight", LK_DTYPE_F32, 12, 8, &g_rng, -1, 1);
    af_file *l = af_new();
    add_pair(l, "layers.3.k", ".lora_A.weight", ".lora_B.weight", 4, 8);
    char *lp = save(l, "map_lora.safetensors"), *mp = tu_path(g_dir, "mine.lkmap");
    lk_adapter *a;
    assert_int_equal(lk_adapter_open(lp, LK_FORMAT_AUTO, &a), LK_OK);
    assert_int_equal(lk_adapter_resolve(a, m->t, m->n, 0, NULL), LK_ERR_UNMATCHED);
    const char *maps[] = {mp};
    lk_resolve_opts ro = {.maps = maps, .n_maps = 1};
    assert_int_equal(lk_adapter_resolve_opts(a, m->t, m->n, &ro, NULL), LK_OK);
    const lk_adapter_placement *p;
    assert_int_equal(lk_adapter_placements(a, "blk.3.wqkv.weight", &p), 1);
    assert_true(p->row0 == 4 && p->rows == 4);
    tu_assert_contains(p->rule, "--map (");
    tu_assert_contains(p->rule, "mine.lkmap:4)");
    lk_adapter_free(a);
    /* A --map that does not exist is an error even where every module lands
     * without it (it was silently unused: QA, issue 19). */
    af_file *e = af_new();
    af_rand(e, "layers.3.k.weight", LK_DTYPE_F32, 4, 8, &g_rng, -1, 1);
    assert_int_equal(lk_adapter_open(lp, LK_FORMAT_AUTO, &a), LK_OK);
    assert_int_equal(lk_adapter_resolve(a, e->t, e->n, 0, NULL), LK_OK);
    char *nop = tu_path(g_dir, "no-such.lkmap");
    const char *missing[] = {nop};
    lk_resolve_opts rm = {.maps = missing, .n_maps = 1};
    assert_int_not_equal(lk_adapter_resolve_opts(a, e->t, e->n, &rm, NULL), LK_OK);
    tu_assert_contains(lk_last_error(), "no-such.lkmap");
    lk_adapter_free(a);
    free(nop);
    af_free(e);
    /* '#last': the checkpoint's highest number there, whose rules replace
     * the '#' ones for that block only (SD3's last context norm); from
     * either side (hand-built model: blocks 0..2, each on both namings). */
    af_write_text(g_dir, "last.lkmap",
                  "lorakit-family 1\nmap blk.#.ada layers.#.mod\n"
                  "map blk.#last.ada layers.#last.mod 0/2:1/2 1/2:2/2\n"
                  "map blk.#last.ada layers.#last.mod 1/2:2/2 0/2:1/2\n");
    char *lastp = tu_path(g_dir, "last.lkmap");
    const char *lmaps[] = {lastp};
    lk_resolve_opts rl = {.maps = lmaps, .n_maps = 1, .arch = "none"};
    for (int side = 0; side < 2; side++) {
        af_file *mm = af_new(), *ll = af_new();
        for (int b = 0; b < 3; b++) {
            char kk[64];
            snprintf(kk, sizeof kk, side ? "layers.%d.mod.weight" : "blk.%d.ada.weight", b);
            af_rand(mm, kk, LK_DTYPE_F32, 8, 4, &g_rng, -1, 1);
            snprintf(kk, sizeof kk, side ? "blk.%d.ada" : "layers.%d.mod", b);
            add_pair(ll, kk, ".lora_A.weight", ".lora_B.weight", 8, 4);
        }
        char *llp = save(ll, "last_lora.safetensors");
        assert_int_equal(lk_adapter_open(llp, LK_FORMAT_AUTO, &a), LK_OK);
        if (lk_adapter_resolve_opts(a, mm->t, mm->n, &rl, NULL)) fail_msg("%s", lk_last_error());
        for (int b = 0; b < 3; b++) {
            char kk[64];
            snprintf(kk, sizeof kk, side ? "layers.%d.mod.weight" : "blk.%d.ada.weight", b);
            assert_int_equal(lk_adapter_placements(a, kk, &p), b == 2 ? 2 : 1);
            if (b < 2) {
                assert_true(p[0].whole);
                tu_assert_contains(p[0].rule, "last.lkmap:2)");
            } else { /* rows 0..4 are the module's rows 4..8 and back */
                assert_true(p[0].row0 == 0 && p[0].b_row0 == 4 && p[0].rows == 4);
                assert_true(p[1].row0 == 4 && p[1].b_row0 == 0 && p[1].rows == 4);
                tu_assert_contains(p[0].rule, "last.lkmap:");
                assert_null(strstr(p[0].rule, "last.lkmap:2)"));
            }
        }
        lk_adapter_free(a);
        free(llp);
        af_free(mm);
        af_free(ll);
    }
    free(lastp);
    static const struct {
        const char *text, *msg;
    } bad[] = {
        {"lorakit-family 1\nmap a.#last b.#\n", "bad.lkmap:2: 'a.#last' and 'b.#' have different '#' / '#last' / '*' parts"},
        {"lorakit-family 1\nmap a.#last.#last b.#last.#last\n", "bad.lkmap:2: 'a.#last.#last' is not a name pattern"},
        {"lorakit-family 1\nmapp a b\n", "bad.lkmap:2: unknown key 'mapp' (valid: lorakit-family, family, detect, map, alias)"},
        {"lorakit-family 1\nmap a.qkv b.q 0/2:1/2 0/1:1/1\nmap a.qkv b.k 1/3:2/3 0/1:1/1\n",
         "bad.lkmap:3: b.k and b.q (line 2) both land on overlapping rows of a.qkv"},
        {"lorakit-family 1\nmap a.# b\n", "bad.lkmap:2: 'a.#' and 'b' have different '#' / '#last' / '*' parts"},
        {"lorakit-family 1\nmap a b 1/2:1/2 0/1:1/1\n", "bad.lkmap:2: rows '1/2:1/2' '0/1:1/1'"},
        {"map a b\n", "bad.lkmap:1: a family table starts with 'lorakit-family 1'"},
        {"lorakit-family 1\n", "bad.lkmap: no 'map' lines"},
        {"lorakit-family 1\ndetect !a.weight\nmap a b\n", "bad.lkmap:2: 'detect' needs a key that must be present"},
        {"lorakit-family 1\ndetect a.weight b.#.weight\nmap a b\n", "bad.lkmap:2: detect key 'b.#.weight'"},
        {"lorakit-family 1\ndetect a.weight !!b\nmap a b\n", "bad.lkmap:2: detect key '!!b'"},
        /* an alias may overlap map lines (another spelling of their rows), but not repeat a line */
        {"lorakit-family 1\nmap a.qkv b.q 0/3:1/3 0/1:1/1\nalias a.qkv a.qk 0/3:2/3 0/1:1/1\n"
         "alias a.qkv a.qk 0/3:2/3 0/1:1/1\n", "bad.lkmap:4: rule repeats line 3 (a.qkv a.qk)"},
        {"lorakit-family 1\nalias a.# b\n", "bad.lkmap:2: 'a.#' and 'b' have different '#' / '#last' / '*' parts"},
        {"lorakit-family 1\nalias a\n", "bad.lkmap:2: 'alias' takes ORIG DIFF [ORIG_ROWS DIFF_ROWS]"},
    };
    { /* the overlap an alias line may have, parsed and kept as an alias; rows in lowest terms (0/6:4/6 is
       * 0/1:2/3), so two spellings of one row range are one placement */
        af_write_text(g_dir, "ok.lkmap", "lorakit-family 1\nmap a.qkv b.q 0/3:1/3 0/1:1/1\nalias a.qkv a.qk 0/6:4/6 0/1:1/1\n");
        char *op = tu_path(g_dir, "ok.lkmap");
        lk_family f;
        if (lk_family_load(op, 0, &f)) fail_msg("%s", lk_last_error());
        assert_int_equal(f.n_rules, 2);
        assert_true(!f.rules[0].alias && f.rules[1].alias);
        assert_true(f.rules[1].orig_rows.n0 == 0 && f.rules[1].orig_rows.d0 == 1);
        assert_true(f.rules[1].orig_rows.n1 == 2 && f.rules[1].orig_rows.d1 == 3);
        assert_true(f.rules[0].orig_rows.n0 == 0 && f.rules[0].orig_rows.d0 == 1);
        lk_family_free(&f);
        free(op);
    }
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        af_write_text(g_dir, "bad.lkmap", bad[i].text);
        char *bp = tu_path(g_dir, "bad.lkmap");
        lk_family f;
        assert_int_equal(lk_family_load(bp, 0, &f), LK_ERR_CONFIG);
        tu_assert_contains(lk_last_error(), bad[i].msg);
        free(bp);
    }
    free(lp);
    free(mp);
    af_free(m);
    af_free(l);
}

/* Every shipped table parses, and each maps its detect names. */
static void test_shipped_tables(void **state) {
    (void)state;
    char *dir;
    assert_int_equal(lk_family_dir(&dir), LK_OK);
    assert_non_null(dir);
    static const char *const names[] = {"flux", "openclip", "sd1", "sdxl"};
    for (size_t i = 0; i < 4; i++) {
        char f[64];
        snprintf(f, sizeof f, "%s.lkmap", names[i]);
        char *p = lk_path_join(dir, f);
        lk_family fam;
        if (lk_family_load(p, 1, &fam)) fail_msg("%s: %s", p, lk_last_error());
        assert_string_equal(fam.name, names[i]);
        assert_true(fam.n_detect >= 1 && fam.n_rules >= 8);
        lk_family_free(&fam);
        lk_free(p);
    }
    lk_free(dir);
}

/* inspect ADAPTER --base CKPT: every placement with its rows and rule, and
 * the nearest names of a module that lands nowhere. */
static void test_inspect_base(void **state) {
    (void)state;
    af_file *d = flux_diffusers(LK_DTYPE_F32), *o = flux_bfl(d, "model.diffusion_model.", LK_DTYPE_F32);
    af_file *l = flux_lora("transformer.", ".lora_A.weight", ".lora_B.weight", ".alpha", 4.0);
    add_pair(l, "transformer.transformer_blocks.0.attn.to_qq", ".lora_A.weight", ".lora_B.weight", H, H);
    char *lp = save(l, "inspect_lora.safetensors"), *bp = save(o, "inspect_bfl.safetensors");
    char *js = NULL;
    if (lk_inspect_base_json(lp, bp, NULL, &js)) fail_msg("%s", lk_last_error());
    tu_assert_contains(js, "\"family\":\"flux\"");
    tu_assert_contains(js, "\"modules_placed\":7,\"modules_unmatched\":1");
    tu_assert_contains(js, "{\"module\":\"single_transformer_blocks.0.proj_mlp\",\"component\":\"transformer\","
                           "\"algorithm\":\"lora\",\"rank\":4,"
                           "\"alpha\":4.0,\"alpha_source\":\".alpha tensor\",\"scale\":1.0,\"placements\":[{\"weight\":"
                           "\"model.diffusion_model.single_blocks.0.linear1.weight\",\"rule\":\"family flux (");
    tu_assert_contains(js, "\"whole\":false,\"rows\":[24,56],\"b_rows\":[0,32]}");
    /* the component its key routes to (its own "transformer." prefix; it was "any": QA, issue 19) */
    tu_assert_contains(js, "{\"module\":\"transformer_blocks.0.attn.to_qq\",\"component\":\"transformer\",\"nearest\":["
                           "\"model.diffusion_model.double_blocks.0.img_attn.qkv.weight\"");
    lk_free(js);
    lk_resolve_opts ro = {.arch = "sd1"};
    assert_int_equal(lk_inspect_base_json(lp, bp, &ro, &js), LK_OK); /* the wrong table: nothing placed */
    tu_assert_contains(js, "\"family\":\"sd1\",\"modules_placed\":0");
    lk_free(js);
    /* no prefix on the module: the component of the weight it lands on (the single file's diffusion model) */
    af_file *np = flux_lora("", ".lora_A.weight", ".lora_B.weight", NULL, 0.0);
    char *npp = save(np, "inspect_noprefix.safetensors");
    if (lk_inspect_base_json(npp, bp, NULL, &js)) fail_msg("%s", lk_last_error());
    tu_assert_contains(js, "{\"module\":\"single_transformer_blocks.0.proj_mlp\",\"component\":\"diffusion_model\",");
    assert_null(strstr(js, "\"component\":\"any\""));
    lk_free(js);
    free(npp);
    af_free(np);
    /* a pipeline folder as the base: each module with the component folder it lands in, its weights as
     * "<component>/<key>" (lycoris-lora's SDXL file: lora_te2_ on text_encoder_2/, lora_unet_ on unet/) */
    if (lk_inspect_base_json(LK_TEST_SRC_DIR "/tests/fixtures/layouts/sdxl_lora_kohya.safetensors",
                             LK_TEST_SRC_DIR "/tests/fixtures/layouts/sdxl_pipe", NULL, &js))
        fail_msg("%s", lk_last_error());
    tu_assert_contains(js, "\"family\":\"sdxl\",\"modules_placed\":190,\"modules_unmatched\":0");
    tu_assert_contains(js, "{\"module\":\"lora_te2_text_model_encoder_layers_0_self_attn_k_proj\",\"component\":"
                           "\"text_encoder_2\",\"algorithm\":\"lora\",\"rank\":4,\"alpha\":2.0,\"alpha_source\":"
                           "\".alpha tensor\",\"scale\":0.5,\"placements\":[{\"weight\":"
                           "\"text_encoder_2/text_model.encoder.layers.0.self_attn.k_proj.weight\"");
    tu_assert_contains(js, "{\"module\":\"lora_unet_down_blocks_1_attentions_0_proj_in\",\"component\":\"unet\",");
    tu_assert_contains(js, "\"weight\":\"unet/down_blocks.1.attentions.0.proj_in.weight\"");
    lk_free(js);
    af_file *pu = af_new();
    add_pair(pu, "unet.down_blocks.1.attentions.0.proj_in", ".lora_A.weight", ".lora_B.weight", 8, 8);
    add_pair(pu, "unet.down_blocks.1.attentions.0.proj_inn", ".lora_A.weight", ".lora_B.weight", 8, 8);
    char *pup = save(pu, "inspect_pipe.safetensors");
    if (lk_inspect_base_json(pup, LK_TEST_SRC_DIR "/tests/fixtures/layouts/sdxl_pipe", NULL, &js))
        fail_msg("%s", lk_last_error());
    tu_assert_contains(js, "\"modules_placed\":1,\"modules_unmatched\":1");
    tu_assert_contains(js, "{\"module\":\"down_blocks.1.attentions.0.proj_inn\",\"component\":\"unet\",\"nearest\":["
                           "\"unet/down_blocks.1.attentions.0.proj_in.weight\"");
    lk_free(js);
    free(pup);
    af_free(pu);
    /* kohya's lora_unet_ / lora_te_ (lycoris-lora's file) on an SD single file; diffusers' unet. on its UNet */
    static const struct {
        const char *lora, *base, *want[2];
    } fx[] = {
        {"sd1_lora_kohya", "sd1_single",
         {"{\"module\":\"lora_unet_down_blocks_0_attentions_0_proj_in\",\"component\":\"unet\",",
          "{\"module\":\"lora_te_encoder_layers_0_self_attn_k_proj\",\"component\":\"text_encoder\","}},
        {"sd1_lora_diffusers", "sd1_unet",
         {"{\"module\":\"down_blocks.0.attentions.0.proj_in\",\"component\":\"unet\",",
          "{\"module\":\"text_encoder.encoder.layers.0.self_attn.k_proj\",\"component\":\"text_encoder\","}},
    };
    for (size_t i = 0; i < sizeof fx / sizeof fx[0]; i++) {
        char a[512], b[512];
        snprintf(a, sizeof a, LK_TEST_SRC_DIR "/tests/fixtures/layouts/%s.safetensors", fx[i].lora);
        snprintf(b, sizeof b, LK_TEST_SRC_DIR "/tests/fixtures/layouts/%s.safetensors", fx[i].base);
        if (lk_inspect_base_json(a, b, NULL, &js)) fail_msg("%s", lk_last_error());
        for (int k = 0; k < 2; k++) tu_assert_contains(js, fx[i].want[k]);
        lk_free(js);
    }
    free(lp);
    free(bp);
    af_free(d);
    af_free(o);
    af_free(l);
}

/* ---- fixtures made by the real tools (tests/fixtures/layouts) ---- */

#define FIX LK_TEST_SRC_DIR "/tests/fixtures/layouts/"

/* Every tensor of a safetensors file, copied into memory (writable). */
static lk_tensor *load_all(const char *path, size_t *n) {
    lk_st *st;
    if (lk_st_open(path, &st)) fail_msg("%s: %s", path, lk_last_error());
    *n = lk_st_count(st);
    lk_tensor *t = calloc(*n, sizeof *t);
    for (size_t i = 0; i < *n; i++) {
        t[i] = *lk_st_tensor(st, i);
        t[i].name = strdup(t[i].name);
        t[i].data = malloc(t[i].nbytes ? t[i].nbytes : 1);
        if (lk_st_read(st, i, 0, t[i].data, t[i].nbytes)) fail_msg("%s: %s", path, lk_last_error());
    }
    lk_st_close(st);
    return t;
}

static void free_all(lk_tensor *t, size_t n) {
    for (size_t i = 0; i < n; i++) free((char *)t[i].name);
    free_tensors(t, n);
}

/* base fused with adapter: each weight of the expected file (F64, from
 * diffusers' own load + fuse in float64) within 1 ulp of F32, every other
 * tensor byte for byte the base's. Keys of the expectation the base lacks
 * (another component's) must be absent from it entirely. Returns the fused tensors. */
/* t (n tensors, fused) against orig (the same before) and the expectation
 * e: each expected weight within 1 ulp of F32, every other tensor byte for
 * byte the base's; with all_expected every expected key must be there (else
 * keys of another component, "text_encoder.", may be absent). */
static void check_fused_expected(const lk_tensor *t, const lk_tensor *orig, size_t n, const lk_tensor *e, size_t ne,
                           int all_expected, const char *adapter, const char *base) {
    size_t checked = 0;
    for (size_t i = 0; i < n; i++) {
        const lk_tensor *x = NULL;
        for (size_t k = 0; k < ne && !x; k++)
            if (!strcmp(e[k].name, t[i].name)) x = &e[k];
        if (!x) {
            if (memcmp(t[i].data, orig[i].data, t[i].nbytes)) fail_msg("%s: %s changed but diffusers leaves it", adapter, t[i].name);
            continue;
        }
        assert_int_equal(t[i].dtype, LK_DTYPE_F32);
        size_t bad = 0, numel = lk_tensor_numel(&t[i]);
        for (size_t j = 0; j < numel; j++) {
            double want = ((const double *)x->data)[j], got = ((const float *)t[i].data)[j];
            if (fabs(got - want) > ar_ulp(LK_DTYPE_F32, fabs(want)) && bad++ < 3)
                print_error("%s on %s: %s[%zu] = %.9g, diffusers %.17g\n", adapter, base, t[i].name, j, got, want);
        }
        if (bad) fail_msg("%s: %zu of %zu elements beyond 1 ulp", t[i].name, bad, numel);
        checked++;
    }
    size_t want_checked = 0;
    for (size_t k = 0; k < ne; k++) want_checked += all_expected || strncmp(e[k].name, "text_encoder.", 13) != 0;
    if (checked < want_checked) fail_msg("%s on %s: %zu of %zu expected weights found", adapter, base, checked, want_checked);
}

/* base fused with adapter: each weight of the expected file (F64, from
 * diffusers' own load + fuse in float64) within 1 ulp of F32, every other
 * tensor byte for byte the base's. Keys of the expectation the base lacks
 * (another component's) must be absent from it entirely. Returns the fused tensors. */
static lk_tensor *fuse_fixture(const char *base, const char *adapter, const char *expected, size_t *n) {
    size_t ne;
    lk_tensor *t = load_all(base, n), *orig = load_all(base, &ne), *e = load_all(expected, &ne);
    fuse_ok(t, *n, adapter, 1.0f);
    check_fused_expected(t, orig, *n, e, ne, 0, adapter, base);
    free_all(orig, ne == 0 ? 0 : *n);
    free_all(e, ne);
    return t;
}

/* Every tensor of a diffusers pipeline folder's unet/, text_encoder/ and
 * text_encoder_2/ files, named as make_layout_fixtures.py names them: the
 * UNet's as they are, a text encoder's "<component>." + its name. */
static lk_tensor *load_pipe(const char *dir, size_t *n) {
    static const char *const comp[][2] = {{"unet/diffusion_pytorch_model.safetensors", ""},
                                          {"text_encoder/model.safetensors", "text_encoder."},
                                          {"text_encoder_2/model.safetensors", "text_encoder_2."}};
    lk_tensor *all = NULL;
    *n = 0;
    for (size_t c = 0; c < 3; c++) {
        char p[700];
        snprintf(p, sizeof p, "%s/%s", dir, comp[c][0]);
        if (!tu_exists(p)) continue;
        size_t k;
        lk_tensor *t = load_all(p, &k);
        all = realloc(all, (*n + k) * sizeof *all);
        for (size_t i = 0; i < k; i++) {
            char *nm = malloc(strlen(comp[c][1]) + strlen(t[i].name) + 1);
            sprintf(nm, "%s%s", comp[c][1], t[i].name);
            free((char *)t[i].name);
            t[i].name = nm;
            all[*n + i] = t[i];
        }
        *n += k;
        free(t);
    }
    return all;
}

/* The pipeline folder pipe fused with adapter (lk_fuse_file, OUT a pipeline
 * folder): every expected weight (all components) within 1 ulp, every other
 * tensor unchanged; returns the fused output's tensors (load_pipe names). */
static lk_tensor *fuse_pipe_fixture(const char *pipe, const char *adapter, const char *expected, size_t *n) {
    char outd[600];
    static int k;
    snprintf(outd, sizeof outd, "%s/pipe_fixture_out%d", g_dir, k++);
    lk_fuse_input in = {adapter, 1.0f, LK_FORMAT_AUTO};
    lk_fuse_stats st;
    if (lk_fuse_file(pipe, &in, 1, outd, NULL, &st)) fail_msg("%s on %s: %s", adapter, pipe, lk_last_error());
    assert_int_equal(st.modules_unmatched, 0);
    size_t no, ne;
    lk_tensor *t = load_pipe(outd, n), *orig = load_pipe(pipe, &no), *e = load_all(expected, &ne);
    assert_int_equal(no, *n);
    for (size_t i = 0; i < no; i++) assert_string_equal(orig[i].name, t[i].name);
    check_fused_expected(t, orig, *n, e, ne, 1, adapter, pipe);
    free_all(orig, no);
    free_all(e, ne);
    return t;
}

/* Each adapter on both layouts of its model: within 1 ulp of diffusers'
 * float64 fuse, and the rows layout_map.txt pairs equal byte for byte
 * (a split weight's fuse == its row slice of the fused one). */
static void test_tool_fixtures(void **state) {
    (void)state;
    static const struct {
        const char *adapter, *diffusers, *single;
    } cs[] = {
        {"flux_lora_diffusers", "flux_diffusers", "flux_bfl"},
        {"flux_lora_kohya", "flux_diffusers", "flux_bfl"},
        {"sd1_lora_diffusers", "sd1_unet", "sd1_single"},
        {"sd1_lora_kohya", "sd1_unet", "sd1_single"},
        /* SDXL (UNet, CLIP, OpenCLIP in conditioner.embedders.1.model. with attn.in_proj_weight) and
         * SD 2.x (OpenCLIP in cond_stage_model.model.): diffusers pipeline folders (each component
         * saved by its library) and single files; LoRAs on the UNet and every text encoder */
        {"sdxl_lora_diffusers", "sdxl_pipe", "sdxl_single"},
        {"sdxl_lora_kohya", "sdxl_pipe", "sdxl_single"},
        /* the kohya file under sd-scripts' SDXL UNet names (lora_unet_input_blocks_4_1_...: the sdxl table) */
        {"sdxl_lora_kohyasgm", "sdxl_pipe", "sdxl_single"},
        /* the diffusers LoRA through diffusers' convert_state_dict_to_kohya (lora_te1_text_model_..., alpha r) */
        {"sdxl_lora_kohyaconv", "sdxl_pipe", "sdxl_single"},
        {"sd2_lora_diffusers", "sd2_pipe", "sd2_single"},
        {"sd2_lora_kohya", "sd2_pipe", "sd2_single"},
        /* the diffusers LoRA's attention factors in diffusers' old attention-processor names */
        {"sd2_lora_oldattn", "sd2_pipe", "sd2_single"},
    };
    size_t map_n;
    char *map = tu_read_file(FIX "layout_map.txt", &map_n);
    assert_non_null(map);
    for (size_t c = 0; c < sizeof cs / sizeof cs[0]; c++) {
        char ad[512], b1[512], b2[512], e1[512], e2[512];
        snprintf(ad, sizeof ad, FIX "%s.safetensors", cs[c].adapter);
        int pipe = strstr(cs[c].diffusers, "_pipe") != NULL;
        snprintf(b1, sizeof b1, FIX "%s%s", cs[c].diffusers, pipe ? "" : ".safetensors");
        snprintf(b2, sizeof b2, FIX "%s.safetensors", cs[c].single);
        snprintf(e1, sizeof e1, FIX "expected_%s_diffusers.safetensors", cs[c].adapter);
        snprintf(e2, sizeof e2, FIX "expected_%s_single.safetensors", cs[c].adapter);
        size_t nd, ns, pairs = 0, sliced = 0;
        lk_tensor *D = pipe ? fuse_pipe_fixture(b1, ad, e1, &nd) : fuse_fixture(b1, ad, e1, &nd);
        lk_tensor *S = fuse_fixture(b2, ad, e2, &ns);
        char *line = map, *save = NULL;
        char *copy = strdup(map);
        for (line = strtok_r(copy, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
            char a[128], dk[256], sk[256];
            long long r0, nr, sr;
            if (sscanf(line, "%127s %255s %lld %lld %255s %lld", a, dk, &r0, &nr, sk, &sr) != 6) fail_msg("%s", line);
            if (strcmp(a, cs[c].adapter) || (!pipe && !strncmp(dk, "text_encoder.", 13))) continue;
            const lk_tensor *d = find(D, nd, dk), *s1 = find(S, ns, sk);
            sliced += nr != s1->shape[0];
            size_t rb = (size_t)d->shape[1] * lk_dtype_size(d->dtype);
            if (memcmp((char *)d->data + (size_t)r0 * rb, (char *)s1->data + (size_t)sr * rb, (size_t)nr * rb))
                fail_msg("%s: %s rows %lld.. differ from %s rows %lld..", cs[c].adapter, dk, r0, sk, sr);
            pairs++;
        }
        assert_true(pairs > 0);
        if (pipe) assert_true(sliced >= 6); /* OpenCLIP's q, k, v: row slices of in_proj_weight */
        print_message("%s: both layouts within 1 ulp of diffusers, %zu row blocks equal (%zu slices)\n", cs[c].adapter,
                      pairs, sliced);
        free(copy);
        free_all(D, nd);
        free_all(S, ns);
    }
    free(map);
}

/* Saves tensors t[0..n) whose name starts with `from` as `to` + the rest. */
static void save_renamed(const lk_tensor *t, size_t n, const char *from, const char *to, const char *path) {
    lk_tensor *v = calloc(n, sizeof *v);
    char **names = calloc(n, sizeof *names);
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (strncmp(t[i].name, from, strlen(from))) continue;
        names[k] = malloc(strlen(to) + strlen(t[i].name) + 1);
        sprintf(names[k], "%s%s", to, t[i].name + strlen(from));
        v[k] = t[i];
        v[k].name = names[k];
        k++;
    }
    if (lk_st_save(path, v, k, NULL, 0)) fail_msg("%s: %s", path, lk_last_error());
    for (size_t i = 0; i < k; i++) free(names[i]);
    free(names);
    free(v);
}

/* A diffusers pipeline folder as the base: unet. / text_encoder. (and
 * lora_unet_ / lora_te_) modules go to their component folders, the output
 * is a pipeline folder of the same layout, each fused component within 1 ulp
 * of diffusers' float64 fuse (the fixtures above), the other files copied
 * byte for byte; a module that lands in no component fails with no OUT. */
static void test_pipeline_folder(void **state) {
    (void)state;
    size_t ns;
    lk_tensor *single = load_all(FIX "sd1_single.safetensors", &ns);
    char *pipe = tu_path(g_dir, "pipe");
    static const char *const dirs[] = {"", "/unet", "/text_encoder", "/scheduler"};
    for (size_t i = 0; i < 4; i++) {
        char d[600];
        snprintf(d, sizeof d, "%s%s", pipe, dirs[i]);
        assert_int_equal(mkdir(d, 0755), 0);
    }
    char p[700];
    snprintf(p, sizeof p, "%s/unet/diffusion_pytorch_model.safetensors", pipe);
    size_t nu;
    lk_tensor *unet = load_all(FIX "sd1_unet.safetensors", &nu);
    if (lk_st_save(p, unet, nu, NULL, 0)) fail_msg("%s", lk_last_error());
    snprintf(p, sizeof p, "%s/text_encoder/model.safetensors", pipe);
    save_renamed(single, ns, "cond_stage_model.transformer.", "", p); /* text_model.encoder... (transformers 4) */
    af_write_text(pipe, "model_index.json", "{\"_class_name\": \"StableDiffusionPipeline\", \"unet\": [\"diffusers\", "
                  "\"UNet2DConditionModel\"], \"text_encoder\": [\"transformers\", \"CLIPTextModel\"]}\n");
    snprintf(p, sizeof p, "%s/scheduler", pipe);
    af_write_text(p, "scheduler_config.json", "{\"num_train_timesteps\": 1000}\n");
    snprintf(p, sizeof p, "%s/unet", pipe);
    af_write_text(p, "config.json", "{\"layers_per_block\": 2}\n");
    static const char *const adapters[] = {"sd1_lora_diffusers", "sd1_lora_kohya"};
    for (size_t c = 0; c < 2; c++) {
        char ad[512], e1[512], outd[600];
        snprintf(ad, sizeof ad, FIX "%s.safetensors", adapters[c]);
        snprintf(e1, sizeof e1, FIX "expected_%s_diffusers.safetensors", adapters[c]);
        snprintf(outd, sizeof outd, "%s/out%zu", g_dir, c);
        lk_fuse_input in = {ad, 1.0, LK_FORMAT_AUTO};
        lk_fuse_stats st;
        if (lk_fuse_file(pipe, &in, 1, outd, NULL, &st)) fail_msg("pipeline fuse: %s", lk_last_error());
        assert_int_equal(st.modules_unmatched, 0);
        size_t ne, nf, nt;
        lk_tensor *e = load_all(e1, &ne);
        snprintf(p, sizeof p, "%s/unet/diffusion_pytorch_model.safetensors", outd);
        lk_tensor *fu = load_all(p, &nf);
        snprintf(p, sizeof p, "%s/text_encoder/model.safetensors", outd);
        lk_tensor *ft = load_all(p, &nt);
        size_t checked = 0;
        for (size_t k = 0; k < ne; k++) {
            const lk_tensor *g = NULL;
            char nm[512];
            if (!strncmp(e[k].name, "text_encoder.", 13)) {
                snprintf(nm, sizeof nm, "text_model.%s", e[k].name + 13);
                g = find(ft, nt, nm);
            } else {
                g = find(fu, nf, e[k].name);
            }
            for (size_t j = 0; j < lk_tensor_numel(g); j++) {
                double want = ((const double *)e[k].data)[j], got = ((const float *)g->data)[j];
                if (fabs(got - want) > ar_ulp(LK_DTYPE_F32, fabs(want))) fail_msg("%s[%zu]", g->name, j);
            }
            checked++;
        }
        assert_true(checked == ne && ne > 100);
        for (size_t f = 0; f < 3; f++) { /* copied byte for byte */
            static const char *const files[] = {"model_index.json", "scheduler/scheduler_config.json", "unet/config.json"};
            char a[700], b[700];
            snprintf(a, sizeof a, "%s/%s", pipe, files[f]);
            snprintf(b, sizeof b, "%s/%s", outd, files[f]);
            size_t na, nb;
            char *x = tu_read_file(a, &na), *y = tu_read_file(b, &nb);
            assert_non_null(y);
            assert_true(na == nb && !memcmp(x, y, na));
            free(x);
            free(y);
        }
        print_message("%s on a pipeline folder: %zu weights in unet/ and text_encoder/ within 1 ulp\n", adapters[c],
                      checked);
        free_all(e, ne);
        free_all(fu, nf);
        free_all(ft, nt);
    }
    /* a module for no component: refused, nothing written */
    af_file *bad = af_new();
    add_pair(bad, "unet.down_blocks.0.attentions.0.proj_in", ".lora_A.weight", ".lora_B.weight", 8, 8);
    add_pair(bad, "unet.no_such_block.proj", ".lora_A.weight", ".lora_B.weight", 8, 8);
    char *bp = save(bad, "pipe_bad.safetensors"), outd[600];
    snprintf(outd, sizeof outd, "%s/out_bad", g_dir);
    lk_fuse_input in = {bp, 1.0, LK_FORMAT_AUTO};
    assert_int_equal(lk_fuse_file(pipe, &in, 1, outd, NULL, NULL), LK_ERR_UNMATCHED);
    tu_assert_contains(lk_last_error(), "no_such_block.proj matches no weight in any component of");
    assert_false(tu_exists(outd));
    /* Running out of memory while opening a component's checkpoint fails
     * the fuse (it is not "no checkpoint: copied", which with
     * allow_unmatched wrote the pipeline with that component unfused and
     * succeeded): each allocation up to the adapter's opening (the count of
     * a fuse whose adapter does not exist) failing in turn is
     * LK_ERR_NOMEM, with no output. */
    char ad[512], missing[600];
    snprintf(ad, sizeof ad, FIX "sd1_lora_kohya.safetensors");
    snprintf(missing, sizeof missing, "%s/no_such_adapter.safetensors", g_dir);
    snprintf(outd, sizeof outd, "%s/out_oom", g_dir);
    lk_fuse_file_opts fo = {0};
    fo.allow_unmatched = 1;
    lk_fuse_input miss = {missing, 1.0, LK_FORMAT_AUTO}, real = {ad, 1.0, LK_FORMAT_AUTO};
    lk_alloc_fail_at(0);
    assert_int_not_equal(lk_fuse_file(pipe, &miss, 1, outd, &fo, NULL), LK_OK);
    const unsigned long n_open = lk_alloc_count();
    for (unsigned long k = 1; k <= n_open; k++) {
        lk_alloc_fail_at(k);
        lk_status s = lk_fuse_file(pipe, &real, 1, outd, &fo, NULL);
        lk_alloc_fail_at(0);
        if (s != LK_ERR_NOMEM) fail_msg("allocation %lu of %lu: %s: %s", k, n_open, lk_status_str(s), lk_last_error());
        assert_false(tu_exists(outd));
    }
    assert_true(n_open > 10);
    print_message("pipeline: each of the %lu allocations that open its components failing: LK_ERR_NOMEM\n", n_open);
    /* unet/ holding two variants (diffusers repos ship .fp16 beside the
     * full file): not "no checkpoint: copied", which with allow_unmatched
     * wrote the pipeline with the UNet unfused and exit 0, but an error
     * naming the component and lk_ckpt_open's reason; nothing written */
    char variant[700];
    snprintf(variant, sizeof variant, "%s/unet/diffusion_pytorch_model.fp16.safetensors", pipe);
    if (lk_st_save(variant, unet, nu, NULL, 0)) fail_msg("%s", lk_last_error());
    for (int allow = 0; allow < 2; allow++) {
        fo.allow_unmatched = allow;
        assert_int_equal(lk_fuse_file(pipe, &real, 1, outd, &fo, NULL), LK_ERR_IO);
        tu_assert_contains(lk_last_error(), "whose unet checkpoint could not be opened: ");
        tu_assert_contains(lk_last_error(), "unet: the folder holds 2 checkpoints (diffusion_pytorch_model.fp16."
                                            "safetensors, diffusion_pytorch_model.safetensors)");
        assert_false(tu_exists(outd));
    }
    assert_int_equal(unlink(variant), 0);
    free(bp);
    af_free(bad);
    free_all(single, ns);
    free_all(unet, nu);
    free(pipe);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_flux_diffusers_lora), cmocka_unit_test(test_flux_fused_lora_on_split),
        cmocka_unit_test(test_flux_adapter_layouts), cmocka_unit_test(test_sd1_layouts),
        cmocka_unit_test(test_sdxl_layout),         cmocka_unit_test(test_ambiguous_kohya),
        cmocka_unit_test(test_map_file),            cmocka_unit_test(test_shipped_tables),
        cmocka_unit_test(test_inspect_base),        cmocka_unit_test(test_tool_fixtures),
        cmocka_unit_test(test_pipeline_folder),     cmocka_unit_test(test_old_attn_processor_format),
    };
    return cmocka_run_group_tests(tests, ar_setup_dir, ar_teardown_dir);
}
