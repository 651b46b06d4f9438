"""lorakit.fuse_ (in place, on NumPy arrays) on the adapters written by the
real lycoris-lora and peft packages (tests/fixtures/lycoris, the rows of
manifest.json), on the F16 and F32 bases (NumPy has no BF16/FP8 dtype).

Oracles: the float64 expectations in the fixtures (LyCORIS's forward /
PEFT's merge_and_unload, cross-checked by make_lycoris_fixtures.py against
the published formulas): every changed element within 1 ulp of its dtype,
every other tensor byte-identical; and the lorakit CLI's fuse of the same
file (same digest). Where the CLI refuses a case (an algorithm not fused
yet; tests/test_lycoris_parity.c lists those), fuse_ must refuse it too,
with the arrays unchanged, and the case is skipped with the CLI's reason."""
import json
import os

import numpy as np
import pytest

import lorakit
import st_io
from conftest import cli

FX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "fixtures", "lycoris")
CASES = [c for c in json.load(open(os.path.join(FX, "manifest.json")))
         if c["kind"] == "fuse" and c["base"] in ("base_f16.safetensors", "base_f32.safetensors")]


def ulp(x, dtype):
    """One unit in the last place of x in dtype (F16/F32), elementwise."""
    mant, emin = (10, -14) if dtype == np.float16 else (23, -126)
    _, e = np.frexp(np.abs(x))  # |x| = m 2^e with m in [0.5, 1): the exponent is e - 1
    e = np.where(x == 0, emin, e - 1)
    return np.ldexp(1.0, np.maximum(e, emin) - mant)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['name']}-{c['base'][5:-12]}-s{c['strength']:g}")
def test_fuse_inplace_matches_fixture(case, tmp_path):
    base, adapter = os.path.join(FX, case["base"]), os.path.join(FX, case["adapter"])
    out = str(tmp_path / "cli.safetensors")
    r = cli("fuse", base, "-l", f"{adapter}:{case['strength']!r}", "-o", out, check=False)
    t = {k: a for k, (dt, a) in st_io.read(base).items()}
    before = {k: v.copy() for k, v in t.items()}
    if r.returncode != 0:
        with pytest.raises(lorakit.LoraError):
            lorakit.fuse_(t, [(adapter, case["strength"])])
        for k in t:
            assert t[k].tobytes() == before[k].tobytes(), k
        pytest.skip(f"not fused yet (the CLI refuses it too): {r.stderr.strip()[:200]}")
    s = lorakit.fuse_(t, [(adapter, case["strength"])], threads=2)
    assert lorakit.digest_tensors(t) == cli("digest", out).stdout.strip()
    exp = {k: a for k, (dt, a) in st_io.read(os.path.join(FX, case["expected"])).items()}
    assert s["tensors_fused"] == len(exp)
    for k, v in t.items():
        if k not in exp:
            assert v.tobytes() == before[k].tobytes(), f"{k} changed, but the adapter does not touch it"
            continue
        got, x = v.astype(np.float64), exp[k].reshape(v.shape)
        err = np.abs(got - x) / ulp(x, v.dtype)
        assert err.max() <= 1.0, f"{k}: {err.max():.3g} ulp from the expectation at {np.argmax(err)}"
