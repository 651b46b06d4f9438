/* bench_io.c — `lorakit bench io`: how fast the safetensors layer is.
 *
 * Cases (each one JSON line with --json):
 *  - write_index / open_index: a file of 20,000 small tensors (mixed dtypes),
 *    written with the streaming writer, then opened, validated and indexed
 *    (lk_st_open + lk_st_close) several times; min and median seconds, plus
 *    the cost of looking every name up (lk_st_find);
 *  - write_digest / digest: a 1 GiB file (16 BF16 tensors of 64 MiB, written
 *    in 8 MiB chunks), then open + lk_digest_st several times; GB/s = 1e9
 *    bytes per second of the best run (page cache warm after the first);
 *  - fuse_file: `lorakit fuse` of a base of the same size (finite BF16
 *    values, the same 16 tensors) with an r = 16 adapter on every third
 *    tensor (6 of 16, 37.5 % of the bytes), against its floor: reading the
 *    base and writing a same-size output through the same I/O path
 *    (lk_st_read of whole tensors, the streaming writer, commit with
 *    fsync) with no fusion. Best of --repeat each (at most 3), the two
 *    alternating which goes first; the line
 *    {"bench":"fuse_file","seconds","floor_seconds","ratio_to_floor"}.
 * Files go to a fresh temporary directory that is removed at the end. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli_util.h"
#include "lorakit/lorakit.h"
#include "bench_util.h"

static const char *const IO_USAGE =
    "usage: lorakit bench io [--json] [--tensors N] [--size-mb N] [--repeat N] [--dir DIR]\n\n"
    "Times opening and indexing a safetensors file of N small tensors\n"
    "(default 20000), digesting a file of N MiB (default 1024), and fusing an\n"
    "r = 16 adapter into a third of a BF16 base of that size against the floor\n"
    "of reading the base and writing the output with no fusion.\n"
    "Files are written in a temporary folder under DIR (default $TMPDIR or\n"
    "/tmp) and removed afterwards.\n\n"
    "options:\n"
    "  --json        one JSON object per case on stdout\n"
    "  --tensors N   tensors in the indexing file (default 20000)\n"
    "  --size-mb N   size of the digest file in MiB, a multiple of 64 or less (default 1024)\n"
    "  --repeat N    timed runs per case (default 5)\n"
    "  --dir DIR     where the temporary folder goes\n"
    "  -h, --help    this text\n";

static void report(int json, const char *cases, const char *fmt_json, const char *fmt_text, ...)
    __attribute__((format(printf, 4, 5)));
/* Prints one result; fmt_json holds the JSON fields after "case". The
 * text form gets the same arguments through fmt_text. */
static void report(int json, const char *cases, const char *fmt_json, const char *fmt_text, ...) {
    va_list ap;
    va_start(ap, fmt_text);
    if (json) {
        printf("{\"bench\":\"io\",\"case\":\"%s\",", cases);
        vprintf(fmt_json, ap);
        printf("}\n");
    } else {
        printf("%-13s ", cases);
        vprintf(fmt_text, ap);
        printf("\n");
    }
    va_end(ap);
    fflush(stdout);
}

/* Writes `n` small tensors of mixed dtypes; returns the file size or 0. */
static unsigned long long write_index_file(const char *path, long n) {
    static const lk_dtype dts[3] = {LK_DTYPE_F32, LK_DTYPE_BF16, LK_DTYPE_F16};
    lk_st_writer *w;
    if (lk_st_writer_create(path, &w)) return 0;
    lk_status s = lk_st_writer_metadata(w, "format", "pt");
    char name[128];
    for (long i = 0; i < n && !s; i++) {
        int64_t shape[2] = {16, 8 + i % 5};
        snprintf(name, sizeof name, "model.layers.%ld.block.%ld.proj_%ld.weight", i / 64, (i / 8) % 8, i % 8);
        s = lk_st_writer_declare(w, name, dts[i % 3], 2, shape, NULL);
    }
    if (!s) s = lk_st_writer_begin(w);
    unsigned char buf[16 * 12 * 4];
    for (size_t i = 0; i < sizeof buf; i++) buf[i] = (unsigned char)(i * 31 + 7);
    for (long i = 0; i < n && !s; i++) {
        size_t bytes = 16 * (size_t)(8 + i % 5) * lk_dtype_size(dts[i % 3]);
        s = lk_st_writer_write(w, (size_t)i, 0, buf, bytes);
    }
    if (!s) s = lk_st_writer_commit(w);
    lk_st_writer_free(w);
    if (s) return 0;
    lk_st *st;
    if (lk_st_open(path, &st)) return 0;
    unsigned long long sz = 8 + lk_st_header_len(st);
    for (size_t i = 0; i < lk_st_count(st); i++) sz += lk_st_tensor(st, i)->nbytes;
    lk_st_close(st);
    return sz;
}

