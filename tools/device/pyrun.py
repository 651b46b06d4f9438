"""tools/device/pyrun.py TEST_FILE...: runs pytest-style test files where
pytest is not installed (tools/device/check.sh on a GPU machine whose image
has torch but no pytest). It provides the small part of pytest those files
use: a `pytest` module with fixture (params, request.param, yield
fixtures), mark.parametrize, skip, importorskip and raises(match=), and
the tmp_path fixture. Prints one line per test (PASSED / SKIPPED reason /
FAILED and the traceback) and a summary; exits 1 if any test failed.
Nothing here is used where pytest exists."""
import contextlib
import inspect
import itertools
import os
import re
import sys
import tempfile
import traceback
import types


class Skipped(Exception):
    pass


def _skip(reason=""):
    raise Skipped(reason)


def _importorskip(name, reason=None):
    try:
        __import__(name)
    except ImportError:
        raise Skipped(reason or f"could not import {name!r}") from None
    return sys.modules[name]


class _Raises:
    def __init__(self, exc, match=None):
        self.exc, self.match, self.value = exc, match, None

    def __enter__(self):
        return self

    def __exit__(self, et, ev, tb):
        if et is None:
            raise AssertionError(f"DID NOT RAISE {self.exc}")
        if not issubclass(et, self.exc):
            return False
        if self.match is not None and not re.search(self.match, str(ev)):
            raise AssertionError(f"{str(ev)!r} does not match {self.match!r}")
        self.value = ev
        return True


_FIXTURES = {}


def _fixture(fn=None, params=None, scope="function", **_):
    def deco(f):
        _FIXTURES[f.__name__] = (f, params)
        return f
    return deco(fn) if fn is not None else deco


def _parametrize(names, values):
    def deco(f):
        f.__dict__.setdefault("_params", []).append(([n.strip() for n in names.split(",")], list(values)))
        return f
    return deco


shim = types.ModuleType("pytest")
shim.skip, shim.importorskip, shim.fixture = _skip, _importorskip, _fixture
shim.raises = lambda exc, match=None: _Raises(exc, match)
shim.mark = types.SimpleNamespace(parametrize=_parametrize)
sys.modules["pytest"] = shim


class _Request:
    def __init__(self, param):
        self.param = param


def _resolve(name, chosen, stack, tmp):
    """The value of fixture `name` (its generator kept on stack for teardown)."""
    if name == "tmp_path":
        import pathlib
        return pathlib.Path(tmp)
    if name == "request":
        return _Request(chosen.get("_request"))
    f, _ = _FIXTURES[name]
    kw = {}
    for a in inspect.signature(f).parameters:
        if a == "request":
            kw[a] = _Request(chosen[name])
        else:
            kw[a] = _resolve(a, chosen, stack, tmp)
    v = f(**kw)
    if inspect.isgenerator(v):
        stack.callback(lambda g=v: next(g, None))
        v = next(v)
    return v


def _cases(fn):
    """(id, {fixture: param}, {arg: value}) for every combination."""
    args = list(inspect.signature(fn).parameters)
    axes = []
    for names, values in reversed(fn.__dict__.get("_params", [])):
        axes.append([("p", names, v if len(names) > 1 else (v,)) for v in values])

    def fixture_axes(a, seen):
        if a in seen or a not in _FIXTURES:
            return []
        seen.add(a)
        f, params = _FIXTURES[a]
        out = [[("f", a, p) for p in params]] if params else []
        for b in inspect.signature(f).parameters:
            out += fixture_axes(b, seen)
        return out

    seen = set()
    for a in args:
        axes += fixture_axes(a, seen)
    for combo in itertools.product(*axes) if axes else [()]:
        chosen, direct, ids = {}, {}, []
        for kind, names, v in combo:
            if kind == "f":
                chosen[names] = v
                ids.append(str(v))
            else:
                direct.update(zip(names, v))
                ids.extend(map(str, v))
        yield "-".join(ids), chosen, direct


def run_file(path):
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    name = os.path.splitext(os.path.basename(path))[0]
    _FIXTURES.clear()
    mod = __import__(name)
    counts = {"passed": 0, "skipped": 0, "failed": 0}
    for tname, fn in list(vars(mod).items()):
        if not tname.startswith("test_") or not callable(fn):
            continue
        for cid, chosen, direct in _cases(fn):
            label = f"{path}::{tname}" + (f"[{cid}]" if cid else "")
            with tempfile.TemporaryDirectory(prefix="pyrun_") as tmp:
                try:
                    with contextlib.ExitStack() as stack:
                        kw = {a: direct[a] if a in direct else _resolve(a, chosen, stack, tmp)
                              for a in inspect.signature(fn).parameters}
                        fn(**kw)
                    counts["passed"] += 1
                    print(f"PASSED {label}", flush=True)
                except Skipped as e:
                    counts["skipped"] += 1
                    print(f"SKIPPED {label}: {e}", flush=True)
                except Exception:
                    counts["failed"] += 1
                    print(f"FAILED {label}\n{traceback.format_exc()}", flush=True)
    return counts


def main(files):
    total = {"passed": 0, "skipped": 0, "failed": 0}
    for f in files:
        for k, v in run_file(f).items():
            total[k] += v
    print(", ".join(f"{v} {k}" for k, v in total.items()), "(tools/device/pyrun.py: pytest not installed)")
    return 1 if total["failed"] or not total["passed"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
