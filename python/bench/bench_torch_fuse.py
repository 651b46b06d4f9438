"""lorakit's in-place fuse against PyTorch's, on the same tensors in one run.

The model: 44 BF16 weights, exactly 2^30 bytes (1 GiB), laid out as 4
DiT-style blocks of 11 weights with hidden size 4096:
    attn1.to_q/to_k/to_v/to_out  4096x4096   (x4)
    attn2.to_q/to_out            4096x4096   (x2)
    attn2.to_k/to_v              4096x1024   (x2, a 1024-wide context)
    ff.gate/ff.up                2048x4096   (x2)
    ff.down                      4096x2048   (x1)
(24 x 4096x4096, 8 x 4096x1024, 12 x 2048/4096 = 2^29 elements), N(0, 0.02).
One r=16 LoRA per weight, A (16 x in) and B (out x 16) BF16, N(0, 0.01),
alpha = 16, so the scale alpha/r is 1 (strength 1).

Rows (each: warm-up once, then best of --repeat, the weights restored to
their clean bytes before every run, outside the timing):
  torch_bf16_rule  LTX-2's production rule (ltx_core/loader/fuse_loras.py,
                   bf16_fuse_rule: aggregation_dtype=bfloat16): per key,
                   delta = matmul(B * strength, A).to(bf16) (a BF16 matmul),
                   delta.add_(W) in BF16, then the tracker's
                   target[key].copy_(fused). The reference text in
                   /work/shared/reference names fuse_lora_weights and a
                   fuse_rule but not the rule's body, so the body is the
                   public LTX-2 one, and the common fp32 variant is a second
                   row:
  torch_fp32_rule  W = (W.float() + (B.float() @ A.float()) * scale)
                   .to(bfloat16), then target[key].copy_(W).
  lorakit          lorakit.fuse_(state_dict, [(adapter, 1.0)], threads=N):
                   in place through DLPack. The adapter is a PEFT folder
                   (adapter_model.safetensors + adapter_config.json) written
                   once to a temporary folder outside the timing; the call's
                   seconds include opening it and lk_fuse_tensors' backup
                   copy of the touched tensors. c_seconds is the C library's
                   own figure (lk_fuse_tensors' stats).
  lorakit_tracker  lorakit.Tracker(state_dict, threads=N).apply([(adapter,
                   1.0)]) from the reset state: the hot-swap path, whose
                   clean copy is taken once (by the warm-up's first apply),
                   so a timed apply is the fuse alone (reset() untimed
                   before each run, instead of the restore).
at torch.set_num_threads(N) and lorakit threads=N for N = 1 and 2. gbps is
the model's weight bytes over seconds (1e9 bytes/s), not the traffic.
For scale, the summary also gives one in-place copy_ of the model
(copy_inplace_seconds) and a copy into newly allocated memory, page faults
included (copy_fresh_seconds: what a backup of the model costs); these run
first, also to bring the process's memory to a steady state (see copies()).
Each row lists its timed runs ("runs"); the machine is shared, so compare
rows of one run only.

Checks (untimed), in a "check" line per implementation: on a sample of
--sample-rows whole rows per weight, the result against the exact value
W + scale * sum_k B[i,k] A[k,j] in float64 (exact here: products of BF16
values and their 16-term sums fit a double), rounded once to BF16 by hand
(round to nearest even, ties decided exactly): how many are correctly
rounded, the largest distance in BF16 ulps, and how many misses are NOT
explained by fp32 accumulation (the exact value lies farther than
2^-24 * ((r + 2) * sum_k |scale B A| + |W|) from a BF16 rounding midpoint;
must be 0 for lorakit). Over the whole model: how many elements lorakit's
bytes differ from each torch rule's (the fp32 rule rounds W + delta to fp32
and then to BF16: double rounding), and that lorakit's bytes are identical
at 1 and 2 threads, on every repeat and through fuse_ and the Tracker
(bytes_identical_all_runs, by digest).

Not a CI test: it needs PyTorch (the venv) and ~4.5 GiB of memory, and
takes about 75 s on 2 cores (--blocks 1: a 256 MiB model, for a quick try).
From the repository root, after the CMake build (which builds the extension
into build/python):

    flock /tmp/lorakit-bench.lock env PYTHONPATH=build/python \\
        /work/venv/bin/python python/bench/bench_torch_fuse.py [--repeat 3] [--threads 1,2]

Prints JSON lines: one per (impl, threads), one check per impl, and a
summary with lorakit's speedup over each torch row at the same thread count.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch

try:
    from safetensors.torch import save_file
except ImportError:  # pragma: no cover
    sys.exit("bench_torch_fuse: needs the safetensors package (the venv has it)")

import lorakit

RANK, ALPHA, STRENGTH = 16, 16.0, 1.0
SCALE = ALPHA / RANK * STRENGTH


def layout(blocks=4):
    """[(name, (out, in))]: 11 weights per block; 4 blocks: 44 weights,
    2^29 elements."""
    w = []
    for b in range(blocks):
        p = f"blocks.{b}"
        for m in ("to_q", "to_k", "to_v", "to_out"):
            w.append((f"{p}.attn1.{m}.weight", (4096, 4096)))
        w.append((f"{p}.attn2.to_q.weight", (4096, 4096)))
        w.append((f"{p}.attn2.to_out.weight", (4096, 4096)))
        w.append((f"{p}.attn2.to_k.weight", (4096, 1024)))
        w.append((f"{p}.attn2.to_v.weight", (4096, 1024)))
        w.append((f"{p}.ff.gate.weight", (2048, 4096)))
        w.append((f"{p}.ff.up.weight", (2048, 4096)))
        w.append((f"{p}.ff.down.weight", (4096, 2048)))
    return w


# ---- the two PyTorch rules, as production code runs them ----

def torch_bf16_rule(target, loras):
    """LTX-2's bf16_fuse_rule through fuse_lora_weights and the tracker's
    copy_: delta aggregated in BF16, W added in BF16."""
    for key, (a, b) in loras.items():
        w = target[key]
        deltas = torch.matmul(b * SCALE, a).to(dtype=torch.bfloat16)  # coef: strength * alpha / r
        deltas.add_(w)
        target[key].copy_(deltas.to(dtype=w.dtype))


def torch_fp32_rule(target, loras):
    """delta in fp32, W + delta in fp32, rounded to BF16 (twice: the sum to
    fp32, then to BF16)."""
    for key, (a, b) in loras.items():
        w = target[key]
        delta = (b.float() @ a.float()) * SCALE
        target[key].copy_((w.float() + delta).to(torch.bfloat16))


# ---- exact references ----

def bf16_bits(t):
    return t.view(torch.int16).numpy().view(np.uint16)


def bits_to_f64(u16):
    return (u16.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def round_bf16(x):
    """float64 -> BF16 bits, rounded once to nearest even (finite, no
    overflow): the candidates below and above |x| are found from a float32
    guess, the midpoint between them (exact in float64) decides."""
    ax = np.abs(x)
    lo = (ax.astype(np.float32).view(np.uint32) >> 16).astype(np.int64)  # truncation of the fp32 guess
    lo -= (bits_to_f64(lo.astype(np.uint16)) > ax)  # the guess rounded up past a BF16 value
    hi = lo + 1
    vlo, vhi = bits_to_f64(lo.astype(np.uint16)), bits_to_f64(hi.astype(np.uint16))
    mid = (vlo + vhi) / 2
    up = (ax > mid) | ((ax == mid) & (lo & 1 == 1))
    r = np.where(up, hi, lo)
    r = np.where(ax == vlo, lo, r)
    return (r | np.where(x < 0, 0x8000, 0)).astype(np.uint16), vlo, vhi, mid


def ordered(u16):
    """BF16 bits -> integers in value order (ulp distance = difference)."""
    v = u16.astype(np.int64)
    return np.where(v & 0x8000, -(v & 0x7FFF), v)


def check(clean, loras, lk, rows, seed):
    """Weight by weight (no second copy of the model): each torch rule's
    result from the clean bytes, compared over the whole weight with
    lorakit's (lk) and, with lorakit's, on `rows` sampled rows against the
    float64 value. Returns {impl: counts}."""
    g = np.random.default_rng(seed)
    rules = {"torch_fp32_rule": torch_fp32_rule, "torch_bf16_rule": torch_bf16_rule}
    acc = {k: {"sample_elements": 0, "correctly_rounded": 0, "max_ulp": 0, "misses_unexplained": 0}
           for k in ("lorakit", *rules)}
    for k in rules:
        acc[k]["elements"] = 0
        acc[k]["differ_from_lorakit"] = 0
    for key, (a, b) in loras.items():
        got = {"lorakit": lk[key]}
        for impl, fn in rules.items():
            one = {key: clean[key].clone()}
            fn(one, {key: (a, b)})
            got[impl] = one[key]
            acc[impl]["elements"] += one[key].numel()
            acc[impl]["differ_from_lorakit"] += int((one[key].view(torch.int16) != lk[key].view(torch.int16)).sum())
        out = clean[key].shape[0]
        ti = torch.from_numpy(np.sort(g.choice(out, size=min(rows, out), replace=False)))
        w = clean[key][ti].double().numpy()
        terms = b[ti].double().numpy()[:, :, None] * a.double().numpy()[None, :, :] * SCALE  # rows x r x in
        exact = w + terms.sum(axis=1)  # exact: 16-bit products, 16 terms, one W
        bound = 2.0 ** -24 * ((RANK + 2) * np.abs(terms).sum(axis=1) + np.abs(w))
        want, _, _, mid = round_bf16(exact)
        near_mid = np.abs(np.abs(exact) - mid) <= bound
        for impl, res in got.items():
            bits = bf16_bits(res[ti].contiguous())
            ulp = np.abs(ordered(bits) - ordered(want))
            c = acc[impl]
            c["sample_elements"] += bits.size
            c["correctly_rounded"] += int((ulp == 0).sum())
            c["max_ulp"] = max(c["max_ulp"], int(ulp.max()))
            c["misses_unexplained"] += int(((ulp != 0) & ~near_mid).sum())
    return acc


# ---- timing ----

def restore(work, clean):
    for k, v in clean.items():
        work[k].copy_(v)


def timed(fn, work, clean, repeat, after=None, setup=None):
    """Warm-up once, then best of repeat; the weights restored before each
    run (by setup() if given), outside the timing. after(result) runs
    untimed after every run."""
    best, extra, runs = None, None, []
    for i in range(repeat + 1):
        if setup:
            setup()
        else:
            restore(work, clean)
        t0 = time.perf_counter()
        r = fn()
        dt = time.perf_counter() - t0
        if after:
            after(r)
        if i:
            runs.append(dt)
            if best is None or dt < best:
                best, extra = dt, r
    return best, extra, runs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--sample-rows", type=int, default=8, help="whole rows per weight checked against float64")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--blocks", type=int, default=4, help="11 weights (256 MiB) per block; 4 is the 1 GiB model")
    a = ap.parse_args()
    threads = [int(t) for t in a.threads.split(",")]

    torch.set_num_threads(max(threads))
    gen = torch.Generator().manual_seed(a.seed)
    shapes = layout(a.blocks)
    clean, loras = {}, {}
    for name, (o, i) in shapes:
        clean[name] = (torch.randn(o, i, generator=gen) * 0.02).to(torch.bfloat16)
        loras[name] = ((torch.randn(RANK, i, generator=gen) * 0.01).to(torch.bfloat16),
                       (torch.randn(o, RANK, generator=gen) * 0.01).to(torch.bfloat16))
    work = {k: v.clone() for k, v in clean.items()}
    nbytes = sum(v.nbytes for v in clean.values())
    common = {"bench": "torch_fuse", "weights": len(clean), "bytes": nbytes, "rank": RANK, "dtype": "BF16",
              "repeat": a.repeat, "torch": torch.__version__}

    d = tempfile.mkdtemp(prefix="lk-bench-torch-")
    try:
        ad = os.path.join(d, "adapter_model.safetensors")
        t = {}
        for name, (la, lb) in loras.items():
            m = "base_model.model." + name[: -len(".weight")]
            t[f"{m}.lora_A.weight"] = la
            t[f"{m}.lora_B.weight"] = lb
        save_file(t, ad)
        with open(os.path.join(d, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA,
                       "target_modules": sorted({n.split(".")[-2] for n in clean})}, f)
        run(a, threads, clean, loras, work, ad, common)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def copies(rows, work, clean, threads):
    """Context figures, taken before any timed row: they also bring the
    process's memory to a steady state. Measured here: in a fresh process
    the torch rules (which allocate several GiB of temporaries a run) ran
    2-3x slower (fp32 rule, 2 threads: 2.3-2.6 s, then 0.8-0.9 s once the
    process had allocated and freed a few GiB of whole-model copies), so
    without this their figures depended on what ran before them."""
    for n in threads:
        torch.set_num_threads(n)
        inplace, fresh = [], []
        for _ in range(3):  # one in-place pass over the model (torch copy_)
            t0 = time.perf_counter()
            restore(work, clean)
            inplace.append(time.perf_counter() - t0)
        for _ in range(3):  # a copy into newly allocated memory, page faults included
            t0 = time.perf_counter()
            tmp = {k: v.clone() for k, v in clean.items()}
            fresh.append(time.perf_counter() - t0)
            del tmp
        rows[("copy", n)], rows[("fresh", n)] = min(inplace), min(fresh)


def emit(rows, common, impl, n, sec, runs, summary=None):
    row = {**common, "impl": impl, "threads": n, "seconds": sec, "gbps": common["bytes"] / sec / 1e9,
           "runs": [round(x, 4) for x in runs]}
    if summary is not None:
        row["c_seconds"] = summary["seconds"]
    rows[(impl, n)] = row
    print(json.dumps(row), flush=True)


def run(a, threads, clean, loras, work, ad, common):
    rows, digests = {}, set()
    load0 = os.getloadavg()[0]

    def lk_call(n):
        s = lorakit.fuse_(work, [(ad, STRENGTH)], threads=n)
        if s["tensors_fused"] != len(clean):
            raise SystemExit(f"lorakit fused {s['tensors_fused']} of {len(clean)} weights")
        return s

    copies(rows, work, clean, threads)
    for n in threads:
        torch.set_num_threads(n)
        impls = [("torch_fp32_rule", lambda: torch_fp32_rule(work, loras), None),
                 ("torch_bf16_rule", lambda: torch_bf16_rule(work, loras), None),
                 ("lorakit", lambda: lk_call(n), lambda s: digests.add(lorakit.digest_tensors(work)))]
        for impl, fn, after in impls:
            sec, extra, runs = timed(fn, work, clean, a.repeat, after)
            emit(rows, common, impl, n, sec, runs, extra)
        # the hot-swap path: a Tracker holds the clean copy (taken by the
        # warm-up's first apply), so apply from the reset state is the fuse
        # alone, with no backup to take
        restore(work, clean)
        tr = lorakit.Tracker(work, threads=n)
        try:
            sec, extra, runs = timed(lambda: tr.apply([(ad, STRENGTH)]), work, clean, a.repeat,
                                     lambda r: digests.add(lorakit.digest_tensors(work)), setup=tr.reset)
            tr.reset()
        finally:
            tr.close()
        emit(rows, common, "lorakit_tracker", n, sec, runs, extra)

    # checks: lorakit's bytes in work (restored, fused once more)
    restore(work, clean)
    lk_call(max(threads))
    digests.add(lorakit.digest_tensors(work))
    acc = check(clean, loras, work, a.sample_rows, a.seed + 1)
    for impl, c in acc.items():
        if impl == "lorakit":
            c["bytes_identical_all_runs"] = len(digests) == 1
        print(json.dumps({"bench": "torch_fuse_check", "impl": impl, **c}), flush=True)
    # the 1-minute load average (others' work on this shared machine) around the run
    summ = {"bench": "torch_fuse_summary", "weights": common["weights"], "bytes": common["bytes"],
            "loadavg_start": load0, "loadavg_end": os.getloadavg()[0]}
    for n in threads:
        for lk in ("lorakit", "lorakit_tracker"):
            for impl in ("torch_fp32_rule", "torch_bf16_rule"):
                summ[f"{lk}_speedup_over_{impl}_t{n}"] = rows[(impl, n)]["seconds"] / rows[(lk, n)]["seconds"]
        summ[f"copy_inplace_seconds_t{n}"] = rows[("copy", n)]
        summ[f"copy_fresh_seconds_t{n}"] = rows[("fresh", n)]
    print(json.dumps(summ), flush=True)


if __name__ == "__main__":
    main()
