/* convert.c — lk_convert: the same LoRA in another format's naming and alpha
 * convention, its factor bytes copied as they are (dtype and shape), so a
 * fuse of the output gives the same bytes as a fuse of the input.
 *
 * Each module's scale is carried as an alpha the target reads back to the
 * same double: PEFT lora_alpha / alpha_pattern (JSON numbers round-trip
 * exactly), kohya an F32 `.alpha` (refused when alpha is not an F32 value),
 * diffusers lora_adapter_metadata's alpha_pattern; rsLoRA (scale alpha /
 * sqrt(r)) stays rsLoRA in PEFT and becomes alpha' = scale r elsewhere,
 * refused unless alpha' / r gives the scale back exactly. Nothing is folded
 * into the factors: what the target cannot carry exactly is refused by
 * name. */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "algebra/algebra_int.h"
#include "core/msg.h"
#include "io/out_file.h"
#include "lorakit/alloc.h"
#include "lorakit/checkpoint.h"
#include "lorakit/safetensors.h"

typedef struct cv {
    lk_adapter *a;
    lk_algebra_format f;
    int rslora; /* written as rsLoRA (PEFT from an rsLoRA input) */
    size_t n;
    char **names;
    char **stems;  /* --base: the model key (less ".weight") module i lands on */
    double *alpha;
    const char *in, *out;
    const lk_algebra_opts *o;
    char digest[64];
} cv;

/* --base: resolves every module against the checkpoint as lk_fuse does and
 * takes the model key it lands on as its name; a module on rows of a fused
 * weight (or split over several) has no name of its own there: refused. */
static lk_status resolve_base(cv *c, const char *base) {
    lk_ckpt *ck = NULL;
    lk_status s = lk_ckpt_open(base, &ck);
    if (s) return s;
    size_t n = lk_ckpt_count(ck);
    lk_tensor *model = lk_malloc((n ? n : 1) * sizeof *model);
    c->stems = lk_calloc(c->n, sizeof *c->stems);
    if (!model || !c->stems) s = lk_error(LK_ERR_NOMEM, "%s: out of memory", base);
    for (size_t i = 0; !s && i < n; i++) model[i] = *lk_ckpt_tensor(ck, i);
    lk_resolve_opts ro = {0};
    if (!s) s = lk_adapter_resolve_opts(c->a, model, n, &ro, NULL);
    for (size_t i = 0; !s && i < c->n; i++) {
        const lk_lora_module *m = lk_adapter_module(c->a, i);
        size_t k = 0;
        const lk_adapter_placement *p = NULL;
        for (size_t j = 0; j < lk_adapter_placement_count(c->a); j++)
            if (lk_adapter_placement_at(c->a, j)->module == m) p = lk_adapter_placement_at(c->a, j), k++;
        if (k != 1 || !p->whole || !p->target)
            s = lk_error(LK_ERR_UNSUPPORTED, "%s: %s: lands on %s of %s in %s (%s), which no module name of another "
                         "format can say; convert without --base keeps its name", c->in, m->module,
                         k == 1 ? "some rows" : "several weights", p ? p->target : "?", base, p ? p->rule : "?");
        size_t tl = s ? 0 : strlen(p->target);
        if (!s && (tl < 8 || strcmp(p->target + tl - 7, ".weight")))
            s = lk_error(LK_ERR_UNSUPPORTED, "%s: %s lands on '%s', not a '.weight' key", c->in, m->module, p->target);
        if (!s && !(c->stems[i] = lk_msg_dup("%.*s", (int)(tl - 7), p->target))) s = lk_error(LK_ERR_NOMEM, "out of memory");
    }
    lk_free(model);
    lk_ckpt_close(ck);
    return s ? lk_error_prefix(s, "convert --base %s", base) : LK_OK;
}

