"""Every error status of DESIGN.md, in the JSON error model, and never a 500 for a bad request.

400, 413, 422, 404 and 405 run against the real app; 401, 429, 503 and 504 against apps
with a fake encoder that can be held busy or made to fail.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch
from service_helpers import FakeEncoder, fake_app, license_text, running

LONG = license_text(12000)  # ~2500 tokens; the session app's limit is 1024


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


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/embeddings", {"input": ""}, "input"),
        ("/v1/embeddings", {"input": []}, "input"),
        ("/v1/embeddings", {"input": ["a", ""]}, "input[1]"),
        ("/v1/embeddings", {"input": [[101, 102], []]}, "input[1]"),
        ("/embed", {"inputs": ""}, "inputs"),
        ("/embed", {"inputs": []}, "inputs"),
        ("/tokenize", {"inputs": []}, "inputs"),
    ],
)
def test_400_empty_input(client, path, body, param):
    error = assert_error(client.post(path, json=body), 400, param, "empty")
    assert error["type"] == "invalid_request_error"
    # The OpenAPI document declares it invalid too (minLength / minItems): it tells the truth.
    schema = request_schema(client, path)
    field = next(iter(body))
    assert not schema.is_valid(body) and schema.is_valid({field: ["a"]})


def request_schema(client, path: str):
    """A JSON Schema validator of the route's request body, as /openapi.json declares it."""
    import jsonschema

    document = client.get("/openapi.json").json()
    ref = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    return jsonschema.Draft202012Validator({"$ref": ref, "components": document["components"]})


@pytest.mark.parametrize(
    "path, raw",
    [
        ("/v1/embeddings", '{"input": "\\udbc6"}'),
        ("/v1/embeddings", '{"input": ["ok", "a\\udc0db"]}'),
        ("/embed", '{"inputs": "\\udbc6"}'),
        ("/embed", '{"inputs": ["\\udbc6\\udc0d"], "chunking": {"size": 64}}'),
        ("/embed", '{"inputs": ["   "], "chunking": {"size": 64, "late": false}}'),
        ("/tokenize", '{"inputs": "\\udbc6"}'),
    ],
)
def test_text_the_tokenizer_drops_or_refuses_is_still_text(client, path, raw):
    # A lone surrogate escape is read as U+FFFD; a private-use character or blanks have no
    # token of their own, and a chunked one is one chunk: each gets an answer, not an error.
    response = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text
    lone = client.post(path, content=raw.replace("\\udbc6", "\\ufffd").replace("\\udc0d", "\\ufffd"),
                       headers={"content-type": "application/json"})
    if "\\udbc6\\udc0d" not in raw:  # a pair is one character (U+F180D), not two U+FFFD
        assert response.json() == lone.json()


def test_tokenize_answers_an_empty_text_with_its_special_tokens_and_the_schema_allows_it(client):
    for body in ({"inputs": ""}, {"inputs": ["a", ""]}):
        assert request_schema(client, "/tokenize").is_valid(body)
        response = client.post("/tokenize", json=body)
        assert response.status_code == 200 and [t["special"] for t in response.json()[-1]] == [True, True]


@pytest.mark.parametrize(
    "path, body",
    [("/v1/embeddings", b'{"input": "a",'), ("/embed", b"{inputs: 1}"), ("/tokenize", b"\xff\xfe")],
)
def test_400_malformed_json(client, path, body):
    response = client.post(path, content=body, headers={"content-type": "application/json"})
    assert_error(response, 400, None, "not valid JSON")


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain", None])
def test_a_json_body_is_read_whatever_its_content_type_says(client, content_type):
    """`curl -d` without -H sends a form's content type: the body is still the request."""
    headers = {"content-type": content_type} if content_type else {}
    for path, body in (("/v1/embeddings", {"input": "a"}), ("/embed", {"inputs": "a"}), ("/", {"inputs": "a"}),
                       ("/embed_all", {"inputs": "a"}), ("/tokenize", {"inputs": "a"})):  # fmt: skip
        response = client.post(path, content=json.dumps(body), headers=headers)
        assert response.status_code == 200, (path, response.text)
    assert_error(client.post("/embed", content=b"inputs=a", headers=headers), 400, None, "not valid JSON")


