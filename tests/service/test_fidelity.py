"""Per-request fidelity ("fidelity": true) and auto's target_fidelity over HTTP."""

from __future__ import annotations

import json

import anyio
import numpy as np
import pytest
from service_helpers import REAL_LIMITS, FakeEncoder, fake_app, license_text, running, scrape, value

from clusterserve.models.planning.calibration import FORMAT, load_calibration
from clusterserve.service.app import create_app
from clusterserve.service.settings import Settings

ICL = {"method": "i-clustered", "clusters": 8, "topk": 8, "iterations": 3, "refine": 1}


def _cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _fidelity_count(client, method: str) -> float:
    return value(scrape(client.get("/metrics").text), "clusterserve_fidelity", "clusterserve_fidelity_count", method=method)


def test_fidelity_equals_the_cosine_of_the_two_embeddings(client):
    text = license_text(3000)  # ~600 tokens
    before = _fidelity_count(client, "i-clustered")
    approx = client.post("/v1/embeddings", json={"input": [text], "attention": ICL, "fidelity": True})
    exact = client.post("/v1/embeddings", json={"input": [text], "attention": {"method": "full"}})
    assert approx.status_code == exact.status_code == 200, approx.text
    item = approx.json()["data"][0]
    expected = _cosine(item["embedding"], exact.json()["data"][0]["embedding"])
    assert item["fidelity"] == pytest.approx(expected, abs=1e-6)
    assert 0.5 < item["fidelity"] < 1.0 - 1e-6  # approximate, and not the exact run again
    assert float(approx.headers["x-fidelity"]) == pytest.approx(item["fidelity"], abs=1e-6)
    assert float(approx.headers["x-exact-time-ms"]) > 0
    assert _fidelity_count(client, "i-clustered") == before + 1


def test_tei_reports_fidelity_per_input_in_a_header(client):
    texts = [license_text(3000), license_text(2000)]
    body = {"inputs": texts, "attention": ICL, "fidelity": True}
    tei = client.post("/embed", json=body)
    openai = client.post("/v1/embeddings", json={"input": texts, "attention": ICL, "fidelity": True})
    assert tei.status_code == openai.status_code == 200, tei.text
    values = [float(v) for v in tei.headers["x-fidelity"].split(",")]
    assert values == pytest.approx([d["fidelity"] for d in openai.json()["data"]], abs=1e-6)


def test_inputs_that_ran_exact_attention_have_fidelity_one(client):
    # The session app's auto threshold is 256 tokens: the short input runs full, the long one not.
    texts = ["a short sentence", license_text(3000)]
    response = client.post(
        "/v1/embeddings", json={"input": texts, "attention": {**ICL, "method": "auto"}, "fidelity": True}
    )
    assert response.status_code == 200, response.text
    short, long = response.json()["data"]
    assert short["fidelity"] == 1.0 and long["fidelity"] < 1.0
    assert [i["method"] for i in response.json()["attention"]["inputs"]] == ["full", "i-clustered"]


def test_without_fidelity_nothing_extra_is_run_or_sent(client):
    response = client.post("/v1/embeddings", json={"input": "hello", "attention": ICL})
    assert "fidelity" not in response.json()["data"][0]
    assert "x-fidelity" not in response.headers and "x-exact-time-ms" not in response.headers


@pytest.mark.parametrize(
    "attention, param",
    [
        ({"method": "i-clustered", "target_fidelity": 0.99}, "attention.target_fidelity"),
        ({"target_fidelity": 0.99, "clusters": 50}, "attention.clusters"),
        ({"method": "auto", "target_fidelity": 0.99, "hash_rounds": 2}, "attention.hash_rounds"),
        ({"target_fidelity": 0}, "attention.target_fidelity"),
        ({"target_fidelity": 1.5}, "attention.target_fidelity"),
        ({"target_fidelity": "high"}, "attention.target_fidelity"),
    ],
)
def test_bad_target_fidelity_is_422_naming_the_field(client, attention, param):
    response = client.post("/v1/embeddings", json={"input": "hello", "attention": attention})
    assert response.status_code == 422, response.text
    assert response.json()["error"]["param"] == param


def test_fidelity_must_be_a_boolean(client):
    response = client.post("/embed", json={"inputs": "hello", "fidelity": "yes"})
    assert response.status_code == 422 and response.json()["error"]["param"] == "fidelity"


def _table(path, model="fake-encoder"):
    """Exact is fastest at 64 tokens; at 512, smyrf (0.95) and i-clustered (0.992) are faster."""
    configs = [
        {"attention": {"method": "smyrf"}, "fidelity_min": 0.95, "fidelity_mean": 0.96, "ms": 10.0},
        {"attention": {"method": "i-clustered", "clusters": 50}, "fidelity_min": 0.992, "fidelity_mean": 0.994, "ms": 20.0},
    ]
    table = {
        "format": FORMAT,
        "model": model,
        "device": "cpu",
        "buckets": [
            {"tokens": 64, "exact_ms": 1.0, "configs": configs},
            {"tokens": 512, "exact_ms": 100.0, "configs": configs},
        ],
    }
    path.write_text(json.dumps(table))
    return path


