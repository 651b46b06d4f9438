/* lorakit/comm_nccl.h — the `nccl` backend of lk_comm: collectives on CUDA
 * device memory through NCCL.
 *
 * Built when NCCL's and the CUDA runtime's headers are found at configure
 * time; the libraries (libnccl.so.2, libcudart) are loaded when the first
 * NCCL communicator is made, so a lorakit built with NCCL runs unchanged on
 * machines without them. Built without NCCL, every function here returns
 * LK_ERR_UNSUPPORTED. This header does not include nccl.h.
 *
 * Every lk_comm operation works on an NCCL communicator, on device memory
 * (cudaMalloc'd, managed) straight, and on host memory (the agreements,
 * hashes, digests) through a small device staging buffer, so the tracker,
 * the gradient sync and the checks run over it unchanged. Operations are
 * issued on the communicator's stream (lk_comm_nccl_set_stream) and are
 * complete on return, as on every backend.
 *
 * Timeouts (lorakit/comm.h) use NCCL's non-blocking mode: a communicator
 * made here has blocking = 0, and a wait polls the stream and
 * ncclCommGetAsyncError with the growing sleeps every backend uses (never
 * spinning a core). Past the timeout the NCCL communicator is aborted
 * (ncclCommAbort: the GPU kernels of the timed-out collective stop, so,
 * unlike MPI, nothing writes the buffers later) and LK_ERR_TIMEOUT is
 * returned with the usual message; NCCL cannot say which ranks were
 * missing. A communicator handed in by the host (lk_comm_from_nccl) is
 * aborted too on a timeout: its collective could not complete otherwise. */
#ifndef LORAKIT_COMM_NCCL_H
#define LORAKIT_COMM_NCCL_H

#include "lorakit/comm.h"

#ifdef __cplusplus
extern "C" {
#endif

struct ncclComm; /* ncclComm_t is struct ncclComm * (nccl.h) */

/* 1 when this lorakit was built with the NCCL backend. */
int lk_comm_nccl_built(void);

/* The CUDA device a rank of a job uses by default: its local rank from
 * the launcher (OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID, SLURM_LOCALID,
 * LOCAL_RANK, in that order; 0 when none) modulo n_devices (> 0). */
int lk_comm_nccl_local_device(int n_devices);

/* Makes an NCCL communicator over the ranks of `boot` (any lk_comm: the MPI
 * world of `mpirun`, a host communicator): every rank selects CUDA device
 * `device` (-1: lk_comm_nccl_local_device of the visible device count),
 * rank 0 makes the ncclUniqueId and broadcasts it over boot, and every
 * rank joins with NCCL's non-blocking init, waiting at most boot's timeout.
 * Collective over boot; the ranks agree on success twice (before and after
 * the init), so a rank without the libraries, a driver or the device makes
 * every rank fail with its message ("rank R: comm nccl: no CUDA device:
 * ..."). The new communicator starts with boot's timeout; boot may be
 * freed afterwards. */
lk_status lk_comm_nccl_create(lk_comm *boot, int device, lk_comm **out);

/* Wraps an NCCL communicator the host program made (on CUDA device
 * `device`, its current device when it made it), issuing on `stream` (a
 * cudaStream_t; NULL: a stream made here). The host keeps the ncclComm_t:
 * lk_comm_free does not destroy it (after a timeout it is aborted, see
 * above). Local (no collective). A communicator in blocking mode cannot be
 * timed out once NCCL has taken a collective: give it blocking = 0. */
lk_status lk_comm_from_nccl(struct ncclComm *comm, int device, void *stream, lk_comm **out);

/* The stream an NCCL communicator issues on from now on (a cudaStream_t;
 * NULL: its own). Its collectives then follow the work already queued on
 * it (a framework's current stream: the kernels that wrote the buffers).
 * LK_ERR_ARG for a communicator of another backend. Local. */
lk_status lk_comm_nccl_set_stream(lk_comm *c, void *stream);

/* The CUDA device of an NCCL communicator, -1 for other backends. */
int lk_comm_nccl_device(const lk_comm *c);

#ifdef __cplusplus
}
#endif
#endif
