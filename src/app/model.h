/* app/model.h — a small decoder-only transformer in plain C (f32), used by
 * `lorakit train`, `lorakit demo` and the training tests.
 *
 * Token + position embedding, n_layers blocks of pre-norm causal
 * self-attention and MLP (GELU), final LayerNorm, output head, softmax
 * cross-entropy. Every layer has a paired forward/backward; parameters live in
 * one allocation and their gradients in another, in a fixed order.
 *
 * Linear layers carry diffusers/HF checkpoint names so FastVideo's default LoRA
 * target list (lk_lora_default_targets) applies unchanged; weights are [out, in] like torch.nn.Linear:
 *
 *   tok_emb.weight                 [vocab, d_model]
 *   pos_emb.weight                 [max_seq, d_model]
 *   blocks.{i}.norm1.weight/.bias  [d_model]
 *   blocks.{i}.attn.to_q.weight    [d_model, d_model]   (+ .bias [d_model])
 *   blocks.{i}.attn.to_k / to_v / to_out.0              (same)
 *   blocks.{i}.norm2.weight/.bias  [d_model]
 *   blocks.{i}.ff.net.0.proj.weight [d_ff, d_model]     (+ .bias [d_ff])
 *   blocks.{i}.ff.net.2.weight     [d_model, d_ff]      (+ .bias [d_model])
 *   norm_out.weight/.bias          [d_model]
 *   lm_head.weight                 [vocab, d_model]     (no bias)
 *
 * Key aliases: `<m>.base_layer.weight` / `.bias` (a LoRA-wrapped layer's base,
 * as PEFT names it) resolve to `<m>.weight` / `.bias` wherever a name is looked
 * up, so a base checkpoint loads into a wrapped model and back.
 *
 * LoRA (or any other additive delta) attaches to a linear through a hook: the
 * forward adds the hook's output to y = x W^T + b, the backward lets the hook
 * accumulate its own gradients and its share of dL/dx. The model knows nothing
 * of LoRA itself; src/app/model_lora.c connects it to the training API. */
#ifndef LK_APP_MODEL_H
#define LK_APP_MODEL_H

#include <stddef.h>
#include <stdint.h>
#include "lorakit/comm.h"
#include "lorakit/lora.h"
#include "lorakit/status.h"
#include "app/task.h"
#include "lorakit/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct lk_model_config {
    int vocab;     /* V: tokens */
    int max_seq;   /* T_max: positions */
    int d_model;   /* C */
    int n_layers;  /* L */
    int n_heads;   /* NH, divides C */
    int d_ff;      /* F: MLP hidden width (0 = 4 * C) */
} lk_model_config;

/* Checks every field is positive, n_heads divides d_model and the total size
 * fits; fills d_ff = 4 * d_model when 0. */
lk_status lk_model_config_check(lk_model_config *cfg);

typedef struct lk_model lk_model;

#define LK_MODEL_NAME_MAX 64

typedef struct lk_model_param {
    char name[LK_MODEL_NAME_MAX];
    int ndim;           /* 1 or 2 */
    int64_t shape[2];
    size_t numel;
    size_t offset;      /* in floats, into lk_model_params() */
} lk_model_param;

/* Creates a model with parameters drawn from `seed` (GPT-2 style: normal
 * std 0.02, residual projections scaled by 1/sqrt(2L), LayerNorm 1/0). */
lk_status lk_model_create(const lk_model_config *cfg, uint64_t seed, lk_model **out);
void lk_model_free(lk_model *m);
const lk_model_config *lk_model_get_config(const lk_model *m);

/* All parameters, contiguous, in the order of lk_model_param_at; and their
 * gradients (same layout). */
float *lk_model_params(lk_model *m);
float *lk_model_grads(lk_model *m);
size_t lk_model_num_floats(const lk_model *m);
size_t lk_model_param_count(const lk_model *m);
const lk_model_param *lk_model_param_at(const lk_model *m, size_t i);
/* Index of a parameter by name (aliases accepted), or -1. */
long lk_model_find_param(const lk_model *m, const char *name);

/* Views of every parameter (names borrowed from the model), for saving or
 * for a weight tracker. `out` has lk_model_param_count() entries. */
void lk_model_tensors(lk_model *m, lk_tensor *out);

