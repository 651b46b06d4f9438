#!/usr/bin/env python3
"""make_family_tables.py — writes data/families/*.lkmap, lorakit's model-family
name tables (format: README "Model families and layouts"), from the published
mappings between the original single-file names and diffusers' names:

- SD 1.x/2.x and SDXL UNets: the LDM <-> diffusers block arithmetic of
  diffusers' convert_ldm_unet_checkpoint (loaders/single_file_utils.py) and
  ComfyUI's comfy/utils.py unet_to_diffusers: input_blocks.i (i >= 1) is
  down block (i-1)//(L+1), layer (i-1)%(L+1) (layer L: the downsampler);
  output_blocks.i is up block i//(L+1), layer i%(L+1); middle_block.0/1/2;
  resnet internals in_layers.2 = conv1, emb_layers.1 = time_emb_proj, ...
- Flux: diffusers' convert_flux_transformer_checkpoint_to_diffusers (BFL ->
  diffusers): double_blocks.N.img_attn.qkv = to_q, to_k, to_v by thirds,
  single_blocks.N.linear1 = to_q, to_k, to_v, proj_mlp (H, H, H, 4H rows),
  final_layer.adaLN_modulation.1 = norm_out.linear with shift/scale swapped.
- SD3, Wan 2.x, HunyuanVideo, LTX-Video / LTX-2: the section "DiT / video
  families" below (diffusers' convert_sd3_/wan_/hunyuan_video_/ltx_/ltx2_
  single-file converters), checked on tiny models by
  tests/fixtures/families/make_family_fixtures.py.

Pure Python, no dependencies: run it and commit the tables it writes.
"""
import os
from fractions import Fraction

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "data", "families")

RESNET = [("in_layers.0", "norm1"), ("in_layers.2", "conv1"), ("emb_layers.1", "time_emb_proj"),
          ("out_layers.0", "norm2"), ("out_layers.3", "conv2"), ("skip_connection", "conv_shortcut")]


def unet_rules(down_attn, up_attn, layers=2):
    """down_attn[b]: down block b has attentions; up_attn[b] likewise (up blocks in diffusers order)."""
    r = [("input_blocks.0.0", "conv_in"), ("time_embed.0", "time_embedding.linear_1"),
         ("time_embed.2", "time_embedding.linear_2"), ("out.0", "conv_norm_out"), ("out.2", "conv_out"),
         ("label_emb.0.0", "add_embedding.linear_1"), ("label_emb.0.2", "add_embedding.linear_2")]
    nb = len(down_attn)

    def resnet(orig, diff):
        for o, d in RESNET:
            r.append((f"{orig}.{o}", f"{diff}.{d}"))

    i = 1
    for b in range(nb):
        for l in range(layers):
            resnet(f"input_blocks.{i}.0", f"down_blocks.{b}.resnets.{l}")
            if down_attn[b]:
                r.append((f"input_blocks.{i}.1.*", f"down_blocks.{b}.attentions.{l}.*"))
            i += 1
        if b != nb - 1:
            r.append((f"input_blocks.{i}.0.op", f"down_blocks.{b}.downsamplers.0.conv"))
            i += 1
    resnet("middle_block.0", "mid_block.resnets.0")
    r.append(("middle_block.1.*", "mid_block.attentions.0.*"))
    resnet("middle_block.2", "mid_block.resnets.1")
    i = 0
    for b in range(nb):
        for l in range(layers + 1):
            resnet(f"output_blocks.{i}.0", f"up_blocks.{b}.resnets.{l}")
            k = 1
            if up_attn[b]:
                r.append((f"output_blocks.{i}.1.*", f"up_blocks.{b}.attentions.{l}.*"))
                k = 2
            if l == layers and b != nb - 1:
                r.append((f"output_blocks.{i}.{k}.conv", f"up_blocks.{b}.upsamplers.0.conv"))
            i += 1
    return [(o, d, None) for o, d in r]


def flux_rules():
    r = [("img_in", "x_embedder"), ("txt_in", "context_embedder"),
         ("time_in.in_layer", "time_text_embed.timestep_embedder.linear_1"),
         ("time_in.out_layer", "time_text_embed.timestep_embedder.linear_2"),
         ("vector_in.in_layer", "time_text_embed.text_embedder.linear_1"),
         ("vector_in.out_layer", "time_text_embed.text_embedder.linear_2"),
         ("guidance_in.in_layer", "time_text_embed.guidance_embedder.linear_1"),
         ("guidance_in.out_layer", "time_text_embed.guidance_embedder.linear_2"),
         ("final_layer.linear", "proj_out")]
    r = [(o, d, None) for o, d in r]
    # AdaLayerNormContinuous: BFL (shift, scale), diffusers (scale, shift)
    r.append(("final_layer.adaLN_modulation.1", "norm_out.linear", ("0/2:1/2", "1/2:2/2")))
    r.append(("final_layer.adaLN_modulation.1", "norm_out.linear", ("1/2:2/2", "0/2:1/2")))
    d = "double_blocks.#"
    t = "transformer_blocks.#"
    for side, q, proj, mlp, mod in (("img", "attn.to_", "attn.to_out.0", "ff", "norm1"),
                                    ("txt", "attn.add_", "attn.to_add_out", "ff_context", "norm1_context")):
        for k, c in enumerate("qkv"):
            name = f"{t}.attn.to_{c}" if side == "img" else f"{t}.attn.add_{c}_proj"
            r.append((f"{d}.{side}_attn.qkv", name, (f"{k}/3:{k + 1}/3", "0/1:1/1")))
        r.append((f"{d}.{side}_attn.proj", f"{t}.{proj}", None))
        r.append((f"{d}.{side}_mlp.0", f"{t}.{mlp}.net.0.proj", None))
        r.append((f"{d}.{side}_mlp.2", f"{t}.{mlp}.net.2", None))
        r.append((f"{d}.{side}_mod.lin", f"{t}.{mod}.linear", None))
    s = "single_blocks.#"
    st = "single_transformer_blocks.#"
    for k, c in enumerate(("attn.to_q", "attn.to_k", "attn.to_v")):
        r.append((f"{s}.linear1", f"{st}.{c}", (f"{k}/7:{k + 1}/7", "0/1:1/1")))
    r.append((f"{s}.linear1", f"{st}.proj_mlp", ("3/7:7/7", "0/1:1/1")))
    r.append((f"{s}.linear2", f"{st}.proj_out", None))
    r.append((f"{s}.modulation.lin", f"{st}.norm.linear", None))
    return r + aliases(r, flux_spellings())


