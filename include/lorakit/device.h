/* lorakit/device.h — where tensor memory lives, and how bytes and kernels
 * get there: allocation, copies, pinned host staging, streams, events and
 * kernel launches on three backends (the `device` layer, between core and
 * fuse; fuse and serve use it).
 *
 *   cpu     host memory (every tensor before round 4): copies are memcpy,
 *           streams and events complete at once.
 *   emul    an emulated device on the CPU: its own allocations (registered,
 *           so a copy whose device side is not an emul allocation is an
 *           error, as a host pointer handed to a GPU is), every copy
 *           explicit; a kernel launch runs the kernel's own per-thread body
 *           (compiled as C from the same source as the CUDA kernel) over
 *           the launch grid, on the calling thread. Streams are synchronous.
 *           How CI, which has no GPU, runs every device code path.
 *   cuda:N  an NVIDIA GPU through the CUDA runtime (built with
 *           LORAKIT_CUDA; the runtime is linked statically and finds the
 *           driver at run time, so the library loads and works everywhere
 *           and only `cuda` fails, plainly, where no driver or GPU exists).
 *
 * Copies take the device that owns the non-host side (D2D: both sides on
 * the one device). A NULL stream is the device's default stream and makes
 * the call synchronous (the call returns when the copy is done); with a
 * stream the copy is queued (host memory must then be pinned, from
 * lk_device_host_alloc, and stay alive until the stream is synchronised).
 * Errors name the device, the operation, the sizes and the backend's own
 * reason. */
#ifndef LORAKIT_DEVICE_H
#define LORAKIT_DEVICE_H

#include <stddef.h>
#include <stdint.h>
#include "lorakit/status.h"
#include "lorakit/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- names and availability ---- */

/* "cpu", "cuda" (= cuda:0), "cuda:N" (N a decimal 0..1023), "emul". Anything
 * else is LK_ERR_ARG naming the text and the valid forms. Parsing does not
 * check that the device exists (lk_device_check does). */
lk_status lk_device_parse(const char *text, lk_device *out);
/* "cpu", "cuda:N", "emul" into buf (at least LK_DEVICE_STR_MAX bytes). */
#define LK_DEVICE_STR_MAX 24
const char *lk_device_str(lk_device d, char *buf);
int lk_device_equal(lk_device a, lk_device b);
/* 1 when the library was built with the CUDA backend (LORAKIT_CUDA). */
int lk_device_cuda_built(void);
/* Number of CUDA devices this process can use (0 without a driver, without
 * a GPU, or without the CUDA backend). */
int lk_device_cuda_count(void);
/* LK_OK when d can be used now. cuda without the backend, without a driver
 * or without that device: LK_ERR_UNSUPPORTED with a message that starts
 * "cuda:N: no CUDA driver or device is available" and gives the runtime's
 * own reason in parentheses. */
lk_status lk_device_check(lk_device d);

/* ---- memory ---- */

/* Device memory of `bytes` (> 0; 0 gives NULL and LK_OK) on d: cpu and emul
 * align to 256 bytes like cudaMalloc. Not zeroed. */
lk_status lk_device_alloc(lk_device d, size_t bytes, void **ptr);
void lk_device_free(lk_device d, void *ptr);
/* Host memory for staging copies to and from d: page-locked (pinned) on
 * cuda, plain aligned host memory on cpu and emul. */
lk_status lk_device_host_alloc(lk_device d, size_t bytes, void **ptr);
void lk_device_host_free(lk_device d, void *ptr);
/* 1 when [ptr, ptr + bytes) lies inside one allocation of d made by
 * lk_device_alloc (emul: checked against its registry; cuda: asked of the
 * runtime; cpu: always 1). */
int lk_device_owns(lk_device d, const void *ptr, size_t bytes);

/* ---- streams and events ---- */

typedef struct lk_stream lk_stream; /* NULL: the device's default stream */
typedef struct lk_event lk_event;

lk_status lk_stream_create(lk_device d, lk_stream **out);
/* Wraps a stream the host program owns (cuda: a cudaStream_t, e.g. torch's
 * current stream; cpu/emul: native is ignored). lk_stream_free frees the
 * wrapper only. */
lk_status lk_stream_wrap(lk_device d, void *native, lk_stream **out);
void lk_stream_free(lk_stream *s);
/* The backend's handle (cuda: cudaStream_t), NULL for cpu/emul. */
void *lk_stream_native(const lk_stream *s);
lk_device lk_stream_device(const lk_stream *s);
/* Waits for everything queued on s (NULL: on d's default stream). */
lk_status lk_stream_sync(lk_device d, lk_stream *s);

lk_status lk_event_create(lk_device d, lk_event **out);
void lk_event_free(lk_event *e);
/* Records e on s (NULL: d's default stream, d being e's device). */
lk_status lk_event_record(lk_event *e, lk_stream *s);
lk_status lk_event_sync(lk_event *e);
/* Work queued on s after this call starts after e completes. */
lk_status lk_stream_wait_event(lk_stream *s, lk_event *e);
/* Seconds between two recorded, completed events (after lk_event_sync). */
lk_status lk_event_elapsed(const lk_event *start, const lk_event *end, double *seconds);

/* ---- copies ---- */

typedef enum lk_copy_kind {
    LK_COPY_H2D = 0, /* host -> device d */
    LK_COPY_D2H = 1, /* device d -> host */
    LK_COPY_D2D = 2  /* device d -> device d */
} lk_copy_kind;

/* Copies bytes on d, queued on s (NULL: synchronous). cpu: memcpy for every
 * kind. emul: the device side(s) must be emul allocations (LK_ERR_ARG
 * naming the pointer and size otherwise). Overlapping D2D ranges are
 * LK_ERR_ARG. */
