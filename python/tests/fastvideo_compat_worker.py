"""One rank of the FastVideo side-by-side check (test_compat_torch.py runs
it under torchrun, gloo on CPU, with TORCHDYNAMO_DISABLE=1: FastVideo's
LoRA forward is wrapped in torch.compile, which on CPU would only add a
compile).

The same training program runs twice on one small DiT-shaped model built
from FastVideo's own ReplicatedLinear: once with FastVideo 0.2.1's
enable_lora_training (fastvideo.train.utils.lora, from PyPI) and once with
lorakit.compat.fastvideo's, the program otherwise unchanged. Checked:
- the same layers wrapped (names and count, exclude_lora_layers honoured)
  and the same error messages;
- lorakit's A equal on every rank without a broadcast, and equal to the C
  library's generator (lorakit._lorakit.rand_uniform);
- from the same start (FastVideo's torch-RNG A replaced by lorakit's), the
  LoRA weights equal bit for bit after every AdamW step, FastVideo's side
  averaging its gradients as the seed's sync_replicated_lora_gradients
  does (one all_reduce and one div_ per parameter, in module order) and
  lorakit's with compat.fastvideo.sync_replicated_lora_gradients;
- lorakit's averaged float32, bfloat16 and float16 gradients against the
  float64 average of every rank's gradients rounded once;
- the trained adapter saved as PEFT: `lorakit fuse` of it equals the
  float64 W + (alpha/r) B A rounded once, PEFT's merge_and_unload is
  within float32's error bound for its own sums (8 eps of |W| + c|B||A|),
  and PEFT's unmerged model gives the trained model's outputs.
Rank 0 prints one JSON line with the timings of both loops (same run).

argv: WORK_DIR"""
import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from fastvideo.layers.linear import ReplicatedLinear  # noqa: E402
from fastvideo.layers.lora.linear import BaseLayerWithLoRA as FVLayer  # noqa: E402
from fastvideo.train.utils import lora as fv  # noqa: E402  (upstream)

import lorakit  # noqa: E402
from lorakit.compat import fastvideo as lk  # noqa: E402  (the only change)

DIM, HEADS, STEPS = 32, 2, 6


def lin(layer, x):
    y = layer(x)
    return y[0] if isinstance(y, tuple) else y


class Attn(nn.Module):
    def __init__(self, L):
        super().__init__()
        self.to_q, self.to_k, self.to_v = L(DIM, DIM), L(DIM, DIM), L(DIM, DIM)
        self.to_out = nn.ModuleList([L(DIM, DIM)])

    def forward(self, x):
        q, k, v = lin(self.to_q, x), lin(self.to_k, x), lin(self.to_v, x)
        a = torch.softmax(q @ k.transpose(-1, -2) / DIM ** 0.5, dim=-1) @ v
        return lin(self.to_out[0], a)


class Block(nn.Module):
    def __init__(self, L):
        super().__init__()
        self.attn = Attn(L)
        self.ff = nn.ModuleList([L(DIM, 2 * DIM), L(2 * DIM, DIM)])

    def forward(self, x):
        x = x + self.attn(x)
        return x + lin(self.ff[1], torch.nn.functional.gelu(lin(self.ff[0], x)))


class DiT(nn.Module):
    def __init__(self, L):
        super().__init__()
        self.blocks = nn.ModuleList([Block(L), Block(L)])
        self.proj_out = L(DIM, DIM)
        self.config = SimpleNamespace(arch_config=SimpleNamespace(exclude_lora_layers=["blocks.1.attn.to_k"]))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return lin(self.proj_out, x)


def fv_linear(i, o):
    return ReplicatedLinear(i, o, bias=True, params_dtype=torch.float32)


def base_state(dtype=torch.float32):
    g = torch.Generator().manual_seed(11)  # the same on every rank
    return {k: (torch.randn(v.shape, generator=g) * 0.2).to(dtype) for k, v in DiT(nn.Linear).state_dict().items()}


def make(L, sd):
    m = DiT(L)
    m.load_state_dict(sd)
    return m


def wrapped(model, cls):
    return sorted(n for n, m in model.named_modules() if isinstance(m, cls))


def seed_sync(transformer):
    """The seed's sync_replicated_lora_gradients on local tensors: for
    each LoRA parameter in module order, zero-fill a missing grad, one
    all_reduce, one div_ by the group size."""
    n = 0
    for module in transformer.modules():
        for attr in ("lora_A", "lora_B"):
            p = getattr(module, attr, None)
            if not isinstance(p, torch.Tensor) or not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
            p.grad.div_(dist.get_world_size())
            n += 1
    return n


def message(f):
    try:
        f()
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(3, 5, DIM, generator=g), torch.randn(3, 5, DIM, generator=g)


def loras(model):
    return {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
            for n, p in model.named_parameters() if n.endswith(("lora_A", "lora_B"))}


