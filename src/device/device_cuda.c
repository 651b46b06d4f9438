/* device_cuda.c — the cuda backend of the device layer, on the CUDA runtime.
 *
 * Why the runtime is linked (statically, CUDA::cudart_static) and not
 * dlopen'ed: the kernels are compiled by nvcc, whose host code registers
 * them with cudart (__cudaRegisterFatBinary, cudaLaunchKernel); a dlopen'ed
 * libcudart would mean re-implementing that registration or moving to the
 * driver API with hand-embedded fatbins. The static runtime has no
 * libcudart.so dependency (the library loads on any machine, GPU or not),
 * finds libcuda.so.1 itself at the first CUDA call, and answers "driver
 * version is insufficient" or "no CUDA-capable device" when there is none:
 * lk_cuda_check turns that into lorakit's plain "no CUDA driver or device is
 * available" with the runtime's words in parentheses. It shares the
 * device's primary context with any other runtime in the process (torch's
 * libcudart), so streams and device pointers pass between them.
 *
 * Built without LORAKIT_CUDA (no nvcc), every entry here reports the same
 * plain message with the reason "built without LORAKIT_CUDA". */
#include "device/backend.h"
#include "lorakit/log.h"

#include <stdint.h>

#define NO_CUDA "no CUDA driver or device is available"

#ifdef LK_HAVE_CUDA
#include <cuda_runtime_api.h>

int lk_cuda_built(void) { return 1; }

int lk_cuda_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return n;
}

lk_status lk_cuda_check(int index) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return lk_error(LK_ERR_UNSUPPORTED, "cuda:%d: " NO_CUDA " (CUDA runtime: %s)", index, cudaGetErrorString(e));
    }
    if (n == 0) return lk_error(LK_ERR_UNSUPPORTED, "cuda:%d: " NO_CUDA " (the driver sees no GPU)", index);
    if (index < 0 || index >= n)
        return lk_error(LK_ERR_UNSUPPORTED, "cuda:%d: " NO_CUDA " (this machine has %d CUDA device%s: cuda:0..cuda:%d)",
                        index, n, n == 1 ? "" : "s", n - 1);
    return LK_OK;
}

/* The runtime's error as lorakit's, clearing the runtime's last error. */
static lk_status cuda_fail(cudaError_t e, int index, const char *what, size_t bytes) {
    (void)cudaGetLastError();
    const lk_status st = e == cudaErrorMemoryAllocation ? LK_ERR_NOMEM : LK_ERR_IO;
    if (e == cudaErrorInsufficientDriver || e == cudaErrorNoDevice || e == cudaErrorInvalidDevice)
        return lk_error(LK_ERR_UNSUPPORTED, "cuda:%d: " NO_CUDA " (%s: %s)", index, what, cudaGetErrorString(e));
    return lk_error(st, "cuda:%d: %s (%zu bytes): %s", index, what, bytes, cudaGetErrorString(e));
}

static lk_status use(int index, const char *what) {
    cudaError_t e = cudaSetDevice(index);
    return e == cudaSuccess ? LK_OK : cuda_fail(e, index, what, 0);
}

lk_status lk_cuda_alloc(int index, size_t bytes, void **ptr) {
    lk_status st = use(index, "cudaMalloc");
    if (st) return st;
    cudaError_t e = cudaMalloc(ptr, bytes);
    if (e != cudaSuccess) {
        *ptr = NULL;
        return cuda_fail(e, index, "cudaMalloc", bytes);
    }
    return LK_OK;
}

void lk_cuda_free(int index, void *ptr) {
    if (use(index, "cudaFree") == LK_OK && cudaFree(ptr) != cudaSuccess) {
        lk_log(LK_LOG_WARN, "cuda:%d: cudaFree(%p): %s", index, ptr, cudaGetErrorString(cudaGetLastError()));
    }
}

lk_status lk_cuda_host_alloc(int index, size_t bytes, void **ptr) {
    lk_status st = use(index, "cudaHostAlloc");
    if (st) return st;
    cudaError_t e = cudaHostAlloc(ptr, bytes, cudaHostAllocPortable);
    if (e != cudaSuccess) {
        *ptr = NULL;
        return cuda_fail(e, index, "cudaHostAlloc (pinned staging)", bytes);
    }
    return LK_OK;
}

