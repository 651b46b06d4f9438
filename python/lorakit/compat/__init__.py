"""The seeds' own API on top of lorakit, as thin shims.

- lorakit.compat.ltx: LTX-2's TransformerWeightTracker (hot-swap serving:
  build, apply_loras_, reset_loras, loras_match, loras);
- lorakit.compat.fastvideo: FastVideo's training API (LoraConfig,
  enable_lora_training, finalize_lora_training,
  sync_replicated_lora_gradients, save_lora_peft).

Each module imports torch only when used; the differences from the seed
are listed in each class's or function's docstring.
"""
__all__ = ["fastvideo", "ltx"]