def flux_spellings():
    """ComfyUI's names for parts of BFL weights (comfy/lora.py model_lora_keys_unet, Flux):
    single_blocks.N.linear1_qkv = rows [0, 3H) of linear1 (of 3H + 4H: q, k, v without the MLP); USO's
    LoRA names (comfy/lora_convert.py convert_uso_lora, ".processor." dropped): qkv_lora1 / proj_lora1 the
    image stream's img_attn.qkv / img_attn.proj, qkv_lora2 / proj_lora2 the text stream's, a single block's
    qkv_lora = linear1_qkv, proj_lora = linear2."""
    d, s = "double_blocks.#", "single_blocks.#"
    out = [(f"{s}.linear1", f"{s}.linear1_qkv", "0/7:3/7"),
           (f"{s}.linear1", f"{s}.processor.qkv_lora", "0/7:3/7"),
           (f"{s}.linear2", f"{s}.processor.proj_lora", None)]
    for k, side in (("1", "img"), ("2", "txt")):
        out += [(f"{d}.{side}_attn.qkv", f"{d}.processor.qkv_lora{k}", None),
                (f"{d}.{side}_attn.proj", f"{d}.processor.proj_lora{k}", None)]
    return out


def openclip_rules():
    """OpenCLIP text transformer (SD 2.x cond_stage_model.model., SDXL
    conditioner.embedders.1.model.) <-> transformers' CLIPTextModel names:
    diffusers' convert_open_clip_checkpoint (textenc_transformer_conversion_lst),
    in_proj_weight split into q, k, v by thirds."""
    r = []
    o, h = "transformer.resblocks.#", "text_model.encoder.layers.#"
    for k, c in enumerate("qkv"):
        r.append((f"{o}.attn.in_proj", f"{h}.self_attn.{c}_proj", (f"{k}/3:{k + 1}/3", "0/1:1/1")))
    for a, b in (("attn.out_proj", "self_attn.out_proj"), ("mlp.c_fc", "mlp.fc1"), ("mlp.c_proj", "mlp.fc2"),
                 ("ln_1", "layer_norm1"), ("ln_2", "layer_norm2")):
        r.append((f"{o}.{a}", f"{h}.{b}", None))
    r.append(("token_embedding", "text_model.embeddings.token_embedding", None))
    r.append(("ln_final", "text_model.final_layer_norm", None))
    return r


def _fr(s):
    a, b = s.split(":")
    return tuple(Fraction(*map(int, x.split("/"))) for x in (a, b))


def _fs(lo, hi):
    return f"{lo.numerator}/{lo.denominator}:{hi.numerator}/{hi.denominator}"


def aliases(rules, spellings):
    """'alias' lines: other spellings of original names (ComfyUI's, a trainer's), each (ORIG, NAME, ROWS): NAME
    is rows ROWS ("a/b:c/d", None: all) of the original weight ORIG. Each gives the line ORIG <-> NAME, and,
    composed with the map rules on ORIG (ORIG rows [a, b) = DIFF rows [c, d)), a line NAME <-> DIFF on the rows
    the two share (exact fractions), so the spelling lands on original- and diffusers-named checkpoints alike."""
    out = []
    for orig, name, rows in spellings:
        p, q = _fr(rows) if rows else (Fraction(0), Fraction(1))
        out.append(("alias", orig, name, (rows, "0/1:1/1") if rows else None))
        for o, d, rr in rules:
            if o != orig:
                continue
            a, b = _fr(rr[0]) if rr else (Fraction(0), Fraction(1))
            c, e = _fr(rr[1]) if rr else (Fraction(0), Fraction(1))
            lo, hi = max(a, p), min(b, q)
            if lo >= hi:
                continue
            n_rows = _fs((lo - p) / (q - p), (hi - p) / (q - p))
            d_rows = _fs(c + (lo - a) / (b - a) * (e - c), c + (hi - a) / (b - a) * (e - c))
            if not rows:  # the whole weight: the map line's own fractions (one spelling of each)
                n_rows, d_rows = rr if rr else ("0/1:1/1", "0/1:1/1")
            whole = n_rows == "0/1:1/1" and d_rows == "0/1:1/1"
            out.append(("alias", name, d, None if whole else (n_rows, d_rows)))
    return out


def write(name, title, detect, rules):
    lines = [f"# {title}", "# Written by scripts/make_family_tables.py from the published mapping; do not edit.",
             "lorakit-family 1", f"family {name}"]
    lines += [f"detect {k}" for k in detect]
    for r in rules:
        kw, (o, d, rows) = (r[0], r[1:]) if len(r) == 4 else ("map", r)
        lines.append(f"{kw} {o} {d}" + (f" {rows[0]} {rows[1]}" if rows else ""))
    with open(os.path.join(OUT, name + ".lkmap"), "w") as f:
        f.write("\n".join(lines) + "\n")


# ------------------------------------------------------------------------
# DiT / video families (SD3, Wan 2.x, HunyuanVideo, LTX-Video / LTX-2).
# Facts from diffusers 0.42's single-file converters (loaders/single_file_utils.py):
# convert_sd3_transformer_checkpoint_to_diffusers, convert_wan_transformer_to_diffusers,
# convert_hunyuan_video_transformer_to_diffusers, convert_ltx_transformer_checkpoint_to_diffusers,
# convert_ltx2_transformer_to_diffusers. tests/fixtures/families/make_family_fixtures.py checks
# each against a tiny model: the original file it writes goes back to the diffusers one exactly.

def renames(pairs, orig="", diff=""):
    """Plain renames: (ORIG, DIFF) pairs, each under the given name prefixes."""
    return [(orig + o, diff + d, None) for o, d in pairs]


