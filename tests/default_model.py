"""What the tests of the served default model need, with one policy: missing, the test skips
with a loud reason; under CI (CI set), where `make test` fetched and installed everything, it
fails instead."""

from __future__ import annotations

import os

import pytest


def require_default_model():
    """The default model's GGUF path. Where it was not fetched the test skips, loudly; under CI
    (CI set) it fails, since `make test` fetches it first."""
    from clusterserve.models.fetch import GGUF_SIZE, default_model_path

    path = default_model_path()
    if not (path.is_file() and path.stat().st_size == GGUF_SIZE):
        reason = f"DEFAULT MODEL NOT FETCHED: {path} is missing; run `clusterserve fetch` (make test does)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return path


def require_llama_cpp():
    """llama_cpp (llama-cpp-python, a test extra built from source); skips loudly where it is
    missing, fails under CI."""
    try:
        import llama_cpp
    except ImportError as error:
        reason = f"LLAMA.CPP NOT INSTALLED ({error}): pip install -e '.[test]' builds llama-cpp-python"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return llama_cpp
