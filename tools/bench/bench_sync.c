/* bench_sync.c — `lorakit bench sync`: the cost of LoRA training's two hot
 * spots.
 *
 *  1. Gradient sync (run under `mpirun -n 4`): the rank-16 LoRA parameters of
 *     N DiT blocks (attn.to_q/to_k/to_v/to_out.0 d x d, ff.net.0.proj d->4d,
 *     ff.net.2 4d->d: 12 parameters a block), 100 to 1,000 parameters, synced
 *     with lk_lora_sync_grads_ex bucketed (one allreduce per 4 MiB bucket)
 *     versus one allreduce per parameter (the reference's way), on a 4 x 1
 *     mesh and, at 4 ranks, a 2 x 2 mesh too. Seconds are the slowest rank's,
 *     best of --repeat runs after one warm-up (medians reported alongside);
 *     the two variants alternate within each run.
 *  2. LoRA linear overhead (rank 0 alone, the others wait without spinning):
 *     forward + backward of a 4096 x 4096 LoRA linear, r = 16, 512 tokens,
 *     versus the base sgemm alone (y = x W^T and dx = dy W); best of
 *     --repeat runs, the two variants alternating which goes first. The
 *     LoRA term is also timed alone (lk_lora_layer_delta_forward/backward,
 *     the hook path) and overhead = (base + term) / base: a few percent is
 *     below the noise of the direct ratio on a shared machine.
 *
 * MPI is initialised here only when the process was started by mpirun
 * (OMPI_COMM_WORLD_SIZE / PMIX_RANK in the environment); otherwise the bench
 * runs on one process, skips the sync cases and says how to run them. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "bench_util.h"
#include "cli_util.h"
#include "lorakit/lorakit.h"

#ifdef LK_HAVE_MPI
#include <mpi.h>
#include "lorakit/comm_mpi.h"
#endif

static const char *const SYNC_USAGE =
    "usage: mpirun -n 4 lorakit bench sync [--json] [--dim D] [--rank R] [--repeat N]\n"
    "                                      [--bucket-mb M | --bucket-kb K] [--tokens T]\n"
    "                                      [--linear-dim N]\n"
    "                                      [--no-linear] [--no-sync]\n\n"
    "Times the LoRA gradient sync of 100, 300 and 1000 rank-R parameters of\n"
    "DiT blocks of width D (default 1152, R = 16) over 4 ranks, bucketed versus\n"
    "one allreduce per parameter, then the forward+backward of an N x N LoRA\n"
    "linear (default 4096, r = R, T = 512 tokens) versus the base sgemm alone.\n"
    "Run it under `mpirun -n 4`; on one process only the linear case runs.\n\n"
    "options:\n"
    "  --json          one JSON object per case on stdout (rank 0)\n"
    "  --dim D         DiT hidden width (default 1152; the MLP is 4D)\n"
    "  --rank R        LoRA rank (default 16)\n"
    "  --repeat N      timed runs per case (default 5)\n"
    "  --bucket-mb M   bucket size of the bucketed sync (default 4, the library's)\n"
    "  --bucket-kb K   the same in KiB (for small-bucket sweeps)\n"
    "  --tokens T      tokens of the linear case (default 512)\n"
    "  --linear-dim N  in = out of the linear case (default 4096)\n"
    "  --no-linear     skip the linear case; --no-sync skips the sync cases\n"
    "  -h, --help      this text\n";

static double minimum(const double *v, int n) {
    double m = v[0];
    for (int i = 1; i < n; i++) m = v[i] < m ? v[i] : m;
    return m;
}

/* The first n_params parameters of a stack of DiT blocks. */
static lk_status make_params(int n_params, int dim, int rank, lk_lora_params **out) {
    static const char *const mods[6] = {"attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                                        "ff.net.0.proj", "ff.net.2"};
    lk_lora_param_spec *s = calloc((size_t)n_params, sizeof *s);
    char (*names)[64] = calloc((size_t)n_params, 64);
    if (!s || !names) {
        free(s);
        free(names);
        return lk_error(LK_ERR_NOMEM, "bench: out of memory");
    }
    for (int k = 0; k < n_params; k++) {
        int block = k / 12, mod = (k % 12) / 2, isB = k % 2;
        int in = mod == 5 ? 4 * dim : dim, outd = mod == 4 ? 4 * dim : dim;
        snprintf(names[k], 64, "blocks.%d.%s.lora_%c", block, mods[mod], isB ? 'B' : 'A');
        s[k].name = names[k];
        s[k].rows = isB ? outd : rank;
        s[k].cols = isB ? rank : in;
    }
    lk_status st = lk_lora_params_create(s, (size_t)n_params, out);
    free(s);
    free(names);
    return st;
}

typedef struct {
    lk_comm *world;
    int json, repeat;
} ctx;

/* Slowest rank's seconds of one sync. */
static lk_status time_sync(ctx *c, lk_lora_params *p, lk_mesh *mesh, const lk_lora_sync_opts *o,
                           double *secs, size_t *calls) {
    lk_status s = lk_comm_barrier(c->world);
    double t0 = lk_now_s();
    if (s == LK_OK) s = lk_lora_sync_grads_ex(p, mesh, o, NULL, calls);
    uint64_t ns = (uint64_t)((lk_now_s() - t0) * 1e9);
    if (s == LK_OK) s = lk_comm_allreduce_u64(c->world, &ns, 1, LK_REDUCE_MAX);
    *secs = (double)ns * 1e-9;
    return s;
}

static lk_status bench_sync_case(ctx *c, int n_params, int dim, int rank, int rep, int shard,
                                 size_t bucket_bytes) {
    lk_lora_params *p;
    lk_mesh *mesh;
    int size = lk_comm_size(c->world);
    lk_status s = make_params(n_params, dim, rank, &p);
    if (s != LK_OK) return s;
    if ((s = lk_mesh_create(c->world, rep, shard, &mesh)) != LK_OK) {
        lk_lora_params_free(p);
        return s;
    }
    float *g = lk_lora_params_grad(p);
    size_t n = lk_lora_params_numel(p);
    double *tb = calloc((size_t)c->repeat, sizeof(double)), *tp = calloc((size_t)c->repeat, sizeof(double));
    size_t calls_b = 0, calls_p = 0;
    /* Filled once: after the first sync every rank holds the same mean, which
     * later syncs keep. Refilling between runs would make the ranks reach the
     * barrier at different times and, oversubscribed, time the scheduler. */
    for (size_t i = 0; i < n; i++) g[i] = (float)((i * 2654435761u + (size_t)lk_comm_rank(c->world)) % 1000) * 1e-3f;
    for (int r = -1; r < c->repeat && s == LK_OK; r++) { /* r = -1: warm-up */
        for (int per = 0; per < 2 && s == LK_OK; per++) {
            lk_lora_sync_opts o = {.bucket_bytes = bucket_bytes, .per_param = per};
            double t;
            s = time_sync(c, p, mesh, &o, &t, per ? &calls_p : &calls_b);
            if (r >= 0) (per ? tp : tb)[r] = t;
        }
    }
    if (s == LK_OK && lk_comm_rank(c->world) == 0) {
        /* best of N (interference only adds time); medians alongside */
        double medb = lk_bench_median(tb, c->repeat), medp = lk_bench_median(tp, c->repeat);
        double mb = minimum(tb, c->repeat), mp = minimum(tp, c->repeat);
        double bytes = (double)n * sizeof(float);
        if (c->json)
            printf("{\"bench\":\"sync\",\"case\":\"grad_sync\",\"ranks\":%d,\"mesh\":\"%dx%d\",\"params\":%d,"
                   "\"floats\":%zu,\"mb\":%.2f,\"dim\":%d,\"rank\":%d,\"bucket_mb\":%.1f,"
                   "\"bucketed_s\":%.6f,\"bucketed_collectives\":%zu,\"per_param_s\":%.6f,"
                   "\"per_param_collectives\":%zu,\"speedup\":%.2f,\"bucketed_gbps\":%.3f,"
                   "\"bucketed_median_s\":%.6f,\"per_param_median_s\":%.6f,\"repeat\":%d}\n",
                   size, rep, shard, n_params, n, bytes / 1048576.0, dim, rank,
                   (double)bucket_bytes / 1048576.0, mb, calls_b, mp, calls_p, mp / mb, bytes / mb * 1e-9,
                   medb, medp, c->repeat);
        else
            printf("grad_sync  ranks %d mesh %dx%d  %4d params (%7.2f MiB): bucketed %8.2f ms (%3zu "
                   "allreduce)  per-param %8.2f ms (%4zu allreduce)  speedup %.1fx  (best of %d; medians "
                   "%.2f / %.2f ms)\n",
                   size, rep, shard, n_params, bytes / 1048576.0, mb * 1e3, calls_b, mp * 1e3, calls_p, mp / mb,
                   c->repeat, medb * 1e3, medp * 1e3);
        fflush(stdout);
    }
    free(tb);
    free(tp);
    lk_mesh_free(mesh);
    lk_lora_params_free(p);
    return s;
}

static float *rnd(size_t n, uint64_t seed, float amp) {
    float *v = malloc(n * sizeof(float));
    if (!v) return NULL;
    lk_lora_rand_uniform(v, n, seed, "bench", amp);
    return v;
}

static lk_status bench_linear(ctx *c, int dim, int r, int T) {
    size_t nW = (size_t)dim * dim, nx = (size_t)T * dim;
    float *W = rnd(nW, 1, 0.02f), *x = rnd(nx, 2, 1.0f), *dy = rnd(nx, 3, 1.0f), *A = rnd((size_t)r * dim, 4, 0.02f),
          *B = rnd((size_t)dim * r, 5, 0.02f);
    float *y = malloc(nx * sizeof(float)), *dx = calloc(nx, sizeof(float)), *h = malloc((size_t)T * r * sizeof(float)),
          *dh = malloc((size_t)T * r * sizeof(float)), *dA = calloc((size_t)r * dim, sizeof(float)),
          *dB = calloc((size_t)dim * r, sizeof(float));
    int nd = 4 * c->repeat; /* the LoRA term alone is cheap: more runs */
    double *tb = calloc((size_t)c->repeat, sizeof(double)), *tl = calloc((size_t)c->repeat, sizeof(double));
    double *td = calloc((size_t)nd, sizeof(double));
    lk_lora_model *m = NULL;
    lk_lora_layer *layer = NULL;
    lk_status s = LK_OK;
    if (!W || !x || !dy || !A || !B || !y || !dx || !h || !dh || !dA || !dB || !tb || !tl || !td)
        s = lk_error(LK_ERR_NOMEM, "bench: out of memory for the linear case");
    /* The LoRA term through a wrapped layer, as a hook-based host runs it. */
    if (s == LK_OK) s = lk_lora_model_create(&m);
    if (s == LK_OK) s = lk_lora_model_add_linear(m, "bench.to_q", dim, dim, W, NULL, &layer);
    lk_lora_config cfg = {.configured = 1, .enable = 1, .rank = r, .alpha = 2 * r};
    if (s == LK_OK) s = lk_lora_enable(m, &cfg, NULL, 0, NULL);
    if (s == LK_OK) {
        memcpy(lk_lora_layer_A(layer), A, (size_t)r * dim * sizeof(float));
        memcpy(lk_lora_layer_B(layer), B, (size_t)dim * r * sizeof(float));
    }
    for (int k = -1; k < c->repeat && s == LK_OK; k++) {
        /* base: the frozen layer's own work in LoRA training, y = x W^T and
         * dx = dy W; the two variants alternate which goes first */
        for (int pass = 0; pass < 2; pass++) {
            int lora = (pass + k) % 2 != 0;
            double t0 = lk_now_s();
            lk_lora_linear_forward(y, lora ? h : NULL, x, W, NULL, A, B, 2.0f, T, dim, dim, lora ? r : 0);
            lk_lora_linear_backward(dx, dA, dB, dh, dy, x, h, W, A, B, 2.0f, T, dim, dim, lora ? r : 0);
            if (k >= 0) (lora ? tl : tb)[k] = lk_now_s() - t0;
        }
    }
    for (int k = -1; k < nd && s == LK_OK; k++) {
        double t0 = lk_now_s();
        s = lk_lora_layer_delta_forward(layer, y, x, T);
        if (s == LK_OK) s = lk_lora_layer_delta_backward(layer, dx, dy, x, T);
        if (k >= 0) td[k] = lk_now_s() - t0;
    }
    if (s == LK_OK) {
        /* best of N: the machine may be shared, and interference only adds time */
        double b = minimum(tb, c->repeat), l = minimum(tl, c->repeat), d = minimum(td, nd);
        double flops = 2.0 * 2.0 * T * (double)dim * dim; /* base fwd + dx */
        if (c->json)
            printf("{\"bench\":\"sync\",\"case\":\"lora_linear\",\"in\":%d,\"out\":%d,\"rank\":%d,\"tokens\":%d,"
                   "\"base_fwd_bwd_s\":%.6f,\"lora_fwd_bwd_s\":%.6f,\"lora_term_fwd_bwd_s\":%.6f,"
                   "\"overhead\":%.4f,\"overhead_direct\":%.4f,\"base_gflops\":%.1f,\"repeat\":%d}\n",
                   dim, dim, r, T, b, l, d, (b + d) / b, l / b, flops / b * 1e-9, c->repeat);
        else
            printf("lora_linear %dx%d r=%d tokens=%d: base fwd+bwd %.2f ms (%.1f GFLOP/s); LoRA term alone "
                   "%.2f ms: overhead x%.4f; LoRA fwd+bwd measured directly %.2f ms (x%.3f, noisier)\n",
                   dim, dim, r, T, b * 1e3, flops / b * 1e-9, d * 1e3, (b + d) / b, l * 1e3, l / b);
        fflush(stdout);
    }
    lk_lora_model_free(m);
    free(W); free(x); free(dy); free(A); free(B); free(y); free(dx); free(h); free(dh); free(dA); free(dB);
    free(tb); free(tl); free(td);
    return s;
}

#ifdef LK_HAVE_MPI
/* Waits for rank 0 without spinning on the cores it is timing. */
static void quiet_barrier(void) {
    MPI_Request req;
    int done = 0;
    MPI_Ibarrier(MPI_COMM_WORLD, &req);
    while (!done) {
        MPI_Test(&req, &done, MPI_STATUS_IGNORE);
        if (!done) usleep(2000);
    }
}
#endif

int lk_bench_sync(int argc, char **argv) {
    if (lk_cli_wants_help(argc, argv)) {
        fputs(SYNC_USAGE, stdout);
        return LK_EXIT_OK;
    }
    ctx c = {.repeat = 5};
    long dim = 1152, rank = 16, bucket_mb = LK_KNOB_SYNC_BUCKET_MB_DEFAULT, bucket_kb = 0, tokens = 512, ldim = 4096;
    int do_linear = 1, do_sync = 1;
    for (int i = 1; i < argc; i++) {
        long *dst = NULL;
        long repeat = c.repeat;
        if (!strcmp(argv[i], "--json")) c.json = 1;
        else if (!strcmp(argv[i], "--no-linear")) do_linear = 0;
        else if (!strcmp(argv[i], "--no-sync")) do_sync = 0;
        else if (!strcmp(argv[i], "--dim")) dst = &dim;
        else if (!strcmp(argv[i], "--rank")) dst = &rank;
        else if (!strcmp(argv[i], "--bucket-mb")) dst = &bucket_mb;
        else if (!strcmp(argv[i], "--bucket-kb")) dst = &bucket_kb;
        else if (!strcmp(argv[i], "--tokens")) dst = &tokens;
        else if (!strcmp(argv[i], "--linear-dim")) dst = &ldim;
        else if (!strcmp(argv[i], "--repeat")) dst = &repeat;
        else return lk_cli_usage("bench sync", "unknown option '%s'", argv[i]);
        if (dst) {
            if (i + 1 >= argc || !lk_cli_parse_int(argv[i + 1], dst) || *dst <= 0 || *dst > 1000000)
                return lk_cli_usage("bench sync", "%s needs a positive integer", argv[i]);
            i++;
            if (dst == &repeat) c.repeat = (int)repeat;
        }
    }
    if (lk_comm_world(&argc, &argv, &c.world) != LK_OK) return lk_cli_fail();
    const int mpi = !strcmp(lk_comm_backend(c.world), "mpi");
    int R = lk_comm_rank(c.world), N = lk_comm_size(c.world);
    lk_status s = LK_OK;
    if (do_sync && N == 1 && R == 0)
        fprintf(stderr, "lorakit bench sync: the gradient-sync cases need 4 ranks: run "
                        "`mpirun -n 4 lorakit bench sync`%s; running the linear case only\n",
                        mpi ? "" : " (this lorakit was started without mpirun)");
    else if (do_sync && N != 4 && R == 0)
        fprintf(stderr, "lorakit bench sync: measuring on %d ranks; the reference figures are for "
                        "`mpirun -n 4`\n", N);
    size_t bucket_bytes = 0;
    if (lk_knob_mib_bytes(LK_KNOB_SYNC_BUCKET_MB, bucket_kb ? (double)bucket_kb / 1024.0 : (double)bucket_mb,
                          &bucket_bytes))
        return lk_cli_usage("bench sync", "%s", lk_last_error());
    if (do_sync && N > 1) {
        static const int counts[3] = {100, 300, 1000};
        for (int k = 0; k < 3 && s == LK_OK; k++)
            s = bench_sync_case(&c, counts[k], (int)dim, (int)rank, N, 1, bucket_bytes);
        if (s == LK_OK && N == 4)
            s = bench_sync_case(&c, 1000, (int)dim, (int)rank, 2, 2, bucket_bytes);
    }
    if (s == LK_OK && do_linear) {
        if (R == 0) s = bench_linear(&c, (int)ldim, (int)rank, (int)tokens);
#ifdef LK_HAVE_MPI
        if (mpi) quiet_barrier();
#endif
    }
    int rc = s == LK_OK ? LK_EXIT_OK : lk_cli_fail();
    lk_comm_free(c.world); /* finalizes MPI when lk_comm_world started it */
    return rc;
}
