"""Makes tests/ importable (pytest puts a conftest's folder on sys.path), so every test folder
can share `server_process`.

Without CUDA, Triton's kernels run under its interpreter. Triton reads TRITON_INTERPRET when it
decorates a kernel, so it is set here, before any test module imports `kernels`: a module
collected early (tests/bench, tests/gpu) would otherwise fix every kernel as compiled-only for
the whole session. Tests that compile for a GPU target do so in a subprocess without it.

The checkout's root is taken off sys.path (`python -m pytest` puts it there): its folders are
`clusterserve`'s sub-packages, never top-level modules, and a root-level `kernels/` would shadow
Hugging Face's `kernels`, which transformers imports. The project is imported as installed
(`pip install -e .`), under its one name.

The longest test files are collected first. `make test` runs them on two workers, a whole
file to a worker in collection order (pytest-xdist's loadfile), so the longest start first and
the short ones fill in around them (tests/collection_order.py)."""

import os
import sys
from pathlib import Path

import torch
from collection_order import LONGEST_FIRST

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != ROOT]

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """The files of LONGEST_FIRST first, in its order; the rest as collected (a stable sort)."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.relative_to(ROOT).as_posix(), len(rank)))
