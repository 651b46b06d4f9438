/* train.c — one training run of the small transformer: what `lorakit train`
 * does, as a library call so that tests (including the MPI test comparing 1
 * and K ranks) run exactly the code the CLI runs.
 *
 * Data parallel in the simplest exact form: example i of step s is a pure
 * function of (seed, s * global_batch + i) (lorakit/task.h), rank r takes a
 * contiguous slice of the global batch, every rank's loss is a mean over the
 * same number of scored tokens, so averaging gradients over the ranks
 * (lk_lora_sync_grads) gives the full-batch gradient and the runs at any
 * rank count agree up to float summation order. Full-model training reuses
 * the same parameter-set machinery (sync, clip, AdamW, replica check) by
 * mirroring the model's parameters into an lk_lora_params set. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/file.h"
#include "core/clock.h"
#include "io/out_file.h"
#include "io/yaml_doc.h"
#include "lora/gemm.h"
#include "lora/config.h"
#include "lorakit/alloc.h"
#include "lorakit/log.h"
#include "lorakit/mesh.h"
#include "app/model.h"

/* ---------------------------------------------------------------- config */

static const char *const k_keys[] = {"model", "base", "task", "digits", "steps", "global_batch",
                                     "lr", "weight_decay", "clip", "schedule", "seed",
                                     "log_every", "eval_examples", "output", "timeout", "models", NULL};

static lk_status get_long(const lk_ydoc *d, const lk_ynode *n, long lo, long hi, long *out) {
    long long v = 0;
    if (!lk_ynode_int(n, lo, hi, &v)) {
        const char *s = lk_ynode_str(n);
        return lk_yerr(d, n, NULL, "expected an integer in %ld..%ld, got \"%s\"", lo, hi,
                       s ? s : "(not a scalar)");
    }
    *out = (long)v;
    return LK_OK;
}

static lk_status get_float(const lk_ydoc *d, const lk_ynode *n, double lo, double hi, float *out) {
    double v;
    if (!lk_ynode_num(n, &v) || v < lo || v > hi) {
        const char *s = lk_ynode_str(n);
        return lk_yerr(d, n, NULL, "expected a number in %g..%g, got \"%s\"", lo, hi,
                       s ? s : "(not a scalar)");
    }
    *out = (float)v;
    return LK_OK;
}

/* dst = the path relative to the config's directory (absolute paths kept). */
static lk_status get_path(const lk_ydoc *d, const char *cfgdir, const lk_ynode *n, char *dst) {
    const char *s = lk_ynode_str(n);
    if (!s || !*s) return lk_yerr(d, n, NULL, "expected a path");
    char *full = lk_path_join(cfgdir, s);
    if (!full) return lk_error(LK_ERR_NOMEM, "%s: out of memory", lk_ydoc_label(d));
    size_t len = strlen(full);
    if (len < LK_TRAIN_PATH_MAX) memcpy(dst, full, len + 1);
    lk_free(full);
    return len < LK_TRAIN_PATH_MAX ? LK_OK : lk_yerr(d, n, NULL, "path too long");
}

static lk_status parse_model(const lk_ydoc *d, const lk_ynode *n, lk_model_config *mc) {
    if (n->type != LK_Y_MAP) return lk_yerr(d, n, NULL, "expected a mapping");
    for (size_t i = 0; i < n->n; i++) {
        const lk_ynode *kn = lk_ymap_key(n, i), *v = lk_ymap_val(n, i);
        const char *k = lk_ynode_str(kn);
        int *dst = !k ? NULL
                   : !strcmp(k, "d_model")  ? &mc->d_model
                   : !strcmp(k, "n_layers") ? &mc->n_layers
                   : !strcmp(k, "n_heads")  ? &mc->n_heads
                   : !strcmp(k, "d_ff")     ? &mc->d_ff
                                            : NULL;
        if (!dst) return lk_yerr(d, kn, NULL, "unknown key (valid: d_model, n_layers, n_heads, d_ff)");
        long x = 0;
        lk_status st = get_long(d, v, 1, 1 << 16, &x);
        if (st) return st;
        *dst = (int)x;
    }
    return LK_OK;
}

