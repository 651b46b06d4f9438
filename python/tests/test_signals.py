"""Ctrl-C (SIGINT) and SIGTERM during lorakit.fuse, fuse_ and Tracker.apply
(issue 28, interrupts): the work stops within a fraction of a second of the
signal, KeyboardInterrupt is raised, no temporary is left, the output (a
file already there) and the weights are byte for byte as before the call;
and with no lorakit call running, Python's own SIGINT handling is as it
was (KeyboardInterrupt from signal.default_int_handler), a program's own
handler is called during a call (with the signal number), and an ignored
SIGINT stays ignored.

Oracles: a real signal sent by this process to a child (os.kill) while the
child is inside the call (it prints "go" with the time just before; the
signal follows 0.05 s later, and the same call takes longer than that
uncancelled: checked by the child's "completed" outcome, which retries with
a bigger model); the file system after it; the child's own copy of the
weights compared with numpy.array_equal; the time between os.kill and the
child's except clause on the same clock (time.time())."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import st_io

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = r"""
import json, os, signal, sys, time
import numpy as np
import lorakit, st_io
mode, src, d, how = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
base, ad = (os.path.join(src, n) for n in ("base.safetensors", "ad.safetensors"))
out = os.path.join(d, "out.safetensors")
handled = []
if how == "own":
    signal.signal(signal.SIGINT, lambda s, f: handled.append(s))
if mode == "fuse":
    before = open(out, "rb").read()
    run = lambda: lorakit.fuse(base, [(ad, 0.5)], out, threads=1)
    same = lambda: open(out, "rb").read() == before
else:
    sd = {k: v.copy() for k, (dt, v) in st_io.read(base).items()}
    if mode == "tracker":
        tr = lorakit.Tracker(sd, threads=1)
        tr.apply([(ad, 0.25)])
        run = lambda: tr.apply([(ad, 0.5)])
    else:
        run = lambda: lorakit.fuse_(sd, [(ad, 0.5)], threads=1)
    copy = {k: v.copy() for k, v in sd.items()}
    same = lambda: all(np.array_equal(sd[k], copy[k]) for k in sd)
print("go", time.time(), flush=True)
try:
    run()
    res, msg = "completed", ""
except KeyboardInterrupt as e:
    res, msg = "KeyboardInterrupt", str(e)
t = time.time()
print(json.dumps({"res": res, "msg": msg, "t": t, "same": same(), "handled": handled}), flush=True)
if mode == "tracker" and res == "KeyboardInterrupt" and how == "default":
    tr.reset()  # still usable
    clean = st_io.read(base)
    same = all(np.array_equal(v, clean[k][1]) for k, v in sd.items())
    print(json.dumps({"after": "ok" if same else "reset gave other weights"}), flush=True)
"""


def make(d, n):
    """A base of n F32 1024 x 1024 weights and a rank-256 adapter on each:
    tens of milliseconds of kernel work per weight on one thread."""
    rng = np.random.default_rng(4)
    st_io.write(os.path.join(d, "base.safetensors"),
                {f"b.{i}.to_q.weight": ("F32", rng.uniform(-1, 1, (1024, 1024)).astype(np.float32)) for i in range(n)})
    t = {}
    for i in range(n):
        t[f"b.{i}.to_q.lora_A.weight"] = ("F32", rng.uniform(-1, 1, (256, 1024)).astype(np.float32))
        t[f"b.{i}.to_q.lora_B.weight"] = ("F32", rng.uniform(-1, 1, (1024, 256)).astype(np.float32))
        t[f"b.{i}.to_q.alpha"] = ("F32", np.array(64, np.float32))
    st_io.write(os.path.join(d, "ad.safetensors"), t)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The models, written once: {n: folder}, made on first use."""
    root, made = tmp_path_factory.mktemp("signal-models"), {}

    def get(n):
        if n not in made:
            made[n] = root / str(n)
            made[n].mkdir()
            make(str(made[n]), n)
        return str(made[n])
    return get


def env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), HERE) if p))


def interrupt(tmp_path, models, mode, sig, how="default"):
    """Runs the child, signals it mid-call, returns (outcome, seconds from
    the signal to the except clause, the folder of its output)."""
    for n in (16, 64):
        d = tmp_path / f"{mode}-{sig}-{n}"
        d.mkdir()
        with open(d / "out.safetensors", "wb") as f:
            f.write(b"the output as it was")
        p = subprocess.Popen([sys.executable, "-c", CHILD, mode, models(n), str(d), how], env=env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        line = p.stdout.readline()
        assert line.startswith("go"), (line, p.stderr.read())
        time.sleep(0.05)
        sent = time.time()
        p.send_signal(sig)
        outs, errs = p.communicate(timeout=120)
        lines = outs.splitlines()
        if p.returncode == -sig and len(lines) == 1 and json.loads(lines[0])["res"] == "completed":
            continue  # the call ended before the signal, which then ended the child as Python does: a bigger model
        assert p.returncode == 0, errs
        r = json.loads(lines[0])
        if r["res"] == "completed":
            continue  # done before the signal: a bigger model
        if mode == "tracker" and r["res"] == "KeyboardInterrupt":
            assert json.loads(lines[1]) == {"after": "ok"}
        return r, r["t"] - sent, d
    pytest.fail(f"{mode}: the call always finished before the signal")


@pytest.mark.parametrize("mode", ["fuse", "fuse_", "tracker"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_stops_the_call(tmp_path, models, mode, sig):
    r, latency, d = interrupt(tmp_path, models, mode, sig)
    print(f"{mode} {signal.Signals(sig).name}: stopped {latency * 1e3:.0f} ms after the signal")
    assert r["res"] == "KeyboardInterrupt", r
    assert "cancelled" in r["msg"] and signal.Signals(sig).name in r["msg"], r["msg"]
    assert r["same"], "the output or the weights changed"
    assert latency < 1.0, latency
    assert os.listdir(d) == ["out.safetensors"], os.listdir(d)


def test_own_handler_is_called(tmp_path, models):
    """A program's SIGINT handler that does not raise: called once with the
    signal number after the call stopped; the call, not done, still raises
    KeyboardInterrupt."""
    r, latency, d = interrupt(tmp_path, models, "fuse_", signal.SIGINT, how="own")
    assert r["handled"] == [int(signal.SIGINT)], r
    assert r["res"] == "KeyboardInterrupt" and r["same"], r


def test_python_sigint_untouched_outside_calls():
    """No lorakit call running: SIGINT is Python's (KeyboardInterrupt from
    the default handler), before and after a call; an ignored SIGINT stays
    ignored through a call."""
    code = r"""
import os, signal, time, numpy as np, lorakit
w = {"a.weight": np.ones((4, 4), np.float32)}
def ki():
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)
        return "no"
    except KeyboardInterrupt:
        return "KeyboardInterrupt"
print(ki())
lorakit.fuse_(w, [])
print(signal.getsignal(signal.SIGINT) is signal.default_int_handler, ki())
signal.signal(signal.SIGINT, signal.SIG_IGN)
lorakit.fuse_(w, [])
os.kill(os.getpid(), signal.SIGINT)
print(signal.getsignal(signal.SIGINT) == signal.SIG_IGN)
"""
    out = subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["KeyboardInterrupt", "True", "KeyboardInterrupt", "True"], out.stdout
