/* checkpoint.c — one .safetensors file or a sharded set behind an index,
 * as one list of tensors (see lorakit/checkpoint.h).
 *
 * Sharded checkpoints are how every model past a few GB ships
 * (transformers' model-00001-of-00004.safetensors + model.safetensors.
 * index.json, diffusers' diffusion_pytorch_model-*.safetensors). The index
 * is hostile input like any file, and transformers/diffusers check almost
 * nothing in it, so a broken set there fails late or loads the wrong bytes.
 * We check, naming the index, the shard and the tensor:
 *   - the index is a JSON object (no duplicate keys) whose "weight_map" is
 *     an object of non-empty tensor name -> shard file name, "metadata" (if
 *     any) an object;
 *   - a shard name is a plain file name in the index's folder (no '/', not
 *     "." or ".."), and the file it opens, after resolving symlinks, is
 *     still inside that folder;
 *   - every shard opens and validates as safetensors;
 *   - no tensor is in two shards, every tensor of a shard is mapped to that
 *     shard, every mapped tensor is in the shard the map names.
 * metadata.total_size (and total_parameters) is informational: older
 * transformers counted bool tensors as 1/8 byte, so stale values exist; a
 * disagreeing total_size is a warning and writers use lk_ckpt_total_size.
 * Shards are opened once and stay open (their descriptors serve pread). */
#include "lorakit/checkpoint.h"
#include "lorakit/alloc.h"
#include "lorakit/log.h"

#include "core/file.h"
#include "io/checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* Largest index file read (a 1T-parameter model's index is a few MB). */
#define INDEX_MAX ((size_t)LK_KNOB_INDEX_MAX_BYTES_DEFAULT) /* lorakit/knobs.h */

struct lk_ckpt {
    char *path;        /* the file or index opened */
    char *dir;         /* its folder */
    char *index_name;  /* basename of the index, NULL for a single file */
    char *index_meta;  /* compact JSON of the index's metadata, NULL for a single file */
    size_t n_shards;
    lk_st **shards;
    char **shard_names;
    size_t n;
    lk_tensor *t;      /* one shard: that shard's own table (not a copy) */
    size_t *shard_of, *local; /* NULL for one shard (0 and i) */
    size_t *by_name;   /* NULL for one shard (its own index) */
    uint64_t total;
};

void lk_ckpt_close(lk_ckpt *ck) {
    if (!ck) return;
    for (size_t j = 0; j < ck->n_shards; j++) {
        if (ck->shards) lk_st_close(ck->shards[j]);
        if (ck->shard_names) lk_free(ck->shard_names[j]);
    }
    lk_free(ck->shards);
    lk_free(ck->shard_names);
    if (ck->n_shards != 1) lk_free(ck->t); /* one shard: the shard's own */
    lk_free(ck->shard_of);
    lk_free(ck->local);
    lk_free(ck->by_name);
    lk_free(ck->path);
    lk_free(ck->dir);
    lk_free(ck->index_name);
    lk_free(ck->index_meta);
    lk_free(ck);
}

const char *lk_ckpt_path(const lk_ckpt *ck) { return ck->path; }
const char *lk_ckpt_dir(const lk_ckpt *ck) { return ck->dir; }
int lk_ckpt_sharded(const lk_ckpt *ck) { return ck->index_name != NULL; }
size_t lk_ckpt_count(const lk_ckpt *ck) { return ck->n; }
const lk_tensor *lk_ckpt_tensor(const lk_ckpt *ck, size_t i) { return i < ck->n ? &ck->t[i] : NULL; }
uint64_t lk_ckpt_total_size(const lk_ckpt *ck) { return ck->total; }
size_t lk_ckpt_shard_count(const lk_ckpt *ck) { return ck->n_shards; }
const lk_st *lk_ckpt_shard(const lk_ckpt *ck, size_t j) { return j < ck->n_shards ? ck->shards[j] : NULL; }
const char *lk_ckpt_shard_name(const lk_ckpt *ck, size_t j) { return j < ck->n_shards ? ck->shard_names[j] : NULL; }
size_t lk_ckpt_tensor_shard(const lk_ckpt *ck, size_t i) { return i < ck->n && ck->shard_of ? ck->shard_of[i] : 0; }
size_t lk_ckpt_tensor_local(const lk_ckpt *ck, size_t i) { return i < ck->n ? ck->local ? ck->local[i] : i : 0; }
const char *lk_ckpt_index_metadata(const lk_ckpt *ck) { return ck->index_meta; }
const char *lk_ckpt_index_name(const lk_ckpt *ck) { return ck->index_name; }

