"""The real server, started as users start it (`clusterserve serve`) on a free loopback port,
driven with the official `openai` client and with plain HTTP."""

from __future__ import annotations

import base64
import json
import signal
import socket
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import torch
from server_process import running_server
from service_helpers import license_text, scrape, value

from clusterserve.kernels import backend_for
from clusterserve.models.runtime.precision import DTYPES, cpu_has_bf16

METHODS = ["full", "clustered", "i-clustered", "smyrf"]
DOCUMENT = license_text(17000)  # real prose, ~3,300 tokens


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    with running_server(log_path, "--drain-timeout-s", "120", ready_timeout_s=600) as (base, process):
        yield {"base": base, "process": process, "log": log_path}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_openai_client_base64_default_and_float_agree(client):
    texts = ["The quick brown fox jumps over the lazy dog.", "Clustered attention for long documents."]
    default = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts)  # asks for base64
    as_float = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts, encoding_format="float")
    assert default.model == "all-MiniLM-L6-v2"
    assert [d.index for d in default.data] == [0, 1]
    a = np.array([d.embedding for d in default.data], dtype=np.float32)
    b = np.array([d.embedding for d in as_float.data], dtype=np.float32)
    assert a.shape == (2, 384)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1.0, atol=1e-5)
    assert default.usage.prompt_tokens == default.usage.total_tokens > 10


def test_openai_client_lists_and_retrieves_the_served_model(client):
    (listed,) = client.models.list().data
    assert (listed.id, listed.object, listed.owned_by) == ("all-MiniLM-L6-v2", "model", "clusterserve")
    assert client.models.retrieve("all-minilm") == listed  # Ollama's name for it
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.models.retrieve("text-embedding-3-small")


def test_openai_client_long_document_each_method(client):
    vectors = {}
    for method in METHODS:
        raw = client.embeddings.with_raw_response.create(
            model="all-MiniLM-L6-v2", input=DOCUMENT, extra_body={"attention": {"method": method}}
        )
        response = raw.parse()
        echo = json.loads(raw.headers["x-attention"])
        assert echo["method"] == method
        assert response.model_extra["attention"] == echo
        assert response.usage.prompt_tokens > 3000
        assert int(raw.headers["x-input-tokens"]) == response.usage.prompt_tokens
        for header in ("x-request-id", "x-queue-time-ms", "x-inference-time-ms", "x-total-time-ms", "x-peak-memory-bytes"):
            assert header in raw.headers, header
        vectors[method] = np.array(response.data[0].embedding, dtype=np.float32)
        assert vectors[method].shape == (384,)
        assert abs(np.linalg.norm(vectors[method]) - 1.0) < 1e-5
    # The approximations are of the same document: close to exact attention, not equal to it.
    for method in METHODS[1:]:
        cosine = float(vectors[method] @ vectors["full"])
        assert 0.5 < cosine < 1.0 - 1e-7, (method, cosine)


def test_plain_http(server):
    base = server["base"]
    with httpx.Client(base_url=base, timeout=300) as http:
        assert http.get("/health/live").json() == {"status": "live"}
        info = http.get("/info").json()
        assert info["extended_positions"] == 32768 and info["native_positions"] == 512

        body = {"inputs": [DOCUMENT, "short"], "attention": {"method": "auto"}}
        response = http.post("/embed", json=body)
        assert response.status_code == 200
        assert np.array(response.json()).shape == (2, 384)
        echo = json.loads(response.headers["x-attention"])
        # auto aims at the server's 0.98 through the shipped CPU table: an approximation for
        # the document, exact attention for the short text.
        assert echo["method"] == "auto" and echo["target_fidelity"] == 0.98
        assert echo["inputs"][0]["method"] in ("clustered", "i-clustered") and echo["inputs"][1]["method"] == "full"

        raw = http.post("/v1/embeddings", json={"input": "hello", "encoding_format": "base64"}).json()
        assert np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4").shape == (384,)

        error = http.post("/v1/embeddings", json={"input": "a", "attention": {"topk": 0}})
        assert error.status_code == 422 and error.json()["error"]["param"] == "attention.topk"
        assert http.post("/v1/embeddings", content=b"{", headers={"content-type": "application/json"}).status_code == 400

        metrics = http.get("/metrics").text
        assert 'clusterserve_requests_total{code="200",endpoint="/embed",method="auto"} 1.0' in metrics
        # The default dtype is "auto": float32 on a CPU without bf16 matrix instructions, else
        # what the server's own start-up measurement chose (bfloat16 where it is fast); /info,
        # the metric and the backend agree on it.
        assert info["dtype"] in (("float32", "bfloat16") if cpu_has_bf16() else ("float32",))
        dtype, backend = info["dtype"], info["backend"]
        assert backend == backend_for(torch.device("cpu"), DTYPES[dtype])
        label = f'clusterserve_build_info{{backend="{backend}",device="cpu",dtype="{dtype}",model="all-MiniLM-L6-v2"'
        assert label in metrics


