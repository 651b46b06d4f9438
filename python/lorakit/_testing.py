"""TEST ONLY: lorakit's device paths on the `emul` device, without a GPU.

CI has no GPU, so the binding's CUDA branches (device memory borrowed
through DLPack, the device fuse, digests read back from the device, the
gradient average on device buffers, the host communicator's callbacks on
device memory, streams) would go untested. This module turns them on for
objects in lorakit's emulated device memory:

- EmulTensor(data, dtype, shape): a tensor in emul memory (allocated by
  lorakit's emul allocator, filled by an explicit host->device copy) whose
  __dlpack_device__ is (kDLCUDA, 0), so lorakit's Python layer routes it
  exactly as a CUDA tensor (_device_name: "cuda:0");
- emul_as_cuda(): while active, the binding takes memory a DLPack exporter
  calls kDLCUDA as the `emul` device (and checks that it lies inside an emul
  allocation) instead of cuda:N. The code path is the CUDA one: the only
  difference is the lk_device the C library is handed, whose emul backend
  runs the CUDA kernels' own per-thread source on the CPU;
- emul_counts(): the emulated device's copies (count and bytes per kind)
  and kernel launches, to assert where bytes went (no device->host copy in
  a device fuse).

Nothing here is used by lorakit itself; python/tests/test_device_emul.py is
its user. Real CUDA tensors are tested by python/tests/test_cuda.py where a
GPU exists."""
import contextlib

import numpy as np

from . import _lorakit as _c

__all__ = ["EmulTensor", "emul_as_cuda", "emul_counts", "to_emul", "from_emul"]

EmulTensor = _c.EmulTensor
emul_counts = _c.emul_counts

_NP = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": np.uint16, "I64": np.int64, "I32": np.int32,
       "U8": np.uint8, "F8_E4M3": np.uint8, "F8_E5M2": np.uint8}


@contextlib.contextmanager
def emul_as_cuda():
    """CUDA memory (as DLPack names it) is taken as `emul` inside the block."""
    was = _c._test_emul_as_cuda(True)
    try:
        yield
    finally:
        _c._test_emul_as_cuda(was)


def to_emul(dtype, array):
    """An EmulTensor holding array's bytes as lorakit dtype (BF16 and FP8 as
    raw uint16 / uint8 arrays, as the tests' st_io reads them)."""
    a = np.ascontiguousarray(array)
    return EmulTensor(a.tobytes(), dtype, tuple(a.shape))


def from_emul(t):
    """A NumPy copy of an EmulTensor's bytes (BF16/FP8 as raw integers)."""
    return np.frombuffer(t.tobytes(), dtype=_NP[t.dtype]).reshape(t.shape).copy()
