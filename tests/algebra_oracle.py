#!/usr/bin/env python3
"""algebra_oracle.py — `lorakit resize` and `lorakit merge` against float64
NumPy: every module's delta is rebuilt densely here from the input file's
own tensors (LyCORIS's published formulas: LoRA up @ down, Tucker
einsum('ijkl,jr,ip->prkl'), LoHa (w1a w1b) * (w2a w2b), LoKr kron(w1, w2),
scale alpha / rank), the optimum at each rank from numpy.linalg.svd of that
dense matrix, and the output's delta from the written factors and alpha. So
nothing here shares code with src/algebra. Inputs: the LyCORIS fixtures
(written by lycoris-lora, tests/fixtures/lycoris/make_lycoris_fixtures.py),
the PEFT fixture (written by peft) and random adapters made here.
extract: BASE / TUNED pairs made here (F32 and BF16: an exactly rank-3
difference, a decaying spectrum, 3x3 and 1x1 convs, a bias, an unchanged
weight, names in one file only); the optimum from numpy.linalg.svd of the
dense f64 TUNED - BASE, the written delta from the output's factors: rel_fro
to 1e-6, the optimum inside [rel_fro_opt, rel_fro_opt_upper] (equal with
--exact-svd), rel_fro within 1e-3 of it at the defaults, bytes equal for
--threads 1 / 2, `lorakit fuse BASE OUT` = base + that delta within one ulp.
Checks: the reported rel_fro, rel_fro_opt and rel_spec equal the oracle's
to 1e-6; rel_fro <= (1 + 1e-6) x max(optimum, the F32 floor 1e-6) at F32;
at BF16 / F16 rel_fro <= (1 + 1e-6) x max(optimum, floor) with floor the
error of the optimum's own factors (numpy's SVD, sqrt(s) on each side, B
divided by the file's alpha / rank) each rounded once to nearest-even in
that dtype here (README "The BF16 bound"); merge is order- and
thread-independent byte for byte.
Usage: algebra_oracle.py LORAKIT TMPDIR"""
import json
import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python", "tests"))
import st_io  # noqa: E402

LK, TMP = sys.argv[1], sys.argv[2]
FX = os.path.join(HERE, "fixtures")
fails = []
checked = [0]
floors = [0]
worst = [0.0]


def f64(e):
    dt, a = e
    if dt == "BF16":
        return st_io.bf16_to_f64(a.reshape(-1)).reshape(a.shape)
    return a.astype(np.float64)


def modules(path):
    """{stem: {suffix: f64 array}} of a kohya / diffusers / PEFT file."""
    out = {}
    for k, e in st_io.read(path).items():
        for suf in ("lora_down.weight", "lora_up.weight", "lora_A.weight", "lora_B.weight", "lora_mid.weight",
                    "alpha", "hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2", "lokr_w1",
                    "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2"):
            if k.endswith("." + suf):
                out.setdefault(k[: -len(suf) - 1], {})[suf] = f64(e)
    return out


def dense(t, alpha_default=None):
    """The module's delta as an (out, N) f64 matrix, scale included."""
    def two(w):
        return w.reshape(w.shape[0], -1)
    if "lora_down.weight" in t or "lora_A.weight" in t:
        d = t.get("lora_down.weight", t.get("lora_A.weight"))
        u = t.get("lora_up.weight", t.get("lora_B.weight"))
        r = d.shape[0]
        if "lora_mid.weight" in t:
            m = t["lora_mid.weight"]
            full = np.einsum("ijkl,jr,pi->prkl", m, two(d), two(u))
            delta = full.reshape(full.shape[0], -1)
        else:
            delta = two(u) @ two(d)
        alpha = float(t["alpha"]) if "alpha" in t else (alpha_default if alpha_default is not None else r)
        return delta * (alpha / r)
    if "hada_w1_a" in t:
        def half(a, b, c):
            if c is not None:
                f = np.einsum("ijkl,jr,ip->prkl", c, two(b), a)
                return f.reshape(f.shape[0], -1)
            return a @ two(b)
        p = half(t["hada_w1_a"], t["hada_w1_b"], t.get("hada_t1")) * half(t["hada_w2_a"], t["hada_w2_b"], t.get("hada_t2"))
        r = t["hada_w1_b"].shape[0]
        alpha = float(t["alpha"]) if "alpha" in t else r
        return p * (alpha / r)
    w1 = t["lokr_w1"] if "lokr_w1" in t else t["lokr_w1_a"] @ t["lokr_w1_b"]
    if "lokr_w2" in t:
        w2 = two(t["lokr_w2"])
    elif "lokr_t2" in t:
        f = np.einsum("ijkl,jr,ip->prkl", t["lokr_t2"], two(t["lokr_w2_b"]), t["lokr_w2_a"])
        w2 = f.reshape(f.shape[0], -1)
    else:
        w2 = t["lokr_w2_a"] @ two(t["lokr_w2_b"])
    full_both = "lokr_w1" in t and "lokr_w2" in t
    r = t["lokr_w1_b"].shape[0] if "lokr_w1_b" in t else (t["lokr_w2_b"].shape[0] if "lokr_w2_b" in t else 1)
    alpha = float(t["alpha"]) if "alpha" in t and not full_both else r
    return np.kron(w1, w2) * (1.0 if full_both else alpha / r)


