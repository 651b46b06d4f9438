/* lorakit/inspect.h — what a checkpoint or adapter holds, as one JSON
 * object: the content of `lorakit inspect --json`, shared by the CLI and the
 * Python package so both describe a file the same way. */
#ifndef LORAKIT_INSPECT_H
#define LORAKIT_INSPECT_H

#include <stddef.h>
#include "lorakit/status.h"
#include "lorakit/adapter.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Validates path and describes it in *json (lk_malloc'd, lk_free it).
 * An adapter (a PEFT folder, or a file whose keys are all LoRA keys, see
 * lk_adapter_looks_like): {path, file, format, config, rslora, module_count,
 * untargeted, groups: [{rank, alpha, scale, count, example}], modules:
 * [{module, rank, alpha, scale, in, out, dtype_A, dtype_B}]}, groups being
 * the modules of equal (rank, alpha, scale) in ascending order. Otherwise a
 * checkpoint (lk_ckpt_open: a safetensors file, an index, or a folder
 * without adapter files): {path, file_bytes, header_bytes, metadata,
 * tensors: [{name, dtype, shape, bytes, offset}] in file order, totals:
 * {DTYPE: {tensors, bytes}}, tensor_count, total_bytes}; a sharded set adds
 * index, shards: [{name, tensors, bytes}] and a shard per tensor (offset
 * within it), and its metadata is the index's (values may be numbers). A name or path that is not
 * UTF-8 cannot be put in JSON: LK_ERR_UNSUPPORTED. */
lk_status lk_inspect_json(const char *path, char **json);
/* The same, reading an adapter with opts (format, alpha_from; NULL: defaults). */
lk_status lk_inspect_json_opts(const char *path, const lk_adapter_opts *opts, char **json);

/* Where every module of `adapter` lands on checkpoint `base`
 * (`lorakit inspect ADAPTER --base CKPT --json`), resolved as a fuse would
 * (opts: arch, maps; unmatched modules are listed, not an error); base may
 * be a diffusers pipeline folder (model_index.json): the adapter is
 * resolved against each component folder with a checkpoint, its weights
 * named "<component>/<key>":
 * {adapter, base, format, family (or null), modules_placed,
 * modules_unmatched, modules: [{module, component, algorithm, rank, alpha,
 * alpha_source, scale, placements: [{weight, rule, whole, rows: [from, to],
 * b_rows: [from, to]}]}], unmatched: [{module, component, nearest: [up to
 * three weight names, nearest first]}]} (nearest: edit distance over the
 * weights' names in both spellings, for the first 64 unmatched modules). */
lk_status lk_inspect_base_json(const char *adapter, const char *base, const lk_resolve_opts *opts, char **json);
/* The same, reading the adapter with aopts (format, alpha_from; NULL:
 * defaults), as `lorakit inspect ADAPTER --base CKPT --alpha-from ...`. */
lk_status lk_inspect_base_json_opts(const char *adapter, const char *base, const lk_resolve_opts *opts,
                                    const lk_adapter_opts *aopts, char **json);

/* lk_inspect_json_opts's text, handed to sink piece by piece (a
 * checkpoint's tensors one at a time), so a many-tensor checkpoint is never
 * held as one string: `lorakit inspect --json` writes it straight out. sink
 * returns 0 to go on, nonzero to stop (then LK_ERR_IO). A failure after the
 * first piece leaves the text incomplete. */
typedef int (*lk_inspect_sink)(const char *text, size_t len, void *ctx);
lk_status lk_inspect_write(const char *path, const lk_adapter_opts *opts, lk_inspect_sink sink, void *ctx);

/* 1 when lk_inspect_json describes path as an adapter, 0 as a checkpoint. */
int lk_inspect_is_adapter(const char *path);

#ifdef __cplusplus
}
#endif
#endif
