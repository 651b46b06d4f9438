#!/usr/bin/env python3
"""QA: lorakit's key-format family tables against diffusers' own LoRA converters.

What it checks, per family that the installed diffusers has both a transformer
class and a converter of non-diffusers LoRA keys for
(diffusers/loaders/lora_conversion_utils.py: _convert_non_diffusers_qwen_lora_to_diffusers,
_convert_kohya_flux_lora_to_diffusers, _convert_non_diffusers_wan_lora_to_diffusers, ...):

 1. a tiny transformer built from the diffusers class, random weights, saved as F32
    safetensors in diffusers' names (the base);
 2. a LoRA in the ORIGINAL / ComfyUI / kohya naming the converter reads, one module per
    diffusers Linear the converter can name (names obtained by inverting the converter's
    mapping, written out below per family), random factors, alpha where the converter reads it;
 3. ORACLE: the converter turns the LoRA into diffusers names (it splits fused qkv / linear1
    factors, folds alpha into the factors, swaps scale/shift halves); W + sum of B @ A per
    converted module, in float64, rounded once to F32. Where diffusers has no LoRA converter but
    a single-file checkpoint converter that maps key by key (AuraFlow; Lumina 2's modules outside
    the blocks), the deltas alpha/r * B @ A in the original names go through that converter, which
    renames / splits / swaps them as it does the weights;
 4. `lorakit fuse base -l lora -o out` (lorakit's convention and `--convention comfyui`):
    every fused weight within 1 ulp of the oracle, every other tensor byte-identical; and
    `lorakit inspect lora --base base --json` places every module.

And the reverse, where diffusers' single-file converter maps an original checkpoint key by key (AuraFlow,
Krea 2, Lumina 2, Qwen Image 2.1's fused gate_up, Z-Image's attention.qkv, Flux 2's img_attn.qkv and final adaLN): an original-named checkpoint made from the diffusers one (checked: the converter gives the
diffusers one back bit for bit), diffusers-named LoRAs (`transformer.<name>`; OneTrainer's
`lora_transformer_<name>` with alpha) fused onto it, lorakit's output turned into diffusers names by that
converter and compared with W + alpha/r * B @ A on the diffusers names in float64.

Not part of CI (CI has no torch / diffusers). Run:
    /work/venv/bin/python tools/qa/keyformats_vs_diffusers.py [--lorakit build/lorakit] [FAMILY...]
Prints one JSON line per (family, format, convention); exit 1 if any line fails, but for the known gaps
(KNOWN_GAPS: such a row says "known_gap"; one that passes fails the run, to be removed from the list).
Families the installed diffusers lacks are printed as {"skipped": reason}.
Where a converter is wrong for a LoRA (HunyuanVideo's token-refiner self_attn_qkv and
final_layer.adaLN_modulation.1: it splits or swaps lora_A's rank rows too), the converter's own
rule for the same kind of weight stands in (img_attn_qkv's; B's rows swapped), said at the place.
Two converters hard-code the full model's hidden size (Flux kohya's linear1 split
[3072, 3072, 3072, 12288], HunyuanVideo's single-block hidden_size = 3072): for the tiny models
those literals are replaced by the tiny sizes before the converter runs (nothing else changes).
"""
import argparse
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import torch
from safetensors.numpy import load_file as np_load
from safetensors.torch import save_file

import diffusers
import diffusers.loaders.lora_conversion_utils as lcu

torch.manual_seed(0)
RANK = 4


# ---------------------------------------------------------------- helpers
def patched(fn, replacements):
    """The converter `fn` re-defined with literal replacements in its source (tiny sizes)."""
    src = textwrap.dedent(inspect.getsource(fn))
    for old, new in replacements.items():
        if old not in src:
            raise RuntimeError(f"{fn.__name__}: literal {old!r} not in its source")
        src = src.replace(old, new)
    ns = dict(vars(lcu))
    exec(compile(src, f"<patched {fn.__name__}>", "exec"), ns)
    return ns[fn.__name__]


def linears(model):
    """diffusers name -> (out, in) of every nn.Linear weight."""
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            out[name] = tuple(mod.weight.shape)
    return out


def base_state(model):
    sd = {}
    g = torch.Generator().manual_seed(1)
    for k, v in model.state_dict().items():
        sd[k] = (torch.randn(v.shape, generator=g, dtype=torch.float64) * 0.05).float().contiguous()
    return sd


def lora_pair(out_dim, in_dim, rank=RANK, g=None):
    a = (torch.randn(rank, in_dim, generator=g) * 0.3).float()
    b = (torch.randn(out_dim, rank, generator=g) * 0.3).float()
    return a, b


class Lora:
    """Writes modules in one naming: prefix + name + down/up suffixes (+ alpha)."""

    def __init__(self, down=".lora_A.weight", up=".lora_B.weight", kohya=False):
        self.sd, self.down, self.up, self.kohya = {}, down, up, kohya
        self.g = torch.Generator().manual_seed(2)
        self.n = 0

    def add(self, name, out_dim, in_dim, alpha=None, rank=RANK):
        a, b = lora_pair(out_dim, in_dim, rank, self.g)
        self.sd[name + self.down] = a
        self.sd[name + self.up] = b
        if alpha is not None:
            self.sd[name + ".alpha"] = torch.tensor(float(alpha))
        self.n += 1


def kohya(name):
    return name.replace(".", "_")


def oracle(base, converted):
    """W + sum B @ A per converted module in float64 (the converter folded alpha / split rows)."""
    mods, exp = {}, {}
    for k, v in converted.items():
        k = k.removeprefix("transformer.")
        m = re.match(r"(.*)\.(lora_A|lora_B)\.weight$", k)
        if isinstance(v, DenseDelta):  # a converted dense delta (single-file converters)
            if k not in base:
                raise RuntimeError(f"oracle: converter output {k} is not a weight of the base")
            exp[k] = exp.get(k, base[k].double().clone()) + v.t
        elif m:
            mods.setdefault(m.group(1), {})[m.group(2)] = v.double()
        elif k.endswith(".alpha"):
            mods.setdefault(k[: -len(".alpha")], {})["alpha"] = float(v)
        else:
            raise RuntimeError(f"oracle: converted key {k} not understood")
    for mod, f in mods.items():
        key = mod + ".weight"
        if key not in base:
            raise RuntimeError(f"oracle: converter output {mod} has no weight in the base (bad inverse name?)")
        a, b = f["lora_A"], f["lora_B"]
        scale = f.get("alpha", a.shape[0]) / a.shape[0]
        if key not in exp:
            exp[key] = base[key].double().clone()
        exp[key] += scale * (b @ a)
    return {k: v.float().numpy() for k, v in exp.items()}


class DenseDelta:
    """A float64 delta that a single-file checkpoint converter moved to its diffusers name."""

    def __init__(self, t):
        self.t = t


