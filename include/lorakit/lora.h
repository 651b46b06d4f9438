/* lorakit/lora.h — LoRA training: config, wrapping a host model's linear
 * layers, the LoRA linear kernels, seeded init, the adapter parameter buffer,
 * gradient sync over a mesh, clipping, AdamW, and PEFT save/load.
 *
 * Matches fastvideo.train.utils.lora (see shared/reference/): the
 * `models.<role>.lora` config rules, substring targeting minus an exclude
 * list, frozen base weights, `<m>.weight` -> `<m>.base_layer.weight` key
 * aliases, replicated adapter parameters whose gradients are averaged over
 * every replicated mesh dim on every rank (zeros where a rank skipped a layer).
 *
 * Typical training loop (one process or one per MPI rank):
 *
 *   lk_lora_config cfg;  lk_lora_config_load("train.yaml", "student", &cfg);
 *   lk_lora_model *m;    lk_lora_model_create(&m);
 *   lk_lora_model_add_linear(m, "blocks.0.attn.to_q", in, out, W, b, NULL); ...
 *   lk_lora_model_add_tensor(m, "blocks.0.norm.weight", 1, shape, w);      ...
 *   lk_lora_enable(m, &cfg, exclude, seed, &n_wrapped);
 *   lk_lora_model_load_base(m, "base.safetensors", NULL);  (aliases applied)
 *   lk_lora_finalize(m, NULL);
 *   lk_lora_params *p = lk_lora_model_params(m);
 *   lk_adamw *opt;       lk_adamw_create(p, &opts, &opt);
 *   for each step:
 *     lk_lora_params_zero_grad(p);
 *     forward with lk_lora_layer_forward, backward with lk_lora_layer_backward
 *     lk_lora_sync_grads(p, mesh, NULL);          (every rank, always)
 *     lk_lora_clip_grad_norm(p, 1.0f, &norm);
 *     lk_adamw_step(opt, p);
 *   lk_lora_save_peft(m, "out/adapter");  lk_adamw_save(opt, p, "out/adapter");
 *
 * All matrices are f32, row-major. Shapes: W is out x in, A is r x in, B is
 * out x r, x is n x in, y is n x out (n = tokens). Scale c = alpha / r.
 * Gradient outputs ACCUMULATE (+=), llm.c style: zero them once per step. */
#ifndef LORAKIT_LORA_H
#define LORAKIT_LORA_H

#include <stddef.h>
#include <stdint.h>
#include "lorakit/status.h"
#include "lorakit/mesh.h"
#include "lorakit/device.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------ config */

/* FastVideo's default targets (substring match against module names). */
extern const char *const lk_lora_default_targets[];  /* NULL-terminated */

/* The resolved `models.<role>.lora` block. Owns its strings: release with
 * lk_lora_config_clear. A zero-initialised struct is "not configured". */
typedef struct lk_lora_config {
    int configured;        /* 0: no `lora` block (or `lora: null`): same effect as enable false */
    int enable;            /* default 0 */
    int rank;              /* 0 when unset; > 0 whenever enable is 1 */
    int alpha;             /* resolved: the given alpha, else rank (0 when rank unset) */
    int alpha_given;       /* 1 when alpha was in the file */
    char **targets;        /* n_targets strings; the default list when none given */
    size_t n_targets;
    int targets_given;     /* 1 when target_modules was a non-empty list in the file */
    size_t n_unknown_keys; /* unknown keys in the block (each warned about) */
    char warning[512];     /* the warning logged for unknown keys ("" if none) */
    char info[512];        /* the info logged for "rank set but enable false" ("" if none) */
} lk_lora_config;

/* Reads `models.<role>.lora` from a YAML file. Rules (FastVideo's training config reader's):
 *  - no `lora` block, or `lora: null`        -> configured = 0, LK_OK
 *  - `lora` not a mapping                    -> LK_ERR_CONFIG
 *  - enable: true|false (YAML 1.1 booleans, null = false); default false;
 *    anything else                            -> LK_ERR_CONFIG
 *  - rank / alpha: integers (null = unset); a non-integer -> LK_ERR_CONFIG
 *  - enable true and rank unset               -> LK_ERR_CONFIG
 *  - enable true and rank <= 0                -> LK_ERR_CONFIG
 *  - rank set with enable false: accepted, logged at info (cfg->info), LoRA off
 *  - alpha defaults to rank
 *  - target_modules: a list of non-empty strings; absent, null or [] gives
 *    the default list; anything else          -> LK_ERR_CONFIG
 *  - unknown keys: a warning listing them and the valid keys (cfg->warning)
 *  - a key repeated anywhere in the file      -> LK_ERR_CONFIG naming both lines
 *  - a missing file, malformed YAML, `models` missing or not a mapping, or
 *    no such role                             -> LK_ERR_IO / LK_ERR_FORMAT / LK_ERR_CONFIG
 * Errors name the file, line and key: "cfg.yaml:7: models.student.lora.rank:
 * must be > 0, got 0". On failure *out is left zeroed (nothing to clear). */
