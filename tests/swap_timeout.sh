#!/usr/bin/env bash
# swap_timeout.sh LORAKIT BUILD_DIR — a stalled rank under `lorakit swap
# --timeout 1` at 2 and 3 MPI ranks, and `--timeout` / plan `timeout:` /
# train config `timeout:` refusals.
# The stall is real: once rank 0 has printed its first step (every rank is
# past the tracker's creation and inside the plan), the last rank gets
# SIGSTOP, as a rank stuck in swap, a debugger or a hung file system would
# be. Expectations (README, "Timeout"): every other rank prints "lorakit:
# rank R: step N: tracker apply: ...: timed out ...; waiting for rank K (no
# answer ...); aborting the job" and the job ends with a non-zero exit well
# within the bound below (timeout 1 s + 0.5 s grace + 2 s for the other
# ranks' reports + Open MPI's abort),
# never hanging: every mpirun runs under `timeout`. The fixtures are
# fault_fuse.sh's (sourced).
set -euo pipefail
LK="$1"
LK_FAULT_LIB=1 source "$(dirname "$0")/fault_fuse.sh"
if ! command -v mpirun >/dev/null; then echo "skip: no mpirun"; exit 0; fi
source "$(dirname "$0")/util/mpi_env.sh"

work="$(mktemp -d "${TMPDIR:-/tmp}/lktimeout.XXXXXX")"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -CONT "$p" 2>/dev/null || true; kill -KILL "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
make_fixtures "$work"
{ # a long plan (4,000 steps: ~100 a second on the 2-vCPU VM): the stall lands inside it
  echo "steps:"
  for i in $(seq 1 2000); do
    echo "  - loras: [{path: adapter.safetensors, strength: 0.5}]"
    echo "  - loras: []"
  done
} >"$work/plan.yaml"

# usage errors first (no MPI needed)
for bad in -1 nan 1e10 abc ""; do
  rc=0; "$LK" swap "$work/base.safetensors" --plan "$work/plan.yaml" --timeout "$bad" 2>"$work/err" >/dev/null || rc=$?
  [ "$rc" -eq 2 ] && grep -q -- "--timeout expects seconds in 0..1e9" "$work/err" || fail "swap --timeout '$bad': exit $rc: $(cat "$work/err")"
done
printf 'timeout: -2\nsteps: []\n' >"$work/bad.yaml"
rc=0; "$LK" swap "$work/base.safetensors" --plan "$work/bad.yaml" 2>"$work/err" >/dev/null || rc=$?
[ "$rc" -eq 1 ] && grep -q "bad.yaml:1: timeout: expected seconds" "$work/err" || fail "plan timeout -2: exit $rc: $(cat "$work/err")"
rc=0; "$LK" train "$work/none.yaml" --timeout x 2>"$work/err" >/dev/null || rc=$?
[ "$rc" -eq 2 ] && grep -q -- "--timeout expects seconds" "$work/err" || fail "train --timeout x: exit $rc: $(cat "$work/err")"

# the pid of rank r among mpirun's children (Open MPI exports the rank)
rank_pid() {
  local mp="$1" r="$2" c
  for c in $(pgrep -P "$mp"); do
    if tr '\0' '\n' <"/proc/$c/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$r"; then echo "$c"; return; fi
  done
}

for np in 2 3; do
  out="$work/out$np" err="$work/err$np"
  timeout 120 mpirun -n "$np" "$LK" swap "$work/base.safetensors" --plan "$work/plan.yaml" --timeout 1 \
    >"$out" 2>"$err" &
  mp=$!
  for _ in $(seq 1 3000); do [ -s "$out" ] && break; sleep 0.1; done # ASan on a loaded VM: minutes
  [ -s "$out" ] || fail "$np ranks: no step printed in 300 s: $(cat "$err")"
  victim=""
  # timeout(1) is mpirun's parent: the ranks are mpirun's children
  mpid=$(pgrep -P "$mp" -x mpirun || pgrep -P "$mp" | head -1)
  for _ in $(seq 1 50); do victim=$(rank_pid "$mpid" $((np - 1))); [ -n "$victim" ] && break; sleep 0.1; done
  [ -n "$victim" ] || fail "$np ranks: rank $((np - 1)) not found under mpirun $mpid"
  pids+=("$victim")
  t0=$(date +%s.%N)
  kill -STOP "$victim"
  [ "$(wc -l <"$out")" -lt 4000 ] || fail "$np ranks: the plan ended before the stall (a faster machine: lengthen it)"
  rc=0; wait "$mp" || rc=$?
  t1=$(date +%s.%N)
  took=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", b - a }')
  kill -CONT "$victim" 2>/dev/null || true
  [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] || fail "$np ranks: exit $rc (124: hung) after the stall: $(tail -5 "$err")"
  awk -v t="$took" 'BEGIN { exit !(t < 30) }' || fail "$np ranks: took $took s to end after the stall"
  for r in $(seq 0 $((np - 2))); do
    line=$(grep "^lorakit: rank $r: step [0-9]*: " "$err" | head -1) || true
    [ -n "$line" ] || fail "$np ranks: rank $r printed no timeout report: $(cat "$err")"
    echo "$line" | grep -q "timed out (not complete after" || fail "$np ranks: rank $r: $line"
    echo "$line" | grep -q "waiting for rank $((np - 1)) (no answer" || fail "$np ranks: rank $r: $line"
    echo "$line" | grep -q "aborting the job" || fail "$np ranks: rank $r: $line"
    echo "$line" | grep -q -E "tracker apply: [a-z ]+: comm mpi |the step's report: |agreeing that every rank has this step: comm mpi " || fail "$np ranks: rank $r: $line"
  done
  echo "ok: $np ranks: stalled rank $((np - 1)) reported by every other rank, job ended (exit $rc) ${took} s after the stall"
  echo "    $(grep "^lorakit: rank 0: step" "$err" | head -1)"
done
echo "swap_timeout: all passed"
