"""LTX-2's TransformerWeightTracker (ltx_core/multigpu
transformer_weight_tracker.py) over lorakit's hot-swap tracker.

The same constructor, methods and attributes, so an LTX-2 program runs with
its import changed: TransformerWeightTracker(group, bucket_mb=256,
no_lora_swap=False); build(builder, device=None, dtype=None, **kwargs),
apply_loras_(target_sd, loras, builder), reset_loras(target_sd),
loras_match(lora_list), loras, stored_sd, broadcast_sd, staging. LTX-2's
builder, registry and LoRA entries (.path, .strength, .sd_ops) are used by
duck typing: ltx-core is never imported here.
"""
import dataclasses
import os

from .. import Adapter, Tracker
from .. import _strength  # one strength rule (no bools; text read as -l PATH:STRENGTH reads it)

__all__ = ["TransformerWeightTracker"]


def _fields(i, e):
    """(path, strength, sd_ops) of one LoRA entry: LTX-2's
    LoraPathStrengthAndSDOps (or any object with .path and .strength, .sd_ops
    optional), a (path, strength[, sd_ops]) tuple, a path or an Adapter."""
    if isinstance(e, (str, bytes, os.PathLike, Adapter)):
        return e, 1.0, None
    if hasattr(e, "path") and hasattr(e, "strength"):
        return e.path, _strength(i, e.strength), getattr(e, "sd_ops", None)
    if isinstance(e, (tuple, list)) and len(e) in (2, 3):
        return e[0], _strength(i, e[1]), e[2] if len(e) == 3 else None
    raise TypeError(f"loras[{i}]: expected an object with .path and .strength (LTX-2's LoraPathStrengthAndSDOps), "
                    f"(path, strength[, sd_ops]), a path or an Adapter, got {e!r}")


def _ops_name(ops):
    return ops if isinstance(ops, str) or ops is None else getattr(ops, "name", None)


def _shown(path):
    return path if isinstance(path, Adapter) else os.fsdecode(path)


def _read_safetensors(path):
    from safetensors.torch import load_file
    return load_file(os.fsdecode(path), device="cpu")


def _mapped_adapter(path, ops):
    """The adapter at path with LTX-2's sd_ops applied to its keys
    (apply_to_key: rename, or None to drop; apply_to_key_value: LTX-2's
    per-key value operations), held in memory, so a custom key mapping
    means what it means in LTX-2."""
    out = {}
    for k, v in _read_safetensors(path).items():
        nk = ops.apply_to_key(k)
        if nk is None:
            continue
        pairs = ops.apply_to_key_value(nk, v) if hasattr(ops, "apply_to_key_value") else [(nk, v)]
        for kk, vv in pairs:
            out[kk] = vv
    return Adapter.from_state_dict(out, name=os.path.basename(os.fsdecode(path)))


def _lorakit_entry(path, strength, ops):
    """(path or Adapter, strength) for lorakit.Tracker.apply."""
    if ops is not None and not isinstance(ops, str) and not isinstance(path, Adapter) and hasattr(ops, "apply_to_key"):
        return _mapped_adapter(path, ops), strength
    return (path if isinstance(path, Adapter) else os.fsdecode(path)), strength


class _Shards:
    """What stored_sd / broadcast_sd stand for here: LTX-2's ShardedSD
    pair becomes one lorakit tracker that keeps each key's clean bytes on
    its owning rank (lazily, when a LoRA first touches it) and broadcasts
    only changed keys. broadcast_shards_into(target_sd, staging) is LTX-2's
    call: on stored_sd it restores the clean weights on every rank
    (cooperative); on broadcast_sd it has nothing to do (apply_loras_ has
    already broadcast every changed key)."""

    def __init__(self, owner, restore):
        self._owner, self._restore = owner, restore

    def broadcast_shards_into(self, target_sd, staging=None):
        self._owner._check_target(target_sd)
        if self._restore:
            self._owner._lk.reset()
            self._owner.loras = []