/* Copies tensors into the model by name (aliases accepted; F32/F16/BF16).
 * Every tensor of the model must be present with its exact shape unless
 * allow_missing; a tensor the model does not have is an error. All checks run
 * before any byte is written: on failure the model is unchanged. `label` names
 * the source in errors. */
lk_status lk_model_set_tensors(lk_model *m, const lk_tensor *ts, size_t n,
                               const char *label, int allow_missing);

/* Saves to safetensors (atomically), with the config in the metadata
 * (lorakit.model.vocab, .max_seq, .d_model, .n_layers, .n_heads, .d_ff). */
lk_status lk_model_save(lk_model *m, const char *path);
/* Creates a model from a file saved by lk_model_save. */
lk_status lk_model_load(const char *path, lk_model **out);
/* Loads a checkpoint's weights into an existing model (see set_tensors). */
lk_status lk_model_load_weights(lk_model *m, const char *path);

/* ---- forward / backward ----
 * inputs [B, T] token ids; targets [B, T] ids or -1 (position ignored), or
 * NULL for inference. Loss = mean cross-entropy over the non-ignored
 * positions (0 when there are none). Activation buffers grow to B*T on
 * demand (one allocation per set) and are kept for the backward. */
lk_status lk_model_forward(lk_model *m, const int *inputs, const int *targets,
                           int B, int T, float *loss);
/* Logits [B, T, V] of the last forward. */
const float *lk_model_logits(const lk_model *m);
void lk_model_zero_grad(lk_model *m);
/* Accumulates dLoss/dparams into lk_model_grads() (only the linears'
 * hooks when the base is frozen) for the last forward, which must have had
 * targets. */
lk_status lk_model_backward(lk_model *m);
/* 1 (default): backward computes gradients of every base parameter;
 * 0: the base is frozen, only activation gradients and hooks run. */
void lk_model_set_train_base(lk_model *m, int on);

/* Greedy decoding: prompts [B, P]; writes gen_len tokens per row into
 * out [B, gen_len]. P + gen_len - 1 <= max_seq (the last token is never fed back). */
lk_status lk_model_generate(lk_model *m, const int *prompts, int B, int P,
                            int gen_len, int *out);

/* ---- linear layers and hooks ---- */
typedef struct lk_model_linear_hook {
    /* out[n, out_f] += delta(inp[n, in_f]) */
    lk_status (*forward)(void *ctx, float *out, const float *inp, int n);
    /* Accumulates the hook's own gradients and dinp[n, in_f] += ... for the
     * same inp given dout[n, out_f]. */
    lk_status (*backward)(void *ctx, float *dinp, const float *dout,
                          const float *inp, int n);
} lk_model_linear_hook;

size_t lk_model_linear_count(const lk_model *m);
/* Module name, e.g. "blocks.0.attn.to_q" (the weight is "<name>.weight"). */
const char *lk_model_linear_name(const lk_model *m, size_t i);
/* Index of the linear named `module` (aliases accepted), or -1. */
long lk_model_find_linear(const lk_model *m, const char *module);
/* Shapes and weights of linear i: W is [out_f, in_f], b [out_f] or NULL. */
void lk_model_linear_info(lk_model *m, size_t i, int *in_f, int *out_f,
                          float **W, float **b);
/* Attaches (hook != NULL) or detaches a hook; the hook struct is copied,
 * ctx is borrowed. */
void lk_model_set_linear_hook(lk_model *m, size_t i,
                              const lk_model_linear_hook *hook, void *ctx);

/* ---- LoRA through the training API (src/app/model_lora.c) ----
 * Registers every linear and every other parameter of m with a new
 * lk_lora_model (weights borrowed from m), calls lk_lora_enable with cfg
 * (targets, rank, alpha; seeded init identical on every rank), attaches a
 * hook to each wrapped linear (lk_lora_layer_delta_forward/backward) and
 * freezes the base (lk_model_set_train_base(m, 0)). The lk_lora_model gives
 * the adapter parameters, PEFT save/load and base loading with key aliases.
 * m must outlive the attachment; detach (or free) before freeing m. */
typedef struct lk_model_lora lk_model_lora;
lk_status lk_model_lora_attach(lk_model *m, const lk_lora_config *cfg, uint64_t seed,
                               lk_model_lora **out);
