#!/usr/bin/env bash
# fault_swap.sh LORAKIT BUILD_DIR — `lorakit swap` at 2 and 4 MPI ranks
# through a plan whose middle steps are faulty:
#   1. adapter.safetensors at 0.5                  -> ok
#   2. + nan.safetensors (a NaN in a lora_B)        -> error, LK_ERR_NONFINITE's message
#   3. + gone.safetensors (deleted before the step) -> error naming the file
#   4. adapter2.safetensors at -0.75 alone          -> ok
#   5. []                                           -> ok (reset)
# Expectations, from outside the tracker: every failed step reports an error
# and leaves the digest of step 1; every step's digests agree over the
# ranks; step 4 equals `lorakit digest` of an offline `lorakit fuse` of
# adapter2 at -0.75, step 5 the base's own digest; the exit code is 1.
# Then two ranks that loaded different base bytes: refused at the start.
# The fixtures are fault_fuse.sh's (sourced). The per-rank-different-file
# and allocation-failure faults are in tests/mpi_fault_swap.c.
set -euo pipefail
LK="$1"
LK_FAULT_LIB=1 source "$(dirname "$0")/fault_fuse.sh"
if ! command -v mpirun >/dev/null; then echo "skip: no mpirun"; exit 0; fi
if ! "$LK" swap --help >/dev/null 2>&1; then echo "skip: lorakit has no swap"; exit 0; fi
source "$(dirname "$0")/util/mpi_env.sh"

work="$(mktemp -d "${TMPDIR:-/tmp}/lkfault.XXXXXX")"
trap 'rm -rf "$work"' EXIT
make_fixtures "$work"
cat >"$work/plan.yaml" <<'EOF'
bucket_mb: 1
steps:
  - loras: [{path: adapter.safetensors, strength: 0.5}]
  - loras: [{path: adapter.safetensors, strength: 0.5}, {path: nan.safetensors, strength: 1.0}]
  - loras: [{path: adapter.safetensors, strength: 0.5}, {path: gone.safetensors, strength: 1.0}]
  - loras: [{path: adapter2.safetensors, strength: -0.75}]
  - loras: []
EOF
"$LK" fuse "$work/base.safetensors" -l "$work/adapter2.safetensors:-0.75" -o "$work/off.safetensors" >/dev/null
want4=$("$LK" digest "$work/off.safetensors" | awk '{print $1}')
want5=$("$LK" digest "$work/base.safetensors" | awk '{print $1}')

# field N KEY: KEY of step N's JSON line (string or bare value).
field() { sed -n "$1p" "$out" | sed -n "s/.*\"$2\": *\"\\{0,1\\}\\([^\",}]*\\).*/\\1/p"; }
for np in 2 4; do
  out="$work/out$np.json"
  rc=0
  mpirun -n "$np" "$LK" swap "$work/base.safetensors" --plan "$work/plan.yaml" --json >"$out" 2>"$work/err$np" || rc=$?
  [ "$rc" -eq 1 ] || { cat "$out" "$work/err$np" >&2; fail "$np ranks: exit $rc, want 1"; }
  [ "$(wc -l <"$out")" -eq 5 ] || { cat "$out" >&2; fail "$np ranks: want 5 step lines"; }
  for s in 1 2 3 4 5; do
    [ "$(field $s digests_agree)" = true ] || fail "$np ranks: step $s: ranks disagree"
  done
  for s in 1 4 5; do [ "$(field $s status)" = ok ] || fail "$np ranks: step $s failed: $(sed -n "${s}p" "$out")"; done
  for s in 2 3; do
    [ "$(field $s status)" = error ] || fail "$np ranks: step $s did not fail"
    [ "$(field $s digest)" = "$(field 1 digest)" ] || fail "$np ranks: step $s changed the weights"
  done
  sed -n 2p "$out" | grep -qi 'non-finite\|nan' || fail "$np ranks: step 2 error does not say non-finite: $(sed -n 2p "$out")"
  sed -n 3p "$out" | grep -q 'gone.safetensors' || fail "$np ranks: step 3 error does not name the file"
  [ "$(field 4 digest)" = "$want4" ] || fail "$np ranks: step 4 digest $(field 4 digest), offline $want4"
  [ "$(field 5 digest)" = "$want5" ] || fail "$np ranks: reset digest $(field 5 digest), base $want5"
  echo "ok: $np ranks: NaN step and missing-file step failed on every rank, weights kept; later steps exact"
done

# Ranks that loaded different base bytes (same names, dtypes, shapes) do not
# start: before, every step reported "ok ... (RANKS DISAGREE)". Rank 1's base
# is a copy with one byte of blocks.0.attn.to_v.weight (the third tensor of
# the file) changed; expected from that edit: exit 1, no step line, and the
# message names that tensor (1 of 4 differs) and each rank's hash of it.
cp "$work/base.safetensors" "$work/other.safetensors"
hl=$(od -An -tu4 -N4 "$work/other.safetensors" | tr -d ' ')
printf '\x5a' | dd of="$work/other.safetensors" bs=1 seek=$(( 8 + hl + 2 * W + 5 )) conv=notrunc status=none
rc=0
mpirun -n 1 "$LK" swap "$work/base.safetensors" --plan "$work/plan.yaml" : \
       -n 1 "$LK" swap "$work/other.safetensors" --plan "$work/plan.yaml" >"$work/outd" 2>"$work/errd" || rc=$?
[ "$rc" -eq 1 ] || fail "different bases: exit $rc, want 1: $(cat "$work/errd")"
[ ! -s "$work/outd" ] || fail "different bases: steps ran: $(head -2 "$work/outd")"
grep -q "the ranks hold different base weights: 1 of 4 tensors differ; the first in byte-wise name order is blocks.0.attn.to_v.weight: rank 0 holds XXH3-64 [0-9a-f]*; rank 1 holds XXH3-64 [0-9a-f]*" "$work/errd" \
  || fail "different bases: message: $(cat "$work/errd")"
echo "ok: 2 ranks with different base bytes: refused at start, naming blocks.0.attn.to_v.weight"
echo "fault_swap: all passed"
