"""The binding's CUDA code paths run on lorakit's `emul` device (no GPU
needed; lorakit._testing explains the hook): tensors in emul device memory
that report themselves as CUDA (kDLCUDA) go through fuse_, digest_tensors,
check_replicas, Tracker and lorakit.Adapter exactly as torch CUDA tensors
do, and the device branch is taken end to end (the device kernel, device
backups, device digests).

Oracle: the CPU path, the offline `lorakit.fuse` of the same checkpoint
written to a file and read back by the tests' own safetensors reader
(st_io), itself tested against float64 references and the CLI elsewhere
(test_lorakit.py). Every comparison is byte for byte, per tensor. The emul
device's counters (copies by kind and bytes, kernel launches) show where
the bytes went: a LoRA fuse on emul weights makes no device->host copy at
all, runs the device kernel, and backs up on the device."""
import os

import numpy as np
import pytest

import lorakit
from lorakit import _testing as lt
from conftest import make_model
import st_io


@pytest.fixture
def m(tmp_path):
    return make_model(tmp_path, bf16=True)


def on_emul(path):
    """Every tensor of a checkpoint as an EmulTensor."""
    return {k: lt.to_emul(dt, a) for k, (dt, a) in st_io.read(path).items()}


def offline(m, loras, name, **kw):
    """{name: bytes} of the CPU path's result: lorakit.fuse to a file."""
    out = os.path.join(m["dir"], name + ".safetensors")
    lorakit.fuse(m["base"], loras, out, **kw)
    return {k: a.tobytes() for k, (_, a) in st_io.read(out).items()}


def raw(ts):
    return {k: t.tobytes() for k, t in ts.items()}


def delta(a, b):
    return {k: b[k] - a[k] for k in a}


def test_fuse_lora_on_emul_equals_cpu_with_no_host_copy(m):
    loras = [(m["a1"], 0.7), (m["a2"], -1.5)]
    want = offline(m, loras, "want")
    ts = on_emul(m["base"])
    with lt.emul_as_cuda():
        c0 = lt.emul_counts()
        s = lorakit.fuse_(ts, loras)
        c1 = lt.emul_counts()
    assert raw(ts) == want
    d = delta(c0, c1)
    # three LoRA keys (F32 to_q, F16 to_k, BF16 blocks.1 to_q), all by the device kernel
    assert s["device"] == "emul" and s["tensors_fused"] == 3
    assert s["keys_device"] == 3 and s["keys_host_fallback"] == 0
    # nothing of the weights came back to the host: the only device->host
    # copies are the kernel's non-finite verdicts, one 8-byte slot per key
    assert d["d2h"] == 3 and d["d2h_bytes"] == 3 * 8, d
    assert d["launches"] >= 3 and d["h2d"] >= 3  # the kernel ran; the factors went up
    touched = 24 * 40 * 4 + 24 * 40 * 2 + 16 * 40 * 2  # the backup: D2D copies of the touched keys
    assert d["d2d_bytes"] == touched


def test_fuse_with_a_host_path_kind_on_emul_equals_cpu(m, tmp_path):
    """A LoRA bias term (1-D: the device kernel's host path) beside 2-D LoRA
    terms: the same bytes as the CPU; the summary counts the host-path key;
    the only device->host bytes are that key's."""
    rng = np.random.default_rng(3)
    t = {"transformer.blocks.0.attn.to_q.lora_A.weight": ("F32", rng.uniform(-1, 1, (2, 40)).astype(np.float32)),
         "transformer.blocks.0.attn.to_q.lora_B.weight": ("F32", rng.uniform(-1, 1, (24, 2)).astype(np.float32)),
         "transformer.blocks.0.attn.to_q.lora_B.bias": ("F32", rng.uniform(-1, 1, (24,)).astype(np.float32))}
    p = str(tmp_path / "bias.safetensors")
    st_io.write(p, t)
    want = offline(m, [(p, 0.5)], "want_bias")
    ts = on_emul(m["base"])
    with lt.emul_as_cuda():
        c0 = lt.emul_counts()
        s = lorakit.fuse_(ts, [(p, 0.5)])
        d = delta(c0, lt.emul_counts())
    assert raw(ts) == want
    # since c280f1e 1-D vector terms run on the device too: both keys by the device
    # kernels, the only device->host bytes their two 8-byte verdict slots
    assert s["keys_device"] == 2 and s["keys_host_fallback"] == 0
    assert d["d2h_bytes"] == 2 * 8, d


def test_failed_fuse_on_emul_restores_every_byte(m):
    """F16 to_k overflows (conftest's "overflow" adapter): LK_ERR_NONFINITE
    after to_q was fused on the device; the device backup puts every key
    back, so all bytes equal the base's."""
    base = {k: a.tobytes() for k, (_, a) in st_io.read(m["base"]).items()}
    ts = on_emul(m["base"])
    with lt.emul_as_cuda():
        c0 = lt.emul_counts()
        with pytest.raises(lorakit.LoraError) as e:
            lorakit.fuse_(ts, [(m["overflow"], 1.0)])
        d = delta(c0, lt.emul_counts())
    assert e.value.status == "LK_ERR_NONFINITE"
    assert raw(ts) == base
    # to_q (F32) backed up and fused on the device, to_k backed up, then both restored
    assert d["launches"] >= 2 and d["d2d_bytes"] == 2 * (24 * 40 * 4 + 24 * 40 * 2), d


