#!/usr/bin/env bash
# matching_bound.sh LORAKIT BUILD_DIR — name matching is bounded in total
# (issue 20 item 13), and gives the results PEFT's rules give.
#  - 10,000 modules against 2,000 plain keys in each of target_modules,
#    exclude_modules, rank_pattern and alpha_pattern (tests/gen_matching.py
#    plain): `inspect` and a `fuse` onto keys under a wrapper prefix succeed
#    within BOUND seconds (13.7 s and 10.1 s before, 1.3 s / 1.6 s after on
#    the 2-core VM; BOUND leaves room for a loaded machine).
#  - 10,000 modules against 2,000 rank_pattern keys with escaped dots and
#    2,000 alpha_pattern keys with \d and a [...] set (gen_matching.py
#    atoms; QA's escaped10k / digits10k): inspect succeeds (refused by the
#    matching budget in 1.4 s before, ~1 s after), and a sample of modules
#    gets the alpha source Python's re gives. The same with 2,000 + 2,000
#    regex keys that each require a distinctive literal (gen_matching.py
#    grams: groups, '|' inside a group, '.*'): inspect succeeds through the
#    required-literal prefilter (refused by the budget after 2.5 s before,
#    ~1.7 s after), sample equal to Python's re.
#  - 100 rank_pattern keys that each take close to PCRE2's per-match limit
#    on 200 modules (gen_matching.py regex; ~220 s before): `inspect` exits 1
#    within BOUND seconds naming the config key, the pattern and the budget.
#  - The mixed adapter (plain, plain-but-for-'.', '.' matching '_', regexes
#    before and after plain keys, non-ASCII names and keys) at PEFT 0.17,
#    0.14 and 0.13 rules, and at 0.17 with modules_to_save: every module's
#    alpha source and the untargeted count equal what Python's `re` gives
#    under PEFT's rules, computed here
#    (the rules as config.c documents them: (.*\.)?(key)$ since 0.15,
#    .*\.key$ before with rank keys chained first at <= 0.13, then the exact
#    name; target/exclude lists: the name or a '.'-suffix; modules_to_save:
#    (^|.*\.)entry($|\..*)).
set -euo pipefail
LK="$1"
HERE="$(cd "$(dirname "$0")" && pwd)"
BOUND=${LK_MATCH_BOUND:-30}
work="$(mktemp -d "${TMPDIR:-/tmp}/lkmatch.XXXXXX")"
trap 'rm -rf "$work"' EXIT
fail() { echo "matching_bound.sh: FAIL: $*" >&2; exit 1; }
command -v python3 >/dev/null || { echo "skip: no python3"; exit 0; }

python3 "$HERE/gen_matching.py" plain "$work/plain"
python3 "$HERE/gen_matching.py" regex "$work/regex"

t0=$(date +%s.%N)
rc=0; timeout "$BOUND" "$LK" inspect "$work/plain" >"$work/out" 2>"$work/err" || rc=$?
t1=$(date +%s.%N)
[ "$rc" -eq 0 ] || fail "plain inspect: rc $rc $(head -c 500 "$work/err")"
grep -q "modules: 10000" "$work/out" || fail "plain inspect: $(head -5 "$work/out")"
echo "ok: plain 10k modules x 2k keys inspect in $(echo "$t1 - $t0" | bc) s"
rc=0; timeout "$BOUND" "$LK" fuse "$work/plain/base.safetensors" -l "$work/plain" -o "$work/f.safetensors" \
  >"$work/out" 2>"$work/err" || rc=$?
t2=$(date +%s.%N)
[ "$rc" -eq 0 ] || fail "plain fuse: rc $rc $(head -c 500 "$work/err")"
grep -q "into 10000 of 10000 tensors" "$work/out" || fail "plain fuse: $(cat "$work/out")"
echo "ok: plain fuse by suffix in $(echo "$t2 - $t1" | bc) s"

for case in atoms grams; do
python3 "$HERE/gen_matching.py" $case "$work/$case"
rc=0; timeout "$BOUND" "$LK" inspect "$work/$case" --json >"$work/$case.json" 2>"$work/err" || rc=$?
t25=$(date +%s.%N)
[ "$rc" -eq 0 ] || fail "$case inspect: rc $rc $(head -c 500 "$work/err")"
python3 - "$work/$case.json" "$work/$case/adapter_config.json" <<'EOF' || fail "$case: lorakit differs from Python's re"
import json, re, sys
got = {m["module"]: m for m in json.load(open(sys.argv[1]))["modules"]}
cfg = json.load(open(sys.argv[2]))
assert len(got) == 10000, len(got)
comp = {}
def first(d, name):  # PEFT >= 0.15: the first key k with re.match(r"(.*\.)?(k)$", name)
    for k, v in d.items():
        if k not in comp:
            comp[k] = re.compile(r"(.*\.)?(%s)$" % k)
        if comp[k].match(name):
            return k, v
    return None, None
