#!/usr/bin/env bash
# many_tensors.sh LORAKIT [N] — peak RSS and time of inspect / digest / fuse
# on a checkpoint of N tensors (default 1,300,000: a 98 MB header, under the
# format's 100 MB limit), written by tests/gen_many_tensors.py into a
# temporary folder (about 120 MB of disk). The figures of issue 20 item 15:
#   before (jansson DOM of the header): inspect 1670 MB, fuse 2301 MB, digest 1646 MB;
#   after: see README ("Memory of many-tensor checkpoints").
set -euo pipefail
LK="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
N="${2:-1300000}"
HERE="$(cd "$(dirname "$0")/../.." && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/lkmany.XXXXXX")"
trap 'rm -rf "$work"' EXIT
python3 "$HERE/tests/gen_many_tensors.py" "$N" "$work/m.safetensors" "$work/ad"
python3 - "$LK" "$work" <<'PY'
import os, struct, sys, time
lk, w = sys.argv[1], sys.argv[2]
hdr = struct.unpack("<Q", open(os.path.join(w, "m.safetensors"), "rb").read(8))[0]
for args in (["inspect", "m.safetensors"], ["inspect", "m.safetensors", "--json"], ["digest", "m.safetensors"],
             ["fuse", "m.safetensors", "-l", "ad", "-o", "out.safetensors"]):
    t0 = time.time()
    pid = os.fork()
    if pid == 0:
        os.chdir(w)
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, 1)
        os.execv(lk, [lk] + args)
    _, st, ru = os.wait4(pid, 0)
    print("%-22s exit %d  %6.1f s  peak RSS %7.1f MB = %.2f x the %.1f MB header" % (
        " ".join(args[:3] if args[0] != "fuse" else args[:1]), os.waitstatus_to_exitcode(st), time.time() - t0,
        ru.ru_maxrss * 1024 / 1e6, ru.ru_maxrss * 1024 / hdr, hdr / 1e6))
PY
