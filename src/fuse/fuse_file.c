/* fuse_file.c — the offline fuse of a whole checkpoint (lk_fuse_file).
 *
 * Validate everything, then stream: every adapter is opened and resolved
 * against the base's keys before the output is even created, so a bad
 * request writes nothing. The output goes through the streaming
 * safetensors writer tensor by tensor, in the base's order. The base's
 * tensor bytes are never touched through the reader's mmap (only its header
 * is): they are read with pread (lk_st_read) from the descriptor the reader
 * keeps open, fused ones whole into one reusable buffer the size of the
 * largest fused tensor and fused there in place, untouched ones copied byte
 * for byte through the same buffer in chunks. So the resident set stays near
 * the largest fused tensor plus the adapters, and a base that another
 * process truncates while we read it is LK_ERR_IO ("changed on disk while
 * being read"), not a SIGBUS. The writer renames its temporary file into
 * place only on commit, so on any error no output exists.
 *
 * The base is a checkpoint (lorakit/checkpoint.h): one file or a sharded
 * set. A sharded base fused to a folder keeps its layout (io/out_dir.c):
 * every shard gets its own writer, all open at once (so a weight and a
 * companion in another shard can be written in any order), inside a fresh
 * temporary folder next to OUT_DIR that is renamed onto it only when every
 * shard, the new index and the copied small files are complete. */
#include "core/alloc.h"
#include "core/clock.h"
#include "lorakit/fuse.h"
#include "fuse/fuse.h"
#include "lorakit/alloc.h"
#include "lorakit/fuse_device.h"
#include "lorakit/log.h"
#include "lorakit/checkpoint.h"
#include "lorakit/safetensors.h"
#include "io/out_dir.h"
#include "io/out_file.h"
#include "io/checkpoint.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <ctype.h>
#include <strings.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define FUSED_KEY "lorakit.fused"


/* Untouched tensors are copied through the tensor buffer in chunks of at
 * most this many bytes (the buffer grows to it only when no fused tensor is
 * larger already). */
#define COPY_CHUNK ((size_t)8 << 20)

/* Case-insensitive: is text (after a sign) a word strtod reads as Inf or NaN? */
static int inf_or_nan_word(const char *t) {
    if (*t == '+' || *t == '-') t++;
    return !strncasecmp(t, "inf", 3) || !strncasecmp(t, "nan", 3);
}

lk_status lk_fuse_strength_parse(const char *text, double *out) {
    if (!text || !*text) return lk_error(LK_ERR_ARG, "strength '' is not a number");
    char *end;
    errno = 0;
    double v = strtod(text, &end);
    int range = errno == ERANGE;
    if (end == text || *end || isspace((unsigned char)text[0]))
        return lk_error(LK_ERR_ARG, "strength '%s' is not a number", text);
    if (!isfinite(v))
        return lk_error(LK_ERR_ARG, "strength '%s' is not finite%s", text,
                        inf_or_nan_word(text) ? "" : " (beyond the range of a double)");
    if (range && v == 0.0) { /* strtod gives 0 with ERANGE only for a non-zero number */
        return lk_error(LK_ERR_ARG, "strength '%s' is too small: it reads as 0 (the smallest double is 4.9e-324)",
                        text);
    }
    *out = v;
    return LK_OK;
}

/* json_dumps(o, flags) with every real written as the shortest decimal
 * that reads back as the same double (lk_num_str, plus ".0" where
 * that is a whole number): jansson writes all reals at one precision, which
 * makes 0.7 "0.69999999999999996" at 17 digits or 0.1 + 0.2 "0.3" at 15.
 * Returns an lk_malloc'd string, or NULL (out of memory). */
static char *dumps_exact(const json_t *o, size_t flags) {
    char *js = json_dumps(o, flags | JSON_REAL_PRECISION(17));
    if (!js) return NULL;
    size_t len = strlen(js), reals = 0;
    for (size_t i = 0; i < len; i++) reals += js[i] == '.' || js[i] == 'e';
    char *r = lk_malloc(len + reals * (LK_NUM_STR_MAX + 2) + 1);
    if (!r) {
        free(js);
        return NULL;
    }
    size_t o_len = 0;
    for (size_t i = 0; i < len;) {
        char c = js[i];
        if (c == '"') { /* a string, copied through its closing quote */
            r[o_len++] = js[i++];
            while (i < len && js[i] != '"') {
                if (js[i] == '\\' && i + 1 < len) r[o_len++] = js[i++];
                r[o_len++] = js[i++];
            }
            if (i < len) r[o_len++] = js[i++];
        } else if (c == '-' || (c >= '0' && c <= '9')) {
            size_t j = i, real = 0;
            while (j < len && strchr("+-0123456789.eE", js[j])) real |= strchr(".eE", js[j++]) != NULL;
            if (real) {
                char buf[LK_NUM_STR_MAX];
                lk_num_str(strtod(js + i, NULL), buf);
                size_t bl = strlen(buf);
                memcpy(r + o_len, buf, bl);
                o_len += bl;
                if (!strpbrk(buf, ".e")) r[o_len++] = '.', r[o_len++] = '0';
            } else {
                memcpy(r + o_len, js + i, j - i);
                o_len += j - i;
            }
            i = j;
        } else {
            r[o_len++] = js[i++];
        }
    }
    r[o_len] = '\0';
    free(js);
    return r;
}

/* The lorakit.fused value: the base's record (when it is a JSON array)
 * followed by this request, into *out (lk_malloc'd). An adapter path that
 * is not UTF-8 cannot be recorded in JSON and is named as such (jansson
 * gives no reason, so without the check it would read as out of memory). */