/* Module i's name and the alpha it is written with. */
static lk_status plan_module(cv *c, size_t i) {
    const lk_lora_module *m = lk_adapter_module(c->a, i);
    const char *why;
    if (!lk_alg_lowrank_supported(m, &why) || m->algo != LK_ALGO_LORA || m->mid.data)
        return lk_error(LK_ERR_UNSUPPORTED, "%s: %s: %s module %s", c->in, m->module, lk_algo_name(m->algo),
                        why ? why : "is not a plain LoRA (LoHa, LoKr and Tucker are kept in their own kohya form "
                                    "only; `lorakit resize` gives their exact low-rank form)");
    lk_status s;
    if (!(c->names[i] = lk_alg_out_name(c->f, c->stems ? c->stems[i] : m->module,
                                          c->stems ? NULL : lk_adapter_module_stem(c->a, i), &s)))
        return s ? lk_error_prefix(s, "%s", c->in) : lk_error(LK_ERR_NOMEM, "out of memory");
    double r = (double)m->rank, al = c->rslora ? m->alpha : m->scale * r;
    if (!c->rslora && lk_adapter_rslora(c->a) && al / r != m->scale)
        return lk_error(LK_ERR_UNSUPPORTED, "%s: %s: the rsLoRA scale %.17g has no alpha a with a / %g equal to it "
                        "exactly; write --format peft (keeps use_rslora)", c->in, m->module, m->scale, r);
    if (!lk_adapter_rslora(c->a)) al = m->alpha;
    if ((c->f == LK_ALG_FORMAT_KOHYA || c->f == LK_ALG_FORMAT_COMFYUI) && (double)(float)al != al)
        return lk_error(LK_ERR_UNSUPPORTED, "%s: %s: alpha %.17g is not an F32 value, so %s's F32 .alpha cannot "
                        "carry it exactly; write --format peft or diffusers", c->in, m->module, al,
                        lk_algebra_format_name(c->f));
    c->alpha[i] = al;
    return LK_OK;
}

/* The most common of v[0..n) (ties: the smaller). */
static double mode_of(const double *v, size_t n) {
    double best = v[0];
    size_t bn = 0;
    for (size_t i = 0; i < n; i++) {
        size_t k = 0;
        for (size_t j = 0; j < n; j++) k += v[j] == v[i];
        if (k > bn || (k == bn && v[i] < best)) best = v[i], bn = k;
    }
    return best;
}

/* PEFT's LoraConfig for the output: r, lora_alpha, rank_pattern, alpha_pattern;
 * indent 0: diffusers' lora_adapter_metadata (packed per component). */
static char *config_text(const cv *c, int indent) {
    double *ranks = lk_calloc(c->n, sizeof *ranks);
    if (!ranks) return NULL;
    for (size_t i = 0; i < c->n; i++) ranks[i] = lk_adapter_module(c->a, i)->rank;
    double r = mode_of(ranks, c->n), al = mode_of(c->alpha, c->n);
    json_t *t = json_array(), *rp = json_object(), *ap = json_object();
    int bad = !t || !rp || !ap;
    for (size_t i = 0; !bad && i < c->n; i++) {
        bad |= json_array_append_new(t, json_string(c->names[i]));
        if (ranks[i] != r) bad |= json_object_set_new(rp, c->names[i], json_integer((json_int_t)ranks[i]));
        if (c->alpha[i] != al) bad |= json_object_set_new(ap, c->names[i], json_real(c->alpha[i]));
    }
    lk_free(ranks);
    json_t *j = bad ? NULL
                    : json_pack("{s:s, s:I, s:f, s:O, s:O, s:O, s:b, s:b, s:s, s:b}", "peft_type", "LORA", "r",
                                (json_int_t)r, "lora_alpha", al, "target_modules", t, "rank_pattern", rp,
                                "alpha_pattern", ap, "use_rslora", c->rslora, "use_dora", 0, "bias", "none",
                                "fan_in_fan_out", 0);
    json_decref(t);
    json_decref(rp);
    json_decref(ap);
    if (j && !indent) {
        json_t *p = lk_alg_diffusers_meta(j);
        json_decref(j);
        j = p;
    }
    char *s = j ? json_dumps(j, JSON_SORT_KEYS | (indent ? JSON_INDENT(2) : JSON_COMPACT)) : NULL;
    json_decref(j);
    return s;
}

static lk_status declare_copy(lk_st_writer *w, const char *name, const lk_tensor *t, size_t *idx) {
    return lk_st_writer_declare(w, name, t->dtype, t->ndim, t->shape, idx);
}

