"""alpha_from (issue 20, item 3): a file whose .alpha tensor (8) and
lora_adapter_metadata (lora_alpha 16, r 4) disagree is refused as diffusers
refuses it, unless alpha_from picks one; fuse, fuse_, Tracker and inspect
take the keyword and give the bytes `lorakit fuse --alpha-from` gives
(compared by digest), and the scale is the hand-computed alpha / r."""
import json
import os

import numpy as np
import pytest

import lorakit
import st_io
from conftest import cli

O, I, R = 8, 12, 4


@pytest.fixture
def files(tmp_path):
    rng = np.random.default_rng(5)
    base = str(tmp_path / "base.safetensors")
    st_io.write(base, {"blocks.0.attn.to_q.weight": ("F32", rng.uniform(-1, 1, (O, I)).astype(np.float32))})
    ad = str(tmp_path / "d.safetensors")
    st_io.write(ad, {"transformer.blocks.0.attn.to_q.lora_A.weight": ("F32", rng.uniform(-1, 1, (R, I)).astype(np.float32)),
                     "transformer.blocks.0.attn.to_q.lora_B.weight": ("F32", rng.uniform(-1, 1, (O, R)).astype(np.float32)),
                     "transformer.blocks.0.attn.to_q.alpha": ("F32", np.array(8, np.float32))},
                metadata={"lora_adapter_metadata": json.dumps({"r": R, "lora_alpha": 16})})
    return base, ad, str(tmp_path)


def state(base):
    return {k: v for k, (_, v) in st_io.read(base).items()}


def test_alpha_from(files):
    base, ad, d = files
    sd = state(base)
    with pytest.raises(lorakit.LoraError) as e:
        lorakit.fuse_(sd, [(ad, 1.0)])
    assert e.value.status == "LK_ERR_CONFIG" and "says alpha = 8 but metadata lora_adapter_metadata says 16" in str(e.value)
    assert sd["blocks.0.attn.to_q.weight"].tobytes() == state(base)["blocks.0.attn.to_q.weight"].tobytes()
    for which, alpha in (("tensors", 8), ("metadata", 16)):
        info = lorakit.inspect(ad, alpha_from=which)
        assert info["modules"][0]["alpha"] == alpha and info["modules"][0]["scale"] == alpha / R
        placed = lorakit.inspect(ad, base, alpha_from=which)  # with a base too (was refused)
        assert placed["modules"][0]["alpha"] == alpha and placed["modules"][0]["scale"] == alpha / R
        out = os.path.join(d, f"cli_{which}.safetensors")
        cli("fuse", base, "-l", ad, "-o", out, "--alpha-from", which)
        want = cli("digest", out).stdout.strip()
        sd = state(base)
        lorakit.fuse_(sd, [(ad, 1.0)], alpha_from=which)
        assert lorakit.digest_tensors(sd) == want
        out2 = os.path.join(d, f"py_{which}.safetensors")
        lorakit.fuse(base, [(ad, 1.0)], out2, alpha_from=which)
        assert lorakit.digest(out2) == want
        sd = state(base)
        with lorakit.Tracker(sd, alpha_from=which) as t:
            t.apply([(ad, 1.0)])
            assert lorakit.digest_tensors(sd) == want
    with pytest.raises(ValueError, match="alpha_from must be"):
        lorakit.fuse_(state(base), [(ad, 1.0)], alpha_from="both")
