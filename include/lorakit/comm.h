/* lorakit/comm.h — the communicator every distributed feature talks through.
 *
 * Two backends behind one vtable: `self` (one process, no MPI needed) and MPI
 * (see lorakit/comm_mpi.h, which is the only header that includes mpi.h).
 * All operations are collective over the communicator unless stated; any
 * size_t count works (the MPI backend splits past INT_MAX). */
#ifndef LORAKIT_COMM_H
#define LORAKIT_COMM_H

#include <stddef.h>
#include <stdint.h>
#include "lorakit/knobs.h"
#include "lorakit/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct lk_comm lk_comm;

typedef enum lk_reduce_op { LK_REDUCE_SUM, LK_REDUCE_MIN, LK_REDUCE_MAX } lk_reduce_op;

/* A one-process communicator (rank 0 of 1). */
lk_status lk_comm_self(lk_comm **out);
/* The one start-up path for programs (the lorakit CLI, benches, examples):
 * every process launched together, or just this one. Built with MPI:
 *   - MPI already initialized by the host: wraps MPI_COMM_WORLD;
 *   - started by an MPI launcher (mpirun, PMI/PMIx): initializes MPI and
 *     wraps MPI_COMM_WORLD (lk_comm_free of this communicator finalizes it);
 *   - otherwise: lk_comm_self, so a plain command never pays for an MPI
 *     singleton start.
 * Built without MPI: lk_comm_self, and LK_ERR_UNSUPPORTED when a launcher
 * started this process as one of several ranks. With more than one rank the
 * logger prefixes lines with the rank (lk_log_set_rank). argc/argv may be
 * NULL. A host that owns MPI's lifetime may use lk_comm_from_mpi instead. */
lk_status lk_comm_world(int *argc, char ***argv, lk_comm **out);
void lk_comm_free(lk_comm *c);

int lk_comm_rank(const lk_comm *c);
int lk_comm_size(const lk_comm *c);
/* "self", "mpi", "host" or "nccl". */
const char *lk_comm_backend(const lk_comm *c);
/* 1 when c's collectives take buffers in CUDA device memory (nccl, which
 * takes host memory too; see lorakit/comm_nccl.h); 0: host memory only, so
 * device bytes go through a host copy (the tracker's staging). */
int lk_comm_takes_cuda(const lk_comm *c);

lk_status lk_comm_barrier(lk_comm *c);
/* Broadcasts n bytes from root into buf on every rank. */
lk_status lk_comm_bcast(lk_comm *c, void *buf, size_t n, int root);
/* One piece of memory of a vectored broadcast. */
typedef struct lk_comm_seg {
    void *p;
    size_t n;
} lk_comm_seg;

/* Broadcasts the bytes of root's segments, in order, into every other
 * rank's segments: scattered memory moved with no staging copy by the
 * caller (MPI: one derived datatype per round). Every rank must pass the
 * same number of segments with the same lengths (the addresses differ). */
lk_status lk_comm_bcastv(lk_comm *c, const lk_comm_seg *seg, size_t nseg, int root);
/* In-place elementwise sum of n floats over all ranks. */
lk_status lk_comm_allreduce_f32_sum(lk_comm *c, float *buf, size_t n);
/* In-place elementwise reduction of n u64s. */
lk_status lk_comm_allreduce_u64(lk_comm *c, uint64_t *buf, size_t n, lk_reduce_op op);
/* Each rank contributes n bytes; recv gets size*n bytes in rank order. */
lk_status lk_comm_allgather(lk_comm *c, const void *send, size_t n, void *recv);
/* Ranks with equal color form a new communicator ordered by key (ties by
 * rank). A rank passing a negative color joins none and gets *out = NULL. */
lk_status lk_comm_split(lk_comm *c, int color, int key, lk_comm **out);

/* ---- collective timeout (every backend honours it) ----
 *
 * A collective waits at most the communicator's timeout for the other
 * ranks: counted from the moment this rank starts it, a collective not
 * complete after `seconds` returns LK_ERR_TIMEOUT with a message naming
 * the operation, its number on this communicator ("collective #N", equal on
 * every rank), how long it waited, and, where the backend can tell, the
 * ranks it waited for and those that were waiting in it too (MPI asks the
 * other ranks; a rank that does not answer within a short grace is named as
 * waited for). Callers prefix their own context (the tracker its phase,
 * the CLI the plan step). Every rank that is waiting times out on its own
 * clock; a stalled rank reports nothing until it resumes.
 *
 * A collective cannot be cancelled: after LK_ERR_TIMEOUT the communicator
 * is unusable (every later call on it, and on communicators split from it
 * later, fails at once with LK_ERR_TIMEOUT repeating the first message),
 * and the transport may still write the timed-out collective's receive
 * buffers should the missing ranks arrive. The program should end:
 * lk_comm_abort ends every rank (the lorakit CLI reports on every rank that
 * can act, then aborts).
 *
 * Waiting never spins a core: backends poll with sleeps that grow from
 * 50 us to 1 ms, and to 10 ms once a wait has lasted a second (the extra
 * latency is at most about 1 ms, or 1% past the first second).
 *
 * Not covered: creating communicators (lk_comm_world, lk_comm_from_mpi,
 * lk_comm_split), which MPI offers only as blocking calls. */