lk_status lk_lora_config_load(const char *path, const char *role, lk_lora_config *out);
/* The same from YAML text in memory; label stands for the file name in errors. */
lk_status lk_lora_config_parse(const char *yaml, size_t len, const char *label,
                               const char *role, lk_lora_config *out);
/* The role names under `models`, in file order; none (n = 0) when the config
 * has no `models` key (*roles is lk_malloc'd, each
 * string too: free with lk_lora_roles_free). */
lk_status lk_lora_config_roles(const char *path, char ***roles, size_t *n);
void lk_lora_roles_free(char **roles, size_t n);
void lk_lora_config_clear(lk_lora_config *cfg);
/* One line describing cfg, e.g. "lora enabled: rank 16, alpha 32, targets
 * [to_q, to_k]" or "lora not configured". Returns the length (snprintf-style). */
int lk_lora_config_describe(const lk_lora_config *cfg, char *buf, size_t cap);

/* ----------------------------------------------------------- the model */

/* A host program's registry of named tensors: linear layers (which LoRA can
 * wrap) and any other parameters (norms, embeddings) it wants loaded from a
 * checkpoint by name. The host owns the weight memory (borrowed pointers,
 * must outlive the model); the model owns the adapter parameters. */
typedef struct lk_lora_model lk_lora_model;
typedef struct lk_lora_layer lk_lora_layer;
typedef struct lk_lora_params lk_lora_params;

lk_status lk_lora_model_create(lk_lora_model **out);
void lk_lora_model_free(lk_lora_model *m);

/* Registers a linear layer y = x W^T + b, W out x in, b of length out or
 * NULL. Names must be unique (e.g. "blocks.0.attn.to_q"); its state names
 * are "<name>.weight" and "<name>.bias". *layer (may be NULL) is a handle
 * valid until lk_lora_model_free. Not allowed after lk_lora_enable. */
lk_status lk_lora_model_add_linear(lk_lora_model *m, const char *name, int in, int out,
                                   float *weight, float *bias, lk_lora_layer **layer);
/* Registers any other named f32 tensor (full state name, e.g. "norm.weight"). */
lk_status lk_lora_model_add_tensor(lk_lora_model *m, const char *name, int ndim,
                                   const int64_t *shape, float *data);

size_t lk_lora_model_layer_count(const lk_lora_model *m);
lk_lora_layer *lk_lora_model_layer(lk_lora_model *m, size_t i); /* registration order */
lk_lora_layer *lk_lora_model_find(lk_lora_model *m, const char *name); /* or NULL */

/* Wraps every registered linear layer whose name contains one of
 * cfg->targets (lk_lora_default_targets when cfg->targets is NULL) and none
 * of `exclude` (NULL-terminated, may be NULL), with
 * rank cfg->rank and scale cfg->alpha / cfg->rank; freezes every base tensor
 * (linear and other); initialises A kaiming-uniform (bound 1/sqrt(in)) and B
 * to zero from (seed, "<name>.lora_A") — identical on every rank, whatever
 * the registration order; and lays out all adapter parameters in one buffer
 * (see lk_lora_params). *count (may be NULL) gets the number of wrapped
 * layers. Errors: cfg not enabled (LK_ERR_CONFIG); nothing matched
 * (LK_ERR_CONFIG, the message lists the targets and excludes); called twice
 * (LK_ERR_STATE). On error the model is unchanged. */
lk_status lk_lora_enable(lk_lora_model *m, const lk_lora_config *cfg,
                         const char *const *exclude, uint64_t seed, size_t *count);
/* Re-asserts the training state after a checkpoint load: base frozen,
 * adapters trainable. Errors if a wrapped layer lacks A or B, or if no
 * wrapped layer exists (LK_ERR_STATE). *count (may be NULL) = wrapped layers. */
