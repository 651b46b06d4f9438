/* bench_swap.c — `lorakit bench swap`: the delta-aware hot-swap tracker
 * against the reference's behaviour (`full` mode: every owned key cloned up
 * front, restored on every change, every key re-broadcast; the benchmark's
 * own baseline, bench_full.c, checked to leave the same bytes) and against
 * reloading the checkpoint from disk.
 *
 * Model: DiT blocks in BF16 (attn1.to_q/to_k/to_v/to_out.0 at d x d,
 * ff.net.0.proj 4d x d, ff.net.2 d x 4d: attention is a third of the bytes),
 * enough blocks for --size-mb. Two adapters on the attention projections
 * only. Ops, each timed as the slowest rank's tracker call (median of
 * --repeat runs): apply (A from clean), strength (A at 0.5), swap (B), reset.
 * Next to each op, in the same run: a bare broadcast of exactly the bytes
 * that op broadcast, in rounds of the same bucket size, each rank the root
 * of its share (as owners are), buffer to buffer with nothing else: the
 * summary's swap_over_bare_bcast says how close the swap gets to it.
 * The summary says how the delta mode overlapped the fuse with the
 * broadcast (lk_tracker_overlaps); --compare also times it serial and with
 * the fuse worker thread forced (LK_TRACKER_SERIAL / _OVERLAP) in the same
 * run: serial_over_bare_bcast, overlap_over_bare_bcast.
 * It relaunches itself under `mpirun -n RANKS` when started alone. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli_util.h"
#include "lorakit/lorakit.h"
#include "bench_full.h"
#include "bench_util.h"
#include "serve/tracker.h"

static const char *const SWAP_BENCH_USAGE =
    "usage: lorakit bench swap [--json] [--ranks K] [--size-mb N] [--dim D] [--rank R]\n"
    "                          [--bucket-mb N] [--repeat N] [--threads N] [--compare] [--dir DIR]\n"
    "                          [--device cpu|cuda[:N]|emul]\n\n"
    "Times the hot-swap tracker in its delta-aware mode and in the reference's\n"
    "`full` mode (restore every owned key, re-broadcast every key) on a synthetic\n"
    "BF16 DiT model of at least N MiB with adapters on the attention projections\n"
    "(a third of the bytes): apply, change strength, swap to a second adapter,\n"
    "reset; the tracker's creation (op create: it checks that every rank holds\n"
    "the same base bytes); plus reloading the checkpoint from disk. Started\n"
    "alone, it relaunches itself as `mpirun --oversubscribe -n K`; under mpirun\n"
    "it uses the ranks it has.\n\n"
    "options:\n"
    "  --json          one JSON object per result line\n"
    "  --ranks K       ranks to relaunch with (default 4)\n"
    "  --size-mb N     model size, MiB (default 512)\n"
    "  --dim D         model width (default 1024)\n"
    "  --rank R        adapter rank (default 16)\n"
    "  --bucket-mb N   staging buffer, MiB (default 64)\n"
    "  --repeat N      runs per op, the median is reported (default 3)\n"
    "  --threads N     fuse threads per rank (default 1)\n"
    "  --compare       also time the delta mode with no fuse/broadcast overlap and\n"
    "                  with a fuse worker thread forced (modes delta_serial,\n"
    "                  delta_overlap; summary serial_over_bare_bcast,\n"
    "                  overlap_over_bare_bcast)\n"
    "  --dir DIR       where the temporary files go (default $TMPDIR or /tmp)\n"
    "  --device D      the working weights on D (cuda: each rank its local GPU,\n"
    "                  over NCCL when built with it; emul: the emulated device);\n"
    "                  the host-memory `full` mode is not run there\n"
    "  -h, --help      this text\n";

typedef struct bopts {
    int json, compare;
    long ranks, size_mb, dim, rank, bucket_mb, repeat, threads;
    const char *dir;
    lk_device device;
    int local_gpu; /* --device cuda: each rank's local GPU */
    uint64_t touched; /* bytes of the keys the adapters touch (set once the model is loaded) */
} bopts;

static int parse(int argc, char **argv, bopts *o) {
    *o = (bopts){0, 0, 4, 512, 1024, 16, 64, 3, 1, NULL, {LK_DEVICE_CPU, 0}, 0, 0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        long *dst = !strcmp(a, "--ranks") ? &o->ranks : !strcmp(a, "--size-mb") ? &o->size_mb
                  : !strcmp(a, "--dim") ? &o->dim : !strcmp(a, "--rank") ? &o->rank
                  : !strcmp(a, "--bucket-mb") ? &o->bucket_mb : !strcmp(a, "--repeat") ? &o->repeat
                  : !strcmp(a, "--threads") ? &o->threads : NULL;
        if (!strcmp(a, "--json")) o->json = 1;
        else if (!strcmp(a, "--compare")) o->compare = 1;
        else if (!strcmp(a, "--dir") && i + 1 < argc) o->dir = argv[++i];
        else if (!strcmp(a, "--device") && i + 1 < argc) {
            if (lk_device_parse(argv[++i], &o->device)) return lk_cli_usage("bench swap", "%s", lk_last_error());
            o->local_gpu = !strcmp(argv[i], "cuda");
        }
        else if (dst && i + 1 < argc) {
            if (!lk_cli_parse_int(argv[++i], dst) || *dst < (dst == &o->threads ? 0 : 1) || *dst > (1L << 20))
                return lk_cli_usage("bench swap", "%s expects a positive whole number, got '%s'", a, argv[i]);
        } else return lk_cli_usage("bench swap", "unknown or incomplete option '%s'", a);
    }
    if (o->dim % 8) return lk_cli_usage("bench swap", "--dim must be a multiple of 8");
    return -1;
}