/* Which of the keys the checks after the loop need were given. */
typedef struct {
    int model, task, steps, batch, lr, out;
} train_seen;

/* schedule: cosine or constant, into c->cosine. */
static lk_status get_schedule(const lk_ydoc *d, const lk_ynode *v, int *cosine) {
    const char *s = lk_ynode_str(v);
    if (s && !strcmp(s, "cosine")) *cosine = 1;
    else if (s && !strcmp(s, "constant")) *cosine = 0;
    else return lk_yerr(d, v, NULL, "expected cosine or constant, got \"%s\"", s ? s : "(not a scalar)");
    return LK_OK;
}

/* timeout: seconds within the timeout knob's range (0 = none). */
static lk_status get_timeout(const lk_ydoc *d, const lk_ynode *v, double *out) {
    double t;
    if (!lk_ynode_num(v, &t) || !lk_knob_in_range(LK_KNOB_TIMEOUT_S, t)) {
        const char *s = lk_ynode_str(v);
        char range[64];
        return lk_yerr(d, v, NULL, "expected seconds in %s (0 = none), got \"%s\"",
                       lk_knob_range(LK_KNOB_TIMEOUT_S, range, sizeof range), s ? s : "(not a scalar)");
    }
    *out = t;
    return LK_OK;
}

/* The error for an unknown top-level key kn, listing the valid ones. */
static lk_status unknown_key(const lk_ydoc *d, const lk_ynode *kn) {
    char valid[256] = "";
    for (int j = 0; k_keys[j]; j++) {
        strcat(valid, j ? ", " : "");
        strcat(valid, k_keys[j]);
    }
    return lk_yerr(d, kn, NULL, "unknown key (valid: %s)", valid);
}

/* One top-level key k (value v) into c; notes in seen what the checks after
 * the loop need. Paths are taken relative to cfgdir. */
static lk_status parse_key(const lk_ydoc *d, const char *cfgdir, const lk_ynode *kn, const char *k,
                           const lk_ynode *v, lk_train_config *c, train_seen *seen) {
    lk_status st = LK_OK;
    long x = 0;
    if (!strcmp(k, "model")) {
        st = parse_model(d, v, &c->model);
        seen->model = 1;
    } else if (!strcmp(k, "base")) {
        st = get_path(d, cfgdir, v, c->base);
    } else if (!strcmp(k, "task")) {
        st = lk_task_from_name(lk_ynode_str(v), &c->task);
        if (st) lk_error_prefix(st, "%s:%d: task", lk_ydoc_label(d), v->line);
        seen->task = 1;
    } else if (!strcmp(k, "digits")) {
        if (!(st = get_long(d, v, 1, LK_TASK_MAX_DIGITS, &x))) c->digits = (int)x;
    } else if (!strcmp(k, "steps")) {
        st = get_long(d, v, 1, 100000000L, &c->steps);
        seen->steps = 1;
    } else if (!strcmp(k, "global_batch")) {
        if (!(st = get_long(d, v, 1, 1 << 20, &x))) c->global_batch = (int)x;
        seen->batch = 1;
    } else if (!strcmp(k, "lr")) {
        st = get_float(d, v, 1e-9, 10.0, &c->lr);
        seen->lr = 1;
    } else if (!strcmp(k, "weight_decay")) {
        st = get_float(d, v, 0.0, 100.0, &c->weight_decay);
    } else if (!strcmp(k, "clip")) {
        st = get_float(d, v, 0.0, 1e6, &c->clip);
    } else if (!strcmp(k, "schedule")) {
        st = get_schedule(d, v, &c->cosine);
    } else if (!strcmp(k, "seed")) {
        if (!(st = get_long(d, v, 0, 0x7fffffffL, &x))) c->seed = (uint64_t)x;
    } else if (!strcmp(k, "log_every")) {
        if (!(st = get_long(d, v, 1, 100000000L, &x))) c->log_every = (int)x;
    } else if (!strcmp(k, "eval_examples")) {
        if (!(st = get_long(d, v, 0, 1000000L, &x))) c->eval_examples = (int)x;
    } else if (!strcmp(k, "output")) {
        st = get_path(d, cfgdir, v, c->output);
        seen->out = 1;
    } else if (!strcmp(k, "timeout")) {
        st = get_timeout(d, v, &c->timeout);
    } else if (!strcmp(k, "models")) {
        /* the lora block: lk_lora_config_from_doc */
    } else {
        st = unknown_key(d, kn);
    }
    return st;
}

