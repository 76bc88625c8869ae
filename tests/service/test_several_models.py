"""Several models behind one endpoint: `--model` more than once, each model reached by name on
every API (OpenAI's `model`, Ollama's names, TEI's /models/{model} routes), listed by
/v1/models, /api/tags and /info, 404 in each API's shape for another name, and one memory
budget for all. In-process: all-MiniLM-L6-v2 (the default, 384-d) beside a tiny GTE (32-d);
then the real server process with the official clients."""

from __future__ import annotations

import time

import numpy as np
import ollama
import openai
import pytest
from fastapi.testclient import TestClient
from server_process import running_server
from service_helpers import REAL_LIMITS, assert_error, scrape, value, wait_ready
from tiny_checkpoints import DIM, make_checkpoint

from clusterserve.service.__main__ import parse_settings
from clusterserve.service.app import create_app
from clusterserve.service.settings import Settings

DEFAULT, DEFAULT_DIM = "all-MiniLM-L6-v2", 384


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(make_checkpoint("gte", tmp_path_factory.mktemp("models") / "tiny-gte"))


@pytest.fixture(scope="module")
def client(tiny):
    app = create_app(Settings(**{**REAL_LIMITS, "model": DEFAULT, "more_models": [tiny]}))
    with TestClient(app) as test_client:
        wait_ready(test_client)
        yield test_client


def test_the_cli_takes_model_more_than_once():
    settings = parse_settings(["--model", "minilm", "--model", "/x/y.gguf", "--model", "nomic"])
    assert (settings.model, settings.more_models) == ("minilm", ["/x/y.gguf", "nomic"])
    assert parse_settings(["--model", "minilm"]).more_models == []


def test_every_listing_names_both_models_the_default_first(client):
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [DEFAULT, "tiny-gte"]
    assert client.get("/v1/models/tiny-gte:latest").json()["id"] == "tiny-gte"
    assert {m["name"] for m in client.get("/api/tags").json()["models"]} >= {"all-minilm:latest", "tiny-gte:latest"}
    info = client.get("/info").json()
    assert (info["models"], info["model"], info["dimension"]) == ([DEFAULT, "tiny-gte"], DEFAULT, DEFAULT_DIM)
    other = client.get("/info", params={"model": "tiny-gte"}).json()
    assert (other["model"], other["dimension"], other["architecture"]) == ("tiny-gte", DIM, "gte")
    assert other["limits"]["work_budget_units"] > 0
    assert_error(client.get("/info", params={"model": "nope"}), 404, "model", says="tiny-gte")
    series = scrape(client.get("/metrics").text)["clusterserve_build_info"]["samples"]
    assert {dict(labels)["model"] for _, labels in series} == {DEFAULT, "tiny-gte"}


@pytest.mark.parametrize("model, dim", [
    (None, DEFAULT_DIM), (DEFAULT, DEFAULT_DIM), ("minilm", DEFAULT_DIM), ("all-minilm:latest", DEFAULT_DIM),
    ("tiny-gte", DIM), ("TINY-GTE:latest", DIM),
])  # fmt: skip
def test_openai_model_picks_the_model(client, model, dim):
    body = {"input": ["a short text", "another one"], **({"model": model} if model else {})}
    answer = client.post("/v1/embeddings", json=body).json()
    assert answer["model"] == (DEFAULT if dim == DEFAULT_DIM else "tiny-gte")
    assert [len(d["embedding"]) for d in answer["data"]] == [dim, dim]


def test_a_name_no_model_answers_to_is_a_404_in_each_apis_shape(client):
    assert_error(client.post("/v1/embeddings", json={"input": "x", "model": "text-embedding-3-small"}), 404, "model")
    assert_error(client.post("/models/nope/embed", json={"inputs": "x"}), 404, "model")
    assert_error(client.post("/models/nope", json={"inputs": "x"}), 404, "model")
    refused = client.post("/api/embed", json={"model": "nope", "input": "x"})
    assert refused.status_code == 404 and set(refused.json()) == {"error"}  # Ollama's shape


