"""A strength is the Python float (a double) as given, through fuse, fuse_
and Tracker (issue 20, item 1). F32 weights that partly cancel the delta
are fused at 0.7 and 0.7 / -0.3; the oracle is the exact value of
W + sum s * B A with Fraction arithmetic (s the double 0.7), correctly
rounded to float32 here, so the float 0.7f (which differs on nearly every
element, checked) would fail it. Plus the strength recorded in the
summary, the output's metadata and Tracker.loras, and the refusals."""
import json
import math
import os
from fractions import Fraction

import numpy as np
import pytest

import lorakit
import st_io

O, I = 12, 16
NAME = "blk.w.weight"


def f32_round(x):
    """The float32 nearest the Fraction x (ties to even), independent of lorakit."""
    f = np.float32(float(x))
    best = None
    for c in (np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))):
        d = abs(Fraction(float(c)) - x)
        even = int(np.array(c, np.float32).view(np.uint32)) % 2 == 0
        if best is None or d < best[0] or (d == best[0] and even):
            best = (d, c)
    return best[1]


def near_midpoint(x, tol):
    """Is x within tol of a point halfway between two float32 (where the
    kernel's double chain may round either way)?"""
    f = np.float32(float(x))
    for c in (np.nextafter(f, np.float32(-np.inf)), np.nextafter(f, np.float32(np.inf))):
        if abs((Fraction(float(f)) + Fraction(float(c))) / 2 - x) <= tol:
            return True
    return False


def make(tmp, strengths, seed):
    rng = np.random.default_rng(seed)
    terms = []
    for k, s in enumerate(strengths):
        a = rng.uniform(-1, 1, (1, I)).astype(np.float32)
        b = rng.uniform(-1, 1, (O, 1)).astype(np.float32)
        p = os.path.join(tmp, f"ad{k}.safetensors")
        st_io.write(p, {"blk.w.lora_A.weight": ("F32", a), "blk.w.lora_B.weight": ("F32", b)})
        terms.append((p, s, a, b))
    d = sum(s * b.astype(np.float64) @ a.astype(np.float64) for _, s, a, b in terms)
    w = (-d * (1 + rng.uniform(-1 / 4096, 1 / 4096, d.shape))).astype(np.float32)  # W + delta ~ 2^-13 of each
    base = os.path.join(tmp, "base.safetensors")
    st_io.write(base, {NAME: ("F32", w), "other.weight": ("F32", np.ones((2, 2), np.float32))})
    ref = np.empty_like(w)
    ref_f = np.empty_like(w)
    skip = np.zeros(w.shape, bool)
    for o in range(O):
        for j in range(I):
            x = Fraction(float(w[o, j]))
            xf = Fraction(float(w[o, j]))
            mag = Fraction(0)
            for _, s, a, b in terms:
                t = Fraction(float(b[o, 0])) * Fraction(float(a[0, j]))
                x += Fraction(s) * t
                xf += Fraction(float(np.float32(s))) * t
                mag += abs(Fraction(s) * t)
            ref[o, j] = f32_round(x)
            ref_f[o, j] = f32_round(xf)
            skip[o, j] = near_midpoint(x, mag * Fraction(8, 2**53))
    assert skip.sum() * 50 < skip.size
    assert (ref_f.view(np.uint32) != ref.view(np.uint32)).sum() * 10 > ref.size * 9  # 0.7f would fail
    return base, [(p, s) for p, s, _, _ in terms], ref, skip


def assert_exact(got, ref, skip):
    bad = (got.view(np.uint32) != ref.view(np.uint32)) & ~skip
    assert not bad.any(), f"{bad.sum()} of {bad.size} elements not the correctly rounded value"


@pytest.mark.parametrize("strengths", [(0.7,), (0.7, -0.3)])
def test_strength_is_the_double(tmp_path, strengths):
    base, loras, ref, skip = make(str(tmp_path), strengths, 7 + len(strengths))
    out = str(tmp_path / "out.safetensors")
    summary = lorakit.fuse(base, loras, out)
    assert_exact(st_io.read(out)[NAME][1], ref, skip)
    assert [a["strength"] for a in summary["adapters"]] == list(strengths)
    meta = json.loads(_metadata(out)["lorakit.fused"])
    assert sorted(e["strength"] for e in meta) == sorted(strengths)

    sd = {k: v for k, (_, v) in st_io.read(base).items()}
    lorakit.fuse_(sd, loras)
    assert_exact(sd[NAME], ref, skip)

    sd = {k: v for k, (_, v) in st_io.read(base).items()}
    t = lorakit.Tracker(sd)
    try:
        t.apply(loras)
        assert_exact(sd[NAME], ref, skip)
        assert sorted(s for _, s in t.loras) == sorted(strengths)
    finally:
        t.close()


def _metadata(path):
    data = open(path, "rb").read()
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n])["__metadata__"]


def test_strength_refusals(tmp_path):
    base, loras, _, _ = make(str(tmp_path), (0.7,), 3)
    sd = {k: v for k, (_, v) in st_io.read(base).items()}
    before = sd[NAME].copy()
    for bad in (math.inf, -math.inf, math.nan):
        with pytest.raises(lorakit.LoraError) as e:
            lorakit.fuse_(sd, [(loras[0][0], bad)])
        assert e.value.status == "LK_ERR_ARG" and "not finite" in str(e.value)
    with pytest.raises(ValueError, match="beyond the range of a double"):
        lorakit.fuse_(sd, [(loras[0][0], 10**400)])
    with pytest.raises(TypeError, match="strength must be a number"):
        lorakit.fuse_(sd, [(loras[0][0], "0.7x")])
    assert sd[NAME].tobytes() == before.tobytes()


def test_strength_one_parser(tmp_path):
    """One strength rule for the CLI, plans and Python (issue 20, QA): a
    bool is not a number (True was taken as 1.0), and text is read by the
    CLI's parser, so "0.7" is the double 0.7 and "0x1p-3" is 0.125 (float()
    refuses hex); "1e-400" is refused as reading 0, as -l PATH:1e-400 is."""
    base, loras, _, _ = make(str(tmp_path), (0.7,), 3)
    sd = {k: v for k, (_, v) in st_io.read(base).items()}
    before = sd[NAME].copy()
    for bad in (True, False, np.bool_(True)):
        with pytest.raises(TypeError, match=r"strength must be a number, got .*\(a bool\)"):
            lorakit.fuse_(sd, [(loras[0][0], bad)])
    with pytest.raises(TypeError, match="strength '1e-400' is too small"):
        lorakit.fuse_(sd, [(loras[0][0], "1e-400")])
    assert sd[NAME].tobytes() == before.tobytes()
    assert lorakit._strength(0, "0.7") == 0.7
    assert lorakit._strength(0, b"0x1p-3") == 0.125
    assert lorakit._strength(0, np.float32(0.5)) == 0.5
    assert lorakit._strength(0, 2) == 2.0
    with pytest.raises(TypeError, match="not finite"):
        lorakit._strength(0, "inf")
    # the same text through fuse_ gives the same bytes as the float
    a = {k: v.copy() for k, v in sd.items()}
    b = {k: v.copy() for k, v in sd.items()}
    lorakit.fuse_(a, [(loras[0][0], "0x1p-3")])
    lorakit.fuse_(b, [(loras[0][0], 0.125)])
    assert a[NAME].tobytes() == b[NAME].tobytes() != before.tobytes()
