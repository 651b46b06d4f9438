"""lorakit.merge / resize / extract: the same bytes and report as the CLI (which
tests/algebra_oracle.py checks against float64 NumPy SVDs), the report as a
dict, errors as LoraError; and (torch venv only, skipped in CI with the
reason) the outputs load in PEFT and diffusers and give the delta lorakit
reports, checked against a float64 dense SVD here."""
import json
import os

import numpy as np
import pytest

import lorakit
from conftest import cli, st_io

FX = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "fixtures")
LOHA = os.path.join(FX, "lycoris", "loha.safetensors")
PEFT = os.path.join(FX, "adapters", "peft")


def test_resize_matches_cli(tmp_path):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    rep = lorakit.resize(LOHA, a, rank=2, dtype="F32")
    cli_rep = json.loads(cli("resize", LOHA, "-o", b, "--rank", "2", "--dtype", "F32", "--json").stdout)
    assert a.read_bytes() == b.read_bytes()
    for k in ("rel_fro", "rel_fro_opt", "rel_spec", "alpha", "dtype", "format"):
        assert rep[k] == cli_rep[k], k
    assert [m["rank"] for m in rep["modules"]] == [2] * len(rep["modules"])
    # rank 2 of a rank-4 LoHa: an error strictly between 0 and 1, never below the optimum
    assert 0 < rep["rel_fro_opt"] <= rep["rel_fro"] < 1


def test_merge_pairs_and_order(tmp_path):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    r1 = lorakit.merge([(LOHA, 0.5), LOHA], a, rank=3)
    r2 = lorakit.merge([LOHA, (LOHA, 0.5)], b, rank=3)
    assert a.read_bytes() == b.read_bytes()
    assert r1["rel_fro"] == r2["rel_fro"]
    # 0.5 X + X = 1.5 X: the exact delta's norm is 1.5 times the resize's
    rr = lorakit.resize(LOHA, tmp_path / "c.safetensors")
    for m1, m0 in zip(r1["modules"], rr["modules"]):
        assert m1["norm"] == pytest.approx(1.5 * m0["norm"], rel=1e-12)


def test_convert_fuses_the_same(tmp_path):
    base = os.path.join(FX, "adapters", "base.safetensors")
    out = tmp_path / "k.safetensors"
    rep = lorakit.convert(PEFT, out, format="kohya")
    assert rep["rel_fro"] == 0.0 and rep["format"] == "kohya"
    # the digests of the two fuses (lorakit fuse is checked elsewhere against float64 references)
    lorakit.fuse(base, [PEFT], tmp_path / "a.safetensors")
    lorakit.fuse(base, [str(out)], tmp_path / "b.safetensors")
    assert lorakit.digest(tmp_path / "a.safetensors") == lorakit.digest(tmp_path / "b.safetensors")


def test_errors(tmp_path):
    with pytest.raises(lorakit.LoraError) as e:
        lorakit.resize(os.path.join(FX, "lycoris", "dora_out.safetensors"), tmp_path / "x.safetensors", rank=1)
    assert e.value.status == "LK_ERR_UNSUPPORTED" and "DoRA" in str(e.value)
    assert not (tmp_path / "x.safetensors").exists()
    with pytest.raises(lorakit.LoraError):
        lorakit.resize(LOHA, tmp_path / "x.safetensors", rank=1, dtype="F64")
    with pytest.raises(lorakit.LoraError):
        lorakit.resize(LOHA, tmp_path / "x.safetensors", rank=1, format="onnx")


def _f64(e):
    dt, a = e
    return st_io.bf16_to_f64(a.reshape(-1)).reshape(a.shape) if dt == "BF16" else a.astype(np.float64)


