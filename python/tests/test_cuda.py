"""The Python API on CUDA tensors (issue 27), byte for byte against the CPU.

Every test body runs on three devices (the `dev` fixture):
- "cuda": torch CUDA tensors on cuda:0. Skipped with a visible reason where
  torch does not import ("torch not importable": CI's Debian python3) or no
  GPU / driver is present ("no CUDA device": torch.cuda.is_available() is
  False); tools/device/check.sh runs them on a GPU machine;
- "emul": the same body on lorakit's emulated device (lorakit._testing:
  EmulTensor reports CUDA device 0, emul_as_cuda() takes it as `emul`), so
  the body itself runs in CI: the binding's CUDA branch end to end (DLPack
  borrowing, the device fuse, device backups, device digests);
- "torch-cpu": the "cuda" helpers on torch CPU tensors (the host path), so
  the bodies' torch code runs where torch is but no GPU (this CPU-torch
  machine; not Debian's python3).
sync_grads also runs on "cpu" (torch CPU tensors: the same F16/BF16 -> F32
-> one rounding code in lorakit's Python layer as on CUDA) because its
low-precision conversion is torch's, which an EmulTensor does not have.

Oracles: the offline CPU file fuse (`lorakit.fuse` written to a file, read
back by the tests' own safetensors reader st_io) for every weight; the
file's digest for digest_tensors; for sync_grads a float64 average of the
ranks' values (regenerated here from their seeds) rounded once to the
gradient's dtype by torch on the CPU. Failures are compared against the
bytes before the call."""
import contextlib
import os
import subprocess
import sys

import numpy as np
import pytest

import lorakit
from lorakit import _testing as lt
from conftest import make_model
import st_io

HERE = os.path.dirname(os.path.abspath(__file__))


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


def tbytes(x):
    """The bytes of a torch tensor (any device), read back on the CPU."""
    x = x.detach().cpu().contiguous()
    return x.reshape(-1).view(sys.modules["torch"].uint8).numpy().tobytes() if x.numel() else b""


def need_torch():
    torch = _torch()
    if torch is None:
        pytest.skip("torch not importable (CI's Debian python3 has none): run with a Python that has it")
    return torch


def need_cuda():
    torch = need_torch()
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device (torch.cuda.is_available() is False: no GPU or no driver)")
    return torch


class Emul:
    """Tensors in lorakit's emulated device memory, seen as CUDA device 0."""
    kind, lk_name = "emul", "emul"

    def put(self, dt, a):
        return lt.to_emul(dt, a)

    def get(self, t):
        return t.tobytes()

    def factor(self, dt, a):  # an adapter's factor as the caller holds it (host memory here)
        return a

    def host_copy(self, ts):  # CPU copies for the same call: none (BF16 has no NumPy dtype here)
        return None

    def ctx(self):
        return lt.emul_as_cuda()


_TDT = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64"}


class Cuda:
    """torch tensors on cuda:0 (BF16 arrays as st_io holds them: raw uint16);
    on "cpu" the same helpers on torch CPU tensors (the host path), so that
    this class and the bodies' torch code run where no GPU is."""

    def __init__(self, torch, device="cuda:0"):
        self.torch, self.device = torch, device
        self.kind = "cuda" if device.startswith("cuda") else "cpu"
        self.lk_name = device

    def put(self, dt, a):
        t = self.torch
        flat = t.from_numpy(np.frombuffer(np.ascontiguousarray(a).tobytes(), np.uint8).copy())
        return flat.view(getattr(t, _TDT[dt])).reshape(a.shape).to(self.device)

    def get(self, x):
        return tbytes(x)

    def factor(self, dt, a):
        return self.put(dt, a)

    def host_copy(self, ts):
        return {k: v.cpu().clone() for k, v in ts.items()}

    def ctx(self):
        return contextlib.nullcontext()


@pytest.fixture(params=["emul", "torch-cpu", "cuda"])
def dev(request):
    if request.param == "emul":
        return Emul()
    return Cuda(need_torch(), "cpu") if request.param == "torch-cpu" else Cuda(need_cuda())


@pytest.fixture
def m(tmp_path):
    return make_model(tmp_path, bf16=True)


