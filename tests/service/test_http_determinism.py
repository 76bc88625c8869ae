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
