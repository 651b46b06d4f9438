/* bench_soak.c — `lorakit bench soak`: a long run of random hot-swap
 * requests, checked against the offline fuse, watching resident memory.
 *
 * Why: servers keep a tracker alive for weeks; a leak per swap or a drift
 * between the fused weights and what an offline `lorakit fuse` gives would
 * only show after thousands of requests. Every rank runs the same seeded
 * sequence of requests (random subsets of four adapters, random strengths,
 * resets, repeats), handed to the tracker in shuffled order. Every K-th step
 * each rank digests its working weights; the digests must all agree and
 * equal the digest of an offline lk_fuse_file of the same set, computed on
 * rank 0 from the files (inputs in path order, the tracker's canonical
 * order). Resident memory (VmRSS, max over ranks) is read after setup,
 * after the first check (every adapter has been loaded and every backup
 * taken by then: the warm state) and at the end; growth is end vs warm.
 *
 * The four adapters use the four formats (PEFT folder with
 * adapter_config.json, diffusers with alpha tensors, kohya, FastVideo) and
 * F32/BF16/F16 factors, on overlapping modules of a BF16/F16/F32 DiT-like
 * model, so every loader and dtype path is exercised thousands of times.
 * Run it under mpirun (`mpirun -n 4 lorakit bench soak`); alone it is one
 * rank. Exit 1 when any apply fails or any check differs.
 *
 * Leak check (issue 7): mpirun -n 2 valgrind --leak-check=full
 *   --suppressions=/usr/share/openmpi/openmpi-valgrind.supp --log-file=vg.%p
 *   lorakit bench soak --steps 20 --check-every 5 --dim 128 --blocks 2
 * then count loss records whose stack has a lorakit frame and no Open MPI,
 * PMIx, hwloc or libevent frame (Open MPI keeps its own allocations past
 * MPI_Finalize by design). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bench_util.h"
#include "cli_util.h"
#include "lorakit/lorakit.h"

static const char *const SOAK_USAGE =
    "usage: mpirun -n RANKS lorakit bench soak [--steps N] [--check-every K] [--json]\n"
    "                 [--dim D] [--blocks B] [--rank R] [--seed S] [--bucket-mb N]\n"
    "                 [--threads N] [--dir DIR] [--keep]\n\n"
    "Soak test of the hot-swap tracker: N random requests (random subsets of four\n"
    "adapters in PEFT, diffusers, kohya and FastVideo form, random strengths,\n"
    "resets), the same on every rank. Every K-th step (and the last) every rank's\n"
    "weights digest must agree and equal an offline fuse of the same set.\n"
    "Reports resident memory (max over ranks) after setup, once warm (after the\n"
    "first check) and at the end. Exit 1 if an apply fails or a check differs.\n\n"
    "options:\n"
    "  --steps N        requests (default 1000)\n"
    "  --check-every K  check every K-th step (default 50)\n"
    "  --json           JSON lines: one per check, then a summary\n"
    "  --dim D          model width (default 512; 8 blocks of 12 d^2 elements)\n"
    "  --blocks B       transformer blocks (default 8)\n"
    "  --rank R         adapter rank (default 8)\n"
    "  --seed S         request sequence seed (default 1)\n"
    "  --bucket-mb N    tracker staging buffer, MiB (default 4)\n"
    "  --threads N      fuse threads per rank (default 1)\n"
    "  --dir DIR        where the model and adapters go (default $TMPDIR or /tmp)\n"
    "  --keep           keep those files\n"
    "  -h, --help       this text\n";

typedef struct soak_opts {
    int json, keep;
    long steps, every, dim, blocks, rank, seed, bucket_mb, threads;
    const char *dir;
} soak_opts;

static int soak_parse(int argc, char **argv, soak_opts *o) {
    *o = (soak_opts){0, 0, 1000, 50, 512, 8, 8, 1, 4, 1, NULL};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        long *dst = !strcmp(a, "--steps") ? &o->steps : !strcmp(a, "--check-every") ? &o->every
                  : !strcmp(a, "--dim") ? &o->dim : !strcmp(a, "--blocks") ? &o->blocks
                  : !strcmp(a, "--rank") ? &o->rank : !strcmp(a, "--seed") ? &o->seed
                  : !strcmp(a, "--bucket-mb") ? &o->bucket_mb : !strcmp(a, "--threads") ? &o->threads : NULL;
        if (!strcmp(a, "--json")) o->json = 1;
        else if (!strcmp(a, "--keep")) o->keep = 1;
        else if (!strcmp(a, "--dir") && i + 1 < argc) o->dir = argv[++i];
        else if (dst && i + 1 < argc) {
            if (!lk_cli_parse_int(argv[++i], dst) || *dst < (dst == &o->threads ? 0 : 1) || *dst > (1L << 24))
                return lk_cli_usage("bench soak", "%s expects a positive whole number, got '%s'", a, argv[i]);
        } else return lk_cli_usage("bench soak", "unknown or incomplete option '%s'", a);
    }
    return -1;
}

/* ---- deterministic randomness (same on every rank) ---- */