lk_status lk_lora_finalize(lk_lora_model *m, size_t *count);

/* 1 if the tensor with this state name gets gradients: after enable only
 * "<m>.lora_A" / "<m>.lora_B"; before enable every registered tensor. */
int lk_lora_model_is_trainable(const lk_lora_model *m, const char *state_name);

/* Options of lk_lora_model_load_base (NULL = all zero). */
typedef struct lk_lora_load_opts {
    int allow_missing;    /* base tensors absent from the file keep their values */
    int allow_unexpected; /* file tensors matching nothing are ignored (else error) */
} lk_lora_load_opts;

/* Loads a base checkpoint (F32/F16/BF16; a safetensors file, a sharded
 * set's index or a folder: lk_ckpt_open) into the registered
 * tensors. Each state name is looked up as-is, and for a wrapped layer
 * "<m>.base_layer.weight|bias" also as "<m>.weight|bias" (the key alias).
 * "<m>.lora_A" / "<m>.lora_B" are loaded when the file has them, else
 * re-initialised from the seed (not an error). Every shape is checked
 * before any byte is written: on error nothing has changed. */
lk_status lk_lora_model_load_base(lk_lora_model *m, const char *path,
                                  const lk_lora_load_opts *opts);
/* Writes the base tensors under their original names ("<m>.weight",
 * "<m>.bias", others as registered), F32, atomically: the checkpoint a
 * `lorakit fuse` takes as BASE. */
lk_status lk_lora_model_save_base(const lk_lora_model *m, const char *path);

/* --------------------------------------------------------------- layers */

const char *lk_lora_layer_name(const lk_lora_layer *l);
int lk_lora_layer_in(const lk_lora_layer *l);
int lk_lora_layer_out(const lk_lora_layer *l);
int lk_lora_layer_wrapped(const lk_lora_layer *l); /* 1 after enable matched it */
int lk_lora_layer_rank(const lk_lora_layer *l);    /* 0 when not wrapped */
float lk_lora_layer_scale(const lk_lora_layer *l); /* alpha / rank; 0 when not wrapped */
/* Pointers into the parameter / gradient buffers (NULL when not wrapped). */
float *lk_lora_layer_A(lk_lora_layer *l);   /* r x in */
float *lk_lora_layer_B(lk_lora_layer *l);   /* out x r */
float *lk_lora_layer_dA(lk_lora_layer *l);
float *lk_lora_layer_dB(lk_lora_layer *l);
const float *lk_lora_layer_weight(const lk_lora_layer *l);
const float *lk_lora_layer_bias(const lk_lora_layer *l);

/* y (n x out) = x W^T + b [+ c (x A^T) B^T when wrapped]. Overwrites y. */
lk_status lk_lora_layer_forward(lk_lora_layer *l, float *y, const float *x, int n);
/* Backward of the forward above for upstream gradient dy (n x out):
 * dA += c (dy B)^T x, dB += c dy^T (x A^T) when wrapped; dx += dy W
 * [+ c (dy B) A] when dx is not NULL. Base W, b get no gradient (frozen).
 * Uses a per-model scratch buffer (grown as needed: LK_ERR_NOMEM possible),
 * so calls on layers of one model must not run concurrently. */
lk_status lk_lora_layer_backward(lk_lora_layer *l, float *dx, const float *dy,
                                 const float *x, int n);
/* The LoRA term alone, for hosts that compute x W^T + b themselves (e.g. a
 * linear hook, as src/app does): y += c (x A^T) B^T (y is n x out,
 * accumulated); nothing when the layer is not wrapped. */
lk_status lk_lora_layer_delta_forward(lk_lora_layer *l, float *y, const float *x, int n);
/* Its backward: dA, dB accumulate as above; dx += c (dy B) A when dx is not
 * NULL. Same scratch rule as lk_lora_layer_backward. */
lk_status lk_lora_layer_delta_backward(lk_lora_layer *l, float *dx, const float *dy,
                                       const float *x, int n);
/* Merged weight W + c B A (out x in) into dst (W itself when not wrapped),
 * through the fuse kernel (lk_fuse_tensor): bit-identical to `lorakit fuse`
 * of the adapter saved by lk_lora_save_peft onto lk_lora_model_save_base. */
lk_status lk_lora_layer_merged(const lk_lora_layer *l, float *dst);

/* The kernels under the layer calls, for hosts with their own layout.
 * h is n x r: written by forward (x A^T, kept for backward); dh is n x r
 * scratch. b, dx may be NULL. A, B, h, dA, dB, dh are unused when r == 0. */
