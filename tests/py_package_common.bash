# py_package_common.bash — sourced by install_python.sh and install_wheel.sh
# (not a test itself: ctest runs tests/*.sh). Sets SRC (the repository),
# CLI (this build's C CLI), BUILD, PY (LK_PYTHON, else the Python the
# build was configured for), skip (exit 77: ctest's "skipped", with the
# reason) and fail; skips a sanitizer build and a Python without setuptools
# and NumPy. Usage: . py_package_common.bash NAME <path-to-lorakit> <build-dir>
LK_TEST_NAME=$1
SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CLI=$(realpath "$2")
BUILD=$(cd "$3" && pwd)
skip() { echo "$LK_TEST_NAME: SKIP: $*"; exit 77; }
fail() { echo "$LK_TEST_NAME: FAIL: $*" >&2; exit 1; }
PY=${LK_PYTHON:-$(sed -n 's/^_\{0,1\}Python3_EXECUTABLE:[A-Z]*=//p' "$BUILD/CMakeCache.txt" | head -1)}
[ -n "$PY" ] || PY=python3
if grep -q '^LK_SANITIZE:BOOL=ON' "$BUILD/CMakeCache.txt" 2>/dev/null; then
  skip "a sanitizer build (the package is built from Release builds)"
fi
"$PY" -c "import setuptools, numpy" 2>/dev/null || skip "$PY has no setuptools or numpy"
