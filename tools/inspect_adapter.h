/* inspect_adapter.h — the text form of `lorakit inspect` on an adapter. */
#ifndef LK_TOOLS_INSPECT_ADAPTER_H
#define LK_TOOLS_INSPECT_ADAPTER_H

#include <jansson.h>
#include <stdio.h>

/* Prints the adapter described by o (lk_inspect_json's adapter object):
 * file, detected format, rsLoRA, module count, and one line per (rank,
 * alpha, scale) group with an example module, so a 400-module adapter
 * prints a few lines. */
void lk_inspect_adapter_text(const char *path, json_t *o, FILE *out);

#endif
