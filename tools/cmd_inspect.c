/* cmd_inspect.c — `lorakit inspect FILE [--json]`.
 *
 * For a safetensors file: the metadata, one line per tensor (name, dtype,
 * shape, bytes) in file order, then totals by dtype; --json prints one JSON
 * object (built with jansson) with the same content. The listing lives in
 * two small functions (st_listing_text / st_listing_json) so that other
 * kinds of input (an adapter folder or file: format, modules, ranks, alphas)
 * can be added as one more branch in lk_cmd_inspect that reuses them. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "inspect_adapter.h"

static const char *const INSPECT_USAGE =
    "usage: lorakit inspect FILE|DIR [--json]\n\n"
    "Lists a safetensors file: its metadata, then one line per tensor (name,\n"
    "dtype, shape, bytes) in file order, then totals by dtype. The file is\n"
    "fully validated first; a malformed file is an error (exit 1).\n"
    "An adapter (a PEFT folder, or a file whose keys are all LoRA keys) is\n"
    "shown as an adapter instead: detected format, module count, and the\n"
    "rank, alpha and resulting scale per module group.\n\n"
    "options:\n"
    "  --json     print one JSON object: {path, file_bytes, header_bytes,\n"
    "             metadata, tensors: [{name, dtype, shape, bytes, offset}],\n"
    "             totals: {DTYPE: {tensors, bytes}}, tensor_count, total_bytes}\n"
    "  -h, --help this text\n";

typedef struct {
    size_t count[LK_DTYPE_COUNT];
    unsigned long long bytes[LK_DTYPE_COUNT];
    unsigned long long total;
} dtype_totals;

static void st_totals(const lk_st *st, dtype_totals *t) {
    memset(t, 0, sizeof *t);
    for (size_t i = 0; i < lk_st_count(st); i++) {
        const lk_tensor *x = lk_st_tensor(st, i);
        t->count[x->dtype]++;
        t->bytes[x->dtype] += x->nbytes;
        t->total += x->nbytes;
    }
}

/* The human-readable listing of an open safetensors file. */
static void st_listing_text(const lk_st *st, FILE *out) {
    size_t n = lk_st_count(st), nm = lk_st_metadata_count(st);
    dtype_totals tot;
    st_totals(st, &tot);
    fprintf(out, "%s: %zu tensors, %llu data bytes, header %llu bytes\n", lk_st_path(st), n, tot.total,
            (unsigned long long)lk_st_header_len(st));
    fprintf(out, "metadata (%zu):\n", nm);
    for (size_t i = 0; i < nm; i++) {
        const char *k, *v;
        lk_st_metadata_at(st, i, &k, &v);
        fprintf(out, "  %s: %s\n", k, v);
    }
    size_t w = 4;
    for (size_t i = 0; i < n; i++) {
        size_t l = strlen(lk_st_tensor(st, i)->name);
        if (l > w) w = l;
    }
    if (w > 80) w = 80;
    fprintf(out, "tensors (%zu):\n", n);
    if (n) fprintf(out, "  %-*s  %-7s  %-20s  %s\n", (int)w, "name", "dtype", "shape", "bytes");
    for (size_t i = 0; i < n; i++) {
        const lk_tensor *t = lk_st_tensor(st, i);
        char shape[256];
        lk_shape_str(t, shape, sizeof shape);
        fprintf(out, "  %-*s  %-7s  %-20s  %zu\n", (int)w, t->name, lk_dtype_name(t->dtype), shape, t->nbytes);
    }
    fprintf(out, "totals by dtype:\n");
    for (int d = 1; d < LK_DTYPE_COUNT; d++)
        if (tot.count[d])
            fprintf(out, "  %-7s  %zu tensors  %llu bytes\n", lk_dtype_name((lk_dtype)d), tot.count[d], tot.bytes[d]);
    fprintf(out, "  %-7s  %zu tensors  %llu bytes\n", "total", n, tot.total);
}

