#!/usr/bin/env bash
# fault_fuse.sh LORAKIT BUILD_DIR — `lorakit fuse` under I/O faults.
#
# Each fault must end with exit 1, a "lorakit: ..." message naming what
# failed, no output file (and no temporary file) left in the output
# directory, and the base checkpoint byte-for-byte as it was:
#   1. the output directory is not writable (as root, permissions do not
#      bind, so the fuse runs as user nobody through setpriv);
#   2. the disk fills during the write, by RLIMIT_FSIZE (ulimit -f, with
#      SIGXFSZ ignored so the write fails with EFBIG instead of killing us);
#   3. the disk fills during the write on a real 128 KiB tmpfs, mounted in a
#      private mount namespace (unshare -m) so it vanishes with the process;
#      skipped (and said so) where mounting is not allowed.
# The truncated-base fault needs a hook between the open and the reads, so it
# is in tests/test_fault_fuse.c. Test files are written here with printf (no
# Python in CI): a 4-tensor F32 base of 256 KiB and a diffusers adapter.
set -euo pipefail
fail() { echo "FAIL: $*" >&2; exit 1; }

# mk_st OUT HEADER_JSON DATA_FILE: a safetensors file (util/st_header.sh:
# 8-byte LE header length, header padded with spaces to 8 bytes), then the data.
. "$(dirname "$0")/util/st_header.sh"
mk_st() { { st_header "$2"; cat "$3"; } >"$1"; }
# pattern N OUT [SKIP]: N bytes of small finite F32 values (0.5 -0.25 0.125
# 1.0 ...), starting SKIP values into the cycle.
pattern() {
  printf '\x00\x00\x00\x3f\x00\x00\x80\xbe\x00\x00\x00\x3e\x00\x00\x80\x3f' >"$2"
  while [ "$(stat -c %s "$2")" -lt $(( $1 + 16 )) ]; do cat "$2" "$2" >"$2.t" && mv "$2.t" "$2"; done
  dd if="$2" of="$2.t" bs=65536 iflag=skip_bytes,count_bytes skip=$(( 4 * ${3:-0} )) count="$1" status=none
  mv "$2.t" "$2"
}
# mk_adapter OUT SKIP MODULE...: a diffusers adapter (rank R) on the given
# attention projections of block 0, values from pattern SKIP.
mk_adapter() {
  local out="$1" skip="$2" hdr="{" off=0 sep="" m
  shift 2
  pattern $(( $# * (A + B) )) "$out.data" "$skip"
  for m in "$@"; do
    hdr="$hdr$sep\"transformer.blocks.0.attn.$m.lora_A.weight\":{\"dtype\":\"F32\",\"shape\":[$R,$I],\"data_offsets\":[$off,$((off + A))]}"
    off=$(( off + A )) sep=","
    hdr="$hdr,\"transformer.blocks.0.attn.$m.lora_B.weight\":{\"dtype\":\"F32\",\"shape\":[$O,$R],\"data_offsets\":[$off,$((off + B))]}"
    off=$(( off + B ))
  done
  mk_st "$out" "$hdr}" "$out.data"
  rm -f "$out.data"
}
# make_fixtures DIR: DIR/base.safetensors (four F32 64x256 weights, 256 KiB),
# DIR/adapter.safetensors (to_q, to_v), DIR/adapter2.safetensors (to_k, other
# values), DIR/nan.safetensors (adapter.safetensors with lora_B[0] = NaN).
O=64 I=256 R=4
W=$(( O * I * 4 )) A=$(( R * I * 4 )) B=$(( O * R * 4 ))
make_fixtures() {
  local d="$1" hdr off=0 m
  pattern $(( 4 * W )) "$d/wdata"
  hdr="{\"__metadata__\":{\"format\":\"pt\"}"
  for m in to_q to_k to_v to_out.0; do
    hdr="$hdr,\"blocks.0.attn.$m.weight\":{\"dtype\":\"F32\",\"shape\":[$O,$I],\"data_offsets\":[$off,$((off + W))]}"
    off=$(( off + W ))
  done
  mk_st "$d/base.safetensors" "$hdr}" "$d/wdata"
  rm -f "$d/wdata"
  mk_adapter "$d/adapter.safetensors" 0 to_q to_v
  mk_adapter "$d/adapter2.safetensors" 1 to_k
  cp "$d/adapter.safetensors" "$d/nan.safetensors"
  local hl
  hl=$(od -An -tu4 -N4 "$d/nan.safetensors" | tr -d ' ')
  printf '\x00\x00\xc0\x7f' | dd of="$d/nan.safetensors" bs=1 seek=$(( 8 + hl + A )) conv=notrunc status=none
  chmod 644 "$d"/*.safetensors
}

# Sourced by fault_swap.sh for the helpers above.
if [ -n "${LK_FAULT_LIB:-}" ]; then return 0; fi

LK="$1"
work="$(mktemp -d "${TMPDIR:-/tmp}/lkfault.XXXXXX")"
chmod 755 "$work"
trap 'rm -rf "$work"' EXIT
make_fixtures "$work"
base_sum=$(cksum <"$work/base.safetensors")

# The baseline: the same fuse works when nothing goes wrong.
"$LK" fuse "$work/base.safetensors" -l "$work/adapter.safetensors:0.5" -o "$work/ok.safetensors" \
  || fail "baseline fuse failed"
[ -s "$work/ok.safetensors" ] || fail "baseline fuse wrote nothing"

# check NAME RC ERRFILE OUTDIR: exit 1, a message, nothing left, base intact.
check() {
  local name="$1" rc="$2" err="$3" dir="$4"
  [ "$rc" -eq 1 ] || { cat "$err" >&2; fail "$name: exit $rc, want 1"; }
  grep -q '^lorakit: ' "$err" || { cat "$err" >&2; fail "$name: no 'lorakit: ' message"; }
  if [ -n "$(ls -A "$dir")" ]; then ls -la "$dir" >&2; fail "$name: files left in $dir"; fi
  [ "$(cksum <"$work/base.safetensors")" = "$base_sum" ] || fail "$name: base changed"
  echo "ok: $name: $(head -1 "$err")"
}

# 1. Output directory not writable.
mkdir "$work/ro"
chmod 555 "$work/ro"
as_user=()
if [ "$(id -u)" = 0 ]; then as_user=(setpriv --reuid=65534 --regid=65534 --clear-groups); fi
rc=0
"${as_user[@]}" "$LK" fuse "$work/base.safetensors" -l "$work/adapter.safetensors:0.5" \
  -o "$work/ro/out.safetensors" 2>"$work/err1" || rc=$?
check "unwritable output directory" "$rc" "$work/err1" "$work/ro"

# 2. Disk full by RLIMIT_FSIZE: 64 KiB, a quarter of the output.
mkdir "$work/fsize"
rc=0
( ulimit -f 64; trap '' XFSZ; exec "$LK" fuse "$work/base.safetensors" \
    -l "$work/adapter.safetensors:0.5" -o "$work/fsize/out.safetensors" ) 2>"$work/err2" || rc=$?
check "disk full (RLIMIT_FSIZE 64 KiB)" "$rc" "$work/err2" "$work/fsize"

# 3. Disk full on a 128 KiB tmpfs (half the output). The checks run inside
# the namespace: the mount is gone once it exits.
mkdir "$work/small"
if unshare -m true 2>/dev/null && unshare -m sh -c "mount -t tmpfs -o size=128k tmpfs '$work/small'" 2>/dev/null; then
  rc=0
  unshare -m bash -c '
    mount --make-rprivate / 2>/dev/null
    mount -t tmpfs -o size=128k tmpfs "$2/small" || exit 99
    rc=0
    "$1" fuse "$2/base.safetensors" -l "$2/adapter.safetensors:0.5" -o "$2/small/out.safetensors" \
      2>"$2/err3" || rc=$?
    ls -A "$2/small" >"$2/left3"
    exit $rc' _ "$LK" "$work" || rc=$?
  [ "$rc" -ne 99 ] || fail "tmpfs mount failed inside the namespace"
  [ -s "$work/left3" ] && { cat "$work/left3" >&2; fail "tmpfs disk full: files left"; }
  check "disk full (128 KiB tmpfs)" "$rc" "$work/err3" "$work/small"
else
  echo "skip: disk full on tmpfs (mount not permitted here; RLIMIT_FSIZE case covers the write path)"
fi
echo "fault_fuse: all passed"
