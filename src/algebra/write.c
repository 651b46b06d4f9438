/* write.c — the output of merge / resize in kohya, PEFT or diffusers form,
 * and the report.
 *
 * One alpha per file (lk_alg_run.alpha): every module's own scale is folded
 * into its B before the single rounding, so loaders that give every module
 * the file's most common alpha (diffusers 0.42.1 on kohya files) read it
 * right. Alpha is written explicitly in every format: kohya an F32 `.alpha`
 * per module plus ss_network_dim ("Dynamic" when ranks differ) and
 * ss_network_alpha; PEFT r, lora_alpha and rank_pattern for every module
 * whose rank is not r; diffusers the same record as lora_adapter_metadata.
 * "lorakit.algebra" records the operation, the inputs' digests and the
 * options. */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "algebra/algebra_int.h"
#include "core/file.h"
#include "io/out_file.h"
#include "core/msg.h"
#include "lorakit/alloc.h"
#include "lorakit/safetensors.h"

static const char *const FORMAT_NAMES[LK_ALG_FORMAT_COUNT] = {"auto", "kohya", "peft", "diffusers", "comfyui"};

const char *lk_algebra_format_name(lk_algebra_format f) {
    return (unsigned)f < LK_ALG_FORMAT_COUNT ? FORMAT_NAMES[f] : "?";
}

lk_status lk_algebra_format_parse(const char *name, lk_algebra_format *out) {
    for (int i = 0; i < LK_ALG_FORMAT_COUNT; i++)
        if (name && !strcmp(name, FORMAT_NAMES[i])) {
            *out = (lk_algebra_format)i;
            return LK_OK;
        }
    return lk_error(LK_ERR_ARG, "unknown output format '%s' (valid: kohya, peft, diffusers, comfyui)", name ? name : "");
}

static const char *const COMPONENTS[][2] = {
    {"transformer.", "lora_unet_"}, {"unet.", "lora_unet_"},         {"diffusion_model.", "lora_unet_"},
    {"text_encoder.", "lora_te1_"}, {"text_encoder_2.", "lora_te2_"}, {"text_encoder_3.", "lora_te3_"},
};

/* The module's name in format f (lk_malloc'd), or NULL with *err set.
 * ComfyUI (model_lora_keys_unet / _clip, comfy/lora.py): a kohya name is
 * read natively and kept; a text encoder's diffusers name (text_encoder.,
 * text_encoder_2.) too; every other name is a diffusion-model key,
 * "diffusion_model.<key>" (a single file's model.diffusion_model., a
 * diffusers file's transformer. / unet. and PEFT's base_model.model.
 * replaced by it). */
char *lk_alg_out_name(lk_algebra_format f, const char *m, const char *stem, lk_status *err) {
    int kohya_in = !strncmp(m, "lora_", 5) && !strchr(m, '.');
    *err = LK_OK;
    if (f == LK_ALG_FORMAT_KOHYA) {
        if (kohya_in) return lk_strdup(m);
        const char *pre = "lora_unet_", *rest = m;
        for (size_t i = 0; i < sizeof COMPONENTS / sizeof *COMPONENTS; i++)
            if (!strncmp(m, COMPONENTS[i][0], strlen(COMPONENTS[i][0]))) {
                pre = COMPONENTS[i][1];
                rest = m + strlen(COMPONENTS[i][0]);
                break;
            }
        char *s = lk_msg_dup("%s%s", pre, rest);
        if (s)
            for (char *p = s + strlen(pre); *p; p++)
                if (*p == '.') *p = '_';
        return s;
    }
    if (f == LK_ALG_FORMAT_COMFYUI) {
        if (kohya_in || !strncmp(m, "text_encoder", 12)) return lk_strdup(m);
        static const char *const wrap[] = {"base_model.model.", "model.diffusion_model.", "diffusion_model.",
                                           "transformer.", "unet."};
        for (size_t i = 0; i < sizeof wrap / sizeof *wrap; i++)
            if (!strncmp(m, wrap[i], strlen(wrap[i]))) m += strlen(wrap[i]);
        return lk_msg_dup("diffusion_model.%s", m);
    }
    if (kohya_in) {
        *err = lk_error(LK_ERR_UNSUPPORTED, "module '%s' has kohya's underscore name, which does not say where the "
                        "dots of the model's name are; write --format kohya or comfyui, or give --base CKPT "
                        "(convert) to resolve it", m);
        return NULL;
    }
    if (f == LK_ALG_FORMAT_PEFT)
        for (size_t i = 0; i < 3; i++)
            if (!strncmp(m, COMPONENTS[i][0], strlen(COMPONENTS[i][0]))) return lk_strdup(m + strlen(COMPONENTS[i][0]));
    for (size_t i = 0; f == LK_ALG_FORMAT_DIFFUSERS && stem && i < 2; i++) { /* "unet." / "transformer." as read */
        size_t pl = strlen(COMPONENTS[i][0]);
        if (!strncmp(stem, COMPONENTS[i][0], pl) && !strcmp(stem + pl, m)) return lk_strdup(stem);
    }
    return lk_strdup(m);
}