/* The metadata of a kohya / diffusers output. */
static lk_status put_meta(lk_st_writer *w, const cv *c) {
    json_t *j = json_pack("{s:s, s:s, s:[{s:s, s:f, s:s}], s:{s:s?, s:b}}", "operation", "convert", "format",
                          lk_algebra_format_name(c->f), "inputs", "path", c->in, "strength", 1.0, "digest", c->digest,
                          "options", "base", c->o->base, "use_rslora", c->rslora);
    char *rec = j ? json_dumps(j, JSON_COMPACT | JSON_SORT_KEYS) : NULL;
    json_decref(j);
    lk_status s = rec ? lk_st_writer_metadata(w, "lorakit.algebra", rec) : lk_error(LK_ERR_NOMEM, "out of memory");
    free(rec);
    if (!s && c->f == LK_ALG_FORMAT_DIFFUSERS) {
        char *t = config_text(c, 0);
        s = t ? lk_st_writer_metadata(w, "lora_adapter_metadata", t) : lk_error(LK_ERR_NOMEM, "out of memory");
        free(t);
    }
    if (!s && c->f == LK_ALG_FORMAT_KOHYA) {
        int same = 1;
        for (size_t i = 1; i < c->n; i++) same &= lk_adapter_module(c->a, i)->rank == lk_adapter_module(c->a, 0)->rank;
        char dim[32], al[LK_NUM_STR_MAX];
        snprintf(dim, sizeof dim, "%d", lk_adapter_module(c->a, 0)->rank);
        s = lk_st_writer_metadata(w, "ss_network_dim", same ? dim : "Dynamic");
        if (!s) s = lk_st_writer_metadata(w, "ss_network_alpha", lk_num_str(mode_of(c->alpha, c->n), al));
    }
    if (!s) s = lk_st_writer_metadata(w, "format", "pt");
    return s;
}

static lk_status put_st(const void *ctx, const char *path) {
    const cv *c = ctx;
    lk_st_writer *w = NULL;
    size_t *idx = lk_calloc(3 * c->n, sizeof *idx);
    float *al = lk_calloc(c->n, sizeof *al);
    lk_status s = idx && al ? lk_st_writer_create(path, &w) : lk_error(LK_ERR_NOMEM, "out of memory");
    const char *pre = c->f == LK_ALG_FORMAT_PEFT ? "base_model.model." : "";
    for (size_t i = 0; !s && i < c->n; i++) {
        const lk_lora_module *m = lk_adapter_module(c->a, i);
        const char *kd, *ku;
        int k;
        lk_alg_key_names(c->f, c->names[i], &kd, &ku, &k);
        char *na = lk_msg_dup("%s%s.%s", pre, c->names[i], kd);
        char *nb = lk_msg_dup("%s%s.%s", pre, c->names[i], ku);
        char *nl = k ? lk_msg_dup("%s.alpha", c->names[i]) : NULL;
        s = na && nb && (nl || !k) ? declare_copy(w, na, &m->A, &idx[3 * i]) : lk_error(LK_ERR_NOMEM, "out of memory");
        if (!s) s = declare_copy(w, nb, &m->B, &idx[3 * i + 1]);
        if (!s && k) s = lk_st_writer_declare(w, nl, LK_DTYPE_F32, 0, NULL, &idx[3 * i + 2]);
        al[i] = k ? (float)c->alpha[i] : NAN;
        lk_free(na);
        lk_free(nb);
        lk_free(nl);
    }
    if (!s) s = put_meta(w, c);
    if (!s) s = lk_st_writer_begin(w);
    for (size_t i = 0; !s && i < c->n; i++) {
        const lk_lora_module *m = lk_adapter_module(c->a, i);
        s = lk_st_writer_write(w, idx[3 * i], 0, m->A.data, m->A.nbytes);
        if (!s) s = lk_st_writer_write(w, idx[3 * i + 1], 0, m->B.data, m->B.nbytes);
        if (!s && !isnan(al[i])) s = lk_st_writer_write(w, idx[3 * i + 2], 0, &al[i], 4);
    }
    if (!s) s = lk_st_writer_commit(w);
    lk_st_writer_free(w);
    lk_free(idx);
    lk_free(al);
    return s;
}