static uint64_t soak_mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t soak_next(uint64_t *s) { return soak_mix(*s += 0x9e3779b97f4a7c15ull); }

/* ---- the synthetic model and adapters ---- */

static const char *const SOAK_LIN[6] = {"attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj",
                                        "ff.net.2"};
static const lk_dtype SOAK_DT[3] = {LK_DTYPE_BF16, LK_DTYPE_F16, LK_DTYPE_F32};

/* A growing list of owned tensors to save in one file. */
typedef struct tlist {
    lk_tensor *t;
    size_t n, cap;
} tlist;

static void tl_free(tlist *l) {
    for (size_t i = 0; i < l->n; i++) {
        lk_free((void *)l->t[i].name);
        lk_free(l->t[i].data);
    }
    lk_free(l->t);
    memset(l, 0, sizeof *l);
}

/* Adds a tensor of uniform values in [-mag, mag) (ndim 0: the value mag). */
static lk_status tl_add(tlist *l, const char *name, lk_dtype dt, int ndim, int64_t d0, int64_t d1, uint64_t seed,
                        float mag) {
    if (l->n == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 64;
        lk_tensor *t = lk_realloc(l->t, cap * sizeof *t);
        if (!t) return lk_error(LK_ERR_NOMEM, "bench soak: out of memory");
        l->t = t;
        l->cap = cap;
    }
    lk_tensor *t = &l->t[l->n];
    memset(t, 0, sizeof *t);
    size_t numel = ndim == 0 ? 1 : (size_t)d0 * (size_t)(ndim == 2 ? d1 : 1);
    float *f = lk_malloc(numel * sizeof *f);
    t->name = lk_strdup(name);
    t->data = lk_malloc(numel * lk_dtype_size(dt));
    if (!f || !t->name || !t->data) {
        lk_free(f);
        lk_free((void *)t->name);
        lk_free(t->data);
        return lk_error(LK_ERR_NOMEM, "bench soak: out of memory");
    }
    for (size_t i = 0; i < numel; i++) {
        double u = (double)(soak_mix(seed + 0x9e3779b97f4a7c15ull * (i + 1)) >> 11) * (1.0 / 9007199254740992.0);
        f[i] = ndim == 0 ? mag : (float)(mag * (2.0 * u - 1.0));
    }
    lk_from_f32(t->data, f, dt, numel);
    lk_free(f);
    t->dtype = dt;
    t->ndim = ndim;
    t->shape[0] = d0;
    t->shape[1] = d1;
    t->nbytes = numel * lk_dtype_size(dt);
    l->n++;
    return LK_OK;
}

static void soak_shape(long d, int j, int64_t *out, int64_t *in) {
    *out = j == 4 ? 4 * d : d;
    *in = j == 5 ? 4 * d : d;
}