void lk_alg_key_names(lk_algebra_format f, const char *name, const char **down, const char **up, int *alpha) {
    int kohya_keys = f == LK_ALG_FORMAT_KOHYA || (f == LK_ALG_FORMAT_COMFYUI && !strchr(name, '.'));
    *down = kohya_keys ? "lora_down.weight" : "lora_A.weight";
    *up = kohya_keys ? "lora_up.weight" : "lora_B.weight";
    *alpha = f == LK_ALG_FORMAT_KOHYA || f == LK_ALG_FORMAT_COMFYUI;
}

lk_algebra_format lk_alg_format_of(lk_algebra_format want, const lk_adapter *a) {
    if (want != LK_ALG_FORMAT_AUTO) return want;
    switch (lk_adapter_get_format(a)) {
    case LK_FORMAT_KOHYA: return LK_ALG_FORMAT_KOHYA;
    case LK_FORMAT_PEFT: return LK_ALG_FORMAT_PEFT;
    default: return LK_ALG_FORMAT_DIFFUSERS;
    }
}

/* The most common output rank (ties: the smaller). */
static size_t mode_rank(const lk_alg_ctx *ctx) {
    size_t best = 0, best_n = 0;
    for (size_t i = 0; i < ctx->n_mods; i++) {
        size_t r = ctx->mods[i].rank, c = 0;
        for (size_t j = 0; j < ctx->n_mods; j++) c += ctx->mods[j].rank == r;
        if (c > best_n || (c == best_n && r < best)) best = r, best_n = c;
    }
    return best;
}

static int uniform_rank(const lk_alg_ctx *ctx) {
    for (size_t i = 1; i < ctx->n_mods; i++)
        if (ctx->mods[i].rank != ctx->mods[0].rank) return 0;
    return 1;
}

/* The options as given, for the report and the metadata. */
static json_t *options_json(const lk_alg_ctx *ctx) {
    const lk_algebra_opts *o = ctx->o;
    json_t *j = json_object();
    if (!j) return NULL;
    int bad = 0;
    if (o->rank) bad |= json_object_set_new(j, "rank", json_integer(o->rank));
    if (o->err > 0) bad |= json_object_set_new(j, "err", json_real(o->err));
    if (o->fro > 0) bad |= json_object_set_new(j, "fro", json_real(o->fro));
    if (o->ratio > 0) bad |= json_object_set_new(j, "ratio", json_real(o->ratio));
    if (o->max_rank) bad |= json_object_set_new(j, "max_rank", json_integer(o->max_rank));
    if (o->conv_rank) bad |= json_object_set_new(j, "conv_rank", json_integer(o->conv_rank));
    bad |= json_object_set_new(j, "exact", json_boolean(ctx->run.exact));
    if (ctx->options_extra) { /* the operation's own options (extract: seed, power, ...) */
        json_t *x = json_loads(ctx->options_extra, 0, NULL);
        bad |= !x || json_object_update(j, x);
        json_decref(x);
    }
    if (bad) {
        json_decref(j);
        return NULL;
    }
    return j;
}

static json_t *inputs_json(const lk_alg_ctx *ctx) {
    json_t *a = json_array();
    for (size_t i = 0; a && i < ctx->n_in; i++) {
        json_t *e = json_pack("{s:s, s:f, s:s}", "path", ctx->in[i].path, "strength", ctx->in[i].strength, "digest",
                              ctx->in[i].digest);
        if (!e || json_array_append_new(a, e)) {
            json_decref(a);
            return NULL;
        }
    }
    return a;
}

