"""lorakit's Python package in one process, on NumPy arrays (PyTorch cases
in test_torch.py). Oracles: the lorakit CLI's own output (digests, --json)
for the same files, a float64 reference of W + sum s * c * B A written here
(within 1 ulp of the weight's dtype), the digest of a file written by our
independent NumPy safetensors writer (st_io), and byte copies taken before
every failing call."""
import copy
import json
import os

import numpy as np
import pytest

import lorakit
import st_io
from conftest import IN, OUT, cli, load_numpy

Q, K = "blocks.0.attn.to_q.weight", "blocks.0.attn.to_k.weight"


def snapshot(d):
    return {k: v.copy() for k, v in d.items()}


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].tobytes() == b[k].tobytes(), k


def cli_fuse_digest(m, loras, tmp="cli_out.safetensors", *extra):
    out = os.path.join(m["dir"], tmp)
    args = ["fuse", m["base"], "-o", out, "--json", *extra]
    for p, s in loras:
        args += ["-l", f"{p}:{s}"]
    summary = json.loads(cli(*args).stdout)
    return cli("digest", out).stdout.strip(), summary, out


def test_version_and_error_type():
    assert lorakit.__version__.count(".") == 2
    assert issubclass(lorakit.LoraError, RuntimeError)


def test_digest_and_inspect_match_cli(model):
    assert lorakit.digest(model["base"]) == cli("digest", model["base"]).stdout.strip()
    for p in (model["base"], model["a1"]):
        assert lorakit.inspect(p) == json.loads(cli("inspect", p, "--json").stdout)
    info = lorakit.inspect(model["a1"])
    assert info["format"] == "diffusers" and info["module_count"] == 2
    with pytest.raises(lorakit.LoraError) as e:
        lorakit.digest(os.path.join(model["dir"], "missing.safetensors"))
    assert e.value.status == "LK_ERR_IO" and "missing.safetensors" in str(e.value)


def test_digest_tensors_equals_file_digest(model):
    # NumPy round trip: arrays -> our writer -> lorakit.digest == digest_tensors
    t = load_numpy(model["base"])
    assert lorakit.digest_tensors(t) == lorakit.digest(model["base"])
    p = os.path.join(model["dir"], "rt.safetensors")
    t[Q][0, 0] += 1.0
    st_io.write(p, {k: ({np.float32: "F32", np.float16: "F16", np.int64: "I64"}[v.dtype.type], v)
                    for k, v in t.items()})
    assert lorakit.digest_tensors(t) == lorakit.digest(p) != lorakit.digest(model["base"])


def test_fuse_file_matches_cli(model):
    loras = [(model["a1"], 0.8), (model["a2"], -1.25)]
    want, cli_sum, _ = cli_fuse_digest(model, loras)
    out = os.path.join(model["dir"], "py_out.safetensors")
    s = lorakit.fuse(model["base"], loras, out)
    assert lorakit.digest(out) == want
    for k in ("adapters", "tensors_total", "tensors_fused", "modules_unmatched", "base"):
        assert s[k] == cli_sum[k], k
    assert s["out"] == out
    # a failing fuse writes nothing
    bad = os.path.join(model["dir"], "bad_out.safetensors")
    with pytest.raises(lorakit.LoraError) as e:
        lorakit.fuse(model["base"], [(model["unmatched"], 1.0)], bad)
    assert e.value.status == "LK_ERR_UNMATCHED" and not os.path.exists(bad)
    with pytest.raises(lorakit.LoraError, match="same file"):
        lorakit.fuse(model["base"], [(model["a1"], 1.0)], model["base"])


