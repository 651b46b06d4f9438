/* comm_impl.h — the backend vtable behind lk_comm (private to src/comm).
 *
 * A backend fills an lk_comm_ops table and allocates its lk_comm with
 * lk_comm_new; the public functions in comm.c check arguments once and
 * dispatch, so each backend only moves bytes. Counts reaching a backend are
 * already validated; backends split them as their transport requires. */
#ifndef LK_COMM_COMM_IMPL_H
#define LK_COMM_COMM_IMPL_H

#include "comm/comm_internal.h"
#include "lorakit/comm.h"

typedef struct lk_comm_ops {
    const char *name;
    void (*destroy)(lk_comm *c);
    lk_status (*barrier)(lk_comm *c);
    lk_status (*bcast)(lk_comm *c, void *buf, size_t n, int root);
    /* NULL: lk_comm_bcastv calls bcast once per segment. ready and idle
     * (may be NULL) as in lk_comm_bcastv_ready (comm_internal.h). */
    lk_status (*bcastv)(lk_comm *c, const lk_comm_seg *seg, size_t nseg, int root, lk_comm_ready_fn ready,
                        lk_comm_idle_fn idle, void *arg);
    lk_status (*allreduce_f32_sum)(lk_comm *c, float *buf, size_t n);
    lk_status (*allreduce_u64)(lk_comm *c, uint64_t *buf, size_t n, lk_reduce_op op);
    lk_status (*allgather)(lk_comm *c, const void *send, size_t n, void *recv);
    /* *out may be set to NULL for a rank with a negative color. */
    lk_status (*split)(lk_comm *c, int color, int key, lk_comm **out);
} lk_comm_ops;

struct lk_comm {
    const lk_comm_ops *ops;
    int rank;
    int size;
    void *impl; /* backend state */
};

/* The rank count an MPI launcher (mpirun, PMI/PMIx) announced in the
 * environment, 0 when none started this process. */
int lk_comm_launcher_size(void);

/* Allocates a communicator of the given backend (LK_ERR_NOMEM on failure). */
lk_status lk_comm_new(const lk_comm_ops *ops, int rank, int size, void *impl, lk_comm **out);

#endif