def load(dev, path):
    return {k: dev.put(dt, a) for k, (dt, a) in st_io.read(path).items()}


def raw(dev, ts):
    return {k: dev.get(t) for k, t in ts.items()}


def offline(m, loras, name, **kw):
    """{name: bytes} of the CPU path's result: lorakit.fuse to a file (an
    empty set: the base's own bytes)."""
    if not loras:
        return {k: a.tobytes() for k, (_, a) in st_io.read(m["base"]).items()}
    out = os.path.join(m["dir"], name + ".safetensors")
    lorakit.fuse(m["base"], loras, out, **kw)
    return {k: a.tobytes() for k, (_, a) in st_io.read(out).items()}


def test_fuse_in_place_equals_cpu(dev, m):
    loras = [(m["a1"], 0.7), (m["a2"], -1.5)]
    ts = load(dev, m["base"])
    cpu = dev.host_copy(ts)
    with dev.ctx():
        s = lorakit.fuse_(ts, loras)
    assert raw(dev, ts) == offline(m, loras, "want")
    if cpu is not None:  # the same call on CPU copies of the same tensors
        lorakit.fuse_(cpu, loras)
        assert raw(dev, ts) == {k: tbytes(v) for k, v in cpu.items()}
    assert s.get("device", "cpu") == dev.lk_name and s["tensors_fused"] == 3, s
    if dev.kind != "cpu":  # the device branch was taken: three LoRA keys by the device kernel
        assert s["keys_device"] == 3 and s["keys_host_fallback"] == 0, s


def test_failed_fuse_changes_nothing(dev, m):
    """conftest's "overflow" adapter makes F16 to_k non-finite after F32
    to_q was fused: LK_ERR_NONFINITE and every tensor keeps its bytes."""
    ts = load(dev, m["base"])
    before = raw(dev, ts)
    with dev.ctx(), pytest.raises(lorakit.LoraError) as e:
        lorakit.fuse_(ts, [(m["overflow"], 1.0)])
    assert e.value.status == "LK_ERR_NONFINITE"
    assert raw(dev, ts) == before


def tracker_steps(dev, m, ts, comm):
    """set, swap, add, a failing apply (unchanged), reset: every step's bytes
    against the offline fuse of the set."""
    base = raw(dev, ts)
    a1, a2 = (m["a1"], 0.7), (m["a2"], -1.5)
    with lorakit.Tracker(ts, comm=comm) as t:
        for i, loras in enumerate(([a1], [(m["a2"], 1.25)], [a1, a2])):
            r = t.apply(loras, digest=True)
            assert raw(dev, ts) == offline(m, loras, f"step{i}"), f"step {i}: {loras}"
            assert r["digests_agree"] is True and r["digest"] == lorakit.digest_tensors(ts)
        fused = raw(dev, ts)
        with pytest.raises(lorakit.LoraError) as e:
            t.apply([(m["overflow"], 1.0)])
        assert e.value.status == "LK_ERR_NONFINITE"
        assert raw(dev, ts) == fused  # the failed apply left the previous set's bytes
        t.reset()
        assert raw(dev, ts) == base


def test_tracker_set_swap_reset(dev, m):
    ts = load(dev, m["base"])
    with dev.ctx():
        tracker_steps(dev, m, ts, "self")


@contextlib.contextmanager
def one_process_group(kind, tmp_path):
    """A torch.distributed group of one process (a file:// store): NCCL for
    CUDA tensors ("cuda"); gloo for host memory ("cpu"); for "emul" a gloo
    group whose host communicator takes emul memory as an NCCL group takes
    CUDA memory (_TorchHost.force_device)."""
    torch = need_torch()
    import torch.distributed as dist
    from lorakit import _torch as lkt
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    if kind == "cuda":
        if not dist.is_nccl_available():
            pytest.skip("this PyTorch has no NCCL backend")
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if kind == "cuda" else "gloo", init_method=f"file://{tmp_path}/pg",
                            rank=0, world_size=1)
    try:
        if kind != "emul":
            yield dist.group.WORLD
        else:
            lkt._TorchHost.force_device = "emul"
            try:
                g = dist.new_group([0])  # its lorakit Comm is made (at first use) with the forced device
                lorakit._comm(g)
            finally:
                lkt._TorchHost.force_device = None
            yield g
    finally:
        dist.destroy_process_group()


