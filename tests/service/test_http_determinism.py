"""Same request and seed -> identical vectors, through the whole HTTP path."""

from __future__ import annotations

import pytest
from service_helpers import license_text

TEXT = license_text(1400)  # ~300 tokens: above the session app's auto threshold (256)
# Small knobs: the PyTorch reference of the clustered methods is slow on a shared CPU, and
# determinism does not depend on the number of clusters.
SMALL = {"clusters": 16, "topk": 16, "iterations": 5, "refine": 1, "hash_rounds": 2}


@pytest.mark.parametrize("method", ["full", "clustered", "i-clustered", "smyrf", "auto"])
def test_same_request_same_vectors(client, method):
    request = {"input": [TEXT], "encoding_format": "base64", "attention": {"method": method, "seed": 1234, **SMALL}}
    first = client.post("/v1/embeddings", json=request)
    second = client.post("/v1/embeddings", json=request)
    assert first.status_code == second.status_code == 200
    # base64 strings: equal only if every float32 bit is.
    assert first.json()["data"] == second.json()["data"]
    assert first.json()["attention"] == second.json()["attention"]


def test_seed_is_part_of_the_request(client):
    def run(seed):
        body = {"inputs": TEXT, "attention": {"method": "clustered", "clusters": 4, "seed": seed}}
        response = client.post("/embed", json=body)
        assert response.status_code == 200
        return response.json()[0], response.headers["x-attention"]

    a, echo_a = run(1)
    b, echo_b = run(2)
    assert '"seed":1' in echo_a and '"seed":2' in echo_b
    # Other random planes and initial centroids give other clusters, hence other vectors.
    assert a != b
    assert run(1)[0] == a


@pytest.mark.parametrize("method", ["full", "clustered", "i-clustered", "smyrf", "auto"])
def test_an_input_gets_the_same_attention_and_vector_alone_or_with_others(client, method):
    import numpy as np
    import torch

    from clusterserve.kernels import AttentionSpec

    attention = {"method": method, "seed": 1234, **SMALL}
    others = [license_text(300), TEXT, license_text(4000)[2000:]]  # ~60, ~300 and ~450 tokens

    def post(inputs):
        response = client.post("/v1/embeddings", json={"input": inputs, "attention": attention})
        assert response.status_code == 200, response.text
        body = response.json()
        echoes = body["attention"].get("inputs", [body["attention"]] * len(inputs))
        return np.array([d["embedding"] for d in body["data"]]), echoes

    alone, (echo,) = post([TEXT])
    together, echoes = post(others)
    assert echoes[1] == echo  # resolved by its own length, whatever else came with it
    if method == "auto":
        assert [e["method"] for e in echoes] == ["full", "i-clustered", "i-clustered"]  # threshold 256
    cosine = float(alone[0] @ together[1] / np.linalg.norm(alone[0]) / np.linalg.norm(together[1]))
    assert cosine >= 1 - 1e-6
    np.testing.assert_allclose(together[1], alone[0], atol=1e-6, rtol=0)
    # The Python API runs the same plan: the same vector.
    encoder = client.app.state.service.encoder
    spec = AttentionSpec(**{**attention, "auto_threshold": 256})
    python = encoder.embed(others, spec)
    np.testing.assert_allclose(python[1].numpy(), alone[0], atol=1e-6, rtol=0)
    assert torch.nn.functional.cosine_similarity(python, torch.tensor(together, dtype=torch.float32)).min() >= 1 - 1e-6
