"""Fixtures of the deployment tests: the real server on a free loopback port, started as the
image starts it (`clusterserve serve`, without warm-up to save time), and what it exports."""

from __future__ import annotations

from collections import defaultdict

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_process import running_server


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """{"base": "http://127.0.0.1:PORT", "port": PORT} of a ready server."""
    log_path = tmp_path_factory.mktemp("deploy-server") / "server.log"
    with running_server(log_path, "--no-warmup", ready_timeout_s=600) as (base, _process):
        yield {"base": base, "port": int(base.rsplit(":", 1)[1]), "log": log_path}


@pytest.fixture(scope="session")
def exported(server) -> dict[str, set[str]]:
    """Sample name -> label names, from one scrape of the running server's /metrics."""
    response = httpx.get(server["base"] + "/metrics", timeout=60)
    response.raise_for_status()
    labels: dict[str, set[str]] = defaultdict(set)
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels[sample.name].update(sample.labels)
    return dict(labels)
