/* bench_algebra.c — `lorakit bench algebra`: merge and resize at the sizes
 * issue 30 names, each case in a child process (fork) so its peak resident
 * memory (wait4's ru_maxrss) is the operation's alone.
 *
 * Cases (one JSON line each with --json):
 *  - resize: 4 modules of 3072 x 3072, kohya BF16, rank 128 -> --rank 16;
 *  - merge: two kohya BF16 adapters of rank 32 on the same 4 modules -> --rank 32;
 *  - extract: rank 32 from a BF16 base / tuned pair of 27 weights of 3072^2
 *    (0.47 GiB per file), the library's defaults (power 2, oversample 8).
 * Inputs are random factors (seeded), written once to a temporary folder.
 * Reported: wall and CPU seconds (best of --repeat), peak RSS in MB, and
 * the report's rel_fro and rel_fro_opt. python/bench/bench_algebra.py runs
 * this beside the anchors (a torch re-implementation of kohya's resize and
 * PEFT's add_weighted_adapter) on the same files and prints the ratios. */
#include <jansson.h>
#include <math.h>
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
    "usage: lorakit bench algebra [--json] [--case C] [--dim N] [--repeat N] [--threads N] [--dir DIR] [--keep]\n\n"
    "Times `resize` (4 modules of DIM x DIM, BF16, rank 128 -> 16), `merge`\n"
    "(two rank-32 adapters on the same modules -> rank 32) and `extract` (rank 32\n"
    "from a BF16 pair of 27 DIM x DIM weights: 0.47 GiB per file at 3072), each in\n"
    "a child process, with its peak resident memory.\n\n"
    "options:\n"
    "  --json        one JSON object per case\n"
    "  --case C      resize, merge, extract or all (default all)\n"
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

/* The extract case's pair: 27 weights "blocks.<b>.attn.to_{q,k,v}.weight" of
 * dim x dim in BF16 (0.47 GiB per file at 3072), base uniform in +-0.04,
 * tuned = bf16(base + delta) with delta a rank-16 part of decaying strength
 * (0.8^j) plus noise at 2 % of it: a fine-tune's spectrum, BF16 quantised.
 * Written tensor by tensor (lk_st_writer): never a whole model in memory. */
static lk_status make_pair(const char *pb, const char *pt, int dim, int nw) {
    const size_t n = (size_t)dim, e = n * n, r = 16;
    lk_st_writer *wb = NULL, *wt = NULL;
    uint16_t *hb = malloc(e * 2), *ht = malloc(e * 2);
    float *B = malloc(n * r * sizeof(float)), *A = malloc(r * n * sizeof(float)), *row = malloc(n * sizeof(float));
    lk_status s = hb && ht && B && A && row ? LK_OK : LK_ERR_NOMEM;
    if (!s) s = lk_st_writer_create(pb, &wb);
    if (!s) s = lk_st_writer_create(pt, &wt);
    for (int w = 0; w < nw && !s; w++) {
        char nm[96];
        int64_t sh[2] = {dim, dim};
        size_t idx;
        snprintf(nm, sizeof nm, "blocks.%d.attn.to_%c.weight", w / 3, "qkv"[w % 3]);
        s = lk_st_writer_declare(wb, nm, LK_DTYPE_BF16, 2, sh, &idx);
        if (!s) s = lk_st_writer_declare(wt, nm, LK_DTYPE_BF16, 2, sh, &idx);
    }
    if (!s) s = lk_st_writer_begin(wb);
    if (!s) s = lk_st_writer_begin(wt);
    uint64_t x = 0x2545F4914F6CDD1Dull;
#define LK_BENCH_U() (x ^= x << 13, x ^= x >> 7, x ^= x << 17, (float)(x >> 40) / 16777216.0f - 0.5f)
    for (int w = 0; w < nw && !s; w++) {
        for (size_t j = 0; j < r; j++) {
            float g = 0.002f * powf(0.8f, (float)j);
            for (size_t i = 0; i < n; i++) B[i * r + j] = g * LK_BENCH_U(), A[j * n + i] = LK_BENCH_U();
        }
        for (size_t i = 0; i < n; i++) {
            for (size_t c = 0; c < n; c++) row[c] = 4e-5f * LK_BENCH_U();
            for (size_t j = 0; j < r; j++)
                for (size_t c = 0; c < n; c++) row[c] += B[i * r + j] * A[j * n + c];
            for (size_t c = 0; c < n; c++) {
                float b = lk_bf16_to_f32(lk_f32_to_bf16(0.08f * LK_BENCH_U()));
                hb[i * n + c] = lk_f32_to_bf16(b);
                ht[i * n + c] = lk_f32_to_bf16(b + row[c]);
            }
        }
        s = lk_st_writer_write(wb, (size_t)w, 0, hb, e * 2);
        if (!s) s = lk_st_writer_write(wt, (size_t)w, 0, ht, e * 2);
    }
#undef LK_BENCH_U
    if (!s) s = lk_st_writer_commit(wb);
    if (!s) s = lk_st_writer_commit(wt);
    lk_st_writer_free(wb);
    lk_st_writer_free(wt);
    free(hb), free(ht), free(B), free(A), free(row);
    return s;
}

