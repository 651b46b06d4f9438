"""FastVideo's training-side LoRA API (fastvideo/train/utils/lora.py) on
lorakit: LoraConfig with the seed's fields, defaults and messages, and
sync_replicated_lora_gradients over lorakit's bucketed gradient average.
"""
import logging
from dataclasses import dataclass
from typing import Any, List, Optional

__all__ = ["DEFAULT_LORA_TARGET_MODULES", "LoraConfig", "sync_replicated_lora_gradients"]

logger = logging.getLogger("lorakit.compat.fastvideo")

DEFAULT_LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "to_q", "to_k", "to_v", "to_out", "to_qkv",
                               "to_gate_compress"]

_LORA_CONFIG_KEYS = ("enable", "rank", "alpha", "target_modules")


@dataclass
class LoraConfig:
    """LoRA settings for one model role, from the ``models.<role>.lora``
    YAML block (enable, rank, alpha, target_modules), with FastVideo's
    rules: enable without rank, or rank <= 0, is a ValueError; a rank while
    disabled is logged (INFO) and ignored; alpha defaults to rank where it
    is used; unknown keys (in coerce) are logged (WARNING) with the valid
    ones. Messages are FastVideo's, on the `lorakit.compat.fastvideo`
    logger."""

    enable: bool = False
    rank: Optional[int] = None
    alpha: Optional[int] = None
    target_modules: Optional[List[str]] = None

    def __post_init__(self) -> None:
        if self.rank is not None:
            self.rank = int(self.rank)
        if self.alpha is not None:
            self.alpha = int(self.alpha)
        if self.target_modules is not None:
            self.target_modules = list(self.target_modules)
        if self.enable:
            if self.rank is None:
                raise ValueError("models.<role>.lora.enable is true but lora.rank is unset "
                                 "— an explicit positive rank is required to enable LoRA")
            if self.rank <= 0:
                raise ValueError(f"models.<role>.lora.rank must be > 0, got {self.rank!r}")
        elif self.rank is not None:
            logger.info("models.<role>.lora.rank=%s is set but lora.enable is false — "
                        "LoRA will NOT be applied (model trains on its normal "
                        "trainable path).", self.rank)

    @classmethod
    def coerce(cls, obj: "LoraConfig | dict[str, Any] | None") -> "Optional[LoraConfig]":
        """A raw YAML mapping (or a LoraConfig) as a LoraConfig; None when no
        lora block was given (the same as enable: false)."""
        if obj is None:
            return None
        if isinstance(obj, LoraConfig):
            return obj
        if not isinstance(obj, dict):
            raise TypeError("models.<role>.lora must be a mapping or LoraConfig, got "
                            f"{type(obj).__name__}")
        unknown = set(obj) - set(_LORA_CONFIG_KEYS)
        if unknown:
            logger.warning("LoraConfig: ignoring unrecognized lora keys %s "
                           "(valid keys: %s)", sorted(unknown), list(_LORA_CONFIG_KEYS))
        return cls(enable=bool(obj.get("enable", False)), rank=obj.get("rank"), alpha=obj.get("alpha"),
                   target_modules=obj.get("target_modules"))


def _is_lora_name(name):
    parts = name.split(".")
    return "lora_A" in parts or "lora_B" in parts


def sync_replicated_lora_gradients(module, mesh=None) -> int:
    """Averages the gradients of the module's LoRA parameters over every
    dimension of mesh (a DeviceMesh; None: the mesh of a DTensor LoRA
    parameter, else the default torch.distributed group), on every rank,
    zero-filling where this rank has no gradient (a rank that skipped a
    layer contributes exactly zero). Returns the number of parameters
    averaged.

    LoRA parameters are found by name (a `lora_A` or `lora_B` component:
    FastVideo's `<m>.lora_A`, PEFT's `<m>.lora_A.default.weight`) among
    those that require grad, in named_parameters() order, so every rank
    walks the same list. Differences from FastVideo's (on purpose): the
    gradients travel packed in buckets (lorakit.sync_grads: a few
    collectives per mesh dimension, not one per parameter), and ranks
    holding different LoRA layouts raise LoraError together instead of
    pairing the wrong tensors or hanging. Plain tensors (not only DTensors)
    are averaged, over mesh or the default group. Without torch.distributed
    initialised it returns 0, as FastVideo's does, unless a launcher
    started several processes (then it raises: acting alone would leave
    each rank's own gradients)."""
    import torch.distributed as dist

    from .. import _default_comm, _launched_size, sync_grads

    if not dist.is_available() or not dist.is_initialized():
        if _launched_size() is not None:
            _default_comm()  # raises, saying why
        return 0
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - older torch
        DTensor = ()
    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad and _is_lora_name(n)]
    if mesh is None:
        mesh = next((p.device_mesh for _, p in params if isinstance(p, DTensor)), None)
    groups = [mesh.get_group(d) for d in range(mesh.ndim) if mesh.size(d) > 1] if mesh is not None else [
        dist.group.WORLD]
    grads, like = [], []
    for _, p in params:
        g = p.grad
        local = p.to_local() if isinstance(p, DTensor) else p
        if g is not None and isinstance(g, DTensor):
            g = g.to_local()
        grads.append(g)
        like.append(local)
    for group in groups:
        grads = sync_grads(grads, group, like=like)
    for (_, p), g in zip(params, grads):
        if p.grad is None:
            if isinstance(p, DTensor):
                p.grad = DTensor.from_local(g, device_mesh=p.device_mesh, placements=p.placements, run_check=False)
            else:
                p.grad = g
    return len(params)
