"""One request cannot stall the server: against a real server process, a heavy but legal
request past its deadline stops within a layer, small requests are served while it runs and
after its 504, and a request over the work budget is refused before it runs. Layers and
answers are counted; nothing is timed."""

from __future__ import annotations

import threading

import httpx
import pytest
from server_process import running_server
from service_helpers import license_text, scrape, value

HEAVY_TOKENS = 30000


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


def test_a_heavy_request_past_its_deadline_stops_and_small_ones_are_served(base):
    document = license_text() * 3
    layers_before, stops_before, _ = layers_and_stops(base)
    small_layers = 0
    answers: dict[str, httpx.Response] = {}

    def heavy() -> None:
        body = {"input": document, "truncate": True, "attention": {"method": "full"}}
        with httpx.Client(timeout=600) as http:
            tokens = http.post(f"{base}/tokenize", json={"inputs": document}).json()[0]
            assert len(tokens) > HEAVY_TOKENS
            # Its own deadline of 3 s (x-request-timeout-ms); every other request keeps the server's.
            answers["heavy"] = http.post(
                f"{base}/v1/embeddings", json={**body, "input": document[: tokens[HEAVY_TOKENS]["stop"]]},
                headers={"x-request-timeout-ms": "3000"},
            )  # fmt: skip

    thread = threading.Thread(target=heavy)
    thread.start()
    with httpx.Client(timeout=600) as http:
        while layers_and_stops(base)[2] == 0 and thread.is_alive():  # until the heavy batch runs
            pass
        during = http.post(f"{base}/v1/embeddings", json={"input": "hello world"})
        small_layers += 6
        thread.join(600)
        assert answers["heavy"].status_code == 504, answers["heavy"].text
        after = http.post(f"{base}/v1/embeddings", json={"input": "hello world"})
        small_layers += 6
        assert during.status_code == after.status_code == 200
        assert during.json()["data"][0]["embedding"] == after.json()["data"][0]["embedding"]
        for _ in range(6000):  # the worker notices at the heavy batch's next layer boundary
            layers, stops, running = layers_and_stops(base)
            if stops > stops_before and running == 0:
                break
            threading.Event().wait(0.1)
    heavy_layers = layers - layers_before - small_layers
    assert stops == stops_before + 1
    assert 0 <= heavy_layers < 6  # the default model has 6 layers: it stopped part-way


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