def round_to(x, dtype):
    """x rounded once (nearest, ties to even) to BF16 (8 significant bits) or F16 (11, subnormal below 2^-14)."""
    bits, emin = (8, -126) if dtype == "BF16" else (11, -14)
    _, e = np.frexp(x)  # x = m 2^e, 0.5 <= |m| < 1
    q = np.ldexp(1.0, np.maximum(e - 1, emin) - (bits - 1))
    return np.rint(x / q) * q


def floor_of(X, k, alpha, dtype):
    """The dtype's floor at rank k: ||X - c round(Be / c) round(Ae)|| / ||X|| for the optimum Be Ae, c = alpha / k."""
    u, s, vt = np.linalg.svd(X, full_matrices=False)
    c = alpha / k
    be, ae = u[:, :k] * np.sqrt(s[:k]), np.sqrt(s[:k])[:, None] * vt[:k]
    return np.linalg.norm(X - c * round_to(be / c, dtype) @ round_to(ae, dtype)) / np.linalg.norm(X)


def run(*args):
    p = subprocess.run([LK, *args], capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"lorakit {' '.join(args)} failed: {p.stderr}")
    return p.stdout


def check_close(what, got, want, tol=1e-6):
    if not abs(got - want) <= tol:
        fails.append(f"{what}: reported {got!r}, oracle {want!r}")


def check(report, expect):
    """expect: {name: dense X}; the output is read back from report['output']."""
    out = report["output"]
    path = os.path.join(out, "adapter_model.safetensors") if os.path.isdir(out) else out
    written = modules(path)
    cfg = None
    if os.path.isdir(out):
        cfg = json.load(open(os.path.join(out, "adapter_config.json")))
    tot_n, tot_e, tot_o = 0.0, 0.0, 0.0
    for m in report["modules"]:
        X = expect[m["name"]]
        key = [k for k in written if k.endswith(m["name"].replace(".", "_")) or k.endswith(m["name"])
               or k == "base_model.model." + m["name"]]
        if len(key) != 1:
            fails.append(f"{m['name']}: not found once in {path}: {key}")
            continue
        t = written[key[0]]
        Y = dense(t, report["alpha"])
        if cfg is not None:  # PEFT: lora_alpha / (rank_pattern or r)
            r = t["lora_A.weight"].shape[0]
            Y = Y / (report["alpha"] / r) * (cfg["lora_alpha"] / cfg["rank_pattern"].get(m["name"], cfg["r"]))
        s = np.linalg.svd(X, compute_uv=False)
        k = m["rank"]
        nx = np.linalg.norm(X)
        opt = np.sqrt(np.sum(s[k:] ** 2)) / nx
        err = np.linalg.norm(X - Y) / nx
        spec = np.linalg.norm(X - Y, 2) / s[0]
        checked[0] += 1
        worst[0] = max(worst[0], abs(m["rel_fro"] - err), abs(m["rel_spec"] - spec))
        check_close(f"{m['name']} rel_fro", m["rel_fro"], err)
        check_close(f"{m['name']} rel_fro_opt", m["rel_fro_opt"], opt)
        check_close(f"{m['name']} rel_spec", m["rel_spec"], spec)
        if report["dtype"] == "F32" and not err <= (1 + 1e-6) * max(opt, 1e-6):
            fails.append(f"{m['name']}: rel_fro {err} above (1 + 1e-6) x max(optimum {opt}, 1e-6)")
        if report["dtype"] != "F32" and not report["options"]["exact"] and cfg is None:
            fl = floor_of(X, k, report["alpha"], report["dtype"])
            floors[0] += 1
            if not err <= (1 + 1e-6) * max(opt, fl):
                fails.append(f"{m['name']}: {report['dtype']} rel_fro {err} above (1 + 1e-6) x max(optimum {opt}, "
                             f"floor {fl})")
        tot_n += nx ** 2
        tot_e += np.linalg.norm(X - Y) ** 2
        tot_o += np.sum(s[k:] ** 2)
    check_close("total rel_fro", report["rel_fro"], np.sqrt(tot_e / tot_n))
    check_close("total rel_fro_opt", report["rel_fro_opt"], np.sqrt(tot_o / tot_n))


