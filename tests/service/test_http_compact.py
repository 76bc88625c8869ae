"""Compact vectors on the wire: encoding_format int8, uint8, binary and ubinary on
/v1/embeddings and /embed (chunk vectors included) are the codes models.compact makes of the
float vectors the same request returns, with the calibration GET /info publishes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from service_helpers import assert_error, license_text

from clusterserve.models.compact import FORMATS, compact

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Clustered attention for long documents."]


def floats(client, route: str, body: dict) -> np.ndarray:
    response = client.post(route, json=body)
    assert response.status_code == 200, response.text
    rows = response.json()
    rows = [item["embedding"] for item in rows["data"]] if route == "/v1/embeddings" else rows
    return np.array(rows, dtype=np.float32)


@pytest.fixture(scope="module")
def value_range(client) -> float:
    encodings = client.get("/info").json()["encodings"]
    assert encodings["formats"] == ["float", "base64", *FORMATS]
    assert encodings["int8_range_measured"] is True  # the embedded MiniLM is calibrated
    return encodings["int8_range"]


@pytest.mark.parametrize("encoding", FORMATS)
@pytest.mark.parametrize("route, field", [("/v1/embeddings", "input"), ("/embed", "inputs")])
def test_codes_are_the_float_vectors_encoded(client, value_range, route, field, encoding):
    body = {field: TEXTS, "dimensions": 100}
    expected = compact(torch.from_numpy(floats(client, route, body)), encoding, value_range).tolist()
    codes = floats(client, route, {**body, "encoding_format": encoding}).astype(np.int64).tolist()
    assert codes == expected
    width = 100 if encoding in ("int8", "uint8") else math.ceil(100 / 8)
    assert [len(row) for row in codes] == [width, width]
    low, high = {"int8": (-127, 127), "uint8": (1, 255), "binary": (-128, 127), "ubinary": (0, 255)}[encoding]
    assert low <= min(map(min, codes)) and max(map(max, codes)) <= high


def test_chunk_vectors_come_back_encoded_on_both_routes(client, value_range):
    text = license_text(3000)
    chunking = {"size": 128}
    items = client.post("/v1/embeddings", json={"input": text, "chunking": chunking}).json()["data"]
    packed = client.post("/v1/embeddings", json={"input": text, "chunking": chunking, "encoding_format": "ubinary"})
    assert packed.status_code == 200, packed.text
    chunked = packed.json()["data"]
    assert len(chunked) == len(items) > 2
    for item, float_item in zip(chunked, items):
        assert item["token_span"] == float_item["token_span"]
        signs = np.unpackbits(np.array(item["embedding"], dtype=np.uint8))[:384]
        np.testing.assert_array_equal(signs, np.array(float_item["embedding"]) > 0)
    (tei,) = client.post("/embed", json={"inputs": text, "chunking": chunking, "encoding_format": "int8"}).json()
    expected = compact(torch.tensor([c["embedding"] for c in items], dtype=torch.float32), "int8", value_range)
    assert [c["embedding"] for c in tei] == expected.tolist()


def test_int8_needs_unit_vectors_and_bits_do_not(client):
    for encoding in ("int8", "uint8"):
        response = client.post("/embed", json={"inputs": TEXTS, "normalize": False, "encoding_format": encoding})
        assert_error(response, 422, "encoding_format", says="normalize")
    raw = floats(client, "/embed", {"inputs": TEXTS, "normalize": False})
    bits = floats(client, "/embed", {"inputs": TEXTS, "normalize": False, "encoding_format": "ubinary"})
    np.testing.assert_array_equal(np.unpackbits(bits.astype(np.uint8), axis=-1)[:, :384], raw > 0)


@pytest.mark.parametrize("route, body", [
    ("/v1/embeddings", {"input": "a", "encoding_format": "int4"}),
    ("/embed", {"inputs": "a", "encoding_format": "base64"}),  # /embed answers JSON arrays only
])  # fmt: skip
def test_an_unknown_format_is_a_422_naming_the_field(client, route, body):
    assert_error(client.post(route, json=body), 422, "encoding_format")
