#!/bin/bash
# fuse_cli.sh — `lorakit fuse` and `lorakit inspect` on adapters, over the
# committed fixtures in tests/fixtures/adapters (made by make_fixtures.py):
# every format fuses, usage errors exit 2, failures exit 1 with the message
# and leave no OUT, OUT = BASE is refused by any path, --json fields,
# digests independent of --threads and of the -l order, strength 0 gives
# the base's tensors back, untouched tensors stay byte-identical.
# Usage: bash fuse_cli.sh <path-to-lorakit> <build-dir>   (as ctest runs it)
set -uo pipefail
LK=$1
FX=$(cd "$(dirname "$0")/fixtures/adapters" && pwd)
TMP=$(mktemp -d "${TMPDIR:-/tmp}/lk-fuse-cli.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
source "$(dirname "$0")/util/cli_expect.sh"

digest() { "$LK" digest "$1" || fail "digest $1"; }
# tensor_hex FILE NAME: the bytes of one tensor, via inspect --json offsets.
tensor_hex() {
  local line off len
  line=$("$LK" inspect "$1" --json | tr '{' '\n' | grep "\"name\":\"$2\"")
  off=$(echo "$line" | sed 's/.*"offset":\([0-9]*\).*/\1/')
  len=$(echo "$line" | sed 's/.*"bytes":\([0-9]*\).*/\1/')
  od -An -tx1 -v -j "$off" -N "$len" "$1" | tr -d ' \n'
}

B=$FX/base.safetensors
O=$TMP/out.safetensors

# --help and usage errors.
expect 0 fuse --help;  out_has "usage: lorakit fuse BASE -l ADAPTER[:STRENGTH]"
expect 2 fuse;         err_has "missing BASE"
expect 2 fuse "$B" -o "$O";                 err_has "at least one -l ADAPTER[:STRENGTH] is needed"
expect 2 fuse "$B" -l "$FX/peft";           err_has "missing -o OUT"
expect 2 fuse "$B" -l "$FX/peft" -o "$O" --threads x; err_has "--threads needs a number"
expect 2 fuse "$B" -l "$FX/peft" -o "$O" --format lycoris; err_has "unknown adapter format 'lycoris'"
expect 2 fuse "$B" -l "$FX/peft" -o "$O" --bogus;  err_has "unknown option '--bogus'"
[ -e "$O" ] && fail "usage error wrote OUT"

# Every format fuses (auto-detected), with the expected tensors touched.
for a in peft diffusers.safetensors kohya.safetensors fastvideo.safetensors; do
  expect 0 fuse "$B" -l "$FX/$a" -o "$O" --json
  grep '^{"base":".*","out":".*","adapters":\[{"path":".*","strength":1.0}\],"tensors_total":5,"tensors_fused":[12],"modules_unmatched":0,"convention":"lorakit","seconds":[0-9.e-]*}$' "$TMP/out" >/dev/null \
    || { cat "$TMP/out"; fail "fuse --json line for $a"; }
  [ "$(tensor_hex "$O" norm.bias)" = "$(tensor_hex "$B" norm.bias)" ] || fail "$a: norm.bias changed"
  [ "$(tensor_hex "$O" ids)" = "$(tensor_hex "$B" ids)" ] || fail "$a: ids changed"
  "$LK" inspect "$O" | grep -F 'lorakit.fused: [{"path":' >/dev/null || fail "$a: no lorakit.fused metadata"
  "$LK" inspect "$O" | grep -F 'note: lorakit fixture' >/dev/null || fail "$a: base metadata lost"
done
# --json with a path that is not UTF-8 (Latin-1 e-acute): JSON cannot hold
# it, so the summary is refused with exit 1 and a message, never exit 0
# with an empty stdout.
LAT=$TMP/out-$'\xe9'.safetensors
expect 1 fuse "$B" -l "$FX/diffusers.safetensors" -o "$LAT" --json
err_has "the --json summary cannot be built"
[ -s "$TMP/out" ] && fail "--json printed something it could not build"
rm -f "$LAT"
# kohya touches only blocks.1.ff.
expect 0 fuse "$B" -l "$FX/kohya.safetensors:0.5" -o "$O"
out_has "fused 1 adapter into 1 of 5 tensors"
[ "$(tensor_hex "$O" blocks.0.attn.to_q.weight)" = "$(tensor_hex "$B" blocks.0.attn.to_q.weight)" ] || fail "kohya changed to_q"
[ "$(tensor_hex "$O" blocks.1.ff.weight)" != "$(tensor_hex "$B" blocks.1.ff.weight)" ] || fail "kohya did not change ff"

# Mix with a negative strength: digests independent of threads and -l order.
expect 0 fuse "$B" -l "$FX/peft:1" -l "$FX/kohya.safetensors:-0.5" -l "$FX/diffusers.safetensors:0.25" -o "$O" --threads 1
D1=$(digest "$O")
expect 0 fuse "$B" -l "$FX/diffusers.safetensors:0.25" -l "$FX/peft:1" -l "$FX/kohya.safetensors:-0.5" -o "$O" --threads 3
[ "$(digest "$O")" = "$D1" ] || fail "digest depends on -l order / threads"
expect 0 fuse "$B" -l "$FX/kohya.safetensors:-0.5" -l "$FX/diffusers.safetensors:0.25" -l "$FX/peft" -o "$O"
[ "$(digest "$O")" = "$D1" ] || fail "digest depends on -l order / default threads"

# Strength 0: the base's tensors, every byte.
expect 0 fuse "$B" -l "$FX/peft:0" -l "$FX/kohya.safetensors:0" -o "$O"
[ "$(digest "$O")" = "$(digest "$B")" ] || fail "strength 0 changed the tensors"

# Failures: exit 1, message, no OUT.
rm -f "$O"
expect 1 fuse "$B" -l "$FX/peft" -o "$B";   err_has "is the same file as the base"
expect 1 fuse "$B" -l "$FX/peft" -o "$FX/../adapters/base.safetensors"; err_has "is the same file as the base"
ln -s "$B" "$TMP/link.safetensors"
expect 1 fuse "$B" -l "$FX/peft" -o "$TMP/link.safetensors"; err_has "is the same file as the base"
expect 1 fuse "$B" -l "$FX/bad_lone_a.safetensors" -o "$O"; err_has "bad_lone_a.safetensors: blocks.0.attn.to_q: lora_A without lora_B"
[ -e "$O" ] && fail "failed fuse left OUT"
expect 1 fuse "$B" -l "$FX/unmatched.safetensors" -o "$O"; err_has "unmatched.safetensors: blocks.9.attn.to_q matches no model weight (looked for blocks.9.attn.to_q.weight)"
[ -e "$O" ] && fail "failed fuse left OUT"
expect 0 fuse "$B" -l "$FX/unmatched.safetensors" -o "$O" --allow-unmatched --json
err_has "1 of 2 modules match no model weight and are skipped"
out_has '"modules_unmatched":1'
rm -f "$O"
# an adapter of which nothing matches (another model's) changes nothing: an
# error even with --allow-unmatched, naming the adapter and the base
PP=$FX/../peft/patterns
expect 1 fuse "$B" -l "$PP" -o "$O" --allow-unmatched
err_has "patterns/adapter_model.safetensors: none of its 16 modules matches a weight of the model (first: encoder.layer.0.attention.output.dense), so it would change nothing; --allow-unmatched skips some unmatched modules, never all of them (base $B)"
[ -e "$O" ] && fail "a fuse that changes nothing wrote OUT"
expect 1 fuse "$B" -l "$PP" -o "$O"; err_has "(and nothing else of it matches: is it for this model?)"
expect 1 fuse "$B" -l "$FX/overflow.safetensors" -o "$O"; err_has "blocks.0.attn.to_k.weight: fusion made element [0, 0] non-finite"
[ -e "$O" ] && fail "non-finite fuse left OUT"
expect 0 fuse "$B" -l "$FX/overflow.safetensors" -o "$O" --allow-nonfinite
expect 1 fuse "$B" -l "$FX/peft" -o "$O" --format kohya; err_has "is not a kohya adapter key"
expect 1 fuse "$B" -l "$FX/nosuch" -o "$O"; err_has "nosuch: no such file or directory"
expect 1 fuse "$TMP/nobase.safetensors" -l "$FX/peft" -o "$TMP/o2.safetensors"
[ -e "$TMP/o2.safetensors" ] && fail "missing base left OUT"
ls "$TMP" | grep -v -E '^(out|err|out\.safetensors|link\.safetensors)$' && fail "temporary files left behind"

# inspect on adapters: format, modules, rank / alpha / scale / where alpha came from.
expect 0 inspect "$FX/peft"
out_has "format:  peft (adapter_config.json)"; out_has "modules: 2"
grep -E '^ +lora +4 +4 +1 +1  config +blocks.0.attn.to_k$' "$TMP/out" >/dev/null || fail "inspect peft: to_k row"
grep -E '^ +lora +2 +4 +2 +1  config +blocks.0.attn.to_q$' "$TMP/out" >/dev/null || fail "inspect peft: to_q row"
expect 0 inspect "$FX/diffusers.safetensors" --json
out_has '"format":"diffusers"'; out_has '"module_count":2'
out_has '{"module":"blocks.0.attn.to_q","algo":"lora","rank":2,"alpha":1.0,"scale":0.5,"alpha_source":".alpha tensor","in":6,"out":8,"dtype_A":"F16","dtype_B":"F16","dora":false,"lora_bias":false,"tucker":false,"conv":false,"tensors":{'
expect 0 inspect "$FX/kohya.safetensors";     out_has "format:  kohya"; out_has ".alpha tensor"
expect 0 inspect "$FX/fastvideo.safetensors"; out_has "format:  fastvideo"
expect 1 inspect "$FX/bad_lone_a.safetensors"; err_has "lora_A without lora_B"
expect 0 inspect "$B"; out_has "tensors (5):"
# inspect --base names each module's algorithm as plain inspect does (a LoHa file said "lora": issue 29)
LY=$FX/../lycoris
expect 0 inspect "$LY/loha.safetensors" --base "$LY/base_f32.safetensors" --json
out_has '"algorithm":"loha"'; grep -F '"algorithm":"lora"' "$TMP/out" >/dev/null && fail "inspect --base: a LoHa module labelled lora"
expect 0 inspect "$LY/loha.safetensors" --base "$LY/base_f32.safetensors"; out_has ", loha, rank "
expect 0 inspect "$LY/dora_out.safetensors" --base "$LY/base_f32.safetensors" --json; out_has '"algorithm":"lora"'; out_has '"dora":true'
expect 0 inspect "$LY/dora_out.safetensors" --base "$LY/base_f32.safetensors"; out_has ", lora+DoRA, rank "
# --convention (issue 29): a DoRA file on the output axis gives other weights under comfyui (the norm of the
# original W); the summary and the lorakit.fused record name it; a bad name is a usage error
expect 2 fuse "$LY/base_f32.safetensors" -l "$LY/dora_out.safetensors" -o "$O" --convention a1111
err_has "unknown convention 'a1111' (valid: lorakit, comfyui, lycoris, peft)"
expect 2 fuse "$LY/base_f32.safetensors" -l "$LY/dora_out.safetensors" -o "$O" --convention
expect 0 fuse "$LY/base_f32.safetensors" -l "$LY/dora_out.safetensors" -o "$O" --json
out_has '"convention":"lorakit"'; d_lk=$(digest "$O")
expect 0 fuse "$LY/base_f32.safetensors" -l "$LY/dora_out.safetensors" -o "$O" --json --convention comfyui
out_has '"convention":"comfyui"'; d_cf=$(digest "$O")
[ "$d_lk" != "$d_cf" ] || fail "--convention comfyui gave lorakit's bytes for a DoRA file"
expect 0 inspect "$O"; out_has '"convention":"comfyui"'
expect 0 fuse "$LY/base_f32.safetensors" -l "$LY/dora_out.safetensors" -o "$O" --convention lorakit
[ "$(digest "$O")" = "$d_lk" ] || fail "--convention lorakit is not the default"
expect 0 inspect "$LY/dora_out.safetensors" --base "$LY/base_f32.safetensors" --convention peft
expect 2 inspect "$LY/dora_out.safetensors" --base "$LY/base_f32.safetensors" --convention x; err_has "unknown convention 'x'"
expect 0 fuse --help; out_has "--convention C"
# Streaming: fusing into a 128 MB model (16 BF16 weights of 8 MB, zeros)
# keeps the peak resident set far below the model size: the base's pages are
# released once each tensor is written. Needs GNU time for the peak RSS.
if [ -x /usr/bin/time ]; then
  h="{"; off=0; sz=$((1024 * 4096 * 2))
  for ((i = 0; i < 16; i++)); do
    h+="\"blocks.$i.w.weight\":{\"dtype\":\"BF16\",\"shape\":[1024,4096],\"data_offsets\":[$off,$((off + sz))]}"
    off=$((off + sz)); [ $i -lt 15 ] && h+=","
  done
  h+="}"
  # 8-byte little-endian header length (padded to 2048), header, zeros.
  { printf '\x00\x08\x00\x00\x00\x00\x00\x00'; printf '%s%*s' "$h" $((2048 - ${#h})) ""; head -c $off /dev/zero; } >"$TMP/big.safetensors"
  h='{"blocks.3.w.lora_A":{"dtype":"BF16","shape":[2,4096],"data_offsets":[0,16384]},"blocks.3.w.lora_B":{"dtype":"BF16","shape":[1024,2],"data_offsets":[16384,20480]}}'
  { printf '\x00\x01\x00\x00\x00\x00\x00\x00'; printf '%s%*s' "$h" $((256 - ${#h})) ""; head -c 20480 /dev/zero; } >"$TMP/bigad.safetensors"
  /usr/bin/time -f "%M" -o "$TMP/rss" "$LK" fuse "$TMP/big.safetensors" -l "$TMP/bigad.safetensors" -o "$TMP/bigout.safetensors" >"$TMP/out" 2>"$TMP/err" \
    || { cat "$TMP/err"; fail "fuse of the 128 MB model"; }
  out_has "fused 1 adapter into 1 of 16 tensors"
  rss=$(tail -1 "$TMP/rss"); echo "fuse_cli.sh: peak RSS fusing a 128 MB model: ${rss} KB"
  [ "$rss" -lt 65536 ] || fail "peak RSS ${rss} KB while fusing a 128 MB model (expected < 64 MB)"
  rm -f "$TMP/big.safetensors" "$TMP/bigad.safetensors" "$TMP/bigout.safetensors" "$TMP/rss"
fi

# bench fuse, tiny: the documented JSON lines (figures not asserted).
expect 0 bench fuse --help; out_has "usage: lorakit bench fuse"
expect 2 bench fuse --dim 0
expect 0 bench fuse --json --dim 96 --repeat 1 --threads 2 --dram-mb 1
[ "$(wc -l <"$TMP/out")" = 60 ] || { cat "$TMP/out"; fail "bench fuse: expected 60 JSON lines"; }
for t in 1 2; do
  grep -E "^\{\"bench\":\"bandwidth\",\"kind\":\"cache\",\"bytes\":18432,\"threads\":$t,\"gbps\":[0-9.]+\}$" "$TMP/out" >/dev/null || fail "cache bandwidth line t=$t"
  grep -E "^\{\"bench\":\"bandwidth\",\"kind\":\"dram\",\"bytes\":1032192,\"llc_bytes\":[0-9]+,\"threads\":$t,\"gbps\":[0-9.]+\}$" "$TMP/out" >/dev/null || fail "dram bandwidth line t=$t"
  grep -E "^\{\"bench\":\"fma_peak\",\"isa\":\"(avx512|avx2|scalar)\",\"threads\":$t,\"glanes_per_s\":[0-9.]+\}$" "$TMP/out" >/dev/null || fail "fma_peak line t=$t"
done
for ms in naive:tensor lorakit:tensor lorakit:model; do for r in 8 16 64 128; do for t in 1 2; do
  m=${ms%%:*}; sc=${ms##*:}
  grep -E "^\{\"bench\":\"fuse\",\"method\":\"$m\",\"scope\":\"$sc\",\"dtype\":\"bf16\",\"rank\":$r,\"threads\":$t,\"tensors\":[0-9]+,\"bytes\":[0-9]+,\"seconds\":[0-9.]+,\"gbps\":[0-9.]+,\"ratio_to_dram\":[0-9.]+,\"ratio_to_cache\":[0-9.]+,.*\"fma_fraction\":[0-9.]+,\"fma_fraction_at_dram\":[0-9.]+\}$" "$TMP/out" >/dev/null \
    || { cat "$TMP/out"; fail "bench fuse line $m $sc r=$r t=$t"; }
done; done; done
for lay in plain scaled; do for rd in nearest stochastic; do for t in 1 2; do
  grep -E "^\{\"bench\":\"fuse\",\"method\":\"lorakit\",\"scope\":\"tensor\",\"dtype\":\"f8_e4m3\",\"layout\":\"$lay\",\"rounding\":\"$rd\",\"rank\":16,\"threads\":$t,\"tensors\":1,\"bytes\":9216,\"seconds\":[0-9.]+,\"gbps\":[0-9.]+,\"ratio_to_dram\":[0-9.]+," "$TMP/out" >/dev/null \
    || { cat "$TMP/out"; fail "bench fuse FP8 line $lay $rd t=$t"; }
done; done; done
for al in lora conv_lora loha lokr dense oft boft; do for t in 1 2; do
  grep -E "^\{\"bench\":\"fuse\",\"method\":\"lorakit\",\"scope\":\"tensor\",\"algo\":\"$al\",\"dtype\":\"bf16\",\"rank\":16,\"threads\":$t,\"bytes\":18432,\"seconds\":[0-9.]+,\"gbps\":[0-9.]+,\"ratio_to_lora\":[0-9.]+,\"ratio_to_dram\":[0-9.]+," "$TMP/out" >/dev/null \
    || { cat "$TMP/out"; fail "bench fuse algorithm line $al t=$t"; }
done; done
# the F32 rows of LoRA, OFT and BOFT (OFT's rule differs by dtype: README, bench fuse)
for al in lora oft boft; do for t in 1 2; do
  grep -E "^\{\"bench\":\"fuse\",\"method\":\"lorakit\",\"scope\":\"tensor\",\"algo\":\"$al\",\"dtype\":\"f32\",\"rank\":16,\"threads\":$t,\"bytes\":36864,\"seconds\":[0-9.]+,\"gbps\":[0-9.]+,\"ratio_to_lora\":[0-9.]+," "$TMP/out" >/dev/null \
    || { cat "$TMP/out"; fail "bench fuse F32 algorithm line $al t=$t"; }
done; done
# the dense row at model scope (every weight of the DRAM-sized buffer, diff read too)
for t in 1 2; do
  grep -E "^\{\"bench\":\"fuse\",\"method\":\"lorakit\",\"scope\":\"model\",\"algo\":\"dense\",\"dtype\":\"bf16\",\"threads\":$t,\"tensors\":[0-9]+,\"bytes\":1032192,\"seconds\":[0-9.]+,\"gbps\":[0-9.]+,\"ratio_to_dram\":[0-9.]+,.*\"ratio_to_dram_bytes_median\":[0-9.]+\}$" "$TMP/out" >/dev/null \
    || { cat "$TMP/out"; fail "bench fuse dense model line t=$t"; }
done
echo "fuse_cli.sh: ok"