lk_status lk_ckpt_read(const lk_ckpt *ck, size_t i, uint64_t off, void *dst, size_t n) {
    if (!ck || i >= ck->n) return lk_error(LK_ERR_ARG, "lk_ckpt_read: bad tensor index");
    return lk_st_read(ck->shards[lk_ckpt_tensor_shard(ck, i)], lk_ckpt_tensor_local(ck, i), off, dst, n);
}

long lk_ckpt_find(const lk_ckpt *ck, const char *name) {
    if (!ck || !name) return -1;
    if (!ck->by_name) return ck->n_shards == 1 ? lk_st_find(ck->shards[0], name) : -1;
    size_t lo = 0, hi = ck->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(ck->t[ck->by_name[mid]].name, name);
        if (c == 0) return (long)ck->by_name[mid];
        if (c < 0) lo = mid + 1;
        else hi = mid;
    }
    return -1;
}

/* ---------------------------------------------------------------- helpers */

static int ends_with(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && !memcmp(s + a - b, suf, b);
}

int lk_ckpt_is_index_name(const char *n) {
    return ends_with(n, ".json") && strstr(n, ".safetensors.index.") != NULL;
}

lk_status lk_out_inputs_add_ckpt(lk_out_inputs *in, const lk_ckpt *ck) {
    int sharded = lk_ckpt_sharded(ck);
    lk_status s = sharded ? lk_out_inputs_add(in, lk_ckpt_path(ck), "base index") : LK_OK;
    for (size_t j = 0; !s && j < lk_ckpt_shard_count(ck); j++) {
        char *p = lk_path_join(lk_ckpt_dir(ck), lk_ckpt_shard_name(ck, j));
        s = p ? lk_out_inputs_add(in, p, sharded ? "base shard" : "base")
              : lk_error(LK_ERR_NOMEM, "%s: out of memory", lk_ckpt_path(ck));
        lk_free(p);
    }
    return s;
}

/* A shard of a sharded set: "<stem>-<digits>-of-<digits>.safetensors". */
static int is_shard_name(const char *n) {
    if (!ends_with(n, ".safetensors")) return 0;
    size_t len = strlen(n) - strlen(".safetensors");
    size_t i = len, d2 = 0, d1 = 0;
    while (i > 0 && n[i - 1] >= '0' && n[i - 1] <= '9') i--, d2++;
    if (!d2 || i < 4 || memcmp(n + i - 4, "-of-", 4)) return 0;
    i -= 4;
    while (i > 0 && n[i - 1] >= '0' && n[i - 1] <= '9') i--, d1++;
    return d1 && i > 0 && n[i - 1] == '-';
}


/* The folder of path (lk_malloc'd; "." for a bare file name). */
static char *dir_of(const char *path) {
    char *d = NULL;
    if (lk_path_dir(path, &d)) return NULL;
    return d ? d : lk_strdup(".");
}

static const char *base_of(const char *path) {
    const char *sl = strrchr(path, '/');
    return sl ? sl + 1 : path;
}

/* A shard name must be a plain file name in the index's folder. */
static const char *bad_shard_name(const char *s) {
    if (!*s) return "is empty";
    if (s[0] == '/') return "is an absolute path";
    if (strchr(s, '/') || strchr(s, '\\')) return "is not a plain file name in the index's folder";
    if (!strcmp(s, ".") || !strcmp(s, "..")) return "leaves the index's folder";
    return NULL;
}

/* ------------------------------------------------------------ index JSON */