static lk_status fused_record(const char *base, const char *old, const lk_fuse_input *in, size_t n,
                              lk_alpha_from alpha_from, lk_convention conv, char **out) {
    json_t *arr = NULL;
    if (old) {
        arr = json_loads(old, 0, NULL);
        if (arr && !json_is_array(arr)) {
            json_decref(arr);
            arr = NULL;
        }
    }
    if (!arr) arr = json_array();
    if (!arr) return lk_error(LK_ERR_NOMEM, "%s: out of memory", base);
    for (size_t i = 0; i < n; i++) {
        json_t *p = json_string(in[i].path); /* NULL: not UTF-8 (or out of memory) */
        if (!p) {
            json_decref(arr);
            return lk_error(LK_ERR_ARG, "%s: adapter path is not valid UTF-8, so it cannot be recorded in %s's "
                            FUSED_KEY " metadata", in[i].path, base);
        }
        json_t *o = json_pack("{s:o, s:f, s:s}", "path", p, "strength", in[i].strength, "format",
                              lk_adapter_format_name(in[i].format));
        if (o && in[i].has_alpha && json_object_set_new(o, "alpha", json_real(in[i].alpha))) {
            json_decref(o);
            o = NULL;
        }
        if (o && alpha_from != LK_ALPHA_AUTO &&
            json_object_set_new(o, "alpha_from", json_string(lk_alpha_from_name(alpha_from)))) {
            json_decref(o);
            o = NULL;
        }
        if (o && conv != LK_CONVENTION_LORAKIT &&
            json_object_set_new(o, "convention", json_string(lk_convention_name(conv)))) {
            json_decref(o);
            o = NULL;
        }
        if (!o || json_array_append_new(arr, o)) {
            json_decref(arr);
            return lk_error(LK_ERR_NOMEM, "%s: out of memory", base);
        }
    }
    *out = dumps_exact(arr, JSON_COMPACT);
    json_decref(arr);
    return *out ? LK_OK : lk_error(LK_ERR_NOMEM, "%s: out of memory", base);
}

typedef struct fctx {
    lk_ckpt *ck;
    lk_adapter **ad;
    size_t n_ad;
    const lk_tensor *model; /* the checkpoint's own table (lk_ckpt_tensor's array), not a copy */
    lk_fuse_term *terms;
    size_t *order; /* canonical summation order of the inputs */
    lk_adapter **ord_ad; /* the adapters and strengths in that order */
    double *ord_s;
    long *scale_of;   /* fused FP8 weight: index of its scale tensor, else -1 */
    unsigned char *is_scale; /* 1: the scale of a fused FP8 weight (written with it) */
    size_t *backup;   /* lk_fuse_tensors: the tensors backed up in buf, in order */
    void *arrays;     /* the one allocation ad .. backup are carved from (alloc_arrays) */
    lk_st_writer **w; /* one per output file */
    size_t n_w;
    int one_file;     /* one output file (else one per shard, in od) */
    lk_out_dir *od;   /* sharded output: the temporary folder */
    void *sbuf;       /* one scale tensor's bytes */
    void *buf;        /* the tensor buffer (lk_fuse_tensors: the backup) */
    void *dbuf;       /* lk_fuse_tensors on device tensors: the backup, on c->dev */
    lk_stream *stream; /* and the stream their work is queued on */
    size_t buf_bytes;
    char *record;
    lk_device dev;             /* lk_fuse_file_opts.device */
    lk_fuse_dev_stats dstats;  /* with a device: where each tensor was fused */
} fctx;

static void fctx_free(fctx *c) {
    for (size_t j = 0; j < c->n_w; j++) lk_st_writer_free(c->w[j]);
    lk_free(c->w);
    lk_out_dir_abort(c->od);
    lk_free(c->sbuf);
    for (size_t i = 0; i < c->n_ad; i++) lk_adapter_free(c->ad[i]);
    lk_free(c->arrays);
    lk_free(c->buf);
    lk_device_free(c->dev, c->dbuf);
    lk_free(c->record);
    lk_ckpt_close(c->ck);
}

/* The request's arrays from one zeroed allocation (c->arrays, freed by
 * fctx_free), as llm.c carves its buffers: per adapter ad, order, ord_ad,
 * ord_s and LK_ADAPTER_MAX_SLICES terms (one term, or one per row slice);
 * per model tensor scale_of (all -1) and is_scale, and for an in-memory
 * fuse (no checkpoint) backup. */
static lk_status alloc_arrays(fctx *c, const char *label, size_t n, size_t nt) {
    const size_t na = n ? n : 1, nm = nt ? nt : 1;
    lk_carve k = {0};
    const size_t o_ad = LK_CARVE(&k, na, lk_adapter *), o_order = LK_CARVE(&k, na, size_t),
                 o_ord_ad = LK_CARVE(&k, na, lk_adapter *), o_ord_s = LK_CARVE(&k, na, double),
                 o_terms = lk_carve_part(&k, na, LK_ADAPTER_MAX_SLICES * sizeof(lk_fuse_term), _Alignof(lk_fuse_term)),
                 o_scale_of = LK_CARVE(&k, nm, long), o_is_scale = LK_CARVE(&k, nm, unsigned char),
                 o_backup = LK_CARVE(&k, c->ck ? 0 : nm, size_t);
    unsigned char *m = lk_carve_alloc(&k);
    if (!m) return lk_error(LK_ERR_NOMEM, "%s: out of memory", label);
    c->arrays = m;
    c->ad = (lk_adapter **)(void *)(m + o_ad);
    c->order = (size_t *)(void *)(m + o_order);
    c->ord_ad = (lk_adapter **)(void *)(m + o_ord_ad);
    c->ord_s = (double *)(void *)(m + o_ord_s);
    c->terms = (lk_fuse_term *)(void *)(m + o_terms);
    c->scale_of = (long *)(void *)(m + o_scale_of);
    c->is_scale = m + o_is_scale;
    c->backup = c->ck ? NULL : (size_t *)(void *)(m + o_backup);
    for (size_t i = 0; i < nt; i++) c->scale_of[i] = -1;
    return LK_OK;
}

