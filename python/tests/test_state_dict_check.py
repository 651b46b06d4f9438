"""Adapter.from_state_dict validates at construction: a bad key or a bad
shape raises LoraError there, naming the key (.key), not later at the fuse;
a good one constructs silently (its alpha warning comes once, at the fuse).
Oracle: the keys and shapes the test writes (PEFT's naming:
base_model.model.<m>.lora_A.weight [r, in] / lora_B.weight [out, r])."""
import numpy as np
import pytest

import lorakit

M = "base_model.model.blocks.0.attn.to_q"


def sd(a_shape=(2, 8), b_shape=(4, 2), extra=None):
    rng = np.random.default_rng(0)
    d = {f"{M}.lora_A.weight": rng.uniform(-1, 1, a_shape).astype(np.float32),
         f"{M}.lora_B.weight": rng.uniform(-1, 1, b_shape).astype(np.float32)}
    d.update(extra or {})
    return d


def test_rank_mismatch_raises_at_construction():
    with pytest.raises(lorakit.LoraError) as ei:
        lorakit.Adapter.from_state_dict(sd(b_shape=(4, 3)), {"r": 2, "lora_alpha": 2}, format="peft", name="bad")
    assert ei.value.status == "LK_ERR_SHAPE", ei.value
    assert ei.value.key == "blocks.0.attn.to_q"
    assert ei.value.path.startswith("bad@")


def test_half_a_pair_raises_naming_the_module():
    d = sd()
    del d[f"{M}.lora_B.weight"]
    with pytest.raises(lorakit.LoraError, match="lora_B") as ei:
        lorakit.Adapter.from_state_dict(d, {"r": 2, "lora_alpha": 2}, format="peft")
    assert ei.value.key == "blocks.0.attn.to_q"


def test_unknown_key_raises_naming_it():
    bad = "base_model.model.blocks.0.attn.to_q.weird"
    with pytest.raises(lorakit.LoraError) as ei:
        lorakit.Adapter.from_state_dict(sd(extra={bad: np.zeros(3, np.float32)}), {"r": 2, "lora_alpha": 2},
                                        format="kohya")
    assert ei.value.key == bad, ei.value


def test_good_adapter_constructs_and_fuses(recwarn):
    rng = np.random.default_rng(1)
    w = rng.uniform(-1, 1, (4, 8)).astype(np.float32)
    d = sd()
    ad = lorakit.Adapter.from_state_dict(d, {"r": 2, "lora_alpha": 4}, format="peft")
    assert not [w_ for w_ in recwarn if issubclass(w_.category, lorakit.LoraWarning)]
    t = {"blocks.0.attn.to_q.weight": w.copy()}
    lorakit.fuse_(t, [(ad, 1.0)])
    a, b = (d[f"{M}.lora_A.weight"].astype(np.float64), d[f"{M}.lora_B.weight"].astype(np.float64))
    want = (w.astype(np.float64) + 2.0 * b @ a).astype(np.float32)  # alpha 4 / r 2, one rounding
    assert t["blocks.0.attn.to_q.weight"].tobytes() == want.tobytes()


def test_alpha_warning_once_at_the_fuse():
    d = sd()
    with pytest.warns(lorakit.LoraWarning, match="alpha defaults to r") as rec:
        ad = lorakit.Adapter.from_state_dict(d, format="peft", name="nocfg")
        lorakit.fuse_({"blocks.0.attn.to_q.weight": np.zeros((4, 8), np.float32)}, [(ad, 1.0)])
    assert len([r for r in rec if "alpha defaults to r" in str(r.message)]) == 1
