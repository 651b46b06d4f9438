"""Shared fixtures: a small model and adapters written with st_io (our own
NumPy safetensors writer), the lorakit CLI to compare against, and, under
mpirun, an abort on the first failure so the other ranks never wait in a
collective the failed rank left."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import st_io  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def lorakit_bin():
    b = os.environ.get("LORAKIT_BIN") or shutil.which("lorakit")
    if not b:
        for cand in ("build/lorakit", "../build/lorakit"):
            p = os.path.join(HERE, "..", "..", cand)
            if os.path.exists(p):
                return os.path.abspath(p)
    return b


def cli(*args, check=True):
    """Runs the lorakit CLI; returns stdout (text)."""
    b = lorakit_bin()
    if not b:
        pytest.skip("the lorakit CLI is not built (set LORAKIT_BIN)")
    r = subprocess.run([b, *map(str, args)], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise AssertionError(f"lorakit {' '.join(map(str, args))}: exit {r.returncode}: {r.stderr}")
    return r


OUT, IN = 24, 40


def make_model(d, seed=7, bf16=True):
    """Writes base.safetensors and adapters into d; returns their paths."""
    rng = np.random.default_rng(seed)
    u = lambda *s, lo=-1.0, hi=1.0: rng.uniform(lo, hi, s)  # noqa: E731
    base = {
        "blocks.0.attn.to_q.weight": ("F32", u(OUT, IN).astype(np.float32)),
        "blocks.0.attn.to_k.weight": ("F16", u(OUT, IN).astype(np.float16)),
        "blocks.0.attn.to_q.bias": ("F32", u(OUT).astype(np.float32)),
        "pos_ids": ("I64", np.arange(7, dtype=np.int64)),
    }
    if bf16:
        base["blocks.1.attn.to_q.weight"] = ("BF16", st_io.f32_to_bf16(u(16, IN)))
    p = {"dir": str(d), "base": os.path.join(d, "base.safetensors")}
    st_io.write(p["base"], base, {"note": "python test base"})

    def adapter(name, mods, fdt=np.float32, lo=-0.5, hi=0.5, alpha=None):
        t = {}
        for m, r, inn, out in mods:
            t[f"transformer.{m}.lora_A.weight"] = ("F32" if fdt == np.float32 else "F16",
                                                   u(r, inn, lo=lo, hi=hi).astype(fdt))
            t[f"transformer.{m}.lora_B.weight"] = ("F32" if fdt == np.float32 else "F16",
                                                   u(out, r, lo=lo, hi=hi).astype(fdt))
            if alpha is not None:
                t[f"transformer.{m}.alpha"] = ("F32", np.array(alpha, dtype=np.float32))
        p[name] = os.path.join(d, name + ".safetensors")
        st_io.write(p[name], t)

    adapter("a1", [("blocks.0.attn.to_q", 4, IN, OUT), ("blocks.0.attn.to_k", 2, IN, OUT)], alpha=2.0)
    a2 = [("blocks.0.attn.to_q", 2, IN, OUT)]
    if bf16:
        a2.append(("blocks.1.attn.to_q", 3, IN, 16))
    adapter("a2", a2, fdt=np.float16)
    adapter("unmatched", [("blocks.0.attn.to_q", 2, IN, OUT), ("blocks.9.ff", 2, IN, OUT)])
    adapter("badshape", [("blocks.0.attn.to_q", 2, IN + 1, OUT)])
    # F16 to_k overflows (B A ~ 300 * 300 per rank-1 term, F16 max 65504)
    adapter("overflow", [("blocks.0.attn.to_q", 1, IN, OUT), ("blocks.0.attn.to_k", 1, IN, OUT)], lo=300, hi=301)
    return p


def load_numpy(path):
    """{name: array} of a file holding no BF16 (for NumPy without ml_dtypes)."""
    return {k: a for k, (dt, a) in st_io.read(path).items()}


@pytest.fixture
def model(tmp_path):
    return make_model(tmp_path, bf16=False)


@pytest.fixture
def model_bf16(tmp_path):
    return make_model(tmp_path, bf16=True)


def _mpi_size():
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi.COMM_WORLD.Get_size() if mpi else 1


def pytest_runtest_logreport(report):
    # Under mpirun a rank that fails an assertion would leave the others
    # waiting in the next collective: stop all of them at once instead.
    if report.failed and _mpi_size() > 1:
        mpi = sys.modules["mpi4py.MPI"]
        sys.stderr.write(f"\nrank {mpi.COMM_WORLD.Get_rank()}: {report.nodeid} failed:\n{report.longreprtext}\n")
        sys.stderr.flush()
        mpi.COMM_WORLD.Abort(1)
