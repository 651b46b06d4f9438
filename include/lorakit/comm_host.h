/* lorakit/comm_host.h — an lk_comm whose collectives the embedding program
 * supplies as function pointers (the `host` backend).
 *
 * A C/C++ host that already has a transport (NCCL, UCC, gloo, its own
 * sockets; torch.distributed from Python) wraps it once and hands the
 * lk_comm to the tracker, gradient sync, mesh and check functions. lorakit
 * keeps the same guarantees as over MPI: before any collective whose size
 * depends on a rank's data, the ranks agree on it with fixed-size
 * collectives (lk_comm_agree, the tracker's request hash, the sync's layout
 * hash), so ranks asking for different things all get LK_ERR_MISMATCH and
 * none waits in a collective the others never join.
 *
 * What the host promises: every callback is collective over the same group
 * of `size` processes, in call order (the host's collectives on this group
 * are issued only by lorakit while lorakit is inside one of its calls, or
 * the host orders them itself), with the sizes lorakit passes (equal on
 * every rank). A callback returns LK_OK, or a failure status with
 * lk_error() set; lorakit then returns LK_ERR_COMM naming the operation. A
 * transport that can fail on one rank only (a local error before the bytes
 * move) must still not leave the others waiting forever: give its
 * collectives a timeout. The callbacks run on the thread that called
 * lorakit (never on the fuse threads). */
#ifndef LORAKIT_COMM_HOST_H
#define LORAKIT_COMM_HOST_H

#include <stddef.h>
#include <stdint.h>

#include "lorakit/comm.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Element types of a host allreduce. */
typedef enum lk_comm_dtype { LK_COMM_F32, LK_COMM_U64 } lk_comm_dtype;

typedef struct lk_comm_host_ops {
    /* Required. */
    lk_status (*barrier)(void *ctx);
    /* n bytes from rank root into buf on every rank. */
    lk_status (*bcast)(void *ctx, void *buf, size_t n, int root);
    /* In place, n elements of dtype; op is LK_REDUCE_SUM for F32 and any
     * of SUM/MIN/MAX for U64 (unsigned order; a transport with only signed
     * 64-bit integers may flip the top bit around a signed min/max). */
    lk_status (*allreduce)(void *ctx, void *buf, size_t n, lk_comm_dtype dtype, lk_reduce_op op);
    /* n bytes from every rank into recv (size * n bytes, rank order).
     * send may lie inside recv at this rank's block. */
    lk_status (*allgather)(void *ctx, const void *send, size_t n, void *recv);

    /* Optional non-blocking broadcast (all three or none): ibcast starts a
     * broadcast and sets *req; test sets *done (never blocks); wait
     * completes it. Each started request is tested/waited until done
     * exactly once. With them, the tracker fuses its next keys while the
     * previous ones move; without them, each broadcast blocks (the
     * documented fallback: same bytes, no overlap). */
    lk_status (*ibcast)(void *ctx, void *buf, size_t n, int root, void **req);
    lk_status (*test)(void *ctx, void *req, int *done);
    lk_status (*wait)(void *ctx, void *req);

    /* Optional: ranks with equal color form a new communicator ordered by
     * key (ties by rank); a negative color gets *out = NULL. The host
     * makes the new group and wraps it with lk_comm_from_host. NULL:
     * lk_comm_split (and so lk_mesh over this communicator) fails with
     * LK_ERR_UNSUPPORTED on every rank. */
    lk_status (*split)(void *ctx, int color, int key, lk_comm **out);

    /* Optional: called by lk_comm_free (and when lk_comm_from_host fails
     * after taking ctx), to release ctx. */
    void (*destroy)(void *ctx);

    /* Largest byte count one callback receives (0: no limit); lorakit
     * splits larger operations into rounds. */
    size_t max_bytes;

    /* Optional: the communicator's collective timeout (lorakit/comm.h,
     * lk_comm_set_timeout; 0 = none), told at creation and on every
     * change. lorakit cannot interrupt a host callback: the host applies
     * the timeout to its own collectives (and to wait), and a callback
     * that gives up returns LK_ERR_TIMEOUT with lk_error() set, naming the
     * operation and, if the transport knows, the ranks it waited for;
     * lorakit passes LK_ERR_TIMEOUT on (the communicator is unusable
     * afterwards, as over MPI). NULL: the host's collectives keep their own
     * timeouts, if any. */
    void (*set_timeout)(void *ctx, double seconds);
} lk_comm_host_ops;

/* Wraps a host transport as an lk_comm of `size` ranks where this process
 * is `rank`. ops is copied; ctx is passed to every callback. Collective:
 * every rank calls it (it agrees on the size, max_bytes and whether the
 * optional callbacks exist, so every rank makes the same calls later), and
 * it fails on every rank when any rank's arguments are invalid. On failure
 * ops->destroy(ctx) has been called (when given). */
lk_status lk_comm_from_host(const lk_comm_host_ops *ops, void *ctx, int rank, int size, lk_comm **out);

/* The ctx of a host communicator (NULL for other backends). */
void *lk_comm_host_ctx(const lk_comm *c);

#ifdef __cplusplus
}
#endif
#endif