/* The record "lorakit.algebra": operation, inputs, options, alpha, dtype. */
static char *record_text(const lk_alg_ctx *ctx) {
    json_t *j = json_pack("{s:s, s:o?, s:o?, s:f, s:s}", "operation", ctx->op, "inputs", inputs_json(ctx), "options",
                          options_json(ctx), "alpha", ctx->run.alpha, "dtype", lk_dtype_name(ctx->run.dtype));
    char *s = j ? json_dumps(j, JSON_COMPACT | JSON_SORT_KEYS) : NULL;
    json_decref(j);
    return s;
}

/* PEFT's LoraConfig fields for the output (also diffusers' metadata). */
static json_t *lora_config(const lk_alg_ctx *ctx, char **names) {
    size_t r = mode_rank(ctx);
    json_t *targets = json_array(), *rp = json_object();
    for (size_t i = 0; targets && rp && i < ctx->n_mods; i++) {
        if (json_array_append_new(targets, json_string(names[i]))) goto fail;
        if (ctx->mods[i].rank != r && json_object_set_new(rp, names[i], json_integer((json_int_t)ctx->mods[i].rank)))
            goto fail;
    }
    if (!targets || !rp) goto fail;
    json_t *c = json_pack("{s:s, s:I, s:f, s:o, s:o, s:{}, s:b, s:b, s:s, s:b, s:f}", "peft_type", "LORA", "r",
                          (json_int_t)r, "lora_alpha", ctx->run.alpha, "target_modules", targets, "rank_pattern", rp,
                          "alpha_pattern", "use_rslora", 0, "use_dora", 0, "bias", "none", "fan_in_fan_out", 0,
                          "lora_dropout", 0.0);
    return c;
fail:
    json_decref(targets);
    json_decref(rp);
    return NULL;
}

/* The component a diffusers pipeline file prefixes name with ("unet", ...), or NULL. */
static const char *component_of(const char *name, size_t *len) {
    static const char *const comps[] = {"unet", "transformer", "text_encoder", "text_encoder_2", "text_encoder_3"};
    const char *dot = strchr(name, '.');
    for (size_t i = 0; dot && i < sizeof comps / sizeof *comps; i++)
        if ((size_t)(dot - name) == strlen(comps[i]) && !strncmp(name, comps[i], strlen(comps[i]))) {
            *len = strlen(comps[i]);
            return comps[i];
        }
    return NULL;
}

/* One component's part of cfg: its target_modules and patterns with the prefix removed, every key
 * prefixed "<comp>." into out (diffusers' _pack_dict_with_prefix layout). */
static int pack_one(const json_t *cfg, const char *comp, size_t cl, json_t *out) {
    int bad = 0;
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)cfg, k, v) {
        json_t *nv = NULL;
        if (!strcmp(k, "target_modules")) {
            nv = json_array();
            size_t i;
            json_t *e;
            json_array_foreach(v, i, e) {
                const char *n = json_string_value(e);
                if (n && !strncmp(n, comp, cl) && n[cl] == '.') bad |= json_array_append_new(nv, json_string(n + cl + 1));
            }
        } else if (!strcmp(k, "rank_pattern") || !strcmp(k, "alpha_pattern")) {
            nv = json_object();
            const char *pk;
            json_t *pv;
            json_object_foreach(v, pk, pv) if (!strncmp(pk, comp, cl) && pk[cl] == '.')
                bad |= json_object_set(nv, pk + cl + 1, pv);
        } else {
            nv = json_incref(v);
        }
        char *key = lk_msg_dup("%s.%s", comp, k);
        bad |= !nv || !key || json_object_set_new(out, key, nv);
        lk_free(key);
    }
    return bad;
}

json_t *lk_alg_diffusers_meta(const json_t *cfg) {
    const json_t *t = json_object_get(cfg, "target_modules");
    const char *seen[8];
    size_t ns = 0, i, cl;
    json_t *e;
    json_array_foreach(t, i, e) {
        const char *c = component_of(json_string_value(e) ? json_string_value(e) : "", &cl);
        if (!c) return json_deep_copy(cfg); /* a model-level file: names of the model itself, metadata unpacked */
        size_t j = 0;
        while (j < ns && seen[j] != c) j++;
        if (j == ns && ns < 8) seen[ns++] = c;
    }
    json_t *out = json_object();
    int bad = !out;
    for (size_t j = 0; j < ns && !bad; j++) bad |= pack_one(cfg, seen[j], strlen(seen[j]), out);
    if (bad) json_decref(out);
    return bad ? NULL : out;
}

