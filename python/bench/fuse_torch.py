"""fuse_torch.py — the torch rows of issue 27's fuse benchmark, on one GPU.

Prints JSON lines for the two rules lorakit's device kernel is compared with,
on the same model shape as `lorakit bench fuse --device cuda` (n dim x dim
BF16 weights, r = 16, in place), in the same run as a device-to-device copy:
  torch_bf16: W.add_(s * (B @ A)) in BF16 (the LTX-2 / PEFT rule; not exact)
  torch_fp32: W.copy_((W.float() + s * (B.float() @ A.float())).to(W.dtype))
GB/s counts W traffic (read + write), as lorakit's rows do.
Usage: python fuse_torch.py [--model-mb 8192] [--dim 4096] [--repeat 3]
Without torch or without CUDA it prints one line saying so and exits 0."""
import argparse
import json
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-mb", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    try:
        import torch
    except ImportError as e:
        print(json.dumps({"bench": "fuse_torch", "skipped": "torch does not import: %s" % e}))
        return 0
    if not torch.cuda.is_available():
        print(json.dumps({"bench": "fuse_torch", "skipped": "no CUDA device"}))
        return 0
    dev = torch.device("cuda")
    n = max(1, (a.model_mb << 20) // (a.dim * a.dim * 2))
    ws = [torch.randn(a.dim, a.dim, device=dev, dtype=torch.bfloat16) for _ in range(n)]
    A = torch.randn(16, a.dim, device=dev, dtype=torch.bfloat16) * 0.01
    B = torch.randn(a.dim, 16, device=dev, dtype=torch.bfloat16) * 0.01
    s = 0.7
    nbytes = n * a.dim * a.dim * 2

    def timed(fn):
        best = None
        for r in range(a.repeat + 1):
            torch.cuda.synchronize()
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            fn()
            t1.record()
            torch.cuda.synchronize()
            t = t0.elapsed_time(t1) / 1e3
            if r and (best is None or t < best):
                best = t
        return best

    flat = torch.empty(nbytes // 2, device=dev, dtype=torch.bfloat16)
    flat2 = torch.empty_like(flat)
    tc = timed(lambda: flat2.copy_(flat))

    def bf16():
        for w in ws:
            w.add_(s * (B @ A))

    def fp32():
        for w in ws:
            w.copy_((w.float() + s * (B.float() @ A.float())).to(w.dtype))

    gb = 2.0 * nbytes / 1e9
    print(json.dumps({"bench": "fuse_torch", "row": "d2d_copy", "bytes": nbytes, "seconds": tc, "gbps": gb / tc}))
    for name, fn in (("torch_bf16", bf16), ("torch_fp32", fp32)):
        t = timed(fn)
        print(json.dumps({"bench": "fuse_torch", "row": name, "rank": 16, "dim": a.dim, "tensors": n, "bytes": nbytes,
                          "seconds": t, "gbps": gb / t, "ratio_to_copy": tc / t}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
