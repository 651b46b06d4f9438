/* plan.c — parser of the `lorakit swap` plan (see lorakit/plan.h).
 *
 * The YAML front-end (io/yaml_doc.h) reads the file once, builds the tree,
 * types the scalars and refuses repeated keys (two `loras:` in one step are
 * an error naming both lines, not "the last one wins"); this file only
 * walks the plan's schema. Errors name file, line and key path
 * ("plan.yaml:4: steps[1].loras[0].strength: ..."). The input is hostile:
 * anchors may fan one list out many times, so the adapter count over all
 * steps is bounded. */
#include "lorakit/plan.h"

#include <limits.h>
#include <math.h>
#include <string.h>

#include "core/file.h"
#include "io/yaml_doc.h"
#include "lorakit/alloc.h"
#include "lorakit/tracker.h"

_Static_assert(LK_PLAN_MAX_BYTES == LK_CONFIG_MAX_BYTES, "a plan is a config file: one size limit");

typedef struct pctx {
    const lk_ydoc *doc;
    const char *label;
    const char *base_dir;
    size_t entries; /* steps + adapters so far, against LK_PLAN_MAX_ENTRIES */
} pctx;

static lk_status parse_lora(pctx *c, const lk_ynode *n, lk_fuse_input *out) {
    if (n->type != LK_Y_MAP)
        return lk_yerr(c->doc, n, NULL, "expected a mapping {path: ..., strength: ...}");
    const char *path = NULL;
    double strength = 1.0; /* the default when a step omits it */
    for (size_t i = 0; i < n->n; i++) {
        const lk_ynode *kn = lk_ymap_key(n, i), *vn = lk_ymap_val(n, i);
        const char *k = lk_ynode_str(kn);
        if (!k) return lk_yerr(c->doc, n, NULL, "keys must be strings");
        if (!strcmp(k, "path")) {
            path = lk_ynode_str(vn);
            if (!path || !*path) return lk_yerr(c->doc, vn, NULL, "expected a non-empty file or folder path");
        } else if (!strcmp(k, "strength")) {
            /* the CLI's parser on the text as written, quoted or not (0.7, "0.7", 0x1p-3): one rule for
             * -l PATH:STRENGTH, plans and Python; a bool, null or collection is not a number */
            if (vn->type != LK_Y_INT && vn->type != LK_Y_FLOAT && vn->type != LK_Y_STR) {
                char r[64];
                lk_ynode_repr(vn, r, sizeof r);
                return lk_yerr(c->doc, vn, NULL, "expected a finite number, got %s", r);
            }
            if (vn->type == LK_Y_FLOAT && !isfinite(vn->f)) /* YAML's .inf / .nan, which strtod does not spell */
                return lk_yerr(c->doc, vn, NULL, "strength '%s' is not finite", vn->text);
            if (lk_fuse_strength_parse(lk_ynode_str(vn), &strength))
                return lk_yerr(c->doc, vn, NULL, "%s", lk_last_error());
        } else if (!strcmp(k, "format")) {
            const char *f = lk_ynode_str(vn);
            if (!f) return lk_yerr(c->doc, vn, NULL, "expected a format name");
            if (lk_adapter_format_parse(f, &out->format)) return lk_yerr(c->doc, vn, NULL, "%s", lk_last_error());
        } else if (!strcmp(k, "alpha")) { /* the adapter's alpha where its file gives none (lk_fuse_input) */
            if ((vn->type != LK_Y_INT && vn->type != LK_Y_FLOAT && vn->type != LK_Y_STR) ||
                (vn->type == LK_Y_FLOAT && !isfinite(vn->f)) || lk_fuse_strength_parse(lk_ynode_str(vn), &out->alpha)) {
                char r[64];
                lk_ynode_repr(vn, r, sizeof r);
                return lk_yerr(c->doc, vn, NULL, "alpha: expected a finite number, got %s", r);
            }
            out->has_alpha = 1;
        } else {
            return lk_yerr(c->doc, kn, NULL, "unknown key (valid: path, strength, format, alpha)");
        }
    }
    if (!path) return lk_yerr(c->doc, n, NULL, "missing 'path'");
    out->strength = strength; /* the double as read: what is fused and recorded */
    char *full = lk_path_join(c->base_dir, path);
    if (!full) return lk_error(LK_ERR_NOMEM, "%s: out of memory", c->label);
    out->path = full;
    return LK_OK;
}