def dense_oracle_converter(convert, required=()):
    """LoRA (orig names, lora_A / lora_B / alpha) -> dense deltas in orig names -> diffusers' single-file
    checkpoint converter (it renames, splits and swaps weights, so it moves deltas the same way)."""

    def run(sd):
        deltas = {}
        for k in [k for k in sd if k.endswith(".lora_A.weight")]:
            mod = k[: -len(".lora_A.weight")]
            a, b = sd[k].double(), sd[mod + ".lora_B.weight"].double()
            alpha = float(sd[mod + ".alpha"]) if mod + ".alpha" in sd else a.shape[0]
            name = mod.removeprefix("diffusion_model.")
            name = re.sub(r"^lora_unet_", "", name)
            deltas[name + ".weight"] = (alpha / a.shape[0]) * (b @ a)
        ckpt = dict(deltas)
        for r in required:
            ckpt.setdefault(r, torch.zeros(1, dtype=torch.float32))
        out = convert(ckpt)
        left = [k for k in deltas if k in ckpt]
        if left:
            raise RuntimeError(f"oracle: the converter does not read {left[:4]} (bad inverse name?)")
        # the deltas are the only float64 tensors; the required dummies are float32
        return {k: DenseDelta(v) for k, v in out.items() if v is not None and v.dtype == torch.float64}

    return run


def ulp_diff(a, b):
    ai = a.view(np.int32).astype(np.int64)
    bi = b.view(np.int32).astype(np.int64)
    ai = np.where(ai < 0, -(ai & 0x7FFFFFFF), ai)
    bi = np.where(bi < 0, -(bi & 0x7FFFFFFF), bi)
    return np.abs(ai - bi)


def run_lorakit(lk, tmp, family, fmt, base_path, lora_sd, expected, base_np, n_modules):
    lora_path = os.path.join(tmp, f"{family}_{fmt}_lora.safetensors")
    save_file({k: v.contiguous() for k, v in lora_sd.items()}, lora_path)
    rows = []
    r = subprocess.run([lk, "inspect", lora_path, "--base", base_path, "--json"], capture_output=True, text=True)
    placed, unplaced = None, []
    if r.returncode == 0:
        try:
            js = json.loads(r.stdout)
            placed, unplaced = inspect_counts(js)
        except (ValueError, KeyError) as e:
            unplaced = [f"inspect json not understood: {e}"]
    else:
        unplaced = [r.stderr.strip()[-400:]]
    for conv in (None, "comfyui"):
        out = os.path.join(tmp, f"{family}_{fmt}_{conv or 'lorakit'}_out.safetensors")
        cmd = [lk, "fuse", base_path, "-l", lora_path, "-o", out]
        if conv:
            cmd += ["--convention", conv]
        r = subprocess.run(cmd, capture_output=True, text=True)
        row = {"family": family, "format": fmt, "convention": conv or "lorakit",
               "modules_in_file": n_modules, "placed": placed, "unplaced": unplaced[:5]}
        if r.returncode != 0:  # a failed fuse writes nothing
            row.update(ok=False, error=r.stderr.strip()[-600:], wrote_output_anyway=os.path.exists(out))
            rows.append(row)
            continue
        got = np_load(out)
        worst, bad, untouched_changed = 0, [], []
        for k, w in base_np.items():
            if k in expected:
                d = int(ulp_diff(got[k], expected[k]).max()) if got[k].size else 0
                worst = max(worst, d)
                if d > 1:
                    bad.append(f"{k}: {d} ulp")
            elif got[k].tobytes() != w.tobytes():
                untouched_changed.append(k)
        row.update(fused_weights=len(expected), worst_ulp=worst, over_1ulp=bad[:8],
                   untouched_changed=untouched_changed[:8],
                   ok=(not bad and not untouched_changed and placed == n_modules and not unplaced))
        rows.append(row)
        os.unlink(out)
    return rows


def inspect_counts(js):
    """(placed, [unmatched names]) from `lorakit inspect --json --base`."""
    unmatched = [u.get("module", str(u)) if isinstance(u, dict) else str(u) for u in js["unmatched"]]
    return int(js["modules_placed"]), unmatched


def run_reverse(lk, tmp, family, model, base, to_orig, convert):
    """diffusers-named LoRAs onto the ORIGINAL-named checkpoint: lorakit's output, turned into diffusers names by
    diffusers' own single-file converter, against W + B @ A in float64 on the diffusers names."""
    orig = to_orig(base)
    back = convert(dict(orig))
    if set(back) != set(base) or any(not torch.equal(back[k], base[k]) for k in base):
        raise RuntimeError(f"{family}: the original-named checkpoint does not convert back to the diffusers one")
    orig_path = os.path.join(tmp, f"{family}_original.safetensors")
    save_file(orig, orig_path)
    lin = linears(model)
    rows = []
    for fmt, L, name in (("diffusers_transformer", Lora(), lambda n: "transformer." + n),
                         ("onetrainer_lora_transformer", Lora(".lora_down.weight", ".lora_up.weight"),
                          lambda n: "lora_transformer_" + kohya(n))):
        conv = {}
        for n, (o, i) in lin.items():
            L.add(name(n), o, i, alpha=8 if fmt.startswith("onetrainer") else None)
            a, b = L.sd[name(n) + L.down], L.sd[name(n) + L.up]
            conv["transformer." + n + ".lora_A.weight"], conv["transformer." + n + ".lora_B.weight"] = a, b
            if fmt.startswith("onetrainer"):
                conv["transformer." + n + ".alpha"] = torch.tensor(8.0)
        expected = oracle(base, conv)
        lora_path = os.path.join(tmp, f"{family}_{fmt}_lora.safetensors")
        save_file(L.sd, lora_path)
        r = subprocess.run([lk, "inspect", lora_path, "--base", orig_path, "--json"], capture_output=True, text=True)
        placed, unplaced = inspect_counts(json.loads(r.stdout)) if r.returncode == 0 else (None, [r.stderr[-300:]])
        for cv in (None, "comfyui"):
            out = os.path.join(tmp, f"{family}_{fmt}_out.safetensors")
            cmd = [lk, "fuse", orig_path, "-l", lora_path, "-o", out] + (["--convention", cv] if cv else [])
            p = subprocess.run(cmd, capture_output=True, text=True)
            row = {"family": family, "format": fmt + " -> original checkpoint", "convention": cv or "lorakit",
                   "modules_in_file": L.n, "placed": placed, "unplaced": unplaced[:5]}
            if p.returncode != 0:
                row.update(ok=False, error=p.stderr.strip()[-600:])
                rows.append(row)
                continue
            got = {k: v for k, v in convert(dict(load_torch(out))).items()}
            worst, bad, changed = 0, [], []
            for k, w in base.items():
                g = got[k].numpy()
                if k in expected:
                    d = int(ulp_diff(g, expected[k]).max())
                    worst = max(worst, d)
                    if d > 1:
                        bad.append(f"{k}: {d} ulp")
                elif g.tobytes() != w.numpy().tobytes():
                    changed.append(k)
            row.update(fused_weights=len(expected), worst_ulp=worst, over_1ulp=bad[:8], untouched_changed=changed[:8],
                       ok=not bad and not changed and placed == L.n and not unplaced)
            rows.append(row)
            os.unlink(out)
    return rows


def load_torch(path):
    from safetensors.torch import load_file
    return load_file(path)


# ---------------------------------------------------------------- families
# Each returns (model, [(format name, lora state dict, module count, converter)]).