def test_fuse_inplace_equals_cli_and_reference(model):
    loras = [(model["a2"], -1.25), (model["a1"], 0.8)]
    want, cli_sum, _ = cli_fuse_digest(model, loras)
    t = load_numpy(model["base"])
    base = snapshot(t)
    ids = {k: id(v) for k, v in t.items()}
    s = lorakit.fuse_(t, loras, threads=2)
    assert {k: id(v) for k, v in t.items()} == ids  # in place: the same arrays
    assert lorakit.digest_tensors(t) == want
    assert s["tensors_fused"] == cli_sum["tensors_fused"] == 2 and s["tensors_total"] == 4
    assert "base" not in s and s["adapters"] == [{"path": model["a2"], "strength": -1.25},
                                                 {"path": model["a1"], "strength": 0.8}]
    # float64 reference: a1 has alpha 2 (scale 2/4 on to_q, 2/2 on to_k), a2 none (scale 1)
    a1, a2 = st_io.read(model["a1"]), st_io.read(model["a2"])

    def term(ad, m, s, c):
        A = ad[f"transformer.{m}.lora_A.weight"][1].astype(np.float64)
        B = ad[f"transformer.{m}.lora_B.weight"][1].astype(np.float64)
        # the kernel's scale: (float)(strength as float * module scale)
        sc = np.float64(np.float32(np.float64(np.float32(s)) * c))
        return sc * (B @ A), abs(sc) * (np.abs(B) @ np.abs(A)), A.shape[0]

    def check(got, w, terms, dt):
        ref = w.astype(np.float64) + sum(t[0] for t in terms)
        tol = np.spacing(np.abs(ref).astype(dt)).astype(np.float64)
        if dt == np.float32:  # plus the fp32 summation bound, as tests/util/adapter_ref.c allows
            tol += (sum(t[2] for t in terms) + 2) * 2.0 ** -24 * sum(t[1] for t in terms)
        assert np.all(np.abs(got.astype(np.float64) - ref) <= tol)

    check(t[Q], base[Q], [term(a1, "blocks.0.attn.to_q", 0.8, 0.5), term(a2, "blocks.0.attn.to_q", -1.25, 1.0)],
          np.float32)
    check(t[K], base[K], [term(a1, "blocks.0.attn.to_k", 0.8, 1.0)], np.float16)
    assert t["blocks.0.attn.to_q.bias"].tobytes() == base["blocks.0.attn.to_q.bias"].tobytes()
    assert t["pos_ids"].tobytes() == base["pos_ids"].tobytes()


def test_strength_zero_and_empty_leave_bytes(model):
    t = load_numpy(model["base"])
    before = snapshot(t)
    assert lorakit.fuse_(t, [(model["a1"], 0.0)])["tensors_fused"] == 0
    assert lorakit.fuse_(t, [])["tensors_fused"] == 0
    assert_same(t, before)


def expect_unchanged(t, exc, match, fn):
    before = snapshot(t)
    with pytest.raises(exc, match=match) as e:
        fn()
    assert_same(t, before)
    return e.value


def test_fuse_inplace_errors_change_nothing(model):
    t = load_numpy(model["base"])
    a1 = [(model["a1"], 1.0)]
    # every value is checked before any write: the bad one comes after Q, which a1 would fuse
    for bad, exc, match in (
        (np.zeros(3, np.complex64), TypeError, "extra: dtype"),
        ([1.0, 2.0], TypeError, "extra: list is neither"),
    ):
        t2 = dict(t, extra=bad)
        expect_unchanged(t, exc, match, lambda: lorakit.fuse_(t2, a1))
    # a non-contiguous tensor no adapter writes is left alone (test_tied.py: one an adapter writes)
    extra = np.arange(OUT * 2 * IN, dtype=np.float32).reshape(OUT, 2 * IN)[:, ::2]
    t2 = {k: v.copy() for k, v in t.items()}
    assert lorakit.fuse_({**t2, "extra": extra}, a1)["tensors_fused"] >= 1
    assert np.array_equal(extra, np.arange(OUT * 2 * IN, dtype=np.float32).reshape(OUT, 2 * IN)[:, ::2])
    ro = t[Q].copy()
    ro.flags.writeable = False
    t3 = dict(t)
    t3[Q] = ro
    expect_unchanged(t3, ValueError, f"{Q}: read-only", lambda: lorakit.fuse_(t3, a1))
    expect_unchanged(t, TypeError, "names must be str", lambda: lorakit.fuse_({**t, 3: t[Q]}, a1))
    expect_unchanged(t, TypeError, "None is not a tensor", lambda: lorakit.fuse_({**t, "x": None}, a1))
    expect_unchanged(t, TypeError, "mapping", lambda: lorakit.fuse_(list(t.values()), a1))
    # adapter failures (LoraError, with the lk_status name)
    for loras, status, match in (
        ([(model["unmatched"], 1.0)], "LK_ERR_UNMATCHED", "blocks.9.ff"),
        ([(model["a1"], 1.0), (model["badshape"], 1.0)], "LK_ERR_SHAPE", "blocks.0.attn.to_q"),
        ([(os.path.join(model["dir"], "nope.safetensors"), 1.0)], "LK_ERR_IO", "nope.safetensors"),
        ([(model["a1"], float("nan"))], "LK_ERR_ARG", "not finite"),
        ([(model["a1"], 1.0, "nosuchformat")], "LK_ERR_ARG", "nosuchformat"),
        ([(model["overflow"], 1.0)], "LK_ERR_NONFINITE", K),  # to_q is fused first, then rolled back
    ):
        e = expect_unchanged(t, lorakit.LoraError, match, lambda: lorakit.fuse_(t, loras))
        assert e.status == status, (loras, e.status, str(e))
    for loras in ([("x", "strong")], [42], "a.safetensors", [(model["a1"],)]):
        expect_unchanged(t, TypeError, "loras", lambda: lorakit.fuse_(t, loras))


