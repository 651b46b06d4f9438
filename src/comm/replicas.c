/* replicas.c — collectives over data that every rank holds a copy of:
 * agreeing on a layout, averaging float buffers in buckets, and asking
 * whether the ranks hold the same bytes.
 *
 * One place for each, built only on lk_comm's primitive collectives, so the
 * tracker's report, LoRA gradient sync and replica checks (src/lora/sync.c)
 * and the Python package's sync_grads / check_replicas share one algorithm:
 * the same collectives in the same order, the same bucket boundaries (an
 * allreduce's summation order may depend on its length, so the boundaries
 * fix the bytes), the same division. */
#include <stdio.h>
#include <string.h>

#include "comm/backend.h"
#include "comm/comm.h"
#include "lorakit/alloc.h"

/* ---- layout agreement ---- */

lk_status lk_comm_agree_layout(lk_comm *c, uint64_t hash, uint64_t size, int *same, uint64_t range[2]) {
    /* max of x and of ~x gives max and ~min in one collective */
    uint64_t v[4] = {hash, ~hash, size, ~size};
    lk_status s = lk_comm_allreduce_u64(c, v, 4, LK_REDUCE_MAX);
    if (s) return s;
    *same = v[0] == ~v[1] && v[2] == ~v[3];
    if (range) {
        range[0] = ~v[3];
        range[1] = v[2];
    }
    return LK_OK;
}

/* The layout of an lk_comm_average_f32 request: FNV-1a over n and counts. */
static uint64_t counts_hash(const size_t *counts, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i <= n; i++) {
        uint64_t v = i < n ? (uint64_t)counts[i] : (uint64_t)n;
        for (int b = 0; b < 8; b++) {
            h ^= (v >> (8 * b)) & 0xff;
            h *= 1099511628211ull;
        }
    }
    return h;
}

/* ---- the bucketed average ---- */

void lk_comm_cursor_skip(lk_comm_cursor *q) {
    while (q->k < q->n && q->off == q->counts[q->k]) q->k++, q->off = 0;
}

size_t lk_comm_cursor_run(lk_comm_cursor *q, size_t len, float **p) {
    lk_comm_cursor_skip(q);
    if (q->k >= q->n) return 0;
    size_t run = q->counts[q->k] - q->off < len ? q->counts[q->k] - q->off : len;
    *p = q->bufs[q->k] + q->off;
    q->off += run;
    return run;
}

lk_status lk_comm_average_check(float *const *bufs, const size_t *counts, size_t n, size_t *total, size_t *nonempty) {
    *total = *nonempty = 0;
    if (n && (!bufs || !counts)) return lk_error(LK_ERR_ARG, "comm average: NULL buffers");
    for (size_t i = 0; i < n; i++) {
        if (!bufs[i] && counts[i]) return lk_error(LK_ERR_ARG, "comm average: buffer %zu is NULL", i);
        *total += counts[i];
        *nonempty += counts[i] != 0;
    }
    return LK_OK;
}

lk_status lk_comm_average_layout(lk_comm *c, const size_t *counts, size_t n, size_t total) {
    uint64_t range[2];
    int same = 0;
    lk_status s = lk_comm_agree_layout(c, counts_hash(counts, n), total, &same, range);
    if (!s && !same)
        s = lk_error(LK_ERR_MISMATCH, "comm average: the ranks hold different buffer sets (this rank: %zu "
                     "buffers, %zu floats; totals across ranks range from %llu to %llu floats)", n, total,
                     (unsigned long long)range[0], (unsigned long long)range[1]);
    return s;
}

/* Copies (to = 1: into the stream, averaged) up to len floats between the
 * stream and stage, advancing the cursor; returns the count. */
static size_t move(lk_comm_cursor *q, float *stage, size_t len, int to, float fs) {
    size_t done = 0, run;
    float *p;
    while (done < len && (run = lk_comm_cursor_run(q, len - done, &p))) {
        if (to)
            for (size_t j = 0; j < run; j++) p[j] = stage[done + j] / fs;
        else
            memcpy(stage + done, p, run * sizeof *stage);
        done += run;
    }
    return done;
}

