"""lorakit's collective calls under mpirun (ctest runs this file at 2 and 4
ranks; alone it runs as one rank). Oracles: the lorakit CLI's offline fuse
digest of the same set, a mean written here in closed form (rank r holds
values r * 1000 + index), and byte copies taken before each failing call,
checked on every rank."""
import os

import numpy as np
import pytest

MPI = pytest.importorskip("mpi4py.MPI", reason="mpi4py is not installed")

import lorakit  # noqa: E402
import st_io  # noqa: E402
from conftest import cli, load_numpy, make_model  # noqa: E402

W = MPI.COMM_WORLD
R, N = W.Get_rank(), W.Get_size()


@pytest.fixture
def shared(tmp_path):
    """One model, written by rank 0 into a folder every rank sees."""
    d = W.bcast(str(tmp_path) if R == 0 else None, root=0)
    m = make_model(d, bf16=False) if R == 0 else None
    return W.bcast(m, root=0)


def snapshot(d):
    return {k: v.copy() for k, v in d.items()}


def same(a, b):
    return all(a[k].tobytes() == b[k].tobytes() for k in a)


def all_true(x):
    return all(W.allgather(bool(x)))


def test_tracker_swaps_equal_offline_fuse(shared):
    t = load_numpy(shared["base"])
    clean = snapshot(t)
    tr = lorakit.Tracker(t, comm=W, bucket_mb=1)
    loras = [(shared["a1"], 0.8), (shared["a2"], -1.25)]
    out = os.path.join(shared["dir"], "offline.safetensors")
    if R == 0:
        cli("fuse", shared["base"], "-l", f"{shared['a1']}:0.8", "-l", f"{shared['a2']}:-1.25", "-o", out)
    want = W.bcast(lorakit.digest(out) if R == 0 else None, root=0)
    r = tr.apply(loras if R % 2 == 0 else loras[::-1], digest=True)  # order does not matter
    assert r["digest"] == want and r["digests_agree"] is True
    assert lorakit.digest_tensors(t) == want
    assert r["keys_fused"] == 2  # summed over ranks: each key fused once, by its owner
    assert lorakit.check_replicas(t, W) is True
    r = tr.reset(digest=True)
    assert r["keys_restored"] == 2 and same(t, clean)
    tr.close()


def test_failure_on_one_rank_changes_nothing(shared):
    t = load_numpy(shared["base"])
    tr = lorakit.Tracker(t, comm=W)
    tr.apply([(shared["a1"], 1.0)])
    fused = snapshot(t)
    # the same relative path names a broken file on the last rank only
    d = os.path.join(shared["dir"], f"rank{R}")
    os.makedirs(d, exist_ok=True)
    src = shared["unmatched"] if R == N - 1 else shared["a2"]
    os.symlink(src, os.path.join(d, "x.safetensors"))
    cwd = os.getcwd()
    os.chdir(d)
    try:
        with pytest.raises(lorakit.LoraError) as e:
            tr.apply([(shared["a1"], 1.0), ("x.safetensors", 1.0)])
    finally:
        os.chdir(cwd)
    assert e.value.status == "LK_ERR_UNMATCHED"
    assert all_true(same(t, fused))
    assert tr.loras == [(shared["a1"], 1.0)]
    # a malformed request on one rank: TypeError there, LoraError elsewhere, nothing changed
    bad = [(shared["a2"], "strong")] if R == N - 1 else [(shared["a2"], 1.0)]
    with pytest.raises((TypeError, lorakit.LoraError)) as e:
        tr.apply(bad)
    assert isinstance(e.value, TypeError) == (R == N - 1)
    assert all_true(same(t, fused))
    # the group still works afterwards
    tr.reset()
    assert lorakit.digest_tensors(t) == lorakit.digest(shared["base"])


