"""The seeds' own API on top of lorakit, as thin shims.

- lorakit.compat.ltx: LTX-2's TransformerWeightTracker (hot-swap serving);
- lorakit.compat.fastvideo: FastVideo's LoraConfig and
  sync_replicated_lora_gradients (training).

Each module imports torch only when used; the differences from the seed
are listed in each class's or function's docstring.
"""
__all__ = ["fastvideo", "ltx"]