/* Tensor layout of module i: B [out, K(, 1, 1)], A [K, tail...]. */
static void shapes(const lk_alg_module *x, int64_t *bs, int *bn, int64_t *as, int *an) {
    bs[0] = (int64_t)x->out;
    bs[1] = (int64_t)x->rank;
    *bn = 2;
    if (x->ntail > 1) bs[2] = bs[3] = 1, *bn = 4;
    as[0] = (int64_t)x->rank;
    for (int d = 0; d < x->ntail; d++) as[1 + d] = x->tail[d];
    *an = 1 + x->ntail;
}

typedef struct wctx {
    lk_alg_ctx *ctx;
    lk_algebra_format f;
    char **names;
    float alpha;
} wctx;

static lk_status declare(lk_st_writer *w, const wctx *c, size_t i, size_t *idx) {
    const lk_alg_module *x = &c->ctx->mods[i];
    int64_t bs[LK_MAX_DIMS], as[LK_MAX_DIMS];
    int bn, an;
    shapes(x, bs, &bn, as, &an);
    const char *pre = c->f == LK_ALG_FORMAT_PEFT ? "base_model.model." : "", *ka, *kb;
    int with_alpha;
    lk_alg_key_names(c->f, c->names[i], &ka, &kb, &with_alpha);
    char *na = lk_msg_dup("%s%s.%s", pre, c->names[i], ka), *nb = lk_msg_dup("%s%s.%s", pre, c->names[i], kb);
    char *nl = with_alpha ? lk_msg_dup("%s.alpha", c->names[i]) : NULL;
    lk_status s = na && nb && (nl || !with_alpha) ? LK_OK : lk_error(LK_ERR_NOMEM, "out of memory");
    if (!s) s = lk_st_writer_declare(w, na, c->ctx->run.dtype, an, as, &idx[0]);
    if (!s) s = lk_st_writer_declare(w, nb, c->ctx->run.dtype, bn, bs, &idx[1]);
    if (!s && nl) s = lk_st_writer_declare(w, nl, LK_DTYPE_F32, 0, NULL, &idx[2]);
    lk_free(na);
    lk_free(nb);
    lk_free(nl);
    return s;
}

static lk_status put_meta(lk_st_writer *w, const wctx *c) {
    lk_alg_ctx *ctx = c->ctx;
    char *rec = record_text(ctx);
    lk_status s = rec ? lk_st_writer_metadata(w, "lorakit.algebra", rec) : lk_error(LK_ERR_NOMEM, "out of memory");
    free(rec);
    if (!s && c->f == LK_ALG_FORMAT_KOHYA) {
        char dim[32], al[32];
        snprintf(dim, sizeof dim, "%zu", ctx->mods[0].rank);
        lk_num_str(ctx->run.alpha, al);
        s = lk_st_writer_metadata(w, "ss_network_dim", uniform_rank(ctx) ? dim : "Dynamic");
        if (!s) s = lk_st_writer_metadata(w, "ss_network_alpha", al);
        if (!s) s = lk_st_writer_metadata(w, "ss_network_module", "networks.lora");
    }
    if (!s && c->f == LK_ALG_FORMAT_DIFFUSERS) {
        json_t *cfg0 = lora_config(ctx, c->names), *cfg = cfg0 ? lk_alg_diffusers_meta(cfg0) : NULL;
        json_decref(cfg0);
        char *t = cfg ? json_dumps(cfg, JSON_COMPACT | JSON_SORT_KEYS) : NULL;
        s = t ? lk_st_writer_metadata(w, "lora_adapter_metadata", t) : lk_error(LK_ERR_NOMEM, "out of memory");
        free(t);
        json_decref(cfg);
    }
    if (!s) s = lk_st_writer_metadata(w, "format", "pt");
    return s;
}