/* After every key: the required ones given, model or base (not both), and
 * the model's dims completed and checked. */
static lk_status check_required(const lk_ydoc *d, const train_seen *seen, lk_train_config *c) {
    const char *path = lk_ydoc_label(d);
    const char *missing = !seen->task ? "task" : !seen->steps ? "steps" : !seen->batch ? "global_batch"
                          : !seen->lr ? "lr" : !seen->out ? "output"
                          : (!seen->model && !c->base[0]) ? "model (or base)" : NULL;
    if (missing) return lk_error(LK_ERR_CONFIG, "%s: %s is required", path, missing);
    if (seen->model && c->base[0])
        return lk_error(LK_ERR_CONFIG, "%s: give either model (dims) or base (a checkpoint), "
                        "not both", path);
    if (seen->model) {
        c->model.vocab = LK_TASK_VOCAB;
        c->model.max_seq = lk_task_train_len(c->digits);
        lk_status st = lk_model_config_check(&c->model);
        if (st) return lk_error_prefix(st, "%s", path);
    }
    return LK_OK;
}

/* The run's keys of the config (all but the lora block) into c. */
static lk_status parse_doc(const lk_ydoc *d, const char *cfgdir, lk_train_config *c) {
    const lk_ynode *root = lk_ydoc_root(d);
    if (!root || root->type != LK_Y_MAP)
        return lk_error(LK_ERR_CONFIG, "%s: expected a mapping at the top level", lk_ydoc_label(d));
    train_seen seen = {0};
    for (size_t i = 0; i < root->n; i++) {
        const lk_ynode *kn = lk_ymap_key(root, i);
        const char *k = lk_ynode_str(kn);
        if (!k) return lk_yerr(d, kn, NULL, "keys must be strings");
        lk_status st = parse_key(d, cfgdir, kn, k, lk_ymap_val(root, i), c, &seen);
        if (st) return st;
    }
    return check_required(d, &seen, c);
}

/* The whole config from its tree: the run's keys, then the lora block of
 * role (or of the first role under models when role is NULL). */
static lk_status config_from_doc(const lk_ydoc *d, const char *cfgdir, const char *role,
                                 lk_train_config *c) {
    const char *path = lk_ydoc_label(d);
    lk_status st = parse_doc(d, cfgdir, c);
    if (st) return st;
    char **roles = NULL;
    size_t nroles = 0;
    if (!role) {
        /* no models block is "LoRA not configured"; a malformed one is an error */
        st = lk_lora_config_roles_doc(d, &roles, &nroles);
        if (st == LK_OK && nroles) role = roles[0];
    }
    if (st == LK_OK && role) {
        snprintf(c->role, sizeof c->role, "%s", role);
        st = lk_lora_config_from_doc(d, role, &c->lora);
    }
    lk_lora_roles_free(roles, nroles);
    if (st) return st;
    if (c->lora.enable && !c->base[0]) {
        lk_lora_config_clear(&c->lora);
        return lk_error(LK_ERR_CONFIG, "%s: models.%s.lora is enabled but no base checkpoint is "
                        "given (base: PATH): an adapter trains on a frozen base", path, c->role);
    }
    return LK_OK;
}

