/* keymem.c — the tracker's key memory on the host or a device (see
 * serve/keymem.h).
 *
 * Why it is built this way: the tracker's transactional logic (backups,
 * restore, rollback, the agreed broadcast rounds) stays one piece of code
 * for every device; only the moves of bytes differ, and they are here.
 * The fuse of a device key is the device kernel's (lorakit/fuse_device.h:
 * in place, the CPU's bytes), which takes the host path itself for the
 * term kinds not on the device; the tracker counts those keys
 * (lk_tracker_stats.keys_fused_on_host). Host weights never come here for
 * a fuse. The host scratch serves reading an FP8 scale's clean values.
 * A device key's hash is its device fingerprint, computed where the key
 * is: checking the weights before a call and hashing what a call wrote
 * move 8 bytes per key over PCIe instead of the key twice (README,
 * Devices). */
#include "serve/keymem.h"

#include <string.h>
#include <xxhash.h>

#include "core/alloc.h"
#include "lorakit/alloc.h"
#include "lorakit/fuse_device.h"

lk_status lk_keymem_init(lk_keymem *km, lk_device dev, int backup_device, int staged, size_t max_key, size_t max_scale,
                         size_t stage_bytes) {
    memset(km, 0, sizeof *km);
    km->dev = dev;
    km->on_device = dev.kind != LK_DEVICE_CPU;
    km->backup_device = km->on_device && backup_device;
    km->staged = km->on_device && staged;
    if (!km->on_device) return LK_OK;
    km->scratch_scale_off = 0;
    km->scratch_bytes = max_scale ? max_scale : 1;
    km->fp_scratch_bytes = lk_device_fingerprint_scratch(max_key > max_scale ? max_key : max_scale);
    lk_status s = lk_device_host_alloc(dev, km->scratch_bytes, (void **)&km->scratch);
    if (!s) s = lk_device_alloc(dev, km->fp_scratch_bytes, &km->fp_scratch);
    if (!s && !(km->fuse_scratch = lk_calloc(1, sizeof *km->fuse_scratch)))
        s = lk_error(LK_ERR_NOMEM, "out of memory");
    if (!s && km->staged && stage_bytes) {
        s = lk_device_host_alloc(dev, stage_bytes, (void **)&km->stage);
        km->stage_bytes = stage_bytes;
    }
    if (s) {
        lk_keymem_free(km);
        return lk_error_prefix(s, "tracker: the host scratch of the device weights");
    }
    km->pinned_bytes = km->scratch_bytes + km->stage_bytes;
    km->device_bytes = km->fp_scratch_bytes;
    return LK_OK;
}

void lk_keymem_free(lk_keymem *km) {
    if (km->scratch) lk_device_host_free(km->dev, km->scratch);
    if (km->stage) lk_device_host_free(km->dev, km->stage);
    if (km->fp_scratch) lk_device_free(km->dev, km->fp_scratch);
    lk_fuse_dev_scratch_free(km->fuse_scratch);
    lk_free(km->fuse_scratch);
    km->scratch = km->stage = NULL;
    km->fp_scratch = NULL;
    km->fuse_scratch = NULL;
}

uint64_t lk_keymem_device_bytes(const lk_keymem *km) {
    return km->device_bytes + (km->fuse_scratch ? km->fuse_scratch->bytes : 0);
}

/* One move of bytes on km's stream, complete when it returns (the caller
 * reads the scratch, reuses the stage or hands the memory to the comm next). */
static lk_status km_copy(const lk_keymem *km, void *dst, const void *src, size_t n, lk_copy_kind kind) {
    lk_status s = lk_device_copy(km->dev, dst, src, n, kind, km->stream);
    return !s && km->stream ? lk_stream_sync(km->dev, km->stream) : s;
}

