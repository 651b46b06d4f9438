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


_ONE_WARNING = r"""
import logging, sys, warnings
sys.path.insert(0, sys.argv[1])
import lorakit, st_io
mode = sys.argv[4]
if mode == "basicConfig":
    logging.basicConfig(level=logging.INFO)
elif mode == "captureWarnings":
    logging.basicConfig(level=logging.INFO)
    logging.captureWarnings(True)
sd = {"base_model.model." + k[len("transformer."):]: v for k, (dt, v) in st_io.read(sys.argv[2]).items()}
t = {k: v for k, (dt, v) in st_io.read(sys.argv[3]).items()}
lorakit.fuse_(t, [(lorakit.Adapter.from_state_dict(sd, name="nocfg"), 1.0)])
"""


@pytest.mark.parametrize("mode", ["default", "basicConfig", "captureWarnings"])
def test_each_warning_printed_once(model, mode):
    """The C library's warning (a PEFT adapter without a config: alpha
    defaults to r) reaches stderr exactly once, whether logging is left
    alone (its last-resort handler used to print it beside the warning),
    configured with basicConfig, or capturing warnings. Oracle: the count
    of the message's lines in a fresh interpreter's stderr."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", _ONE_WARNING, HERE, model["a2"], model["base"], mode],
                       capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "default"})
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "alpha defaults to r" in ln]
    assert len(lines) == 1, r.stderr
    assert "nocfg@" in lines[0]


def test_warning_is_a_lorawarning(model, caplog):
    """The warning is a LoraWarning (filterable), and not a record on the
    `lorakit` logger (that would be its second copy)."""
    sd = {"base_model.model." + k[len("transformer."):]: v for k, (dt, v) in st_io.read(model["a2"]).items()}
    ad = lorakit.Adapter.from_state_dict(sd, name="nocfg")
    t = load_numpy(model["base"])
    with caplog.at_level("DEBUG", logger="lorakit"), pytest.warns(lorakit.LoraWarning, match="alpha defaults to r"):
        lorakit.fuse_(t, [(ad, 1.0)])
    assert not [r for r in caplog.records if "alpha defaults to r" in r.getMessage()], caplog.records
    with pytest.raises(ValueError, match="level must be one of"):
        lorakit.set_log_level("loud")
