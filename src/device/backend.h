/* device/backend.h — between device.c (names, dispatch, the cpu and emul
 * backends) and device_cuda.c (the CUDA runtime backend). Internal.
 *
 * device.c owns the public functions and sends cuda devices here; with the
 * CUDA backend not built, device_cuda.c's functions report that plainly
 * (the same "no CUDA driver or device" message, with the reason "built
 * without LORAKIT_CUDA"), so no caller needs an #ifdef. */
#ifndef LK_DEVICE_BACKEND_H
#define LK_DEVICE_BACKEND_H

#include "lorakit/device.h"

struct lk_stream {
    lk_device dev;
    void *native; /* cudaStream_t (NULL: the default stream); NULL for cpu/emul */
    int owned;    /* created here (lk_stream_free destroys it) */
    uintptr_t tag; /* emul: the handle lk_stream_wrap was given (recorded by the
                      emul counts, so tests see which stream work was queued on) */
};

struct lk_event {
    lk_device dev;
    void *native;  /* cudaEvent_t; NULL for cpu/emul */
    double at;     /* cpu/emul: the monotonic time it was recorded */
    int recorded;
};

int lk_cuda_built(void);
int lk_cuda_count(void);
lk_status lk_cuda_check(int index);
lk_status lk_cuda_alloc(int index, size_t bytes, void **ptr);
void lk_cuda_free(int index, void *ptr);
lk_status lk_cuda_host_alloc(int index, size_t bytes, void **ptr);
void lk_cuda_host_free(void *ptr);
int lk_cuda_owns(int index, const void *ptr, size_t bytes);
lk_status lk_cuda_stream_create(int index, void **native);
void lk_cuda_stream_destroy(void *native);
lk_status lk_cuda_stream_sync(int index, void *native);
lk_status lk_cuda_event_create(int index, void **native);
void lk_cuda_event_destroy(void *native);
lk_status lk_cuda_event_record(int index, void *ev, void *stream);
lk_status lk_cuda_event_sync(void *ev);
lk_status lk_cuda_stream_wait(int index, void *stream, void *ev);
lk_status lk_cuda_event_elapsed(void *a, void *b, double *seconds);
lk_status lk_cuda_copy(int index, void *dst, const void *src, size_t bytes, lk_copy_kind kind, void *stream);
lk_status lk_cuda_memset(int index, void *dst, int value, size_t bytes, void *stream);
lk_status lk_cuda_launch(int index, const lk_kernel *k, lk_dim3 grid, lk_dim3 block, const void *args, void *stream);
lk_status lk_cuda_sync(int index);

#endif
