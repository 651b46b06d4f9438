"""lorakit.compat without torch: FastVideo's LoraConfig (fields, defaults,
messages and coerce as in fastvideo/train/utils/lora.py, the seed's text in
shared/reference: the expected strings are copied from it)."""
import logging

import pytest

from lorakit.compat.fastvideo import DEFAULT_LORA_TARGET_MODULES, LoraConfig


def test_defaults_and_normalisation():
    c = LoraConfig()
    assert (c.enable, c.rank, c.alpha, c.target_modules) == (False, None, None, None)
    c = LoraConfig(enable=True, rank="16", alpha=32.0, target_modules=("to_q", "to_k"))
    assert (c.rank, c.alpha, c.target_modules) == (16, 32, ["to_q", "to_k"])
    assert DEFAULT_LORA_TARGET_MODULES[:4] == ["q_proj", "k_proj", "v_proj", "o_proj"]


def test_errors():
    with pytest.raises(ValueError, match="lora.enable is true but lora.rank is unset — an explicit positive rank"):
        LoraConfig(enable=True)
    with pytest.raises(ValueError, match=r"models.<role>.lora.rank must be > 0, got 0"):
        LoraConfig(enable=True, rank=0)
    with pytest.raises(TypeError, match="models.<role>.lora must be a mapping or LoraConfig, got list"):
        LoraConfig.coerce([1])


def test_coerce_and_logging(caplog):
    assert LoraConfig.coerce(None) is None
    c = LoraConfig(enable=True, rank=4)
    assert LoraConfig.coerce(c) is c
    with caplog.at_level(logging.INFO, logger="lorakit.compat.fastvideo"):
        c = LoraConfig.coerce({"enable": False, "rank": 8, "dropout": 0.1})
    assert c.enable is False and c.rank == 8
    msgs = [r.getMessage() for r in caplog.records]
    assert any("ignoring unrecognized lora keys ['dropout'] (valid keys: ['enable', 'rank', 'alpha', "
               "'target_modules'])" in m for m in msgs), msgs
    assert any("models.<role>.lora.rank=8 is set but lora.enable is false — LoRA will NOT be applied" in m
               for m in msgs), msgs
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.INFO]
