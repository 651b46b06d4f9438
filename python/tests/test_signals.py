"""SIGTERM during lorakit.fuse (issue 28, item 4, the part landed): the
process still ends by the signal, and lorakit's temporary (a full-size
<out>.tmp.<pid>.<n>) is removed by the handler lorakit installs where the
signal's action is the default; the output is not written. The oracle is
the file system after a real signal sent to a child process caught with
its temporary on disk."""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import st_io

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = """
import sys, lorakit
lorakit.fuse(sys.argv[1], [(sys.argv[2], 0.5)], sys.argv[3], threads=1)
"""


def make(d, rows):
    rng = np.random.default_rng(4)
    base = os.path.join(d, "base.safetensors")
    st_io.write(base, {f"b.{i}.to_q.weight": ("F32", rng.uniform(-1, 1, (rows, 1024)).astype(np.float32))
                       for i in range(8)})
    ad = os.path.join(d, "ad.safetensors")
    t = {}
    for i in range(8):
        t[f"b.{i}.to_q.lora_A.weight"] = ("F32", rng.uniform(-1, 1, (4, 1024)).astype(np.float32))
        t[f"b.{i}.to_q.lora_B.weight"] = ("F32", rng.uniform(-1, 1, (rows, 4)).astype(np.float32))
        t[f"b.{i}.to_q.alpha"] = ("F32", np.array(4, np.float32))
    st_io.write(ad, t)
    return base, ad


def test_sigterm_removes_the_temporary(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), HERE) if p))
    for rows in (2048, 4096, 8192):  # 64, 128, 256 MiB: until the temporary is seen on disk
        d = tmp_path / str(rows)
        d.mkdir()
        base, ad = make(str(d), rows)
        out = str(d / "out.safetensors")
        p = subprocess.Popen([sys.executable, "-c", CHILD, base, ad, out], env=env, stderr=subprocess.PIPE)
        seen = None
        while p.poll() is None and not seen:
            seen = next((e for e in os.listdir(d) if e.startswith("out.safetensors.tmp.")), None)
            if not seen:
                time.sleep(0.0005)
        if not seen:
            p.wait()
            continue  # finished first: a bigger base
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)
        assert p.returncode == -signal.SIGTERM, p.stderr.read()
        assert not os.path.exists(out)
        assert sorted(os.listdir(d)) == ["ad.safetensors", "base.safetensors"], os.listdir(d)
        return
    pytest.fail("the fuse never had its temporary on disk long enough to be signalled")
