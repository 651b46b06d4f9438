#!/usr/bin/env python3
"""bench_algebra.py — lorakit merge / resize against the anchors, in one run,
on the same files: `lorakit bench algebra --json --keep` writes the inputs and
times lorakit (each case in a child process: wall, CPU, peak RSS), then each
anchor runs here in its own child process on those files:

  kohya_resize  a torch re-implementation of sd-scripts' resize_lora.py at a
                fixed rank: delta = up @ down * alpha / r densely in float32,
                torch.linalg.svd of it, U S kept at rank 16, new alpha = 16
                stored as BF16 (its formulas, restated; not its code);
  peft_svd      PEFT's own LoraModel.add_weighted_adapter(combination_type=
                "svd", svd_rank=32) of the two rank-32 adapters loaded into a
                model of four 3072 x 3072 Linear layers (the timed part is the
                call only; the RSS is the child's peak, model included);
  mergekit_extract  what mergekit-extract-lora does per linear weight,
                restated in torch: the two weights read lazily one tensor at a
                time, delta = (tuned - base) in float32, torch.linalg.svd
                (full_matrices=False), the top 32 kept (B = U_r sqrt(S_r),
                A = sqrt(S_r) Vh_r), stored BF16;
  kohya_extract what sd-scripts' extract_lora_from_models.py does: both
                state dicts loaded whole, delta in float32, torch.linalg.svd,
                U_r diag(S_r) and Vh_r, both clamped to the 0.99 quantile of
                their joint absolute values (its clamp_quantile default),
                stored BF16.
  (the extract anchors' formulas are restated from the tools' published
  behaviour, not their code; --extract-weights N times them on the first N
  of the 27 weights only and scales the seconds by 27 / N, said in the line)

Each line: {"bench": "algebra_anchor", "case", "tool", "seconds", "peak_rss_mb",
"rel_fro", "rel_fro_opt"} with errors computed here in float64 from the
written factors, then one {"case", "speedup", "rss_ratio"} line per case.
Needs the /work/venv packages (torch, peft); CI does not run it.
Usage: /work/venv/bin/python python/bench/bench_algebra.py [--lorakit PATH] [--dim N] [--threads N]
       [--extract-weights N] [--cases resize,merge,extract]"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def child(fn, *args):
    """Runs fn(*args) in a fresh interpreter; returns its JSON result plus peak RSS."""
    code = f"import json, sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); " \
           f"import bench_algebra as b; print(json.dumps(b.{fn}(*{args!r})))"
    # this child's own peak (os.wait4's rusage): RUSAGE_CHILDREN is the maximum over every child so far,
    # so a later, smaller anchor would report an earlier one's peak
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=err, text=True)
        _, status, ru = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if p.returncode != 0:
            raise SystemExit(f"{fn} failed: {err.read()[-2000:]}")
        r = json.loads(out.read().strip().splitlines()[-1])
    r["peak_rss_mb"] = ru.ru_maxrss / 1024.0
    return r


def load(path):
    from safetensors.torch import load_file
    return load_file(path)


def modules(sd):
    return sorted({k.rsplit(".", 2)[0] for k in sd if k.endswith("lora_down.weight")})


def errors(exact, written):
    """rel_fro of written vs exact deltas, and the optimum at written's rank, all float64."""
    import torch
    n2 = e2 = o2 = 0.0
    for name, X in exact.items():
        Y = written[name]
        k = written[name + "#rank"]
        s = torch.linalg.svdvals(X)
        n2 += float((s ** 2).sum())
        e2 += float(((X - Y) ** 2).sum())
        o2 += float((s[k:] ** 2).sum())
    return (e2 / n2) ** 0.5, (o2 / n2) ** 0.5


def exact_delta(sds_strengths):
    import torch
    out = {}
    for sd, st in sds_strengths:
        for m in modules(sd):
            up = sd[m + ".lora_up.weight"].double()
            down = sd[m + ".lora_down.weight"].double()
            a = float(sd[m + ".alpha"]) / down.shape[0]
            out[m] = out.get(m, 0) + st * a * (up @ down)
    return out


def kohya_resize(path, rank):
    import torch
    sd = load(path)
    t0 = time.perf_counter()
    new = {}
    for m in modules(sd):
        up = sd[m + ".lora_up.weight"].float()
        down = sd[m + ".lora_down.weight"].float()
        alpha = float(sd[m + ".alpha"])
        delta = (up @ down) * (alpha / down.shape[0])
        U, S, Vh = torch.linalg.svd(delta)
        new[m + ".lora_up.weight"] = (U[:, :rank] @ torch.diag(S[:rank])).to(torch.bfloat16)
        new[m + ".lora_down.weight"] = Vh[:rank].contiguous().to(torch.bfloat16)
        new[m + ".alpha"] = torch.tensor(float(rank)).to(torch.bfloat16)
    sec = time.perf_counter() - t0
    exact = exact_delta([(sd, 1.0)])
    w = {}
    for m in modules(sd):
        w[m] = new[m + ".lora_up.weight"].double() @ new[m + ".lora_down.weight"].double() * \
            (float(new[m + ".alpha"]) / rank)
        w[m + "#rank"] = rank
    rel, opt = errors(exact, w)
    return {"seconds": sec, "rel_fro": rel, "rel_fro_opt": opt}


