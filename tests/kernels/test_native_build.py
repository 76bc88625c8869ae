"""An install that can build the native CPU loops has them: a missing build fails here
instead of every native test skipping."""

from __future__ import annotations

import shlex
import shutil
import sysconfig

import pytest
import torch

from clusterserve.kernels import backend_for, native


def _c_compiler() -> str | None:
    command = shlex.split(sysconfig.get_config_var("CC") or "cc")
    return shutil.which(command[0]) if command else None


def test_the_native_loops_are_built_where_a_c_compiler_is():
    if _c_compiler() is None:
        pytest.skip("no C compiler: the install builds no native loops, and the reference runs on CPU")
    assert native.library() is not None, (
        "a C compiler is installed but no native library loads: reinstall (pip install -e .) and read the build log"
    )
    assert backend_for("cpu", torch.float32) == "native"
