/* lorakit/mesh.h — a 1-D or 2-D device mesh (replicate x shard) over a
 * communicator. Rank r sits at (r / shard, r % shard). Dim 0 ("replicate")
 * groups the ranks with the same shard index, dim 1 ("shard") the ranks with
 * the same replicate index. Every sub-communicator is built up front by all
 * ranks in lk_mesh_create, so later collectives never need a split. */
#ifndef LORAKIT_MESH_H
#define LORAKIT_MESH_H

#include "lorakit/comm.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct lk_mesh lk_mesh;

#define LK_MESH_REPLICATE 0
#define LK_MESH_SHARD 1

/* replicate * shard must equal lk_comm_size(world); shard == 1 gives a 1-D
 * mesh of replicas (dim 1 then exists with size 1). The mesh borrows world
 * (which must outlive it). Collective; the ranks first agree on the shape,
 * so differing arguments are LK_ERR_MISMATCH on every rank, never a hang. */
lk_status lk_mesh_create(lk_comm *world, int replicate, int shard, lk_mesh **out);
void lk_mesh_free(lk_mesh *m);
int lk_mesh_ndim(const lk_mesh *m);           /* 1 or 2 */
int lk_mesh_dim_size(const lk_mesh *m, int dim);
lk_comm *lk_mesh_dim_comm(lk_mesh *m, int dim); /* sub-communicator of dim */
lk_comm *lk_mesh_world(lk_mesh *m);
/* This rank's index along dim (its rank in lk_mesh_dim_comm(m, dim)). */
int lk_mesh_coord(const lk_mesh *m, int dim);

#ifdef __cplusplus
}
#endif
#endif
