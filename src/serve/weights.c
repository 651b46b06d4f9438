/* weights.c — in-memory working weights (see lorakit/weights.h).
 *
 * A loaded checkpoint (one file or a sharded set, lorakit/checkpoint.h)
 * becomes one allocation: the tensor table, a name-sorted
 * index, the names, then the data at 64-byte alignment (llm.c style: one
 * object, one free). The copy, rather than the reader's read-only mmap, is
 * what makes the weights writable in place by the tracker. */
#include "lorakit/weights.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h"
#include "core/file.h"
#include "lorakit/alloc.h"
#include "lorakit/checkpoint.h"
#include "lorakit/device.h"
#include "lorakit/fuse.h"

#include <stdio.h>
#include <sys/stat.h>

struct lk_weights {
    size_t n;
    size_t nbytes;
    lk_tensor *t;    /* n views */
    const lk_tensor **sorted; /* the views in byte-wise name order */
    void *block;     /* the single allocation (everything lives in it) */
    lk_device dev;   /* where every tensor's data lives (one device per weights) */
    void *dev_block; /* lk_weights_to_device's device allocation, or NULL */
};

static int cmp_name(const void *a, const void *b) {
    return strcmp((*(const lk_tensor *const *)a)->name, (*(const lk_tensor *const *)b)->name);
}

/* Sorts the index and refuses duplicate names. */
static lk_status build_index(lk_weights *w) {
    for (size_t i = 0; i < w->n; i++) w->sorted[i] = &w->t[i];
    if (w->n) qsort(w->sorted, w->n, sizeof *w->sorted, cmp_name);
    for (size_t i = 1; i < w->n; i++)
        if (!strcmp(w->sorted[i]->name, w->sorted[i - 1]->name))
            return lk_error(LK_ERR_ARG, "weights: %s: tensor name appears twice", w->sorted[i]->name);
    return LK_OK;
}

#define ALIGN_UP(x) (((x) + 63) & ~(size_t)63)

/* A diffusers pipeline folder holds several models (transformer or UNet,
 * text encoders, VAE); weights are one model: refused, naming the
 * component folders to pass instead. */
static lk_status refuse_pipeline(const char *path) {
    static const char *const comps[] = {"transformer", "unet", "text_encoder", "text_encoder_2", "text_encoder_3"};
    size_t cap = 5 * (strlen(path) + 24) + 1, used = 0;
    char *list = lk_malloc(cap);
    if (!list) return lk_error(LK_ERR_NOMEM, "%s: out of memory", path);
    list[0] = '\0';
    for (size_t i = 0; i < sizeof comps / sizeof comps[0]; i++) {
        char *p = lk_path_join(path, comps[i]);
        struct stat sb;
        if (p && stat(p, &sb) == 0 && S_ISDIR(sb.st_mode))
            used += (size_t)snprintf(list + used, cap - used, "%s%s", used ? ", " : "", p);
        lk_free(p);
    }
    if (!used) snprintf(list, cap, "e.g. %s/transformer or %s/unet", path, path);
    lk_status s = lk_error(LK_ERR_ARG, "%s: is a diffusers pipeline folder (model_index.json), which holds several "
                           "models; hot-swapping works on one checkpoint: pass the component's folder (%s)", path, list);
    lk_free(list);
    return s;
}