/* ---- the synthetic model and adapters ---- */

static const char *const LIN[6] = {"attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "ff.net.0.proj",
                                   "ff.net.2"};

static void lin_shape(long d, int j, int64_t *out, int64_t *in) {
    *out = j == 4 ? 4 * d : d;
    *in = j == 5 ? 4 * d : d;
}

/* Uniform BF16 values in [-mag, mag) from a counter-based generator. */
static void fill_bf16(uint16_t *dst, size_t n, uint64_t seed, float mag) {
    for (size_t i = 0; i < n; i++) {
        uint64_t z = seed + 0x9e3779b97f4a7c15ull * (i + 1);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z ^= z >> 31;
        float u = (float)(z >> 40) * (1.0f / 16777216.0f);
        dst[i] = lk_f32_to_bf16(mag * (2.0f * u - 1.0f));
    }
}

typedef struct decl {
    char name[160];
    int64_t shape[2];
    int ndim;
} decl;

/* Writes n declared BF16 tensors with random values, in 8 MiB chunks. */
static lk_status write_file(const char *path, const decl *d, size_t n, uint64_t seed, float mag) {
    lk_st_writer *w;
    lk_status s = lk_st_writer_create(path, &w);
    for (size_t i = 0; !s && i < n; i++) s = lk_st_writer_declare(w, d[i].name, LK_DTYPE_BF16, d[i].ndim, d[i].shape, NULL);
    if (!s) s = lk_st_writer_begin(w);
    const size_t chunk = 4u << 20; /* elements */
    uint16_t *buf = s ? NULL : lk_malloc(chunk * 2);
    if (!s && !buf) s = lk_error(LK_ERR_NOMEM, "bench swap: out of memory");
    for (size_t i = 0; !s && i < n; i++) {
        size_t numel = (size_t)d[i].shape[0] * (size_t)(d[i].ndim == 2 ? d[i].shape[1] : 1);
        for (size_t off = 0; !s && off < numel; off += chunk) {
            size_t k = numel - off < chunk ? numel - off : chunk;
            fill_bf16(buf, k, seed * 1000003u + i * 7919u + off, mag);
            s = lk_st_writer_write(w, i, off * 2, buf, k * 2);
        }
    }
    if (!s) s = lk_st_writer_commit(w);
    lk_free(buf);
    lk_st_writer_free(w);
    return s;
}

static lk_status write_model(const char *path, long d, long blocks) {
    size_t n = (size_t)blocks * 7;
    decl *t = lk_calloc(n, sizeof *t);
    if (!t) return lk_error(LK_ERR_NOMEM, "bench swap: out of memory");
    size_t k = 0;
    for (long b = 0; b < blocks; b++) {
        for (int j = 0; j < 6; j++, k++) {
            snprintf(t[k].name, sizeof t[k].name, "transformer_blocks.%ld.%s.weight", b, LIN[j]);
            lin_shape(d, j, &t[k].shape[0], &t[k].shape[1]);
            t[k].ndim = 2;
        }
        snprintf(t[k].name, sizeof t[k].name, "transformer_blocks.%ld.norm1.weight", b);
        t[k].shape[0] = d;
        t[k++].ndim = 1;
    }
    lk_status s = write_file(path, t, n, 1, 0.05f);
    lk_free(t);
    return s;
}

/* diffusers-format adapter on the attention projections (alpha = rank). */
static lk_status write_adapter(const char *path, long d, long blocks, long r, uint64_t seed) {
    size_t n = (size_t)blocks * 8;
    decl *t = lk_calloc(n, sizeof *t);
    if (!t) return lk_error(LK_ERR_NOMEM, "bench swap: out of memory");
    size_t k = 0;
    for (long b = 0; b < blocks; b++)
        for (int j = 0; j < 4; j++) {
            snprintf(t[k].name, sizeof t[k].name, "transformer.transformer_blocks.%ld.%s.lora_A.weight", b, LIN[j]);
            t[k].shape[0] = r;
            t[k].shape[1] = d;
            t[k++].ndim = 2;
            snprintf(t[k].name, sizeof t[k].name, "transformer.transformer_blocks.%ld.%s.lora_B.weight", b, LIN[j]);
            t[k].shape[0] = d;
            t[k].shape[1] = r;
            t[k++].ndim = 2;
        }
    lk_status s = write_file(path, t, n, seed, 0.02f);
    lk_free(t);
    return s;
}

/* adapter_config.json beside a and b (both rank r): lora_alpha = r, so the
 * scale is 1 and said, not defaulted with a warning. */
static lk_status write_config(const char *path, long r) {
    FILE *f = fopen(path, "w");
    if (!f) return lk_error(LK_ERR_IO, "bench swap: cannot write %s", path);
    int bad = fprintf(f, "{\"peft_type\": \"LORA\", \"r\": %ld, \"lora_alpha\": %ld}\n", r, r) < 0;
    if (fclose(f) || bad) return lk_error(LK_ERR_IO, "bench swap: cannot write %s", path);
    return LK_OK;
}

