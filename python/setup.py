"""Builds lorakit._lorakit, the CPython extension over liblorakit, and
ships the C CLI and the model-family tables inside the package.

Where the C library (and the CLI beside it) come from, first match wins:
  1. LORAKIT_BUILD_DIR: a CMake build folder of this repository (holds
     liblorakit.a, lorakit.pc and the lorakit CLI), e.g. the one `make
     build` makes;
  2. ../build, when it holds them and matches the MPI choice below;
  3. with LORAKIT_WITH_MPI=1 only: an installed lorakit found by pkg-config
     (`make install`; its bin/lorakit is the CLI);
  4. otherwise the static library and the CLI are configured and built here
     with CMake from the repository around this folder (what `pip install
     ./python` does on a fresh clone), in build/lorakit-cmake[-nompi].
MPI: the package is built WITHOUT MPI (no Open MPI dependency; comm=None
and torch.distributed work, an mpi4py communicator is refused) unless
LORAKIT_WITH_MPI=1 (mpi4py users set it). A LORAKIT_BUILD_DIR configured the
other way is refused naming the fix.
Shipped in the package folder (lorakit/): lorakit-cli (the C CLI, run by the
`lorakit` console command and `python -m lorakit`) and lorakit-families/
(data/families/*.lkmap); the library looks for lorakit-families beside the
file that holds it (the extension module, the CLI), so an installed package
finds its tables wherever it is unpacked, without the clone.
The extension lists the static library and the headers as dependencies, so
a changed liblorakit.a rebuilds it. The static library is linked in (it is
position-independent), so the extension does not need liblorakit.so at run
time; its own dependencies (jansson, libyaml, xxhash, PCRE2, and Open MPI
when asked for) are linked as shared libraries, read from lorakit.pc's
Requires.private (OpenBLAS is loaded by lorakit itself when training first
needs it). `auditwheel repair` copies them into the wheel.
"""
import glob
import os
import re
import shutil
import subprocess

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def pkgconfig(*args):
    return subprocess.run(["pkg-config", *args], check=True, capture_output=True, text=True).stdout.split()


def version():
    cm = open(os.path.join(ROOT, "CMakeLists.txt")).read() if os.path.exists(os.path.join(ROOT, "CMakeLists.txt")) else ""
    m = re.search(r"project\(lorakit VERSION ([0-9.]+)", cm)
    return m.group(1) if m else "0.1.0"


def pc_field(pc_path, field):
    for line in open(pc_path):
        if line.startswith(field + ":"):
            return line.split(":", 1)[1].split()
    return []


def requires_of(pc_path):
    return pc_field(pc_path, "Requires.private")


def from_build_dir(build):
    lib, pc = os.path.join(build, "liblorakit.a"), os.path.join(build, "lorakit.pc")
    if not (os.path.exists(lib) and os.path.exists(pc)):
        return None
    reqs = requires_of(pc)
    flags = pkgconfig("--cflags", "--libs", *reqs) if reqs else []
    # Libs.private: a CUDA build's static runtime and the C++ runtime its objects need, -lm, -ldl
    flags += [f for f in pc_field(pc, "Libs.private") if "${" not in f]
    return {"include": [os.path.join(ROOT, "include")], "objects": [lib], "flags": flags + ["-lm", "-lpthread", "-ldl"],
            "mpi": any(r.startswith("ompi-c") for r in reqs), "cli": os.path.join(build, "lorakit"), "where": build}


def from_pkgconfig():
    try:
        flags = pkgconfig("--static", "--cflags", "--libs", "lorakit")
    except (OSError, subprocess.CalledProcessError):
        return None
    reqs = pkgconfig("--print-requires-private", "lorakit")
    libdir = pkgconfig("--variable=libdir", "lorakit")[0]
    static = os.path.join(libdir, "liblorakit.a")
    flags = [f for f in flags if f != "-llorakit"]
    prefix = pkgconfig("--variable=prefix", "lorakit")[0]
    return {"include": [], "objects": [static], "flags": flags, "mpi": any(r.startswith("ompi-c") for r in reqs),
            "cli": os.path.join(prefix, "bin", "lorakit"), "where": "pkg-config lorakit (" + prefix + ")"}