@pytest.mark.anyio
async def test_target_fidelity_picks_exact_short_and_the_fastest_faithful_long(tmp_path):
    encoder = FakeEncoder(max_input_tokens=1024)
    encoder.calibration = load_calibration(_table(tmp_path / "t.json"))
    app, encoder = fake_app(encoder)
    async with running(app) as http:
        info = (await http.get("/info")).json()["attention"]["calibration"]
        assert [b["tokens"] for b in info["frontier"]] == [64, 512]
        assert [p["attention"]["method"] for p in info["frontier"][1]["points"]] == ["smyrf", "i-clustered", "full"]

        texts = ["short text", "word " * 600]  # past the longest bucket: judged by it alone
        body = {"input": texts, "attention": {"target_fidelity": 0.99, "seed": 3}}
        response = await http.post("/v1/embeddings", json=body)
        assert response.status_code == 200, response.text
        short, long = response.json()["attention"]["inputs"]
        assert short["method"] == "full" and short["calibration_bucket"] == 64
        assert long["method"] == "i-clustered" and long["clusters"] == 50 and long["seed"] == 3
        assert (long["calibrated_fidelity"], long["calibrated_speedup"], long["calibration_bucket"]) == (0.992, 5.0, 512)
        # Each ran its own spec (in batches of their own: their work is unlike).
        assert sorted(spec.method for call in encoder.calls for spec in call["specs"]) == ["full", "i-clustered"]

        low = await http.post("/v1/embeddings", json={"input": texts[1], "attention": {"target_fidelity": 0.9}})
        assert low.json()["attention"]["method"] == "smyrf"
        high = await http.post("/v1/embeddings", json={"input": texts[1], "attention": {"target_fidelity": 0.999}})
        assert high.json()["attention"]["method"] == "full"
        assert json.loads(high.headers["x-attention"])["target_fidelity"] == 0.999


@pytest.mark.anyio
async def test_without_a_table_target_fidelity_falls_back_to_the_threshold():
    app, _ = fake_app(FakeEncoder(max_input_tokens=1024), auto_threshold=100, auto_method="smyrf")
    async with running(app) as http:
        assert (await http.get("/info")).json()["attention"]["calibration"] is None
        body = {"input": ["short", "word " * 300], "attention": {"target_fidelity": 0.99}}
        response = await http.post("/v1/embeddings", json=body)
        assert response.status_code == 200, response.text
        echo = response.json()["attention"]
        assert echo["target_fidelity"] == 0.99
        assert [(i["method"], i["calibrated_fidelity"]) for i in echo["inputs"]] == [("full", None), ("smyrf", None)]


@pytest.mark.anyio
@pytest.mark.parametrize("problem", ["missing", "malformed", "other model"])
async def test_a_bad_configured_table_fails_start_up_clearly(tmp_path, problem):
    path = tmp_path / "calibration.json"
    if problem == "malformed":
        path.write_text(json.dumps({"format": FORMAT, "model": "fake-encoder", "device": "cpu", "buckets": [{}]}))
    elif problem == "other model":
        _table(path, model="another-model")
    # The real loader: it reads the configured table with the model.
    app = create_app(Settings(warmup=False, max_input_tokens=512, calibration=path))
    async with running(app, ready=False) as http:
        with anyio.move_on_after(120):  # the load fails on the loader thread: wait for it, generously
            while "failed to load" not in (response := await http.get("/health/ready")).text:
                await anyio.sleep(0.01)
        assert response.status_code == 503
        message = response.json()["error"]["message"]
        assert "CalibrationError" in message and str(path) in message
        assert {"missing": "does not exist", "malformed": "buckets[0]", "other model": "another-model"}[problem] in message


@pytest.mark.anyio
@pytest.mark.parametrize("reference", ["startup", "off"])
async def test_the_float32_reference_loads_at_start_up_or_fidelity_is_refused(reference):
    """A bfloat16 server loads its float32 reference before it turns ready (never in the worker,
    while batches wait), or, told not to, answers "fidelity": true with a 422 naming it."""
    settings = {**REAL_LIMITS, "dtype": "bfloat16", "fidelity_reference": reference}
    app = create_app(Settings(**settings))
    async with running(app) as http:
        encoder = app.state.service.encoder
        assert (encoder._float32 is not None) == (reference == "startup")
        body = {"input": "a short sentence", "attention": {"method": "full"}, "fidelity": True}
        response = await http.post("/v1/embeddings", json=body)
        if reference == "startup":
            assert response.status_code == 200, response.text
            assert 0.99 < response.json()["data"][0]["fidelity"] <= 1.0 + 1e-6  # bfloat16 against float32
        else:
            assert response.status_code == 422 and response.json()["error"]["param"] == "fidelity"
            assert (await http.post("/v1/embeddings", json={"input": "a short sentence"})).status_code == 200