/* The record already in the base: a single file's metadata, or the index
 * metadata of a sharded set (a string there too when lorakit wrote it). */
static const char *base_record(const lk_ckpt *ck, json_t **hold) {
    *hold = NULL;
    if (!lk_ckpt_sharded(ck)) return lk_st_metadata_get(lk_ckpt_shard(ck, 0), FUSED_KEY);
    json_t *m = json_loads(lk_ckpt_index_metadata(ck), 0, NULL);
    json_t *v = m ? json_object_get(m, FUSED_KEY) : NULL;
    if (!json_is_string(v)) {
        json_decref(m);
        return NULL;
    }
    *hold = m;
    return json_string_value(v);
}

/* Writer j's metadata: shard j's own (all shards' for a single output from
 * a sharded base, first value of a key wins) without an old record, then
 * the new record. */
static lk_status writer_metadata(fctx *c, size_t j, int one_file) {
    size_t j0 = one_file ? 0 : j, j1 = one_file ? lk_ckpt_shard_count(c->ck) : j + 1;
    lk_status s = LK_OK;
    for (size_t q = j0; q < j1 && !s; q++) {
        const lk_st *sh = lk_ckpt_shard(c->ck, q);
        for (size_t i = 0; i < lk_st_metadata_count(sh) && !s; i++) {
            const char *k, *v;
            lk_st_metadata_at(sh, i, &k, &v);
            int seen = 0;
            for (size_t r = j0; r < q && !seen; r++) seen = lk_st_metadata_get(lk_ckpt_shard(c->ck, r), k) != NULL;
            if (!seen && strcmp(k, FUSED_KEY)) s = lk_st_writer_metadata(c->w[j], k, v);
        }
    }
    return s ? s : lk_st_writer_metadata(c->w[j], FUSED_KEY, c->record);
}

static int input_cmp(const void *pa, const void *pb, void *ctx) {
    const lk_fuse_input *in = ctx;
    size_t a = *(const size_t *)pa, b = *(const size_t *)pb;
    int c = strcmp(in[a].path, in[b].path);
    if (c) return c;
    if (in[a].strength != in[b].strength) return in[a].strength < in[b].strength ? -1 : 1;
    if (in[a].format != in[b].format) return in[a].format < in[b].format ? -1 : 1;
    if (in[a].has_alpha != in[b].has_alpha) return in[a].has_alpha < in[b].has_alpha ? -1 : 1;
    if (in[a].has_alpha && in[a].alpha != in[b].alpha) return in[a].alpha < in[b].alpha ? -1 : 1;
    return a < b ? -1 : a > b;
}

void lk_fuse_canonical_order(const lk_fuse_input *in, size_t n, size_t *order) {
    for (size_t i = 0; i < n; i++) order[i] = i;
    qsort_r(order, n, sizeof *order, input_cmp, (void *)in);
}

/* The plan for model tensor t (the tracker uses the same one). */
static lk_status gather(const fctx *c, const lk_tensor *t, lk_fuse_key *k) {
    return lk_fuse_key_plan(c->ord_ad, c->ord_s, c->n_ad, t, c->terms, k);
}

/* Shared by lk_fuse_file and lk_fuse_tensors, so both refuse and sum
 * exactly alike: checks the inputs, opens every adapter, resolves it against
 * model[0..nt) (strict unless fo->allow_unmatched; alpha by fo->alpha_from) and sizes the term list.
 * label names the model in errors. Nothing is written. */
static lk_status prepare(fctx *c, const char *label, const lk_tensor *model, size_t nt, const lk_fuse_input *inputs,
                         const lk_adapter_source *const *sources, size_t n, const lk_fuse_file_opts *fo,
                         lk_fuse_stats *st) {
    lk_status s;
    st->convention = fo->fuse.convention;
    for (size_t i = 0; i < n; i++) {
        if (!inputs[i].path) return lk_error(LK_ERR_ARG, "%s: adapter %zu has no path", label, i);
        if (!isfinite(inputs[i].strength))
            return lk_error(LK_ERR_ARG, "%s: strength %g is not finite", inputs[i].path, inputs[i].strength);
    }
    if ((s = alloc_arrays(c, label, n, nt))) return s;
    lk_fuse_canonical_order(inputs, n, c->order);
    /* Open and validate every adapter before anything is written. */
    for (size_t i = 0; i < n; i++) {
        size_t un = 0;
        lk_adapter_opts ao = {.format = inputs[i].format, .alpha_from = fo->alpha_from,
                              .convention = fo->fuse.convention};
        if ((s = lk_cancel_check(fo->fuse.cancel, label))) return s;
        if ((s = lk_fuse_input_open(&inputs[i], sources ? sources[i] : NULL, &ao, &c->ad[i]))) return s;
        c->n_ad = i + 1;
        lk_resolve_opts ro = {.allow_unmatched = fo->allow_unmatched, .arch = fo->arch, .maps = fo->maps,
                              .n_maps = fo->n_maps, .tied = fo->tied, .n_tied = fo->n_tied, .component = fo->component};
        if ((s = lk_adapter_resolve_opts(c->ad[i], model, nt, &ro, &un))) {
            if (s == LK_ERR_UNMATCHED && fo->allow_unmatched) { /* nothing of it lands: name the base too */
                char msg[2048];
                snprintf(msg, sizeof msg, "%s", lk_last_error());
                lk_error(s, "%s (base %s)", msg, label);
            }
            return s;
        }
        st->modules_unmatched += un;
    }
    size_t live = 0;
    for (size_t j = 0; j < n; j++) {
        c->ord_ad[j] = c->ad[c->order[j]];
        c->ord_s[j] = inputs[c->order[j]].strength;
        live += c->ord_s[j] != 0.0;
    }
    for (size_t j = 0; j < n; j++)
        if (live > 1 && c->ord_s[j] != 0.0 && lk_adapter_dora(c->ord_ad[j]))
            return lk_error(LK_ERR_ARG, "%s: a DoRA adapter must be the only adapter in its request (%zu given)",
                            lk_adapter_path(c->ord_ad[j]), live);
    /* every key's plan is checked here, before anything is written */
    for (size_t i = 0; i < nt; i++) {
        lk_fuse_key plan;
        if ((s = gather(c, &model[i], &plan))) return s;
    }
    return LK_OK;
}

