"""kohya module names with the other factor spellings ComfyUI reads: its
LoRA loader tries `{name}.lora_up.weight`, `{name}.lora.up.weight` and
`{name}.lora_B.weight` (and the matching down / A names) for every name its
key map produces, kohya names (lora_unet_..., lora_te..., lycoris_...)
included; diffusers' Z-Image converter reads the dotted form too.

Oracle: the same file with kohya's own spelling (lora_down / lora_up),
whose fuse test_keyformats checks against ComfyUI's mapping in float64
(tests/fixtures/keyformats): every kohya-named case of cases.txt, with its
factors renamed, must give byte-identical output on every base it is fused
onto. numpy only: runs in CI."""
import os

import pytest

import st_io
from conftest import cli

FX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "fixtures", "keyformats")
KOHYA = ("lora_unet_", "lora_te", "lycoris_", "lora_transformer_", "lora_prior_")


def kohya_cases():
    out = []
    for line in open(os.path.join(FX, "cases.txt")):
        f = line.split()
        if not f or f[0].startswith("#") or len(f) > 5:  # a convention column: not this test's
            continue
        keys = st_io.read(os.path.join(FX, f[2]))
        if any(k.startswith(KOHYA) and k.endswith(".lora_down.weight") for k in keys):
            out.append(f)
    return out


CASES = kohya_cases()
SPELLINGS = {"dotted": (".lora.down.weight", ".lora.up.weight"), "peft": (".lora_A.weight", ".lora_B.weight")}


def test_cases_found():
    assert len(CASES) >= 8, [c[0] for c in CASES]  # the fixture set has this many kohya-named cases


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[3][:-12]}")
@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_respelled_factors_fuse_the_same(case, spelling, tmp_path):
    name, strength, lora, base = case[:4]
    down, up = SPELLINGS[spelling]
    t = st_io.read(os.path.join(FX, lora))
    renamed = {}
    for k, v in t.items():
        if k.startswith(KOHYA) and k.endswith(".lora_down.weight"):
            k = k[: -len(".lora_down.weight")] + down
        elif k.startswith(KOHYA) and k.endswith(".lora_up.weight"):
            k = k[: -len(".lora_up.weight")] + up
        renamed[k] = v
    assert renamed.keys() != t.keys()
    respelled = str(tmp_path / "respelled.safetensors")
    st_io.write(respelled, renamed)
    ref, got = str(tmp_path / "ref.safetensors"), str(tmp_path / "got.safetensors")
    cli("fuse", os.path.join(FX, base), "-l", f"{os.path.join(FX, lora)}:{strength}", "-o", ref)
    cli("fuse", os.path.join(FX, base), "-l", f"{respelled}:{strength}", "-o", got)
    a, b = st_io.read(ref), st_io.read(got)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k][1].tobytes() == b[k][1].tobytes(), k
