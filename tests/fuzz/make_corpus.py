#!/usr/bin/env python3
"""Makes the committed seed corpora in tests/fuzz/corpus/ (run once by hand;
CI never runs it: the outputs are committed).

Seeds are real-shaped: safetensors images come from the reference writer
(`pip install numpy safetensors`, the Rust implementation Hugging Face ships),
adapter key layouts follow what PEFT, diffusers, kohya sd-scripts and
FastVideo save, adapter_config.json follows PEFT's LoraConfig.to_dict(), and
the YAML and swap-plan seeds follow the fastvideo LoRA block and the plan in
DESIGN.md. They are small on purpose (libFuzzer mutates small inputs faster);
the shapes match the toy model the adapter target resolves against
(tests/fuzz/fuzz_adapter.c: hidden 16, rank 4).

    python3 tests/fuzz/make_corpus.py
"""
import json
import os
import struct

import numpy as np
from safetensors.numpy import save

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "corpus")
rng = np.random.default_rng(7)


def put(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def arr(shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def bf16(shape):
    """bf16 has no numpy dtype: the reference writer is fed through a raw
    header instead (same layout rules: sorted by dtype alignment, then name)."""
    return (arr(shape).view(np.uint32) >> 16).astype(np.uint16)


def raw_st(tensors, metadata=None):
    """A safetensors image written by hand for dtypes numpy lacks (BF16,
    F8): header JSON, padded with spaces to 8 bytes, as the Rust writer does."""
    header, blobs, off = {}, [], 0
    if metadata:
        header["__metadata__"] = metadata
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + b"".join(blobs)


# ---- safetensors reader --------------------------------------------------
put("safetensors", "f32_small", save({"w": arr((4, 4))}))
put("safetensors", "mixed_dtypes", save({
    "a.weight": arr((8, 4), np.float16), "b.bias": arr((8,)), "c.idx": np.arange(6, dtype=np.int64),
    "d.mask": np.array([True, False, True]), "e.u8": np.arange(5, dtype=np.uint8),
    "f.f64": arr((2, 3), np.float64), "g.i32": np.arange(4, dtype=np.int32)},
    metadata={"format": "pt", "note": "mixed"}))
put("safetensors", "scalar_and_empty", save({"s": np.array(3.5, np.float32), "e": np.zeros((0, 4), np.float32),
                                             "z": np.zeros((2, 0, 3), np.float16)}))
put("safetensors", "empty_file", save({}))
put("safetensors", "metadata_only", save({}, metadata={"ss_network_dim": "4", "ss_network_alpha": "2"}))
put("safetensors", "bf16_raw", raw_st([("x.weight", "BF16", (2, 3), bf16((2, 3)).tobytes()),
                                       ("y", "F8_E4M3", (4,), bytes([0x38, 0x40, 0xB8, 0x7F]))],
                                      {"format": "pt"}))
put("safetensors", "high_rank", save({"t": arr((1, 2, 1, 2, 1, 2, 1, 2))}))
put("safetensors", "unicode_names", save({"blöcks.0.ätt": arr((2,)), "\u65e5\u672c": arr((1,))}))
# JSON as other writers may emit it (the header scanner's paths): whitespace,
# escaped names and __metadata__ key, unknown nested fields, offsets out of order
_forms = (' {\n "b\\u00e9" : { "x" : {"n": [1, 2.5, null, {"k": "\\n"}]}, "dtype" : "U8" , "shape" : [ 2 ] ,'
          ' "data_offsets" : [ 4 , 6 ] } ,\r\n\t"\\u005f_metadata__":{"q\\"":"v\\\\"},'
          '"\\ud83d\\ude00a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]} }  ').encode()
put("safetensors", "json_forms", struct.pack("<Q", len(_forms)) + _forms + bytes(range(10, 16)))

# ---- adapters (format detection + key resolution) -------------------------
R, H = 4, 16
peft = {f"base_model.model.blocks.{b}.attn.{p}.lora_{ab}.weight": arr((R, H) if ab == "A" else (H, R))
        for b in range(2) for p in ("to_q", "to_v") for ab in "AB"}
put("adapter", "peft", save(peft, metadata={"format": "pt"}))
put("adapter", "peft_default", save({
    "base_model.model.blocks.0.attn.to_k.lora_A.default.weight": arr((R, H)),
    "base_model.model.blocks.0.attn.to_k.lora_B.default.weight": arr((H, R))}))
diff = {}
for p in ("to_q", "to_k"):
    diff[f"transformer.blocks.1.attn.{p}.lora_A.weight"] = arr((R, H), np.float16)
    diff[f"transformer.blocks.1.attn.{p}.lora_B.weight"] = arr((H, R), np.float16)
    diff[f"transformer.blocks.1.attn.{p}.alpha"] = np.array(8.0, np.float32)
put("adapter", "diffusers", save(diff))
put("adapter", "diffusers_noprefix", save({
    "blocks.0.ff.net.0.proj.lora_A.weight": arr((R, H)),
    "blocks.0.ff.net.0.proj.lora_B.weight": arr((2 * H, R))}))
put("adapter", "comfy", save({
    "diffusion_model.blocks.0.attn.to_out.0.lora_A.weight": arr((R, H)),
    "diffusion_model.blocks.0.attn.to_out.0.lora_B.weight": arr((H, R))}))
put("adapter", "kohya", save({
    "lora_unet_blocks_0_attn_to_q.lora_down.weight": arr((R, H)),
    "lora_unet_blocks_0_attn_to_q.lora_up.weight": arr((H, R)),
    "lora_unet_blocks_0_attn_to_q.alpha": np.array(2.0, np.float32),
    "lora_unet_blocks_1_ff_net_2.lora_down.weight": arr((R, 2 * H)),
    "lora_unet_blocks_1_ff_net_2.lora_up.weight": arr((H, R))},
    metadata={"ss_network_dim": "4", "ss_network_alpha": "2"}))
put("adapter", "fastvideo", save({
    "blocks.1.attn.to_v.lora_A": arr((R, H)), "blocks.1.attn.to_v.lora_B": arr((H, R))}))
put("adapter", "bf16_peft", raw_st([
    ("base_model.model.blocks.0.attn.to_q.lora_A.weight", "BF16", (R, H), bf16((R, H)).tobytes()),
    ("base_model.model.blocks.0.attn.to_q.lora_B.weight", "BF16", (H, R), bf16((H, R)).tobytes())]))
put("adapter", "unmatched", save({
    "transformer.blocks.9.attn.to_q.lora_A.weight": arr((R, H)),
    "transformer.blocks.9.attn.to_q.lora_B.weight": arr((H, R))}))
put("adapter", "shape_mismatch", save({
    "transformer.blocks.0.attn.to_q.lora_A.weight": arr((R, H + 1)),
    "transformer.blocks.0.attn.to_q.lora_B.weight": arr((H, R))}))

# LyCORIS (kohya / "lycoris_" names, as lycoris-lora writes them) and dense
# deltas (ComfyUI / FastVideo names), on the toy model's 16 x 16 to_q
lq = "lycoris_blocks_0_attn_to_q"
put("adapter", "loha_tucker", save({
    f"{lq}.hada_t1": arr((R, R, 1, 1)), f"{lq}.hada_w1_a": arr((R, H)), f"{lq}.hada_w1_b": arr((R, H)),
    f"{lq}.hada_t2": arr((R, R, 1, 1)), f"{lq}.hada_w2_a": arr((R, H)), f"{lq}.hada_w2_b": arr((R, H))}))
# (plain LoHa, LoKr and full-LoKr keys are in mixed_lycoris: few seeds keep the
# allocation-failure replay of tests/test_fuzz_regress.c short)
put("adapter", "lokr_tucker", save({
    f"{lq}.lokr_w1_a": arr((4, 2)), f"{lq}.lokr_w1_b": arr((2, 4)), f"{lq}.lokr_t2": arr((2, 2, 1, 1)),
    f"{lq}.lokr_w2_a": arr((2, 4)), f"{lq}.lokr_w2_b": arr((2, 4))}))
put("adapter", "locon_tucker", save({
    "lora_unet_blocks_0_attn_to_q.lora_down.weight": arr((R, H, 1, 1)),
    "lora_unet_blocks_0_attn_to_q.lora_mid.weight": arr((R, R, 1, 1)),
    "lora_unet_blocks_0_attn_to_q.lora_up.weight": arr((H, R, 1, 1)),
    "lora_unet_blocks_0_attn_to_q.alpha": np.array(1.0, np.float32)}))
put("adapter", "dora_scale", save({
    "lora_unet_blocks_0_attn_to_q.lora_down.weight": arr((R, H)),
    "lora_unet_blocks_0_attn_to_q.lora_up.weight": arr((H, R)),
    "lora_unet_blocks_0_attn_to_q.dora_scale": arr((1, H))}))
put("adapter", "full_diff", save({
    "diffusion_model.blocks.0.attn.to_q.diff": arr((H, H)), "diffusion_model.blocks.0.attn.to_q.diff_b": arr((H,)),
    "diffusion_model.blocks.0.norm.w_norm": arr((H,)),
    "diffusion_model.blocks.1.attn.to_k.set_weight": arr((H, H))}))
put("adapter", "mixed_lycoris", save({
    f"{lq}.lokr_w1": arr((4, 4)), f"{lq}.lokr_w2": arr((4, 4)),
    "lycoris_blocks_0_attn_to_k.hada_w1_a": arr((H, R)), "lycoris_blocks_0_attn_to_k.hada_w1_b": arr((R, H)),
    "lycoris_blocks_0_attn_to_k.hada_w2_a": arr((H, R)), "lycoris_blocks_0_attn_to_k.hada_w2_b": arr((R, H)),
    "lycoris_blocks_0_attn_to_k.dora_scale": arr((H, 1)),
    "lycoris_blocks_0_attn_to_v.lora_down.weight": arr((R, H)), "lycoris_blocks_0_attn_to_v.lora_up.weight": arr((H, R))}))
# OFT (LyCORIS diag-oft: 4 blocks of 4 rotate the 16 rows), fused since issue 29 (BOFT and GLoRA at the end)
put("adapter", "oft", save({f"{lq}.oft_blocks": arr((4, 4, 4)), f"{lq}.alpha": np.array(1.0, np.float32)}))

# ---- adapter_config.json (PEFT LoraConfig.to_dict()) -----------------------
cfg = {
    "alpha_pattern": {}, "auto_mapping": None, "base_model_name_or_path": "toy/model", "bias": "none",
    "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
    "layer_replication": None, "layers_pattern": None, "layers_to_transform": None,
    "loftq_config": {}, "lora_alpha": 8, "lora_dropout": 0.0, "megatron_config": None,
    "megatron_core": "megatron.core", "modules_to_save": None, "peft_type": "LORA", "r": 4,
    "rank_pattern": {}, "revision": None, "target_modules": ["to_q", "to_v"], "task_type": None,
    "use_dora": False, "use_rslora": False}
put("adapter_config", "peft_basic.json", json.dumps(cfg, indent=2))
put("adapter_config", "peft_rslora.json", json.dumps(dict(cfg, use_rslora=True, lora_alpha=16), indent=2))
put("adapter_config", "peft_patterns.json", json.dumps(dict(
    cfg, rank_pattern={"blocks.0.attn.to_q": 2, "to_v": 4},
    alpha_pattern={"blocks.1.attn.to_q": 3.5, "^blocks\\.0": 1}), indent=2))
put("adapter_config", "peft_float_alpha.json", json.dumps(dict(cfg, lora_alpha=4.5, r=4)))
put("adapter_config", "minimal.json", '{"r": 4, "lora_alpha": 4}')
put("adapter_config", "target_regex.json", json.dumps(dict(cfg, target_modules=".*attn\\.to_[qv]")))
# PEFT 0.21 fields and Python-re patterns (PCRE2): \d, (?:...), {m,n}, {,n}, lookahead
put("adapter_config", "peft021_python_re.json", json.dumps(dict(
    cfg, peft_version="0.21.2", rank_pattern={"blocks\\.\\d\\.attn\\.to_q": 4},
    alpha_pattern={"(?=blocks\\.1)blocks\\.\\d{1,2}\\.attn\\.to_v{,1}": 2},
    target_modules="blocks\\.[0-9]{1,2}\\.attn\\.(?:to_q|to_v)", exclude_modules=["ff"],
    modules_to_save=["norm"], bias="lora_only", lora_bias=False, use_dora=False), indent=2))
put("adapter_config", "peft014_layers.json", json.dumps(dict(
    cfg, peft_version="0.14.0", layers_to_transform=[0, 1], layers_pattern="blocks",
    rank_pattern={"to_q|to_v": 4})))
# keys that are runs of one-character atoms (matched by lookup, config.c): escaped dots, \d \w \S,
# sets with ranges / '^' / a leading ']' / '-', keys differing only in a set (chained)
put("adapter_config", "peft_atom_keys.json", json.dumps(dict(
    cfg, peft_version="0.17.0", rank_pattern={"blocks\\.\\d\\.attn\\.to_\\d": 2, "blocks\\.\\d\\.attn\\.to_[^q]": 4},
    alpha_pattern={"blocks\\.[]0]\\.attn\\.to_[a-z]": 2, "[^.]\\.attn\\.to\\_\\w": 3, "blocks.1.attn.to_[-v]": 5,
                   "attn\\Wto_\\S": 6}, modules_to_save=["blocks\\.[2-9]"])))
put("adapter_config", "re_backtrack.txt", "re:(a+)+$")
put("adapter_config", "re_python.txt", "re:blocks\\.\\d{,2}\\.(?:attn|mlp)\\.to_[qv]\\Z")

# ---- YAML LoRA config (models.<role>.lora) --------------------------------
put("yaml", "basic.yaml", """models:
  transformer:
    lora:
      enable: true                       # default false
      rank: 16
      alpha: 32                          # defaults to rank when omitted
      target_modules: [to_q, to_k, to_v, to_out]
""")
put("yaml", "disabled_rank.yaml", "models:\n  student:\n    lora:\n      enable: false\n      rank: 8\n")
put("yaml", "block_targets.yaml", """models:
  transformer:
    lora:
      enable: true
      rank: 4
      target_modules:
        - q_proj
        - k_proj
        - to_gate_compress
  vae:
    lora: {enable: false}
training:
  seed: 42
""")
put("yaml", "unknown_key.yaml", "models:\n  transformer:\n    lora:\n      enable: true\n      rank: 4\n      dropout: 0.1\n")
put("yaml", "anchors.yaml", """defaults: &d {enable: true, rank: 8, alpha: 8}
models:
  a: {lora: *d}
  b:
    lora:
      <<: *d
      rank: 2
""")
# a repeated key: the front-end refuses it naming both lines
put("yaml", "duplicate_role.yaml", "models:\n  student:\n    lora: {enable: true, rank: 4}\n  student:\n    lora: {enable: false}\n")

# ---- swap plan -------------------------------------------------------------
put("plan", "duplicate_loras.yaml", "bucket_mb: 4\nsteps:\n  - loras: [{path: a/, strength: 1.0}]\n    loras: []\n")
put("plan", "design.yaml", """bucket_mb: 64          # optional
no_lora_swap: false    # optional
steps:
  - loras: [{path: a/, strength: 1.0}, {path: b.safetensors, strength: 0.5}]
  - loras: []          # reset
""")
put("plan", "block_style.yaml", """bucket_mb: 1
steps:
  - loras:
      - path: adapters/style.safetensors
        strength: 0.8
  - loras:
      - {path: adapters/style.safetensors, strength: 0.8}
      - {path: adapters/detail, strength: -0.25}
  - loras: [{path: adapters/detail, strength: 0}]
""")
put("plan", "no_swap.yaml", "no_lora_swap: true\nsteps:\n  - loras: [{path: x.safetensors, strength: 1}]\n")
# the name tables (issue 19): arch and maps, map paths relative to the plan
put("plan", "tables.yaml", "arch: flux\nmaps: [mine.lkmap, /abs/other.lkmap]\nsteps:\n  - loras: [{path: a}]\n")
# strengths are doubles read whole: 0.7 exactly, 1e39 fine, 1e-400 (reads as 0) refused, subnormals kept
put("plan", "strengths.yaml", "steps:\n  - loras: [{path: a, strength: 0.7}, {path: b, strength: 1e39}]\n"
    "  - loras: [{path: a, strength: 1e-320}]\n  - loras: [{path: a, strength: -1e-400}]\n")
# one strength parser with the CLI: hex floats and quoted numbers read; bools, YAML .inf refused
put("plan", "strength_text.yaml", "steps:\n  - loras: [{path: a, strength: 0x1p-3}, {path: b, strength: \"0.7\"}]\n"
    "  - loras: [{path: a, strength: true}]\n  - loras: [{path: a, strength: -.inf}]\n")
# alpha rules (issue 20): .alpha vs lora_adapter_metadata disagreeing; ss_network_alpha not a number
put("adapter", "alpha_vs_metadata", save({
    "transformer.blocks.0.attn.to_q.lora_A.weight": arr((R, H)),
    "transformer.blocks.0.attn.to_q.lora_B.weight": arr((H, R)),
    "transformer.blocks.0.attn.to_q.alpha": np.array(8.0, np.float32)},
    metadata={"lora_adapter_metadata": json.dumps({"r": R, "lora_alpha": 16})}))
put("adapter", "kohya_bad_ss", save({
    "lora_unet_blocks_0_attn_to_q.lora_down.weight": arr((R, H)),
    "lora_unet_blocks_0_attn_to_q.lora_up.weight": arr((H, R))},
    metadata={"ss_network_dim": "4", "ss_network_alpha": "nan"}))
# lora_adapter_metadata with one component's config nested (read as the packed form)
put("adapter", "meta_nested", save({
    "transformer.blocks.0.attn.to_q.lora_A.weight": arr((R, H)),
    "transformer.blocks.0.attn.to_q.lora_B.weight": arr((H, R))},
    metadata={"lora_adapter_metadata": json.dumps({"transformer": {"r": R, "lora_alpha": 2}, "note": 1})}))

# ---- .lorakit-output (src/io/out_dir.c: may a sharded output replace a folder?) ----
# fuzz_out_record.c's folder holds a.safetensors: "ok" lists it (as lorakit
# writes the record: JSON, indent 1), the others must be refused
put("out_record", "ok.json", '{\n "lorakit_output": 1,\n "files": [\n  "a.safetensors",\n'
    '  "model.safetensors.index.json"\n ]\n}')
put("out_record", "unlisted.json", '{"lorakit_output": 1, "files": ["b.safetensors"]}')
put("out_record", "not_string.json", '{"lorakit_output": 1, "files": ["a.safetensors", 3]}')
put("out_record", "bad_version.json", '{"lorakit_output": "1", "files": ["a.safetensors"]}')
put("out_record", "odd_names.json", '{"lorakit_output": 1, "files": ["../a.safetensors", "a.safetensors", "a.safetensors"]}')
put("out_record", "array.json", "[]")
# a pipeline output's record (tree mode) also lists its folders
put("out_record", "tree.json", '{"lorakit_output": 1, "files": ["a.safetensors", "unet/x.safetensors"], "folders": ["unet"]}')
put("out_record", "tree_bad_folders.json", '{"lorakit_output": 1, "files": ["a.safetensors"], "folders": "unet"}')
# ---- diffusers' old attention-processor LoRA format (appended last, so the rng draws of the seeds above are unchanged) ----
put("adapter", "old_attn_processor", save({
    "unet.blocks.0.attn.processor.to_q_lora.down.weight": arr((R, H)),
    "unet.blocks.0.attn.processor.to_q_lora.up.weight": arr((H, R)),
    "unet.blocks.1.attn.processor.to_out_lora.down.weight": arr((R, H)),
    "unet.blocks.1.attn.processor.to_out_lora.up.weight": arr((H, R))}))
print("corpus written to", CORPUS)

# BOFT (2 butterfly stages of 4 blocks of 4, a rescale) and GLoRA (rank 4) in
# LyCORIS's names; last, so that every seed above keeps its random values
put("adapter", "boft_glora", save({
    "lycoris_blocks_0_attn_to_k.oft_blocks": arr((2, 4, 4, 4)), "lycoris_blocks_0_attn_to_k.rescale": arr((H, 1)),
    "lycoris_blocks_0_attn_to_k.alpha": np.array(0.5, np.float32),
    "lycoris_blocks_0_attn_to_v.a1.weight": arr((H, R)), "lycoris_blocks_0_attn_to_v.a2.weight": arr((R, H)),
    "lycoris_blocks_0_attn_to_v.b1.weight": arr((H, R)), "lycoris_blocks_0_attn_to_v.b2.weight": arr((R, H)),
    "lycoris_blocks_0_attn_to_v.alpha": np.array(2.0, np.float32)}))

# PEFT's OFT (oft_R.weight: 4 blocks of 4 columns, 6 packed values each; one shared block on to_k), last
put("adapter", "peft_oft", save({
    "base_model.model.blocks.0.attn.to_q.oft_R.weight": arr((4, 6)),
    "base_model.model.blocks.0.attn.to_k.oft_R.weight": arr((1, 6)),
    "base_model.model.blocks.0.ff.net.2.oft_R.weight": arr((8, 6))}))

# PEFT's BOFT (boft_R: one stage of 4 blocks of 4 columns, boft_s per row; 2 blocks of 8 with boft_s [1, out]), last
put("adapter", "peft_boft", save({
    "base_model.model.blocks.0.attn.to_q.boft_R": arr((1, 4, 4, 4)),
    "base_model.model.blocks.0.attn.to_q.boft_s": arr((H, 1)),
    "base_model.model.blocks.0.attn.to_v.boft_R": arr((1, 2, 8, 8)),
    "base_model.model.blocks.0.attn.to_v.boft_s": arr((1, H))}))