static lk_status write_out(const cv *c) {
    if (c->f == LK_ALG_FORMAT_PEFT) {
        char *text = config_text(c, 1);
        lk_status s = text ? lk_alg_write_peft_dir(c->out, &c->a, 1, text, put_st, c)
                           : lk_error(LK_ERR_NOMEM, "out of memory");
        free(text);
        return s;
    }
    lk_out_inputs in = LK_OUT_INPUTS_INIT;
    lk_status s = lk_out_inputs_add(&in, lk_adapter_file(c->a), "input");
    if (!s) s = lk_out_check(c->out, &in);
    lk_out_inputs_free(&in);
    return s ? s : put_st(c, c->out);
}

static lk_status report_of(const cv *c, char **out) {
    json_t *mods = json_array();
    for (size_t i = 0; mods && i < c->n; i++) {
        const lk_lora_module *m = lk_adapter_module(c->a, i);
        json_t *e = json_pack("{s:s, s:s, s:i, s:f, s:f, s:f, s:f, s:f}", "name", m->module, "written_as", c->names[i],
                              "rank", m->rank, "alpha", c->alpha[i], "scale", m->scale, "rel_fro", 0.0, "rel_fro_opt",
                              0.0, "rel_spec", 0.0);
        if (!e || json_array_append_new(mods, e)) json_decref(mods), mods = NULL;
    }
    json_t *j = mods ? json_pack("{s:s, s:s, s:[{s:s, s:f, s:s}], s:s?, s:s, s:s, s:b, s:f, s:f, s:f, s:o}", "operation",
                                 "convert", "input", c->in, "inputs", "path", c->in, "strength", 1.0, "digest",
                                 c->digest, "base", c->o->base, "output", c->out, "format",
                                 lk_algebra_format_name(c->f), "use_rslora", c->rslora, "rel_fro", 0.0, "rel_fro_opt",
                                 0.0, "rel_spec", 0.0, "modules", mods)
                     : NULL;
    char *t = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    *out = t ? lk_strdup(t) : NULL;
    free(t);
    return *out ? LK_OK : lk_error(LK_ERR_NOMEM, "%s: out of memory for the report", c->out);
}

lk_status lk_convert(const char *in, const char *out, const lk_algebra_opts *opts, char **report) {
    lk_algebra_opts zero = {0};
    const lk_algebra_opts *o = opts ? opts : &zero;
    if (report) *report = NULL;
    if (!in || !out || !*out) return lk_error(LK_ERR_ARG, "convert: an input and an output are needed");
    cv c = {.in = in, .out = out, .o = o};
    lk_status s = lk_adapter_open_opts(in, &o->read, &c.a);
    if (s) return s;
    c.f = lk_alg_format_of(o->format, c.a);
    c.rslora = lk_adapter_rslora(c.a) && c.f == LK_ALG_FORMAT_PEFT;
    c.n = lk_adapter_count(c.a);
    if (lk_adapter_replacement_count(c.a))
        s = lk_error(LK_ERR_UNSUPPORTED, "%s: replaces tensor '%s' whole (modules_to_save or a saved bias); convert "
                     "carries LoRA modules only", in, lk_adapter_replacement(c.a, 0)->key);
    else if (!c.n)
        s = lk_error(LK_ERR_FORMAT, "%s: no adapter modules", in);
    c.names = s ? NULL : lk_calloc(c.n, sizeof *c.names);
    c.alpha = s ? NULL : lk_calloc(c.n, sizeof *c.alpha);
    if (!s && (!c.names || !c.alpha)) s = lk_error(LK_ERR_NOMEM, "out of memory");
    if (!s) s = lk_alg_input_digest(c.a, c.digest, sizeof c.digest);
    if (!s && o->base) s = resolve_base(&c, o->base);
    for (size_t i = 0; !s && i < c.n; i++) s = plan_module(&c, i);
    if (!s) s = write_out(&c);
    if (!s && report) s = report_of(&c, report);
    for (size_t i = 0; c.names && i < c.n; i++) lk_free(c.names[i]);
    for (size_t i = 0; c.stems && i < c.n; i++) lk_free(c.stems[i]);
    lk_free(c.stems);
    lk_free(c.names);
    lk_free(c.alpha);
    lk_adapter_free(c.a);
    return s;
}