def test_allow_unmatched(model):
    t = load_numpy(model["base"])
    s = lorakit.fuse_(t, [(model["unmatched"], 1.0)], allow_unmatched=True)
    assert s["modules_unmatched"] == 1 and s["tensors_fused"] == 1
    want, _, _ = cli_fuse_digest(model, [(model["unmatched"], 1.0)], "u.safetensors", "--allow-unmatched")
    assert lorakit.digest_tensors(t) == want


def test_float64_target_is_refused_by_name(model):
    t = load_numpy(model["base"])
    t[Q] = t[Q].astype(np.float64)
    e = expect_unchanged(t, lorakit.LoraError, Q, lambda: lorakit.fuse_(t, [(model["a1"], 1.0)]))
    assert e.status in ("LK_ERR_DTYPE", "LK_ERR_SHAPE", "LK_ERR_UNSUPPORTED")


def test_tracker_one_process(model):
    t = load_numpy(model["base"])
    clean = snapshot(t)
    tr = lorakit.Tracker(t, bucket_mb=1)
    assert tr.loras == []
    r = tr.apply([(model["a1"], 0.8), (model["a2"], -1.25)], digest=True)
    want, _, _ = cli_fuse_digest(model, [(model["a1"], 0.8), (model["a2"], -1.25)])
    assert r["status"] == "ok" and r["digest"] == want and r["digests_agree"] is True
    assert lorakit.digest_tensors(t) == want
    assert r["keys_fused"] == 2 and set(r) >= {"keys_restored", "bytes_broadcast", "seconds", "skipped", "phases"}
    assert tr.loras == [(model["a1"], 0.8), (model["a2"], -1.25)]
    assert tr.apply([(model["a2"], -1.25), (model["a1"], 0.8)])["skipped"] is True  # order-insensitive
    # a failed apply leaves the tensors and the applied set as they were
    fused = snapshot(t)
    for loras, status in (([(model["a1"], 1.0), (model["unmatched"], 1.0)], "LK_ERR_UNMATCHED"),
                          ([(model["overflow"], 1.0)], "LK_ERR_NONFINITE")):
        e = expect_unchanged(t, lorakit.LoraError, None, lambda: tr.apply(loras))
        assert e.status == status
    expect_unchanged(t, TypeError, "loras", lambda: tr.apply([(model["a1"], "x")]))
    assert_same(t, fused)
    assert sorted(tr.loras) == [(model["a1"], 0.8), (model["a2"], -1.25)]
    want1, _, _ = cli_fuse_digest(model, [(model["a1"], 1.0)], "one.safetensors")
    r = tr.apply([model["a1"]])
    assert lorakit.digest_tensors(t) == want1 and r["keys_fused"] == 2
    r = tr.reset(digest=True)
    assert r["digest"] == lorakit.digest(model["base"])
    assert_same(t, clean)
    assert tr.loras == []
    tr.close()
    with pytest.raises(lorakit.LoraError, match="closed"):
        tr.apply([])