/* Writes size_mb MiB as BF16 tensors of at most 64 MiB, in 8 MiB chunks:
 * random bit patterns, or (finite) BF16 values in [-1, 1). */
static int write_big_file(const char *path, long size_mb, int finite) {
    const size_t chunk = (size_t)8 << 20;
    long per = size_mb < 64 ? size_mb : 64, nt = (size_mb + per - 1) / per;
    unsigned char *buf = malloc(chunk);
    if (!buf) return lk_error(LK_ERR_NOMEM, "bench: out of memory");
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (size_t i = 0; i < chunk; i += 8) {
        x ^= x << 13; x ^= x >> 7; x ^= x << 17;
        memcpy(buf + i, &x, 8);
        if (finite)
            for (int h = 0; h < 4; h++) {
                uint16_t v = lk_f32_to_bf16((float)((double)((x >> (16 * h)) & 0xffff) / 32768.0 - 1.0));
                memcpy(buf + i + 2 * (size_t)h, &v, 2);
            }
    }
    lk_st_writer *w;
    lk_status s = lk_st_writer_create(path, &w);
    if (s) {
        free(buf);
        return s;
    }
    char name[64];
    long left = size_mb;
    for (long i = 0; i < nt && !s; i++) {
        long mb = left < per ? left : per;
        left -= mb;
        int64_t shape[2] = {mb * 512, 1024}; /* mb MiB of BF16 */
        snprintf(name, sizeof name, "blocks.%ld.weight", i);
        s = lk_st_writer_declare(w, name, LK_DTYPE_BF16, 2, shape, NULL);
    }
    if (!s) s = lk_st_writer_begin(w);
    left = size_mb;
    for (long i = 0; i < nt && !s; i++) {
        size_t bytes = (size_t)(left < per ? left : per) << 20;
        left -= left < per ? left : per;
        for (size_t off = 0; off < bytes && !s; off += chunk) {
            if (!finite) buf[0] = (unsigned char)(off >> 20); /* vary the chunks a little */
            s = lk_st_writer_write(w, (size_t)i, off, buf, bytes - off < chunk ? bytes - off : chunk);
        }
    }
    if (!s) s = lk_st_writer_commit(w);
    lk_st_writer_free(w);
    free(buf);
    return s;
}

/* The r = 16 adapter (diffusers keys) on every third tensor of base. */
static lk_status write_fuse_adapter(const char *path, const lk_st *base, size_t *fused_bytes) {
    const size_t r = 16;
    lk_tensor t[64];
    char names[64][64];
    void *bufs[64];
    size_t n = 0;
    *fused_bytes = 0;
    uint64_t x = 12345;
    for (size_t i = 0; i < lk_st_count(base) && n + 2 <= 64; i += 3) {
        const lk_tensor *w = lk_st_tensor(base, i);
        const int64_t out = w->shape[0], in = w->shape[1];
        *fused_bytes += w->nbytes;
        const size_t na = r * (size_t)in, nb = (size_t)out * r;
        for (int ab = 0; ab < 2; ab++) {
            size_t cnt = ab ? nb : na;
            uint16_t *v = malloc(cnt * 2);
            if (!v) {
                for (size_t j = 0; j < n; j++) free(bufs[j]);
                return lk_error(LK_ERR_NOMEM, "bench: out of memory");
            }
            for (size_t j = 0; j < cnt; j++) {
                x ^= x << 13; x ^= x >> 7; x ^= x << 17;
                v[j] = lk_f32_to_bf16((float)((double)(x & 0xffff) / 65536.0 * 0.02 - 0.01));
            }
            const char *stem = w->name; /* blocks.N.weight -> blocks.N.lora_X.weight */
            size_t len = strlen(stem) > 7 ? strlen(stem) - 7 : 0;
            snprintf(names[n], sizeof names[n], "%.*s.lora_%s.weight", (int)len, stem, ab ? "B" : "A");
            t[n] = (lk_tensor){.name = names[n], .dtype = LK_DTYPE_BF16, .ndim = 2,
                               .shape = {ab ? out : (int64_t)r, ab ? (int64_t)r : in}, .nbytes = cnt * 2, .data = v};
            bufs[n++] = v;
        }
    }
    lk_status s = lk_st_save(path, t, n, NULL, 0);
    for (size_t j = 0; j < n; j++) free(bufs[j]);
    return s;
}

/* The floor: base -> out through lk_st_read of whole tensors and the
 * streaming writer (declare, begin, write, commit with fsync), no fusion. */
