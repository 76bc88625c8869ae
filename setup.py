"""Builds the native CPU loops (kernels/native/native.c) with the package: one shared library per
x86-64 level, so that one install runs on any x86-64 CPU and kernels/native/__init__.py loads the best
level the CPU has at run time. Everything else is declared in pyproject.toml.

The libraries are optional: where no C compiler is found the install goes on without them,
and the clustered methods run the PyTorch reference on CPU (kernels.backend_for says which).
"""

import os
import platform

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# -ffast-math at compile time only (vectorised expf, reassociated sums): linking with it would
# add crtfastmath.o, which switches on flush-to-zero for the whole process when it loads.
COMPILE = ["-O3", "-ffast-math", "-fPIC", "-std=gnu11", "-Wno-psabi"]
# x86-64 micro-architecture levels: baseline (SSE2), v3 (AVX2 + FMA), v4 (AVX-512).
X86_LEVELS = {"x86_64": "x86-64", "x86_64_v3": "x86-64-v3", "x86_64_v4": "x86-64-v4"}


def native_extensions() -> list[Extension]:
    if platform.machine().lower() in ("x86_64", "amd64"):
        levels = {name: [f"-march={march}"] for name, march in X86_LEVELS.items()}
    else:
        levels = {"generic": []}
    return [
        Extension(
            f"kernels.native._native_{name}",
            sources=["kernels/native/native.c"],
            extra_compile_args=COMPILE + flags,
            libraries=["m"],  # glibc's vector expf
            optional=True,  # no compiler: install anyway, the reference runs
        )
        for name, flags in levels.items()
    ]


class BuildNative(build_ext):
    """One object folder per level: the levels compile the same source file."""

    def build_extension(self, ext: Extension) -> None:
        shared_temp = self.build_temp
        self.build_temp = os.path.join(shared_temp, ext.name)
        try:
            super().build_extension(ext)
        finally:
            self.build_temp = shared_temp


setup(ext_modules=native_extensions(), cmdclass={"build_ext": BuildNative})
