/* cmd_demo.c — `lorakit demo`: the end-to-end demonstration.
 *
 *   1. pretrain a small transformer on `copy` (or reuse it from --out DIR);
 *   2. train two LoRA adapters (rank 8, attention + MLP projections),
 *      `reverse` and `sort`, data-parallel over --ranks MPI ranks;
 *   3. run a hot-swap group over the base with a plan (no adapter, reverse,
 *      sort, reverse at 0.5, reset), evaluating the model on the tracker's
 *      working weights after each step;
 *   4. print a table and check it against the expected figures.
 *
 * Each stage is a child process: `lorakit train CONFIG` and `lorakit demo
 * --swap-stage` under `mpirun -n RANKS` (run-as-root and oversubscription
 * allowed for the children, one BLAS thread per rank). The parent never
 * initialises MPI, so the demo works the same from a shell, from `make demo`
 * and from a test, and falls back to one process when mpirun is missing.
 * The configs it writes into DIR are ordinary `lorakit train` configs. */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cli.h"
#include "demo.h"
#include "core/clock.h"
#include "io/out_file.h"

static void usage(FILE *f) {
    fprintf(f,
            "usage: lorakit demo [--out DIR] [--ranks N] [--quick]\n\n"
            "The end-to-end demonstration of lorakit, on real computation:\n"
            "  1. pretrains a small transformer on the `copy` task (reused when DIR\n"
            "     already holds it),\n"
            "  2. trains two LoRA adapters (rank 8 on the attention and MLP projections),\n"
            "     `reverse` and `sort`, data-parallel over N MPI ranks,\n"
            "  3. starts an N-rank hot-swap group over the base and runs a plan: no\n"
            "     adapter, reverse 1.0, sort 1.0, reverse 0.5, reset; after each step it\n"
            "     prints the swap time, bytes broadcast, whether the ranks agree, the\n"
            "     accuracy on each task and two sample completions,\n"
            "  4. ends with a table and checks: each adapter >= 95%% on its task, the base\n"
            "     < 20%% on both, reset restores the base bit for bit.\n"
            "Tasks are digit sequences generated from a seed (`3 1 4 1 5 | 5 1 4 1 3`);\n"
            "accuracy is the fraction of answers exactly right by greedy decoding.\n\n"
            "options:\n"
            "  --out DIR   output folder (default ./lorakit-demo): configs, base model,\n"
            "              adapters (PEFT), loss.csv and loss.png per run, demo_results.txt\n"
            "  --ranks N   MPI ranks for training and the hot-swap group (default 2; 1 when\n"
            "              mpirun is not installed)\n"
            "  --quick     a smaller, faster run (used by the test suite); thresholds relaxed\n"
            "              to 80%% / 25%%\n"
            "Exit status 0 when every check passes.\n");
}

static int have_mpirun(void) { return system("command -v mpirun >/dev/null 2>&1") == 0; }