void lk_cuda_host_free(void *ptr) {
    if (cudaFreeHost(ptr) != cudaSuccess)
        lk_log(LK_LOG_WARN, "cudaFreeHost(%p): %s", ptr, cudaGetErrorString(cudaGetLastError()));
}

int lk_cuda_owns(int index, const void *ptr, size_t bytes) {
    struct cudaPointerAttributes a, b;
    const unsigned char *p = ptr;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    if (a.type != cudaMemoryTypeDevice || a.device != index) return 0;
    if (bytes <= 1) return 1;
    if (cudaPointerGetAttributes(&b, p + bytes - 1) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return b.type == cudaMemoryTypeDevice && b.device == index;
}

lk_status lk_cuda_stream_create(int index, void **native) {
    lk_status st = use(index, "cudaStreamCreate");
    if (st) return st;
    cudaStream_t s;
    cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    if (e != cudaSuccess) return cuda_fail(e, index, "cudaStreamCreate", 0);
    *native = s;
    return LK_OK;
}

void lk_cuda_stream_destroy(void *native) {
    if (native) (void)cudaStreamDestroy((cudaStream_t)native);
}

lk_status lk_cuda_stream_sync(int index, void *native) {
    lk_status st = use(index, "cudaStreamSynchronize");
    if (st) return st;
    cudaError_t e = cudaStreamSynchronize((cudaStream_t)native);
    return e == cudaSuccess ? LK_OK : cuda_fail(e, index, "cudaStreamSynchronize", 0);
}

lk_status lk_cuda_event_create(int index, void **native) {
    lk_status st = use(index, "cudaEventCreate");
    if (st) return st;
    cudaEvent_t ev;
    cudaError_t e = cudaEventCreate(&ev);
    if (e != cudaSuccess) return cuda_fail(e, index, "cudaEventCreate", 0);
    *native = ev;
    return LK_OK;
}

void lk_cuda_event_destroy(void *native) { (void)cudaEventDestroy((cudaEvent_t)native); }

lk_status lk_cuda_event_record(int index, void *ev, void *stream) {
    lk_status st = use(index, "cudaEventRecord");
    if (st) return st;
    cudaError_t e = cudaEventRecord((cudaEvent_t)ev, (cudaStream_t)stream);
    return e == cudaSuccess ? LK_OK : cuda_fail(e, index, "cudaEventRecord", 0);
}

lk_status lk_cuda_event_sync(void *ev) {
    cudaError_t e = cudaEventSynchronize((cudaEvent_t)ev);
    return e == cudaSuccess ? LK_OK : cuda_fail(e, -1, "cudaEventSynchronize", 0);
}

lk_status lk_cuda_stream_wait(int index, void *stream, void *ev) {
    lk_status st = use(index, "cudaStreamWaitEvent");
    if (st) return st;
    cudaError_t e = cudaStreamWaitEvent((cudaStream_t)stream, (cudaEvent_t)ev, 0);
    return e == cudaSuccess ? LK_OK : cuda_fail(e, index, "cudaStreamWaitEvent", 0);
}

lk_status lk_cuda_event_elapsed(void *a, void *b, double *seconds) {
    float ms = 0;
    cudaError_t e = cudaEventElapsedTime(&ms, (cudaEvent_t)a, (cudaEvent_t)b);
    if (e != cudaSuccess) return cuda_fail(e, -1, "cudaEventElapsedTime", 0);
    *seconds = ms * 1e-3;
    return LK_OK;
}

lk_status lk_cuda_copy(int index, void *dst, const void *src, size_t bytes, lk_copy_kind kind, void *stream) {
    static const enum cudaMemcpyKind kinds[] = {cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost,
                                                cudaMemcpyDeviceToDevice};
    static const char *const names[] = {"copy host->device", "copy device->host", "copy device->device"};
    lk_status st = use(index, names[kind]);
    if (st) return st;
    cudaError_t e = stream ? cudaMemcpyAsync(dst, src, bytes, kinds[kind], (cudaStream_t)stream)
                           : cudaMemcpy(dst, src, bytes, kinds[kind]);
    return e == cudaSuccess ? LK_OK : cuda_fail(e, index, names[kind], bytes);
}

lk_status lk_cuda_memset(int index, void *dst, int value, size_t bytes, void *stream) {
    lk_status st = use(index, "cudaMemset");
    if (st) return st;
    cudaError_t e = stream ? cudaMemsetAsync(dst, value, bytes, (cudaStream_t)stream) : cudaMemset(dst, value, bytes);
    return e == cudaSuccess ? LK_OK : cuda_fail(e, index, "cudaMemset", bytes);
}

lk_status lk_cuda_launch(int index, const lk_kernel *k, lk_dim3 grid, lk_dim3 block, const void *args, void *stream) {
    if (!k->cuda) return lk_error(LK_ERR_ARG, "cuda:%d: kernel %s has no CUDA build", index, k->name);
    lk_status st = use(index, "launch");
    if (st) return st;
    void *argv[1] = {(void *)args};
    dim3 g = {grid.x, grid.y, grid.z}, b = {block.x, block.y, block.z};
    cudaError_t e = cudaLaunchKernel(k->cuda, g, b, argv, 0, (cudaStream_t)stream);
    if (e == cudaSuccess && !stream) e = cudaStreamSynchronize(NULL);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return lk_error(LK_ERR_IO, "cuda:%d: kernel %s (grid %ux%ux%u, block %ux%ux%u): %s", index, k->name, grid.x,
                        grid.y, grid.z, block.x, block.y, block.z, cudaGetErrorString(e));
    }
    return LK_OK;
}

