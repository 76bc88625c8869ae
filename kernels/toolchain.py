"""What the kernels need from the machine beyond Python packages, checked in one place.

- Triton compiles a small C launcher (a Python extension) for each kernel signature the first
  time it runs, with the compiler in $CC, else gcc, else clang, against Python's headers.
- The native CPU loops are compiled by `pip install` (setup.py); without them the CPU runs
  the reference.

    python -m clusterserve.kernels.toolchain      # exit 1 and say what is missing

The Docker build runs it after installing the package, so an image that could not serve its
own kernels fails to build.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from clusterserve.kernels import native

# A Python extension as small as Triton's launcher is simple: it includes Python.h.
_LAUNCHER_PROBE = '#include <Python.h>\nstatic PyObject *probe(PyObject *self, PyObject *args) { Py_RETURN_NONE; }\n'


def c_compiler() -> str | None:
    """The compiler Triton would use: $CC, else gcc, else clang on the PATH."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")


def problems() -> list[str]:
    """What is missing for the Triton launcher and the native loops; empty when nothing is."""
    found = []
    compiler = c_compiler()
    if compiler is None:
        found.append("no C compiler (CC, gcc or clang): Triton cannot build its kernel launcher")
    else:
        with tempfile.TemporaryDirectory() as folder:
            source = Path(folder) / "probe.c"
            source.write_text(_LAUNCHER_PROBE)
            include = sysconfig.get_paths()["include"]
            command = [compiler, "-shared", "-fPIC", f"-I{include}", "-o", str(Path(folder) / "probe.so"), str(source)]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                found.append(f"{compiler} cannot build a Python extension as Triton's launcher: {result.stderr.strip()[-300:]}")
    if not native.available():
        found.append("the native CPU loops were not built with the package (kernels/native/_native_*.so)")
    return found


def main() -> int:
    missing = problems()
    for line in missing:
        print(f"missing: {line}", file=sys.stderr)
    if not missing:
        print(f"toolchain: C compiler {c_compiler()}, native loops {native.level()}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
