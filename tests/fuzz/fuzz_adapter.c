/* fuzz_adapter.c — libFuzzer target: adapter format detection, module
 * pairing and key resolution against a small model (include/lorakit/adapter.h).
 *
 * The input is an adapter safetensors file (PEFT, diffusers/ComfyUI, kohya or
 * FastVideo keys). lk_adapter_open only takes a path, so the bytes go to a
 * scratch file, which is then opened with format detection (AUTO) and with
 * each format forced, and resolved against the toy model of
 * fuzz_adapter_model.h, strictly and with unmatched modules allowed. The
 * seeds cover every algorithm's keys (LoRA, conv / Tucker LoRA, LoHa, LoKr,
 * full diff / diff_b, set_weight, norm, dora_scale). Invariants of an
 * accepted adapter: every module's tensors have consistent byte sizes, a
 * LoRA module rank r > 0 with A r x ... and B out x r; after a resolve,
 * every module either has a target that is a model key its delta's shape
 * lands on, findable by lk_adapter_find_target, or (allowed only then) none,
 * and the unmatched count says how many. A refusal is a clean error.
 * Resolved adapters are then fused into the toy weights through the real
 * per-key plan and kernel. */
#include "fuzz_adapter_model.h"

/* Fuses the adapter into F32 copies of the toy weights (values i/64) through
 * the per-key plan, as a fuse or a swap would: hostile factor values (NaN,
 * Inf, huge) must give a clean LK_ERR_NONFINITE, or pass with
 * allow_nonfinite; a refused plan is a clean error. */
static void fz_adapter_fuse(lk_adapter *a) {
    static float w[32 * 32], out[32 * 32];
    for (size_t i = 0; i < sizeof w / sizeof w[0]; i++) w[i] = (float)(i % 64) / 64.0f;
    const lk_tensor *model = fz_model();
    for (size_t i = 0; i < FZ_NMODEL; i++) {
        const lk_tensor *t = &model[i];
        lk_fuse_term terms[2];
        lk_fuse_key k;
        const double one = 1.0;
        lk_status s = lk_fuse_key_plan(&a, &one, 1, t, terms, &k);
        if (s != LK_OK) {
            fz_clean_error(s);
            continue;
        }
        if (!lk_fuse_key_touches(&k)) continue;
        lk_fuse_opts o = {.threads = 1};
        s = lk_fuse_key_apply(out, w, t, &k, terms, &o);
        if (s != LK_OK) {
            fz_clean_error(s);
            o.allow_nonfinite = 1;
            s = lk_fuse_key_apply(out, w, t, &k, terms, &o);
            if (s != LK_OK) fz_clean_error(s);
        }
        fz_touch(out, t->nbytes);
    }
}

/* Opens path with format fmt (and alpha source af) and resolves it; returns
 * the open status. */
static lk_status fz_adapter_try(const char *path, lk_adapter_format fmt, lk_alpha_from af, int allow) {
    lk_adapter *a = NULL;
    lk_adapter_opts o = {.format = fmt, .alpha_from = af};
    lk_status s = lk_adapter_open_opts(path, &o, &a);
    if (s != LK_OK) {
        fz_clean_error(s);
        FZ_CHECK(a == NULL);
        return s;
    }
    fz_adapter_check_open(a, fmt);
    size_t unmatched = 12345, warned = 0;
    lk_status r = fz_resolve_counting(a, allow, &unmatched, &warned);
    if (r != LK_OK) fz_clean_error(r);
    else {
        fz_adapter_check_resolved(a, allow, unmatched, warned);
        fz_adapter_fuse(a);
    }
    lk_adapter_free(a);
    return s;
}

static void fz_adapter(const uint8_t *data, size_t size) {
    const char *path = fz_write_tmp("adapter.safetensors", data, size);
    (void)lk_adapter_looks_like(path); /* must not crash; sets no error */
    fz_adapter_try(path, LK_FORMAT_AUTO, LK_ALPHA_AUTO, 0);
    lk_status auto_s = fz_adapter_try(path, LK_FORMAT_AUTO, LK_ALPHA_AUTO, 1);
    for (int f = LK_FORMAT_AUTO + 1; f < LK_FORMAT_COUNT; f++)
        fz_adapter_try(path, (lk_adapter_format)f, LK_ALPHA_AUTO, 1);
    /* each alpha source: an adapter that opens under auto opens under both
     * (out of memory aside: the tests inject allocation failures) */
    lk_status a0 = fz_adapter_try(path, LK_FORMAT_AUTO, LK_ALPHA_TENSORS, 1);
    lk_status a1 = fz_adapter_try(path, LK_FORMAT_AUTO, LK_ALPHA_METADATA, 1);
    FZ_CHECK(auto_s != LK_OK || ((a0 == LK_OK || a0 == LK_ERR_NOMEM) && (a1 == LK_OK || a1 == LK_ERR_NOMEM)));
}

LK_FUZZ_MAIN(fz_adapter)