/* The safetensors file at path. */
static lk_status write_st(const wctx *c, const char *path) {
    lk_alg_ctx *ctx = c->ctx;
    lk_st_writer *w = NULL;
    size_t *idx = lk_calloc(3 * ctx->n_mods, sizeof *idx);
    lk_status s = idx ? lk_st_writer_create(path, &w) : lk_error(LK_ERR_NOMEM, "out of memory");
    for (size_t i = 0; !s && i < ctx->n_mods; i++) s = declare(w, c, i, idx + 3 * i);
    if (!s) s = put_meta(w, c);
    if (!s) s = lk_st_writer_begin(w);
    const size_t es = lk_dtype_size(ctx->run.dtype);
    for (size_t i = 0; !s && i < ctx->n_mods; i++) {
        const lk_alg_module *x = &ctx->mods[i];
        s = lk_st_writer_write(w, idx[3 * i], 0, x->a_bytes, x->rank * x->N * es);
        if (!s) s = lk_st_writer_write(w, idx[3 * i + 1], 0, x->b_bytes, x->rank * x->out * es);
        if (!s && (c->f == LK_ALG_FORMAT_KOHYA || c->f == LK_ALG_FORMAT_COMFYUI))
            s = lk_st_writer_write(w, idx[3 * i + 2], 0, &c->alpha, 4);
    }
    if (!s) s = lk_st_writer_commit(w);
    lk_st_writer_free(w);
    lk_free(idx);
    return s;
}

/* A PEFT folder dir: the safetensors (written by put_st) and the config text, both or neither; no
 * file of an input may be replaced. */
lk_status lk_alg_write_peft_dir(const char *dir, lk_adapter *const *ins, size_t n_in, const char *text,
                                lk_status (*put_st)(const void *ctx, const char *path), const void *ctx) {
    int made = mkdir(dir, 0777) == 0;
    if (!made && errno != EEXIST)
        return lk_error(LK_ERR_IO, "%s: cannot create folder: %s", dir, strerror(errno));
    struct stat sb;
    if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return lk_error(LK_ERR_IO, "%s: a PEFT output is a folder (adapter_model.safetensors + adapter_config.json)",
                        dir);
    char *st = lk_path_join(dir, "adapter_model.safetensors"), *js = lk_path_join(dir, "adapter_config.json");
    lk_status s = st && js && text ? LK_OK : lk_error(LK_ERR_NOMEM, "out of memory");
    lk_out_inputs in = LK_OUT_INPUTS_INIT;
    for (size_t i = 0; !s && i < n_in; i++) {
        if (!ins[i]) continue; /* not an adapter (extract's checkpoints): the caller checked its files */
        s = lk_out_inputs_add(&in, lk_adapter_file(ins[i]), "input adapter");
        if (!s && lk_adapter_config_file(ins[i])) s = lk_out_inputs_add(&in, lk_adapter_config_file(ins[i]), "input adapter config");
    }
    if (!s) s = lk_out_check(st, &in);
    if (!s) s = lk_out_check(js, &in);
    struct stat old;
    int had_st = st && stat(st, &old) == 0;
    if (!s) s = put_st(ctx, st);
    if (!s && (s = lk_out_file_write(js, text, strlen(text))) && !had_st) unlink(st); /* nothing half-written */
    if (s && made) rmdir(dir);
    lk_out_inputs_free(&in);
    lk_free(st);
    lk_free(js);
    return s;
}

static lk_status put_merged(const void *c, const char *path) { return write_st(c, path); }

static lk_status write_peft(const wctx *c) {
    json_t *cfg = lora_config(c->ctx, c->names);
    char *text = cfg ? json_dumps(cfg, JSON_INDENT(2) | JSON_SORT_KEYS) : NULL;
    lk_adapter **ins = lk_calloc(c->ctx->n_in, sizeof *ins);
    lk_status s = ins && text ? LK_OK : lk_error(LK_ERR_NOMEM, "out of memory");
    for (size_t i = 0; ins && i < c->ctx->n_in; i++) ins[i] = c->ctx->in[i].a;
    if (!s) s = lk_alg_write_peft_dir(c->ctx->out, ins, c->ctx->n_in, text, put_merged, c);
    lk_free(ins);
    free(text);
    json_decref(cfg);
    return s;
}

