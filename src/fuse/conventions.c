/* conventions.c — where the four conventions (lorakit | comfyui | lycoris |
 * peft, README "Conventions") would give different weights for one adapter
 * file, and by how much, so `lorakit inspect` can say so before a fuse
 * (issue 29: "DoRA: comfyui and lycoris differ by up to X").
 *
 * The differences are computed, not predicted. The adapter is opened once
 * under each convention. With a base checkpoint, every weight the adapter
 * touches is fused four times at each compared strength (1 and a second one,
 * 0.5 by default: set_weight, DoRA's strength rule and OFT/BOFT differ only
 * at s != 1) by the fuse's own per-key plan (lk_fuse_key_plan /
 * lk_fuse_key_apply, as `lorakit fuse --convention C` writes it, in the
 * weight's dtype); the results are grouped by their bytes and each pair of
 * groups is measured in double: max |W_a - W_b| and the relative Frobenius
 * difference of the deltas ||W_a - W_b|| / max(||W_a - W||, ||W_b - W||).
 * A weight whose four plans are the same terms at the same scales, with no
 * DoRA, replacement or rotation (whose arithmetic reads the convention), is
 * the same bytes by construction and is not fused (a plain LoRA file costs
 * one plan per weight, not four fuses). FP8 weights are not compared
 * (listed in "not_compared"). A diffusers pipeline folder as the base is
 * compared as without one.
 * Without a base only what the file itself decides can be measured: a module
 * whose delta does not read the weight differs between conventions only by
 * its scale c, so the relative Frobenius difference of the deltas is
 * |c_a - c_b| / max(|c_a|, |c_b|) at every strength (no max abs: that needs
 * the delta's size, which needs no base but is reported with one); modules
 * whose delta reads W (DoRA, set_weight, replacements, OFT, BOFT, GLoRA)
 * are listed with their points and "needs_base": true.
 * Each entry also names the points of README's table that apply to the
 * module (the reason the numbers differ). */
#include "lorakit/fuse.h"
#include "lorakit/alloc.h"
#include "lorakit/checkpoint.h"
#include "lorakit/dtype.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define NC LK_CONVENTION_COUNT
#define MAX_S 2

typedef struct cmp {
    lk_adapter *ad[NC];
    double st[MAX_S];
    size_t ns;
    json_t *mods, *skipped; /* skipped: touched weights not compared (FP8) */
    size_t differ;
    int bad;
} cmp;

static int reads_weight(const lk_lora_module *m) {
    return m->magnitude.data || m->dora_scale.data || m->algo == LK_ALGO_SET || m->algo == LK_ALGO_OFT ||
           m->algo == LK_ALGO_BOFT || m->algo == LK_ALGO_GLORA;
}

static void point(cmp *c, json_t *pts, const char *text) { c->bad |= json_array_append_new(pts, json_string(text)); }

/* "scale: lorakit 1 (default r), comfyui 0 (...), ..." when the conventions' scales differ. */
static void scale_point(cmp *c, json_t *pts, const lk_lora_module *const *ms) {
    int same = 1;
    for (int k = 1; k < NC; k++) same &= ms[k]->scale == ms[0]->scale;
    if (same) return;
    char buf[1024], num[LK_NUM_STR_MAX];
    size_t at = (size_t)snprintf(buf, sizeof buf, "scale (alpha / rank):");
    for (int k = 0; k < NC && at < sizeof buf; k++) {
        const lk_lora_module *m = ms[k];
        at += (size_t)snprintf(buf + at, sizeof buf - at, "%s %s %s (%s)", k ? "," : "",
                               lk_convention_name((lk_convention)k), lk_num_str(m->scale, num), m->alpha_source);
    }
    point(c, pts, buf);
}

/* The points of README's conventions tables that apply to a module (ms[k]:
 * the module as convention k's adapter reads it). */
