/* cmd_inspect.c — `lorakit inspect FILE|INDEX|DIR [--json]`: prints lk_inspect_write
 * (the library describes the file, shared with the Python package) as it is
 * with --json, or as text read back from it.
 *
 * For a checkpoint the text is the metadata, the shards of a sharded set, one line per tensor
 * (name, dtype, shape, bytes) in file order, then totals by dtype; for an
 * adapter, inspect_adapter.c's grouped summary. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "inspect_adapter.h"

static const char *const INSPECT_USAGE =
    "usage: lorakit inspect FILE|DIR [--json] [--alpha-from tensors|metadata]\n"
    "       lorakit inspect ADAPTER --base CKPT [--arch NAME] [--map FILE] [--json]\n"
    "                       [--alpha-from tensors|metadata] [--convention C] [--strength S]\n\n"
    "Lists a checkpoint (a safetensors file, or a sharded set given by its\n"
    "*.safetensors.index*.json or its folder): its metadata (the index's for a\n"
    "sharded set), its shards, then one line per tensor (name, dtype, shape,\n"
    "bytes, shard) in file order, then totals by dtype. Every file is fully\n"
    "validated first; a malformed file or index is an error (exit 1).\n"
    "An adapter (a PEFT folder, or a file whose keys are all LoRA keys) is\n"
    "shown as an adapter instead: detected format, module count, and the\n"
    "rank, alpha and resulting scale per module group.\n"
    "With --base, where each module of ADAPTER lands on CKPT (a checkpoint, or\n"
    "a diffusers pipeline folder: weights named <component>/<key>), resolved as\n"
    "`lorakit fuse` would: the weight(s) and rows (a row slice of a fused\n"
    "weight), the rule that matched the name (exact, suffix, kohya form,\n"
    "prefix, family table, --map), the component it routes to (unet,\n"
    "transformer, text_encoder[_2|_3], diffusion_model, any), the algorithm,\n"
    "rank, alpha and its source, and the scale; each module that lands\n"
    "nowhere with its component and the three nearest weight names.\n"
    "For an adapter, also where the conventions (lorakit, comfyui, lycoris,\n"
    "peft: README \"Conventions\") would give different weights for this file,\n"
    "module by module, with the points that apply and the size: with --base\n"
    "each touched weight is fused under every convention at strength 1 and S\n"
    "and compared (max |W_a - W_b|, relative Frobenius difference of the\n"
    "deltas); without, only the scales (modules whose delta reads the weight:\n"
    "DoRA, set_weight, OFT, BOFT, GLoRA, are listed as needing --base).\n"
    "JSON: \"conventions\": {base, strengths, modules_differ, modules: [{module,\n"
    "weight, points, needs_base, at: [{strength, groups, pairs: [{a, b,\n"
    "max_abs, rel_fro, elements}]}]}], computed}.\n\n"
    "options:\n"
    "  --base CKPT    show where ADAPTER's modules land on CKPT\n"
    "  --arch NAME    with --base: the model family table (as lorakit fuse)\n"
    "  --map FILE     with --base: an extra name table (repeatable)\n"
    "  --strength S   the second strength the conventions are compared at\n"
    "                 (besides 1; default 0.5)\n"
    "  --json     print one JSON object: {path, file_bytes, header_bytes,\n"
    "             metadata, tensors: [{name, dtype, shape, bytes, offset}],\n"
    "             (sharded: also index, shards: [{name, tensors, bytes}],\n"
    "             a shard per tensor, offset within that shard)\n"
    "             totals: {DTYPE: {tensors, bytes}}, tensor_count, total_bytes}\n"
    LK_CLI_ALPHA_FROM_HELP
    LK_CLI_CONVENTION_HELP
    "                         (the alpha and scale shown are the convention's)\n"
    "  -h, --help this text\n";

/* The human-readable listing of a checkpoint, from the opened set itself
 * (the fields lk_inspect_json gives, without building that text: a 1.3 M-
 * tensor file is listed in the memory its index takes). */
