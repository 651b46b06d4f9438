/* lorakit/lorakit.h — includes every public lorakit header (except
 * comm_mpi.h, which needs mpi.h and is included on its own). */
#ifndef LORAKIT_H
#define LORAKIT_H

#include "lorakit/status.h"
#include "lorakit/cancel.h"
#include "lorakit/log.h"
#include "lorakit/alloc.h"
#include "lorakit/dtype.h"
#include "lorakit/tensor.h"
#include "lorakit/device.h"
#include "lorakit/knobs.h"
#include "lorakit/safetensors.h"
#include "lorakit/checkpoint.h"
#include "lorakit/digest.h"
#include "lorakit/adapter.h"
#include "lorakit/fuse.h"
#include "lorakit/fuse_device.h"
#include "lorakit/algebra.h"
#include "lorakit/inspect.h"
#include "lorakit/comm.h"
#include "lorakit/comm_host.h"
#include "lorakit/comm_nccl.h"
#include "lorakit/mesh.h"
#include "lorakit/weights.h"
#include "lorakit/tracker.h"
#include "lorakit/plan.h"
#include "lorakit/lora.h"

#endif
