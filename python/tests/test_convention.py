"""convention= in Python (issue 29): lorakit.fuse, fuse_, Tracker, inspect and
lorakit.Adapter take the CLI's `--convention lorakit|comfyui|lycoris|peft`.

Oracle: the lorakit CLI's own `fuse --convention C` (and `inspect --json
--convention C`) on the same files; the Python result must equal it byte for
byte, tensor by tensor. The file holds every point where the conventions
disagree (README "Conventions"): DoRA on the output axis (LoRA and LoHa),
set_weight, LoHa / LoKr / LoRA with .alpha 0, and a second file whose alpha
is only in lora_adapter_metadata; the four conventions must give four
different fused checkpoints, so a convention= that is dropped on the way to
C fails here. What each convention computes is checked against float64
formulas in tests/test_convention.c.
"""
import json
import os

import numpy as np
import pytest

import lorakit
import st_io
from conftest import cli

O, I, R = 8, 6, 2
CONVS = ("lorakit", "comfyui", "lycoris", "peft")
MODS = ("dout", "dloha", "sw", "lh", "lk", "lr", "md")


def _write(d, seed=29):
    rng = np.random.default_rng(seed)
    u = lambda *s, lo=-0.5, hi=0.5: rng.uniform(lo, hi, s).astype(np.float32)  # noqa: E731
    base = {}
    for i, m in enumerate(MODS):  # F32 and F16 weights (fuse_ / Tracker take NumPy arrays of these)
        w = rng.uniform(-1, 1, (O, I))
        base[f"{m}.weight"] = ("F32", w.astype(np.float32)) if i % 2 == 0 else ("F16", w.astype(np.float16))
    base["pos_ids"] = ("I64", np.arange(5, dtype=np.int64))
    p = {"dir": str(d), "base": os.path.join(d, "base.safetensors"), "base_bf16": os.path.join(d, "base_bf16.safetensors")}
    st_io.write(p["base"], base)
    st_io.write(p["base_bf16"], {k: ("BF16", st_io.f32_to_bf16(a.astype(np.float64))) if dt != "I64" else (dt, a)
                                 for k, (dt, a) in base.items()})
    ly = {}

    def lora(stem):
        ly[f"{stem}.lora_down.weight"] = ("F32", u(R, I))
        ly[f"{stem}.lora_up.weight"] = ("F32", u(O, R))

    def loha(stem):
        for k, shape in (("w1_a", (O, R)), ("w1_b", (R, I)), ("w2_a", (O, R)), ("w2_b", (R, I))):
            ly[f"{stem}.hada_{k}"] = ("F32", u(*shape))

    scalar = lambda v: ("F32", np.array(v, dtype=np.float32))  # noqa: E731
    lora("lycoris_dout")
    ly["lycoris_dout.alpha"] = scalar(1.0)
    ly["lycoris_dout.dora_scale"] = ("F32", u(O, 1, lo=0.5, hi=1.5))
    loha("lycoris_dloha")
    ly["lycoris_dloha.alpha"] = scalar(4.0)
    ly["lycoris_dloha.dora_scale"] = ("F32", u(O, 1, lo=0.5, hi=1.5))
    ly["lycoris_sw.set_weight"] = ("F32", u(O, I, lo=-1, hi=1))
    loha("lycoris_lh")
    ly["lycoris_lh.alpha"] = scalar(0.0)
    ly["lycoris_lk.lokr_w1"] = ("F32", u(2, 2, lo=-1, hi=1))
    ly["lycoris_lk.lokr_w2_a"] = ("F32", u(4, R))
    ly["lycoris_lk.lokr_w2_b"] = ("F32", u(R, 3))
    ly["lycoris_lk.alpha"] = scalar(0.0)
    lora("lycoris_lr")
    ly["lycoris_lr.alpha"] = scalar(0.0)
    p["ly"] = os.path.join(d, "conv_lycoris.safetensors")
    st_io.write(p["ly"], ly)
    p["md"] = os.path.join(d, "conv_meta.safetensors")
    st_io.write(p["md"], {"md.lora_A.weight": ("F32", u(R, I)), "md.lora_B.weight": ("F32", u(O, R))},
                {"lora_adapter_metadata": json.dumps({"r": R, "lora_alpha": 6})})
    return p


@pytest.fixture
def files(tmp_path):
    return _write(str(tmp_path))


def _cli_fuse(base, loras, out, conv):
    args = ["fuse", base, "-o", out, "--json", "--convention", conv]
    for path, s in loras:
        args += ["-l", f"{path}:{s}"]
    return json.loads(cli(*args).stdout)


