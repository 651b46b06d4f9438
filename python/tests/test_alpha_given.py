"""Alpha never silently lost (issue 28, item 1): a FastVideo-legacy file
("<m>.lora_A", "<m>.lora_B") trained at alpha 16, rank 8 fuses at scale 2
when the alpha is given, by Adapter.load(path, alpha=A),
Adapter.from_state_dict(..., alpha=A) or a config passed there (which was
ignored); without any alpha it fuses at scale 1 and warns. The oracle is a
float64 reference W + s * (alpha / r) * B @ A rounded once to float32 (the
single rounding of the F32 kernel: the same float within 1 ulp)."""
import os

import numpy as np
import pytest

import lorakit
import st_io

O, I, R, ALPHA = 6, 10, 8, 16.0
M = "blocks.0.attn.to_q"


@pytest.fixture
def fv(tmp_path):
    rng = np.random.default_rng(28)
    w = rng.uniform(-1, 1, (O, I)).astype(np.float32)
    a = rng.uniform(-1, 1, (R, I)).astype(np.float32)
    b = rng.uniform(-1, 1, (O, R)).astype(np.float32)
    path = str(tmp_path / "fv.safetensors")
    st_io.write(path, {f"{M}.lora_A": ("F32", a), f"{M}.lora_B": ("F32", b)})
    return w, a, b, path


def reference(w, a, b, scale):
    return (w.astype(np.float64) + scale * (b.astype(np.float64) @ a.astype(np.float64))).astype(np.float32)


def fused(w, adapter, strength=1.0):
    sd = {f"{M}.weight": w.copy()}
    lorakit.fuse_(sd, [(adapter, strength)])
    return sd[f"{M}.weight"]


def close(x, want):
    # within 1 ulp of the float32 rounding of the float64 reference
    assert np.all(np.abs(x.astype(np.float64) - want.astype(np.float64)) <= np.spacing(np.abs(want)).astype(np.float64))


def test_load_with_alpha(fv):
    w, a, b, path = fv
    ad = lorakit.Adapter.load(path, alpha=ALPHA)
    assert ad.alpha == ALPHA and ad != lorakit.Adapter.load(path)
    close(fused(w, ad), reference(w, a, b, ALPHA / R))
    close(fused(w, ad, 0.5), reference(w, a, b, 0.5 * ALPHA / R))
    with pytest.raises(ValueError, match="not finite"):
        lorakit.Adapter.load(path, alpha=float("nan"))
    with pytest.raises(TypeError, match="alpha must be a number"):
        lorakit.Adapter.load(path, alpha="16")


def test_default_warns(fv):
    w, a, b, path = fv
    with pytest.warns(lorakit.LoraWarning, match="alpha defaults to r"):
        got = fused(w, path)
    close(got, reference(w, a, b, 1.0))


def test_state_dict_alpha_and_config(fv):
    w, a, b, path = fv
    sd = {f"{M}.lora_A": a, f"{M}.lora_B": b}
    close(fused(w, lorakit.Adapter.from_state_dict(sd, alpha=ALPHA)), reference(w, a, b, ALPHA / R))
    # a config is no longer dropped for a non-PEFT key layout
    cfg = {"r": R, "lora_alpha": ALPHA}
    close(fused(w, lorakit.Adapter.from_state_dict(sd, cfg)), reference(w, a, b, ALPHA / R))
    # the caller's alpha against the config's: refused, naming both
    with pytest.raises(lorakit.LoraError, match="the file gives alpha = 16 .config. but the caller gives alpha = 4"):
        fused(w, lorakit.Adapter.from_state_dict(sd, cfg, alpha=4))


def test_alpha_tensor_int64(fv, tmp_path):
    # diffusers' convert_state_dict_to_kohya writes alpha as an int64 scalar
    w, a, b, _ = fv
    p = str(tmp_path / "fv_alpha.safetensors")
    st_io.write(p, {f"{M}.lora_A": ("F32", a), f"{M}.lora_B": ("F32", b), f"{M}.alpha": ("I64", np.array(16, np.int64))})
    close(fused(w, p), reference(w, a, b, ALPHA / R))
    info = lorakit.inspect(p)
    assert info["modules"][0]["alpha"] == 16 and info["modules"][0]["scale"] == 2


def test_tracker_alpha(fv):
    w, a, b, path = fv
    sd = {f"{M}.weight": w.copy()}
    with lorakit.Tracker(sd) as t:
        t.apply([(lorakit.Adapter.load(path, alpha=ALPHA), 1.0)])
        close(sd[f"{M}.weight"], reference(w, a, b, ALPHA / R))
        rep = t.apply([(lorakit.Adapter.load(path, alpha=8), 1.0)])  # another alpha: another set
        assert not rep["skipped"]
        close(sd[f"{M}.weight"], reference(w, a, b, 1.0))
