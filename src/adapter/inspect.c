/* inspect.c — lk_inspect_json / lk_inspect_write: a checkpoint or an adapter described as one
 * JSON object (lorakit/inspect.h). It lives in the library, not the CLI, so
 * `lorakit inspect` (which prints it, or a text form read back from it) and
 * the Python package's lorakit.inspect() cannot drift apart. It sits at the
 * adapter layer because an adapter is described through lk_adapter_open. */
#include "lorakit/inspect.h"
#include "lorakit/adapter.h"
#include "lorakit/alloc.h"
#include "lorakit/checkpoint.h"
#include "lorakit/safetensors.h"
#include "adapter/adapter.h"
#include "adapter/layout.h"
#include "core/file.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct group {
    const char *algo;
    int rank;
    double alpha, scale;
    const char *source; /* where alpha came from */
    size_t count;
    const char *example;
} group;

static int group_cmp(const void *pa, const void *pb) {
    const group *a = pa, *b = pb;
    int c = strcmp(a->algo, b->algo);
    if (c) return c;
    if (a->rank != b->rank) return a->rank < b->rank ? -1 : 1;
    if (a->alpha != b->alpha) return a->alpha < b->alpha ? -1 : 1;
    if (a->scale != b->scale) return a->scale < b->scale ? -1 : 1;
    return strcmp(a->source, b->source);
}

/* Groups of equal (rank, alpha, scale, alpha source), sorted; *ng gets their count. */
static group *make_groups(const lk_adapter *a, size_t *ng) {
    size_t n = lk_adapter_count(a), k = 0;
    group *g = lk_calloc(n ? n : 1, sizeof *g);
    if (!g) return NULL;
    for (size_t i = 0; i < n; i++) {
        const lk_lora_module *m = lk_adapter_module(a, i);
        group key = {lk_algo_name(m->algo), m->rank, m->alpha, (float)m->scale, m->alpha_source, 1, m->module};
        size_t j = 0;
        while (j < k && group_cmp(&g[j], &key)) j++;
        if (j < k) g[j].count++;
        else g[k++] = key;
    }
    qsort(g, k, sizeof *g, group_cmp);
    *ng = k;
    return g;
}

/* NULL when out of memory or a string is not UTF-8. */
static json_t *adapter_json(const lk_adapter *a) {
    size_t ng = 0;
    group *g = make_groups(a, &ng);
    json_t *groups = json_array(), *mods = json_array(), *reps = json_array();
    int bad = !g || !groups || !mods || !reps;
    for (size_t i = 0; i < ng && !bad; i++)
        bad |= json_array_append_new(groups, json_pack("{s:s, s:i, s:f, s:f, s:s, s:I, s:s}", "algo", g[i].algo, "rank",
                                                       g[i].rank, "alpha",
                                                       (double)g[i].alpha, "scale", (double)g[i].scale, "alpha_source",
                                                       g[i].source, "count", (json_int_t)g[i].count, "example",
                                                       g[i].example));
    for (size_t i = 0; i < lk_adapter_count(a) && !bad; i++) {
        const lk_lora_module *m = lk_adapter_module(a, i);
        /* the module's own tensors: key and shape each */
        const lk_tensor *ts[LK_MODULE_MAX_TENSORS];
        size_t nts = lk_lora_module_tensors(m, ts);
        json_t *tens = json_object();
        bad |= !tens;
        for (size_t k = 0; k < nts && !bad; k++) {
            json_t *sh = json_array();
            for (int d = 0; sh && d < ts[k]->ndim; d++) bad |= json_array_append_new(sh, json_integer(ts[k]->shape[d]));
            bad |= !sh || json_object_set_new(tens, ts[k]->name, json_pack("{s:o, s:s}", "shape", sh, "dtype",
                                                                              lk_dtype_name(ts[k]->dtype)));
        }
        const int lora = m->algo == LK_ALGO_LORA;
        bad |= json_array_append_new(
            mods, json_pack("{s:s, s:s, s:i, s:f, s:f, s:s, s:I, s:I, s:s, s:s, s:b, s:b, s:b, s:b, s:o}", "module",
                            m->module, "algo", lk_algo_name(m->algo), "rank", m->rank, "alpha", (double)m->alpha,
                            "scale", (double)m->scale, "alpha_source", m->alpha_source, "in", (json_int_t)m->in,
                            "out", (json_int_t)m->out, "dtype_A", lora ? lk_dtype_name(m->A.dtype) : "",
                            "dtype_B", lora ? lk_dtype_name(m->B.dtype) : "", "dora",
                            m->magnitude.data != NULL || m->dora_scale.data != NULL, "lora_bias",
                            m->bias.data != NULL, "tucker", m->mid.data || m->t1.data || m->t2.data, "conv",
                            (m->A.ndim == 4 && (m->A.shape[2] != 1 || m->A.shape[3] != 1)) || m->mid.data ||
                                m->t1.data || m->t2.data || m->w2.ndim == 4 || m->w1b.ndim == 4,
                            "tensors", tens));
    }
    for (size_t i = 0; i < lk_adapter_replacement_count(a) && !bad; i++) {
        const lk_adapter_tensor *r = lk_adapter_replacement(a, i);
        bad |= json_array_append_new(reps, json_pack("{s:s, s:s, s:s}", "key", r->key, "kind", r->why, "dtype",
                                                     lk_dtype_name(r->t.dtype)));
    }
    lk_free(g);
    if (bad) {
        json_decref(groups);
        json_decref(mods);
        json_decref(reps);
        return NULL;
    }
    return json_pack("{s:s, s:s, s:s, s:b, s:b, s:b, s:I, s:I, s:o, s:o, s:o}", "path", lk_adapter_path(a), "file",
                     lk_adapter_file(a), "format", lk_adapter_format_name(lk_adapter_get_format(a)), "config",
                     lk_adapter_has_config(a), "rslora", lk_adapter_rslora(a), "dora", lk_adapter_dora(a),
                     "module_count", (json_int_t)lk_adapter_count(a), "untargeted",
                     (json_int_t)lk_adapter_untargeted(a), "groups", groups, "modules", mods, "replaced", reps);
}

