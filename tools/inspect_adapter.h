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

/* Prints lk_fuse_conventions_json's object c: one line per module where the
 * conventions differ, its points, and per strength the groups of equal
 * results and how far each pair of groups is apart. */
void lk_inspect_conventions_text(json_t *c, FILE *out);

#endif
