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
Checks: the reported rel_fro, rel_fro_opt and rel_spec equal the oracle's
to 1e-6; rel_fro <= (1 + 1e-6) x max(optimum, the F32 floor 1e-6) at F32;
merge is order- and thread-independent byte for byte.
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

if checked[0] < 180:  # 11 LyCORIS cases x 5 option sets, 4 merges, 2 PEFT resizes: a silent skip would show here
    fails.append(f"only {checked[0]} modules were checked")
if fails:
    print("\n".join(fails))
    sys.exit(1)
print(f"algebra_oracle: ok ({checked[0]} modules; largest |reported - oracle| {worst[0]:.3g})")
