/* extract.c — lk_extract: a LoRA of TUNED - BASE. Opens both checkpoints,
 * pairs their tensors by name (a shape or dtype mismatch is an error naming
 * the key and both shapes, before any work), sorts every name into extracted,
 * unchanged, excluded, not extractable (with the reason) or in one file only,
 * runs the weights over threads (each weight wholly on one thread, streamed
 * from the files in row chunks: extract_weight.c), and writes the adapter
 * and the report through the algebra's writer (write.c). Nothing is
 * written on failure. */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <jansson.h>
#include <math.h>
#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "algebra/extract_int.h"
#include "core/clock.h"
#include "core/file.h"
#include "core/msg.h"
#include "io/out_file.h"
#include "lorakit/alloc.h"
#include "lorakit/digest.h"

/* What became of one name. */
enum { K_EXTRACT, K_UNCHANGED, K_EXCLUDED, K_NOT_EXTRACTED, K_ONLY_BASE, K_ONLY_TUNED };

typedef struct xname {
    const char *name;
    long ib, it;         /* index in base / tuned, or -1 */
    int kind;
    const char *why;     /* K_NOT_EXTRACTED: the reason */
    size_t mod;          /* K_EXTRACT: its module */
} xname;

typedef struct xctx {
    const lk_extract_opts *o;
    lk_algebra_opts alg; /* o->alg with the format resolved */
    const char *base_path, *tuned_path, *out;
    lk_ckpt *base, *tuned;
    xname *names;
    size_t n_names;
    lk_alg_module *mods;
    lk_x_result *res;
    lk_x_src *src;
    size_t n_mods;
    lk_x_run xr;
    pcre2_code **inc, **exc;
    pcre2_match_context *mctx;
} xctx;

static int name_cmp(const void *a, const void *b) { return strcmp(((const xname *)a)->name, ((const xname *)b)->name); }

/* Compiles the patterns (errors name the option and PCRE2's reason). */
static lk_status compile(const char *const *pat, size_t n, pcre2_code ***out, const char *opt) {
    *out = n ? lk_calloc(n, sizeof **out) : NULL;
    if (n && !*out) return lk_error(LK_ERR_NOMEM, "out of memory");
    for (size_t i = 0; i < n; i++) {
        int err;
        PCRE2_SIZE off;
        (*out)[i] = pcre2_compile((PCRE2_SPTR)pat[i], PCRE2_ZERO_TERMINATED, PCRE2_UTF, &err, &off, NULL);
        if (!(*out)[i]) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(err, msg, sizeof msg);
            return lk_error(LK_ERR_ARG, "extract: %s '%s' is not a valid regex (at offset %zu: %s)", opt, pat[i],
                            (size_t)off, (const char *)msg);
        }
    }
    return LK_OK;
}

/* *hit = 1 when some pattern is found in name; an error when one ran out of its match budget. */
static lk_status matches(const xctx *c, pcre2_code *const *re, size_t n, const char *name, const char *opt, int *hit) {
    *hit = 0;
    for (size_t i = 0; i < n && !*hit; i++) {
        pcre2_match_data *md = pcre2_match_data_create_from_pattern(re[i], NULL);
        if (!md) return lk_error(LK_ERR_NOMEM, "out of memory");
        int rc = pcre2_match(re[i], (PCRE2_SPTR)name, PCRE2_ZERO_TERMINATED, 0, 0, md, c->mctx);
        pcre2_match_data_free(md);
        if (rc < 0 && rc != PCRE2_ERROR_NOMATCH)
            return lk_error(LK_ERR_ARG, "extract: %s '%s' failed on '%s' (PCRE2 error %d: its match budget)", opt,
                            c->o->include && re == c->inc ? c->o->include[i] : c->o->exclude[i], name, rc);
        *hit = rc >= 0;
    }
    return LK_OK;
}

static void shape_str(const lk_tensor *t, char *buf, size_t cap) {
    size_t k = (size_t)snprintf(buf, cap, "%s [", lk_dtype_name(t->dtype));
    for (int d = 0; d < t->ndim && k < cap; d++) k += (size_t)snprintf(buf + k, cap - k, d ? ", %lld" : "%lld", (long long)t->shape[d]);
    if (k < cap) snprintf(buf + k, cap - k, "]");
}