def _tensors(path):
    return {k: a.tobytes() for k, (_, a) in st_io.read(path).items()}


def _numpy_state(path):
    return {k: a for k, (_, a) in st_io.read(path).items()}


def _loras(p, s):
    return [(p["ly"], s), (p["md"], s)]


@pytest.mark.parametrize("s", [1.0, 0.7, -0.3])
def test_fuse_file_equals_cli(files, s):
    digests = set()
    for base in ("base", "base_bf16"):
        for cv in CONVS:
            want = os.path.join(files["dir"], f"cli_{base}_{cv}.safetensors")
            got = os.path.join(files["dir"], f"py_{base}_{cv}.safetensors")
            summary_cli = _cli_fuse(files[base], _loras(files, s), want, cv)
            summary = lorakit.fuse(files[base], _loras(files, s), got, convention=cv)
            assert summary["convention"] == summary_cli["convention"] == cv
            assert _tensors(got) == _tensors(want), (base, cv)
            assert lorakit.digest(got) == cli("digest", want).stdout.strip()
            digests.add(lorakit.digest(got))
    assert len(digests) == 2 * len(CONVS)  # every convention means other weights for this file


@pytest.mark.parametrize("s", [1.0, -0.3])
def test_fuse_inplace_and_tracker_equal_cli(files, s):
    for cv in CONVS:
        want = os.path.join(files["dir"], f"cli_{cv}.safetensors")
        _cli_fuse(files["base"], _loras(files, s), want, cv)
        t = _numpy_state(files["base"])
        assert lorakit.fuse_(t, _loras(files, s), convention=cv)["convention"] == cv
        assert {k: a.tobytes() for k, a in t.items()} == _tensors(want), cv
        t = _numpy_state(files["base"])
        with lorakit.Tracker(t, comm="self", convention=cv) as tr:
            assert tr.convention == cv
            tr.apply(_loras(files, s))
            assert {k: a.tobytes() for k, a in t.items()} == _tensors(want), cv
            tr.reset()
            assert {k: a.tobytes() for k, a in t.items()} == _tensors(files["base"])


def test_adapter_convention(files):
    """An Adapter made with convention=C fuses as `--convention C` when the
    call gives none; a call or tracker with another refuses it."""
    want = os.path.join(files["dir"], "cli_comfyui.safetensors")
    _cli_fuse(files["base"], _loras(files, 0.7), want, "comfyui")
    ad = [(lorakit.Adapter.load(files["ly"], convention="comfyui"), 0.7),
          (lorakit.Adapter.load(files["md"], convention="comfyui"), 0.7)]
    got = os.path.join(files["dir"], "py.safetensors")
    assert lorakit.fuse(files["base"], ad, got)["convention"] == "comfyui"
    assert _tensors(got) == _tensors(want)
    t = _numpy_state(files["base"])
    lorakit.fuse_(t, ad, convention="comfyui")  # the same one given twice: fine
    assert {k: a.tobytes() for k, a in t.items()} == _tensors(want)
    # identity: the convention is part of the label (the tracker's request)
    plain = lorakit.Adapter.load(files["ly"])
    assert plain != ad[0][0] and plain.label != ad[0][0].label and plain.convention is None
    assert "convention 'comfyui'" in repr(ad[0][0])
    with pytest.raises(ValueError, match=r"was made with convention 'comfyui' but the call uses 'peft'"):
        lorakit.fuse(files["base"], ad, got + "2", convention="peft")
    assert not os.path.exists(got + "2")
    mixed = [ad[0], (lorakit.Adapter.load(files["md"], convention="lycoris"), 0.7)]
    with pytest.raises(ValueError, match=r"convention 'lycoris' but adapter conv_lycoris.safetensors@\w+ uses 'comfyui'"):
        lorakit.fuse_(_numpy_state(files["base"]), mixed)
    t = _numpy_state(files["base"])
    with lorakit.Tracker(t, comm="self") as tr:
        assert tr.convention == "lorakit"
        with pytest.raises(ValueError, match="but the call uses 'lorakit'"):
            tr.apply(ad)
        assert {k: a.tobytes() for k, a in t.items()} == _tensors(files["base"])


def test_inspect_convention_equals_cli(files):
    for cv in CONVS:
        assert lorakit.inspect(files["ly"], convention=cv) == json.loads(
            cli("inspect", files["ly"], "--json", "--convention", cv).stdout)
        assert lorakit.inspect(files["ly"], files["base"], convention=cv) == json.loads(
            cli("inspect", files["ly"], "--base", files["base"], "--json", "--convention", cv).stdout)
    # the alpha 0 LoHa: scale 1 (alpha = r) under lorakit, 0 under comfyui
    mods = lambda cv: {m["module"]: m for m in lorakit.inspect(files["ly"], convention=cv)["modules"]}  # noqa: E731
    assert mods("lorakit")["lycoris_lh"]["scale"] == 1.0 and mods("comfyui")["lycoris_lh"]["scale"] == 0.0