static lk_status parse_step(pctx *c, const lk_ynode *n, lk_plan_step *st) {
    st->line = n->line;
    if (n->type != LK_Y_MAP) return lk_yerr(c->doc, n, NULL, "expected a mapping with 'loras'");
    for (size_t i = 0; i < n->n; i++) {
        const lk_ynode *kn = lk_ymap_key(n, i);
        const char *k = lk_ynode_str(kn);
        if (!k || strcmp(k, "loras")) return lk_yerr(c->doc, kn, NULL, "unknown key (valid: loras)");
    }
    const lk_ynode *list = lk_ymap_get(n, "loras");
    if (!list || list->type != LK_Y_SEQ)
        return lk_yerr(c->doc, list ? list : n, list ? NULL : "loras",
                       "expected a list of {path, strength} ([] resets)");
    if (list->n > LK_PLAN_MAX_ENTRIES - c->entries)
        return lk_yerr(c->doc, list, NULL, "too many adapters in the plan");
    c->entries += list->n;
    if (list->n) {
        st->loras = lk_calloc(list->n, sizeof *st->loras);
        if (!st->loras) return lk_error(LK_ERR_NOMEM, "%s: out of memory", c->label);
    }
    for (size_t i = 0; i < list->n; i++) {
        lk_status s = parse_lora(c, list->kids[i], &st->loras[i]);
        if (s) return s;
        st->n++;
    }
    return LK_OK;
}

/* maps: a list of table files, each made relative to the plan's folder;
 * p->maps and its strings are owned by p (lk_plan_free), n_maps counting
 * those made. */
static lk_status parse_maps(pctx *c, const lk_ynode *vn, lk_plan *p) {
    if (vn->type != LK_Y_SEQ) return lk_yerr(c->doc, vn, NULL, "expected a list of table files ([a.lkmap, ...])");
    if (vn->n && !(p->maps = lk_calloc(vn->n, sizeof *p->maps)))
        return lk_error(LK_ERR_NOMEM, "%s: out of memory", c->label);
    for (size_t j = 0; j < vn->n; j++) {
        const char *m = lk_ynode_str(vn->kids[j]);
        if (!m || !*m) return lk_yerr(c->doc, vn->kids[j], NULL, "expected a non-empty file path");
        if (!(p->maps[j] = lk_path_join(c->base_dir, m))) /* relative to the plan, as adapters */
            return lk_error(LK_ERR_NOMEM, "%s: out of memory", c->label);
        p->n_maps = j + 1;
    }
    return LK_OK;
}

/* bucket_mb: a whole number of MiB in the swap bucket knob's range (the
 * error names the range and the value as written). */
static lk_status parse_bucket_mb(pctx *c, const lk_ynode *vn, long *out) {
    long long b;
    if (!lk_ynode_int(vn, LLONG_MIN, LLONG_MAX, &b) || !lk_knob_in_range(LK_KNOB_SWAP_BUCKET_MB, (double)b)) {
        char r[64], range[64];
        lk_ynode_repr(vn, r, sizeof r);
        return lk_yerr(c->doc, vn, NULL, "expected a whole number of MiB in %s, got %s",
                       lk_knob_range(LK_KNOB_SWAP_BUCKET_MB, range, sizeof range), r);
    }
    *out = (long)b;
    return LK_OK;
}

/* timeout: seconds in the timeout knob's range, 0 = none (the error names
 * the range and the value as written). */
