"""LTX-2's TransformerWeightTracker over lorakit's hot-swap tracker.

LTX-2 keeps a clean backup of the transformer's weights sharded over the
ranks, fuses a LoRA set on each key's owning rank and broadcasts the fused
results in buckets (ltx_core/multigpu transformer_weight_tracker.py). This
shim offers the same operations on a model this process holds, with the
tracker underneath (lorakit.Tracker: canonical arithmetic, transactional
swaps, only touched keys recomputed and moved).
"""
import os

from .. import Tracker
from .. import _strength  # one strength rule (no bools; text read as -l PATH:STRENGTH reads it)

__all__ = ["TransformerWeightTracker"]


def _adapter_type():
    import lorakit
    return getattr(lorakit, "Adapter", ())


def _entry(i, e):
    """(path or Adapter, strength) of one LoRA entry: a (path, strength)
    pair (LTX-2's (path, strength, sd_ops name) triples too), an Adapter,
    or an object with .path and .strength (LTX-2's LoraPathStrengthAndSDOps)."""
    Adapter = _adapter_type()
    if isinstance(e, Adapter):
        return (e, 1.0)
    if isinstance(e, (str, bytes, os.PathLike)):
        return (os.fsdecode(e), 1.0)
    if isinstance(e, (tuple, list)) and len(e) in (2, 3):
        p = e[0] if isinstance(e[0], Adapter) else os.fsdecode(e[0])
        return (p, _strength(i, e[1]))
    if hasattr(e, "path") and hasattr(e, "strength"):
        p = e.path if isinstance(e.path, Adapter) else os.fsdecode(e.path)
        return (p, _strength(i, e.strength))
    raise TypeError(f"loras[{i}]: expected (path, strength), an Adapter or an object with .path and .strength, got {e!r}")


def _key(entry):
    p, s = entry
    Adapter = _adapter_type()
    return (("adapter", p.digest) if isinstance(p, Adapter) else ("path", os.path.abspath(p)), s)


class TransformerWeightTracker:
    """LTX-2's tracker API over a model this process holds.

    TransformerWeightTracker(model, *, group=None, no_lora_swap=False,
    bucket_mb=256): model is an nn.Module (its state_dict: parameters and
    persistent buffers) or a state_dict; group a torch.distributed
    ProcessGroup (None: the default group when torch.distributed is
    initialised with several processes, else this process alone; an error
    under torchrun without a group). apply(loras) and reset() are
    cooperative: every rank calls them together, as in LTX-2.

    Differences from LTX-2 (on purpose):
    - Construction takes the model instead of a builder: there is no
      separate build() step; the clean bytes of a key are backed up by its
      owner only when a LoRA first touches it (LTX-2 clones every owned key
      up front). With no_lora_swap there is no backup: the first set is
      fused in place and any change or reset raises, as in LTX-2.
    - loras_match is order-insensitive as LTX-2's, and here that is exact:
      the fused bytes do not depend on the order of the entries (one
      canonical term order, one rounding per element), where LTX-2 fuses in
      list order in bf16, so two orders give different weights that its
      matching treats as equal. Strengths compare exactly, as given.
    - A failed apply (a missing or malformed file, a shape mismatch, a
      non-finite result, ranks asking for different sets) raises on every
      rank and changes nothing on any rank; LTX-2 may leave keys half
      rewritten.
    - Only keys touched by the old or the new set are restored, fused and
      broadcast; LTX-2 rewrites and re-broadcasts every key.
    - Entries are (path, strength) pairs, LTX-2's (path, strength, sd_ops)
      triples (the sd_ops name is ignored: adapter key formats are detected),
      objects with .path and .strength, or lorakit.Adapter objects held in
      memory (strength 1). loras lists (path or Adapter, strength) pairs.
    - Entries whose strength is 0 are dropped; all zero (or none) resets.
    """

    def __init__(self, model, *, group=None, no_lora_swap=False, bucket_mb=256):
        if bucket_mb <= 0:
            raise ValueError("bucket_mb must be > 0")
        self._no_lora_swap = bool(no_lora_swap)
        self._t = Tracker(model, comm=group, bucket_mb=int(bucket_mb), no_lora_swap=self._no_lora_swap)
        self.loras = []

    def _normalise(self, loras):
        return [_entry(i, e) for i, e in enumerate(loras)]

    def loras_match(self, loras):
        """True when loras names the set fused now (order-insensitive)."""
        new = self._normalise(loras)
        if len(new) != len(self.loras):
            return False
        return sorted(map(_key, new)) == sorted(map(_key, self.loras))

    def apply(self, loras):
        """Makes the fused set equal loras (cooperative). Skips the work when
        the set is unchanged; all strengths zero (or none) resets. Returns
        the swap's report (a dict, as lorakit.Tracker.apply)."""
        new = self._normalise(loras)
        report = self._t.apply(new)
        self.loras = [e for e in new if e[1] != 0]
        return report

    def reset(self):
        """Restores the clean weights on every rank (cooperative). No-op when
        nothing is fused."""
        if not self.loras:
            return None
        if self._no_lora_swap:
            raise RuntimeError("no_lora_swap tracker has no backup to reset from")
        report = self._t.reset()
        self.loras = []
        return report

    def close(self):
        self._t.close()