@pytest.mark.skipif(N == 1, reason="needs 2 or more ranks")
def test_mismatched_requests_raise_on_all(shared):
    t = load_numpy(shared["base"])
    tr = lorakit.Tracker(t, comm=W)
    before = snapshot(t)
    with pytest.raises(lorakit.LoraError) as e:
        tr.apply([(shared["a1"], 1.0 if R == 0 else 0.5)])
    assert e.value.status == "LK_ERR_MISMATCH"
    assert all_true(same(t, before))
    # tensors that differ in shape between ranks: the tracker refuses to start on every rank
    t2 = load_numpy(shared["base"])
    if R == N - 1:
        t2["pos_ids"] = np.arange(8, dtype=np.int64)
    with pytest.raises(lorakit.LoraError) as e:
        lorakit.Tracker(t2, comm=W)
    assert e.value.status == "LK_ERR_MISMATCH"
    # a bad tensor on one rank: ValueError there, LoraError (naming it) elsewhere
    t3 = load_numpy(shared["base"])
    if R == 0:
        t3["pos_ids"].flags.writeable = False
    with pytest.raises((ValueError, lorakit.LoraError), match="pos_ids: read-only"):
        lorakit.Tracker(t3, comm=W)


def test_sync_grads_average_and_skipped_layers():
    shapes = [(3, 5), (7,), (2, 2, 2), (1000,)]
    grads = [np.full(s, 0, np.float32) + np.arange(int(np.prod(s)), dtype=np.float32).reshape(s) + R * 1000
             for s in shapes]
    like = [np.zeros(s, np.float32) for s in shapes]
    skip = 1 if N > 1 else None
    if R == 0 and skip is not None:
        grads[skip] = None  # rank 0 skipped this layer: it contributes zeros
    out = lorakit.sync_grads(grads, W, like=like, bucket_mb=1 / 1024)  # 1 KiB buckets: several rounds
    for i, s in enumerate(shapes):
        idx = np.arange(int(np.prod(s)), dtype=np.float64).reshape(s)
        ranks = [r for r in range(N) if not (r == 0 and i == skip)]
        want = (sum(r * 1000 + idx for r in ranks)) / N  # closed form, exact in float32 here
        assert np.array_equal(out[i], want.astype(np.float32)), i
        if grads[i] is not None:
            assert out[i] is grads[i]  # in place
    assert lorakit.check_replicas(out, W) is True


def test_sync_grads_on_emul_device_memory():
    """The CUDA path of sync_grads (device gradients averaged where they
    are: the pinned host stage per bucket over MPI, the division by lorakit's
    device kernel) on the emul device (lorakit._testing): the same bytes as
    the host path on NumPy copies, and as the closed-form mean; then
    check_replicas and digest_tensors on the same device memory."""
    from lorakit import _testing as lt
    rng = np.random.default_rng(11 + R)
    shapes = [(3, 5), (0,), (1000,), (7,)]
    host = [rng.uniform(-1, 1, s).astype(np.float32) for s in shapes]
    dev = [lt.to_emul("F32", h) for h in host]
    with lt.emul_as_cuda():
        c0 = lt.emul_counts()
        lorakit.sync_grads(dev, W, bucket_mb=1 / 1024)  # 256-float buckets: inside and across buffers
        d2h = lt.emul_counts()["d2h_bytes"] - c0["d2h_bytes"]
        ok = lorakit.check_replicas(dev, W)
    lorakit.sync_grads(host, W, bucket_mb=1 / 1024)
    for h, t in zip(host, dev):
        assert lt.from_emul(t).tobytes() == h.tobytes()
    gens = [np.random.default_rng(11 + r) for r in range(N)]  # every rank's values, regenerated here
    every = [[g.uniform(-1, 1, s).astype(np.float32).astype(np.float64) for s in shapes] for g in gens]
    for i, t in enumerate(dev):
        mean = sum(e[i] for e in every) / N
        assert np.all(np.abs(lt.from_emul(t).astype(np.float64) - mean) <= 2.0 ** -20), i
    if N > 1:
        assert d2h == sum(h.size for h in host) * 4  # every float once through the pinned stage (MPI takes host memory)
    assert ok is True


