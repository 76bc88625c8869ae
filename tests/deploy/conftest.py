"""Fixtures of the deployment tests: the real server on a free loopback port, started as the
image starts it (`python -m service`, without warm-up to save time), and what it exports."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import defaultdict

import httpx
import pytest
from deploy_helpers import ROOT, free_port
from prometheus_client.parser import text_string_to_metric_families


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """{"base": "http://127.0.0.1:PORT", "port": PORT} of a ready server."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("deploy-server") / "server.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLUSTERSERVE_")}
    command = [sys.executable, "-m", "service", "--host", "127.0.0.1", "--port", str(port), "--no-warmup"]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if process.poll() is not None:
                pytest.fail(f"server exited with {process.returncode}:\n{log_path.read_text()}")
            try:
                if httpx.get(f"{base}/health/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not ready after 180 s:\n{log_path.read_text()}")
            time.sleep(0.2)
        yield {"base": base, "port": port, "log": log_path}
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)


@pytest.fixture(scope="session")
def exported(server) -> dict[str, set[str]]:
    """Sample name -> label names, from one scrape of the running server's /metrics."""
    response = httpx.get(server["base"] + "/metrics", timeout=10)
    response.raise_for_status()
    labels: dict[str, set[str]] = defaultdict(set)
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels[sample.name].update(sample.labels)
    return dict(labels)