/* Parses and checks the index's structure; *root owns the JSON. */
static lk_status index_parse(const char *text, size_t len, const char *label, json_t **root_out) {
    json_error_t je;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return lk_error(LK_ERR_FORMAT, "%s: not a valid JSON index: %s (line %d, column %d)", label, je.text, je.line,
                        je.column);
    lk_status s = LK_OK;
    json_t *wm = json_object_get(root, "weight_map"), *meta = json_object_get(root, "metadata");
    if (!json_is_object(root)) s = lk_error(LK_ERR_FORMAT, "%s: the index is not a JSON object", label);
    else if (!wm) s = lk_error(LK_ERR_FORMAT, "%s: the index has no \"weight_map\"", label);
    else if (!json_is_object(wm)) s = lk_error(LK_ERR_FORMAT, "%s: \"weight_map\" is not an object", label);
    else if (meta && !json_is_object(meta)) s = lk_error(LK_ERR_FORMAT, "%s: \"metadata\" is not an object", label);
    const char *k;
    json_t *v;
    if (!s) json_object_foreach(wm, k, v) {
        if (!*k) {
            s = lk_error(LK_ERR_FORMAT, "%s: weight_map has an empty tensor name", label);
            break;
        }
        if (!json_is_string(v)) {
            s = lk_error(LK_ERR_FORMAT, "%s: weight_map: %s: the shard is not a string", label, k);
            break;
        }
        const char *why = bad_shard_name(json_string_value(v));
        if (why) {
            s = lk_error(LK_ERR_FORMAT, "%s: weight_map: %s: shard name '%s' %s", label, k, json_string_value(v), why);
            break;
        }
    }
    if (s) {
        json_decref(root);
        return s;
    }
    *root_out = root;
    return LK_OK;
}

lk_status lk_ckpt_parse_index(const char *text, size_t len, const char *label, size_t *n_entries) {
    if (!text && len) return lk_error(LK_ERR_ARG, "lk_ckpt_parse_index: NULL text");
    json_t *root = NULL;
    lk_status s = index_parse(text ? text : "", len, label ? label : "(index)", &root);
    if (s) return s;
    if (n_entries) *n_entries = json_object_size(json_object_get(root, "weight_map"));
    json_decref(root);
    return LK_OK;
}

/* ------------------------------------------------------------------ open */

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static int cmp_by_name(const void *a, const void *b, void *ctx) {
    const lk_tensor *t = ctx;
    return strcmp(t[*(const size_t *)a].name, t[*(const size_t *)b].name);
}

/* Builds the flat tensor table and name index from the open shards; one
 * shard's own are used as they are (a 1.3 M-tensor file would otherwise
 * hold its 120 bytes per tensor twice). */
static lk_status build_table(lk_ckpt *ck, const char *label) {
    size_t n = 0;
    for (size_t j = 0; j < ck->n_shards; j++) n += lk_st_count(ck->shards[j]);
    ck->n = n;
    if (ck->n_shards == 1) {
        ck->t = (lk_tensor *)lk_st_tensor(ck->shards[0], 0); /* never written through */
        ck->total = 0;
        for (size_t i = 0; i < n; i++) ck->total += ck->t[i].nbytes;
        return LK_OK;
    }
    ck->t = lk_malloc((n ? n : 1) * sizeof *ck->t);
    ck->shard_of = lk_malloc((n ? n : 1) * sizeof *ck->shard_of);
    ck->local = lk_malloc((n ? n : 1) * sizeof *ck->local);
    ck->by_name = lk_malloc((n ? n : 1) * sizeof *ck->by_name);
    if (!ck->t || !ck->shard_of || !ck->local || !ck->by_name)
        return lk_error(LK_ERR_NOMEM, "%s: out of memory for %zu tensors", label, n);
    size_t k = 0;
    ck->total = 0;
    for (size_t j = 0; j < ck->n_shards; j++)
        for (size_t i = 0; i < lk_st_count(ck->shards[j]); i++, k++) {
            ck->t[k] = *lk_st_tensor(ck->shards[j], i);
            ck->shard_of[k] = j;
            ck->local[k] = i;
            ck->by_name[k] = k;
            ck->total += ck->t[k].nbytes;
        }
    qsort_r(ck->by_name, n, sizeof *ck->by_name, cmp_by_name, ck->t);
    for (size_t i = 1; i < n; i++) {
        size_t a = ck->by_name[i - 1], b = ck->by_name[i];
        if (!strcmp(ck->t[a].name, ck->t[b].name))
            return lk_error(LK_ERR_FORMAT, "%s: tensor %s is in two shards: %s and %s", label, ck->t[a].name,
                            ck->shard_names[ck->shard_of[a < b ? a : b]], ck->shard_names[ck->shard_of[a < b ? b : a]]);
    }
    return LK_OK;
}

