/* fuzz_adapter.c — libFuzzer target: adapter format detection, module
 * pairing and key resolution against a small model (include/lorakit/adapter.h).
 *
 * The input is an adapter safetensors file (PEFT, diffusers/ComfyUI, kohya or
 * FastVideo keys). lk_adapter_open only takes a path, so the bytes go to a
 * scratch file, which is then opened with format detection (AUTO) and with
 * each format forced, and resolved against the toy model of
 * fuzz_adapter_model.h, strictly and with unmatched modules allowed. Invariants of an accepted adapter: every
 * module has rank r > 0 with A r x in and B out x r; after a resolve, every
 * module either has a target that is a model key whose 2-D shape is out x in,
 * findable by lk_adapter_find_target, or (allowed only then) none, and the
 * unmatched count says how many. A refusal is a clean error. */
#include "fuzz_adapter_model.h"

/* Opens path with format fmt and resolves it; returns the open status. */
static lk_status fz_adapter_try(const char *path, lk_adapter_format fmt, int allow) {
    lk_adapter *a = NULL;
    lk_status s = lk_adapter_open(path, fmt, &a);
    if (s != LK_OK) {
        fz_clean_error(s);
        FZ_CHECK(a == NULL);
        return s;
    }
    fz_adapter_check_open(a, fmt);
    size_t unmatched = 12345;
    lk_status r = lk_adapter_resolve(a, fz_model(), FZ_NMODEL, allow, &unmatched);
    if (r != LK_OK) fz_clean_error(r);
    else fz_adapter_check_resolved(a, allow, unmatched);
    lk_adapter_free(a);
    return s;
}

static void fz_adapter(const uint8_t *data, size_t size) {
    const char *path = fz_write_tmp("adapter.safetensors", data, size);
    (void)lk_adapter_looks_like(path); /* must not crash; sets no error */
    fz_adapter_try(path, LK_FORMAT_AUTO, 0);
    fz_adapter_try(path, LK_FORMAT_AUTO, 1);
    for (int f = LK_FORMAT_AUTO + 1; f < LK_FORMAT_COUNT; f++)
        fz_adapter_try(path, (lk_adapter_format)f, 1);
}

LK_FUZZ_MAIN(fz_adapter)
