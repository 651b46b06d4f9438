#!/usr/bin/env python3
"""gen_matching.py CASE OUTDIR [N_MODULES N_KEYS] — adapters whose name matching
is the expensive part (issue 20 item 13), written with the standard library
only (CI has no torch).

Every adapter is a PEFT folder: adapter_model.safetensors with one F32 1x1
lora_A / lora_B pair per module "blocks.<i>.attn.to_q" (rank 1, so every
rank_pattern value below is 1 and the adapter stays valid) and an
adapter_config.json; the base "base.safetensors" holds the matching 1x1
"<prefix>blocks.<i>.attn.to_q.weight" keys.

Cases:
  plain    N_MODULES modules (default 10000) and N_KEYS (default 2000) plain
           names in each of target_modules, exclude_modules (names that match
           nothing), modules_to_save-free rank_pattern and alpha_pattern (full
           module names "blocks.<j>.attn.to_q", literal but for PEFT's '.',
           and bare ones "x<j>"); the base keys carry a ComfyUI-style prefix
           ("model.diffusion_model.") so a fuse resolves every module by
           suffix.
  regex    N_MODULES modules (default 200) "b.blocks.<i>.aaa...a.to_q" and
           N_KEYS (default 100) rank_pattern keys that each take close to
           PCRE2's per-match limit on every module name (nested quantifiers
           over a run of 'a's not followed by 'b'), none of which matches.
  atoms    N_MODULES modules (default 10000) and N_KEYS (default 2000) keys
           in each of rank_pattern ("blocks\\.<5j>\\.attn\\.to_q") and
           alpha_pattern ("blocks\\.<j>\\d\\.attn\\.to_[a-z]"): regexes that
           are runs of one-character atoms, matched by lookup.
  grams    like atoms, with regex keys that need PCRE2 but each require a
           distinctive literal ("(?:blocks|layers)\\.<5j>\\.attn\\.to_q",
           ".*\\.<j>\\d\\.attn\\.to_(?:q|k)").
  mixed    [PEFT_VERSION [MODULES_TO_SAVE_JSON]] the MIXED_* adapter below (a
           few hundred modules).
"""
import json
import os
import struct
import sys


