/* serve/keymem.h — how the tracker moves a key's bytes wherever the
 * weights live (internal to src/serve).
 *
 * The tracker touches weight memory only through these functions, the fuse
 * kernel and lk_comm calls (DESIGN.md, Hot-swap tracker, Devices). On host
 * weights every function is a memcpy or malloc; on a device (cuda:N, emul)
 * they are the device layer's copies and allocations: the clean backup in
 * pinned host memory (default) or on the device (backup = device), a
 * pinned host scratch for an FP8 scale's clean values, and, where the
 * communicator cannot take device memory (emul; cuda over MPI), a pinned
 * host stage of one broadcast round. Device keys are hashed on the device
 * (lk_device_fingerprint: 8 bytes cross to the host, not the key) into a
 * device scratch of partial sums, and fused with a grow-only device
 * scratch for the factors (lk_fuse_dev_scratch), both kept for the
 * tracker's life: device memory beyond the model is those two (the
 * fingerprint's partial sums, at most an eighth of the largest key and 1
 * MiB; the largest key's factors) plus device backups (backup = device). */
#ifndef LK_SERVE_KEYMEM_H
#define LK_SERVE_KEYMEM_H

#include <stddef.h>
#include <stdint.h>

#include "lorakit/device.h"
#include "lorakit/fuse.h"
#include "lorakit/fuse_device.h"
#include "lorakit/tensor.h"

typedef struct lk_keymem {
    lk_device dev;         /* the weights' device */
    int on_device;         /* dev is not the host */
    int backup_device;     /* backups in device memory */
    int staged;            /* broadcasts go through stage (comm cannot take device memory) */
    unsigned char *scratch; /* pinned host: the largest FP8 scale (at scratch_scale_off, 0) */
    size_t scratch_bytes, scratch_scale_off;
    void *fp_scratch;       /* device: the fingerprint's partial sums for the largest key */
    size_t fp_scratch_bytes;
    lk_fuse_dev_scratch *fuse_scratch; /* device: the fuse's uploads (grow-only), one thread at a time */
    unsigned char *stage;  /* pinned host: one broadcast round */
    size_t stage_bytes;
    uint64_t device_bytes; /* device memory held: the backups on the device and fp_scratch
                              (lk_keymem_device_bytes adds the fuse scratch) */
    uint64_t pinned_bytes; /* pinned host memory held (backups, scratch, stage) */
    lk_stream *stream;     /* where the device work is queued (NULL: the default stream);
                              borrowed (lk_tracker_set_stream). Each move completes
                              before its function returns, on whichever stream */
} lk_keymem;

/* Sets km up for weights on dev: on a device, a scratch of max_key bytes
 * plus max_scale (the largest FP8 scale key) and, when staged, a stage of
 * stage_bytes. Local. */
lk_status lk_keymem_init(lk_keymem *km, lk_device dev, int backup_device, int staged, size_t max_key, size_t max_scale,
                         size_t stage_bytes);
void lk_keymem_free(lk_keymem *km);

/* A backup of w's bytes: allocated (host, pinned host or device) and
 * copied. */
lk_status lk_keymem_backup(lk_keymem *km, const lk_tensor *w, void **backup);
void lk_keymem_drop(lk_keymem *km, const lk_tensor *w, void *backup);
/* w's bytes from its backup. */
lk_status lk_keymem_restore(const lk_keymem *km, const lk_tensor *w, const void *backup);
/* n bytes at off of device (or host) memory src into host dst. */
lk_status lk_keymem_read(const lk_keymem *km, void *dst, const void *src, size_t n);
/* n host bytes into device (or host) memory dst. */
lk_status lk_keymem_write(const lk_keymem *km, void *dst, const void *src, size_t n);
/* A hash of n bytes of weight memory p: on the host XXH3-64 (one-shot's
 * value), on a device its fingerprint computed there
 * (lk_device_fingerprint). Every rank's weights are on the same device
 * kind (the tracker agrees on it), so hashes compared across ranks or
 * calls are always of one kind; lk_keymem_hash_name names it. */
lk_status lk_keymem_hash(const lk_keymem *km, const void *p, size_t n, uint64_t *h);
const char *lk_keymem_hash_name(const lk_keymem *km);
/* Device memory held now: device_bytes plus the fuse scratch. */
uint64_t lk_keymem_device_bytes(const lk_keymem *km);
/* A backup's or weight's bytes readable by the CPU: p itself on the host,
 * else copied into the scratch at off (scratch_scale_off: the scratch
 * holds the largest FP8 scale, n at most that). */
lk_status lk_keymem_host_view(const lk_keymem *km, const void *p, size_t n, size_t off, const void **out);

/* Fuses plan into device weight w in place (lk_fuse_key_apply_dev: the
 * device kernel, or its host path for the kinds not on the device, whose
 * keys are added to *on_host). */
lk_status lk_keymem_fuse(const lk_keymem *km, const lk_tensor *w, const lk_fuse_key *plan, const lk_fuse_term *terms,
                         const lk_fuse_opts *fo, size_t *on_host);
/* The FP8 fuse of device weight w with its scale sc (may be NULL)
 * (lk_fuse_fp8_dev). */
lk_status lk_keymem_fuse_fp8(const lk_keymem *km, const lk_tensor *w, const lk_tensor *sc, const lk_fuse_term *terms,
                             size_t nt, const lk_fuse_opts *fo, size_t *on_host);

#endif
