"""FastVideo's training-side LoRA API (fastvideo/train/utils/lora.py) on
lorakit: DEFAULT_LORA_TARGET_MODULES, LoraConfig (the seed's fields,
defaults and messages), enable_lora_training, finalize_lora_training,
sync_replicated_lora_gradients (over lorakit's bucketed gradient average,
float32, float16 and bfloat16), and save_lora_peft (the trained adapter as
a PEFT folder that PEFT, diffusers and `lorakit fuse` load). A FastVideo
training loop runs on it with its import changed. The torch half lives in
_fastvideo_torch.py, imported on first use (LoraConfig needs no torch).
"""
import logging
from dataclasses import dataclass
from typing import Any, List, Optional

__all__ = ["DEFAULT_LORA_TARGET_MODULES", "LORA_CHECKPOINT_KEY_ALIASES_ATTR", "LORA_MISSING_PARAMETER_INITIALIZER_ATTR",
           "BaseLayerWithLoRA", "LoraConfig", "enable_lora_training", "finalize_lora_training", "save_lora_peft",
           "sync_replicated_lora_gradients"]

logger = logging.getLogger("lorakit.compat.fastvideo")

DEFAULT_LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "to_q", "to_k", "to_v", "to_out", "to_qkv",
                               "to_gate_compress"]

_LORA_CONFIG_KEYS = ("enable", "rank", "alpha", "target_modules")

# the attributes prepare_for_fsdp=True sets on the transformer (lorakit's
# names: a loader that consumes them reads these constants)
LORA_CHECKPOINT_KEY_ALIASES_ATTR = "_lora_checkpoint_key_aliases"
LORA_MISSING_PARAMETER_INITIALIZER_ATTR = "_lora_missing_parameter_initializer"


def _t():
    from . import _fastvideo_torch
    return _fastvideo_torch


def __getattr__(name):
    if name == "BaseLayerWithLoRA":
        return _t().BaseLayerWithLoRA
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


def _is_target_layer(module_name, target_modules):
    return any(target_name in module_name for target_name in target_modules)


def _is_excluded_layer(module_name, excluded_modules):
    return any(excluded in module_name for excluded in excluded_modules)


def enable_lora_training(transformer, *, lora_rank, lora_alpha=None, lora_target_modules=None,
                         prepare_for_fsdp=False, initialization_seed=0) -> int:
    """Replaces every matching linear layer with a trainable LoRA wrapper
    and returns how many, as FastVideo's: target modules match by
    substring (DEFAULT_LORA_TARGET_MODULES when none are given), minus
    transformer.config.arch_config.exclude_lora_layers (also substrings);
    lora_rank <= 0 and no compatible layer are the seed's ValueErrors, word
    for word; alpha defaults to rank; the base is frozen. With
    prepare_for_fsdp the transformer gets the checkpoint key aliases
    ("<m>.weight" -> "<m>.base_layer.weight", attribute
    LORA_CHECKPOINT_KEY_ALIASES_ATTR) and the missing-parameter initializer
    (LORA_MISSING_PARAMETER_INITIALIZER_ATTR: initializer(name, tensor) ->
    bool) for a loader to use; otherwise LoRA parameters of layers whose
    base is a DTensor become replicated DTensors on its mesh and
    finalize_lora_training runs.

    Differences from FastVideo's (on purpose):
    - A comes from lorakit's counter-based generator keyed by
      (initialization_seed, "<module>.lora_A") (the C library's, as
      `lorakit train`): the same on every rank with no broadcast, whatever
      the order layers are made in; FastVideo draws from torch's global RNG
      and broadcasts (run_check=True) when replicating. The bound is
      FastVideo's, 1/sqrt(in). B is zero, as in FastVideo.
    - Plain nn.Linear layers are wrapped too (FastVideo's get_lora_layer
      wraps only its own linear classes); FastVideo's ReplicatedLinear is
      wrapped (forward returns (out, bias), as its own). Tensor-parallel
      linears (Column/RowParallelLinear) are not: lorakit's layer does not
      slice A and B."""
    from functools import partial
    ft = _t()
    rank = int(lora_rank)
    if rank <= 0:
        raise ValueError(f"lora_rank must be > 0, got {lora_rank!r}")
    alpha = int(lora_alpha) if lora_alpha is not None else rank
    target_modules = list(lora_target_modules or DEFAULT_LORA_TARGET_MODULES)
    arch_config = getattr(getattr(transformer, "config", None), "arch_config", None)
    excluded_modules = list(getattr(arch_config, "exclude_lora_layers", []))
    transformer.requires_grad_(False)
    replacements, aliases, names = [], {}, set()
    for module_name, module in transformer.named_modules():
        if not module_name or not _is_target_layer(module_name, target_modules):
            continue
        if _is_excluded_layer(module_name, excluded_modules) or not ft.lora_compatible(module):
            continue
        replacements.append((module_name, ft.BaseLayerWithLoRA(module, rank, alpha, module_name,
                                                               int(initialization_seed))))
        for state_name in module.state_dict():
            aliases[f"{module_name}.{state_name}"] = f"{module_name}.base_layer.{state_name}"
        names.update({f"{module_name}.lora_A", f"{module_name}.lora_B"})
    if not replacements:
        raise ValueError("No LoRA-compatible layers were found for the requested "
                         f"target modules: {target_modules}")
    for module_name, layer in replacements:
        ft.replace_submodule(transformer, module_name, layer)
    if prepare_for_fsdp:
        setattr(transformer, LORA_CHECKPOINT_KEY_ALIASES_ATTR, aliases)
        setattr(transformer, LORA_MISSING_PARAMETER_INITIALIZER_ATTR,
                partial(ft.initialize_lora_parameter, parameter_names=frozenset(names),
                        seed=int(initialization_seed)))
    else:
        ft.replicate_lora_parameters(transformer)
        finalize_lora_training(transformer)
    logger.info("Enabled LoRA training with rank=%d alpha=%d on %d layers", rank, alpha, len(replacements))
    return len(replacements)