/* Checks OUT against every file read (the base's index and shards, each
 * adapter's file and config); a sharded OUT's folder is begun here. */
static lk_status check_out(fctx *c, const char *out, int one_file) {
    lk_out_inputs in = LK_OUT_INPUTS_INIT;
    lk_status s = lk_out_inputs_add_ckpt(&in, c->ck);
    for (size_t i = 0; !s && i < c->n_ad; i++) {
        s = lk_out_inputs_add(&in, lk_adapter_file(c->ad[i]), "adapter");
        const char *cfg = lk_adapter_config_file(c->ad[i]);
        if (!s && cfg) s = lk_out_inputs_add(&in, cfg, "adapter config");
    }
    if (!s) s = one_file ? lk_out_check(out, &in) : lk_out_dir_begin(out, &in, &c->od);
    lk_out_inputs_free(&in);
    return s;
}

/* An in-memory scale's values checked (lk_fp8_scale_values_check); on a
 * device, through a host copy of its few bytes. */
static lk_status scale_check(const fctx *c, const lk_tensor *sc) {
    const int64_t n = (int64_t)lk_tensor_numel(sc);
    if (lk_tensor_on_host(sc)) return lk_fp8_scale_values_check(sc->name, sc->data, sc->dtype, n);
    void *h = NULL;
    lk_status s = lk_device_host_alloc(sc->device, sc->nbytes, &h);
    if (!s) s = lk_device_copy(sc->device, h, sc->data, sc->nbytes, LK_COPY_D2H, c->stream);
    if (!s) s = lk_stream_sync(sc->device, c->stream);
    if (!s) s = lk_fp8_scale_values_check(sc->name, h, sc->dtype, n);
    lk_device_host_free(sc->device, h);
    return s;
}

/* Checks an FP8 weight's plan (LoRA terms only) and finds its scale into
 * c->scale_of[i], marking the scale in c->is_scale; the scale's values too
 * when they are in memory (lk_fuse_tensors). */
static lk_status fp8_prepare(fctx *c, const char *label, const lk_tensor *model, size_t nt, size_t i,
                             const lk_fuse_key *plan) {
    if (plan->replace || plan->dora)
        return lk_error(LK_ERR_UNSUPPORTED, "%s: %s: %s on an FP8 weight is not supported (LoRA terms only)", label,
                        model[i].name, plan->dora ? "DoRA" : "a replacement (modules_to_save, bias)");
    lk_status s = lk_fp8_scale_of(model, nt, i, &c->scale_of[i]);
    if (s) return lk_error_prefix(s, "%s", label);
    if (c->scale_of[i] >= 0) {
        const lk_tensor *sc = &model[c->scale_of[i]];
        c->is_scale[c->scale_of[i]] = 1;
        /* values in memory (lk_fuse_tensors) are checked here; a file's are read and checked by the caller */
        if (sc->data && !c->ck && (s = scale_check(c, sc))) return lk_error_prefix(s, "%s", label);
    }
    return LK_OK;
}

lk_status lk_fuse_input_open(const lk_fuse_input *in, const lk_adapter_source *src, const lk_adapter_opts *opts,
                             lk_adapter **out) {
    if (!in || !out) return lk_error(LK_ERR_ARG, "lk_fuse_input_open: NULL argument");
    lk_adapter_opts o = opts ? *opts : (lk_adapter_opts){0};
    if (in->has_alpha) o.has_alpha = 1, o.alpha = in->alpha; /* the input's own alpha */
    if (!src) return lk_adapter_open_opts(in->path, &o, out);
    lk_adapter_source labelled = *src;
    if (in->path) labelled.label = in->path;
    return lk_adapter_open_mem(&labelled, &o, out);
}

/* Every model tensor's plan, before anything is written: an FP8 weight's
 * layout checked and its scale marked (fp8_prepare); sizes c->buf_bytes (the
 * largest fused tensor, and at least the largest copy chunk), *sbuf_bytes
 * (the largest scale of a fused FP8 weight) and *total (all the bytes, for
 * the progress). Allocates nothing. */
