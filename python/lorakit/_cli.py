"""The `lorakit` command that `pip install` puts on PATH (and `python -m
lorakit`): replaces this process with the C CLI shipped in the package
(lorakit/lorakit-cli), so it is the C CLI: the same options, output,
signals and exit codes. The CLI finds the family tables beside itself
(lorakit/lorakit-families)."""
import os
import sys


def cli_path():
    """The C CLI inside this package."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "lorakit-cli")


def main(argv=None):
    exe = cli_path()
    args = sys.argv[1:] if argv is None else list(argv)
    if not os.access(exe, os.X_OK):
        sys.stderr.write(f"lorakit: {exe}: the C CLI is not in this lorakit package (a build tree's package has "
                         "none: run build/lorakit, or install the package with pip)\n")
        return 127  # what a shell answers for a command it cannot run
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(exe, [exe, *args])
    return 127  # not reached: execv replaces the process or raises


if __name__ == "__main__":
    sys.exit(main())
