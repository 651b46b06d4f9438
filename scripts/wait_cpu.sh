#!/usr/bin/env bash
# wait_cpu.sh LORAKIT [SECONDS] — the CPU a rank burns while it waits for a
# stalled one (issue 20 item 14; README, "Timeout"). Runs `mpirun -n 2
# LORAKIT swap` over a small base and a long plan, stops rank 1 (SIGSTOP)
# once rank 0 has printed its first step, then reads rank 0's utime+stime
# from /proc/PID/stat over SECONDS (default 5) and prints them as a share
# of one core. A build that busy-polls in its collectives shows ~100% (or
# its share of the cores when they are oversubscribed); lorakit's waits
# sleep between polls. --timeout 0, so no timeout ends the wait early.
# Everything started is killed at the end. Uses tests/fault_fuse.sh's
# fixtures. Example: scripts/wait_cpu.sh build/lorakit 5
set -euo pipefail
LK="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
SECS="${2:-5}"
here="$(cd "$(dirname "$0")" && pwd)"
LK_FAULT_LIB=1 source "$here/../tests/fault_fuse.sh"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
work="$(mktemp -d "${TMPDIR:-/tmp}/lkwaitcpu.XXXXXX")"
victim="" mp=""
cleanup() {
  [ -n "$victim" ] && { kill -CONT "$victim" 2>/dev/null || true; }
  [ -n "$mp" ] && { kill -TERM "$mp" 2>/dev/null || true; sleep 1; kill -KILL "$mp" 2>/dev/null || true; }
  for c in $(pgrep -P "${mp:-1}" 2>/dev/null); do kill -KILL "$c" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
make_fixtures "$work"
{ echo "steps:"; for i in $(seq 1 20000); do echo "  - loras: [{path: adapter.safetensors, strength: 0.5}]"; echo "  - loras: []"; done; } >"$work/plan.yaml"
to=()
"$LK" swap --help | grep -q -- --timeout && to=(--timeout 0)
mpirun -n 2 "$LK" swap "$work/base.safetensors" --plan "$work/plan.yaml" "${to[@]}" >"$work/out" 2>"$work/err" &
mp=$!
for _ in $(seq 1 600); do [ -s "$work/out" ] && break; sleep 0.1; done
[ -s "$work/out" ] || { echo "no step printed: $(cat "$work/err")" >&2; exit 1; }
rank_pid() {
  for c in $(pgrep -P "$mp"); do
    tr '\0' '\n' <"/proc/$c/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$1" && { echo "$c"; return; }
  done
}
victim=$(rank_pid 1) waiter=$(rank_pid 0)
kill -STOP "$victim"
sleep 0.5 # let rank 0 reach the collective
ticks() { awk '{ print $14 + $15 }' "/proc/$waiter/stat"; }
hz=$(getconf CLK_TCK)
a=$(ticks); t0=$(date +%s.%N)
sleep "$SECS"
b=$(ticks); t1=$(date +%s.%N)
awk -v a="$a" -v b="$b" -v t0="$t0" -v t1="$t1" -v hz="$hz" -v lk="$LK" \
  'BEGIN { printf "%s: waiting rank used %.2f s CPU in %.2f s (%.1f%% of a core)\n", lk, (b - a) / hz, t1 - t0, 100 * (b - a) / hz / (t1 - t0) }'
