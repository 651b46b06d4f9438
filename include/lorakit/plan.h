/* lorakit/plan.h — the hot-swap plan of `lorakit swap` (DESIGN.md, CLI).
 *
 *   bucket_mb: 64          # optional (> 0)
 *   no_lora_swap: false    # optional
 *   allow_nonfinite: false # optional: lk_tracker_opts.allow_nonfinite
 *   timeout: 300           # optional: seconds a collective may wait (0 = none)
 *   alpha_from: tensors    # optional: tensors | metadata, lk_tracker_opts.alpha_from
 *   convention: comfyui    # optional: lorakit | comfyui | lycoris | peft, lk_tracker_opts.convention
 *   arch: flux             # optional: the family table, lk_tracker_opts.arch (none: no table)
 *   maps: [mine.lkmap]     # optional: extra name tables, lk_tracker_opts.maps
 *   steps:
 *     - loras: [{path: a/, strength: 1.0}, {path: b.safetensors, strength: 0.5, format: kohya, alpha: 16}]
 *     - loras: []          # reset
 *
 * Relative adapter and map paths are taken relative to the plan file's directory.
 * Parsing is strict: unknown keys, wrong types, non-finite strengths, a key
 * repeated anywhere (e.g. two `loras:` in one step) and anything past the
 * size limits are LK_ERR_CONFIG naming file, line and key path; text that is
 * not YAML is LK_ERR_FORMAT. Scalars follow lorakit's one YAML rule set
 * (README, "config check and train"). */
#ifndef LORAKIT_PLAN_H
#define LORAKIT_PLAN_H

#include <stddef.h>
#include "lorakit/status.h"
#include "lorakit/fuse.h"
#include "lorakit/knobs.h"

#ifdef __cplusplus
extern "C" {
#endif

/* plan files past LK_KNOB_CONFIG_MAX_BYTES (lorakit/knobs.h, 16 MiB) are refused */
#define LK_PLAN_MAX_BYTES ((unsigned)LK_KNOB_CONFIG_MAX_BYTES_DEFAULT)
#define LK_PLAN_MAX_ENTRIES 65536     /* steps, and adapters over all steps */

typedef struct lk_plan_step {
    lk_fuse_input *loras; /* paths owned by the plan */
    size_t n;
    int line;             /* 1-based line of the step in the plan file */
} lk_plan_step;

typedef struct lk_plan {
    long bucket_mb;       /* 0 when the plan does not set it */
    int no_lora_swap;
    int allow_nonfinite;  /* 0 when the plan does not set it */
    double timeout;       /* seconds, the bounds of LK_KNOB_TIMEOUT_S (0 = none; lk_comm_set_timeout);
                             -1 when the plan does not set it */
    lk_fp8_opts fp8;      /* fp8_rounding, fp8_seed, fp8_scale, fp8_saturate (all zero: nearest, seed 0, rescale, no) */
    lk_alpha_from alpha_from; /* LK_ALPHA_AUTO when the plan does not set it */
    lk_convention convention; /* LK_CONVENTION_LORAKIT when the plan does not set it */
    char *arch;           /* NULL when the plan does not set it */
    char **maps;          /* n_maps paths (relative ones joined to the plan's folder) */
    size_t n_maps;
    lk_plan_step *steps;
    size_t n_steps;
} lk_plan;

/* Reads and parses a plan file. */
lk_status lk_plan_load(const char *path, lk_plan **out);
/* Parses plan text; label names it in errors, base_dir (may be NULL) is
 * prefixed to relative adapter paths. */
lk_status lk_plan_parse(const char *text, size_t len, const char *label, const char *base_dir,
                        lk_plan **out);
void lk_plan_free(lk_plan *p);

#ifdef __cplusplus
}
#endif
#endif
