"""Convention fixtures written by the real tools (issue 29), fused under every
convention at F32, F16 and BF16 and strengths 1, 0.7, -0.3.

Oracle: tests/fixtures/conventions/expected.safetensors, float64
expectations written by make_convention_fixtures.py from each tool's formula
(README "Conventions"; the lycoris ones cross-checked there against
lycoris-lora 4.1.3's own forward, the peft ones against peft 0.21.2's merge).
The adapters: lycoris-lora's DoRA LoRA / LoHa / LoKr (dora_scale on the output
axis), its LoHa / LoKr with .alpha set to 0, and a diffusers-written PEFT
LoRA whose alpha is only in lora_adapter_metadata. Every fused element must
be within 1 ulp of its dtype of the expectation; every other tensor keeps
its bytes.
"""
import os

import numpy as np
import pytest

import lorakit
import st_io

FX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "fixtures", "conventions")
ADAPTERS = {"ly_dora_lora": "dlora", "ly_dora_loha": "dloha", "ly_dora_lokr": "dlokr", "ly_loha_a0": "aloha",
            "ly_lokr_a0": "alokr", "peft_meta_alpha": "md"}
CONVS = ("lorakit", "comfyui", "lycoris", "peft")


def _values(dt, a):
    if dt == "BF16":
        return st_io.bf16_to_f64(a)
    return a.astype(np.float64)


def _ulp(e, dt):
    """The spacing of dtype dt at each |e| (normal range: the fixtures' values are)."""
    a = np.abs(e)
    if dt == "F32":
        return np.spacing(a.astype(np.float32)).astype(np.float64)
    if dt == "F16":
        return np.spacing(a.astype(np.float16)).astype(np.float64)
    return np.exp2(np.floor(np.log2(a)) - 7)


@pytest.fixture(scope="module")
def expected():
    return {k: a for k, (_, a) in st_io.read(os.path.join(FX, "expected.safetensors")).items()}


@pytest.mark.parametrize("dt", ["F32", "F16", "BF16"])
@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
def test_fixture_within_one_ulp(tmp_path, expected, adapter, dt):
    base = os.path.join(FX, f"base_{dt.lower()}.safetensors")
    clean = st_io.read(base)
    target = f"{ADAPTERS[adapter]}.weight"
    worst, results = {}, set()
    for cv in CONVS:
        for s in (1.0, 0.7, -0.3):
            out = str(tmp_path / f"{cv}_{s}.safetensors")
            lorakit.fuse(base, [(os.path.join(FX, adapter + ".safetensors"), s)], out, convention=cv)
            got = st_io.read(out)
            for k, (kdt, a) in clean.items():
                if k != target:
                    assert got[k][1].tobytes() == a.tobytes(), (k, cv, s)
            e = expected[f"{cv}/{s!r}/{target}"]
            g = _values(dt, got[target][1])
            err = np.abs(g - e) / _ulp(e, dt)
            assert err.max() <= 1.0, (adapter, dt, cv, s, float(err.max()))
            worst[cv] = max(worst.get(cv, 0.0), float(err.max()))
            results.add(got[target][1].tobytes())
    print(f"{adapter} {dt}: worst ulp " + " ".join(f"{cv} {w:.3f}" for cv, w in worst.items()))
    assert len(results) > 3  # the conventions (and strengths) give different weights for this file


def test_expectations_differ_by_convention(expected):
    """The fixtures hold a disagreement for each file (else the test above could not tell conventions apart)."""
    for target in ADAPTERS.values():
        vals = {cv: expected[f"{cv}/0.7/{target}.weight"].tobytes() for cv in CONVS}
        assert len(set(vals.values())) >= 2, target
