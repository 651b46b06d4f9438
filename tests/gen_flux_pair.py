"""Writes DIR/flux.safetensors (a BFL-named Flux base: single_blocks.0.linear1
holds q, k, v, mlp fused, and the flux table's detect keys
double_blocks.0.img_attn.qkv/proj and img_in) and DIR/lora.safetensors (a
diffusers-named LoRA on transformer.single_transformer_blocks.0.attn.to_k),
which match only through the flux family table. Used by install.sh and
install_python.sh. Usage: python3 gen_flux_pair.py DIR"""
import json
import struct
import sys


def save(path, tensors):
    hdr, blob = {}, b""
    for name, rows, cols in tensors:
        data = b"".join(struct.pack("<f", ((i * 7) % 13) / 13.0 - 0.5) for i in range(rows * cols))
        hdr[name] = {"dtype": "F32", "shape": [rows, cols], "data_offsets": [len(blob), len(blob) + len(data)]}
        blob += data
    h = json.dumps(hdr).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + blob)


save(sys.argv[1] + "/flux.safetensors", [("model.diffusion_model.single_blocks.0.linear1.weight", 28, 4),
                                        ("model.diffusion_model.double_blocks.0.img_attn.qkv.weight", 12, 4),
                                        ("model.diffusion_model.double_blocks.0.img_attn.proj.weight", 4, 4),
                                        ("model.diffusion_model.img_in.weight", 4, 4)])
save(sys.argv[1] + "/lora.safetensors", [("transformer.single_transformer_blocks.0.attn.to_k.lora_A.weight", 2, 4),
                                        ("transformer.single_transformer_blocks.0.attn.to_k.lora_B.weight", 4, 2)])