@pytest.mark.parametrize(
    "body, param, says",
    [
        ({"input": "a", "attention": {"clusters": 0}}, "attention.clusters", "greater than or equal to 1"),
        ({"input": "a", "attention": {"bits": 64}}, "attention.bits", "less than or equal to 63"),
        ({"input": "a", "attention": {"bits": 0, "iterations": 2}}, "attention.iterations", "need LSH codes"),
        ({"input": "a", "attention": {"topk": "many"}}, "attention.topk", None),
        ({"input": "a", "attention": {"seed": True}}, "attention.seed", None),
        ({"input": "a", "attention": {"method": "linear"}}, "attention.method", "i-clustered"),
        ({"input": "a", "attention": {"cluster": 8}}, "attention.cluster", None),
        ({"input": "a", "attention": {"method": "smyrf", "target_fidelity": 0.99}}, "attention.target_fidelity", "auto"),
        ({"input": "a", "attention": 5}, "attention", None),
        ({"input": "a", "encoding_format": "hex"}, "encoding_format", None),
        ({"input": "a", "dimensions": 0}, "dimensions", None),
        ({"input": "a", "dimensions": 385}, "dimensions", "[1, 384]"),
        ({"input": "a", "truncate": "yes"}, "truncate", None),
        ({"input": 42}, "input", "list of token ids"),
        ({"input": [1.5, 2]}, "input", "list of token ids"),
        ({"input": ["a", 1]}, "input", "input[0] is a string but input[1] is a token id"),
        ({"input": ["a", "b", None]}, "input", "input[2] is null"),
        ({"input": [[101, 102], [101, "a"]]}, "input", "input[0] is a token-id list but input[1] is a list"),
        ({"input": [[101, 10**9]]}, "input[0]", "token ids must be in [0, 30522)"),
        ({"input": [-1]}, "input", "token ids must be in"),
        ({}, "input", "required"),
        ({"input": "a", "temperature": 1}, "temperature", None),
    ],
)
def test_422_names_the_field_openai(client, body, param, says):
    error = assert_error(client.post("/v1/embeddings", json=body), 422, param, says)
    assert error["message"].startswith(param)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/embed", {"inputs": "a", "truncation_direction": "up"}, "truncation_direction"),
        ("/embed", {"inputs": "a", "normalize": "no"}, "normalize"),
        ("/embed", {"inputs": [[1, 2]]}, "inputs"),
        ("/embed", {"inputs": "a", "attention": {"refine": -1}}, "attention.refine"),
        ("/tokenize", {"inputs": 3}, "inputs"),
        ("/tokenize", {"inputs": "a", "add_special_tokens": 2}, "add_special_tokens"),
    ],
)
def test_422_names_the_field_other_routes(client, path, body, param):
    assert_error(client.post(path, json=body), 422, param)


def test_422_names_the_first_item_that_breaks_the_inputs_shape(client):
    assert_error(client.post("/embed", json={"inputs": ["a", "b", 7]}), 422, "inputs",
                 "inputs[0] is a string but inputs[2] is a token id")


def test_422_body_not_an_object(client):
    assert_error(client.post("/v1/embeddings", json=["a"]), 422, None)


def test_413_input_too_long(client):
    response = client.post("/v1/embeddings", json={"input": ["short", LONG]})
    error = assert_error(response, 413, "input[1]", "more than the limit of 1024")
    assert "truncate" in error["message"]
    assert_error(client.post("/embed", json={"inputs": LONG}), 413, "inputs")
    assert_error(client.post("/v1/embeddings", json={"input": list(range(1000, 3000))}), 413, "input")


def test_413_batch_too_large(client):
    assert_error(client.post("/v1/embeddings", json={"input": ["a"] * 9}), 413, "input", "9 inputs")
    assert_error(client.post("/tokenize", json={"inputs": ["a"] * 9}), 413, "inputs")


def test_413_body_too_large(client):
    big = {"input": "word " * 20000}  # ~100 kB, the session limit is 64 KiB
    assert_error(client.post("/v1/embeddings", json=big), 413, None, "limit")

    def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(100):
            yield b"x" * 1024

    response = client.post("/embed", content=chunks(), headers={"content-type": "application/json"})
    assert_error(response, 413, None, "limit")


