"""/metrics: every series of DESIGN.md before the first request, and counting after it."""

from __future__ import annotations

import pytest
from service_helpers import FakeEncoder, fake_app, running, scrape, value

from clusterserve.kernels import fallbacks

# DESIGN.md's metrics table: name -> (type, labels).
SERIES = {
    "clusterserve_requests": ("counter", {"endpoint", "method", "code"}),
    "clusterserve_request_duration_seconds": ("histogram", {"endpoint", "method"}),
    "clusterserve_queue_duration_seconds": ("histogram", {"method"}),
    "clusterserve_inference_duration_seconds": ("histogram", {"method"}),
    "clusterserve_input_tokens": ("histogram", {"method"}),
    "clusterserve_chunks": ("histogram", {"method"}),
    "clusterserve_batch_size": ("histogram", {"method"}),
    "clusterserve_batch_tokens": ("histogram", {"method"}),
    "clusterserve_peak_memory_bytes": ("histogram", {"method"}),
    "clusterserve_queue_depth": ("gauge", set()),
    "clusterserve_inflight_requests": ("gauge", set()),
    "clusterserve_device_memory_bytes": ("gauge", {"kind"}),
    "clusterserve_request_failures": ("counter", {"reason"}),
    "clusterserve_build_info": ("gauge", {"version", "model", "device", "backend", "dtype"}),
    # The scheduler's (docs/metrics.md): layers run, batches under way, inputs stopped part-way.
    "clusterserve_layers": ("counter", set()),
    "clusterserve_running_batches": ("gauge", set()),
    "clusterserve_stopped_inputs": ("counter", {"reason"}),
    # CUDA graphs (docs/metrics.md): events, and batch shapes captured now; 0 without graphs.
    "clusterserve_cuda_graph_events": ("counter", {"event"}),
    "clusterserve_cuda_graph_signatures": ("gauge", set()),
    # Kernel calls that fell back to a slower path (kernels.fallbacks), process-wide.
    "clusterserve_kernel_fallbacks": ("counter", {"kernel", "reason"}),
}


@pytest.mark.anyio
async def test_every_series_before_the_first_request_and_counts_after():
    app, encoder = fake_app()
    async with running(app) as http:
        response = await http.get("/metrics")
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/plain")
        before = scrape(response.text)
        for name, (kind, labels) in SERIES.items():
            assert name in before, name
            assert before[name]["type"] == kind, name
            names = {label for (_, label_set) in before[name]["samples"] for label, _ in label_set}
            assert labels <= names | {"le"}, (name, names)
        for method in ("full", "clustered", "i-clustered", "smyrf"):
            inference = ("clusterserve_inference_duration_seconds", "clusterserve_inference_duration_seconds_count")
            assert value(before, *inference, method=method) == 0
        assert value(before, "clusterserve_requests", "clusterserve_requests_total",
                     endpoint="/v1/embeddings", method="full", code="200") == 0
        assert value(before, "clusterserve_build_info", "clusterserve_build_info",
                     version=app.version, model="fake-encoder", device="cpu", backend=FakeEncoder.backend,
                     dtype="float32") == 1
        assert value(before, "clusterserve_device_memory_bytes", "clusterserve_device_memory_bytes", kind="rss") > 0
        assert value(before, "clusterserve_request_failures", "clusterserve_request_failures_total", reason="invalid_field") == 0
        for event in ("captured", "replayed", "failed", "evicted"):
            assert value(before, "clusterserve_cuda_graph_events", "clusterserve_cuda_graph_events_total", event=event) == 0
        assert value(before, "clusterserve_cuda_graph_signatures", "clusterserve_cuda_graph_signatures") == 0
        fallback = ("clusterserve_kernel_fallbacks", "clusterserve_kernel_fallbacks_total")
        key = {"kernel": "centroid_triton", "reason": "topk_over_on_chip"}
        assert value(before, *fallback, **key) == fallbacks.counts()[tuple(key.values())]
        fallbacks.record(*key.values())
        after = scrape((await http.get("/metrics")).text)
        assert value(after, *fallback, **key) == value(before, *fallback, **key) + 1

        ok = await http.post("/v1/embeddings", json={"input": ["hello world", "abc"], "attention": {"method": "full"}})
        assert ok.status_code == 200
        bad = await http.post("/embed", json={"inputs": "a", "attention": {"clusters": 0}})
        assert bad.status_code == 422
        after = scrape((await http.get("/metrics")).text)

    assert value(after, "clusterserve_requests", "clusterserve_requests_total",
                 endpoint="/v1/embeddings", method="full", code="200") == 1
    assert value(after, "clusterserve_requests", "clusterserve_requests_total",
                 endpoint="/embed", method="none", code="422") == 1
    assert value(after, "clusterserve_request_duration_seconds", "clusterserve_request_duration_seconds_count",
                 endpoint="/v1/embeddings", method="full") == 1
    # Both inputs ran in one batch of 4 + 3 tokens.
    assert value(after, "clusterserve_batch_size", "clusterserve_batch_size_sum", method="full") == 2
    assert value(after, "clusterserve_batch_tokens", "clusterserve_batch_tokens_sum", method="full") == 7
    assert value(after, "clusterserve_input_tokens", "clusterserve_input_tokens_count", method="full") == 2
    assert value(after, "clusterserve_input_tokens", "clusterserve_input_tokens_sum", method="full") == 7
    assert value(after, "clusterserve_queue_duration_seconds", "clusterserve_queue_duration_seconds_count", method="full") == 2
    inference = ("clusterserve_inference_duration_seconds", "clusterserve_inference_duration_seconds_count")
    assert value(after, *inference, method="full") == 1
    assert value(after, "clusterserve_peak_memory_bytes", "clusterserve_peak_memory_bytes_count", method="full") == 1
    assert value(after, "clusterserve_request_failures", "clusterserve_request_failures_total", reason="invalid_field") == 1
    assert value(after, "clusterserve_queue_depth", "clusterserve_queue_depth") == 0
    assert value(after, "clusterserve_inflight_requests", "clusterserve_inflight_requests") == 0
    assert len(encoder.calls) == 1


def test_real_model_metrics_count_per_method(client):
    def count(text, method):
        families = scrape(text)
        return value(families, "clusterserve_inference_duration_seconds",
                     "clusterserve_inference_duration_seconds_count", method=method)

    before = client.get("/metrics").text
    # cluster_size 1: approximate even for a text this short (one SMYRF cluster would be exact)
    smyrf = {"method": "smyrf", "cluster_size": 1}
    response = client.post("/v1/embeddings", json={"input": "a short text", "attention": smyrf})
    assert response.status_code == 200
    after = client.get("/metrics").text
    assert count(after, "smyrf") == count(before, "smyrf") + 1
    peak = value(scrape(after), "clusterserve_peak_memory_bytes", "clusterserve_peak_memory_bytes_sum", method="smyrf")
    assert peak >= int(response.headers["x-peak-memory-bytes"]) > 10**7  # the weights alone are ~90 MB
