"""One rank of the torch.distributed tests (test_torch_dist.py launches it
under torchrun with gloo). argv[1]: a JSON file holding the model's paths
and the expected digests, computed by the parent with the lorakit CLI's
offline fuse (the independent oracle). Every scenario runs on every rank;
a failed check raises, the process exits non-zero, torchrun reports it.

Run by hand: torchrun --nproc_per_node 2 torch_dist_worker.py spec.json
"""
import datetime
import json
import os
import re
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lorakit  # noqa: E402
import st_io  # noqa: E402
from lorakit.compat import fastvideo, ltx  # noqa: E402

Q, K = "blocks.0.attn.to_q.weight", "blocks.0.attn.to_k.weight"


def load(path):
    out = {}
    for k, (dt, a) in st_io.read(path).items():
        t = torch.from_numpy(a.copy())
        out[k] = t.view(torch.bfloat16) if dt == "BF16" else t
    return out


class Model(torch.nn.Module):
    """The checkpoint's tensors as a module whose state_dict names are the
    checkpoint's (nested submodules): float tensors are parameters
    (requires_grad, as in training), the rest persistent buffers."""

    def __init__(self, sd):
        super().__init__()
        for k, v in sd.items():
            *path, leaf = k.split(".")
            mod = self
            for p in path:
                if not hasattr(mod, p):
                    mod.add_module(p, torch.nn.Module())
                mod = getattr(mod, p)
            if v.is_floating_point():
                mod.register_parameter(leaf, torch.nn.Parameter(v.clone(), requires_grad=True))
            else:
                mod.register_buffer(leaf, v.clone())

    def tensor(self, k):
        return self.get_parameter(k) if k in dict(self.named_parameters()) else self.get_buffer(k)

    def sd(self):
        return self.state_dict(keep_vars=True)


def expect_raise(fn, exc, needle):
    try:
        fn()
    except exc as e:
        assert needle in str(e), f"expected {needle!r} in {e}"
        return e
    raise AssertionError(f"expected {exc.__name__} ({needle})")


def digest(sd):
    return lorakit.digest_tensors({k: v.detach() for k, v in sd.items()})