def qkv_rules(orig, diffs, parts=3):
    """orig (a fused projection) = diffs[0], diffs[1], ... by equal row parts of `parts`."""
    return [(orig, d, (f"{k}/{parts}:{k + 1}/{parts}", "0/1:1/1")) for k, d in enumerate(diffs)]


def joint_qkv_rules(img, txt, blk):
    """A joint block's fused qkv of the image and the text stream = blk's attn.to_q, to_k, to_v and
    attn.add_q_proj, add_k_proj, add_v_proj, each by thirds."""
    return (qkv_rules(img, [f"{blk}.attn.to_{c}" for c in "qkv"])
            + qkv_rules(txt, [f"{blk}.attn.add_{c}_proj" for c in "qkv"]))


def swapped_halves(orig, diff):
    """An AdaLayerNormContinuous: original (shift, scale), diffusers (scale, shift)."""
    return [(orig, diff, ("0/2:1/2", "1/2:2/2")), (orig, diff, ("1/2:2/2", "0/2:1/2"))]


def sd3_rules():
    """SD3 / SD3.5 MMDiT: joint_blocks.N.{x,context}_block.attn.qkv = q, k, v by thirds.
    joint_blocks.N.context_block.adaLN_modulation.1 = transformer_blocks.N.norm1_context.linear, but in
    the last block (context_pre_only: AdaLayerNormContinuous) with its two halves swapped
    (swap_scale_shift): '#last' rules, which replace the '#' rule for the checkpoint's last block."""
    r = renames((
        ("x_embedder.proj", "pos_embed.proj"),
        ("t_embedder.mlp.0", "time_text_embed.timestep_embedder.linear_1"),
        ("t_embedder.mlp.2", "time_text_embed.timestep_embedder.linear_2"),
        ("y_embedder.mlp.0", "time_text_embed.text_embedder.linear_1"),
        ("y_embedder.mlp.2", "time_text_embed.text_embedder.linear_2"),
        ("final_layer.linear", "proj_out")))
    r += swapped_halves("final_layer.adaLN_modulation.1", "norm_out.linear")
    j, t = "joint_blocks.#", "transformer_blocks.#"
    r += joint_qkv_rules(f"{j}.x_block.attn.qkv", f"{j}.context_block.attn.qkv", t)
    r += qkv_rules(f"{j}.x_block.attn2.qkv", [f"{t}.attn2.to_{c}" for c in "qkv"])
    r += renames((
        ("x_block.attn.proj", "attn.to_out.0"), ("context_block.attn.proj", "attn.to_add_out"),
        ("x_block.attn2.proj", "attn2.to_out.0"),
        ("x_block.attn.ln_q", "attn.norm_q"), ("x_block.attn.ln_k", "attn.norm_k"),
        ("context_block.attn.ln_q", "attn.norm_added_q"), ("context_block.attn.ln_k", "attn.norm_added_k"),
        ("x_block.attn2.ln_q", "attn2.norm_q"), ("x_block.attn2.ln_k", "attn2.norm_k"),
        ("x_block.adaLN_modulation.1", "norm1.linear"),
        ("x_block.mlp.fc1", "ff.net.0.proj"), ("x_block.mlp.fc2", "ff.net.2"),
        ("context_block.mlp.fc1", "ff_context.net.0.proj"), ("context_block.mlp.fc2", "ff_context.net.2"),
        ("context_block.adaLN_modulation.1", "norm1_context.linear")),
        j + ".", t + ".")
    r += swapped_halves("joint_blocks.#last.context_block.adaLN_modulation.1",
                        "transformer_blocks.#last.norm1_context.linear")
    return r