lk_status lk_comm_average_f32_ex(lk_comm *c, float *const *bufs, const size_t *counts, size_t n,
                                 const lk_comm_average_opts *opts, size_t *n_collectives) {
    if (n_collectives) *n_collectives = 0;
    const lk_comm_average_opts o = opts ? *opts : (lk_comm_average_opts){0};
    size_t bucket = (o.bucket_bytes ? o.bucket_bytes : LK_COMM_AVERAGE_BUCKET_DEFAULT) / sizeof(float), total, nonempty;
    if (bucket == 0) bucket = 1;
    lk_status local = lk_comm_average_check(bufs, counts, n, &total, &nonempty);
    if (lk_comm_size(c) <= 1) return local;
    /* a bucket within one buffer is reduced in place; only buckets that
     * span buffers go through the staging copy */
    size_t stage_n = nonempty > 1 ? (total < bucket ? total : bucket) : 0;
    float *stage = local || !stage_n ? NULL : lk_malloc(stage_n * sizeof *stage);
    if (!local && stage_n && !stage)
        local = lk_error(LK_ERR_NOMEM, "comm average: out of memory for a %zu-float bucket", stage_n);
    lk_status s = LK_OK;
    if (!o.layout_agreed || stage_n || local) s = lk_comm_agree(c, local);
    if (!s && !o.layout_agreed) s = lk_comm_average_layout(c, counts, n, total);
    const float fs = (float)lk_comm_size(c);
    size_t calls = 0;
    lk_comm_cursor in = {bufs, counts, n, 0, 0}, out = in;
    for (size_t left = total; !s && left;) {
        size_t len = left < bucket ? left : bucket;
        lk_comm_cursor_skip(&in);
        if (in.counts[in.k] - in.off >= len) { /* within one buffer: in place */
            float *p = in.bufs[in.k] + in.off;
            if ((s = lk_comm_allreduce_f32_sum(c, p, len))) break;
            for (size_t j = 0; j < len; j++) p[j] /= fs;
            in.off += len;
            out = in;
        } else {
            move(&in, stage, len, 0, fs);
            if ((s = lk_comm_allreduce_f32_sum(c, stage, len))) break;
            move(&out, stage, len, 1, fs);
        }
        calls++;
        left -= len;
    }
    lk_free(stage);
    if (!s && n_collectives) *n_collectives = calls;
    return s;
}

lk_status lk_comm_average_f32(lk_comm *c, float *const *bufs, const size_t *counts, size_t n, size_t bucket_bytes,
                              size_t *n_collectives) {
    const lk_comm_average_opts o = {.bucket_bytes = bucket_bytes};
    return lk_comm_average_f32_ex(c, bufs, counts, n, &o, n_collectives);
}

/* ---- do the ranks hold the same bytes ---- */

lk_status lk_comm_same_bytes_all(lk_comm *c, lk_status local, const void *items, size_t item_bytes, size_t n,
                                 void *all, lk_comm_same *out) {
    if (!c || !out) return lk_error(LK_ERR_ARG, "comm same bytes: NULL communicator or result");
    memset(out, 0, sizeof *out);
    out->first = n;
    const size_t size = (size_t)lk_comm_size(c);
    size_t mine = 0, all_bytes = 0;
    if (!local && (!lk_checked_mul(n, item_bytes, &mine) || !lk_checked_mul(mine, size, &all_bytes)))
        local = lk_error(LK_ERR_ARG, "comm same bytes: %zu items of %zu bytes x %zu ranks overflows", n, item_bytes,
                         size);
    if (!local && mine && !items) local = lk_error(LK_ERR_ARG, "comm same bytes: NULL items");
    if (!local && !all) local = lk_error(LK_ERR_ARG, "comm same bytes: NULL gather buffer");
    /* a rank that failed to make its items, or to get memory, still joins:
     * every rank returns its error before anything is gathered */
    lk_status s = lk_comm_agree(c, local);
    if (!s) s = lk_comm_allgather(c, items, mine, all);
    for (size_t k = 0; !s && k < n; k++) {
        const unsigned char *a = all, *r0 = a + k * item_bytes;
        int differs = 0;
        for (size_t r = 1; r < size; r++) differs |= memcmp(a + r * mine + k * item_bytes, r0, item_bytes) != 0;
        if (!differs || out->n_differ++) continue;
        out->first = k;
        size_t o = 0;
        for (size_t r = 1; r < size && o < sizeof out->ranks - 12; r++)
            if (memcmp(a + r * mine + k * item_bytes, r0, item_bytes))
                o += (size_t)snprintf(out->ranks + o, sizeof out->ranks - o, "%s%zu", o ? ", " : "", r);
    }
    return s;
}

lk_status lk_comm_same_bytes(lk_comm *c, lk_status local, const void *items, size_t item_bytes, size_t n,
                             void *rank0, lk_comm_same *out) {
    if (!c || !out) return lk_error(LK_ERR_ARG, "comm same bytes: NULL communicator or result");
    size_t mine = 0, all_bytes = 0;
    /* the sizes' and items' checks are lk_comm_same_bytes_all's: nothing is allocated before they pass */
    int fits = lk_checked_mul(n, item_bytes, &mine) && lk_checked_mul(mine, (size_t)lk_comm_size(c), &all_bytes);
    unsigned char *all = local || !fits || (mine && !items) ? NULL : lk_malloc(all_bytes ? all_bytes : 1);
    if (!local && fits && (!mine || items) && !all)
        local = lk_error(LK_ERR_NOMEM, "comm same bytes: out of memory for %zu bytes", all_bytes);
    lk_status s = lk_comm_same_bytes_all(c, local, items, item_bytes, n, all, out);
    if (!s && rank0 && mine) memcpy(rank0, all, mine);
    lk_free(all);
    return s;
}
