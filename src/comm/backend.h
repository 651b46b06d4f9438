/* comm/backend.h — the backend vtable behind lk_comm (private to src/comm).
 *
 * A backend fills an lk_comm_ops table and allocates its lk_comm with
 * lk_comm_new; the public functions in comm.c check arguments once and
 * dispatch, so each backend only moves bytes. Counts reaching a backend are
 * already validated; backends split them as their transport requires. */
#ifndef LK_COMM_BACKEND_H
#define LK_COMM_BACKEND_H

#include "comm/comm.h"
#include "lorakit/comm.h"

typedef struct lk_comm_ops {
    const char *name;
    void (*destroy)(lk_comm *c);
    lk_status (*barrier)(lk_comm *c);
    lk_status (*bcast)(lk_comm *c, void *buf, size_t n, int root);
    /* NULL: lk_comm_bcastv calls bcast once per segment. ready and idle
     * (may be NULL) as in lk_comm_bcastv_ready (comm/comm.h). */
    lk_status (*bcastv)(lk_comm *c, const lk_comm_seg *seg, size_t nseg, int root, lk_comm_ready_fn ready,
                        lk_comm_idle_fn idle, void *arg);
    lk_status (*allreduce_f32_sum)(lk_comm *c, float *buf, size_t n);
    lk_status (*allreduce_u64)(lk_comm *c, uint64_t *buf, size_t n, lk_reduce_op op);
    lk_status (*allgather)(lk_comm *c, const void *send, size_t n, void *recv);
    /* *out may be set to NULL for a rank with a negative color. */
    lk_status (*split)(lk_comm *c, int color, int key, lk_comm **out);
    /* May be NULL (lk_comm_abort then returns LK_ERR_UNSUPPORTED). */
    void (*abort)(lk_comm *c, int code);
    /* May be NULL: called after c->timeout changed (a backend whose waits
     * happen in a transport it does not run, e.g. the host's). */
    void (*timeout_changed)(lk_comm *c);
} lk_comm_ops;

/* Backends honour the timeout (lorakit/comm.h) in their waits: every wait
 * for a transport operation is an lk_comm_wait loop (poll, then
 * lk_comm_wait_pause), and on lk_comm_wait_expired the backend returns
 * LK_ERR_TIMEOUT with lk_comm_timeout_error's message. The dispatch layer
 * (comm.c) then marks the communicator unusable. */
struct lk_comm {
    const lk_comm_ops *ops;
    int rank;
    int size;
    void *impl;        /* backend state */
    double timeout;    /* seconds, 0 = none */
    uint64_t seq;      /* collectives started on this communicator (equal on every rank) */
    const char *op;    /* the collective in progress (its name), for reports */
    int dead;          /* a collective timed out: every later call fails */
    int cuda_buffers;  /* collectives take CUDA device memory (lk_comm_takes_cuda) */
    char dead_msg[1024];
};

/* One wait for one transport operation. */
typedef struct lk_comm_wait {
    double t0;    /* when the operation started (lk_now_s) */
    double pause; /* the next sleep, seconds (0: none yet) */
} lk_comm_wait;

/* Starts the clock of a wait (call it when the operation is started). */
void lk_comm_wait_start(lk_comm_wait *w);
/* Sleeps before the next poll: 50 us, doubling to 1 ms; 10 ms once the wait
 * has lasted a second. */
void lk_comm_wait_pause(lk_comm_wait *w);
/* 1 when c has a timeout and it has passed since w started. */
int lk_comm_wait_expired(const lk_comm *c, const lk_comm_wait *w);
/* Records LK_ERR_TIMEOUT "comm <backend> <op> (collective #N on this
 * communicator): timed out after S s<detail>" and returns it; detail (may
 * be NULL or "") names the ranks, e.g. "; waiting for rank 1 (no answer)". */
lk_status lk_comm_timeout_error(const lk_comm *c, const lk_comm_wait *w, const char *detail);

/* The rank count an MPI launcher (mpirun, PMI/PMIx) announced in the
 * environment, 0 when none started this process. */
int lk_comm_launcher_size(void);

/* Allocates a communicator of the given backend (LK_ERR_NOMEM on failure). */
lk_status lk_comm_new(const lk_comm_ops *ops, int rank, int size, void *impl, lk_comm **out);

#endif
