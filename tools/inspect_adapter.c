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
