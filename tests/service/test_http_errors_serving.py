"""The errors of a server that is busy, failing or past a deadline, in the JSON error model:
401, 429, 503 (not loaded, failed to load, out of memory) and 504, and a client that goes away
(499), against apps with a fake encoder that can be held busy or made to fail."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from service_helpers import FakeEncoder, assert_error, fake_app, running


@pytest.mark.anyio
async def test_401_api_key():
    app, _ = fake_app(api_key="s3cret")
    async with running(app) as http:
        body = {"input": "hello"}
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Basic s3cret"}):
            response = await http.post("/v1/embeddings", json=body, headers=headers)
            error = assert_error(response, 401, None, "API key")
            assert error["type"] == "authentication_error"
            assert response.headers["www-authenticate"] == "Bearer"
        assert (await http.post("/embed", json={"inputs": "a"})).status_code == 401
        assert (await http.post("/tokenize", json={"inputs": "a"})).status_code == 401
        for listing in ("/v1/models", "/v1/models/fake-encoder"):  # as OpenAI's, behind the key
            assert_error(await http.get(listing), 401, None, "API key")
            assert (await http.get(listing, headers={"authorization": "Bearer s3cret"})).status_code == 200, listing
        ok = await http.post("/v1/embeddings", json=body, headers={"authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        for open_path in ("/health/ready", "/health/live", "/metrics", "/info"):
            assert (await http.get(open_path)).status_code == 200, open_path


@pytest.mark.anyio
async def test_429_over_max_concurrent_requests():
    import anyio

    gate = threading.Event()
    app, encoder = fake_app(FakeEncoder(gate=gate), max_concurrent_requests=1)
    async with running(app) as http:
        async with anyio.create_task_group() as tasks:
            first = {}

            async def hold():
                first["response"] = await http.post("/v1/embeddings", json={"input": "first"})

            tasks.start_soon(hold)
            with anyio.fail_after(120):
                while not encoder.calls:  # the first request is running
                    await anyio.sleep(0.005)
            response = await http.post("/v1/embeddings", json={"input": "second"})
            error = assert_error(response, 429, None, "busy")
            assert error["type"] == "rate_limit_error"
            assert response.headers["retry-after"] == "1"
            gate.set()
        assert first["response"].status_code == 200
        # Capacity is back once the first answer went out.
        assert (await http.post("/v1/embeddings", json={"input": "third"})).status_code == 200


@pytest.mark.anyio
async def test_503_until_the_model_is_loaded():
    loaded = threading.Event()
    encoder = FakeEncoder()

    def slow_load(_settings):
        loaded.wait(120)
        return encoder

    from clusterserve.service.app import create_app
    from clusterserve.service.settings import Settings

    app = create_app(Settings(warmup=False), load=slow_load)
    async with running(app, ready=False) as http:
        assert (await http.get("/health/live")).status_code == 200
        for path in ("/health/ready", "/health"):
            assert_error(await http.get(path), 503, None, "loading")
        response = await http.post("/v1/embeddings", json={"input": "a"})
        assert_error(response, 503, None, "loading")
        assert response.headers["retry-after"] == "1"
        assert_error(await http.post("/tokenize", json={"inputs": "a"}), 503, None)
        assert_error(await http.get("/info"), 503, None)
        assert_error(await http.get("/v1/models"), 503, None, "loading")
        loaded.set()
        import anyio

        with anyio.fail_after(120):
            while (await http.get("/health/ready")).status_code != 200:
                await anyio.sleep(0.01)
        assert (await http.post("/v1/embeddings", json={"input": "a"})).status_code == 200


@pytest.mark.anyio
async def test_503_when_the_model_fails_to_load():
    from clusterserve.service.app import create_app
    from clusterserve.service.settings import Settings

    def broken(_settings):
        raise FileNotFoundError("no config.json in /nowhere")

    app = create_app(Settings(warmup=False), load=broken)
    async with running(app, ready=False) as http:
        import anyio

        with anyio.fail_after(120):
            while (await http.get("/health/live")).status_code == 200:
                await anyio.sleep(0.01)
        assert_error(await http.get("/health/live"), 503, None, "no config.json")
        assert_error(await http.get("/health/ready"), 503, None, "failed to load")
        assert_error(await http.post("/embed", json={"inputs": "a"}), 503, None, "failed to load")


@pytest.mark.anyio
@pytest.mark.parametrize("fault", [MemoryError(), torch.OutOfMemoryError("CUDA out of memory")])
async def test_503_out_of_memory_and_the_server_keeps_serving(fault):
    app, encoder = fake_app(FakeEncoder(fail=fault))
    async with running(app) as http:
        response = await http.post("/v1/embeddings", json={"input": ["hello world", "abc"]})
        error = assert_error(response, 503, None, "out of memory")
        # Split down to single inputs; the one tried first (the lighter, "abc": 3 tokens) failed alone.
        assert "input of 3 tokens" in error["message"]
        assert response.headers["retry-after"] == "1"
        assert [len(call["inputs"]) for call in encoder.calls] == [2, 1]  # its batch-mate was skipped
        encoder.fail = None
        assert (await http.post("/v1/embeddings", json={"input": "hello world"})).status_code == 200
        assert (await http.get("/health/ready")).status_code == 200
        metrics = (await http.get("/metrics")).text
        assert 'clusterserve_request_failures_total{reason="out_of_memory"} 1.0' in metrics


@pytest.mark.anyio
async def test_out_of_memory_mid_batch_splits_and_retries_down_to_the_input_that_does_not_fit():
    import anyio

    gate = threading.Event()
    # Out of memory above 20 tokens: the eight short inputs together (40 tokens), or the long one alone.
    encoder = FakeEncoder(gate=gate, fail=torch.OutOfMemoryError("CUDA out of memory"), fail_above_tokens=20)
    app, encoder = fake_app(encoder)
    shorts = [f"short text {i}" for i in range(8)]  # 5 tokens each
    long = " ".join(["word"] * 48)  # 50 tokens
    async with running(app) as http:
        responses = {}

        async def post(text):
            responses[text] = await http.post("/v1/embeddings", json={"input": text})

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(post, "hold")  # holds the worker while the others queue
            with anyio.fail_after(120):
                while not encoder.calls:
                    await anyio.sleep(0.005)
            for text in [*shorts[:4], long, *shorts[4:]]:
                tasks.start_soon(post, text)
            with anyio.fail_after(120):
                while app.state.service.scheduler.snapshot()["pending_items"] < 9:
                    await anyio.sleep(0.005)
            gate.set()

        for text in ["hold", *shorts]:
            assert responses[text].status_code == 200, responses[text].text
            assert responses[text].json()["data"][0]["embedding"]
        error = assert_error(responses[long], 503, None, "input of 50 tokens")
        assert error["type"] == "service_unavailable"
        # The hold; the eight short inputs (the long one is no batch-mate of theirs: unlike work),
        # which failed and were retried in halves that fit; the long one alone, which failed.
        sizes = [len(call["inputs"]) for call in encoder.calls]
        assert sizes == [1, 8, 4, 4, 1], sizes
        # Every short input was embedded exactly once, in a batch that fit.
        succeeded = [ids for call in encoder.calls[2:] for ids in call["inputs"]
                     if sum(map(len, call["inputs"])) <= 20]
        assert sorted(map(tuple, succeeded)) == sorted(tuple(t.ids) for t in encoder.tokenize(shorts))

        # The server keeps serving, even long inputs that fit alone.
        encoder.fail_above_tokens = 60
        assert (await http.post("/v1/embeddings", json={"input": long})).status_code == 200
        assert (await http.get("/health/ready")).status_code == 200
        metrics = (await http.get("/metrics")).text
        assert 'clusterserve_request_failures_total{reason="out_of_memory"} 1.0' in metrics


@pytest.mark.anyio
async def test_504_deadline_and_expired_work_is_never_started():
    import anyio

    gate = threading.Event()
    # Long enough for the first request to reach the worker on a slow, loaded machine.
    app, encoder = fake_app(FakeEncoder(gate=gate), request_timeout_s=2)
    async with running(app) as http:
        async with anyio.create_task_group() as tasks:
            responses = {}

            async def post(name):
                responses[name] = await http.post("/v1/embeddings", json={"input": name})

            tasks.start_soon(post, "running")
            with anyio.fail_after(120):
                while not encoder.calls:
                    await anyio.sleep(0.005)
            tasks.start_soon(post, "queued")
            with anyio.fail_after(120):  # both deadlines pass while the worker is held
                while len(responses) < 2:
                    await anyio.sleep(0.01)
            gate.set()
        for name in ("running", "queued"):
            error = assert_error(responses[name], 504, None, "deadline of 2 s")
            assert error["type"] == "timeout_error"
        # The queued request expired before the worker reached it: it never ran.
        with anyio.fail_after(120):
            while (await http.post("/v1/embeddings", json={"input": "later"})).status_code != 200:
                await anyio.sleep(0.01)
        ran = [call["inputs"] for call in encoder.calls]
        running_ids, queued_ids = (t.ids for t in encoder.tokenize(["running", "queued"]))
        assert ran[0] == [running_ids]
        assert [queued_ids] not in ran


@pytest.mark.anyio
async def test_deadline_header_shortens_but_never_extends_the_server_deadline():
    import anyio

    gate = threading.Event()
    app, encoder = fake_app(FakeEncoder(gate=gate), request_timeout_s=3)
    async with running(app) as http:
        async with anyio.create_task_group() as tasks:
            responses = {}

            async def post(name, timeout_ms):
                headers = {"x-request-timeout-ms": timeout_ms}
                responses[name] = await http.post("/v1/embeddings", json={"input": name}, headers=headers)

            tasks.start_soon(post, "running", "1500")
            with anyio.fail_after(120):
                while not encoder.calls:
                    await anyio.sleep(0.005)
            tasks.start_soon(post, "queued", "100000")  # asks for 100 s: capped at the server's 3 s
            with anyio.fail_after(120):  # both deadlines pass while the worker is held
                while len(responses) < 2:
                    await anyio.sleep(0.01)
            gate.set()
        assert_error(responses["running"], 504, None, "deadline of 1.5 s")
        assert_error(responses["queued"], 504, None, "deadline of 3 s")
        ran = [call["inputs"] for call in encoder.calls]
        assert [encoder.tokenize(["queued"])[0].ids] not in ran  # expired in the queue: never run

        # A deadline already passed on arrival is answered at once and never queued.
        calls = len(encoder.calls)
        response = await http.post("/v1/embeddings", json={"input": "late"}, headers={"x-request-timeout-ms": "0.001"})
        assert_error(response, 504, None, "deadline")
        assert len(encoder.calls) == calls
        for bad in ("0", "-5", "soon", "nan", "inf"):
            response = await http.post("/v1/embeddings", json={"input": "a"}, headers={"x-request-timeout-ms": bad})
            assert_error(response, 422, "x-request-timeout-ms", "milliseconds")
        ok = await http.post("/embed", json={"inputs": "a"}, headers={"x-request-timeout-ms": "5000"})
        assert ok.status_code == 200


@pytest.mark.anyio
async def test_a_client_that_disconnects_before_its_batch_runs_is_dropped_and_counted():

    import anyio

    gate = threading.Event()
    app, encoder = fake_app(FakeEncoder(gate=gate))
    async with running(app) as http:
        held = {}
        body = json.dumps({"input": "gone away"}).encode()
        incoming = [{"type": "http.request", "body": body, "more_body": False}]
        leave, answered, sent = anyio.Event(), anyio.Event(), []

        async def receive():
            if incoming:
                return incoming.pop()
            await leave.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": "/v1/embeddings", "raw_path": b"/v1/embeddings", "query_string": b"",
            "root_path": "", "client": ("127.0.0.1", 40000), "server": ("testserver", 80),
            "headers": [(b"host", b"testserver"), (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode())],
        }

        async def hold():
            held["response"] = await http.post("/v1/embeddings", json={"input": "hold"})

        async def leaving_client():
            await app(scope, receive, send)
            answered.set()

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(hold)
            with anyio.fail_after(120):
                while not encoder.calls:
                    await anyio.sleep(0.005)
            tasks.start_soon(leaving_client)
            scheduler = app.state.service.scheduler
            with anyio.fail_after(120):
                while scheduler.snapshot()["pending_items"] < 1:  # queued behind the held batch
                    await anyio.sleep(0.005)
            leave.set()
            with anyio.fail_after(120):
                await answered.wait()
            assert scheduler.snapshot()["admitted"] == 1  # only the held request is still in
            gate.set()
        assert held["response"].status_code == 200
        assert sent[0]["status"] == 499
        gone_ids = encoder.tokenize(["gone away"])[0].ids
        assert all(gone_ids not in call["inputs"] for call in encoder.calls)  # never run
        assert (await http.post("/v1/embeddings", json={"input": "next"})).status_code == 200
        metrics = (await http.get("/metrics")).text
        assert 'clusterserve_request_failures_total{reason="disconnected"} 1.0' in metrics
