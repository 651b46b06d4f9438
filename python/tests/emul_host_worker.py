"""Run by test_device_emul.py under `torchrun --nproc_per_node 2` (gloo):
sync_grads on gradients in emul device memory (lorakit._testing) over a
torch.distributed ProcessGroup whose _TorchHost takes that device's memory
(force_device="emul", as an NCCL group takes the CUDA device's): every
bucket's allreduce reaches the callback as a DLPack capsule over the device
buffer itself (zero-copy, no pinned stage: no device->host byte), and the
result equals, byte for byte, sync_grads over the same group on NumPy
copies (the host path)."""
import sys

import numpy as np
import torch.distributed as dist

import lorakit
from lorakit import _testing as lt
from lorakit import _torch

dist.init_process_group("gloo")
R, N = dist.get_rank(), dist.get_world_size()
_torch._TorchHost.force_device = "emul"
seen = []
orig = _torch._TorchHost.allreduce


def spy(self, buf, kind, op):
    seen.append((type(buf).__name__, kind))
    return orig(self, buf, kind, op)


_torch._TorchHost.allreduce = spy
group = dist.new_group(list(range(N)))  # a group of its own: its lorakit Comm is made with the forced device
rng = np.random.default_rng(5 + R)
shapes = [(3, 5), (1000,), (0,), (7, 1)]
host = [rng.uniform(-1, 1, s).astype(np.float32) for s in shapes]
dev = [lt.to_emul("F32", h) for h in host]
with lt.emul_as_cuda():
    c0 = lt.emul_counts()
    lorakit.sync_grads(dev, group, bucket_mb=1 / 1024)
    c1 = lt.emul_counts()
capsules = [k for t, k in seen if t == "PyCapsule"]
_torch._TorchHost.force_device = None
lorakit.sync_grads(host, dist.group.WORLD, bucket_mb=1 / 1024)
ok = all(lt.from_emul(t).tobytes() == h.tobytes() for t, h in zip(dev, host))
ok = ok and c1["d2h_bytes"] == c0["d2h_bytes"]  # no pinned stage: the callbacks took the device memory
ok = ok and len(capsules) == 4 and set(capsules) == {"f32"}  # 1022 floats in 256-float buckets
print(f"rank {R}: capsules {len(capsules)} of {len(seen)} allreduces, bytes equal: {ok}", flush=True)
dist.barrier()
if ok:
    print("emul host checks passed", flush=True)
sys.exit(0 if ok else 1)
