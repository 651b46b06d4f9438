#!/usr/bin/env bash
# config_check.sh — `lorakit config check`: output per role, exit codes 0/1/2,
# errors naming file:line:key, the unknown-key warning on stderr.
# Expectations come from the fixtures in tests/fixtures/config/ (read them).
set -u
BIN="$1"
HERE="$(cd "$(dirname "$0")" && pwd)"
FX="$HERE/fixtures/config"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
fail=0
check() { # name expected-rc actual-rc
  if [ "$2" != "$3" ]; then echo "FAIL $1: exit $3, expected $2"; fail=1; fi
}
has() { # name file text
  if ! grep -qF -- "$3" "$2"; then echo "FAIL $1: '$3' not in $2:"; cat "$2"; fail=1; fi
}

"$BIN" config check "$FX/roles.yaml" >"$TMP/o" 2>"$TMP/e"; check roles 0 $?
has roles "$TMP/o" "student: lora enabled: rank 16, alpha 32, targets [to_q, to_k, to_v, to_out]"
has roles "$TMP/o" "teacher: lora not configured"
has roles "$TMP/o" "critic: lora disabled (rank 8 set but enable is false: not applied)"
has roles "$TMP/e" "roles.yaml:6: models.student.lora: ignoring unrecognized lora keys ['dropout'] (valid keys: enable, rank, alpha, target_modules)"

"$BIN" config check "$FX/roles.yaml" --role teacher >"$TMP/o" 2>"$TMP/e"; check role 0 $?
[ "$(cat "$TMP/o")" = "teacher: lora not configured" ] || { echo "FAIL role: $(cat "$TMP/o")"; fail=1; }

"$BIN" config check "$FX/bad_rank.yaml" >"$TMP/o" 2>"$TMP/e"; check bad_rank 1 $?
has bad_rank "$TMP/e" "lorakit: $FX/bad_rank.yaml:7: models.student.lora.rank: must be > 0, got 0"

# one bad role: the others are still reported, exit 1
"$BIN" config check "$FX/bad_block.yaml" >"$TMP/o" 2>"$TMP/e"; check bad_block 1 $?
has bad_block "$TMP/e" "bad_block.yaml:3: models.student.lora: must be a mapping, got a list"
has bad_block "$TMP/o" "teacher: lora disabled"

"$BIN" config check "$FX/roles.yaml" --role nobody >"$TMP/o" 2>"$TMP/e"; check norole 1 $?
has norole "$TMP/e" "no role 'nobody' (roles: 'student', 'teacher', 'critic')"
"$BIN" config check "$TMP/missing.yaml" >"$TMP/o" 2>"$TMP/e"; check missing 1 $?
has missing "$TMP/e" "missing.yaml: cannot open"

# a config with no models block (a full-model training config): nothing configured, exit 0;
# asking for a role in it is still an error
printf 'task: copy\nsteps: 10\n' >"$TMP/nomodels.yaml"
"$BIN" config check "$TMP/nomodels.yaml" >"$TMP/o" 2>"$TMP/e"; check nomodels 0 $?
has nomodels "$TMP/o" "no roles under models: lora not configured"
"$BIN" config check "$TMP/nomodels.yaml" --role student >"$TMP/o" 2>"$TMP/e"; check nomodels_role 1 $?
has nomodels_role "$TMP/e" "nomodels.yaml: no 'models' key"

"$BIN" config >"$TMP/o" 2>"$TMP/e"; check usage1 2 $?
"$BIN" config check >"$TMP/o" 2>"$TMP/e"; check usage2 2 $?
"$BIN" config check a.yaml --bogus >"$TMP/o" 2>"$TMP/e"; check usage3 2 $?
"$BIN" config frob a.yaml >"$TMP/o" 2>"$TMP/e"; check usage4 2 $?
"$BIN" config check --help >"$TMP/o" 2>"$TMP/e"; check help 0 $?
has help "$TMP/o" "usage: lorakit config check CONFIG.yaml [--role ROLE]"

[ $fail = 0 ] && echo "config_check: all passed"
exit $fail