void lk_lora_linear_forward(float *y, float *h, const float *x, const float *W,
                            const float *b, const float *A, const float *B, float scale,
                            int n, int in, int out, int r);
void lk_lora_linear_backward(float *dx, float *dA, float *dB, float *dh, const float *dy,
                             const float *x, const float *h, const float *W, const float *A,
                             const float *B, float scale, int n, int in, int out, int r);

/* ------------------------------------------------------------- the init */

/* dst[i] = bound * (2u - 1), u in [0, 1) from a counter-based generator:
 * key = XXH3-64(name) seeded with seed, u = top 24 bits of
 * splitmix64(key + (i + 1) * 0x9E3779B97F4A7C15) / 2^24. Pure function of
 * (seed, name, i): no state, no order dependence. */
void lk_lora_rand_uniform(float *dst, size_t n, uint64_t seed, const char *name, float bound);

/* ---------------------------------------------------------- parameters */

/* All adapter parameters of a model (or a standalone set, e.g. for a
 * benchmark) in ONE contiguous f32 buffer, gradients in another of equal
 * layout, ordered by parameter name (byte-wise strcmp; a model's parameters
 * are named "<m>.lora_A" and "<m>.lora_B"). Owned by the model (lk_lora_model_params) or by the
 * caller (lk_lora_params_create / _free). */
typedef struct lk_lora_param_spec {
    const char *name;
    int64_t rows, cols;
} lk_lora_param_spec;

lk_status lk_lora_params_create(const lk_lora_param_spec *specs, size_t n, lk_lora_params **out);
void lk_lora_params_free(lk_lora_params *p);
/* The model's parameters (NULL before lk_lora_enable). */
lk_lora_params *lk_lora_model_params(lk_lora_model *m);

size_t lk_lora_params_count(const lk_lora_params *p);  /* parameter tensors */
size_t lk_lora_params_numel(const lk_lora_params *p);  /* total floats */
float *lk_lora_params_data(lk_lora_params *p);
float *lk_lora_params_grad(lk_lora_params *p);
/* Name, offset (in floats) and shape of parameter i (name order). */
const char *lk_lora_params_name(const lk_lora_params *p, size_t i);
size_t lk_lora_params_offset(const lk_lora_params *p, size_t i);
void lk_lora_params_shape(const lk_lora_params *p, size_t i, int64_t *rows, int64_t *cols);
long lk_lora_params_find(const lk_lora_params *p, const char *name); /* or -1 */
void lk_lora_params_zero_grad(lk_lora_params *p);

/* --------------------------------------------------------- distributed */

typedef struct lk_lora_sync_opts {
    size_t bucket_bytes; /* 0: LK_COMM_AVERAGE_BUCKET_DEFAULT (4 MiB). One
                            allreduce per bucket per mesh dim. */
    int per_param;       /* 1: one allreduce per parameter (FastVideo's
                            way; for benchmarks and comparison only) */
} lk_lora_sync_opts;

/* Averages the gradient buffer over every mesh dim of size > 1 (adapter
 * parameters are replicated on every dim): per dim, lk_comm_average_f32
 * over the dim's communicator (allreduce-sum, then divide by its size),
 * the buffer as one stream of buckets. Every rank must call it every step, whatever layers
 * its loss touched: a skipped layer's gradient is zero (from zero_grad) and
 * still joins every collective, so no rank can hang or mis-pair tensors.
 * Call after backward, before clipping and the optimizer. *synced (may be
 * NULL) = parameters synchronised: 0 when mesh is NULL or every dim has
 * size 1 (no communication). *n_collectives (in the _ex form, may be NULL)
 * = allreduce calls issued. */
lk_status lk_lora_sync_grads(lk_lora_params *p, lk_mesh *mesh, size_t *synced);

/* lk_comm_average_f32 on float buffers in the memory of device d (cuda:N,
 * emul; cpu: lk_comm_average_f32 itself): the same collectives in the same
 * order (the agreement, the layout, one allreduce per bucket at the same
 * bucket boundaries), each element divided by the rank count by a device
 * kernel (one IEEE float division, as the host's), so the bytes equal the
 * host average's for the same sums. A bucket inside one buffer is reduced
 * in place, one that spans buffers is gathered into a device stage; with
 * comm_takes_device the allreduce gets the device memory itself (NCCL, or
 * the host communicator whose callbacks take device buffers: Python's over
 * an NCCL ProcessGroup), else each bucket goes through a pinned host stage.
 * Copies and the division are queued on stream (NULL: d's default), which
 * is synchronised before each allreduce and at the end (never the whole
 * device). */
