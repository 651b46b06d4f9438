"""merge / resize / convert outputs read by the loaders people use, and
their metadata.

Without torch (CI): the metadata every output carries (kohya ss_network_dim
/ ss_network_alpha, PEFT r / lora_alpha / rank_pattern / alpha_pattern,
diffusers lora_adapter_metadata, the lorakit.algebra record with the inputs'
digests as `lorakit digest` prints them and the options), checked against
the report and against ranks computed here.

With torch, peft and diffusers (the /work/venv; skipped in CI with the
reason): a tiny diffusers UNet2DConditionModel (seeded) is the base; two
kohya LoRAs on its attention projections (random, different ranks and
alphas, written here with st_io) are merged with --fro (so ranks differ per
module: a dynamic-rank file, the diffusers 0.42.1 trap: it gives every module
the file's most common alpha). Each output is loaded by diffusers
(StableDiffusionPipeline.lora_state_dict + load_lora_into_unet, the code
load_lora_weights runs) or PEFT (PeftModel.from_pretrained), and the delta
each loaded layer applies (lora_B @ lora_A x scaling, as the library computes
it) is compared with the float64 oracle: the exact delta sum_i s_i (alpha_i /
r_i) up_i @ down_i built here with numpy, whose distance to the loaded delta
must be the rel_fro lorakit reported (to 1e-6), itself within 1e-6 of
numpy's SVD optimum at that rank (F32). lorakit fuse of each output must give
base + the loaded delta within the F32 rounding of the sum."""
import json
import os
import struct

import numpy as np
import pytest

import lorakit
from conftest import cli, st_io

FX = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "fixtures")
ATTN = ["down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q",
        "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_k",
        "down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k",
        "down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_out.0",
        "up_blocks.1.attentions.0.transformer_blocks.0.attn1.to_v"]


def header(path):
    b = open(path, "rb").read(8)
    n = struct.unpack("<Q", b)[0]
    with open(path, "rb") as f:
        f.seek(8)
        return json.loads(f.read(n))


def lora_pair(d, shapes):
    """Two LoRAs on the modules of shapes {diffusers name: (out, in)}: ranks 4 / 3, alphas 2 / 5 (a), rank 5,
    alpha 1.5 (b), in diffusers naming (unet.<name>.lora_A.weight, .lora_B.weight, .alpha); a_kohya.safetensors
    holds a's tensors under kohya's names (lora_unet_<name with _>.lora_down.weight, ...). Returns the paths
    (a, b, a_kohya) and {name: [(tag, up, down, scale)...]} in float64."""
    g = np.random.default_rng(11)
    terms, paths = {}, []
    for tag, rs, alphas in (("a", (4, 3), (2.0, 5.0)), ("b", (5,), (1.5,))):
        t, tk = {}, {}
        for j, (name, (o, i)) in enumerate(shapes.items()):
            r, al = rs[j % len(rs)], alphas[j % len(alphas)]
            k, kk = "unet." + name, "lora_unet_" + name.replace(".", "_")
            down = g.standard_normal((r, i)).astype(np.float32)
            up = (g.standard_normal((o, r)) * 0.05).astype(np.float32)
            t[k + ".lora_A.weight"], tk[kk + ".lora_down.weight"] = ("F32", down), ("F32", down)
            t[k + ".lora_B.weight"], tk[kk + ".lora_up.weight"] = ("F32", up), ("F32", up)
            t[k + ".alpha"] = tk[kk + ".alpha"] = ("F32", np.array(al, np.float32))
            terms.setdefault(name, []).append((tag, up.astype(np.float64), down.astype(np.float64), al / r))
        p = os.path.join(d, f"{tag}.safetensors")
        st_io.write(p, t)
        paths.append(p)
        if tag == "a":
            ka = os.path.join(d, "a_kohya.safetensors")
            st_io.write(ka, tk)
    return paths + [ka], terms


def exact(terms, strengths):
    return {n: sum(strengths[tag] * s * (u @ v) for tag, u, v, s in ts) for n, ts in terms.items()}


