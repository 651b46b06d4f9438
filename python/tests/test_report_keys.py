"""Tracker.apply's report keys are documented: the dict it returns has
exactly the keys of TrackerReport in __init__.pyi (and its phases those of
TrackerPhases), and each is described in Tracker.apply's docstring and the
README. Oracle: the returned dict against the stub file parsed with ast."""
import ast
import os

import numpy as np

import lorakit

HERE = os.path.dirname(os.path.abspath(__file__))
PYI = os.path.join(HERE, "..", "lorakit", "__init__.pyi")
README = os.path.join(HERE, "..", "..", "README.md")


def stub_keys(cls):
    tree = ast.parse(open(PYI).read())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return [n.target.id for n in node.body if isinstance(n, ast.AnnAssign)]


def test_report_keys_documented():
    rng = np.random.default_rng(0)
    t = {"w.weight": np.zeros((4, 8), np.float32)}
    ad = lorakit.Adapter.from_state_dict({"w.lora_A.weight": rng.uniform(size=(2, 8)).astype(np.float32),
                                          "w.lora_B.weight": rng.uniform(size=(4, 2)).astype(np.float32)}, alpha=2)
    with lorakit.Tracker(t) as tr:
        reports = [tr.apply([(ad, 1.0)], digest=True), tr.apply([(ad, 1.0)]), tr.reset()]
    keys = stub_keys("TrackerReport")
    readme = open(README).read()
    for r in reports:
        assert sorted(r) == sorted(keys), (sorted(r), keys)
        assert sorted(r["phases"]) == sorted(stub_keys("TrackerPhases"))
    for k in keys:
        assert k in lorakit.Tracker.apply.__doc__, k
        assert f"`{k}`" in readme, k
    assert reports[0]["keys_fused"] == 1 and reports[1]["skipped"] and reports[2]["keys_restored"] == 1
