"""The Grafana dashboard: every PromQL expression (panels and template variables) refers only to
metrics and labels that a running server exports, uses only real PromQL functions, and the
panels cover what operators need (issue: rate, latency quantiles, queue and inference time,
queue depth and in-flight, batching, peak memory, input lengths, failures)."""

from __future__ import annotations

import json
import re

import pytest
from deploy_helpers import DASHBOARD, PROMQL_AGGREGATIONS, PROMQL_FUNCTIONS, promql_names

# Added by Prometheus to every scraped series.
TARGET_LABELS = {"job", "instance"}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out += panel.get("panels", [])  # collapsed rows hold their panels
    return out


def targets(dashboard) -> list[tuple[str, dict]]:
    return [(p["title"], t) for p in panels(dashboard) for t in p.get("targets", [])]


def variable_queries(dashboard) -> list[str]:
    """The PromQL of query variables (`label_values(metric, label)` is Grafana's, not PromQL)."""
    out = []
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
            match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
            out.append(f"group by ({match.group(2)}) ({match.group(1)})" if match else query)
    return out


def test_dashboard_structure(dashboard):
    assert dashboard["uid"] == "clusterserve"
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for panel in panels(dashboard):
        assert panel["type"] in {"row", "timeseries", "stat", "heatmap", "table"}
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert panel["targets"], f"panel {panel['title']!r} has no query"
        x, w = panel["gridPos"]["x"], panel["gridPos"]["w"]
        assert 0 <= x and x + w <= 24


def test_every_expression_uses_only_exported_metrics_and_labels(dashboard, exported):
    expressions = [(title, t["expr"], t.get("legendFormat", "")) for title, t in targets(dashboard)]
    expressions += [("variable", query, "") for query in variable_queries(dashboard)]
    assert len(expressions) > 10
    for title, expr, legend in expressions:
        metrics, functions, labels = promql_names(expr)
        assert metrics, f"{title}: no metric in {expr!r}"
        unknown = metrics - exported.keys()
        assert not unknown, f"{title}: {sorted(unknown)} not exported by the server (expression {expr!r})"
        assert functions <= PROMQL_FUNCTIONS | PROMQL_AGGREGATIONS, f"{title}: {functions - PROMQL_FUNCTIONS}"
        known_labels = set().union(*(exported[m] for m in metrics)) | TARGET_LABELS
        assert labels <= known_labels, f"{title}: labels {labels - known_labels} not on {sorted(metrics)}"
        legend_labels = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))
        assert legend_labels <= known_labels, f"{title}: legend names {legend_labels - known_labels}"


def test_dashboard_covers_the_operator_questions(dashboard):
    exprs = [t["expr"] for _, t in targets(dashboard)]
    used = set().union(*(promql_names(e)[0] for e in exprs))
    required = {
        "clusterserve_requests_total",
        "clusterserve_request_failures_total",
        "clusterserve_request_duration_seconds_bucket",
        "clusterserve_queue_duration_seconds_bucket",
        "clusterserve_inference_duration_seconds_bucket",
        "clusterserve_queue_depth",
        "clusterserve_inflight_requests",
        "clusterserve_batch_size_bucket",
        "clusterserve_batch_tokens_bucket",
        "clusterserve_peak_memory_bytes_bucket",
        "clusterserve_input_tokens_bucket",
    }
    assert required <= used, f"missing panels for {sorted(required - used)}"
    # Request rate by method and status; failures by reason; latency p50/p95/p99 by method.
    assert any("clusterserve_requests_total" in e and re.search(r"by \(method, code\)", e) for e in exprs)
    assert any("clusterserve_request_failures_total" in e and "by (reason)" in e for e in exprs)
    for quantile in ("0.5", "0.95", "0.99"):
        assert any(e.startswith(f"histogram_quantile({quantile}, sum by (le, method) (rate(clusterserve_request_duration")
                   for e in exprs), f"no p{quantile} request latency by method"
    assert any("clusterserve_peak_memory_bytes_bucket" in e and "method" in promql_names(e)[2] for e in exprs)
