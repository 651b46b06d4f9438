#!/bin/bash
# device_cli.sh — `lorakit fuse --device`: on the emul device (the CUDA
# kernel's own body run as C) every committed fixture fuses to the digest
# of the CPU fuse (LoRA, kohya, LoCon, dense, LoHa, LoKr, DoRA, norm, FP8 and
# BF16/F16/F32 bases: the last ones through the host path, the summary says
# how many went where); `--device cuda` on a machine without a GPU exits 1
# saying so plainly; a bad device name is a usage error (exit 2).
# Usage: bash device_cli.sh <path-to-lorakit> <build-dir>   (as ctest runs it)
set -uo pipefail
LK=$1
FX=$(cd "$(dirname "$0")/fixtures" && pwd)
TMP=$(mktemp -d "${TMPDIR:-/tmp}/lk-device-cli.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
source "$(dirname "$0")/util/cli_expect.sh"
export LORAKIT_LOG=error

# same BASE ADAPTER...: cpu and emul give one digest
n=0
same() {
  local base=$1; shift
  local args=()
  for a in "$@"; do args+=(-l "$a"); done
  n=$((n + 1))
  "$LK" fuse "$base" "${args[@]}" -o "$TMP/cpu$n.safetensors" >"$TMP/out" 2>"$TMP/err" || { cat "$TMP/err"; fail "cpu fuse $base $*"; }
  "$LK" fuse "$base" "${args[@]}" -o "$TMP/emul$n.safetensors" --device emul >"$TMP/out" 2>"$TMP/err" ||
    { cat "$TMP/err"; fail "emul fuse $base $*"; }
  grep -q " on emul: [0-9]* by the device kernel, [0-9]* on the host path" "$TMP/out" || { cat "$TMP/out"; fail "no device summary"; }
  local a b
  a=$("$LK" digest "$TMP/cpu$n.safetensors") && b=$("$LK" digest "$TMP/emul$n.safetensors") || fail "digest"
  [ "$a" = "$b" ] || fail "$base $*: cpu digest $a, emul digest $b"
  cat "$TMP/out"
}
A=$FX/adapters
same "$A/base.safetensors" "$A/diffusers.safetensors:0.7" "$A/kohya.safetensors"
same "$A/base.safetensors" "$A/fastvideo.safetensors:-1.5"
L=$FX/lycoris
for base in base_f32 base_bf16 base_f16; do
  for ad in lora_linear locon loha lokr full mixed norm dora_out; do
    [ -f "$L/$ad.safetensors" ] && same "$L/$base.safetensors" "$L/$ad.safetensors:0.8"
  done
done
[ -f "$L/base_fp8.safetensors" ] && same "$L/base_fp8.safetensors" "$L/lora_linear.safetensors"
# the device kernel did fuse something (not everything through the host path)
"$LK" fuse "$L/base_bf16.safetensors" -l "$L/lora_linear.safetensors" -o "$TMP/k.safetensors" --device emul >"$TMP/out" 2>&1 || fail "emul lora"
grep -q " on emul: [1-9][0-9]* by the device kernel, 0 on the host path" "$TMP/out" || { cat "$TMP/out"; fail "LoRA not on the device kernel"; }

# cuda without a GPU: exit 1, the plain message, no output file
"$LK" fuse "$A/base.safetensors" -l "$A/diffusers.safetensors" -o "$TMP/c.safetensors" --device cuda >"$TMP/out" 2>"$TMP/err"
rc=$?
if grep -q "no CUDA driver or device is available" "$TMP/err"; then
  [ $rc = 1 ] || fail "--device cuda without a GPU exited $rc"
  [ ! -e "$TMP/c.safetensors" ] || fail "--device cuda without a GPU left an output"
  echo "device_cli.sh: no CUDA device: $(cat "$TMP/err")"
else
  [ $rc = 0 ] || { cat "$TMP/err"; fail "--device cuda exited $rc"; }
  "$LK" fuse "$A/base.safetensors" -l "$A/diffusers.safetensors" -o "$TMP/h.safetensors" >/dev/null 2>&1 || fail "cpu fuse"
  [ "$("$LK" digest "$TMP/c.safetensors")" = "$("$LK" digest "$TMP/h.safetensors")" ] || fail "cuda and cpu digests differ"
fi
"$LK" fuse "$A/base.safetensors" -l "$A/diffusers.safetensors" -o "$TMP/d.safetensors" --device tpu >/dev/null 2>"$TMP/err"
[ $? = 2 ] || fail "--device tpu is not a usage error"
grep -q "expected cpu, cuda, cuda:N" "$TMP/err" || fail "bad device message: $(cat "$TMP/err")"
echo "device_cli.sh: OK"
