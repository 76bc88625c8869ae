"""Servers on tiny NomicBERT, GTE, Jina v3 and EuroBERT checkpoints (tests/service/tiny_checkpoints):
every attention method over /v1/embeddings; sentence-transformers prompts on /embed, / and
/v1/embeddings (named, default, unknown, counted toward the limit); Jina v3's task adapters
chosen by prompt name or by `adapter`; /info listing prompts and adapters.
"""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
from fastapi.testclient import TestClient
from service_helpers import license_text, wait_ready
from tiny_checkpoints import ARCHITECTURES, DIM, JINA_PROMPTS, JINA_TASKS, PLAIN_PROMPTS, PROMPTS, make_checkpoint

from clusterserve.service.app import create_app
from clusterserve.service.settings import Settings

pytest.importorskip("transformers")

LONG = license_text(2800)  # ~550 tokens: past auto's threshold below, within the 1024 positions
SHORT = "a short query about rotary positions"
AUTO_THRESHOLD = 256
# Coarse knobs, so that the approximations visibly differ from exact attention on ~550 tokens.
KNOBS = {
    "full": {},
    "clustered": {"clusters": 8},
    "i-clustered": {"clusters": 8, "topk": 16},
    "smyrf": {"hash_rounds": 2, "cluster_size": 32},
    "auto": {},
}


def _client(stack: contextlib.ExitStack, folder, **settings) -> TestClient:
    app = create_app(Settings(model=folder, device="cpu", warmup=False, auto_threshold=AUTO_THRESHOLD, **settings))
    client = stack.enter_context(TestClient(app))
    wait_ready(client)
    return client


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {arch: make_checkpoint(arch, tmp_path_factory.mktemp(arch)) for arch in ARCHITECTURES}


@pytest.fixture(scope="module")
def clients(folders):
    with contextlib.ExitStack() as stack:
        yield {arch: _client(stack, folder) for arch, folder in folders.items()}


def _vectors(response) -> np.ndarray:
    assert response.status_code == 200, response.text
    body = response.json()
    rows = body if isinstance(body, list) else [item["embedding"] for item in body["data"]]
    return np.array(rows, dtype=np.float32)


# --- every method ----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_method_answers_v1_embeddings(arch, clients):
    client = clients[arch]
    vectors = {}
    for method, knobs in KNOBS.items():
        body = {"input": [LONG, SHORT], "attention": {"method": method, **knobs}}
        response = client.post("/v1/embeddings", json=body)
        vectors[method] = _vectors(response)
        assert vectors[method].shape == (2, DIM)
        np.testing.assert_allclose(np.linalg.norm(vectors[method], axis=1), 1.0, atol=1e-5)
        echo = response.json()["attention"]
        assert json.loads(response.headers["x-attention"]) == echo
        assert response.json()["usage"]["prompt_tokens"] > AUTO_THRESHOLD
        if method == "auto":  # the long input past the threshold approximated, the short one exact
            assert echo["inputs"][0]["method"] != "full" and echo["inputs"][1]["method"] == "full"
        else:
            assert echo["method"] == method
    for method in ("clustered", "i-clustered", "smyrf"):
        # The long input is approximated: close to exact attention, not a copy of it.
        cosine = float(vectors[method][0] @ vectors["full"][0])
        assert 0.5 < cosine < 1 - 1e-7, (method, cosine)
    np.testing.assert_allclose(vectors["auto"][1], vectors["full"][1], atol=1e-6)


# --- prompts ---------------------------------------------------------------------------------