static json_t *module_points(cmp *c, const lk_lora_module *const *ms) {
    const lk_lora_module *m = ms[LK_CONVENTION_LORAKIT];
    json_t *pts = json_array();
    if (!pts) return c->bad = 1, NULL;
    scale_point(c, pts, ms);
    if (m->dora_scale.data) {
        if (m->dora_scale.ndim >= 2 && m->dora_scale.shape[0] == m->out && m->out != 1)
            point(c, pts, "DoRA on the output axis: comfyui norms the original W's rows, lorakit, lycoris and peft "
                          "those of W + c delta");
        point(c, pts, "DoRA epsilon: lorakit 2^-52, comfyui and lycoris 2^-23, peft 0");
        point(c, pts, "DoRA at strength s != 1: lorakit and comfyui W + s (W' - W), lycoris V + s (W' - V), "
                      "peft W' of V = W + s c delta");
    }
    if (m->magnitude.data)
        point(c, pts, "PEFT DoRA (lora_magnitude_vector): comfyui does not read it (the plain LoRA); at s != 1 "
                      "peft puts s into V = W + s c delta, the others W + s (W' - W)");
    if (m->algo == LK_ALGO_SET)
        point(c, pts, "set_weight at strength s != 1: comfyui copies it, the others W + s (R - W)");
    if ((m->algo == LK_ALGO_OFT && m->w1.ndim == 2) || m->oft_peft.boft)
        return pts; /* PEFT's OFT / BOFT: one rule for every convention */
    if (m->algo == LK_ALGO_OFT) {
        point(c, pts, "OFT strength: comfyui W + s^2 (R^T - I) W, the others W + s (R^T - I) W");
        if (m->w2.data) point(c, pts, "OFT rescale: comfyui ignores it, the others apply it");
    }
    if (m->algo == LK_ALGO_BOFT)
        point(c, pts, "BOFT at strength s != 1: comfyui W + s (W' - W) of the interpolated stages, the others "
                      "the interpolated stages");
    if ((m->algo == LK_ALGO_OFT || m->algo == LK_ALGO_BOFT) && m->alpha > 0)
        point(c, pts, "OFT/BOFT constraint: comfyui alpha, the others alpha x out_dim");
    return pts;
}

static json_t *conv_list(const int *grp, int g) {
    json_t *a = json_array();
    for (int k = 0; a && k < NC; k++)
        if (grp[k] == g && json_array_append_new(a, json_string(lk_convention_name((lk_convention)k)))) {
            json_decref(a);
            return NULL;
        }
    return a;
}

/* groups: [[conventions with equal results], ...] from grp[k] (the group
 * of convention k, groups numbered in order of first appearance). */
static json_t *groups_json(const int *grp, int ng) {
    json_t *a = json_array();
    for (int g = 0; a && g < ng; g++)
        if (json_array_append_new(a, conv_list(grp, g))) {
            json_decref(a);
            return NULL;
        }
    return a;
}

/* grp[k] by equality of key[k] (eq(ka, kb) != 0: equal); returns the group count. */
static int group_by(int *grp, int (*eq)(const void *ctx, int a, int b), const void *ctx) {
    int ng = 0;
    for (int k = 0; k < NC; k++) {
        grp[k] = -1;
        for (int j = 0; j < k && grp[k] < 0; j++)
            if (eq(ctx, j, k)) grp[k] = grp[j];
        if (grp[k] < 0) grp[k] = ng++;
    }
    return ng;
}

static int rep_of(const int *grp, int g) {
    for (int k = 0; k < NC; k++)
        if (grp[k] == g) return k;
    return 0;
}

/* ---- without a base: the scales alone ---- */

static int scale_eq(const void *ctx, int a, int b) {
    const double *sc = ctx;
    return sc[a] == sc[b];
}

static json_t *scale_pairs(const double *sc, const int *grp, int ng) {
    json_t *pairs = json_array();
    for (int g = 0; pairs && g < ng; g++)
        for (int h = g + 1; h < ng; h++) {
            int a = rep_of(grp, g), b = rep_of(grp, h);
            double den = fmax(fabs(sc[a]), fabs(sc[b]));
            if (json_array_append_new(pairs, json_pack("{s:s, s:s, s:n, s:f}", "a", lk_convention_name(a), "b",
                                                       lk_convention_name(b), "max_abs", "rel_fro",
                                                       den > 0 ? fabs(sc[a] - sc[b]) / den : 0.0))) {
                json_decref(pairs);
                return NULL;
            }
        }
    return pairs;
}

