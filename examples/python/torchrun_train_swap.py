"""Train a LoRA data-parallel under torchrun, save it, hot-swap it: the
whole loop of a FastVideo-style trainer and an LTX-2-style server on
lorakit, over torch.distributed (gloo on CPU), without mpi4py.

    torchrun --nproc_per_node 2 examples/python/torchrun_train_swap.py [OUT_DIR]

1. Every rank builds the same small attention-style model (seeded) and wraps
   its to_q/to_v projections with PEFT LoRA (rank 4).
2. Each rank trains on its own batches; after backward,
   lorakit.compat.fastvideo.sync_replicated_lora_gradients averages the LoRA
   gradients over the default group (bucketed, zero-filled for a skipped
   layer), so the replicas stay identical (checked with check_replicas).
3. Rank 0 saves the adapter with PEFT's save_pretrained (what PEFT,
   diffusers and `lorakit fuse` load).
4. A fresh copy of the base model is served with
   lorakit.compat.ltx.TransformerWeightTracker: the saved adapter is fused
   in (outputs equal the trained PEFT model's), then swapped to half
   strength from memory (Adapter.from_peft), then reset (outputs equal the
   base model's bit for bit). Rank 0 prints what happened.
"""
import copy
import os
import sys
import tempfile

import torch
import torch.distributed as dist

import lorakit
from lorakit.compat import fastvideo, ltx


class Block(torch.nn.Module):
    def __init__(self, dim=32):
        super().__init__()
        self.to_q = torch.nn.Linear(dim, dim)
        self.to_k = torch.nn.Linear(dim, dim)
        self.to_v = torch.nn.Linear(dim, dim)
        self.to_out = torch.nn.Linear(dim, dim)

    def forward(self, x):  # x: (batch, tokens, dim)
        q, k, v = self.to_q(x), self.to_k(x), self.to_v(x)
        a = torch.softmax(q @ k.transpose(1, 2) / q.shape[-1] ** 0.5, dim=-1)
        return x + self.to_out(a @ v)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def main():
    import peft

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(tempfile.gettempdir(), "lorakit_torchrun_lora")

    torch.manual_seed(0)
    base = Model()
    clean = {k: v.clone() for k, v in base.state_dict().items()}
    cfg = fastvideo.LoraConfig.coerce({"enable": True, "rank": 4, "alpha": 8, "target_modules": ["to_q", "to_v"]})
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha,
                                                                     target_modules=cfg.target_modules))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)

    # each rank its own data; the teacher is the base model with a rank-2
    # change to every to_v, which the LoRA can learn
    teacher = copy.deepcopy(base)
    with torch.no_grad():
        for b in teacher.blocks:
            b.to_v.weight += 0.5 * torch.randn(32, 2) @ torch.randn(2, 32) / 32 ** 0.5
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(40):
        x = torch.randn(8, 6, 32, generator=gen)
        with torch.no_grad():
            y = teacher(x)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        n = fastvideo.sync_replicated_lora_gradients(model)
        opt.step()
        if step % 10 == 0 or step == 39:
            say(f"step {step:2d}  loss {loss.item():.4f}  ({n} LoRA gradients averaged over {world} ranks)")
    lora_params = {k: v for k, v in model.named_parameters() if "lora_" in k}
    assert lorakit.check_replicas(lora_params), "LoRA replicas diverged"
    say("replicas identical after training:", True)

    if rank == 0:
        model.save_pretrained(out_dir)
    dist.barrier()
    say(f"saved {out_dir} (PEFT format)")

    # serve: a fresh base model, the adapter swapped in and out in place
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want_trained = model(x)
    served = Model()
    served.load_state_dict(clean)
    with torch.no_grad():
        want_base = served(x)
    sd = served.state_dict()  # the served model's own memory, fused in place
    tracker = ltx.TransformerWeightTracker(dist.group.WORLD, bucket_mb=1)  # LTX-2's signature
    tracker.apply_loras_(sd, [(out_dir, 1.0)], None)
    with torch.no_grad():
        got = served(x)
    err = (got - want_trained).abs().max().item()
    say(f"apply saved adapter: {tracker.loras}, max |out - PEFT model out| = {err:.2e}")
    assert err < 1e-4
    half = lorakit.Adapter.from_peft(model)
    tracker.apply_loras_(sd, [(half, 0.5)], None)
    say(f"swap to in-memory adapter at 0.5: loras_match={tracker.loras_match([(half, 0.5, None)])}")
    tracker.reset_loras(sd)
    with torch.no_grad():
        same = torch.equal(served(x), want_base)
    say("reset: outputs equal the base model's bit for bit:", same)
    assert same and lorakit.check_replicas(served)
    tracker.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