static lk_status copy_floor(const char *base, const char *out, void *buf) {
    lk_st *st;
    lk_status s = lk_st_open(base, &st);
    if (s) return s;
    lk_st_writer *w = NULL;
    s = lk_st_writer_create(out, &w);
    for (size_t i = 0; i < lk_st_count(st) && !s; i++) {
        const lk_tensor *t = lk_st_tensor(st, i);
        s = lk_st_writer_declare(w, t->name, t->dtype, t->ndim, t->shape, NULL);
    }
    if (!s) s = lk_st_writer_begin(w);
    for (size_t i = 0; i < lk_st_count(st) && !s; i++) {
        const lk_tensor *t = lk_st_tensor(st, i);
        if (!(s = lk_st_read(st, i, 0, buf, t->nbytes))) s = lk_st_writer_write(w, i, 0, buf, t->nbytes);
    }
    if (!s) s = lk_st_writer_commit(w);
    lk_st_writer_free(w);
    lk_st_close(st);
    return s;
}

/* fuse_file vs its floor; prints the fuse_file line. */
static lk_status bench_fuse_file(int json, const char *dir, long size_mb, long repeat) {
    char p_base[4200], p_ad[4200], p_out[4200];
    snprintf(p_base, sizeof p_base, "%s/fbase.safetensors", dir);
    snprintf(p_ad, sizeof p_ad, "%s/fadapter.safetensors", dir);
    snprintf(p_out, sizeof p_out, "%s/fout.safetensors", dir);
    lk_status s = write_big_file(p_base, size_mb, 1);
    lk_st *st = NULL;
    void *buf = NULL;
    size_t fused = 0;
    if (!s) s = lk_st_open(p_base, &st);
    if (!s) s = write_fuse_adapter(p_ad, st, &fused);
    size_t maxb = 0;
    for (size_t i = 0; st && i < lk_st_count(st); i++)
        if (lk_st_tensor(st, i)->nbytes > maxb) maxb = lk_st_tensor(st, i)->nbytes;
    lk_st_close(st);
    if (!s && !(buf = malloc(maxb ? maxb : 1))) s = lk_error(LK_ERR_NOMEM, "bench: out of memory");
    double best_f = 1e30, best_c = 1e30;
    lk_fuse_input in = {.path = p_ad, .strength = 1.0f, .format = LK_FORMAT_AUTO};
    for (long r = 0; r <= repeat && !s; r++) { /* run 0 warms the page cache */
        double tc = 0, tf = 0;
        for (int k = 0; k < 2 && !s; k++) { /* which goes first alternates: neither always pays for the other */
            double t0 = lk_now_s();
            if ((k == 0) == (r % 2 == 0)) {
                s = copy_floor(p_base, p_out, buf);
                tc = lk_now_s() - t0;
            } else {
                lk_fuse_stats fst;
                s = lk_fuse_file(p_base, &in, 1, p_out, NULL, &fst);
                tf = lk_now_s() - t0;
            }
            unlink(p_out);
        }
        if (r && !s) {
            if (tc < best_c) best_c = tc;
            if (tf < best_f) best_f = tf;
        }
    }
    free(buf);
    unlink(p_base);
    unlink(p_ad);
    if (s) return s;
    const double bytes = (double)size_mb * 1048576.0;
    if (json)
        printf("{\"bench\":\"fuse_file\",\"seconds\":%.6f,\"floor_seconds\":%.6f,\"ratio_to_floor\":%.3f,"
               "\"bytes\":%.0f,\"fused_bytes\":%zu,\"rank\":16,\"runs\":%ld}\n",
               best_f, best_c, best_f / best_c, bytes, fused, repeat);
    else
        printf("fuse_file     %.0f bytes (%zu fused, r = 16), best of %ld: fuse %.6f s, floor %.6f s, %.3f x floor\n",
               bytes, fused, repeat, best_f, best_c, best_f / best_c);
    fflush(stdout);
    return LK_OK;
}

