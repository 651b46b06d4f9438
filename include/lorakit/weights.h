/* lorakit/weights.h — a writable in-memory state of named tensors: the
 * working weights an inference server holds and the hot-swap tracker
 * rewrites in place.
 *
 * lk_weights_load copies a checkpoint (file or sharded set) into one allocation (tensor
 * table, names and 64-byte-aligned data together). lk_weights_wrap instead
 * borrows tensors the host program already holds (a server's own weight
 * memory), so the tracker can work on them without a copy. Either way the
 * tensor views are writable and lookups by name are O(log n). */
#ifndef LORAKIT_WEIGHTS_H
#define LORAKIT_WEIGHTS_H

#include <stddef.h>
#include "lorakit/status.h"
#include "lorakit/tensor.h"
#include "lorakit/digest.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct lk_weights lk_weights;

/* Loads every tensor of a checkpoint (a safetensors file, an index of a
 * sharded set, or a folder holding one: lk_ckpt_open) into memory (one
 * allocation; tensors in shard then file order). A diffusers pipeline
 * folder (model_index.json: several models) is LK_ERR_ARG naming the
 * component folders to load instead (its transformer/, unet/, ...). */
lk_status lk_weights_load(const char *path, lk_weights **out);
/* Borrows n tensors (names and data stay the caller's and must outlive the
 * weights; data must be writable). The table itself is copied. Duplicate
 * names or an nbytes that disagrees with dtype x shape are LK_ERR_ARG. */
lk_status lk_weights_wrap(const lk_tensor *t, size_t n, lk_weights **out);
void lk_weights_free(lk_weights *w);

size_t lk_weights_count(const lk_weights *w);
/* Tensor i (file order for loaded weights); its data is writable. */
const lk_tensor *lk_weights_tensor(const lk_weights *w, size_t i);
/* All count tensors as one array (for lk_adapter_resolve, lk_st_save). */
const lk_tensor *lk_weights_tensors(const lk_weights *w);
/* Index of the tensor named name, or -1. */
long lk_weights_find(const lk_weights *w, const char *name);
/* Total data bytes. */
size_t lk_weights_nbytes(const lk_weights *w);
/* Where the tensors' data lives (every tensor on the same device:
 * lk_weights_wrap refuses tensors on different devices, naming two). */
lk_device lk_weights_device(const lk_weights *w);
/* Moves loaded host weights to device d (lorakit/device.h: cuda:N, emul):
 * one device allocation holding every tensor (256-byte aligned), the
 * bytes copied, the views pointed at it (lk_weights_free frees it). On a
 * failure (no such device, out of device memory) nothing changes. The
 * host copy of a loaded checkpoint stays allocated (the table and names
 * live in it). */
lk_status lk_weights_to_device(lk_weights *w, lk_device d);
/* The content digest (lorakit/digest.h) of the current bytes (device
 * weights are copied to the host piece by piece). */
lk_status lk_weights_digest(const lk_weights *w, char hex[LK_DIGEST_HEX]);

#ifdef __cplusplus
}
#endif
#endif