class TransformerWeightTracker:
    """LTX-2's TransformerWeightTracker on lorakit: same signature, same
    call sequence (build, apply_loras_, reset_loras, loras_match, loras),
    same exceptions and messages (bucket_mb <= 0; "no_lora_swap tracker
    cannot change LoRAs: have ..., requested ..."; "no_lora_swap tracker has
    no backup to reset from"). group is a torch.distributed ProcessGroup
    (None: the default group). build(builder) does what LTX-2's does with
    its builder and registry (duck typed: builder.loras,
    builder.with_loras(()) or a dataclass replace, builder.model_path,
    builder.model_sd_ops, builder.registry.get(paths, sd_ops),
    builder.build(device=, dtype=, **kwargs)); the registry's state dict
    is the model's memory, fused in place on every rank. Entries are LTX-2's
    LoraPathStrengthAndSDOps (.path, .strength, .sd_ops); an sd_ops with
    apply_to_key is applied to the adapter's keys as LTX-2 applies it
    (renames and drops), otherwise the key format is detected. loras holds
    (path, strength, sd_ops name) triples, as in LTX-2.

    Differences from LTX-2 (on purpose):
    - Only keys touched by the old or the new set are restored, fused and
      broadcast; LTX-2 copies every owned key back and re-broadcasts all of
      them. The clean bytes of a key are backed up (on its owner) when a
      LoRA first touches it; LTX-2 clones every owned key at build.
    - A failed step (a missing or malformed file, a shape mismatch, a
      non-finite result, ranks asking for different sets) raises on every
      rank and changes no rank's weights; LTX-2 may leave keys half
      rewritten, or ranks disagreeing.
    - Arithmetic: each fused element is W + sum_i s_i * (B_i A_i) computed in
      at least twice the weight's precision and rounded once (the bytes do
      not depend on the order of the entries, the rank count or the bucket
      size); LTX-2 sums the deltas in the weight's dtype (bf16) and rounds
      at each step, so its results may differ in the last bits (equal where
      the products are exact). F32 and F16 weights are fused (LTX-2 refuses
      anything but bf16 and fp8). A `.alpha` tensor beside a LoRA scales it
      by alpha / r (LTX-2 ignores it; LTX-2's LoRAs have none).
    - apply_loras_ asks lorakit even when loras_match says the set is
      unchanged: an adapter file rewritten at the same path is read again
      (LTX-2 skips by path, so a retrained adapter would stay stale).
    - apply_loras_ before build starts tracking target_sd (LTX-2 raises);
      target_sd must then be the same tensors at every later call (a
      different dict holding other memory raises naming the key).
    - staging is a scratch tensor of bucket_mb MiB on the weights' device,
      kept for code that reads it; lorakit stages inside the library
      (staging_bytes says how much it holds).
    """

    def __init__(self, group=None, bucket_mb=256, no_lora_swap=False):
        if bucket_mb <= 0:
            raise ValueError("bucket_mb must be > 0")
        self._group = group
        self._bucket_mb = bucket_mb
        self._no_lora_swap = bool(no_lora_swap)
        self._staging = None
        self._lk = None
        self._ptrs = None
        self.stored_sd = None
        self.broadcast_sd = None
        self.loras = []

    # ---- LTX-2's attributes ----

    @property
    def staging(self):
        if self._staging is None:
            import torch
            dev = next(iter(self._ptrs.values()))[1] if self._ptrs else torch.device("cpu")
            self._staging = torch.empty(self._bucket_mb * 1024 * 1024, dtype=torch.uint8, device=dev)
        return self._staging

    @property
    def staging_bytes(self):
        """The bytes lorakit's tracker holds for staging (0 before build)."""
        return self._lk.staging_bytes if self._lk is not None else 0

    def loras_match(self, lora_list):
        if len(lora_list) != len(self.loras):
            return False
        try:
            return sorted(lora_list) == sorted(self.loras)
        except TypeError:  # entries that do not order (Adapters, None beside a name)
            return sorted(lora_list, key=repr) == sorted(self.loras, key=repr)

    # ---- tracking ----

    def _track(self, target_sd):
        """Makes the lorakit tracker over target_sd (cooperative)."""
        self._lk = Tracker(target_sd, comm=self._group, bucket_mb=self._bucket_mb, no_lora_swap=self._no_lora_swap)
        self._ptrs = {k: (v.data_ptr(), v.device) for k, v in target_sd.items() if hasattr(v, "data_ptr")}
        self.stored_sd = _Shards(self, True)
        self.broadcast_sd = _Shards(self, False)

    def _check_target(self, target_sd):
        for k, (ptr, _) in self._ptrs.items():
            v = target_sd.get(k) if hasattr(target_sd, "get") else None
            if v is None or v.data_ptr() != ptr:
                where = "is missing from it" if v is None else "is other memory than the tracked tensor"
                raise ValueError(f"{k}: target_sd is not the state dict this tracker tracks ({k} {where}); "
                                 "pass the registry's state dict given to build (or to the first apply_loras_)")

    def reset_loras(self, target_sd):
        """Restore target_sd to its clean weights on every rank
        (cooperative). No-op when no LoRAs are applied."""
        if not self.loras:
            return
        if self._no_lora_swap:
            raise RuntimeError("no_lora_swap tracker has no backup to reset from")
        if self.stored_sd is None:
            raise RuntimeError("stored_sd must be initialised before reset_loras")
        self._check_target(target_sd)
        self._lk.reset()
        self.loras = []

    def apply_loras_(self, target_sd, loras, builder=None):
        """Fuse loras into target_sd in place on every rank (cooperative);
        all strengths 0 resets. builder is accepted for LTX-2's signature;
        lorakit reads the adapter files itself."""
        fields = [_fields(i, e) for i, e in enumerate(loras)]
        new_loras = [(_shown(p), s, _ops_name(o)) for p, s, o in fields]
        if self._no_lora_swap and self.loras and not self.loras_match(new_loras):
            raise RuntimeError(f"no_lora_swap tracker cannot change LoRAs: have {self.loras}, requested {new_loras}")
        if all(s == 0 for _, s, _ in fields):
            self.reset_loras(target_sd)
            return
        if self._lk is None:
            self._track(target_sd)
        else:
            self._check_target(target_sd)
        self._lk.apply([_lorakit_entry(p, s, o) for p, s, o in fields if s != 0])
        if not self.loras_match(new_loras):  # a matched set keeps its listing, as in LTX-2
            self.loras = new_loras

    def build(self, builder, device=None, dtype=None, **kwargs):
        """Build the model with its LoRAs fused, as LTX-2's build: the
        registry is filled with the clean weights on the first call, the
        builder's LoRAs applied in place (or reset when it has none), and
        the model built from the registry's state dict."""
        loras = builder.loras
        clean_builder = builder.with_loras(()) if hasattr(builder, "with_loras") else dataclasses.replace(
            builder, loras=())
        model_paths = list(builder.model_path) if isinstance(builder.model_path, tuple) else [builder.model_path]
        if clean_builder.registry.get(model_paths, clean_builder.model_sd_ops) is None:
            clean_builder.build(device=device, dtype=dtype, **kwargs)
        cached_sd = clean_builder.registry.get(model_paths, clean_builder.model_sd_ops)
        if cached_sd is None:
            raise RuntimeError("Expected model state dict in registry but found None")
        if self._lk is None:
            self._track(cached_sd.sd)
        if loras:
            self.apply_loras_(cached_sd.sd, loras, builder)
        else:
            self.reset_loras(cached_sd.sd)
        return clean_builder.build(device=device, dtype=dtype, **kwargs)

    def close(self):
        """Releases the tracked tensors (lorakit's; the tracker cannot be
        used after)."""
        if self._lk is not None:
            self._lk.close()

