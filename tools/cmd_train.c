/* cmd_train.c — `lorakit train CONFIG.yaml`: trains the small transformer
 * (LoRA adapter or full model) on a generated task, in one process or
 * data-parallel under mpirun. The work is lk_train_run (src/app/train.c);
 * this file adds the user-facing parts on rank 0: progress lines, loss.csv,
 * the loss-curve PNG and a summary. The files are written like every output
 * of lorakit (io/out_file.h): whole, through a temporary file and a rename. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "io/out_file.h"
#include "loss_plot.h"

static void usage(FILE *f) {
    fprintf(f,
            "usage: lorakit train CONFIG.yaml [--role ROLE] [--quiet] [--timeout S]\n"
            "       mpirun -n K lorakit train CONFIG.yaml     (data parallel over K ranks)\n\n"
            "Trains the small transformer of lorakit on a generated digit task (copy,\n"
            "reverse, sort, increment). With models.<role>.lora enabled it trains a LoRA\n"
            "adapter on a frozen base checkpoint and saves it in PEFT format; otherwise it\n"
            "trains the whole model and saves OUTPUT/model.safetensors; the AdamW state goes\n"
            "to OUTPUT/optimizer.safetensors.\n"
            "Under mpirun the global batch is split over the ranks, adapter gradients are\n"
            "averaged with lk_lora_sync_grads every step, and the replicas are checked for\n"
            "bit-identical parameters at the end.\n\n"
            "Rank 0 prints a progress line every log_every steps (step, loss, tokens/s,\n"
            "elapsed) and writes OUTPUT/loss.csv, OUTPUT/loss.png (gnuplot; skipped with a\n"
            "warning when it cannot be drawn) and OUTPUT/train.json.\n\n"
            "options:\n"
            "  --role ROLE   the models.<role> block to read (default: the first one)\n"
            "  --quiet       no progress lines\n"
            LK_CLI_TIMEOUT_HELP
            "                  (the gradient sync and every agreement; overrides the\n"
            "                  config's timeout)\n\n"
            "CONFIG keys: model {d_model, n_layers, n_heads, d_ff} or base PATH, task,\n"
            "digits, steps, global_batch, lr, weight_decay, clip, schedule (cosine|constant),\n"
            "seed, log_every, eval_examples, output, timeout (seconds, 0 = none),\n"
            "models.<role>.lora {enable, rank, alpha, target_modules}. See examples/*.yaml.\n",
            LK_KNOB_TIMEOUT_S_DEFAULT);
}

typedef struct {
    int rank, quiet, log_every;
    float *loss;
    long n;
} train_cli;

static int on_step(void *ctx, const lk_train_progress *p) {
    train_cli *c = ctx;
    if (c->rank != 0) return 0;
    if (c->loss && p->step - 1 < c->n) c->loss[p->step - 1] = p->loss;
    if (!c->quiet && (p->step % c->log_every == 0 || p->step == p->steps || p->step == 1)) {
        printf("step %6ld/%ld  loss %.4f  tokens/s %8.0f  elapsed %6.1fs\n", p->step, p->steps,
               p->loss, p->tokens_per_s, p->elapsed);
        fflush(stdout);
    }
    return 0;
}

/* Writes the text printed by fn(f, ctx) to path, whole or not at all.
 * Returns 0, or reports why on stderr and returns LK_EXIT_FAIL. */
static int write_output(const char *path, void (*fn)(FILE *f, const void *ctx), const void *ctx) {
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f) {
        fprintf(stderr, "lorakit: %s: cannot write: out of memory\n", path);
        return LK_EXIT_FAIL;
    }
    fn(f, ctx);
    int bad = ferror(f);
    bad |= fclose(f) != 0;
    lk_status s = bad ? lk_error(LK_ERR_NOMEM, "%s: out of memory", path) : lk_out_file_write(path, text, len);
    free(text);
    return s ? lk_cli_fail() : 0;
}

typedef struct {
    const lk_train_config *cfg;
    const lk_train_result *r;
    const float *loss;
    int ranks;
} train_out;

static void print_csv(FILE *f, const void *ctx) {
    const train_out *o = ctx;
    fprintf(f, "step,loss\n");
    for (long i = 0; i < o->r->steps; i++) fprintf(f, "%ld,%.6f\n", i + 1, o->loss[i]);
}

static void print_json(FILE *f, const void *ctx) {
    const train_out *o = ctx;
    const lk_train_config *cfg = o->cfg;
    const lk_train_result *r = o->r;
    fprintf(f,
            "{\"task\": \"%s\", \"lora\": %s, \"lora_layers\": %zu, \"trainable\": %zu, "
            "\"ranks\": %d, \"steps\": %ld, \"global_batch\": %d, \"first_loss\": %.6f, "
            "\"final_loss\": %.6f, \"accuracy\": %.6f, \"eval_examples\": %d, "
            "\"seconds\": %.3f, \"replicas_agree\": %s}\n",
            lk_task_name(cfg->task), r->lora_layers ? "true" : "false", r->lora_layers,
            r->trainable, o->ranks, r->steps, cfg->global_batch, r->first_loss, r->final_loss,
            r->accuracy, cfg->eval_examples, r->seconds, r->replicas_agree ? "true" : "false");
}

