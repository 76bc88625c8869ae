"""The `chunking` extension (/v1/embeddings, /embed), Jina's `late_chunking` form and
/embed_all, in-process: against the real default model (the session app, 1024-token limit)
for the vectors, spans and errors, and against the arithmetic fake encoder for the limits and
the chunks histogram."""

from __future__ import annotations

import base64
import re

import numpy as np
import pytest
import torch
from service_helpers import fake_app, license_text, running, scrape, value

from clusterserve.kernels import AttentionSpec
from clusterserve.models.planning.chunk_plan import plan_late_inputs
from clusterserve.models.planning.chunking import ChunkingSpec

DOCUMENT = license_text(1500)  # ~300 tokens of real prose
FULL = {"method": "full"}


def chunk_items(response) -> list[dict]:
    assert response.status_code == 200, response.text
    return response.json()["data"]


def test_openai_chunking_returns_one_item_per_chunk_with_its_spans(client):
    chunking = {"size": 64, "overlap": 8}
    response = client.post("/v1/embeddings", json={"input": [DOCUMENT, "A short text."], "chunking": chunking, "attention": FULL})
    items = chunk_items(response)
    encoder = client.app.state.service.encoder
    expected = encoder.embed_chunks([DOCUMENT, "A short text."], AttentionSpec(method="full"), ChunkingSpec(**chunking))
    assert [(item["index"], item["chunk"]) for item in items] == [
        (i, j) for i, one in enumerate(expected) for j in range(len(one.chunks))
    ]
    assert len(expected[0].chunks) > 4 and len(expected[1].chunks) == 1
    vectors = np.array([item["embedding"] for item in items], dtype=np.float32)
    np.testing.assert_allclose(vectors, torch.cat([one.vectors for one in expected]).numpy(), atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    tokens = client.post("/tokenize", json={"inputs": DOCUMENT}).json()[0]
    for item in items[: len(expected[0].chunks)]:
        start, stop = item["token_span"]
        first, last = tokens[start], tokens[stop - 1]
        assert not first["special"] and not last["special"]
        assert item["text_span"] == [first["start"], last["stop"]]
    spans = [item["token_span"] for item in items[: len(expected[0].chunks)]]
    assert spans[0][0] == 1 and spans[-1][1] == len(tokens) - 1
    assert all(b[0] <= a[1] <= b[0] + 8 for a, b in zip(spans, spans[1:])), "chunks share at most 8 tokens"
    assert response.json()["usage"]["prompt_tokens"] == len(tokens) + 6 == int(response.headers["x-input-tokens"])


def test_naive_chunks_are_the_chunks_embedded_alone_and_base64_agrees(client):
    request = {"input": DOCUMENT, "chunking": {"size": 100, "late": False, "boundaries": "tokens"}, "attention": FULL}
    items = chunk_items(client.post("/v1/embeddings", json=request))
    ids = [t["id"] for t in client.post("/tokenize", json={"inputs": DOCUMENT}).json()[0]]
    start, stop = items[1]["token_span"]
    assert stop - start == 100
    alone = chunk_items(client.post("/v1/embeddings", json={"input": [ids[0], *ids[start:stop], ids[-1]], "attention": FULL}))
    np.testing.assert_allclose(items[1]["embedding"], alone[0]["embedding"], atol=1e-6)
    encoded = chunk_items(client.post("/v1/embeddings", json={**request, "encoding_format": "base64"}))
    decoded = np.stack([np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4") for item in encoded])
    np.testing.assert_array_equal(decoded, np.array([item["embedding"] for item in items], dtype=np.float32))


def test_embed_chunking_answers_chunk_objects_per_input(client):
    chunking = {"size": 80, "boundaries": "paragraphs"}
    tei = client.post("/embed", json={"inputs": [DOCUMENT, "Two."], "chunking": chunking, "attention": FULL, "normalize": False})
    assert tei.status_code == 200, tei.text
    per_input = tei.json()
    assert [len(chunks) for chunks in per_input][1] == 1 and len(per_input[0]) > 2
    assert set(per_input[0][0]) == {"chunk", "embedding", "text_span", "token_span"}
    assert [c["chunk"] for c in per_input[0]] == list(range(len(per_input[0])))
    request = {"input": [DOCUMENT, "Two."], "chunking": chunking, "attention": FULL}
    openai_items = chunk_items(client.post("/v1/embeddings", json=request))
    raw = np.array([c["embedding"] for chunks in per_input for c in chunks])
    assert abs(np.linalg.norm(raw[0]) - 1) > 1e-3  # normalize: false
    normalised = raw / np.linalg.norm(raw, axis=1, keepdims=True)
    np.testing.assert_allclose(normalised, np.array([item["embedding"] for item in openai_items]), atol=1e-5)
    assert [c["text_span"] for c in per_input[0]] == [item["text_span"] for item in openai_items[: len(per_input[0])]]


def test_jina_late_chunking_returns_one_vector_per_input(client):
    pieces = ["Clustered attention groups the queries.", " Each cluster attends once.", " The members share it."]
    body = {"input": pieces, "late_chunking": True, "attention": FULL, "chunking": {"window": 256, "window_overlap": 32}}
    items = chunk_items(client.post("/v1/embeddings", json=body))
    assert [item["index"] for item in items] == [0, 1, 2] and "chunk" not in items[0]
    encoder = client.app.state.service.encoder
    call = plan_late_inputs(encoder, pieces, AttentionSpec(method="full"), window=256, window_overlap=32)
    expected = torch.nn.functional.normalize(encoder.run_chunks(call)[0], dim=-1)
    np.testing.assert_allclose(np.array([item["embedding"] for item in items]), expected.numpy(), atol=1e-6)
    # Each input in context differs from the input embedded alone.
    alone = chunk_items(client.post("/v1/embeddings", json={"input": pieces, "attention": FULL}))
    assert all(abs(np.dot(a["embedding"], b["embedding"]) - 1) > 1e-4 for a, b in zip(items, alone))


def test_embed_all_returns_every_tokens_state(client):
    texts = ["Hello world.", "Clustered attention for long documents."]
    response = client.post("/embed_all", json={"inputs": texts, "attention": FULL})
    assert response.status_code == 200, response.text
    per_input = response.json()
    tokens = client.post("/tokenize", json={"inputs": texts}).json()
    assert [len(states) for states in per_input] == [len(t) for t in tokens]
    assert all(len(state) == 384 for states in per_input for state in states)
    encoder = client.app.state.service.encoder
    ids = [[t["id"] for t in row] for row in tokens]
    expected = encoder.token_states(ids, [AttentionSpec(method="full")] * 2)
    for got, want in zip(per_input, expected):
        np.testing.assert_allclose(np.array(got), want.numpy(), atol=1e-5)
    assert int(response.headers["x-input-tokens"]) == sum(len(t) for t in tokens)
    assert response.headers["x-attention"] == '{"method":"full"}'


def test_fidelity_with_chunking_reports_one_cosine_per_chunk(client):
    attention = {"method": "clustered", "clusters": 8}
    body = {"input": DOCUMENT, "chunking": {"size": 100, "window": 200}, "attention": attention, "fidelity": True}
    response = client.post("/v1/embeddings", json=body)
    items = chunk_items(response)
    cosines = [float(c) for c in response.headers["x-fidelity"].split(",")]
    assert len(cosines) == len(items) > 2 and [item["fidelity"] for item in items] == pytest.approx(cosines)
    assert all(0.5 < c < 1 - 1e-6 for c in cosines)
    exact = chunk_items(client.post("/v1/embeddings", json={**body, "attention": FULL, "fidelity": False}))
    np.testing.assert_allclose(
        cosines, [np.dot(a["embedding"], b["embedding"]) for a, b in zip(items, exact)], atol=1e-5
    )  # fmt: skip


@pytest.mark.parametrize(
    "route, body, param",
    [
        ("/v1/embeddings", {"input": "x", "chunking": {"size": 0}}, "chunking.size"),
        ("/v1/embeddings", {"input": "x", "chunking": {"size": 16, "overlap": 16}}, "chunking.overlap"),
        ("/v1/embeddings", {"input": "x", "chunking": {"overlap": 300}}, "chunking.overlap"),
        ("/v1/embeddings", {"input": "x", "chunking": {"boundaries": "words"}}, "chunking.boundaries"),
        ("/v1/embeddings", {"input": "x", "chunking": {"late": "yes"}}, "chunking.late"),
        ("/v1/embeddings", {"input": "x", "chunking": {"window": 2000}}, "chunking.window"),
        ("/v1/embeddings", {"input": "x", "chunking": {"window": 2}}, "chunking.window"),
        ("/v1/embeddings", {"input": "x", "chunking": {"window": 100, "window_overlap": 98}}, "chunking.window_overlap"),
        ("/v1/embeddings", {"input": "x", "chunking": {"size": 1023, "late": False}}, "chunking.size"),
        ("/v1/embeddings", {"input": "x", "chunking": {"sizes": 8}}, "chunking.sizes"),
        ("/v1/embeddings", {"input": [[101, 102]], "chunking": {}}, "chunking"),
        ("/v1/embeddings", {"input": [7592, 2088], "late_chunking": True}, "late_chunking"),
        ("/v1/embeddings", {"input": ["a", "b"], "late_chunking": True, "chunking": {"size": 8}}, "chunking.size"),
        ("/v1/embeddings", {"input": "x", "late_chunking": "yes"}, "late_chunking"),
        ("/embed", {"inputs": "x", "chunking": {"overlap": -1}}, "chunking.overlap"),
        ("/embed_all", {"inputs": "x", "normalize": True}, "normalize"),
        ("/embed_all", {"inputs": "x", "attention": {"clusters": 0}}, "attention.clusters"),
    ],
)  # fmt: skip
def test_a_bad_chunking_field_is_a_422_naming_it(client, route, body, param):
    response = client.post(route, json=body)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(param + ": "), error


def test_a_text_with_no_token_is_one_chunk_but_no_piece_of_jinas_form(client):
    response = client.post("/v1/embeddings", json={"input": ["fine", "   "], "chunking": {}})
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [(d["index"], d["chunk"]) for d in data][-1] == (1, 0) and sum(d["index"] == 1 for d in data) == 1
    # In Jina's form the pieces are one text's chunks: a piece with no token cannot be one.
    response = client.post("/v1/embeddings", json={"input": ["fine", "   "], "late_chunking": True})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == "input[1]" and "has no tokens" in error["message"], error


def test_info_states_the_chunking_defaults_and_bounds(client):
    info = client.get("/info").json()
    limits = info["limits"]
    assert limits["max_request_tokens"] > 0 and limits["max_request_chunks"] > 0 and limits["max_embed_all_tokens"] > 0
    chunking = info["chunking"]
    assert chunking["defaults"]["window"] == 512 and chunking["defaults"]["late"] is True
    assert chunking["boundaries"] == ["tokens", "sentences", "paragraphs"]
    assert chunking["defaults"]["window_overlap"] < chunking["defaults"]["window"]


def test_every_window_counts_toward_the_work_budget(client):
    """A document that fits the budget as one pass is refused (422, before it runs) when late
    chunking would run it as many heavily overlapping windows; the message counts them."""
    text = license_text(6000)  # cut to the session's 1024 tokens
    plain = client.post("/v1/embeddings", json={"input": text, "truncate": True, "attention": FULL})
    assert plain.status_code == 200, plain.text
    windows = {"size": 64, "window": 128, "window_overlap": 120}  # 8 new tokens a window: ~128 windows
    body = {"input": text, "truncate": True, "attention": FULL, "chunking": windows}
    response = client.post("/v1/embeddings", json=body)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == "input" and "over its budget" in error["message"]
    assert re.search(r"1 input\(s\), run as \d{3} sequences,", error["message"]), error["message"]
    assert "chunking.window_overlap" in error["message"]
    sparse = {**body, "chunking": {"size": 64, "window": 128, "window_overlap": 16}}  # ~10 windows
    assert client.post("/v1/embeddings", json=sparse).status_code == 200


@pytest.mark.anyio
async def test_limits_and_the_chunks_histogram():
    app, encoder = fake_app(max_request_chunks=6, max_request_tokens=200, max_embed_all_tokens=12)
    async with running(app) as http:
        before = scrape((await http.get("/metrics")).text)
        assert value(before, "clusterserve_chunks", "clusterserve_chunks_count", method="full") == 0
        text = "One sentence here. " * 9  # 37 tokens with [CLS] and [SEP]
        ok = await http.post("/v1/embeddings", json={"input": text, "chunking": {"size": 8, "boundaries": "tokens"}})
        assert ok.status_code == 200, ok.text
        assert [item["chunk"] for item in ok.json()["data"]] == [0, 1, 2, 3, 4]
        too_many = await http.post("/v1/embeddings", json={"input": text, "chunking": {"size": 4}})
        assert too_many.status_code == 413 and too_many.json()["error"]["param"] == "input"
        assert "chunks" in too_many.json()["error"]["message"]
        windows = {"input": text, "chunking": {"size": 8, "window": 8, "window_overlap": 5}}  # 3 new tokens a window
        too_long = await http.post("/v1/embeddings", json=windows)
        assert too_long.status_code == 413 and "tokens" in too_long.json()["error"]["message"]
        assert (await http.post("/embed_all", json={"inputs": ["a b c", "d e f"]})).status_code == 200
        vectors = await http.post("/embed_all", json={"inputs": ["a b c d e f g", "h i j k l m n"]})
        assert vectors.status_code == 413 and "token vectors" in vectors.json()["error"]["message"]
        plain = await http.post("/embed", json={"inputs": [text] * 6})  # 222 tokens
        assert plain.status_code == 413 and plain.json()["error"]["param"] == "inputs"
        after = scrape((await http.get("/metrics")).text)
    assert value(after, "clusterserve_chunks", "clusterserve_chunks_count", method="full") == 1
    assert value(after, "clusterserve_chunks", "clusterserve_chunks_sum", method="full") == 5