int lk_bench_io(int argc, char **argv) {
    if (lk_cli_wants_help(argc, argv)) {
        fputs(IO_USAGE, stdout);
        return LK_EXIT_OK;
    }
    int json = 0;
    long ntensors = 20000, size_mb = 1024, repeat = 5;
    const char *base = getenv("TMPDIR");
    if (!base || !*base) base = "/tmp";
    for (int i = 1; i < argc; i++) {
        long *dst = NULL;
        if (!strcmp(argv[i], "--json")) { json = 1; continue; }
        if (!strcmp(argv[i], "--tensors")) dst = &ntensors;
        else if (!strcmp(argv[i], "--size-mb")) dst = &size_mb;
        else if (!strcmp(argv[i], "--repeat")) dst = &repeat;
        else if (!strcmp(argv[i], "--dir")) {
            if (i + 1 >= argc) return lk_cli_usage("bench io", "--dir needs a value");
            base = argv[++i];
            continue;
        } else return lk_cli_usage("bench io", "unknown option '%s'", argv[i]);
        if (i + 1 >= argc || !lk_cli_parse_int(argv[i + 1], dst) || *dst < 1)
            return lk_cli_usage("bench io", "%s needs a positive integer", argv[i]);
        i++;
    }
    if (repeat > 1000) repeat = 1000;
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/lorakit-bench.XXXXXX", base);
    if (!mkdtemp(dir)) {
        lk_error(LK_ERR_IO, "%s: cannot create a temporary folder", base);
        return lk_cli_fail();
    }
    char p_index[4200], p_big[4200];
    snprintf(p_index, sizeof p_index, "%s/index.safetensors", dir);
    snprintf(p_big, sizeof p_big, "%s/big.safetensors", dir);
    int rc = LK_EXIT_FAIL;
    double *t = malloc((size_t)repeat * sizeof *t);
    if (!t) goto out;

    /* ---- open + index ---- */
    double t0 = lk_now_s();
    unsigned long long isz = write_index_file(p_index, ntensors);
    if (!isz) goto out;
    double tw = lk_now_s() - t0;
    report(json, "write_index", "\"tensors\":%ld,\"file_bytes\":%llu,\"seconds\":%.6f",
           "%ld tensors, %llu bytes written in %.6f s", ntensors, isz, tw);
    double tl = 0;
    for (long r = 0; r < repeat; r++) {
        lk_st *st;
        t0 = lk_now_s();
        if (lk_st_open(p_index, &st)) goto out;
        t[r] = lk_now_s() - t0;
        if (r == 0) { /* every name looked up once */
            t0 = lk_now_s();
            for (size_t i = 0; i < lk_st_count(st); i++)
                if (lk_st_find(st, lk_st_tensor(st, i)->name) != (long)i) {
                    lk_error(LK_ERR_STATE, "bench: lookup of %s failed", lk_st_tensor(st, i)->name);
                    lk_st_close(st);
                    goto out;
                }
            tl = lk_now_s() - t0;
        }
        t0 = lk_now_s();
        lk_st_close(st);
        t[r] += lk_now_s() - t0;
    }
    qsort(t, (size_t)repeat, sizeof *t, lk_bench_cmp_double);
    report(json, "open_index",
           "\"tensors\":%ld,\"runs\":%ld,\"seconds_min\":%.6f,\"seconds_median\":%.6f,\"lookup_ns_per_name\":%.1f",
           "%ld tensors, %ld runs: min %.6f s, median %.6f s; lookup %.1f ns/name", ntensors, repeat, t[0],
           t[repeat / 2], 1e9 * tl / (double)ntensors);
    unlink(p_index);

    /* ---- digest ---- */
    t0 = lk_now_s();
    if (write_big_file(p_big, size_mb, 0)) goto out;
    tw = lk_now_s() - t0;
    double bytes = (double)size_mb * 1048576.0;
    report(json, "write_digest", "\"bytes\":%.0f,\"seconds\":%.6f,\"gb_per_s\":%.3f",
           "%.0f bytes written in %.6f s (%.3f GB/s, streamed, fsync'ed)", bytes, tw, bytes / tw / 1e9);
    char hex[LK_DIGEST_HEX], first[LK_DIGEST_HEX] = "";
    for (long r = 0; r < repeat; r++) {
        lk_st *st;
        t0 = lk_now_s();
        if (lk_st_open(p_big, &st)) goto out;
        lk_status s = lk_digest_st(st, hex);
        lk_st_close(st);
        t[r] = lk_now_s() - t0;
        if (s) goto out;
        if (r == 0) memcpy(first, hex, sizeof hex);
        else if (strcmp(first, hex)) {
            lk_error(LK_ERR_STATE, "bench: digest differs between runs (%s vs %s)", first, hex);
            goto out;
        }
    }
    double first_run = t[0];
    qsort(t, (size_t)repeat, sizeof *t, lk_bench_cmp_double);
    report(json, "digest",
           "\"bytes\":%.0f,\"runs\":%ld,\"seconds_first\":%.6f,\"seconds_min\":%.6f,\"gb_per_s\":%.3f,\"digest\":\"%s\"",
           "%.0f bytes, %ld runs: first %.6f s, min %.6f s, %.3f GB/s (%s)", bytes, repeat, first_run, t[0],
           bytes / t[0] / 1e9, hex);
    unlink(p_big);
    if (bench_fuse_file(json, dir, size_mb, repeat < 3 ? repeat : 3)) goto out;
    rc = LK_EXIT_OK;
out:
    free(t);
    unlink(p_index);
    unlink(p_big);
    rmdir(dir);
    return rc == LK_EXIT_OK ? rc : lk_cli_fail();
}