/* Runs argv (NULL-terminated) as a child, stdout/stderr inherited. */
static int run_child(char *const *argv) {
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid < 0) {
        fprintf(stderr, "lorakit: demo: fork failed: %s\n", strerror(errno));
        return -1;
    }
    if (pid == 0) {
        execvp(argv[0], argv);
        fprintf(stderr, "lorakit: demo: cannot run %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    int status;
    while (waitpid(pid, &status, 0) < 0)
        if (errno != EINTR) return -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

/* Runs `lorakit ARGS...` at `ranks` ranks (through mpirun when ranks > 1). */
static int run_lorakit(const char *exe, int ranks, const char *const *args) {
    char nbuf[16];
    char *argv[32];
    int k = 0;
    if (ranks > 1) {
        snprintf(nbuf, sizeof nbuf, "%d", ranks);
        argv[k++] = "mpirun";
        argv[k++] = "--oversubscribe";
        argv[k++] = "--bind-to";
        argv[k++] = "none";
        argv[k++] = "-n";
        argv[k++] = nbuf;
    }
    argv[k++] = (char *)exe;
    for (int i = 0; args[i] && k < 31; i++) argv[k++] = (char *)args[i];
    argv[k] = NULL;
    return run_child(argv);
}

static int write_text(const char *path, const char *text) {
    return lk_out_file_write(path, text, strlen(text)) == LK_OK ? 0 : -1;
}

static char *read_text(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) return NULL;
    char *buf = malloc(65536);
    size_t n = buf ? fread(buf, 1, 65535, f) : 0;
    fclose(f);
    if (buf) buf[n] = 0;
    return buf;
}

typedef struct demo_sizes {
    int d_model, n_layers, n_heads;
    int base_steps, steps_a, steps_b, batch;
} demo_sizes;

static const char *k_lora_block =
    "models:\n"
    "  student:\n"
    "    lora:\n"
    "      enable: true\n"
    "      rank: 8\n"
    "      alpha: 16\n"
    "      target_modules: [to_q, to_k, to_v, to_out, ff.net.0.proj, ff.net.2]\n";

static void base_yaml(char *buf, size_t cap, const demo_sizes *z, int digits, int eval) {
    snprintf(buf, cap,
             "# lorakit demo, stage 1: pretrain the base on `copy` (full model).\n"
             "# Weight decay keeps the base's attention soft enough for adapters to\n"
             "# re-target it.\n"
             "model: {d_model: %d, n_layers: %d, n_heads: %d}\n"
             "task: copy\n"
             "digits: %d\n"
             "steps: %d\n"
             "global_batch: %d\n"
             "lr: 0.003\n"
             "weight_decay: 1.0\n"
             "seed: 1\n"
             "log_every: 50\n"
             "eval_examples: %d\n"
             "output: base\n",
             z->d_model, z->n_layers, z->n_heads, digits, z->base_steps, z->batch, eval);
}

static void adapter_yaml(char *buf, size_t cap, lk_task_kind task, int steps, int batch,
                         int digits, int seed, int eval) {
    snprintf(buf, cap,
             "# lorakit demo, stage 2: a LoRA adapter for `%s` on the frozen base.\n"
             "base: base/model.safetensors\n"
             "task: %s\n"
             "digits: %d\n"
             "steps: %d\n"
             "global_batch: %d\n"
             "lr: 0.01\n"
             "clip: 1.0\n"
             "seed: %d\n"
             "log_every: 100\n"
             "eval_examples: %d\n"
             "output: %s\n%s",
             lk_task_name(task), lk_task_name(task), digits, steps, batch, seed, eval,
             lk_task_name(task), k_lora_block);
}

int lk_cmd_demo(int argc, char **argv) {
    if (lk_cli_wants_help(argc, argv)) {
        usage(stdout);
        return LK_EXIT_OK;
    }
    lk_demo_opts o;
    memset(&o, 0, sizeof o);
    const char *out = "./lorakit-demo";
    int swap_stage = 0;
    o.ranks = 2;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--out")) {
            if (++i >= argc) return lk_cli_usage("demo", "--out needs a value");
            out = argv[i];
        } else if (!strcmp(argv[i], "--ranks")) {
            long v;
            if (++i >= argc || !lk_cli_parse_int(argv[i], &v) || v < 1 || v > 64)
                return lk_cli_usage("demo", "--ranks needs a number in 1..64");
            o.ranks = (int)v;
        } else if (!strcmp(argv[i], "--quick")) {
            o.quick = 1;
        } else if (!strcmp(argv[i], "--swap-stage")) { /* internal: step 3 */
            swap_stage = 1;
        } else {
            return lk_cli_usage("demo", "unknown argument '%s'", argv[i]);
        }
    }
    demo_sizes z = {64, 2, 4, 200, 400, 800, 64};
    o.digits = 5;
    o.eval = 500;
    o.tasks[0] = LK_TASK_REVERSE;
    o.tasks[1] = LK_TASK_SORT;
    o.min_acc = 0.95;
    o.max_base = 0.20;
    if (o.quick) {
        z = (demo_sizes){32, 2, 4, 150, 200, 500, 32};
        o.eval = 100;
        o.min_acc = 0.80;
        o.max_base = 0.25;
    }
    if (mkdir(out, 0777) && errno != EEXIST) {
        fprintf(stderr, "lorakit: %s: cannot create: %s\n", out, strerror(errno));
        return LK_EXIT_FAIL;
    }
    if (!realpath(out, o.out)) {
        fprintf(stderr, "lorakit: %s: %s\n", out, strerror(errno));
        return LK_EXIT_FAIL;
    }
    if (swap_stage) return lk_demo_swap_stage(&o);

    double t0 = lk_now_s();
    char exe[PATH_MAX];
    const char *env_bin = getenv("LORAKIT_DEMO_BIN");
    if (env_bin && *env_bin) {
        snprintf(exe, sizeof exe, "%s", env_bin);
    } else {
        ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
        if (n <= 0) {
            fprintf(stderr, "lorakit: demo: cannot find the lorakit executable\n");
            return LK_EXIT_FAIL;
        }
        exe[n] = 0;
    }
    /* the children: MPI as root in containers, oversubscription, one BLAS
     * thread per rank (ranks already fill the cores) */
    setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
    setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
    setenv("OMPI_MCA_rmaps_base_oversubscribe", "1", 1);
    setenv("OPENBLAS_NUM_THREADS", "1", 1);
    setenv("OMPI_MCA_mpi_yield_when_idle", "1", 0); /* ranks may share cores */
    int built_with_mpi = 0;
