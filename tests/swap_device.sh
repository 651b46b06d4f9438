#!/usr/bin/env bash
# swap_device.sh LORAKIT BUILD_DIR — `lorakit swap --device`: the working
# weights on the emulated device (1 and 3 ranks, host and device backups)
# give, step by step, the digests of the same plan on the CPU and of an
# offline `lorakit fuse` (adapter2 at -0.75), the base's digest after the
# reset, and a failing step (a NaN in a lora_B) changes nothing. --device
# cuda without a GPU or driver: exit 1 saying so; where a GPU exists the
# same digests are required. A bad device name is a usage error (exit 2).
set -euo pipefail
LK="$1"
LK_FAULT_LIB=1 source "$(dirname "$0")/fault_fuse.sh"
if ! command -v mpirun >/dev/null; then echo "skip: no mpirun"; exit 0; fi
source "$(dirname "$0")/util/mpi_env.sh"

work="$(mktemp -d "${TMPDIR:-/tmp}/lkswapdev.XXXXXX")"
trap 'rm -rf "$work"' EXIT
make_fixtures "$work"
cat >"$work/plan.yaml" <<'EOF'
bucket_mb: 1
steps:
  - loras: [{path: adapter.safetensors, strength: 0.5}]
  - loras: [{path: adapter.safetensors, strength: 0.5}, {path: nan.safetensors, strength: 1.0}]
  - loras: [{path: adapter2.safetensors, strength: -0.75}]
  - loras: []
EOF
"$LK" fuse "$work/base.safetensors" -l "$work/adapter2.safetensors:-0.75" -o "$work/off.safetensors" >/dev/null
want3=$("$LK" digest "$work/off.safetensors" | awk '{print $1}')
want4=$("$LK" digest "$work/base.safetensors" | awk '{print $1}')
digests() { sed -n 's/.*"digest": *"\([0-9a-f]*\)".*/\1/p' "$1" | tr '\n' ' '; }
statuses() { sed -n 's/.*"status": *"\([a-z]*\)".*/\1/p' "$1" | tr '\n' ' '; }

rc=0
"$LK" swap "$work/base.safetensors" --plan "$work/plan.yaml" --json >"$work/cpu.json" 2>"$work/cpu.err" || rc=$?
[ "$rc" -eq 1 ] || fail "cpu: exit $rc, want 1 (step 2 fails)"
cpu=$(digests "$work/cpu.json")
[ "$(statuses "$work/cpu.json")" = "ok error ok ok " ] || fail "cpu: statuses $(statuses "$work/cpu.json")"
set -- $cpu
[ "$1" = "$2" ] && [ "$3" = "$want3" ] && [ "$4" = "$want4" ] || fail "cpu digests $cpu (offline $want3, base $want4)"

for run in "1 host" "3 host" "2 device"; do
  set -- $run
  out="$work/emul$1$2.json"
  rc=0
  mpirun -n "$1" "$LK" swap "$work/base.safetensors" --plan "$work/plan.yaml" --json --device emul --backup "$2" \
    >"$out" 2>"$work/err" || rc=$?
  [ "$rc" -eq 1 ] || { cat "$work/err" >&2; fail "emul, $1 ranks, $2 backup: exit $rc, want 1"; }
  [ "$(digests "$out")" = "$cpu" ] || fail "emul, $1 ranks, $2 backup: digests $(digests "$out"), cpu $cpu"
  [ "$(statuses "$out")" = "ok error ok ok " ] || fail "emul, $1 ranks: statuses $(statuses "$out")"
  grep -q '"digests_agree": false' "$out" && fail "emul, $1 ranks: ranks disagree"
  echo "ok: --device emul, $1 ranks, $2 backup: every step's digest equals the CPU's and the offline fuse"
done

rc=0
"$LK" swap "$work/base.safetensors" --plan "$work/plan.yaml" --json --device cuda >"$work/cuda.json" 2>"$work/cuda.err" || rc=$?
if grep -q "no CUDA driver or device is available" "$work/cuda.err"; then
  [ "$rc" -eq 1 ] || fail "--device cuda without a GPU: exit $rc, want 1"
  [ ! -s "$work/cuda.json" ] || fail "--device cuda without a GPU: steps ran"
  echo "ok: --device cuda without a GPU: exit 1, $(head -c 160 "$work/cuda.err")"
else
  [ "$(digests "$work/cuda.json")" = "$cpu" ] || fail "cuda: digests $(digests "$work/cuda.json"), cpu $cpu: $(cat "$work/cuda.err")"
  echo "ok: --device cuda: every step's digest equals the CPU's"
fi
rc=0
"$LK" swap "$work/base.safetensors" --plan "$work/plan.yaml" --device gpu >/dev/null 2>"$work/bad.err" || rc=$?
[ "$rc" -eq 2 ] && grep -q "gpu" "$work/bad.err" || fail "--device gpu: exit $rc, $(cat "$work/bad.err")"
echo "swap_device: all passed"