lk_status lk_train_config_load(const char *path, const char *role, lk_train_config *out) {
    if (!path || !out) return lk_error(LK_ERR_ARG, "lk_train_config_load: NULL argument");
    lk_train_config c;
    memset(&c, 0, sizeof c);
    c.digits = 6;
    c.clip = 1.0f;
    c.cosine = 1;
    c.seed = 1;
    c.log_every = 50;
    c.eval_examples = 500;
    c.timeout = LK_COMM_TIMEOUT_DEFAULT;
    c.model.d_model = 64; /* model: defaults for keys not given */
    c.model.n_layers = 2;
    c.model.n_heads = 4;
    /* read once, bounded; the lora block is read from the same tree */
    char *dir = NULL;
    lk_ydoc *d = NULL;
    lk_status st = lk_path_dir(path, &dir);
    if (!st) st = lk_ydoc_load(path, &d);
    if (!st) st = config_from_doc(d, dir, role, &c);
    lk_ydoc_free(d);
    lk_free(dir);
    if (st) return st;
    if (strlen(path) < sizeof c.source) memcpy(c.source, path, strlen(path) + 1);
    *out = c;
    return LK_OK;
}

void lk_train_config_clear(lk_train_config *cfg) {
    if (cfg) lk_lora_config_clear(&cfg->lora);
}

/* ------------------------------------------------------------------- run */

static lk_status mkdir_p(const char *dir) {
    char buf[LK_TRAIN_PATH_MAX];
    size_t n = strlen(dir);
    if (n >= sizeof buf) return lk_error(LK_ERR_IO, "%s: path too long", dir);
    memcpy(buf, dir, n + 1);
    for (size_t i = 1; i <= n; i++) {
        if (buf[i] == '/' || buf[i] == 0) {
            char c = buf[i];
            buf[i] = 0;
            if (mkdir(buf, 0777) && errno != EEXIST)
                return lk_error(LK_ERR_IO, "%s: cannot create directory: %s", buf,
                                strerror(errno));
            buf[i] = c;
        }
    }
    return LK_OK;
}

/* Before any work: OUTPUT is a folder (or new), and none of the files a
 * run writes there (the last three by tools/cmd_train.c, listed here so
 * every rank learns of a refusal before training starts) is an input (the
 * base, the config) or anything but a regular file (io/out_file.h). */
static lk_status check_outputs(const lk_train_config *cfg) {
    static const char *const lora_files[] = {"adapter_model.safetensors", "adapter_config.json"};
    static const char *const full_files[] = {"model.safetensors"};
    static const char *const common[] = {"optimizer.safetensors", "loss.csv", "loss.png", "train.json"};
    struct stat sb;
    if (stat(cfg->output, &sb) == 0 && !S_ISDIR(sb.st_mode))
        return lk_error(LK_ERR_ARG, "%s: the output exists and is %s, not a folder", cfg->output,
                        lk_file_kind((unsigned)sb.st_mode));
    lk_out_inputs in = LK_OUT_INPUTS_INIT;
    lk_status s = cfg->base[0] ? lk_out_inputs_add(&in, cfg->base, "base") : LK_OK;
    if (!s && cfg->source[0]) s = lk_out_inputs_add(&in, cfg->source, "config");
    const char *const *own = cfg->lora.enable ? lora_files : full_files;
    size_t n_own = cfg->lora.enable ? 2 : 1;
    for (size_t i = 0; !s && i < n_own + 4; i++) {
        char *p = lk_path_join(cfg->output, i < n_own ? own[i] : common[i - n_own]);
        s = p ? lk_out_check(p, &in) : lk_error(LK_ERR_NOMEM, "%s: out of memory", cfg->output);
        lk_free(p);
    }
    lk_out_inputs_free(&in);
    return s;
}

