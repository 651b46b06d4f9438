/* sync.c — gradient averaging and replica checks for the adapter parameters.
 *
 * Adapter parameters are replicated on every mesh dim (as the reference's
 * Replicate() placements), so a gradient is averaged over each dim of size
 * > 1 in turn: sum over the dim's sub-communicator, then divide by its size.
 * The reference issues one allreduce per parameter from a walk over modules
 * and zero-fills a missing gradient so no rank skips a collective; here the
 * gradients already live in one zero-initialised buffer, so the same promise
 * holds by construction and the buffer goes out in a few large buckets:
 * O(buckets) collectives instead of O(parameters). Before the first sync of
 * a parameter set the ranks agree on its layout (one tiny allreduce, cached),
 * so ranks with different adapters fail together instead of mis-pairing
 * buckets or hanging. Uses only lk_comm: no MPI in this file. */
#include <stdio.h>
#include <string.h>
#include <xxhash.h>

#include "lorakit/alloc.h"
#include "lorakit/comm.h"
#include "lorakit/log.h"
#include "train_impl.h"

/* 4 MiB, measured (bench sync, 4 ranks on Open MPI shared memory): buckets
 * of 256 KiB to 4 MiB were at least as fast as one call per parameter,
 * 25 MiB buckets (DDP's GPU default) sometimes slower. Tunable per call
 * through lk_lora_sync_opts.bucket_bytes for other transports. */
#define DEFAULT_BUCKET_BYTES ((size_t)4 << 20)

lk_status lk_lora_params_agree(lk_lora_params *p, lk_comm *world) {
    if (lk_comm_size(world) <= 1 || p->agreed_world == (const void *)world) return LK_OK;
    /* max of x and of ~x gives max and ~min in one collective. */
    uint64_t h = lk_lora_params_layout_hash(p);
    uint64_t v[4] = {h, ~h, (uint64_t)p->numel, ~(uint64_t)p->numel};
    lk_status s = lk_comm_allreduce_u64(world, v, 4, LK_REDUCE_MAX);
    if (s != LK_OK) return lk_error_prefix(s, "LoRA parameters: agreeing on the layout");
    if (v[0] != ~v[1] || v[2] != ~v[3])
        return lk_error(LK_ERR_MISMATCH,
                        "the ranks hold different LoRA parameter sets (this rank: %zu tensors, "
                        "%zu floats; sizes across ranks range from %llu to %llu floats)",
                        p->count, p->numel, (unsigned long long)~v[3], (unsigned long long)v[2]);
    p->agreed_world = world;
    return LK_OK;
}

lk_status lk_lora_sync_grads_ex(lk_lora_params *p, lk_mesh *mesh, const lk_lora_sync_opts *opts,
                                size_t *synced, size_t *n_collectives) {
    if (synced) *synced = 0;
    if (n_collectives) *n_collectives = 0;
    if (!p) return lk_error(LK_ERR_ARG, "lk_lora_sync_grads: no parameters");
    if (!mesh) return LK_OK;
    lk_lora_sync_opts o = {0};
    if (opts) o = *opts;
    size_t bucket = (o.bucket_bytes ? o.bucket_bytes : DEFAULT_BUCKET_BYTES) / sizeof(float);
    if (bucket == 0) bucket = 1;
    int any = 0;
    for (int d = 0; d < lk_mesh_ndim(mesh); d++) any |= lk_mesh_dim_size(mesh, d) > 1;
    if (!any) return LK_OK;
    lk_status s = lk_lora_params_agree(p, lk_mesh_world(mesh));
    if (s != LK_OK) return s;
    size_t calls = 0;
    for (int d = 0; d < lk_mesh_ndim(mesh); d++) {
        int size = lk_mesh_dim_size(mesh, d);
        if (size <= 1) continue;
        lk_comm *c = lk_mesh_dim_comm(mesh, d);
        if (o.per_param) {
            for (size_t k = 0; k < p->count; k++) {
                size_t numel = (size_t)p->rows[k] * (size_t)p->cols[k];
                if ((s = lk_comm_allreduce_f32_sum(c, p->grad + p->offset[k], numel)) != LK_OK)
                    return lk_error_prefix(s, "LoRA gradient sync (%s, mesh dim %d)", p->names[k], d);
                calls++;
            }
        } else {
            for (size_t off = 0; off < p->numel; off += bucket) {
                size_t len = p->numel - off < bucket ? p->numel - off : bucket;
                if ((s = lk_comm_allreduce_f32_sum(c, p->grad + off, len)) != LK_OK)
                    return lk_error_prefix(s, "LoRA gradient sync (mesh dim %d)", d);
                calls++;
            }
        }
        /* Divide (as the reference's div_) rather than multiply by 1/size, so
         * a mean of equal values stays exactly that value. */
        float fs = (float)size;
        for (size_t i = 0; i < p->numel; i++) p->grad[i] /= fs;
    }
    if (synced) *synced = p->count;
    if (n_collectives) *n_collectives = calls;
    return LK_OK;
}

