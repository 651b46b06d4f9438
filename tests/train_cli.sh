#!/usr/bin/env bash
# train_cli.sh — `lorakit train`: usage and exit codes, the files a run
# writes (loss.csv with one row per step, train.json, loss.png or a warning
# when gnuplot is missing, the PEFT adapter), progress lines, and a 2-rank
# run under mpirun (when installed) reporting identical replicas.
# Expectations are the documented formats (lorakit train --help).
set -u
BIN="$1"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
fail=0
check() { if [ "$2" != "$3" ]; then echo "FAIL $1: exit $3, expected $2"; cat "$TMP/e" 2>/dev/null; fail=1; fi; }
has() { if ! grep -qE -- "$3" "$2"; then echo "FAIL $1: /$3/ not in $2:"; cat "$2"; fail=1; fi; }
export OPENBLAS_NUM_THREADS=1

"$BIN" train --help >"$TMP/o" 2>"$TMP/e"; check help 0 $?
has help "$TMP/o" "^usage: lorakit train CONFIG.yaml"
"$BIN" train >"$TMP/o" 2>"$TMP/e"; check no-config 2 $?
has no-config "$TMP/e" "missing CONFIG.yaml"
"$BIN" train a.yaml --bogus >"$TMP/o" 2>"$TMP/e"; check bad-option 2 $?
"$BIN" train "$TMP/none.yaml" >"$TMP/o" 2>"$TMP/e"; check missing-file 1 $?
has missing-file "$TMP/e" "^lorakit: .*none.yaml: cannot open"

cat >"$TMP/base.yaml" <<EOT
model: {d_model: 16, n_layers: 1, n_heads: 2}
task: copy
digits: 3
steps: 30
global_batch: 8
lr: 0.003
log_every: 10
eval_examples: 20
output: base
EOT
"$BIN" train "$TMP/base.yaml" >"$TMP/o" 2>"$TMP/e"; check base 0 $?
has base "$TMP/o" "^lorakit train: task copy \(3 digits\), 30 steps, global batch 8 over 1 rank, lr 0.003; full-model training"
has base "$TMP/o" "^step +10/30  loss [0-9.]+  tokens/s +[0-9]+  elapsed +[0-9.]+s$"
has base "$TMP/o" "^trained the full model on copy: 30 steps on 1 rank"
[ "$(wc -l <"$TMP/base/loss.csv")" = 31 ] || { echo "FAIL loss.csv rows"; fail=1; }
has base "$TMP/base/loss.csv" "^step,loss$"
has base "$TMP/base/loss.csv" "^30,[0-9.]+$"
has base "$TMP/base/train.json" '"steps": 30, "global_batch": 8'
[ -f "$TMP/base/model.safetensors" ] || { echo "FAIL model.safetensors"; fail=1; }
[ -f "$TMP/base/optimizer.safetensors" ] || { echo "FAIL optimizer.safetensors"; fail=1; }
if command -v gnuplot >/dev/null; then
  [ -s "$TMP/base/loss.png" ] || { echo "FAIL loss.png"; fail=1; }
fi

cat >"$TMP/rev.yaml" <<EOT
base: base/model.safetensors
task: reverse
digits: 3
steps: 20
global_batch: 8
lr: 0.01
eval_examples: 20
output: rev
models:
  student:
    lora: {enable: true, rank: 2, target_modules: [to_q, ff.net.2]}
EOT
# without gnuplot on PATH: a warning, no PNG, still success
PATH=/nonexistent "$BIN" train --quiet "$TMP/rev.yaml" >"$TMP/o" 2>"$TMP/e"; check nognuplot 0 $?
has nognuplot "$TMP/e" "^lorakit: warning: no loss curve: gnuplot is not installed"
[ ! -e "$TMP/rev/loss.png" ] || { echo "FAIL loss.png without gnuplot"; fail=1; }
[ -s "$TMP/rev/adapter_model.safetensors" ] && [ -s "$TMP/rev/adapter_config.json" ] || { echo "FAIL PEFT files"; fail=1; }
has peft "$TMP/rev/adapter_config.json" '"r": 2'
# an output path that is a folder fails the run before training and says why
rm -f "$TMP/rev/train.json" && mkdir "$TMP/rev/train.json"
PATH=/nonexistent "$BIN" train --quiet "$TMP/rev.yaml" >"$TMP/o" 2>"$TMP/e"; check unwritable 1 $?
has unwritable "$TMP/e" "^lorakit: .*rev/train.json: exists and is a folder; an output replaces only a regular file"
# written through a temporary file and a rename: nothing half-written is left
[ -z "$(ls "$TMP/rev" | grep '\.tmp\.')" ] || { echo "FAIL temporary files left in rev/"; fail=1; }
rmdir "$TMP/rev/train.json"

if command -v mpirun >/dev/null; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
  # as for the MPI ctests: Open MPI's own allocations past MPI_Finalize are
  # not lorakit's leaks (tests/mpi_lsan.supp), components stay loaded so the
  # suppressions can name them
  export OMPI_MCA_mca_base_component_disable_dlclose=1 OMPI_MCA_mpi_yield_when_idle=1
  export LSAN_OPTIONS="suppressions=$(cd "$(dirname "$0")" && pwd)/mpi_lsan.supp"
  export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}fast_unwind_on_malloc=0"
  mpirun -n 2 "$BIN" train "$TMP/rev.yaml" >"$TMP/o" 2>"$TMP/e"; check mpi 0 $?
  has mpi "$TMP/o" "global batch 8 over 2 ranks"
  has mpi "$TMP/o" "^replicas identical: yes"
  [ "$(grep -c '^lorakit train:' "$TMP/o")" = 1 ] || { echo "FAIL mpi: rank 0 only should print"; cat "$TMP/o"; fail=1; }
  sed -i 's/global_batch: 8/global_batch: 7/' "$TMP/rev.yaml"
  mpirun -n 2 "$BIN" train "$TMP/rev.yaml" >"$TMP/o" 2>"$TMP/e"; check mpi-split 1 $?
  has mpi-split "$TMP/e" "global_batch 7 does not split evenly over 2 ranks"
fi
[ $fail = 0 ] && echo "train_cli.sh: OK"
exit $fail
