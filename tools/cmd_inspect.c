/* cmd_inspect.c — `lorakit inspect FILE|INDEX|DIR [--json]`: prints lk_inspect_json
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
    "       lorakit inspect ADAPTER --base CKPT [--arch NAME] [--map FILE] [--json]\n\n"
    "Lists a checkpoint (a safetensors file, or a sharded set given by its\n"
    "*.safetensors.index*.json or its folder): its metadata (the index's for a\n"
    "sharded set), its shards, then one line per tensor (name, dtype, shape,\n"
    "bytes, shard) in file order, then totals by dtype. Every file is fully\n"
    "validated first; a malformed file or index is an error (exit 1).\n"
    "An adapter (a PEFT folder, or a file whose keys are all LoRA keys) is\n"
    "shown as an adapter instead: detected format, module count, and the\n"
    "rank, alpha and resulting scale per module group.\n"
    "With --base, where each module of ADAPTER lands on CKPT, resolved as\n"
    "`lorakit fuse` would: the weight(s) and rows (a row slice of a fused\n"
    "weight), the rule that matched the name (exact, suffix, kohya form,\n"
    "prefix, family table, --map), the algorithm, rank, alpha and its source,\n"
    "and the scale; each module that lands nowhere with the three nearest\n"
    "weight names.\n\n"
    "options:\n"
    "  --base CKPT    show where ADAPTER's modules land on CKPT\n"
    "  --arch NAME    with --base: the model family table (as lorakit fuse)\n"
    "  --map FILE     with --base: an extra name table (repeatable)\n"
    "  --json     print one JSON object: {path, file_bytes, header_bytes,\n"
    "             metadata, tensors: [{name, dtype, shape, bytes, offset}],\n"
    "             (sharded: also index, shards: [{name, tensors, bytes}],\n"
    "             a shard per tensor, offset within that shard)\n"
    "             totals: {DTYPE: {tensors, bytes}}, tensor_count, total_bytes}\n"
    LK_CLI_ALPHA_FROM_HELP
    "  -h, --help this text\n";

/* The human-readable listing, from the JSON description. */
static void st_listing_text(json_t *o, FILE *out) {
    json_t *tensors = json_object_get(o, "tensors"), *meta = json_object_get(o, "metadata");
    json_t *shards = json_object_get(o, "shards");
    size_t n = json_array_size(tensors);
    if (shards)
        fprintf(out, "%s: %zu tensors in %zu shards, %lld data bytes, headers %lld bytes\n",
                json_string_value(json_object_get(o, "path")), n, json_array_size(shards),
                (long long)json_integer_value(json_object_get(o, "total_bytes")),
                (long long)json_integer_value(json_object_get(o, "header_bytes")));
    else
        fprintf(out, "%s: %zu tensors, %lld data bytes, header %lld bytes\n",
                json_string_value(json_object_get(o, "path")), n,
                (long long)json_integer_value(json_object_get(o, "total_bytes")),
                (long long)json_integer_value(json_object_get(o, "header_bytes")));
    fprintf(out, "metadata%s (%zu):\n", shards ? " (index)" : "", json_object_size(meta));
    const char *k;
    json_t *v;
    json_object_foreach(meta, k, v) {
        /* index metadata may hold numbers (total_size) */
        char *txt = json_is_string(v) ? NULL : json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
        fprintf(out, "  %s: %s\n", k, json_is_string(v) ? json_string_value(v) : txt ? txt : "?");
        free(txt);
    }
    size_t w = 4, i;
    if (shards) {
        fprintf(out, "shards (%zu):\n", json_array_size(shards));
        json_array_foreach(shards, i, v)
            fprintf(out, "  %s  %lld tensors  %lld bytes\n", json_string_value(json_object_get(v, "name")),
                    (long long)json_integer_value(json_object_get(v, "tensors")),
                    (long long)json_integer_value(json_object_get(v, "bytes")));
    }
    json_array_foreach(tensors, i, v) {
        size_t l = strlen(json_string_value(json_object_get(v, "name")));
        if (l > w) w = l;
    }
    if (w > 80) w = 80;
    fprintf(out, "tensors (%zu):\n", n);
    if (n) fprintf(out, "  %-*s  %-7s  %-20s  %s%s\n", (int)w, "name", "dtype", "shape", "bytes", shards ? "  shard" : "");
    json_array_foreach(tensors, i, v) {
        char shape[256];
        size_t off = (size_t)snprintf(shape, sizeof shape, "[");
        json_t *sh = json_object_get(v, "shape"), *d;
        size_t j;
        json_array_foreach(sh, j, d) if (off < sizeof shape) off += (size_t)snprintf(
            shape + off, sizeof shape - off, j ? ", %lld" : "%lld", (long long)json_integer_value(d));
        if (off < sizeof shape) snprintf(shape + off, sizeof shape - off, "]");
        const char *shard = json_string_value(json_object_get(v, "shard"));
        fprintf(out, "  %-*s  %-7s  %-20s  %lld%s%s\n", (int)w, json_string_value(json_object_get(v, "name")),
                json_string_value(json_object_get(v, "dtype")), shape,
                (long long)json_integer_value(json_object_get(v, "bytes")), shard ? "  " : "", shard ? shard : "");
    }
    fprintf(out, "totals by dtype:\n");
    json_object_foreach(json_object_get(o, "totals"), k, v)
        fprintf(out, "  %-7s  %lld tensors  %lld bytes\n", k, (long long)json_integer_value(json_object_get(v, "tensors")),
                (long long)json_integer_value(json_object_get(v, "bytes")));
    fprintf(out, "  %-7s  %zu tensors  %lld bytes\n", "total", n,
            (long long)json_integer_value(json_object_get(o, "total_bytes")));
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
        fprintf(out, "  %s  (%s, rank %lld, alpha %g from %s, scale %g)\n", json_string_value(json_object_get(m, "module")),
                json_string_value(json_object_get(m, "algorithm")),
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

/* The library describes the file (lk_inspect_json_opts, reading an adapter
 * with ao), or where an adapter lands on a base (lk_inspect_base_json);
 * --json prints that, the text forms are read back from it. */
static int inspect(const char *path, const char *base, const lk_resolve_opts *ro, const lk_adapter_opts *ao,
                   int json) {
    char *js = NULL;
    lk_status s = base ? lk_inspect_base_json(path, base, ro, &js) : lk_inspect_json_opts(path, ao, &js);
    if (s != LK_OK) return lk_cli_fail();
    if (json) {
        puts(js);
        lk_free(js);
        return LK_EXIT_OK;
    }
    json_t *o = json_loads(js, 0, NULL);
    lk_free(js);
    if (!o) {
        lk_error(LK_ERR_NOMEM, "%s: out of memory", path);
        return lk_cli_fail();
    }
    if (base) placement_text(o, stdout);
    else if (json_object_get(o, "module_count")) lk_inspect_adapter_text(path, o, stdout);
    else st_listing_text(o, stdout);
    json_decref(o);
    return LK_EXIT_OK;
}

static int inspect_args(int argc, char **argv, const char **path_out, const char **base, int *json_out,
                        lk_resolve_opts *ro, const char **maps, lk_adapter_opts *ao);

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
    int rc = inspect_args(argc, argv, &path, &base, &json, &ro, maps, &ao);
    if (rc < 0) rc = inspect(path, base, &ro, &ao, json);
    free(maps);
    return rc;
}

/* Parses inspect's arguments; -1 when the command should run, else the exit code. */
static int inspect_args(int argc, char **argv, const char **path_out, const char **base, int *json_out,
                        lk_resolve_opts *ro, const char **maps, lk_adapter_opts *ao) {
    const char *path = NULL;
    int json = 0;
    for (int i = 1; i < argc; i++) {
        int has_val = i + 1 < argc;
        if ((!strcmp(argv[i], "--base") || !strcmp(argv[i], "--arch") || !strcmp(argv[i], "--map") ||
             !strcmp(argv[i], "--alpha-from")) && !has_val)
            return lk_cli_usage("inspect", "%s needs a value", argv[i]);
        if (!strcmp(argv[i], "--base")) *base = argv[++i];
        else if (!strcmp(argv[i], "--arch")) ro->arch = argv[++i];
        else if (!strcmp(argv[i], "--map")) maps[ro->n_maps++] = argv[++i];
        else if (!strcmp(argv[i], "--json")) json = 1;
        else if (!strcmp(argv[i], "--alpha-from")) {
            if (lk_alpha_from_parse(argv[++i], &ao->alpha_from)) return lk_cli_usage("inspect", "%s", lk_last_error());
        }
        else if (!strcmp(argv[i], "--") && i + 1 < argc && !path && i + 2 == argc) path = argv[++i];
        else if (argv[i][0] == '-' && argv[i][1]) return lk_cli_usage("inspect", "unknown option '%s'", argv[i]);
        else if (path) return lk_cli_usage("inspect", "one FILE expected, got '%s' and '%s'", path, argv[i]);
        else path = argv[i];
    }
    if (!path) return lk_cli_usage("inspect", "missing FILE");
    if (!*base && (ro->arch || ro->n_maps)) return lk_cli_usage("inspect", "--arch and --map need --base");
    if (*base && ao->alpha_from) return lk_cli_usage("inspect", "--alpha-from is not taken with --base");
    *path_out = path;
    *json_out = json;
    return -1;
}
