"""Helpers of the service tests: real text, readiness polling, apps serving the fake encoder
(tests/fake_encoder.py, shared with the engine's tests)."""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
from fake_encoder import FakeEncoder, ManualClock, until
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from clusterserve.service.app import create_app
from clusterserve.service.settings import Settings

__all__ = ["FakeEncoder", "ManualClock", "until"]  # re-exported for the service tests

LICENSES = Path("/usr/share/common-licenses")
# Limits of the session app: small, so 413s and truncation cost no real inference.
REAL_LIMITS = dict(
    model="all-MiniLM-L6-v2",  # the plumbing model: small and fast; the default has tests of its own
    warmup=False,
    dtype="float32",  # the numbers the tests compare do not depend on the CPU's bf16 support
    max_input_tokens=1024,
    auto_threshold=256,
    max_client_batch_size=8,
    max_body_bytes=64 * 1024,
)


def license_text(chars: int | None = None) -> str:
    """Real English prose (the system's licence texts), optionally cut to `chars` characters."""
    names = ("GPL-3", "Apache-2.0", "MPL-2.0", "LGPL-2.1", "Artistic", "GFDL-1.3")
    paths = [LICENSES / name for name in names if (LICENSES / name).is_file()]
    if paths:
        text = "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in paths)
    else:  # not a Debian-like system: the project's own sources are real text too
        root = Path(__file__).resolve().parents[2]
        text = "\n\n".join(p.read_text(encoding="utf-8") for p in sorted(root.glob("*/*.py")))
    return text if chars is None else text[:chars]


def wait_ready(client: TestClient, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if client.get("/health/ready").status_code == 200:
            return
        time.sleep(0.05)
    raise TimeoutError(f"app not ready after {timeout_s} s: {client.get('/health/ready').json()}")


def scrape(text: str) -> dict[str, dict]:
    """family name -> {"type", "samples": {(sample name, frozenset(labels)): value}}."""
    families = {}
    for family in text_string_to_metric_families(text):
        samples = {(s.name, frozenset(s.labels.items())): s.value for s in family.samples}
        families[family.name] = {"type": family.type, "samples": samples}
    return families


def value(families, family: str, sample: str, **labels) -> float:
    return families[family]["samples"][(sample, frozenset(labels.items()))]


@asynccontextmanager
async def running(app, ready: bool = True):
    """The app's lifespan plus an httpx client talking to it in-process."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver", timeout=60) as http:
            if ready:
                with anyio.fail_after(120):
                    while (await http.get("/health/ready")).status_code != 200:
                        await anyio.sleep(0.01)
            yield http


def fake_app(encoder: FakeEncoder | None = None, **settings: Any):
    """(app, encoder): an app serving `encoder` (a fresh FakeEncoder by default)."""
    encoder = encoder or FakeEncoder()
    values = {"warmup": False, "method": "full", **settings}
    return create_app(Settings(**values), load=lambda _settings: encoder), encoder


def assert_error(response, status: int, param: str | None = None, says: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert "x-request-id" in response.headers
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["param"] == param
    if says is not None:
        assert says in error["message"], error["message"]
    return error