static lk_status open_single(lk_ckpt *ck, const char *path) {
    if (!(ck->path = lk_strdup(path)) || !(ck->dir = dir_of(path)) ||
        !(ck->shards = lk_calloc(1, sizeof *ck->shards)) || !(ck->shard_names = lk_calloc(1, sizeof(char *))) ||
        !(ck->shard_names[0] = lk_strdup(base_of(path))))
        return lk_error(LK_ERR_NOMEM, "%s: out of memory", path);
    ck->n_shards = 1;
    lk_status s = lk_st_open(path, &ck->shards[0]);
    if (s) return s;
    return build_table(ck, path);
}

/* 1 when rp is realdir itself's child path (strictly inside). */
static int path_inside(const char *rp, const char *dir) {
    size_t l = strlen(dir);
    if (l == 1 && dir[0] == '/') return rp[0] == '/' && rp[1];
    return !strncmp(rp, dir, l) && rp[l] == '/' && rp[l + 1];
}

/* The shard file must resolve (symlinks followed) to a file inside the
 * index's folder. One exception, the most common layout in the wild: a
 * Hugging Face cache snapshot (<repo>/snapshots/<rev>/<file>) whose files
 * are symlinks into that same repo's <repo>/blobs/. */
static lk_status check_inside(const char *label, const char *realdir, const char *shard, const char *path,
                              const char *tensor) {
    char *rp = realpath(path, NULL);
    if (!rp) {
        if (errno == ENOMEM) return lk_error(LK_ERR_NOMEM, "%s: out of memory", label);
        return lk_error(LK_ERR_IO, "%s: shard %s (holding %s): cannot open: %s", label, shard, tensor,
                        strerror(errno));
    }
    int inside = path_inside(rp, realdir);
    if (!inside) {
        /* realdir = <repo>/snapshots/<rev>: allow <repo>/blobs/<x>. */
        const char *rev = strrchr(realdir, '/');
        const char *snap = rev;
        while (snap && snap > realdir && snap[-1] != '/') snap--;
        size_t repo_len = snap && snap > realdir ? (size_t)(snap - realdir) : 0; /* includes the '/' */
        if (rev && repo_len && rev - snap == 9 && !strncmp(snap, "snapshots", 9)) {
            size_t rl = strlen(rp);
            inside = rl > repo_len + 6 && !strncmp(rp, realdir, repo_len) && !strncmp(rp + repo_len, "blobs/", 6) &&
                     !strchr(rp + repo_len + 6, '/');
        }
    }
    lk_status s = inside ? LK_OK
                         : lk_error(LK_ERR_FORMAT, "%s: shard %s (holding %s) resolves to %s, outside the index's folder",
                                    label, shard, tensor, rp);
    free(rp);
    return s;
}

/* open_index's steps. The index file, read whole (bounded) and parsed. */
static lk_status read_index(const char *path, json_t **root) {
    char *text = NULL;
    size_t len = 0;
    lk_status s = lk_read_file(path, INDEX_MAX, &text, &len);
    if (s) return s;
    if (len > INDEX_MAX) {
        lk_free(text);
        return lk_error(LK_ERR_FORMAT, "%s: index larger than %zu bytes", path, INDEX_MAX);
    }
    s = index_parse(text, len, path, root);
    lk_free(text);
    return s;
}

/* The distinct shard names of the weight_map, sorted (*names: lk_malloc'd,
 * the strings borrowed from wm). */
static lk_status distinct_shards(json_t *wm, const char *path, char ***names_out, size_t *ns_out) {
    size_t nw = json_object_size(wm);
    char **names = lk_malloc((nw ? nw : 1) * sizeof *names);
    if (!names) return lk_error(LK_ERR_NOMEM, "%s: out of memory", path);
    size_t nn = 0;
    const char *k;
    json_t *v;
    json_object_foreach(wm, k, v) names[nn++] = (char *)json_string_value(v);
    qsort(names, nn, sizeof *names, cmp_str);
    size_t ns = 0;
    for (size_t i = 0; i < nn; i++)
        if (!ns || strcmp(names[i], names[ns - 1])) names[ns++] = names[i];
    *names_out = names;
    *ns_out = ns;
    if (!ns) return lk_error(LK_ERR_FORMAT, "%s: weight_map is empty", path);
    return LK_OK;
}

/* Opens every shard (each inside the index's folder), naming in messages a
 * tensor the map assigns to it. */