lk_status lk_device_copy(lk_device d, void *dst, const void *src, size_t bytes, lk_copy_kind kind, lk_stream *s);
/* Sets bytes of device memory to the byte value (0..255), on s. */
lk_status lk_device_memset(lk_device d, void *dst, int value, size_t bytes, lk_stream *s);

/* A tensor's bytes moved between host and device: dst->data must hold
 * src->nbytes; the dtype and shape must agree (LK_ERR_SHAPE naming both
 * tensors). The direction comes from the tensors' device fields. */
lk_status lk_tensor_copy(lk_tensor *dst, const lk_tensor *src, lk_stream *s);

/* ---- kernels ---- */

/* A launch grid or block, as CUDA's dim3. */
typedef struct lk_dim3 {
    unsigned x, y, z;
} lk_dim3;

/* One thread's coordinates, handed to an emulated kernel's body. */
typedef struct lk_thread_idx {
    lk_dim3 block_idx, thread_idx, grid_dim, block_dim;
} lk_thread_idx;

/* A kernel, as its backends see it. `cuda` is the address of a __global__
 * function taking the argument struct by value (`__global__ void
 * k(args_t a)`), NULL when not built with CUDA; `emul` runs the same
 * per-thread body for one thread (the body, written once in a header with
 * host-and-device qualifiers, is what both call). Kernels never rely on
 * shared memory or barriers, so emul may run the threads one by one. */
typedef struct lk_kernel {
    const char *name;
    const void *cuda;
    void (*emul)(const void *args, const lk_thread_idx *t);
} lk_kernel;

/* Launches k on d over grid x block with the argument struct args
 * (args_size bytes, copied for the launch), queued on s. cuda: the CUDA
 * launch; emul: k->emul for every thread, block by block in order, before
 * returning; cpu: LK_ERR_ARG (kernels run on devices; host code calls the
 * CPU kernel). */
lk_status lk_device_launch(lk_device d, const lk_kernel *k, lk_dim3 grid, lk_dim3 block, const void *args,
                           size_t args_size, lk_stream *s);
/* Waits for all work on d. */
lk_status lk_device_sync(lk_device d);

/* ---- device memory in use ----
 * Bytes lk_device_alloc holds on d now (*in_use) and the most it has held
 * since the process started or the last lk_device_mem_peak_reset(d)
 * (*peak); either may be NULL. Counted for emul and cuda:0..15 (0 for the
 * cpu and higher indices); host staging (lk_device_host_alloc) is not
 * device memory and is not counted. */
void lk_device_mem_stats(lk_device d, uint64_t *in_use, uint64_t *peak);
void lk_device_mem_peak_reset(lk_device d);

/* ---- fingerprints ----
 * A 64-bit fingerprint of n bytes of d's memory, computed where the bytes
 * are (cuda, emul: kernels over the bytes, then 8 bytes copied to the
 * host; cpu: the same arithmetic on the host), so checking that a buffer
 * still holds what it held moves 8 bytes over PCIe instead of the buffer.
 * Not XXH3 (XXH3 is a sequential stripe-and-accumulate design; this is a
 * sum of independently mixed words, which a grid computes in any split):
 * per 8-byte little-endian word i (the last zero-padded)
 * h_i = mix64(w_i ^ mix64(i ^ seed)) with splitmix64's finaliser, summed
 * mod 2^64, then mixed with n (src/device/fingerprint.h gives the
 * constants). Any change within one word (any single bit flip) always
 * changes it; any other change with probability about 1 - 2^-64. The
 * value does not depend on the launch grid, the device or the stream:
 * equal bytes give equal fingerprints everywhere, on every backend.
 * scratch: lk_device_fingerprint_scratch(n) bytes of d's memory the call
 * may use (NULL: allocated and freed by the call); queued on s, complete
 * when the call returns. */
size_t lk_device_fingerprint_scratch(size_t n);
lk_status lk_device_fingerprint(lk_device d, const void *p, size_t n, void *scratch, lk_stream *s, uint64_t *h);
/* The same with the first pass's grid given (blocks >= 1; at most
 * lk_device_fingerprint_scratch(n) / 2048 with a scratch given): tests show the value does not
 * depend on it. */
lk_status lk_device_fingerprint_grid(lk_device d, const void *p, size_t n, unsigned blocks, void *scratch, lk_stream *s,
                                     uint64_t *h);

/* ---- what emul did (tests) ---- */

/* Running totals of the emulated device's copies (by lk_copy_kind: count
 * and bytes) and kernel launches since the process started, over every
 * thread. Tests read them before and after a call to assert where the bytes
 * went (e.g. a fuse on emul weights made no device->host copy). */
typedef struct lk_device_counts {
    uint64_t copies[3], bytes[3];
    uint64_t launches;
    uint64_t on_default, on_stream; /* copies + launches queued on the default stream (NULL) / on a given one */
    uint64_t last_tag; /* the handle lk_stream_wrap was given for the stream of the latest
                          copy or launch queued on a given stream (emul keeps it as a tag) */
} lk_device_counts;
void lk_device_emul_counts(lk_device_counts *out);

/* ---- what the device layer moved ----
 * Running totals of the copies (by lk_copy_kind: count and bytes) and
 * kernel launches since the process started, over every thread, for emul
 * and cuda:0..15 (zero for the cpu and higher indices): lk_device_copy
 * counts each copy it queued (a failed one is not counted). bench swap
 * reads them around a swap (the bytes that crossed PCIe on a GPU). */
void lk_device_counts_of(lk_device d, lk_device_counts *out);

#ifdef __cplusplus
}
#endif
#endif
