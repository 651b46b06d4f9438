"""Fuse an adapter into a CUDA model, then hot-swap two adapters with
lorakit.Tracker over an NCCL process group (one GPU is enough).

    torchrun --nproc_per_node 1 examples/python/cuda_swap_nccl.py [OUT_DIR]
    torchrun --nproc_per_node 2 examples/python/cuda_swap_nccl.py   # one GPU per rank

1. Every rank builds the same small attention-style model (seeded) on its
   local GPU (LOCAL_RANK); rank 0 writes it and two LoRA adapters (diffusers
   key names, alpha = rank) into OUT_DIR (default: a temporary folder).
2. lorakit.fuse_ fuses adapter A at strength 1 into the CUDA state_dict in
   place; the result is checked against lorakit's offline file fuse of the
   same base and adapter (the same bytes: the canonical arithmetic).
3. A Tracker over the NCCL group (torch.distributed, backend "nccl") makes
   the set A, then B at 0.5, then A + B, then resets; after every step
   every rank's tensors equal the offline fuse of that set, and the reset
   gives the base back bit for bit.

Without a CUDA device (torch.cuda.is_available() is False, no driver) or
without NCCL in this PyTorch, it says so and exits with status 1.

TEST ONLY: LORAKIT_EXAMPLE_DEVICE=emul runs the same steps on lorakit's
emulated device instead (lorakit._testing: tensors in emul memory that
report CUDA device 0, over a gloo group whose host communicator takes that
memory as an NCCL group takes the GPU's), so CI runs this file without a
GPU (python/tests/test_examples_emul.py). Nothing else differs.
"""
import os
import sys
import tempfile


EMUL = os.environ.get("LORAKIT_EXAMPLE_DEVICE") == "emul"


def need_gpu():
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        sys.exit(f"cuda_swap_nccl.py: PyTorch is not installed ({e})")
    if EMUL:
        return torch, dist
    if not torch.cuda.is_available():
        sys.exit("cuda_swap_nccl.py: no CUDA device: this example needs an NVIDIA GPU and its driver "
                 "(torch.cuda.is_available() is False); nothing was run")
    if not dist.is_available() or not dist.is_nccl_available():
        sys.exit("cuda_swap_nccl.py: this PyTorch has no NCCL backend; nothing was run")
    return torch, dist


def model_tensors(torch, dim=64, blocks=2, seed=7):
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for b in range(blocks):
        for p in ("to_q", "to_k", "to_v", "to_out.0"):
            sd[f"blocks.{b}.attn.{p}.weight"] = (torch.randn(dim, dim, generator=g) * 0.05).to(torch.bfloat16)
            sd[f"blocks.{b}.attn.{p}.bias"] = torch.zeros(dim, dtype=torch.bfloat16)
    return sd


def write_adapter(torch, path, sd, targets, rank, seed):
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, w in sd.items():
        if k.endswith(".weight") and any(t in k for t in targets):
            m = k[: -len(".weight")]
            out[f"{m}.lora_A.weight"] = torch.randn(rank, w.shape[1], generator=g) * 0.1
            out[f"{m}.lora_B.weight"] = torch.randn(w.shape[0], rank, generator=g) * 0.1
    save_file(out, path)


def offline(torch, base_path, loras, out_path):
    """lorakit's offline file fuse of the set, loaded back (the oracle)."""
    import lorakit
    from safetensors.torch import load_file
    lorakit.fuse(base_path, loras, out_path)
    return load_file(out_path)


class OnGpu:
    """The model on this rank's GPU, the group NCCL."""

    def __init__(self, torch, dist):
        self.torch = torch
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        dist.init_process_group("nccl")
        self.group = dist.group.WORLD

    def put(self, t):
        return t.cuda()

    def bits(self, t):
        return t.cpu().view(self.torch.int16)

    def active(self):
        import contextlib
        return contextlib.nullcontext()


class OnEmul(OnGpu):
    """TEST ONLY (LORAKIT_EXAMPLE_DEVICE=emul): the model in lorakit's
    emulated device memory, the group gloo taking that memory in place."""

    def __init__(self, torch, dist):
        from lorakit import _testing, _torch
        self.torch, self.lt = torch, _testing
        dist.init_process_group("gloo")
        _torch._TorchHost.force_device = "emul"  # the group's lorakit communicator takes emul memory
        self.group = dist.new_group(list(range(dist.get_world_size())))

    def put(self, t):
        return self.lt.to_emul("BF16", t.view(self.torch.int16).numpy())

    def bits(self, t):
        return self.torch.from_numpy(self.lt.from_emul(t).view("int16"))

    def active(self):
        return self.lt.emul_as_cuda()


def same(place, a, b):
    """Bit equality of every tensor of b (host) with a's (on the device;
    BF16 compared as bits)."""
    import torch
    return sorted(a) == sorted(b) and all(place.bits(a[k]).equal(b[k].view(torch.int16)) for k in b)


def main():
    torch, dist = need_gpu()
    import lorakit
    from safetensors.torch import save_file

    place = (OnEmul if EMUL else OnGpu)(torch, dist)
    group = place.group
    rank = dist.get_rank()
    # one folder for every rank (the tracker's request names the adapters' paths, equal on every
    # rank): OUT_DIR, or rank 0's temporary folder sent to the others; rank 0 writes the files
    box = [sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="lk_cuda_swap_") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    out_dir = box[0]
    paths = {k: os.path.join(out_dir, f"{k}.safetensors") for k in ("base", "a", "b", "ref")}
    host = model_tensors(torch)
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        save_file(host, paths["base"])
        write_adapter(torch, paths["a"], host, ("to_q", "to_v"), 4, 11)
        write_adapter(torch, paths["b"], host, ("to_k", "to_out"), 8, 12)
    dist.barrier()

    with place.active():
        # 2. fuse_ into CUDA tensors, in place
        sd = {k: place.put(v) for k, v in host.items()}
        s = lorakit.fuse_(sd, [(paths["a"], 1.0)])
        want = offline(torch, paths["base"], [(paths["a"], 1.0)], paths["ref"] + f".{rank}")
        assert same(place, sd, want), "fuse_ on CUDA differs from the offline fuse"
        if rank == 0:
            print(f"fuse_: {s['tensors_fused']} tensors on {s['device']} ({s['keys_device']} by the device kernel, "
                  f"{s['keys_host_fallback']} on the host path): equal to the offline fuse")

        # 3. the tracker over the NCCL group
        sd = {k: place.put(v) for k, v in host.items()}
        tr = lorakit.Tracker(sd, comm=group, bucket_mb=1)
        steps = [[(paths["a"], 1.0)], [(paths["b"], 0.5)], [(paths["a"], 1.0), (paths["b"], 0.5)], []]
        for i, loras in enumerate(steps, 1):
            summary = tr.apply(loras) if loras else tr.reset()
            want = offline(torch, paths["base"], loras, paths["ref"] + f".{rank}") if loras else host
            assert same(place, sd, want), f"step {i}: the tracker's bytes differ from the offline fuse"
            assert lorakit.check_replicas(sd, group)
            if rank == 0:
                print(f"step {i}: {len(loras)} adapter(s): equal to the offline fuse on every rank ({summary})")
        tr.close()
    dist.destroy_process_group()
    if rank == 0:
        print(f"cuda_swap_nccl: fuse_ and the hot-swap on {'emul (TEST ONLY)' if EMUL else 'CUDA'} equal lorakit's "
              "offline fuse")


if __name__ == "__main__":
    main()