/* The metadata shown: a single file's own, or a sharded set's index
 * metadata (whose values may be numbers), as a JSON object. */
static json_t *ck_metadata(const lk_ckpt *ck) {
    if (lk_ckpt_sharded(ck)) return json_loads(lk_ckpt_index_metadata(ck), 0, NULL);
    const lk_st *st = lk_ckpt_shard(ck, 0);
    json_t *meta = json_object();
    for (size_t i = 0; meta && i < lk_st_metadata_count(st); i++) {
        const char *k, *v;
        lk_st_metadata_at(st, i, &k, &v);
        if (json_object_set_new(meta, k, json_string(v))) {
            json_decref(meta);
            return NULL;
        }
    }
    return meta;
}

/* Writes text to the sink; NULL text (a failed json_dumps) is an error. */
typedef struct {
    lk_inspect_sink sink;
    void *ctx;
    int bad;  /* a value could not be encoded (not UTF-8, or no memory) */
    int stop; /* the sink said stop */
} out_t;

static void put(out_t *o, const char *text, size_t len) {
    if (o->bad || o->stop) return;
    if (!text) o->bad = 1;
    else if (o->sink(text, len, o->ctx)) o->stop = 1;
}

static void put_s(out_t *o, const char *text) { put(o, text, text ? strlen(text) : 0); }

/* Writes v compactly (jansson's encoding, so the text is what one dump of
 * the whole object gave) and releases it. */
static void put_json(out_t *o, json_t *v) {
    char *js = v ? json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY) : NULL;
    put_s(o, js);
    free(js);
    json_decref(v);
}

static void put_u(out_t *o, unsigned long long v) {
    char b[32];
    put(o, b, (size_t)snprintf(b, sizeof b, "%llu", v));
}

/* The checkpoint's JSON, one tensor at a time: a 1.3 M-tensor file is never
 * a DOM or one string here (in lk_inspect_json, the string only). A sharded
 * set adds "index" (its file name), "shards" ([{name, tensors, bytes}]) and
 * a "shard" per tensor; "offset" is then within that shard's file, and
 * file_bytes / header_bytes are summed over the shards. */
