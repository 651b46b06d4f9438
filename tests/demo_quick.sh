#!/usr/bin/env bash
# demo_quick.sh — `lorakit demo --quick`: the whole demo at a smaller size
# (pretrain, two adapters over 2 MPI ranks, the 5-step hot-swap plan), then
# its table's numbers checked against the issue's expectations, relaxed to
# what the quick run reaches reliably: each adapter >= 80% on its task (full
# run: 95%), the base < 25% on both (full run: 20%), reset bit-exact, ranks
# agreeing after every step, the adapters usable by `lorakit fuse`.
set -u
BIN="$1"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
fail=0
# MPI under the sanitizer build: as for the MPI ctests (tests/CMakeLists.txt)
export OMPI_MCA_mca_base_component_disable_dlclose=1
export LSAN_OPTIONS="suppressions=$(cd "$(dirname "$0")" && pwd)/mpi_lsan.supp"
export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}fast_unwind_on_malloc=0"

"$BIN" demo --help >"$TMP/o" 2>&1 || { echo "FAIL demo --help"; fail=1; }
grep -q "^usage: lorakit demo \[--out DIR\] \[--ranks N\] \[--quick\]" "$TMP/o" || { echo "FAIL usage text"; cat "$TMP/o"; fail=1; }
"$BIN" demo --ranks 0 >"$TMP/o" 2>&1; [ $? = 2 ] || { echo "FAIL --ranks 0 should be a usage error"; fail=1; }

start=$(date +%s)
"$BIN" demo --quick --out "$TMP/d" >"$TMP/o" 2>"$TMP/e"; rc=$?
secs=$(( $(date +%s) - start ))
[ $rc = 0 ] || { echo "FAIL demo --quick exit $rc"; cat "$TMP/o" "$TMP/e"; fail=1; }
R="$TMP/d/demo_results.txt"
[ -f "$R" ] || { echo "FAIL no $R"; cat "$TMP/o" "$TMP/e"; exit 1; }
val() { sed -n "s/^$1=//p" "$R"; }
ge() { awk -v a="$1" -v b="$2" 'BEGIN{exit !(a >= b)}'; }
lt() { awk -v a="$1" -v b="$2" 'BEGIN{exit !(a < b)}'; }
ge "$(val adapter_a_acc)" 0.80 || { echo "FAIL adapter A ($(val task_a)) accuracy $(val adapter_a_acc) < 0.80"; fail=1; }
ge "$(val adapter_b_acc)" 0.80 || { echo "FAIL adapter B ($(val task_b)) accuracy $(val adapter_b_acc) < 0.80"; fail=1; }
lt "$(val base_a_acc)" 0.25 || { echo "FAIL base on $(val task_a): $(val base_a_acc)"; fail=1; }
lt "$(val base_b_acc)" 0.25 || { echo "FAIL base on $(val task_b): $(val base_b_acc)"; fail=1; }
[ "$(val reset_bit_exact)" = 1 ] || { echo "FAIL reset not bit-exact"; fail=1; }
[ "$(val ranks_agree)" = 1 ] || { echo "FAIL ranks disagree"; fail=1; }
[ "$(val reset_digest)" = "$(val base_digest)" ] || { echo "FAIL digests"; fail=1; }
[ "$(val offline_fuse_same)" = 1 ] && [ "$(val offline_digest)" = "$(val half_a_digest)" ] || { echo "FAIL offline fuse digest differs from the hot-swap"; fail=1; }
# the base digest is the file's, as `lorakit digest` computes it
[ "$("$BIN" digest "$TMP/d/base/model.safetensors")" = "$(val base_digest)" ] || { echo "FAIL base digest vs lorakit digest"; fail=1; }
# the table and the checks are printed
grep -q "^== 4. summary ==" "$TMP/o" || { echo "FAIL no summary table"; fail=1; }
[ "$(grep -c ' PASS$' "$TMP/o")" = 6 ] || { echo "FAIL expected 6 PASS lines"; cat "$TMP/o"; fail=1; }
for f in base/model.safetensors base/loss.csv reverse/adapter_model.safetensors reverse/adapter_config.json sort/adapter_model.safetensors reverse/loss.csv; do
  [ -s "$TMP/d/$f" ] || { echo "FAIL missing $f"; fail=1; }
done
# the adapters are ordinary PEFT adapters: `lorakit fuse` takes them
"$BIN" fuse "$TMP/d/base/model.safetensors" -l "$TMP/d/reverse" -o "$TMP/fused.safetensors" >/dev/null 2>"$TMP/e" || { echo "FAIL fuse of the demo adapter"; cat "$TMP/e"; fail=1; }
echo "demo --quick: ${secs}s, $(val task_a) $(val adapter_a_acc), $(val task_b) $(val adapter_b_acc), base $(val base_a_acc)/$(val base_b_acc)"

[ $fail = 0 ] && echo "demo_quick.sh: OK"
exit $fail