def fam_qwen():
    m = diffusers.QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                              attention_head_dim=16, num_attention_heads=2,
                                              joint_attention_dim=24, axes_dims_rope=(4, 6, 6))
    lin = linears(m)
    fmts = []
    # diffusion_model. + PEFT factors + alpha (Qwen's names are diffusers')
    L = Lora()
    for n, (o, i) in lin.items():
        L.add("diffusion_model." + n, o, i, alpha=8)
    fmts.append(("diffusion_model_peft_alpha", L.sd, L.n, lcu._convert_non_diffusers_qwen_lora_to_diffusers))
    # kohya lora_unet_ (sd-scripts / musubi Qwen-Image)
    L = Lora(".lora_down.weight", ".lora_up.weight")
    for n, (o, i) in lin.items():
        L.add("lora_unet_" + kohya(n), o, i, alpha=2)
    fmts.append(("kohya_lora_unet", L.sd, L.n, lcu._convert_non_diffusers_qwen_lora_to_diffusers))
    return m, fmts


def fam_qwen21():
    """Qwen Image 2.1: ComfyUI's names (diffusers' but for the fused img_mlp.gate_up = gate_layer, proj by halves);
    oracle: diffusers' convert_qwen_image21_transformer_checkpoint_to_diffusers on the deltas."""
    from diffusers.loaders import single_file_utils as sfu

    m = diffusers.QwenImage21Transformer2DModel(patch_size=1, in_channels=4, out_channels=4, num_layers=2,
                                                attention_head_dim=8, num_attention_heads=2, context_in_dim=12,
                                                mlp_ratio=3, axes_dims_rope=(2, 2, 4))
    lin = linears(m)
    conv = dense_oracle_converter(sfu.convert_qwen_image21_transformer_checkpoint_to_diffusers)
    fmts = []
    for fmt, prefix, L in (("comfy_diffusion_model", "diffusion_model.", Lora()),
                           ("comfy_kohya", "lora_unet_", Lora(".lora_down.weight", ".lora_up.weight"))):
        names = []
        for n, (o, i) in lin.items():
            if n.endswith(".img_mlp.proj"):
                continue
            if n.endswith(".img_mlp.gate_layer"):
                n, o = n.replace("gate_layer", "gate_up"), 2 * o
            names.append(n)
            L.add(prefix + (kohya(n) if prefix == "lora_unet_" else n), o, i, alpha=2)
        fmts.append((fmt, L.sd, L.n, kohya_to_dotted(conv, names) if prefix == "lora_unet_" else conv))
    return m, fmts


def qwen21_original(d):
    """ComfyUI's Qwen Image 2.1 checkpoint from a diffusers one: gate_layer and proj stacked into gate_up."""
    o = {}
    for k, v in d.items():
        if k.endswith("img_mlp.gate_layer.weight"):
            o[k.replace("gate_layer", "gate_up")] = torch.cat([v, d[k.replace("gate_layer", "proj")]], 0)
        elif not k.endswith("img_mlp.proj.weight"):
            o[k] = v
    return o


def fam_hidream():
    m = diffusers.HiDreamImageTransformer2DModel(patch_size=2, in_channels=4, out_channels=4, num_layers=1,
                                                 num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
                                                 caption_channels=[8, 4], text_emb_dim=8, num_routed_experts=2,
                                                 num_activated_experts=1, axes_dims_rope=(4, 4),
                                                 max_resolution=(32, 32), llama_layers=[0, 1])
    L = Lora()
    for n, (o, i) in linears(m).items():
        L.add("diffusion_model." + n, o, i)
    return m, [("diffusion_model_peft", L.sd, L.n, lcu._convert_non_diffusers_hidream_lora_to_diffusers)]


def fam_lumina2():
    # the converter splits qkv's B as [2304, 768, 768]: Lumina 2's real width, 24 q heads, 8 kv heads
    m = diffusers.Lumina2Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, hidden_size=2304,
                                            num_layers=1, num_refiner_layers=1, num_attention_heads=24,
                                            num_kv_heads=8, multiple_of=16, ffn_dim_multiplier=0.02,
                                            axes_dim_rope=(32, 32, 32), axes_lens=(16, 16, 16), cap_feat_dim=16)
    lin = linears(m)
    L = Lora()
    for blk in ("noise_refiner.0", "context_refiner.0", "layers.0"):
        q, k, v = lin[f"{blk}.attn.to_q"], lin[f"{blk}.attn.to_k"], lin[f"{blk}.attn.to_v"]
        L.add(f"diffusion_model.{blk}.attention.qkv", q[0] + k[0] + v[0], q[1])
        L.add(f"diffusion_model.{blk}.attention.out", *lin[f"{blk}.attn.to_out.0"])
        for j in (1, 2, 3):
            L.add(f"diffusion_model.{blk}.feed_forward.w{j}", *lin[f"{blk}.feed_forward.linear_{j}"])
        if not blk.startswith("context_refiner"):
            L.add(f"diffusion_model.{blk}.adaLN_modulation.1", *lin[f"{blk}.norm1.linear"])
    fmts = [("comfy_original_names", L.sd, L.n, lcu._convert_non_diffusers_lumina2_lora_to_diffusers)]
    # the modules outside the blocks, which the LoRA converter does not read, by the single-file converter
    # (convert_lumina2_to_diffusers renames key by key; its final_layer.* -> norm_out.linear_1 / linear_2)
    from diffusers.loaders import single_file_utils as sfu
    T = Lora()
    for orig, d in (("x_embedder", "x_embedder"), ("t_embedder.mlp.0", "time_caption_embed.timestep_embedder.linear_1"),
                    ("t_embedder.mlp.2", "time_caption_embed.timestep_embedder.linear_2"),
                    ("cap_embedder.1", "time_caption_embed.caption_embedder.1"),
                    ("final_layer.adaLN_modulation.1", "norm_out.linear_1"), ("final_layer.linear", "norm_out.linear_2")):
        T.add("diffusion_model." + orig, *lin[d], alpha=2)
    fmts.append(("comfy_original_names_outside_blocks", T.sd, T.n,
                 dense_oracle_converter(sfu.convert_lumina2_to_diffusers)))
    return m, fmts


def fam_flux_kohya():
    H = 16
    m = diffusers.FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                         attention_head_dim=8, num_attention_heads=2, joint_attention_dim=12,
                                         pooled_projection_dim=8, guidance_embeds=True, axes_dims_rope=(2, 2, 4))
    lin = linears(m)
    conv = patched(lcu._convert_kohya_flux_lora_to_diffusers,
                   {"dims=[3072, 3072, 3072, 12288]": f"dims=[{H}, {H}, {H}, {4 * H}]"})
    L = Lora(".lora_down.weight", ".lora_up.weight")
    t, s = "transformer_blocks.0", "single_transformer_blocks.0"
    q = lin[f"{t}.attn.to_q"]
    L.add("lora_unet_double_blocks_0_img_attn_qkv", 3 * q[0], q[1], alpha=1.5, rank=3)
    L.add("lora_unet_double_blocks_0_txt_attn_qkv", 3 * q[0], q[1], alpha=6, rank=6)
    for orig, d in [("img_attn_proj", "attn.to_out.0"), ("img_mlp_0", "ff.net.0.proj"), ("img_mlp_2", "ff.net.2"),
                    ("img_mod_lin", "norm1.linear"), ("txt_attn_proj", "attn.to_add_out"),
                    ("txt_mlp_0", "ff_context.net.0.proj"), ("txt_mlp_2", "ff_context.net.2"),
                    ("txt_mod_lin", "norm1_context.linear")]:
        L.add("lora_unet_double_blocks_0_" + orig, *lin[f"{t}.{d}"], alpha=2)
    L.add("lora_unet_single_blocks_0_linear1", 3 * H + lin[f"{s}.proj_mlp"][0], H, alpha=1, rank=4)
    L.add("lora_unet_single_blocks_0_linear2", *lin[f"{s}.proj_out"], alpha=8)
    L.add("lora_unet_single_blocks_0_modulation_lin", *lin[f"{s}.norm.linear"], alpha=1)
    for orig, d in [("guidance_in_in_layer", "time_text_embed.guidance_embedder.linear_1"),
                    ("guidance_in_out_layer", "time_text_embed.guidance_embedder.linear_2"),
                    ("img_in", "x_embedder"), ("txt_in", "context_embedder"),
                    ("time_in_in_layer", "time_text_embed.timestep_embedder.linear_1"),
                    ("time_in_out_layer", "time_text_embed.timestep_embedder.linear_2"),
                    ("vector_in_in_layer", "time_text_embed.text_embedder.linear_1"),
                    ("vector_in_out_layer", "time_text_embed.text_embedder.linear_2")]:
        L.add("lora_unet_" + orig, *lin[d], alpha=2)
    # final layer: diffusers drops its alpha ("TODO: alphas"), so none is written
    L.add("lora_unet_final_layer_adaLN_modulation_1", *lin["norm_out.linear"])
    L.add("lora_unet_final_layer_linear", *lin["proj_out"])
    return m, [("kohya_sd_scripts", L.sd, L.n, conv)]