def test_tracker_over_one_process_group(dev, m, tmp_path):
    ts = load(dev, m["base"])
    with one_process_group(dev.kind, tmp_path) as g, dev.ctx():
        assert lorakit._comm(g).backend == "host"
        tracker_steps(dev, m, ts, g)
        assert lorakit.check_replicas(ts, g) is True


def test_digest_and_check_replicas(dev, m):
    ts = load(dev, m["base"])
    with dev.ctx():
        assert lorakit.digest_tensors(ts) == lorakit.digest(m["base"])  # the file's digest: the CPU reader's
        assert lorakit.check_replicas(ts, "self") is True
        assert lorakit.check_replicas(list(ts.values()), "self") is True


def test_adapter_in_memory(dev, m):
    """lorakit.Adapter made from factors the caller holds where it trains
    (CUDA tensors on the GPU), fused into device weights: the file fuse's
    bytes."""
    fac = {k: dev.factor(dt, a) for k, (dt, a) in st_io.read(m["a1"]).items()}
    ad = lorakit.Adapter.from_state_dict(fac, name="a1")
    assert ad.data == lorakit.Adapter.from_state_dict({k: a for k, (_, a) in st_io.read(m["a1"]).items()}).data
    ts = load(dev, m["base"])
    with dev.ctx():
        s = lorakit.fuse_(ts, [(ad, 0.3)])
    assert raw(dev, ts) == offline(m, [(m["a1"], 0.3)], "want_ad")
    assert s.get("keys_device", 2) == 2 and s.get("device", "cpu") == dev.lk_name, s


def test_mixed_devices_refused_naming_keys(dev, m):
    if dev.kind == "cpu":
        pytest.skip("torch-cpu: host memory only, nothing to mix")
    ts = load(dev, m["base"])
    ts["pos_ids"] = np.arange(7, dtype=np.int64)  # host memory beside the device tensors
    before = raw(dev, {k: v for k, v in ts.items() if k != "pos_ids"})
    first = next(iter(ts))
    with dev.ctx():
        for call in (lambda: lorakit.fuse_(ts, [(m["a1"], 1.0)]), lambda: lorakit.digest_tensors(ts),
                     lambda: lorakit.Tracker(ts, comm="self"), lambda: lorakit.check_replicas(ts, "self")):
            with pytest.raises(ValueError, match=rf"{first} is on cuda:0, pos_ids is on cpu"):
                call()
        g = [dev.put("F32", np.ones(3, np.float32)), np.ones(3, np.float32)]
        with pytest.raises(ValueError, match=r"grad\[0\] is on cuda:0, grad\[1\] is on cpu"):
            lorakit.sync_grads(g, "self", names=["grad[0]", "grad[1]"])
        assert dev.get(g[0]) == np.ones(3, np.float32).tobytes()
    del ts["pos_ids"]
    assert raw(dev, ts) == before


# ---- gradients ----

class TorchOn:
    """torch tensors on a device ("cpu" or "cuda:0") for sync_grads."""

    def __init__(self, torch, device):
        self.torch, self.device = torch, device
        self.kind = "cuda" if device.startswith("cuda") else "cpu"

    def ctx(self):
        return contextlib.nullcontext()


@pytest.fixture(params=["emul", "cpu", "cuda"])
def gdev(request):
    if request.param == "emul":
        return Emul()
    if request.param == "cpu":
        return TorchOn(need_torch(), "cpu")
    return TorchOn(need_cuda(), "cuda:0")


SHAPES = [(3, 5), (1000,), (0,), (7, 1)]


def rank_grads(rank, dt, torch=None):
    """Rank `rank`'s gradients as float64 arrays, exactly representable in
    dt (drawn, then rounded to dt by torch when it is there)."""
    rng = np.random.default_rng(50 + rank)
    out = []
    for s in SHAPES:
        a = rng.uniform(-1, 1, s)
        if torch is not None:
            a = torch.from_numpy(a).to(getattr(torch, dt)).to(torch.float64).numpy()
        elif dt != "float32":
            raise ValueError(dt)
        else:
            a = a.astype(np.float32).astype(np.float64)
        out.append(a)
    return out