lk_status lk_keymem_backup(lk_keymem *km, const lk_tensor *w, void **backup) {
    const size_t n = w->nbytes ? w->nbytes : 1;
    lk_status s;
    *backup = NULL;
    if (!km->on_device) {
        if (!(*backup = lk_malloc(n)))
            return lk_error(LK_ERR_NOMEM, "tracker: out of memory backing up %s (%zu bytes)", w->name, w->nbytes);
        memcpy(*backup, w->data, w->nbytes);
        return LK_OK;
    }
    if (km->backup_device) {
        s = lk_device_alloc(km->dev, n, backup);
        if (!s) s = km_copy(km, *backup, w->data, w->nbytes, LK_COPY_D2D);
    } else {
        s = lk_device_host_alloc(km->dev, n, backup);
        if (!s) s = lk_keymem_read(km, *backup, w->data, w->nbytes);
    }
    if (s) {
        lk_keymem_drop(km, w, *backup);
        *backup = NULL;
        return lk_error_prefix(s, "tracker: backing up %s (%zu bytes)", w->name, w->nbytes);
    }
    if (km->backup_device) km->device_bytes += w->nbytes;
    else km->pinned_bytes += w->nbytes;
    return LK_OK;
}

void lk_keymem_drop(lk_keymem *km, const lk_tensor *w, void *backup) {
    if (!backup) return;
    if (!km->on_device) lk_free(backup);
    else if (km->backup_device) {
        lk_device_free(km->dev, backup);
        km->device_bytes -= w->nbytes;
    } else {
        lk_device_host_free(km->dev, backup);
        km->pinned_bytes -= w->nbytes;
    }
}

lk_status lk_keymem_read(const lk_keymem *km, void *dst, const void *src, size_t n) {
    if (!km->on_device) {
        memcpy(dst, src, n);
        return LK_OK;
    }
    return n ? km_copy(km, dst, src, n, LK_COPY_D2H) : LK_OK;
}

lk_status lk_keymem_write(const lk_keymem *km, void *dst, const void *src, size_t n) {
    if (!km->on_device) {
        memcpy(dst, src, n);
        return LK_OK;
    }
    return n ? km_copy(km, dst, src, n, LK_COPY_H2D) : LK_OK;
}

lk_status lk_keymem_restore(const lk_keymem *km, const lk_tensor *w, const void *backup) {
    if (!w->nbytes) return LK_OK;
    if (km->backup_device) return km_copy(km, w->data, backup, w->nbytes, LK_COPY_D2D);
    return lk_keymem_write(km, w->data, backup, w->nbytes);
}

lk_status lk_keymem_hash(const lk_keymem *km, const void *p, size_t n, uint64_t *h) {
    if (!km->on_device) {
        *h = XXH3_64bits(p, n);
        return LK_OK;
    }
    void *scratch = lk_device_fingerprint_scratch(n) <= km->fp_scratch_bytes ? km->fp_scratch : NULL;
    return lk_device_fingerprint(km->dev, p, n, scratch, km->stream, h);
}

const char *lk_keymem_hash_name(const lk_keymem *km) { return km->on_device ? "device fingerprint" : "XXH3-64"; }

lk_status lk_keymem_host_view(const lk_keymem *km, const void *p, size_t n, size_t off, const void **out) {
    *out = p;
    if (!km->on_device) return LK_OK;
    *out = km->scratch + off;
    return lk_keymem_read(km, km->scratch + off, p, n);
}

lk_status lk_keymem_fuse(const lk_keymem *km, const lk_tensor *w, const lk_fuse_key *plan, const lk_fuse_term *terms,
                         const lk_fuse_opts *fo, size_t *on_host) {
    lk_tensor d = *w;
    lk_fuse_dev_stats fs = {0};
    lk_status s = lk_fuse_key_apply_dev_in(&d, plan, terms, fo, km->stream, km->fuse_scratch, &fs);
    __atomic_fetch_add(on_host, fs.keys_host_fallback, __ATOMIC_RELAXED);
    return s;
}

lk_status lk_keymem_fuse_fp8(const lk_keymem *km, const lk_tensor *w, const lk_tensor *sc, const lk_fuse_term *terms,
                             size_t nt, const lk_fuse_opts *fo, size_t *on_host) {
    lk_tensor d = *w, ds = sc ? *sc : (lk_tensor){0};
    lk_fuse_dev_stats fs = {0};
    lk_status s = lk_fuse_fp8_dev_in(&d, sc ? &ds : NULL, terms, nt, fo, km->stream, km->fuse_scratch, &fs);
    __atomic_fetch_add(on_host, fs.keys_host_fallback, __ATOMIC_RELAXED);
    return s;
}