def test_outputs_load_in_peft(tmp_path):
    torch = pytest.importorskip("torch", reason="needs torch (the /work/venv); CI has none")
    peft = pytest.importorskip("peft", reason="needs peft (the /work/venv); CI has none")
    out = tmp_path / "p"
    rep = lorakit.merge([(PEFT, 0.7), (PEFT, 0.6)], out, err=0.3, dtype="F32", format="peft")
    cfg = json.load(open(os.path.join(PEFT, "adapter_config.json")))
    sd = st_io.read(os.path.join(PEFT, "adapter_model.safetensors"))
    exact, shapes = {}, {}
    for k in sd:
        if k.endswith("lora_A.weight"):
            n = k[len("base_model.model."):-len(".lora_A.weight")]
            A, B = _f64(sd[k]), _f64(sd[k.replace("lora_A", "lora_B")])
            alpha = cfg.get("alpha_pattern", {}).get(n, cfg["lora_alpha"])
            exact[n] = 1.3 * (B @ A) * (alpha / A.shape[0])  # 0.7 X + 0.6 X, float64
            shapes[n] = (B.shape[0], A.shape[1])

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Module()])
            self.blocks[0].attn = torch.nn.Module()
            for n, (o, i) in shapes.items():
                setattr(self.blocks[0].attn, n.split(".")[-1], torch.nn.Linear(i, o, bias=False))
    pm = peft.PeftModel.from_pretrained(M(), str(out))
    for m in rep["modules"]:
        lin = getattr(pm.base_model.model.blocks[0].attn, m["name"].split(".")[-1])
        got = (lin.lora_B["default"].weight.double() @ lin.lora_A["default"].weight.double()).numpy() * \
            lin.scaling["default"]
        X = exact[m["name"]]
        assert lin.lora_A["default"].weight.shape[0] == m["rank"]
        # PEFT's own reading of the file has exactly the error lorakit reported, and the optimum is numpy's
        assert np.linalg.norm(got - X) / np.linalg.norm(X) == pytest.approx(m["rel_fro"], abs=1e-6)
        s = np.linalg.svd(X, compute_uv=False)
        assert np.sqrt(np.sum(s[m["rank"]:] ** 2)) / np.linalg.norm(X) == pytest.approx(m["rel_fro_opt"], abs=1e-9)


def _pair(tmp_path, shape_k=(6, 8)):
    """BASE / TUNED (F32): q's difference exactly rank 2 (integers), k random, a bias, an unchanged weight."""
    g = np.random.default_rng(3)
    u, v = g.integers(-3, 4, (8, 2)), g.integers(-3, 4, (2, 10))
    bq, bk = g.integers(-5, 6, (8, 10)).astype(np.float32), g.standard_normal((6, 8)).astype(np.float32)
    same = np.ones((2, 2), np.float32)
    b = {"m.q.weight": ("F32", bq), "m.k.weight": ("F32", bk), "m.q.bias": ("F32", np.zeros(8, np.float32)),
         "m.same.weight": ("F32", same)}
    tk = (bk + 0.1 * g.standard_normal((6, 8))).astype(np.float32).reshape(shape_k)
    t = {"m.q.weight": ("F32", (bq + u @ v).astype(np.float32)), "m.k.weight": ("F32", tk),
         "m.q.bias": ("F32", np.ones(8, np.float32)), "m.same.weight": ("F32", same)}
    pb, pt = tmp_path / "base.safetensors", tmp_path / "tuned.safetensors"
    st_io.write(pb, b)
    st_io.write(pt, t)
    dk = tk.astype(np.float64) - bk if tk.shape == bk.shape else None
    return pb, pt, {"m.q": (u @ v).astype(np.float64), "m.k": dk}