def wan_rules():
    """Wan 2.1 / 2.2 (T2V, I2V): plain renames (self_attn -> attn1, cross_attn -> attn2, q -> to_q,
    o -> to_out.0, k_img/v_img -> add_k_proj/add_v_proj, ffn.0/2 -> ffn.net.0.proj/net.2, the affine
    cross-attention norm norm3 -> norm2)."""
    r = renames((
        ("time_embedding.0", "condition_embedder.time_embedder.linear_1"),
        ("time_embedding.2", "condition_embedder.time_embedder.linear_2"),
        ("text_embedding.0", "condition_embedder.text_embedder.linear_1"),
        ("text_embedding.2", "condition_embedder.text_embedder.linear_2"),
        ("time_projection.1", "condition_embedder.time_proj"),
        ("img_emb.proj.0", "condition_embedder.image_embedder.norm1"),
        ("img_emb.proj.1", "condition_embedder.image_embedder.ff.net.0.proj"),
        ("img_emb.proj.3", "condition_embedder.image_embedder.ff.net.2"),
        ("img_emb.proj.4", "condition_embedder.image_embedder.norm2"),
        ("head.head", "proj_out")))
    b = "blocks.#"
    for o, d in (("self_attn", "attn1"), ("cross_attn", "attn2")):
        r += renames((("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("o", "to_out.0"), ("norm_q", "norm_q"),
                       ("norm_k", "norm_k")), f"{b}.{o}.", f"{b}.{d}.")
    r += renames((
        ("cross_attn.k_img", "attn2.add_k_proj"), ("cross_attn.v_img", "attn2.add_v_proj"),
        ("cross_attn.norm_k_img", "attn2.norm_added_k"),
        ("ffn.0", "ffn.net.0.proj"), ("ffn.2", "ffn.net.2"), ("norm3", "norm2")), b + ".", b + ".")
    return r


def hunyuan_video_rules():
    """HunyuanVideo: double_blocks.N.img_attn_qkv / txt_attn_qkv = q, k, v by thirds;
    single_blocks.N.linear1 = q, k, v, proj_mlp (H, H, H, 4H rows: mlp_ratio 4);
    the token refiner's self_attn_qkv by thirds; final_layer.adaLN_modulation.1 with shift/scale swapped."""
    r = renames((
        ("img_in.proj", "x_embedder.proj"),
        ("time_in.mlp.0", "time_text_embed.timestep_embedder.linear_1"),
        ("time_in.mlp.2", "time_text_embed.timestep_embedder.linear_2"),
        ("guidance_in.mlp.0", "time_text_embed.guidance_embedder.linear_1"),
        ("guidance_in.mlp.2", "time_text_embed.guidance_embedder.linear_2"),
        ("vector_in.in_layer", "time_text_embed.text_embedder.linear_1"),
        ("vector_in.out_layer", "time_text_embed.text_embedder.linear_2"),
        ("txt_in.input_embedder", "context_embedder.proj_in"),
        ("txt_in.t_embedder.mlp.0", "context_embedder.time_text_embed.timestep_embedder.linear_1"),
        ("txt_in.t_embedder.mlp.2", "context_embedder.time_text_embed.timestep_embedder.linear_2"),
        ("txt_in.c_embedder.linear_1", "context_embedder.time_text_embed.text_embedder.linear_1"),
        ("txt_in.c_embedder.linear_2", "context_embedder.time_text_embed.text_embedder.linear_2"),
        ("final_layer.linear", "proj_out")))
    r += swapped_halves("final_layer.adaLN_modulation.1", "norm_out.linear")
    o, d = "txt_in.individual_token_refiner.blocks.#", "context_embedder.token_refiner.refiner_blocks.#"
    r += qkv_rules(f"{o}.self_attn_qkv", [f"{d}.attn.to_{c}" for c in "qkv"])
    r += renames((("self_attn_proj", "attn.to_out.0"), ("mlp.fc1", "ff.net.0.proj"), ("mlp.fc2", "ff.net.2"),
                   ("adaLN_modulation.1", "norm_out.linear"), ("norm1", "norm1"), ("norm2", "norm2")), o + ".", d + ".")
    o, d = "double_blocks.#", "transformer_blocks.#"
    r += qkv_rules(f"{o}.img_attn_qkv", [f"{d}.attn.to_{c}" for c in "qkv"])
    r += qkv_rules(f"{o}.txt_attn_qkv", [f"{d}.attn.add_{c}_proj" for c in "qkv"])
    r += renames((
        ("img_attn_proj", "attn.to_out.0"), ("txt_attn_proj", "attn.to_add_out"),
        ("img_attn_q_norm", "attn.norm_q"), ("img_attn_k_norm", "attn.norm_k"),
        ("txt_attn_q_norm", "attn.norm_added_q"), ("txt_attn_k_norm", "attn.norm_added_k"),
        ("img_mod.linear", "norm1.linear"), ("txt_mod.linear", "norm1_context.linear"),
        ("img_mlp.fc1", "ff.net.0.proj"), ("img_mlp.fc2", "ff.net.2"),
        ("txt_mlp.fc1", "ff_context.net.0.proj"), ("txt_mlp.fc2", "ff_context.net.2")), o + ".", d + ".")
    o, d = "single_blocks.#", "single_transformer_blocks.#"
    r += [(f"{o}.linear1", f"{d}.{x}", (rows, "0/1:1/1")) for x, rows in (
        ("attn.to_q", "0/7:1/7"), ("attn.to_k", "1/7:2/7"), ("attn.to_v", "2/7:3/7"), ("proj_mlp", "3/7:7/7"))]
    r += renames((("linear2", "proj_out"), ("modulation.linear", "norm.linear"),
                   ("q_norm", "attn.norm_q"), ("k_norm", "attn.norm_k")), o + ".", d + ".")
    return r + aliases(r, hunyuan_comfy_spellings())


def hunyuan_comfy_spellings():
    """ComfyUI's own HunyuanVideo names (the Flux layers it reuses): supported_models.HunyuanVideo's
    process_unet_state_dict renames the original ones on load (_attn_qkv -> _attn.qkv, _attn_proj ->
    _attn.proj, _mod.linear -> _mod.lin, mlp.fc1 / fc2 -> mlp.0 / 2, .modulation.linear -> .modulation.lin,
    the embedders' mlp.0 / mlp.2 and linear_1 / linear_2 -> in_layer / out_layer), and a checkpoint it saves
    keeps them; comfy/lora.py maps them back for diffusion-pipe's LoRAs. Each is the whole original weight."""
    d, b = "double_blocks.#", "txt_in.individual_token_refiner.blocks.#"
    out = []
    for side in ("img", "txt"):
        out += [(f"{d}.{side}_attn_qkv", f"{d}.{side}_attn.qkv", None),
                (f"{d}.{side}_attn_proj", f"{d}.{side}_attn.proj", None),
                (f"{d}.{side}_mod.linear", f"{d}.{side}_mod.lin", None),
                (f"{d}.{side}_mlp.fc1", f"{d}.{side}_mlp.0", None),
                (f"{d}.{side}_mlp.fc2", f"{d}.{side}_mlp.2", None)]
    out += [("single_blocks.#.modulation.linear", "single_blocks.#.modulation.lin", None),
            (f"{b}.self_attn_qkv", f"{b}.self_attn.qkv", None), (f"{b}.self_attn_proj", f"{b}.self_attn.proj", None),
            (f"{b}.mlp.fc1", f"{b}.mlp.0", None), (f"{b}.mlp.fc2", f"{b}.mlp.2", None)]
    for o, c in (("txt_in.t_embedder.mlp.0", "txt_in.t_embedder.in_layer"),
                 ("txt_in.t_embedder.mlp.2", "txt_in.t_embedder.out_layer"),
                 ("txt_in.c_embedder.linear_1", "txt_in.c_embedder.in_layer"),
                 ("txt_in.c_embedder.linear_2", "txt_in.c_embedder.out_layer"),
                 ("time_in.mlp.0", "time_in.in_layer"), ("time_in.mlp.2", "time_in.out_layer"),
                 ("guidance_in.mlp.0", "guidance_in.in_layer"), ("guidance_in.mlp.2", "guidance_in.out_layer")):
        out.append((o, c, None))
    return out


def z_image_rules():
    """Z-Image (ComfyUI's Lumina2 / NextDiT names, the original's) <-> diffusers ZImageTransformer2DModel:
    ComfyUI's z_image_to_diffusers and diffusers' convert_z_image_transformer_checkpoint_to_diffusers: in
    layers / noise_refiner / context_refiner blocks attention.qkv = to_q, to_k, to_v (thirds: as many k, v
    heads as q heads), attention.out = to_out.0, q_norm / k_norm = norm_q / norm_k; final_layer and x_embedder
    under all_final_layer.2-1 and all_x_embedder.2-1. Other names are the same on both sides."""
    r = renames((("final_layer.*", "all_final_layer.2-1.*"), ("x_embedder", "all_x_embedder.2-1")))
    for blk in ("layers.#", "noise_refiner.#", "context_refiner.#"):
        a = f"{blk}.attention"
        r += qkv_rules(f"{a}.qkv", [f"{a}.to_{c}" for c in "qkv"])
        r += renames((("out", "to_out.0"), ("q_norm", "norm_q"), ("k_norm", "norm_k")), a + ".", a + ".")
    return r


def auraflow_rules():
    """AuraFlow: the original (fal's, ComfyUI's) names <-> diffusers AuraFlowTransformer2DModel, as ComfyUI's
    comfy/utils.py auraflow_to_diffusers maps them: double_layers.N = joint_transformer_blocks.N (attn.w2q/w2k/w2v/w2o
    the image stream's to_q/to_k/to_v/to_out.0, attn.w1q/w1k/w1v/w1o the text stream's add_q/k/v_proj/to_add_out,
    mlpX / mlpC c_fc1, c_fc2, c_proj = ff / ff_context linear_1, linear_2, out_projection, modX.1 / modC.1 =
    norm1 / norm1_context.linear); single_layers.N = single_transformer_blocks.N (both counted from 0: attn.w1q ...
    w1o = to_q ... to_out.0, modCX.1 = norm1.linear, mlp.* = ff.*); modF.1 = norm_out.linear with its halves swapped
    (swap_scale_shift); the embedders renamed."""
    r = renames((("t_embedder.mlp.0", "time_step_proj.linear_1"), ("t_embedder.mlp.2", "time_step_proj.linear_2"),
                 ("cond_seq_linear", "context_embedder"), ("init_x_linear", "pos_embed.proj"),
                 ("final_linear", "proj_out")))
    r += swapped_halves("modF.1", "norm_out.linear")
    mlp = (("c_fc1", "linear_1"), ("c_fc2", "linear_2"), ("c_proj", "out_projection"))
    r += renames((("attn.w2q", "attn.to_q"), ("attn.w2k", "attn.to_k"), ("attn.w2v", "attn.to_v"),
                  ("attn.w2o", "attn.to_out.0"), ("attn.w1q", "attn.add_q_proj"), ("attn.w1k", "attn.add_k_proj"),
                  ("attn.w1v", "attn.add_v_proj"), ("attn.w1o", "attn.to_add_out"), ("modX.1", "norm1.linear"),
                  ("modC.1", "norm1_context.linear"))
                 + tuple((f"mlpX.{a}", f"ff.{b}") for a, b in mlp) + tuple((f"mlpC.{a}", f"ff_context.{b}") for a, b in mlp),
                 "double_layers.#.", "joint_transformer_blocks.#.")
    r += renames((("attn.w1q", "attn.to_q"), ("attn.w1k", "attn.to_k"), ("attn.w1v", "attn.to_v"),
                  ("attn.w1o", "attn.to_out.0"), ("modCX.1", "norm1.linear"))
                 + tuple((f"mlp.{a}", f"ff.{b}") for a, b in mlp), "single_layers.#.", "single_transformer_blocks.#.")
    return r


def pixart_rules():
    """PixArt-alpha / -Sigma: the original (ComfyUI's) names <-> diffusers PixArtTransformer2DModel, as ComfyUI's
    comfy/utils.py pixart_to_diffusers maps them: blocks.N.attn.qkv = transformer_blocks.N.attn1.to_q, to_k, to_v
    by thirds (offset = hidden size); cross_attn.q_linear = attn2.to_q; cross_attn.kv_linear = attn2.to_k, to_v by
    halves; attn.proj / cross_attn.proj = attn1 / attn2.to_out.0, mlp.fc1 / fc2 = ff.net.0.proj / ff.net.2; the
    embedders under adaln_single / caption_projection / pos_embed, final_layer.linear = proj_out."""
    r = renames((("csize_embedder.mlp.0", "adaln_single.emb.resolution_embedder.linear_1"),
                 ("csize_embedder.mlp.2", "adaln_single.emb.resolution_embedder.linear_2"),
                 ("ar_embedder.mlp.0", "adaln_single.emb.aspect_ratio_embedder.linear_1"),
                 ("ar_embedder.mlp.2", "adaln_single.emb.aspect_ratio_embedder.linear_2"),
                 ("x_embedder.proj", "pos_embed.proj"),
                 ("y_embedder.y_proj.fc1", "caption_projection.linear_1"),
                 ("y_embedder.y_proj.fc2", "caption_projection.linear_2"),
                 ("t_embedder.mlp.0", "adaln_single.emb.timestep_embedder.linear_1"),
                 ("t_embedder.mlp.2", "adaln_single.emb.timestep_embedder.linear_2"),
                 ("t_block.1", "adaln_single.linear"), ("final_layer.linear", "proj_out")))
    b, t = "blocks.#", "transformer_blocks.#"
    r += qkv_rules(f"{b}.attn.qkv", [f"{t}.attn1.to_{c}" for c in "qkv"])
    r += qkv_rules(f"{b}.cross_attn.kv_linear", [f"{t}.attn2.to_k", f"{t}.attn2.to_v"], parts=2)
    r += renames((("cross_attn.q_linear", "attn2.to_q"), ("attn.proj", "attn1.to_out.0"),
                  ("cross_attn.proj", "attn2.to_out.0"), ("mlp.fc1", "ff.net.0.proj"), ("mlp.fc2", "ff.net.2")),
                 b + ".", t + ".")
    return r


def krea2_rules():
    """Krea 2: ComfyUI's (the original) names <-> the diffusers ones, as ComfyUI's comfy/utils.py krea2_to_diffusers
    maps them: blocks.N = transformer_blocks.N, txtfusion.{layerwise,refiner}_blocks.N =
    text_fusion.{layerwise,refiner}_blocks.N, each with attn.wq/wk/wv/gate/wo = attn.to_q/to_k/to_v/to_gate/to_out.0
    (ComfyUI also reads attn.to_out: an alias) and mlp.gate/up/down = ff.gate/up/down; first = img_in, tmlp.0/2 =
    time_embed.linear_1/2, tproj.1 = time_mod_proj, txtmlp.1/3 = txt_in.linear_1/2, txtfusion.projector =
    text_fusion.projector, last.linear = final_layer.linear."""
    r = renames((("first", "img_in"), ("tmlp.0", "time_embed.linear_1"), ("tmlp.2", "time_embed.linear_2"),
                 ("tproj.1", "time_mod_proj"), ("txtmlp.1", "txt_in.linear_1"), ("txtmlp.3", "txt_in.linear_2"),
                 ("txtfusion.projector", "text_fusion.projector"), ("last.linear", "final_layer.linear")))
    blocks = (("blocks.#", "transformer_blocks.#"), ("txtfusion.layerwise_blocks.#", "text_fusion.layerwise_blocks.#"),
              ("txtfusion.refiner_blocks.#", "text_fusion.refiner_blocks.#"))
    sp = []
    for o, d in blocks:
        r += renames((("attn.wq", "attn.to_q"), ("attn.wk", "attn.to_k"), ("attn.wv", "attn.to_v"),
                      ("attn.gate", "attn.to_gate"), ("attn.wo", "attn.to_out.0"), ("mlp.gate", "ff.gate"),
                      ("mlp.up", "ff.up"), ("mlp.down", "ff.down")), o + ".", d + ".")
        sp.append((f"{o}.attn.wo", f"{d}.attn.to_out", None))
    return r + aliases(r, sp)


def lumina2_rules():
    """Lumina-Image 2.0: the original (NextDiT, ComfyUI's Lumina2) names <-> diffusers Lumina2Transformer2DModel, as
    diffusers' convert_lumina2_to_diffusers renames them: attention.* = attn.*, with attention.qkv = attn.to_q, to_k,
    to_v split [2304, 768, 768] rows (rows 0..3/5, 3/5..4/5, 4/5..1: 24 query heads, 8 key/value heads),
    attention.out = attn.to_out.0, q_norm / k_norm = norm_q / norm_k; feed_forward.w1/w2/w3 =
    feed_forward.linear_1/2/3; adaLN_modulation.1 = norm1.linear, attention_norm1 = norm1.norm, attention_norm2 =
    norm2 (the context refiner's: norm1, norm2); cap_embedder = time_caption_embed.caption_embedder, t_embedder.mlp.0/2
    = time_caption_embed.timestep_embedder.linear_1/2, final_layer.adaLN_modulation.1 / final_layer.linear =
    norm_out.linear_1 / norm_out.linear_2. (Z-Image's diffusers names are another model's: z-image.lkmap.)"""
    r = renames((("cap_embedder.*", "time_caption_embed.caption_embedder.*"),
                 ("t_embedder.mlp.0", "time_caption_embed.timestep_embedder.linear_1"),
                 ("t_embedder.mlp.2", "time_caption_embed.timestep_embedder.linear_2"),
                 ("final_layer.adaLN_modulation.1", "norm_out.linear_1"), ("final_layer.linear", "norm_out.linear_2")))
    for blk in ("layers.#", "noise_refiner.#", "context_refiner.#"):
        b = blk + "."
        r += [(f"{b}attention.qkv", f"{b}attn.to_{c}", (rows, "0/1:1/1"))
              for c, rows in (("q", "0/5:3/5"), ("k", "3/5:4/5"), ("v", "4/5:5/5"))]
        r += renames((("attention.out", "attn.to_out.0"), ("attention.q_norm", "attn.norm_q"),
                      ("attention.k_norm", "attn.norm_k"), ("feed_forward.w1", "feed_forward.linear_1"),
                      ("feed_forward.w2", "feed_forward.linear_2"), ("feed_forward.w3", "feed_forward.linear_3")), b, b)
        if blk == "context_refiner.#":
            r += renames((("attention_norm1", "norm1"), ("attention_norm2", "norm2")), b, b)
        else:
            r += renames((("adaLN_modulation.1", "norm1.linear"), ("attention_norm1", "norm1.norm"),
                          ("attention_norm2", "norm2")), b, b)
    return r


def ace_step15_rules():
    """ACE-Step 1.5: its LoRAs name the DiT decoder's weights without their "decoder." (ComfyUI's
    model_lora_keys_unet, ACEStep15: base_model.model.<name> and lycoris_<name> = diffusion_model.decoder.<name>);
    the checkpoint's decoder.layers.N.*, decoder.time_embed(_r).*, decoder.condition_embedder,
    decoder.proj_in.* / proj_out.* are the LoRA's layers.N.*, time_embed(_r).*, ... (the "diffusers" side here
    is the LoRA's naming).
    diffusers' AceStepTransformer1DModel keeps those names but for the attention projections: q_proj, k_proj,
    v_proj, o_proj = to_q, to_k, to_v, to_out.0 (diffusers' _convert_non_diffusers_ace_step_lora_to_diffusers);
    those lines put the LoRA's names on a diffusers checkpoint, and 'alias' lines diffusers' names on ComfyUI's."""
    r = renames((("decoder.layers.#.*", "layers.#.*"), ("decoder.time_embed.*", "time_embed.*"),
                 ("decoder.time_embed_r.*", "time_embed_r.*"), ("decoder.condition_embedder", "condition_embedder"),
                 ("decoder.proj_in.*", "proj_in.*"), ("decoder.proj_out.*", "proj_out.*")))
    proj = (("q_proj", "to_q"), ("k_proj", "to_k"), ("v_proj", "to_v"), ("o_proj", "to_out.0"))
    for a in ("self_attn", "cross_attn"):
        r += renames(proj, f"layers.#.{a}.", f"layers.#.{a}.")
        # ComfyUI's spelling of the same weights (exempt from the overlap check: both name to_q's rows)
        r += [("alias", f"decoder.layers.#.{a}.{o}", f"layers.#.{a}.{d}", None) for o, d in proj]
    return r


def qwen_image_rules():
    """Qwen-Image: ComfyUI's names are the diffusers ones (QwenImageTransformer2DModel), but for Qwen Image 2.1,
    whose img_mlp.gate_layer and img_mlp.proj ComfyUI fuses on load into img_mlp.gate_up (a checkpoint it saves,
    and leejet's files, hold the fused weight): gate_layer = rows [0, half), proj = rows [half, 2 half) of gate_up
    (comfy/lora.py model_lora_keys_unet, QwenImage)."""
    t = "transformer_blocks.#.img_mlp"
    return qkv_rules(f"{t}.gate_up", [f"{t}.gate_layer", f"{t}.proj"], parts=2)


LTX_ATTN = ("attn1", "attn2", "audio_attn1", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn")


def ltx_rules():
    """LTX-Video (0.9.x) and LTX-2: the blocks keep their names; patchify_proj -> proj_in,
    adaln_single -> time_embed, q_norm/k_norm -> norm_q/norm_k; LTX-2's audio and audio-video
    cross-attention modulation (audio_patchify_proj, audio_adaln_single, av_ca_*_adaln_single)."""
    r = renames((
        ("patchify_proj", "proj_in"), ("audio_patchify_proj", "audio_proj_in"),
        ("adaln_single.*", "time_embed.*"), ("audio_adaln_single.*", "audio_time_embed.*"),
        ("av_ca_video_scale_shift_adaln_single.*", "av_cross_attn_video_scale_shift.*"),
        ("av_ca_a2v_gate_adaln_single.*", "av_cross_attn_video_a2v_gate.*"),
        ("av_ca_audio_scale_shift_adaln_single.*", "av_cross_attn_audio_scale_shift.*"),
        ("av_ca_v2a_gate_adaln_single.*", "av_cross_attn_audio_v2a_gate.*")))
    for a in LTX_ATTN:
        r += renames(((f"{x}_norm", f"norm_{x}") for x in "qk"), f"transformer_blocks.#.{a}.", f"transformer_blocks.#.{a}.")
    return r


def stable_cascade_rules():
    """Stable Cascade stage C: Stability's attention.attn.in_proj_weight = diffusers' attention.to_q, to_k, to_v
    (thirds) and attention.attn.out_proj = attention.to_out.0 (diffusers'
    convert_stable_cascade_unet_single_file_to_diffusers); ComfyUI's own names split in_proj into
    attention.attn.to_q, to_k, to_v (Stable_Cascade_C.process_unet_state_dict) and keep attn.out_proj: aliases.
    The other layers keep their names."""
    r, sp = [], []
    for side in ("down_blocks", "up_blocks"):
        a = f"{side}.#.#.attention"
        r += qkv_rules(f"{a}.attn.in_proj", [f"{a}.to_{c}" for c in "qkv"])
        r += renames(((f"{a}.attn.out_proj", f"{a}.to_out.0"),))
        sp += [(f"{a}.attn.in_proj", f"{a}.attn.to_{c}", f"{k}/3:{k + 1}/3") for k, c in enumerate("qkv")]
    return r + aliases(r, sp)


def flux2_rules():
    """Flux 2: BFL / ComfyUI names <-> diffusers Flux2Transformer2DModel, as diffusers'
    convert_flux2_transformer_checkpoint_to_diffusers renames them (and _convert_non_diffusers_flux2_lora_to_diffusers
    its LoRAs): double_blocks.N = transformer_blocks.N, img_attn.qkv / txt_attn.qkv = to_q, to_k, to_v /
    add_q_proj, add_k_proj, add_v_proj by thirds, img_attn.proj / txt_attn.proj = to_out.0 / to_add_out,
    img_mlp.0/2 / txt_mlp.0/2 = ff / ff_context linear_in/linear_out; single_blocks.N = single_transformer_blocks.N,
    linear1 = attn.to_qkv_mlp_proj whole (q, k, v and the gated MLP stay fused on both sides), linear2 = attn.to_out;
    the shared modulations' lin = linear; img_in, txt_in, time_in, guidance_in renamed; final_layer.adaLN_modulation.1
    = norm_out.linear with its halves swapped (swap_scale_shift)."""
    r = renames((("img_in", "x_embedder"), ("txt_in", "context_embedder"),
                 ("time_in.in_layer", "time_guidance_embed.timestep_embedder.linear_1"),
                 ("time_in.out_layer", "time_guidance_embed.timestep_embedder.linear_2"),
                 ("guidance_in.in_layer", "time_guidance_embed.guidance_embedder.linear_1"),
                 ("guidance_in.out_layer", "time_guidance_embed.guidance_embedder.linear_2"),
                 ("double_stream_modulation_img.lin", "double_stream_modulation_img.linear"),
                 ("double_stream_modulation_txt.lin", "double_stream_modulation_txt.linear"),
                 ("single_stream_modulation.lin", "single_stream_modulation.linear"),
                 ("final_layer.linear", "proj_out")))
    r += swapped_halves("final_layer.adaLN_modulation.1", "norm_out.linear")
    b, d = "double_blocks.#.", "transformer_blocks.#."
    r += joint_qkv_rules(f"{b}img_attn.qkv", f"{b}txt_attn.qkv", d[:-1])
    r += renames((("img_attn.proj", "attn.to_out.0"), ("img_mlp.0", "ff.linear_in"), ("img_mlp.2", "ff.linear_out"),
                  ("txt_attn.proj", "attn.to_add_out"), ("txt_mlp.0", "ff_context.linear_in"),
                  ("txt_mlp.2", "ff_context.linear_out")), b, d)
    r += renames((("linear1", "attn.to_qkv_mlp_proj"), ("linear2", "attn.to_out")),
                 "single_blocks.#.", "single_transformer_blocks.#.")
    return r


def write_dit_families():
    write("sd3", "SD3 / SD3.5: Stability single file (joint_blocks) <-> diffusers SD3Transformer2DModel",
          ["joint_blocks.0.x_block.attn.qkv.weight",
           "pos_embed.proj.weight transformer_blocks.0.attn.add_q_proj.weight"], sd3_rules())
    write("wan", "Wan 2.x: original (blocks.N.self_attn.q) <-> diffusers WanTransformer3DModel",
          ["head.modulation", "condition_embedder.time_proj.weight"], wan_rules())
    write("hunyuan-video", "HunyuanVideo: original (double_blocks / single_blocks) <-> diffusers "
          "HunyuanVideoTransformer3DModel",
          ["double_blocks.0.img_attn_qkv.weight", "txt_in.individual_token_refiner.blocks.0.self_attn_qkv.weight",
           "double_blocks.0.img_attn.qkv.weight img_in.proj.weight",
           "context_embedder.token_refiner.refiner_blocks.0.attn.to_q.weight"], hunyuan_video_rules())
    write("stable-cascade", "Stable Cascade stage C: Stability / ComfyUI <-> diffusers StableCascadeUNet",
          ["clip_txt_mapper.weight"], stable_cascade_rules())
    write("z-image", "Z-Image: ComfyUI / original (NextDiT: attention.qkv) <-> diffusers ZImageTransformer2DModel",
          ["noise_refiner.0.attention.qkv.weight !layers.0.adaLN_modulation.1.weight",
           "noise_refiner.0.attention.to_q.weight"], z_image_rules())
    write("auraflow", "AuraFlow: original / ComfyUI (double_layers, single_layers) <-> diffusers AuraFlowTransformer2DModel",
          ["double_layers.0.attn.w2q.weight", "joint_transformer_blocks.0.attn.to_add_out.weight time_step_proj.linear_1.weight"],
          auraflow_rules())
    write("pixart", "PixArt-alpha / -Sigma: original / ComfyUI (blocks.N.attn.qkv) <-> diffusers PixArtTransformer2DModel",
          ["t_block.1.weight blocks.0.cross_attn.kv_linear.weight blocks.0.mlp.fc1.weight",
           "adaln_single.linear.weight pos_embed.proj.weight transformer_blocks.0.attn2.to_k.weight"], pixart_rules())
    write("krea2", "Krea 2: original / ComfyUI (blocks.N.attn.wq) <-> diffusers (transformer_blocks.N.attn.to_q)",
          ["txtfusion.projector.weight blocks.0.attn.wq.weight",
           "text_fusion.projector.weight transformer_blocks.0.attn.to_gate.weight"], krea2_rules())
    write("lumina2", "Lumina-Image 2.0: original / ComfyUI (NextDiT: attention.qkv) <-> diffusers Lumina2Transformer2DModel",
          ["noise_refiner.0.attention.qkv.weight layers.0.adaLN_modulation.1.weight",
           "time_caption_embed.caption_embedder.1.weight layers.0.attn.to_q.weight"], lumina2_rules())
    write("ace-step15", "ACE-Step 1.5: the checkpoint's decoder.<name> <-> its LoRAs' <name>",
          ["decoder.condition_embedder.weight decoder.layers.0.self_attn.q_proj.weight null_condition_emb",
           "condition_embedder.weight layers.0.self_attn.to_q.weight time_embed_r.linear_1.weight"],
          ace_step15_rules())
    write("flux2", "Flux 2: BFL / ComfyUI single file <-> diffusers Flux2Transformer2DModel",
          ["double_stream_modulation_img.lin.weight double_blocks.0.img_attn.qkv.weight",
           "double_stream_modulation_img.linear.weight single_transformer_blocks.0.attn.to_qkv_mlp_proj.weight"],
          flux2_rules())
    write("qwen-image", "Qwen Image 2.1: ComfyUI's fused img_mlp.gate_up <-> diffusers' img_mlp.gate_layer, img_mlp.proj",
          ["transformer_blocks.0.img_mlp.gate_up.weight", "transformer_blocks.0.img_mlp.gate_layer.weight"],
          qwen_image_rules())
    write("ltx", "LTX-Video / LTX-2: original <-> diffusers LTXVideoTransformer3DModel / LTX2VideoTransformer3DModel",
          ["patchify_proj.weight", "time_embed.emb.timestep_embedder.linear_1.weight", "audio_proj_in.weight"],
          ltx_rules())


def main():
    os.makedirs(OUT, exist_ok=True)
    write("openclip", "OpenCLIP text encoder (SD 2.x, SDXL's second) <-> transformers CLIPTextModel",
          ["transformer.resblocks.0.attn.in_proj_weight"], openclip_rules())
    write("sd1", "SD 1.x / 2.x UNet: LDM (model.diffusion_model.) <-> diffusers (unet/)",
          ["input_blocks.1.1.proj_in.weight", "down_blocks.0.attentions.0.proj_in.weight"],
          unet_rules([True, True, True, False], [False, True, True, True]))
    write("sdxl", "SDXL UNet: SGM (model.diffusion_model.) <-> diffusers (unet/)",
          ["label_emb.0.0.weight", "add_embedding.linear_1.weight"],
          unet_rules([False, True, True], [True, True, False]))
    # HunyuanVideo has single_blocks.N.linear1 and single_transformer_blocks.N.proj_mlp too: Flux is BFL's
    # img_attn.qkv (HunyuanVideo: img_attn_qkv) with a plain img_in linear (HunyuanVideo: img_in.proj, a
    # conv), or diffusers' proj_mlp with a plain x_embedder linear (HunyuanVideo: x_embedder.proj) and
    # no token refiner. A Flux 2 BFL checkpoint has img_attn.qkv, img_attn.proj and img_in too, but its
    # single_blocks.N.linear1 is q, k, v + a gated MLP (3H + 6H rows, diffusers' to_qkv_mlp_proj whole), not
    # Flux's sevenths: it is excluded by its shared double_stream_modulation_img.lin (Flux has per-block img_mod)
    write("flux", "Flux: BFL / ComfyUI single file <-> diffusers FluxTransformer2DModel",
          ["double_blocks.0.img_attn.qkv.weight double_blocks.0.img_attn.proj.weight img_in.weight "
           "!txt_in.individual_token_refiner.blocks.0.self_attn_qkv.weight !double_stream_modulation_img.lin.weight",
           "single_transformer_blocks.0.proj_mlp.weight x_embedder.weight "
           "!context_embedder.token_refiner.refiner_blocks.0.attn.to_q.weight"], flux_rules())
    write_dit_families()


if __name__ == "__main__":
    main()