static void ck_write(const lk_ckpt *ck, out_t *o) {
    size_t n = lk_ckpt_count(ck), ns = lk_ckpt_shard_count(ck);
    int sharded = lk_ckpt_sharded(ck);
    size_t count[LK_DTYPE_COUNT] = {0};
    unsigned long long bytes[LK_DTYPE_COUNT] = {0}, total = 0, header = 0;
    for (size_t i = 0; i < n; i++) {
        const lk_tensor *x = lk_ckpt_tensor(ck, i);
        count[x->dtype]++;
        bytes[x->dtype] += x->nbytes;
        total += x->nbytes;
    }
    for (size_t j = 0; j < ns; j++) header += lk_st_header_len(lk_ckpt_shard(ck, j));
    put_s(o, "{\"path\":");
    put_json(o, json_string(lk_ckpt_path(ck)));
    put_s(o, ",\"file_bytes\":");
    put_u(o, 8 * ns + header + total);
    put_s(o, ",\"header_bytes\":");
    put_u(o, header);
    put_s(o, ",\"metadata\":");
    put_json(o, ck_metadata(ck));
    if (sharded) {
        json_t *sh = json_array();
        int bad = !sh;
        for (size_t j = 0; sh && j < ns; j++) {
            const lk_st *st = lk_ckpt_shard(ck, j);
            json_int_t b = 0;
            for (size_t i = 0; i < lk_st_count(st); i++) b += (json_int_t)lk_st_tensor(st, i)->nbytes;
            bad |= json_array_append_new(sh, json_pack("{s:s,s:I,s:I}", "name", lk_ckpt_shard_name(ck, j), "tensors",
                                                       (json_int_t)lk_st_count(st), "bytes", b));
        }
        put_s(o, ",\"index\":");
        put_json(o, json_string(lk_ckpt_index_name(ck)));
        put_s(o, ",\"shards\":");
        if (bad) {
            json_decref(sh);
            sh = NULL;
        }
        put_json(o, sh);
    }
    put_s(o, ",\"tensors\":[");
    for (size_t i = 0; i < n && !o->bad && !o->stop; i++) {
        const lk_tensor *t = lk_ckpt_tensor(ck, i);
        json_t *e = json_object(), *sh = json_array();
        int bad = !e || !sh;
        size_t j = lk_ckpt_tensor_shard(ck, i);
        for (int d = 0; sh && d < t->ndim; d++) bad |= json_array_append_new(sh, json_integer(t->shape[d]));
        if (e) {
            bad |= json_object_set_new(e, "name", json_string(t->name));
            bad |= json_object_set_new(e, "dtype", json_string(lk_dtype_name(t->dtype)));
            bad |= json_object_set_new(e, "shape", sh);
            sh = NULL;
            bad |= json_object_set_new(e, "bytes", json_integer((json_int_t)t->nbytes));
            bad |= json_object_set_new(
                e, "offset", json_integer((json_int_t)lk_st_file_offset(lk_ckpt_shard(ck, j), lk_ckpt_tensor_local(ck, i))));
            if (sharded) bad |= json_object_set_new(e, "shard", json_string(lk_ckpt_shard_name(ck, j)));
        }
        json_decref(sh);
        if (bad) {
            json_decref(e);
            e = NULL;
        }
        if (i) put_s(o, ",");
        put_json(o, e);
    }
    put_s(o, "],\"totals\":");
    json_t *tj = json_object();
    for (int d = 1; tj && d < LK_DTYPE_COUNT; d++)
        if (count[d] && json_object_set_new(tj, lk_dtype_name((lk_dtype)d),
                                            json_pack("{s:I,s:I}", "tensors", (json_int_t)count[d], "bytes",
                                                      (json_int_t)bytes[d]))) {
            json_decref(tj);
            tj = NULL;
        }
    put_json(o, tj);
    put_s(o, ",\"tensor_count\":");
    put_u(o, n);
    put_s(o, ",\"total_bytes\":");
    put_u(o, total);
    put_s(o, "}");
}

/* A folder holding neither adapter_model.safetensors nor adapter_config.json
 * is a checkpoint folder (a sharded set or one .safetensors file). */
