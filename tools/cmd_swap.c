/* cmd_swap.c — `lorakit swap BASE --plan PLAN.yaml`: runs a hot-swap plan
 * over a group of ranks (mpirun -n K, or alone for one rank), one result
 * line per step from rank 0 (DESIGN.md, CLI).
 *
 * Every rank reads its own plan, so ranks may be handed different plans:
 * every local step (argument parsing, plan, weights) ends in an agreement,
 * and the step loop runs to the longest plan with a rank that has no such
 * step failing it, so a disagreement is an error on that step on every rank,
 * never a rank left waiting in a collective. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"

/* a printf format: the knobs' defaults in order (bucket_mb, timeout,
 * --bucket-mb, --timeout) */
static const char *const SWAP_USAGE =
    "usage: lorakit swap BASE --plan PLAN.yaml [--json] [--bucket-mb N] [--threads N]\n"
    "                    [--allow-nonfinite] [--timeout S] [--alpha-from tensors|metadata]\n"
    "                    [--arch NAME] [--map FILE ...] [--device cpu|cuda[:N]|emul]\n"
    "                    [--backup host|device] [--convention lorakit|comfyui|lycoris|peft]\n\n"
    "Loads the safetensors checkpoint BASE into memory on every rank and\n"
    "applies each step of the plan with the hot-swap tracker: ranks own keys by\n"
    "size, owners recompute only the keys whose adapters changed and broadcast\n"
    "them through one staging buffer. Run it as `mpirun -n K lorakit swap ...`\n"
    "for K ranks, or alone for one. Each rank reads the plan path it is given.\n"
    "BASE is one checkpoint (a file, a sharded set's index, or a folder holding\n"
    "one); a diffusers pipeline folder (model_index.json) is refused: pass the\n"
    "component's folder (BASE/transformer, BASE/unet, ...).\n\n"
    "plan (YAML; adapter paths are relative to the plan's folder):\n"
    "  bucket_mb: %-12d# optional: staging buffer in MiB\n"
    "  no_lora_swap: false    # optional: fuse the first set in place, no backup\n"
    "  allow_nonfinite: false # optional: keep NaN/Inf fused results (see below)\n"
    "  fp8_rounding: nearest  # optional, FP8 weights: nearest | stochastic\n"
    "  fp8_seed: 0            # optional: stochastic rounding's seed\n"
    "  fp8_scale: rescale     # optional: rescale | keep the weights' scales\n"
    "  fp8_saturate: false    # optional: clamp instead of failing on overflow\n"
    "  timeout: %-14d# optional: seconds a collective may wait (0 = none)\n"
    "  alpha_from: tensors    # optional: tensors | metadata (see --alpha-from)\n"
    "  convention: comfyui    # optional: lorakit | comfyui | lycoris | peft (see --convention)\n"
    "  arch: flux             # optional: family table (see --arch)\n"
    "  maps: [mine.lkmap]     # optional: extra name tables (see --map)\n"
    "  steps:\n"
    "    - loras: [{path: a/, strength: 1.0}, {path: b.safetensors, strength: 0.5, format: kohya, alpha: 16}]\n"
    "    - loras: []          # reset to the base weights\n\n"
    "output: one line per step from rank 0; with --json one object per line:\n"
    "  {\"step\": 1, \"status\": \"ok\"|\"error\", \"error\": \"...\", \"keys_fused\": N,\n"
    "   \"keys_restored\": N, \"bytes_broadcast\": N, \"seconds\": X, \"digest\": \"<hex>\",\n"
    "   \"digests_agree\": true, \"skipped\": false, \"adapters_changed\": N, \"backup_bytes_max\": N,\n"
    "   \"phases\": {\"agree\": X, \"load\": X, \"fuse\": X, \"broadcast\": X}}\n"
    "keys are summed over ranks, seconds are the slowest rank's, digest is the\n"
    "content digest of the working weights (equal to `lorakit digest` of an\n"
    "offline `lorakit fuse` of the same set).\n"
    "A failed step leaves the weights as they were and the plan goes on.\n"
    "The tracker starts only when every rank loaded the same base bytes (else\n"
    "every rank fails naming the first differing tensor and which ranks hold\n"
    "which bytes). A collective that times out ends the job (see --timeout).\n\n"
    "options:\n"
    "  --plan FILE      the plan (required)\n"
    "  --json           JSON lines instead of text\n"
    "  --bucket-mb N    staging buffer in MiB (overrides the plan; default %d)\n"
    "  --threads N      fuse threads per rank (default: cores / ranks on this node)\n"
    "  --allow-nonfinite  apply a set even when fusing turns a finite weight into\n"
    "                   NaN or Inf (e.g. a NaN in an adapter); by default such a\n"
    "                   step fails and the weights stay as they were. Same as\n"
    "                   allow_nonfinite: true in the plan (either one turns it on)\n"
    LK_CLI_TIMEOUT_HELP
    "                  (overrides the plan's timeout; it also bounds how long a\n"
    "                  rank waits for the others to read the plan and the base)\n"
    LK_CLI_ALPHA_FROM_HELP
    LK_CLI_CONVENTION_HELP
    "                         (overrides the plan's convention)\n"
    "                         (overrides the plan's alpha_from)\n"
    "  --arch NAME      the model family table that maps diffusers names onto the\n"
    "                   original single-file names (flux, sd1, sdxl, ...; \"none\": no\n"
    "                   table), as `lorakit fuse --arch`; default: recognised from\n"
    "                   BASE's keys (overrides the plan's arch)\n"
    "  --map FILE       an extra name table, as `lorakit fuse --map` (repeatable;\n"
    "                   replaces the plan's maps). Adapters land where `lorakit fuse`\n"
    "                   with the same --arch/--map puts them, row slices of fused\n"
    "                   weights (Flux qkv, linear1) included; a bad table fails setup\n"

    "  --device D       where the working weights live: cpu (default), cuda (each rank\n"
    "                   its local GPU: OMPI_COMM_WORLD_LOCAL_RANK modulo the GPUs), cuda:N,\n"
    "                   or emul (the emulated device that runs every device path on\n"
    "                   the CPU). On cuda the broadcast runs over NCCL when lorakit\n"
    "                   was built with it (else through pinned host rounds over MPI);\n"
    "                   without a CUDA driver or GPU: exit 1 saying so\n"
    "  --backup P       device weights: keep the clean bytes of touched keys in host\n"
    "                   (pinned) memory (default) or on the device\n"
    "  -h, --help       this text\n\n"
    "exit codes: 0 every step succeeded, 1 a step (or setup) failed, 2 bad usage.\n";

