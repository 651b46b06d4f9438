"""lorakit.compat side by side with the seeds' own code, under torchrun
(gloo, CPU) at 2 and 4 ranks:
- ltx_compat_worker.py: LTX-2's tracker (ltx_seed.py on ltx-core from
  PyPI) and lorakit.compat.ltx's, the same call sequence, every tensor
  equal after every step;
- fastvideo_compat_worker.py: FastVideo's LoRA training (fastvideo 0.2.1
  from PyPI) and lorakit.compat.fastvideo's, the same loop, weights equal
  after every step.
Each skips, with the reason shown, where torch, gloo or the seed's package
is missing (CI has none of them; see python/README.md for the
PYTHONPATH these runs use)."""
import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (CI has none); run with a Python that has it")
dist = pytest.importorskip("torch.distributed", reason="torch.distributed is not available in this PyTorch")

HERE = os.path.dirname(os.path.abspath(__file__))


def torchrun(worker, nproc, *args):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this PyTorch has no gloo backend")
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1")
    for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MPI_LOCALNRANKS", "WORLD_SIZE", "RANK"):
        env.pop(v, None)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                        "--master_port", str(29700 + nproc + os.getpid() % 1000), os.path.join(HERE, worker), *args],
                       capture_output=True, text=True, timeout=600, env=env)
    ok = r.stdout.count("side by side passed")
    assert r.returncode == 0 and ok == nproc, f"exit {r.returncode}, {ok}/{nproc} ranks passed\n{r.stdout}\n{r.stderr[-6000:]}"
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    for x in lines:
        print(json.dumps(x))  # the timings, shown with pytest -s
    return lines


@pytest.mark.parametrize("nproc", [2, 4])
def test_ltx_side_by_side(tmp_path, nproc):
    pytest.importorskip("ltx_core", reason="ltx-core is not installed (pip install --no-deps ltx-core: the oracle)")
    pytest.importorskip("safetensors", reason="safetensors is not installed")
    (res,) = torchrun("ltx_compat_worker.py", nproc, str(tmp_path))
    assert res["ranks"] == nproc and "reset_loras" in res["steps"]
