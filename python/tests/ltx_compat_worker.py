"""One rank of the LTX-2 side-by-side check (test_compat_torch.py runs it
under torchrun, 2 and 4 ranks, gloo on CPU).

The same call sequence goes to LTX-2's own tracker (ltx_seed.py: the
seed's code on ltx-core's builder, registry and fusion) and to
lorakit.compat.ltx's, each over its own registry (two copies of one bf16
checkpoint), and after every step every tensor of the two registries is
compared bit for bit. The exact LoRAs' factors are multiples of 1/4 in
{-1/4, 0, 1/4} and the weights multiples of 2^-6 in [-1/2, 1/2], so every
product and sum is exact in bf16 (the test checks it: the float64
reference rounds to bf16 without loss): there LTX-2's bf16 arithmetic and
lorakit's single rounding must agree to the bit. A Gaussian LoRA step is
compared with the float64 reference rounded once (lorakit must equal it;
LTX-2's distance from it is reported). Rank 0 prints one JSON line with the
per-step timings of both trackers.

argv: WORK_DIR [DIM BLOCKS] (files written there by rank 0)."""
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ltx_seed  # noqa: E402
from ltx_core.loader.registry import StateDictRegistry  # noqa: E402
from ltx_core.loader.sd_ops import LTXV_LORA_COMFY_RENAMING_MAP as OPS  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import lorakit  # noqa: E402
from lorakit.compat import ltx  # noqa: E402  (the only change an LTX-2 program makes)

NAMES = ("to_q", "to_k", "to_v", "to_out")


class Tiny(torch.nn.Module):
    def __init__(self, dim, blocks):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleDict({n: torch.nn.Linear(dim, dim, bias=n != "to_k") for n in NAMES}) for _ in range(blocks))
        self.norm = torch.nn.LayerNorm(dim)


class Configurator:
    @classmethod
    def from_config(cls, config):
        return Tiny(config["dim"], config["blocks"])


def write_files(d, dim, blocks):
    g = torch.Generator().manual_seed(5)
    sd = {k: (torch.randint(-32, 33, v.shape, generator=g) * 2.0 ** -6).to(torch.bfloat16)
          for k, v in Tiny(dim, blocks).state_dict().items()}
    save_file(sd, os.path.join(d, "model.safetensors"), metadata={"config": json.dumps({"dim": dim, "blocks": blocks})})
    r = 4

    def lora(name, which, exact):
        t = {}
        for b in range(blocks):
            for n in which:
                m = f"diffusion_model.blocks.{b}.{n}"
                if exact:
                    a = torch.randint(-1, 2, (r, dim), generator=g) * 0.25
                    bb = torch.randint(-1, 2, (dim, r), generator=g) * 0.25
                else:
                    a = torch.randn(r, dim, generator=g) * 0.1
                    bb = torch.randn(dim, r, generator=g) * 0.1
                t[m + ".lora_A.weight"] = a.to(torch.bfloat16).contiguous()
                t[m + ".lora_B.weight"] = bb.to(torch.bfloat16).contiguous()
        save_file(t, os.path.join(d, name))

    lora("l1.safetensors", ("to_q", "to_v"), True)
    lora("l2.safetensors", ("to_v", "to_out"), True)
    lora("l3.safetensors", ("to_q", "to_k"), False)


def reference(clean, loras, d):
    """W + sum s * B A in float64 (from the files, keys renamed as OPS
    does), rounded once to bf16: {key: tensor} for the touched keys."""
    from safetensors.torch import load_file
    acc = {}
    for p, s in loras:
        for k, v in load_file(os.path.join(d, p)).items():
            if k.endswith(".lora_A.weight"):
                m = k[len("diffusion_model."):-len(".lora_A.weight")]
                b = load_file(os.path.join(d, p))[k.replace("lora_A", "lora_B")].double()
                acc[m + ".weight"] = acc.get(m + ".weight", 0) + s * (b @ v.double())
    return {k: clean[k].double() + v for k, v in acc.items()}


