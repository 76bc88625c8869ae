"""One request cannot stall the server: a heavy but legal request past its deadline stops
within a layer, small requests are served while it runs and after its 504 (in process, on a
gated encoder and a clock the test moves), and a request over the work budget is refused
before it runs (against a real server process). Layers and answers are counted; nothing is
timed."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from server_process import running_server
from service_helpers import FakeEncoder, ManualClock, fake_app, license_text, running, scrape, until, value


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    with running_server(log_path, ready_timeout_s=600) as (url, _process):
        yield url


def layers_and_stops(base: str) -> tuple[float, float, float]:
    families = scrape(httpx.get(f"{base}/metrics").text)
    return (
        value(families, "clusterserve_layers", "clusterserve_layers_total"),
        value(families, "clusterserve_stopped_inputs", "clusterserve_stopped_inputs_total", reason="deadline"),
        value(families, "clusterserve_running_batches", "clusterserve_running_batches"),
    )


@pytest.mark.anyio
async def test_a_heavy_request_past_its_deadline_stops_and_small_ones_are_served():
    # In process, on a gated encoder and a scheduler clock the test moves: layers are
    # released one by one, and the heavy request's deadline passes when the clock says so.
    gate = threading.Semaphore(0)
    app, encoder = fake_app(FakeEncoder(layers=6, layer_gate=gate))
    async with running(app) as http:
        scheduler = app.state.service.scheduler
        clock = ManualClock(time.monotonic())
        scheduler.clock = clock
        body = {"input": "heavy " * 200, "truncate": True}
        heavy = asyncio.ensure_future(http.post("/v1/embeddings", json=body, headers={"x-request-timeout-ms": "60000"}))
        gate.release(2)
        await until(lambda: len(encoder.layers_run) == 2)
        small = asyncio.ensure_future(http.post("/v1/embeddings", json={"input": "hello world"}))
        await until(lambda: scheduler.snapshot()["pending_items"] == 1)
        gate.release(7)  # the heavy one's third layer (under way), then the small one's 6
        during = await small
        clock.now += 120  # past the heavy request's deadline, while its fourth layer waits
        gate.release(1)
        answer = await heavy
        after = asyncio.ensure_future(http.post("/v1/embeddings", json={"input": "hello world"}))
        gate.release(6)
        after = await after
        families = scrape((await http.get("/metrics")).text)
    assert answer.status_code == 504, answer.text
    assert during.status_code == after.status_code == 200
    assert during.json()["data"][0]["embedding"] == after.json()["data"][0]["embedding"]
    heavy_layers = sum(1 for step in encoder.layers_run if len(step[0]) > 32)
    assert heavy_layers == 3  # it stopped at the first layer boundary after its deadline passed
    assert value(families, "clusterserve_stopped_inputs", "clusterserve_stopped_inputs_total", reason="deadline") == 1.0


def test_a_request_over_the_work_budget_is_refused_at_once(base):
    heavy = {"method": "i-clustered", "clusters": 4096, "topk": 4096, "iterations": 100, "refine": 100}
    with httpx.Client(timeout=600) as http:
        layers_before = layers_and_stops(base)[0]
        response = http.post(f"{base}/v1/embeddings", json={"input": license_text(60000), "truncate": True, "attention": heavy})
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["param"] == "attention.clusters" and "can be at most" in error["message"]
        assert layers_and_stops(base)[0] == layers_before  # nothing ran
        assert http.post(f"{base}/v1/embeddings", json={"input": "hello world"}).status_code == 200