/* ---- measuring ---- */

typedef struct result {
    double seconds;  /* slowest rank */
    double phase[4]; /* agree, load, fuse, broadcast: slowest rank each */
    uint64_t bytes_broadcast, backup_max, keys_fused, keys_restored;
    uint64_t h2d_bytes, d2h_bytes; /* on a device: what the call copied host->device and back, summed over ranks */
    int counted;                   /* h2d_bytes and d2h_bytes were measured (printed on a device) */
} result;

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* The `full` baseline (bench_full.c) where run_mode takes a tracker mode. */
#define MODE_FULL (-1)

/* A tracker (the library's, in a mode of serve/tracker.h) or the
 * baseline. */
typedef struct swapper {
    lk_tracker *t;
    lk_bench_full *f;
} swapper;

/* One tracker call on every rank, reduced over the group (the library's
 * summary of a call: the slowest rank's times, summed key counts). */
static lk_status timed_apply(lk_comm *c, const swapper *sw, lk_device dev, const lk_fuse_input *in, size_t n,
                             result *r) {
    lk_tracker_stats st;
    lk_device_counts k0, k1; /* the device layer's copy counters around the call (bytes over PCIe on a GPU) */
    lk_status s = lk_comm_barrier(c);
    lk_device_counts_of(dev, &k0);
    if (!s) s = sw->t ? lk_tracker_apply(sw->t, in, n, &st) : lk_bench_full_apply(sw->f, in, n, &st);
    lk_device_counts_of(dev, &k1);
    uint64_t moved[2] = {k1.bytes[LK_COPY_H2D] - k0.bytes[LK_COPY_H2D], k1.bytes[LK_COPY_D2H] - k0.bytes[LK_COPY_D2H]};
    lk_tracker_summary sum;
    if (!s) s = lk_tracker_summarize(c, NULL, &st, 0, &sum);
    if (!s) s = lk_comm_allreduce_u64(c, moved, 2, LK_REDUCE_SUM);
    if (s) return s;
    *r = (result){sum.seconds, {sum.seconds_agree, sum.seconds_load, sum.seconds_fuse, sum.seconds_broadcast},
                  sum.bytes_broadcast, sum.backup_bytes_max, sum.keys_fused, sum.keys_restored, moved[0], moved[1], 1};
    return LK_OK;
}

static void print_result(const bopts *o, int ranks, const char *mode, const char *op, const result *r, size_t staging) {
    /* on a device: the bytes the call copied each way (every rank's, summed) against the touched keys' bytes */
    char moved[256] = "";
    const double tb = o->touched ? (double)o->touched : 1.0;
    if (o->device.kind != LK_DEVICE_CPU && r->counted && o->json)
        snprintf(moved, sizeof moved, ", \"h2d_bytes\": %llu, \"d2h_bytes\": %llu, \"h2d_over_touched\": %.4f, "
                 "\"d2h_over_touched\": %.4f", (unsigned long long)r->h2d_bytes, (unsigned long long)r->d2h_bytes,
                 (double)r->h2d_bytes / tb, (double)r->d2h_bytes / tb);
    else if (o->device.kind != LK_DEVICE_CPU && r->counted)
        snprintf(moved, sizeof moved, "  h2d %.1f MiB (%.3fx touched) d2h %.1f MiB (%.3fx)",
                 (double)r->h2d_bytes / 1048576.0, (double)r->h2d_bytes / tb, (double)r->d2h_bytes / 1048576.0,
                 (double)r->d2h_bytes / tb);
    if (o->json)
        printf("{\"bench\": \"swap\", \"mode\": \"%s\", \"op\": \"%s\", \"ranks\": %d, \"seconds\": %.6f, "
               "\"bytes_broadcast\": %llu, \"backup_bytes_max\": %llu, \"keys_fused\": %llu, "
               "\"keys_restored\": %llu, \"staging_bytes\": %zu, \"phases\": {\"agree\": %.6f, \"load\": %.6f, "
               "\"fuse\": %.6f, \"broadcast\": %.6f}%s}\n",
               mode, op, ranks, r->seconds, (unsigned long long)r->bytes_broadcast,
               (unsigned long long)r->backup_max, (unsigned long long)r->keys_fused,
               (unsigned long long)r->keys_restored, staging, r->phase[0], r->phase[1], r->phase[2], r->phase[3], moved);
    else
        printf("%-6s %-9s %7.3f s (load %.3f fuse %.3f bcast %.3f)  %6.1f MiB sent  backup/rank %6.1f MiB  "
               "fused %3llu  restored %3llu%s\n",
               mode, op, r->seconds, r->phase[1], r->phase[2], r->phase[3], (double)r->bytes_broadcast / 1048576.0,
               (double)r->backup_max / 1048576.0, (unsigned long long)r->keys_fused,
               (unsigned long long)r->keys_restored, moved);
    fflush(stdout);
}

enum { OP_APPLY, OP_STRENGTH, OP_SWAP, OP_RESET, N_OPS };
static const char *const OPS[N_OPS] = {"apply", "strength", "swap", "reset"};