/* The same content as one JSON object (NULL when out of memory). */
static json_t *st_listing_json(const lk_st *st) {
    size_t n = lk_st_count(st), nm = lk_st_metadata_count(st);
    dtype_totals tot;
    st_totals(st, &tot);
    json_t *o = json_object(), *meta = json_object(), *arr = json_array(), *tj = json_object();
    if (!o || !meta || !arr || !tj) {
        json_decref(o); json_decref(meta); json_decref(arr); json_decref(tj);
        return NULL;
    }
    int bad = 0;
    uint64_t file_bytes = 8 + lk_st_header_len(st) + tot.total;
    bad |= json_object_set_new(o, "path", json_string(lk_st_path(st)));
    bad |= json_object_set_new(o, "file_bytes", json_integer((json_int_t)file_bytes));
    bad |= json_object_set_new(o, "header_bytes", json_integer((json_int_t)lk_st_header_len(st)));
    for (size_t i = 0; i < nm; i++) {
        const char *k, *v;
        lk_st_metadata_at(st, i, &k, &v);
        bad |= json_object_set_new(meta, k, json_string(v));
    }
    bad |= json_object_set_new(o, "metadata", meta);
    for (size_t i = 0; i < n && !bad; i++) {
        const lk_tensor *t = lk_st_tensor(st, i);
        json_t *e = json_object(), *sh = json_array();
        if (!e || !sh) {
            json_decref(e); json_decref(sh);
            bad = 1;
            break;
        }
        for (int d = 0; d < t->ndim; d++) bad |= json_array_append_new(sh, json_integer(t->shape[d]));
        bad |= json_object_set_new(e, "name", json_string(t->name));
        bad |= json_object_set_new(e, "dtype", json_string(lk_dtype_name(t->dtype)));
        bad |= json_object_set_new(e, "shape", sh);
        bad |= json_object_set_new(e, "bytes", json_integer((json_int_t)t->nbytes));
        bad |= json_object_set_new(e, "offset", json_integer((json_int_t)lk_st_file_offset(st, i)));
        bad |= json_array_append_new(arr, e);
    }
    bad |= json_object_set_new(o, "tensors", arr);
    for (int d = 1; d < LK_DTYPE_COUNT; d++)
        if (tot.count[d])
            bad |= json_object_set_new(tj, lk_dtype_name((lk_dtype)d),
                                       json_pack("{s:I,s:I}", "tensors", (json_int_t)tot.count[d], "bytes",
                                                 (json_int_t)tot.bytes[d]));
    bad |= json_object_set_new(o, "totals", tj);
    bad |= json_object_set_new(o, "tensor_count", json_integer((json_int_t)n));
    bad |= json_object_set_new(o, "total_bytes", json_integer((json_int_t)tot.total));
    if (bad) {
        json_decref(o);
        return NULL;
    }
    return o;
}

int lk_inspect_print_json(json_t *o) {
    if (!o) {
        lk_error(LK_ERR_NOMEM, "cannot build the JSON output (out of memory, or a name or path that is not UTF-8)");
        return lk_cli_fail();
    }
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    if (!s) {
        lk_error(LK_ERR_NOMEM, "out of memory building JSON output");
        return lk_cli_fail();
    }
    puts(s);
    free(s);
    return LK_EXIT_OK;
}

static int inspect_safetensors(const char *path, int json) {
    lk_st *st;
    if (lk_st_open(path, &st) != LK_OK) return lk_cli_fail();
    int rc = LK_EXIT_OK;
    if (json) rc = lk_inspect_print_json(st_listing_json(st));
    else st_listing_text(st, stdout);
    lk_st_close(st);
    return rc;
}

int lk_cmd_inspect(int argc, char **argv) {
    if (lk_cli_wants_help(argc, argv)) {
        fputs(INSPECT_USAGE, stdout);
        return LK_EXIT_OK;
    }
    const char *path = NULL;
    int json = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json")) json = 1;
        else if (!strcmp(argv[i], "--") && i + 1 < argc && !path && i + 2 == argc) path = argv[++i];
        else if (argv[i][0] == '-' && argv[i][1]) return lk_cli_usage("inspect", "unknown option '%s'", argv[i]);
        else if (path) return lk_cli_usage("inspect", "one FILE expected, got '%s' and '%s'", path, argv[i]);
        else path = argv[i];
    }
    if (!path) return lk_cli_usage("inspect", "missing FILE");
    /* Adapter inputs (a folder, or an adapter file) get their own branch here. */
    if (lk_adapter_looks_like(path)) return lk_inspect_adapter(path, json);
    return inspect_safetensors(path, json);
}
