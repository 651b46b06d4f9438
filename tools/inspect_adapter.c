/* inspect_adapter.c — `lorakit inspect` on an adapter file or PEFT folder.
 *
 * Shows what a fuse would use: the detected format, whether an
 * adapter_config.json was read (and rsLoRA), the module count, and the
 * modules grouped by (rank, alpha, scale) with one example name each, so a
 * 400-module adapter prints a few lines. --json gives the groups and every
 * module. The adapter is fully validated by lk_adapter_open first. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "inspect_adapter.h"

typedef struct group {
    int rank;
    float alpha, scale;
    size_t count;
    const char *example;
} group;

static int group_cmp(const void *pa, const void *pb) {
    const group *a = pa, *b = pb;
    if (a->rank != b->rank) return a->rank < b->rank ? -1 : 1;
    if (a->alpha != b->alpha) return a->alpha < b->alpha ? -1 : 1;
    if (a->scale != b->scale) return a->scale < b->scale ? -1 : 1;
    return 0;
}

/* Groups of equal (rank, alpha, scale), sorted; *ng gets their count. */
static group *make_groups(const lk_adapter *a, size_t *ng) {
    size_t n = lk_adapter_count(a), k = 0;
    group *g = calloc(n ? n : 1, sizeof *g);
    if (!g) return NULL;
    for (size_t i = 0; i < n; i++) {
        const lk_lora_module *m = lk_adapter_module(a, i);
        group key = {m->rank, m->alpha, m->scale, 1, m->module};
        size_t j = 0;
        while (j < k && group_cmp(&g[j], &key)) j++;
        if (j < k) g[j].count++;
        else g[k++] = key;
    }
    qsort(g, k, sizeof *g, group_cmp);
    *ng = k;
    return g;
}

static json_t *adapter_json(const lk_adapter *a, const group *g, size_t ng) {
    json_t *groups = json_array(), *mods = json_array();
    for (size_t i = 0; i < ng; i++)
        json_array_append_new(groups, json_pack("{s:i, s:f, s:f, s:I, s:s}", "rank", g[i].rank, "alpha",
                                                (double)g[i].alpha, "scale", (double)g[i].scale, "count",
                                                (json_int_t)g[i].count, "example", g[i].example));
    for (size_t i = 0; i < lk_adapter_count(a); i++) {
        const lk_lora_module *m = lk_adapter_module(a, i);
        json_array_append_new(mods, json_pack("{s:s, s:i, s:f, s:f, s:I, s:I, s:s, s:s}", "module", m->module,
                                              "rank", m->rank, "alpha", (double)m->alpha, "scale", (double)m->scale,
                                              "in", (json_int_t)m->A.shape[1], "out", (json_int_t)m->B.shape[0],
                                              "dtype_A", lk_dtype_name(m->A.dtype), "dtype_B",
                                              lk_dtype_name(m->B.dtype)));
    }
    return json_pack("{s:s, s:s, s:s, s:b, s:b, s:I, s:I, s:o, s:o}", "path", lk_adapter_path(a), "file",
                     lk_adapter_file(a), "format", lk_adapter_format_name(lk_adapter_get_format(a)), "config",
                     lk_adapter_has_config(a), "rslora", lk_adapter_rslora(a), "module_count",
                     (json_int_t)lk_adapter_count(a), "untargeted", (json_int_t)lk_adapter_untargeted(a), "groups",
                     groups, "modules", mods);
}

int lk_inspect_adapter(const char *path, int json) {
    lk_adapter *a;
    if (lk_adapter_open(path, LK_FORMAT_AUTO, &a) != LK_OK) return lk_cli_fail();
    size_t ng = 0;
    group *g = make_groups(a, &ng);
    int rc = LK_EXIT_OK;
    if (!g) {
        lk_error(LK_ERR_NOMEM, "out of memory");
        rc = lk_cli_fail();
    } else if (json) {
        rc = lk_inspect_print_json(adapter_json(a, g, ng));
    } else {
        printf("%s: LoRA adapter\n", path);
        printf("  file:    %s\n", lk_adapter_file(a));
        printf("  format:  %s%s\n", lk_adapter_format_name(lk_adapter_get_format(a)),
               lk_adapter_has_config(a) ? " (adapter_config.json)" : "");
        printf("  rsLoRA:  %s\n", lk_adapter_rslora(a) ? "yes (scale = alpha / sqrt(rank))" : "no (scale = alpha / rank)");
        printf("  modules: %zu", lk_adapter_count(a));
        if (lk_adapter_untargeted(a)) printf(" (%zu outside target_modules)", lk_adapter_untargeted(a));
        printf("\n  %6s  %10s  %10s  %8s  %s\n", "rank", "alpha", "scale", "modules", "example");
        for (size_t i = 0; i < ng; i++)
            printf("  %6d  %10g  %10g  %8zu  %s\n", g[i].rank, (double)g[i].alpha, (double)g[i].scale, g[i].count,
                   g[i].example);
    }
    free(g);
    lk_adapter_free(a);
    return rc;
}