static void st_listing_text(const lk_ckpt *ck, FILE *out) {
    size_t n = lk_ckpt_count(ck), ns = lk_ckpt_shard_count(ck);
    int sharded = lk_ckpt_sharded(ck);
    size_t count[LK_DTYPE_COUNT] = {0};
    unsigned long long bytes[LK_DTYPE_COUNT] = {0}, total = 0, header = 0;
    size_t w = 4;
    for (size_t i = 0; i < n; i++) {
        const lk_tensor *t = lk_ckpt_tensor(ck, i);
        count[t->dtype]++;
        bytes[t->dtype] += t->nbytes;
        total += t->nbytes;
        size_t l = strlen(t->name);
        if (l > w) w = l;
    }
    if (w > 80) w = 80;
    for (size_t j = 0; j < ns; j++) header += lk_st_header_len(lk_ckpt_shard(ck, j));
    if (sharded)
        fprintf(out, "%s: %zu tensors in %zu shards, %llu data bytes, headers %llu bytes\n", lk_ckpt_path(ck), n, ns,
                total, header);
    else
        fprintf(out, "%s: %zu tensors, %llu data bytes, header %llu bytes\n", lk_ckpt_path(ck), n, total, header);
    if (sharded) { /* the index's metadata: a JSON object whose values may be numbers (total_size) */
        json_t *meta = json_loads(lk_ckpt_index_metadata(ck), 0, NULL);
        fprintf(out, "metadata (index) (%zu):\n", json_object_size(meta));
        const char *k;
        json_t *v;
        json_object_foreach(meta, k, v) {
            char *txt = json_is_string(v) ? NULL : json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
            fprintf(out, "  %s: %s\n", k, json_is_string(v) ? json_string_value(v) : txt ? txt : "?");
            free(txt);
        }
        json_decref(meta);
        fprintf(out, "shards (%zu):\n", ns);
        for (size_t j = 0; j < ns; j++) {
            const lk_st *st = lk_ckpt_shard(ck, j);
            unsigned long long b = 0;
            for (size_t i = 0; i < lk_st_count(st); i++) b += lk_st_tensor(st, i)->nbytes;
            fprintf(out, "  %s  %zu tensors  %llu bytes\n", lk_ckpt_shard_name(ck, j), lk_st_count(st), b);
        }
    } else {
        const lk_st *st = lk_ckpt_shard(ck, 0);
        fprintf(out, "metadata (%zu):\n", lk_st_metadata_count(st));
        for (size_t i = 0; i < lk_st_metadata_count(st); i++) {
            const char *k, *v;
            lk_st_metadata_at(st, i, &k, &v);
            fprintf(out, "  %s: %s\n", k, v);
        }
    }
    fprintf(out, "tensors (%zu):\n", n);
    if (n) fprintf(out, "  %-*s  %-7s  %-20s  %s%s\n", (int)w, "name", "dtype", "shape", "bytes", sharded ? "  shard" : "");
    for (size_t i = 0; i < n; i++) {
        const lk_tensor *t = lk_ckpt_tensor(ck, i);
        char shape[256];
        size_t off = (size_t)snprintf(shape, sizeof shape, "[");
        for (int d = 0; d < t->ndim && off < sizeof shape; d++)
            off += (size_t)snprintf(shape + off, sizeof shape - off, d ? ", %lld" : "%lld", (long long)t->shape[d]);
        if (off < sizeof shape) snprintf(shape + off, sizeof shape - off, "]");
        const char *shard = sharded ? lk_ckpt_shard_name(ck, lk_ckpt_tensor_shard(ck, i)) : NULL;
        fprintf(out, "  %-*s  %-7s  %-20s  %zu%s%s\n", (int)w, t->name, lk_dtype_name(t->dtype), shape, t->nbytes,
                shard ? "  " : "", shard ? shard : "");
    }
    fprintf(out, "totals by dtype:\n");
    for (int d = 1; d < LK_DTYPE_COUNT; d++)
        if (count[d])
            fprintf(out, "  %-7s  %zu tensors  %llu bytes\n", lk_dtype_name((lk_dtype)d), count[d], bytes[d]);
    fprintf(out, "  %-7s  %zu tensors  %llu bytes\n", "total", n, total);
}

