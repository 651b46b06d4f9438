"""lorakit fuse / inspect on OFT adapters written by PEFT 0.21 itself
(tests/fixtures/peft_oft: make_peft_oft_fixtures.py ran OFTConfig +
get_peft_model + save_pretrained, and merge_and_unload on model.double()).
numpy only (no torch): runs in CI.

Oracles: PEFT's own float64 merge (expected/<case>_<dtype>.safetensors) at
strength 1: every element within 1 ulp of its dtype (F32, F16, BF16), every
other tensor byte-identical. At strength s the README's rule
W (I + s (BD - I))^T = W + s (W_peft - W) (linear in s), built from the same
float64 merge; every convention gives the same bytes. Malformed files:
hand-made from the fixture, refused naming the key and shapes."""
import json
import os
import shutil

import numpy as np
import pytest

import st_io
from conftest import cli

FX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "fixtures", "peft_oft")
ALL = json.load(open(os.path.join(FX, "manifest.json")))
# more than one butterfly stage: make_peft_boft_stages.py (PEFT's own permutations and merge on the CPU, its
# fbd_cuda block-diagonal step given as torch.block_diag), on base_stages_*.safetensors
STAGES = json.load(open(os.path.join(FX, "manifest_stages.json")))
CASES = [c for c in ALL if c["base"] != "base_fp8.safetensors"] + STAGES
FP8 = [c for c in ALL if c["base"] == "base_fp8.safetensors"]
MANT = {"F16": (10, -14), "F32": (23, -126), "BF16": (7, -126)}


def ulp(x, dt):
    mant, emin = MANT[dt]
    _, e = np.frexp(np.abs(x))
    e = np.where(x == 0, emin, e - 1)
    return np.ldexp(1.0, np.maximum(e, emin) - mant)


def f64(dt, a):
    if dt == "BF16":
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def fuse(base, adapter, out, *extra):
    cli("fuse", base, "-l", adapter, "-o", out, *extra)
    return st_io.read(out)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['case']}-{c['base'][5:-12]}")
@pytest.mark.parametrize("s", [1.0, 0.7, -0.3])
def test_fuse_matches_peft_merge(case, s, tmp_path):
    base = os.path.join(FX, case["base"])
    ad = os.path.join(FX, case["case"])
    before = st_io.read(base)
    exp = st_io.read(os.path.join(FX, case["expected"]))
    got = fuse(base, f"{ad}:{s!r}", str(tmp_path / "o.safetensors"))
    worst = 0.0
    for k, (dt, a) in got.items():
        if k not in exp:
            assert a.tobytes() == before[k][1].tobytes(), f"{k} changed, but the adapter does not touch it"
            continue
        w = f64(*before[k])
        x = exp[k][1].reshape(a.shape)
        x = w + s * (x - w)  # s = 1: PEFT's merge itself
        err = np.abs(f64(dt, a) - x) / ulp(x, dt)
        worst = max(worst, err.max())
        assert err.max() <= 1.0, f"{k} ({dt}, s={s}): {err.max():.3g} ulp from PEFT's merge at {np.argmax(err)}"
    assert worst > 0.0  # the expectation is not representable exactly everywhere: the comparison is live
    if s != 1.0:  # every convention: the same bytes (one rule, README)
        for conv in ("comfyui", "lycoris", "peft"):
            o = fuse(base, f"{ad}:{s!r}", str(tmp_path / f"{conv}.safetensors"), "--convention", conv)
            assert all(o[k][1].tobytes() == got[k][1].tobytes() for k in got), conv


def e4m3(codes):
    """F8_E4M3 (e4m3fn) codes as float64 (no NaN codes here: checked)."""
    c = codes.astype(np.int64)
    s, e, m = np.where(c & 0x80, -1.0, 1.0), (c >> 3) & 15, c & 7
    assert not np.any((e == 15) & (m == 7)), "NaN code"
    return s * np.where(e == 0, np.ldexp(m / 8.0, -6), np.ldexp(1 + m / 8.0, e - 7))


@pytest.mark.parametrize("case", FP8, ids=lambda c: c["case"])
def test_fuse_fp8_matches_peft_merge(case, tmp_path):
    # the oracle: PEFT's float64 merge of the real weight code x scale; with the scale kept, each in-range code is
    # that merge divided by the scale rounded to nearest in e4m3 (within 0.5 e4m3 ulp), the rest clamp to +-448
    base = os.path.join(FX, case["base"])
    before = st_io.read(base)
    got = fuse(base, os.path.join(FX, case["case"]), str(tmp_path / "o.safetensors"), "--fp8-scale", "keep",
               "--fp8-saturate")
    sc = float(before["lin.weight_scale"][1].reshape(()))
    q = st_io.read(os.path.join(FX, case["expected"]))["lin.weight"][1].reshape(got["lin.weight"][1].shape) / sc
    g = e4m3(got["lin.weight"][1])
    _, e = np.frexp(np.abs(q))
    u = np.ldexp(1.0, np.maximum(e - 1, -6) - 3)
    inr = np.abs(q) < 448
    assert inr.sum() > q.size // 2
    assert np.max(np.abs(g - q)[inr] / u[inr]) <= 0.5
    assert np.all(np.abs(g[~inr]) == 448)
    assert got["lin.weight_scale"][1].tobytes() == before["lin.weight_scale"][1].tobytes()
    for k in ("keep.weight", "keep.bias", "lin.bias", "conv.bias"):
        assert got[k][1].tobytes() == before[k][1].tobytes(), k


