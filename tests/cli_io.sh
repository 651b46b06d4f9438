#!/bin/bash
# cli_io.sh — the foundation's CLI surface: --help/--version, `<cmd> --help`
# for inspect/digest/demo/bench, usage errors (exit 2), a tiny `bench io`
# run (JSON lines with the documented fields; figures not asserted), and
# `demo` (its digests: reordered copy equal, changed copy different).
# Usage: bash cli_io.sh <path-to-lorakit> <build-dir>   (as ctest runs it)
set -uo pipefail
LK=$1
TMP=$(mktemp -d "${TMPDIR:-/tmp}/lk-cli-io.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
source "$(dirname "$0")/util/cli_expect.sh"


expect 0 --help;            grep -E "^  (inspect|digest|demo|bench) " "$TMP/out" | wc -l | grep -x 4 >/dev/null || fail "--help lists the commands"
expect 0 --version;         grep -E "^lorakit [0-9]+\.[0-9]+\.[0-9]+$" "$TMP/out" >/dev/null || fail "--version"
for c in inspect digest demo bench; do
  expect 0 "$c" --help;     grep "^usage: lorakit $c" "$TMP/out" >/dev/null || fail "$c --help"
done
expect 0 bench io --help;   grep "^usage: lorakit bench io" "$TMP/out" >/dev/null || fail "bench io --help"
expect 2 bench;             grep "^usage: lorakit bench" "$TMP/err" >/dev/null || fail "bench without a name"
expect 2 bench nosuch;      grep "unknown benchmark 'nosuch'" "$TMP/err" >/dev/null || fail "unknown bench"
expect 2 bench io --tensors 0
expect 2 digest a b
expect 2 demo --bogus
expect 2 nosuchcommand

# bench io, small: five JSON lines with the documented fields.
expect 0 bench io --json --tensors 200 --size-mb 2 --repeat 2 --dir "$TMP"
[ "$(wc -l <"$TMP/out")" = 5 ] || { cat "$TMP/out"; fail "bench io: expected 5 JSON lines"; }
grep '^{"bench":"fuse_file","seconds":[0-9.]*,"floor_seconds":[0-9.]*,"ratio_to_floor":[0-9.]*,"bytes":2097152,"fused_bytes":2097152,"rank":16,"runs":2}$' "$TMP/out" >/dev/null || fail "fuse_file line"
grep '^{"bench":"io","case":"open_index","tensors":200,"runs":2,"seconds_min":[0-9.]*,"seconds_median":[0-9.]*,"lookup_ns_per_name":[0-9.]*}$' "$TMP/out" >/dev/null || fail "open_index line"
grep '^{"bench":"io","case":"digest","bytes":2097152,"runs":2,.*"gb_per_s":[0-9.]*,"digest":"[0-9a-f]\{32\}"}$' "$TMP/out" >/dev/null || fail "digest line"
[ -z "$(ls -A "$TMP" | grep lorakit-bench)" ] || fail "bench left files behind"

# The demo itself is tested by demo_quick.sh.
echo "cli_io.sh: OK"