def with_mpi():
    """LORAKIT_WITH_MPI=1: a package linked to Open MPI that accepts mpi4py
    communicators; unset or 0 (the default): no MPI dependency."""
    v = os.environ.get("LORAKIT_WITH_MPI", "").strip().lower()
    if v in ("1", "on", "yes", "true"):
        return True
    if v in ("", "0", "off", "no", "false"):
        return False
    raise SystemExit(f"lorakit: LORAKIT_WITH_MPI={v!r}: use 0 or 1")


def build_here(mpi):
    if not shutil.which("cmake") or not os.path.exists(os.path.join(ROOT, "CMakeLists.txt")):
        raise SystemExit("lorakit: liblorakit not found: run `make build` in the repository (or set "
                         "LORAKIT_BUILD_DIR, or install it so that pkg-config finds lorakit)")
    build = os.path.join(HERE, "build", "lorakit-cmake" if mpi else "lorakit-cmake-nompi")
    cuda = os.environ.get("LORAKIT_CUDA", "").strip()  # AUTO (CMake's default), ON or OFF
    subprocess.run(["cmake", "-S", ROOT, "-B", build, "-DCMAKE_BUILD_TYPE=Release", "-DLK_TESTS=OFF",
                    "-DLK_PYTHON=OFF"] + ([] if mpi else ["-DCMAKE_DISABLE_FIND_PACKAGE_MPI=TRUE"])
                   + ([f"-DLORAKIT_CUDA={cuda}"] if cuda else []), check=True)
    subprocess.run(["cmake", "--build", build, "--target", "lorakit_static", "lorakit", "-j",
                    str(os.cpu_count() or 2)], check=True)
    return from_build_dir(build)


def checked(found, mpi, what):
    """found, when it matches the MPI choice and holds the CLI; else None
    (what: None) or an error naming the fix (what: the variable that named it)."""
    if not found:
        return None
    bad = None
    if found["mpi"] != mpi:
        bad = (f"{found['where']} was configured with{'' if found['mpi'] else 'out'} MPI but LORAKIT_WITH_MPI is "
               f"{'1' if mpi else 'not 1 (the default builds without MPI)'}: "
               + ("set LORAKIT_WITH_MPI=1, or configure that build with -DCMAKE_DISABLE_FIND_PACKAGE_MPI=TRUE"
                  if found["mpi"] else "configure that build with Open MPI found, or unset LORAKIT_WITH_MPI"))
    elif not os.access(found["cli"], os.X_OK):
        bad = f"{found['where']} holds no lorakit CLI ({found['cli']}): build it (cmake --build DIR --target lorakit)"
    if bad and what:
        raise SystemExit(f"lorakit: {what}: {bad}")
    return None if bad else found


def find_lorakit():
    mpi = with_mpi()
    env = os.environ.get("LORAKIT_BUILD_DIR")
    if env:
        found = from_build_dir(os.path.abspath(env))
        if not found:
            raise SystemExit(f"lorakit: LORAKIT_BUILD_DIR={env} holds no liblorakit.a and lorakit.pc")
        return checked(found, mpi, f"LORAKIT_BUILD_DIR={env}")
    return (checked(from_build_dir(os.path.join(ROOT, "build")), mpi, None)
            or (checked(from_pkgconfig(), mpi, None) if mpi else None) or build_here(mpi))


class BuildPy(build_py):
    """Copies the CLI (as lorakit/lorakit-cli) and the family tables (as
    lorakit/lorakit-families/) into the package being built."""

    def run(self):
        super().run()
        pkg = os.path.join(self.build_lib, "lorakit")
        self.copy_file(lk["cli"], os.path.join(pkg, "lorakit-cli"))
        os.chmod(os.path.join(pkg, "lorakit-cli"), 0o755)
        tables = os.path.join(pkg, "lorakit-families")
        self.mkpath(tables)
        src = os.path.join(ROOT, "data", "families")
        if not os.path.isdir(src):
            raise SystemExit(f"lorakit: {src}: the model-family tables are missing")
        for f in sorted(glob.glob(os.path.join(src, "*.lkmap"))):
            self.copy_file(f, os.path.join(tables, os.path.basename(f)))


lk = find_lorakit()
cflags = [f for f in lk["flags"] if f.startswith(("-I", "-D"))]
ldflags = [f for f in lk["flags"] if not f.startswith(("-I", "-D"))]
macros = [("LK_PY_VERSION", f'"{version()}"')] + ([("LK_HAVE_MPI", "1")] if lk["mpi"] else [])

setup(
    version=version(),
    cmdclass={"build_py": BuildPy},
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
