"""Ollama's routes over plain HTTP, in-process: every field of /api/embed and /api/embeddings,
/api/tags, /api/show and /api/version, the model names the served model answers to, no prompt
on these routes (even for a checkpoint with a default prompt), the `attention` extension, and
every error in Ollama's shape `{"error": "..."}` with its statuses.

The session app serves all-MiniLM-L6-v2 (Ollama's all-minilm) with small limits (conftest);
429, 401 and 503 run against apps with a fake encoder; the no-prompt rule on a tiny checkpoint
whose default prompt is "document". The real clients against a real server process are in
test_ollama_clients.py.
"""

from __future__ import annotations

import contextlib
import json
import threading

import numpy as np
import pytest
from fastapi.testclient import TestClient
from service_helpers import FakeEncoder, fake_app, license_text, running, scrape, value, wait_ready

from clusterserve.service.app import create_app
from clusterserve.service.settings import Settings

MODEL = "all-minilm"  # Ollama's name for the session's all-MiniLM-L6-v2
DIM = 384
LONG = license_text(12000)  # ~2500 tokens; the session limit is 1024
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Clustered attention for long documents."]


def ollama_error(response, status: int, says: str | None = None) -> str:
    """Ollama's error shape: {"error": message}, nothing else."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert "x-request-id" in response.headers
    body = response.json()
    assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"], body
    if says is not None:
        assert says in body["error"], body["error"]
    return body["error"]


def vectors(response) -> np.ndarray:
    assert response.status_code == 200, response.text
    return np.array(response.json()["embeddings"], dtype=np.float32)


# --- /api/embed ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["all-minilm", "all-minilm:latest", "ALL-MiniLM", "all-MiniLM-L6-v2", "all-minilm-l6-v2:latest"])
def test_the_served_model_answers_to_its_own_name_and_ollamas(client, name):
    response = client.post("/api/embed", json={"model": name, "input": "hello"})
    assert response.status_code == 200, response.text
    assert response.json()["model"] == name  # as Ollama answers: the name the request gave


def test_embed_answers_as_ollama_with_the_vectors_of_the_other_routes(client):
    response = client.post("/api/embed", json={"model": MODEL, "input": TEXTS})
    body = response.json()
    assert set(body) == {"model", "embeddings", "total_duration", "load_duration", "prompt_eval_count"}
    got = vectors(response)
    assert got.shape == (2, DIM)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    # MiniLM has no prompt: the vectors are /embed's, bit for bit (both print float32's 9 digits).
    np.testing.assert_array_equal(got, np.array(client.post("/embed", json={"inputs": TEXTS}).json(), dtype=np.float32))
    tokens = sum(len(one) for one in client.post("/tokenize", json={"inputs": TEXTS}).json())
    assert body["prompt_eval_count"] == tokens == int(response.headers["x-input-tokens"])
    # Nanoseconds: from arrival to the answer, within the request's own total time.
    total_ms = float(response.headers["x-total-time-ms"])
    assert isinstance(body["total_duration"], int) and 0 < body["total_duration"] <= total_ms * 1e6
    assert body["total_duration"] >= float(response.headers["x-inference-time-ms"]) * 1e6
    assert body["load_duration"] == 0
    for header in ("x-attention", "x-queue-time-ms", "x-inference-time-ms", "x-request-id"):
        assert header in response.headers, header
    assert "x-prompt-name" not in response.headers
    # Alone, the first text gets the batch's first vector; a batch of one runs the matmuls at
    # other shapes, which some CPUs' kernels sum in another order (an ulp apart, 1.2e-7 seen).
    one = client.post("/api/embed", json={"model": MODEL, "input": TEXTS[0]})
    np.testing.assert_allclose(vectors(one), got[:1], rtol=0, atol=1e-6)


def test_dimensions_keep_the_first_components_renormalised(client):
    cut = vectors(client.post("/api/embed", json={"model": MODEL, "input": TEXTS, "dimensions": 64}))
    assert cut.shape == (2, 64)
    np.testing.assert_allclose(np.linalg.norm(cut, axis=1), 1.0, atol=1e-6)
    full = vectors(client.post("/api/embed", json={"model": MODEL, "input": TEXTS}))
    expected = full[:, :64] / np.linalg.norm(full[:, :64], axis=1, keepdims=True)
    np.testing.assert_allclose(cut, expected, atol=1e-6)
    for everything in (0, DIM, float(DIM), DIM + 1, 10**6):  # as Ollama: 0 or the width or more is all
        body = {"model": MODEL, "input": TEXTS, "dimensions": everything}
        assert vectors(client.post("/api/embed", json=body)).shape == (2, DIM)
    ollama_error(client.post("/api/embed", json={"model": MODEL, "input": "a", "dimensions": -1}), 400, "dimensions")
    ollama_error(client.post("/api/embed", json={"model": MODEL, "input": "a", "dimensions": "8"}), 400, "dimensions")


def test_truncate_is_true_by_default_and_false_is_a_413(client):
    cut = client.post("/api/embed", json={"model": MODEL, "input": LONG})
    assert cut.status_code == 200 and cut.json()["prompt_eval_count"] == 1024
    explicit = client.post("/api/embed", json={"model": MODEL, "input": LONG, "truncate": True})
    np.testing.assert_array_equal(vectors(cut), vectors(explicit))
    says = ollama_error(client.post("/api/embed", json={"model": MODEL, "input": ["a", LONG], "truncate": False}), 413)
    assert says.startswith("input[1]: ") and "more than the limit of 1024" in says
    ollama_error(client.post("/api/embed", json={"model": MODEL, "input": "a", "truncate": "yes"}), 400, "truncate")


@pytest.mark.parametrize("body", [{}, {"input": ""}, {"input": []}, {"input": None}])
def test_an_empty_input_returns_no_vectors_as_ollama_does(client, body):
    response = client.post("/api/embed", json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    assert response.json()["embeddings"] == [] and response.json()["prompt_eval_count"] == 0


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain", None])
def test_the_body_is_json_whatever_its_content_type_as_ollama_reads_it(client, content_type):
    """Ollama's documentation posts with `curl -d '{...}'`, which sends a form's content type."""
    body = json.dumps({"model": MODEL, "input": TEXTS}).encode()
    headers = {} if content_type is None else {"content-type": content_type}
    response = client.post("/api/embed", content=body, headers=headers)
    np.testing.assert_array_equal(vectors(response), vectors(client.post("/api/embed", json={"model": MODEL, "input": TEXTS})))


def test_an_empty_item_is_a_400_naming_it(client):
    ollama_error(client.post("/api/embed", json={"model": MODEL, "input": ["a", ""]}), 400, "input[1]")


def test_options_and_keep_alive_are_accepted_and_change_nothing(client):
    plain = vectors(client.post("/api/embed", json={"model": MODEL, "input": TEXTS}))
    # What LangChain's OllamaEmbeddings sends: every option, most of them null.
    options = {"mirostat": None, "num_ctx": 2048, "num_thread": 2, "temperature": None, "stop": None, "top_k": None}
    for keep_alive in ("5m", -1, 0, 300.5, None):
        body = {"model": MODEL, "input": TEXTS, "options": options, "keep_alive": keep_alive}
        np.testing.assert_array_equal(vectors(client.post("/api/embed", json=body)), plain)
    ollama_error(client.post("/api/embed", json={"model": MODEL, "input": "a", "options": [1]}), 400, "options")
    ollama_error(client.post("/api/embed", json={"model": MODEL, "input": "a", "keep_alive": {"m": 5}}), 400, "keep_alive")


def test_attention_is_an_extension_with_the_other_routes_knobs_echo_and_errors(client):
    text = license_text(2500)  # ~500 tokens: the approximations differ from exact attention
    for attention in ({"method": "full"}, {"method": "clustered", "clusters": 20, "seed": 3},
                      {"method": "smyrf", "hash_rounds": 2, "cluster_size": 32}):  # fmt: skip
        ours = client.post("/api/embed", json={"model": MODEL, "input": text, "attention": attention})
        other = client.post("/v1/embeddings", json={"input": text, "attention": attention})
        assert json.loads(ours.headers["x-attention"]) == other.json()["attention"]
        expected = np.array(other.json()["data"][0]["embedding"], dtype=np.float32)
        np.testing.assert_array_equal(vectors(ours)[0], expected)
    says = ollama_error(client.post("/api/embed", json={"model": MODEL, "input": "a", "attention": {"clusters": 0}}), 400)
    assert says.startswith("attention.clusters: ")
    ollama_error(client.post("/api/embed", json={"model": MODEL, "input": "a", "attention": {"cluster": 8}}), 400,
                 "attention.cluster")  # fmt: skip


def test_a_request_over_the_work_budget_is_a_400_naming_the_knob(client):
    heavy = {"method": "i-clustered", "clusters": 900, "topk": 128, "iterations": 100, "refine": 100}
    body = {"model": MODEL, "input": license_text(6000), "attention": heavy}
    says = ollama_error(client.post("/api/embed", json=body), 400, "over its budget")
    assert says.startswith("attention.clusters: ")


def test_more_inputs_than_the_limit_is_a_413(client):
    ollama_error(client.post("/api/embed", json={"model": MODEL, "input": ["a"] * 9}), 413, "9 inputs")


# --- /api/embeddings (legacy) ------------------------------------------------------------


def test_legacy_embeddings_is_the_pooled_vector_not_normalised(client):
    response = client.post("/api/embeddings", json={"model": MODEL, "prompt": TEXTS[0]})
    assert response.status_code == 200, response.text
    assert set(response.json()) == {"embedding"}
    raw = np.array(response.json()["embedding"], dtype=np.float32)
    assert raw.shape == (DIM,)
    assert abs(np.linalg.norm(raw) - 1.0) > 0.1  # MiniLM's mean-pooled states are not unit vectors
    unit = vectors(client.post("/api/embed", json={"model": MODEL, "input": TEXTS[0]}))[0]
    np.testing.assert_allclose(raw / np.linalg.norm(raw), unit, atol=1e-6)
    for body in ({"model": MODEL}, {"model": MODEL, "prompt": ""}):
        assert client.post("/api/embeddings", json=body).json() == {"embedding": []}
    # Truncated as Ollama's legacy route does; the attention extension applies.
    long = client.post("/api/embeddings", json={"model": MODEL, "prompt": LONG, "attention": {"method": "full"}})
    assert long.status_code == 200 and long.headers["x-input-tokens"] == "1024"
    assert json.loads(long.headers["x-attention"]) == {"method": "full"}
    ollama_error(client.post("/api/embeddings", json={"model": "nomic-embed-text", "prompt": "a"}), 404)
    ollama_error(client.post("/api/embeddings", json={"model": MODEL, "prompt": ["a"]}), 400, "prompt")
    ollama_error(client.post("/api/embeddings", json={"model": MODEL, "input": "a"}), 400, "input")


# --- the model routes ------------------------------------------------------------------


def test_tags_list_the_served_model_under_each_name_it_answers_to(client):
    models = client.get("/api/tags").json()["models"]
    assert [m["name"] for m in models] == [m["model"] for m in models] == ["all-minilm:latest", "all-MiniLM-L6-v2:latest"]
    parameters = client.post("/api/show", json={"model": MODEL}).json()["model_info"]["general.parameter_count"]
    assert 22e6 < parameters < 23e6
    for m in models:
        assert m["size"] == 4 * parameters  # float32 weights
        assert m["details"] == {"family": "bert", "families": ["bert"], "parameter_size": "23M", "quantization_level": "F32"}


def test_show_describes_the_model_and_answers_ollamas_404(client):
    for body in ({"model": "all-minilm"}, {"name": "all-MiniLM-L6-v2:latest"}, {"model": "all-minilm", "verbose": True}):
        shown = client.post("/api/show", json=body)
        assert shown.status_code == 200, shown.text
        info = shown.json()["model_info"]
        assert info["general.architecture"] == "bert" and info["general.name"] == "all-MiniLM-L6-v2"
        assert info["bert.embedding_length"] == DIM and info["bert.context_length"] == 1024
        assert info["bert.block_count"] == 6 and info["bert.attention.head_count"] == 12
        assert shown.json()["capabilities"] == ["embedding"]
    assert ollama_error(client.post("/api/show", json={"model": "llama3"}), 404) == "model 'llama3' not found"
    assert ollama_error(client.post("/api/show", json={}), 400) == "model is required"


def test_version(client):
    from clusterserve.service import __version__

    assert client.get("/api/version").json() == {"version": __version__}


# --- errors ----------------------------------------------------------------------------


def test_an_unknown_model_is_ollamas_404(client):
    says = ollama_error(client.post("/api/embed", json={"model": "nomic-embed-text", "input": "a"}), 404)
    assert says == 'model "nomic-embed-text" not found, try pulling it first'
    assert ollama_error(client.post("/api/embed", json={"model": "", "input": "a"}), 400) == "model is required"
    assert ollama_error(client.post("/api/embed", json={"input": "a"}), 400) == "model is required"


def test_bad_bodies_get_400_in_ollamas_shape_never_500(client):
    bodies = [b"", b"{", b"null", b"[]", b"1", b'"x"', b'{"model": 5, "input": "a"}', b'{"model": "all-minilm", "input": 5}',
              b'{"model": "all-minilm", "input": [1, 2]}', b'{"model": "all-minilm", "input": {"a": 1}}',
              b'{"model": "all-minilm", "input": "a", "dimensions": 1.5}',
              b'{"model": "all-minilm", "input": "a", "attention": {"seed": 1e30}}',
              b'{"model": "all-minilm", "input": "a", "attention": []}',
              b'{"model": "all-minilm", "input": "a", "inputs": "b"}']  # fmt: skip
    for path in ("/api/embed", "/api/embeddings", "/api/show"):
        for body in bodies:
            response = client.post(path, content=body, headers={"content-type": "application/json"})
            assert response.status_code in (400, 404), (path, body, response.text)
            ollama_error(response, response.status_code)


def test_limits_and_unknown_paths_answer_in_ollamas_shape(client):
    ollama_error(client.post("/api/embed", json={"model": MODEL, "input": "word " * 20000}), 413, "limit")  # 64 KiB body
    ollama_error(client.get("/api/generate"), 404)
    ollama_error(client.get("/api/embed"), 405)
    # The other routes keep theirs.
    assert set(client.post("/embed", json={"inputs": "a", "attention": {"clusters": 0}}).json()["error"]) == {
        "message", "type", "param",
    }  # fmt: skip


def test_metrics_count_each_ollama_route(client):
    def count(endpoint: str, code: str) -> float:
        families = scrape(client.get("/metrics").text)
        return sum(
            v for (name, labels), v in families["clusterserve_requests"]["samples"].items()
            if name == "clusterserve_requests_total" and dict(labels)["endpoint"] == endpoint and dict(labels)["code"] == code
        )  # fmt: skip

    calls = [("post", "/api/embed", {"model": MODEL, "input": "a"}, "200"),
             ("post", "/api/embed", {"model": "x", "input": "a"}, "404"),
             ("post", "/api/embeddings", {"model": MODEL, "prompt": "a"}, "200"), ("get", "/api/tags", None, "200"),
             ("post", "/api/show", {"model": MODEL}, "200"), ("get", "/api/version", None, "200")]  # fmt: skip
    for verb, path, body, code in calls:
        before = count(path, code)
        getattr(client, verb)(path, **({"json": body} if body is not None else {}))
        assert count(path, code) == before + 1, (path, code)
    assert value(scrape(client.get("/metrics").text), "clusterserve_requests", "clusterserve_requests_total",
                 endpoint="/api/embeddings", method="none", code="200") >= 0  # pre-created at start-up  # fmt: skip


# --- statuses that need a server in a particular state --------------------------------


@pytest.mark.anyio
async def test_429_over_max_concurrent_requests_in_ollamas_shape():
    import anyio

    gate = threading.Event()
    app, encoder = fake_app(FakeEncoder(gate=gate), max_concurrent_requests=1)
    async with running(app) as http:
        async with anyio.create_task_group() as tasks:
            first = {}

            async def hold():
                first["response"] = await http.post("/api/embed", json={"model": "fake-encoder", "input": "first"})

            tasks.start_soon(hold)
            with anyio.fail_after(120):
                while not encoder.calls:
                    await anyio.sleep(0.005)
            response = await http.post("/api/embed", json={"model": "fake-encoder", "input": "second"})
            ollama_error(response, 429, "busy")
            assert response.headers["retry-after"] == "1"
            gate.set()
        assert first["response"].status_code == 200


@pytest.mark.anyio
async def test_401_on_the_embedding_routes_and_the_model_routes_stay_open():
    app, _ = fake_app(api_key="s3cret")
    async with running(app) as http:
        for path, body in (("/api/embed", {"model": "fake-encoder", "input": "a"}),
                           ("/api/embeddings", {"model": "fake-encoder", "prompt": "a"})):  # fmt: skip
            ollama_error(await http.post(path, json=body), 401, "API key")
            ok = await http.post(path, json=body, headers={"authorization": "Bearer s3cret"})
            assert ok.status_code == 200, ok.text
        assert (await http.get("/api/version")).status_code == 200


@pytest.mark.anyio
async def test_503_until_the_model_is_loaded():
    gate = threading.Event()

    def load(_settings):
        gate.wait(60)
        return FakeEncoder()

    app = create_app(Settings(warmup=False, method="full"), load=load)
    async with running(app, ready=False) as http:
        for verb, path, body in (("post", "/api/embed", {"model": "fake-encoder", "input": "a"}), ("get", "/api/tags", None),
                                 ("post", "/api/show", {"model": "fake-encoder"})):  # fmt: skip
            response = await getattr(http, verb)(path, **({"json": body} if body is not None else {}))
            ollama_error(response, 503, "loading")
            assert response.headers["retry-after"] == "1"
        gate.set()
        import anyio

        with anyio.fail_after(120):
            while (await http.get("/health/ready")).status_code != 200:
                await anyio.sleep(0.01)
        assert (await http.post("/api/embed", json={"model": "fake-encoder", "input": "a"})).status_code == 200


# --- no prompt on Ollama's routes ------------------------------------------------------


@pytest.fixture(scope="module")
def prompted(tmp_path_factory):
    """An app on a tiny checkpoint whose default prompt is "document" ("search_document: ")."""
    pytest.importorskip("transformers")
    from tiny_checkpoints import make_checkpoint

    folder = make_checkpoint("gte", tmp_path_factory.mktemp("gte"))
    with contextlib.ExitStack() as stack:
        app = create_app(Settings(model=str(folder), device="cpu", warmup=False, dtype="float32"))
        client = stack.enter_context(TestClient(app))
        wait_ready(client)
        yield client, folder.name


def test_ollamas_routes_add_no_prompt_where_the_others_add_the_default(prompted):
    client, name = prompted
    text = "what rotary positions do"
    ollama = client.post("/api/embed", json={"model": name, "input": text})
    ids = client.post("/tokenize", json={"inputs": text}).json()[0]
    assert ollama.json()["prompt_eval_count"] == len(ids) and "x-prompt-name" not in ollama.headers
    tei = client.post("/embed", json={"inputs": text})  # gets "search_document: " in front
    assert tei.headers["x-prompt-name"] == "document"
    assert not np.allclose(vectors(ollama)[0], np.array(tei.json()[0], dtype=np.float32), atol=1e-3)
    # Written by the user, the prompt is embedded as written: /embed's default-prompt vector.
    written = client.post("/api/embed", json={"model": name, "input": "search_document: " + text})
    np.testing.assert_array_equal(vectors(written)[0], np.array(tei.json()[0], dtype=np.float32))
    # prompt_name "" asks the other routes for no prompt too: the Ollama route's vector.
    bare = client.post("/embed", json={"inputs": text, "prompt_name": ""})
    assert "x-prompt-name" not in bare.headers
    np.testing.assert_array_equal(np.array(bare.json()[0], dtype=np.float32), vectors(ollama)[0])
    legacy = np.array(client.post("/api/embeddings", json={"model": name, "prompt": text}).json()["embedding"])
    np.testing.assert_allclose(legacy / np.linalg.norm(legacy), vectors(ollama)[0], atol=1e-6)


def test_the_schema_says_a_model_is_required_as_the_server_does(client):
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    for name in ("OllamaEmbedRequest", "OllamaEmbeddingsRequest"):
        assert schemas[name]["required"] == ["model"]
        assert schemas[name]["properties"]["model"]["type"] == "string"
        assert schemas[name]["properties"]["model"]["minLength"] == 1
    assert schemas["OllamaShowRequest"]["anyOf"] == [{"required": ["model"]}, {"required": ["name"]}]
    for body in ({"input": "a"}, {"model": None, "input": "a"}):
        assert ollama_error(client.post("/api/embed", json=body), 400) == "model is required"