def lyco(name):
    return os.path.join(FX, "lycoris", name + ".safetensors")


# resize of every LyCORIS kind, at F32 (the oracle's bound) and BF16 (reported error checked only)
for case in ("lora_linear", "locon", "locon_tucker", "loha", "loha_tucker", "lokr", "lokr_both", "lokr_conv",
             "lokr_conv4d", "lokr_full", "lokr_tucker"):
    src = modules(lyco(case))
    X = {k: dense(v) for k, v in src.items()}
    for opts in (["--rank", "2", "--dtype", "F32"], ["--err", "0.3", "--dtype", "F32"], ["--dtype", "F32"],
                 ["--rank", "1", "--dtype", "BF16"], ["--fro", "0.9", "--dtype", "F16"]):
        out = os.path.join(TMP, f"{case}.safetensors")
        rep = json.loads(run("resize", lyco(case), "-o", out, "--json", *opts))
        check(rep, X)
        if opts[0] == "--err":
            for m in rep["modules"]:
                s = np.linalg.svd(X[m["name"]], compute_uv=False)
                tails = [np.sqrt(np.sum(s[k:] ** 2)) / np.linalg.norm(s) for k in range(len(s) + 1)]
                least = min(k for k in range(len(s) + 1) if tails[k] <= 0.3)
                if m["rank"] != max(least, 1):
                    fails.append(f"{case} {m['name']}: --err 0.3 kept rank {m['rank']}, the least is {least}")

# merge of two random kohya adapters (shared and own modules), strengths 0.7 and -1.3
rng = np.random.default_rng(7)
def rand_kohya(path, mods, seed):
    g = np.random.default_rng(seed)
    t = {}
    for name, (o, n, r, a) in mods.items():
        t[name + ".lora_down.weight"] = ("F32", g.standard_normal((r, n)).astype(np.float32))
        t[name + ".lora_up.weight"] = ("F32", (g.standard_normal((o, r)) * 0.1).astype(np.float32))
        t[name + ".alpha"] = ("F32", np.array(a, np.float32))
    st_io.write(path, t)
a = os.path.join(TMP, "a.safetensors")
b = os.path.join(TMP, "b.safetensors")
rand_kohya(a, {"lora_unet_x": (40, 24, 6, 3.0), "lora_unet_y": (16, 30, 4, 4.0)}, 1)
rand_kohya(b, {"lora_unet_x": (40, 24, 5, 5.0), "lora_unet_z": (20, 12, 3, 1.5)}, 2)
ma, mb = modules(a), modules(b)
X = {"lora_unet_x": 0.7 * dense(ma["lora_unet_x"]) - 1.3 * dense(mb["lora_unet_x"]),
     "lora_unet_y": 0.7 * dense(ma["lora_unet_y"]), "lora_unet_z": -1.3 * dense(mb["lora_unet_z"])}
