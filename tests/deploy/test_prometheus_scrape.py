"""A real Prometheus (Debian's package) scrapes a real server, both on loopback.

Prometheus runs as a subprocess with the scrape job of deploy/prometheus/prometheus.yml,
retargeted at the test server, a one-second interval, a temporary data folder, and the
`namespace` and `pod` labels that the Prometheus Operator would add in a cluster. After some
embedding requests its HTTP API must return the request counter and a latency quantile by
method; the prometheus-adapter rule behind the HPA and every dashboard expression must run
on it and return series. Skipped when no `prometheus` binary is installed.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import time

import httpx
import pytest
import yaml
from deploy_helpers import ADAPTER_VALUES, DASHBOARD, PROMETHEUS_CONFIG
from server_process import free_port

METHODS = ("full", "clustered", "i-clustered", "smyrf")
# Knobs that keep each method approximate for TEXT (~70 tokens): a method exact by its knobs
# would run (and be counted as) full attention.
KNOBS = {"clustered": {"clusters": 8}, "i-clustered": {"clusters": 8, "topk": 8}, "smyrf": {"cluster_size": 16}}
REQUESTS_PER_METHOD = 3
NAMESPACE, POD = "clusterserve-test", "clusterserve-0"
TEXT = "Clustered attention groups the queries of a long document and attends once per cluster. " * 4


@pytest.fixture(scope="module")
def prometheus(server, tmp_path_factory):
    """Base URL of a Prometheus that scrapes `server` every second."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus binary not found: install Debian's `prometheus` package (.ci/run does)")
    folder = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    (job,) = config["scrape_configs"]
    (static,) = job["static_configs"]
    static["targets"] = [f"127.0.0.1:{server['port']}"]
    static["labels"] = {"namespace": NAMESPACE, "pod": POD}
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log_path = folder / "prometheus.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [binary, f"--config.file={folder / 'prometheus.yml'}", f"--storage.tsdb.path={folder / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: process.poll() is None and httpx.get(base + "/-/ready", timeout=2).status_code == 200,
                 180, lambda: f"Prometheus not ready (exit {process.poll()}):\n{log_path.read_text()}")
        wait_for(lambda: values(query(base, f'up{{job="{job["job_name"]}"}}')) == {(): 1.0}, 180,
                 lambda: f"target never up:\n{log_path.read_text()}")
        yield base
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def wait_for(condition, timeout_s: float, message) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if condition():
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(message())
        time.sleep(0.25)


def query(base: str, promql: str) -> list[dict]:
    response = httpx.get(base + "/api/v1/query", params={"query": promql}, timeout=60)
    body = response.json()
    assert response.status_code == 200 and body["status"] == "success", f"{promql!r}: {body}"
    assert body["data"]["resultType"] == "vector"
    return body["data"]["result"]


def values(result: list[dict], by: tuple[str, ...] = ()) -> dict[tuple[str, ...], float]:
    return {tuple(r["metric"].get(label, "") for label in by): float(r["value"][1]) for r in result}


@pytest.fixture(scope="module")
def traffic(server, prometheus) -> dict[str, int]:
    """Sends embedding requests of every method; returns the 200s per method once scraped."""
    sent = {method: 0 for method in METHODS}
    with httpx.Client(base_url=server["base"], timeout=600) as client:
        for method in METHODS:
            for _ in range(REQUESTS_PER_METHOD):
                body = {"input": [TEXT], "attention": {"method": method, **KNOBS.get(method, {})}}
                response = client.post("/v1/embeddings", json=body)
                assert response.status_code == 200, response.text
                sent[method] += 1
        assert client.post("/embed", json={"inputs": TEXT}).status_code == 200
    counter = 'sum by (method) (clusterserve_requests_total{endpoint="/v1/embeddings", code="200"})'
    expected = {(m,): float(n) for m, n in sent.items()}
    wait_for(lambda: {k: v for k, v in values(query(prometheus, counter), ("method",)).items() if v} == expected,
             180, lambda: f"counter never reached {expected}: {query(prometheus, counter)}")
    # One more scrape, so that the last interval holds samples after the requests.
    scrapes = 'count_over_time(up[1h])'
    seen = values(query(prometheus, scrapes))[()]
    wait_for(lambda: values(query(prometheus, scrapes))[()] > seen, 180, lambda: "Prometheus stopped scraping")
    return sent


def test_request_counter_by_method(prometheus, traffic):
    result = query(prometheus, 'sum by (method) (clusterserve_requests_total{endpoint="/v1/embeddings", code="200"})')
    counted = values(result, ("method",))
    for method, sent in traffic.items():
        assert counted[(method,)] == sent
    assert values(query(prometheus, 'sum(clusterserve_requests_total{endpoint="/embed", code="200"})')) == {(): 1.0}


def test_latency_quantile_by_method(prometheus, traffic):
    p95 = values(query(prometheus, "histogram_quantile(0.95, sum by (le, method) "
                                   '(rate(clusterserve_request_duration_seconds_bucket{endpoint="/v1/embeddings"}[10m])))'),
                 ("method",))
    for method in traffic:
        latency = p95[(method,)]
        assert math.isfinite(latency) and latency > 0, f"{method}: p95 {latency}"
    inference = values(query(prometheus, "histogram_quantile(0.5, sum by (le, method) "
                                         "(rate(clusterserve_inference_duration_seconds_bucket[10m])))"), ("method",))
    assert all(math.isfinite(inference[(m,)]) for m in traffic)


def test_adapter_rule_yields_the_per_pod_metric(prometheus, traffic):
    """The HPA's metric, queried the way prometheus-adapter queries it for one pod."""
    (rule,) = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]
    series = httpx.get(prometheus + "/api/v1/series", params={"match[]": rule["seriesQuery"]}, timeout=60).json()
    assert series["status"] == "success" and series["data"], f"no series for {rule['seriesQuery']}"
    name = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", rule["seriesQuery"]).group(0)
    promql = (rule["metricsQuery"].replace("<<.Series>>", name)
              .replace("<<.LabelMatchers>>", f'namespace="{NAMESPACE}",pod=~"{POD}"')
              .replace("<<.GroupBy>>", "pod"))
    assert "<<" not in promql, f"a template field the test does not fill: {promql}"
    per_pod = values(query(prometheus, promql), ("pod",))
    assert per_pod.keys() == {(POD,)} and per_pod[(POD,)] >= 0


def test_every_dashboard_expression_runs_and_returns_series(prometheus, traffic):
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for top in dashboard["panels"] for p in (top, *top.get("panels", []))]
    for panel in panels:
        for target in panel.get("targets", []):
            promql = target["expr"].replace("$__rate_interval", "10m").replace("$method", ".*")
            assert "$" not in promql, f"{panel['title']}: a dashboard variable the test does not fill: {promql}"
            assert query(prometheus, promql), f"{panel['title']}: no series for {promql!r}"
