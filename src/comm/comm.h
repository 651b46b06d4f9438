/* comm/comm.h — what lk_comm offers lorakit's own layers beyond
 * lorakit/comm.h (internal, not installed). */
#ifndef LK_COMM_COMM_H
#define LK_COMM_COMM_H

#include "lorakit/comm.h"

/* Called on the root of lk_comm_bcastv_ready before each transport
 * operation that reads segments [0, upto): it returns once those bytes are
 * final (the tracker waits there for the fuse of the keys they hold). It
 * cannot fail: the other ranks are already in the collective. */
typedef void (*lk_comm_ready_fn)(void *arg, size_t upto);

/* Called on every rank of lk_comm_bcastv_ready while an operation it
 * started is still in flight: does one unit of the caller's work and
 * returns 1, or returns 0 when it has none left (the backend then waits).
 * It must not touch the segments or call lk_comm. */
typedef int (*lk_comm_idle_fn)(void *arg);

/* lk_comm_bcastv, with ready (may be NULL) called on the root as above.
 * The transport operations, and so what every rank does, are the same as
 * lk_comm_bcastv's: only the root's moment of starting each one moves.
 * With idle (not NULL, on every rank alike), a backend that can starts
 * the operations without blocking (MPI: MPI_Ibcast, a few in flight) and
 * runs idle while they move; every operation is complete on return. */
lk_status lk_comm_bcastv_ready(lk_comm *c, const lk_comm_seg *seg, size_t nseg, int root, lk_comm_ready_fn ready,
                               lk_comm_idle_fn idle, void *arg);

/* lk_comm_agree and an element-wise minimum of v[0..n) (n <= 7) over the
 * ranks in the same collective: one allreduce where the two would take
 * two. v is reduced whatever the statuses (a failing rank's values count
 * too); on a failure the result is lk_comm_agree's. */
lk_status lk_comm_agree_min(lk_comm *c, lk_status local, uint64_t *v, size_t n);

/* lk_comm_same_bytes, handing back what it gathered: all (the caller's,
 * n * item_bytes * size bytes; not NULL) gets every rank's items, rank r's
 * at r * n * item_bytes, and nothing is allocated here. The same
 * collectives, checks, messages and *out as lk_comm_same_bytes; a caller
 * that could not get all passes its error as local. */
lk_status lk_comm_same_bytes_all(lk_comm *c, lk_status local, const void *items, size_t item_bytes, size_t n,
                                 void *all, lk_comm_same *out);

/* The layout agreement of lk_comm_average_f32 (one allreduce over FNV-1a
 * of n and the counts, and the total), for a caller that averages the same
 * layout its own way with the same collectives (src/lora/average_dev.c, on
 * device buffers): LK_ERR_MISMATCH on every rank when the ranks differ. */
lk_status lk_comm_average_layout(lk_comm *c, const size_t *counts, size_t n, size_t total);

/* The buffers of an average as one stream of floats (cut into buckets):
 * the cursor is the next float, bufs[k][off]. */
typedef struct lk_comm_cursor {
    float *const *bufs;
    const size_t *counts;
    size_t n, k, off;
} lk_comm_cursor;
/* Moves past empty buffers. */
void lk_comm_cursor_skip(lk_comm_cursor *q);
/* The next run of at most len floats at q (inside one buffer) into *p,
 * its length returned (0 at the end); q advances past it. */
size_t lk_comm_cursor_run(lk_comm_cursor *q, size_t len, float **p);
/* An average's request checked (NULL buffers: LK_ERR_ARG naming the index)
 * and measured: *total floats, *nonempty buffers. */
lk_status lk_comm_average_check(float *const *bufs, const size_t *counts, size_t n, size_t *total, size_t *nonempty);

#endif