/* `inspect ADAPTER --base CKPT`: one line per module. */
static void placement_text(json_t *o, FILE *out) {
    const char *fam = json_string_value(json_object_get(o, "family"));
    fprintf(out, "%s on %s: %lld modules placed, %lld unmatched (%s; family table %s)\n",
            json_string_value(json_object_get(o, "adapter")), json_string_value(json_object_get(o, "base")),
            (long long)json_integer_value(json_object_get(o, "modules_placed")),
            (long long)json_integer_value(json_object_get(o, "modules_unmatched")),
            json_string_value(json_object_get(o, "format")), fam ? fam : "none");
    size_t i, k;
    json_t *m, *p;
    json_array_foreach(json_object_get(o, "modules"), i, m) {
        fprintf(out, "  %s  (%s, %s%s, rank %lld, alpha %g from %s, scale %g)\n",
                json_string_value(json_object_get(m, "module")), json_string_value(json_object_get(m, "component")),
                json_string_value(json_object_get(m, "algorithm")), json_is_true(json_object_get(m, "dora")) ? "+DoRA" : "",
                (long long)json_integer_value(json_object_get(m, "rank")),
                json_real_value(json_object_get(m, "alpha")), json_string_value(json_object_get(m, "alpha_source")),
                json_real_value(json_object_get(m, "scale")));
        json_array_foreach(json_object_get(m, "placements"), k, p) {
            json_t *r = json_object_get(p, "rows"), *b = json_object_get(p, "b_rows");
            if (json_is_true(json_object_get(p, "whole")))
                fprintf(out, "    -> %s  [%s]\n", json_string_value(json_object_get(p, "weight")),
                        json_string_value(json_object_get(p, "rule")));
            else
                fprintf(out, "    -> %s rows %lld..%lld (its B rows %lld..%lld)  [%s]\n",
                        json_string_value(json_object_get(p, "weight")),
                        (long long)json_integer_value(json_array_get(r, 0)),
                        (long long)json_integer_value(json_array_get(r, 1)),
                        (long long)json_integer_value(json_array_get(b, 0)),
                        (long long)json_integer_value(json_array_get(b, 1)),
                        json_string_value(json_object_get(p, "rule")));
        }
    }
    json_array_foreach(json_object_get(o, "unmatched"), i, m) {
        fprintf(out, "  %s  matches no weight (component %s); nearest:", json_string_value(json_object_get(m, "module")),
                json_string_value(json_object_get(m, "component")));
        json_array_foreach(json_object_get(m, "nearest"), k, p) fprintf(out, "%s %s", k ? "," : "", json_string_value(p));
        fputc('\n', out);
    }
}

static int to_file(const char *text, size_t len, void *ctx) { return fwrite(text, 1, len, ctx) != len; }

/* The library describes the file (lk_inspect_write / lk_inspect_json_opts,
 * reading an adapter with ao), or where an adapter lands on a base
 * (lk_inspect_base_json). --json prints that (a file's description written
 * as it is made); the text forms of an adapter and of a placement are read
 * back from it, a checkpoint's is listed from the opened set (a 1.3 M-tensor
 * file is never a JSON DOM here). */
static int inspect(const char *path, const char *base, const lk_resolve_opts *ro, const lk_adapter_opts *ao,
                   int json, double strength) {
    const int adapter = base || lk_inspect_is_adapter(path);
    if (!adapter && json) {
        if (lk_inspect_write(path, ao, to_file, stdout) != LK_OK) return lk_cli_fail();
        putchar('\n');
        return LK_EXIT_OK;
    }
    if (!adapter) {
        lk_ckpt *ck;
        if (lk_ckpt_open(path, &ck) != LK_OK) return lk_cli_fail();
        st_listing_text(ck, stdout);
        lk_ckpt_close(ck);
        return LK_EXIT_OK;
    }
    char *js = NULL, *cs = NULL;
    lk_status s = base ? lk_inspect_base_json_opts(path, base, ro, ao, &js) : lk_inspect_json_opts(path, ao, &js);
    if (s != LK_OK) return lk_cli_fail();
    /* a comparison that cannot be made is said, never a failed inspect */
    json_t *cv = lk_fuse_conventions_json(path, base, ro, ao, strength, &cs) ? json_pack("{s:s}", "error", lk_last_error())
                                                                             : json_loads(cs, 0, NULL);
    json_t *o = json_loads(js, 0, NULL);
    lk_free(js);
    lk_free(cs);
    if (!o || !cv || json_object_set_new(o, "conventions", cv)) {
        json_decref(o);
        lk_error(LK_ERR_NOMEM, "%s: out of memory", path);
        return lk_cli_fail();
    }
    if (json) {
        char *txt = json_dumps(o, JSON_COMPACT);
        if (txt) puts(txt);
        free(txt);
    } else {
        if (base) placement_text(o, stdout);
        else lk_inspect_adapter_text(path, o, stdout);
        lk_inspect_conventions_text(json_object_get(o, "conventions"), stdout);
    }
    json_decref(o);
    return LK_EXIT_OK;
}