static lk_status plan_tensors(fctx *c, const char *base, size_t nt, size_t *sbuf_bytes, uint64_t *total) {
    size_t copy_bytes = 0;
    for (size_t i = 0; i < nt; i++) {
        size_t nb = c->model[i].nbytes;
        *total += nb;
        lk_fuse_key plan;
        lk_status s = gather(c, &c->model[i], &plan);
        if (s) return s;
        if (!lk_fuse_key_touches(&plan)) {
            if (nb > copy_bytes) copy_bytes = nb;
            continue;
        }
        if (nb > c->buf_bytes) c->buf_bytes = nb;
        if (!lk_dtype_is_fp8(c->model[i].dtype)) continue;
        if ((s = fp8_prepare(c, base, c->model, nt, i, &plan))) return s;
        if (c->scale_of[i] >= 0 && c->model[c->scale_of[i]].nbytes > *sbuf_bytes)
            *sbuf_bytes = c->model[c->scale_of[i]].nbytes;
    }
    if (copy_bytes > COPY_CHUNK) copy_bytes = COPY_CHUNK;
    if (copy_bytes > c->buf_bytes) c->buf_bytes = copy_bytes;
    return LK_OK;
}

/* The scale buffer c->sbuf (sbuf_bytes; freed by fctx_free), then every
 * fused FP8 weight's scale values read into it and checked, before
 * anything is written. */
static lk_status check_fp8_scales(fctx *c, const char *base, size_t nt, size_t sbuf_bytes) {
    if (sbuf_bytes && !(c->sbuf = lk_malloc(sbuf_bytes))) return lk_error(LK_ERR_NOMEM, "%s: out of memory", base);
    for (size_t i = 0; i < nt; i++) {
        long si = c->scale_of[i];
        if (si < 0) continue;
        const lk_tensor *sc = &c->model[si];
        lk_status s = lk_ckpt_read(c->ck, (size_t)si, 0, c->sbuf, sc->nbytes);
        if (!s) s = lk_fp8_scale_values_check(sc->name, c->sbuf, sc->dtype, (int64_t)lk_tensor_numel(sc));
        if (s) return lk_error_prefix(s, "%s", base);
    }
    return LK_OK;
}

/* c->record: the base's lorakit.fused record followed by this request, each
 * input recorded with the format its adapter was read as. */
static lk_status make_record(fctx *c, const char *base, const lk_fuse_input *inputs, size_t n,
                             const lk_fuse_file_opts *fo) {
    lk_fuse_input *rec = lk_malloc((n ? n : 1) * sizeof *rec);
    if (!rec) return lk_error(LK_ERR_NOMEM, "%s: out of memory", base);
    for (size_t i = 0; i < n; i++) {
        rec[i] = inputs[i];
        rec[i].format = lk_adapter_get_format(c->ad[i]);
    }
    json_t *hold;
    const char *old = base_record(c->ck, &hold);
    lk_status s = fused_record(lk_ckpt_path(c->ck), old, rec, n, fo->alpha_from, fo->fuse.convention, &c->record);
    json_decref(hold);
    lk_free(rec);
    return s;
}

/* The writer of model tensor i, and i's index in it (*wi): tensors are
 * declared in checkpoint order, so that is its index in the checkpoint
 * (one file) or in its shard. */
static lk_st_writer *writer_of(const fctx *c, size_t i, size_t *wi) {
    *wi = c->one_file ? i : lk_ckpt_tensor_local(c->ck, i);
    return c->w[c->one_file ? 0 : lk_ckpt_tensor_shard(c->ck, i)];
}

/* The output's writers (c->w; fctx_free frees them, and their temporary
 * files with them): one output file, or, for a sharded base fused to a
 * folder, one per shard in a temporary folder (c->od). OUT is checked
 * against every input first (check_out); then each writer gets its
 * metadata and its tensors declared, and begins. */
static lk_status open_writers(fctx *c, const char *base, const char *out, size_t nt) {
    c->one_file = !lk_ckpt_sharded(c->ck) || lk_out_is_file(out);
    size_t n_w = c->one_file ? 1 : lk_ckpt_shard_count(c->ck);
    if (!(c->w = lk_calloc(n_w, sizeof *c->w))) return lk_error(LK_ERR_NOMEM, "%s: out of memory", base);
    c->n_w = n_w;
    /* OUT (each of its files) is none of the inputs, by any path, and no
     * device, FIFO or folder is replaced (io/out_file.h) */
    lk_status s = check_out(c, out, c->one_file);
    for (size_t j = 0; !s && j < c->n_w; j++) {
        char *wp = c->one_file ? NULL : lk_out_dir_file(c->od, lk_ckpt_shard_name(c->ck, j));
        if (!c->one_file && !wp) return lk_error(LK_ERR_NOMEM, "%s: out of memory", out);
        s = lk_st_writer_create(c->one_file ? out : wp, &c->w[j]);
        lk_free(wp);
        if (!s) s = writer_metadata(c, j, c->one_file);
    }
    for (size_t i = 0; !s && i < nt; i++) {
        size_t wi;
        lk_st_writer *w = writer_of(c, i, &wi);
        s = lk_st_writer_declare(w, c->model[i].name, c->model[i].dtype, c->model[i].ndim,
                                 c->model[i].shape, NULL);
    }
    for (size_t j = 0; !s && j < c->n_w; j++) s = lk_st_writer_begin(c->w[j]);
    return s;
}

/* lk_fuse_fp8 on FP8 weight t, its bytes at w, with its scale sc's bytes at
 * sd (sc NULL: no scale). */
static lk_status fuse_fp8_weight(const fctx *c, const lk_tensor *t, void *w, const lk_tensor *sc, void *sd,
                                 const lk_fuse_key *plan, const lk_fuse_opts *fo) {
    return lk_fuse_fp8(w, t->dtype, t->shape[0], (int64_t)(lk_tensor_numel(t) / (size_t)t->shape[0]),
                       sc ? sd : NULL, sc ? sc->dtype : LK_DTYPE_F32, sc ? (int64_t)lk_tensor_numel(sc) : 0,
                       c->terms, plan->n_terms, fo, t->name);
}