def test_metadata_of_every_format(tmp_path):
    shapes = {n: (24, 16 if "attn2.to_k" in n else 24) for n in ATTN}
    (a, b, _), _ = lora_pair(tmp_path, shapes)
    digests = {a: lorakit.digest(a), b: lorakit.digest(b)}
    for fmt in ("kohya", "diffusers", "comfyui", "peft"):
        out = tmp_path / (fmt if fmt == "peft" else fmt + ".safetensors")
        rep = lorakit.merge([(a, 0.7), (b, -0.4)], out, fro=0.97, max_rank=6, format=fmt, dtype="F32")
        st = out / "adapter_model.safetensors" if fmt == "peft" else out
        meta = header(st)["__metadata__"]
        rec = json.loads(meta["lorakit.algebra"])
        # the inputs' digests are `lorakit digest` of each file (an independent command), with the strengths
        assert sorted((i["digest"], i["strength"]) for i in rec["inputs"]) == \
            sorted([(digests[a], 0.7), (digests[b], -0.4)])
        assert rec["options"] == {"fro": 0.97, "max_rank": 6, "exact": False} and rec["operation"] == "merge"
        ranks = sorted(m["rank"] for m in rep["modules"])
        assert len(set(ranks)) > 1, "the case must give a dynamic-rank file"
        assert rec["alpha"] == 6.0  # the one alpha of the file: --max-rank
        mode = max(set(ranks), key=lambda r: (ranks.count(r), -r))
        if fmt == "kohya":
            assert meta["ss_network_dim"] == "Dynamic" and float(meta["ss_network_alpha"]) == 6.0
        if fmt in ("kohya", "comfyui"):  # an F32 .alpha per module, all the file's one alpha
            hd = header(st)
            alphas = [k for k in hd if k.endswith(".alpha")]
            assert len(alphas) == len(ATTN) and all(hd[k]["dtype"] == "F32" for k in alphas)
        if fmt in ("diffusers", "peft"):
            if fmt == "diffusers":  # packed per component as diffusers' pipelines save it: "unet.r", ...
                packed = json.loads(meta["lora_adapter_metadata"])
                assert all(k.startswith("unet.") for k in packed)
                cfg = {k[len("unet."):]: v for k, v in packed.items()}
            else:
                cfg = json.load(open(out / "adapter_config.json"))
            assert cfg["r"] == mode and cfg["lora_alpha"] == 6.0 and cfg["alpha_pattern"] == {}
            assert sorted(cfg["target_modules"]) == sorted(ATTN)  # the UNet's own module names
            want = {m["name"]: m["rank"] for m in rep["modules"] if m["rank"] != mode}
            assert cfg["rank_pattern"] == want


def test_convert_record(tmp_path):
    src = os.path.join(FX, "keyformats", "sd1_lycoris_lora.safetensors")
    base = os.path.join(FX, "keyformats", "sd1_lycoris_original.safetensors")
    out = tmp_path / "c.safetensors"
    rep = lorakit.convert(src, out, format="comfyui", base=base)
    rec = json.loads(header(out)["__metadata__"]["lorakit.algebra"])
    assert rec["inputs"][0]["digest"] == lorakit.digest(src) == rep["inputs"][0]["digest"]
    assert rec["options"]["base"] == base and rep["base"] == base
    # ComfyUI's generic key for the LDM weight input_blocks.1.1.proj_in (model_lora_keys_unet)
    assert "diffusion_model.input_blocks.1.1.proj_in.lora_A.weight" in header(out)
    a, b = tmp_path / "f_in.safetensors", tmp_path / "f_out.safetensors"
    lorakit.fuse(base, [src], a)
    lorakit.fuse(base, [str(out)], b)
    assert lorakit.digest(a) == lorakit.digest(b)


def _tiny_unet(torch, diffusers):
    torch.manual_seed(0)
    return diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(24, 48),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16, attention_head_dim=4, norm_num_groups=8)


def _loaded_deltas(torch, unet, names):
    out = {}
    for n in names:
        lin = unet.get_submodule(n)
        ad = next(iter(lin.lora_A.keys()))
        out[n] = (lin.lora_B[ad].weight.detach().double() @ lin.lora_A[ad].weight.detach().double()).numpy() * \
            lin.scaling[ad]
    return out


def _check(rep, X, Y, what):
    for m in rep["modules"]:
        key = m["name"].removeprefix("unet.")
        err = np.linalg.norm(X[key] - Y[key]) / np.linalg.norm(X[key])
        s = np.linalg.svd(X[key], compute_uv=False)
        opt = np.sqrt(np.sum(s[m["rank"]:] ** 2)) / np.linalg.norm(s)
        assert err == pytest.approx(m["rel_fro"], abs=1e-6), f"{what} {key}: loaded error {err}, reported {m}"
        assert err <= (1 + 1e-6) * max(opt, 1e-6), f"{what} {key}: {err} above the optimum {opt}"