lk_lora_model *lk_model_lora_get(lk_model_lora *ml);
/* Removes the hooks, unfreezes the base and frees the LoRA state. */
void lk_model_lora_detach(lk_model *m, lk_model_lora *ml);

/* ---- a training run (src/app/train.c): what `lorakit train` does ---- */

#define LK_TRAIN_PATH_MAX 1024

/* The YAML of `lorakit train` (every key but `models` is lorakit's; unknown
 * keys are errors; relative paths are relative to the config's directory):
 *
 *   model: {d_model: 64, n_layers: 2, n_heads: 4, d_ff: 256}  # (defaults; d_ff 4*d_model) or:
 *   base: out/base/model.safetensors    # start from a checkpoint (dims from it)
 *   task: reverse                       # copy | reverse | sort | increment
 *   digits: 6
 *   steps: 600
 *   global_batch: 64                    # split evenly over the ranks
 *   lr: 0.01
 *   weight_decay: 0.0                   # optional
 *   clip: 1.0                           # optional, 0 = off
 *   schedule: cosine                    # optional: cosine (default) | constant
 *   seed: 1
 *   log_every: 50                       # optional
 *   eval_examples: 500                  # optional, 0 = skip the final evaluation
 *   output: out/reverse
 *   models:
 *     student:
 *       lora: {enable: true, rank: 8, alpha: 16, target_modules: [to_q, ff.net.2]}
 *
 * With LoRA enabled the adapter is trained on a frozen base (which then must
 * be given), else the whole model is. */
typedef struct lk_train_config {
    lk_model_config model;
    char base[LK_TRAIN_PATH_MAX];     /* "" = create from `model` and seed */
    lk_task_kind task;
    int digits;
    long steps;
    int global_batch;
    float lr, weight_decay, clip;
    int cosine;
    uint64_t seed;
    int log_every;
    int eval_examples;
    char output[LK_TRAIN_PATH_MAX];
    char source[LK_TRAIN_PATH_MAX];   /* the config file read ("" if none): an input no output may replace */
    char role[64];
    lk_lora_config lora;              /* models.<role>.lora */
    double timeout;                   /* seconds each collective may wait (lk_comm_set_timeout
                                         on the run's communicator); 0 = none; default
                                         LK_COMM_TIMEOUT_DEFAULT */
} lk_train_config;

/* Parses path; role NULL = the first role under `models` (none: no LoRA). */
lk_status lk_train_config_load(const char *path, const char *role, lk_train_config *out);
void lk_train_config_clear(lk_train_config *cfg);

typedef struct lk_train_progress {
    long step;            /* 1-based */
    long steps;
    float loss;           /* mean over the global batch */
    float grad_norm;      /* before clipping */
    double tokens_per_s;  /* global tokens (batch x positions) per second */
    double elapsed;       /* seconds since the first step began */
} lk_train_progress;

/* Called on every rank after every step (the values are the same on every
 * rank); a non-zero return stops the run with LK_ERR_STATE. */
typedef int (*lk_train_progress_fn)(void *ctx, const lk_train_progress *p);

typedef struct lk_train_result {
    long steps;
    float first_loss, final_loss;
    double seconds;
    size_t trainable;    /* trained floats */
    size_t lora_layers;  /* wrapped layers (0: full model) */
    double accuracy;     /* greedy exact-match on eval_examples held-out examples */
    int replicas_agree;  /* 1 when every rank ended with identical parameters */
    char saved[LK_TRAIN_PATH_MAX]; /* adapter directory or model file written */
} lk_train_result;

/* Runs the whole training on `world` (collective; comm_self for one
 * process): data-parallel over the ranks, gradients averaged with
 * lk_lora_sync_grads, clipping, AdamW; checks the replicas at the end; rank 0
 * writes the output (PEFT adapter in `output/`, or `output/model.safetensors`
 * for full-model training) and the AdamW state (`output/optimizer.safetensors`).
 * For the run, world's collective timeout is cfg->timeout (restored on
 * return); LK_ERR_TIMEOUT names the step (lorakit/comm.h: the group is then
 * unusable and the program should end). */
lk_status lk_train_run(const lk_train_config *cfg, lk_comm *world, lk_train_progress_fn fn,
                       void *ctx, lk_train_result *res);

#ifdef __cplusplus
}
#endif
#endif
