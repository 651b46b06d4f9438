#!/usr/bin/env bash
# rss_many_tensors.sh LORAKIT BUILD_DIR — the memory a many-tensor
# checkpoint takes (issue 20 item 15): peak RSS of `inspect`, `inspect
# --json`, `digest` and a `fuse` of a 200,000-tensor file (14.6 MB header,
# tests/gen_many_tensors.py) stays within
#     baseline + K x header + largest tensor,
# K = 4 for inspect/digest (they hold one lk_tensor of 96 bytes and a name
# per tensor, 2.8x the header here) and 4.5 for fuse (it also holds the
# output's index: 3.9x here). Before: inspect 17x the header (a jansson DOM
# of the whole header), fuse 23x. The baseline is the same command on a
# 4-tensor file from the same generator (libraries, allocator, buffers that
# do not grow with the tensor count), plus 4 MiB for page and allocator
# granularity. Peak RSS is the child's ru_maxrss (wait4); it includes the
# ~10 MiB of the measuring python a forked child starts from, in both
# runs, so it is part of the baseline (the multiples printed are above it).
set -euo pipefail
LK="$1"
HERE="$(cd "$(dirname "$0")" && pwd)"
. "$HERE/util/sh_common.sh"
lk_sh_setup "$LK" lkrss "a sanitizer build's shadow memory and quarantine make RSS meaningless"
python3 "$HERE/gen_many_tensors.py" 200000 "$work/big.safetensors" "$work/bigad" >/dev/null
python3 "$HERE/gen_many_tensors.py" 4 "$work/small.safetensors" "$work/smallad" >/dev/null
python3 - "$LK" "$work" <<'PY'
import os, resource, subprocess, sys, struct
lk, work = sys.argv[1], sys.argv[2]
def peak_kib(args):
    # one child per measurement: RUSAGE_CHILDREN's maxrss is the largest child so far
    pid = os.fork()
    if pid == 0:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, 1)
        os.execv(lk, [lk] + args)
    _, status, ru = os.wait4(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit("lorakit %s failed (%d)" % (" ".join(args), os.waitstatus_to_exitcode(status)))
    return ru.ru_maxrss
def header_len(p):
    with open(p, "rb") as f:
        return struct.unpack("<Q", f.read(8))[0]
hdr = header_len(os.path.join(work, "big.safetensors"))
largest = 64 * 64 * 4
bad = 0
for name, k, args in [
    ("inspect", 4.0, ["inspect", "%s.safetensors"]),
    ("inspect --json", 4.0, ["inspect", "%s.safetensors", "--json"]),
    ("digest", 4.0, ["digest", "%s.safetensors"]),
    ("fuse", 4.5, ["fuse", "%s.safetensors", "-l", "%sad", "-o", "%s.out.safetensors"]),
]:
    small = [a % os.path.join(work, "small") if "%s" in a else a for a in args]
    big = [a % os.path.join(work, "big") if "%s" in a else a for a in args]
    base = peak_kib(small) * 1024 + (4 << 20)
    peak = peak_kib(big) * 1024
    limit = base + k * hdr + largest
    ok = peak <= limit
    bad += not ok
    print("%-15s peak %6.1f MiB = baseline %5.1f MiB + %.2f x header (%.1f MiB); limit %.1f MiB (%.1f x) %s" % (
        name, peak / 2**20, base / 2**20, (peak - base) / hdr, hdr / 2**20, limit / 2**20, k, "ok" if ok else "FAIL"))
sys.exit(1 if bad else 0)
PY
echo "rss_many_tensors: all passed"
