/* layout.h — how an adapter module's name finds its weight across checkpoint
 * layouts (internal to src/adapter): wrapper prefixes and components on both
 * sides, kohya's underscore spelling, and the per-family name tables
 * (data/families, *.lkmap files) that map diffusers names onto original (LDM/BFL)
 * names, row slices of fused projections included.
 *
 * resolve.c builds one lk_layout per resolve from the model's keys and asks
 * it for the weight(s) a module name lands on. */
#ifndef LK_ADAPTER_LAYOUT_H
#define LK_ADAPTER_LAYOUT_H

#include <stddef.h>
#include <stdint.h>
#include "lorakit/adapter.h"
#include "lorakit/status.h"
#include "lorakit/tensor.h"

/* Components of a pipeline: where a prefix says a name belongs. */
enum { LK_COMP_ANY = 0, LK_COMP_DIFFUSION, LK_COMP_TE1, LK_COMP_TE2, LK_COMP_TE3, LK_COMP_COUNT };
const char *lk_comp_name(int comp);
/* A pipeline folder's component ("unet", "transformer", "text_encoder", "text_encoder_2", "text_encoder_3"), or
 * LK_COMP_ANY for another name. */
int lk_comp_from_name(const char *name);

/* Rows [num0/den0, num1/den1) of a weight or module, as fractions of its rows. */
typedef struct lk_frac {
    int64_t n0, d0, n1, d1;
} lk_frac;

/* One mapping rule of a table: ORIG <-> DIFF, rows orig_rows of the
 * original weight are rows diff_rows of the diffusers one. */
typedef struct lk_fam_rule {
    char *orig, *diff; /* patterns: '.'-separated; '#' = a decimal number (captured), '#last' = the highest
                        * number the checkpoint has there (captured), a final '*' = the rest */
    lk_frac orig_rows, diff_rows;
    int line;
    int last; /* the capture index of '#last' (the checkpoint's highest number there) on both sides, or -1 */
    int alias; /* an 'alias' line: another spelling (a trainer's, ComfyUI's) of rows the 'map' lines name too */
} lk_fam_rule;

typedef struct lk_family {
    char *name;  /* "flux", "sd15", ... (or the --map file's) */
    char *file;  /* the table file */
    char **detect; /* per detect line, its keys (without prefix) separated by ' ', '!' before one that
                    * must be absent: a line whose keys all hold picks this family */
    size_t n_detect;
    lk_fam_rule *rules;
    size_t n_rules;
} lk_family;

/* Parses a table (text of len bytes) read from `file`; errors name the file
 * and line. require_name: a family table must name itself. */
lk_status lk_family_parse(const char *text, size_t len, const char *file, int require_name, lk_family *out);
lk_status lk_family_load(const char *path, int require_name, lk_family *out);
void lk_family_free(lk_family *f);
/* The folder holding the installed family tables (LORAKIT_FAMILIES_DIR,
 * else beside the library / executable, else the source tree) in *out,
 * lk_malloc'd; *out = NULL (and LK_OK) when there is none. LK_ERR_NOMEM
 * when out of memory. */
lk_status lk_family_dir(char **out);

/* A model-side name under which a module may find a weight. */
typedef struct lk_alias {
    char *name;         /* dotted form */
    char *uname;        /* kohya form ('.' -> '_') */
    size_t key;         /* model tensor index */
    int comp;           /* component the model key lives in */
    int level;          /* 1: prefix stripped, 2: family table / --map */
    const char *rule;   /* "prefix", "family flux (file:line)", ... (owned by the layout) */
    lk_frac w, m;       /* rows of the weight / of the module that correspond */
} lk_alias;

typedef struct lk_layout {
    lk_alias *al;
    size_t n;
    size_t *by_name, *by_uname; /* al sorted by name / uname */
    char **rules;       /* owned rule strings */
    size_t n_rules;
    char *family;       /* the family tables used ("openclip,sdxl"), or NULL */
    int also[LK_COMP_COUNT]; /* a module of component c also lands on model keys of component also[c] (else c):
                              * a single file's T5 (text_encoders.t5xxl.) answers to lora_te2_ beside CLIP-L
                              * alone (Flux: OneTrainer), to lora_te1_ alone, as ComfyUI numbers it */
} lk_layout;

typedef struct lk_layout_opts {
    const char *arch;          /* family name to use; NULL: recognised from the keys; "none": no table */
    const char *const *maps;   /* extra table files (--map) */
    size_t n_maps;
} lk_layout_opts;

lk_status lk_layout_build(const lk_tensor *model, size_t n_model, const lk_layout_opts *o, const char *label,
                          lk_layout *out);
void lk_layout_free(lk_layout *l);

/* Strips the adapter-side wrapper prefixes of a module name: *comp gets the
 * component a prefix names (LK_COMP_ANY if none); kohya: the name is in
 * kohya's underscore spelling (lora_unet_..., lycoris_...). Returns a
 * pointer into name. */
const char *lk_layout_strip_module(const char *name, int kohya, int *comp);

/* The pipeline component a module routes to, as inspect names it: the one
 * its own prefix names (module: its full adapter-side name or stem; kohya:
 * underscore spelling), else the one the prefix of the model key it lands on
 * (key, may be NULL) names; "unet", "transformer", "text_encoder",
 * "text_encoder_2", "text_encoder_3", "diffusion_model" (a single file's
 * model.diffusion_model.), or "any". */
const char *lk_layout_component(const char *module, int kohya, const char *key);

/* The aliases name (kohya: its underscore form) may land on, at the lowest
 * level that has any: *first and *count index a run of the sorted order
 * (*ord: by_name or by_uname). Component filter: comp ANY matches all. */
size_t lk_layout_find(const lk_layout *l, const char *name, int kohya, int comp, size_t *hits, size_t cap);

#endif
