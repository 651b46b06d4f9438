#!/usr/bin/env bash
# device_ptx.sh — the compiled-code audit of the device kernels: nvcc's PTX
# of src/fuse/*.cu (built by CMake with the real build's flags, for
# compute_80 and compute_90: targets lk_ptx_80 / lk_ptx_90) must hold
#  1. no approximate or flush-to-zero float instruction: no .approx, .ftz,
#     div.full, rcp/rsqrt/sqrt/ex2/lg2/sin/cos/tanh except IEEE ones
#     (div.rn, sqrt.rn, rcp.rn);
#  2. every f32/f64 add, sub and mul with an explicit rounding (.rn): ptxas
#     may contract a plain mul.f32 + add.f32 into an fma, never a .rn one;
#  3. exactly the FMAs the source writes: kernel_dev.h's chain is one fma per
#     row per k with the k loop rolled, so LK_KDEV_RPT fma.rn.f32 (narrow
#     chain) and LK_KDEV_RPT fma.rn.f64 (wide chain), and no mad on floats.
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
RPT=$(sed -n 's/^#define LK_KDEV_RPT \([0-9]*\).*/\1/p' "$SRC/src/fuse/kernel_dev.h")
[ -n "$RPT" ] || { echo "FAIL cannot read LK_KDEV_RPT from kernel_dev.h"; exit 1; }
fail=0
for arch in 80 90; do
  for ptx in "$BUILD"/CMakeFiles/lk_ptx_$arch.dir/src/fuse/*.ptx; do
    n=$(basename "$ptx")
    # instructions only: PTX comments start with //
    ins=$(sed 's|//.*||' "$ptx")
    bad=$( (printf '%s\n' "$ins" | grep -nE '\.approx|\.ftz|div\.full|\b(rsqrt|ex2|lg2|sin|cos|tanh)\.'
            printf '%s\n' "$ins" | grep -nE '\b(rcp|sqrt|div)\.[a-z0-9.]*f(32|64)\b' | grep -vE '\b(rcp|sqrt|div)\.rn\.') || true)
    if [ -n "$bad" ]; then echo "FAIL $n (compute_$arch): approximate or FTZ float instructions:"; echo "$bad" | head; fail=1; fi
    plain=$(printf '%s\n' "$ins" | grep -nE '\b(add|sub|mul)\.(f32|f64)\b' || true)
    if [ -n "$plain" ]; then echo "FAIL $n (compute_$arch): float add/sub/mul without .rn (contractible):"; echo "$plain" | head; fail=1; fi
    mad=$(printf '%s\n' "$ins" | grep -nE '\bmad(\.[a-z]+)*\.(f32|f64)\b' || true)
    if [ -n "$mad" ]; then echo "FAIL $n (compute_$arch): mad on floats:"; echo "$mad" | head; fail=1; fi
    f32=$(printf '%s\n' "$ins" | grep -cE '\bfma\.rn\.f32\b')
    f64=$(printf '%s\n' "$ins" | grep -cE '\bfma\.rn\.f64\b')
    other=$(printf '%s\n' "$ins" | grep -E '\bfma\.' | grep -cvE '\bfma\.rn\.f(32|64)\b')
    if [ "$f32" != "$RPT" ] || [ "$f64" != "$RPT" ] || [ "$other" != 0 ]; then
      echo "FAIL $n (compute_$arch): $f32 fma.rn.f32, $f64 fma.rn.f64 and $other other fma; the source writes $RPT and $RPT"
      fail=1
    fi
    echo "{\"audit\": \"ptx\", \"file\": \"$n\", \"arch\": \"compute_$arch\", \"fma_f32\": $f32, \"fma_f64\": $f64, \"source_fma_f32\": $RPT, \"source_fma_f64\": $RPT}"
  done
done
# SASS, when the tools are here (not in CI)
if command -v cuobjdump >/dev/null 2>&1; then
  LIB=$(ls "$BUILD"/liblorakit.so.* 2>/dev/null | head -1)
  for sm in 80 90; do
    sass=$(cuobjdump -sass -arch sm_$sm "$LIB" 2>/dev/null | grep -A100000 'lk_kdev_fuse')
    [ -n "$sass" ] || { echo "FAIL no sm_$sm SASS for lk_kdev_fuse in $LIB"; fail=1; continue; }
    bad=$(printf '%s\n' "$sass" | grep -E '\.FTZ|MUFU' || true)
    if [ -n "$bad" ]; then echo "FAIL sm_$sm SASS: FTZ or MUFU (approximate) instructions:"; echo "$bad" | head; fail=1; fi
    ffma=$(printf '%s\n' "$sass" | grep -cE '\bFFMA\b')
    dfma=$(printf '%s\n' "$sass" | grep -cE '\bDFMA\b')
    if [ "$ffma" != "$RPT" ] || [ "$dfma" != "$RPT" ]; then
      echo "FAIL sm_$sm SASS: $ffma FFMA and $dfma DFMA; the source writes $RPT and $RPT"; fail=1
    fi
    echo "{\"audit\": \"sass\", \"arch\": \"sm_$sm\", \"ffma\": $ffma, \"dfma\": $dfma, \"source_fma\": $RPT}"
  done
else
  echo "device_ptx.sh: no cuobjdump on PATH: SASS not audited (PTX only, as in CI)"
fi
[ $fail = 0 ] && echo "device_ptx.sh: OK"
exit $fail
