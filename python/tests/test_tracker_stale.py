"""The tracker never keeps a silently wrong model (issue 28, items 2-3):
retrain -> save to the same path -> apply([(path, 1.0)]) fuses the new
file (reported "adapters_changed": 1, not skipped); model weights changed
in place behind the tracker (load_state_dict into the same memory) make the
next apply/reset raise, naming the key, with nothing changed. Oracle: the
float64 reference W + s * (alpha / r) * B @ A of the file as rewritten."""
import numpy as np
import pytest

import lorakit
import st_io

O, I, R = 6, 10, 4
K = "blocks.0.attn.to_q"


def write(path, seed):
    rng = np.random.default_rng(seed)
    a = rng.uniform(-1, 1, (R, I)).astype(np.float32)
    b = rng.uniform(-1, 1, (O, R)).astype(np.float32)
    st_io.write(path, {f"transformer.{K}.lora_A.weight": ("F32", a), f"transformer.{K}.lora_B.weight": ("F32", b),
                       f"transformer.{K}.alpha": ("F32", np.array(8, np.float32))})
    return a, b


def want(w, a, b, s):
    return (w.astype(np.float64) + s * 8 / R * (b.astype(np.float64) @ a.astype(np.float64))).astype(np.float32)


def close(x, ref):
    assert np.all(np.abs(x.astype(np.float64) - ref.astype(np.float64)) <= np.spacing(np.abs(ref)).astype(np.float64))


@pytest.fixture
def model():
    rng = np.random.default_rng(1)
    return {f"{K}.weight": rng.uniform(-1, 1, (O, I)).astype(np.float32),
            "blocks.0.attn.to_k.weight": rng.uniform(-1, 1, (O, I)).astype(np.float32)}


def test_rewritten_file_is_read_again(model, tmp_path):
    p = str(tmp_path / "ad.safetensors")
    w0 = model[f"{K}.weight"].copy()
    a, b = write(p, 10)
    with lorakit.Tracker(model) as t:
        t.apply([(p, 1.0)])
        close(model[f"{K}.weight"], want(w0, a, b, 1.0))
        rep = t.apply([(p, 1.0)])
        assert rep["skipped"] and rep["adapters_changed"] == 0
        a, b = write(p, 11)  # train -> save to the same path
        rep = t.apply([(p, 1.0)])
        assert not rep["skipped"] and rep["adapters_changed"] == 1 and rep["keys_fused"] == 1
        close(model[f"{K}.weight"], want(w0, a, b, 1.0))


def test_weights_changed_behind_the_tracker(model, tmp_path):
    p = str(tmp_path / "ad.safetensors")
    write(p, 12)
    with lorakit.Tracker(model) as t:
        t.apply([(p, 1.0)])
        model[f"{K}.weight"][...] = 0.5  # load_state_dict(new_base), in place
        snapshot = {k: v.copy() for k, v in model.items()}
        with pytest.raises(lorakit.LoraError, match=r"the model's weights were changed outside the tracker: make a new "
                                                    r"Tracker \(base weights: blocks.0.attn.to_q.weight holds"):
            t.reset()
        with pytest.raises(lorakit.LoraError, match="changed outside the tracker"):
            t.apply([(p, 0.5)])
        for k in model:
            assert model[k].tobytes() == snapshot[k].tobytes()