/* Runs the four ops --repeat times in one tracker mode (serve/tracker.h,
 * or MODE_FULL); med[] gets the medians, *create the slowest rank's
 * lk_tracker_create (from a barrier; it includes the check that every rank
 * holds the same base bytes). Every mode must leave the same bytes: after
 * each op of the last repeat the weights' digest goes into dig[op] (the
 * first mode run) or is compared with it (LK_ERR_MISMATCH). */
static lk_status run_mode(lk_comm *c, lk_weights *w, const bopts *o, int mode, const char *pa, const char *pb,
                          result med[N_OPS], size_t *staging, int *overlaps, result *create,
                          char dig[N_OPS][LK_DIGEST_HEX], const char *name) {
    lk_tracker_opts to = LK_TRACKER_OPTS_DEFAULT;
    lk_status s = lk_knob_mib_bytes(LK_KNOB_SWAP_BUCKET_MB, (double)o->bucket_mb, &to.bucket_bytes);
    to.threads = (int)o->threads;
    swapper sw = {NULL, NULL};
    if (!s) s = lk_comm_barrier(c);
    double t0 = lk_now_s();
    if (!s) s = mode == MODE_FULL ? lk_bench_full_create(c, w, &to, &sw.f) : lk_tracker_create_ex(c, w, &to, mode, &sw.t);
    if (s) return s;
    uint64_t ns = (uint64_t)((lk_now_s() - t0) * 1e9);
    if ((s = lk_comm_allreduce_u64(c, &ns, 1, LK_REDUCE_MAX))) {
        lk_tracker_free(sw.t);
        lk_bench_full_free(sw.f);
        return s;
    }
    memset(create, 0, sizeof *create);
    create->seconds = (double)ns * 1e-9;
    *staging = sw.t ? lk_tracker_staging_bytes(sw.t) : lk_bench_full_staging_bytes(sw.f);
    *overlaps = sw.t ? lk_tracker_overlaps(sw.t) : 0;
    lk_fuse_input a1[] = {{pa, 1.0f, LK_FORMAT_AUTO}}, a05[] = {{pa, 0.5f, LK_FORMAT_AUTO}},
                  b1[] = {{pb, 1.0f, LK_FORMAT_AUTO}};
    const lk_fuse_input *req[N_OPS] = {a1, a05, b1, NULL};
    result *runs = lk_calloc((size_t)o->repeat * N_OPS, sizeof *runs);
    double *sec = lk_calloc((size_t)o->repeat, sizeof *sec);
    if (!runs || !sec) s = lk_error(LK_ERR_NOMEM, "bench swap: out of memory");
    for (long k = 0; !s && k < o->repeat; k++)
        for (int op = 0; !s && op < N_OPS; op++) {
            s = timed_apply(c, &sw, o->device, req[op], req[op] ? 1 : 0, &runs[k * N_OPS + op]);
            if (s || k != o->repeat - 1) continue;
            char hex[LK_DIGEST_HEX] = {0};
            if ((s = lk_weights_digest(w, hex))) break;
            if (!dig[op][0]) memcpy(dig[op], hex, sizeof hex);
            else if (strcmp(dig[op], hex))
                s = lk_error(LK_ERR_MISMATCH, "bench swap: %s %s left digest %s, the first mode %s (rank %d)", name,
                             OPS[op], hex, dig[op], lk_comm_rank(c));
        }
    for (int op = 0; !s && op < N_OPS; op++) { /* report the whole median run */
        for (long k = 0; k < o->repeat; k++) sec[k] = runs[k * N_OPS + op].seconds;
        qsort(sec, (size_t)o->repeat, sizeof *sec, cmp_d);
        for (long k = 0; k < o->repeat; k++)
            if (runs[k * N_OPS + op].seconds == sec[o->repeat / 2]) med[op] = runs[k * N_OPS + op];
    }
    lk_free(runs);
    lk_free(sec);
    lk_tracker_free(sw.t);
    lk_bench_full_free(sw.f);
    return s;
}

/* The bare broadcast of `bytes` in rounds of at most `bucket` bytes:
 * rank r is the root of the r-th share (in order), straight from/into one
 * buffer; median over repeat of the slowest rank's time. */
static lk_status bare_bcast(lk_comm *c, uint64_t bytes, size_t bucket, long repeat, double *sec) {
    const int size = lk_comm_size(c);
    unsigned char *buf = lk_malloc(bytes ? (size_t)bytes : 1);
    double *t = lk_calloc((size_t)repeat, sizeof *t);
    lk_status s = buf && t ? LK_OK : lk_error(LK_ERR_NOMEM, "bench swap: out of memory for %llu bytes",
                                              (unsigned long long)bytes);
    s = lk_comm_agree(c, s);
    if (!s) memset(buf, 1, (size_t)bytes);
    for (long k = 0; !s && k < repeat; k++) {
        s = lk_comm_barrier(c);
        double t0 = lk_now_s();
        for (int r = 0; !s && r < size; r++) {
            uint64_t lo = bytes * (uint64_t)r / (uint64_t)size, hi = bytes * (uint64_t)(r + 1) / (uint64_t)size;
            for (uint64_t off = lo; !s && off < hi; off += bucket)
                s = lk_comm_bcast(c, buf + off, hi - off < bucket ? (size_t)(hi - off) : bucket, r);
        }
        uint64_t ns = (uint64_t)((lk_now_s() - t0) * 1e9);
        if (!s) s = lk_comm_allreduce_u64(c, &ns, 1, LK_REDUCE_MAX);
        t[k] = (double)ns * 1e-9;
    }
    if (!s) {
        qsort(t, (size_t)repeat, sizeof *t, cmp_d);
        *sec = t[repeat / 2];
    }
    lk_free(buf);
    lk_free(t);
    return s;
}

