/* mesh.c — a 1-D or 2-D (replicate x shard) mesh over a communicator.
 *
 * Both sub-communicators are split up front, by all ranks, in
 * lk_mesh_create: a collective issued later by only some ranks (say, a
 * gradient sync over the replicate dim) then never needs a split that the
 * other ranks would have to join. The shape is agreed first (allreduce of
 * min and max), so ranks passing different shapes fail together. */
#include "lorakit/mesh.h"

#include "lorakit/alloc.h"

struct lk_mesh {
    lk_comm *world; /* borrowed */
    int dims[2];    /* replicate, shard */
    lk_comm *sub[2];
};

lk_status lk_mesh_create(lk_comm *world, int replicate, int shard, lk_mesh **out) {
    if (!world || !out) return lk_error(LK_ERR_ARG, "mesh: NULL argument");
    *out = NULL;
    int size = lk_comm_size(world), rank = lk_comm_rank(world);
    uint64_t v[4] = {(uint64_t)(uint32_t)replicate, (uint64_t)(uint32_t)shard,
                     (uint64_t)(uint32_t)replicate, (uint64_t)(uint32_t)shard};
    lk_status st = lk_comm_allreduce_u64(world, v, 2, LK_REDUCE_MIN);
    if (!st) st = lk_comm_allreduce_u64(world, v + 2, 2, LK_REDUCE_MAX);
    if (st) return st;
    if (v[0] != v[2] || v[1] != v[3])
        return lk_error(LK_ERR_MISMATCH, "mesh: ranks disagree on the shape (this rank asked for %d x %d)",
                        replicate, shard);
    if (replicate < 1 || shard < 1 || (long long)replicate * shard != size)
        return lk_error(LK_ERR_ARG, "mesh: %d x %d (replicate x shard) does not cover %d ranks",
                        replicate, shard, size);
    lk_mesh *m = lk_calloc(1, sizeof *m);
    lk_status local = m ? LK_OK : lk_error(LK_ERR_NOMEM, "mesh: out of memory");
    /* Every rank takes part in both splits even if its allocation or the
     * first split failed locally: skipping the second would leave the
     * others waiting in it. */
    lk_comm *sub[2] = {NULL, NULL};
    lk_status s0 = lk_comm_split(world, rank % shard, rank / shard, &sub[LK_MESH_REPLICATE]);
    lk_status s1 = lk_comm_split(world, rank / shard, rank % shard, &sub[LK_MESH_SHARD]);
    if (s1) local = s1;
    else if (s0) local = s0;
    st = lk_comm_agree(world, local);
    if (st) {
        lk_comm_free(sub[0]);
        lk_comm_free(sub[1]);
        lk_free(m);
        return st;
    }
    m->world = world;
    m->dims[0] = replicate;
    m->dims[1] = shard;
    m->sub[0] = sub[0];
    m->sub[1] = sub[1];
    *out = m;
    return LK_OK;
}

void lk_mesh_free(lk_mesh *m) {
    if (!m) return;
    lk_comm_free(m->sub[0]);
    lk_comm_free(m->sub[1]);
    lk_free(m);
}

int lk_mesh_ndim(const lk_mesh *m) { return m->dims[1] == 1 ? 1 : 2; }

int lk_mesh_dim_size(const lk_mesh *m, int dim) { return (dim == 0 || dim == 1) ? m->dims[dim] : 1; }

lk_comm *lk_mesh_dim_comm(lk_mesh *m, int dim) { return (dim == 0 || dim == 1) ? m->sub[dim] : NULL; }

lk_comm *lk_mesh_world(lk_mesh *m) { return m->world; }

int lk_mesh_coord(const lk_mesh *m, int dim) {
    return (dim == 0 || dim == 1) ? lk_comm_rank(m->sub[dim]) : 0;
}