def fam_flux2():
    """Flux 2 (flux2 table): BFL names, as the converter reads them. final_layer.adaLN_modulation.1
    is left out: this converter does not swap its halves while diffusers' single-file Flux 2 converter swaps the
    weight's (one of the two is wrong; not an oracle)."""
    m = diffusers.Flux2Transformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                          attention_head_dim=8, num_attention_heads=2, joint_attention_dim=12,
                                          timestep_guidance_channels=16, mlp_ratio=3.0, axes_dims_rope=(2, 2, 2, 2))
    lin = linears(m)
    t = "transformer_blocks.0"
    q = lin[f"{t}.attn.to_q"]
    L = Lora()
    L.add("diffusion_model.double_blocks.0.img_attn.qkv", 3 * q[0], q[1])
    L.add("diffusion_model.double_blocks.0.txt_attn.qkv", 3 * q[0], q[1])
    for orig, d in [("double_blocks.0.img_attn.proj", f"{t}.attn.to_out.0"),
                    ("double_blocks.0.txt_attn.proj", f"{t}.attn.to_add_out"),
                    ("double_blocks.0.img_mlp.0", f"{t}.ff.linear_in"), ("double_blocks.0.img_mlp.2", f"{t}.ff.linear_out"),
                    ("double_blocks.0.txt_mlp.0", f"{t}.ff_context.linear_in"),
                    ("double_blocks.0.txt_mlp.2", f"{t}.ff_context.linear_out"),
                    ("single_blocks.0.linear1", "single_transformer_blocks.0.attn.to_qkv_mlp_proj"),
                    ("single_blocks.0.linear2", "single_transformer_blocks.0.attn.to_out"),
                    ("img_in", "x_embedder"), ("txt_in", "context_embedder"),
                    ("time_in.in_layer", "time_guidance_embed.timestep_embedder.linear_1"),
                    ("time_in.out_layer", "time_guidance_embed.timestep_embedder.linear_2"),
                    ("guidance_in.in_layer", "time_guidance_embed.guidance_embedder.linear_1"),
                    ("guidance_in.out_layer", "time_guidance_embed.guidance_embedder.linear_2"),
                    ("final_layer.linear", "proj_out"),
                    ("single_stream_modulation.lin", "single_stream_modulation.linear"),
                    ("double_stream_modulation_img.lin", "double_stream_modulation_img.linear"),
                    ("double_stream_modulation_txt.lin", "double_stream_modulation_txt.linear")]:
        L.add("diffusion_model." + orig, *lin[d])
    return m, [("bfl_names", L.sd, L.n, lcu._convert_non_diffusers_flux2_lora_to_diffusers)]


def fam_wan():
    m = diffusers.WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8,
                                        in_channels=4, out_channels=4, text_dim=12, freq_dim=16, ffn_dim=32,
                                        num_layers=2, image_dim=12, added_kv_proj_dim=16)
    lin = linears(m)
    blocks = [(f"self_attn.{o}", f"attn1.{c}") for o, c in zip("qkvo", ["to_q", "to_k", "to_v", "to_out.0"])]
    blocks += [(f"cross_attn.{o}", f"attn2.{c}") for o, c in zip("qkvo", ["to_q", "to_k", "to_v", "to_out.0"])]
    blocks += [("cross_attn.k_img", "attn2.add_k_proj"), ("cross_attn.v_img", "attn2.add_v_proj"),
               ("ffn.0", "ffn.net.0.proj"), ("ffn.2", "ffn.net.2")]
    top = [("time_projection.1", "condition_embedder.time_proj"), ("head.head", "proj_out"),
           ("text_embedding.0", "condition_embedder.text_embedder.linear_1"),
           ("text_embedding.2", "condition_embedder.text_embedder.linear_2"),
           ("time_embedding.0", "condition_embedder.time_embedder.linear_1"),
           ("time_embedding.2", "condition_embedder.time_embedder.linear_2"),
           ("img_emb.proj.1", "condition_embedder.image_embedder.ff.net.0.proj"),
           ("img_emb.proj.3", "condition_embedder.image_embedder.ff.net.2")]
    fmts = []
    L = Lora()
    for i in range(2):
        for o, d in blocks:
            L.add(f"diffusion_model.blocks.{i}.{o}", *lin[f"blocks.{i}.{d}"], alpha=8)
    for o, d in top:  # the converter reads no alpha outside the blocks
        L.add(f"diffusion_model.{o}", *lin[d])
    fmts.append(("original_peft_alpha", L.sd, L.n, lcu._convert_non_diffusers_wan_lora_to_diffusers))
    L = Lora(".lora_down.weight", ".lora_up.weight")
    for i in range(2):
        for o, d in blocks:
            L.add(f"lora_unet_blocks_{i}_{kohya(o)}", *lin[f"blocks.{i}.{d}"], alpha=2)
    fmts.append(("musubi_lora_unet", L.sd, L.n, lcu._convert_musubi_wan_lora_to_diffusers))
    return m, fmts


