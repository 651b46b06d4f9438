"""The torch.distributed backend (the host communicator over gloo) against
the MPI one, in the same run, on the same bytes: a Tracker swap step and a
gradient sync. Run under mpirun so both exist in every process:

    OMP_NUM_THREADS=1 mpirun -n 2 python python/bench/bench_comm.py [--keys 64] [--dim 512] [--grad-mb 64]

Every rank joins one MPI communicator (mpi4py.MPI.COMM_WORLD) and one gloo
process group (tcp on localhost, ranks from MPI), then, alternating the two
backends each repeat (so load drifts hit both alike):
- swap: Tracker.apply toggling between two adapter sets that touch every
  key (keys x dim x dim BF16 weights, rank-8 adapters), bucket_mb 16:
  each step restores, fuses on the owners and broadcasts every key; the
  C tracker's own broadcast phase seconds (communication, overlapped with fusing)
  and the wall time of the call are reported;
- sync: lorakit.sync_grads over float32 gradients of grad_mb MiB in 256
  tensors, bucket_mb 4.
Prints one JSON line per measurement (rank 0): medians over --repeat.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import st_io  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", type=int, default=64)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--grad-mb", type=float, default=64)
    ap.add_argument("--repeat", type=int, default=7)
    a = ap.parse_args()

    from mpi4py import MPI
    import torch
    import torch.distributed as dist

    import lorakit

    W = MPI.COMM_WORLD
    R, N = W.Get_rank(), W.Get_size()
    port = W.bcast(29700 + os.getpid() % 200 if R == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=R, world_size=N)
    pg = dist.group.WORLD

    # fixtures: rank 0 writes the adapters; every rank makes the same base
    d = W.bcast(tempfile.mkdtemp(prefix="lk-bench-comm-") if R == 0 else None, root=0)
    names = [f"blocks.{i}.attn.to_q.weight" for i in range(a.keys)]
    rng = np.random.default_rng(1)
    base = {n: torch.from_numpy(rng.standard_normal((a.dim, a.dim), dtype=np.float32)).to(torch.bfloat16)
            for n in names}
    paths = [os.path.join(d, f"a{j}.safetensors") for j in range(2)]
    if R == 0:
        for j, p in enumerate(paths):
            g = np.random.default_rng(10 + j)
            t = {}
            for n in names:
                m = n[: -len(".weight")]
                t[f"{m}.lora_A.weight"] = ("F32", g.uniform(-0.05, 0.05, (8, a.dim)).astype(np.float32))
                t[f"{m}.lora_B.weight"] = ("F32", g.uniform(-0.05, 0.05, (a.dim, 8)).astype(np.float32))
            st_io.write(p, t)
    W.Barrier()

    comms = {"mpi": W, "torch.distributed": pg}
    trackers = {}
    for k, c in comms.items():
        sd = {n: v.clone() for n, v in base.items()}
        trackers[k] = (sd, lorakit.Tracker(sd, comm=c, bucket_mb=16))
        trackers[k][1].apply([(paths[0], 1.0)])
    swap = {k: [] for k in comms}
    bcast = {k: [] for k in comms}
    for r in range(a.repeat):
        for k in (list(comms) if r % 2 == 0 else list(reversed(list(comms)))):
            W.Barrier()
            t0 = time.perf_counter()
            rep = trackers[k][1].apply([(paths[(r + 1) % 2], 1.0)])
            swap[k].append(time.perf_counter() - t0)
            bcast[k].append(rep["phases"]["broadcast"])
    digests = {k: lorakit.digest_tensors(trackers[k][0]) for k in comms}
    assert len(set(digests.values())) == 1, digests
    swap_bytes = sum(v.numel() * 2 for v in base.values())

    count = 256
    per = int(a.grad_mb * (1 << 20) / 4 / count)
    grads = {k: [torch.full((per,), float(R + i % 7), dtype=torch.float32) for i in range(count)] for k in comms}
    sync = {k: [] for k in comms}
    for r in range(a.repeat):
        for k in (list(comms) if r % 2 == 0 else list(reversed(list(comms)))):
            W.Barrier()
            t0 = time.perf_counter()
            lorakit.sync_grads(grads[k], comms[k], bucket_mb=4)
            sync[k].append(time.perf_counter() - t0)
    for k in comms:  # sanity: the average of R + i % 7 over the ranks (repeated averaging keeps it)
        assert all(torch.all(v == (N - 1) / 2 + i % 7) for i, v in enumerate(grads[k])), k
    if R == 0:
        med = statistics.median
        for k in comms:
            print(json.dumps({"bench": "swap", "backend": k, "ranks": N, "keys": a.keys, "bytes": swap_bytes,
                              "seconds": round(med(swap[k]), 4), "seconds_broadcast": round(med(bcast[k]), 4)}))
        for k in comms:
            print(json.dumps({"bench": "sync", "backend": k, "ranks": N, "tensors": count,
                              "bytes": per * 4 * count, "seconds": round(med(sync[k]), 4)}))
        print(json.dumps({"bench": "ratio", "swap_torch_over_mpi": round(med(swap["torch.distributed"]) / med(swap["mpi"]), 3),
                          "sync_torch_over_mpi": round(med(sync["torch.distributed"]) / med(sync["mpi"]), 3),
                          "digests_equal": True}))
    for k in comms:
        trackers[k][1].close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
