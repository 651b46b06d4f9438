/* lorakit/tensor.h — a named view of tensor bytes, shared by every module. */
#ifndef LORAKIT_TENSOR_H
#define LORAKIT_TENSOR_H

#include <stddef.h>
#include <stdint.h>
#include "lorakit/dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

#define LK_MAX_DIMS 8

/* Where a tensor's memory lives. All zero = host memory (every tensor before
 * round 4, and every reader view). LK_DEVICE_EMUL is an emulated device on
 * the CPU (its own allocations, explicit copies, kernels run as their
 * per-thread bodies over the launch grid): how CI runs every device path.
 * The device layer (include/lorakit/device.h) allocates, copies and runs
 * kernels on each kind; code below it only reads this field. */
typedef enum lk_device_kind {
    LK_DEVICE_CPU = 0,
    LK_DEVICE_CUDA = 1,
    LK_DEVICE_EMUL = 2
} lk_device_kind;

typedef struct lk_device {
    lk_device_kind kind;
    int index;                   /* cuda:N; 0 for cpu and emul */
} lk_device;

/* How a 2-D weight stores its axes, where the caller knows the layer that
 * owns it (Python passes it from the module's type). A PEFT LoRA on an
 * IN_OUT weight (transformers' Conv1D: [in, out]) applies transposed, as
 * PEFT's layer sets fan_in_fan_out for it whatever the saved config says;
 * on an OUT_IN weight (nn.Linear) never. UNKNOWN: the resolver's rules
 * (the config's fan_in_fan_out, GPT-2's Conv1D names: README, fuse). */
typedef enum lk_axes {
    LK_AXES_UNKNOWN = 0,
    LK_AXES_OUT_IN = 1,
    LK_AXES_IN_OUT = 2
} lk_axes;

typedef struct lk_tensor {
    const char *name;
    lk_dtype dtype;
    int ndim;                    /* 0 for a scalar */
    int64_t shape[LK_MAX_DIMS];
    size_t nbytes;               /* product(shape) * dtype size */
    void *data;                  /* borrowed; read-only for reader views */
    lk_device device;            /* where data lives; zero = host memory */
    const char *frozen;          /* NULL, or why the caller's own tensor cannot be written (data is then a
                                    copy of it, e.g. a non-contiguous torch tensor): an in-memory fuse or a
                                    tracker call that would write it fails naming it and this reason, before
                                    any write; borrowed */
    lk_axes axes;              /* a 2-D weight's axes where the owning layer is known; else UNKNOWN */
} lk_tensor;

/* 1 when the tensor's bytes are in host memory (readable by the CPU). */
static inline int lk_tensor_on_host(const lk_tensor *t) { return t->device.kind == LK_DEVICE_CPU; }

/* Number of elements (1 for a 0-d tensor). */
size_t lk_tensor_numel(const lk_tensor *t);
/* Writes "[a, b, c]" into buf. */
void lk_shape_str(const lk_tensor *t, char *buf, size_t cap);

#ifdef __cplusplus
}
#endif
#endif