/* Fused tensor i: read whole into c->buf (an FP8 weight's scale into
 * c->sbuf), fused there in place, written (the scale too, possibly
 * rescaled). */
static lk_status write_fused(fctx *c, size_t i, const lk_fuse_key *plan, const char *base, const lk_fuse_opts *fo) {
    const lk_tensor *t = &c->model[i];
    const long si = c->scale_of[i];
    const lk_tensor *sc = si >= 0 ? &c->model[si] : NULL;
    lk_status s = lk_ckpt_read(c->ck, i, 0, c->buf, t->nbytes);
    if (!s && sc) s = lk_ckpt_read(c->ck, (size_t)si, 0, c->sbuf, sc->nbytes);
    if (s) return s;
    if (c->dev.kind != LK_DEVICE_CPU) s = lk_fuse_key_staged(c->dev, t, c->buf, sc, c->sbuf, plan, c->terms, fo, &c->dstats);
    else if (lk_dtype_is_fp8(t->dtype)) s = fuse_fp8_weight(c, t, c->buf, sc, c->sbuf, plan, fo);
    else s = lk_fuse_key_apply(c->buf, c->buf, t, plan, c->terms, fo);
    if (s) return lk_error_at(lk_error_prefix(s, "%s", base), base, t->name);
    size_t wi, swi;
    lk_st_writer *w = writer_of(c, i, &wi);
    if ((s = lk_st_writer_write(w, wi, 0, c->buf, t->nbytes)) || !sc) return s;
    lk_st_writer *sw = writer_of(c, (size_t)si, &swi);
    return lk_st_writer_write(sw, swi, 0, c->sbuf, sc->nbytes);
}

/* Untouched tensor i, copied byte for byte through c->buf in chunks. */
static lk_status copy_tensor(fctx *c, size_t i, const char *base, const lk_fuse_opts *fo) {
    const lk_tensor *t = &c->model[i];
    size_t wi;
    lk_st_writer *w = writer_of(c, i, &wi);
    lk_status s = LK_OK;
    for (size_t off = 0; !s && off < t->nbytes;) {
        size_t len = t->nbytes - off < c->buf_bytes ? t->nbytes - off : c->buf_bytes;
        if (off && (s = lk_cancel_check(fo->cancel, base))) break; /* a cancellation point per chunk */
        if (!(s = lk_ckpt_read(c->ck, i, off, c->buf, len))) s = lk_st_writer_write(w, wi, off, c->buf, len);
        off += len;
    }
    return s;
}

/* Model tensor i into its writer: fused (write_fused) or copied; the scale
 * of a fused FP8 weight is skipped here (written with its weight). */
static lk_status write_tensor(fctx *c, size_t i, const char *base, const lk_fuse_opts *fo, lk_fuse_stats *st) {
    if (c->is_scale[i]) return LK_OK;
    lk_fuse_key plan;
    lk_status s = lk_cancel_check(fo->cancel, base); /* a cancellation point per tensor */
    if (!s) s = gather(c, &c->model[i], &plan);
    if (s) return s;
    if (!lk_fuse_key_touches(&plan)) return copy_tensor(c, i, base, fo);
    if (!(s = write_fused(c, i, &plan, base, fo))) st->tensors_fused++;
    return s;
}

/* Commits every writer (each renames its file into place), then for a
 * sharded output writes the index and the small files and renames the
 * folder onto OUT (c->od is NULL after; on a failure fctx_free removes it). */
static lk_status publish(fctx *c) {
    lk_status s = LK_OK;
    for (size_t j = 0; !s && j < c->n_w; j++) s = lk_st_writer_commit(c->w[j]);
    if (s || !c->od) return s;
    if ((s = lk_out_dir_index(c->od, c->ck, FUSED_KEY, c->record)) || (s = lk_out_dir_copy_small(c->od, c->ck)) ||
        (s = lk_out_dir_commit(c->od)))
        return s;
    c->od = NULL;
    return LK_OK;
}

/* Plan (every adapter resolved, every key's plan and FP8 scale checked),
 * record, open the writers, write every tensor in the base's order, publish:
 * nothing is written before the plan holds, and a failure at any step
 * leaves no output (fctx_free). */
lk_status lk_fuse_checkpoint(const char *base, const lk_fuse_input *inputs, const lk_adapter_source *const *sources,
                             size_t n, const char *out, const lk_fuse_file_opts *opts, lk_fuse_stats *stats) {
    static const lk_fuse_file_opts defaults;
    if (!opts) opts = &defaults;
    if (!base || !out || (n && !inputs)) return lk_error(LK_ERR_ARG, "lk_fuse_file: NULL argument");
    double t0 = lk_now_s();
    fctx c;
    memset(&c, 0, sizeof c);
    c.dev = opts->device;
    lk_fuse_stats st = {0};
    size_t nt = 0, sbuf_bytes = 0;
    uint64_t total_bytes = 0, done = 0;
    lk_status s = lk_device_check(c.dev);
    if (!s) s = lk_ckpt_open(base, &c.ck);
    if (!s) {
        st.tensors_total = nt = lk_ckpt_count(c.ck);
        c.model = lk_ckpt_tensor(c.ck, 0); /* the tensors are one array (a copy was 96 bytes a tensor more) */
        s = prepare(&c, base, c.model, nt, inputs, sources, n, opts, &st);
    }
    if (!s) s = plan_tensors(&c, base, nt, &sbuf_bytes, &total_bytes);
    if (!s) s = check_fp8_scales(&c, base, nt, sbuf_bytes);
    if (!s && c.buf_bytes && !(c.buf = lk_malloc(c.buf_bytes)))
        s = lk_error(LK_ERR_NOMEM, "%s: out of memory for a %zu-byte tensor buffer", base, c.buf_bytes);
    if (!s) s = make_record(&c, base, inputs, n, opts);
    if (!s) s = open_writers(&c, base, out, nt);
    for (size_t i = 0; !s && i < nt; i++) {
        if ((s = write_tensor(&c, i, base, &opts->fuse, &st))) break;
        done += c.model[i].nbytes;
        if (opts->on_progress) opts->on_progress(opts->progress_ctx, done, total_bytes, i + 1, nt);
    }
    if (!s) s = publish(&c);
    if (!s && stats) {
        st.seconds = lk_now_s() - t0;
        st.keys_device = c.dstats.keys_device;
        st.keys_host_fallback = c.dstats.keys_host_fallback;
        *stats = st;
    }
    fctx_free(&c);
    return s;
}

