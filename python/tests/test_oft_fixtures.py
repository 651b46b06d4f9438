"""lorakit.fuse_ (in place, on NumPy arrays) on the OFT, BOFT and GLoRA files
written by lycoris-lora's own modules (tests/fixtures/oft, manifest.json), on
the F16 and F32 bases (NumPy has no BF16/FP8 dtype), under the default
convention (lorakit: LyCORIS's formulas for these files, README).

Oracles: the float64 expectations of the "lycoris" rows (LyCORIS's formulas,
cross-checked by make_oft_fixtures.py against LyCORIS's module code): every
changed element within 1 ulp of its dtype, every other tensor
byte-identical; and the lorakit CLI's fuse of the same file (same digest)."""
import json
import os

import numpy as np
import pytest

import lorakit
import st_io
from conftest import cli
from test_lycoris_fixtures import ulp

FX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "fixtures", "oft")
CASES = [c for c in json.load(open(os.path.join(FX, "manifest.json")))
         if c["convention"] == "lycoris" and c["base"] in ("base_f16.safetensors", "base_f32.safetensors")]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['case']}-{c['base'][5:-12]}-s{c['strength']:g}")
def test_fuse_inplace_matches_fixture(case, tmp_path):
    base, adapter = os.path.join(FX, case["base"]), os.path.join(FX, case["case"] + ".safetensors")
    out = str(tmp_path / "cli.safetensors")
    cli("fuse", base, "-l", f"{adapter}:{case['strength']!r}", "-o", out)
    t = {k: a for k, (dt, a) in st_io.read(base).items()}
    before = {k: v.copy() for k, v in t.items()}
    lorakit.fuse_(t, [(adapter, case["strength"])], threads=2)
    assert lorakit.digest_tensors(t) == cli("digest", out).stdout.strip()
    exp = {k: a for k, (dt, a) in st_io.read(os.path.join(FX, case["expected"])).items()}
    for k, v in t.items():
        if k not in exp:
            assert v.tobytes() == before[k].tobytes(), f"{k} changed, but the adapter does not touch it"
            continue
        got, x = v.astype(np.float64), exp[k].reshape(v.shape)
        err = np.abs(got - x) / ulp(x, v.dtype)
        assert err.max() <= 1.0, f"{k}: {err.max():.3g} ulp from the expectation at {np.argmax(err)}"
