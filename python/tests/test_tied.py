"""Tied weights (one tensor under several names) and non-contiguous tensors
in fuse_ / Tracker / fuse / `lorakit fuse --tie` (issue 28).

Oracles: PEFT's own merge_and_unload in float64 on a tiny randomly
initialised Llama with tie_word_embeddings=True (transformers + peft from
the venv; skipped with the reason without them), and float64 formulas
W + (alpha / r) B A rounded once to F32 for the hand-built cases (NumPy
only: these run in CI without torch)."""
import copy
import json
import os
import subprocess

import numpy as np
import pytest

import lorakit
import st_io

try:
    import torch
except ImportError:  # CI: no torch
    torch = None
need_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")


def peft_sd(module, a, b):
    return {f"base_model.model.{module}.lora_A.weight": a, f"base_model.model.{module}.lora_B.weight": b}


def adapter(module, a, b, alpha=None):
    r = a.shape[0]
    return lorakit.Adapter.from_state_dict(peft_sd(module, a, b), {"r": r, "lora_alpha": alpha or r}, format="peft")


def f64_fuse(w, a, b, scale):
    return (w.astype(np.float64) + scale * (b.astype(np.float64) @ a.astype(np.float64))).astype(np.float32)


rng = np.random.default_rng(28)
A = rng.uniform(-1, 1, (2, 3)).astype(np.float32)
B = rng.uniform(-1, 1, (4, 2)).astype(np.float32)


# ---- tied names in memory (torch: one storage under two state_dict names) ----

@pytest.fixture
def tiny_llama():
    if torch is None:
        pytest.skip("torch is not installed")
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    cfg = transformers.LlamaConfig(vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg).eval()
    assert m.lm_head.weight is m.model.embed_tokens.weight  # the tie this test is about
    return m


def peft_adapter(model, tmp_path, targets, save_embedding_layers="auto"):
    """PEFT's save; by default (save_embedding_layers "auto") a targeted lm_head's base weight is saved
    too (lm_head.base_layer.weight: a replacement of the tied tensor by its own value, under the LoRA)."""
    peft = pytest.importorskip("peft", reason="peft is not installed")
    torch.manual_seed(1)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    pm = peft.get_peft_model(copy.deepcopy(model), cfg)
    pm.save_pretrained(tmp_path / "ad", save_embedding_layers=save_embedding_layers)
    return tmp_path / "ad"


def peft_merged64(model, ad):
    """PEFT's merge_and_unload on a float64 copy: the reference."""
    peft = pytest.importorskip("peft")
    m64 = copy.deepcopy(model).double()
    merged = peft.PeftModel.from_pretrained(m64, str(ad)).merge_and_unload()
    assert merged.lm_head.weight.data_ptr() == merged.model.embed_tokens.weight.data_ptr()
    return merged.model.embed_tokens.weight.detach()


def ulps(ours, ref64):
    o = ours.detach().double().numpy()
    sp = np.spacing(np.abs(ours.detach().numpy())).astype(np.float64)
    return float(np.max(np.abs(o - ref64.numpy()) / sp))


@pytest.mark.parametrize("save_embedding_layers", ["auto", False])
def test_adapter_on_lm_head_fuses_the_tied_embedding_once_as_peft(tiny_llama, tmp_path, save_embedding_layers):
    ad = peft_adapter(tiny_llama, tmp_path, ["lm_head"], save_embedding_layers)
    keys = set(st_io.read(str(ad / "adapter_model.safetensors")))
    assert ("base_model.model.lm_head.base_layer.weight" in keys) == (save_embedding_layers == "auto")
    ref = peft_merged64(tiny_llama, ad)
    base = tiny_llama.model.embed_tokens.weight.detach().clone()
    sd = tiny_llama.state_dict()
    assert "lm_head.weight" in sd and "model.embed_tokens.weight" in sd  # both names, one tensor
    rep = lorakit.fuse_(tiny_llama, [(str(ad), 1.0)])
    assert rep["tensors_fused"] == 1
    w = tiny_llama.model.embed_tokens.weight
    assert tiny_llama.lm_head.weight is w
    assert ulps(w, ref) <= 0.5  # fused once: twice would be a whole delta off
    assert not torch.equal(w, base)


