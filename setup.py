"""The one import name and the native CPU loops; everything else is declared in pyproject.toml.

The repository's top-level folders (kernels/, models/, engine/, service/, bench/) install as sub-packages of
`clusterserve` (clusterserve/ holds the package itself and its command), so that nothing this
project installs is a generic top-level module that shadows another distribution's (Hugging
Face's `kernels`, an application's `models`). A folder that is absent (bench/ in the image) is
left out.

The native CPU loops (kernels/native/native.c) build with the package: one shared library per
x86-64 level, so that one install runs on any x86-64 CPU and kernels/native/__init__.py loads the best
level the CPU has at run time.

The libraries are optional: where no C compiler is found the install goes on without them,
and the clustered methods run the PyTorch reference on CPU (kernels.backend_for says which).
"""

import copy
import os
import platform

from setuptools import Extension, find_namespace_packages, setup
from setuptools.command.build_ext import build_ext

# -ffast-math at compile time only (vectorised expf, reassociated sums): linking with it would
# add crtfastmath.o, which switches on flush-to-zero for the whole process when it loads.
COMPILE = ["-O3", "-ffast-math", "-fPIC", "-std=gnu11", "-Wno-psabi"]
# x86-64 micro-architecture levels: baseline (SSE2), v3 (AVX2 + FMA), v4 (AVX-512).
X86_LEVELS = {"x86_64": "x86-64", "x86_64_v3": "x86-64-v3", "x86_64_v4": "x86-64-v4"}
NAME = "clusterserve"
SUBPACKAGES = ("kernels", "models", "engine", "service", "bench")


def package_layout() -> tuple[list[str], dict[str, str]]:
    """The packages under the one import name, and the folder each comes from."""
    here = os.path.dirname(os.path.abspath(__file__))
    packages, folders = [NAME], {NAME: NAME}
    for top in SUBPACKAGES:
        if not os.path.isfile(os.path.join(here, top, "__init__.py")):
            continue
        packages.append(f"{NAME}.{top}")
        folders[f"{NAME}.{top}"] = top
        # namespace discovery: the data folders (models/calibrations, bench/data) count as packages
        found = find_namespace_packages(os.path.join(here, top), exclude=["*__pycache__*"])
        packages += [f"{NAME}.{top}.{sub}" for sub in found]
    return packages, folders


def native_extensions() -> list[Extension]:
    if platform.machine().lower() in ("x86_64", "amd64"):
        levels = {name: [f"-march={march}"] for name, march in X86_LEVELS.items()}
    else:
        levels = {"generic": []}
    return [
        Extension(
            f"{NAME}.kernels.native._native_{name}",
            sources=["kernels/native/native.c"],
            extra_compile_args=COMPILE + flags,
            libraries=["m"],  # glibc's vector expf
            optional=True,  # no compiler: install anyway, the reference runs
        )
        for name, flags in levels.items()
    ]


class BuildNative(build_ext):
    """One object folder per level, as the levels compile the same source file; the levels build
    in parallel, one per core."""

    def finalize_options(self) -> None:
        if self.parallel is None:
            self.parallel = True  # distutils: as many as os.cpu_count()
        super().finalize_options()

    def build_extension(self, ext: Extension) -> None:
        own = copy.copy(self)  # parallel builds share `self`: each level sets its folder on a copy
        own.build_temp = os.path.join(self.build_temp, ext.name)
        build_ext.build_extension(own, ext)


PACKAGES, PACKAGE_DIR = package_layout()
setup(packages=PACKAGES, package_dir=PACKAGE_DIR, ext_modules=native_extensions(), cmdclass={"build_ext": BuildNative})
