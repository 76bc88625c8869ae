"""The chunking fields and /embed_all with real clients against a real server process
(`clusterserve serve`): the official `openai` client and curl. huggingface_hub's
`InferenceClient` has no call for /embed_all (its `feature_extraction` posts /embed's body to
the root route), so curl stands for TEI-style clients there."""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import openai
import pytest
from server_process import running_server
from service_helpers import license_text

DOCUMENT = license_text(2500)  # ~500 tokens of real prose
CURL = shutil.which("curl")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    with running_server(log_path, "--no-warmup", "--max-input-tokens", "2048", ready_timeout_s=300) as (base, _):
        yield base


def test_openai_client_parses_chunks_and_jina_late_chunking(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=300)
    chunking = {"size": 96, "overlap": 16}
    response = client.embeddings.create(model="m", input=[DOCUMENT, "A short text."], extra_body={"chunking": chunking})
    items = response.data  # the client asked for base64 and decoded it
    assert len(items) > 4 and [item.index for item in items].count(1) == 1
    chunks = [item.model_extra for item in items if item.index == 0]
    assert [extra["chunk"] for extra in chunks] == list(range(len(chunks)))
    start, stop = chunks[1]["text_span"]
    assert 0 < start < stop <= len(DOCUMENT) and DOCUMENT[start:stop].strip() == DOCUMENT[start:stop]
    vectors = np.array([item.embedding for item in items], dtype=np.float32)
    assert vectors.shape == (len(items), 384)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    as_float = client.embeddings.create(
        model="m", input=[DOCUMENT, "A short text."], encoding_format="float", extra_body={"chunking": chunking}
    )
    np.testing.assert_array_equal(np.array([item.embedding for item in as_float.data], dtype=np.float32), vectors)

    pieces = ["Clustered attention groups queries.", " Each cluster attends once.", " Members share the result."]
    late = client.embeddings.create(model="m", input=pieces, extra_body={"late_chunking": True})
    assert [item.index for item in late.data] == [0, 1, 2] and late.usage.prompt_tokens > 10

    with pytest.raises(openai.UnprocessableEntityError) as caught:
        client.embeddings.create(model="m", input=DOCUMENT, extra_body={"chunking": {"size": 32, "overlap": 32}})
    assert caught.value.response.json()["error"]["param"] == "chunking.overlap"


@pytest.mark.skipif(CURL is None, reason="needs curl")
def test_curl_chunks_on_embed_and_token_vectors_on_embed_all(server):
    def curl(route: str, body: dict) -> tuple[int, object]:
        done = subprocess.run(
            [CURL, "-s", "-w", "\n%{http_code}", f"{server}{route}", "-H", "content-type: application/json",
             "-d", json.dumps(body)],
            capture_output=True, text=True, timeout=300, check=True,
        )  # fmt: skip
        payload, _, status = done.stdout.rpartition("\n")
        return int(status), json.loads(payload)

    status, per_input = curl("/embed", {"inputs": [DOCUMENT], "chunking": {"size": 128, "late": False}})
    assert status == 200 and len(per_input) == 1 and len(per_input[0]) >= 4
    first = per_input[0][0]
    assert set(first) == {"chunk", "embedding", "text_span", "token_span"} and len(first["embedding"]) == 384
    status, states = curl("/embed_all", {"inputs": ["Hello world.", "Long documents."]})
    assert status == 200 and [len(s) for s in states] == [5, 5] and len(states[0][0]) == 384
    status, error = curl("/embed", {"inputs": "x", "chunking": {"boundaries": "lines"}})
    assert status == 422 and error["error"]["param"] == "chunking.boundaries"