lk_status lk_weights_load(const char *path, lk_weights **out) {
    if (!path || !out) return lk_error(LK_ERR_ARG, "lk_weights_load: NULL argument");
    *out = NULL;
    if (lk_fuse_is_pipeline(path)) return refuse_pipeline(path);
    lk_ckpt *st = NULL;
    lk_status s = lk_ckpt_open(path, &st);
    if (s) return s;
    size_t n = lk_ckpt_count(st);
    /* layout: [lk_weights][n lk_tensor][n pointers][names][pad][data...] */
    size_t off = ALIGN_UP(sizeof(lk_weights)), names_off, data_off, total, data = 0;
    size_t tab_off = off;
    int ok = lk_checked_mul(n, sizeof(lk_tensor) + sizeof(lk_tensor *), &total) &&
             lk_checked_add(off, total, &off);
    names_off = off;
    for (size_t i = 0; ok && i < n; i++) {
        const lk_tensor *t = lk_ckpt_tensor(st, i);
        ok = lk_checked_add(off, strlen(t->name) + 1, &off);
        size_t a = ALIGN_UP(t->nbytes);
        ok = ok && a >= t->nbytes && lk_checked_add(data, a, &data);
    }
    data_off = ALIGN_UP(off);
    ok = ok && data_off >= off && lk_checked_add(data_off, data, &total) && lk_checked_add(total, 64, &total);
    if (!ok) {
        lk_ckpt_close(st);
        return lk_error(LK_ERR_NOMEM, "%s: the tensors' total size overflows", path);
    }
    unsigned char *raw = lk_malloc(total);
    if (!raw) {
        lk_ckpt_close(st);
        return lk_error(LK_ERR_NOMEM, "%s: out of memory loading %zu bytes of weights", path, total);
    }
    /* align the block start itself so data_off offsets stay 64-aligned */
    unsigned char *b = raw + ((64 - ((uintptr_t)raw & 63)) & 63);
    lk_weights *w = (lk_weights *)b;
    w->block = raw;
    w->n = n;
    w->dev = (lk_device){LK_DEVICE_CPU, 0};
    w->dev_block = NULL;
    w->t = (lk_tensor *)(b + tab_off);
    w->sorted = (const lk_tensor **)(b + tab_off + n * sizeof(lk_tensor));
    char *names = (char *)(b + names_off);
    unsigned char *d = b + data_off;
    w->nbytes = 0;
    for (size_t i = 0; i < n; i++) {
        const lk_tensor *src = lk_ckpt_tensor(st, i);
        size_t len = strlen(src->name) + 1;
        w->t[i] = *src;
        memcpy(names, src->name, len);
        w->t[i].name = names;
        names += len;
        w->t[i].data = d;
        /* pread, not the mmap: a file truncated while loading is an error, not SIGBUS. */
        if (src->nbytes && (s = lk_ckpt_read(st, i, 0, d, src->nbytes)) != LK_OK) {
            lk_ckpt_close(st);
            lk_free(raw);
            return s;
        }
        d += ALIGN_UP(src->nbytes);
        w->nbytes += src->nbytes;
    }
    lk_ckpt_close(st);
    s = build_index(w);
    if (s) {
        lk_free(raw);
        return lk_error_prefix(s, "%s", path);
    }
    *out = w;
    return LK_OK;
}

lk_status lk_weights_wrap(const lk_tensor *t, size_t n, lk_weights **out) {
    if (!out || (n && !t)) return lk_error(LK_ERR_ARG, "lk_weights_wrap: NULL argument");
    *out = NULL;
    /* one allocation: the weights, the n views, the sorted index */
    lk_carve lay = {0};
    const size_t o_w = LK_CARVE(&lay, 1, lk_weights), o_t = LK_CARVE(&lay, n, lk_tensor),
                 o_sorted = LK_CARVE(&lay, n, const lk_tensor *);
    if (lay.overflow) return lk_error(LK_ERR_ARG, "lk_weights_wrap: %zu tensors is too many", n);
    size_t nbytes = 0;
    for (size_t i = 0; i < n; i++) {
        size_t numel = 1, want = 0;
        int ok = t[i].name && t[i].ndim >= 0 && t[i].ndim <= LK_MAX_DIMS && lk_dtype_size(t[i].dtype);
        for (int d = 0; ok && d < t[i].ndim; d++)
            ok = t[i].shape[d] >= 0 && lk_checked_mul(numel, (size_t)t[i].shape[d], &numel);
        ok = ok && lk_checked_mul(numel, lk_dtype_size(t[i].dtype), &want) && want == t[i].nbytes &&
             (!want || t[i].data) && lk_checked_add(nbytes, want, &nbytes);
        if (!ok)
            return lk_error(LK_ERR_ARG, "lk_weights_wrap: tensor %zu (%s): name, dtype, shape and nbytes disagree",
                            i, t[i].name ? t[i].name : "(no name)");
    }
    for (size_t i = 1; i < n; i++)
        if (!lk_device_equal(t[i].device, t[0].device)) {
            char a[LK_DEVICE_STR_MAX], b[LK_DEVICE_STR_MAX];
            return lk_error(LK_ERR_ARG, "lk_weights_wrap: tensors on different devices: %s is on %s, %s on %s (one "
                            "device per weights)", t[0].name, lk_device_str(t[0].device, a), t[i].name,
                            lk_device_str(t[i].device, b));
        }
    unsigned char *raw = lk_carve_alloc(&lay);
    if (!raw) return lk_error(LK_ERR_NOMEM, "lk_weights_wrap: out of memory for %zu tensors", n);
    lk_weights *w = (lk_weights *)(void *)(raw + o_w);
    w->block = raw;
    w->n = n;
    w->nbytes = nbytes;
    w->t = (lk_tensor *)(void *)(raw + o_t);
    w->sorted = (const lk_tensor **)(void *)(raw + o_sorted);
    if (n) memcpy(w->t, t, n * sizeof *t);
    w->dev = n ? t[0].device : (lk_device){LK_DEVICE_CPU, 0};
    w->dev_block = NULL;
    lk_status s = build_index(w);
    if (s) {
        lk_free(raw);
        return s;
    }
    *out = w;
    return LK_OK;
}