/* --device: the floor a swap is measured against (issue 27: a swap step
 * on one GPU <= 1.3x this): the touched keys' clean bytes copied up from
 * pinned host memory (the default backup's restore) and adapter B fused
 * into each by the device kernel, key after key on the default stream,
 * nothing else: no agreement, no delta planning, no broadcast. Every rank
 * does all of it (one GPU's work); median over repeat of the slowest rank;
 * moved[]: the bytes the last run copied host->device and back, summed over
 * ranks. w holds its base bytes before and after. */
static lk_status floor_swap(lk_comm *c, lk_weights *w, const bopts *o, const char *pb, double *sec, uint64_t moved[2]) {
    const lk_device dev = o->device;
    const size_t nw = lk_weights_count(w);
    lk_tensor *ts = (lk_tensor *)lk_weights_tensors(w); /* the weights' own views: fused in place below */
    lk_adapter *ad = NULL;
    lk_fuse_term *terms = lk_calloc(nw * LK_ADAPTER_MAX_SLICES, sizeof *terms);
    lk_fuse_key *keys = lk_calloc(nw, sizeof *keys);
    size_t *idx = lk_calloc(nw, sizeof *idx), nk = 0;
    uint64_t bytes = 0;
    unsigned char *host = NULL;
    double *t = lk_calloc((size_t)o->repeat, sizeof *t);
    const double one = 1.0;
    lk_status s = terms && keys && idx && t ? LK_OK : lk_error(LK_ERR_NOMEM, "bench swap: out of memory");
    if (!s) s = lk_adapter_open(pb, LK_FORMAT_AUTO, &ad);
    if (!s) s = lk_adapter_resolve(ad, ts, nw, 0, NULL);
    for (size_t i = 0; !s && i < nw; i++) {
        s = lk_fuse_key_plan(&ad, &one, 1, &ts[i], terms + nk * LK_ADAPTER_MAX_SLICES, &keys[nk]);
        if (!s && lk_fuse_key_touches(&keys[nk])) {
            idx[nk++] = i;
            bytes += ts[i].nbytes;
        }
    }
    if (!s) s = lk_device_host_alloc(dev, bytes ? (size_t)bytes : 1, (void **)&host);
    for (size_t j = 0, off = 0; !s && j < nk; off += ts[idx[j]].nbytes, j++)
        s = lk_device_copy(dev, host + off, ts[idx[j]].data, ts[idx[j]].nbytes, LK_COPY_D2H, NULL);
    lk_fuse_opts fo = {.threads = (int)o->threads};
    s = lk_comm_agree(c, s);
    for (long r = 0; !s && r <= o->repeat; r++) { /* run 0 warms up */
        s = lk_comm_barrier(c);
        lk_device_counts k0, k1;
        lk_device_counts_of(dev, &k0);
        double t0 = lk_now_s();
        for (size_t j = 0, off = 0; !s && j < nk; off += ts[idx[j]].nbytes, j++) {
            lk_tensor *x = &ts[idx[j]];
            s = lk_device_copy(dev, x->data, host + off, x->nbytes, LK_COPY_H2D, NULL);
            if (!s) s = lk_fuse_key_apply_dev(x, &keys[j], terms + j * LK_ADAPTER_MAX_SLICES, &fo, NULL, NULL);
        }
        if (!s) s = lk_device_sync(dev);
        uint64_t ns = (uint64_t)((lk_now_s() - t0) * 1e9);
        lk_device_counts_of(dev, &k1);
        moved[0] = k1.bytes[LK_COPY_H2D] - k0.bytes[LK_COPY_H2D];
        moved[1] = k1.bytes[LK_COPY_D2H] - k0.bytes[LK_COPY_D2H];
        s = lk_comm_agree(c, s);
        if (!s) s = lk_comm_allreduce_u64(c, &ns, 1, LK_REDUCE_MAX);
        if (!s) s = lk_comm_allreduce_u64(c, moved, 2, LK_REDUCE_SUM);
        if (r) t[r - 1] = (double)ns * 1e-9;
    }
    for (size_t j = 0, off = 0; host && j < nk; off += ts[idx[j]].nbytes, j++) { /* the base again */
        lk_status cs = lk_device_copy(dev, ts[idx[j]].data, host + off, ts[idx[j]].nbytes, LK_COPY_H2D, NULL);
        if (!s) s = cs;
    }
    if (host && lk_device_sync(dev) && !s) s = lk_error(LK_ERR_IO, "bench swap: %s", lk_last_error());
    if (!s) {
        qsort(t, (size_t)o->repeat, sizeof *t, cmp_d);
        *sec = t[o->repeat / 2];
    }
    lk_device_host_free(dev, host);
    lk_adapter_free(ad);
    lk_free(terms);
    lk_free(keys);
    lk_free(idx);
    lk_free(t);
    return s;
}

