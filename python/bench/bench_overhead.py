"""The Python layer's overhead over the C calls under it, measured in the
same run: a 1,000-tensor lorakit.fuse_ (state_dict in place) and a
Tracker.apply step, each timed around the Python call (time.perf_counter)
and compared with the seconds the C library measures inside the call it
makes (lk_fuse_tensors' and lk_tracker_apply's own stats, returned in the
summary). The difference is what the package adds: argument checks, taking
the 1,000 zero-copy views (buffer protocol / DLPack), the agreement
collective, JSON summaries. Prints JSON lines; medians over --repeat runs.

    PYTHONPATH=build/python python3 python/bench/bench_overhead.py [--tensors 1000] [--dim 128] [--torch]
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

import lorakit  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--torch", action="store_true", help="torch tensors (DLPack) instead of NumPy arrays")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    d = tempfile.mkdtemp(prefix="lk-bench-py-")
    names = [f"layers.{i}.proj.weight" for i in range(a.tensors)]
    sd = {n: rng.standard_normal((a.dim, a.dim), dtype=np.float32) for n in names}
    if a.torch:
        import torch
        sd = {k: torch.from_numpy(v) for k, v in sd.items()}
    ads = []
    for j in range(2):
        t = {}
        for n in names:
            m = n[: -len(".weight")]
            t[f"{m}.lora_A.weight"] = ("F32", rng.standard_normal((a.rank, a.dim), dtype=np.float32) * 0.01)
            t[f"{m}.lora_B.weight"] = ("F32", rng.standard_normal((a.dim, a.rank), dtype=np.float32) * 0.01)
        p = os.path.join(d, f"ad{j}.safetensors")
        st_io.write(p, t)
        ads.append(p)
    common = {"tensors": a.tensors, "dim": a.dim, "rank": a.rank, "dtype": "F32",
              "kind": "torch" if a.torch else "numpy", "repeat": a.repeat}

    py, c = [], []
    for i in range(a.repeat):
        t0 = time.perf_counter()
        s = lorakit.fuse_(sd, [(ads[i % 2], 1.0)], threads=a.threads)
        py.append(time.perf_counter() - t0)
        c.append(s["seconds"])
        assert s["tensors_fused"] == a.tensors
    report("fuse_", common, py, c)

    tr = lorakit.Tracker(sd, threads=a.threads)
    py, c = [], []
    for i in range(a.repeat + 1):
        t0 = time.perf_counter()
        r = tr.apply([(ads[i % 2], 1.0)])
        dt = time.perf_counter() - t0
        if i:  # the first apply also backs up every key
            py.append(dt)
            c.append(r["seconds"])
    tr.close()
    report("tracker_apply", common, py, c)


def report(what, common, py, c):
    mp, mc = statistics.median(py), statistics.median(c)
    print(json.dumps({"bench": "python_overhead", "call": what, **common, "python_seconds": mp, "c_seconds": mc,
                      "overhead_seconds": mp - mc, "overhead_per_tensor_us": (mp - mc) / common["tensors"] * 1e6,
                      "ratio": mp / mc if mc else None}), flush=True)


if __name__ == "__main__":
    main()