bad = 0
for i in list(range(0, 10000, 101)) + [5, 10, 9995, 1999]:
    name = "blocks.%d.attn.to_q" % i
    m = got[name]
    k, _ = first(cfg["alpha_pattern"], name)
    want = 'alpha_pattern "%s"' % k if k else "config"
    if m["alpha_source"] != want:
        print(name, m["alpha_source"], "want", want); bad += 1
sys.exit(1 if bad else 0)
EOF
echo "ok: $case: 10k modules x 2k + 2k keys inspect in $(echo "$t25 - $t2" | bc) s (equals Python's re on a sample)"
t2=$(date +%s.%N)
done

rc=0; timeout "$BOUND" "$LK" inspect "$work/regex" >"$work/out" 2>"$work/err" || rc=$?
t3=$(date +%s.%N)
[ "$rc" -eq 1 ] || fail "regex inspect: rc $rc (want 1 within ${BOUND} s) $(head -c 500 "$work/err")"
grep -q 'rank_pattern: pattern "(?:a|aa)+b(?#[0-9]*)" on module b.blocks.*total matching budget' "$work/err" ||
  fail "regex inspect: $(cat "$work/err")"
echo "ok: 100 near-limit patterns x 200 modules refused in $(echo "$t3 - $t2" | bc) s: $(cut -c1-160 "$work/err")"

mts='["ff", "blocks.1", "attn.to.v", "b.ocks.2", "attn\\\\.to_[kq]"]'
for ver in 0.17.0 0.14.0 0.13.0 0.17.0+mts; do
  if [ "$ver" = 0.17.0+mts ]; then python3 "$HERE/gen_matching.py" mixed "$work/mixed$ver" 0.17.0 "$mts"
  else python3 "$HERE/gen_matching.py" mixed "$work/mixed$ver" "$ver"; fi
  "$LK" inspect "$work/mixed$ver" --json >"$work/mixed$ver.json" 2>"$work/err" ||
    fail "mixed $ver: $(cat "$work/err")"
  cfg="$work/mixed$ver/adapter_config.json"
  python3 - "$work/mixed$ver.json" "$ver" "$HERE" "$cfg" <<'EOF' || fail "mixed $ver differs from Python's re"
import json, re, sys
sys.path.insert(0, sys.argv[3])
from gen_matching import MIXED_CONFIG, MIXED_MODULES
got = json.load(open(sys.argv[1]))
minor = int(sys.argv[2].split(".")[1])
ap, rp = MIXED_CONFIG["alpha_pattern"], MIXED_CONFIG["rank_pattern"]
def hit(k, name):
    tmpl = r"(.*\.)?(%s)$" if minor >= 15 else r".*\.%s$"
    return re.match(tmpl % k, name) is not None
def source(name):
    keys = list(rp) + list(ap) if minor <= 13 else list(ap)
    for k in keys:
        if hit(k, name):
            if k in ap:
                return 'alpha_pattern "%s"' % k
            return "config"  # 0.13: a rank key that alpha_pattern lacks
    return 'alpha_pattern "%s"' % name if name in ap else "config"
def listed(lst, name):
    return any(name == e or name.endswith("." + e) for e in lst)
bad = 0
for m in got["modules"]:
    want = source(m["module"])
    if m["alpha_source"] != want:
        print("%s: lorakit %s, re %s" % (m["module"], m["alpha_source"], want)); bad += 1
mts = json.load(open(sys.argv[4])).get("modules_to_save") or []
unt = sum(1 for n in MIXED_MODULES
          if listed(MIXED_CONFIG["exclude_modules"], n) or not listed(MIXED_CONFIG["target_modules"], n)
          or any(re.match(r"(^|.*\.)%s($|\..*)" % m, n) for m in mts))
if got["untargeted"] != unt:
    print("untargeted: lorakit %d, rule %d" % (got["untargeted"], unt)); bad += 1
if len(got["modules"]) != len(MIXED_MODULES):
    print("module count", len(got["modules"])); bad += 1
srcs = {m["alpha_source"] for m in got["modules"]}
print("  %d modules, %d distinct alpha sources, %d untargeted" % (len(got["modules"]), len(srcs), unt))
sys.exit(1 if bad or len(srcs) < 4 else 0)
EOF
  echo "ok: mixed adapter at PEFT $ver equals Python's re"
done
echo "matching_bound: all passed"