def test_tracker_backs_up_and_restores_the_tied_tensor_once(tiny_llama, tmp_path):
    ad = peft_adapter(tiny_llama, tmp_path, ["lm_head"])
    ref = peft_merged64(tiny_llama, ad)
    w = tiny_llama.model.embed_tokens.weight
    base = w.detach().clone()
    t = lorakit.Tracker(tiny_llama)
    rep = t.apply([(str(ad), 1.0)])
    assert rep["keys_fused"] == 1 and rep["backup_bytes_max"] == w.numel() * w.element_size()
    assert ulps(w, ref) <= 0.5
    rep = t.reset()
    assert rep["keys_restored"] == 1 and torch.equal(w.detach(), base)
    t.close()


@need_torch
def test_adapter_naming_both_tied_names_is_refused_and_changes_nothing():
    w = torch.from_numpy(rng.uniform(-1, 1, (4, 3)).astype(np.float32))
    sd = {"emb.weight": w, "head.weight": w}
    before = w.clone()
    both = {**peft_sd("emb", A, B), **peft_sd("head", A, B)}
    ad = lorakit.Adapter.from_state_dict(both, {"r": 2, "lora_alpha": 2}, format="peft")
    with pytest.raises(lorakit.LoraError, match="both target emb.weight"):
        lorakit.fuse_(sd, [(ad, 1.0)])
    with pytest.raises(lorakit.LoraError, match="both target emb.weight"):
        lorakit.Tracker(sd).apply([(ad, 1.0)])
    assert torch.equal(w, before)
    # two adapters, one on each name: both deltas land on the one tensor (as PEFT merges two
    # adapters into a shared parameter)
    lorakit.fuse_(sd, [(adapter("emb", A, B), 1.0), (adapter("head", A, B), 0.5)])
    want = (before.double() + 1.5 * (torch.from_numpy(B).double() @ torch.from_numpy(A).double())).float()
    assert torch.equal(w, want)


# ---- a non-contiguous tensor no adapter writes is left alone ----

def strided_cases():
    out = [("numpy", lambda: np.ascontiguousarray(rng.uniform(-1, 1, (3, 4)).astype(np.float32)).T)]
    if torch is not None:
        out.append(("torch", lambda: torch.from_numpy(rng.uniform(-1, 1, (3, 4)).astype(np.float32)).t()))
    return out


def as_np(x):
    return x.numpy() if torch is not None and isinstance(x, torch.Tensor) else x


@pytest.mark.parametrize("kind,make", strided_cases(), ids=[k for k, _ in strided_cases()])
def test_untouched_strided_tensor_is_left_alone(kind, make):
    w = rng.uniform(-1, 1, (4, 3)).astype(np.float32)
    s = make()
    assert not (s.flags.c_contiguous if kind == "numpy" else s.is_contiguous())
    sd = {"lin.weight": w.copy() if kind == "numpy" else torch.from_numpy(w.copy()), "s.weight": s}
    s_bytes, s_strides = np.array(as_np(s)).tobytes(), (s.strides if kind == "numpy" else s.stride())
    lorakit.fuse_(sd, [(adapter("lin", A, B), 1.0)])
    assert np.array_equal(as_np(sd["lin.weight"]), f64_fuse(w, A, B, 1.0))
    assert np.array(as_np(s)).tobytes() == s_bytes and (s.strides if kind == "numpy" else s.stride()) == s_strides
    t = lorakit.Tracker(sd)
    t.apply([(adapter("lin", A, B), 0.5)])
    assert np.array_equal(as_np(sd["lin.weight"]), f64_fuse(f64_fuse(w, A, B, 1.0), A, B, 0.5))
    t.reset()
    assert np.array_equal(as_np(sd["lin.weight"]), f64_fuse(w, A, B, 1.0))
    assert np.array(as_np(s)).tobytes() == s_bytes
    t.close()


@pytest.mark.parametrize("kind,make", strided_cases(), ids=[k for k, _ in strided_cases()])
def test_strided_tensor_an_adapter_writes_is_refused_by_name(kind, make):
    w = rng.uniform(-1, 1, (4, 3)).astype(np.float32)
    s = make()
    sd = {"lin.weight": w.copy() if kind == "numpy" else torch.from_numpy(w.copy()), "s.weight": s}
    s_bytes = np.array(as_np(s)).tobytes()
    both = [(adapter("lin", A, B), 1.0), (adapter("s", A, B), 1.0)]
    with pytest.raises(lorakit.LoraError, match=r"s\.weight: an adapter writes it, but it is not contiguous"):
        lorakit.fuse_(sd, both)
    t = lorakit.Tracker(sd)
    with pytest.raises(lorakit.LoraError, match=r"s\.weight: the adapter writes it, but it is not contiguous"):
        t.apply(both)
    t.close()
    assert np.array_equal(as_np(sd["lin.weight"]), w) and np.array(as_np(s)).tobytes() == s_bytes