def test_inspect_names_the_algorithm():
    r = cli("inspect", os.path.join(FX, "oft_coft"), "--json")
    mods = json.loads(r.stdout)["modules"]
    assert {m["module"] for m in mods} == {"lin", "conv"}
    assert all(m["algo"] == "oft" and m["rank"] == 4 for m in mods)
    assert "Cayley-Neumann, 7 terms, coft eps 0.02" in mods[0]["alpha_source"]
    r = cli("inspect", os.path.join(FX, "oft_exact"))
    assert "exact Cayley" in r.stdout


def copy_case(tmp_path, case, edit_cfg=None, edit_sd=None):
    d = tmp_path / case
    shutil.copytree(os.path.join(FX, case), d)
    if edit_cfg:
        cfg = json.load(open(d / "adapter_config.json"))
        edit_cfg(cfg)
        json.dump(cfg, open(d / "adapter_config.json", "w"))
    if edit_sd:
        sd = st_io.read(str(d / "adapter_model.safetensors"))
        edit_sd(sd)
        st_io.write(str(d / "adapter_model.safetensors"), sd)
    return str(d)


def refused(tmp_path, ad, *words):
    out = tmp_path / "bad.safetensors"
    r = cli("fuse", os.path.join(FX, "base_f32.safetensors"), "-l", ad, "-o", str(out), check=False)
    assert r.returncode != 0 and not out.exists(), r.stderr
    for w in words:
        assert w in r.stderr, (w, r.stderr)


def test_malformed_shapes_refused(tmp_path):
    def packed(sd):  # 5 values per block: no b with b (b - 1) / 2 = 5
        sd["base_model.model.lin.oft_R.weight"] = ("F32", np.zeros((3, 5), np.float32))
    refused(tmp_path, copy_case(tmp_path, "oft_neumann", edit_sd=packed), "lin.oft_R.weight", "[3, 5]")

    def blocks(sd):  # 2 blocks of 4 columns on a 12-column weight
        sd["base_model.model.lin.oft_R.weight"] = ("F32", np.zeros((2, 6), np.float32))
    refused(tmp_path, copy_case(tmp_path / "b", "oft_neumann", edit_sd=blocks), "lin.oft_R.weight", "[2, 6]",
            "12 elements per output row")


def test_boft_malformed_refused(tmp_path):
    def stages(sd):  # two butterfly stages of 3 blocks: PEFT's butterfly pairs the blocks, so refused by name
        sd["base_model.model.lin.boft_R"] = ("F32", np.zeros((2, 3, 4, 4), np.float32))
    refused(tmp_path, copy_case(tmp_path, "boft", edit_sd=stages), "lin.boft_R", "[2, 3, 4, 4]",
            "butterfly of 2 stages", "multiple of 2^1")

    def odd(sd):  # blocks of 3: a butterfly needs an even block size
        sd["base_model.model.lin.boft_R"] = ("F32", np.zeros((2, 4, 3, 3), np.float32))
    refused(tmp_path, copy_case(tmp_path / "o", "boft", edit_sd=odd), "lin.boft_R", "[2, 4, 3, 3]", "even block size")

    def cols(sd):  # 2 blocks of 4 columns on a 12-column weight
        sd["base_model.model.lin.boft_R"] = ("F32", np.zeros((1, 2, 4, 4), np.float32))
    refused(tmp_path, copy_case(tmp_path / "b", "boft", edit_sd=cols), "lin.boft_R", "[1, 2, 4, 4]",
            "12 elements per output row")

    def rows(sd):  # boft_s of 8 rows on a 16-row weight
        sd["base_model.model.lin.boft_s"] = ("F32", np.ones((8, 1), np.float32))
    refused(tmp_path / "c", copy_case(tmp_path / "c", "boft", edit_sd=rows), "lin.boft_R", "8 rows", "[16, 12]")


def test_unsupported_options_refused_by_name(tmp_path):
    refused(tmp_path, copy_case(tmp_path, "oft_neumann", lambda c: c.update(fan_in_fan_out=True)),
            "fan_in_fan_out = true")
    refused(tmp_path, copy_case(tmp_path / "b", "oft_neumann", lambda c: c.update(bias="all")), 'bias = "all"')
    refused(tmp_path, copy_case(tmp_path / "c", "oft_neumann", lambda c: c.update(peft_type="BOFT")),
            "conv.oft_R.weight' is PEFT's OFT but", 'not peft_type "OFT"')
    refused(tmp_path, copy_case(tmp_path / "e", "oft_neumann", lambda c: c.update(peft_type="VERA")),
            'peft_type = "VERA"')
    # block_share true in the config, but one block per 4 columns in the file
    refused(tmp_path, copy_case(tmp_path / "d", "oft_neumann", lambda c: c.update(block_share=True)),
            "block_share", "conv.oft_R.weight")
