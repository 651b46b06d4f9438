/* lorakit/knobs.h — every setting a person or program can give lorakit, and
 * every size limit, defined once: one row each (name, unit, default,
 * bounds, the layer that uses it, what it is). The CLI, the swap plan and
 * training config readers and the Python package (through its extension)
 * take defaults and bounds from here, and turn MiB into bytes with
 * lk_knob_mib_bytes, so no number is written twice. */
#ifndef LORAKIT_KNOBS_H
#define LORAKIT_KNOBS_H

#include <stddef.h>
#include "lorakit/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* X(ID, name, unit, default, min, max, layer, what). Bounds are inclusive;
 * a MiB value must also come to at least one byte (lk_knob_mib_bytes). A
 * limit (min = max = default) is not settable. */
#define LK_KNOB_LIST(X)                                                                                          \
    X(SWAP_BUCKET_MB, "bucket_mb", "MiB", 64, 1, 1048576, "serve",                                               \
      "hot-swap broadcast round (swap plans, --bucket-mb, Tracker(bucket_mb=)); LTX's tracker uses 256")         \
    X(SYNC_BUCKET_MB, "bucket_mb", "MiB", 4, 0, 1048576, "comm",                                                 \
      "gradient-average bucket (lk_comm_average_f32, LoRA sync, sync_grads(bucket_mb=)); measured by bench sync") \
    X(THREADS, "threads", "threads", 0, 0, 4096, "fuse", "fuse threads (0 = all cores; swap: cores / ranks)")    \
    X(TIMEOUT_S, "timeout", "s", 300, 0, 1000000000, "comm",                                                     \
      "seconds a collective may wait for the other ranks (0 = none)")                                            \
    X(CONFIG_MAX_BYTES, "config_max_bytes", "bytes", 16777216, 16777216, 16777216, "core",                       \
      "largest config file read (YAML, JSON)")                                                                   \
    X(INDEX_MAX_BYTES, "index_max_bytes", "bytes", 67108864, 67108864, 67108864, "io",                           \
      "largest *.safetensors.index.json read")                                                                   \
    X(FAMILY_TABLE_MAX_BYTES, "family_table_max_bytes", "bytes", 4194304, 4194304, 4194304, "adapter",           \
      "largest model-family table (.lkmap) read")

typedef enum lk_knob_id {
#define LK_KNOB_ID_(id, ...) LK_KNOB_##id,
    LK_KNOB_LIST(LK_KNOB_ID_)
#undef LK_KNOB_ID_
    LK_KNOB_COUNT
} lk_knob_id;

/* The rows' numbers as constants for static initializers:
 * LK_KNOB_<ID>_DEFAULT, _MIN, _MAX. */
enum {
#define LK_KNOB_NUM_(id, name, unit, def, lo, hi, ...) \
    LK_KNOB_##id##_DEFAULT = def, LK_KNOB_##id##_MIN = lo, LK_KNOB_##id##_MAX = hi,
    LK_KNOB_LIST(LK_KNOB_NUM_)
#undef LK_KNOB_NUM_
};

typedef struct lk_knob {
    const char *id;          /* the row's ID: "SWAP_BUCKET_MB" */
    const char *name, *unit; /* the key people write ("bucket_mb"), "MiB" */
    double def, min, max;
    const char *layer, *what;
} lk_knob;

/* The row of id (NULL when out of range). */
const lk_knob *lk_knob_get(lk_knob_id id);
/* 1 when v is a finite number within id's bounds. */
int lk_knob_in_range(lk_knob_id id, double v);
/* id's bounds as text for messages, "1..1048576" or "0..1e9" (powers of
 * ten from 1e6 up written so); returns buf. */
const char *lk_knob_range(lk_knob_id id, char *buf, size_t cap);
/* The one MiB -> bytes conversion: mib within id's bounds, times 2^20,
 * rounded toward zero. LK_ERR_ARG naming the knob and value when out of
 * bounds or when it comes to 0 bytes (0 never means "the default" here). */
lk_status lk_knob_mib_bytes(lk_knob_id id, double mib, size_t *bytes);

#ifdef __cplusplus
}
#endif
#endif