static int write_outputs(const lk_train_config *cfg, const lk_train_result *r, const float *loss,
                         int ranks, int quiet) {
    char path[LK_TRAIN_PATH_MAX + 32], png[LK_TRAIN_PATH_MAX + 32];
    train_out o = {cfg, r, loss, ranks};
    snprintf(path, sizeof path, "%s/loss.csv", cfg->output);
    if (!loss) {
        /* only the curve is lost: train.json and the summary still follow */
        fprintf(stderr, "lorakit: warning: no memory to record %ld losses: no loss.csv\n",
                r->steps);
    } else {
        if (write_output(path, print_csv, &o)) return LK_EXIT_FAIL;
        snprintf(png, sizeof png, "%s/loss.png", cfg->output);
        char title[160], why[256];
        snprintf(title, sizeof title, "lorakit train: %s, %s", lk_task_name(cfg->task),
                 r->lora_layers ? "LoRA adapter" : "full model");
        if (lk_plot_loss(path, png, title, why, sizeof why))
            fprintf(stderr, "lorakit: warning: no loss curve: %s\n", why);
    }
    snprintf(path, sizeof path, "%s/train.json", cfg->output);
    if (write_output(path, print_json, &o)) return LK_EXIT_FAIL;
    if (!quiet) {
        printf("trained %s on %s: %ld steps on %d rank%s in %.1fs, loss %.4f -> %.4f",
               r->lora_layers ? "a LoRA adapter" : "the full model", lk_task_name(cfg->task),
               r->steps, ranks, ranks == 1 ? "" : "s", r->seconds, r->first_loss, r->final_loss);
        if (cfg->eval_examples > 0)
            printf(", accuracy %.1f%% on %d held-out examples", 100.0 * r->accuracy,
                   cfg->eval_examples);
        printf("\nreplicas identical: %s; saved %s\n", r->replicas_agree ? "yes" : "NO", r->saved);
    }
    return 0;
}

int lk_cmd_train(int argc, char **argv) {
    if (lk_cli_wants_help(argc, argv)) {
        usage(stdout);
        return LK_EXIT_OK;
    }
    const char *cfgpath = NULL, *role = NULL;
    int quiet = 0;
    double timeout = -1; /* -1: the config's */
    char range[64];
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--role")) {
            if (++i >= argc) return lk_cli_usage("train", "--role needs a value");
            role = argv[i];
        } else if (!strcmp(argv[i], "--quiet")) {
            quiet = 1;
        } else if (!strcmp(argv[i], "--timeout")) {
            if (++i >= argc) return lk_cli_usage("train", "--timeout needs a value");
            if (!lk_cli_parse_timeout(argv[i], &timeout))
                return lk_cli_usage("train", "--timeout expects seconds in %s (0 = none), got '%s'",
                                    lk_knob_range(LK_KNOB_TIMEOUT_S, range, sizeof range), argv[i]);
        } else if (argv[i][0] == '-' && argv[i][1]) {
            return lk_cli_usage("train", "unknown option '%s'", argv[i]);
        } else if (!cfgpath) {
            cfgpath = argv[i];
        } else {
            return lk_cli_usage("train", "more than one config given ('%s')", argv[i]);
        }
    }
    if (!cfgpath) return lk_cli_usage("train", "missing CONFIG.yaml");

    lk_comm *world = NULL;
    if (lk_comm_world(&argc, &argv, &world)) return lk_cli_fail();
    int rank = lk_comm_rank(world), K = lk_comm_size(world);
    lk_train_config cfg;
    lk_train_result res;
    int rc = LK_EXIT_OK;
    if (lk_train_config_load(cfgpath, role, &cfg)) {
        rc = rank == 0 ? lk_cli_fail() : LK_EXIT_FAIL; /* the same on every rank */
        lk_comm_free(world);
        return rc;
    }
    if (timeout >= 0) cfg.timeout = timeout;
    train_cli c = {rank, quiet, cfg.log_every, NULL, cfg.steps};
    if (rank == 0) c.loss = calloc((size_t)cfg.steps, sizeof(float));
    if (rank == 0 && !quiet) {
        char desc[512];
        lk_lora_config_describe(&cfg.lora, desc, sizeof desc);
        printf("lorakit train: task %s (%d digits), %ld steps, global batch %d over %d rank%s, "
               "lr %g; %s%s%s\n",
               lk_task_name(cfg.task), cfg.digits, cfg.steps, cfg.global_batch, K,
               K == 1 ? "" : "s", cfg.lr, cfg.lora.enable ? desc : "full-model training",
               cfg.base[0] ? "; base " : "", cfg.base);
        fflush(stdout);
    }
    lk_status st = lk_train_run(&cfg, world, on_step, &c, &res);
    if (st == LK_ERR_TIMEOUT) {
        rc = lk_cli_timeout_abort(world);
    } else if (st) {
        /* config errors are the same on every rank: rank 0 reports them; a
         * rank's own failure is also reported by that rank */
        rc = rank == 0 || (st != LK_ERR_MISMATCH && st != LK_ERR_CONFIG) ? lk_cli_fail()
                                                                          : LK_EXIT_FAIL;
    } else if (rank == 0) {
        rc = write_outputs(&cfg, &res, c.loss, K, quiet);
    }
    free(c.loss);
    lk_train_config_clear(&cfg);
    lk_comm_free(world);
    return rc;
}
