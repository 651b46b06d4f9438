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

Pure Python, no dependencies: run it and commit the tables it writes.
"""
import os

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
    return r


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


def write(name, title, detect, rules):
    lines = [f"# {title}", "# Written by scripts/make_family_tables.py from the published mapping; do not edit.",
             "lorakit-family 1", f"family {name}"]
    lines += [f"detect {k}" for k in detect]
    for o, d, rows in rules:
        lines.append(f"map {o} {d}" + (f" {rows[0]} {rows[1]}" if rows else ""))
    with open(os.path.join(OUT, name + ".lkmap"), "w") as f:
        f.write("\n".join(lines) + "\n")


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
    write("flux", "Flux: BFL / ComfyUI single file <-> diffusers FluxTransformer2DModel",
          ["double_blocks.0.img_attn.qkv.weight", "double_blocks.0.img_attn.proj.weight",
           "single_blocks.0.linear1.weight", "single_transformer_blocks.0.proj_mlp.weight"], flux_rules())


if __name__ == "__main__":
    main()