lk_status lk_cuda_sync(int index) {
    lk_status st = use(index, "cudaDeviceSynchronize");
    if (st) return st;
    cudaError_t e = cudaDeviceSynchronize();
    return e == cudaSuccess ? LK_OK : cuda_fail(e, index, "cudaDeviceSynchronize", 0);
}

#else /* built without LORAKIT_CUDA */

#define NOT_BUILT(index) \
    lk_error(LK_ERR_UNSUPPORTED, "cuda:%d: " NO_CUDA " (lorakit was built without LORAKIT_CUDA)", index)

int lk_cuda_built(void) { return 0; }
int lk_cuda_count(void) { return 0; }
lk_status lk_cuda_check(int index) { return NOT_BUILT(index); }
lk_status lk_cuda_alloc(int index, size_t bytes, void **ptr) {
    (void)bytes;
    *ptr = NULL;
    return NOT_BUILT(index);
}
void lk_cuda_free(int index, void *ptr) { (void)index, (void)ptr; }
lk_status lk_cuda_host_alloc(int index, size_t bytes, void **ptr) {
    (void)bytes;
    *ptr = NULL;
    return NOT_BUILT(index);
}
void lk_cuda_host_free(void *ptr) { (void)ptr; }
int lk_cuda_owns(int index, const void *ptr, size_t bytes) { return (void)index, (void)ptr, (void)bytes, 0; }
lk_status lk_cuda_stream_create(int index, void **native) { return (void)native, NOT_BUILT(index); }
void lk_cuda_stream_destroy(void *native) { (void)native; }
lk_status lk_cuda_stream_sync(int index, void *native) { return (void)native, NOT_BUILT(index); }
lk_status lk_cuda_event_create(int index, void **native) { return (void)native, NOT_BUILT(index); }
void lk_cuda_event_destroy(void *native) { (void)native; }
lk_status lk_cuda_event_record(int index, void *ev, void *stream) { return (void)ev, (void)stream, NOT_BUILT(index); }
lk_status lk_cuda_event_sync(void *ev) { return (void)ev, NOT_BUILT(0); }
lk_status lk_cuda_stream_wait(int index, void *stream, void *ev) { return (void)stream, (void)ev, NOT_BUILT(index); }
lk_status lk_cuda_event_elapsed(void *a, void *b, double *seconds) {
    return (void)a, (void)b, (void)seconds, NOT_BUILT(0);
}
lk_status lk_cuda_copy(int index, void *dst, const void *src, size_t bytes, lk_copy_kind kind, void *stream) {
    return (void)dst, (void)src, (void)bytes, (void)kind, (void)stream, NOT_BUILT(index);
}
lk_status lk_cuda_memset(int index, void *dst, int value, size_t bytes, void *stream) {
    return (void)dst, (void)value, (void)bytes, (void)stream, NOT_BUILT(index);
}
lk_status lk_cuda_launch(int index, const lk_kernel *k, lk_dim3 grid, lk_dim3 block, const void *args, void *stream) {
    return (void)k, (void)grid, (void)block, (void)args, (void)stream, NOT_BUILT(index);
}
lk_status lk_cuda_sync(int index) { return NOT_BUILT(index); }

#endif
