"""Fixtures for the service tests: the real app (embedded all-MiniLM-L6-v2) in-process,
loaded once per session with small limits so that every limit is cheap to hit."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from service_helpers import REAL_LIMITS, wait_ready

from clusterserve.service.app import create_app
from clusterserve.service.settings import Settings


@pytest.fixture(scope="session")
def client() -> TestClient:
    app = create_app(Settings(**REAL_LIMITS))
    with TestClient(app) as test_client:
        wait_ready(test_client)
        yield test_client


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"




def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "load: a bounded load test against a real server process (under ~60 s)")
