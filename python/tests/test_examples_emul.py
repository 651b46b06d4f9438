"""examples/python/cuda_swap_nccl.py run as CI can: on lorakit's emulated
device (LORAKIT_EXAMPLE_DEVICE=emul, lorakit._testing) at 2 ranks over
gloo, so the example is not dead code where no GPU is. The example checks
itself: after fuse_ and after every Tracker step each rank's tensors equal
lorakit's offline file fuse of the set, bit for bit (its oracle), the
reset gives the base back and check_replicas holds; an assertion there
exits non-zero. Here: both ranks exit 0, the fuse_ ran on the device
(`emul`, every key by the device kernel) and all four steps were
checked."""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, "..", "..", "examples", "python", "cuda_swap_nccl.py")


def test_cuda_swap_nccl_example_on_emul(tmp_path):
    torch = pytest.importorskip("torch", reason="torch not importable (CI's Debian python3 has none): run with a "
                                "Python that has it")
    pytest.importorskip("safetensors", reason="safetensors not importable (the example writes its files with it)")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("this PyTorch has no gloo backend")
    env = dict(os.environ, LORAKIT_EXAMPLE_DEVICE="emul", PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1")
    for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MPI_LOCALNRANKS", "WORLD_SIZE", "RANK"):
        env.pop(v, None)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        str(28600 + os.getpid() % 1000), EXAMPLE, str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=300, env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "fuse_: 4 tensors on emul (4 by the device kernel, 0 on the host path)" in r.stdout, out
    assert all(f"step {i}:" in r.stdout for i in range(1, 5)), out
    assert "hot-swap on emul (TEST ONLY) equal lorakit's offline fuse" in r.stdout, out