/* Why a changed tensor cannot be a LoRA module (NULL: it can). */
static const char *not_lora(const lk_tensor *t) {
    size_t len = strlen(t->name);
    if (t->dtype != LK_DTYPE_F32 && t->dtype != LK_DTYPE_F16 && t->dtype != LK_DTYPE_BF16)
        return "its dtype is not F32, F16 or BF16";
    if (t->ndim != 2 && t->ndim != 4) return "not a 2-D (linear) or 4-D (conv) weight: a LoRA cannot carry it";
    if (len < 8 || strcmp(t->name + len - 7, ".weight")) return "its name does not end in '.weight'";
    for (int d = 0; d < t->ndim; d++)
        if (t->shape[d] < 1) return "it is empty";
    return NULL;
}

/* 1 when the two tensors' bytes differ (read in chunks). */
static lk_status differ(const xctx *c, const xname *x, int *out) {
    const lk_tensor *t = lk_ckpt_tensor(c->base, (size_t)x->ib);
    char a[65536], b[65536];
    *out = 0;
    for (uint64_t off = 0; off < t->nbytes && !*out; off += sizeof a) {
        size_t k = t->nbytes - off < sizeof a ? (size_t)(t->nbytes - off) : sizeof a;
        lk_status s = lk_ckpt_read(c->base, (size_t)x->ib, off, a, k);
        if (!s) s = lk_ckpt_read(c->tuned, (size_t)x->it, off, b, k);
        if (s) return s;
        *out = memcmp(a, b, k) != 0;
    }
    return LK_OK;
}

/* Checks one paired name: same dtype and shape, or an error naming both. */
static lk_status same_kind(const xctx *c, const xname *x) {
    const lk_tensor *a = lk_ckpt_tensor(c->base, (size_t)x->ib), *b = lk_ckpt_tensor(c->tuned, (size_t)x->it);
    int same = a->dtype == b->dtype && a->ndim == b->ndim;
    for (int d = 0; same && d < a->ndim; d++) same = a->shape[d] == b->shape[d];
    if (same) return LK_OK;
    char sa[160], sb[160];
    shape_str(a, sa, sizeof sa);
    shape_str(b, sb, sizeof sb);
    return lk_error(LK_ERR_SHAPE, "extract: '%s' is %s in %s but %s in %s", x->name, sa, c->base_path, sb, c->tuned_path);
}

/* Every name of either file, sorted, paired and classified (modules not yet run). */
static lk_status classify(xctx *c) {
    size_t nb = lk_ckpt_count(c->base), nt = lk_ckpt_count(c->tuned), k = 0;
    c->names = lk_calloc(nb + nt + 1, sizeof *c->names);
    if (!c->names) return lk_error(LK_ERR_NOMEM, "out of memory");
    for (size_t i = 0; i < nb; i++) {
        const char *nm = lk_ckpt_tensor(c->base, i)->name;
        c->names[k++] = (xname){nm, (long)i, lk_ckpt_find(c->tuned, nm), K_EXTRACT, NULL, 0};
    }
    for (size_t i = 0; i < nt; i++) {
        const char *nm = lk_ckpt_tensor(c->tuned, i)->name;
        if (lk_ckpt_find(c->base, nm) < 0) c->names[k++] = (xname){nm, -1, (long)i, K_ONLY_TUNED, NULL, 0};
    }
    c->n_names = k;
    qsort(c->names, k, sizeof *c->names, name_cmp);
    for (size_t i = 0; i < k; i++) {
        xname *x = &c->names[i];
        if (x->it < 0) x->kind = K_ONLY_BASE;
        if (x->kind != K_EXTRACT) continue;
        lk_status s = same_kind(c, x);
        if (s) return s;
        int in = 1, ex = 0;
        if (c->o->n_include && (s = matches(c, c->inc, c->o->n_include, x->name, "--include", &in))) return s;
        if (in && (s = matches(c, c->exc, c->o->n_exclude, x->name, "--exclude", &ex))) return s;
        if (!in || ex) {
            x->kind = K_EXCLUDED;
            continue;
        }
        x->why = not_lora(lk_ckpt_tensor(c->base, (size_t)x->ib));
        if (!x->why) {
            x->mod = c->n_mods++;
            continue;
        }
        int d;
        if ((s = differ(c, x, &d))) return s;
        x->kind = d ? K_NOT_EXTRACTED : K_UNCHANGED;
    }
    return LK_OK;
}

/* The modules of the extracted names: name "<m>" of "<m>.weight", the delta's
 * [out, in(, kh, kw)] layout; the output dtype (given, else the weights'
 * when they agree, else F32) and the file's one alpha (--rank K: K; --err:
 * --max-rank, else 1). */