def fam_hunyuan_video():
    H = 16
    m = diffusers.HunyuanVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2,
                                                 attention_head_dim=8, num_layers=1, num_single_layers=1,
                                                 num_refiner_layers=1, mlp_ratio=4.0, patch_size=1,
                                                 patch_size_t=1, guidance_embeds=True, text_embed_dim=12,
                                                 pooled_projection_dim=8, rope_axes_dim=(2, 2, 4))
    lin = linears(m)
    conv = patched(lcu._convert_hunyuan_video_lora_to_diffusers, {"hidden_size = 3072": f"hidden_size = {H}"})
    t, s, r = "transformer_blocks.0", "single_transformer_blocks.0", "context_embedder.token_refiner.refiner_blocks.0"
    q = lin[f"{t}.attn.to_q"]
    mods = [("double_blocks.0.img_attn_qkv", (3 * q[0], q[1])), ("double_blocks.0.txt_attn_qkv", (3 * q[0], q[1])),
            ("single_blocks.0.linear1", (3 * H + lin[f"{s}.proj_mlp"][0], H)),
            ("txt_in.individual_token_refiner.blocks.0.self_attn_qkv",
             (3 * lin[f"{r}.attn.to_q"][0], lin[f"{r}.attn.to_q"][1]))]
    # embedders: the converter's mlp.0 / mlp.2 (in_layer / out_layer) -> linear_1 / linear_2
    plain = [(f"{o}.{a}", f"{d}.linear_{j}")
             for o, d, parts in (("time_in", "time_text_embed.timestep_embedder", ("mlp.0", "mlp.2")),
                                 ("guidance_in", "time_text_embed.guidance_embedder", ("mlp.0", "mlp.2")),
                                 ("vector_in", "time_text_embed.text_embedder", ("in_layer", "out_layer")),
                                 ("txt_in.t_embedder", "context_embedder.time_text_embed.timestep_embedder",
                                  ("mlp.0", "mlp.2")),
                                 ("txt_in.c_embedder", "context_embedder.time_text_embed.text_embedder",
                                  ("linear_1", "linear_2")))
             for j, a in enumerate(parts, 1)]
    plain += [("txt_in.input_embedder", "context_embedder.proj_in"),
             ("txt_in.individual_token_refiner.blocks.0.self_attn_proj", f"{r}.attn.to_out.0"),
             ("txt_in.individual_token_refiner.blocks.0.mlp.fc1", f"{r}.ff.net.0.proj"),
             ("txt_in.individual_token_refiner.blocks.0.mlp.fc2", f"{r}.ff.net.2"),
             ("txt_in.individual_token_refiner.blocks.0.adaLN_modulation.1", f"{r}.norm_out.linear"),
             ("double_blocks.0.img_mod.linear", f"{t}.norm1.linear"),
             ("double_blocks.0.img_attn_proj", f"{t}.attn.to_out.0"),
             ("double_blocks.0.img_mlp.fc1", f"{t}.ff.net.0.proj"), ("double_blocks.0.img_mlp.fc2", f"{t}.ff.net.2"),
             ("double_blocks.0.txt_mod.linear", f"{t}.norm1_context.linear"),
             ("double_blocks.0.txt_attn_proj", f"{t}.attn.to_add_out"),
             ("double_blocks.0.txt_mlp.fc1", f"{t}.ff_context.net.0.proj"),
             ("double_blocks.0.txt_mlp.fc2", f"{t}.ff_context.net.2"),
             ("single_blocks.0.linear2", f"{s}.proj_out"), ("single_blocks.0.modulation.linear", f"{s}.norm.linear"),
             ("final_layer.linear", "proj_out")]
    # final_layer.adaLN_modulation.1 is left out: the converter swaps the halves of lora_A's rank rows
    # as well as lora_B's output rows, which is not the swapped product (reported, not an oracle).
    L = Lora()
    for n, shp in mods:
        L.add("diffusion_model." + n, *shp)
    for n, d in plain:
        L.add("diffusion_model." + n, *lin[d])

    def conv_refiner_qkv_as_img_qkv(sd):
        # The converter chunks the token refiner's self_attn_qkv lora_A by 3 as well as lora_B (rank rows of A
        # split: a shape error or a wrong product); it is converted here by the converter's own img_attn_qkv rule
        # (A shared, B by thirds), the rest by the converter.
        out = {}
        for k in [k for k in sd if ".self_attn_qkv." in k]:
            w = sd.pop(k)
            d = k.removeprefix("diffusion_model.").replace("txt_in.individual_token_refiner.blocks",
                                                           "context_embedder.token_refiner.refiner_blocks")
            for part, piece in zip(("to_q", "to_k", "to_v"), w.chunk(3, 0) if ".lora_B." in k else (w, w, w)):
                out["transformer." + d.replace("self_attn_qkv", "attn." + part)] = piece
        out.update(conv(sd))
        return out

    # final_layer.adaLN_modulation.1 alone, against the converter's rule done right: the converter swaps the
    # (shift, scale) halves of lora_B's rows (correct: diffusers' norm_out.linear is (scale, shift)) but also of
    # lora_A's rank rows (a different product); here only B's rows are swapped, as diffusers' single-file
    # conversion swaps the weight's rows (swap_scale_shift).
    F = Lora()
    F.add("diffusion_model.final_layer.adaLN_modulation.1", *lin["norm_out.linear"], alpha=2)

    def conv_final_b_rows_swapped(sd):
        a = sd["diffusion_model.final_layer.adaLN_modulation.1.lora_A.weight"]
        b = sd["diffusion_model.final_layer.adaLN_modulation.1.lora_B.weight"]
        alpha = sd["diffusion_model.final_layer.adaLN_modulation.1.alpha"]
        return {"transformer.norm_out.linear.lora_A.weight": a,
                "transformer.norm_out.linear.lora_B.weight": lcu.swap_scale_shift(b),
                "transformer.norm_out.linear.alpha": alpha}

    return m, [("original_names", L.sd, L.n, conv_refiner_qkv_as_img_qkv),
               ("final_layer_adaLN_B_rows_swapped", F.sd, F.n, conv_final_b_rows_swapped)]


def fam_ltx2():
    m = diffusers.LTX2VideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2,
                                              attention_head_dim=8, cross_attention_dim=16, audio_in_channels=4,
                                              audio_out_channels=4, audio_num_attention_heads=2,
                                              audio_attention_head_dim=8, audio_cross_attention_dim=16,
                                              num_layers=1, caption_channels=12)
    inv = [("audio_proj_in", "audio_patchify_proj"), ("proj_in", "patchify_proj"),
           ("av_cross_attn_video_scale_shift", "av_ca_video_scale_shift_adaln_single"),
           ("av_cross_attn_video_a2v_gate", "av_ca_a2v_gate_adaln_single"),
           ("av_cross_attn_audio_scale_shift", "av_ca_audio_scale_shift_adaln_single"),
           ("av_cross_attn_audio_v2a_gate", "av_ca_v2a_gate_adaln_single"),
           ("audio_prompt_adaln", "audio_prompt_adaln_single"), ("prompt_adaln", "prompt_adaln_single")]
    L = Lora()
    for n, (o, i) in linears(m).items():
        orig = n
        if orig.startswith("time_embed."):
            orig = "adaln_single." + orig[len("time_embed."):]
        elif orig.startswith("audio_time_embed."):
            orig = "audio_adaln_single." + orig[len("audio_time_embed."):]
        else:
            for d, o_ in inv:
                if orig.startswith(d + ".") or orig == d:
                    orig = o_ + orig[len(d):]
                    break
        L.add("diffusion_model." + orig, o, i)
    return m, [("original_names", L.sd, L.n, lcu._convert_non_diffusers_ltx2_lora_to_diffusers)]