typedef struct swap_args {
    const char *base, *plan;
    int json;
    long bucket_mb; /* 0: from the plan, else LK_KNOB_SWAP_BUCKET_MB's default */
    long threads;   /* -1: automatic */
    int allow_nonfinite;
    double timeout; /* -1: from the plan, else LK_COMM_TIMEOUT_DEFAULT */
    lk_alpha_from alpha_from; /* LK_ALPHA_AUTO: the plan's */
    int has_convention;       /* 0: the plan's */
    lk_convention convention;
    const char *arch;         /* NULL: the plan's */
    const char **maps;        /* n_maps given: they replace the plan's */
    size_t n_maps;
    lk_device device;         /* where the weights live */
    int local_gpu;            /* --device cuda: each rank's local GPU */
    int backup_device;        /* --backup device */
} swap_args;

/* Local parse; on error the message is in lk_last_error(). */
static lk_status parse_args(int argc, char **argv, swap_args *a) {
    memset(a, 0, sizeof *a);
    a->threads = -1;
    a->timeout = -1;
    if (!(a->maps = calloc((size_t)argc, sizeof *a->maps))) return lk_error(LK_ERR_NOMEM, "out of memory");
    char range[64];
    for (int i = 1; i < argc; i++) {
        const char *o = argv[i];
        if (!strcmp(o, "--json")) a->json = 1;
        else if (!strcmp(o, "--allow-nonfinite")) a->allow_nonfinite = 1;
        else if (!strcmp(o, "--plan") || !strcmp(o, "--bucket-mb") || !strcmp(o, "--threads") ||
                 !strcmp(o, "--timeout") || !strcmp(o, "--alpha-from") || !strcmp(o, "--arch") ||
                 !strcmp(o, "--map") || !strcmp(o, "--device") || !strcmp(o, "--backup") ||
                 !strcmp(o, "--convention")) {
            if (i + 1 == argc) return lk_error(LK_ERR_ARG, "%s needs a value", o);
            const char *v = argv[++i];
            if (!strcmp(o, "--plan")) a->plan = v;
            else if (!strcmp(o, "--arch")) a->arch = v;
            else if (!strcmp(o, "--map")) a->maps[a->n_maps++] = v;
            else if (!strcmp(o, "--device")) {
                if (lk_device_parse(v, &a->device)) return LK_ERR_ARG;
                a->local_gpu = !strcmp(v, "cuda");
            } else if (!strcmp(o, "--backup")) {
                if (strcmp(v, "host") && strcmp(v, "device"))
                    return lk_error(LK_ERR_ARG, "--backup expects host or device, got '%s'", v);
                a->backup_device = !strcmp(v, "device");
            }
            else if (!strcmp(o, "--alpha-from")) {
                if (lk_alpha_from_parse(v, &a->alpha_from)) return LK_ERR_ARG;
            } else if (!strcmp(o, "--convention")) {
                if (lk_convention_parse(v, &a->convention)) return LK_ERR_ARG;
                a->has_convention = 1;
            } else if (!strcmp(o, "--timeout")) {
                if (!lk_cli_parse_timeout(v, &a->timeout))
                    return lk_error(LK_ERR_ARG, "--timeout expects seconds in %s (0 = none), got '%s'",
                                    lk_knob_range(LK_KNOB_TIMEOUT_S, range, sizeof range), v);
            } else if (!strcmp(o, "--bucket-mb")) {
                if (!lk_cli_parse_int(v, &a->bucket_mb) || !lk_knob_in_range(LK_KNOB_SWAP_BUCKET_MB, (double)a->bucket_mb))
                    return lk_error(LK_ERR_ARG, "--bucket-mb expects a whole number of MiB in %s, got '%s'",
                                    lk_knob_range(LK_KNOB_SWAP_BUCKET_MB, range, sizeof range), v);
            } else if (!lk_cli_parse_int(v, &a->threads) || !lk_knob_in_range(LK_KNOB_THREADS, (double)a->threads))
                return lk_error(LK_ERR_ARG, "--threads expects %s, got '%s'", lk_knob_range(LK_KNOB_THREADS, range,
                                sizeof range), v);
        } else if (o[0] == '-' && o[1]) return lk_error(LK_ERR_ARG, "unknown option '%s'", o);
        else if (a->base) return lk_error(LK_ERR_ARG, "one BASE expected, got '%s' and '%s'", a->base, o);
        else a->base = o;
    }
    if (!a->base) return lk_error(LK_ERR_ARG, "missing BASE");
    if (!a->plan) return lk_error(LK_ERR_ARG, "missing --plan PLAN.yaml");
    return LK_OK;
}