static lk_status setup(xctx *c) {
    c->mods = lk_calloc(c->n_mods + 1, sizeof *c->mods);
    c->res = lk_calloc(c->n_mods + 1, sizeof *c->res);
    c->src = lk_calloc(c->n_mods + 1, sizeof *c->src);
    if (!c->mods || !c->res || !c->src) return lk_error(LK_ERR_NOMEM, "out of memory");
    lk_dtype d = LK_DTYPE_INVALID;
    for (size_t i = 0; i < c->n_names; i++) {
        const xname *x = &c->names[i];
        if (x->kind != K_EXTRACT) continue;
        const lk_tensor *t = lk_ckpt_tensor(c->base, (size_t)x->ib);
        lk_alg_module *m = &c->mods[x->mod];
        size_t len = strlen(x->name) - 7;
        char *nm = lk_malloc(len + 1);
        if (!nm) return lk_error(LK_ERR_NOMEM, "out of memory");
        memcpy(nm, x->name, len), nm[len] = 0;
        m->name = nm;
        m->out = (size_t)t->shape[0];
        m->N = 1;
        m->ntail = t->ndim - 1;
        for (int k = 1; k < t->ndim; k++) m->tail[k - 1] = t->shape[k], m->N *= (size_t)t->shape[k];
        m->conv = t->ndim == 4 && t->shape[2] * t->shape[3] > 1;
        c->src[x->mod] = (lk_x_src){c->base, c->tuned, (size_t)x->ib, (size_t)x->it, t->dtype, m->out, m->N};
        d = d == LK_DTYPE_INVALID || d == t->dtype ? t->dtype : LK_DTYPE_F32;
    }
    const lk_algebra_opts *o = &c->o->alg;
    lk_alg_run *run = &c->xr.run;
    run->o = &c->alg;
    run->dtype = o->dtype != LK_DTYPE_INVALID ? o->dtype : d == LK_DTYPE_INVALID ? LK_DTYPE_F32 : d;
    run->alpha = o->rank > 0 ? o->rank : o->max_rank > 0 ? o->max_rank : 1.0;
    run->exact = 0;
    return LK_OK;
}

static lk_status weight_one(void *ctx, size_t i) {
    xctx *c = ctx;
    return lk_x_weight(&c->xr, &c->src[i], &c->mods[i], &c->res[i]);
}

/* Moves weights found unchanged (D == 0) out of the module list. */
static lk_status drop_unchanged(xctx *c) {
    size_t k = 0;
    size_t *to = lk_calloc(c->n_mods + 1, sizeof *to);
    if (!to) return lk_error(LK_ERR_NOMEM, "out of memory");
    for (size_t i = 0; i < c->n_mods; i++) {
        if (c->res[i].unchanged) {
            lk_free((void *)c->mods[i].name);
            to[i] = (size_t)-1;
            continue;
        }
        to[i] = k;
        c->mods[k] = c->mods[i], c->res[k] = c->res[i], c->src[k] = c->src[i];
        k++;
    }
    for (size_t i = 0; i < c->n_names; i++)
        if (c->names[i].kind == K_EXTRACT) {
            if (to[c->names[i].mod] == (size_t)-1) c->names[i].kind = K_UNCHANGED;
            else c->names[i].mod = to[c->names[i].mod];
        }
    lk_free(to);
    c->n_mods = k;
    return LK_OK;
}

/* The names of one kind as a JSON array (K_NOT_EXTRACTED: {name, reason}). */
static json_t *names_json(const xctx *c, int kind) {
    json_t *a = json_array();
    for (size_t i = 0; a && i < c->n_names; i++) {
        const xname *x = &c->names[i];
        if (x->kind != kind) continue;
        json_t *e = kind == K_NOT_EXTRACTED ? json_pack("{s:s, s:s}", "name", x->name, "reason", x->why)
                                            : json_string(x->name);
        if (!e || json_array_append_new(a, e)) json_decref(a), a = NULL;
    }
    return a;
}

/* The options beyond merge's, for the record and the report. */
static char *options_extra(const xctx *c) {
    const lk_extract_opts *o = c->o;
    json_t *inc = json_array(), *exc = json_array();
    for (size_t i = 0; inc && i < o->n_include; i++) json_array_append_new(inc, json_string(o->include[i]));
    for (size_t i = 0; exc && i < o->n_exclude; i++) json_array_append_new(exc, json_string(o->exclude[i]));
    json_t *j = json_pack("{s:I, s:i, s:i, s:b, s:o?, s:o?}", "seed", (json_int_t)o->seed, "oversample",
                          c->xr.oversample, "power", c->xr.power, "exact_svd", o->exact_svd != 0, "include", inc,
                          "exclude", exc);
    char *t = j ? json_dumps(j, JSON_COMPACT | JSON_SORT_KEYS) : NULL;
    json_decref(j);
    return t;
}