def test_digest_and_check_replicas_on_emul(m):
    ts = on_emul(m["base"])
    want = lorakit.digest(m["base"])  # the file's digest: the CPU reader's
    with lt.emul_as_cuda():
        assert lorakit.digest_tensors(ts) == want
        assert lorakit.check_replicas(ts, "self") is True


def test_tracker_on_emul_equals_offline_fuse(m):
    ts = on_emul(m["base"])
    base = raw(ts)
    with lt.emul_as_cuda():
        with lorakit.Tracker(ts, comm="self") as t:
            r = t.apply([(m["a1"], 0.7), (m["a2"], -1.5)], digest=True)
            assert raw(ts) == offline(m, [(m["a1"], 0.7), (m["a2"], -1.5)], "want_t")
            assert r["digests_agree"] is True
            t.apply([(m["a2"], 1.25)])
            assert raw(ts) == offline(m, [(m["a2"], 1.25)], "want_t2")
            t.reset()
    assert raw(ts) == base


def test_tracker_queues_its_device_work_on_the_given_stream(m, monkeypatch):
    """Tracker.apply/reset hand torch's current stream (_stream_handle: the
    cudaStream_t as an int) to the C tracker, which queues every copy and
    kernel launch of the call there. Oracle: the emul device's own record of
    the stream each copy/launch was queued on (the handle lk_stream_wrap was
    given, kept as a tag), and the offline CPU fuse's bytes."""
    tag = 0x5EED0
    monkeypatch.setattr(lorakit, "_stream_handle", lambda named: tag)
    ts = on_emul(m["base"])
    base = raw(ts)
    with lt.emul_as_cuda():
        with lorakit.Tracker(ts, comm="self", threads=2) as t:
            for fuses, call in ((True, lambda: t.apply([(m["a1"], 0.7), (m["a2"], -1.5)])),
                                (True, lambda: t.apply([(m["a2"], 1.25)])), (False, t.reset)):
                c0 = lt.emul_counts()
                call()
                d = delta(c0, lt.emul_counts())
                assert d["on_stream"] > 0 and d["on_default"] == 0, d
                assert lt.emul_counts()["last_stream"] == tag
                if fuses:
                    assert d["launches"] > 0, d  # the fuse kernel ran (on that stream)
                else:
                    # reset only copies, and fingerprints keys on the device (3 launches each: the words and
                    # two sums, one 8-byte copy down): the 3 keys the tracker wrote (a1's blocks.0 to_q, to_k,
                    # a2's blocks.1 to_q) checked first, then a2's 2 keys it rewrote
                    assert d["launches"] == 3 * (3 + 2) and d["d2h"] == 3 + 2 and d["d2h_bytes"] == 8 * 5, d
            assert raw(ts) == base
            t.apply([(m["a2"], 1.25)])
            assert raw(ts) == offline(m, [(m["a2"], 1.25)], "want_s")


def test_adapter_in_memory_on_emul(m):
    """lorakit.Adapter (bytes in this process) fused into emul weights: the
    bytes of the file-based CPU fuse."""
    ad = lorakit.Adapter.load(m["a1"])
    want = offline(m, [(m["a1"], 0.3)], "want_ad")
    ts = on_emul(m["base"])
    with lt.emul_as_cuda():
        lorakit.fuse_(ts, [(ad, 0.3)])
    assert raw(ts) == want


def test_mixed_emul_and_host_are_refused_naming_keys(m):
    ts = on_emul(m["base"])
    ts["pos_ids"] = np.arange(7, dtype=np.int64)
    before = raw({k: v for k, v in ts.items() if k != "pos_ids"})
    with lt.emul_as_cuda():
        with pytest.raises(ValueError, match=r"is on cuda:0, pos_ids is on cpu"):
            lorakit.fuse_(ts, [(m["a1"], 1.0)])
        with pytest.raises(ValueError, match=r"pos_ids is on cpu"):
            lorakit.digest_tensors(ts)
    assert raw({k: v for k, v in ts.items() if k != "pos_ids"}) == before


def test_hook_off_emul_memory_is_not_taken_as_cuda(m):
    """Without the hook, a kDLCUDA tensor is a CUDA tensor: this build has no
    GPU or driver here, so lorakit says so (and names the key's device)."""
    ts = on_emul(m["base"])
    if lorakit._lorakit.EmulTensor is None:  # pragma: no cover
        pytest.skip("no EmulTensor")
    with pytest.raises(lorakit.LoraError, match="cuda:0: no CUDA driver or device is available|not built with"):
        lorakit.fuse_(ts, [(m["a1"], 1.0)])