def main():
    spec = json.load(open(sys.argv[1]))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    R, N = dist.get_rank(), dist.get_world_size()
    want, m = spec["want"], spec["model"]
    base = load(m["base"])

    # --- Tracker over a module, comm=None: the default group ---
    model = Model(base)
    sd = model.sd()
    tr = lorakit.Tracker(sd, bucket_mb=1)
    steps = [("a1", [(m["a1"], 1.0)]), ("a1a2", [(m["a2"], -0.5), (m["a1"], 0.7)]), ("a2", [(m["a2"], 1.25)])]
    for name, loras in steps:
        tr.apply(loras)
        assert digest(sd) == want[name], name
        assert lorakit.check_replicas(sd)
    assert all(p.requires_grad for p in model.parameters())
    # failures: every rank raises, nothing changes anywhere
    before = digest(sd)
    e = expect_raise(lambda: tr.apply([(m["a1"], 1.0), (m["badshape"], 1.0)]), lorakit.LoraError, "badshape")
    assert digest(sd) == before
    mine = [(m["a1"], 0.5 if R == 0 else 0.25)]
    e = expect_raise(lambda: tr.apply(mine), lorakit.LoraError, "ranks disagree")
    assert e.status == "LK_ERR_MISMATCH"
    # every rank names rank 0's request and the first differing rank's (rank 1: the test's own requests)
    assert f"rank 0 asked for 1 adapter: {m['a1']}@0.5;" in str(e), str(e)
    assert f"rank 1 asked for 1 adapter: {m['a1']}@0.25 (this is rank {R})" in str(e), str(e)
    assert digest(sd) == before
    # a bad argument on one rank only: that rank its TypeError, the others LoraError
    bad = [(m["a1"], "x" if R == N - 1 else 1.0)]
    expect_raise(lambda: tr.apply(bad), TypeError if R == N - 1 else lorakit.LoraError, "strength")
    # apply on rank 0, reset on the others: a mismatch everywhere, no hang
    if R == 0:
        expect_raise(lambda: tr.apply([(m["a1"], 1.0)]), lorakit.LoraError, "ranks disagree")
    else:
        expect_raise(lambda: tr.reset(), lorakit.LoraError, "ranks disagree")
    assert digest(sd) == before
    tr.reset()
    assert digest(sd) == want["base"]
    tr.close()

    # --- the staged path an NCCL group takes (host buffers copied to a
    # device tensor, the collective, copied back), forced over gloo with the
    # CPU as the staging device: the same digests as the in-place path ---
    lorakit._torch._TorchHost.force_stage = torch.device("cpu")
    try:
        sd = Model(base).sd()
        tr = lorakit.Tracker(sd, bucket_mb=1)
        for name, loras in steps:
            tr.apply(loras)
            assert digest(sd) == want[name], "staged " + name
            assert lorakit.check_replicas(sd)
        g = [torch.full((5,), float(R + 1))]
        assert torch.equal(lorakit.sync_grads(g)[0], torch.full((5,), (N + 1) / 2))  # mean of 1..N
        tr.reset()
        assert digest(sd) == want["base"]
        tr.close()
    finally:
        lorakit._torch._TorchHost.force_stage = None
    assert lorakit._torch._stage_device(dist.group.WORLD) is None  # gloo: host memory in place

    # --- the Tracker made over the module itself remembers its memory ---
    model = Model(base)
    tr = lorakit.Tracker(model, bucket_mb=1)
    tr.apply([(m["a1"], 1.0)])
    assert digest(model.sd()) == want["a1"]
    model.tensor(Q).data = model.tensor(Q).data.clone()  # reallocated (as .to() would)
    expect_raise(lambda: tr.apply([(m["a2"], 1.25)]), RuntimeError, f"{Q}: moved")
    tr.close()

    # --- in-memory adapters: the files' bytes; ranks holding different
    # adapters under one name all raise, nothing changes ---
    model = Model(base)
    tr = lorakit.Tracker(model, bucket_mb=1)
    a1, a2 = lorakit.Adapter.load(m["a1"]), lorakit.Adapter.load(m["a2"])
    tr.apply([(a2, -0.5), (a1, 0.7)])
    assert digest(model.sd()) == want["a1a2"]
    mine = lorakit.Adapter(open(m["a1"] if R == 0 else m["a2"], "rb").read(), name="same-name")
    e = expect_raise(lambda: tr.apply([(mine, 1.0)]), lorakit.LoraError, "ranks disagree")
    assert e.status == "LK_ERR_MISMATCH" and digest(model.sd()) == want["a1a2"]
    tr.apply([a1])
    assert digest(model.sd()) == want["a1"]
    tr.close()

    # --- check_replicas on modules and parameters ---
    model = Model(base)
    assert lorakit.check_replicas(model) is True
    assert lorakit.check_replicas(model.parameters()) is True
    if R == N - 1:
        with torch.no_grad():
            model.tensor(Q)[0, 0] += 1
    assert lorakit.check_replicas(model) is (N == 1)

    # --- gradients: closed forms. grad of rank r = (r + 1) * i + r / 4;
    # mean = i * (N + 1) / 2 + (N - 1) / 8, exact in f32 at these sizes ---
    lin = torch.nn.Linear(12, 5)
    for i, p in enumerate(lin.parameters()):
        idx = torch.arange(p.numel(), dtype=torch.float64).reshape(p.shape)
        p.grad = ((R + 1) * idx + R / 4).to(torch.float32) if i == 0 or R != 1 else None  # rank 1 skipped the bias
    lorakit.sync_param_grads(lin.named_parameters())
    for i, p in enumerate(lin.parameters()):
        idx = torch.arange(p.numel(), dtype=torch.float64).reshape(p.shape)
        if i == 0 or N == 1:
            ref = idx * (N + 1) / 2 + (N - 1) / 8
        else:  # the bias: rank 1 contributes zeros
            ref = sum(((r + 1) * idx + r / 4) for r in range(N) if r != 1) / N
        assert torch.equal(p.grad.to(torch.float64), ref), (i, p.grad, ref)
    # different layouts: every rank raises
    g = [torch.ones(3 + (R == 0))]
    expect_raise(lambda: lorakit.sync_grads(g), lorakit.LoraError, "different buffer sets")

    # --- tied weights: one memory under two names is fused once, the same
    # by fuse_ and Tracker (and equal to fusing it under one name) ---
    tied = {k: v.clone() for k, v in base.items()}
    tied["lm_head.weight"] = tied[Q]
    single = {k: v.clone() for k, v in base.items()}
    lorakit.fuse_(single, [(m["a1"], 1.0)])
    lorakit.fuse_(tied, [(m["a1"], 1.0)])
    assert torch.equal(tied[Q], single[Q]) and tied["lm_head.weight"].data_ptr() == tied[Q].data_ptr()
    tied2 = {k: v.clone() for k, v in base.items()}
    tied2["lm_head.weight"] = tied2[Q]
    t2 = lorakit.Tracker(tied2)
    t2.apply([(m["a1"], 1.0)])
    assert torch.equal(tied2[Q], single[Q])
    t2.close()
    # overlapping different views: refused naming both keys, on every rank
    ov = {k: v.clone() for k, v in base.items()}
    ov["half"] = ov[Q].view(-1)[: ov[Q].numel() // 2 + 3]
    expect_raise(lambda: lorakit.Tracker(ov), (ValueError, lorakit.LoraError), "overlap")

    # --- the compat tracker: LTX-2's API, equal to the offline fuse ---
    class Entry:  # LTX-2's LoraPathStrengthAndSDOps shape (sd_ops None: formats detected)
        def __init__(self, path, strength):
            self.path, self.strength, self.sd_ops = path, strength, None

    model = Model(base)
    sd = model.state_dict()
    ct = ltx.TransformerWeightTracker(dist.group.WORLD, bucket_mb=1)
    for name, loras in steps:
        ct.apply_loras_(sd, [Entry(p, s) for p, s in loras] if name == "a1a2" else loras, None)
        assert digest(model.sd()) == want[name], name
        assert ct.loras_match(list(reversed(ct.loras)))
    ct.apply_loras_(sd, [lorakit.Adapter.load(m["a1"])], None)  # an Adapter alone: strength 1
    assert digest(model.sd()) == want["a1"]
    ct.apply_loras_(sd, steps[-1][1], None)
    before, listed = digest(model.sd()), list(ct.loras)
    expect_raise(lambda: ct.apply_loras_(sd, [(m["missing"], 1.0)], None), lorakit.LoraError, "missing")
    assert digest(model.sd()) == before and ct.loras == listed
    ct.reset_loras(sd)
    assert digest(model.sd()) == want["base"] and ct.loras == []
    ct.close()

    # --- FastVideo's sync over a 2 x 2 DeviceMesh (4 ranks), else the default group ---
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, N // 2), mesh_dim_names=("replicate", "shard")) if N == 4 else None

    class Lora(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.base = torch.nn.Linear(6, 4)
            self.base.requires_grad_(False)
            self.lora_A = torch.nn.Parameter(torch.zeros(2, 6))
            self.lora_B = torch.nn.Parameter(torch.zeros(4, 2))

    net = torch.nn.Sequential(Lora(), Lora())
    gen = torch.Generator().manual_seed(1234 + R)  # different values on every rank
    grads = {}
    for n, p in net.named_parameters():
        if p.requires_grad and not (R == N - 1 and n.startswith("1.")):  # the last rank skipped layer 1
            p.grad = torch.randn(p.shape, generator=gen)
        grads[n] = p.grad
    gathered = [None] * N
    dist.all_gather_object(gathered, {n: (g.to(torch.float64) if g is not None else None) for n, g in grads.items()})
    count = fastvideo.sync_replicated_lora_gradients(net, mesh)
    assert count == 4, count
    for n, p in net.named_parameters():
        if not p.requires_grad:
            continue
        ref = sum((gr[n] if gr[n] is not None else torch.zeros(p.shape, dtype=torch.float64)) for gr in gathered) / N
        err = (p.grad.to(torch.float64) - ref).abs().max().item()
        assert err <= 4 * 2.0 ** -24 * max(1.0, ref.abs().max().item()), (n, err)

    # --- a stalled rank: Tracker(timeout=1) over a group of its own; the last
    # rank sleeps 2.5 s before apply. The others raise LK_ERR_TIMEOUT within
    # the timeout and slack (lorakit/comm.h, passed to gloo through the host
    # backend's set_timeout); the late one finds them gone. ---
    g = dist.new_group(backend="gloo")
    sd2 = {k: v.clone() for k, v in base.items()}
    tr = lorakit.Tracker(sd2, comm=g, timeout=1.0)
    if R == N - 1:
        time.sleep(2.5)
    t0 = time.monotonic()
    try:
        tr.apply([(m["a1"], 1.0)])
        err = None
    except lorakit.LoraError as e:
        err = e
    took = time.monotonic() - t0
    if R != N - 1:
        assert err is not None and err.status == "LK_ERR_TIMEOUT", err
        assert "not complete after" in str(err), str(err)
        # the collective and the ranks waited for: the late rank among them
        mt = re.search(r"torch\.distributed (\S+).* not complete after .* on group rank (\d+) of (\d+), "
                       r"waiting for group ranks ([0-9, ]+)", str(err))
        assert mt and int(mt.group(2)) == R and int(mt.group(3)) == N, str(err)
        assert N - 1 in [int(x) for x in mt.group(4).split(",")], str(err)
        assert 0.9 <= took < 6, took
    else:
        # the others are gone: its first collective may still complete, or
        # time out, or meet a gloo pair the others' timeout tore down
        assert err is None or err.status in ("LK_ERR_TIMEOUT", "LK_ERR_COMM"), err
    print(f"rank {R}/{N}: stalled-rank check: {took:.2f} s: {err}", flush=True)

    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {R}/{N}: all torch.distributed checks passed", flush=True)


if __name__ == "__main__":
    main()