def want_average(ranks, dt, torch=None):
    """float64 mean over the ranks' gradients, rounded once to dt (torch's
    round-to-nearest-even on the CPU; NumPy's for float32)."""
    per = [rank_grads(r, dt, torch) for r in range(ranks)]
    means = [sum(p[i] for p in per) / ranks for i in range(len(SHAPES))]
    if torch is None:
        return [x.astype(np.float32).tobytes() for x in means]
    return [tbytes(torch.from_numpy(x).to(getattr(torch, dt))) for x in means]


def put_grads(gdev, dt, arrays):
    if isinstance(gdev, Emul):
        return [lt.to_emul("F32", a.astype(np.float32)) for a in arrays]
    t = gdev.torch
    return [t.from_numpy(a).to(getattr(t, dt)).to(gdev.device) for a in arrays]


def get_grad(gdev, g):
    if isinstance(gdev, Emul):
        return g.tobytes()
    return tbytes(g)


@pytest.mark.parametrize("dt", ["float32", "bfloat16", "float16"])
def test_sync_grads_one_process_group(gdev, dt, tmp_path):
    """sync_grads and sync_param_grads over a 1-process group (NCCL on
    CUDA): the mean over one rank is the value itself, rounded once (an
    F16/BF16 gradient through F32 and back: the same bits); a None entry
    comes back as zeros of like's shape and dtype."""
    if isinstance(gdev, Emul) and dt != "float32":
        pytest.skip("emul: F16/BF16 gradients are converted by torch (.to(float32)); the 'cpu' and 'cuda' "
                    "params run that code")
    torch = need_torch()
    host = rank_grads(0, dt, torch)
    grads = put_grads(gdev, dt, host)
    with one_process_group(gdev.kind, tmp_path) as g, gdev.ctx():
        if isinstance(gdev, Emul):  # (a None entry's zeros are made by torch or NumPy: host memory for emul)
            out = lorakit.sync_grads(grads, g, bucket_mb=1 / 1024)
            assert [get_grad(gdev, x) for x in out] == want_average(1, dt, torch)
        else:
            out = lorakit.sync_grads(grads + [None], g, like=grads + [grads[0]], bucket_mb=1 / 1024)
            assert [get_grad(gdev, x) for x in out[:-1]] == want_average(1, dt, torch)
            assert get_grad(gdev, out[-1]) == bytes(len(get_grad(gdev, grads[0])))  # zeros
            assert out[-1].dtype == grads[0].dtype and out[-1].device == grads[0].device
            ps = [torch.nn.Parameter(x.clone()) for x in grads]
            for p, x in zip(ps, grads):
                p.grad = x.clone()
            ps[1].grad = None
            lorakit.sync_param_grads(ps, g, bucket_mb=1 / 1024)
            assert get_grad(gdev, ps[0].grad) == get_grad(gdev, grads[0])
            assert ps[1].grad is not None and not ps[1].grad.any()  # averaged zeros assigned


@pytest.mark.parametrize("dt", ["float32", "bfloat16", "float16"])
def test_sync_grads_average_at_two_ranks(gdev, dt):
    """sync_grads at 2 ranks (torchrun, gloo; cuda_sync_worker.py): on CUDA
    gradients both processes share cuda:0 (NCCL refuses two ranks on one
    GPU), so each bucket goes through the pinned host stage; the result on
    every rank equals the float64 mean of both ranks' gradients rounded
    once to their dtype."""
    if isinstance(gdev, Emul):
        pytest.skip("emul gradients at 2 ranks: test_device_emul.py's test_host_communicator_gets_device_"
                    "buffers_over_torch")
    torch = need_torch()
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("this PyTorch has no gloo backend")
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1")
    for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MPI_LOCALNRANKS", "WORLD_SIZE", "RANK"):
        env.pop(v, None)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        str(29100 + os.getpid() % 500 + 500 * (gdev.kind == "cuda")),
                        os.path.join(HERE, "cuda_sync_worker.py"), gdev.device, dt],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.stdout.count("sync checks passed") == 2, r.stdout + r.stderr
