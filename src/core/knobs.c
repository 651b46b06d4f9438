/* knobs.c — the table of lorakit/knobs.h as data, and the one MiB -> bytes
 * conversion. In core, the lowest layer, so every layer that owns a knob
 * (serve, comm, fuse, io, adapter) and every front end reads the same row. */
#include "lorakit/knobs.h"

#include <math.h>
#include <stdio.h>

static const lk_knob g_knobs[LK_KNOB_COUNT] = {
#define LK_KNOB_ROW_(id, name, unit, def, lo, hi, layer, what) {#id, name, unit, def, lo, hi, layer, what},
    LK_KNOB_LIST(LK_KNOB_ROW_)
#undef LK_KNOB_ROW_
};

const lk_knob *lk_knob_get(lk_knob_id id) {
    return (int)id >= 0 && id < LK_KNOB_COUNT ? &g_knobs[id] : NULL;
}

int lk_knob_in_range(lk_knob_id id, double v) {
    const lk_knob *k = lk_knob_get(id);
    return k && isfinite(v) && v >= k->min && v <= k->max;
}

static void put_num(char *buf, size_t cap, double v) {
    int e = 0;
    double p = 1;
    while (p < v && e < 30) p *= 10, e++;
    if (e >= 6 && p == v) snprintf(buf, cap, "1e%d", e);
    else snprintf(buf, cap, "%.17g", v);
}

const char *lk_knob_range(lk_knob_id id, char *buf, size_t cap) {
    const lk_knob *k = lk_knob_get(id);
    char lo[32] = "?", hi[32] = "?";
    if (k) {
        put_num(lo, sizeof lo, k->min);
        put_num(hi, sizeof hi, k->max);
    }
    snprintf(buf, cap, "%s..%s", lo, hi);
    return buf;
}

lk_status lk_knob_mib_bytes(lk_knob_id id, double mib, size_t *bytes) {
    const lk_knob *k = lk_knob_get(id);
    if (!k || !bytes) return lk_error(LK_ERR_ARG, "knob %d: no such setting or NULL output", (int)id);
    *bytes = 0;
    char r[64];
    if (!lk_knob_in_range(id, mib))
        return lk_error(LK_ERR_ARG, "%s: %g %s is outside %s", k->name, mib, k->unit, lk_knob_range(id, r, sizeof r));
    const double b = floor(mib * 1048576.0);
    if (b < 1) return lk_error(LK_ERR_ARG, "%s: %g %s rounds to 0 bytes", k->name, mib, k->unit);
    *bytes = (size_t)b;
    return LK_OK;
}