def peft_svd(path_a, path_b, rank):
    import torch
    from peft import LoraConfig, get_peft_model
    sda, sdb = load(path_a), load(path_b)
    names = modules(sda)
    dim = sda[names[0] + ".lora_up.weight"].shape[0]

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(dim, dim, bias=False) for _ in names])
    model = M()
    r = sda[names[0] + ".lora_down.weight"].shape[0]
    alpha = float(sda[names[0] + ".alpha"])
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=["layers." + str(i) for i in range(len(names))])
    pm = get_peft_model(model, cfg, adapter_name="a")
    pm.add_adapter("b", cfg)
    with torch.no_grad():
        for i, m in enumerate(names):
            lin = pm.base_model.model.layers[i]
            for ad, sd in (("a", sda), ("b", sdb)):
                lin.lora_A[ad].weight.copy_(sd[m + ".lora_down.weight"].float())
                lin.lora_B[ad].weight.copy_(sd[m + ".lora_up.weight"].float())
    t0 = time.perf_counter()
    pm.base_model.add_weighted_adapter(["a", "b"], [1.0, 1.0], "merged", combination_type="svd", svd_rank=rank)
    sec = time.perf_counter() - t0
    exact = exact_delta([(sda, 1.0), (sdb, 1.0)])
    w = {}
    for i, m in enumerate(names):
        lin = pm.base_model.model.layers[i]
        w[m] = lin.lora_B["merged"].weight.double() @ lin.lora_A["merged"].weight.double() * lin.scaling["merged"]
        w[m + "#rank"] = rank
    rel, opt = errors(exact, w)
    return {"seconds": sec, "rel_fro": rel, "rel_fro_opt": opt}


def _pair_names(path):
    from safetensors import safe_open
    with safe_open(path, "pt") as f:
        return sorted(f.keys())


def _extract_errors(base, tuned, factors, names):
    """rel_fro of each written B A against the float64 delta, and its float64 optimum at rank 32."""
    import torch
    from safetensors import safe_open
    out = []
    with safe_open(base, "pt") as fb, safe_open(tuned, "pt") as ft:
        for n in names:
            D = ft.get_tensor(n).double() - fb.get_tensor(n).double()
            B, A = factors[n]
            s = torch.linalg.svdvals(D)
            nd = float(torch.linalg.norm(D))
            out.append((float(torch.linalg.norm(D - B.double() @ A.double())) / nd,
                        float((s[32:] ** 2).sum()) ** 0.5 / nd))
    return out


def mergekit_extract(base, tuned, nw, rank=32):
    import torch
    from safetensors import safe_open
    names = _pair_names(base)[:nw]
    t0 = time.perf_counter()
    fac = {}
    with safe_open(base, "pt") as fb, safe_open(tuned, "pt") as ft:
        for n in names:
            delta = ft.get_tensor(n).float() - fb.get_tensor(n).float()
            U, S, Vh = torch.linalg.svd(delta, full_matrices=False)
            r = S[:rank].sqrt()
            fac[n] = ((U[:, :rank] * r).to(torch.bfloat16), (r[:, None] * Vh[:rank]).to(torch.bfloat16))
    sec = time.perf_counter() - t0
    e = _extract_errors(base, tuned, fac, names)
    return {"seconds": sec, "weights": len(names), "rel_fro_minus_opt": max(a - b for a, b in e),
            "rel_fro": e[0][0], "rel_fro_opt": e[0][1]}


def kohya_extract(base, tuned, nw, rank=32):
    import torch
    sb, st = load(base), load(tuned)
    names = sorted(sb)[:nw]
    t0 = time.perf_counter()
    fac = {}
    for n in names:
        delta = st[n].float() - sb[n].float()
        U, S, Vh = torch.linalg.svd(delta)
        U = U[:, :rank] @ torch.diag(S[:rank])
        Vh = Vh[:rank]
        hi = torch.quantile(torch.cat([U.flatten(), Vh.flatten()]).abs(), 0.99)
        fac[n] = (U.clamp(-hi, hi).to(torch.bfloat16), Vh.clamp(-hi, hi).to(torch.bfloat16))
    sec = time.perf_counter() - t0
    e = _extract_errors(base, tuned, fac, names)
    return {"seconds": sec, "weights": len(names), "rel_fro_minus_opt": max(a - b for a, b in e),
            "rel_fro": e[0][0], "rel_fro_opt": e[0][1]}