def test_host_communicator_gets_device_buffers_over_torch(tmp_path):
    """sync_grads on emul gradients over a torch.distributed group at 2
    ranks (gloo; emul_host_worker.py): the host communicator's callbacks
    receive the device buffers themselves as DLPack capsules, and the bytes
    equal the host path's over the same group."""
    import subprocess
    import sys
    torch = pytest.importorskip("torch", reason="PyTorch is not installed (CI has none): run with a Python that has it")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("this PyTorch has no gloo backend")
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1")
    for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MPI_LOCALNRANKS", "WORLD_SIZE", "RANK"):
        env.pop(v, None)
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        str(29700 + os.getpid() % 1000), os.path.join(here, "emul_host_worker.py")],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.stdout.count("emul host checks passed") == 2, r.stdout + r.stderr


def factor_upload(m, loras, dtypes):
    """{weight key: bytes the device kernel needs uploaded for it}, by hand
    from the design (README "Devices"): the CPU's prepared factors B' (O x R)
    and A (R x I) of every LoRA term stacked on the key, in the accumulator's
    precision (double for F32 weights, float for F16/BF16), unpadded on the
    portable kernel path, plus the key's 8-byte non-finite verdict slot."""
    rank = {}
    for path, _ in loras:
        path = path if isinstance(path, str) else m[path.name.split(".")[0]]  # Adapter.load's name: the file's
        for k, (_, a) in st_io.read(path).items():
            if k.endswith(".lora_A.weight"):
                w = k[len("transformer."):-len(".lora_A.weight")] + ".weight"
                r, i = a.shape
                rank.setdefault(w, [0, i])[0] += r
    out = {}
    for w, (r, i) in rank.items():
        o = {"blocks.1.attn.to_q.weight": 16}.get(w, 24)
        out[w] = 8 + (8 if dtypes[w] == "F32" else 4) * r * (i + o)
    return out


def test_adapter_factors_uploaded_once_per_apply(m, monkeypatch):
    """Each factor of a lorakit.Adapter crosses host->device once per call
    that fuses its key (fuse_, Tracker.apply), in the accumulator's
    precision, and is not kept on the device between calls: a Tracker step
    uploads the factors of the keys it fuses again (restored to the base,
    then fused with the whole new set) plus, for keys it restores, their
    base bytes from the pinned host backup (but at a key's first fuse: it
    was backed up in that call and holds them already); a key whose set did
    not change uploads nothing. Oracle: factor_upload (sizes by hand from the shapes)
    and the keys' sizes; the emul device counts every copy it makes. The
    bytes equal the CPU fuse's."""
    monkeypatch.setenv("LORAKIT_KERNEL", "portable")  # no panel padding: the factors' bytes exactly
    dts = {k: dt for k, (dt, _) in st_io.read(m["base"]).items()}
    size = {k: a.nbytes for k, (_, a) in st_io.read(m["base"]).items()}
    ad1, ad2 = lorakit.Adapter.load(m["a1"]), lorakit.Adapter.load(m["a2"])
    both = [(ad1, 0.7), (ad2, -1.5)]
    ts = on_emul(m["base"])
    with lt.emul_as_cuda():
        c0 = lt.emul_counts()
        lorakit.fuse_(ts, both)
        d = delta(c0, lt.emul_counts())
    up = factor_upload(m, both, dts)
    assert sorted(up) == ["blocks.0.attn.to_k.weight", "blocks.0.attn.to_q.weight", "blocks.1.attn.to_q.weight"]
    assert d["h2d_bytes"] == sum(up.values()), (d, up)
    assert d["h2d"] == 3 * len(up), d  # per key: its verdict slot, A, B' (the terms stacked in each)
    assert raw(ts) == offline(m, both, "want_once")

    ts = on_emul(m["base"])
    # (set, the keys it fuses, the keys it only restores): to_k keeps a1 at step 1 (untouched);
    # blocks.1 keeps a2 at step 2
    steps = [([(ad1, 0.7)], {"blocks.0.attn.to_q.weight", "blocks.0.attn.to_k.weight"}, set()),
             (both, {"blocks.0.attn.to_q.weight", "blocks.1.attn.to_q.weight"}, set()),
             ([(ad2, -1.5)], {"blocks.0.attn.to_q.weight"}, {"blocks.0.attn.to_k.weight"})]
    seen = set()  # keys the tracker has backed up: their first fuse needs no restore
    with lt.emul_as_cuda(), lorakit.Tracker(ts, comm="self") as t:
        for i, (loras, fused, dropped) in enumerate(steps):
            c0 = lt.emul_counts()
            t.apply(loras)
            d = delta(c0, lt.emul_counts())
            up = factor_upload(m, loras, dts)
            # every key it fuses starts from its base bytes, copied up from the pinned backup, but at
            # the key's first fuse (backed up in this call, the weight holds them already)
            restored = (fused | dropped) & seen
            want = sum(up[k] for k in fused) + sum(size[k] for k in restored)
            assert d["h2d_bytes"] == want, (i, d, {k: up[k] for k in fused}, dropped, restored)
            assert d["h2d"] == 3 * len(fused) + len(restored), d  # + one copy of the base bytes per restored key
            seen |= fused | dropped
            assert raw(ts) == offline(m, [(m[a.name.split(".")[0]], s) for a, s in loras], f"want_step{i}")
