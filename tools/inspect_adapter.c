/* inspect_adapter.c — `lorakit inspect` on an adapter file or PEFT folder,
 * as text: read back from the library's JSON description
 * (lk_inspect_json), which --json prints as it is. */
#include <stdio.h>

#include "inspect_adapter.h"

void lk_inspect_adapter_text(const char *path, json_t *o, FILE *out) {
    json_t *g;
    size_t i, untargeted = (size_t)json_integer_value(json_object_get(o, "untargeted"));
    fprintf(out, "%s: adapter\n", path);
    fprintf(out, "  file:    %s\n", json_string_value(json_object_get(o, "file")));
    fprintf(out, "  format:  %s%s\n", json_string_value(json_object_get(o, "format")),
            json_is_true(json_object_get(o, "config")) ? " (adapter_config.json)" : "");
    fprintf(out, "  rsLoRA:  %s\n", json_is_true(json_object_get(o, "rslora")) ? "yes (scale = alpha / sqrt(rank))"
                                                                             : "no (scale = alpha / rank)");
    if (json_is_true(json_object_get(o, "dora"))) fprintf(out, "  DoRA:    yes (lora_magnitude_vector per module)\n");
    size_t nd = 0, j;
    json_t *mo;
    json_array_foreach(json_object_get(o, "modules"), j, mo) nd += json_is_true(json_object_get(mo, "dora"));
    if (nd && !json_is_true(json_object_get(o, "dora")))
        fprintf(out, "  DoRA:    %zu modules (dora_scale: LyCORIS's weight decomposition)\n", nd);
    fprintf(out, "  modules: %lld", (long long)json_integer_value(json_object_get(o, "module_count")));
    if (untargeted) fprintf(out, " (%zu outside target_modules)", untargeted);
    fprintf(out, "\n  %-10s  %6s  %10s  %10s  %8s  %-28s  %s\n", "algorithm", "rank", "alpha", "scale", "modules",
            "alpha from", "example");
    json_array_foreach(json_object_get(o, "groups"), i, g)
        fprintf(out, "  %-10s  %6lld  %10g  %10g  %8lld  %-28s  %s\n", json_string_value(json_object_get(g, "algo")),
                (long long)json_integer_value(json_object_get(g, "rank")),
                json_number_value(json_object_get(g, "alpha")), json_number_value(json_object_get(g, "scale")),
                (long long)json_integer_value(json_object_get(g, "count")),
                json_string_value(json_object_get(g, "alpha_source")), json_string_value(json_object_get(g, "example")));
    json_t *reps = json_object_get(o, "replaced");
    if (json_array_size(reps)) fprintf(out, "  replaced whole: %zu tensors\n", json_array_size(reps));
    json_array_foreach(reps, i, g)
        fprintf(out, "    %-16s  %s\n", json_string_value(json_object_get(g, "kind")),
                json_string_value(json_object_get(g, "key")));
}

static void pairs_text(json_t *at, FILE *out) {
    size_t i, j;
    json_t *a, *p;
    json_array_foreach(at, i, a) {
        json_t *g, *c;
        size_t k, l;
        fprintf(out, "    s=%g: ", json_number_value(json_object_get(a, "strength")));
        json_array_foreach(json_object_get(a, "groups"), k, g) {
            fputs(k ? " | " : "", out);
            json_array_foreach(g, l, c) fprintf(out, "%s%s", l ? " = " : "", json_string_value(c));
        }
        fputc('\n', out);
        json_array_foreach(json_object_get(a, "pairs"), j, p) {
            json_t *mx = json_object_get(p, "max_abs"), *ne = json_object_get(p, "elements");
            fprintf(out, "      %s and %s differ by", json_string_value(json_object_get(p, "a")),
                    json_string_value(json_object_get(p, "b")));
            if (json_is_number(mx)) fprintf(out, " up to %.3g,", json_number_value(mx));
            fprintf(out, " relative Frobenius %.3g of the delta", json_number_value(json_object_get(p, "rel_fro")));
            if (ne) fprintf(out, " (%lld elements)", (long long)json_integer_value(ne));
            fputc('\n', out);
        }
    }
}

void lk_inspect_conventions_text(json_t *c, FILE *out) {
    json_t *mods = json_object_get(c, "modules"), *m, *p;
    if (json_object_get(c, "error")) {
        fprintf(out, "conventions: not compared: %s\n", json_string_value(json_object_get(c, "error")));
        return;
    }
    size_t i, k;
    json_array_foreach(json_object_get(c, "not_compared"), i, p)
        fprintf(out, "conventions: %s not compared (an FP8 weight)\n", json_string_value(p));
    if (!json_array_size(mods)) {
        fprintf(out, "conventions: lorakit, comfyui, lycoris and peft give the same weights for this file%s\n",
                !json_is_true(json_object_get(c, "base")) ? " (compared by its scales and rules, without a base: no module where they differ)"
                : json_array_size(json_object_get(c, "not_compared")) ? " on every compared weight of this base"
                                                                       : " on this base");
        return;
    }
    fprintf(out, "conventions: %lld module(s) where they give different weights (%s):\n",
            (long long)json_integer_value(json_object_get(c, "modules_differ")),
            json_string_value(json_object_get(c, "computed")));
    json_array_foreach(mods, i, m) {
        json_t *w = json_object_get(m, "weight");
        fprintf(out, "  %s%s%s%s\n", json_string_value(json_object_get(m, "module")), w && json_is_string(w) ? " -> " : "",
                w && json_is_string(w) ? json_string_value(w) : "",
                json_is_true(json_object_get(m, "needs_base")) ? " (the size needs --base: its delta reads the weight)"
                                                                : "");
        json_array_foreach(json_object_get(m, "points"), k, p) fprintf(out, "    %s\n", json_string_value(p));
        pairs_text(json_object_get(m, "at"), out);
    }
}