static int is_checkpoint_dir(const char *path) {
    struct stat sb;
    if (stat(path, &sb) != 0 || !S_ISDIR(sb.st_mode)) return 0;
    static const char *const adapter_files[] = {"adapter_model.safetensors", "adapter_config.json"};
    for (size_t i = 0; i < 2; i++) {
        char p[4096];
        if (snprintf(p, sizeof p, "%s/%s", path, adapter_files[i]) >= (int)sizeof p) return 0;
        if (access(p, F_OK) == 0) return 0;
    }
    return 1;
}

int lk_inspect_is_adapter(const char *path) {
    return path && lk_adapter_looks_like(path) && !is_checkpoint_dir(path);
}

lk_status lk_inspect_write(const char *path, const lk_adapter_opts *opts, lk_inspect_sink sink, void *ctx) {
    if (!path || !sink) return lk_error(LK_ERR_ARG, "lk_inspect_write: NULL argument");
    out_t o = {sink, ctx, 0, 0};
    if (lk_inspect_is_adapter(path)) {
        lk_adapter *a;
        lk_status s = lk_adapter_open_opts(path, opts, &a);
        if (s) return s;
        put_json(&o, adapter_json(a));
        lk_adapter_free(a);
    } else {
        lk_ckpt *ck;
        lk_status s = lk_ckpt_open(path, &ck);
        if (s) return s;
        ck_write(ck, &o);
        lk_ckpt_close(ck);
    }
    /* jansson refuses a string that is not UTF-8 the same way as a failed
     * allocation; the former is the likely one */
    if (o.bad)
        return lk_error(LK_ERR_UNSUPPORTED, "%s: cannot describe as JSON (a name or path that is not UTF-8, or out "
                        "of memory)", path);
    if (o.stop) return lk_error(LK_ERR_IO, "%s: the description could not be written out", path);
    return LK_OK;
}

typedef struct {
    char *p;
    size_t len, cap;
    int nomem;
} sbuf;

static int sbuf_put(const char *text, size_t len, void *ctx) {
    sbuf *b = ctx;
    if (len + 1 > b->cap - b->len) {
        size_t cap = b->cap ? b->cap : 4096;
        while (len + 1 > cap - b->len) {
            if (cap > SIZE_MAX / 2) return b->nomem = 1;
            cap *= 2;
        }
        char *p = lk_realloc(b->p, cap);
        if (!p) return b->nomem = 1;
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, text, len);
    b->len += len;
    b->p[b->len] = '\0';
    return 0;
}

lk_status lk_inspect_json(const char *path, char **out) { return lk_inspect_json_opts(path, NULL, out); }

lk_status lk_inspect_json_opts(const char *path, const lk_adapter_opts *opts, char **out) {
    if (!path || !out) return lk_error(LK_ERR_ARG, "lk_inspect_json: NULL argument");
    *out = NULL;
    sbuf b = {0};
    lk_status s = lk_inspect_write(path, opts, sbuf_put, &b);
    if (s) {
        lk_free(b.p);
        return b.nomem ? lk_error(LK_ERR_NOMEM, "%s: out of memory building JSON", path) : s;
    }
    *out = b.p;
    return LK_OK;
}

/* ---- where an adapter lands on a base (inspect ADAPTER --base CKPT) ---- */

/* Levenshtein distance of a and b, or cap when it is at least cap (rows of
 * at most 256 + 1 cells; longer names are cut there). */
static size_t edit_distance(const char *a, const char *b, size_t cap) {
    size_t la = strlen(a), lb = strlen(b);
    if (la > 256) la = 256;
    if (lb > 256) lb = 256;
    if ((la > lb ? la - lb : lb - la) >= cap) return cap;
    size_t row[257];
    for (size_t j = 0; j <= lb; j++) row[j] = j;
    for (size_t i = 1; i <= la; i++) {
        size_t diag = row[0], best = row[0] = i;
        for (size_t j = 1; j <= lb; j++) {
            size_t up = row[j], v = diag + (a[i - 1] != b[j - 1]);
            if (up + 1 < v) v = up + 1;
            if (row[j - 1] + 1 < v) v = row[j - 1] + 1;
            row[j] = v;
            diag = up;
            if (v < best) best = v;
        }
        if (best >= cap) return cap;
    }
    return row[lb] < cap ? row[lb] : cap;
}

#define LK_NEAREST 3
#define LK_NEAREST_MODULES 64 /* unmatched modules that get suggestions (each one is a pass over the names) */