def _ids(client, texts):
    """Token ids of texts with their special tokens: what the server runs for them."""
    return [[t["id"] for t in row] for row in client.post("/tokenize", json={"inputs": texts}).json()]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_named_prompt_is_prepended_on_every_route(arch, clients):
    client = clients[arch]
    prompts, _, query = PROMPTS[arch]
    texts = [SHORT, "clustered attention"]
    adapter = query if query in JINA_TASKS else None  # Jina's query prompt is a task too
    # By hand: the prompt's text in front, sent as token ids (which get no prompt, not even a default).
    by_hand = {"input": _ids(client, [prompts[query] + t for t in texts]), "adapter": adapter}
    expected = _vectors(client.post("/v1/embeddings", json=by_hand))
    for route, field in (("/embed", "inputs"), ("/", "inputs"), ("/v1/embeddings", "input")):
        response = client.post(route, json={field: texts, "prompt_name": query})
        np.testing.assert_allclose(_vectors(response), expected, atol=1e-6, err_msg=route)
        assert response.headers["x-prompt-name"] == query
        assert response.headers.get("x-adapter") == adapter
        if route == "/v1/embeddings":
            assert (response.json()["prompt_name"], response.json()["adapter"]) == (query, adapter)
    without = _vectors(client.post("/v1/embeddings", json={"input": _ids(client, texts), "adapter": adapter}))
    assert np.abs(without - expected).max() > 1e-3  # the prompt changed the embeddings


def test_the_default_prompt_applies_when_none_is_named_and_is_shown(clients):
    client = clients["gte"]  # its config names default_prompt_name "document"
    info = client.get("/info").json()
    assert info["default_prompt_name"] == "document" and info["prompts"] == PLAIN_PROMPTS
    texts = [SHORT]
    default = client.post("/embed", json={"inputs": texts})
    named = client.post("/embed", json={"inputs": texts, "prompt_name": "document"})
    query = client.post("/embed", json={"inputs": texts, "prompt_name": "query"})
    assert default.headers["x-prompt-name"] == "document"
    np.testing.assert_allclose(_vectors(default), _vectors(named), atol=1e-6)
    assert np.abs(_vectors(default) - _vectors(query)).max() > 1e-3
    openai = client.post("/v1/embeddings", json={"input": texts})
    assert openai.json()["prompt_name"] == "document" and openai.json()["adapter"] is None
    # A text written with a prompt gets no default in front, and reports the prompt it carries;
    # where the default went in front of any text, the default is reported.
    written = [PLAIN_PROMPTS["query"] + SHORT]
    as_written = client.post("/embed", json={"inputs": written})
    assert as_written.headers["x-prompt-name"] == "query"
    np.testing.assert_allclose(_vectors(as_written), _vectors(query), atol=1e-6)
    assert client.post("/v1/embeddings", json={"input": written}).json()["prompt_name"] == "query"
    assert client.post("/embed", json={"inputs": written + texts}).headers["x-prompt-name"] == "document"
    both = [PLAIN_PROMPTS["query"] + SHORT, PLAIN_PROMPTS["document"] + SHORT]
    assert "x-prompt-name" not in client.post("/embed", json={"inputs": both}).headers
    # Token ids are the model's input as given: no prompt, none reported.
    ids = client.post("/v1/embeddings", json={"input": [101, 7592, 102]})
    assert ids.status_code == 200 and ids.json()["prompt_name"] is None and "x-prompt-name" not in ids.headers


@pytest.mark.parametrize("route,field", [("/embed", "inputs"), ("/", "inputs"), ("/v1/embeddings", "input")])
def test_an_unknown_prompt_is_a_422_that_names_it_and_lists_the_known_ones(route, field, clients):
    response = clients["nomic-bert"].post(route, json={field: SHORT, "prompt_name": "passage"})
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["param"] == "prompt_name"
    assert "'passage'" in error["message"] and "query, document" in error["message"]


def test_a_prompt_for_token_ids_is_a_422_naming_prompt_name(clients):
    response = clients["nomic-bert"].post("/v1/embeddings", json={"input": [101, 7592, 102], "prompt_name": "query"})
    assert response.status_code == 422
    assert response.json()["error"]["param"] == "prompt_name" and "token-id" in response.json()["error"]["message"]


