# sh_common.sh — sourced by tests/*.sh that run lorakit on generated inputs.
# lk_sh_setup LORAKIT TAG SANITIZER_REASON: exits 0 with "skip: ..." when
# LORAKIT is a sanitizer build (SANITIZER_REASON says why the test cannot
# apply there) or python3 (the generators) is missing; else sets $work to a
# fresh temporary folder removed on exit.
lk_sh_setup() {
  # not `ldd | grep -q`: under pipefail, grep -q's early exit can kill ldd
  # with SIGPIPE and the pipeline then reads as "not found"
  if [[ "$(ldd "$1" 2>/dev/null)" == *libasan* ]]; then
    echo "skip: $3"
    exit 0
  fi
  command -v python3 >/dev/null || { echo "skip: no python3"; exit 0; }
  work="$(mktemp -d "${TMPDIR:-/tmp}/$2.XXXXXX")"
  trap 'rm -rf "$work"' EXIT
}
