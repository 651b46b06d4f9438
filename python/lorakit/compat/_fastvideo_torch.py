"""The torch half of lorakit.compat.fastvideo (imported on first use, so
the LoraConfig half works without torch): the LoRA layer, the injector,
the replicated-parameter setup and the PEFT export.

The layer computes what FastVideo's BaseLayerWithLoRA computes, in the
same order (base(x) + ((x A^T) B^T) * (alpha / rank when they differ) *
strength), so a model trained through it steps to the same weights as
FastVideo's. Its A comes from lorakit's counter-based generator (the C
library's lk_lora_rand_uniform, the one `lorakit train` uses): uniform in
[-1/sqrt(in), 1/sqrt(in)] (FastVideo's kaiming_uniform_(a=sqrt(5))
bound), keyed by (seed, "<module>.lora_A"), so every rank holds the same
A with no broadcast, whatever the order layers are made in; B is zero.
"""
import json
import os
import tempfile

import torch
from torch import nn

from .. import _lorakit as _c
from .._adapter import _safetensors_image

try:
    from torch.distributed.tensor import DTensor, Replicate
except ImportError:  # pragma: no cover - older torch
    DTensor, Replicate = (), ()


def _tuple_layer(module):
    """FastVideo's ReplicatedLinear (forward returns (out, bias)), known by
    its class name so that fastvideo is never imported."""
    return any(c.__name__ == "ReplicatedLinear" for c in type(module).__mro__)


def lora_compatible(module):
    """A layer enable_lora_training wraps: an nn.Linear, or FastVideo's
    ReplicatedLinear (what its get_lora_layer wraps without tensor
    parallelism)."""
    w = getattr(module, "weight", None)
    return (isinstance(module, nn.Linear) or _tuple_layer(module)) and isinstance(w, torch.Tensor) and w.dim() == 2


def init_a(name, seed, rank, in_dim, dtype, device):
    """A (rank x in_dim) from lorakit's generator keyed by (seed, name), in
    dtype: float32 values rounded once."""
    bound = (torch.tensor(1.0, dtype=torch.float32) / torch.tensor(float(in_dim), dtype=torch.float32).sqrt()).item()
    raw = _c.rand_uniform(rank * in_dim, int(seed) & (2**64 - 1), name, bound)
    a = torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(rank, in_dim)
    return a.to(dtype=dtype, device=device)


class BaseLayerWithLoRA(nn.Module):
    """A trainable LoRA around a frozen linear layer (FastVideo's
    BaseLayerWithLoRA in training mode): base_layer, lora_A (rank x in),
    lora_B (out x rank), lora_rank, lora_alpha, lora_strength (1.0),
    merged and disable_lora (False), weight and bias read through
    base_layer. forward returns what the base layer returns (a tensor for
    nn.Linear, (out, bias) for FastVideo's layers) plus the LoRA term."""

    def __init__(self, base_layer, lora_rank, lora_alpha, name, seed=0):
        super().__init__()
        self.base_layer = base_layer
        self.lora_rank = int(lora_rank)
        self.lora_alpha = int(lora_alpha) if lora_alpha is not None else self.lora_rank
        self.lora_strength = 1.0
        self.merged = False
        self.disable_lora = False
        self.training_mode = True
        self.lora_path = None
        self._returns_tuple = _tuple_layer(base_layer)
        self.base_layer.requires_grad_(False)
        w = base_layer.weight
        local = w.to_local() if isinstance(w, DTensor) else w
        out_dim, in_dim = local.shape
        self.lora_A = nn.Parameter(init_a(f"{name}.lora_A", seed, self.lora_rank, in_dim, local.dtype, local.device))
        self.lora_B = nn.Parameter(torch.zeros(out_dim, self.lora_rank, dtype=local.dtype, device=local.device))

    @property
    def weight(self):
        return self.base_layer.weight

    @property
    def bias(self):
        return getattr(self.base_layer, "bias", None)

    def forward(self, x):
        a, b = self.lora_A, self.lora_B
        if isinstance(b, DTensor):
            a, b = a.to_local(), b.to_local()
        # FastVideo's order: the LoRA term before the base layer (autograd
        # then sums x's gradient contributions in the same order)
        delta = None
        if not self.merged and not self.disable_lora:
            delta = x @ a.to(x).T @ b.to(x).T
            if self.lora_alpha != self.lora_rank:
                delta = delta * (self.lora_alpha / self.lora_rank)
            delta = delta * self.lora_strength
        out = self.base_layer(x)
        bias = None
        if self._returns_tuple:
            out, bias = out
        if delta is not None:
            out = out + delta
        return (out, bias) if self._returns_tuple else out