static void module_no_base(cmp *c, size_t i) {
    const lk_lora_module *ms[NC];
    for (int k = 0; k < NC; k++) ms[k] = lk_adapter_module(c->ad[k], i);
    const lk_lora_module *m = ms[0];
    json_t *pts = module_points(c, ms);
    if (!pts || !json_array_size(pts)) {
        json_decref(pts);
        return;
    }
    double sc[NC];
    for (int k = 0; k < NC; k++) sc[k] = ms[k]->scale;
    int grp[NC], ng = group_by(grp, scale_eq, sc);
    const int wdep = reads_weight(m);
    json_t *e = json_pack("{s:s, s:n, s:o, s:b}", "module", m->module, "weight", "points", pts, "needs_base", wdep);
    if (e && !wdep) {
        json_t *at = json_array();
        for (size_t s = 0; at && s < c->ns; s++)
            c->bad |= json_array_append_new(at, json_pack("{s:f, s:o, s:o}", "strength", c->st[s], "groups",
                                                          groups_json(grp, ng), "pairs", scale_pairs(sc, grp, ng)));
        c->bad |= !at || json_object_set_new(e, "at", at);
    }
    c->differ += !wdep && ng > 1;
    c->bad |= !e || json_array_append_new(c->mods, e);
}

/* A replacement (modules_to_save, a saved bias) reads the weight at s != 1. */
static void replacement_no_base(cmp *c, size_t i) {
    const lk_adapter_tensor *r = lk_adapter_replacement(c->ad[0], i);
    json_t *pts = json_array();
    point(c, pts, "PEFT replacement at strength s != 1: peft copies it, the others W + s (R - W)");
    json_t *e = pts ? json_pack("{s:s, s:n, s:o, s:b}", "module", r->key, "weight", "points", pts, "needs_base", 1)
                    : NULL;
    c->bad |= !e || json_array_append_new(c->mods, e);
}

/* ---- with a base: each convention's fuse of the weight, compared ---- */

typedef struct keyrun {
    const lk_tensor *t;
    const void *w; /* the clean bytes */
    void *out[NC];
    lk_fuse_key k[NC];
    lk_fuse_term terms[NC][2 * LK_ADAPTER_MAX_SLICES];
} keyrun;

static int bytes_eq(const void *ctx, int a, int b) {
    const keyrun *r = ctx;
    return !memcmp(r->out[a], r->out[b], r->t->nbytes);
}

/* 1 when the four plans are the same terms at the same scales and read no
 * convention in their arithmetic (no DoRA, replacement or rotation). */
static int plans_same(const keyrun *r) {
    for (int k = 1; k < NC; k++) {
        const lk_fuse_key *a = &r->k[0], *b = &r->k[k];
        if (a->replace || b->replace || a->dora || b->dora || a->n_terms != b->n_terms) return 0;
        for (size_t j = 0; j < a->n_terms; j++) {
            const lk_fuse_term *x = &r->terms[0][j], *y = &r->terms[k][j];
            if (x->kind == LK_TERM_OFT || x->kind != y->kind || x->scale != y->scale || x->slice != y->slice ||
                x->alpha != y->alpha)
                return 0;
        }
    }
    return 1;
}

#define CHUNK 16384 /* elements decoded at a time (buf holds 3 x CHUNK floats) */

/* {a, b, max_abs, rel_fro, elements} of conventions a and b's results. */
static json_t *pair_json(const keyrun *r, int a, int b, float *buf) {
    size_t n = lk_tensor_numel(r->t), es = lk_dtype_size(r->t->dtype);
    float *fw = buf, *fa = buf + CHUNK, *fb = buf + 2 * CHUNK;
    double mx = 0, dd = 0, da = 0, db = 0;
    json_int_t ne = 0;
    for (size_t j0 = 0; j0 < n; j0 += CHUNK) {
        size_t m = n - j0 < CHUNK ? n - j0 : CHUNK;
        lk_to_f32(fw, (const char *)r->w + j0 * es, r->t->dtype, m);
        lk_to_f32(fa, (const char *)r->out[a] + j0 * es, r->t->dtype, m);
        lk_to_f32(fb, (const char *)r->out[b] + j0 * es, r->t->dtype, m);
        for (size_t j = 0; j < m; j++) {
            double x = (double)fa[j] - fb[j], ya = (double)fa[j] - fw[j], yb = (double)fb[j] - fw[j];
            mx = fmax(mx, fabs(x));
            dd += x * x;
            da += ya * ya;
            db += yb * yb;
            ne += x != 0;
        }
    }
    double den = sqrt(fmax(da, db));
    return json_pack("{s:s, s:s, s:f, s:f, s:I}", "a", lk_convention_name(a), "b", lk_convention_name(b), "max_abs", mx,
                     "rel_fro", den > 0 ? sqrt(dd) / den : 0.0, "elements", ne);
}