def gathered_avg(model):
    """{name: float64 average of every rank's grad}."""
    mine = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {n: sum(e[n] for e in every) / len(every) for n in mine}


def check_low_precision(R, N, sd):
    """bf16 and f16 gradients: averaged in f32, rounded once (against the
    float64 average); a float64 gradient is refused naming its parameter."""
    out = {}
    for dt in (torch.bfloat16, torch.float16):
        m = make(nn.Linear, sd).to(dt)
        lk.enable_lora_training(m, lora_rank=4, lora_alpha=8)
        for p in m.parameters():
            if p.requires_grad:
                g = torch.Generator().manual_seed(hash((R, p.shape)) % 2**31)
                p.grad = (torch.randn(p.shape, generator=g) * 1e-2).to(dt)
        ref = gathered_avg(m)
        assert lk.sync_replicated_lora_gradients(m) == len(ref)
        worst, inexact, total = 0.0, 0, 0
        for n, p in m.named_parameters():
            if n in ref:
                assert p.grad.dtype == dt, (n, p.grad.dtype)
                want = ref[n].to(dt)
                off = (p.grad.double() - want.double()).abs()
                # at most the second rounding of a tie: one ulp of want
                ulp = (want.double().abs() * 2.0 ** -(8 if dt == torch.bfloat16 else 11)).clamp_min(2.0 ** -133)
                assert bool((off <= ulp).all()), (n, float(off.max()))
                inexact, total = inexact + int((off != 0).sum()), total + off.numel()
                worst = max(worst, float(off.max()))
        assert inexact <= max(2, total // 500), (dt, inexact, total)
        out[str(dt)] = {"elements": total, "not_equal_to_f64_rounded_once": inexact}
    m = make(nn.Linear, sd).to(torch.float64)
    lk.enable_lora_training(m, lora_rank=2)
    for p in m.parameters():
        if p.requires_grad:
            p.grad = torch.zeros(p.shape, dtype=torch.float64)
    try:
        lk.sync_replicated_lora_gradients(m)
        raise AssertionError("a float64 gradient was averaged")
    except (TypeError, lorakit.LoraError) as e:
        assert "blocks.0.attn.to_q.lora_A" in str(e), str(e)
    return out


def peft_check(d, model, sd):
    """rank 0: the trained adapter as PEFT, fused by the CLI and by PEFT."""
    from peft import PeftModel
    from safetensors.torch import load_file, save_file
    out = lk.save_lora_peft(model, os.path.join(d, "adapter"))
    base = os.path.join(d, "base.safetensors")
    save_file({k: v.contiguous() for k, v in sd.items()}, base)
    fused = os.path.join(d, "fused.safetensors")
    cli = os.environ.get("LORAKIT_BIN")
    if cli:
        subprocess.run([cli, "fuse", base, "-l", out, "-o", fused], check=True, capture_output=True)
    else:
        lorakit.fuse(base, [(out, 1.0)], fused)
    got = load_file(fused)
    twin = make(nn.Linear, sd)
    twin.config = {}  # PEFT reads model.config as a dict
    merged = PeftModel.from_pretrained(twin, out).merge_and_unload().state_dict()
    worst_peft = 0.0
    for n, m in model.named_modules():
        if isinstance(m, lk.BaseLayerWithLoRA):
            w = sd[n + ".weight"].double() + (m.lora_alpha / m.lora_rank) * (m.lora_B.double() @ m.lora_A.double())
            want = w.float()
            assert torch.equal(got[n + ".weight"], want), n
            # PEFT merges in float32 (a rank-4 product, a scale, an add): its
            # error bound, in units of the magnitudes it sums
            mag = sd[n + ".weight"].double().abs() + (m.lora_alpha / m.lora_rank) * (
                m.lora_B.double().abs() @ m.lora_A.double().abs())
            off = (merged[n + ".weight"].double() - w).abs() / mag.clamp_min(2.0 ** -126)
            worst_peft = max(worst_peft, float(off.max()))
    assert worst_peft <= 8 * 2.0 ** -24, worst_peft
    untouched = [k for k in sd if k not in {n + ".weight" for n, m in model.named_modules()
                                            if isinstance(m, lk.BaseLayerWithLoRA)}]
    assert all(torch.equal(got[k], sd[k]) for k in untouched)
    x = batch(99, 0)[0]
    twin = make(nn.Linear, sd)
    twin.config = {}
    peft_model = PeftModel.from_pretrained(twin, out)
    with torch.no_grad():
        err = float((peft_model(x) - model(x)).abs().max())
    assert err < 1e-5, err
    return {"peft_merge_max_rel_off": worst_peft, "peft_forward_max_abs_off": err}


def main():
    d = sys.argv[1]
    dist.init_process_group("gloo")
    R, N = dist.get_rank(), dist.get_world_size()
    sd = base_state()
    fv_m, lk_m = make(fv_linear, sd), make(fv_linear, sd)
    n_fv = fv.enable_lora_training(fv_m, lora_rank=4, lora_alpha=8)
    n_lk = lk.enable_lora_training(lk_m, lora_rank=4, lora_alpha=8)
    assert n_fv == n_lk and wrapped(fv_m, FVLayer) == wrapped(lk_m, lk.BaseLayerWithLoRA), (
        wrapped(fv_m, FVLayer), wrapped(lk_m, lk.BaseLayerWithLoRA))
    assert "blocks.1.attn.to_k" not in wrapped(lk_m, lk.BaseLayerWithLoRA)
    # the seed's messages, word for word (FastVideo 0.2.1's where it has them)
    for kw in ({"lora_rank": 0}, {"lora_rank": 2, "lora_target_modules": ["nothing_here"]}):
        a = message(lambda: fv.enable_lora_training(make(fv_linear, sd), **kw))
        b = message(lambda: lk.enable_lora_training(make(fv_linear, sd), **kw))
        assert a == b and a is not None, (a, b)
    assert message(lambda: lk.finalize_lora_training(make(fv_linear, sd))) == (
        "ValueError: No training LoRA wrappers were found after checkpoint loading")  # the seed's text
    # lorakit's A: the generator's values, equal on every rank
    a = lk_m.blocks[0].attn.to_q.lora_A.detach()
    bound = float(torch.tensor(1.0) / torch.tensor(float(DIM)).sqrt())
    raw = lorakit._lorakit.rand_uniform(a.numel(), 0, "blocks.0.attn.to_q.lora_A", bound)
    assert torch.equal(a, torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(a.shape))
    assert float(a.abs().max()) <= bound and float(a.abs().max()) > 0.9 * bound
    every = [None] * N
    dist.all_gather_object(every, loras(lk_m))
    assert all(all(torch.equal(e[k], every[0][k]) for k in e) for e in every)
    assert all(float(v.abs().max()) == 0 for k, v in loras(lk_m).items() if k.endswith("lora_B"))
    # the same start: FastVideo's torch-RNG A replaced by lorakit's
    with torch.no_grad():
        src = dict(lk_m.named_parameters())
        for n, p in fv_m.named_parameters():
            if n.endswith(("lora_A", "lora_B")):
                p.copy_(src[n])
    opt = {id(m): torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2, foreach=False)
           for m in (fv_m, lk_m)}
    timing = {"fastvideo": {"step_s": 0.0, "sync_s": 0.0}, "lorakit": {"step_s": 0.0, "sync_s": 0.0}}
    worst4 = 0.0
    for step in range(STEPS):
        x, y = batch(step, R)
        for who, m, sync in (("fastvideo", fv_m, seed_sync), ("lorakit", lk_m, lk.sync_replicated_lora_gradients)):
            dist.barrier()
            t0 = time.perf_counter()
            opt[id(m)].zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward()
            t_ref = time.perf_counter()
            ref = gathered_avg(m) if who == "lorakit" and step == 0 else None
            t1 = time.perf_counter()
            t0 += t1 - t_ref  # the check's gather is not the loop's time
            assert sync(m) == 2 * n_lk
            timing[who]["sync_s"] += time.perf_counter() - t1
            if ref is not None:  # float32: the float64 average rounded once (exact at 2 ranks)
                for n, p in m.named_parameters():
                    if n in ref:
                        off = float((p.grad.double() - ref[n].float().double()).abs().max())
                        assert off == 0 if N == 2 else off <= 4 * 2.0 ** -24 * float(ref[n].abs().max()), (n, off)
            opt[id(m)].step()
            timing[who]["step_s"] += time.perf_counter() - t0
        a, b = loras(fv_m), loras(lk_m)
        if N == 2:
            assert all(torch.equal(a[k], b[k]) for k in a), (step, [k for k in a if not torch.equal(a[k], b[k])])
        else:  # gloo's and lorakit's sums of 4 terms are ordered differently: a few ulps
            off = max(float((a[k] - b[k]).abs().max()) for k in a)
            assert off <= 1e-6, (step, off)
            worst4 = max(worst4, off)
    assert lorakit.check_replicas(loras(lk_m))
    low = check_low_precision(R, N, sd)
    res = {"bench": "fastvideo_compat", "ranks": N, "steps": STEPS, "layers": n_lk,
           "fastvideo": {k: round(v, 6) for k, v in timing["fastvideo"].items()},
           "lorakit": {k: round(v, 6) for k, v in timing["lorakit"].items()}, "low_precision": low,
           "max_abs_weight_off": worst4}
    if R == 0:
        res.update(peft_check(d, lk_m, sd))
        print(json.dumps(res), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {R}/{N}: fastvideo compat side by side passed", flush=True)


if __name__ == "__main__":
    main()