def is_lora_layer(module):
    """lorakit's layer or FastVideo's own (duck typed)."""
    return isinstance(module, BaseLayerWithLoRA) or (
        hasattr(module, "base_layer") and hasattr(module, "lora_A") and hasattr(module, "lora_B"))


def replace_submodule(model, module_name, new_module):
    parent = model.get_submodule(".".join(module_name.split(".")[:-1]))
    setattr(parent, module_name.split(".")[-1], new_module)
    return new_module


def replicate_lora_parameters(transformer):
    """Where the base layers' parameters are DTensors (FSDP/HSDP), the LoRA
    parameters become replicated DTensors on the same mesh (Replicate on
    every mesh dim). The values are equal on every rank by construction
    (the seeded generator), so nothing is broadcast."""
    mesh = None
    for m in transformer.modules():
        if is_lora_layer(m):
            mesh = next((p.device_mesh for p in m.base_layer.parameters() if isinstance(p, DTensor)), None)
            if mesh is not None:
                break
    if mesh is None:
        return
    for m in transformer.modules():
        if not is_lora_layer(m):
            continue
        for attr in ("lora_A", "lora_B"):
            p = getattr(m, attr, None)
            if p is None or isinstance(p, DTensor):
                continue
            d = DTensor.from_local(p.detach(), device_mesh=mesh, placements=[Replicate()] * mesh.ndim,
                                   run_check=False)
            setattr(m, attr, nn.Parameter(d, requires_grad=p.requires_grad))


def initialize_lora_parameter(name, tensor, *, parameter_names, seed):
    """FastVideo's missing-parameter initializer for prepare_for_fsdp: fills
    tensor in place when name is one of the LoRA parameters (A from the
    seeded generator, B zero) and returns True; False for other names."""
    if name not in parameter_names:
        return False
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    with torch.no_grad():
        if name.endswith(".lora_A"):
            local.copy_(init_a(name, seed, local.shape[0], local.shape[1], local.dtype, local.device))
        else:
            local.zero_()
    return True


def lora_layers(transformer):
    return [(n, m) for n, m in transformer.named_modules() if is_lora_layer(m) and m.lora_A is not None]


def peft_state(transformer):
    """(tensors, config) of the model's LoRA layers as PEFT saves them:
    base_model.model.<m>.lora_A.weight / .lora_B.weight, and an
    adapter_config.json dict with r, lora_alpha and the wrapped modules.
    Ranks and alphas must be uniform (PEFT's rank_pattern/alpha_pattern
    carry the exceptions)."""
    layers = lora_layers(transformer)
    if not layers:
        raise ValueError("No training LoRA wrappers were found: nothing to save")
    tensors, ranks, alphas = {}, {}, {}
    for n, m in layers:
        for attr in ("lora_A", "lora_B"):
            t = getattr(m, attr)
            t = t.to_local() if isinstance(t, DTensor) else t
            tensors[f"base_model.model.{n}.{attr}.weight"] = t.detach().cpu().contiguous()
        ranks[n], alphas[n] = int(m.lora_rank), int(m.lora_alpha)
    r = max(set(ranks.values()), key=list(ranks.values()).count)
    a = max(set(alphas.values()), key=list(alphas.values()).count)
    config = {"peft_type": "LORA", "task_type": None, "r": r, "lora_alpha": a,
              "target_modules": sorted(ranks), "lora_dropout": 0.0, "bias": "none", "use_rslora": False,
              "use_dora": False, "fan_in_fan_out": False, "init_lora_weights": True, "modules_to_save": None,
              "rank_pattern": {n: v for n, v in ranks.items() if v != r},
              "alpha_pattern": {n: v for n, v in alphas.items() if v != a}}
    return tensors, config


def save_peft(transformer, out_dir):
    """Writes out_dir/adapter_model.safetensors and adapter_config.json,
    each to a temporary in out_dir renamed into place when complete."""
    tensors, config = peft_state(transformer)
    os.makedirs(out_dir, exist_ok=True)
    for name, data in (("adapter_model.safetensors", _safetensors_image(tensors)),
                       ("adapter_config.json", json.dumps(config, indent=2, sort_keys=True).encode())):
        fd, tmp = tempfile.mkstemp(dir=out_dir, prefix="." + name + ".")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, os.path.join(out_dir, name))
        except BaseException:
            os.unlink(tmp)
            raise
    return out_dir