/* lk_alg_report's text with extract's fields added. */
static lk_status report(const xctx *c, const lk_alg_ctx *ctx, char **out) {
    char *base = NULL;
    lk_status s = lk_alg_report(ctx, &base);
    if (s) return s;
    json_t *j = json_loads(base, 0, NULL), *mods = json_object_get(j, "modules");
    lk_free(base);
    double up2 = 0, n2 = 0;
    for (size_t i = 0; i < c->n_mods; i++) {
        const lk_alg_module *x = &c->mods[i];
        up2 += c->res[i].opt_up2, n2 += x->norm2;
        json_t *m = json_array_get(mods, i);
        json_object_set_new(m, "rel_fro_opt_upper", json_real(sqrt(c->res[i].opt_up2 / x->norm2)));
        json_object_set_new(m, "sketch", json_integer((json_int_t)c->res[i].sketch));
    }
    const char *kind = c->o->exact_svd ? "exact" : "lower_bound";
    int bad = !j || !mods;
    bad = bad || json_object_set_new(j, "rel_fro_opt_kind", json_string(kind));
    bad = bad || json_object_set_new(j, "rel_fro_opt_upper", json_real(n2 > 0 ? sqrt(up2 / n2) : 0));
    bad = bad || json_object_set_new(j, "rel_spec_kind", json_string("projected"));
    static const char *const keys[] = {"unchanged", "excluded", "not_extracted", "only_in_base", "only_in_tuned"};
    static const int kinds[] = {K_UNCHANGED, K_EXCLUDED, K_NOT_EXTRACTED, K_ONLY_BASE, K_ONLY_TUNED};
    for (int k = 0; k < 5 && !bad; k++) bad = json_object_set_new(j, keys[k], names_json(c, kinds[k])) != 0;
    char *t = bad ? NULL : json_dumps(j, JSON_COMPACT);
    json_decref(j);
    *out = t ? lk_strdup(t) : NULL;
    free(t);
    return *out ? LK_OK : lk_error(LK_ERR_NOMEM, "%s: out of memory for the report", c->out);
}

/* No output path may be a file of either checkpoint (every shard, the index). */
static lk_status check_out(const xctx *c) {
    lk_out_inputs in = LK_OUT_INPUTS_INIT;
    lk_status s = LK_OK;
    const lk_ckpt *ck[2] = {c->base, c->tuned};
    for (int k = 0; k < 2 && !s; k++) {
        s = lk_out_inputs_add(&in, lk_ckpt_path(ck[k]), k ? "TUNED" : "BASE");
        for (size_t j = 0; j < lk_ckpt_shard_count(ck[k]) && !s; j++) {
            char *p = lk_path_join(lk_ckpt_dir(ck[k]), lk_ckpt_shard_name(ck[k], j));
            s = p ? lk_out_inputs_add(&in, p, k ? "TUNED shard" : "BASE shard") : lk_error(LK_ERR_NOMEM, "out of memory");
            lk_free(p);
        }
    }
    if (!s && c->alg.format == LK_ALG_FORMAT_PEFT) {
        char *a = lk_path_join(c->out, "adapter_model.safetensors"), *b = lk_path_join(c->out, "adapter_config.json");
        s = a && b ? lk_out_check(a, &in) : lk_error(LK_ERR_NOMEM, "out of memory");
        if (!s) s = lk_out_check(b, &in);
        lk_free(a), lk_free(b);
    } else if (!s) {
        s = lk_out_check(c->out, &in);
    }
    lk_out_inputs_free(&in);
    return s;
}

static lk_status check_opts(const lk_extract_opts *o) {
    const lk_algebra_opts *a = &o->alg;
    if (a->rank < 0 || a->max_rank < 0 || a->conv_rank < 0 || !(a->err >= 0) || !isfinite(a->err))
        return lk_error(LK_ERR_ARG, "extract: --rank, --max-rank, --conv-rank must be >= 1 and --err > 0");
    if ((a->rank > 0) == (a->err > 0))
        return lk_error(LK_ERR_ARG, "extract: give one of --rank K and --err E");
    if (a->fro > 0 || a->ratio > 0)
        return lk_error(LK_ERR_ARG, "extract: --fro and --ratio are merge / resize options; give --rank K or --err E");
    if (o->oversample < 0 || o->oversample > 4096 || o->power > 64)
        return lk_error(LK_ERR_ARG, "extract: --oversample from 0 to 4096, --power from 0 to 64 (got %d, %d)",
                        o->oversample, o->power);
    if (a->dtype != LK_DTYPE_INVALID && a->dtype != LK_DTYPE_F32 && a->dtype != LK_DTYPE_F16 && a->dtype != LK_DTYPE_BF16)
        return lk_error(LK_ERR_ARG, "extract: output dtype %s: F32, F16 or BF16", lk_dtype_name(a->dtype));
    if ((o->n_include && !o->include) || (o->n_exclude && !o->exclude))
        return lk_error(LK_ERR_ARG, "extract: include / exclude counts without their patterns");
    return LK_OK;
}