static lk_status open_shards(lk_ckpt *ck, const char *path, json_t *wm, char **names, size_t ns) {
    lk_status s = LK_OK;
    ck->shards = lk_calloc(ns, sizeof *ck->shards);
    ck->shard_names = lk_calloc(ns, sizeof *ck->shard_names);
    const char **first_tensor = lk_calloc(ns, sizeof *first_tensor);
    char *realdir = realpath(ck->dir, NULL);
    if (!ck->shards || !ck->shard_names || !first_tensor) {
        s = lk_error(LK_ERR_NOMEM, "%s: out of memory", path);
        goto done;
    }
    if (!realdir) {
        s = lk_error(LK_ERR_IO, "%s: cannot resolve the folder %s: %s", path, ck->dir, strerror(errno));
        goto done;
    }
    ck->n_shards = ns;
    const char *k;
    json_t *v;
    json_object_foreach(wm, k, v) {
        char *sv = (char *)json_string_value(v);
        char **hit = bsearch(&sv, names, ns, sizeof *names, cmp_str);
        if (hit && !first_tensor[hit - names]) first_tensor[hit - names] = k;
    }
    for (size_t j = 0; j < ns && !s; j++) {
        if (!(ck->shard_names[j] = lk_strdup(names[j]))) {
            s = lk_error(LK_ERR_NOMEM, "%s: out of memory", path);
            break;
        }
        char *sp = lk_path_join(ck->dir, names[j]);
        if (!sp) {
            s = lk_error(LK_ERR_NOMEM, "%s: out of memory", path);
            break;
        }
        s = check_inside(path, realdir, names[j], sp, first_tensor[j]);
        if (!s && (s = lk_st_open(sp, &ck->shards[j])))
            lk_error_prefix(s, "%s: shard %s (holding %s)", path, names[j], first_tensor[j]);
        lk_free(sp);
    }
done:
    free(realdir);
    lk_free(first_tensor);
    return s;
}

/* Every shard's tensor is mapped to that shard, and every mapped tensor is
 * there. */
static lk_status check_weight_map(const lk_ckpt *ck, const char *path, json_t *wm) {
    for (size_t i = 0; i < ck->n; i++) {
        const char *sh = ck->shard_names[lk_ckpt_tensor_shard(ck, i)];
        json_t *m = json_object_get(wm, ck->t[i].name);
        if (!m)
            return lk_error(LK_ERR_FORMAT, "%s: shard %s holds tensor %s, which the index's weight_map omits", path,
                            sh, ck->t[i].name);
        if (strcmp(json_string_value(m), sh))
            return lk_error(LK_ERR_FORMAT, "%s: tensor %s is in shard %s, but the weight_map names shard %s", path,
                            ck->t[i].name, sh, json_string_value(m));
    }
    const char *k;
    json_t *v;
    json_object_foreach(wm, k, v) {
        if (lk_ckpt_find(ck, k) < 0)
            return lk_error(LK_ERR_FORMAT, "%s: tensor %s: the weight_map names shard %s, which does not hold it", path,
                            k, json_string_value(v));
    }
    return LK_OK;
}

/* The index's metadata, kept as compact JSON; a total_size that disagrees
 * with the tensors is only warned about. */
static lk_status keep_index_metadata(lk_ckpt *ck, const char *path, json_t *meta) {
    json_t *ts = meta ? json_object_get(meta, "total_size") : NULL;
    if (ts && json_is_number(ts) && json_number_value(ts) != (double)ck->total)
        lk_log(LK_LOG_WARN, "%s: metadata.total_size is %.0f but the tensors hold %llu bytes (using %llu)", path,
               json_number_value(ts), (unsigned long long)ck->total, (unsigned long long)ck->total);
    else if (ts && !json_is_number(ts))
        lk_log(LK_LOG_WARN, "%s: metadata.total_size is not a number (the tensors hold %llu bytes)", path,
               (unsigned long long)ck->total);
    char *mt = meta ? json_dumps(meta, JSON_COMPACT | JSON_REAL_PRECISION(17)) : NULL;
    if (meta && !mt) return lk_error(LK_ERR_NOMEM, "%s: out of memory", path);
    ck->index_meta = lk_strdup(mt ? mt : "{}");
    free(mt);
    return ck->index_meta ? LK_OK : lk_error(LK_ERR_NOMEM, "%s: out of memory", path);
}

