"""Run by test_cuda.py under `torchrun --nproc_per_node 2` (gloo):
cuda_sync_worker.py DEVICE DTYPE (DEVICE cpu | cuda:0, both ranks on it;
DTYPE float32 | bfloat16 | float16). Each rank's gradients are test_cuda's
rank_grads(rank) in DTYPE on DEVICE; after sync_grads (one bucket of 1 KiB:
several buckets) and sync_param_grads every rank's bytes must equal the
float64 mean of both ranks' gradients rounded once to DTYPE (test_cuda's
want_average, computed by torch on the CPU)."""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lorakit  # noqa: E402
from test_cuda import TorchOn, get_grad, put_grads, rank_grads, want_average  # noqa: E402

device, dt = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
R, N = dist.get_rank(), dist.get_world_size()
if device.startswith("cuda"):
    torch.cuda.set_device(0)
gd = TorchOn(torch, device)
want = want_average(N, dt, torch)
grads = put_grads(gd, dt, rank_grads(R, dt, torch))
out = lorakit.sync_grads(grads, dist.group.WORLD, bucket_mb=1 / 1024)
ok = [get_grad(gd, g) for g in out] == want and all(o is g for o, g in zip(out, grads))
params = [torch.nn.Parameter(torch.zeros_like(g)) for g in put_grads(gd, dt, rank_grads(R, dt, torch))]
for p, g in zip(params, put_grads(gd, dt, rank_grads(R, dt, torch))):
    p.grad = g
lorakit.sync_param_grads(params, dist.group.WORLD, bucket_mb=1 / 1024)
ok = ok and [get_grad(gd, p.grad) for p in params] == want
print(f"rank {R}: {device} {dt}: equal to the float64 mean rounded once: {ok}", flush=True)
dist.barrier()
if ok:
    print("sync checks passed", flush=True)
dist.destroy_process_group()
sys.exit(0 if ok else 1)