#ifdef LK_HAVE_MPI
    built_with_mpi = 1;
#endif
    if (o.ranks > 1 && !built_with_mpi) {
        printf("note: this lorakit was built without MPI: running with 1 rank instead of %d\n",
               o.ranks);
        o.ranks = 1;
    } else if (o.ranks > 1 && !have_mpirun()) {
        printf("note: mpirun was not found (install openmpi-bin, see scripts/setup.sh): "
               "running with 1 rank instead of %d\n", o.ranks);
        o.ranks = 1;
    }

    /* the global batch must split evenly over the ranks */
    z.batch = (z.batch + o.ranks - 1) / o.ranks * o.ranks;
    printf("lorakit demo: output in %s, %d rank%s%s\n", o.out, o.ranks, o.ranks == 1 ? "" : "s",
           o.quick ? ", quick run" : "");
    printf("tasks: %d digits, a separator, the answer; e.g. copy `3 1 4 1 5 | 3 1 4 1 5`, "
           "reverse `... | 5 1 4 1 3`, sort `... | 1 1 3 4 5`\n", o.digits);

    char path[LK_DEMO_PATH + 64], text[4096];
    /* 1. base */
    printf("\n== 1. base model: a %d-layer transformer (d_model %d) pretrained on copy ==\n",
           z.n_layers, z.d_model);
    base_yaml(text, sizeof text, &z, o.digits, o.eval);
    snprintf(path, sizeof path, "%s/base.yaml", o.out);
    char *old = read_text(path);
    char model_path[LK_DEMO_PATH + 64];
    snprintf(model_path, sizeof model_path, "%s/base/model.safetensors", o.out);
    int reuse = old && !strcmp(old, text) && access(model_path, R_OK) == 0;
    free(old);
    int rc;
    if (reuse) {
        printf("reusing %s (trained by an earlier run with the same config)\n", model_path);
    } else {
        if (write_text(path, text)) {
            fprintf(stderr, "lorakit: %s: cannot write\n", path);
            return LK_EXIT_FAIL;
        }
        const char *args[] = {"train", path, NULL};
        if ((rc = run_lorakit(exe, o.ranks, args))) {
            fprintf(stderr, "lorakit: demo: base training failed (exit %d)\n", rc);
            remove(path); /* never reuse a half-made base */
            return LK_EXIT_FAIL;
        }
    }
    double t1 = lk_now_s();

    /* 2. adapters */
    const int steps[2] = {z.steps_a, z.steps_b};
    for (int a = 0; a < 2; a++) {
        printf("\n== 2.%d. LoRA adapter for %s: rank 8 on to_q/to_k/to_v/to_out.0/ff.net.0.proj/"
               "ff.net.2, %d rank%s ==\n", a + 1, lk_task_name(o.tasks[a]), o.ranks,
               o.ranks == 1 ? "" : "s");
        adapter_yaml(text, sizeof text, o.tasks[a], steps[a], z.batch, o.digits, 2 + a, o.eval);
        snprintf(path, sizeof path, "%s/%s.yaml", o.out, lk_task_name(o.tasks[a]));
        if (write_text(path, text)) {
            fprintf(stderr, "lorakit: %s: cannot write\n", path);
            return LK_EXIT_FAIL;
        }
        const char *args[] = {"train", path, NULL};
        if ((rc = run_lorakit(exe, o.ranks, args))) {
            fprintf(stderr, "lorakit: demo: training the %s adapter failed (exit %d)\n",
                    lk_task_name(o.tasks[a]), rc);
            return LK_EXIT_FAIL;
        }
    }
    double t2 = lk_now_s();

    /* 3 + 4. hot-swap group */
    const char *args[] = {"demo", "--swap-stage", "--out", o.out, o.quick ? "--quick" : NULL,
                          NULL};
    rc = run_lorakit(exe, o.ranks, args);
    double t3 = lk_now_s();
    printf("\ntime: base %.1fs%s, adapters %.1fs, hot-swap group %.1fs; total %.1fs\n", t1 - t0,
           reuse ? " (reused)" : "", t2 - t1, t3 - t2, t3 - t0);
    printf("files in %s: base/ (model), %s/ and %s/ (PEFT adapters), each with loss.csv, "
           "loss.png, train.json; the configs (*.yaml); fused_%s_0.5.safetensors; "
           "demo_results.txt\n", o.out, lk_task_name(o.tasks[0]), lk_task_name(o.tasks[1]),
           lk_task_name(o.tasks[0]));
    if (rc) {
        fprintf(stderr, "lorakit: demo: %s\n",
                rc == 1 ? "some checks failed (see the table above)" : "the hot-swap stage failed");
        return LK_EXIT_FAIL;
    }
    printf("all checks passed\n");
    return LK_EXIT_OK;
}