/* Full-model training: mirror the model's parameters in a parameter set. */
static lk_status full_params(lk_model *m, lk_lora_params **out) {
    size_t n = lk_model_param_count(m);
    lk_lora_param_spec *specs = lk_calloc(n, sizeof *specs);
    if (!specs) return lk_error(LK_ERR_NOMEM, "train: out of memory");
    for (size_t i = 0; i < n; i++) {
        const lk_model_param *p = lk_model_param_at(m, i);
        specs[i].name = p->name;
        specs[i].rows = p->shape[0];
        specs[i].cols = p->ndim == 2 ? p->shape[1] : 1;
    }
    lk_status st = lk_lora_params_create(specs, n, out);
    lk_free(specs);
    return st;
}

/* dir 0: model -> set (data), 1: model grads -> set grads, 2: set -> model */
static void mirror(lk_model *m, lk_lora_params *p, int dir) {
    for (size_t i = 0; i < lk_model_param_count(m); i++) {
        const lk_model_param *mp = lk_model_param_at(m, i);
        long j = lk_lora_params_find(p, mp->name);
        size_t off = lk_lora_params_offset(p, (size_t)j);
        size_t nb = mp->numel * sizeof(float);
        if (dir == 0) memcpy(lk_lora_params_data(p) + off, lk_model_params(m) + mp->offset, nb);
        if (dir == 1) memcpy(lk_lora_params_grad(p) + off, lk_model_grads(m) + mp->offset, nb);
        if (dir == 2) memcpy(lk_model_params(m) + mp->offset, lk_lora_params_data(p) + off, nb);
    }
}

/* Every rank learns whether any rank failed; returns the first failure (this
 * rank's own, or LK_ERR_MISMATCH naming the rank). */
static lk_status agree(lk_comm *world, lk_status mine, const char *what) {
    uint64_t v = mine ? 1 : 0;
    lk_status s = lk_comm_allreduce_u64(world, &v, 1, LK_REDUCE_MAX);
    if (s) return lk_error_prefix(s, "agreeing after %s", what);
    if (mine) return mine;
    if (v) return lk_error(LK_ERR_MISMATCH, "%s failed on another rank", what);
    return LK_OK;
}

/* lk_train_run's state, and its steps: set up (outputs checked, model,
 * trainable parameters, mesh, optimizer, batch), the steps, the checks
 * after them (replicas, held-out accuracy), save. Each step agrees across
 * the ranks before it returns, so every rank takes the same path. */
typedef struct train_run {
    const lk_train_config *cfg;
    lk_comm *world;
    int rank, K, Bl, T;
    lk_model *m;
    lk_model_lora *ml;
    lk_lora_params *p, *own;
    lk_mesh *mesh;
    lk_adamw *opt;
    int *in, *tg;
    long at; /* the step in progress (0: setting up, -1: after the steps), for a timeout's report */
} train_run;

static lk_status run_setup(train_run *t, lk_train_result *r) {
    const lk_train_config *cfg = t->cfg;
    /* rank 0 writes the outputs: refused ones are known before any work */
    lk_status st = t->rank == 0 ? check_outputs(cfg) : LK_OK;
    if ((st = agree(t->world, st, "checking the outputs"))) return st;

    /* model: from the base checkpoint or fresh from the seed */
    if (cfg->base[0]) st = lk_model_load(cfg->base, &t->m);
    else st = lk_model_create(&cfg->model, cfg->seed, &t->m);
    if (!st) {
        const lk_model_config *mc = lk_model_get_config(t->m);
        if (mc->vocab < LK_TASK_VOCAB || mc->max_seq < t->T)
            st = lk_error(LK_ERR_CONFIG, "%s: the model has vocab %d and max_seq %d; the task "
                          "needs %d and %d", cfg->base, mc->vocab, mc->max_seq, LK_TASK_VOCAB, t->T);
    }
    if ((st = agree(t->world, st, "loading the model"))) return st;
    if (cfg->lora.enable) {
        st = lk_model_lora_attach(t->m, &cfg->lora, cfg->seed, &t->ml);
        if (!st) {
            t->p = lk_lora_model_params(lk_model_lora_get(t->ml));
            st = lk_lora_finalize(lk_model_lora_get(t->ml), &r->lora_layers);
        }
    } else {
        st = full_params(t->m, &t->own);
        if (!st) {
            t->p = t->own;
            mirror(t->m, t->p, 0);
        }
    }
    if (!st) st = lk_mesh_create(t->world, t->K, 1, &t->mesh);
    if (!st) {
        lk_adamw_opts o = {.lr = cfg->lr, .weight_decay = cfg->weight_decay};
        st = lk_adamw_create(t->p, &o, &t->opt);
    }
    if (!st) {
        t->in = lk_malloc((size_t)t->Bl * t->T * sizeof(int));
        t->tg = lk_malloc((size_t)t->Bl * t->T * sizeof(int));
        if (!t->in || !t->tg) st = lk_error(LK_ERR_NOMEM, "train: out of memory for the batch");
    }
    if ((st = agree(t->world, st, "setting up training"))) return st;
    r->trainable = lk_lora_params_numel(t->p);
    return LK_OK;
}