/* The knob LK_KNOB_TIMEOUT_S (lorakit/knobs.h), 300 s: long enough for a
 * rank to load its adapters or fuse its largest key while the others wait,
 * short enough that a stalled job ends. */
#define LK_COMM_TIMEOUT_DEFAULT ((double)LK_KNOB_TIMEOUT_S_DEFAULT)

/* Sets c's timeout in seconds (0 = wait forever). Local: set the same value
 * on every rank. A new communicator starts at LK_COMM_TIMEOUT_DEFAULT; one
 * from lk_comm_split inherits its parent's. LK_ERR_ARG for a negative,
 * NaN or infinite value (use 0 for none). */
lk_status lk_comm_set_timeout(lk_comm *c, double seconds);
/* The timeout in seconds (0 = none). */
double lk_comm_timeout(const lk_comm *c);
/* Ends every process of c's job with exit code `code`, for a program after
 * an unrecoverable failure (LK_ERR_TIMEOUT: the collective cannot be
 * cancelled). MPI: MPI_Abort. Returns only where the backend cannot abort
 * the group (self, a host backend without an abort callback), with
 * LK_ERR_UNSUPPORTED: the caller then exits by itself. */
lk_status lk_comm_abort(lk_comm *c, int code);

/* Agreement on success, for operations where any rank may fail locally:
 * every rank passes its own status (its message in lk_last_error()). Returns
 * LK_OK on every rank when all passed LK_OK; otherwise every rank returns
 * the status of the lowest failing rank with the message
 * "rank R: <that rank's message>" (at one rank: local, message untouched).
 * Collective: call it on every path. */
lk_status lk_comm_agree(lk_comm *c, lk_status local);

/* Agreement on a layout (what a bucketed collective needs to pair up):
 * every rank passes a hash of its layout and its size; *same is 1 on every
 * rank when all passed the same pair. range (may be NULL) gets the smallest
 * and largest size, for the caller's message. One allreduce. */
lk_status lk_comm_agree_layout(lk_comm *c, uint64_t hash, uint64_t size, int *same, uint64_t range[2]);

/* The knob LK_KNOB_SYNC_BUCKET_MB's default, 4 MiB, measured (bench sync,
 * 4 ranks on Open MPI shared memory): buckets of 256 KiB to 4 MiB were at
 * least as fast as one call per parameter, 25 MiB buckets (DDP's GPU
 * default) sometimes slower. */
#define LK_COMM_AVERAGE_BUCKET_DEFAULT ((size_t)LK_KNOB_SYNC_BUCKET_MB_DEFAULT << 20)

/* Averages n float buffers over the ranks, in place: bufs[i] holds
 * counts[i] floats; each element becomes the sum over ranks divided by the
 * rank count (a division, as torch's div_, so equal values stay exact).
 * The buffers travel as one stream cut into buckets of at most bucket_bytes
 * (0: LK_COMM_AVERAGE_BUCKET_DEFAULT; one allreduce per bucket, a buffer
 * larger than a bucket spans several; a bucket inside one buffer is reduced
 * there, one that spans buffers through a staging copy), so many small
 * gradients cost a few collectives. The ranks first agree on the layout (n
 * and every count): a rank holding a different set makes it LK_ERR_MISMATCH
 * on every rank, nothing changed, never a hang. *n_collectives (may be
 * NULL) gets the number of bucket allreduces. */
lk_status lk_comm_average_f32(lk_comm *c, float *const *bufs, const size_t *counts, size_t n, size_t bucket_bytes,
                              size_t *n_collectives);

typedef struct lk_comm_average_opts {
    size_t bucket_bytes; /* as lk_comm_average_f32's */
    int layout_agreed;   /* 1: the caller has agreed on the layout over these
                            ranks already (lk_comm_agree_layout, e.g. once per
                            parameter set): no agreement here, and none at all
                            when no bucket needs staging */
} lk_comm_average_opts;

/* lk_comm_average_f32 with options (opts may be NULL: the defaults). */
lk_status lk_comm_average_f32_ex(lk_comm *c, float *const *bufs, const size_t *counts, size_t n,
                                 const lk_comm_average_opts *opts, size_t *n_collectives);

/* What lk_comm_same_bytes found (equal on every rank). */
typedef struct lk_comm_same {
    size_t n_differ; /* items where some rank's bytes differ from rank 0's */
    size_t first;    /* the first of them (n when none) */
    char ranks[256]; /* the ranks whose item `first` differs from rank 0's:
                        "1, 3" (cut short past about 240 characters) */
} lk_comm_same;

/* Do the ranks hold the same bytes? Each rank passes n items of item_bytes
 * each (digests of its own data) and the status of making them (message in
 * lk_last_error()): a failure on any rank, or no memory here, is every
 * rank's error as from lk_comm_agree ("rank R: ..."), before anything is
 * gathered. Then every rank's items are gathered and each compared with
 * rank 0's; rank0 (may be NULL; n * item_bytes) gets rank 0's items. Used
 * by the tracker's report, the LoRA replica check and the Python package. */
lk_status lk_comm_same_bytes(lk_comm *c, lk_status local, const void *items, size_t item_bytes, size_t n,
                             void *rank0, lk_comm_same *out);

#ifdef __cplusplus
}
#endif
#endif