/* The comparison of r at strength s into *at (an entry appended when the conventions differ). */
static lk_status key_at(cmp *c, keyrun *r, double s, float *buf, json_t *at) {
    lk_status st = LK_OK;
    int touched = 0;
    for (int k = 0; k < NC && !st; k++) {
        st = lk_fuse_key_plan(&c->ad[k], &s, 1, r->t, r->terms[k], &r->k[k]);
        touched |= !st && lk_fuse_key_touches(&r->k[k]);
    }
    if (st || !touched || plans_same(r)) return st;
    for (int k = 0; k < NC && !st; k++) {
        lk_fuse_opts o = {.threads = 0, .allow_nonfinite = 1, .convention = (lk_convention)k};
        st = lk_fuse_key_apply(r->out[k], r->w, r->t, &r->k[k], r->terms[k], &o);
    }
    int grp[NC], ng = st ? 1 : group_by(grp, bytes_eq, r);
    if (ng < 2) return st;
    json_t *pairs = json_array();
    for (int g = 0; pairs && g < ng; g++)
        for (int h = g + 1; h < ng; h++) c->bad |= json_array_append_new(pairs, pair_json(r, rep_of(grp, g), rep_of(grp, h), buf));
    c->bad |= json_array_append_new(at, json_pack("{s:f, s:o, s:o}", "strength", s, "groups", groups_json(grp, ng),
                                                  "pairs", pairs));
    return LK_OK;
}

/* The entry of weight t: what lands there, its points, and "at". */
static void key_entry(cmp *c, const lk_tensor *t, json_t *at) {
    const lk_adapter_placement *pl[NC];
    const lk_lora_module *ms[NC];
    int have = 1;
    for (int k = 0; k < NC; k++) {
        have &= lk_adapter_placements(c->ad[k], t->name, &pl[k]) > 0;
        ms[k] = have ? pl[k]->module : NULL;
    }
    const lk_adapter_tensor *rep = lk_adapter_find_replacement(c->ad[0], t->name);
    json_t *pts = have ? module_points(c, ms) : json_array();
    if (rep) point(c, pts, "PEFT replacement at strength s != 1: peft copies it, the others W + s (R - W)");
    json_t *e = json_pack("{s:s, s:s, s:o, s:b, s:o}", "module", have ? ms[0]->module : rep ? rep->key : t->name,
                          "weight", t->name, "points", pts, "needs_base", 0, "at", at);
    c->bad |= !e || json_array_append_new(c->mods, e);
    c->differ++;
}

static lk_status compare_base(cmp *c, const lk_ckpt *ck) {
    const lk_tensor *model = lk_ckpt_tensor(ck, 0);
    size_t n = lk_ckpt_count(ck);
    lk_status s = LK_OK;
    for (size_t i = 0; i < n && !s && !c->bad; i++) {
        const lk_tensor *t = &model[i];
        if (!lk_dtype_is_fusable(t->dtype) && !lk_dtype_is_fp8(t->dtype)) continue;
        int any = 0;
        for (int k = 0; k < NC; k++) {
            const lk_adapter_placement *pl;
            any |= lk_adapter_placements(c->ad[k], t->name, &pl) || lk_adapter_find_replacement(c->ad[k], t->name) ||
                   lk_adapter_find_bias_target(c->ad[k], t->name);
        }
        if (any && lk_dtype_is_fp8(t->dtype)) c->bad |= json_array_append_new(c->skipped, json_string(t->name));
        if (!any || lk_dtype_is_fp8(t->dtype)) continue;
        char *mem = lk_malloc((NC + 1) * t->nbytes + 3 * CHUNK * sizeof(float) + sizeof(keyrun) + 128);
        if (!mem) return lk_error(LK_ERR_NOMEM, "%s: out of memory comparing conventions", t->name);
        keyrun *r = (keyrun *)(void *)mem;
        r->t = t;
        char *p = mem + ((sizeof *r + 63) / 64) * 64;
        r->w = p;
        for (int k = 0; k < NC; k++) r->out[k] = p + (size_t)(k + 1) * t->nbytes;
        float *buf = (float *)(void *)(p + (NC + 1) * t->nbytes + (4 - ((NC + 1) * t->nbytes) % 4) % 4);
        s = lk_ckpt_read(ck, i, 0, (void *)r->w, t->nbytes);
        json_t *at = json_array();
        for (size_t j = 0; j < c->ns && !s && at; j++) s = key_at(c, r, c->st[j], buf, at);
        if (!s && at && json_array_size(at)) key_entry(c, t, json_incref(at));
        json_decref(at);
        c->bad |= !at;
        lk_free(mem);
    }
    return s;
}