#ifdef LK_HAVE_MPI
/* Starts `mpirun --oversubscribe -n K <this program> bench swap <args>`. */
static int relaunch(long ranks, int argc, char **argv) {
    char exe[4096], nbuf[32];
    ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (len <= 0) return -1;
    exe[len] = '\0';
    snprintf(nbuf, sizeof nbuf, "%ld", ranks);
    char **av = calloc((size_t)argc + 8, sizeof *av);
    if (!av) return -1;
    int k = 0;
    av[k++] = "mpirun";
    av[k++] = "--oversubscribe";
    av[k++] = "-n";
    av[k++] = nbuf;
    av[k++] = exe;
    av[k++] = "bench";
    for (int i = 0; i < argc; i++) av[k++] = argv[i];
    fflush(stdout);
    execvp("mpirun", av);
    free(av);
    return -1; /* exec failed: run here, one rank */
}
#endif

/* --device: the weights moved there on every rank (agreed), and on cuda
 * with more than one rank an NCCL communicator over c when lorakit has
 * NCCL (*nc; NULL otherwise: host rounds over c). */
static lk_status bench_to_device(lk_comm *c, bopts *o, lk_weights *w, lk_comm **nc) {
    if (o->local_gpu) o->device.index = lk_comm_nccl_local_device(lk_device_cuda_count());
    lk_status s = lk_comm_agree(c, lk_weights_to_device(w, o->device));
    if (s || o->device.kind != LK_DEVICE_CUDA || lk_comm_size(c) == 1 || !lk_comm_nccl_built()) return s;
    s = lk_comm_nccl_create(c, o->device.index, nc);
    if (s && s != LK_ERR_TIMEOUT) {
        if (lk_comm_rank(c) == 0) fprintf(stderr, "bench swap: NCCL could not start (%s); host rounds over %s\n",
                                          lk_last_error(), lk_comm_backend(c));
        s = LK_OK;
    }
    return s;
}

