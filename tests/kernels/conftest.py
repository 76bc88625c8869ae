"""Fixtures shared by the kernel tests."""

import pytest

from clusterserve.kernels import native


@pytest.fixture
def reloaded():
    """native.library() forgets the loaded library now and after the test (for tests that set
    CLUSTERSERVE_NATIVE_ISA or hide the built libraries)."""
    native.library.cache_clear()
    yield
    native.library.cache_clear()
