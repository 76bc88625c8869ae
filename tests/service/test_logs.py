"""One access line per request, with its id, route, status, tokens and times; JSON when asked;
never the API key."""

from __future__ import annotations

import json
import logging

import pytest
from service_helpers import fake_app, running

from clusterserve.service.logs import ACCESS_FIELD, JsonFormatter

KEY = "sk-very-secret-key"


@pytest.mark.anyio
async def test_one_json_access_line_per_request_with_its_id_and_never_the_key(caplog):
    app, _ = fake_app(api_key=KEY)
    auth = {"Authorization": f"Bearer {KEY}", "x-request-id": "req-42"}
    async with running(app) as http:
        with caplog.at_level(logging.INFO, logger="clusterserve.access"):
            assert (await http.post("/v1/embeddings", json={"input": "hello world"}, headers=auth)).status_code == 200
            wrong = {"Authorization": "Bearer sk-wrong-key-xyz"}
            assert (await http.post("/embed", json={"inputs": "a"}, headers=wrong)).status_code == 401
    lines = [r for r in caplog.records if r.name == "clusterserve.access"]
    assert len(lines) == 2
    ok, refused = (json.loads(JsonFormatter().format(r)) for r in lines)
    assert ok["request_id"] == "req-42"
    assert (ok["http_method"], ok["route"], ok["status"], ok["attention"]) == ("POST", "/v1/embeddings", 200, "full")
    assert ok["tokens"] == "4" and float(ok["queue_ms"]) >= 0 and float(ok["inference_ms"]) >= 0
    assert ok["total_ms"] > 0 and ok["level"] == "info" and ok["ts"].endswith("Z")
    assert (refused["route"], refused["status"]) == ("/embed", 401) and len(refused["request_id"]) == 32
    everything = caplog.text + "".join(JsonFormatter().format(r) for r in caplog.records)
    assert KEY not in everything and "sk-wrong-key-xyz" not in everything
    assert all(hasattr(r, ACCESS_FIELD) for r in lines)


def test_log_format_setting(monkeypatch):
    from clusterserve.service.settings import Settings

    assert Settings().log_format == "text"
    monkeypatch.setenv("CLUSTERSERVE_LOG_FORMAT", "json")
    assert Settings().log_format == "json"
    monkeypatch.setenv("CLUSTERSERVE_LOG_FORMAT", "xml")
    with pytest.raises(ValueError, match="log_format"):
        Settings()
