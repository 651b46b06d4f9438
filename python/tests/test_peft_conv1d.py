"""PEFT LoRA on transformers' Conv1D layers (GPT-2's c_attn / c_proj / c_fc:
weight [in, out]), with adapters PEFT itself wrote on a tiny random GPT-2
(tests/fixtures/peft_conv1d, make_peft_conv1d_fixtures.py: LoraConfig +
get_peft_model + save_pretrained, then merge_and_unload on model.double()).

PEFT sets fan_in_fan_out per layer from its type and saves the value its
last layer set: `lm_head_last` (an nn.Linear lm_head created last) says
false although every Conv1D merged transposed, and its square attn.c_proj
fits either orientation; `conv1d_only` says true. It also saves the targeted
lm_head's base weight (save_embedding_layers), which loading puts back.

Oracles: PEFT's own float64 merge (expected/<case>.safetensors) at strength
1, every element within 1 ulp of F32; at strength s, W + s (W_peft - W)
(LoRA is linear in s). The discriminating check: the untransposed product
(what the saved false would say) is far from PEFT's merge on the square
c_proj. A base_layer weight unlike the base: R + (alpha / r) B A in float64
(what PEFT's load + merge computes). numpy only: runs in CI; the nn.Module
tests need torch + transformers + peft and skip by name without them."""
import json
import os
import shutil

import numpy as np
import pytest

import st_io
from conftest import cli

FX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "fixtures", "peft_conv1d")
MANIFEST = json.load(open(os.path.join(FX, "manifest.json")))
BASE = os.path.join(FX, "base_f32.safetensors")
PRE = "base_model.model."


def ulp32(x):
    _, e = np.frexp(np.abs(x))
    e = np.where(x == 0, -126, e - 1)
    return np.ldexp(1.0, np.maximum(e, -126) - 23)


def factors(case):
    cfg = json.load(open(os.path.join(FX, case, "adapter_config.json")))
    ad = st_io.read(os.path.join(FX, case, "adapter_model.safetensors"))
    return cfg["lora_alpha"] / cfg["r"], ad


@pytest.mark.parametrize("case", MANIFEST, ids=lambda c: c["case"])
@pytest.mark.parametrize("s", [1.0, 0.7, -0.3])
def test_fuse_matches_peft_merge(case, s, tmp_path):
    before = st_io.read(BASE)
    exp = st_io.read(os.path.join(FX, case["expected"]))
    assert sorted(exp) == case["changed"]
    out = str(tmp_path / "o.safetensors")
    cli("fuse", BASE, "-l", f"{os.path.join(FX, case['case'])}:{s!r}", "-o", out)
    got = st_io.read(out)
    worst = 0.0
    for k, (dt, a) in got.items():
        if k not in exp:
            assert a.tobytes() == before[k][1].tobytes(), f"{k} changed, but the adapter does not touch it"
            continue
        w = before[k][1].astype(np.float64)
        x = w + s * (exp[k][1].reshape(a.shape) - w)
        err = np.abs(a.astype(np.float64) - x) / ulp32(x)
        worst = max(worst, err.max())
        assert err.max() <= 1.0, f"{k} (s={s}): {err.max():.3g} ulp from PEFT's merge at {np.argmax(err)}"
    assert worst > 0.0  # the expectation is not representable exactly everywhere: the comparison is live


@pytest.mark.parametrize("case", MANIFEST, ids=lambda c: c["case"])
def test_untransposed_would_be_wrong(case):
    """The fixture discriminates: on the square attn.c_proj, W + c B A
    (untransposed) is far from PEFT's merge, W + c (B A)^T is it."""
    c, ad = factors(case["case"])
    w = st_io.read(BASE)["transformer.h.0.attn.c_proj.weight"][1].astype(np.float64)
    exp = st_io.read(os.path.join(FX, case["expected"]))["transformer.h.0.attn.c_proj.weight"][1]
    m = PRE + "transformer.h.0.attn.c_proj"
    ba = ad[m + ".lora_B.weight"][1].astype(np.float64) @ ad[m + ".lora_A.weight"][1].astype(np.float64)
    assert ba.shape == w.shape  # square: the shape cannot tell
    assert np.abs(w + c * ba.T - exp).max() < 1e-12
    assert np.abs(w + c * ba - exp).max() > 1e-2


def test_saved_fan_in_fan_out_as_peft_wrote_it():
    said = {c["case"]: c["saved_fan_in_fan_out"] for c in MANIFEST}
    assert said == {"lm_head_last": False, "conv1d_only": True, "lm_head_last_nosave": False}


def copy_case(tmp_path, case, edit):
    d = tmp_path / case
    shutil.copytree(os.path.join(FX, case), d)
    p = str(d / "adapter_model.safetensors")
    t = st_io.read(p)
    edit(t)
    st_io.write(p, t)
    return str(d)


def test_base_layer_weight_replaces_the_base(tmp_path):
    """PEFT's load puts the saved lm_head.base_layer.weight into the model,
    then merges: R + c B A."""
    rng = np.random.default_rng(3)
    key = PRE + "lm_head.base_layer.weight"
    r = {}

    def edit(t):
        dt, a = t[key]
        r["R"] = (a + rng.uniform(-0.1, 0.1, a.shape)).astype(np.float32)
        t[key] = (dt, r["R"])

    ad = copy_case(tmp_path, "lm_head_last", edit)
    out = str(tmp_path / "o.safetensors")
    cli("fuse", BASE, "-l", ad, "-o", out)
    c, f = factors("lm_head_last")
    x = r["R"].astype(np.float64) + c * (f[PRE + "lm_head.lora_B.weight"][1].astype(np.float64)
                                         @ f[PRE + "lm_head.lora_A.weight"][1].astype(np.float64))
    got = st_io.read(out)["lm_head.weight"][1].astype(np.float64)
    assert (np.abs(got - x) / ulp32(x)).max() <= 1.0