def test_tracker_no_lora_swap_and_args(model):
    t = load_numpy(model["base"])
    tr = lorakit.Tracker(t, no_lora_swap=True)
    tr.apply([(model["a1"], 1.0)])
    with pytest.raises(lorakit.LoraError) as e:
        tr.apply([(model["a2"], 1.0)])
    assert e.value.status == "LK_ERR_STATE"
    with pytest.raises(ValueError, match="bucket_mb"):
        lorakit.Tracker(load_numpy(model["base"]), bucket_mb=0)
    ro = load_numpy(model["base"])
    ro[K].flags.writeable = False
    with pytest.raises(ValueError, match=f"{K}: read-only"):
        lorakit.Tracker(ro)
    with pytest.raises(TypeError, match="comm"):
        lorakit.Tracker(t, comm="world")


def test_sync_grads_one_process():
    g = [np.arange(6, dtype=np.float32).reshape(2, 3), None]
    like = [None, np.ones((4,), np.float32)]
    out = lorakit.sync_grads(g, None, like=like)
    assert out[0] is g[0] and out[0].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert out[1].shape == (4,) and not out[1].any()
    # float16: averaged through a float32 copy and written back in place
    h = np.array([0.1, -3.5, 65504.0], np.float16)
    keep = h.copy()
    assert lorakit.sync_grads([h], None)[0] is h and h.dtype == np.float16 and np.array_equal(h, keep)
    with pytest.raises(TypeError, match=r"grads\[0\]: dtype F64, float32 expected"):
        lorakit.sync_grads([np.zeros(3, np.float64)], None)
    with pytest.raises(TypeError, match=r"^blocks.0.to_q.lora_A: dtype F64"):  # names= name the entries
        lorakit.sync_grads([np.zeros(3, np.float64)], None, names=["blocks.0.to_q.lora_A"])
    with pytest.raises(ValueError, match=r"grads\[0\] is None"):
        lorakit.sync_grads([None], None)
    assert lorakit.check_replicas({"a": g[0]}, None) is True


def test_knobs_bounds_and_zero_bytes(model):
    """Defaults and bounds come from the C table (lorakit/knobs.h): the
    signatures show its defaults (64 MiB, 4 MiB, 300 s, written here from the
    README), and a bucket out of bounds or under one byte is a ValueError
    naming the knob and value, never "the default" (before, bucket_mb=1e-9
    became 0 bytes and silently 4 MiB)."""
    import inspect as pyinspect
    k = lorakit._KNOBS
    assert (k["swap_bucket_mb"]["default"], k["swap_bucket_mb"]["min"], k["swap_bucket_mb"]["max"]) == (64, 1, 1048576)
    assert (k["sync_bucket_mb"]["default"], k["timeout_s"]["default"], k["threads"]["max"]) == (4, 300, 4096)
    sig = pyinspect.signature(lorakit.Tracker.__init__).parameters
    assert sig["bucket_mb"].default == 64 and sig["timeout"].default == 300.0 and sig["threads"].default == 0
    assert pyinspect.signature(lorakit.sync_grads).parameters["bucket_mb"].default == 4
    g = [np.ones(3, np.float32)]
    for bad, msg in ((1e-9, "bucket_mb: 1e-09 MiB rounds to 0 bytes"), (0, "bucket_mb: 0 MiB rounds to 0 bytes"),
                     (-1, r"bucket_mb: -1 MiB is outside 0\.\.1048576")):
        with pytest.raises(ValueError, match=msg):
            lorakit.sync_grads(g, None, bucket_mb=bad)
    assert lorakit.sync_grads(g, None, bucket_mb=1 / 1048576)[0].tolist() == [1, 1, 1]  # one byte: allowed
    t = load_numpy(model["base"])
    for bad, msg in ((0.5, r"bucket_mb: 0.5 MiB is outside 1\.\.1048576"), (2 ** 21, "outside 1..1048576")):
        with pytest.raises(ValueError, match=msg):
            lorakit.Tracker(t, bucket_mb=bad)
    with pytest.raises(ValueError, match=r"threads must be in 0\.\.4096, got 5000"):
        lorakit.Tracker(t, threads=5000)
    with pytest.raises(ValueError, match=r"seconds in 0\.\.1e9 \(0 = none\), got 2e\+09"):
        lorakit.Tracker(t, timeout=2e9)
    with pytest.raises(ValueError, match=r"threads must be in 0\.\.4096, got -1"):
        lorakit.fuse_(t, [], threads=-1)