/* One checkpoint the adapter is resolved against: the base, or one
 * component folder of a pipeline base (comp: its name, which prefixes its
 * weights as "<comp>/<key>"; NULL for a plain base). */
typedef struct part {
    const char *comp;
    lk_ckpt *ck;
    lk_tensor *model;
    size_t n;
    lk_layout lay;
    int have_lay;
} part;

/* "<comp>/<key>", or key itself for a plain base; NULL without memory. */
static json_t *weight_json(const part *p, const char *key) {
    if (!p->comp) return json_string(key);
    char *w = lk_path_join(p->comp, key);
    json_t *j = w ? json_string(w) : NULL;
    lk_free(w);
    return j;
}

/* The three model weights (over every part) whose names, either spelling,
 * after the layout's prefixes and tables, are nearest to module name q. */
static json_t *nearest(const part *parts, size_t np, const char *q, int kohya) {
    size_t best[LK_NEAREST], bpart[LK_NEAREST], dist[LK_NEAREST], nb = 0;
    for (size_t pi = 0; pi < np; pi++) {
        const lk_layout *l = &parts[pi].lay;
        const lk_tensor *model = parts[pi].model;
        for (size_t i = 0; i < l->n; i++) {
            const lk_alias *al = &l->al[i];
            size_t cap = nb == LK_NEAREST ? dist[LK_NEAREST - 1] : (size_t)-1;
            size_t d = edit_distance(q, kohya ? al->uname : al->name, cap == (size_t)-1 ? 4096 : cap + 1);
            size_t k = 0;
            while (k < nb && !(best[k] == al->key && bpart[k] == pi)) k++;
            if (k < nb) { /* the weight already listed: keep its best distance */
                if (d < dist[k]) dist[k] = d;
                else continue;
            } else if (nb < LK_NEAREST) {
                k = nb++;
            } else if (d < dist[LK_NEAREST - 1] ||
                       (d == dist[LK_NEAREST - 1] &&
                        strcmp(model[al->key].name, parts[bpart[LK_NEAREST - 1]].model[best[LK_NEAREST - 1]].name) < 0)) {
                k = LK_NEAREST - 1;
            } else {
                continue;
            }
            best[k] = al->key;
            bpart[k] = pi;
            dist[k] = d;
            while (k > 0 && (dist[k] < dist[k - 1] ||
                             (dist[k] == dist[k - 1] &&
                              strcmp(parts[bpart[k]].model[best[k]].name, parts[bpart[k - 1]].model[best[k - 1]].name) < 0))) {
                size_t tb = best[k], tp = bpart[k], td = dist[k];
                best[k] = best[k - 1], bpart[k] = bpart[k - 1], dist[k] = dist[k - 1];
                best[k - 1] = tb, bpart[k - 1] = tp, dist[k - 1] = td;
                k--;
            }
        }
    }
    json_t *arr = json_array();
    for (size_t k = 0; arr && k < nb; k++)
        if (json_array_append_new(arr, weight_json(&parts[bpart[k]], parts[bpart[k]].model[best[k]].name))) {
            json_decref(arr);
            return NULL;
        }
    return arr;
}

static json_t *rows_json(int64_t a, int64_t n) { return json_pack("[I, I]", (json_int_t)a, (json_int_t)(a + n)); }

/* Appends the placements of a (as just resolved against part p) to pl[i]
 * per module; where[i] gets the component of a module's first placement. */
static int add_placements(const lk_adapter *a, const part *p, json_t **pl, const char **where) {
    for (size_t k = 0; k < lk_adapter_placement_count(a); k++) {
        const lk_adapter_placement *pc = lk_adapter_placement_at(a, k);
        size_t i = (size_t)(pc->module - lk_adapter_module(a, 0));
        if (!where[i]) {
            int kohya = lk_adapter_kohya_module(a, pc->module->module);
            where[i] = p->comp ? p->comp : lk_layout_component(kohya ? pc->module->module : a->stems[i], kohya, pc->target);
        }
        json_t *w = weight_json(p, pc->target);
        if (!w || json_array_append_new(pl[i], json_pack("{s:o, s:s, s:b, s:o, s:o}", "weight", w, "rule", pc->rule,
                                                        "whole", pc->whole, "rows", rows_json(pc->row0, pc->rows),
                                                        "b_rows", rows_json(pc->b_row0, pc->rows))))
            return 1;
    }
    return 0;
}