def finalize_lora_training(transformer) -> int:
    """Freezes the base weights and enables only the adapter parameters (of
    lorakit's LoRA layers or FastVideo's), puts the model in train mode and
    returns the number of LoRA layers; the seed's errors when one lacks its
    parameters or none exists."""
    ft = _t()
    transformer.requires_grad_(False)
    count = 0
    for module in transformer.modules():
        if not ft.is_lora_layer(module):
            continue
        if module.lora_A is None or module.lora_B is None:
            raise RuntimeError("Training LoRA wrapper is missing adapter parameters")
        module.base_layer.requires_grad_(False)
        module.lora_A.requires_grad_(True)
        module.lora_B.requires_grad_(True)
        count += 1
    if count == 0:
        raise ValueError("No training LoRA wrappers were found after checkpoint loading")
    transformer.train()
    return count


def save_lora_peft(transformer, out_dir):
    """Saves the model's LoRA layers as a PEFT folder (out_dir/
    adapter_model.safetensors with base_model.model.<m>.lora_A.weight /
    .lora_B.weight, and adapter_config.json with r, lora_alpha and the
    wrapped modules as target_modules; differing ranks or alphas in
    rank_pattern / alpha_pattern), each file written to a temporary and
    renamed into place. PEFT (PeftModel.from_pretrained), diffusers and
    `lorakit fuse` load it, at scale alpha / r. Call it on one rank."""
    return _t().save_peft(transformer, out_dir)


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
    walks the same list. float32, float16 and bfloat16 gradients are
    averaged in float32 (over every mesh dim) and rounded back once; errors
    name the parameter. A DTensor's mesh dims that are not Replicate
    (sharded) are not averaged over. Differences from FastVideo's (on purpose): the
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
    from .. import _as_f32, _low_precision, _round_back, _zeros_like
    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad and _is_lora_name(n)]
    if mesh is None:
        mesh = next((p.device_mesh for _, p in params if isinstance(p, DTensor)), None)
    if mesh is None:
        groups = [dist.group.WORLD]
    else:
        first = next((p for _, p in params if isinstance(p, DTensor) and p.device_mesh is mesh), None)
        dims = [d for d in range(mesh.ndim) if mesh.size(d) > 1 and (
            first is None or type(first.placements[d]).__name__ == "Replicate")]
        groups = [mesh.get_group(d) for d in dims]
    grads = []
    for _, p in params:
        g = p.grad
        if g is None:  # this rank skipped the layer: it contributes zeros
            g = _zeros_like(p)
            p.grad = DTensor.from_local(g, device_mesh=p.device_mesh, placements=p.placements,
                                        run_check=False) if isinstance(p, DTensor) else g
        grads.append(g.to_local() if isinstance(g, DTensor) else g)
    # float16/bfloat16: one float32 copy averaged over every mesh dim, then
    # one rounding back
    work = [_as_f32(g) if _low_precision(g) else g for g in grads]
    names = [n for n, _ in params]
    for group in groups:
        work = sync_grads(work, group, names=names)
    for g, w in zip(grads, work):
        if w is not g:
            _round_back(g, w)
    return len(params)
