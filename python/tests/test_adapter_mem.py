"""lorakit.Adapter: adapters held in memory (NumPy; runs without torch).
Oracle: the same adapter read from disk (the lorakit CLI's offline fuse and
its digest), so memory and file must give the same bytes; the PEFT case
uses a committed PEFT fixture (tests/fixtures/peft/patterns: made by PEFT,
with rank_pattern / alpha_pattern in its config)."""
import json
import os

import pytest

import lorakit
import st_io
from conftest import cli, load_numpy

HERE = os.path.dirname(os.path.abspath(__file__))
PEFT = os.path.join(HERE, "..", "..", "tests", "fixtures", "peft")
Q = "blocks.0.attn.to_q.weight"


def offline(base, loras, out):
    args = ["fuse", base, "-o", out]
    for p, s in loras:
        args += ["-l", f"{p}:{s}"]
    cli(*args)
    return cli("digest", out).stdout.strip()


def test_load_and_state_dict_equal_the_file(model):
    want = offline(model["base"], [(model["a1"], 0.7), (model["a2"], -1.5)], os.path.join(model["dir"], "o.safetensors"))
    a1 = lorakit.Adapter.load(model["a1"])
    a2 = lorakit.Adapter.from_state_dict({k: v for k, (dt, v) in st_io.read(model["a2"]).items()})
    t = load_numpy(model["base"])
    s = lorakit.fuse_(t, [(a1, 0.7), (a2, -1.5)])
    assert lorakit.digest_tensors(t) == want
    assert s["adapters"][0]["path"].startswith("a1.safetensors@")
    # file to file
    out = os.path.join(model["dir"], "m.safetensors")
    lorakit.fuse(model["base"], [(a2, -1.5), (a1, 0.7)], out)
    assert lorakit.digest(out) == want
    # the tracker: same bytes; a different adapter under the same name is a different set
    t = load_numpy(model["base"])
    tr = lorakit.Tracker(t)
    tr.apply([(a1, 0.7), (a2, -1.5)])
    assert lorakit.digest_tensors(t) == want
    assert tr.apply([(a2, -1.5), (a1, 0.7)])["keys_fused"] == 0  # unchanged set: skipped
    assert tr.loras[0][0] is a1 or tr.loras[0][0] is a2
    tr.close()


def test_peft_state_dict_and_config(tmp_path):
    folder = os.path.join(PEFT, "patterns")
    base = os.path.join(PEFT, "base_f32.safetensors")
    want = offline(base, [(folder, 0.75)], str(tmp_path / "p.safetensors"))
    sd = {k: v for k, (dt, v) in st_io.read(os.path.join(folder, "adapter_model.safetensors")).items()}
    cfg = json.load(open(os.path.join(folder, "adapter_config.json")))
    t = load_numpy(base)
    lorakit.fuse_(t, [(lorakit.Adapter.from_state_dict(sd, cfg), 0.75)])
    assert lorakit.digest_tensors(t) == want
    # without its config the alphas differ (r instead of the patterns): other bytes
    t = load_numpy(base)
    with pytest.warns(lorakit.LoraWarning, match="alpha defaults to r"):
        lorakit.fuse_(t, [(lorakit.Adapter.from_state_dict(sd), 0.75)])
    assert lorakit.digest_tensors(t) != want
    t = load_numpy(base)
    lorakit.fuse_(t, [(lorakit.Adapter.load(folder), 0.75)])  # the folder read into memory
    assert lorakit.digest_tensors(t) == want


def test_errors_name_the_adapter(model):
    bad = lorakit.Adapter.from_state_dict({k: v for k, (dt, v) in st_io.read(model["badshape"]).items()},
                                          name="mine")
    t = load_numpy(model["base"])
    before = {k: v.copy() for k, v in t.items()}
    with pytest.raises(lorakit.LoraError, match=r"mine@[0-9a-f]{32}.*lora_A"):
        lorakit.fuse_(t, [(bad, 1.0)])
    assert all(t[k].tobytes() == before[k].tobytes() for k in t)
    with pytest.raises(lorakit.LoraError, match="mine@"):
        lorakit.fuse_(t, [lorakit.Adapter(b"\x08\0\0\0\0\0\0\0{}      ", name="mine")])  # no tensors: an error
    with pytest.raises(TypeError, match="must be a dict, a PEFT LoraConfig or JSON"):
        lorakit.Adapter(b"", 42)


def test_warnings_reach_python_logging(model, caplog):
    """The C library's warning (here: a PEFT adapter without a config, so
    alpha defaults to r) is a record on the `lorakit` logger and a
    LoraWarning, not a line on C stderr."""
    sd = {"base_model.model." + k[len("transformer."):]: v for k, (dt, v) in st_io.read(model["a2"]).items()}
    ad = lorakit.Adapter.from_state_dict(sd, name="nocfg")
    t = load_numpy(model["base"])
    with caplog.at_level("WARNING", logger="lorakit"), pytest.warns(lorakit.LoraWarning, match="alpha defaults to r"):
        lorakit.fuse_(t, [(ad, 1.0)])
    assert any(r.name == "lorakit" and "nocfg@" in r.getMessage() and "alpha defaults to r" in r.getMessage()
               for r in caplog.records), caplog.records
    with pytest.raises(ValueError, match="level must be one of"):
        lorakit.set_log_level("loud")
