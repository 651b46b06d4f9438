"""The oracle for lorakit.compat.ltx: LTX-2's own TransformerWeightTracker
(the seed's ltx_core/multigpu/transformer_weight_tracker.py, kept as one
line in shared/reference/ltx_transformer_weight_tracker.py.txt; its code
below is that text laid out again, statement for statement, and run
unchanged) on top of ltx-core from PyPI.

ltx-core 1.0.0 (the release on PyPI) predates the seed: it has no
ltx_core.multigpu (ShardedSD), no fuse_lora_weights, no builder.fuse_rule,
no builder.with_loras and no SDOps.with_additional_allowed_keys. The few
lines below supply them from what 1.0.0 has, so the seed's tracker runs
on ltx-core's own fusion (_prepare_deltas, _fuse_deltas: bf16 sums, as
LTX-2 fuses), its builder, registry, loader and SDOps:
- fuse_lora_weights yields (key, fused) for every key a LoRA touches,
  from ltx-core's _prepare_deltas and _fuse_deltas;
- ShardedSD: each key owned by one rank (crc32 of its name modulo the
  group size, as LTX-2 hashes names), local_shard the owned keys (cloned
  when asked), broadcast_shards_into broadcasts each key from its owner
  into target_sd (the staging buffer only batches LTX-2's broadcasts; the
  bytes that arrive are the owner's either way);
- Builder = SingleGPUModelBuilder plus with_loras and fuse_rule.
Only tests import this module, and only where ltx_core is installed."""
from __future__ import annotations

import dataclasses
import zlib

import torch
import torch.distributed as dist
from ltx_core.loader import fuse_loras as _fl
from ltx_core.loader.primitives import LoraPathStrengthAndSDOps, LoraStateDictWithStrength, StateDict  # noqa: F401
from ltx_core.loader.sd_ops import SDOps
from ltx_core.loader.single_gpu_model_builder import SingleGPUModelBuilder

if not hasattr(SDOps, "with_additional_allowed_keys"):
    # the seed adds the owned LoRA keys to the matching; the LoRA entries of
    # the tests use ltx-core's LTXV_LORA_COMFY_RENAMING_MAP, which matches
    # every key already
    SDOps.with_additional_allowed_keys = lambda self, keys: self


def fuse_lora_weights(target_sd, lora_sds, fuse_rule=None):
    for key, weight in target_sd.sd.items():
        deltas = _fl._prepare_deltas(lora_sds, key, weight.dtype, weight.device)
        if deltas is None:
            continue
        fused = _fl._fuse_deltas(deltas, weight, key, {}, weight.dtype, weight.device, False, None, target_sd)
        yield key, fused[key]


@dataclasses.dataclass(frozen=True)
class Builder(SingleGPUModelBuilder):
    fuse_rule: object = None

    def with_loras(self, loras):
        return dataclasses.replace(self, loras=tuple(loras))


class ShardedSD:
    def __init__(self, local_shard, owners, group):
        self.local_shard, self._owners, self._group = local_shard, owners, group

    @classmethod
    def from_state_dict(cls, sd, group, clone):
        n, r = dist.get_world_size(group), dist.get_rank(group)
        owners = {k: zlib.crc32(k.encode()) % n for k in sd}
        local = {k: (v.clone() if clone else v) for k, v in sd.items() if owners[k] == r}
        return cls(local, owners, group)

    def broadcast_shards_into(self, target_sd, staging):
        r = dist.get_rank(self._group)
        for k in sorted(self._owners):
            t = target_sd[k]
            if self._owners[k] == r and self.local_shard[k].data_ptr() != t.data_ptr():
                t.copy_(self.local_shard[k])
            flat = t.view(-1).view(torch.uint8)
            dist.broadcast(flat, src=dist.get_global_rank(self._group, self._owners[k]), group=self._group)


# ---- the seed's tracker, as in shared/reference (statement for statement) ----