def test_a_client_that_hangs_up_while_queued_is_dropped_unrun_and_counted(server):
    """A real socket closed while its request waits behind a busy worker: the server notices,
    never runs its input (no second batch of exact attention), counts it, and keeps serving.
    The queued request is much more work than what is left of the busy one (exact attention on
    ~18k tokens), so the scheduler keeps it queued until the busy batch is done: the window in
    which it is seen queued is the busy batch's whole run, not one layer."""
    base = server["base"]
    host, port = base.removeprefix("http://").split(":")

    def full_batches(metrics: str) -> float:
        family = "clusterserve_inference_duration_seconds"
        return value(scrape(metrics), family, family + "_count", method="full")

    def disconnected(metrics: str) -> float:
        family = "clusterserve_request_failures"
        return value(scrape(metrics), family, family + "_total", reason="disconnected")

    with httpx.Client(base_url=base, timeout=300) as http:
        before = http.get("/metrics").text
        busy = {"inputs": [DOCUMENT] * 4, "attention": {"method": "full"}}  # ~13k tokens: seconds of work
        worker = threading.Thread(target=lambda: http.post("/embed", json=busy))
        worker.start()
        wait_for_gauges(http, inflight=1, queued=0)  # the busy batch is running
        heavy = {"input": license_text(90000), "truncate": True, "attention": {"method": "full"}}
        body = json.dumps(heavy).encode()
        with socket.create_connection((host, int(port))) as sock:
            head = f"POST /v1/embeddings HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            sock.sendall(head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            wait_for_gauges(http, inflight=2, queued=1)  # queued behind the busy batch
        worker.join()
        deadline = time.monotonic() + 120
        while disconnected(http.get("/metrics").text) < disconnected(before) + 1:
            assert time.monotonic() < deadline, "the hang-up was never counted"
            time.sleep(0.1)
        after = http.get("/metrics").text
        assert full_batches(after) == full_batches(before) + 1  # the busy request's batch alone
        assert http.get("/health/ready").status_code == 200


def wait_for_gauges(http: httpx.Client, inflight: int, queued: int) -> None:
    """Poll /metrics until the in-flight and queued request gauges read these values."""
    wanted = (f"clusterserve_inflight_requests {inflight:.1f}", f"clusterserve_queue_depth {queued:.1f}")
    deadline = time.monotonic() + 120
    while not all(line in http.get("/metrics").text.splitlines() for line in wanted):
        assert time.monotonic() < deadline, f"never reached {wanted}"
        time.sleep(0.02)


def test_sigterm_during_traffic_finishes_in_flight_requests_and_exits_0(server):
    process, base = server["process"], server["base"]
    results: list[httpx.Response | Exception] = []

    def slow_request() -> None:
        try:  # a ~3.3k-token document with exact attention: seconds of CPU work
            body = {"inputs": DOCUMENT, "attention": {"method": "full"}}
            results.append(httpx.post(f"{base}/embed", json=body, timeout=300))
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            results.append(exc)

    threads = [threading.Thread(target=slow_request) for _ in range(3)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 120
    while "clusterserve_inflight_requests 3.0" not in httpx.get(f"{base}/metrics", timeout=60).text:
        assert time.monotonic() < deadline, "the slow requests never got in flight"
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)
    # Once the signal is handled a new request is refused: the listening socket is closed, or
    # 503 while draining. A request that got in before that is served (a loaded machine may
    # take a while to handle the signal), so ask until one is refused.
    deadline = time.monotonic() + 120
    while True:
        try:
            late = httpx.post(f"{base}/embed", json={"inputs": "late"}, timeout=300)
        except httpx.TransportError:
            break
        if late.status_code == 503:
            break
        assert late.status_code == 200 and time.monotonic() < deadline, late.text
        time.sleep(0.1)
    for thread in threads:
        thread.join(300)
    assert len(results) == 3
    for result in results:
        assert isinstance(result, httpx.Response), result
        assert result.status_code == 200, result.text + server["log"].read_text()[-3000:]
        assert np.array(result.json()).shape == (1, 384)
    assert process.wait(300) == 0, server["log"].read_text()
    log = server["log"].read_text()
    assert "Traceback" not in log, log
