"""Ollama's real clients, unchanged, against the real server (`clusterserve serve`) serving the
default model, nomic-embed-text-v1.5 from its GGUF, under Ollama's name for it,
"nomic-embed-text": `ollama.Client(host=...)`, LangChain's `OllamaEmbeddings` and LlamaIndex's
`OllamaEmbedding`. Each checks the dimensions, that a query vector and a document vector differ
as they should (nomic's users write `search_query: ` / `search_document: ` themselves: no
prompt is added, so the same text gives the same vector whichever method embeds it), and the
errors. One input is checked against llama.cpp on the same GGUF.

The server runs in float32, so that exact attention is compared with llama.cpp's at the
0.9999 that the default model's own llama.cpp test holds. Skips loudly where the GGUF (or, for
the parity test, llama-cpp-python) is missing; under CI it fails instead (tests/default_model).
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from default_model import require_default_model, require_llama_cpp
from server_process import running_server
from service_helpers import license_text

ollama = pytest.importorskip("ollama")

NAME = "nomic-embed-text"
DIM = 768
QUERY = "What does clustered attention do to the cost of long inputs?"
RELEVANT = (
    "Clustered attention groups the queries into clusters and computes attention once per "
    "centroid, so its cost grows linearly with the sequence length instead of quadratically."
)
UNRELATED = "The recipe calls for two cups of flour, a pinch of salt and an hour in a warm oven."
PARITY_TEXT = "search_document: " + license_text(2000)  # ~400 tokens of real prose

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    require_default_model()
    log = tmp_path_factory.mktemp("ollama") / "server.log"
    with running_server(log, "--dtype", "float32", model=None, ready_timeout_s=600) as (url, _process):
        yield url


@pytest.fixture(scope="module")
def client(base):
    return ollama.Client(host=base, timeout=300)


def unit(rows) -> np.ndarray:
    return np.asarray(rows, dtype=np.float64)


def check_query_and_documents(query: np.ndarray, relevant: np.ndarray, unrelated: np.ndarray) -> None:
    """A search_query: vector is nearer the document that answers it than an unrelated one."""
    for vector in (query, relevant, unrelated):
        assert vector.shape == (DIM,)
        assert abs(np.linalg.norm(vector) - 1.0) < 1e-5
    assert query @ relevant > query @ unrelated + 0.1, (query @ relevant, query @ unrelated)


# --- the ollama package ----------------------------------------------------------------


def test_ollama_client_embed(client, base):
    response = client.embed(
        model=NAME, input=["search_query: " + QUERY, "search_document: " + RELEVANT, "search_document: " + UNRELATED]
    )
    assert response.model == NAME
    vectors = unit(response.embeddings)
    assert vectors.shape == (3, DIM)
    check_query_and_documents(*vectors)
    assert response.prompt_eval_count > 60 and response.total_duration > 0 and response.load_duration == 0
    # The text is embedded as written: the user's search_query: is /v1/embeddings' query prompt.
    with httpx.Client(base_url=base, timeout=300) as http:
        openai = http.post("/v1/embeddings", json={"input": QUERY, "prompt_name": "query"}).json()
    np.testing.assert_allclose(vectors[0], unit(openai["data"][0]["embedding"]), atol=1e-6)
    # Without a prefix, no prompt: not the document prompt /v1/embeddings adds by default.
    bare = unit(client.embed(model=NAME, input=RELEVANT).embeddings[0])
    assert 0.5 < bare @ vectors[1] < 0.999

    cut = client.embed(model=f"{NAME}:latest", input="search_query: " + QUERY, dimensions=256)
    cut_vector = unit(cut.embeddings[0])
    assert cut_vector.shape == (256,) and abs(np.linalg.norm(cut_vector) - 1.0) < 1e-5
    np.testing.assert_allclose(cut_vector, vectors[0][:256] / np.linalg.norm(vectors[0][:256]), atol=1e-5)

    legacy = unit(client.embeddings(model=NAME, prompt="search_query: " + QUERY).embedding)
    assert legacy.shape == (DIM,) and abs(np.linalg.norm(legacy) - 1.0) > 0.1  # not normalised, as Ollama's
    np.testing.assert_allclose(legacy / np.linalg.norm(legacy), vectors[0], atol=1e-5)


def test_ollama_client_list_and_show(client):
    names = [m.model for m in client.list().models]
    assert names == [f"{NAME}:latest", "nomic-embed-text-v1.5:latest"]
    shown = client.show(NAME)
    assert shown.capabilities == ["embedding"]
    assert shown.modelinfo["nomic-bert.embedding_length"] == DIM
    assert shown.modelinfo["nomic-bert.context_length"] == 8192
    assert shown.details.family == "nomic-bert" and shown.details.parameter_size == "137M"


def test_ollama_client_errors(client):
    with pytest.raises(ollama.ResponseError) as unknown:
        client.embed(model="mxbai-embed-large", input="a")
    assert unknown.value.status_code == 404
    assert unknown.value.error == 'model "mxbai-embed-large" not found, try pulling it first'
    with pytest.raises(ollama.ResponseError) as too_long:  # refused before it runs
        client.embed(model=NAME, input="word " * 9000, truncate=False)
    assert too_long.value.status_code == 413 and "more than the limit of 8192" in too_long.value.error
    with pytest.raises(ollama.ResponseError) as empty_item:
        client.embed(model=NAME, input=["a", ""])
    assert empty_item.value.status_code == 400 and empty_item.value.error == "input[1]: must not be empty"
    with pytest.raises(ollama.ResponseError) as not_shown:
        client.show("llama3")
    assert not_shown.value.status_code == 404 and not_shown.value.error == "model 'llama3' not found"
    assert client.embed(model=NAME, input=[]).embeddings == []  # what a client sends to load a model


# --- LangChain ---------------------------------------------------------------------------


def test_langchain_ollama_embeddings(base, client):
    langchain_ollama = pytest.importorskip("langchain_ollama")

    embedder = langchain_ollama.OllamaEmbeddings(model=NAME, base_url=base, validate_model_on_init=True)
    documents = unit(embedder.embed_documents(["search_document: " + RELEVANT, "search_document: " + UNRELATED]))
    query = unit(embedder.embed_query("search_query: " + QUERY))
    assert documents.shape == (2, DIM)
    check_query_and_documents(query, *documents)
    # Neither method adds a prompt: the same text is the same vector, the ollama client's.
    np.testing.assert_array_equal(unit(embedder.embed_query(RELEVANT)), unit(embedder.embed_documents([RELEVANT])[0]))
    np.testing.assert_array_equal(query, unit(client.embed(model=NAME, input="search_query: " + QUERY).embeddings[0]))

    short = langchain_ollama.OllamaEmbeddings(model=NAME, base_url=base, dimensions=64).embed_query("search_query: " + QUERY)
    assert len(short) == 64

    with pytest.raises(ValueError, match="not found"):  # checked against /api/tags
        langchain_ollama.OllamaEmbeddings(model="mxbai-embed-large", base_url=base, validate_model_on_init=True)
    with pytest.raises(ollama.ResponseError) as unknown:
        langchain_ollama.OllamaEmbeddings(model="mxbai-embed-large", base_url=base).embed_query("a")
    assert unknown.value.status_code == 404


# --- LlamaIndex ----------------------------------------------------------------------------


def test_llama_index_ollama_embedding(base, client):
    module = pytest.importorskip("llama_index.embeddings.ollama")

    embedder = module.OllamaEmbedding(
        model_name=NAME, base_url=base, query_instruction="search_query:", text_instruction="search_document:"
    )
    query = unit(embedder.get_query_embedding(QUERY))
    relevant, unrelated = unit(embedder.get_text_embedding_batch([RELEVANT, UNRELATED]))
    check_query_and_documents(query, relevant, unrelated)
    # LlamaIndex writes the instruction in front of the text; the server adds nothing more.
    expected = unit(client.embed(model=NAME, input="search_query: " + QUERY).embeddings[0])
    np.testing.assert_array_equal(query, expected)
    # The same text as a query and as a document: near, not equal.
    as_document = unit(embedder.get_text_embedding(QUERY))
    assert 0.6 < query @ as_document < 0.999, query @ as_document

    with pytest.raises(ollama.ResponseError) as unknown:
        module.OllamaEmbedding(model_name="mxbai-embed-large", base_url=base).get_query_embedding("a")
    assert unknown.value.status_code == 404


# --- llama.cpp on the same GGUF ------------------------------------------------------------


def test_one_input_equals_llama_cpp_on_the_same_gguf(base, client):
    llama_cpp = require_llama_cpp()
    llama = llama_cpp.Llama(
        model_path=str(require_default_model()), embedding=True, n_ctx=2048, n_batch=2048, n_ubatch=2048,
        n_threads=2, verbose=False,
    )  # fmt: skip
    reference = np.asarray(llama.embed(PARITY_TEXT), dtype=np.float64)  # pooled, not normalised
    tokens = len(llama.tokenize(PARITY_TEXT.encode(), add_bos=True, special=False))
    assert 300 < tokens < 2048

    with httpx.Client(base_url=base, timeout=300) as http:
        exact = http.post("/api/embed", json={"model": NAME, "input": PARITY_TEXT, "attention": {"method": "full"}})
        raw = http.post("/api/embeddings", json={"model": NAME, "prompt": PARITY_TEXT, "attention": {"method": "full"}})
        default = http.post("/api/embed", json={"model": NAME, "input": PARITY_TEXT})
    assert exact.json()["prompt_eval_count"] == tokens
    ours = unit(exact.json()["embeddings"][0])
    cosine = float(ours @ reference / np.linalg.norm(reference))
    assert cosine >= 0.9999, cosine
    legacy = unit(raw.json()["embedding"])  # Ollama's legacy route: llama.cpp's pooled vector itself
    assert abs(np.linalg.norm(legacy) / np.linalg.norm(reference) - 1) < 1e-3
    assert float(legacy @ reference) / np.linalg.norm(legacy) / np.linalg.norm(reference) >= 0.9999

    # The default attention runs exact attention at this length, so the client gets the same.
    assert json.loads(default.headers["x-attention"])["method"] == "full"
    via_client = unit(client.embed(model=NAME, input=PARITY_TEXT).embeddings[0])
    np.testing.assert_allclose(via_client, ours, atol=1e-6)
    print(f"parity with llama.cpp at {tokens} tokens: cosine {cosine:.8f}")
