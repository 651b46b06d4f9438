#!/usr/bin/env bash
# swap_stall_loop.sh LORAKIT [RUNS] [DELAY] — QA's reproduction for issue 20
# item 14: `mpirun -n 4 LORAKIT swap` over a 12,000-step plan with
# --timeout 3, rank 2 SIGSTOPped DELAY seconds (default 1.5) after launch,
# RUNS times (default 5). Each run prints its exit code, how long the job
# took to end after the stop, how many of the other three ranks printed
# their own report, and where each was (reading the plan or the base, or a
# step's collective). A small DELAY (0 to 0.6 here) lands the stop in the
# start-up (reading the plan): that agreement was not timed before and the
# group waited forever. Not a ctest (RUNS x ~7 s); uses tests/fault_fuse.sh's
# fixtures. Example: scripts/swap_stall_loop.sh build/lorakit 3 0.3
set -uo pipefail
LK="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
N=${2:-5} DELAY=${3:-1.5}
here="$(cd "$(dirname "$0")" && pwd)"
BASH_ARGV0="$here/../tests/fault_fuse.sh" # it finds its helpers beside $0
LK_FAULT_LIB=1 source "$here/../tests/fault_fuse.sh"
set +e
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
work="$(mktemp -d "${TMPDIR:-/tmp}/lkstall.XXXXXX")"
v=""
cleanup() { [ -n "$v" ] && { kill -CONT "$v"; kill -KILL "$v"; } 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
make_fixtures "$work"
{ echo "steps:"; for _ in $(seq 1 6000); do echo "  - loras: [{path: adapter.safetensors, strength: 0.5}]"; echo "  - loras: []"; done; } >"$work/plan.yaml"
rank_pid() { local mp="$1" r="$2" c; for c in $(pgrep -P "$mp"); do tr '\0' '\n' <"/proc/$c/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$r" && { echo "$c"; return; }; done; }
for it in $(seq 1 "$N"); do
  timeout 120 mpirun -n 4 "$LK" swap "$work/base.safetensors" --plan "$work/plan.yaml" --timeout 3 >"$work/out" 2>"$work/err" &
  mp=$!
  sleep 0.2
  mpid=$(pgrep -P "$mp" -x mpirun || pgrep -P "$mp" | head -1)
  v=""
  for _ in $(seq 1 100); do v=$(rank_pid "$mpid" 2); [ -n "$v" ] && break; sleep 0.05; done
  sleep "$DELAY"; t0=$(date +%s.%N); kill -STOP "$v"
  rc=0; wait "$mp" || rc=$?; t1=$(date +%s.%N)
  kill -CONT "$v" 2>/dev/null; kill -KILL "$v" 2>/dev/null; v=""
  took=$(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", b-a}')
  nrep=$(grep -c "^lorakit: rank [013]: .*aborting the job" "$work/err")
  echo "run $it: exit $rc (124: hung), ended ${took} s after the stop, $nrep of 3 ranks reported, $(wc -l <"$work/out") steps printed; $(grep -o "^lorakit: rank [013]: [^:]*" "$work/err" | sed 's/^lorakit: //' | tr '\n' ';')"
done
