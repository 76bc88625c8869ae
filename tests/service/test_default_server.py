"""The server as `make serve` starts it, with no model named: nomic-embed-text-v1.5 from its
GGUF, in the dtype `auto` picks, driven by the clients people use (the official openai
client, huggingface_hub's InferenceClient, plain HTTP as curl sends it): 768-d vectors with
nomic's prompts applied, queries and documents told apart, the 8,192-token limit as TEI users
expect (413 naming it, truncation when asked, chunking a document longer than the limit).
"""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
from default_model import require_default_model
from server_process import running_server
from service_helpers import license_text

from clusterserve.kernels import AttentionSpec

DOCUMENT = "Clustered attention groups similar queries so that long documents embed quickly."
QUERY = "how do long documents embed quickly?"
LONG = license_text(60000)  # ~12k tokens of real prose: past the 8,192-token limit


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require_default_model()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    with running_server(log_path, "--no-warmup", model=None, ready_timeout_s=600) as (base, _process):
        yield base


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=600) as client:
        yield client


@pytest.fixture(scope="module")
def reference():
    """The same model in-process, float32: what the prompts and vectors must match."""
    from clusterserve.models import load_encoder

    return load_encoder(None, dtype="float32")


def test_info_describes_the_default_model(http):
    info = http.get("/info").json()
    assert (info["model"], info["architecture"], info["dimension"]) == ("nomic-embed-text-v1.5", "nomic-bert", 768)
    assert (info["max_input_tokens"], info["native_positions"]) == (8192, 8192)
    assert info["position_scaling"] == {"type": "dynamic", "factor": 2.0, "trained_positions": 2048}
    assert info["default_prompt_name"] == "document" and info["prompts"]["query"] == "search_query: "


def test_openai_client_gets_768_d_vectors_with_the_document_prompt(server, reference):
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=600)
    response = client.embeddings.create(model="nomic-embed-text-v1.5", input=[DOCUMENT, QUERY])
    vectors = np.array([d.embedding for d in response.data], dtype=np.float32)
    assert vectors.shape == (2, 768)
    assert response.model_extra["prompt_name"] == "document"
    expected = reference.embed([DOCUMENT, QUERY], AttentionSpec(method="full"), prompt_name="document").numpy()
    # The server runs the default attention in its own dtype: within bfloat16's rounding of float32.
    assert (vectors * expected).sum(axis=1).min() >= 0.995
    # "search_query: " written by the user is kept, not doubled, and differs from the document prompt.
    as_query = client.embeddings.create(model="nomic-embed-text-v1.5", input="search_query: " + QUERY)
    named = client.embeddings.create(model="x", input=QUERY, extra_body={"prompt_name": "query"})
    q1, q2 = (np.array(r.data[0].embedding) for r in (as_query, named))
    assert q1 @ q2 >= 0.99999 and q1 @ vectors[1] < 0.999


def test_inference_client_feature_extraction(server, monkeypatch):
    pytest.importorskip("huggingface_hub")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    client = huggingface_hub.InferenceClient(model=server, timeout=600)
    vectors = client.feature_extraction([DOCUMENT, QUERY], prompt_name="query")
    assert np.asarray(vectors).shape == (2, 768)


def test_long_input_413_names_the_limit_truncate_and_chunking(http):
    refused = http.post("/embed", json={"inputs": LONG})
    assert refused.status_code == 413
    assert "8192" in refused.json()["error"]["message"]
    # The limits are what this checks: the cheap method keeps an 8k pass short on a slow CPU.
    cheap = {"method": "banded"}
    cut = http.post("/embed", json={"inputs": LONG, "truncate": True, "attention": cheap})
    assert cut.status_code == 200 and len(cut.json()[0]) == 768
    assert int(cut.headers["x-input-tokens"]) == 8192
    chunked = http.post("/embed", json={"inputs": LONG, "chunking": {"size": 2048}, "attention": cheap})
    assert chunked.status_code == 200, chunked.text
    chunks = chunked.json()[0]
    assert len(chunks) >= 5 and all(len(c["embedding"]) == 768 for c in chunks)