static lk_status parse_timeout(pctx *c, const lk_ynode *vn, double *out) {
    double t;
    if (!lk_ynode_num(vn, &t) || !lk_knob_in_range(LK_KNOB_TIMEOUT_S, t)) {
        char r[64], range[64];
        lk_ynode_repr(vn, r, sizeof r);
        return lk_yerr(c->doc, vn, NULL, "expected seconds in %s (0 = none), got %s",
                       lk_knob_range(LK_KNOB_TIMEOUT_S, range, sizeof range), r);
    }
    *out = t;
    return LK_OK;
}

/* One top-level setting k (key node kn, value vn) into p; "steps" is left
 * to parse_steps, any other key is an error listing the valid ones. What it
 * allocates (arch, maps) is owned by p. */
static lk_status parse_setting(pctx *c, const lk_ynode *kn, const char *k, const lk_ynode *vn, lk_plan *p) {
    if (!strcmp(k, "bucket_mb")) return parse_bucket_mb(c, vn, &p->bucket_mb);
    if (!strcmp(k, "timeout")) return parse_timeout(c, vn, &p->timeout);
    if (!strcmp(k, "maps")) return parse_maps(c, vn, p);
    if (!strcmp(k, "no_lora_swap") || !strcmp(k, "allow_nonfinite")) {
        int *dst = k[0] == 'n' ? &p->no_lora_swap : &p->allow_nonfinite;
        if (!lk_ynode_bool(vn, dst)) return lk_yerr(c->doc, vn, NULL, "expected true or false");
    } else if (!strcmp(k, "fp8_rounding") || !strcmp(k, "fp8_scale")) {
        const char *v = lk_ynode_str(vn);
        lk_status bad = !v ? LK_ERR_ARG
                        : k[4] == 'r' ? lk_fp8_rounding_parse(v, &p->fp8.rounding)
                                      : lk_fp8_scale_parse(v, &p->fp8.scale);
        if (bad)
            return lk_yerr(c->doc, vn, NULL, "expected %s", k[4] == 'r' ? "nearest or stochastic" : "rescale or keep");
    } else if (!strcmp(k, "fp8_seed")) {
        long long v;
        if (!lk_ynode_int(vn, 0, LLONG_MAX, &v)) return lk_yerr(c->doc, vn, NULL, "expected a whole number >= 0");
        p->fp8.seed = (uint64_t)v;
    } else if (!strcmp(k, "fp8_saturate")) {
        if (!lk_ynode_bool(vn, &p->fp8.saturate)) return lk_yerr(c->doc, vn, NULL, "expected true or false");
    } else if (!strcmp(k, "alpha_from")) {
        const char *v = lk_ynode_str(vn);
        if (!v || lk_alpha_from_parse(v, &p->alpha_from))
            return lk_yerr(c->doc, vn, NULL, "expected tensors or metadata");
    } else if (!strcmp(k, "convention")) {
        const char *v = lk_ynode_str(vn);
        if (!v || lk_convention_parse(v, &p->convention))
            return lk_yerr(c->doc, vn, NULL, "expected lorakit, comfyui, lycoris or peft");
    } else if (!strcmp(k, "arch")) {
        const char *v = lk_ynode_str(vn);
        if (!v || !*v) return lk_yerr(c->doc, vn, NULL, "expected a family name (flux, sdxl, ...; none: no table)");
        if (!(p->arch = lk_strdup(v))) return lk_error(LK_ERR_NOMEM, "%s: out of memory", c->label);
    } else if (strcmp(k, "steps")) {
        return lk_yerr(c->doc, kn, NULL,
                       "unknown key (valid: bucket_mb, no_lora_swap, allow_nonfinite, fp8_rounding, fp8_seed, "
                       "fp8_scale, fp8_saturate, timeout, alpha_from, convention, arch, maps, steps)");
    }
    return LK_OK;
}

/* steps: the list of steps, bounded by LK_PLAN_MAX_ENTRIES; p->steps is
 * owned by p, n_steps counting every step begun (so that lk_plan_free
 * releases a partly parsed one). */