int lk_bench_swap(int argc, char **argv) {
    if (lk_cli_wants_help(argc, argv)) {
        fputs(SWAP_BENCH_USAGE, stdout);
        return LK_EXIT_OK;
    }
    bopts o;
    int prc = parse(argc, argv, &o);
    if (prc >= 0) return prc;
#ifdef LK_HAVE_MPI
    if (o.ranks > 1 && !getenv("OMPI_COMM_WORLD_SIZE") && !getenv("PMIX_RANK")) relaunch(o.ranks, argc, argv);
#endif
    lk_comm *c;
    if (lk_comm_world(NULL, NULL, &c)) return lk_cli_fail();
    int rank = lk_comm_rank(c), ranks = lk_comm_size(c), rc = LK_EXIT_FAIL;
    const long d = o.dim, block_bytes = 12 * d * d * 2;
    const long blocks = (long)(((unsigned long long)o.size_mb << 20) + (unsigned long long)block_bytes - 1) / block_bytes;
    char dir[4096] = {0};
    char pm[4200], pa[4200], pb[4200], pc[4200];
    lk_weights *w = NULL;
    lk_comm *nc = NULL; /* NCCL over c for cuda weights (then swapped with c) */
    lk_status s = LK_OK;
    if (rank == 0) {
        const char *base = o.dir ? o.dir : getenv("TMPDIR") && *getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
        snprintf(dir, sizeof dir, "%s/lkbench_swap.XXXXXX", base);
        if (!mkdtemp(dir)) s = lk_error(LK_ERR_IO, "bench swap: cannot create a folder under %s", base);
    }
    s = lk_comm_agree(c, s);
    if (!s) s = lk_comm_bcast(c, dir, sizeof dir, 0);
    snprintf(pm, sizeof pm, "%s/model.safetensors", dir);
    snprintf(pa, sizeof pa, "%s/a.safetensors", dir);
    snprintf(pb, sizeof pb, "%s/b.safetensors", dir);
    snprintf(pc, sizeof pc, "%s/adapter_config.json", dir);
    if (!s && rank == 0) {
        s = write_model(pm, d, blocks);
        if (!s) s = write_adapter(pa, d, blocks, o.rank, 2);
        if (!s) s = write_adapter(pb, d, blocks, o.rank, 3);
        if (!s) s = write_config(pc, o.rank);
    }
    if (!s) s = lk_comm_agree(c, s);
    if (!s) s = lk_comm_agree(c, lk_weights_load(pm, &w));
    if (!s && o.device.kind != LK_DEVICE_CPU) s = bench_to_device(c, &o, w, &nc);
    if (nc) { /* every collective below over NCCL; the world kept for the end */
        lk_comm *world = c;
        c = nc;
        nc = world;
    }
    if (s) {
        if (rank == 0) lk_cli_fail();
        goto out;
    }
    /* bytes the adapters touch, and the largest tensor */
    uint64_t touched = 0, largest = 0, total = lk_weights_nbytes(w);
    for (size_t i = 0; i < lk_weights_count(w); i++) {
        const lk_tensor *t = lk_weights_tensor(w, i);
        if (strstr(t->name, ".attn1.")) touched += t->nbytes;
        if (t->nbytes > largest) largest = t->nbytes;
    }
    o.touched = touched;
    char devname[LK_DEVICE_STR_MAX];
    lk_device_str(o.device, devname);
    if (rank == 0 && !o.json)
        printf("model %.1f MiB (%ld blocks, d=%ld, BF16) on %s, adapters rank %ld on attention (%.1f%% of bytes), "
               "%d ranks over %s, bucket %ld MiB, median of %ld\n",
               (double)total / 1048576.0, blocks, d, devname, o.rank,
               100.0 * (double)touched / (double)total, ranks, lk_comm_backend(c), o.bucket_mb, o.repeat);
    /* delta (the tracker), full (the reference's behaviour), and with
     * --compare the delta mode with the overlap forced off and on */
    static const int MODE[4] = {0, MODE_FULL, LK_TRACKER_SERIAL, LK_TRACKER_OVERLAP};
    static const char *const MODE_NAME[4] = {"delta", "full", "delta_serial", "delta_overlap"};
    static const char *const OVERLAP_NAME[3] = {"off", "nonblocking", "nonblocking+thread"}; /* lk_tracker_overlaps */
    result res[4][N_OPS], created[4];
    char dig[N_OPS][LK_DIGEST_HEX] = {{0}}; /* every mode's bytes after each op: the first mode's */
    size_t staging[4];
    int overlaps[4];
    memset(res, 0, sizeof res);
    uint64_t dev_before = 0, dev_peak = 0; /* device memory the delta mode held beyond the model (slowest rank) */
    for (int mode = 0; mode < (o.compare ? 4 : 2) && !s; mode++) {
        if (MODE[mode] == MODE_FULL && o.device.kind != LK_DEVICE_CPU) continue; /* host memory only */
        if (mode == 0) {
            lk_device_mem_peak_reset(o.device);
            lk_device_mem_stats(o.device, &dev_before, NULL);
        }
        s = run_mode(c, w, &o, MODE[mode], pa, pb, res[mode], &staging[mode], &overlaps[mode], &created[mode], dig,
                     MODE_NAME[mode]);
        if (mode == 0 && !s) {
            lk_device_mem_stats(o.device, NULL, &dev_peak);
            dev_peak -= dev_before;
            s = lk_comm_allreduce_u64(c, &dev_peak, 1, LK_REDUCE_MAX);
        }
        if (!s && rank == 0) print_result(&o, ranks, MODE_NAME[mode], "create", &created[mode], staging[mode]);
        for (int op = 0; !s && rank == 0 && op < N_OPS; op++)
            print_result(&o, ranks, MODE_NAME[mode], OPS[op], &res[mode][op], staging[mode]);
    }
    /* the bare broadcast of each delta op's bytes, same bucket size */
    double bare[N_OPS] = {0};
    for (int op = 0; !s && op < N_OPS; op++)
        s = bare_bcast(c, res[0][op].bytes_broadcast, staging[0], o.repeat, &bare[op]);
    for (int op = 0; !s && rank == 0 && op < N_OPS; op++) {
        result rb = {bare[op], {0}, res[0][op].bytes_broadcast, 0, 0, 0, 0, 0};
        print_result(&o, ranks, "bare_bcast", OPS[op], &rb, staging[0]);
    }
    /* on a device: the floor of a swap (restore + the kernel alone) */
    double floor_s = 0;
    uint64_t floor_moved[2] = {0, 0};
    if (!s && o.device.kind != LK_DEVICE_CPU) {
        s = floor_swap(c, w, &o, pb, &floor_s, floor_moved);
        if (!s && rank == 0) {
            result rf = {floor_s, {0}, 0, 0, 0, 0, floor_moved[0], floor_moved[1], 1};
            print_result(&o, ranks, "restore_plus_kernel", "swap", &rf, 0);
        }
    }
    /* the naive alternative: every rank reloads the checkpoint */
    double reload[64];
    long nr = o.repeat < 64 ? o.repeat : 64;
    for (long k = 0; !s && k < nr; k++) {
        lk_weights *w2 = NULL;
        s = lk_comm_barrier(c);
        double t0 = lk_now_s();
        lk_status ls = lk_weights_load(pm, &w2);
        uint64_t ns = (uint64_t)((lk_now_s() - t0) * 1e9);
        lk_weights_free(w2);
        if (!s) s = lk_comm_agree(c, ls);
        if (!s) s = lk_comm_allreduce_u64(c, &ns, 1, LK_REDUCE_MAX);
        reload[k] = (double)ns * 1e-9;
    }
    if (s) {
        if (rank == 0) lk_cli_fail();
        goto out;
    }
#define RATIO(m, op) (bare[op] > 0 ? res[m][op].seconds / bare[op] : 0.0)
    if (rank == 0) {
        qsort(reload, (size_t)nr, sizeof *reload, cmp_d);
        result rr = {reload[nr / 2], {0}, 0, 0, 0, 0, 0, 0};
        print_result(&o, ranks, "reload", "reload", &rr, 0);
        double ratio = res[1][OP_SWAP].seconds > 0 ? res[0][OP_SWAP].seconds / res[1][OP_SWAP].seconds : 0.0;
        uint64_t backup_target = touched / (uint64_t)ranks + largest;
        const int staged = lk_comm_size(c) > 1 && !(o.device.kind == LK_DEVICE_CUDA && lk_comm_takes_cuda(c)); /* as the tracker's */
        char devrow[768] = ""; /* on a device: the swap against its floor, its copies, the device memory beyond the model */
        if (o.device.kind != LK_DEVICE_CPU) {
            double fr = floor_s > 0 ? res[0][OP_SWAP].seconds / floor_s : 0.0;
            unsigned long long tgt = (unsigned long long)(staging[0] + largest);
            const double th = touched ? (double)touched : 1.0;
            const double h2d = (double)res[0][OP_SWAP].h2d_bytes / th, d2h = (double)res[0][OP_SWAP].d2h_bytes / th;
            if (o.json)
                snprintf(devrow, sizeof devrow,
                         ", \"swap_over_restore_plus_kernel\": %.3f, \"device_bytes_beyond_model\": %llu, "
                         "\"device_bytes_target\": %llu, \"swap_h2d_bytes\": %llu, \"swap_d2h_bytes\": %llu, "
                         "\"swap_h2d_over_touched\": %.4f, \"swap_d2h_over_touched\": %.4f, \"staged\": %d",
                         fr, (unsigned long long)dev_peak, tgt, (unsigned long long)res[0][OP_SWAP].h2d_bytes,
                         (unsigned long long)res[0][OP_SWAP].d2h_bytes, h2d, d2h, staged);
            else
                snprintf(devrow, sizeof devrow,
                         "\non %s: swap / (restore + fuse kernel alone) = %.2f (target <= 1.3); device memory beyond "
                         "the model %llu bytes (target <= %llu = staging + largest tensor); a swap copied %.3fx the "
                         "touched bytes host->device and %.4fx device->host (every rank's; %s broadcast)",
                         devname, fr, (unsigned long long)dev_peak, tgt, h2d, d2h, staged ? "staged" : "direct");
        }
        char cmp[512] = ""; /* the delta mode with the overlap forced off and on, when timed */
        if (o.compare)
            snprintf(cmp, sizeof cmp,
                     o.json ? ", \"serial_over_bare_bcast\": {\"apply\": %.3f, \"strength\": %.3f, \"swap\": %.3f, "
                              "\"reset\": %.3f}, \"overlap_over_bare_bcast\": {\"apply\": %.3f, \"strength\": %.3f, "
                              "\"swap\": %.3f, \"reset\": %.3f}"
                            : "\nserial: apply %.2f, strength %.2f, swap %.2f, reset %.2f; overlap forced: apply %.2f, "
                              "strength %.2f, swap %.2f, reset %.2f",
                     RATIO(2, OP_APPLY), RATIO(2, OP_STRENGTH), RATIO(2, OP_SWAP), RATIO(2, OP_RESET),
                     RATIO(3, OP_APPLY), RATIO(3, OP_STRENGTH), RATIO(3, OP_SWAP), RATIO(3, OP_RESET));
        if (o.json)
            printf("{\"bench\": \"swap\", \"mode\": \"summary\", \"device\": \"%s\", \"ranks\": %d, \"model_bytes\": %llu, "
                   "\"touched_bytes\": %llu, \"largest_tensor_bytes\": %llu, \"swap_delta_over_full\": %.3f, "
                   "\"backup_bytes_max\": %llu, \"backup_target\": %llu, \"staging_bytes\": %zu, \"overlap\": \"%s\", "
                   "\"swap_over_bare_bcast\": {\"apply\": %.3f, \"strength\": %.3f, \"swap\": %.3f, \"reset\": %.3f}"
                   "%s%s}\n",
                   devname, ranks, (unsigned long long)total, (unsigned long long)touched, (unsigned long long)largest, ratio,
                   (unsigned long long)res[0][OP_SWAP].backup_max, (unsigned long long)backup_target, staging[0],
                   OVERLAP_NAME[overlaps[0]], RATIO(0, OP_APPLY), RATIO(0, OP_STRENGTH), RATIO(0, OP_SWAP),
                   RATIO(0, OP_RESET), cmp, devrow);
        else
            printf("swap: delta / full = %.2f (target <= 0.3); backup per rank %.1f MiB (target <= %.1f MiB = "
                   "touched/ranks + largest tensor); staging %.1f MiB\n"
                   "swap / bare broadcast of the same bytes (overlap %s): apply %.2f, strength %.2f, swap %.2f, "
                   "reset %.2f (target <= 1.3)%s%s\n",
                   ratio, (double)res[0][OP_SWAP].backup_max / 1048576.0, (double)backup_target / 1048576.0,
                   (double)staging[0] / 1048576.0, OVERLAP_NAME[overlaps[0]], RATIO(0, OP_APPLY),
                   RATIO(0, OP_STRENGTH), RATIO(0, OP_SWAP), RATIO(0, OP_RESET), cmp, devrow);
    }
    rc = LK_EXIT_OK;
out:
    lk_weights_free(w);
    if (nc) { /* c is the NCCL communicator, nc the world */
        lk_comm_free(c);
        c = nc;
    }
    lk_comm_barrier(c);
    if (rank == 0 && dir[0]) {
        remove(pm);
        remove(pa);
        remove(pb);
        remove(pc);
        rmdir(dir);
    }
    lk_comm_free(c);
    return rc;
}