# ---- files: a tied weight saved once (`lorakit fuse --tie`, fuse(tied=)) ----

EMB = "model.embed_tokens.weight"


@pytest.fixture
def saved_once(tmp_path):
    """A checkpoint as transformers saves a tied model (lm_head.weight left
    out) and a PEFT folder with a LoRA on lm_head (alpha 4, r 2)."""
    w = rng.uniform(-1, 1, (4, 3)).astype(np.float32)
    st_io.write(tmp_path / "base.safetensors", {EMB: ("F32", w), "model.norm.weight": ("F32", np.ones(3, np.float32))})
    (tmp_path / "ad").mkdir()
    st_io.write(tmp_path / "ad" / "adapter_model.safetensors",
                {k: ("F32", v) for k, v in peft_sd("lm_head", A, B).items()})
    (tmp_path / "ad" / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["lm_head"]}))
    return tmp_path, w


def cli(*args):
    return subprocess.run([os.environ.get("LORAKIT_BIN", "lorakit"), *map(str, args)], capture_output=True, text=True)


def test_cli_tie_fuses_lm_head_into_the_saved_embedding(saved_once):
    d, w = saved_once
    p = cli("fuse", d / "base.safetensors", "-l", d / "ad", "-o", d / "out.safetensors")
    assert p.returncode != 0 and "lm_head matches no model weight" in p.stderr and "--tie" in p.stderr, p.stderr
    assert not (d / "out.safetensors").exists()
    p = cli("fuse", d / "base.safetensors", "-l", d / "ad", "--tie", f"lm_head.weight={EMB}", "-o",
            d / "out.safetensors")
    assert p.returncode == 0, p.stderr
    out = st_io.read(d / "out.safetensors")
    assert sorted(out) == [EMB, "model.norm.weight"]
    assert out[EMB][1].tobytes() == f64_fuse(w, A, B, 2.0).tobytes()
    r = lorakit.fuse(d / "base.safetensors", [(str(d / "ad"), 1.0)], d / "py.safetensors",
                     tied={"lm_head.weight": EMB})
    assert r["tensors_fused"] == 1
    assert (d / "py.safetensors").read_bytes() == (d / "out.safetensors").read_bytes()


def test_cli_tie_bad_values_are_refused(saved_once):
    d, _ = saved_once
    p = cli("fuse", d / "base.safetensors", "-l", d / "ad", "--tie", "lm_head.weight=nope.weight", "-o",
            d / "out.safetensors")
    assert p.returncode != 0 and "the model has no tensor nope.weight" in p.stderr, p.stderr
    p = cli("fuse", d / "base.safetensors", "-l", d / "ad", "--tie", "lm_head.weight", "-o", d / "out.safetensors")
    assert p.returncode != 0 and "--tie needs NAME=KEY" in p.stderr, p.stderr
    assert not (d / "out.safetensors").exists()
    with pytest.raises(TypeError, match="tied must be a mapping"):
        lorakit.fuse(d / "base.safetensors", [(str(d / "ad"), 1.0)], d / "py.safetensors", tied=[("a", "b")])


def test_cli_tie_on_a_pipeline_folder_is_refused_by_name(tmp_path):
    """Each pipeline component resolves with its own options, so tied names are refused there (never
    silently dropped); expectation: the error names the folder and the pair, no output is written."""
    fx = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "fixtures", "layouts")
    out = tmp_path / "out"
    p = cli("fuse", os.path.join(fx, "sd2_pipe"), "-l", os.path.join(fx, "sd2_lora_kohya.safetensors"),
            "--tie", "lm_head.weight=x.weight", "-o", out)
    assert p.returncode != 0, p.stderr
    assert "sd2_pipe: a pipeline folder: tied names (--tie lm_head.weight=x.weight) are not supported" in p.stderr, p.stderr
    assert not out.exists()