void lk_weights_free(lk_weights *w) {
    if (!w) return;
    if (w->dev_block) lk_device_free(w->dev, w->dev_block);
    lk_free(w->block);
}

size_t lk_weights_count(const lk_weights *w) { return w ? w->n : 0; }

const lk_tensor *lk_weights_tensor(const lk_weights *w, size_t i) {
    return (w && i < w->n) ? &w->t[i] : NULL;
}

const lk_tensor *lk_weights_tensors(const lk_weights *w) { return w ? w->t : NULL; }

size_t lk_weights_nbytes(const lk_weights *w) { return w ? w->nbytes : 0; }

long lk_weights_find(const lk_weights *w, const char *name) {
    if (!w || !name) return -1;
    size_t lo = 0, hi = w->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(w->sorted[mid]->name, name);
        if (c == 0) return (long)(w->sorted[mid] - w->t);
        if (c < 0) lo = mid + 1;
        else hi = mid;
    }
    return -1;
}

lk_device lk_weights_device(const lk_weights *w) { return w ? w->dev : (lk_device){LK_DEVICE_CPU, 0}; }

/* lk_digest_views' reader of device weights: a copy to the host. */
static lk_status device_rd(void *ctx, size_t i, uint64_t off, void *dst, size_t len) {
    const lk_weights *w = ctx;
    return lk_device_copy(w->dev, dst, (const unsigned char *)w->t[i].data + off, len, LK_COPY_D2H, NULL);
}

lk_status lk_weights_digest(const lk_weights *w, char hex[LK_DIGEST_HEX]) {
    if (!w) return lk_error(LK_ERR_ARG, "lk_weights_digest: NULL weights");
    if (w->dev.kind == LK_DEVICE_CPU) return lk_digest_tensors(w->t, w->n, hex);
    const lk_tensor **v = lk_malloc((w->n ? w->n : 1) * sizeof *v);
    if (!v) return lk_error(LK_ERR_NOMEM, "weights digest: out of memory for %zu tensors", w->n);
    for (size_t i = 0; i < w->n; i++) v[i] = &w->t[i];
    lk_status s = lk_digest_views(v, w->n, device_rd, (void *)w, "weights digest", hex);
    lk_free(v);
    return s;
}

/* Device offsets: 256 bytes, as cudaMalloc aligns. */
#define DEV_ALIGN(x) (((x) + 255) & ~(size_t)255)

lk_status lk_weights_to_device(lk_weights *w, lk_device d) {
    if (!w) return lk_error(LK_ERR_ARG, "lk_weights_to_device: NULL weights");
    if (lk_device_equal(w->dev, d)) return LK_OK;
    char name[LK_DEVICE_STR_MAX];
    if (w->dev.kind != LK_DEVICE_CPU || d.kind == LK_DEVICE_CPU)
        return lk_error(LK_ERR_ARG, "lk_weights_to_device: the weights are on %s: only host weights move to a device",
                        lk_device_str(w->dev, name));
    lk_status s = LK_OK;
    size_t total = 0;
    for (size_t i = 0; !s && i < w->n; i++)
        if (!lk_checked_add(total, DEV_ALIGN(w->t[i].nbytes), &total))
            s = lk_error(LK_ERR_NOMEM, "lk_weights_to_device: the tensors' total size overflows");
    if (!s) s = lk_device_check(d);
    void *blk = NULL;
    if (!s && total) s = lk_device_alloc(d, total, &blk);
    if (s) return lk_error_prefix(s, "moving %zu bytes of weights to %s", total, lk_device_str(d, name));
    size_t off = 0;
    for (size_t i = 0; !s && i < w->n; i++) {
        if (w->t[i].nbytes)
            s = lk_device_copy(d, (unsigned char *)blk + off, w->t[i].data, w->t[i].nbytes, LK_COPY_H2D, NULL);
        off += DEV_ALIGN(w->t[i].nbytes);
    }
    if (s) { /* nothing changed: the host copy stays in use */
        lk_device_free(d, blk);
        return lk_error_prefix(s, "moving the weights to %s", lk_device_str(d, name));
    }
    off = 0;
    for (size_t i = 0; i < w->n; i++) {
        w->t[i].data = w->t[i].nbytes ? (unsigned char *)blk + off : NULL;
        w->t[i].device = d;
        off += DEV_ALIGN(w->t[i].nbytes);
    }
    w->dev = d;
    w->dev_block = blk;
    return LK_OK;
}
