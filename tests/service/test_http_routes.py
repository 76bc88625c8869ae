"""Every route's success path, in-process against the real default model."""

from __future__ import annotations

import base64
import json
import time
from decimal import Decimal

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from service_helpers import REAL_LIMITS, license_text, scrape, value, wait_ready

from clusterserve.kernels import KNOB_RANGES, METHOD_KNOBS, AttentionSpec, backend_for
from clusterserve.service.app import create_app
from clusterserve.service.settings import Settings

TIMING_HEADERS = ("x-request-id", "x-queue-time-ms", "x-inference-time-ms", "x-total-time-ms")
SUCCESS_HEADERS = TIMING_HEADERS + ("x-input-tokens", "x-attention", "x-peak-memory-bytes")
SENTENCES = ["The cat sat on the mat.", "Clustered attention groups similar queries together."]


def vectors(response) -> np.ndarray:
    return np.array([row["embedding"] for row in response.json()["data"]], dtype=np.float32)


def test_openai_embeddings_float(client):
    response = client.post("/v1/embeddings", json={"input": SENTENCES, "model": "anything", "user": "u1"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list" and body["model"] == "all-MiniLM-L6-v2"
    assert [row["index"] for row in body["data"]] == [0, 1]
    assert all(row["object"] == "embedding" for row in body["data"])
    got = vectors(response)
    assert got.shape == (2, 384)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)

    tokens = [len(t) for t in client.post("/tokenize", json={"inputs": SENTENCES}).json()]
    assert body["usage"] == {"prompt_tokens": sum(tokens), "total_tokens": sum(tokens)}
    for name in SUCCESS_HEADERS:
        assert name in response.headers, name
    assert int(response.headers["x-input-tokens"]) == sum(tokens)
    assert int(response.headers["x-peak-memory-bytes"]) > 0
    assert json.loads(response.headers["x-attention"]) == body["attention"]
    # The server's default: auto aiming at 0.98 through the shipped CPU table, which runs exact
    # attention at these lengths.
    assert body["attention"]["method"] == "full" and body["attention"]["target_fidelity"] == 0.98
    assert body["attention"]["calibration_bucket"] == 1024
    total = float(response.headers["x-total-time-ms"])
    assert total >= float(response.headers["x-inference-time-ms"]) >= 0


def test_openai_vectors_equal_the_model_run_directly(client):
    spec = AttentionSpec(method="full")
    response = client.post("/v1/embeddings", json={"input": SENTENCES[1], "attention": {"method": "full"}})
    encoder = client.app.state.service.encoder
    expected = encoder.embed([SENTENCES[1]], spec).numpy()
    np.testing.assert_array_equal(vectors(response), expected)


def test_openai_base64_is_little_endian_float32(client):
    request = {"input": SENTENCES, "attention": {"method": "full"}}
    as_float = vectors(client.post("/v1/embeddings", json=request))
    response = client.post("/v1/embeddings", json={**request, "encoding_format": "base64"})
    assert response.status_code == 200
    decoded = np.stack(
        [np.frombuffer(base64.b64decode(row["embedding"]), dtype="<f4") for row in response.json()["data"]]
    )
    np.testing.assert_array_equal(decoded, as_float)


def test_openai_token_ids_are_used_as_given(client):
    ids = [[t["id"] for t in row] for row in client.post("/tokenize", json={"inputs": SENTENCES}).json()]
    attention = {"method": "full"}
    from_text = vectors(client.post("/v1/embeddings", json={"input": SENTENCES, "attention": attention}))
    from_ids = client.post("/v1/embeddings", json={"input": ids, "attention": attention})
    assert from_ids.status_code == 200
    np.testing.assert_array_equal(vectors(from_ids), from_text)
    single = client.post("/v1/embeddings", json={"input": ids[0], "attention": attention})  # list[int]: one input
    assert len(single.json()["data"]) == 1
    # Alone vs. padded in a batch of two: the same up to float rounding.
    np.testing.assert_allclose(vectors(single)[0], from_text[0], atol=1e-6)
    assert single.json()["usage"]["prompt_tokens"] == len(ids[0])


def test_openai_dimensions_cut_and_renormalise(client):
    request = {"input": SENTENCES[0], "attention": {"method": "full"}}
    full = vectors(client.post("/v1/embeddings", json=request))[0]
    cut = vectors(client.post("/v1/embeddings", json={**request, "dimensions": 16}))[0]
    assert cut.shape == (16,)
    np.testing.assert_allclose(cut, full[:16] / np.linalg.norm(full[:16]), rtol=1e-5, atol=1e-6)


def test_openai_models_list_the_served_model_and_retrieve_it_by_its_names(client):
    listed = client.get("/v1/models")
    assert listed.status_code == 200, listed.text
    body = listed.json()
    assert body["object"] == "list" and len(body["data"]) == 1
    card = body["data"][0]
    assert card["id"] == "all-MiniLM-L6-v2" == client.post("/v1/embeddings", json={"input": "a"}).json()["model"]
    assert card["object"] == "model" and card["owned_by"] == "clusterserve"
    assert 0 < card["created"] <= time.time()  # when the server had loaded it
    for name in ("all-MiniLM-L6-v2", "all-minilm", "ALL-MINILM:latest"):  # as /api/tags names it
        retrieved = client.get(f"/v1/models/{name}")
        assert retrieved.status_code == 200, (name, retrieved.text)
        assert retrieved.json() == card
    missing = client.get("/v1/models/text-embedding-3-small")
    assert missing.status_code == 404
    assert missing.json()["error"] == {
        "message": "model 'text-embedding-3-small' is not served here; GET /v1/models lists the ones that are",
        "type": "not_found_error", "param": "model",
    }  # fmt: skip
    families = scrape(client.get("/metrics").text)
    for endpoint, code in (("/v1/models", "200"), ("/v1/models/{model}", "200"), ("/v1/models/{model}", "404")):
        assert value(families, "clusterserve_requests", "clusterserve_requests_total",
                     endpoint=endpoint, method="none", code=code) >= 1, (endpoint, code)  # fmt: skip


@pytest.mark.parametrize("method", ["full", "clustered", "i-clustered", "smyrf"])
def test_attention_is_resolved_and_echoed(client, method):
    # Knobs that keep each method approximate for a sentence of ~10 tokens.
    knobs = {"clusters": 7, "topk": 5, "hash_rounds": 2, "cluster_size": 2, "seed": 3}
    knobs = {k: v for k, v in knobs.items() if k in METHOD_KNOBS[method]}
    response = client.post("/v1/embeddings", json={"input": SENTENCES[1], "attention": {"method": method, **knobs}})
    assert response.status_code == 200, response.text
    expected = AttentionSpec(auto_threshold=256).with_knobs(method=method, **knobs).used_knobs()
    assert response.json()["attention"] == expected
    assert json.loads(response.headers["x-attention"]) == expected

    tei = client.post("/embed", json={"inputs": SENTENCES[1], "attention": {"method": method, **knobs}})
    assert json.loads(tei.headers["x-attention"]) == expected
    np.testing.assert_array_equal(np.array(tei.json(), dtype=np.float32), vectors(response))


def test_auto_with_a_knob_picks_by_length(client):
    # The session app sets auto_threshold=256; naming a knob a calibration chooses leaves the
    # server's default target out, so the threshold decides.
    long_text = license_text(1500)
    auto = {"method": "auto", "clusters": 9}
    short = client.post("/v1/embeddings", json={"input": SENTENCES[0], "attention": auto})
    assert short.json()["attention"] == {"method": "full"}
    long = client.post("/v1/embeddings", json={"input": long_text, "attention": auto})
    assert long.json()["usage"]["prompt_tokens"] >= 256
    assert long.json()["attention"]["method"] == "i-clustered"
    assert long.json()["attention"]["clusters"] == 9
    mixed = client.post("/v1/embeddings", json={"input": [SENTENCES[0], long_text], "attention": auto})
    echo = mixed.json()["attention"]
    assert echo["method"] == "auto" and echo["auto_threshold"] == 256
    assert [spec["method"] for spec in echo["inputs"]] == ["full", "i-clustered"]


def test_a_method_exact_by_its_knobs_runs_exact_attention_and_says_so(client):
    long_text = license_text(1500)  # ~300 tokens
    asked = {"method": "i-clustered", "clusters": 100, "topk": 8}
    mixed = client.post("/v1/embeddings", json={"input": [SENTENCES[0], long_text], "attention": asked})
    echo = mixed.json()["attention"]
    assert echo["method"] == "i-clustered"
    short, long = echo["inputs"]
    assert short["method"] == "full" and short["exact_by_knobs"]["method"] == "i-clustered"
    assert short["exact_by_knobs"]["clusters"] == 100 and long["method"] == "i-clustered"
    full = client.post("/v1/embeddings", json={"input": SENTENCES[0], "attention": {"method": "full"}})
    # The same exact attention; packed with a longer input, its GEMM rows may round differently.
    np.testing.assert_allclose(vectors(mixed)[0], vectors(full)[0], atol=1e-6, rtol=0)


def test_truncate_cuts_to_the_limit(client):
    text = license_text(12000)  # ~2500 tokens, the session limit is 1024
    request = {"inputs": text, "truncate": True, "attention": {"method": "full"}}
    right = client.post("/embed", json=request)
    left = client.post("/embed", json={**request, "truncation_direction": "Left"})
    assert right.status_code == left.status_code == 200
    assert right.headers["x-input-tokens"] == left.headers["x-input-tokens"] == "1024"
    # Different ends of the text: different vectors.
    assert not np.allclose(right.json(), left.json(), atol=1e-3)
    openai = client.post("/v1/embeddings", json={"input": text, "truncate": True, "attention": {"method": "full"}})
    assert openai.json()["usage"]["prompt_tokens"] == 1024
    np.testing.assert_array_equal(vectors(openai), np.array(right.json(), dtype=np.float32))


def test_tei_embed(client):
    response = client.post("/embed", json={"inputs": SENTENCES, "attention": {"method": "full"}})
    assert response.status_code == 200
    got = np.array(response.json(), dtype=np.float32)
    assert got.shape == (2, 384)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    for name in SUCCESS_HEADERS:
        assert name in response.headers, name
    raw = np.array(
        client.post("/embed", json={"inputs": SENTENCES[0], "normalize": False, "attention": {"method": "full"}}).json()
    )
    assert raw.shape == (1, 384) and abs(np.linalg.norm(raw) - 1.0) > 1e-3
    np.testing.assert_allclose(raw[0] / np.linalg.norm(raw[0]), got[0], rtol=1e-5, atol=1e-6)
    cut = client.post("/embed", json={"inputs": SENTENCES[0], "dimensions": 8, "attention": {"method": "full"}})
    assert np.array(cut.json()).shape == (1, 8)


def test_tokenize(client):
    text = "Hello there, world!"
    response = client.post("/tokenize", json={"inputs": text})
    assert response.status_code == 200
    [tokens] = response.json()
    assert tokens[0]["special"] and tokens[-1]["special"]  # [CLS] ... [SEP]
    assert [t["text"] for t in tokens[1:-1]] == ["Hello", "there", ",", "world", "!"]
    for token in tokens[1:-1]:
        assert text[token["start"] : token["stop"]] == token["text"] and not token["special"]
    assert tokens[1]["id"] == 7592  # "hello" in the uncased BERT vocabulary
    plain = client.post("/tokenize", json={"inputs": [text, "a"], "add_special_tokens": False}).json()
    assert plain[0] == tokens[1:-1] and len(plain) == 2


def cpu_backend() -> str:
    """What "auto" runs for the served model's float32 CPU tensors."""
    return backend_for(torch.device("cpu"), torch.float32)


def test_the_backend_is_resolved_once_at_start_up_and_every_attention_call_gets_it(monkeypatch):
    # The Triton tests of the same session set TRITON_INTERPRET=1, which lets triton run on CPU.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert cpu_backend() in ("native", "reference")
    app = create_app(Settings(**{**REAL_LIMITS, "backend": "reference"}))
    with TestClient(app) as reference_client:
        wait_ready(reference_client)
        assert reference_client.get("/info").json()["backend"] == "reference"
        assert app.state.service.encoder.backend == "reference"
    # One that cannot run on this device fails start-up, and readiness says why.
    app = create_app(Settings(**{**REAL_LIMITS, "backend": "triton"}))
    with TestClient(app) as triton_client:
        deadline = time.monotonic() + 60
        while app.state.service.load_error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        ready = triton_client.get("/health/ready")
        assert ready.status_code == 503 and "triton" in json.dumps(ready.json())


def test_info(client):
    info = client.get("/info").json()
    assert info["model"] == "all-MiniLM-L6-v2"
    assert info["dimension"] == 384
    assert info["native_positions"] == 512
    assert info["extended_positions"] == info["max_input_tokens"] == 1024
    assert info["position_extension"] == "copied"
    assert info["limits"]["max_client_batch_size"] == 8
    assert info["limits"]["max_body_bytes"] == 64 * 1024
    assert info["backend"] == cpu_backend() and info["device"] == "cpu"
    assert info["cuda_graphs"] is None  # a CPU replays no CUDA graphs
    methods = info["attention"]["methods"]
    assert set(methods) == {"full", "clustered", "i-clustered", "smyrf", "banded", "auto"}
    for method, knobs in METHOD_KNOBS.items():
        default = AttentionSpec(method=method)
        assert set(methods[method]) == set(knobs)
        for name, described in methods[method].items():
            low, high = KNOB_RANGES[name]
            assert described == {"default": getattr(default, name), "min": low, "max": high}
    # i-clustered starts from the seed queries, clustered from LSH codes
    assert methods["i-clustered"]["bits"]["default"] == 0 and methods["i-clustered"]["refine"]["default"] == 2
    assert methods["clustered"]["bits"]["default"] == 63 and methods["clustered"]["refine"]["default"] == 3
    assert info["attention"]["default_method"] == "auto"
    assert info["attention"]["auto"] == {"target_fidelity": 0.98, "threshold": 256, "method": "i-clustered"}


@pytest.mark.parametrize(
    "asked, start",
    [
        ({"method": "i-clustered"}, {"bits": 0, "iterations": 0, "refine": 2}),  # the seeds
        ({"method": "clustered"}, {"bits": 63, "iterations": 0, "refine": 3}),  # the codes
        ({"method": "i-clustered", "iterations": 2}, {"bits": 63, "iterations": 2, "refine": 3}),  # codes asked for
        ({"method": "clustered", "bits": 0}, {"bits": 0, "iterations": 0, "refine": 2}),
    ],
)
def test_bits_and_refine_left_out_follow_the_method(client, asked, start):
    """A request that leaves bits and refine out gets its method's start: i-clustered from the
    seed queries, clustered, or any that asks for Hamming iterations, from 63-bit codes."""
    response = client.post("/v1/embeddings", json={"input": SENTENCES[1], "attention": {**asked, "clusters": 7, "topk": 5}})
    assert response.status_code == 200, response.text
    echoed = response.json()["attention"]
    assert {name: echoed[name] for name in start} == start


@pytest.mark.parametrize("path", ["/health", "/health/live", "/health/ready"])
def test_health(client, path):
    response = client.get(path)
    assert response.status_code == 200
    assert response.json()["status"] in ("live", "ready")


def test_docs_and_openapi(client):
    assert client.get("/docs").status_code == 200
    schema = client.get("/openapi.json").json()
    for path in ("/v1/embeddings", "/embed", "/tokenize", "/info", "/health/live", "/health/ready", "/metrics"):
        assert path in schema["paths"], path
    knobs = schema["components"]["schemas"]["AttentionRequest"]["properties"]
    assert {"method", "clusters", "topk", "seed", "target_fidelity"} <= set(knobs)


def test_request_id_is_echoed(client):
    response = client.get("/health/live", headers={"x-request-id": "trace-42"})
    assert response.headers["x-request-id"] == "trace-42"
    generated = client.get("/health/live", headers={"x-request-id": "bad id with spaces"})
    assert generated.headers["x-request-id"] != "bad id with spaces"
    assert len(generated.headers["x-request-id"]) == 32


def test_json_numbers_give_the_float32_values_back_in_nine_digits(client):
    body = {"input": SENTENCES[0], "attention": {"method": "full"}}
    row = client.post("/v1/embeddings", json=body).json()["data"][0]["embedding"]
    raw = client.post("/v1/embeddings", json={**body, "encoding_format": "base64"}).json()["data"][0]["embedding"]
    # Read as float32, every JSON number is the served value bit for bit (base64 carries the bytes)...
    np.testing.assert_array_equal(np.array(row, dtype=np.float32), np.frombuffer(base64.b64decode(raw), dtype="<f4"))
    # ...printed with at most the 9 significant digits a float32 needs, not a double's 17.
    assert max(significant_digits(x) for x in row) <= 9, row


def significant_digits(x: float) -> int:
    return len(Decimal(repr(x)).normalize().as_tuple().digits)


def test_the_openapi_document_states_what_the_loaded_model_allows(client):
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    request = schemas["EmbeddingRequest"]
    # The default model has no prompts and no task adapters: only null (and "", no prompt) is allowed.
    prompt = request["properties"]["prompt_name"]["anyOf"]
    assert prompt == [{"type": "string", "enum": [""]}, {"type": "null"}]
    assert client.post("/v1/embeddings", json={"input": "x", "prompt_name": "query"}).status_code == 422
    assert schemas["EmbedRequest"]["properties"]["adapter"]["type"] == "null"
    dimensions = [arm for arm in request["properties"]["dimensions"]["anyOf"] if arm.get("type") == "integer"]
    assert dimensions == [{"type": "integer", "minimum": 1, "maximum": 384}]
    assert '"maximum": 30521' in json.dumps(request["properties"]["input"])  # token ids < the vocabulary
    assert client.post("/v1/embeddings", json={"input": "x", "dimensions": 385}).status_code == 422
    assert client.post("/v1/embeddings", json={"input": [30522]}).status_code == 422
    # JSON integers may be written 8.0; the server agrees with the document.
    ok = client.post("/v1/embeddings", json={"input": [101.0, 2023.0, 102], "dimensions": 16.0})
    assert ok.status_code == 200, ok.text