static int inspect_args(int argc, char **argv, const char **path_out, const char **base, int *json_out,
                        lk_resolve_opts *ro, const char **maps, lk_adapter_opts *ao, double *strength);

int lk_cmd_inspect(int argc, char **argv) {
    if (lk_cli_wants_help(argc, argv)) {
        fputs(INSPECT_USAGE, stdout);
        return LK_EXIT_OK;
    }
    const char *path = NULL, *base = NULL;
    int json = 0;
    const char **maps = calloc((size_t)argc, sizeof *maps);
    lk_resolve_opts ro = {.maps = maps};
    if (!maps) {
        fprintf(stderr, "lorakit: out of memory\n");
        return LK_EXIT_FAIL;
    }
    lk_adapter_opts ao = {0};
    double strength = 0.5;
    int rc = inspect_args(argc, argv, &path, &base, &json, &ro, maps, &ao, &strength);
    if (rc < 0) rc = inspect(path, base, &ro, &ao, json, strength);
    free(maps);
    return rc;
}

/* Parses inspect's arguments; -1 when the command should run, else the exit code. */
static int inspect_args(int argc, char **argv, const char **path_out, const char **base, int *json_out,
                        lk_resolve_opts *ro, const char **maps, lk_adapter_opts *ao, double *strength) {
    const char *path = NULL;
    int json = 0;
    for (int i = 1; i < argc; i++) {
        int has_val = i + 1 < argc;
        if ((!strcmp(argv[i], "--base") || !strcmp(argv[i], "--arch") || !strcmp(argv[i], "--map") ||
             !strcmp(argv[i], "--alpha-from") || !strcmp(argv[i], "--convention") || !strcmp(argv[i], "--strength")) &&
            !has_val)
            return lk_cli_usage("inspect", "%s needs a value", argv[i]);
        if (!strcmp(argv[i], "--base")) *base = argv[++i];
        else if (!strcmp(argv[i], "--arch")) ro->arch = argv[++i];
        else if (!strcmp(argv[i], "--map")) maps[ro->n_maps++] = argv[++i];
        else if (!strcmp(argv[i], "--json")) json = 1;
        else if (!strcmp(argv[i], "--alpha-from")) {
            if (lk_alpha_from_parse(argv[++i], &ao->alpha_from)) return lk_cli_usage("inspect", "%s", lk_last_error());
        } else if (!strcmp(argv[i], "--convention")) {
            if (lk_convention_parse(argv[++i], &ao->convention)) return lk_cli_usage("inspect", "%s", lk_last_error());
        } else if (!strcmp(argv[i], "--strength")) {
            if (lk_fuse_strength_parse(argv[++i], strength) || *strength == 0.0)
                return lk_cli_usage("inspect", "--strength: %s", *strength == 0.0 ? "0 compares nothing" : lk_last_error());
        }
        else if (!strcmp(argv[i], "--") && i + 1 < argc && !path && i + 2 == argc) path = argv[++i];
        else if (argv[i][0] == '-' && argv[i][1]) return lk_cli_usage("inspect", "unknown option '%s'", argv[i]);
        else if (path) return lk_cli_usage("inspect", "one FILE expected, got '%s' and '%s'", path, argv[i]);
        else path = argv[i];
    }
    if (!path) return lk_cli_usage("inspect", "missing FILE");
    if (!*base && (ro->arch || ro->n_maps)) return lk_cli_usage("inspect", "--arch and --map need --base");
    *path_out = path;
    *json_out = json;
    return -1;
}
