/* sync.c — gradient averaging and replica checks for the adapter parameters.
 *
 * Adapter parameters are replicated on every mesh dim (FastVideo's
 * training code places them with Replicate()), so a gradient is averaged over each dim of size
 * > 1 in turn: sum over the dim's sub-communicator, then divide by its size.
 * FastVideo issues one allreduce per parameter from a walk over modules
 * and zero-fills a missing gradient so no rank skips a collective; here the
 * gradients already live in one zero-initialised buffer, so the same promise
 * holds by construction and the buffer goes out in a few large buckets
 * (lk_comm_average_f32_ex, the library's one bucketed average):
 * O(buckets) collectives instead of O(parameters). Before the first sync of
 * a parameter set the ranks agree on its layout (one tiny allreduce, cached),
 * so ranks with different adapters fail together instead of mis-pairing
 * buckets or hanging. Uses only lk_comm: no MPI in this file. */
#include <string.h>
#include <xxhash.h>

#include "lorakit/alloc.h"
#include "lorakit/comm.h"
#include "lorakit/log.h"
#include "lora/params.h"

lk_status lk_lora_params_agree(lk_lora_params *p, lk_comm *world) {
    if (lk_comm_size(world) <= 1 || p->agreed_world == (const void *)world) return LK_OK;
    uint64_t range[2];
    int same = 0;
    lk_status s = lk_comm_agree_layout(world, lk_lora_params_layout_hash(p), p->numel, &same, range);
    if (s != LK_OK) return lk_error_prefix(s, "LoRA parameters: agreeing on the layout");
    if (!same)
        return lk_error(LK_ERR_MISMATCH,
                        "the ranks hold different LoRA parameter sets (this rank: %zu tensors, "
                        "%zu floats; sizes across ranks range from %llu to %llu floats)",
                        p->count, p->numel, (unsigned long long)range[0], (unsigned long long)range[1]);
    p->agreed_world = world;
    return LK_OK;
}

/* Bucketed: the whole gradient buffer as one lk_comm_average_f32 stream
 * (bucket_bytes, 0 = LK_COMM_AVERAGE_BUCKET_DEFAULT). per_param: one
 * average of one buffer per parameter, one allreduce each. */
lk_status lk_lora_sync_grads_ex(lk_lora_params *p, lk_mesh *mesh, const lk_lora_sync_opts *opts,
                                size_t *synced, size_t *n_collectives) {
    if (synced) *synced = 0;
    if (n_collectives) *n_collectives = 0;
    if (!p) return lk_error(LK_ERR_ARG, "lk_lora_sync_grads: no parameters");
    if (!mesh) return LK_OK;
    lk_lora_sync_opts o = {0};
    if (opts) o = *opts;
    int any = 0;
    for (int d = 0; d < lk_mesh_ndim(mesh); d++) any |= lk_mesh_dim_size(mesh, d) > 1;
    if (!any) return LK_OK;
    lk_status s = lk_lora_params_agree(p, lk_mesh_world(mesh));
    if (s != LK_OK) return s;
    size_t calls = 0, c1;
    for (int d = 0; d < lk_mesh_ndim(mesh); d++) {
        if (lk_mesh_dim_size(mesh, d) <= 1) continue;
        lk_comm *c = lk_mesh_dim_comm(mesh, d);
        if (o.per_param) {
            for (size_t k = 0; k < p->count; k++) {
                float *g = p->grad + p->offset[k];
                size_t numel = (size_t)p->rows[k] * (size_t)p->cols[k];
                const lk_comm_average_opts ao = {.bucket_bytes = numel * sizeof(float), .layout_agreed = 1};
                if ((s = lk_comm_average_f32_ex(c, &g, &numel, 1, &ao, &c1)) != LK_OK)
                    return lk_error_prefix(s, "LoRA gradient sync (%s, mesh dim %d)", p->names[k], d);
                calls += c1;
            }
        } else {
            const lk_comm_average_opts ao = {.bucket_bytes = o.bucket_bytes, .layout_agreed = 1};
            if ((s = lk_comm_average_f32_ex(c, &p->grad, &p->numel, 1, &ao, &c1)) != LK_OK)
                return lk_error_prefix(s, "LoRA gradient sync (mesh dim %d)", d);
            calls += c1;
        }
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
    size_t n = p->count;
    uint64_t *mine = lk_malloc(n ? n * sizeof(uint64_t) : 1);
    lk_status local = mine ? LK_OK : lk_error(LK_ERR_NOMEM, "replica check: out of memory");
    for (size_t k = 0; mine && k < n; k++)
        mine[k] = XXH3_64bits(p->data + p->offset[k], (size_t)p->rows[k] * (size_t)p->cols[k] * sizeof(float));
    lk_comm_same same;
    s = lk_comm_same_bytes(world, local, mine, sizeof *mine, n, NULL, &same);
    lk_free(mine);
    /* the transport's failures get this call's name; a rank's own is "rank R: ..." */
    if (s == LK_ERR_COMM || s == LK_ERR_TIMEOUT) return lk_error_prefix(s, "LoRA replica check");
    if (s != LK_OK) return s;
    size_t drifted = same.n_differ;
    if (n_drifted) *n_drifted = drifted;
    if (drifted)
        return lk_error(LK_ERR_MISMATCH,
                        "LoRA replicas have drifted apart: %zu of %zu parameters differ across "
                        "ranks; first: %s (ranks differing from rank 0: %s)",
                        drifted, n, p->names[same.first], same.ranks);
    return LK_OK;
}