def _apply_loras_inplace(source, target, loras, builder, lora_keys):
    """Reset *target* to clean weights from *source*, then fuse all LoRAs in one pass."""
    for key, clean_weight in source.items():
        target[key].copy_(clean_weight)
    lora_sds = [
        LoraStateDictWithStrength(
            builder.load_sd(
                [lora.path],
                sd_ops=lora.sd_ops.with_additional_allowed_keys(lora_keys),
                registry=builder.registry,
                device=builder.lora_load_device,
            ),
            lora.strength,
        )
        for lora in loras
        if lora.strength != 0
    ]
    target_sd = StateDict(
        sd=target, device=next(iter(target.values())).device, size=0, dtype={next(iter(target.values())).dtype}
    )
    for key, fused in fuse_lora_weights(target_sd, lora_sds, fuse_rule=builder.fuse_rule):
        target[key].copy_(fused)


class TransformerWeightTracker:
    def __init__(self, group, bucket_mb=256, no_lora_swap=False):
        if bucket_mb <= 0:
            raise ValueError("bucket_mb must be > 0")
        self._group = group
        self._bucket_mb = bucket_mb
        self._no_lora_swap = no_lora_swap
        self._staging = None
        self.stored_sd = None
        self.broadcast_sd = None
        self.loras = []

    @property
    def staging(self):
        if self._staging is None:
            # the seed allocates on cuda:current_device; these tests run on CPU
            self._staging = torch.empty(self._bucket_mb * 1024 * 1024, dtype=torch.uint8)
        return self._staging

    def loras_match(self, lora_list):
        if len(lora_list) != len(self.loras):
            return False
        return sorted(lora_list) == sorted(self.loras)

    def reset_loras(self, target_sd):
        if not self.loras:
            return
        if self._no_lora_swap:
            raise RuntimeError("no_lora_swap tracker has no backup to reset from")
        if self.stored_sd is None:
            raise RuntimeError("stored_sd must be initialised before reset_loras")
        self.loras = []
        self.stored_sd.broadcast_shards_into(target_sd, self.staging)

    def _local_lora_keys(self):
        if self.stored_sd is None:
            return frozenset()
        keys = set()
        for k in self.stored_sd.local_shard:
            if k.endswith(".weight"):
                prefix = k[: -len(".weight")]
                keys.add(f"{prefix}.lora_A.weight")
                keys.add(f"{prefix}.lora_B.weight")
        return frozenset(keys)

    def apply_loras_(self, target_sd, loras, builder):
        new_loras = [(lora.path, lora.strength, lora.sd_ops.name) for lora in loras]
        if self.loras_match(new_loras):
            return
        if self._no_lora_swap and self.loras:
            raise RuntimeError(f"no_lora_swap tracker cannot change LoRAs: have {self.loras}, requested {new_loras}")
        if all(lora.strength == 0 for lora in loras):
            self.reset_loras(target_sd)
            return
        if self.stored_sd is None or self.broadcast_sd is None:
            raise RuntimeError("ShardedSDs must be initialised before apply_loras_ (call build first)")
        source = self.stored_sd.local_shard
        target = {k: v for k, v in target_sd.items() if k in source}
        lora_keys = self._local_lora_keys()
        _apply_loras_inplace(source, target, loras, builder, lora_keys)
        self.broadcast_sd.broadcast_shards_into(target_sd, self.staging)
        self.loras = new_loras

    def build(self, builder, device=None, dtype=None, **kwargs):
        loras = builder.loras
        clean_builder = builder.with_loras(())
        model_paths = list(builder.model_path) if isinstance(builder.model_path, tuple) else [builder.model_path]
        if clean_builder.registry.get(model_paths, clean_builder.model_sd_ops) is None:
            clean_builder.build(device=device, dtype=dtype, **kwargs)
        cached_sd = clean_builder.registry.get(model_paths, clean_builder.model_sd_ops)
        if cached_sd is None:
            raise RuntimeError("Expected model state dict in registry but found None")
        if self.stored_sd is None:
            self.stored_sd = ShardedSD.from_state_dict(cached_sd.sd, self._group, clone=not self._no_lora_swap)
            self.broadcast_sd = ShardedSD.from_state_dict(cached_sd.sd, self._group, clone=False)
        if loras:
            self.apply_loras_(cached_sd.sd, loras, builder)
        else:
            self.reset_loras(cached_sd.sd)
        return clean_builder.build(device=device, dtype=dtype, **kwargs)