def write_st(path, names):
    """F32 1x1 tensors of value 0.5, in name order."""
    hdr, off = {}, 0
    for n in names:
        hdr[n] = {"dtype": "F32", "shape": [1, 1], "data_offsets": [off, off + 4]}
        off += 4
    h = json.dumps(hdr, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        f.write(struct.pack("<f", 0.5) * len(names))


def adapter(out, mods, cfg, base_prefix=""):
    os.makedirs(out, exist_ok=True)
    keys = []
    for m in mods:
        keys += ["base_model.model.%s.lora_A.weight" % m, "base_model.model.%s.lora_B.weight" % m]
    write_st(os.path.join(out, "adapter_model.safetensors"), keys)
    base = {"peft_type": "LORA", "r": 1, "lora_alpha": 1, "peft_version": "0.17.0"}
    base.update(cfg)
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump(base, f)
    write_st(os.path.join(out, "base.safetensors"), [base_prefix + m + ".weight" for m in mods])


# "mixed": every kind of key the matcher tells apart, for a comparison
# with Python's re under PEFT's rules (tests/matching_bound.sh): plain
# names, names plain but for '.', a '.' that matches '_' ("attn.to.v" on
# "attn_to_v"), runs of one-character atoms (escaped dots and '_', \d \w
# \s \S, sets with ranges, '^', a leading ']', a '-', a one-character set;
# keys with equal literal bytes that differ only in a set, in key order),
# regexes before and after them, a non-ASCII name and key (the regex path),
# keys that match nothing.
MIXED_MODULES = sorted(
    ["blocks.%d.attn.to_%s" % (i, x) for i in range(30) for x in "qkv"]
    + ["blocks.%d.ff.net.0.proj" % i for i in range(30)]
    + ["single.%d.attn_to_v" % i for i in range(30)]
    + ["blocks.%d.attn.t\u00f6_q" % i for i in range(3)]
)
MIXED_KEYS = [
    "blocks.1.attn.to_q", r"blocks\.1\d\.attn\.to_\d", r"blocks\.1\d\.attn\.to_[^q]", "attn.to.v",
    r"blocks\.1\d\.attn\.to_[a-z]", r"blocks\.2\d\.attn\.to_[qk]", r"[^.]\.attn\.to_v", r"blocks\.2[-9]\.attn\.to_k",
    "to_k", r"[]x]locks\.5\.ff\.net\.0\.proj", r"[b-c]locks\.5\.ff\.net\.0\.proj", r"attn\.to_\s", "proj",
    r"single\.\d\.attn[_]to\wv", "single.1.attn.to.v", "t\u00f6_q", "blocks.2", r"blocks\.3\.attn\.to\_v", r"attn\.to_q",
    "x.y.z", "blocks.1.ff.net.0.proj", r"ff\.net\.\S\.proj", "q", "single.12.attn_to_v", "attn_to_v", r"to_[\w]",
    r"(?:blocks|single)\.1\d?\.attn[._]to_v", r"x*blocks\.2\.ff\.net\.0\.pro+j", r"attn\.to_[kq]+",
    r"(?i:BLOCKS)\.4\.attn\.to_k", r"ab?locks\.5\.attn\.to_q|single\.5\..*",
]
MIXED_CONFIG = {
    "r": 1,
    "lora_alpha": 1,
    "alpha_pattern": {k: i + 2 for i, k in enumerate(MIXED_KEYS)},
    "rank_pattern": {"attn.to.v": 1, r"blocks\.2[0-4]\.attn\.to_k": 1, r"blocks\.2\d\..*": 1},
    "target_modules": ["to_q", "to_k", "attn_to_v", "proj", "t\u00f6_q"],
    "exclude_modules": ["blocks.3.attn.to_q", "0.proj", "single.2.attn.to.v"],
}


def main():
    case, out = sys.argv[1], sys.argv[2]
    if case == "plain":
        nm = int(sys.argv[3]) if len(sys.argv) > 3 else 10000
        nk = int(sys.argv[4]) if len(sys.argv) > 4 else 2000
        mods = ["blocks.%d.attn.to_q" % i for i in range(nm)]
        # half full names (literal but for '.'), half bare names, interleaved
        pat = {}
        for j in range(nk):
            pat[("blocks.%d.attn.to_q" % (nm + j)) if j % 2 else ("x%d" % j)] = 1
        cfg = {
            "target_modules": ["t%d" % j for j in range(nk - 1)] + ["to_q"],
            "exclude_modules": ["e%d" % j for j in range(nk)],
            "rank_pattern": pat,
            "alpha_pattern": dict(pat),
        }
        adapter(out, mods, cfg, "model.diffusion_model.")
    elif case in ("atoms", "grams"):
        # atoms: keys that are runs of one-character atoms, as PEFT users
        # write them: N_KEYS rank_pattern keys with escaped dots, each naming
        # one module, and N_KEYS alpha_pattern keys with \d and a [...] set,
        # each naming the ten modules blocks.<j><digit>. grams: the same
        # modules through regex keys (groups, alternation, '.*') that each
        # require a distinctive literal (the required-literal prefilter)
        nm = int(sys.argv[3]) if len(sys.argv) > 3 else 10000
        nk = int(sys.argv[4]) if len(sys.argv) > 4 else 2000
        rank_fmt, alpha_fmt = {
            "atoms": (r"blocks\.%d\.attn\.to_q", r"blocks\.%d\d\.attn\.to_[a-z]"),
            "grams": (r"(?:blocks|layers)\.%d\.attn\.to_q", r".*\.%d\d\.attn\.to_(?:q|k)"),
        }[case]
        cfg = {
            "target_modules": ["to_q"],
            "rank_pattern": {rank_fmt % (5 * j): 1 for j in range(nk)},
            "alpha_pattern": {alpha_fmt % j: j + 2 for j in range(nk)},
        }
        adapter(out, ["blocks.%d.attn.to_q" % i for i in range(nm)], cfg)
    elif case == "regex":
        nm = int(sys.argv[3]) if len(sys.argv) > 3 else 200
        nk = int(sys.argv[4]) if len(sys.argv) > 4 else 100
        run = int(os.environ.get("LK_GEN_RUN", "25"))
        mods = ["b.blocks.%d.%s.to_q" % (i, "a" * run) for i in range(nm)]
        # (a|aa)+ explores Fibonacci(run) ways of splitting the run (at 25,
        # about 30 ms and just under PCRE2's limit of 10^6 steps here; 26
        # exceeds it); a comment (?#j) keeps the JSON keys distinct
        pat = {"(?:a|aa)+b(?#%d)" % j: 1 for j in range(nk)}
        adapter(out, mods, {"target_modules": ["to_q"], "rank_pattern": pat})
    elif case == "mixed":
        ver = sys.argv[3] if len(sys.argv) > 3 else "0.17.0"
        cfg = dict(MIXED_CONFIG, peft_version=ver)
        if len(sys.argv) > 4:  # a JSON list for modules_to_save
            cfg["modules_to_save"] = json.loads(sys.argv[4])
        adapter(out, MIXED_MODULES, cfg)
    else:
        sys.exit("unknown case " + case)


if __name__ == "__main__":
    main()
