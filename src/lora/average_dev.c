/* average_dev.c — lk_lora_average_dev: the bucketed gradient average of
 * lk_comm_average_f32 on buffers in device memory (lorakit/lora.h).
 *
 * Why it is built this way: the host average (src/comm/replicas.c) fixes
 * the bytes by its collectives and bucket boundaries; this file issues the
 * very same collectives (agreement, layout agreement with the same hash,
 * one allreduce per bucket at the same boundaries), so ranks whose
 * gradients live on a device pair up with ranks on the host, and only the
 * moves differ: the allreduce on the device memory itself where the
 * communicator takes it, else through a pinned host stage; a bucket that
 * spans buffers gathered into a device stage; the division by the rank
 * count by a device kernel (average_dev.h, one IEEE division as on the
 * host). Everything is queued on the caller's stream, synchronised before
 * each allreduce (the transport may run on its own stream) and at the end. */
#include <string.h>

#include "comm/comm.h"
#include "lora/average_dev.h"
#include "lorakit/comm.h"
#include "lorakit/device.h"
#include "lorakit/lora.h"

#ifdef LK_HAVE_CUDA
const void *lk_avg_div_cuda(void); /* average_cuda.cu */
#define AVG_CUDA lk_avg_div_cuda()
#else
#define AVG_CUDA NULL
#endif

#define DIV_BLOCK 256u
#define DIV_MAX_GRID 65535u

static void div_emul(const void *args, const lk_thread_idx *t) {
    lk_avg_div_thread((const lk_avg_div_args *)args, t->block_idx.x, t->thread_idx.x, t->block_dim.x, t->grid_dim.x);
}

typedef struct avg {
    lk_comm *c;
    lk_device d;
    lk_stream *s;
    int direct;     /* the allreduce takes d's memory */
    float *hstage;  /* pinned host stage of one bucket (!direct) */
    float *dstage;  /* device stage of a bucket spanning buffers */
    float fs;
} avg;

/* p[0..len) on the device: summed over the ranks, then divided by fs. */
static lk_status reduce(const avg *a, float *p, size_t len) {
    lk_status s = lk_stream_sync(a->d, a->s);
    if (!s && a->direct) s = lk_comm_allreduce_f32_sum(a->c, p, len);
    if (!s && !a->direct) {
        s = lk_device_copy(a->d, a->hstage, p, len * sizeof *p, LK_COPY_D2H, a->s);
        if (!s) s = lk_stream_sync(a->d, a->s);
        if (!s) s = lk_comm_allreduce_f32_sum(a->c, a->hstage, len);
        if (!s) s = lk_device_copy(a->d, p, a->hstage, len * sizeof *p, LK_COPY_H2D, a->s);
    }
    if (s) return s;
    const lk_avg_div_args args = {p, len, a->fs};
    const lk_kernel k = {"lk_avg_div", AVG_CUDA, div_emul};
    size_t blocks = (len + DIV_BLOCK - 1) / DIV_BLOCK;
    lk_dim3 grid = {(unsigned)(blocks < DIV_MAX_GRID ? blocks : DIV_MAX_GRID), 1, 1}, block = {DIV_BLOCK, 1, 1};
    return lk_device_launch(a->d, &k, grid, block, &args, sizeof args, a->s);
}

/* len floats between the buffers at q and the device stage (to = 1: into
 * the buffers), device-to-device, advancing q. */
static lk_status move(const avg *a, lk_comm_cursor *q, size_t len, int to) {
    lk_status s = LK_OK;
    size_t done = 0, run;
    float *p;
    while (!s && done < len && (run = lk_comm_cursor_run(q, len - done, &p))) {
        float *st = a->dstage + done;
        s = lk_device_copy(a->d, to ? p : st, to ? st : p, run * sizeof *p, LK_COPY_D2D, a->s);
        done += run;
    }
    return s;
}

/* The stages (pinned host and device) a request needs, or the failure as
 * this rank's local status. */
static lk_status stages(avg *a, size_t total, size_t bucket, size_t nonempty) {
    const size_t one = total < bucket ? total : bucket;
    lk_status s = LK_OK;
    if (!a->direct && one) s = lk_device_host_alloc(a->d, one * sizeof(float), (void **)&a->hstage);
    if (!s && nonempty > 1 && one) s = lk_device_alloc(a->d, one * sizeof(float), (void **)&a->dstage);
    return s ? lk_error_prefix(s, "comm average on device: the staging buffers") : LK_OK;
}

static lk_status buckets(const avg *a, float *const *bufs, const size_t *counts, size_t n, size_t total, size_t bucket,
                         size_t *calls) {
    lk_comm_cursor in = {bufs, counts, n, 0, 0}, out = in;
    lk_status s = LK_OK;
    for (size_t left = total; !s && left; (*calls)++) {
        size_t len = left < bucket ? left : bucket;
        lk_comm_cursor_skip(&in);
        if (in.counts[in.k] - in.off >= len) { /* within one buffer: in place */
            s = reduce(a, in.bufs[in.k] + in.off, len);
            in.off += len;
            out = in;
        } else {
            s = move(a, &in, len, 0);
            if (!s) s = reduce(a, a->dstage, len);
            if (!s) s = move(a, &out, len, 1);
        }
        left -= len;
    }
    return s;
}

lk_status lk_lora_average_dev(lk_comm *c, lk_device d, float *const *bufs, const size_t *counts, size_t n,
                              const lk_lora_average_dev_opts *opts, size_t *n_collectives) {
    const lk_lora_average_dev_opts o = opts ? *opts : (lk_lora_average_dev_opts){0};
    if (d.kind == LK_DEVICE_CPU) return lk_comm_average_f32(c, bufs, counts, n, o.bucket_bytes, n_collectives);
    if (n_collectives) *n_collectives = 0;
    size_t bucket = (o.bucket_bytes ? o.bucket_bytes : LK_COMM_AVERAGE_BUCKET_DEFAULT) / sizeof(float), total, nonempty;
    if (bucket == 0) bucket = 1;
    lk_status local = lk_comm_average_check(bufs, counts, n, &total, &nonempty);
    for (size_t i = 0; !local && i < n; i++)
        if (counts[i] && !lk_device_owns(d, bufs[i], counts[i] * sizeof(float))) {
            char dn[LK_DEVICE_STR_MAX];
            local = lk_error(LK_ERR_ARG, "comm average: buffer %zu (%zu floats) is not %s memory", i, counts[i],
                             lk_device_str(d, dn));
        }
    if (!local) local = lk_device_check(d);
    if (lk_comm_size(c) <= 1) return local;
    avg a = {c, d, o.stream, o.comm_takes_device || (d.kind == LK_DEVICE_CUDA && lk_comm_takes_cuda(c)), NULL, NULL,
             (float)lk_comm_size(c)};
    if (!local) local = stages(&a, total, bucket, nonempty);
    /* the collectives of lk_comm_average_f32 (layout_agreed = 0): agree, the layout, the buckets */
    lk_status s = lk_comm_agree(c, local);
    if (!s) s = lk_comm_average_layout(c, counts, n, total);
    size_t calls = 0;
    if (!s) s = buckets(&a, bufs, counts, n, total, bucket, &calls);
    lk_status done = lk_stream_sync(d, o.stream); /* before the stages go */
    if (!s) s = done;
    lk_device_host_free(d, a.hstage);
    lk_device_free(d, a.dstage);
    if (!s && n_collectives) *n_collectives = calls;
    return s;
}
