"""Settings from CLUSTERSERVE_* variables and `clusterserve serve` flags; CORS."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from service_helpers import fake_app, running

from clusterserve.kernels import AttentionSpec
from clusterserve.service.__main__ import parse_settings
from clusterserve.service.app import load_model
from clusterserve.service.settings import Settings


def test_defaults_match_the_contract(monkeypatch):
    for name in ("HOST", "PORT", "MODEL", "METHOD", "API_KEY", "TARGET_FIDELITY", "CUDA_GRAPHS", "CUDA_GRAPH_SIGNATURES"):
        monkeypatch.delenv(f"CLUSTERSERVE_{name}", raising=False)
    settings = Settings()
    assert (settings.host, settings.port, settings.model) == ("127.0.0.1", 8000, None)
    # A request that names nothing runs auto aiming at 0.98 through the calibration table.
    assert settings.default_spec() == AttentionSpec(method="auto") and settings.target_fidelity == 0.98
    assert settings.api_key is None and settings.cors_origins == []
    assert settings.cuda_graphs is True and settings.cuda_graph_signatures == 16  # used on CUDA only


def test_environment_variables(monkeypatch):
    monkeypatch.setenv("CLUSTERSERVE_PORT", "9123")
    monkeypatch.setenv("CLUSTERSERVE_METHOD", "smyrf")
    monkeypatch.setenv("CLUSTERSERVE_HASH_ROUNDS", "8")
    monkeypatch.setenv("CLUSTERSERVE_MAX_BATCH_TOKENS", "4096")
    monkeypatch.setenv("CLUSTERSERVE_CORS_ORIGINS", "http://a.example, http://b.example")
    monkeypatch.setenv("CLUSTERSERVE_API_KEY", "key-9f3a")
    monkeypatch.setenv("CLUSTERSERVE_LOG_LEVEL", "WARNING")
    settings = Settings()
    assert settings.port == 9123 and settings.max_batch_tokens == 4096
    assert settings.default_spec() == AttentionSpec(method="smyrf", hash_rounds=8)
    assert settings.cors_origins == ["http://a.example", "http://b.example"]
    assert settings.api_key.get_secret_value() == "key-9f3a" and "key-9f3a" not in repr(settings)
    assert settings.log_level == "warning"


@pytest.mark.parametrize("unset", ["", "none", "None"])
def test_an_empty_target_fidelity_leaves_auto_to_the_threshold(monkeypatch, unset):
    monkeypatch.setenv("CLUSTERSERVE_TARGET_FIDELITY", unset)
    assert Settings().target_fidelity is None


def test_flags_override_the_environment(monkeypatch):
    monkeypatch.setenv("CLUSTERSERVE_PORT", "9123")
    monkeypatch.setenv("CLUSTERSERVE_CLUSTERS", "50")
    settings = parse_settings(["--port", "9001", "--host", "127.0.0.2", "--topk", "8", "--no-warmup",
                               "--auto-threshold", "2048", "--auto-method", "smyrf", "--model", "/tmp"])
    assert (settings.port, settings.host, settings.warmup) == (9001, "127.0.0.2", False)
    assert settings.default_spec() == AttentionSpec(
        method="auto", clusters=50, topk=8, auto_threshold=2048, auto_method="smyrf"
    )
    assert str(settings.model) == "/tmp"


@pytest.mark.parametrize("word, on", [("on", True), ("off", False), ("true", True), ("0", False)])
def test_cuda_graphs_on_or_off_and_what_load_model_asks_for(monkeypatch, word, on):
    monkeypatch.setenv("CLUSTERSERVE_CUDA_GRAPHS", word)
    monkeypatch.setenv("CLUSTERSERVE_CUDA_GRAPH_SIGNATURES", "5")
    settings = Settings(device="cpu", dtype="float32")
    assert (settings.cuda_graphs, settings.cuda_graph_signatures, settings.cuda_graph_max_length) == (on, 5, 8192)
    asked = {}
    monkeypatch.setattr("clusterserve.models.load_encoder", lambda *args, **kwargs: asked.update(kwargs))
    load_model(settings)
    assert (asked["cuda_graphs"], asked["cuda_graph_max_length"]) == (5 if on else 0, 8192)
    assert parse_settings(["--no-cuda-graphs"]).cuda_graphs is False


@pytest.mark.parametrize(
    "kwargs, field",
    [({"clusters": 0}, "clusters"), ({"bits": 64}, "bits"), ({"method": "linear"}, "method"),
     ({"auto_method": "full"}, "auto_method"), ({"max_batch_tokens": 0}, "max_batch_tokens"),
     ({"device": "tpu9"}, "device"), ({"port": 70000}, "port"), ({"target_fidelity": 1.5}, "target_fidelity"),
     ({"cuda_graph_signatures": 0}, "cuda_graph_signatures"), ({"cuda_graph_max_length": 0}, "cuda_graph_max_length")],
)
def test_bad_settings_stop_start_up(kwargs, field):
    with pytest.raises(ValidationError, match=field):
        Settings(**kwargs)


def test_bad_flag_exits_with_a_message(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_settings(["--clusters", "0"])
    assert exit_info.value.code == 2
    assert "clusters" in capsys.readouterr().err


@pytest.mark.anyio
async def test_cors_exposes_the_timing_headers():
    app, _ = fake_app(cors_origins=["http://ui.example"])
    async with running(app) as http:
        preflight = await http.options(
            "/v1/embeddings",
            headers={"origin": "http://ui.example", "access-control-request-method": "POST"},
        )
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "http://ui.example"
        response = await http.post("/embed", json={"inputs": "a"}, headers={"origin": "http://ui.example"})
        exposed = response.headers["access-control-expose-headers"]
        assert "x-attention" in exposed and "x-total-time-ms" in exposed
        other = await http.post("/embed", json={"inputs": "a"}, headers={"origin": "http://evil.example"})
        assert "access-control-allow-origin" not in other.headers