static lk_status open_index(lk_ckpt *ck, const char *path) {
    if (!(ck->path = lk_strdup(path)) || !(ck->dir = dir_of(path)) || !(ck->index_name = lk_strdup(base_of(path))))
        return lk_error(LK_ERR_NOMEM, "%s: out of memory", path);
    json_t *root = NULL;
    lk_status s = read_index(path, &root);
    if (s) return s;
    json_t *wm = json_object_get(root, "weight_map"), *meta = json_object_get(root, "metadata");
    char **names = NULL;
    size_t ns = 0;
    s = distinct_shards(wm, path, &names, &ns);
    if (!s) s = open_shards(ck, path, wm, names, ns);
    lk_free(names);
    if (!s) s = build_table(ck, path);
    if (!s) s = check_weight_map(ck, path, wm);
    if (!s) s = keep_index_metadata(ck, path, meta);
    json_decref(root);
    return s;
}

/* Picks the one checkpoint in a folder (lk_malloc'd path in *out). */
static lk_status resolve_dir(const char *dir, char **out) {
    DIR *d = opendir(dir);
    if (!d) return lk_error(LK_ERR_IO, "%s: cannot open the folder: %s", dir, strerror(errno));
    char **idx = NULL, **single = NULL;
    size_t ni = 0, nsg = 0, cap = 0;
    lk_status s = LK_OK;
    struct dirent *e;
    while (!s && (e = readdir(d))) {
        int is_idx = lk_ckpt_is_index_name(e->d_name);
        int is_single = !is_idx && ends_with(e->d_name, ".safetensors") && !is_shard_name(e->d_name);
        if (!is_idx && !is_single) continue;
        if (ni + nsg + 1 > cap) {
            cap = cap ? 2 * cap : 8;
            char **a = lk_realloc(idx, cap * sizeof *a), **b = a ? lk_realloc(single, cap * sizeof *b) : NULL;
            if (a) idx = a;
            if (b) single = b;
            if (!a || !b) {
                s = lk_error(LK_ERR_NOMEM, "%s: out of memory", dir);
                break;
            }
        }
        char *nm = lk_strdup(e->d_name);
        if (!nm) {
            s = lk_error(LK_ERR_NOMEM, "%s: out of memory", dir);
            break;
        }
        if (is_idx) idx[ni++] = nm;
        else single[nsg++] = nm;
    }
    closedir(d);
    if (!s) {
        if (ni + nsg == 0) {
            s = lk_error(LK_ERR_IO, "%s: the folder holds no .safetensors file and no *.safetensors.index*.json", dir);
        } else if (ni + nsg > 1) {
            qsort(idx, ni, sizeof *idx, cmp_str);
            qsort(single, nsg, sizeof *single, cmp_str);
            char list[1024];
            size_t o = 0;
            list[0] = 0;
            for (size_t i = 0; i < ni + nsg && o < sizeof list; i++)
                o += (size_t)snprintf(list + o, sizeof list - o, "%s%s", i ? ", " : "", i < ni ? idx[i] : single[i - ni]);
            s = lk_error(LK_ERR_ARG, "%s: the folder holds %zu checkpoints (%s); name the index or file to use", dir,
                         ni + nsg, list);
        } else {
            *out = lk_path_join(dir, ni ? idx[0] : single[0]);
            if (!*out) s = lk_error(LK_ERR_NOMEM, "%s: out of memory", dir);
        }
    }
    for (size_t i = 0; i < ni; i++) lk_free(idx[i]);
    for (size_t i = 0; i < nsg; i++) lk_free(single[i]);
    lk_free(idx);
    lk_free(single);
    return s;
}

lk_status lk_ckpt_open(const char *path, lk_ckpt **out) {
    if (!path || !out) return lk_error(LK_ERR_ARG, "lk_ckpt_open: NULL argument");
    *out = NULL;
    struct stat sb;
    char *resolved = NULL;
    if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode)) {
        lk_status s = resolve_dir(path, &resolved);
        if (s) return s;
        path = resolved;
    }
    lk_ckpt *ck = lk_calloc(1, sizeof *ck);
    lk_status s = ck ? LK_OK : lk_error(LK_ERR_NOMEM, "%s: out of memory", path);
    if (!s) s = ends_with(path, ".json") ? open_index(ck, path) : open_single(ck, path);
    lk_free(resolved);
    if (s) {
        lk_ckpt_close(ck);
        return s;
    }
    *out = ck;
    return LK_OK;
}