def test_ml_dtypes_bfloat16(model_bf16):
    ml = pytest.importorskip("ml_dtypes", reason="ml_dtypes is not installed (BF16 NumPy arrays need it)")
    t = {k: (a.view(ml.bfloat16) if dt == "BF16" else a) for k, (dt, a) in st_io.read(model_bf16["base"]).items()}
    loras = [(model_bf16["a1"], 1.0), (model_bf16["a2"], 0.5)]
    want, _, _ = cli_fuse_digest(model_bf16, loras)
    lorakit.fuse_(t, loras)
    assert lorakit.digest_tensors(t) == want



def test_gil_released_during_tracker_calls(tmp_path):
    # Thread A applies a set (a long call); this thread watches tr.busy
    # meanwhile. It sees True across most of the C call only if A released
    # the GIL for it; held, this thread could run only around the call (the
    # agreement's GIL release gives it one switch interval, 5 ms). Oracle:
    # the span of True observations against the call's own seconds. Then a
    # second call during A's is refused, not run concurrently.
    import threading
    import time

    rng = np.random.default_rng(1)
    n, d = 200, 192
    sd = {f"l{i}.weight": rng.standard_normal((d, d), dtype=np.float32) for i in range(n)}
    ad = {}
    for i in range(n):
        ad[f"l{i}.lora_A.weight"] = ("F32", rng.standard_normal((16, d), dtype=np.float32))
        ad[f"l{i}.lora_B.weight"] = ("F32", rng.standard_normal((d, 16), dtype=np.float32))
    p = str(tmp_path / "big.safetensors")
    st_io.write(p, ad)
    tr = lorakit.Tracker(sd, threads=1)
    seen, span, res = [], [], {}

    def apply():
        try:
            res.update(tr.apply([(p, 0.01)]))
        except lorakit.LoraError as e:
            seen.append(str(e))

    import sys
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.001)
    th = threading.Thread(target=apply)
    th.start()
    refused = None
    while th.is_alive():
        if tr.busy:
            span.append(time.perf_counter())
            if refused is None:
                try:
                    tr.reset()
                except lorakit.LoraError as e:
                    refused = str(e)
    th.join()
    sys.setswitchinterval(interval)
    assert not seen and tr.loras == [(p, 0.01)]
    assert span and span[-1] - span[0] >= 0.5 * res["seconds"], (span[-1] - span[0] if span else None, res)
    assert refused is None or "in use by another thread" in refused
    tr.close()


def test_inspect_base_matches_cli(tmp_path):
    """inspect(adapter, base=) is `lorakit inspect ADAPTER --base CKPT --json`:
    a diffusers Flux LoRA on a BFL single file lands on row 4..8 of linear1
    (the flux table: to_k is the second seventh); a misspelt module gets the
    three nearest weight names."""
    d = str(tmp_path)
    rng = np.random.default_rng(7)
    base, lora = os.path.join(d, "flux.safetensors"), os.path.join(d, "lora.safetensors")
    f32 = lambda *shape: ("F32", rng.standard_normal(shape).astype(np.float32))  # noqa: E731
    # (with the keys flux.lkmap's detect line needs: img_attn.qkv, img_attn.proj, img_in)
    st_io.write(base, {"model.diffusion_model.single_blocks.0.linear1.weight": f32(28, 4),
                       "model.diffusion_model.double_blocks.0.img_attn.proj.weight": f32(4, 4),
                       "model.diffusion_model.double_blocks.0.img_attn.qkv.weight": f32(12, 4),
                       "model.diffusion_model.img_in.weight": f32(4, 4)})
    t = {}
    for m in ("single_transformer_blocks.0.attn.to_k", "transformer_blocks.0.attn.to_outt"):
        t[f"transformer.{m}.lora_A.weight"] = f32(2, 4)
        t[f"transformer.{m}.lora_B.weight"] = f32(4, 2)
    st_io.write(lora, t)
    got = lorakit.inspect(lora, base=base)
    assert got == json.loads(cli("inspect", lora, "--base", base, "--json").stdout)
    assert got["family"] == "flux" and got["modules_placed"] == 1 and got["modules_unmatched"] == 1
    assert got["modules"][0]["component"] == "transformer"  # its key's transformer. prefix
    assert got["unmatched"][0]["component"] == "transformer"
    (p,) = got["modules"][0]["placements"]
    assert p["weight"] == "model.diffusion_model.single_blocks.0.linear1.weight"
    assert p["rows"] == [4, 8] and p["b_rows"] == [0, 4] and not p["whole"]
    assert got["unmatched"][0]["nearest"][0] == "model.diffusion_model.double_blocks.0.img_attn.proj.weight"
    with pytest.raises(lorakit.LoraError, match="--arch nope: no such family table"):
        lorakit.inspect(lora, base=base, arch="nope")


