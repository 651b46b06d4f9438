"""lorakit over torch.distributed (gloo): torch_dist_worker.py under
`torchrun --nproc_per_node 2` and `4`, plus the single-process rules of
comm=None. Skipped, with the reason shown, where torch (or its gloo
backend) is missing: CI has no torch.

The worker's oracle is computed here, independently of the code under
test: the lorakit CLI's offline fuse of each step's set, digested."""
import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (CI has none); run with a Python that has it")
dist = pytest.importorskip("torch.distributed", reason="torch.distributed is not available in this PyTorch")

import lorakit  # noqa: E402
from conftest import cli, make_model  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def offline(m, loras, name):
    out = os.path.join(m["dir"], "fused_" + name + ".safetensors")
    args = ["fuse", m["base"], "-o", out]
    for p, s in loras:
        args += ["-l", f"{p}:{s}"]
    cli(*args)
    return cli("digest", out).stdout.strip()


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this PyTorch has no gloo backend")
    d = tmp_path_factory.mktemp("dist")
    m = make_model(str(d), bf16=True)
    m["missing"] = os.path.join(str(d), "missing.safetensors")
    want = {
        "base": cli("digest", m["base"]).stdout.strip(),
        "a1": offline(m, [(m["a1"], 1.0)], "a1"),
        "a1a2": offline(m, [(m["a1"], 0.7), (m["a2"], -0.5)], "a1a2"),
        "a2": offline(m, [(m["a2"], 1.25)], "a2"),
    }
    p = str(d / "spec.json")
    json.dump({"model": m, "want": want}, open(p, "w"))
    return p


@pytest.mark.parametrize("nproc", [2, 4])
def test_torchrun_gloo(spec, nproc):
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1")
    for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MPI_LOCALNRANKS", "WORLD_SIZE", "RANK"):
        env.pop(v, None)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                        "--master_port", str(29500 + nproc + os.getpid() % 1000),
                        os.path.join(HERE, "torch_dist_worker.py"), spec],
                       capture_output=True, text=True, timeout=600, env=env)
    ok = r.stdout.count("all torch.distributed checks passed")
    assert r.returncode == 0 and ok == nproc, f"exit {r.returncode}, {ok}/{nproc} ranks passed\n{r.stdout}\n{r.stderr[-6000:]}"


def test_comm_none_under_a_launcher_without_a_group(monkeypatch, model):
    """WORLD_SIZE > 1 (torchrun) with no process group: raise, never act alone."""
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    monkeypatch.setenv("WORLD_SIZE", "2")
    t = {"w": torch.zeros(4)}
    for call in (lambda: lorakit.Tracker(t), lambda: lorakit.sync_grads([torch.zeros(3)]),
                 lambda: lorakit.check_replicas(t)):
        with pytest.raises(RuntimeError, match="one of 2 .WORLD_SIZE=2. but comm=None and torch.distributed is not"):
            call()
    assert lorakit.check_replicas(t, "self") is True  # explicit: this process alone
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "3")
    with pytest.raises(RuntimeError, match="pass comm=MPI.COMM_WORLD"):
        lorakit.sync_grads([torch.zeros(3)])


def test_one_process_group(tmp_path):
    """A 1-process gloo group: the host backend at one rank."""
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        g = [torch.arange(5, dtype=torch.float32)]
        out = lorakit.sync_grads(g, dist.group.WORLD)
        assert torch.equal(out[0], torch.arange(5, dtype=torch.float32))
        assert lorakit.check_replicas({"g": g[0]}, dist.group.WORLD) is True
        assert lorakit._comm(dist.group.WORLD).backend == "host"
    finally:
        dist.destroy_process_group()