static lk_status write_model(const char *path, const soak_opts *o) {
    tlist l = {0};
    lk_status s = LK_OK;
    char name[160];
    for (long b = 0; !s && b < o->blocks; b++) {
        for (int j = 0; !s && j < 6; j++) {
            int64_t out, in;
            soak_shape(o->dim, j, &out, &in);
            snprintf(name, sizeof name, "blocks.%ld.%s.weight", b, SOAK_LIN[j]);
            s = tl_add(&l, name, SOAK_DT[(b * 6 + j) % 3], 2, out, in, (uint64_t)(b * 6 + j) * 1000003u, 0.05f);
        }
        snprintf(name, sizeof name, "blocks.%ld.norm.weight", b);
        if (!s) s = tl_add(&l, name, LK_DTYPE_F32, 1, o->dim, 0, (uint64_t)b * 31u + 7u, 1.0f);
    }
    if (!s) s = lk_st_save(path, l.t, l.n, NULL, 0);
    tl_free(&l);
    return s;
}

/* The four adapters: format, factor dtype, linears covered (bit j of
 * SOAK_LIN), blocks covered (0 all, 1 even, 2 odd). Named so that path
 * order is this order. */
static const struct {
    const char *file;
    lk_adapter_format fmt;
    lk_dtype dt;
    int lin_mask, parity;
} SOAK_AD[4] = {
    {"a_peft", LK_FORMAT_PEFT, LK_DTYPE_F32, 0x05, 0},            /* to_q, to_v */
    {"b_diffusers.safetensors", LK_FORMAT_DIFFUSERS, LK_DTYPE_BF16, 0x1a, 1}, /* to_k, to_out.0, ff.0 */
    {"c_kohya.safetensors", LK_FORMAT_KOHYA, LK_DTYPE_F16, 0x21, 0},  /* to_q, ff.2 */
    {"d_fastvideo.safetensors", LK_FORMAT_FASTVIDEO, LK_DTYPE_F32, 0x0f, 2}, /* attention */
};

static lk_status write_adapter(const char *dir, int k, const soak_opts *o) {
    tlist l = {0};
    lk_status s = LK_OK;
    char m[160], name[256], path[4400];
    const long r = o->rank;
    for (long b = 0; !s && b < o->blocks; b++) {
        if ((SOAK_AD[k].parity == 1 && b % 2) || (SOAK_AD[k].parity == 2 && !(b % 2))) continue;
        for (int j = 0; !s && j < 6; j++) {
            if (!(SOAK_AD[k].lin_mask >> j & 1)) continue;
            int64_t out, in;
            soak_shape(o->dim, j, &out, &in);
            snprintf(m, sizeof m, "blocks.%ld.%s", b, SOAK_LIN[j]);
            const char *fa, *fb, *falpha = NULL;
            char kohya[160];
            switch (SOAK_AD[k].fmt) {
            case LK_FORMAT_PEFT: fa = "base_model.model.%s.lora_A.weight"; fb = "base_model.model.%s.lora_B.weight"; break;
            case LK_FORMAT_DIFFUSERS:
                fa = "transformer.%s.lora_A.weight"; fb = "transformer.%s.lora_B.weight"; falpha = "transformer.%s.alpha";
                break;
            case LK_FORMAT_KOHYA:
                snprintf(kohya, sizeof kohya, "%s", m);
                for (char *c = kohya; *c; c++)
                    if (*c == '.') *c = '_';
                snprintf(m, sizeof m, "%s", kohya);
                fa = "lora_unet_%s.lora_down.weight"; fb = "lora_unet_%s.lora_up.weight"; falpha = "lora_unet_%s.alpha";
                break;
            default: fa = "%s.lora_A"; fb = "%s.lora_B"; break;
            }
            uint64_t seed = (uint64_t)(k + 1) * 0x100000001b3ull + (uint64_t)b * 64u + (uint64_t)j * 2u;
            snprintf(name, sizeof name, fa, m);
            s = tl_add(&l, name, SOAK_AD[k].dt, 2, r, in, seed, 0.1f);
            snprintf(name, sizeof name, fb, m);
            if (!s) s = tl_add(&l, name, SOAK_AD[k].dt, 2, out, r, seed + 1, 0.1f);
            if (!s && falpha) {
                snprintf(name, sizeof name, falpha, m);
                s = tl_add(&l, name, LK_DTYPE_F32, 0, 0, 0, 0, (float)r / (float)(k + 1));
            }
        }
    }
    if (!s && SOAK_AD[k].fmt == LK_FORMAT_PEFT) {
        snprintf(path, sizeof path, "%s/%s", dir, SOAK_AD[k].file);
        if (mkdir(path, 0755) != 0) s = lk_error(LK_ERR_IO, "bench soak: cannot create %s", path);
        snprintf(path, sizeof path, "%s/%s/adapter_config.json", dir, SOAK_AD[k].file);
        FILE *f = s ? NULL : fopen(path, "w");
        if (!s && (!f || fprintf(f, "{\"peft_type\": \"LORA\", \"r\": %ld, \"lora_alpha\": %ld, \"use_rslora\": false, "
                                    "\"bias\": \"none\", \"target_modules\": [\"to_q\", \"to_v\"]}\n",
                                 r, 2 * r) < 0))
            s = lk_error(LK_ERR_IO, "bench soak: cannot write %s", path);
        if (f && fclose(f) != 0 && !s) s = lk_error(LK_ERR_IO, "bench soak: cannot write %s", path);
        snprintf(path, sizeof path, "%s/%s/adapter_model.safetensors", dir, SOAK_AD[k].file);
    } else {
        snprintf(path, sizeof path, "%s/%s", dir, SOAK_AD[k].file);
    }
    if (!s) s = lk_st_save(path, l.t, l.n, NULL, 0);
    tl_free(&l);
    return s;
}