LAYOUTS = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "fixtures", "layouts")
FLUX_MAP = os.path.join(os.path.dirname(__file__), "..", "..", "data", "families", "flux.lkmap")


def test_arch_and_maps_in_fuse_and_tracker(tmp_path):
    """arch= / maps= in fuse, fuse_ and Tracker are `lorakit fuse --arch /
    --map`: a diffusers Flux LoRA on Flux's BFL single file (to_q/to_k/to_v/
    proj_mlp on row slices of the fused qkv and linear1) with no family
    table but the flux table given as a map gives the CLI's bytes (which
    test_layouts checks against diffusers' own fuse); with no table at all
    nothing lands and every call refuses, tensors unchanged."""
    base = os.path.join(LAYOUTS, "flux_bfl.safetensors")
    lora = os.path.join(LAYOUTS, "flux_lora_diffusers.safetensors")
    want_file = str(tmp_path / "cli.safetensors")
    cli("fuse", base, "-l", f"{lora}:0.8", "-o", want_file, "--arch", "none", "--map", FLUX_MAP)
    want = cli("digest", want_file).stdout.strip()
    assert want != cli("digest", base).stdout.strip()
    out = str(tmp_path / "py.safetensors")
    lorakit.fuse(base, [(lora, 0.8)], out, arch="none", maps=[FLUX_MAP])
    assert lorakit.digest(out) == want
    with pytest.raises(lorakit.LoraError, match="norm_out.linear matches no model weight"):
        lorakit.fuse(base, [(lora, 0.8)], str(tmp_path / "no.safetensors"), arch="none")
    assert not os.path.exists(tmp_path / "no.safetensors")
    t = load_numpy(base)
    lorakit.fuse_(t, [(lora, 0.8)], arch="none", maps=[FLUX_MAP])
    assert lorakit.digest_tensors(t) == want

    t = load_numpy(base)
    clean = lorakit.digest_tensors(t)
    tr = lorakit.Tracker(t, arch="none", maps=[FLUX_MAP], bucket_mb=1)
    assert tr.apply([(lora, 0.8)], digest=True)["digest"] == want
    assert tr.reset(digest=True)["digest"] == clean
    tr.close()
    tr = lorakit.Tracker(t, arch="flux")  # the shipped table, named: the same bytes
    assert tr.apply([(lora, 0.8)], digest=True)["digest"] == want
    tr.close()
    t = load_numpy(base)
    tr = lorakit.Tracker(t, arch="none")
    before = snapshot(t)
    with pytest.raises(lorakit.LoraError, match="norm_out.linear matches no model weight"):
        tr.apply([(lora, 0.8)])
    assert_same(t, before)
    tr.close()
    with pytest.raises(lorakit.LoraError, match="--arch nope: no such family table"):
        lorakit.Tracker(t, arch="nope")
    with pytest.raises(lorakit.LoraError, match="no-such.lkmap"):
        lorakit.Tracker(t, maps=[str(tmp_path / "no-such.lkmap")])
    with pytest.raises(TypeError, match="arch must be a family name"):
        lorakit.Tracker(t, arch=3)
    with pytest.raises(TypeError, match="maps must be a sequence of paths"):
        lorakit.fuse(base, [(lora, 1)], out, maps=FLUX_MAP)