/* Fuse threads per rank when not given: this node's cores shared by the
 * ranks on it (Open MPI tells how many), at least one. */
static int auto_threads(const lk_comm *c) {
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    const char *ls = getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
    long local = ls ? atol(ls) : lk_comm_size(c);
    if (cores < 1) cores = 1;
    if (local < 1) local = 1;
    return cores / local > 1 ? (int)(cores / local) : 1;
}

/* Prints one step's summary: the JSON line (lk_tracker_summary_json), or
 * text from the same struct. */
static void print_step(size_t step, const lk_tracker_summary *r, lk_status status, const char *error, int json) {
    if (json) {
        char *js = NULL;
        if (!lk_tracker_summary_json(r, step, status, error, &js)) printf("%s\n", js);
        lk_free(js);
    } else if (status) {
        printf("step %zu: error: %s (weights unchanged)\n", step, error);
    } else {
        printf("step %zu: ok%s: %llu keys fused, %llu restored, %.2f MiB broadcast, %.3f s, digest %s%s\n", step,
               r->skipped ? " (unchanged set, skipped)" : "", (unsigned long long)r->keys_fused,
               (unsigned long long)r->keys_restored, (double)r->bytes_broadcast / 1048576.0, r->seconds, r->digest,
               r->digests_agree ? "" : " (RANKS DISAGREE)");
    }
    fflush(stdout);
}

