"""TEI's root route: `POST /` answers as `/embed` does, so that clients which post to the
server's URL as given get vectors. Checked with the real huggingface_hub `InferenceClient`
(the client behind LangChain's `HuggingFaceEndpointEmbeddings`) against a real server process
on a tiny NomicBERT checkpoint with prompts, behind an API key; and, in-process, that `/` and
`/embed` give the same answers and the same errors.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from server_process import running_server
from service_helpers import REAL_LIMITS, license_text, scrape, value
from tiny_checkpoints import DIM, make_checkpoint

huggingface_hub = pytest.importorskip("huggingface_hub")
pytest.importorskip("transformers")
from huggingface_hub.errors import HfHubHTTPError  # noqa: E402

KEY = "tei-client-test-key"
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Clustered attention for long documents."]
LONG = license_text(17000)  # ~3,300 tokens: past the checkpoint's 1024 positions


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = make_checkpoint("nomic-bert", tmp_path_factory.mktemp("nomic-bert"))
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    flags = ("--model", str(folder), "--device", "cpu", "--no-warmup", "--api-key", KEY)
    with running_server(log_path, *flags, ready_timeout_s=300) as (base, _):
        yield base


@pytest.fixture
def inference_client(server, monkeypatch):
    # tests/models sets HF_HUB_OFFLINE=1 for the whole session (nothing there may reach a hub),
    # and the client refuses every URL in offline mode, ours on the loopback too.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    return huggingface_hub.InferenceClient(model=server, token=KEY, timeout=120)


def _embed(server: str, **body) -> httpx.Response:
    return httpx.post(f"{server}/embed", json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=120)


def test_feature_extraction_gets_the_vectors_that_embed_returns(server, inference_client):
    one = inference_client.feature_extraction(TEXTS[0])
    assert isinstance(one, np.ndarray) and one.dtype == np.float32 and one.shape == (1, DIM)
    np.testing.assert_allclose(np.linalg.norm(one, axis=1), 1.0, atol=1e-5)
    both = inference_client.feature_extraction(TEXTS)
    assert both.shape == (2, DIM)
    expected = np.array(_embed(server, inputs=TEXTS).json(), dtype=np.float32)
    np.testing.assert_allclose(both, expected, atol=1e-6)
    np.testing.assert_allclose(one[0], expected[0], atol=1e-6)


def test_feature_extraction_parameters_reach_the_server(server, inference_client):
    query = inference_client.feature_extraction(TEXTS, prompt_name="query")
    np.testing.assert_allclose(query, np.array(_embed(server, inputs=TEXTS, prompt_name="query").json()), atol=1e-6)
    assert np.abs(query - inference_client.feature_extraction(TEXTS)).max() > 1e-3
    raw = inference_client.feature_extraction(TEXTS[0], normalize=False)
    assert abs(float(np.linalg.norm(raw)) - 1.0) > 1e-3
    left = inference_client.feature_extraction(LONG, truncate=True, truncation_direction="left")
    right = inference_client.feature_extraction(LONG, truncate=True, truncation_direction="right")
    assert left.shape == right.shape == (1, DIM) and np.abs(left - right).max() > 1e-3


def test_the_servers_errors_reach_the_client(server, inference_client):
    with pytest.raises(HfHubHTTPError) as unknown:
        inference_client.feature_extraction(TEXTS[0], prompt_name="passage")
    assert unknown.value.response.status_code == 422
    error = unknown.value.response.json()["error"]
    assert error["param"] == "prompt_name" and "'passage'" in error["message"]
    with pytest.raises(HfHubHTTPError) as too_long:
        inference_client.feature_extraction(LONG)
    assert too_long.value.response.status_code == 413
    stranger = huggingface_hub.InferenceClient(model=server, token="not-the-key", timeout=120)
    with pytest.raises(HfHubHTTPError) as unauthorized:
        stranger.feature_extraction(TEXTS[0])
    assert unauthorized.value.response.status_code == 401


# --- in-process: / is /embed -----------------------------------------------------------------

BODIES = [
    {"inputs": "hello"},
    {"inputs": ["hello", "a second, longer text about attention"], "normalize": False, "dimensions": 16},
    {"inputs": "word " * 2000, "truncate": True, "truncation_direction": "left", "attention": {"method": "smyrf"}},
    {"inputs": "hello", "fidelity": True, "attention": {"method": "clustered", "clusters": 2}},
]
ERRORS = [
    ({"inputs": ""}, 400),
    ({"inputs": []}, 400),
    ({"inputs": "word " * 2000}, 413),
    ({"inputs": ["x"] * (REAL_LIMITS["max_client_batch_size"] + 1)}, 413),
    ({"inputs": "hello", "prompt_name": "query"}, 422),  # the embedded model defines no prompts
    ({"inputs": "hello", "adapter": "retrieval.query"}, 422),
    ({"inputs": "hello", "attention": {"topk": 0}}, 422),
    ({"inputs": "hello", "encoding_format": "base64"}, 422),  # an OpenAI field: TEI's body has none
    ({"input": "hello"}, 422),
]
SAME_HEADERS = ("x-input-tokens", "x-attention", "x-fidelity")


@pytest.mark.parametrize("body", BODIES)
def test_root_answers_as_embed(client, body):
    embed, root = client.post("/embed", json=body), client.post("/", json=body)
    assert embed.status_code == root.status_code == 200, root.text
    np.testing.assert_array_equal(np.array(root.json()), np.array(embed.json()))
    for header in SAME_HEADERS:
        assert root.headers.get(header) == embed.headers.get(header), header


@pytest.mark.parametrize("body,status", ERRORS)
def test_root_refuses_as_embed(client, body, status):
    embed, root = client.post("/embed", json=body), client.post("/", json=body)
    assert embed.status_code == root.status_code == status, root.text
    assert root.json() == embed.json()


def test_root_is_documented_and_counted(client):
    paths = client.get("/openapi.json").json()["paths"]
    assert paths["/"]["post"]["requestBody"] == paths["/embed"]["post"]["requestBody"]
    assert client.get("/").status_code == 405

    def served() -> float:
        family = "clusterserve_requests"
        return value(scrape(client.get("/metrics").text), family, family + "_total", endpoint="/", code="200", method="full")

    before = served()
    assert client.post("/", json={"inputs": "hello", "attention": {"method": "full"}}).status_code == 200
    assert served() == before + 1