/* The JSON object of lk_inspect_base_json: a resolved against every part. */
static json_t *placement_json(lk_adapter *a, part *parts, size_t np, const lk_resolve_opts *ro, lk_status *st) {
    size_t nm = lk_adapter_count(a);
    json_t **pl = lk_calloc(nm ? nm : 1, sizeof *pl), *mods = json_array(), *un = json_array(), *res = NULL;
    const char **where = lk_calloc(nm ? nm : 1, sizeof *where);
    char *fam = NULL; /* the families of every part, "sdxl,openclip" */
    int bad = !pl || !where || !mods || !un;
    for (size_t i = 0; i < nm && !bad; i++) bad |= !(pl[i] = json_array());
    for (size_t pi = 0; pi < np && !bad && !*st; pi++) {
        lk_resolve_opts r = *ro;
        r.component = parts[pi].comp;
        if ((*st = lk_adapter_resolve_opts(a, parts[pi].model, parts[pi].n, &r, NULL))) break;
        bad |= add_placements(a, &parts[pi], pl, where);
        const char *f = lk_adapter_family(a) ? lk_adapter_family(a) : parts[pi].lay.family;
        if (f && (!fam || !strstr(fam, f))) { /* (a family list, not a family name: joined whole) */
            size_t ol = fam ? strlen(fam) : 0;
            char *nf = lk_realloc(fam, ol + strlen(f) + 2);
            if (!nf) bad = 1;
            else snprintf(nf + ol, strlen(f) + 2, "%s%s", ol ? "," : "", f), fam = nf;
        }
    }
    size_t placed = 0, n_un = 0;
    for (size_t i = 0; i < nm && !bad && !*st; i++) {
        const lk_lora_module *m = lk_adapter_module(a, i);
        /* the module's full name (a diffusers module keeps its unet. / transformer. there) */
        int kohya = lk_adapter_kohya_module(a, m->module);
        const char *full = kohya ? m->module : a->stems[i];
        if (!json_array_size(pl[i])) {
            int comp;
            const char *q = lk_layout_strip_module(full, kohya, &comp);
            json_t *nr = n_un++ < LK_NEAREST_MODULES ? nearest(parts, np, q, kohya) : json_array();
            bad |= !nr || json_array_append_new(un, json_pack("{s:s, s:s, s:o}", "module", m->module, "component",
                                                              lk_layout_component(full, kohya, NULL), "nearest", nr));
            continue;
        }
        placed++;
        bad |= json_array_append_new(
            mods, json_pack("{s:s, s:s, s:s, s:i, s:f, s:s, s:f, s:O, s:b}", "module", m->module, "component", where[i],
                            "algorithm", lk_algo_name(m->algo), "rank", m->rank, "alpha", (double)m->alpha,
                            "alpha_source", m->alpha_source, "scale", m->scale, "placements", pl[i], "dora",
                            m->magnitude.data || m->dora_scale.data));
    }
    if (!bad && !*st)
        res = json_pack("{s:s, s:s, s:s?, s:I, s:I, s:O, s:O}", "adapter", lk_adapter_path(a), "format",
                        lk_adapter_format_name(lk_adapter_get_format(a)), "family", fam, "modules_placed",
                        (json_int_t)placed, "modules_unmatched", (json_int_t)n_un, "modules", mods, "unmatched", un);
    for (size_t i = 0; pl && i < nm; i++) json_decref(pl[i]);
    lk_free(pl);
    lk_free(where);
    lk_free(fam);
    json_decref(mods);
    json_decref(un);
    return res;
}

lk_status lk_inspect_base_json(const char *adapter, const char *base, const lk_resolve_opts *opts, char **out) {
    return lk_inspect_base_json_opts(adapter, base, opts, NULL, out);
}

/* A diffusers pipeline folder (model_index.json): its component folders. */
static int is_pipeline(const char *base) {
    struct stat sb;
    char *p = lk_path_join(base, "model_index.json");
    int r = p && stat(base, &sb) == 0 && S_ISDIR(sb.st_mode) && stat(p, &sb) == 0 && S_ISREG(sb.st_mode);
    lk_free(p);
    return r;
}