def test_base_layer_weight_of_another_shape_is_refused(tmp_path):
    key = PRE + "lm_head.base_layer.weight"

    def edit(t):
        dt, a = t[key]
        t[key] = (dt, np.concatenate([a, a[:2]]))  # a resized vocabulary: 42 rows for the model's 40

    ad = copy_case(tmp_path, "lm_head_last", edit)
    out = tmp_path / "o.safetensors"
    r = cli("fuse", BASE, "-l", ad, "-o", str(out), check=False)
    assert r.returncode == 1 and "lm_head" in r.stderr and "42" in r.stderr, r.stderr
    assert not out.exists()


def test_renamed_blocks_without_the_names_refused_or_exact(tmp_path):
    """Without GPT-2's names (a checkpoint whose qkv is not [x, 3x] under
    attn.c_attn) the file's own fan_in_fan_out rules: conv1d_only (true)
    still lands transposed by shape on the non-square weights, and a
    non-square weight a false config leaves untransposed is refused by its
    shape, never fused wrong."""
    before = st_io.read(BASE)
    renamed = {k.replace(".attn.c_attn.", ".attn.qkv."): v for k, v in before.items()}
    base = str(tmp_path / "renamed.safetensors")
    st_io.write(base, renamed)

    def ren(t):
        for k in list(t):
            if ".attn.c_attn." in k:
                t[k.replace(".attn.c_attn.", ".attn.qkv.")] = t.pop(k)

    ad = copy_case(tmp_path, "lm_head_last", ren)
    r = cli("fuse", base, "-l", ad, "-o", str(tmp_path / "o.safetensors"), check=False)
    assert r.returncode == 1 and "qkv" in r.stderr, r.stderr  # [24, 8] factors on an [8, 24] weight
    assert not (tmp_path / "o.safetensors").exists()


# ---- nn.Module: the layer's type decides (torch + transformers + peft) ----

def _torch_stack():
    try:
        import peft  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        pytest.skip(f"torch, transformers and peft are not importable ({e.name}): the nn.Module tests need them")
    import lorakit
    return lorakit


def test_fuse_module_by_layer_type(tmp_path):
    """A model whose Conv1D layers have no GPT-2 names (a square Conv1D
    'mix' and an nn.Linear 'head' created last: the saved config says
    false): fuse_ on the module transposes by the layer's type; the oracle
    is PEFT's float64 merge_and_unload of the same adapter."""
    lorakit = _torch_stack()
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers.pytorch_utils import Conv1D

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mix = Conv1D(6, 6)
            self.up = Conv1D(10, 6)
            self.head = torch.nn.Linear(6, 6)

    torch.manual_seed(5)
    net = Net()
    base = {k: v.clone() for k, v in net.state_dict().items()}
    pm = get_peft_model(Net(), LoraConfig(r=2, lora_alpha=3, target_modules=["mix", "up", "head"],
                                          init_lora_weights=False))
    pm.base_model.model.load_state_dict(base, strict=False)
    torch.manual_seed(6)
    for n, p in pm.named_parameters():
        if "lora_" in n:
            p.data.uniform_(-0.5, 0.5)
    pm.save_pretrained(tmp_path / "ad")
    assert json.load(open(tmp_path / "ad" / "adapter_config.json"))["fan_in_fan_out"] is False
    ref = Net()
    ref.load_state_dict(base)
    exp = {k: v.double() for k, v in PeftModel.from_pretrained(ref.double(), tmp_path / "ad")
           .merge_and_unload().state_dict().items()}
    net.load_state_dict(base)
    lorakit.fuse_(net, [str(tmp_path / "ad")])
    for k in ("mix.weight", "up.weight", "head.weight"):
        got = net.state_dict()[k].double().numpy()
        x = exp[k].numpy()
        assert (np.abs(got - x) / ulp32(x)).max() <= 1.0, k
    # the Tracker lands it by the layer's type too (the same bytes), and reset gives the base back
    fused = {k: v.clone() for k, v in net.state_dict().items()}
    net.load_state_dict(base)
    t = lorakit.Tracker(net)
    t.apply([(str(tmp_path / "ad"), 1.0)])
    assert all(torch.equal(net.state_dict()[k], fused[k]) for k in fused)
    t.reset()
    assert all(torch.equal(net.state_dict()[k], base[k]) for k in base)
    t.close()
    # a plain state dict carries no layer types: the square 'mix' follows the saved false, i.e. not PEFT's merge
    sd = {k: v.clone() for k, v in base.items()}
    with pytest.raises(lorakit.LoraError, match="up"):  # the non-square Conv1D is refused by its shape
        lorakit.fuse_(sd, [str(tmp_path / "ad")])


def test_gpt2_module_equals_file_fuse(tmp_path):
    """fuse_ on a GPT2LMHeadModel with the fixture's base gives the CLI's
    bytes (the module's types and GPT-2's names agree)."""
    lorakit = _torch_stack()
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=40, n_positions=16, n_embd=8, n_layer=2, n_head=2, tie_word_embeddings=False)
    m = GPT2LMHeadModel(cfg).eval()
    base = st_io.read(BASE)
    m.load_state_dict({k: torch.from_numpy(a.copy()) for k, (dt, a) in base.items()}, strict=False)
    lorakit.fuse_(m, [os.path.join(FX, "lm_head_last")])
    out = str(tmp_path / "o.safetensors")
    cli("fuse", BASE, "-l", os.path.join(FX, "lm_head_last"), "-o", out)
    got = st_io.read(out)
    sd = m.state_dict()
    for k, (dt, a) in got.items():
        assert sd[k].numpy().tobytes() == a.tobytes(), k
