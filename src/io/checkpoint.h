/* io/checkpoint.h — what the checkpoint reader (checkpoint.c) offers the
 * library beyond lorakit/checkpoint.h (internal, not installed). */
#ifndef LK_IO_CHECKPOINT_H
#define LK_IO_CHECKPOINT_H

#include "lorakit/checkpoint.h"
#include "io/out_file.h"

/* 1 for an index file name ("*.safetensors.index.json",
 * "*.safetensors.index.<variant>.json"): what lk_ckpt_open reads as an
 * index, and what an output folder's writer treats as one. */
int lk_ckpt_is_index_name(const char *name);

/* Adds a checkpoint's files to an output's inputs (io/out_file.h): the
 * index and every shard, or its one file. */
lk_status lk_out_inputs_add_ckpt(lk_out_inputs *in, const lk_ckpt *ck);

#endif