static void xctx_free(xctx *c) {
    for (size_t i = 0; c->mods && i < c->n_mods; i++) {
        lk_alg_module_free(&c->mods[i]);
        lk_free((void *)c->mods[i].name);
    }
    lk_free(c->mods), lk_free(c->res), lk_free(c->src), lk_free(c->names);
    for (size_t i = 0; c->inc && i < c->o->n_include; i++) pcre2_code_free(c->inc[i]);
    for (size_t i = 0; c->exc && i < c->o->n_exclude; i++) pcre2_code_free(c->exc[i]);
    lk_free(c->inc), lk_free(c->exc);
    pcre2_match_context_free(c->mctx);
    lk_ckpt_close(c->base), lk_ckpt_close(c->tuned);
}

/* Writes the output and the report once every weight is done. */
static lk_status finish(xctx *c, double t0, char **rep) {
    lk_alg_input in[2] = {{c->base_path, -1.0, NULL, {0}}, {c->tuned_path, 1.0, NULL, {0}}};
    lk_status s = lk_digest_ckpt(c->base, in[0].digest);
    if (!s) s = lk_digest_ckpt(c->tuned, in[1].digest);
    char *extra = options_extra(c);
    lk_alg_ctx ctx = {.op = "extract", .out = c->out, .o = &c->alg, .in = in, .n_in = 2, .mods = c->mods,
                      .n_mods = c->n_mods, .run = c->xr.run, .format = c->alg.format, .options_extra = extra};
    if (!s && !extra) s = lk_error(LK_ERR_NOMEM, "out of memory");
    if (!s) s = check_out(c);
    ctx.seconds = lk_now_s() - t0;
    if (!s) s = lk_alg_write(&ctx);
    if (!s && rep) s = report(c, &ctx, rep);
    free(extra);
    return s;
}

lk_status lk_extract(const char *base, const char *tuned, const char *out, const lk_extract_opts *o, char **rep) {
    if (rep) *rep = NULL;
    if (!base || !tuned || !out || !*out || !o) return lk_error(LK_ERR_ARG, "extract: BASE, TUNED, an output and options are needed");
    lk_status s = check_opts(o);
    if (s) return s;
    double t0 = lk_now_s();
    xctx c = {.o = o, .alg = o->alg, .base_path = base, .tuned_path = tuned, .out = out};
    size_t ol = strlen(out);
    if (c.alg.format == LK_ALG_FORMAT_AUTO)
        c.alg.format = ol > 12 && !strcmp(out + ol - 12, ".safetensors") ? LK_ALG_FORMAT_DIFFUSERS : LK_ALG_FORMAT_PEFT;
    c.xr.o = o;
    c.xr.power = o->power < 0 ? 2 : o->power;
    c.xr.oversample = o->oversample ? o->oversample : 8;
    c.mctx = pcre2_match_context_create(NULL);
    if (!c.mctx) s = lk_error(LK_ERR_NOMEM, "out of memory");
    else pcre2_set_match_limit(c.mctx, 1000000);
    if (!s) s = compile(o->include, o->n_include, &c.inc, "--include");
    if (!s) s = compile(o->exclude, o->n_exclude, &c.exc, "--exclude");
    if (!s && (s = lk_ckpt_open(base, &c.base))) lk_error_prefix(s, "BASE");
    if (!s && (s = lk_ckpt_open(tuned, &c.tuned))) lk_error_prefix(s, "TUNED");
    if (!s) s = classify(&c);
    if (!s) s = setup(&c);
    if (!s) s = lk_alg_pool(c.n_mods, &o->alg, weight_one, &c);
    if (!s) s = drop_unchanged(&c);
    if (!s && !c.n_mods)
        s = lk_error(LK_ERR_ARG, "extract: no weight differs between %s and %s (nothing to extract; %zu names compared)",
                     base, tuned, c.n_names);
    if (!s) s = finish(&c, t0, rep);
    xctx_free(&c);
    return s;
}