lk_status lk_lora_sync_grads(lk_lora_params *p, lk_mesh *mesh, size_t *synced) {
    return lk_lora_sync_grads_ex(p, mesh, NULL, synced, NULL);
}

lk_status lk_lora_check_replicas(lk_lora_params *p, lk_mesh *mesh, size_t *n_drifted) {
    if (n_drifted) *n_drifted = 0;
    if (!p) return lk_error(LK_ERR_ARG, "lk_lora_check_replicas: no parameters");
    if (!mesh) return LK_OK;
    lk_comm *world = lk_mesh_world(mesh);
    int size = lk_comm_size(world);
    if (size <= 1) return LK_OK;
    lk_status s = lk_lora_params_agree(p, world);
    if (s != LK_OK) return s;
    size_t n = p->count, all_bytes;
    if (!lk_checked_mul(n * sizeof(uint64_t), (size_t)size, &all_bytes))
        return lk_error(LK_ERR_NOMEM, "replica check: too many parameters");
    uint64_t *mine = lk_malloc(n * sizeof(uint64_t));
    uint64_t *all = lk_malloc(all_bytes);
    /* Allocation failure must not make this rank skip the collective. */
    lk_status local = (mine && all) ? LK_OK : lk_error(LK_ERR_NOMEM, "replica check: out of memory");
    s = lk_comm_agree(world, local);
    if (s != LK_OK) {
        lk_free(mine);
        lk_free(all);
        return s;
    }
    for (size_t k = 0; k < n; k++)
        mine[k] = XXH3_64bits(p->data + p->offset[k],
                              (size_t)p->rows[k] * (size_t)p->cols[k] * sizeof(float));
    s = lk_comm_allgather(world, mine, n * sizeof(uint64_t), all);
    if (s != LK_OK) {
        lk_free(mine);
        lk_free(all);
        return lk_error_prefix(s, "LoRA replica check");
    }
    size_t drifted = 0, first = 0;
    char ranks[256] = "";
    for (size_t k = 0; k < n; k++) {
        int differs = 0;
        for (int r = 1; r < size; r++) differs |= all[(size_t)r * n + k] != all[k];
        if (!differs) continue;
        if (drifted++ == 0) {
            first = k;
            size_t o = 0;
            for (int r = 1; r < size && o < sizeof ranks - 12; r++)
                if (all[(size_t)r * n + k] != all[k])
                    o += (size_t)snprintf(ranks + o, sizeof ranks - o, "%s%d", o ? ", " : "", r);
        }
    }
    lk_free(mine);
    lk_free(all);
    if (n_drifted) *n_drifted = drifted;
    if (drifted)
        return lk_error(LK_ERR_MISMATCH,
                        "LoRA replicas have drifted apart: %zu of %zu parameters differ across "
                        "ranks; first: %s (ranks differing from rank 0: %s)",
                        drifted, n, p->names[first], ranks);
    return LK_OK;
}