/* Runs one case in a child: wall, CPU seconds and peak RSS; the report's errors. */
static int run_case(int merge /* 0 resize, 1 merge, 2 extract */, const char *a, const char *b, const char *out, int threads, double *wall,
                    double *cpu, double *rss_mb, double *rel, double *opt) {
    int fd[2];
    if (pipe(fd)) return 0;
    double t0 = lk_now_s();
    pid_t pid = fork();
    if (pid == 0) {
        close(fd[0]);
        lk_algebra_opts o = {.rank = merge ? 32 : 16, .threads = threads};
        lk_algebra_input in[2] = {{a, 1.0}, {b, 1.0}};
        lk_extract_opts xo = {.alg = {.rank = 32, .threads = threads}, .power = -1};
        char *rep = NULL;
        lk_status s = merge == 2 ? lk_extract(a, b, out, &xo, &rep)
                      : merge    ? lk_merge(in, 2, out, &o, &rep)
                                 : lk_resize(a, out, &o, &rep);
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

static const char *const CASES[3] = {"resize", "merge", "extract"};

/* Runs case k (0 resize, 1 merge, 2 extract) --repeat times and prints its line. */
static int bench_case(int k, char (*p)[4096], long dim, long repeat, long threads, int json) {
    double best_w = 1e30, best_c = 0, rss = 0, rel = 0, opt = 0;
    const char *a = k == 0 ? p[0] : k == 1 ? p[1] : p[4], *b = k == 2 ? p[5] : p[2];
    for (int r = 0; r < repeat; r++) {
        double w, c, m, e, o;
        if (!run_case(k, a, b, p[3], (int)threads, &w, &c, &m, &e, &o)) {
            fprintf(stderr, "lorakit: bench algebra: the %s case failed\n", CASES[k]);
            return 1;
        }
        if (w < best_w) best_w = w, best_c = c;
        if (m > rss) rss = m;
        rel = e, opt = o;
    }
    int mods = k == 2 ? 27 : 4, rin = k == 0 ? 128 : k == 1 ? 32 : 0, rout = k == 0 ? 16 : 32;
    if (json)
        printf("{\"bench\":\"algebra\",\"case\":\"%s\",\"dim\":%ld,\"modules\":%d,\"rank_in\":%d,\"rank_out\":%d,"
               "\"threads\":%ld,\"seconds\":%.6f,\"cpu_seconds\":%.6f,\"peak_rss_mb\":%.1f,\"rel_fro\":%.9g,"
               "\"rel_fro_opt\":%.9g,\"input\":\"%s\",\"tuned\":\"%s\"}\n", CASES[k], dim, mods, rin, rout, threads,
               best_w, best_c, rss, rel, opt, a, k == 2 ? b : "");
    else
        printf("%-7s %ld^2 x %d: %.3f s (%.3f s CPU), peak RSS %.1f MB, rel_fro %.6g (optimum%s %.6g)\n", CASES[k], dim,
               mods, best_w, best_c, rss, rel, k == 2 ? ", a lower bound" : "", opt);
    fflush(stdout);
    return 0;
}

int lk_bench_algebra(int argc, char **argv) {
    if (lk_cli_wants_help(argc, argv)) return fputs(ALG_USAGE, stdout), 0;
    int json = 0, keep = 0, want[3] = {1, 1, 1};
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
        else if (!strcmp(a, "--case") && hv) {
            const char *v = argv[++i];
            int any = !strcmp(v, "all");
            for (int k = 0; k < 3; k++) want[k] = any || !strcmp(v, CASES[k]), any |= want[k];
            if (!any) return lk_cli_usage("bench algebra", "--case resize|merge|extract|all, got '%s'", v);
        } else return lk_cli_usage("bench algebra", "bad option '%s'", a);
    }
    char p[6][4096];
    const char *nm[6] = {"r128", "r32a", "r32b", "out", "base", "tuned"};
    for (int i = 0; i < 6; i++) snprintf(p[i], sizeof p[i], "%s/lk-bench-algebra-%d-%s.safetensors", dir, (int)getpid(), nm[i]);
    if ((want[0] || want[1]) &&
        (make_input(p[0], (int)dim, 128, 1) || make_input(p[1], (int)dim, 32, 2) || make_input(p[2], (int)dim, 32, 3)))
        return lk_cli_fail();
    if (want[2] && make_pair(p[4], p[5], (int)dim, 27)) return lk_cli_fail();
    int rc = 0;
    for (int k = 0; k < 3 && !rc; k++)
        if (want[k]) rc = bench_case(k, p, dim, repeat, threads, json);
    for (int i = 0; i < 6; i++)
        if (!keep || i == 3) unlink(p[i]);
    return rc;
}
