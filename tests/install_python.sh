#!/bin/bash
# install_python.sh — `pip install ./python` works: installs the package
# (from this build's static library and CLI, LORAKIT_BUILD_DIR) into a
# temporary --target from a copy of the repository's python/, include/ and
# data/ (nothing is written into the source tree), then, from another
# folder, with only that target on PYTHONPATH:
#   - the package holds the family tables (lorakit/lorakit-families) and
#     finds them relative to the module: a diffusers Flux LoRA onto a
#     BFL-named base matches through lorakit-families/flux.lkmap of the
#     INSTALLED package (the info line names that file; the library's
#     compiled-in source-tree path comes after it), also after the copy it
#     was built from is moved away;
#   - the `lorakit` console command (and `python -m lorakit`) is the C CLI:
#     the same stdout, stderr and exit code as this build's CLI for
#     --version, a fuse (same digest), a missing input (1) and an unknown
#     command (2), and its fuse finds the package's flux table;
#   - MPI: a package is built without it unless LORAKIT_WITH_MPI=1: with a
#     build that links Open MPI, an install without LORAKIT_WITH_MPI=1 is
#     refused naming it, and LORAKIT_WITH_MPI=1 installs one that has MPI;
#     with a build without MPI the default install has none (no libmpi).
# The wheel (python -m build + auditwheel) is tests/install_wheel.sh.
# Usage: bash install_python.sh <path-to-lorakit> <build-dir>   (as ctest runs it)
set -euo pipefail
# shellcheck source=tests/py_package_common.bash
. "$(dirname "$0")/py_package_common.bash" install_python.sh "$1" "$2"
"$PY" -m pip --version >/dev/null 2>&1 || skip "$PY has no pip"
[ -f "$BUILD/liblorakit.a" ] && [ -f "$BUILD/lorakit.pc" ] || skip "$BUILD holds no liblorakit.a / lorakit.pc"