/* ---- the run ---- */

static long rss_kb(void) {
    long pages = 0, resident = 0;
    FILE *f = fopen("/proc/self/statm", "r");
    if (!f) return 0;
    if (fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    fclose(f);
    return resident * (sysconf(_SC_PAGESIZE) / 1024);
}

/* The digest an offline fuse of in[0..n) (path order) gives; rank 0. */
static lk_status offline_digest(const char *dir, const char *base, const lk_fuse_input *in, size_t n, long threads,
                                char hex[LK_DIGEST_HEX]) {
    char out[4400];
    snprintf(out, sizeof out, "%s/offline.safetensors", dir);
    lk_fuse_file_opts fo = {.fuse = {.threads = (int)threads}};
    lk_st *st;
    lk_status s = n ? lk_fuse_file(base, in, n, out, &fo, NULL) : LK_OK;
    if (!s) s = lk_st_open(n ? out : base, &st);
    if (!s) {
        s = lk_digest_st(st, hex);
        lk_st_close(st);
    }
    if (n) remove(out);
    return s;
}

static void rm_inputs(const char *dir) {
    char p[4400];
    for (int k = 0; k < 4; k++) {
        if (SOAK_AD[k].fmt == LK_FORMAT_PEFT) {
            snprintf(p, sizeof p, "%s/%s/adapter_model.safetensors", dir, SOAK_AD[k].file);
            remove(p);
            snprintf(p, sizeof p, "%s/%s/adapter_config.json", dir, SOAK_AD[k].file);
            remove(p);
        }
        snprintf(p, sizeof p, "%s/%s", dir, SOAK_AD[k].file);
        remove(p);
    }
    snprintf(p, sizeof p, "%s/base.safetensors", dir);
    remove(p);
    remove(dir);
}

typedef struct soak_result {
    long checks, equal, failed_applies;
    long rss_setup, rss_warm, rss_end; /* KiB, max over ranks */
    double seconds;
} soak_result;

/* One check: every rank's digest agrees and equals the offline fuse. */
static lk_status soak_check(lk_comm *c, const soak_opts *o, const char *dir, const char *base, lk_weights *w,
                            const lk_fuse_input *sorted, size_t n, long step, soak_result *res) {
    int rank = lk_comm_rank(c), ranks = lk_comm_size(c);
    char mine[LK_DIGEST_HEX], want[LK_DIGEST_HEX] = {0};
    lk_status s = lk_weights_digest(w, mine);
    char *all = lk_malloc((size_t)ranks * LK_DIGEST_HEX);
    if (!s && !all) s = lk_error(LK_ERR_NOMEM, "bench soak: out of memory");
    s = lk_comm_agree(c, s);
    if (!s) s = lk_comm_allgather(c, mine, LK_DIGEST_HEX, all);
    lk_status off = rank == 0 && !s ? offline_digest(dir, base, sorted, n, o->threads, want) : LK_OK;
    if (!s) s = lk_comm_agree(c, off);
    if (!s) s = lk_comm_bcast(c, want, sizeof want, 0);
    uint64_t rss = (uint64_t)rss_kb();
    if (!s) s = lk_comm_allreduce_u64(c, &rss, 1, LK_REDUCE_MAX);
    if (s) {
        lk_free(all);
        return s;
    }
    int agree = 1;
    for (int r = 1; r < ranks; r++) agree &= !strcmp(all, all + (size_t)r * LK_DIGEST_HEX);
    int equal = agree && !strcmp(mine, want);
    res->checks++;
    res->equal += equal;
    if (rank == 0) {
        char set[512] = "";
        size_t used = 0;
        for (size_t i = 0; i < n && used < sizeof set; i++) {
            int wr = snprintf(set + used, sizeof set - used, "%s%s:%g", i ? "," : "",
                              strrchr(sorted[i].path, '/') + 1, (double)sorted[i].strength);
            if (wr > 0) used += (size_t)wr;
        }
        if (o->json)
            printf("{\"bench\": \"soak\", \"step\": %ld, \"set\": \"%s\", \"digest\": \"%s\", \"offline\": \"%s\", "
                   "\"ranks_agree\": %s, \"equal\": %s, \"rss_kb\": %llu}\n",
                   step, set, mine, want, agree ? "true" : "false", equal ? "true" : "false",
                   (unsigned long long)rss);
        else
            printf("step %5ld  %-8s %s  set [%s]  rss %llu KiB\n", step, equal ? "equal" : "DIFFERS", mine,
                   n ? set : "reset", (unsigned long long)rss);
        fflush(stdout);
    }
    if (res->checks == 1) res->rss_warm = (long)rss;
    res->rss_end = (long)rss;
    lk_free(all);
    return LK_OK;
}

static int cmp_input_path(const void *a, const void *b) {
    return strcmp(((const lk_fuse_input *)a)->path, ((const lk_fuse_input *)b)->path);
}

static lk_status soak_run(lk_comm *c, const soak_opts *o, const char *dir, soak_result *res) {
    int rank = lk_comm_rank(c);
    char base[4400], paths[4][4400];
    snprintf(base, sizeof base, "%s/base.safetensors", dir);
    for (int k = 0; k < 4; k++) snprintf(paths[k], sizeof paths[k], "%s/%s", dir, SOAK_AD[k].file);
    lk_status s = LK_OK;
    if (rank == 0) {
        s = write_model(base, o);
        for (int k = 0; !s && k < 4; k++) s = write_adapter(dir, k, o);
    }
    s = lk_comm_agree(c, s);
    lk_weights *w = NULL;
    lk_tracker *t = NULL;
    if (!s) s = lk_comm_agree(c, lk_weights_load(base, &w));
    lk_tracker_opts to = LK_TRACKER_OPTS_DEFAULT;
    if (!s) s = lk_knob_mib_bytes(LK_KNOB_SWAP_BUCKET_MB, (double)o->bucket_mb, &to.bucket_bytes);
    to.threads = (int)o->threads;
    if (!s) s = lk_tracker_create(c, w, &to, &t);
    uint64_t rss = (uint64_t)rss_kb();
    if (!s) s = lk_comm_allreduce_u64(c, &rss, 1, LK_REDUCE_MAX);
    res->rss_setup = (long)rss;
    if (rank == 0 && !o->json && !s)
        printf("soak: %d ranks, %ld steps, model %.1f MiB (%ld blocks, d=%ld, BF16/F16/F32), 4 adapters rank %ld, "
               "check every %ld\n",
               lk_comm_size(c), o->steps, (double)lk_weights_nbytes(w) / 1048576.0, o->blocks, o->dim, o->rank,
               o->every);
    uint64_t rng = (uint64_t)o->seed * 0x2545f4914f6cdd1dull;
    lk_fuse_input req[4], sorted[4];
    size_t n = 0;
    double t0 = lk_now_s();
    for (long step = 1; !s && step <= o->steps; step++) {
        uint64_t roll = soak_next(&rng) % 20;
        if (roll == 0) {
            n = 0; /* reset */
        } else if (roll == 1 && step > 1) {
            /* the same set again, in another order: must be skipped */
        } else {
            unsigned mask = 0;
            while (!mask) mask = (unsigned)(soak_next(&rng) & 15u);
            n = 0;
            for (int k = 0; k < 4; k++) {
                if (!(mask >> k & 1)) continue;
                long q = (long)(soak_next(&rng) % 48) - 24; /* strengths in [-1.5, 1.5) by 1/16, not 0 */
                req[n++] = (lk_fuse_input){paths[k], (float)(q ? q : 4) / 16.0f, LK_FORMAT_AUTO};
            }
        }
        for (size_t i = n; i > 1; i--) { /* shuffle: order must not matter */
            size_t j = (size_t)(soak_next(&rng) % i);
            lk_fuse_input tmp = req[i - 1];
            req[i - 1] = req[j];
            req[j] = tmp;
        }
        lk_status a = lk_tracker_apply(t, req, n, NULL);
        if (a) {
            res->failed_applies++;
            if (rank == 0) fprintf(stderr, "lorakit: soak step %ld: %s\n", step, lk_last_error());
        }
        if (step % o->every == 0 || step == o->steps) {
            memcpy(sorted, req, n * sizeof *req);
            qsort(sorted, n, sizeof *sorted, cmp_input_path);
            s = soak_check(c, o, dir, base, w, sorted, n, step, res);
        }
    }
    res->seconds = lk_now_s() - t0;
    lk_tracker_free(t);
    lk_weights_free(w);
    return s;
}

int lk_bench_soak(int argc, char **argv) {
    if (lk_cli_wants_help(argc, argv)) {
        fputs(SOAK_USAGE, stdout);
        return LK_EXIT_OK;
    }
    soak_opts o;
    int prc = soak_parse(argc, argv, &o);
    if (prc >= 0) return prc;
    lk_comm *c;
    if (lk_comm_world(NULL, NULL, &c)) return lk_cli_fail();
    int rank = lk_comm_rank(c), ranks = lk_comm_size(c);
    char dir[4096] = {0};
    lk_status s = LK_OK;
    if (rank == 0) {
        const char *tmp = getenv("TMPDIR");
        const char *root = o.dir ? o.dir : tmp && *tmp ? tmp : "/tmp";
        snprintf(dir, sizeof dir, "%s/lkbench_soak.XXXXXX", root);
        if (!mkdtemp(dir)) s = lk_error(LK_ERR_IO, "bench soak: cannot create a folder under %s", root);
    }
    s = lk_comm_agree(c, s);
    if (!s) s = lk_comm_bcast(c, dir, sizeof dir, 0);
    soak_result res = {0};
    if (!s) s = soak_run(c, &o, dir, &res);
    lk_comm_barrier(c);
    if (rank == 0 && dir[0] && !o.keep) rm_inputs(dir);
    int rc = s || res.failed_applies || res.equal != res.checks ? LK_EXIT_FAIL : LK_EXIT_OK;
    if (rank == 0) {
        if (s) {
            lk_cli_fail();
        } else {
            double growth = res.rss_warm ? 100.0 * (double)(res.rss_end - res.rss_warm) / (double)res.rss_warm : 0;
            if (o.json)
                printf("{\"bench\": \"soak\", \"summary\": true, \"ranks\": %d, \"steps\": %ld, \"checks\": %ld, "
                       "\"checks_equal\": %ld, \"failed_applies\": %ld, \"rss_setup_kb\": %ld, \"rss_warm_kb\": %ld, "
                       "\"rss_end_kb\": %ld, \"rss_growth_pct\": %.3f, \"seconds\": %.2f}\n",
                       ranks, o.steps, res.checks, res.equal, res.failed_applies, res.rss_setup, res.rss_warm,
                       res.rss_end, growth, res.seconds);
            else
                printf("soak: %ld/%ld checks equal, %ld failed applies; resident memory (max over ranks) "
                       "%ld KiB after setup, %ld KiB warm, %ld KiB at the end (%+.3f%%); %.1f s\n",
                       res.equal, res.checks, res.failed_applies, res.rss_setup, res.rss_warm, res.rss_end, growth,
                       res.seconds);
        }
    }
    lk_comm_free(c);
    return rc;
}