for opts in (["--dtype", "F32"], ["--rank", "4", "--dtype", "F32"], ["--ratio", "0.2", "--dtype", "F32"],
             ["--rank", "3", "--dtype", "BF16"]):
    o1, o2, o3 = (os.path.join(TMP, f"m{i}.safetensors") for i in (1, 2, 3))
    rep = json.loads(run("merge", "-l", a + ":0.7", "-l", b + ":-1.3", "-o", o1, "--json", "--threads", "1", *opts))
    check(rep, X)
    run("merge", "-l", b + ":-1.3", "-l", a + ":0.7", "-o", o2, "--threads", "2", *opts)
    run("merge", "-l", b + ":-1.3", "-l", a + ":0.7", "-o", o3, "--threads", "3", *opts)
    if not open(o1, "rb").read() == open(o2, "rb").read() == open(o3, "rb").read():
        fails.append(f"merge {opts}: bytes depend on the -l order or the thread count")

# the PEFT fixture (written by peft) resized into PEFT, kohya and diffusers form
peft = os.path.join(FX, "adapters", "peft")
pcfg = json.load(open(os.path.join(peft, "adapter_config.json")))
pm = modules(os.path.join(peft, "adapter_model.safetensors"))
X = {}
for k, v in pm.items():
    name = k[len("base_model.model."):]
    r = v["lora_A.weight"].shape[0]
    alpha = pcfg.get("alpha_pattern", {}).get(name, pcfg["lora_alpha"])
    X[name] = v["lora_B.weight"] @ v["lora_A.weight"] * (alpha / r)
for fmt in ("peft", "diffusers"):
    out = os.path.join(TMP, "p_" + fmt + ("" if fmt == "peft" else ".safetensors"))
    rep = json.loads(run("resize", peft, "-o", out, "--json", "--rank", "1", "--dtype", "F32", "--format", fmt))
    check(rep, X)

# ---- extract: TUNED - BASE against numpy.linalg.svd of the dense f64 difference ----
def write_pair(pb, pt, dtype, seed):
    """BASE and TUNED: a linear weight whose difference is exactly rank 3, one with a decaying
    spectrum, a 3x3 conv, a 1x1 conv, a changed bias, an unchanged weight, one name in each file only."""
    g = np.random.default_rng(seed)
    def enc(x):
        return ("BF16", st_io.f32_to_bf16(x)) if dtype == "BF16" else ("F32", x.astype(np.float32))
    def dec(e):
        return f64(e)
    b, t = {}, {}
    def pair(name, base, delta):
        b[name] = enc(base)
        t[name] = enc(dec(b[name]) + delta)
    pair("blk.q.weight", g.standard_normal((48, 40)), g.standard_normal((48, 3)) @ g.standard_normal((3, 40)))
    pair("blk.k.weight", g.standard_normal((30, 70)), g.standard_normal((30, 70)) * np.exp(-np.arange(70) / 6.0))
    pair("blk.conv.weight", g.standard_normal((16, 8, 3, 3)), 0.2 * g.standard_normal((16, 8, 3, 3)) *
         np.exp(-np.arange(16) / 3.0)[:, None, None, None])
    pair("blk.pw.weight", g.standard_normal((12, 20, 1, 1)),
         (g.standard_normal((12, 2)) @ g.standard_normal((2, 20))).reshape(12, 20, 1, 1))
    pair("blk.q.bias", g.standard_normal(48), np.ones(48))
    u = g.standard_normal((10, 10))
    b["same.weight"] = t["same.weight"] = enc(u)
    b["gone.weight"] = enc(u)
    t["new.weight"] = enc(u)
    st_io.write(pb, b)
    st_io.write(pt, t)
    return {k[:-7]: (dec(t[k]) - dec(b[k])).reshape(dec(b[k]).shape[0], -1)
            for k in b if k in t and k.endswith(".weight") and k != "same.weight"}