TMP=$(mktemp -d "${TMPDIR:-/tmp}/lk-pyinst.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$TMP/clone"
cp -r "$SRC/include" "$SRC/data" "$SRC/CMakeLists.txt" "$TMP/clone/"
mkdir "$TMP/clone/python"
(cd "$SRC/python" && cp -r setup.py pyproject.toml README.md src lorakit "$TMP/clone/python/")
find "$TMP/clone" -name __pycache__ -prune -exec rm -rf {} +

pipi() { # pip install of the copy into $1 (no network, no build isolation: CI is offline)
  local target=$1; shift
  env "$@" LORAKIT_BUILD_DIR="$BUILD" "$PY" -m pip install --no-build-isolation --no-deps --no-index \
    --no-cache-dir --target "$target" "$TMP/clone/python" >"$TMP/pip.log" 2>&1
}
MPI=0
grep -q '^Requires.private:.*ompi-c' "$BUILD/lorakit.pc" && MPI=1
if [ $MPI = 1 ]; then
  pipi "$TMP/refused" LORAKIT_WITH_MPI= && fail "an install from a build with MPI, LORAKIT_WITH_MPI unset, was not refused"
  grep -q "configured with MPI but LORAKIT_WITH_MPI is not 1" "$TMP/pip.log" \
    || { cat "$TMP/pip.log"; fail "the refusal does not name LORAKIT_WITH_MPI"; }
  pipi "$TMP/site" LORAKIT_WITH_MPI=1 || { cat "$TMP/pip.log"; fail "pip install (LORAKIT_WITH_MPI=1)"; }
else
  pipi "$TMP/site" LORAKIT_WITH_MPI= || { cat "$TMP/pip.log"; fail "pip install"; }
fi
PKG="$TMP/site/lorakit"
EXT=$(ls "$PKG"/_lorakit*.so)
for f in flux sd1 sdxl openclip sd3 wan hunyuan-video ltx; do
  [ -f "$PKG/lorakit-families/$f.lkmap" ] || fail "lorakit-families/$f.lkmap not in the package"
done
[ -x "$PKG/lorakit-cli" ] || fail "the C CLI is not in the package"
[ -x "$TMP/site/bin/lorakit" ] || fail "no lorakit console command installed"
if [ $MPI = 1 ]; then
  ldd "$EXT" | grep libmpi >/dev/null || fail "LORAKIT_WITH_MPI=1 gave an extension without Open MPI"
else
  ! ldd "$EXT" "$PKG/lorakit-cli" | grep libmpi >/dev/null || fail "a default install links Open MPI"
fi
mv "$TMP/clone" "$TMP/moved" # the copy it was built from is gone

# the Flux files of install.sh: diffusers-named LoRA, BFL-named base
"$PY" "$SRC/tests/gen_flux_pair.py" "$TMP" || fail "cannot write the Flux test files"
TABLE="model family flux ($(realpath "$PKG")/lorakit-families/flux.lkmap)"
mkdir "$TMP/cwd"
cd "$TMP/cwd"
export PYTHONPATH="$TMP/site" PYTHONDONTWRITEBYTECODE=1
LORAKIT_LOG=info "$PY" - "$TMP" >"$TMP/py.log" 2>&1 <<'PY' || { cat "$TMP/py.log"; fail "the installed package: fuse through the flux table"; }
import logging, os, sys
logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
import lorakit
assert os.path.dirname(lorakit.__file__).startswith(sys.argv[1] + "/site"), lorakit.__file__
lorakit.fuse(sys.argv[1] + "/flux.safetensors", [(sys.argv[1] + "/lora.safetensors", 1.0)], sys.argv[1] + "/py.safetensors")
print("digest", lorakit.digest(sys.argv[1] + "/py.safetensors"))
PY
grep -qF "$TABLE" "$TMP/py.log" || { cat "$TMP/py.log"; fail "the installed package did not use its own flux table"; }

# the console command is the C CLI: same streams and exit codes
same() { # same(expected rc, args...): this build's CLI and the installed command agree
  local want=$1; shift
  local rc1=0 rc2=0 rc3=0
  "$CLI" "$@" >"$TMP/c.out" 2>"$TMP/c.err" || rc1=$?
  "$TMP/site/bin/lorakit" "$@" >"$TMP/p.out" 2>"$TMP/p.err" || rc2=$?
  "$PY" -m lorakit "$@" >"$TMP/m.out" 2>"$TMP/m.err" || rc3=$?
  [ "$rc1" = "$want" ] || fail "build CLI $*: exit $rc1, expected $want"
  [ "$rc2" = "$rc1" ] && [ "$rc3" = "$rc1" ] || fail "lorakit $*: exit $rc2 (command) / $rc3 (python -m) != $rc1 (C CLI)"
  cmp -s "$TMP/c.out" "$TMP/p.out" && cmp -s "$TMP/c.out" "$TMP/m.out" || fail "lorakit $*: stdout differs from the C CLI's"
  sed "s#$CLI#CLI#g" "$TMP/c.err" >"$TMP/c.err2"
  for e in p m; do sed "s#$PKG/lorakit-cli#CLI#g" "$TMP/$e.err" >"$TMP/$e.err2"
    cmp -s "$TMP/c.err2" "$TMP/$e.err2" || { diff "$TMP/c.err2" "$TMP/$e.err2" || true; fail "lorakit $*: stderr differs"; }
  done
}
same 0 --version
same 0 digest "$TMP/flux.safetensors"
same 1 fuse "$TMP/nonexistent.safetensors" -l "$TMP/lora.safetensors" -o "$TMP/x.safetensors"
same 2 no-such-command
LORAKIT_LOG=info "$TMP/site/bin/lorakit" fuse "$TMP/flux.safetensors" -l "$TMP/lora.safetensors" -o "$TMP/cli.safetensors" \
  >/dev/null 2>"$TMP/cli.log" || { cat "$TMP/cli.log"; fail "the console command: fuse"; }
grep -qF "$TABLE" "$TMP/cli.log" || { cat "$TMP/cli.log"; fail "the packaged CLI did not use the package's flux table"; }
D1=$("$CLI" digest "$TMP/cli.safetensors")
grep -qx "digest $D1" "$TMP/py.log" || fail "the package's fuse and the CLI's differ"
echo "install_python.sh: OK (mpi=$MPI, $TMP/site, digest $D1)"