def fam_z_image():
    m = diffusers.ZImageTransformer2DModel(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32,
                                           n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2,
                                           cap_feat_dim=16, axes_dims=[4, 6, 6], axes_lens=[64, 32, 32])
    lin = linears(m)
    fmts = []
    L = Lora(".lora_down.weight", ".lora_up.weight")
    for n, (o, i) in lin.items():
        L.add("lora_unet_" + kohya(n), o, i, alpha=2)
    fmts.append(("kohya_diffusers_names", L.sd, L.n, lcu._convert_non_diffusers_z_image_lora_to_diffusers))
    # kohya on the original module tree, dotted factor names: attention.qkv (fused) and attention.out
    L = Lora(".lora.down.weight", ".lora.up.weight")
    for n, (o, i) in lin.items():
        mq = re.match(r"(.*\.attention)\.to_q$", n)
        if mq:
            L.add("lora_unet_" + kohya(mq.group(1)) + "_qkv", 3 * o, i, alpha=2)
        elif re.search(r"\.attention\.to_[kv]$", n):
            continue
        elif n.endswith(".attention.to_out.0"):
            L.add("lora_unet_" + kohya(n[: -len(".to_out.0")]) + "_out", o, i, alpha=8)
        else:
            L.add("lora_unet_" + kohya(n), o, i)
    fmts.append(("kohya_original_qkv_dotted", L.sd, L.n, lcu._convert_non_diffusers_z_image_lora_to_diffusers))
    # the same modules with kohya's own factor names (lora_down / lora_up): diffusers splits attention.qkv only
    # on the dotted spelling, so the oracle is the converter on this file with the factors renamed to it
    U = {k.replace(".lora.down.weight", ".lora_down.weight").replace(".lora.up.weight", ".lora_up.weight"): v
         for k, v in L.sd.items()}

    def as_dotted(sd):
        return lcu._convert_non_diffusers_z_image_lora_to_diffusers(
            {k.replace(".lora_down.weight", ".lora.down.weight").replace(".lora_up.weight", ".lora.up.weight"): v
             for k, v in sd.items()})

    fmts.append(("kohya_original_qkv", U, L.n, as_dotted))
    return m, fmts


def fam_auraflow():
    from diffusers.loaders import single_file_utils as sfu

    m = diffusers.AuraFlowTransformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_mmdit_layers=1,
                                             num_single_dit_layers=1, attention_head_dim=8, num_attention_heads=2,
                                             joint_attention_dim=12, caption_projection_dim=16, out_channels=4,
                                             pos_embed_max_size=16)
    lin = linears(m)
    inv = auraflow_inverse()
    conv = dense_oracle_converter(sfu.convert_auraflow_transformer_checkpoint_to_diffusers,
                                  required=("positional_encoding", "init_x_linear.bias"))
    fmts = []
    for fmt, prefix, L in (("comfy_diffusion_model", "diffusion_model.", Lora()),
                           ("comfy_kohya", "lora_unet_", Lora(".lora_down.weight", ".lora_up.weight"))):
        for d, (o, i) in lin.items():
            if d not in inv:
                raise RuntimeError(f"auraflow: no original name for {d}")
            name = prefix + (kohya(inv[d]) if prefix == "lora_unet_" else inv[d])
            L.add(name, o, i, alpha=8)
        if prefix == "lora_unet_":  # the dense oracle reads dotted names
            fmts.append((fmt, L.sd, L.n, kohya_to_dotted(conv, inv.values())))
        else:
            fmts.append((fmt, L.sd, L.n, conv))
    return m, fmts


def auraflow_inverse():
    """diffusers name -> original name of AuraFlow's Linears (one block each), by inverting
    convert_auraflow_transformer_checkpoint_to_diffusers."""
    inv = {"time_step_proj.linear_1": "t_embedder.mlp.0", "time_step_proj.linear_2": "t_embedder.mlp.2",
           "context_embedder": "cond_seq_linear", "proj_out": "final_linear", "norm_out.linear": "modF.1",
           "pos_embed.proj": "init_x_linear"}
    for i in range(1):
        for o, d in (("mlpX", "ff"), ("mlpC", "ff_context")):
            for k, v in (("c_fc1", "linear_1"), ("c_fc2", "linear_2"), ("c_proj", "out_projection")):
                inv[f"joint_transformer_blocks.{i}.{d}.{v}"] = f"double_layers.{i}.{o}.{k}"
        inv[f"joint_transformer_blocks.{i}.norm1.linear"] = f"double_layers.{i}.modX.1"
        inv[f"joint_transformer_blocks.{i}.norm1_context.linear"] = f"double_layers.{i}.modC.1"
        for k, v in {"w2q": "to_q", "w2k": "to_k", "w2v": "to_v", "w2o": "to_out.0", "w1q": "add_q_proj",
                     "w1k": "add_k_proj", "w1v": "add_v_proj", "w1o": "to_add_out"}.items():
            inv[f"joint_transformer_blocks.{i}.attn.{v}"] = f"double_layers.{i}.attn.{k}"
        for k, v in (("c_fc1", "linear_1"), ("c_fc2", "linear_2"), ("c_proj", "out_projection")):
            inv[f"single_transformer_blocks.{i}.ff.{v}"] = f"single_layers.{i}.mlp.{k}"
        inv[f"single_transformer_blocks.{i}.norm1.linear"] = f"single_layers.{i}.modCX.1"
        for k, v in {"w1q": "to_q", "w1k": "to_k", "w1v": "to_v", "w1o": "to_out.0"}.items():
            inv[f"single_transformer_blocks.{i}.attn.{v}"] = f"single_layers.{i}.attn.{k}"
    return inv


def auraflow_original(d):
    """An original-named AuraFlow checkpoint from a diffusers state dict (the inverse of diffusers'
    single-file converter; main() checks that the converter gives d back, bit for bit)."""
    inv = auraflow_inverse()
    other = {"register_tokens": "register_tokens", "pos_embed.pos_embed": "positional_encoding",
             "pos_embed.proj.bias": "init_x_linear.bias", "time_step_proj.linear_1.bias": "t_embedder.mlp.0.bias",
             "time_step_proj.linear_2.bias": "t_embedder.mlp.2.bias"}
    o = {}
    for k, v in d.items():
        if k in other:
            o[other[k]] = v
        else:
            w = inv[k[: -len(".weight")]] + ".weight"
            o[w] = lcu.swap_scale_shift(v).contiguous() if k == "norm_out.linear.weight" else v
    return o


def kohya_to_dotted(conv, names):
    """The converter run on the same factors under the dotted original names (the kohya names' source)."""
    back = {"lora_unet_" + kohya(n): n for n in names}

    def run(sd):
        out = {}
        for k, v in sd.items():
            mod, suf = k.split(".", 1)
            suf = {"lora_down.weight": "lora_A.weight", "lora_up.weight": "lora_B.weight"}.get(suf, suf)
            out[back[mod] + "." + suf] = v
        return conv(out)

    return run


def fam_krea2():
    m = diffusers.Krea2Transformer2DModel(in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=32, timestep_embed_dim=16,
                                          text_hidden_dim=12, num_text_layers=2, text_num_attention_heads=2,
                                          text_num_key_value_heads=2, text_intermediate_size=16,
                                          num_layerwise_text_blocks=1, num_refiner_text_blocks=1,
                                          axes_dims_rope=(2, 2, 4))
    attn = {"to_q": "wq", "to_k": "wk", "to_v": "wv", "to_out.0": "wo", "to_gate": "gate"}
    ff = {"ff.gate": "mlp.gate", "ff.up": "mlp.up", "ff.down": "mlp.down"}
    top = {"img_in": "first", "final_layer.linear": "last.linear", "time_embed.linear_1": "tmlp.0",
           "time_embed.linear_2": "tmlp.2", "time_mod_proj": "tproj.1", "txt_in.linear_1": "txtmlp.1",
           "txt_in.linear_2": "txtmlp.3", "text_fusion.projector": "txtfusion.projector"}

    def orig(n):
        if n in top:
            return top[n]
        mm = re.match(r"(transformer_blocks|text_fusion\.(?:layerwise|refiner)_blocks)\.(\d+)\.(.*)$", n)
        if not mm:
            return None
        blk = "blocks" if mm.group(1) == "transformer_blocks" else "txtfusion." + mm.group(1).split(".", 1)[1]
        rest = mm.group(3)
        if rest.startswith("attn.") and rest[5:] in attn:
            return f"{blk}.{mm.group(2)}.attn.{attn[rest[5:]]}"
        if rest in ff:
            return f"{blk}.{mm.group(2)}.{ff[rest]}"
        return None

    fmts = []
    for prefix in ("diffusion_model.", "base_model.model."):
        L = Lora()
        for n, (o, i) in linears(m).items():
            on = orig(n)
            if on is None:  # a Linear the converter has no name for (none in diffusers 0.42)
                continue
            L.add(prefix + on, o, i)
        fmts.append((prefix.rstrip(".") + "_original_names", L.sd, L.n,
                     lcu._convert_non_diffusers_krea2_lora_to_diffusers))
    return m, fmts


