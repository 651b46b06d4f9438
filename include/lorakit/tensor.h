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

typedef struct lk_tensor {
    const char *name;
    lk_dtype dtype;
    int ndim;                    /* 0 for a scalar */
    int64_t shape[LK_MAX_DIMS];
    size_t nbytes;               /* product(shape) * dtype size */
    void *data;                  /* borrowed; read-only for reader views */
} lk_tensor;

/* Number of elements (1 for a 0-d tensor). */
size_t lk_tensor_numel(const lk_tensor *t);
/* Writes "[a, b, c]" into buf. */
void lk_shape_str(const lk_tensor *t, char *buf, size_t cap);

#ifdef __cplusplus
}
#endif
#endif