/* Runs every step; returns the exit code. */
static int run_steps(lk_comm *c, lk_tracker *t, lk_weights *w, const lk_plan *plan, const char *plan_path, int json) {
    uint64_t n_max = plan->n_steps;
    lk_status s0 = lk_comm_allreduce_u64(c, &n_max, 1, LK_REDUCE_MAX);
    if (s0 == LK_ERR_TIMEOUT) return lk_cli_timeout_abort(c);
    if (s0) return lk_cli_fail();
    int failed = 0, rank0 = lk_comm_rank(c) == 0;
    for (size_t i = 0; i < n_max; i++) {
        lk_tracker_stats st;
        memset(&st, 0, sizeof st);
        lk_status s = i < plan->n_steps ? LK_OK
                                        : lk_error(LK_ERR_MISMATCH, "%s has %zu steps; the other ranks' plans have more",
                                                   plan_path, plan->n_steps);
        s = lk_comm_agree(c, s);
        if (s == LK_ERR_TIMEOUT) lk_error_prefix(s, "agreeing that every rank has this step"); /* name the collective */
        if (!s) s = lk_tracker_apply(t, plan->steps[i].loras, plan->steps[i].n, &st);
        if (s == LK_ERR_TIMEOUT) {
            lk_error_prefix(s, "step %zu", i + 1);
            return lk_cli_timeout_abort(c);
        }
        char error[1024];
        snprintf(error, sizeof error, "%s", s ? lk_last_error() : "");
        lk_tracker_summary sum;
        lk_status r = s == LK_ERR_COMM ? s : lk_tracker_summarize(c, w, &st, 1, &sum);
        if (r == LK_ERR_TIMEOUT) {
            lk_error_prefix(r, "step %zu: the step's report", i + 1);
            return lk_cli_timeout_abort(c);
        }
        if (r) return lk_cli_fail(); /* the group is gone */
        if (s || !sum.digests_agree) failed = 1;
        if (rank0) print_step(i + 1, &sum, s, error, json);
        if (rank0 && s) fprintf(stderr, "lorakit: step %zu: %s\n", i + 1, error);
    }
    return failed ? LK_EXIT_FAIL : LK_EXIT_OK;
}

/* --device: the weights moved there on every rank (agreed: no driver or
 * GPU on one rank is every rank's error), and on cuda an NCCL communicator
 * over c when lorakit has NCCL and there is more than one rank (else, or
 * when NCCL cannot start, the broadcast goes through pinned host rounds
 * over c). */
static lk_status swap_to_device(lk_comm *c, swap_args *a, lk_weights *w, lk_comm **nc) {
    if (a->local_gpu) a->device.index = lk_comm_nccl_local_device(lk_device_cuda_count());
    lk_status s = lk_comm_agree(c, lk_weights_to_device(w, a->device));
    if (s == LK_ERR_TIMEOUT) return lk_error_prefix(s, "moving the base to the device");
    if (s || a->device.kind != LK_DEVICE_CUDA || lk_comm_size(c) == 1 || !lk_comm_nccl_built()) return s;
    s = lk_comm_nccl_create(c, a->device.index, nc);
    if (s == LK_ERR_TIMEOUT) return s;
    if (s) {
        if (lk_comm_rank(c) == 0)
            lk_log(LK_LOG_WARN, "swap: NCCL could not start (%s); broadcasting through host memory over %s",
                   lk_last_error(), lk_comm_backend(c));
        *nc = NULL;
        return LK_OK;
    }
    lk_comm_set_timeout(*nc, lk_comm_timeout(c));
    return LK_OK;
}