def make_pipeline(d):
    """A diffusers pipeline folder from the layout fixtures: unet/ (the
    diffusers UNet), text_encoder/ (the SD single file's CLIP under
    transformers' names), model_index.json, scheduler/."""
    import shutil
    pipe = os.path.join(d, "pipe")
    for sub in ("unet", "text_encoder", "scheduler"):
        os.makedirs(os.path.join(pipe, sub))
    shutil.copy(os.path.join(LAYOUTS, "sd1_unet.safetensors"), os.path.join(pipe, "unet", "diffusion_pytorch_model.safetensors"))
    pre = "cond_stage_model.transformer."
    te = {k[len(pre):]: v for k, v in st_io.read(os.path.join(LAYOUTS, "sd1_single.safetensors")).items() if k.startswith(pre)}
    st_io.write(os.path.join(pipe, "text_encoder", "model.safetensors"), te)
    with open(os.path.join(pipe, "model_index.json"), "w") as f:
        json.dump({"_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet2DConditionModel"],
                   "text_encoder": ["transformers", "CLIPTextModel"]}, f)
    with open(os.path.join(pipe, "scheduler", "scheduler_config.json"), "w") as f:
        f.write('{"num_train_timesteps": 1000}\n')
    return pipe


def test_fuse_pipeline_folder(tmp_path):
    """fuse(PIPELINE_DIR, ...) is `lorakit fuse PIPELINE_DIR -o OUT_DIR`: a
    diffusers SD LoRA's unet. and text_encoder. modules go to their
    component folders (whose bytes test_layouts checks against diffusers'
    own fuse), the same files as the CLI's, the other files copied; arch and
    maps reach every component (arch="none" still fuses these diffusers
    names, which need no table; an unknown one is refused naming it)."""
    pipe = make_pipeline(str(tmp_path))
    lora = os.path.join(LAYOUTS, "sd1_lora_diffusers.safetensors")
    cli_out, py_out = str(tmp_path / "cli_out"), str(tmp_path / "py_out")
    cli("fuse", pipe, "-l", f"{lora}:0.9", "-o", cli_out)
    got = lorakit.fuse(pipe, [(lora, 0.9)], py_out, arch="none")
    assert got["modules_unmatched"] == 0 and got["tensors_fused"] > 0
    for f in ("unet/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors"):
        a, b, base = (os.path.join(x, f) for x in (cli_out, py_out, pipe))
        assert lorakit.digest(a) == lorakit.digest(b) != lorakit.digest(base), f
    for f in ("model_index.json", "scheduler/scheduler_config.json"):
        assert open(os.path.join(py_out, f), "rb").read() == open(os.path.join(pipe, f), "rb").read()
    with pytest.raises(lorakit.LoraError, match="--arch nope"):
        lorakit.fuse(pipe, [(lora, 0.9)], str(tmp_path / "nope"), arch="nope")
    assert not os.path.exists(tmp_path / "nope")


def test_inspect_base_pipeline_folder(tmp_path):
    """inspect(adapter, base=PIPELINE_DIR) is `lorakit inspect ADAPTER --base
    PIPELINE_DIR --json`: a diffusers SD LoRA's modules placed on the
    weights of their component folders (unet/..., text_encoder/...)."""
    pipe = make_pipeline(str(tmp_path))
    lora = os.path.join(LAYOUTS, "sd1_lora_diffusers.safetensors")
    got = lorakit.inspect(lora, base=pipe)
    assert got == json.loads(cli("inspect", lora, "--base", pipe, "--json").stdout)
    assert got["modules_unmatched"] == 0 and got["modules_placed"] > 0
    comps = {m["component"] for m in got["modules"]}
    assert comps == {"unet", "text_encoder"}
    for m in got["modules"]:
        for p in m["placements"]:
            assert p["weight"].startswith(m["component"] + "/"), (m["module"], p["weight"])