lk_status lk_fuse_tensors(lk_tensor *tensors, size_t nt, const lk_fuse_input *inputs, size_t n,
                          const lk_fuse_file_opts *opts, lk_fuse_stats *stats) {
    return lk_fuse_tensors_src(tensors, nt, inputs, NULL, n, opts, stats);
}

/* LK_ERR_ARG naming t and why when the fuse would write t but the caller
 * marked it unwritable (lk_tensor.frozen). */
static lk_status frozen_check(const char *label, const lk_tensor *t) {
    return t->frozen ? lk_error(LK_ERR_ARG, "%s: %s: an adapter writes it, but %s", label, t->name, t->frozen)
                     : LK_OK;
}

/* Every tensor of an in-memory fuse checked (its data there, its plan, an
 * FP8 weight's layout and scale values), then the backup of every touched
 * tensor and FP8 scale taken as one allocation (c->buf) before the first
 * write, so running out of memory changes nothing. */
static lk_status plan_backup(fctx *c, const char *label, const lk_tensor *tensors, size_t nt) {
    size_t backup_bytes = 0;
    for (size_t i = 0; i < nt; i++) {
        if (!tensors[i].data && tensors[i].nbytes)
            return lk_error(LK_ERR_ARG, "%s: %s has no data", label, tensors[i].name);
        lk_fuse_key plan;
        lk_status s = gather(c, &tensors[i], &plan);
        if (s) return s;
        if (!lk_fuse_key_touches(&plan)) continue;
        if ((s = frozen_check(label, &tensors[i]))) return s;
        backup_bytes += tensors[i].nbytes;
        if (!lk_dtype_is_fp8(tensors[i].dtype)) continue;
        if ((s = fp8_prepare(c, label, tensors, nt, i, &plan))) return s;
        if (c->scale_of[i] >= 0 && (s = frozen_check(label, &tensors[c->scale_of[i]]))) return s;
        if (c->scale_of[i] >= 0) backup_bytes += tensors[c->scale_of[i]].nbytes;
    }
    if (backup_bytes && c->dev.kind != LK_DEVICE_CPU) {
        lk_status s = lk_device_alloc(c->dev, backup_bytes, &c->dbuf);
        return s ? lk_error_prefix(s, "%s: the device backup of the fused tensors", label) : LK_OK;
    }
    if (backup_bytes && !(c->buf = lk_malloc(backup_bytes)))
        return lk_error(LK_ERR_NOMEM, "%s: out of memory for a %zu-byte backup of the fused tensors", label,
                        backup_bytes);
    return LK_OK;
}

/* Moves n bytes for the backup of an in-memory fuse: memcpy on the host, a
 * device-to-device copy on c->stream for device tensors. */
static lk_status backup_move(const fctx *c, void *dst, const void *src, size_t n) {
    if (c->dev.kind == LK_DEVICE_CPU) {
        memcpy(dst, src, n);
        return LK_OK;
    }
    return lk_device_copy(c->dev, dst, src, n, LK_COPY_D2D, c->stream);
}

/* The device of an in-memory fuse's tensors into c->dev (cpu for host
 * tensors); tensors on two devices are LK_ERR_ARG naming one on each. */
static lk_status tensors_device(fctx *c, const char *label, const lk_tensor *tensors, size_t nt) {
    for (size_t i = 1; i < nt; i++)
        if (!lk_device_equal(tensors[i].device, tensors[0].device)) {
            char a[LK_DEVICE_STR_MAX], b[LK_DEVICE_STR_MAX];
            return lk_error(LK_ERR_ARG, "%s: %s is on %s but %s is on %s: one fuse works on one device", label,
                            tensors[0].name, lk_device_str(tensors[0].device, a), tensors[i].name,
                            lk_device_str(tensors[i].device, b));
        }
    c->dev = nt ? tensors[0].device : (lk_device){LK_DEVICE_CPU, 0};
    lk_status s = lk_device_check(c->dev);
    return s ? lk_error_prefix(s, "%s", label) : LK_OK;
}

/* Tensor i's bytes appended to the backup at *off, its index to c->backup. */
static lk_status back_up(fctx *c, const lk_tensor *tensors, size_t i, size_t *off, size_t *n_bk) {
    char *b = c->dev.kind == LK_DEVICE_CPU ? c->buf : c->dbuf;
    lk_status s = backup_move(c, b + *off, tensors[i].data, tensors[i].nbytes);
    if (s) return lk_error_prefix(s, "%s: backing up", tensors[i].name);
    *off += tensors[i].nbytes;
    c->backup[(*n_bk)++] = i;
    return LK_OK;
}