static lk_status run_steps(train_run *t, lk_train_progress_fn fn, void *ctx, lk_train_result *r) {
    const lk_train_config *cfg = t->cfg;
    lk_status st;
    double t0 = lk_now_s();
    for (long s = 0; s < cfg->steps; s++) {
        t->at = s + 1;
        float lr = cfg->lr;
        if (cfg->cosine && cfg->steps > 1)
            lr = cfg->lr * (0.1f + 0.9f * 0.5f * (1.0f + cosf(3.14159265f * (float)s /
                                                               (float)(cfg->steps - 1))));
        lk_adamw_set_lr(t->opt, lr);
        uint64_t first = (uint64_t)s * (uint64_t)cfg->global_batch + (uint64_t)t->rank * t->Bl;
        float loss = 0.0f, norm = 0.0f;
        st = lk_task_batch(cfg->task, cfg->digits, cfg->seed, first, t->Bl, t->in, t->tg);
        if (!st) st = lk_model_forward(t->m, t->in, t->tg, t->Bl, t->T, &loss);
        if (!st) {
            if (t->ml) lk_lora_params_zero_grad(t->p);
            else lk_model_zero_grad(t->m);
            st = lk_model_backward(t->m);
        }
        if (!st && !t->ml) mirror(t->m, t->p, 1);
        if ((st = agree(t->world, st, "the forward/backward pass"))) return st;
        /* every rank, every step: the collective count never depends on data */
        if ((st = lk_lora_sync_grads(t->p, t->mesh, NULL))) return st;
        st = lk_lora_clip_grad_norm(t->p, cfg->clip, &norm);
        if (!st) st = lk_adamw_step(t->opt, t->p);
        if ((st = agree(t->world, st, "the optimizer step"))) return st;
        if (!t->ml) mirror(t->m, t->p, 2);
        if ((st = lk_comm_allreduce_f32_sum(t->world, &loss, 1))) return st;
        loss /= (float)t->K;
        if (s == 0) r->first_loss = loss;
        r->final_loss = loss;
        r->steps = s + 1;
        lk_train_progress pr = {.step = s + 1, .steps = cfg->steps, .loss = loss,
                                .grad_norm = norm};
        pr.elapsed = lk_now_s() - t0;
        pr.tokens_per_s = pr.elapsed > 0 ? (double)(s + 1) * cfg->global_batch * t->T / pr.elapsed
                                         : 0.0;
        if (fn && fn(ctx, &pr)) return lk_error(LK_ERR_STATE, "training stopped at step %ld", s + 1);
    }
    r->seconds = lk_now_s() - t0;
    t->at = -1;
    return LK_OK;
}