def fam_ace_step():
    m = diffusers.AceStepTransformer1DModel(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                            in_channels=16, audio_acoustic_hidden_dim=8, patch_size=2,
                                            sliding_window=4)
    ren = {".to_q": ".q_proj", ".to_k": ".k_proj", ".to_v": ".v_proj", ".to_out.0": ".o_proj"}
    L = Lora()
    for n, (o, i) in linears(m).items():
        orig = n
        for d, on in ren.items():
            if orig.endswith(d):
                orig = orig[: -len(d)] + on
        L.add("base_model.model." + orig, o, i)  # PEFT files: alpha in adapter_config.json, none here
    return m, [("acestep15_peft_base_model", L.sd, L.n, lcu._convert_non_diffusers_ace_step_lora_to_diffusers)]


# (family, format): why lorakit fails it today. Such a row prints "known_gap" and does not fail the run; a
# known gap that passes fails the run (remove it here).
KNOWN_GAPS = {
}

SFU = "diffusers.loaders.single_file_utils"
LCU = "diffusers.loaders.lora_conversion_utils"
# family: (diffusers class, (module, converter) the oracle uses, builder)
FAMILIES = {
    "qwen-image": ("QwenImageTransformer2DModel", (LCU, "_convert_non_diffusers_qwen_lora_to_diffusers"), fam_qwen),
    "qwen-image21": ("QwenImage21Transformer2DModel",
                     (SFU, "convert_qwen_image21_transformer_checkpoint_to_diffusers"), fam_qwen21),
    "hidream": ("HiDreamImageTransformer2DModel", (LCU, "_convert_non_diffusers_hidream_lora_to_diffusers"),
                fam_hidream),
    "lumina2": ("Lumina2Transformer2DModel", (LCU, "_convert_non_diffusers_lumina2_lora_to_diffusers"), fam_lumina2),
    "flux": ("FluxTransformer2DModel", (LCU, "_convert_kohya_flux_lora_to_diffusers"), fam_flux_kohya),
    "flux2": ("Flux2Transformer2DModel", (LCU, "_convert_non_diffusers_flux2_lora_to_diffusers"), fam_flux2),
    "wan": ("WanTransformer3DModel", (LCU, "_convert_non_diffusers_wan_lora_to_diffusers"), fam_wan),
    "hunyuan-video": ("HunyuanVideoTransformer3DModel", (LCU, "_convert_hunyuan_video_lora_to_diffusers"),
                      fam_hunyuan_video),
    "ltx2": ("LTX2VideoTransformer3DModel", (LCU, "_convert_non_diffusers_ltx2_lora_to_diffusers"), fam_ltx2),
    "z-image": ("ZImageTransformer2DModel", (LCU, "_convert_non_diffusers_z_image_lora_to_diffusers"), fam_z_image),
    "auraflow": ("AuraFlowTransformer2DModel", (SFU, "convert_auraflow_transformer_checkpoint_to_diffusers"),
                 fam_auraflow),
    "krea2": ("Krea2Transformer2DModel", (LCU, "_convert_non_diffusers_krea2_lora_to_diffusers"), fam_krea2),
    "ace-step15": ("AceStepTransformer1DModel", (LCU, "_convert_non_diffusers_ace_step_lora_to_diffusers"),
                   fam_ace_step),
}


def krea2_original(d):
    """An original-named Krea 2 checkpoint from a diffusers state dict (the inverse of diffusers'
    convert_krea2_transformer_checkpoint_to_diffusers; run_reverse checks that it gives d back)."""
    prefix = [("img_in.", "first."), ("time_embed.linear_1.", "tmlp.0."), ("time_embed.linear_2.", "tmlp.2."),
              ("time_mod_proj.", "tproj.1."), ("txt_in.norm.weight", "txtmlp.0.scale"), ("txt_in.linear_1.", "txtmlp.1."),
              ("txt_in.linear_2.", "txtmlp.3."), ("text_fusion.", "txtfusion."), ("transformer_blocks.", "blocks."),
              ("final_layer.linear.", "last.linear."), ("final_layer.norm.weight", "last.norm.scale"),
              ("final_layer.scale_shift_table", "last.modulation.lin")]
    block = [(".attn.to_q.", ".attn.wq."), (".attn.to_k.", ".attn.wk."), (".attn.to_v.", ".attn.wv."),
             (".attn.to_out.0.", ".attn.wo."), (".attn.to_gate.", ".attn.gate."),
             (".attn.norm_q.weight", ".attn.qknorm.qnorm.scale"), (".attn.norm_k.weight", ".attn.qknorm.knorm.scale"),
             (".ff.", ".mlp."), (".norm1.weight", ".prenorm.scale"), (".norm2.weight", ".postnorm.scale"),
             (".scale_shift_table", ".mod.lin")]
    o = {}
    for k, v in d.items():
        n = k
        for a, b in block:
            n = n.replace(a, b)
        for a, b in prefix:
            if n.startswith(a):
                n = b + n[len(a):]
                break
        if k.startswith("transformer_blocks.") and k.endswith(".scale_shift_table"):
            v = v.reshape(-1).contiguous()
        o[n] = v
    return o


def stack_qkv(d, k, attn, o):
    """Whether k is <blk>.<attn>.to_q / to_k / to_v.weight of d; at to_q, o gets <blk>.attention.qkv.weight, the
    three stacked by rows (the original fused weight these converters split)."""
    m = re.match(r"(.*)\." + attn + r"\.to_([qkv])\.weight$", k)
    if m and m.group(2) == "q":
        o[m.group(1) + ".attention.qkv.weight"] = torch.cat([d[f"{m.group(1)}.{attn}.to_{c}.weight"] for c in "qkv"], 0)
    return m is not None


