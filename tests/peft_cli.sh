#!/usr/bin/env bash
# peft_cli.sh LORAKIT BUILD_DIR — the PEFT fixtures (tests/fixtures/peft,
# written by the real peft package) through the command line.
# Expectations, from outside the library:
#  - `lorakit fuse` of each case equals, by digest, the library fuse that
#    test_peft_parity checks against PEFT's merge_and_unload (here: fusing
#    the folder and fusing the file with its sidecar config give one digest,
#    and the DoRA fuse at strength 0 is the base's digest);
#  - `lorakit inspect` names where alpha came from and what is replaced;
#  - refusals exit 1 naming why (DoRA with another adapter, two adapters
#    replacing one tensor), leaving no output;
#  - `lorakit swap` at 2 ranks through a plan with the DoRA and the
#    modules_to_save adapters gives, at every step, the digest of the
#    offline `lorakit fuse` of the same set, and the base's after a reset.
set -euo pipefail
LK="$1"
FX="$(cd "$(dirname "$0")" && pwd)/fixtures/peft"
work="$(mktemp -d "${TMPDIR:-/tmp}/lkpeft.XXXXXX")"
trap 'rm -rf "$work"' EXIT
fail() { echo "peft_cli.sh: FAIL: $*" >&2; exit 1; }
dig() { "$LK" digest "$1" | awk '{print $1}'; }
B="$FX/base_bf16.safetensors"

# inspect: alpha sources, DoRA, replaced tensors
"$LK" inspect "$FX/patterns" >"$work/out"
grep -q 'alpha_pattern "layer\\.\\d\\.attention\\.self\\.value"' "$work/out" || fail "inspect: alpha_pattern source"
"$LK" inspect "$FX/dora" | grep -q "DoRA:    yes" || fail "inspect: DoRA"
"$LK" inspect "$FX/modules_to_save" | grep -q "modules_to_save   base_model.model.pooler.dense.weight" ||
  fail "inspect: modules_to_save"
"$LK" inspect "$FX/sidecar/adapter_model.safetensors" | grep -q "peft (adapter_config.json)" ||
  fail "inspect: the config beside the file"

# folder and file-with-sidecar fuse alike
"$LK" fuse "$B" -l "$FX/sidecar" -o "$work/a.safetensors" >/dev/null
"$LK" fuse "$B" -l "$FX/sidecar/adapter_model.safetensors" -o "$work/b.safetensors" >/dev/null
[ "$(dig "$work/a.safetensors")" = "$(dig "$work/b.safetensors")" ] || fail "file + sidecar differs from the folder"
"$LK" fuse "$B" -l "$FX/dora:0" -o "$work/z.safetensors" >/dev/null
[ "$(dig "$work/z.safetensors")" = "$(dig "$B")" ] || fail "DoRA at strength 0 is not the base"

# refusals
rc=0; "$LK" fuse "$B" -l "$FX/dora" -l "$FX/patterns" -o "$work/r.safetensors" 2>"$work/err" || rc=$?
[ "$rc" -eq 1 ] && grep -q "a DoRA adapter must be the only adapter" "$work/err" || fail "DoRA + another: rc $rc $(cat "$work/err")"
rc=0; "$LK" fuse "$B" -l "$FX/bias_all" -l "$FX/modules_to_save" -o "$work/r.safetensors" 2>"$work/err" || rc=$?
[ "$rc" -eq 1 ] && grep -q "both replace pooler.dense.bias" "$work/err" || fail "two replacements: rc $rc $(cat "$work/err")"
[ ! -e "$work/r.safetensors" ] || fail "a refused fuse left an output"
echo "ok: fuse / inspect / refusals"

if ! command -v mpirun >/dev/null; then echo "skip: no mpirun"; exit 0; fi
source "$(dirname "$0")/util/mpi_env.sh"
cat >"$work/plan.yaml" <<EOF
bucket_mb: 1
steps:
  - loras: [{path: $FX/dora, strength: 1.0}]
  - loras: [{path: $FX/modules_to_save, strength: 1.0}, {path: $FX/lora_bias, strength: 0.5}]
  - loras: [{path: $FX/dora, strength: 0.5}]
  - loras: []
EOF
"$LK" fuse "$B" -l "$FX/dora:1" -o "$work/s1.safetensors" >/dev/null
"$LK" fuse "$B" -l "$FX/modules_to_save:1" -l "$FX/lora_bias:0.5" -o "$work/s2.safetensors" >/dev/null
"$LK" fuse "$B" -l "$FX/dora:0.5" -o "$work/s3.safetensors" >/dev/null
want=("$(dig "$work/s1.safetensors")" "$(dig "$work/s2.safetensors")" "$(dig "$work/s3.safetensors")" "$(dig "$B")")
out="$work/swap.json"
mpirun -n 2 "$LK" swap "$B" --plan "$work/plan.yaml" --json >"$out" 2>"$work/err" || { cat "$work/err" >&2; fail "swap failed"; }
[ "$(wc -l <"$out")" -eq 4 ] || { cat "$out" >&2; fail "want 4 step lines"; }
for s in 1 2 3 4; do
  line=$(sed -n "${s}p" "$out")
  echo "$line" | grep -q '"status": *"ok"' || fail "step $s: $line"
  echo "$line" | grep -q '"digests_agree": *true' || fail "step $s: ranks disagree"
  echo "$line" | grep -q "\"digest\": *\"${want[$((s - 1))]}\"" || fail "step $s: $line, offline ${want[$((s - 1))]}"
done
echo "ok: 2-rank swap of the DoRA and modules_to_save adapters equals the offline fuse at every step"
echo "peft_cli: all passed"