static lk_status parse_steps(pctx *c, const lk_ynode *root, lk_plan *p) {
    const lk_ynode *steps = lk_ymap_get(root, "steps");
    if (!steps || steps->type != LK_Y_SEQ)
        return lk_yerr(c->doc, steps ? steps : root, steps ? NULL : "steps", "expected a list of steps");
    if (steps->n > LK_PLAN_MAX_ENTRIES) return lk_yerr(c->doc, steps, NULL, "too many steps");
    c->entries = steps->n;
    if (steps->n) {
        p->steps = lk_calloc(steps->n, sizeof *p->steps);
        if (!p->steps) return lk_error(LK_ERR_NOMEM, "%s: out of memory", c->label);
    }
    for (size_t i = 0; i < steps->n; i++) {
        lk_status s = parse_step(c, steps->kids[i], &p->steps[i]);
        p->n_steps = i + 1; /* so lk_plan_free releases a partly parsed step */
        if (s) return s;
    }
    return LK_OK;
}

/* The plan's top level: every setting in the order written, then the steps. */
static lk_status parse_root(pctx *c, lk_plan *p) {
    const lk_ynode *root = lk_ydoc_root(c->doc);
    if (!root) return lk_error(LK_ERR_CONFIG, "%s: the plan is empty (it needs 'steps')", c->label);
    if (root->type != LK_Y_MAP) return lk_yerr(c->doc, root, "(top level)", "expected a mapping with 'steps'");
    for (size_t i = 0; i < root->n; i++) {
        const lk_ynode *kn = lk_ymap_key(root, i);
        const char *k = lk_ynode_str(kn);
        if (!k) return lk_yerr(c->doc, kn, "(top level)", "keys must be strings");
        lk_status s = parse_setting(c, kn, k, lk_ymap_val(root, i), p);
        if (s) return s;
    }
    return parse_steps(c, root, p);
}

static lk_status plan_from_doc(const lk_ydoc *d, const char *base_dir, lk_plan **out) {
    lk_plan *p = lk_calloc(1, sizeof *p);
    if (!p) return lk_error(LK_ERR_NOMEM, "%s: out of memory", lk_ydoc_label(d));
    p->timeout = -1; /* not set */
    pctx c = {d, lk_ydoc_label(d), base_dir, 0};
    lk_status s = parse_root(&c, p);
    if (s) {
        lk_plan_free(p);
        return s;
    }
    *out = p;
    return LK_OK;
}

lk_status lk_plan_parse(const char *text, size_t len, const char *label, const char *base_dir, lk_plan **out) {
    if (!out || (len && !text)) return lk_error(LK_ERR_ARG, "lk_plan_parse: NULL argument");
    *out = NULL;
    lk_ydoc *d;
    lk_status s = lk_ydoc_parse(text, len, label ? label : "(plan)", &d);
    if (s) return s;
    s = plan_from_doc(d, base_dir, out);
    lk_ydoc_free(d);
    return s;
}

lk_status lk_plan_load(const char *path, lk_plan **out) {
    if (!path || !out) return lk_error(LK_ERR_ARG, "lk_plan_load: NULL argument");
    *out = NULL;
    char *dir;
    lk_ydoc *d;
    lk_status s = lk_path_dir(path, &dir);
    if (s) return s;
    s = lk_ydoc_load(path, &d);
    if (!s) s = plan_from_doc(d, dir, out);
    lk_ydoc_free(d);
    lk_free(dir);
    return s;
}

void lk_plan_free(lk_plan *p) {
    if (!p) return;
    for (size_t i = 0; i < p->n_steps; i++) {
        for (size_t j = 0; j < p->steps[i].n; j++) lk_free((void *)p->steps[i].loras[j].path);
        lk_free(p->steps[i].loras);
    }
    lk_free(p->steps);
    for (size_t i = 0; i < p->n_maps; i++) lk_free(p->maps[i]);
    lk_free(p->maps);
    lk_free(p->arch);
    lk_free(p);
}
