"""tools/device/pyrun.py (the plain runner tools/device/check.sh uses for
test_cuda.py where a GPU image has torch but no pytest) on a file whose
outcomes are known by construction: a fixture with params x a
parametrize, a yield fixture's teardown, tmp_path, skip, raises(match=)
passing and failing, an assertion failing. Oracle: the per-test lines and
the summary counted by hand from the file below."""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PYRUN = os.path.join(HERE, "..", "..", "tools", "device", "pyrun.py")

CASES = '''
import pytest

torn = []

@pytest.fixture(params=["a", "b"])
def kind(request):
    yield request.param
    torn.append(request.param)

@pytest.fixture
def two(tmp_path):
    (tmp_path / "x").write_text("2")
    return int((tmp_path / "x").read_text())

@pytest.mark.parametrize("n", [1, 3])
def test_grid(kind, n, two):
    assert kind in "ab" and two == 2 and n in (1, 3)

def test_teardown_ran():
    assert sorted(torn) == ["a", "a", "b", "b"], torn

def test_skips():
    pytest.skip("no such thing here")

def test_raises_match():
    with pytest.raises(ValueError, match="bad v"):
        raise ValueError("a bad value")

def test_raises_wrong_message():
    with pytest.raises(ValueError, match="other"):
        raise ValueError("a bad value")

def test_fails(kind):
    assert kind == "a"
'''


def test_pyrun_counts_and_exit(tmp_path):
    f = tmp_path / "cases_file.py"
    f.write_text(CASES)
    r = subprocess.run([sys.executable, PYRUN, str(f)], capture_output=True, text=True, timeout=60)
    lines = [ln for ln in r.stdout.splitlines() if ln.split(" ")[0] in ("PASSED", "SKIPPED", "FAILED")]
    got = {ln.split(" ")[0] + " " + ln.split(" ")[1].split("::")[1].rstrip(":") for ln in lines}
    assert got == {"PASSED test_grid[1-a]", "PASSED test_grid[3-a]", "PASSED test_grid[1-b]", "PASSED test_grid[3-b]",
                   "PASSED test_teardown_ran", "SKIPPED test_skips", "PASSED test_raises_match",
                   "FAILED test_raises_wrong_message", "PASSED test_fails[a]", "FAILED test_fails[b]"}, r.stdout
    assert "SKIPPED " in r.stdout and "no such thing here" in r.stdout
    assert "7 passed, 1 skipped, 2 failed" in r.stdout and r.returncode == 1, r.stdout