int lk_cmd_swap(int argc, char **argv) {
    if (lk_cli_wants_help(argc, argv)) {
        printf(SWAP_USAGE, LK_KNOB_SWAP_BUCKET_MB_DEFAULT, LK_KNOB_TIMEOUT_S_DEFAULT, LK_KNOB_SWAP_BUCKET_MB_DEFAULT,
               LK_KNOB_TIMEOUT_S_DEFAULT);
        return LK_EXIT_OK;
    }
    lk_comm *c = NULL;
    if (lk_comm_world(NULL, NULL, &c)) return lk_cli_fail();
    int rank0 = lk_comm_rank(c) == 0, rc = LK_EXIT_FAIL;
    swap_args a;
    lk_plan *plan = NULL;
    lk_weights *w = NULL;
    lk_tracker *t = NULL;
    lk_comm *nc = NULL; /* NCCL over c, for weights on cuda */
    lk_status s = lk_comm_agree(c, parse_args(argc, argv, &a)); /* at the default timeout: --timeout is not known yet */
    if (s == LK_ERR_TIMEOUT) {
        lk_error_prefix(s, "agreeing on the arguments");
        rc = lk_cli_timeout_abort(c);
        goto out;
    }
    if (s) {
        rc = s == LK_ERR_ARG ? LK_EXIT_USAGE : LK_EXIT_FAIL;
        if (rank0) {
            if (rc == LK_EXIT_USAGE) lk_cli_usage("swap", "%s", lk_last_error());
            else lk_cli_fail();
        }
        goto out;
    }
    /* Reading the plan and the base: the agreement after each is timed too (a rank stalled while reading
     * blocked the others forever: QA saw a 58 s silence). A rank waits that long for the slowest rank to
     * finish reading: --timeout when given (else the default) for the plan, then the plan's timeout */
    lk_comm_set_timeout(c, a.timeout >= 0 ? a.timeout : LK_COMM_TIMEOUT_DEFAULT);
    s = lk_comm_agree(c, lk_plan_load(a.plan, &plan));
    if (s == LK_ERR_TIMEOUT) lk_error_prefix(s, "reading the plan %s", a.plan);
    if (!s) {
        double to = a.timeout >= 0 ? a.timeout : plan->timeout >= 0 ? plan->timeout : LK_COMM_TIMEOUT_DEFAULT;
        s = lk_comm_set_timeout(c, to); /* checked by the parsers: cannot fail */
    }
    if (!s) {
        s = lk_comm_agree(c, lk_weights_load(a.base, &w));
        if (s == LK_ERR_TIMEOUT) lk_error_prefix(s, "reading the base %s", a.base);
    }
    if (!s && a.device.kind != LK_DEVICE_CPU) s = swap_to_device(c, &a, w, &nc);
    if (!s) {
        lk_tracker_opts o = LK_TRACKER_OPTS_DEFAULT;
        long mb = a.bucket_mb ? a.bucket_mb : plan->bucket_mb;
        if (mb) (void)lk_knob_mib_bytes(LK_KNOB_SWAP_BUCKET_MB, (double)mb, &o.bucket_bytes); /* checked by the parsers */
        o.no_lora_swap = plan->no_lora_swap;
        o.allow_nonfinite = a.allow_nonfinite || plan->allow_nonfinite;
        o.fp8 = plan->fp8;
        o.alpha_from = a.alpha_from ? a.alpha_from : plan->alpha_from;
        o.convention = a.has_convention ? a.convention : plan->convention;
        o.base_label = a.base; /* a bad FP8 scale in the base is named under the base */
        o.threads = a.threads >= 0 ? (int)a.threads : auto_threads(c);
        o.arch = a.arch ? a.arch : plan->arch;
        o.maps = a.n_maps ? a.maps : (const char *const *)plan->maps;
        o.n_maps = a.n_maps ? a.n_maps : plan->n_maps;
        o.backup = a.backup_device ? LK_TRACKER_BACKUP_DEVICE : LK_TRACKER_BACKUP_HOST;
        s = lk_tracker_create(nc ? nc : c, w, &o, &t);
    }
    if (s == LK_ERR_TIMEOUT) {
        rc = lk_cli_timeout_abort(c);
        goto out;
    }
    if (s) {
        if (rank0) lk_cli_fail();
        goto out;
    }
    rc = run_steps(nc ? nc : c, t, w, plan, a.plan, a.json);
    /* every rank here before MPI_Finalize (which cannot be timed: a rank stalled in it stops the job's end) */
    if (lk_comm_size(c) > 1 && (s = lk_comm_barrier(c)) == LK_ERR_TIMEOUT) {
        lk_error_prefix(s, "finishing (every rank done with the plan)");
        rc = lk_cli_timeout_abort(c);
    } else if (s) {
        rc = lk_cli_fail();
    }
out:
    lk_tracker_free(t);
    lk_comm_free(nc);
    lk_weights_free(w);
    lk_plan_free(plan);
    lk_comm_free(c);
    free(a.maps);
    return rc;
}