def test_prompt_tokens_count_toward_the_limit(folders):
    limit = 16
    text = " ".join(["word"] * 12)  # 12 tokens + [CLS] [SEP] = 14 <= 16; "search_query: " adds 4
    with contextlib.ExitStack() as stack:
        client = _client(stack, folders["nomic-bert"], max_input_tokens=limit)
        for route, field in (("/embed", "inputs"), ("/", "inputs"), ("/v1/embeddings", "input")):
            assert client.post(route, json={field: text}).headers["x-input-tokens"] == "14"
            refused = client.post(route, json={field: text, "prompt_name": "query"})
            assert refused.status_code == 413, route
            assert refused.json()["error"]["param"] == field and "18 tokens" in refused.json()["error"]["message"]
            cut = client.post(route, json={field: text, "prompt_name": "query", "truncate": True})
            assert cut.status_code == 200 and cut.headers["x-input-tokens"] == str(limit)


# --- Jina v3's task adapters -----------------------------------------------------------------


def test_info_lists_prompts_and_adapters(clients):
    jina = clients["jina-embeddings-v3"].get("/info").json()
    assert jina["prompts"] == JINA_PROMPTS and jina["default_prompt_name"] is None
    assert jina["adapters"] == JINA_TASKS
    nomic = clients["nomic-bert"].get("/info").json()
    assert nomic["prompts"] == PLAIN_PROMPTS and nomic["adapters"] == []


def test_jina_prompt_names_select_their_task_adapter_and_adapter_selects_one_alone(clients):
    client = clients["jina-embeddings-v3"]
    query = JINA_PROMPTS["retrieval.query"]

    def embed(text, **fields):
        response = client.post("/embed", json={"inputs": text, **fields})
        return _vectors(response), response.headers.get("x-adapter")

    base, base_adapter = embed(query + SHORT)
    adapted, adapted_adapter = embed(query + SHORT, adapter="retrieval.query")
    by_prompt, prompt_adapter = embed(SHORT, prompt_name="retrieval.query")
    assert (base_adapter, adapted_adapter, prompt_adapter) == (None, "retrieval.query", "retrieval.query")
    assert np.abs(base - adapted).max() > 1e-3  # the adapter matters
    np.testing.assert_allclose(by_prompt, adapted, atol=1e-6)
    # An explicit adapter wins over the prompt's; a prompt that is no task runs the base weights.
    other, other_adapter = embed(SHORT, prompt_name="retrieval.query", adapter="retrieval.passage")
    assert other_adapter == "retrieval.passage" and np.abs(other - by_prompt).max() > 1e-3
    matching, matching_adapter = embed(SHORT, prompt_name="text-matching")
    assert matching_adapter is None
    np.testing.assert_allclose(matching, embed(SHORT)[0], atol=1e-6)
    # The same over the OpenAI route, token-id inputs included (adapter only: ids take no prompt).
    openai = client.post("/v1/embeddings", json={"input": SHORT, "prompt_name": "retrieval.query"})
    assert openai.json()["adapter"] == "retrieval.query"
    np.testing.assert_allclose(_vectors(openai), by_prompt, atol=1e-6)
    ids = client.post("/tokenize", json={"inputs": SHORT}).json()[0]
    by_ids = client.post("/v1/embeddings", json={"input": [t["id"] for t in ids], "adapter": "retrieval.passage"})
    assert by_ids.json()["adapter"] == "retrieval.passage" and by_ids.json()["prompt_name"] is None
    np.testing.assert_allclose(_vectors(by_ids), embed(SHORT, adapter="retrieval.passage")[0], atol=1e-6)


@pytest.mark.parametrize("arch,known", [("jina-embeddings-v3", "retrieval.query, retrieval.passage"), ("gte", "none")])
def test_an_unknown_adapter_is_a_422_naming_it(arch, known, clients):
    for route, field in (("/embed", "inputs"), ("/v1/embeddings", "input")):
        response = clients[arch].post(route, json={field: SHORT, "adapter": "summarization"})
        assert response.status_code == 422
        error = response.json()["error"]
        assert error["param"] == "adapter" and "'summarization'" in error["message"] and known in error["message"]