def test_404_and_405(client):
    assert_error(client.get("/v2/nothing"), 404, None)
    assert_error(client.get("/v1/embeddings"), 405, None)


def test_bad_requests_never_500(client):
    bodies = [b"", b"null", b"[]", b"1", b'"x"', b'{"input": null}', b'{"input": {"a": 1}}',
              b'{"input": [[]]}', b'{"input": [[-5]]}', b'{"input": "a", "dimensions": 1e9}',
              b'{"input": "a", "attention": {"seed": 1e30}}', b'{"input": "a", "attention": []}']
    for path in ("/v1/embeddings", "/embed", "/tokenize"):
        for body in bodies:
            response = client.post(path, content=body, headers={"content-type": "application/json"})
            assert 400 <= response.status_code < 500, (path, body, response.text)
            assert set(response.json()["error"]) == {"message", "type", "param"}


# --- statuses that need a server in a particular state --------------------------------


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
                while app.state.service.batcher.snapshot()["pending_items"] < 9:
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
    import json

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
            batcher = app.state.service.batcher
            with anyio.fail_after(120):
                while batcher.snapshot()["pending_items"] < 1:  # queued behind the held batch
                    await anyio.sleep(0.005)
            leave.set()
            with anyio.fail_after(120):
                await answered.wait()
            assert batcher.snapshot()["admitted"] == 1  # only the held request is still in
            gate.set()
        assert held["response"].status_code == 200
        assert sent[0]["status"] == 499
        gone_ids = encoder.tokenize(["gone away"])[0].ids
        assert all(gone_ids not in call["inputs"] for call in encoder.calls)  # never run
        assert (await http.post("/v1/embeddings", json={"input": "next"})).status_code == 200
        metrics = (await http.get("/metrics")).text
        assert 'clusterserve_request_failures_total{reason="disconnected"} 1.0' in metrics


@pytest.mark.parametrize(
    "attention, status",
    [
        ({"target_fidelity": 0.9, "clusters": 3}, 422),
        ({"target_fidelity": 0.9, "method": "full"}, 422),
        ({"target_fidelity": 0.9, "seed": 3}, 200),
        ({"target_fidelity": None, "method": "clustered", "clusters": 3}, 200),
    ],
)
def test_the_schema_states_which_knobs_target_fidelity_excludes(client, attention, status):
    body = {"inputs": "a short text", "attention": attention}
    assert request_schema(client, "/embed").is_valid(body) == (status == 200)
    assert client.post("/embed", json=body).status_code == status


def test_a_request_over_the_work_budget_is_refused_before_it_runs_naming_the_knob(client):
    import re

    from service_helpers import license_text

    limits = client.get("/info").json()["limits"]
    assert limits["max_request_work_s"] > 0 and limits["work_budget_units"] > 0
    text = license_text(6000)  # over the session limit of 1024 tokens: cut to it
    heavy = {"method": "i-clustered", "clusters": 900, "topk": 128, "iterations": 100, "refine": 100}
    counted = 'clusterserve_request_failures_total{reason="over_budget"} '
    before = float(client.get("/metrics").text.split(counted)[1].split()[0])  # present from start-up
    response = client.post("/v1/embeddings", json={"input": text, "truncate": True, "attention": heavy})
    error = assert_error(response, 422, "attention.clusters", "over its budget")
    largest = int(re.search(r"at 1024 tokens, clusters can be at most (\d+)", error["message"]).group(1))
    others = {name: int(value) for name, value in re.findall(r"with (\w+) at most (\d+)", error["message"])}
    assert 1 <= largest < 900 and set(others) <= {"topk", "iterations", "refine", "bits"}
    assert float(client.get("/metrics").text.split(counted)[1].split()[0]) == before + 1
    # The largest value it names runs.
    within = {**heavy, **others, "clusters": largest}
    fits = client.post("/v1/embeddings", json={"input": text, "truncate": True, "attention": within})
    assert fits.status_code == 200, fits.text
