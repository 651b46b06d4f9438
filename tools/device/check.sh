#!/usr/bin/env bash
# tools/device/check.sh — the one prepared check for a machine with an NVIDIA
# GPU (issue 27): builds lorakit with LORAKIT_CUDA=ON, runs the device tests
# (byte equality with the CPU for every term kind and dtype on emul and on
# cuda:0: the fuse kernel's LoRA / conv / row slices / LoHa / LoKr / dense,
# the key kernel's replacements and vector terms, DoRA's two passes, the FP8 kernel's
# formats x scales x roundings (test_fp8 in test_device_fuse); the
# compiled-code audit of every kernel; the CLI digests; the swap CLI on
# cuda), compute-sanitizer memcheck on the kernel test when present (every
# kernel launched by it), `lorakit bench fuse --device
# cuda` (an 8 GiB-class BF16 model at r = 16 against a device-to-device copy
# in the same run), `lorakit bench swap --device cuda` (swap against restore +
# kernel alone; GPU memory beyond the model), the torch rows (python/bench/fuse_torch.py) and, when
# torch with CUDA imports, python/tests/test_cuda.py (pytest, else tools/device/pyrun.py) and
# examples/python/cuda_swap_nccl.py at one rank (a "not run" row with the reason otherwise). Prints JSON lines ({"check": ..., "ok": ...} and the bench rows);
# exits 1 if any check failed. Meant to take under 8 minutes on an H200.
# Usage: bash tools/device/check.sh [BUILD_DIR]   (default build-cuda)
set -uo pipefail
SRC=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:-$SRC/build-cuda}
JOBS=$(nproc 2>/dev/null || echo 4)
MODEL_MB=${LK_CHECK_MODEL_MB:-8192}
fail=0
row() { echo "{\"check\": \"$1\", \"ok\": $2, \"seconds\": $3${4:+, \"note\": \"$4\"}}"; [ "$2" = true ] || fail=1; }
run() { # name cmd...: runs it, logs to $BUILD/check-<name>.log, prints a row
  local name=$1; shift
  local t0=$SECONDS
  if "$@" >"$BUILD/check-$name.log" 2>&1; then row "$name" true $((SECONDS - t0))
  else row "$name" false $((SECONDS - t0)) "see $BUILD/check-$name.log"; tail -20 "$BUILD/check-$name.log" >&2; fi
}
mkdir -p "$BUILD"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader |
  sed 's/^/{"gpu": "/; s/$/"}/'
run configure cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DLORAKIT_CUDA=ON -DLK_PYTHON=OFF
run build cmake --build "$BUILD" -j "$JOBS" --target lorakit test_device test_device_fuse lk_ptx_80 lk_ptx_90
LK=$BUILD/lorakit
run cuda_present "$LK" bench fuse --device cuda --model-mb 64 --dim 1024 --repeat 1
run test_device "$BUILD/tests/test_device"
run test_device_fuse "$BUILD/tests/test_device_fuse"
grep -q 'cuda:0 skipped' "$BUILD/check-test_device_fuse.log" && row test_device_fuse_ran_on_cuda false 0 "skipped: no CUDA device"
run audit_ptx bash "$SRC/tests/device_ptx.sh" "$LK" "$BUILD"
grep '^{' "$BUILD/check-audit_ptx.log"
run device_cli bash "$SRC/tests/device_cli.sh" "$LK" "$BUILD"
run swap_device bash "$SRC/tests/swap_device.sh" "$LK" "$BUILD"
if command -v compute-sanitizer >/dev/null; then
  run memcheck compute-sanitizer --tool memcheck --error-exitcode 1 "$BUILD/tests/test_device_fuse"
else
  row memcheck true 0 "compute-sanitizer not on PATH: not run"
fi
run bench_fuse "$LK" bench fuse --device cuda --json --model-mb "$MODEL_MB" --repeat 3
grep '^{' "$BUILD/check-bench_fuse.log"
# the swap step on one GPU (2 GiB touched: a 6 GiB model, attention a third) against restoring the
# touched keys + the fuse kernel alone, and the GPU memory beyond the model (summary row)
run bench_swap "$LK" bench swap --device cuda --ranks 1 --json --size-mb "${LK_CHECK_SWAP_MB:-6144}" --dim 3072 --repeat 3
grep '^{' "$BUILD/check-bench_swap.log"
PY=${PYTHON:-python3}
if "$PY" -c 'import torch' 2>/dev/null; then
  run bench_torch "$PY" "$SRC/python/bench/fuse_torch.py" --model-mb "$MODEL_MB"
  grep '^{' "$BUILD/check-bench_torch.log"
else
  row bench_torch true 0 "torch does not import: torch rows not run"
fi
# the Python API on CUDA tensors (python/tests/test_cuda.py: every test on cuda:0 and on emul) and the
# example examples/python/cuda_swap_nccl.py (fuse_ + Tracker over a 1-rank NCCL group), with the
# binding built for $PY in the same build folder (the library is built already: only the extension)
why=$("$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)' >/dev/null 2>&1; case $? in
  0) ;; 3) echo "torch imports but sees no CUDA device (torch.cuda.is_available() is False)";;
  *) echo "torch does not import with $PY";; esac)
if [ -z "$why" ]; then
  run py_configure cmake -S "$SRC" -B "$BUILD" -DLK_PYTHON=ON -DPython3_EXECUTABLE="$(command -v "$PY")"
  run py_build cmake --build "$BUILD" -j "$JOBS" --target _lorakit lorakit_py_files
  export PYTHONPATH="$BUILD/python${PYTHONPATH:+:$PYTHONPATH}" LORAKIT_BIN="$LK" PYTHONDONTWRITEBYTECODE=1
  if "$PY" -c 'import pytest' 2>/dev/null; then
    run py_test_cuda timeout 300 "$PY" -m pytest -q -rs -p no:cacheprovider "$SRC/python/tests/test_cuda.py"
  else # the image has torch but no pytest: the plain runner
    run py_test_cuda timeout 300 "$PY" "$SRC/tools/device/pyrun.py" "$SRC/python/tests/test_cuda.py"
  fi
  grep -q 'no CUDA device' "$BUILD/check-py_test_cuda.log" && row py_test_cuda_ran_on_cuda false 0 "skipped: no CUDA device"
  run py_example_cuda_swap_nccl timeout 120 "$PY" -m torch.distributed.run --nproc_per_node 1 --master_port 29533 \
    "$SRC/examples/python/cuda_swap_nccl.py" "$BUILD/example-cuda-swap"
else
  row py_test_cuda true 0 "not run: $why"
  row py_example_cuda_swap_nccl true 0 "not run: $why"
fi
exit $fail
