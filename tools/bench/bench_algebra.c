/* bench_algebra.c — `lorakit bench algebra`: merge and resize at the sizes
 * issue 30 names, each case in a child process (fork) so its peak resident
 * memory (wait4's ru_maxrss) is the operation's alone.
 *
 * Cases (one JSON line each with --json):
 *  - resize: 4 modules of 3072 x 3072, kohya BF16, rank 128 -> --rank 16;
 *  - merge: two kohya BF16 adapters of rank 32 on the same 4 modules -> --rank 32.
 * Inputs are random factors (seeded), written once to a temporary folder.
 * Reported: wall and CPU seconds (best of --repeat), peak RSS in MB, and
 * the report's rel_fro and rel_fro_opt. python/bench/bench_algebra.py runs
 * this beside the anchors (a torch re-implementation of kohya's resize and
 * PEFT's add_weighted_adapter) on the same files and prints the ratios. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench_util.h"
#include "cli_util.h"
#include "lorakit/lorakit.h"

static const char *const ALG_USAGE =
    "usage: lorakit bench algebra [--json] [--dim N] [--repeat N] [--threads N] [--dir DIR] [--keep]\n\n"
    "Times `resize` (4 modules of DIM x DIM, BF16, rank 128 -> 16) and `merge`\n"
    "(two rank-32 adapters on the same modules -> rank 32), each in a child\n"
    "process, with its peak resident memory.\n\n"
    "options:\n"
    "  --json        one JSON object per case\n"
    "  --dim N       module size (default 3072)\n"
    "  --repeat N    runs per case, the best is reported (default 3)\n"
    "  --threads N   threads (default 2)\n"
    "  --dir DIR     where the inputs go (default $TMPDIR or /tmp); --keep keeps them\n"
    "  -h, --help    this text\n";

/* A kohya BF16 adapter of 4 modules dim x dim at rank r (seeded normal-ish factors). */
static lk_status make_input(const char *path, int dim, int r, unsigned seed) {
    lk_tensor t[12];
    char names[12][64];
    uint16_t *buf[12] = {0};
    float alpha = (float)r / 2;
    uint64_t x = 0x9e3779b97f4a7c15ull * (seed + 1);
    lk_status s = LK_OK;
    for (int m = 0; m < 4; m++)
        for (int k = 0; k < 3; k++) {
            int i = 3 * m + k;
            static const char *const suf[3] = {"lora_down.weight", "lora_up.weight", "alpha"};
            snprintf(names[i], sizeof names[i], "lora_unet_blocks_%d_attn_to_q.%s", m, suf[k]);
            memset(&t[i], 0, sizeof t[i]);
            t[i].name = names[i];
            if (k == 2) {
                t[i].dtype = LK_DTYPE_F32, t[i].ndim = 0, t[i].nbytes = 4, t[i].data = &alpha;
                continue;
            }
            size_t n = (size_t)dim * (size_t)r;
            buf[i] = malloc(n * 2);
            if (!buf[i]) s = LK_ERR_NOMEM;
            for (size_t e = 0; buf[i] && e < n; e++) {
                x ^= x << 13, x ^= x >> 7, x ^= x << 17;
                float v = ((float)(x >> 40) / 16777216.0f - 0.5f) * 0.1f;
                buf[i][e] = lk_f32_to_bf16(v);
            }
            t[i].dtype = LK_DTYPE_BF16;
            t[i].ndim = 2;
            t[i].shape[0] = k ? dim : r;
            t[i].shape[1] = k ? r : dim;
            t[i].nbytes = n * 2;
            t[i].data = buf[i];
        }
    if (!s) s = lk_st_save(path, t, 12, NULL, 0);
    for (int i = 0; i < 12; i++) free(buf[i]);
    return s;
}