def test_tei_routes_take_the_model_from_the_path_and_ollama_from_its_name(client):
    assert len(client.post("/embed", json={"inputs": "x"}).json()[0]) == DEFAULT_DIM
    for route in ("/models/tiny-gte/embed", "/models/tiny-gte"):
        assert len(client.post(route, json={"inputs": "x"}).json()[0]) == DIM
    tokens = client.post("/models/tiny-gte/embed_all", json={"inputs": "hello"}).json()[0]
    assert len(tokens[0]) == DIM
    assert len(client.post("/api/embed", json={"model": "tiny-gte", "input": "x"}).json()["embeddings"][0]) == DIM
    chunked = client.post("/models/tiny-gte/embed", json={"inputs": "word " * 300, "chunking": {"size": 64}}).json()
    assert len(chunked[0]) > 1 and len(chunked[0][0]["embedding"]) == DIM


def test_the_same_text_gets_each_models_own_vector(client):
    body = {"input": "Clustered attention for long documents."}
    alone = create_app(Settings(**{**REAL_LIMITS, "model": DEFAULT}))
    with TestClient(alone) as single:
        wait_ready(single)
        expected = single.post("/v1/embeddings", json=body).json()["data"][0]["embedding"]
    got = client.post("/v1/embeddings", json={**body, "model": DEFAULT}).json()["data"][0]["embedding"]
    np.testing.assert_array_equal(np.float32(got), np.float32(expected))


def test_models_that_do_not_fit_the_memory_budget_fail_start_up_and_say_so(client, tiny):
    first, second = client.app.state.service.models.values()
    budget = first.weight_bytes + second.weight_bytes // 2  # the default fits, the two together do not
    app = create_app(Settings(**{**REAL_LIMITS, "model": DEFAULT, "more_models": [tiny], "memory_budget_bytes": budget}))
    with TestClient(app) as test_client:
        deadline = time.monotonic() + 300
        while app.state.service.load_error is None and time.monotonic() < deadline:
            time.sleep(0.1)
        ready = test_client.get("/health/ready")
    assert ready.status_code == 503
    assert "do not fit the memory budget" in ready.text and DEFAULT in ready.text and "tiny-gte" in ready.text


def test_each_client_reaches_each_model_by_name(tiny, tmp_path):
    with running_server(tmp_path / "server.log", "--no-warmup", "--model", DEFAULT, "--model", tiny) as (base, _):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == [DEFAULT, "tiny-gte"]
        for name, dim in ((DEFAULT, DEFAULT_DIM), ("tiny-gte", DIM)):
            assert len(client.embeddings.create(model=name, input="hello").data[0].embedding) == dim
            assert len(ollama.Client(host=base, timeout=120).embed(model=name, input="hello").embeddings[0]) == dim


def test_metrics_count_each_models_requests_and_batches(client):
    before = scrape(client.get("/metrics").text)
    for _ in range(2):
        assert client.post("/v1/embeddings", json={"input": "x", "model": "tiny-gte"}).status_code == 200
    assert client.post("/embed", json={"inputs": "x"}).status_code == 200
    after = scrape(client.get("/metrics").text)

    def grew(family: str, sample: str, **labels) -> float:
        was = before[family]["samples"].get((sample, frozenset(labels.items())), 0.0)
        return value(after, family, sample, **labels) - was

    assert grew("clusterserve_model_requests", "clusterserve_model_requests_total", model="tiny-gte", code="200") == 2
    assert grew("clusterserve_model_requests", "clusterserve_model_requests_total", model=DEFAULT, code="200") == 1
    duration = "clusterserve_model_inference_duration_seconds"
    assert grew(duration, duration + "_count", model="tiny-gte") == 2
    assert grew(duration, duration + "_count", model=DEFAULT) == 1
    for model in (DEFAULT, "tiny-gte"):
        assert value(after, "clusterserve_model_inflight_requests", "clusterserve_model_inflight_requests", model=model) == 0
    assert value(after, "clusterserve_inflight_requests", "clusterserve_inflight_requests") == 0
