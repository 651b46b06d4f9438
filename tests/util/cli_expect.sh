# cli_expect.sh — sourced by the CLI tests (tests/*.sh): one copy of
#   fail MSG            print "<script>: FAIL: MSG" on stderr, exit 1
#   expect CODE ARGS... run lorakit ARGS (the array RUN if set, else $LK)
#                       under a timeout (LK_EXPECT_TIMEOUT s, default 120:
#                       a hang fails instead of blocking ctest), stdout in
#                       $TMP/out, stderr in $TMP/err; fail unless it exits
#                       CODE and the sanitizers reported nothing
#   err_has TEXT        fail unless $TMP/err contains TEXT (fixed string)
#   out_has TEXT        the same for $TMP/out
# The caller sets TMP (a scratch folder) and LK or RUN before the first use.
lk_test_name=$(basename "$0")
fail() { echo "$lk_test_name: FAIL: $*" >&2; exit 1; }
expect() {
  local want=$1; shift
  local -a cmd
  if [ -n "${RUN+set}" ]; then cmd=("${RUN[@]}"); else cmd=("$LK"); fi
  timeout "${LK_EXPECT_TIMEOUT:-120}" "${cmd[@]}" "$@" >"$TMP/out" 2>"$TMP/err"
  local rc=$?
  [ "$rc" = 124 ] && fail "lorakit $* hung (timeout)"
  [ "$rc" = "$want" ] || { cat "$TMP/out" "$TMP/err" >&2; fail "lorakit $* exited $rc, expected $want"; }
  if grep -E "Sanitizer|runtime error" "$TMP/err" >/dev/null; then
    cat "$TMP/err" >&2
    fail "sanitizer report: lorakit $*"
  fi
}
err_has() { grep -F -- "$1" "$TMP/err" >/dev/null || { cat "$TMP/err" >&2; fail "stderr lacks: $1"; }; }
out_has() { grep -F -- "$1" "$TMP/out" >/dev/null || { cat "$TMP/out" >&2; fail "stdout lacks: $1"; }; }