static const char *const COMPUTED_BASE =
    "each touched weight fused under every convention at each strength (as lorakit fuse --convention writes it, in "
    "the weight's dtype), the results grouped by their bytes; max_abs = max |W_a - W_b|, rel_fro = ||W_a - W_b|| / "
    "max(||W_a - W||, ||W_b - W||)";
static const char *const COMPUTED_FILE =
    "without a base: modules whose delta does not read the weight differ only by their scale c, rel_fro = |c_a - "
    "c_b| / max(|c_a|, |c_b|) (max_abs needs --base); modules whose delta reads W are listed with needs_base";

static lk_status open_all(cmp *c, const char *adapter, const lk_adapter_opts *ao) {
    lk_status s = LK_OK;
    for (int k = 0; k < NC && !s; k++) {
        lk_adapter_opts o = ao ? *ao : (lk_adapter_opts){0};
        o.convention = (lk_convention)k;
        s = lk_adapter_open_opts(adapter, &o, &c->ad[k]);
    }
    return s;
}

static lk_status with_base(cmp *c, const char *base, const lk_resolve_opts *ro) {
    lk_ckpt *ck;
    lk_status s = lk_ckpt_open(base, &ck);
    if (s) return s;
    lk_resolve_opts r = ro ? *ro : (lk_resolve_opts){0};
    r.allow_unmatched = LK_RESOLVE_LIST_ALL;
    for (int k = 0; k < NC && !s; k++) s = lk_adapter_resolve_opts(c->ad[k], lk_ckpt_tensor(ck, 0), lk_ckpt_count(ck), &r, NULL);
    if (!s) s = compare_base(c, ck);
    lk_ckpt_close(ck);
    return s;
}

/* A diffusers pipeline folder (model_index.json): compared without its weights. */
static int is_pipeline(const char *base) {
    char p[4096];
    struct stat sb;
    return snprintf(p, sizeof p, "%s/model_index.json", base) < (int)sizeof p && !stat(p, &sb);
}

lk_status lk_fuse_conventions_json(const char *adapter, const char *base, const lk_resolve_opts *ro,
                                   const lk_adapter_opts *ao, double strength, char **out) {
    if (!adapter || !out) return lk_error(LK_ERR_ARG, "lk_fuse_conventions_json: NULL argument");
    *out = NULL;
    if (!isfinite(strength) || strength == 0.0)
        return lk_error(LK_ERR_ARG, "%s: the conventions are compared at strength 1 and a finite, non-zero one (got "
                        "%g)", adapter, strength);
    cmp c = {.st = {1.0, strength}, .ns = strength == 1.0 ? 1 : 2, .mods = json_array(), .skipped = json_array()};
    lk_status s = c.mods && c.skipped ? open_all(&c, adapter, ao) : lk_error(LK_ERR_NOMEM, "%s: out of memory", adapter);
    if (base && is_pipeline(base)) base = NULL; /* (said in "computed") */
    if (!s && base) s = with_base(&c, base, ro);
    for (size_t i = 0; !s && !base && i < lk_adapter_count(c.ad[0]); i++) module_no_base(&c, i);
    for (size_t i = 0; !s && !base && i < lk_adapter_replacement_count(c.ad[0]); i++) replacement_no_base(&c, i);
    json_t *st = json_array();
    for (size_t i = 0; st && i < c.ns; i++) c.bad |= json_array_append_new(st, json_real(c.st[i]));
    json_t *o = s ? NULL : json_pack("{s:b, s:o, s:I, s:O, s:O, s:s}", "base", base != NULL, "strengths", st,
                                     "modules_differ", (json_int_t)c.differ, "modules", c.mods, "not_compared",
                                     c.skipped, "computed", base ? COMPUTED_BASE : COMPUTED_FILE);
    if (s) json_decref(st);
    char *js = o && !c.bad ? json_dumps(o, JSON_COMPACT) : NULL;
    if (!s && !(*out = js ? lk_strdup(js) : NULL))
        s = lk_error(LK_ERR_UNSUPPORTED, "%s: cannot describe the conventions as JSON (a name that is not UTF-8, or "
                     "out of memory)", adapter);
    free(js);
    json_decref(o);
    json_decref(c.mods);
    json_decref(c.skipped);
    for (int k = 0; k < NC; k++) lk_adapter_free(c.ad[k]);
    return s;
}