@pytest.mark.parametrize("bad", ["ComfyUI", "kohya", "", 3])
def test_unknown_convention(files, bad):
    shown = f"'{bad}'" if isinstance(bad, str) else repr(bad)
    msg = f"unknown convention {shown}: expected lorakit\\|comfyui\\|lycoris\\|peft"
    out = os.path.join(files["dir"], "never.safetensors")
    t = _numpy_state(files["base"])
    for call in (lambda: lorakit.fuse(files["base"], _loras(files, 1), out, convention=bad),
                 lambda: lorakit.fuse_(t, _loras(files, 1), convention=bad),
                 lambda: lorakit.Tracker(t, comm="self", convention=bad),
                 lambda: lorakit.inspect(files["ly"], convention=bad),
                 lambda: lorakit.Adapter.load(files["ly"], convention=bad)):
        with pytest.raises(ValueError, match=msg):
            call()
    assert not os.path.exists(out)
    assert {k: a.tobytes() for k, a in t.items()} == _tensors(files["base"])


# ---- inspect: where the conventions differ, and by how much ----

OFT_FX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "fixtures", "oft")


def _decoded(path):
    """{name: float64 values} of every float tensor of a file (st_io, our own reader)."""
    out = {}
    for k, (dt, a) in st_io.read(path).items():
        if dt == "BF16":
            out[k] = st_io.bf16_to_f64(a).ravel()
        elif dt in ("F32", "F16"):
            out[k] = a.astype(np.float64).ravel()
    return out


def _expected_differences(d, base, adapter, s):
    """The oracle: `lorakit fuse --convention C` at strength s for each C (the
    bytes tests/test_convention.c and tests/test_oft.c check against float64
    formulas), grouped per weight by bytes, each pair of groups measured here
    in float64: {weight: (groups, {(a, b): (max_abs, rel_fro, elements)})}."""
    raw, val = {}, {}
    for cv in CONVS:
        out = os.path.join(d, f"exp_{cv}_{s}.safetensors")
        _cli_fuse(base, [(adapter, s)], out, cv)
        raw[cv], val[cv] = _tensors(out), _decoded(out)
    w0, exp = _decoded(base), {}
    for name in w0:
        groups = []
        for cv in CONVS:
            for g in groups:
                if raw[g[0]][name] == raw[cv][name]:
                    g.append(cv)
                    break
            else:
                groups.append([cv])
        if len(groups) < 2:
            continue
        pairs = {}
        for i, ga in enumerate(groups):
            for gb in groups[i + 1:]:
                a, b = val[ga[0]][name], val[gb[0]][name]
                den = max(np.linalg.norm(a - w0[name]), np.linalg.norm(b - w0[name]))
                pairs[(ga[0], gb[0])] = (np.abs(a - b).max(), np.linalg.norm(a - b) / den if den else 0.0,
                                         int(np.count_nonzero(a != b)))
        exp[name] = (groups, pairs)
    return exp


def _check_reported(conv, exp, s):
    got = {}
    for m in conv["modules"]:
        for at in m["at"]:
            if at["strength"] == s:
                got[m["weight"]] = at
    assert set(got) == set(exp), (sorted(got), sorted(exp))
    for w, (groups, pairs) in exp.items():
        assert got[w]["groups"] == groups, w
        rep = {(p["a"], p["b"]): p for p in got[w]["pairs"]}
        assert set(rep) == set(pairs), w
        for ab, (mx, rel, ne) in pairs.items():
            assert rep[ab]["elements"] == ne
            assert rep[ab]["max_abs"] == pytest.approx(mx, rel=1e-12, abs=0)
            assert rep[ab]["rel_fro"] == pytest.approx(rel, rel=1e-9, abs=1e-300)