/* Runs one case in a child: wall, CPU seconds and peak RSS; the report's errors. */
static int run_case(int merge, const char *a, const char *b, const char *out, int threads, double *wall,
                    double *cpu, double *rss_mb, double *rel, double *opt) {
    int fd[2];
    if (pipe(fd)) return 0;
    double t0 = lk_now_s();
    pid_t pid = fork();
    if (pid == 0) {
        close(fd[0]);
        lk_algebra_opts o = {.rank = merge ? 32 : 16, .threads = threads};
        lk_algebra_input in[2] = {{a, 1.0}, {b, 1.0}};
        char *rep = NULL;
        lk_status s = merge ? lk_merge(in, 2, out, &o, &rep) : lk_resize(a, out, &o, &rep);
        if (s) _exit(1);
        json_t *j = json_loads(rep, 0, NULL);
        double v[2] = {json_real_value(json_object_get(j, "rel_fro")), json_real_value(json_object_get(j, "rel_fro_opt"))};
        if (write(fd[1], v, sizeof v) != (ssize_t)sizeof v) _exit(1);
        _exit(0);
    }
    close(fd[1]);
    int st = 0;
    struct rusage ru;
    double v[2] = {0, 0};
    ssize_t got = read(fd[0], v, sizeof v);
    close(fd[0]);
    if (pid < 0 || wait4(pid, &st, 0, &ru) < 0 || !WIFEXITED(st) || WEXITSTATUS(st) || got != (ssize_t)sizeof v)
        return 0;
    *wall = lk_now_s() - t0;
    *cpu = (double)ru.ru_utime.tv_sec + 1e-6 * (double)ru.ru_utime.tv_usec + (double)ru.ru_stime.tv_sec +
           1e-6 * (double)ru.ru_stime.tv_usec;
    *rss_mb = (double)ru.ru_maxrss / 1024.0;
    *rel = v[0], *opt = v[1];
    return 1;
}

int lk_bench_algebra(int argc, char **argv) {
    if (lk_cli_wants_help(argc, argv)) return fputs(ALG_USAGE, stdout), 0;
    int json = 0, keep = 0;
    long dim = 3072, repeat = 3, threads = 2;
    const char *dir = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int hv = i + 1 < argc;
        if (!strcmp(a, "--json")) json = 1;
        else if (!strcmp(a, "--keep")) keep = 1;
        else if (!strcmp(a, "--dim") && hv && lk_cli_parse_int(argv[++i], &dim) && dim >= 16 && dim <= 65536) continue;
        else if (!strcmp(a, "--repeat") && hv && lk_cli_parse_int(argv[++i], &repeat) && repeat >= 1 && repeat <= 100) continue;
        else if (!strcmp(a, "--threads") && hv && lk_cli_parse_int(argv[++i], &threads) && threads >= 1 && threads <= 256) continue;
        else if (!strcmp(a, "--dir") && hv) dir = argv[++i];
        else return lk_cli_usage("bench algebra", "bad option '%s'", a);
    }
    char p[4][4096];
    const char *nm[4] = {"r128", "r32a", "r32b", "out"};
    for (int i = 0; i < 4; i++) snprintf(p[i], sizeof p[i], "%s/lk-bench-algebra-%d-%s.safetensors", dir, (int)getpid(), nm[i]);
    if (make_input(p[0], (int)dim, 128, 1) || make_input(p[1], (int)dim, 32, 2) || make_input(p[2], (int)dim, 32, 3))
        return lk_cli_fail();
    int rc = 0;
    for (int merge = 0; merge < 2 && !rc; merge++) {
        double best_w = 1e30, best_c = 0, rss = 0, rel = 0, opt = 0;
        for (int r = 0; r < repeat; r++) {
            double w, c, m, e, o;
            if (!run_case(merge, merge ? p[1] : p[0], p[2], p[3], (int)threads, &w, &c, &m, &e, &o)) {
                fprintf(stderr, "lorakit: bench algebra: the %s case failed\n", merge ? "merge" : "resize");
                rc = 1;
                break;
            }
            if (w < best_w) best_w = w, best_c = c;
            if (m > rss) rss = m;
            rel = e, opt = o;
        }
        if (rc) break;
        const char *cs = merge ? "merge" : "resize";
        if (json)
            printf("{\"bench\":\"algebra\",\"case\":\"%s\",\"dim\":%ld,\"modules\":4,\"rank_in\":%d,\"rank_out\":%d,"
                   "\"threads\":%ld,\"seconds\":%.6f,\"cpu_seconds\":%.6f,\"peak_rss_mb\":%.1f,\"rel_fro\":%.9g,"
                   "\"rel_fro_opt\":%.9g,\"input\":\"%s\"}\n", cs, dim, merge ? 32 : 128, merge ? 32 : 16, threads,
                   best_w, best_c, rss, rel, opt, merge ? p[1] : p[0]);
        else
            printf("%-7s %ld^2 x 4: %.3f s (%.3f s CPU), peak RSS %.1f MB, rel_fro %.6g (optimum %.6g)\n", cs, dim,
                   best_w, best_c, rss, rel, opt);
        fflush(stdout);
    }
    for (int i = 0; i < 4; i++)
        if (!keep || i == 3) unlink(p[i]);
    return rc;
}
