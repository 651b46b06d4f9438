#!/bin/bash
# algebra_cli.sh — `lorakit merge`, `resize`, `convert` and `extract`: the float64 NumPy
# oracle (tests/algebra_oracle.py: dense deltas and numpy SVDs of inputs
# written by lycoris-lora and peft), then the CLI's refusals: --help, usage
# errors exit 2, DoRA / dense diffs / an output that is an input exit 1
# naming the module or file, and no output is left behind on failure.
# Usage: bash algebra_cli.sh <path-to-lorakit> <build-dir>   (as ctest runs it)
set -uo pipefail
LK=$1
HERE=$(cd "$(dirname "$0")" && pwd)
FX=$HERE/fixtures
TMP=$(mktemp -d "${TMPDIR:-/tmp}/lk-algebra.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
source "$(dirname "$0")/util/cli_expect.sh"

if /usr/bin/python3 -c 'import numpy' 2>/dev/null; then
  /usr/bin/python3 "$HERE/algebra_oracle.py" "$LK" "$TMP" || fail "the NumPy oracle"
else
  echo "algebra_cli.sh: SKIP the NumPy oracle: /usr/bin/python3 has no numpy (Debian python3-numpy)"
fi

for c in merge resize; do
  expect 0 $c --help
  grep -F "usage: lorakit $c" "$TMP/out" >/dev/null || fail "$c --help"
done
expect 2 merge -o "$TMP/x.safetensors"
err_has "at least one -l"
expect 2 resize "$FX/lycoris/loha.safetensors"
err_has "missing -o OUT"
expect 2 resize "$FX/lycoris/loha.safetensors" -o "$TMP/x.safetensors" --rank 0
expect 2 resize "$FX/lycoris/loha.safetensors" -o "$TMP/x.safetensors" --fro 1.5
expect 2 resize "$FX/lycoris/loha.safetensors" -o "$TMP/x.safetensors" --dtype F64
expect 1 resize "$FX/lycoris/loha.safetensors" -o "$TMP/x.safetensors" --rank 2 --err 0.1
err_has "give one of"
# refused by name, nothing written
expect 1 resize "$FX/lycoris/dora_out.safetensors" -o "$TMP/d.safetensors" --rank 1
err_has "DoRA"
[ ! -e "$TMP/d.safetensors" ] || fail "a refused resize wrote its output"
expect 1 resize "$FX/lycoris/full.safetensors" -o "$TMP/d.safetensors" --rank 1
err_has "no low-rank form"
[ ! -e "$TMP/d.safetensors" ] || fail "a refused resize wrote its output"
cp "$FX/lycoris/loha.safetensors" "$TMP/in.safetensors"
expect 1 resize "$TMP/in.safetensors" -o "$TMP/./in.safetensors" --rank 1
err_has "same file"
cmp -s "$TMP/in.safetensors" "$FX/lycoris/loha.safetensors" || fail "the input was changed"
expect 1 merge -l "$FX/lycoris/loha.safetensors" -l "$FX/adapters/peft" -o "$TMP/y" --format peft
err_has "kohya's underscore name"
# the output fuses in lorakit to what the input fuses to, within the rounding (exact resize at F32)
expect 0 resize "$FX/lycoris/locon.safetensors" -o "$TMP/e.safetensors" --dtype F32 --json
grep -F '"rel_fro_opt":0.0' "$TMP/out" >/dev/null || fail "an exact resize reports a nonzero optimum"
expect 0 fuse "$FX/lycoris/base_f32.safetensors" -l "$TMP/e.safetensors" -o "$TMP/f1.safetensors"
# convert: fuse(base, IN) and fuse(base, OUT) are the same bytes (inputs written by peft and lycoris-lora)
expect 0 convert --help
grep -F "usage: lorakit convert" "$TMP/out" >/dev/null || fail "convert --help"
same_fuse() { # BASE IN FORMAT [convert options: --base CKPT]
  local o="$TMP/cv_$3"; [ "$3" = peft ] || o="$o.safetensors"
  rm -rf "$o"
  expect 0 convert "$2" -o "$o" --format "$3" --json "${@:4}"
  grep -F '"rel_fro":0.0' "$TMP/out" >/dev/null || fail "convert reports a nonzero error"
  expect 0 fuse "$1" -l "$2" -o "$TMP/f_in.safetensors"
  expect 0 fuse "$1" -l "$o" -o "$TMP/f_out.safetensors"
  [ "$("$LK" digest "$TMP/f_in.safetensors")" = "$("$LK" digest "$TMP/f_out.safetensors")" ] ||
    fail "fuse of convert $2 --format $3 differs from fuse of the input"
}
for f in kohya peft diffusers comfyui; do
  same_fuse "$FX/adapters/base.safetensors" "$FX/adapters/peft" $f
  same_fuse "$FX/adapters/base.safetensors" "$FX/adapters/diffusers.safetensors" $f
done
for f in kohya comfyui; do
  same_fuse "$FX/lycoris/base_f32.safetensors" "$FX/lycoris/lora_linear.safetensors" $f
  same_fuse "$FX/lycoris/base_f32.safetensors" "$FX/lycoris/locon.safetensors" $f
done
# --base: kohya names (written by lycoris-lora) resolved on the model, into every format, on a diffusers
# UNet and on the original (LDM, ComfyUI's) layout of the same model
KF=$FX/keyformats
for f in kohya peft diffusers comfyui; do
  same_fuse "$FX/lycoris/base_f32.safetensors" "$FX/lycoris/lora_linear.safetensors" $f --base "$FX/lycoris/base_f32.safetensors"
  same_fuse "$FX/lycoris/base_f32.safetensors" "$FX/lycoris/locon.safetensors" $f --base "$FX/lycoris/base_f32.safetensors"
  for b in original diffusers; do
    same_fuse "$KF/sd1_lycoris_$b.safetensors" "$KF/sd1_lycoris_lora.safetensors" $f --base "$KF/sd1_lycoris_$b.safetensors"
  done
done
# ComfyUI's names on the original layout: diffusion_model.<the LDM key> (model_lora_keys_unet's generic rule)
expect 0 convert "$KF/sd1_lycoris_lora.safetensors" -o "$TMP/c1.safetensors" --format comfyui --base "$KF/sd1_lycoris_original.safetensors"
for k in lora_A.weight lora_B.weight alpha; do # (the file's JSON header names its keys)
  grep -aF "\"diffusion_model.input_blocks.1.1.proj_in.$k\"" "$TMP/c1.safetensors" >/dev/null || fail "comfyui key $k"
done
# a module on rows of a fused weight has no name of its own there: refused by name, nothing written
expect 1 convert "$KF/flux_linear1_qkv_lora.safetensors" -o "$TMP/q.safetensors" --format peft --base "$KF/flux_linear1_qkv_original.safetensors"
err_has "single_blocks.0.linear1_qkv: lands on some rows of single_blocks.0.linear1.weight"
[ ! -e "$TMP/q.safetensors" ] || fail "a refused convert wrote its output"
expect 1 convert "$FX/lycoris/lora_linear.safetensors" -o "$TMP/q.safetensors" --format peft
err_has "give --base CKPT"
expect 2 convert "$FX/lycoris/lora_linear.safetensors" -o "$TMP/q.safetensors" --base
# a PEFT alpha that is no F32 value: kohya refuses it by name, PEFT and diffusers carry it
mkdir -p "$TMP/p01"
cp "$FX/adapters/peft/adapter_model.safetensors" "$TMP/p01/"
sed 's/"lora_alpha": *[0-9.]*/"lora_alpha": 0.1/' "$FX/adapters/peft/adapter_config.json" > "$TMP/p01/adapter_config.json"
grep -F '"lora_alpha": 0.1' "$TMP/p01/adapter_config.json" >/dev/null || fail "the fixture's config changed shape"
expect 1 convert "$TMP/p01" -o "$TMP/k01.safetensors" --format kohya
err_has "alpha 0.10000000000000001 is not an F32 value"
[ ! -e "$TMP/k01.safetensors" ] || fail "a refused convert wrote its output"
same_fuse "$FX/adapters/base.safetensors" "$TMP/p01" diffusers
expect 1 convert "$FX/lycoris/loha.safetensors" -o "$TMP/l.safetensors" --format kohya
err_has "not a plain LoRA"
# extract: usage, refusals (nothing written), a real fused checkpoint as TUNED (the NumPy oracle above checks the numbers)
expect 0 extract --help
grep -F "usage: lorakit extract" "$TMP/out" >/dev/null || fail "extract --help"
B="$FX/adapters/base.safetensors"
expect 0 fuse "$B" -l "$FX/adapters/peft" -o "$TMP/tuned.safetensors"
expect 2 extract "$B" "$TMP/tuned.safetensors" -o "$TMP/x.safetensors" --rank 0
expect 2 extract "$B" -o "$TMP/x.safetensors" --rank 2
err_has "missing TUNED"
expect 2 extract "$B" "$TMP/tuned.safetensors" -o "$TMP/x.safetensors" --rank 2 --power 99
expect 1 extract "$B" "$TMP/tuned.safetensors" -o "$TMP/x.safetensors"
err_has "give one of --rank K and --err E"
expect 1 extract "$B" "$TMP/tuned.safetensors" -o "$TMP/x.safetensors" --rank 2 --include '('
err_has "not a valid regex"
expect 1 extract "$B" "$TMP/tuned.safetensors" -o "$TMP/tuned.safetensors" --rank 2
err_has "same file"
expect 1 extract "$B" "$B" -o "$TMP/x.safetensors" --rank 2
err_has "no weight differs"
[ ! -e "$TMP/x.safetensors" ] || fail "a refused extract wrote its output"
expect 0 extract "$B" "$TMP/tuned.safetensors" -o "$TMP/xp" --rank 4 --json --threads 2
[ -f "$TMP/xp/adapter_model.safetensors" ] && [ -f "$TMP/xp/adapter_config.json" ] || fail "extract -o DIR: no PEFT folder"
grep -F '"operation":"extract"' "$TMP/out" >/dev/null || fail "extract --json: no report"
expect 0 extract "$B" "$TMP/tuned.safetensors" -o "$TMP/xk.safetensors" --rank 4 --format kohya --exclude 'to_k' --json
grep -F '"excluded":["blocks.0.attn.to_k.weight"]' "$TMP/out" >/dev/null || fail "extract --exclude to_k: not listed"
expect 0 inspect "$TMP/xk.safetensors"
grep -F "modules: 1" "$TMP/out" >/dev/null || fail "extract --exclude to_k: not one module (to_q) written"
echo "algebra_cli.sh: ok"
