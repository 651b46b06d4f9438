/* lorakit/checkpoint.h — a checkpoint as it ships: one .safetensors file or
 * a sharded set described by an index (*.safetensors.index.json), seen as
 * one list of tensors.
 *
 * lk_ckpt_open accepts a .safetensors file, an index file (any name ending
 * in ".json": model.safetensors.index.json, the diffusers
 * diffusion_pytorch_model.safetensors.index.json, variant indexes such as
 * model.safetensors.index.fp16.json), or a folder holding exactly one
 * candidate (one index, or, without an index, one .safetensors file; several
 * are an error listing them). An index is checked strictly (see
 * src/io/checkpoint.c): every shard opens and validates, every tensor sits
 * in exactly the shard the map names, no shard holds a tensor the map omits,
 * shard names stay inside the index's folder. A metadata.total_size that
 * disagrees with the tensors is only a warning (stale values exist in the
 * wild); lk_ckpt_total_size gives the right one.
 *
 * Tensor bytes are read with lk_ckpt_read (pread through the shard's
 * reader): a file that changes underneath is LK_ERR_IO, never a SIGBUS. */
#ifndef LORAKIT_CHECKPOINT_H
#define LORAKIT_CHECKPOINT_H

#include <stddef.h>
#include <stdint.h>
#include "lorakit/status.h"
#include "lorakit/tensor.h"
#include "lorakit/safetensors.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct lk_ckpt lk_ckpt;

lk_status lk_ckpt_open(const char *path, lk_ckpt **out);
void lk_ckpt_close(lk_ckpt *ck);

/* The file the checkpoint was resolved to: the .safetensors file or the index. */
const char *lk_ckpt_path(const lk_ckpt *ck);
/* The folder holding it (the shards' folder for an index). */
const char *lk_ckpt_dir(const lk_ckpt *ck);
/* 1 when opened from an index. */
int lk_ckpt_sharded(const lk_ckpt *ck);

/* All tensors: shard by shard (shards in byte-wise name order), file order
 * within a shard, one array (lk_ckpt_tensor(ck, 0) + i is tensor i). The
 * views' data point into the shards' mappings; read the bytes with
 * lk_ckpt_read instead. */
size_t lk_ckpt_count(const lk_ckpt *ck);
const lk_tensor *lk_ckpt_tensor(const lk_ckpt *ck, size_t i);
/* Index by name, or -1. O(log n). */
long lk_ckpt_find(const lk_ckpt *ck, const char *name);
/* Sum of every tensor's bytes (the correct metadata.total_size). */
uint64_t lk_ckpt_total_size(const lk_ckpt *ck);
/* Copies n bytes at offset off within tensor i (lk_st_read on its shard). */
lk_status lk_ckpt_read(const lk_ckpt *ck, size_t i, uint64_t off, void *dst, size_t n);

/* Shards (1 for a single file). */
size_t lk_ckpt_shard_count(const lk_ckpt *ck);
const lk_st *lk_ckpt_shard(const lk_ckpt *ck, size_t j);
/* The shard's file name within lk_ckpt_dir (the name the index uses). */
const char *lk_ckpt_shard_name(const lk_ckpt *ck, size_t j);
/* The shard holding tensor i, and its index within that shard. */
size_t lk_ckpt_tensor_shard(const lk_ckpt *ck, size_t i);
size_t lk_ckpt_tensor_local(const lk_ckpt *ck, size_t i);

/* The index's "metadata" object as compact JSON text (values as they were,
 * numbers included), "{}" when it has none; NULL for a single file. */
const char *lk_ckpt_index_metadata(const lk_ckpt *ck);
/* The index's file name (e.g. "model.safetensors.index.json"); NULL for a
 * single file. */
const char *lk_ckpt_index_name(const lk_ckpt *ck);

/* Parses an index held in memory (for the fuzz target and tests): checks the
 * JSON structure and every shard name; label names it in errors. On success
 * *n_entries is the weight_map's size. Opens no file. */
lk_status lk_ckpt_parse_index(const char *text, size_t len, const char *label, size_t *n_entries);

#ifdef __cplusplus
}
#endif
#endif