/* The parts of base: itself, or (a pipeline folder) each component folder
 * that holds a checkpoint. */
static lk_status open_parts(const char *base, const lk_resolve_opts *ro, const char *label, part *parts, size_t *np) {
    static const char *const comps[] = {"unet", "transformer", "text_encoder", "text_encoder_2", "text_encoder_3"};
    int pipe = is_pipeline(base);
    lk_status s = LK_OK;
    *np = 0;
    for (size_t k = 0; k < (pipe ? sizeof comps / sizeof comps[0] : 1) && !s; k++) {
        part *p = &parts[*np];
        memset(p, 0, sizeof *p);
        char *dir = pipe ? lk_path_join(base, comps[k]) : NULL;
        struct stat sb;
        if (pipe && !dir) s = lk_error(LK_ERR_NOMEM, "%s: out of memory", base);
        if (s || (pipe && (stat(dir, &sb) || !S_ISDIR(sb.st_mode) || lk_ckpt_open(dir, &p->ck)))) {
            lk_free(dir); /* (a component folder without a checkpoint: nothing of the adapter lands there) */
            continue;
        }
        lk_free(dir);
        if (!pipe && (s = lk_ckpt_open(base, &p->ck))) break;
        p->comp = pipe ? comps[k] : NULL;
        (*np)++;
        p->n = lk_ckpt_count(p->ck);
        if (!(p->model = lk_malloc((p->n ? p->n : 1) * sizeof *p->model))) {
            s = lk_error(LK_ERR_NOMEM, "%s: out of memory", base);
            break;
        }
        for (size_t i = 0; i < p->n; i++) p->model[i] = *lk_ckpt_tensor(p->ck, i);
        lk_layout_opts lo = {ro->arch, ro->maps, ro->n_maps};
        if (!(s = lk_layout_build(p->model, p->n, &lo, label, &p->lay))) p->have_lay = 1;
    }
    if (!s && pipe && !*np) s = lk_error(LK_ERR_FORMAT, "%s: a pipeline folder with no checkpoint in unet/, transformer/ "
                                         "or text_encoder[_2|_3]/", base);
    return s;
}

lk_status lk_inspect_base_json_opts(const char *adapter, const char *base, const lk_resolve_opts *opts,
                                    const lk_adapter_opts *aopts, char **out) {
    if (!adapter || !base || !out) return lk_error(LK_ERR_ARG, "lk_inspect_base_json: NULL argument");
    *out = NULL;
    lk_adapter *a = NULL;
    part parts[5];
    size_t np = 0;
    json_t *o = NULL;
    lk_adapter_opts ao = aopts ? *aopts : (lk_adapter_opts){.format = LK_FORMAT_AUTO, .alpha_from = LK_ALPHA_AUTO};
    lk_resolve_opts ro = opts ? *opts : (lk_resolve_opts){0};
    ro.allow_unmatched = LK_RESOLVE_LIST_ALL; /* inspect shows the unmatched modules, all of them if need be */
    lk_status s = lk_adapter_open_opts(adapter, &ao, &a);
    if (!s) s = open_parts(base, &ro, lk_adapter_path(a), parts, &np);
    if (!s) {
        o = placement_json(a, parts, np, &ro, &s);
        if (o && json_object_set_new(o, "base", json_string(base))) {
            json_decref(o);
            o = NULL;
        }
        if (!o && !s)
            s = lk_error(LK_ERR_UNSUPPORTED, "%s: cannot describe as JSON (a name that is not UTF-8, or out of "
                         "memory)", adapter);
    }
    if (!s) {
        char *js = json_dumps(o, JSON_COMPACT);
        *out = js ? lk_strdup(js) : NULL;
        free(js);
        if (!*out) s = lk_error(LK_ERR_NOMEM, "%s: out of memory building JSON", adapter);
    }
    json_decref(o);
    for (size_t i = 0; i < np; i++) {
        if (parts[i].have_lay) lk_layout_free(&parts[i].lay);
        lk_free(parts[i].model);
        lk_ckpt_close(parts[i].ck);
    }
    lk_adapter_free(a);
    return s;
}
