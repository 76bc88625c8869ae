"""Makes tests/ importable (pytest puts a conftest's folder on sys.path), so every test folder
can share `server_process`.

Without CUDA, Triton's kernels run under its interpreter. Triton reads TRITON_INTERPRET when it
decorates a kernel, so it is set here, before any test module imports `kernels`: a module
collected early (tests/bench, tests/gpu) would otherwise fix every kernel as compiled-only for
the whole session. Tests that compile for a GPU target do so in a subprocess without it."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