def test_sync_grads_float16_one_rounding():
    """float16 gradients: summed and divided in float32, rounded once into
    the gradient (the expectation: the float64 average rounded to float16)."""
    rng = np.random.default_rng(100 + R)
    g = (rng.standard_normal(4096) * 1e-2).astype(np.float16)
    every = W.allgather(g.astype(np.float64)) if N > 1 else [g.astype(np.float64)]
    avg = sum(every) / N
    want = avg.astype(np.float16)
    out = lorakit.sync_grads([g], W)
    assert out[0] is g and g.dtype == np.float16
    # one rounding of a float32 average: the float64 average rounded once,
    # but for the rare tie moved by the float32 step (never more than 1 ulp);
    # rounding in float16 at each step would miss far more often
    assert np.all(np.abs(g.astype(np.float64) - avg) <= np.abs(np.spacing(want)).astype(np.float64))
    assert int((g != want).sum()) <= 4, int((g != want).sum())


@pytest.mark.skipif(N == 1, reason="needs 2 or more ranks")
def test_sync_grads_disagreements_raise_on_all():
    g = [np.ones(4, np.float32) * R for _ in range(3 if R == N - 1 else 2)]
    before = [x.copy() for x in g]
    with pytest.raises(lorakit.LoraError) as e:
        lorakit.sync_grads(g, W)
    assert e.value.status == "LK_ERR_MISMATCH"
    assert all_true(all(np.array_equal(a, b) for a, b in zip(g, before)))
    # a rank that cannot fill a skipped layer (no like): its ValueError, LoraError elsewhere
    g = [None if R == 0 else np.ones(4, np.float32)]
    with pytest.raises((ValueError, lorakit.LoraError), match=r"grads\[0\] is None"):
        lorakit.sync_grads(g, W)
    # check_replicas sees one rank's drift on every rank
    t = {"w": np.ones(8, np.float32)}
    if R == N - 1:
        t["w"][3] = 2.0
    assert lorakit.check_replicas(t, W) is False


def test_sync_param_grads_torch():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed (CI has none)")
    torch.manual_seed(0)
    lin = torch.nn.Linear(5, 3)  # same parameters on every rank
    if R != 0:  # rank 0 skipped the layer: its grads stay None
        lin.weight.grad = torch.full((3, 5), float(R))
        lin.bias.grad = torch.full((3,), float(2 * R))
    lorakit.sync_param_grads(lin.parameters(), W, bucket_mb=1)
    # closed form: mean over ranks of R (rank 0 contributes zeros)
    assert torch.equal(lin.weight.grad, torch.full((3, 5), sum(range(N)) / N))
    assert torch.equal(lin.bias.grad, torch.full((3,), 2 * sum(range(N)) / N))


@pytest.mark.skipif(N == 1, reason="needs 2 or more ranks")
def test_stalled_rank_times_out(shared):
    """Tracker(timeout=1): the last rank sleeps 2.5 s before apply; every
    other rank raises LK_ERR_TIMEOUT after 1-3.5 s naming the phase and the
    stalled rank (lorakit/comm.h's contract). On a duplicate of the world
    communicator: the timed-out one is unusable afterwards. A tracker's
    timeout applies to its own calls only (the comm's setting comes back)."""
    import time
    dup = W.Dup()
    t = load_numpy(shared["base"])
    tr = lorakit.Tracker(t, comm=dup, timeout=1.0)
    with pytest.raises(ValueError, match="timeout"):
        lorakit.Tracker(load_numpy(shared["base"]), comm=dup, timeout=-1)
    if R == N - 1:
        time.sleep(2.5)
    t0 = time.monotonic()
    try:
        tr.apply([(shared["a1"], 1.0)])
        err = None
    except lorakit.LoraError as e:
        err = e
    took = time.monotonic() - t0
    if R != N - 1:
        assert err is not None and err.status == "LK_ERR_TIMEOUT"
        assert 1.0 <= took < 3.5, took
        assert "agreeing on the call's arguments: comm mpi agree (collective #" in str(err)
        assert f"waiting for rank {N - 1} (no answer" in str(err)
    else:  # late: the others are gone (its first agreement may still complete)
        assert err is not None and err.status == "LK_ERR_TIMEOUT"
    W.Barrier()
