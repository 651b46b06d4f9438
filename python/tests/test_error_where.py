"""LoraError carries .path and .key where the library knows them (the file
and the tensor key the failure is about), None where it does not. Oracle:
the names the test itself wrote into its files (conftest.make_model: the
"unmatched" adapter holds module blocks.9.ff, no model weight has that
name; "badshape" holds blocks.0.attn.to_q with A of IN+1 columns)."""
import os

import pytest

import lorakit
from conftest import load_numpy


def _fuse_error(model, adapter):
    t = load_numpy(model["base"])
    before = {k: v.tobytes() for k, v in t.items()}
    with pytest.raises(lorakit.LoraError) as ei:
        lorakit.fuse_(t, [(adapter, 1.0)])
    assert {k: v.tobytes() for k, v in t.items()} == before  # a failed fuse changes nothing
    return ei.value


def test_unmatched_module_names_path_and_key(model):
    e = _fuse_error(model, model["unmatched"])
    assert e.status == "LK_ERR_UNMATCHED"
    assert e.path == model["unmatched"]
    assert e.key == "blocks.9.ff"
    assert "blocks.9.ff" in str(e)


def test_bad_shape_names_path_and_key(model):
    e = _fuse_error(model, model["badshape"])
    assert e.status == "LK_ERR_SHAPE"
    assert (e.path, e.key) == (model["badshape"], "blocks.0.attn.to_q")


def test_offline_fuse_names_the_adapter(model):
    out = os.path.join(model["dir"], "o.safetensors")
    with pytest.raises(lorakit.LoraError) as ei:
        lorakit.fuse(model["base"], [(model["unmatched"], 1.0)], out)
    assert (ei.value.path, ei.value.key) == (model["unmatched"], "blocks.9.ff")
    assert not os.path.exists(out)


def test_malformed_file_names_its_path(model):
    bad = os.path.join(model["dir"], "trunc.safetensors")
    with open(model["a1"], "rb") as f:
        data = f.read()
    with open(bad, "wb") as f:
        f.write(data[: len(data) // 2])  # the header promises bytes that are not there
    e = _fuse_error(model, bad)
    assert e.path == bad and e.key is None


def test_in_memory_adapter_names_its_label_and_key(model):
    import st_io
    sd = {k: v for k, (dt, v) in st_io.read(model["unmatched"]).items()}
    ad = lorakit.Adapter.from_state_dict(sd, name="mine")
    e = _fuse_error(model, ad)
    assert e.path is not None and e.path.startswith("mine@")
    assert e.key == "blocks.9.ff"


def test_unknown_where_is_none():
    tr = lorakit.Tracker({})
    tr.close()
    with pytest.raises(lorakit.LoraError) as ei:
        tr.apply([])
    assert ei.value.status == "LK_ERR_STATE"
    assert (ei.value.path, ei.value.key) == (None, None)
