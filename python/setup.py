"""Builds lorakit._lorakit, the CPython extension over liblorakit.

Where the C library comes from, first match wins:
  1. LORAKIT_BUILD_DIR: a CMake build folder of this repository (holds
     liblorakit.a and lorakit.pc), e.g. the one `make build` makes;
  2. ../build, when it holds liblorakit.a (after `make build`);
  3. an installed lorakit found by pkg-config (`make install`);
  4. otherwise the static library is configured and built here with CMake
     from the repository around this folder (what `pip install ./python`
     does on a fresh clone where `make build` would work).
LORAKIT_WITH_MPI=0 makes a package with no MPI dependency: it builds the
library here with -DCMAKE_DISABLE_FIND_PACKAGE_MPI=TRUE (or takes
LORAKIT_BUILD_DIR, which must have been configured that way). The
extension lists the static library and the headers as dependencies, so a
changed liblorakit.a rebuilds it.
The static library is linked in (it is position-independent), so the
extension does not need liblorakit.so at run time; its own dependencies
(jansson, libyaml, xxhash, Open MPI) are linked as shared libraries, read
from lorakit.pc's Requires.private (OpenBLAS is loaded by lorakit itself
when training first needs it).
"""
import glob
import os
import re
import shutil
import subprocess

from setuptools import Extension, setup

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def pkgconfig(*args):
    return subprocess.run(["pkg-config", *args], check=True, capture_output=True, text=True).stdout.split()


def version():
    cm = open(os.path.join(ROOT, "CMakeLists.txt")).read() if os.path.exists(os.path.join(ROOT, "CMakeLists.txt")) else ""
    m = re.search(r"project\(lorakit VERSION ([0-9.]+)", cm)
    return m.group(1) if m else "0.1.0"


def requires_of(pc_path):
    for line in open(pc_path):
        if line.startswith("Requires.private:"):
            return line.split(":", 1)[1].split()
    return []


def from_build_dir(build):
    lib, pc = os.path.join(build, "liblorakit.a"), os.path.join(build, "lorakit.pc")
    if not (os.path.exists(lib) and os.path.exists(pc)):
        return None
    reqs = requires_of(pc)
    flags = pkgconfig("--cflags", "--libs", *reqs) if reqs else []
    return {"include": [os.path.join(ROOT, "include")], "objects": [lib], "flags": flags + ["-lm", "-lpthread", "-ldl"],
            "mpi": "ompi-c" in reqs}


def from_pkgconfig():
    try:
        flags = pkgconfig("--static", "--cflags", "--libs", "lorakit")
    except (OSError, subprocess.CalledProcessError):
        return None
    reqs = pkgconfig("--print-requires-private", "lorakit")
    libdir = pkgconfig("--variable=libdir", "lorakit")[0]
    static = os.path.join(libdir, "liblorakit.a")
    flags = [f for f in flags if f != "-llorakit"]
    return {"include": [], "objects": [static], "flags": flags, "mpi": any(r.startswith("ompi-c") for r in reqs)}


def with_mpi():
    """LORAKIT_WITH_MPI=0: a package with no MPI dependency (torch.distributed
    and comm=None still work; an mpi4py communicator is refused)."""
    v = os.environ.get("LORAKIT_WITH_MPI", "").strip().lower()
    if v in ("", "1", "on", "yes", "true"):
        return True
    if v in ("0", "off", "no", "false"):
        return False
    raise SystemExit(f"lorakit: LORAKIT_WITH_MPI={v!r}: use 0 or 1")


def build_here(mpi=True):
    if not shutil.which("cmake") or not os.path.exists(os.path.join(ROOT, "CMakeLists.txt")):
        raise SystemExit("lorakit: liblorakit not found: run `make build` in the repository (or set "
                         "LORAKIT_BUILD_DIR, or install it so that pkg-config finds lorakit)")
    build = os.path.join(HERE, "build", "lorakit-cmake" if mpi else "lorakit-cmake-nompi")
    subprocess.run(["cmake", "-S", ROOT, "-B", build, "-DCMAKE_BUILD_TYPE=Release", "-DLK_TESTS=OFF",
                    "-DLK_PYTHON=OFF"] + ([] if mpi else ["-DCMAKE_DISABLE_FIND_PACKAGE_MPI=TRUE"]), check=True)
    subprocess.run(["cmake", "--build", build, "--target", "lorakit_static", "-j", str(os.cpu_count() or 2)],
                   check=True)
    return from_build_dir(build)


def find_lorakit():
    mpi = with_mpi()
    env = os.environ.get("LORAKIT_BUILD_DIR")
    if env:
        found = from_build_dir(os.path.abspath(env))
        if not found:
            raise SystemExit(f"lorakit: LORAKIT_BUILD_DIR={env} holds no liblorakit.a and lorakit.pc")
        if found["mpi"] and not mpi:
            raise SystemExit(f"lorakit: LORAKIT_WITH_MPI=0 but LORAKIT_BUILD_DIR={env} was configured with MPI; "
                             "configure that build with -DCMAKE_DISABLE_FIND_PACKAGE_MPI=TRUE")
        return found
    if not mpi:  # the repository's build and an installed lorakit may link MPI: build one without
        return build_here(mpi=False)
    return from_build_dir(os.path.join(ROOT, "build")) or from_pkgconfig() or build_here()


lk = find_lorakit()
cflags = [f for f in lk["flags"] if f.startswith(("-I", "-D"))]
ldflags = [f for f in lk["flags"] if not f.startswith(("-I", "-D"))]
macros = [("LK_PY_VERSION", f'"{version()}"')] + ([("LK_HAVE_MPI", "1")] if lk["mpi"] else [])

setup(
    version=version(),
    ext_modules=[Extension(
        "lorakit._lorakit",
        sources=["src/_lorakit.c"],
        include_dirs=lk["include"],
        define_macros=macros,
        extra_compile_args=cflags + ["-std=gnu11"],
        extra_objects=lk["objects"],
        # rebuilt whenever the library (or a header) changed, not only _lorakit.c
        depends=lk["objects"] + sorted(glob.glob(os.path.join(ROOT, "include", "lorakit", "*.h"))),
        extra_link_args=ldflags,
    )],
)
