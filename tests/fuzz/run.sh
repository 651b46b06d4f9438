#!/usr/bin/env bash
# tests/fuzz/run.sh BUILD_DIR SECONDS [TARGET...] — runs each libFuzzer target
# built in BUILD_DIR (default: every fuzz_* there) for SECONDS seconds, one
# after the other (the machine is small; parallel jobs would only share it).
#
# The committed seeds in tests/fuzz/corpus/<name>/ are read, never written:
# new inputs go to BUILD_DIR/corpus/<name>/, which persists between runs so
# coverage accumulates locally. A crash, leak, UB report or timeout leaves
# its input in BUILD_DIR/artifacts/<name>/ and makes this script fail; to
# keep it as a regression input, minimise it (fuzz_<name> -minimize_crash=1
# -runs=10000 FILE) and copy it into tests/fuzz/regress/<name>/, which
# tests/test_fuzz_regress.c replays in every `make test`.
#
# FUZZ_SEED fixes libFuzzer's seed (CI, where CI=true, uses 1 so a run on a
# fresh clone replays the same mutation sequence); otherwise it is random.
#
# Prints one summary line per target: execs, execs/s, coverage (cov = edges,
# ft = features, as libFuzzer counts them) and corpus size.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
build="${1:?usage: run.sh BUILD_DIR SECONDS [TARGET...]}"
secs="${2:?usage: run.sh BUILD_DIR SECONDS [TARGET...]}"
shift 2
build="$(cd "$build" && pwd)"

targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  for b in "$build"/fuzz_*; do
    [ -x "$b" ] && [ -f "$b" ] && targets+=("$(basename "$b" | sed 's/^fuzz_//')")
  done
fi
if [ ${#targets[@]} -eq 0 ]; then
  echo "fuzz: no targets built in $build" >&2
  exit 1
fi

# Leaks are bugs too (libFuzzer checks each input when LSan is on).
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
export LORAKIT_LOG="${LORAKIT_LOG:-error}"
seed="${FUZZ_SEED:-}"
[ -z "$seed" ] && [ "${CI:-}" = true ] && seed=1
seed_arg=()
[ -n "$seed" ] && seed_arg=(-seed="$seed")

failed=0
summary=""
for t in "${targets[@]}"; do
  bin="$build/fuzz_$t"
  work="$build/corpus/$t"
  art="$build/artifacts/$t"
  log="$build/logs/$t.log"
  mkdir -p "$work" "$art" "$build/logs"
  seeds=()
  [ -d "$here/corpus/$t" ] && seeds+=("$here/corpus/$t")
  dict=()
  [ -f "$here/$t.dict" ] && dict=(-dict="$here/$t.dict")
  echo "fuzz: $t for ${secs}s (log: $log)"
  "$bin" "$work" "${seeds[@]}" "${dict[@]}" "${seed_arg[@]}" \
    -max_total_time="$secs" -timeout=20 -rss_limit_mb=2048 -max_len=65536 \
    -print_final_stats=1 -artifact_prefix="$art/" >"$log" 2>&1
  rc=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  last=$(grep -E '^#[0-9]+' "$log" | tail -1)
  cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last")
  ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")
  corp=$(sed -n 's/.* corp: \([0-9]*\).*/\1/p' <<<"$last")
  line=$(printf '%-18s rc=%d execs=%s execs/s=%s cov=%s ft=%s corpus=%s' \
    "$t" "$rc" "${execs:-?}" "${rate:-?}" "${cov:-?}" "${ft:-?}" "${corp:-?}")
  summary+="$line"$'\n'
  if [ "$rc" -ne 0 ]; then
    failed=1
    echo "fuzz: $t FAILED (rc=$rc); the end of its log:" >&2
    tail -40 "$log" >&2
    ls -1 "$art" >&2
  fi
done
echo "fuzz summary (${secs}s per target):"
printf '%s' "$summary"
exit $failed