CASES = [  # (adapter, base, the points the file must show)
    ("ly", "base", ["DoRA on the output axis", "DoRA epsilon", "set_weight", "scale (alpha / rank)"]),
    ("ly", "base_bf16", ["DoRA on the output axis", "set_weight"]),
    ("md", "base", ["metadata lora_adapter_metadata"]),
    (os.path.join(OFT_FX, "oft.safetensors"), os.path.join(OFT_FX, "base_f32.safetensors"),
     ["OFT strength", "OFT rescale", "OFT/BOFT constraint"]),
    (os.path.join(OFT_FX, "boft.safetensors"), os.path.join(OFT_FX, "base_bf16.safetensors"),
     ["BOFT at strength s != 1", "OFT/BOFT constraint"]),
    (os.path.join(OFT_FX, "glora_a0.safetensors"), os.path.join(OFT_FX, "base_f16.safetensors"), ["scale"]),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_inspect_reports_the_differences(files, case):
    adapter, base, points = CASES[case]
    adapter, base = files.get(adapter, adapter), files.get(base, base)
    py = lorakit.inspect(adapter, base, strength=0.7)
    js = json.loads(cli("inspect", adapter, "--base", base, "--json", "--strength", "0.7").stdout)
    assert py["conventions"] == js["conventions"]
    assert js["conventions"]["strengths"] == [1.0, 0.7] and js["conventions"]["base"] is True
    differ = set()
    for s in (1.0, 0.7):
        exp = _expected_differences(files["dir"], base, adapter, s)
        _check_reported(js["conventions"], exp, s)
        differ |= set(exp)
    assert differ and js["conventions"]["modules_differ"] == len(differ)
    text = " ".join(p for m in js["conventions"]["modules"] for p in m["points"])
    for p in points:
        assert p in text, p
    assert "differ by up to" in cli("inspect", adapter, "--base", base, "--strength", "0.7").stdout


def test_inspect_plain_lora_agrees(files):
    """A plain LoRA with an .alpha tensor means the same weights everywhere: nothing is reported."""
    rng = np.random.default_rng(3)
    p = os.path.join(files["dir"], "plain.safetensors")
    st_io.write(p, {"lora_unet_dout.lora_down.weight": ("F32", rng.uniform(-1, 1, (R, I)).astype(np.float32)),
                    "lora_unet_dout.lora_up.weight": ("F32", rng.uniform(-1, 1, (O, R)).astype(np.float32)),
                    "lora_unet_dout.alpha": ("F32", np.array(1.0, dtype=np.float32))})
    for s in (1.0, 0.7):
        assert _expected_differences(files["dir"], files["base"], p, s) == {}
    for base in (None, files["base"]):
        c = lorakit.inspect(p, base, strength=0.7)["conventions"]
        assert c["modules"] == [] and c["modules_differ"] == 0
    assert "give the same weights for this file on this base" in cli("inspect", p, "--base", files["base"]).stdout


def test_inspect_without_base(files):
    """Without a base: modules whose delta does not read W differ by their
    scales alone (rel_fro = |c_a - c_b| / max(|c_a|, |c_b|), by hand below);
    DoRA and set_weight are listed as needing the base."""
    c = lorakit.inspect(files["ly"])["conventions"]
    assert c == json.loads(cli("inspect", files["ly"], "--json").stdout)["conventions"]
    mods = {m["module"]: m for m in c["modules"]}
    assert {k for k, m in mods.items() if m["needs_base"]} == {"lycoris_dout", "lycoris_dloha", "lycoris_sw"}
    assert all("at" not in mods[k] for k in ("lycoris_dout", "lycoris_dloha", "lycoris_sw"))
    # LoHa / LoKr .alpha 0: scale 1 (lorakit, lycoris: alpha = r) against 0 (comfyui, peft)
    for k in ("lycoris_lh", "lycoris_lk"):
        for at in mods[k]["at"]:
            assert at["groups"] == [["lorakit", "lycoris"], ["comfyui", "peft"]]
            assert at["pairs"] == [{"a": "lorakit", "b": "comfyui", "max_abs": None, "rel_fro": 1.0}]
    # LoRA .alpha 0: only lycoris reads 0 as r
    assert mods["lycoris_lr"]["at"][0]["groups"] == [["lorakit", "comfyui", "peft"], ["lycoris"]]
    # alpha only in lora_adapter_metadata (r 2, lora_alpha 6): 3 against 1
    md = lorakit.inspect(files["md"])["conventions"]["modules"][0]
    assert md["at"][0]["groups"] == [["lorakit", "peft"], ["comfyui", "lycoris"]]
    assert md["at"][0]["pairs"][0]["rel_fro"] == pytest.approx(2 / 3, rel=1e-15)
    assert c["modules_differ"] == 3  # lh, lk, lr (the others need the base)


def test_inspect_fp8_weight_not_compared():
    """FP8 weights are not compared: said, never reported as agreeing."""
    c = lorakit.inspect(os.path.join(OFT_FX, "oft.safetensors"), os.path.join(OFT_FX, "base_fp8.safetensors"))
    assert c["conventions"]["not_compared"] == ["oft_lin.weight"] and c["conventions"]["modules"] == []
