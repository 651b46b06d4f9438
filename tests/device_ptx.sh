#!/usr/bin/env bash
# device_ptx.sh — the compiled-code audit of the device kernels: nvcc's PTX
# of src/fuse/*.cu and src/device/*.cu (built by CMake with the real build's flags, for
# compute_80 and compute_90: targets lk_ptx_80 / lk_ptx_90) must hold
#  1. no approximate or flush-to-zero float instruction: no .approx, .ftz,
#     div.full, rcp/rsqrt/sqrt/ex2/lg2/sin/cos/tanh except IEEE ones
#     (div.rn, sqrt.rn, rcp.rn);
#  2. every f32/f64 add, sub and mul with an explicit rounding (.rn): ptxas
#     may contract a plain mul.f32 + add.f32 into an fma, never a .rn one;
#  3. exactly the FMAs the source writes, kernel by kernel: each __global__
#     kernel's expected fma.rn.f32 / fma.rn.f64 counts are declared in the
#     source as a line "// LK_AUDIT <kernel> <fma_f32> <fma_f64>" (beside
#     the code that writes them, kept honest by _Static_asserts in the C
#     build), and the PTX of each .entry must hold exactly those, no other
#     fma and no mad on floats. Every device function is inlined (LK_HD is
#     static inline), so an entry's body is all its code.
# With SASS tools on PATH (cuobjdump, e.g. from NVIDIA's PyPI wheel
# nvidia-cuda-cuobjdump), the sm_80/sm_90 machine code in the built library
# is checked the same way (no FTZ, no MUFU approximations, FFMA / DFMA
# count); CI has nvcc only and audits the PTX.
# Usage: bash device_ptx.sh <path-to-lorakit> <build-dir>   (as ctest runs it)
set -u
BUILD=$(cd "$2" && pwd)
SRC=$(cd "$(dirname "$0")/.." && pwd)
if ! ls "$BUILD"/CMakeFiles/lk_ptx_90.dir/src/fuse/*.ptx >/dev/null 2>&1; then
  echo "device_ptx.sh: SKIP: built without LORAKIT_CUDA (no PTX to audit)"
  exit 0
fi
# the declared table: kernel f32 f64, from every device source
TABLE=$(cat "$SRC"/src/fuse/*.h "$SRC"/src/fuse/*.cu "$SRC"/src/device/*.h "$SRC"/src/device/*.cu | sed -n 's|^// LK_AUDIT \([A-Za-z0-9_]*\) \([0-9]*\) \([0-9]*\)$|\1 \2 \3|p')
[ -n "$TABLE" ] || { echo "FAIL no // LK_AUDIT lines in src/fuse, src/device"; exit 1; }
# per-entry counts of a disassembly: lines "name f32 f64 other"; $1: the
# entry-start regex, $2..$4: the f32, f64 and any-fma regexes
count_per_entry() {
  START="$1" RF="$2" RD="$3" RA="$4" awk '
    $0 ~ ENVIRON["START"] { if (name != "") print name, f, d, o; name = $0; f = d = o = 0; next }
    name != "" && $0 ~ ENVIRON["RF"] { f++; next }
    name != "" && $0 ~ ENVIRON["RD"] { d++; next }
    name != "" && $0 ~ ENVIRON["RA"] { o++ }
    END { if (name != "") print name, f, d, o }'
}
# check_counts LABEL COUNTS: every declared kernel found once with its counts
check_counts() {
  local label=$1 counts=$2 k want_f want_d line f d o
  while read -r k want_f want_d; do
    line=$(printf '%s\n' "$counts" | grep -F "$k" | head -1)
    if [ -z "$line" ]; then echo "FAIL $label: no kernel $k"; fail=1; continue; fi
    read -r o d f <<<"$(printf '%s\n' "$line" | awk '{print $NF, $(NF-1), $(NF-2)}')"
    if [ "$f" != "$want_f" ] || [ "$d" != "$want_d" ] || [ "$o" != 0 ]; then
      echo "FAIL $label $k: $f fma.f32, $d fma.f64 and $o other fma; the source writes $want_f and $want_d"; fail=1
    fi
    echo "{\"audit\": \"$label\", \"kernel\": \"$k\", \"fma_f32\": $f, \"fma_f64\": $d, \"source_fma_f32\": $want_f, \"source_fma_f64\": $want_d}"
  done <<<"$TABLE"
  local n_entries n_declared
  n_entries=$(printf '%s\n' "$counts" | grep -c .)
  n_declared=$(printf '%s\n' "$TABLE" | grep -c .)
  if [ "$n_entries" != "$n_declared" ]; then
    echo "FAIL $label: $n_entries kernels compiled but $n_declared declared by // LK_AUDIT lines:"; printf '%s\n' "$counts"; fail=1
  fi
}
fail=0
for arch in 80 90; do
  ins=$(for ptx in "$BUILD"/CMakeFiles/lk_ptx_$arch.dir/src/{fuse,device}/*.ptx; do [ -f "$ptx" ] && sed 's|//.*||' "$ptx"; done)
  n="src/{fuse,device}/*.cu"
  bad=$( (printf '%s\n' "$ins" | grep -nE '\.approx|\.ftz|div\.full|\b(rsqrt|ex2|lg2|sin|cos|tanh)\.'
          printf '%s\n' "$ins" | grep -nE '\b(rcp|sqrt|div)\.[a-z0-9.]*f(32|64)\b' | grep -vE '\b(rcp|sqrt|div)\.rn\.') || true)
  if [ -n "$bad" ]; then echo "FAIL $n (compute_$arch): approximate or FTZ float instructions:"; echo "$bad" | head; fail=1; fi
  plain=$(printf '%s\n' "$ins" | grep -nE '\b(add|sub|mul)\.(f32|f64)\b' || true)
  if [ -n "$plain" ]; then echo "FAIL $n (compute_$arch): float add/sub/mul without .rn (contractible):"; echo "$plain" | head; fail=1; fi
  mad=$(printf '%s\n' "$ins" | grep -nE '\bmad(\.[a-z]+)*\.(f32|f64)\b' || true)
  if [ -n "$mad" ]; then echo "FAIL $n (compute_$arch): mad on floats:"; echo "$mad" | head; fail=1; fi
  counts=$(printf '%s\n' "$ins" | count_per_entry '\.entry ' '(^|[^a-z.])fma\.rn\.f32([^0-9]|$)' '(^|[^a-z.])fma\.rn\.f64([^0-9]|$)' '(^|[^a-z.])fma\.')
  check_counts "ptx compute_$arch" "$counts"
done
# SASS, when the tools are here (not in CI)
if command -v cuobjdump >/dev/null 2>&1; then
  LIB=$(ls "$BUILD"/liblorakit.so.* 2>/dev/null | head -1)
  for sm in 80 90; do
    sass=$(cuobjdump -sass -arch sm_$sm "$LIB" 2>/dev/null | grep -A1000000 'Function : ')
    [ -n "$sass" ] || { echo "FAIL no sm_$sm SASS in $LIB"; fail=1; continue; }
    bad=$(printf '%s\n' "$sass" | grep -E '\.FTZ|MUFU' || true)
    if [ -n "$bad" ]; then echo "FAIL sm_$sm SASS: FTZ or MUFU (approximate) instructions:"; echo "$bad" | head; fail=1; fi
    counts=$(printf '%s\n' "$sass" | count_per_entry 'Function : ' '(^|[^A-Z])FFMA([^A-Z0-9]|$)' '(^|[^A-Z])DFMA([^A-Z0-9]|$)' '(^|[^A-Z])HFMA2?([^A-Z0-9]|$)')
    check_counts "sass sm_$sm" "$counts"
  done
else
  echo "device_ptx.sh: no cuobjdump on PATH: SASS not audited (PTX only, as in CI)"
fi
[ $fail = 0 ] && echo "device_ptx.sh: OK"
exit $fail