def main():
    d = sys.argv[1]
    dim = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    blocks = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    dist.init_process_group("gloo")
    R, N = dist.get_rank(), dist.get_world_size()
    if R == 0:
        write_files(d, dim, blocks)
    dist.barrier()
    P = lambda f: os.path.join(d, f)  # noqa: E731
    entry = lambda f, s: ltx_seed.LoraPathStrengthAndSDOps(P(f), s, OPS)  # noqa: E731
    mk = lambda: ltx_seed.Builder(model_class_configurator=Configurator, model_path=P("model.safetensors"),  # noqa: E731
                                  registry=StateDictRegistry())
    seed_b, lk_b = mk(), mk()
    seed_t = ltx_seed.TransformerWeightTracker(dist.group.WORLD, bucket_mb=1)
    lk_t = ltx.TransformerWeightTracker(dist.group.WORLD, bucket_mb=1)
    cpu = torch.device("cpu")
    times = []

    def sd_of(b):
        return b.registry.get([b.model_path], b.model_sd_ops).sd

    def same(step):
        a, b = sd_of(seed_b), sd_of(lk_b)
        assert a.keys() == b.keys(), step
        for k in a:
            assert torch.equal(a[k].view(torch.int16) if a[k].dtype == torch.bfloat16 else a[k],
                               b[k].view(torch.int16) if b[k].dtype == torch.bfloat16 else b[k]), (step, k)
        assert seed_t.loras == lk_t.loras, (step, seed_t.loras, lk_t.loras)

    def both(step, f_seed, f_lk):
        out = []
        for f in (f_seed, f_lk):
            dist.barrier()
            t0 = time.perf_counter()
            out.append(f())
            times.append((step, "seed" if f is f_seed else "lorakit", time.perf_counter() - t0))
        same(step)
        return out

    m_seed, m_lk = both("build clean", lambda: seed_t.build(seed_b, device=cpu), lambda: lk_t.build(lk_b, device=cpu))
    clean = {k: v.clone() for k, v in sd_of(lk_b).items()}
    b1s, b1l = seed_b.lora(P("l1.safetensors"), 1.0, OPS), lk_b.lora(P("l1.safetensors"), 1.0, OPS)
    m_seed, m_lk = both("build +l1", lambda: seed_t.build(b1s, device=cpu), lambda: lk_t.build(b1l, device=cpu))
    # the built model shares the registry's memory: its weight is the fused one
    assert m_lk.blocks[0]["to_q"].weight.data_ptr() == sd_of(lk_b)["blocks.0.to_q.weight"].data_ptr()
    ref = reference(clean, [("l1.safetensors", 1.0)], d)
    for k, v in ref.items():
        assert torch.equal(v.to(torch.bfloat16).double(), v), f"{k}: the exact case is not exact in bf16"
        assert torch.equal(sd_of(lk_b)[k], v.to(torch.bfloat16)), k
    both("build +l1 again", lambda: seed_t.build(b1s, device=cpu), lambda: lk_t.build(b1l, device=cpu))
    steps = [("l1 0.5 + l2 -0.25", [entry("l1.safetensors", 0.5), entry("l2.safetensors", -0.25)]),
             ("l2 1.0", [entry("l2.safetensors", 1.0)]),
             ("all zero: reset", [entry("l1.safetensors", 0.0)]),
             ("l2 -1 + l1 0.25", [entry("l2.safetensors", -1.0), entry("l1.safetensors", 0.25)]),
             ("same set reordered", [entry("l1.safetensors", 0.25), entry("l2.safetensors", -1.0)])]
    for name, loras in steps:
        both(name, lambda: seed_t.apply_loras_(sd_of(seed_b), tuple(loras), seed_b),
             lambda: lk_t.apply_loras_(sd_of(lk_b), tuple(loras), lk_b))
    assert lk_t.loras_match([(P("l1.safetensors"), 0.25, OPS.name), (P("l2.safetensors"), -1.0, OPS.name)])
    both("reset_loras", lambda: seed_t.reset_loras(sd_of(seed_b)), lambda: lk_t.reset_loras(sd_of(lk_b)))
    for k, v in clean.items():
        assert torch.equal(sd_of(lk_b)[k], v), k

    # a failed step: lorakit changes nothing on any rank (the seed is not run:
    # it copies the clean weights back before loading, so it would not)
    lk_t.apply_loras_(sd_of(lk_b), (entry("l1.safetensors", 1.0),), lk_b)
    before = {k: v.clone() for k, v in sd_of(lk_b).items()}
    try:
        lk_t.apply_loras_(sd_of(lk_b), (entry("missing.safetensors", 1.0),), lk_b)
        raise AssertionError("a missing adapter was applied")
    except (lorakit.LoraError, FileNotFoundError, OSError) as e:
        assert "missing" in str(e), str(e)
    assert all(torch.equal(before[k], v) for k, v in sd_of(lk_b).items())
    assert lk_t.loras == [(P("l1.safetensors"), 1.0, OPS.name)]
    seed_t.apply_loras_(sd_of(seed_b), (entry("l1.safetensors", 1.0),), seed_b)
    same("after the failed step")

    # a Gaussian LoRA: lorakit equals the float64 reference rounded once;
    # the seed's bf16 sums are measured against it
    g3 = [entry("l3.safetensors", 0.7)]
    for who, f in (("seed", lambda: seed_t.apply_loras_(sd_of(seed_b), tuple(g3), seed_b)),
                   ("lorakit", lambda: lk_t.apply_loras_(sd_of(lk_b), tuple(g3), lk_b))):
        dist.barrier()
        t0 = time.perf_counter()
        f()
        times.append(("gaussian l3 0.7", who, time.perf_counter() - t0))
    ref = reference(clean, [("l3.safetensors", 0.7)], d)
    worst, diff = 0, 0
    for k, v in ref.items():
        want = v.to(torch.bfloat16)
        assert torch.equal(sd_of(lk_b)[k], want), k
        off = (sd_of(seed_b)[k].double() - want.double()).abs()
        worst, diff = max(worst, float(off.max())), diff + int((off != 0).sum())
    for k in clean:
        if k not in ref:
            assert torch.equal(sd_of(lk_b)[k], clean[k]) and torch.equal(sd_of(seed_b)[k], clean[k]), k

    # no_lora_swap: the same refusals, word for word
    msgs = []
    for T, b in ((ltx_seed.TransformerWeightTracker, mk()), (ltx.TransformerWeightTracker, mk())):
        t = T(dist.group.WORLD, bucket_mb=1, no_lora_swap=True)
        t.build(b.lora(P("l1.safetensors"), 1.0, OPS), device=cpu)
        got = []
        for f in (lambda: t.apply_loras_(sd_of(b), (entry("l2.safetensors", 1.0),), b),
                  lambda: t.reset_loras(sd_of(b))):
            try:
                f()
                got.append(None)
            except RuntimeError as e:
                got.append(str(e))
        msgs.append(got)
    assert msgs[0] == msgs[1] and None not in msgs[0], msgs
    try:
        ltx.TransformerWeightTracker(dist.group.WORLD, bucket_mb=0)
    except ValueError as e:
        assert str(e) == "bucket_mb must be > 0"

    lk_t.close()
    tot = {}
    for step, who, s in times:
        tot.setdefault(step, {})[who] = round(s, 6)
    if R == 0:
        print(json.dumps({"bench": "ltx_compat", "ranks": N, "dim": dim, "blocks": blocks, "steps": tot,
                          "seed_total_s": round(sum(s for _, w, s in times if w == "seed"), 6),
                          "lorakit_total_s": round(sum(s for _, w, s in times if w == "lorakit"), 6),
                          "gaussian_seed_max_abs_off": worst, "gaussian_seed_elems_off": diff,
                          "gaussian_elems": sum(v.numel() for v in ref.values())}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {R}/{N}: ltx compat side by side passed", flush=True)


if __name__ == "__main__":
    main()