typedef struct lk_lora_average_dev_opts {
    size_t bucket_bytes;      /* as lk_comm_average_f32's (0: the default) */
    lk_stream *stream;
    int comm_takes_device;
} lk_lora_average_dev_opts;
lk_status lk_lora_average_dev(lk_comm *c, lk_device d, float *const *bufs, const size_t *counts, size_t n,
                              const lk_lora_average_dev_opts *opts, size_t *n_collectives);
lk_status lk_lora_sync_grads_ex(lk_lora_params *p, lk_mesh *mesh, const lk_lora_sync_opts *opts,
                                size_t *synced, size_t *n_collectives);

/* Checks that every rank of the mesh's world holds bit-identical adapter
 * parameters: each rank hashes each parameter (XXH3-64), the hashes are
 * allgathered, and any difference is LK_ERR_MISMATCH on every rank, naming
 * the first drifted parameter and the ranks that disagree with rank 0, with
 * the number of drifted parameters in *n_drifted (may be NULL). Collective. */
lk_status lk_lora_check_replicas(lk_lora_params *p, lk_mesh *mesh, size_t *n_drifted);

/* Global L2 norm of the gradient buffer (accumulated in double) into *norm
 * (may be NULL); when it exceeds max_norm (> 0), scales every gradient by
 * max_norm / (norm + 1e-6), as torch.nn.utils.clip_grad_norm_. A non-finite
 * norm is LK_ERR_NONFINITE with the gradients untouched. Call after sync:
 * the norm is then identical on every rank without communication. */
lk_status lk_lora_clip_grad_norm(lk_lora_params *p, float max_norm, float *norm);

/* ------------------------------------------------------------- AdamW */

typedef struct lk_adamw_opts {
    float lr;            /* e.g. 1e-4 */
    float beta1, beta2;  /* 0 and 0 mean the defaults 0.9, 0.999 */
    float eps;           /* 0 means 1e-8 */
    float weight_decay;  /* decoupled: p -= lr * wd * p; e.g. 0.01 */
} lk_adamw_opts;

typedef struct lk_adamw lk_adamw;

/* Optimizer state (exp_avg, exp_avg_sq: one buffer) for the parameters p. */
lk_status lk_adamw_create(const lk_lora_params *p, const lk_adamw_opts *opts, lk_adamw **out);
void lk_adamw_free(lk_adamw *o);
/* One step on p's data from p's gradients, exactly torch.optim.AdamW's
 * update (bias-corrected, decoupled weight decay). */
lk_status lk_adamw_step(lk_adamw *o, lk_lora_params *p);
long lk_adamw_steps(const lk_adamw *o);      /* steps taken */
void lk_adamw_set_lr(lk_adamw *o, float lr); /* for schedules */
/* Saves / loads the state as DIR/optimizer.safetensors ("<param>.exp_avg",
 * "<param>.exp_avg_sq", metadata step, lr, betas, eps, weight_decay). Load
 * checks every parameter name and shape; on error the state is unchanged. */
lk_status lk_adamw_save(const lk_adamw *o, const lk_lora_params *p, const char *dir);
lk_status lk_adamw_load(lk_adamw *o, const lk_lora_params *p, const char *dir);

/* -------------------------------------------------------------- PEFT */

/* Writes DIR/adapter_model.safetensors (F32; keys
 * "base_model.model.<m>.lora_A.weight" r x in, ".lora_B.weight" out x r) and
 * DIR/adapter_config.json (peft_type LORA, r, lora_alpha, target_modules =
 * the wrapped module names, use_rslora false, bias none, fan_in_fan_out
 * false, lora_dropout 0). DIR is created if needed; each file is written to
 * a temporary name and renamed into place. */
lk_status lk_lora_save_peft(const lk_lora_model *m, const char *dir);
/* Loads an adapter saved by lk_lora_save_peft into the wrapped layers (for
 * resuming): every wrapped module must be present with matching r x in /
 * out x r shapes and the same r and lora_alpha; the values are copied bit
 * for bit. On error nothing has changed. */
lk_status lk_lora_load_peft(lk_lora_model *m, const char *dir);

#ifdef __cplusplus
}
#endif
#endif
