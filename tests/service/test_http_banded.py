"""The banded method over HTTP: its knobs in the `attention` object, 422s naming them, its echo
and its ranges on /info."""

import json

import pytest


def assert_error(response, status: int, param: str | None, says: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    if says is not None:
        assert says in error["message"], error["message"]
    return error


@pytest.mark.parametrize(
    "knobs, param, says",
    [
        ({"band": -1}, "attention.band", "greater than or equal to 0"),
        ({"block": 0}, "attention.block", "greater than or equal to 1"),
        ({"sinks": 65}, "attention.sinks", "less than or equal to 64"),
        ({"far_blocks": 1025}, "attention.far_blocks", "less than or equal to 1024"),
        ({"far_blocks": -1}, "attention.far_blocks", "greater than or equal to 0"),
        ({"method": "auto", "target_fidelity": 0.99, "far_blocks": 2}, "attention.far_blocks", None),
        ({"band": "wide"}, "attention.band", None),
        ({"method": "auto", "target_fidelity": 0.99, "band": 2}, "attention.band", None),
    ],
)
def test_422_names_the_knob(client, knobs, param, says):
    body = {"input": "a", "attention": {"method": "banded", **knobs}}
    error = assert_error(client.post("/v1/embeddings", json=body), 422, param, says)
    assert error["message"].startswith(param)


def test_banded_runs_and_echoes_its_knobs(client):
    text = " ".join(["the licence grants the rights listed below"] * 40)  # ~300 tokens: approximate
    body = {"input": text, "attention": {"method": "banded", "band": 1, "block": 32, "sinks": 4, "far_blocks": 0}}
    response = client.post("/v1/embeddings", json=body)
    assert response.status_code == 200
    echo = {"method": "banded", "band": 1, "block": 32, "sinks": 4, "far_blocks": 0}
    assert json.loads(response.headers["x-attention"]) == echo
    body["attention"]["far_blocks"] = 2
    far = client.post("/v1/embeddings", json=body)
    assert json.loads(far.headers["x-attention"]) == {**echo, "far_blocks": 2}
    vectors = [r.json()["data"][0]["embedding"] for r in (response, far)]
    assert vectors[0] != vectors[1]  # two far blocks per query block attended exactly, not pooled
    short = client.post("/v1/embeddings", json={"input": "a", "attention": {"method": "banded"}})
    assert json.loads(short.headers["x-attention"])["method"] == "full"  # the band covers it: exact


def test_info_lists_the_knobs(client):
    knobs = client.get("/info").json()
    text = json.dumps(knobs)
    assert "banded" in text and '"band"' in text and '"sinks"' in text and '"far_blocks"' in text