def check_extract(rep, D, exact, floor):
    path = rep["output"]
    written = modules(path)
    for m in rep["modules"]:
        X = D[m["name"]]
        Y = dense(written[m["name"]], rep["alpha"])
        s = np.linalg.svd(X, compute_uv=False)
        nx = np.linalg.norm(X)
        opt = np.sqrt(np.sum(s[m["rank"]:] ** 2)) / nx
        err = np.linalg.norm(X - Y) / nx
        checked[0] += 1
        worst[0] = max(worst[0], abs(m["rel_fro"] - err))
        check_close(f"extract {m['name']} rel_fro", m["rel_fro"], err)
        if exact:
            check_close(f"extract --exact-svd {m['name']} rel_fro_opt", m["rel_fro_opt"], opt)
        elif not (m["rel_fro_opt"] <= opt + 1e-9 and m["rel_fro_opt_upper"] >= opt - 1e-9):
            fails.append(f"extract {m['name']}: the optimum {opt} is outside the reported bounds "
                         f"[{m['rel_fro_opt']}, {m['rel_fro_opt_upper']}]")
        defaults = "--power" not in rep["options"] and rep["options"]["power"] == 2 and rep["options"]["oversample"] == 8
        if defaults and not err <= max(opt + 1e-3, floor):  # the target at the defaults: within 1e-3 of the optimum
            fails.append(f"extract {m['name']} {rep['options']}: rel_fro {err} vs optimum {opt}")
    lists = {k: rep[k] for k in ("unchanged", "only_in_base", "only_in_tuned")}
    if lists != {"unchanged": ["same.weight"], "only_in_base": ["gone.weight"], "only_in_tuned": ["new.weight"]}:
        fails.append(f"extract: the weights not extracted are listed as {lists}")
    if [x["name"] for x in rep["not_extracted"]] != ["blk.q.bias"]:
        fails.append(f"extract: not_extracted {rep['not_extracted']}")


for dtype, floor in (("F32", 1e-6), ("BF16", 2.0 ** -7)):
    pb, pt = os.path.join(TMP, f"xb_{dtype}.safetensors"), os.path.join(TMP, f"xt_{dtype}.safetensors")
    D = write_pair(pb, pt, dtype, 11)
    for opts, exact in ((["--rank", "3"], False), (["--rank", "5", "--power", "0", "--oversample", "4"], False),
                        (["--err", "0.2"], False), (["--rank", "4", "--exact-svd"], True),
                        (["--rank", "3", "--conv-rank", "6"], False)):
        o1, o2 = os.path.join(TMP, "x1.safetensors"), os.path.join(TMP, "x2.safetensors")
        rep = json.loads(run("extract", pb, pt, "-o", o1, "--json", "--threads", "1", *opts))
        check_extract(rep, D, exact, floor)
        q = [m for m in rep["modules"] if m["name"] == "blk.q"][0]
        if opts[:2] == ["--rank", "3"] and not q["rel_fro"] <= floor:  # exactly rank 3: recovered to the dtype floor
            fails.append(f"extract {dtype} {opts}: the exact rank-3 difference has rel_fro {q['rel_fro']}")
        if opts == ["--rank", "3"]:  # lorakit fuse BASE OUT gives base + the oracle's delta of the written file
            fused = os.path.join(TMP, "xf.safetensors")
            run("fuse", pb, "-l", o1, "-o", fused)
            fw, bw, written = st_io.read(fused), st_io.read(pb), modules(o1)
            for m in rep["modules"]:
                k = m["name"] + ".weight"
                want = f64(bw[k]).reshape(D[m["name"]].shape) + dense(written[m["name"]], rep["alpha"])
                got = f64(fw[k]).reshape(want.shape)
                ulp = np.abs(want) * (2.0 ** -8 if dtype == "BF16" else 2.0 ** -23) + 1e-30
                if not np.all(np.abs(got - want) <= ulp):
                    fails.append(f"extract {dtype}: fuse of the output differs from base + delta at {k}")
        run("extract", pb, pt, "-o", o2, "--threads", "2", *opts)
        if open(o1, "rb").read() != open(o2, "rb").read():
            fails.append(f"extract {dtype} {opts}: bytes depend on the thread count")
        if opts[0] == "--err":
            for m in rep["modules"]:
                if not m["rel_fro"] <= 0.2 + floor:
                    fails.append(f"extract --err 0.2: {m['name']} rel_fro {m['rel_fro']}")

if floors[0] < 40:  # the BF16 / F16 runs above: 11 LyCORIS cases x 2 option sets + one merge
    fails.append(f"only {floors[0]} modules were checked against their dtype's floor")
if checked[0] < 180:  # 11 LyCORIS cases x 5 option sets, 4 merges, 2 PEFT resizes: a silent skip would show here
    fails.append(f"only {checked[0]} modules were checked")
if fails:
    print("\n".join(fails))
    sys.exit(1)
print(f"algebra_oracle: ok ({checked[0]} modules, {floors[0]} against their dtype's floor; largest |reported - oracle| {worst[0]:.3g})")