/* One touched key fused in place (t's device's kernel, or the CPU's). */
static lk_status fuse_one(fctx *c, lk_tensor *t, lk_tensor *sc, const lk_fuse_key *plan, const lk_fuse_opts *fo) {
    if (c->dev.kind != LK_DEVICE_CPU)
        return lk_dtype_is_fp8(t->dtype) ? lk_fuse_fp8_dev(t, sc, c->terms, plan->n_terms, fo, c->stream, &c->dstats)
                                         : lk_fuse_key_apply_dev(t, plan, c->terms, fo, c->stream, &c->dstats);
    if (lk_dtype_is_fp8(t->dtype)) return fuse_fp8_weight(c, t, t->data, sc, sc ? sc->data : NULL, plan, fo);
    return lk_fuse_key_apply(t->data, t->data, t, plan, c->terms, fo);
}

/* Every touched tensor fused in place, backed up first (with an FP8
 * weight's scale); a failure part-way (LK_ERR_NONFINITE from a kernel)
 * gives every tensor backed up so far its bytes back. */
static lk_status fuse_in_place(fctx *c, lk_tensor *tensors, size_t nt, const lk_fuse_opts *fo, lk_fuse_stats *st) {
    size_t off = 0, n_bk = 0;
    lk_status s = LK_OK;
    for (size_t i = 0; i < nt && !s; i++) {
        lk_tensor *t = &tensors[i];
        lk_fuse_key plan;
        if (c->is_scale[i]) continue; /* with its weight */
        if ((s = lk_cancel_check(fo->cancel, "tensors")) || (s = gather(c, t, &plan))) break;
        if (!lk_fuse_key_touches(&plan)) continue;
        long si = c->scale_of[i];
        lk_tensor *sc = si >= 0 ? &tensors[si] : NULL;
        s = back_up(c, tensors, i, &off, &n_bk);
        if (!s && sc) s = back_up(c, tensors, (size_t)si, &off, &n_bk);
        if (!s) s = fuse_one(c, t, sc, &plan, fo);
        if (!s) st->tensors_fused++;
        else lk_error_at(s, NULL, t->name);
    }
    if (s) { /* every tensor backed up so far back to its bytes */
        const char *b = c->dev.kind == LK_DEVICE_CPU ? c->buf : c->dbuf;
        size_t back = 0;
        for (size_t j = 0; j < n_bk; j++) {
            if (backup_move(c, tensors[c->backup[j]].data, b + back, tensors[c->backup[j]].nbytes))
                lk_log(LK_LOG_ERROR, "%s: restoring its bytes after a failed fuse failed too", tensors[c->backup[j]].name);
            back += tensors[c->backup[j]].nbytes;
        }
    }
    if (c->dev.kind != LK_DEVICE_CPU) { /* the backup is freed after this: its copies must be done */
        lk_status ss = lk_stream_sync(c->dev, c->stream);
        if (!s) s = ss;
    }
    return s;
}

/* Plan (prepare, plan_backup), then fuse in place (fuse_in_place): as
 * lk_fuse_checkpoint refuses and sums, with the tensors as they were on
 * any failure. */
lk_status lk_fuse_tensors_src(lk_tensor *tensors, size_t nt, const lk_fuse_input *inputs,
                              const lk_adapter_source *const *sources, size_t n, const lk_fuse_file_opts *opts,
                              lk_fuse_stats *stats) {
    static const lk_fuse_file_opts defaults;
    if (!opts) opts = &defaults;
    if ((nt && !tensors) || (n && !inputs)) return lk_error(LK_ERR_ARG, "lk_fuse_tensors: NULL argument");
    double t0 = lk_now_s();
    const char *label = "tensors";
    fctx c;
    memset(&c, 0, sizeof c);
    lk_fuse_stats st = {0};
    st.tensors_total = nt;
    c.stream = opts->stream;
    lk_status s = tensors_device(&c, label, tensors, nt);
    if (!s) s = prepare(&c, label, tensors, nt, inputs, sources, n, opts, &st);
    if (!s) s = plan_backup(&c, label, tensors, nt);
    if (!s) s = fuse_in_place(&c, tensors, nt, &opts->fuse, &st);
    if (!s && stats) {
        st.seconds = lk_now_s() - t0;
        st.keys_device = c.dstats.keys_device;
        st.keys_host_fallback = c.dstats.keys_host_fallback;
        *stats = st;
    }
    fctx_free(&c);
    return s;
}
char *lk_fuse_summary_json(const char *base, const char *out, const lk_fuse_input *inputs, size_t n,
                           const lk_fuse_stats *st) {
    json_t *ads = json_array();
    int bad = !ads;
    for (size_t i = 0; i < n && !bad; i++) {
        json_t *e = json_pack("{s:s, s:f}", "path", inputs[i].path, "strength", inputs[i].strength);
        if (e && inputs[i].has_alpha) bad |= json_object_set_new(e, "alpha", json_real(inputs[i].alpha));
        bad |= json_array_append_new(ads, e);
    }
    json_t *o = bad ? NULL : json_object();
    if (!o) {
        json_decref(ads);
        return NULL;
    }
    if (base) bad |= json_object_set_new(o, "base", json_string(base));
    if (out) bad |= json_object_set_new(o, "out", json_string(out));
    bad |= json_object_set_new(o, "adapters", ads);
    bad |= json_object_set_new(o, "tensors_total", json_integer((json_int_t)st->tensors_total));
    bad |= json_object_set_new(o, "tensors_fused", json_integer((json_int_t)st->tensors_fused));
    bad |= json_object_set_new(o, "modules_unmatched", json_integer((json_int_t)st->modules_unmatched));
    bad |= json_object_set_new(o, "convention", json_string(lk_convention_name(st->convention)));
    bad |= json_object_set_new(o, "seconds", json_real(st->seconds));
    char *r = bad ? NULL : dumps_exact(o, JSON_COMPACT);
    json_decref(o);
    return r;
}
