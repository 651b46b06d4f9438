/* inspect.c — lk_inspect_json: a checkpoint or an adapter described as one
 * JSON object (lorakit/inspect.h). It lives in the library, not the CLI, so
 * `lorakit inspect` (which prints it, or a text form read back from it) and
 * the Python package's lorakit.inspect() cannot drift apart. It sits at the
 * adapter layer because an adapter is described through lk_adapter_open. */
#include "lorakit/inspect.h"
#include "lorakit/adapter.h"
#include "lorakit/alloc.h"
#include "lorakit/checkpoint.h"
#include "lorakit/safetensors.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct group {
    int rank;
    float alpha, scale;
    const char *source; /* where alpha came from */
    size_t count;
    const char *example;
} group;

static int group_cmp(const void *pa, const void *pb) {
    const group *a = pa, *b = pb;
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
        group key = {m->rank, m->alpha, m->scale, m->alpha_source, 1, m->module};
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
        bad |= json_array_append_new(groups, json_pack("{s:i, s:f, s:f, s:s, s:I, s:s}", "rank", g[i].rank, "alpha",
                                                       (double)g[i].alpha, "scale", (double)g[i].scale, "alpha_source",
                                                       g[i].source, "count", (json_int_t)g[i].count, "example",
                                                       g[i].example));
    for (size_t i = 0; i < lk_adapter_count(a) && !bad; i++) {
        const lk_lora_module *m = lk_adapter_module(a, i);
        bad |= json_array_append_new(
            mods, json_pack("{s:s, s:i, s:f, s:f, s:s, s:I, s:I, s:s, s:s, s:b, s:b}", "module", m->module, "rank",
                            m->rank, "alpha", (double)m->alpha, "scale", (double)m->scale, "alpha_source",
                            m->alpha_source, "in", (json_int_t)m->A.shape[1], "out", (json_int_t)m->B.shape[0],
                            "dtype_A", lk_dtype_name(m->A.dtype), "dtype_B", lk_dtype_name(m->B.dtype), "dora",
                            m->magnitude.data != NULL, "lora_bias", m->bias.data != NULL));
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

/* NULL when out of memory or a string is not UTF-8. A sharded set adds
 * "index" (its file name), "shards" ([{name, tensors, bytes}]) and a
 * "shard" per tensor; "offset" is then within that shard's file, and
 * file_bytes / header_bytes are summed over the shards. */
static json_t *ck_json(const lk_ckpt *ck) {
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
    json_t *o = json_object(), *meta = ck_metadata(ck), *arr = json_array(), *tj = json_object();
    if (!o || !meta || !arr || !tj) {
        json_decref(o); json_decref(meta); json_decref(arr); json_decref(tj);
        return NULL;
    }
    int bad = 0;
    bad |= json_object_set_new(o, "path", json_string(lk_ckpt_path(ck)));
    bad |= json_object_set_new(o, "file_bytes", json_integer((json_int_t)(8 * ns + header + total)));
    bad |= json_object_set_new(o, "header_bytes", json_integer((json_int_t)header));
    bad |= json_object_set_new(o, "metadata", meta);
    if (sharded) {
        json_t *sh = json_array();
        bad |= !sh;
        for (size_t j = 0; sh && j < ns; j++) {
            const lk_st *st = lk_ckpt_shard(ck, j);
            json_int_t b = 0;
            for (size_t i = 0; i < lk_st_count(st); i++) b += (json_int_t)lk_st_tensor(st, i)->nbytes;
            bad |= json_array_append_new(sh, json_pack("{s:s,s:I,s:I}", "name", lk_ckpt_shard_name(ck, j), "tensors",
                                                       (json_int_t)lk_st_count(st), "bytes", b));
        }
        bad |= json_object_set_new(o, "index", json_string(lk_ckpt_index_name(ck)));
        bad |= json_object_set_new(o, "shards", sh);
    }
    for (size_t i = 0; i < n && !bad; i++) {
        const lk_tensor *t = lk_ckpt_tensor(ck, i);
        json_t *e = json_object(), *sh = json_array();
        if (!e || !sh) {
            json_decref(e); json_decref(sh);
            bad = 1;
            break;
        }
        size_t j = lk_ckpt_tensor_shard(ck, i);
        for (int d = 0; d < t->ndim; d++) bad |= json_array_append_new(sh, json_integer(t->shape[d]));
        bad |= json_object_set_new(e, "name", json_string(t->name));
        bad |= json_object_set_new(e, "dtype", json_string(lk_dtype_name(t->dtype)));
        bad |= json_object_set_new(e, "shape", sh);
        bad |= json_object_set_new(e, "bytes", json_integer((json_int_t)t->nbytes));
        bad |= json_object_set_new(e, "offset", json_integer((json_int_t)lk_st_file_offset(lk_ckpt_shard(ck, j),
                                                                                           lk_ckpt_tensor_local(ck, i))));
        if (sharded) bad |= json_object_set_new(e, "shard", json_string(lk_ckpt_shard_name(ck, j)));
        bad |= json_array_append_new(arr, e);
    }
    bad |= json_object_set_new(o, "tensors", arr);
    for (int d = 1; d < LK_DTYPE_COUNT; d++)
        if (count[d])
            bad |= json_object_set_new(tj, lk_dtype_name((lk_dtype)d),
                                       json_pack("{s:I,s:I}", "tensors", (json_int_t)count[d], "bytes",
                                                 (json_int_t)bytes[d]));
    bad |= json_object_set_new(o, "totals", tj);
    bad |= json_object_set_new(o, "tensor_count", json_integer((json_int_t)n));
    bad |= json_object_set_new(o, "total_bytes", json_integer((json_int_t)total));
    if (bad) {
        json_decref(o);
        return NULL;
    }
    return o;
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

lk_status lk_inspect_json(const char *path, char **out) {
    if (!path || !out) return lk_error(LK_ERR_ARG, "lk_inspect_json: NULL argument");
    *out = NULL;
    json_t *o;
    if (lk_adapter_looks_like(path) && !is_checkpoint_dir(path)) {
        lk_adapter *a;
        lk_status s = lk_adapter_open(path, LK_FORMAT_AUTO, &a);
        if (s) return s;
        o = adapter_json(a);
        lk_adapter_free(a);
    } else {
        lk_ckpt *ck;
        lk_status s = lk_ckpt_open(path, &ck);
        if (s) return s;
        o = ck_json(ck);
        lk_ckpt_close(ck);
    }
    /* jansson refuses a string that is not UTF-8 the same way as a failed
     * allocation; the former is the likely one */
    if (!o)
        return lk_error(LK_ERR_UNSUPPORTED, "%s: cannot describe as JSON (a name or path that is not UTF-8, or out "
                        "of memory)", path);
    char *js = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    *out = js ? lk_strdup(js) : NULL;
    free(js);
    return *out ? LK_OK : lk_error(LK_ERR_NOMEM, "%s: out of memory building JSON", path);
}