def test_extract_matches_cli(tmp_path):
    pb, pt, D = _pair(tmp_path)
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    rep = lorakit.extract(pb, pt, a, rank=2, dtype="F32", exclude="nothing-matches", seed=5)
    cli_rep = json.loads(cli("extract", pb, pt, "-o", b, "--rank", "2", "--dtype", "F32", "--seed", "5",
                             "--exclude", "nothing-matches", "--json").stdout)
    assert a.read_bytes() == b.read_bytes()
    for k in ("rel_fro", "rel_fro_opt", "rel_fro_opt_upper", "alpha", "dtype", "format", "unchanged", "not_extracted"):
        assert rep[k] == cli_rep[k], k
    assert rep["operation"] == "extract" and rep["options"]["seed"] == 5
    assert rep["unchanged"] == ["m.same.weight"] and [x["name"] for x in rep["not_extracted"]] == ["m.q.bias"]
    # the exactly rank-2 difference comes back to the F32 floor; the other's optimum (numpy) lies in the bounds
    mods = {m["name"]: m for m in rep["modules"]}
    assert mods["m.q"]["rel_fro"] < 1e-6
    s = np.linalg.svd(D["m.k"], compute_uv=False)
    opt = np.sqrt(np.sum(s[2:] ** 2) / np.sum(s ** 2))
    assert mods["m.k"]["rel_fro_opt"] <= opt + 1e-12 <= mods["m.k"]["rel_fro_opt_upper"] + 2e-12
    ex = lorakit.extract(pb, pt, tmp_path / "e.safetensors", rank=2, exact_svd=True, dtype="F32")
    assert ex["rel_fro_opt_kind"] == "exact"
    assert {m["name"]: m for m in ex["modules"]}["m.k"]["rel_fro_opt"] == pytest.approx(opt, abs=1e-12)


def test_extract_errors(tmp_path):
    pb, pt, _ = _pair(tmp_path, shape_k=(8, 6))
    with pytest.raises(lorakit.LoraError) as e:
        lorakit.extract(pb, pt, tmp_path / "x.safetensors", rank=2)
    assert e.value.status == "LK_ERR_SHAPE" and "m.k.weight" in str(e.value) and "[6, 8]" in str(e.value)
    assert not (tmp_path / "x.safetensors").exists()
    with pytest.raises(lorakit.LoraError):
        lorakit.extract(pb, pt, tmp_path / "x.safetensors")  # neither rank nor err
    with pytest.raises(lorakit.LoraError):
        lorakit.extract(pb, pt, tmp_path / "x.safetensors", rank=2, include="(")
    assert not (tmp_path / "x.safetensors").exists()


def test_extract_loads_in_peft_and_fuses(tmp_path):
    torch = pytest.importorskip("torch", reason="needs torch (the /work/venv); CI has none")
    peft = pytest.importorskip("peft", reason="needs peft (the /work/venv); CI has none")
    pb, pt, D = _pair(tmp_path)
    out = tmp_path / "p"
    rep = lorakit.extract(pb, pt, out, include=r"\.(q|k)\.weight$", rank=2, dtype="F32")
    assert rep["format"] == "peft"

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = torch.nn.Module()
            self.m.q, self.m.k = torch.nn.Linear(10, 8, bias=False), torch.nn.Linear(8, 6, bias=False)
    pm = peft.PeftModel.from_pretrained(M(), str(out))
    for m in rep["modules"]:
        lin = getattr(pm.base_model.model.m, m["name"].split(".")[-1])
        got = (lin.lora_B["default"].weight.double() @ lin.lora_A["default"].weight.double()).numpy() * \
            lin.scaling["default"]
        X = D[m["name"]]
        # PEFT's reading of the file has the error lorakit reported (numpy f64 here); lorakit's is
        # ||D||^2 - 2 <D, BA> + ||BA||^2 in f64, so ~1e-8 absolute at the F32 floor (the target: 1e-4)
        assert np.linalg.norm(got - X) / np.linalg.norm(X) == pytest.approx(m["rel_fro"], abs=1e-7)
    # lorakit fuse BASE OUT: base + PEFT's delta, rounded once to F32
    lorakit.fuse(pb, [str(out)], tmp_path / "f.safetensors")
    fused, base = st_io.read(tmp_path / "f.safetensors"), st_io.read(pb)
    lin = pm.base_model.model.m.q
    want = base["m.q.weight"][1].astype(np.float64) + \
        (lin.lora_B["default"].weight.double() @ lin.lora_A["default"].weight.double()).numpy() * lin.scaling["default"]
    assert np.max(np.abs(fused["m.q.weight"][1] - want)) <= 2.0 ** -23 * np.max(np.abs(want))