def lorakit_extract_errors(lk, base, tuned, nw, threads):
    """lorakit's per-weight rel_fro (its report) minus the float64 optimum on the first nw weights."""
    out = base.replace("base", "lkx")
    rep = json.loads(subprocess.run([lk, "extract", base, tuned, "-o", out, "--rank", "32", "--json", "--threads",
                                     str(threads)], capture_output=True, text=True, check=True).stdout)
    os.unlink(out)
    from safetensors import safe_open
    import torch
    names = _pair_names(base)[:nw]
    worst, bound_ok = 0.0, True
    mods = {m["name"] + ".weight": m for m in rep["modules"]}
    with safe_open(base, "pt") as fb, safe_open(tuned, "pt") as ft:
        for n in names:
            D = ft.get_tensor(n).double() - fb.get_tensor(n).double()
            s = torch.linalg.svdvals(D)
            opt = float((s[32:] ** 2).sum() / (s ** 2).sum()) ** 0.5
            m = mods[n]
            worst = max(worst, m["rel_fro"] - opt)
            bound_ok = bound_ok and m["rel_fro_opt"] <= opt + 1e-12 <= m["rel_fro_opt_upper"] + 1e-12
    return {"rel_fro_minus_opt": worst, "optimum_inside_reported_bounds": bound_ok, "weights": len(names)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lorakit", default=os.path.join(os.path.dirname(__file__), "..", "..", "build", "lorakit"))
    ap.add_argument("--dim", type=int, default=3072)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--extract-weights", type=int, default=27)
    ap.add_argument("--cases", default="resize,merge,extract", help="the anchors to run (comma-separated)")
    args = ap.parse_args()
    cases = set(args.cases.split(","))
    with tempfile.TemporaryDirectory() as d:
        p = subprocess.run([args.lorakit, "bench", "algebra", "--json", "--keep", "--dir", d, "--dim", str(args.dim),
                            "--threads", str(args.threads)], capture_output=True, text=True, check=True)
        lk = {}
        for line in p.stdout.splitlines():
            r = json.loads(line)
            lk[r["case"]] = r
            print(json.dumps({"bench": "algebra_anchor", "case": r["case"], "tool": "lorakit", "seconds": r["seconds"],
                              "cpu_seconds": r["cpu_seconds"], "peak_rss_mb": r["peak_rss_mb"],
                              "rel_fro": r["rel_fro"], "rel_fro_opt": r["rel_fro_opt"]}), flush=True)
        r128 = lk["resize"]["input"]
        r32a = lk["merge"]["input"]
        r32b = r32a.replace("r32a", "r32b")
        anchors = []
        if "resize" in cases:
            anchors.append(("resize", "kohya_resize", child("kohya_resize", r128, 16)))
        if "merge" in cases:
            anchors.append(("merge", "peft_svd", child("peft_svd", r32a, r32b, 32)))
        xb = lk["extract"]["input"]
        xt = lk["extract"]["tuned"]
        nw = args.extract_weights
        scale = 27.0 / nw
        for tool in ("mergekit_extract", "kohya_extract") if "extract" in cases else ():
            r = child(tool, xb, xt, nw)
            r["seconds_measured"] = r["seconds"]
            r["seconds"] = r["seconds"] * scale
            if nw != 27:
                r["note"] = f"timed on {nw} of 27 weights, seconds scaled by 27/{nw}"
            anchors.append(("extract", tool, r))
        if "extract" in cases:
            lx = lorakit_extract_errors(args.lorakit, xb, xt, nw, args.threads)
            print(json.dumps({"bench": "algebra_anchor", "case": "extract", "tool": "lorakit_accuracy", **lx}), flush=True)
        for case, tool, r in anchors:
            print(json.dumps({"bench": "algebra_anchor", "case": case, "tool": tool, **r}), flush=True)
            print(json.dumps({"bench": "algebra_ratio", "case": case, "anchor": tool,
                              "speedup": r["seconds"] / lk[case]["seconds"],
                              "rss_ratio": r["peak_rss_mb"] / lk[case]["peak_rss_mb"],
                              "lorakit_rel_fro_over_opt": lk[case]["rel_fro"] / lk[case]["rel_fro_opt"]
                              if case != "extract" else None,  # extract's rel_fro_opt is a lower bound: see lorakit_accuracy
                              "anchor_rel_fro_over_opt": r["rel_fro"] / r["rel_fro_opt"]}), flush=True)


if __name__ == "__main__":
    main()