static int str_cmp(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* The output names, checked distinct. */
static lk_status make_names(wctx *c) {
    lk_alg_ctx *ctx = c->ctx;
    lk_status s = LK_OK;
    c->names = lk_calloc(ctx->n_mods, sizeof *c->names);
    char **sorted = lk_calloc(ctx->n_mods, sizeof *sorted);
    if (!c->names || !sorted) s = lk_error(LK_ERR_NOMEM, "out of memory");
    for (size_t i = 0; !s && i < ctx->n_mods; i++) {
        c->names[i] = lk_alg_out_name(c->f, ctx->mods[i].name, ctx->mods[i].stem, &s);
        if (!c->names[i] && !s) s = lk_error(LK_ERR_NOMEM, "out of memory");
        if (s) lk_error_prefix(s, "%s", ctx->out);
        sorted[i] = c->names[i];
    }
    if (!s) {
        qsort(sorted, ctx->n_mods, sizeof *sorted, str_cmp);
        for (size_t i = 1; i < ctx->n_mods && !s; i++)
            if (!strcmp(sorted[i], sorted[i - 1]))
                s = lk_error(LK_ERR_FORMAT, "%s: two modules are both named '%s' in %s form", ctx->out, sorted[i],
                             lk_algebra_format_name(c->f));
    }
    lk_free(sorted);
    return s;
}

lk_status lk_alg_write(lk_alg_ctx *ctx) {
    lk_algebra_format f = ctx->in[0].a ? lk_alg_format_of(ctx->o->format, ctx->in[0].a) : ctx->o->format;
    wctx c = {ctx, f, NULL, (float)ctx->run.alpha};
    lk_status s = make_names(&c);
    if (!s && c.f == LK_ALG_FORMAT_PEFT) {
        s = write_peft(&c);
    } else if (!s) {
        lk_out_inputs in = LK_OUT_INPUTS_INIT;
        for (size_t i = 0; !s && i < ctx->n_in; i++)
            s = lk_out_inputs_add(&in, ctx->in[i].a ? lk_adapter_file(ctx->in[i].a) : ctx->in[i].path, "input");
        if (!s) s = lk_out_check(ctx->out, &in);
        lk_out_inputs_free(&in);
        if (!s) s = write_st(&c, ctx->out);
    }
    for (size_t i = 0; c.names && i < ctx->n_mods; i++) lk_free(c.names[i]);
    lk_free(c.names);
    ctx->format = c.f;
    return s;
}

static double ratio(double num2, double den2) { return den2 > 0 ? sqrt(num2 / den2) : 0.0; }

lk_status lk_alg_report(const lk_alg_ctx *ctx, char **out) {
    json_t *mods = json_array();
    double n2 = 0, e2 = 0, o2 = 0, spec = 0;
    for (size_t i = 0; mods && i < ctx->n_mods; i++) {
        const lk_alg_module *x = &ctx->mods[i];
        double rs = x->spec > 0 ? x->err_spec / x->spec : 0.0;
        n2 += x->norm2, e2 += x->err2, o2 += x->opt2;
        if (rs > spec) spec = rs;
        json_t *m = json_pack("{s:s, s:I, s:f, s:f, s:f, s:f}", "name", x->name, "rank", (json_int_t)x->rank, "rel_fro",
                              ratio(x->err2, x->norm2), "rel_fro_opt", ratio(x->opt2, x->norm2), "rel_spec", rs,
                              "norm", sqrt(x->norm2));
        if (!m || json_array_append_new(mods, m)) {
            json_decref(mods);
            mods = NULL;
        }
    }
    json_t *j = mods ? json_pack("{s:s, s:s, s:s, s:s, s:f, s:o?, s:o?, s:f, s:f, s:f, s:f, s:o}", "operation",
                                 ctx->op, "output", ctx->out, "format", lk_algebra_format_name(ctx->format), "dtype",
                                 lk_dtype_name(ctx->run.dtype), "alpha", ctx->run.alpha, "inputs", inputs_json(ctx),
                                 "options", options_json(ctx), "rel_fro", ratio(e2, n2), "rel_fro_opt", ratio(o2, n2),
                                 "rel_spec", spec, "seconds", ctx->seconds, "modules", mods)
                     : NULL;
    *out = NULL;
    char *t = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    if (!t) return lk_error(LK_ERR_NOMEM, "%s: out of memory for the report", ctx->out);
    *out = lk_strdup(t);
    free(t);
    return *out ? LK_OK : lk_error(LK_ERR_NOMEM, "%s: out of memory for the report", ctx->out);
}