static lk_status run_verify(train_run *t, lk_train_result *r) {
    const lk_train_config *cfg = t->cfg;
    /* the replicas must be bit-identical: same data order, same averaged
     * gradients, same optimizer arithmetic */
    size_t drifted = 0;
    lk_status st = lk_lora_check_replicas(t->p, t->mesh, &drifted);
    if (st && st != LK_ERR_MISMATCH) return st;
    r->replicas_agree = st == LK_OK;
    if (st) return st;

    /* held-out accuracy, sharded over the ranks */
    if (cfg->eval_examples > 0) {
        int per = (cfg->eval_examples + t->K - 1) / t->K;
        int lo = t->rank * per, hi = lo + per > cfg->eval_examples ? cfg->eval_examples : lo + per;
        lk_task_eval ev = {0, 0, 0.0};
        if (hi > lo)
            st = lk_task_evaluate(t->m, cfg->task, cfg->digits, cfg->seed + 1000003u, (uint64_t)lo,
                                  hi - lo, 250, &ev, NULL);
        if ((st = agree(t->world, st, "evaluation"))) return st;
        uint64_t c = (uint64_t)ev.correct;
        if ((st = lk_comm_allreduce_u64(t->world, &c, 1, LK_REDUCE_SUM))) return st;
        r->accuracy = (double)c / cfg->eval_examples;
    }
    return LK_OK;
}

/* rank 0 writes; everyone learns whether it worked */
static lk_status run_save(train_run *t, lk_train_result *r) {
    const lk_train_config *cfg = t->cfg;
    lk_status st = LK_OK;
    if (t->rank == 0) {
        st = mkdir_p(cfg->output);
        if (!st && t->ml) {
            st = lk_lora_save_peft(lk_model_lora_get(t->ml), cfg->output);
            snprintf(r->saved, sizeof r->saved, "%s", cfg->output);
        } else if (!st) {
            int w = snprintf(r->saved, sizeof r->saved, "%s/model.safetensors", cfg->output);
            st = w >= (int)sizeof r->saved ? lk_error(LK_ERR_IO, "%s: path too long", cfg->output)
                                           : lk_model_save(t->m, r->saved);
        }
        /* the optimizer state, for resuming: OUTPUT/optimizer.safetensors */
        if (!st) st = lk_adamw_save(t->opt, t->p, cfg->output);
    }
    return agree(t->world, st, "saving on rank 0");
}

lk_status lk_train_run(const lk_train_config *cfg, lk_comm *world, lk_train_progress_fn fn,
                       void *ctx, lk_train_result *res) {
    if (!cfg || !world) return lk_error(LK_ERR_ARG, "lk_train_run: NULL argument");
    int K = lk_comm_size(world);
    if (cfg->global_batch % K)
        return lk_error(LK_ERR_CONFIG, "global_batch %d does not split evenly over %d ranks",
                        cfg->global_batch, K);
    lk_train_result r;
    memset(&r, 0, sizeof r);
    train_run t = {.cfg = cfg, .world = world, .rank = lk_comm_rank(world), .K = K,
                   .Bl = cfg->global_batch / K, .T = lk_task_train_len(cfg->digits)};
    lk_status st;
    const double timeout_was = lk_comm_timeout(world);
    if ((st = lk_comm_set_timeout(world, cfg->timeout))) return lk_error_prefix(st, "train: timeout");

    /* OpenBLAS first: an address-space limit too low for it is an error here, on every rank */
    if ((st = agree(world, lk_gemm_prepare(), "loading OpenBLAS"))) return st;

    st = run_setup(&t, &r);
    if (!st) st = run_steps(&t, fn, ctx, &r);
    if (!st) st = run_verify(&t, &r);
    if (!st) st = run_save(&t, &r);

    if (st == LK_ERR_TIMEOUT) {
        if (t.at > 0) lk_error_prefix(st, "train step %ld", t.at);
        else lk_error_prefix(st, "train (%s)", t.at ? "after the steps" : "setting up");
    }
    lk_comm_set_timeout(world, timeout_was);
    if (res) *res = r;
    lk_free(t.in);
    lk_free(t.tg);
    lk_adamw_free(t.opt);
    lk_mesh_free(t.mesh);
    lk_lora_params_free(t.own);
    lk_model_lora_detach(t.m, t.ml);
    lk_model_free(t.m);
    return st;
}