def lumina2_original(d):
    """An original-named Lumina 2 checkpoint from a diffusers state dict (the inverse of diffusers'
    convert_lumina2_to_diffusers: to_q, to_k, to_v stacked into attention.qkv; run_reverse checks it)."""
    ren = [("time_caption_embed.caption_embedder", "cap_embedder"),
           ("time_caption_embed.timestep_embedder.linear_1", "t_embedder.mlp.0"),
           ("time_caption_embed.timestep_embedder.linear_2", "t_embedder.mlp.2"),
           ("norm_out.linear_1", "final_layer.adaLN_modulation.1"), ("norm_out.linear_2", "final_layer.linear"),
           (".attn.to_out.0.", ".attention.out."), (".attn.norm_k.", ".attention.k_norm."),
           (".attn.norm_q.", ".attention.q_norm."), (".feed_forward.linear_1.", ".feed_forward.w1."),
           (".feed_forward.linear_2.", ".feed_forward.w2."), (".feed_forward.linear_3.", ".feed_forward.w3."),
           (".norm1.linear.", ".adaLN_modulation.1."), (".norm1.norm.", ".attention_norm1."),
           (".norm2.", ".attention_norm2.")]
    o = {}
    for k, v in d.items():
        if stack_qkv(d, k, "attn", o):
            continue
        n = k
        if re.match(r"context_refiner\.\d+\.norm[12]\.", n):
            n = re.sub(r"\.norm([12])\.", r".attention_norm\1.", n)
        for a, b in ren:
            n = n.replace(a, b)
        o[n] = v
    return o


def z_image_original(d):
    """ComfyUI's / the original Z-Image checkpoint from a diffusers one (the inverse of diffusers'
    convert_z_image_transformer_checkpoint_to_diffusers: to_q, to_k, to_v stacked into attention.qkv)."""
    ren = [("all_final_layer.2-1.", "final_layer."), ("all_x_embedder.2-1.", "x_embedder."),
           (".attention.to_out.0.", ".attention.out."), (".attention.norm_k.", ".attention.k_norm."),
           (".attention.norm_q.", ".attention.q_norm.")]
    o = {}
    for k, v in d.items():
        if stack_qkv(d, k, "attention", o):
            continue
        for a, b in ren:
            k = k.replace(a, b)
        o[k] = v
    return o


def flux2_original(d):
    """A BFL-named Flux 2 checkpoint from a diffusers state dict (the inverse of diffusers'
    convert_flux2_transformer_checkpoint_to_diffusers: q, k, v stacked into img_attn.qkv / txt_attn.qkv, norm_out's
    halves swapped back, the q/k norms' .weight = .scale; run_reverse checks that it gives d back)."""
    top = {"x_embedder": "img_in", "context_embedder": "txt_in", "proj_out": "final_layer.linear",
           "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
           "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
           "time_guidance_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
           "time_guidance_embed.guidance_embedder.linear_2": "guidance_in.out_layer"}
    blk = {"attn.norm_q": "img_attn.norm.query_norm", "attn.norm_k": "img_attn.norm.key_norm",
           "attn.to_out.0": "img_attn.proj", "ff.linear_in": "img_mlp.0", "ff.linear_out": "img_mlp.2",
           "attn.norm_added_q": "txt_attn.norm.query_norm", "attn.norm_added_k": "txt_attn.norm.key_norm",
           "attn.to_add_out": "txt_attn.proj", "ff_context.linear_in": "txt_mlp.0", "ff_context.linear_out": "txt_mlp.2"}
    single = {"attn.to_qkv_mlp_proj": "linear1", "attn.to_out": "linear2", "attn.norm_q": "norm.query_norm",
              "attn.norm_k": "norm.key_norm"}
    o = {}
    for k, v in d.items():
        mod, pt = k.rsplit(".", 1)
        mb = re.match(r"transformer_blocks\.(\d+)\.(.*)", mod)
        ms = re.match(r"single_transformer_blocks\.(\d+)\.(.*)", mod)
        if mb and mb.group(2) in ("attn.to_q", "attn.add_q_proj"):
            n, txt = mb.group(1), mb.group(2) == "attn.add_q_proj"
            parts = [f"add_{c}_proj" if txt else f"to_{c}" for c in "qkv"]
            o[f"double_blocks.{n}.{'txt' if txt else 'img'}_attn.qkv.{pt}"] = torch.cat(
                [d[f"transformer_blocks.{n}.attn.{c}.{pt}"] for c in parts], 0)
        elif mb and re.fullmatch(r"attn\.(to_[kv]|add_[kv]_proj)", mb.group(2)):
            pass  # stacked at to_q / add_q_proj
        elif mb or ms:
            n, r = (mb or ms).groups()
            name = f"double_blocks.{n}.{blk[r]}" if mb else f"single_blocks.{n}.{single[r]}"
            o[f"{name}.{'scale' if 'norm' in r else pt}"] = v
        elif mod == "norm_out.linear":
            o[f"final_layer.adaLN_modulation.1.{pt}"] = torch.cat(v.chunk(2, 0)[::-1], 0)
        else:
            o[f"{top.get(mod, mod.replace('.linear', '.lin'))}.{pt}"] = v
    return o


# family: (diffusers name -> original-named checkpoint, diffusers' single-file converter): the reverse check
REVERSE = {
    "auraflow": (auraflow_original, "convert_auraflow_transformer_checkpoint_to_diffusers"),
    "krea2": (krea2_original, "convert_krea2_transformer_checkpoint_to_diffusers"),
    "lumina2": (lumina2_original, "convert_lumina2_to_diffusers"),
    "z-image": (z_image_original, "convert_z_image_transformer_checkpoint_to_diffusers"),
    "qwen-image21": (qwen21_original, "convert_qwen_image21_transformer_checkpoint_to_diffusers"),
    "flux2": (flux2_original, "convert_flux2_transformer_checkpoint_to_diffusers"),
}


def has_converter(mod, name):
    try:
        return hasattr(__import__(mod, fromlist=[name]), name)
    except ImportError:
        return False


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lorakit", default=os.path.join(os.path.dirname(__file__), "..", "..", "build", "lorakit"))
    ap.add_argument("families", nargs="*")
    args = ap.parse_args()
    lk = os.path.abspath(args.lorakit)
    failed = False
    for fam, (cls, conv, build) in FAMILIES.items():
        if args.families and fam not in args.families:
            continue
        if not hasattr(diffusers, cls) or not has_converter(*conv):
            print(json.dumps({"family": fam, "skipped": f"diffusers {diffusers.__version__} lacks {cls} or "
                                                        f"{conv[0]}.{conv[1]}"}))
            continue
        with tempfile.TemporaryDirectory(prefix=f"qa-{fam}-") as tmp:
            try:
                model, fmts = build()
            except Exception as e:  # a tiny config this diffusers version rejects
                print(json.dumps({"family": fam, "ok": False, "error": f"building the tiny model: {e!r}"}))
                failed = True
                continue
            base = base_state(model)
            base_path = os.path.join(tmp, f"{fam}_base.safetensors")
            save_file(base, base_path)
            base_np = np_load(base_path)
            if fam in REVERSE:
                to_orig, conv_name = REVERSE[fam]
                sfu_conv = getattr(__import__(SFU, fromlist=[conv_name]), conv_name)
                for row in run_reverse(lk, tmp, fam, model, base, to_orig, sfu_conv):
                    failed |= not row["ok"]
                    print(json.dumps(row), flush=True)
            for fmt, lora, n, converter in fmts:
                converted = converter({k: v.clone() for k, v in lora.items()})
                expected = oracle(base, converted)
                gap = KNOWN_GAPS.get((fam, fmt))
                for row in run_lorakit(lk, tmp, fam, fmt, base_path, lora, expected, base_np, n):
                    if gap and not row["ok"]:
                        row["known_gap"] = gap
                    elif gap:
                        row["known_gap_now_passes"] = gap
                    failed |= (not row["ok"]) != bool(gap)
                    print(json.dumps(row), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