def test_outputs_load_in_diffusers_and_peft(tmp_path):
    torch = pytest.importorskip("torch", reason="needs torch (the /work/venv); CI has none")
    diffusers = pytest.importorskip("diffusers", reason="needs diffusers (the /work/venv); CI has none")
    peft = pytest.importorskip("peft", reason="needs peft (the /work/venv); CI has none")
    from safetensors.torch import save_file
    unet = _tiny_unet(torch, diffusers)
    base = str(tmp_path / "unet.safetensors")
    save_file({k: v.contiguous() for k, v in unet.state_dict().items()}, base)
    shapes = {n: tuple(unet.get_submodule(n).weight.shape) for n in ATTN}
    (a, b, a_kohya), terms = lora_pair(tmp_path, shapes)
    X = exact(terms, {"a": 0.7, "b": -0.4})
    Pipe = diffusers.StableDiffusionPipeline

    # merge to a dynamic-rank kohya file (one alpha per file), loaded the way load_lora_weights loads it
    mk = tmp_path / "m.safetensors"
    rep = lorakit.merge([(a, 0.7), (b, -0.4)], mk, fro=0.97, max_rank=6, format="kohya", dtype="F32")
    assert len({m["rank"] for m in rep["modules"]}) > 1
    sd, alphas = Pipe.lora_state_dict(str(mk))
    u1 = _tiny_unet(torch, diffusers)
    Pipe.load_lora_into_unet(sd, alphas, unet=u1, adapter_name="m")
    Y = _loaded_deltas(torch, u1, ATTN)
    _check(rep, X, Y, "diffusers kohya merge")

    # the same merge in diffusers form (lora_adapter_metadata), and a resize of a to rank 2
    for fmt, call in (("diffusers", lambda o: lorakit.merge([(a, 0.7), (b, -0.4)], o, fro=0.97, max_rank=6,
                                                             format="diffusers", dtype="F32")),
                      ("resize", lambda o: lorakit.resize(a, o, rank=2, format="diffusers", dtype="F32"))):
        o = tmp_path / f"{fmt}.safetensors"
        rep = call(o)
        sd, alphas, meta = Pipe.lora_state_dict(str(o), return_lora_metadata=True)
        assert all(k.startswith("unet.") for k in sd), "diffusers' loaders select the UNet's keys by unet."
        u2 = _tiny_unet(torch, diffusers)
        Pipe.load_lora_into_unet(sd, alphas, unet=u2, adapter_name="x", metadata=meta)
        want = X if fmt == "diffusers" else exact({n: [t for t in ts if t[0] == "a"] for n, ts in terms.items()},
                                                 {"a": 1.0})
        _check(rep, want, _loaded_deltas(torch, u2, ATTN), f"diffusers {fmt}")

    # convert --base: kohya names resolved on the UNet, written as PEFT, loaded by PEFT onto the UNet; the
    # fuse of the output is the fuse of the input, byte for byte
    pd = tmp_path / "peft"
    rep = lorakit.convert(a_kohya, pd, format="peft", base=base)
    assert sorted(json.load(open(pd / "adapter_config.json"))["target_modules"]) == sorted(ATTN)
    u3 = peft.PeftModel.from_pretrained(_tiny_unet(torch, diffusers), str(pd))
    Xa = exact({n: [t for t in ts if t[0] == "a"] for n, ts in terms.items()}, {"a": 1.0})
    Ya = _loaded_deltas(torch, u3.base_model.model, ATTN)
    for n in ATTN:  # convert copies the factors: PEFT's delta is the input's (rounded factors), to f64 rounding
        assert np.allclose(Ya[n], Xa[n], rtol=0, atol=1e-12 * np.abs(Xa[n]).max()), n
    f_in, f_out = tmp_path / "fi.safetensors", tmp_path / "fo.safetensors"
    lorakit.fuse(base, [a_kohya], f_in)
    lorakit.fuse(base, [str(pd)], f_out)
    assert lorakit.digest(f_in) == lorakit.digest(f_out)
    # lorakit's fuse of the merged kohya file is base + the delta diffusers loaded, within F32's rounding
    fm = tmp_path / "fm.safetensors"
    lorakit.fuse(base, [str(mk)], fm)
    got = st_io.read(str(fm))
    for n in ATTN:
        W = unet.get_submodule(n).weight.detach().double().numpy()
        w = got[n + ".weight"][1].astype(np.float64)
        assert np.all(np.abs(w - (W + Y[n])) <= 2 ** -23 * np.abs(W + Y[n]) + 1e-30), n
