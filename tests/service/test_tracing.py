"""OpenTelemetry traces (service.tracing): off unless OTEL_* variables configure them, and on the
wire: a real server process exports its spans over OTLP/HTTP to a receiver this test starts,
which decodes the protobuf as a collector does (opentelemetry-proto), not a mock of the SDK."""

from __future__ import annotations

import gzip
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest, ExportTraceServiceResponse
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from server_process import running_server
from service_helpers import license_text

from clusterserve.service.tracing import TracingConfigError, exporter_from_env

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


@pytest.mark.parametrize("env, traced", [
    ({}, False),
    ({"OTEL_SERVICE_NAME": "x"}, False),  # naming the service configures no exporter
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, True),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, False),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, False),
])  # fmt: skip
def test_traces_are_off_unless_the_otel_variables_ask(env, traced):
    exporter = exporter_from_env(env)
    assert isinstance(exporter, OTLPSpanExporter) if traced else exporter is None


@pytest.mark.parametrize("env, says", [
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "http/protobuf"),
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, "otlp, console or none"),
])  # fmt: skip
def test_what_the_server_cannot_export_fails_at_start_up(env, says):
    with pytest.raises(TracingConfigError, match=says):
        exporter_from_env(env)


class Receiver(ThreadingHTTPServer):
    """An OTLP/HTTP trace receiver on a free port: POST /v1/traces, protobuf, gzip or not."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.spans: list[tuple[dict, Span]] = []  # (resource attributes, span)
        self.lock = threading.Lock()

    def trace(self, trace_id: str) -> list[Span]:
        with self.lock:
            return [span for _, span in self.spans if span.trace_id.hex() == trace_id]


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        request = ExportTraceServiceRequest.FromString(body)
        with self.server.lock:
            for resource_spans in request.resource_spans:
                resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    self.server.spans += [(resource, span) for span in scope_spans.spans]
        answer = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200 if self.path == "/v1/traces" else 404)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args) -> None:
        pass


def attributes(span: Span) -> dict:
    values = {}
    for a in span.attributes:
        kind = a.value.WhichOneof("value")
        value = getattr(a.value, kind)
        values[a.key] = list(v.string_value for v in value.values) if kind == "array_value" else value
    return values


def wait_for(receiver: Receiver, trace_id: str, names: set[str], timeout_s: float = 60) -> list[Span]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        spans = receiver.trace(trace_id)
        if names <= {s.name for s in spans}:
            return spans
        time.sleep(0.1)
    raise AssertionError(f"spans of {trace_id} after {timeout_s:.0f} s: {sorted(s.name for s in receiver.trace(trace_id))}")


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    receiver = Receiver()
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.server_address[1]}",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_SERVICE_NAME": "clusterserve-test",
    }
    log_path = tmp_path_factory.mktemp("traced") / "server.log"
    try:
        with running_server(log_path, "--no-warmup", env=env) as (base, _):
            yield base, receiver
    finally:
        receiver.shutdown()


def test_a_chunked_request_is_one_trace_under_the_callers_span(traced):
    base, receiver = traced
    body = {"input": license_text(2500), "chunking": {"size": 64, "late": False}}
    headers = {"traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-01"}
    response = httpx.post(f"{base}/v1/embeddings", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    chunks = len(response.json()["data"])
    spans = wait_for(receiver, TRACE_ID, {"POST /v1/embeddings", "tokenize", "queue", "forward pass", "render"})
    (root,) = [s for s in spans if s.name == "POST /v1/embeddings"]
    assert root.parent_span_id.hex() == CALLER_SPAN and root.kind == Span.SPAN_KIND_SERVER
    said = attributes(root)
    assert said["http.response.status_code"] == 200 and said["http.route"] == "/v1/embeddings"
    assert said["clusterserve.chunks"] == chunks > 1
    assert said["clusterserve.input_tokens"] == int(response.headers["x-input-tokens"])
    assert said["clusterserve.attention.method"] == response.json()["attention"]["method"]  # what ran
    assert said["clusterserve.attention.requested"] == "auto"  # what was asked: the default
    assert said["clusterserve.request_id"] == response.headers["x-request-id"]
    children = [s for s in spans if s is not root]
    assert {s.parent_span_id for s in children} == {root.span_id}
    passes = [s for s in children if s.name == "forward pass"]
    assert sum(attributes(s)["clusterserve.sequences"] for s in passes) == chunks  # naive: a sequence a chunk
    for span in children:
        assert root.start_time_unix_nano <= span.start_time_unix_nano <= span.end_time_unix_nano <= root.end_time_unix_nano
    (queue,) = [s for s in children if s.name == "queue"]
    assert queue.end_time_unix_nano <= min(s.start_time_unix_nano for s in passes) + 1_000_000  # clocks read apart
    (resource, _), *_ = receiver.spans
    assert resource["service.name"] == "clusterserve-test"


def test_a_refused_request_is_traced_with_its_status_and_probes_are_not(traced):
    base, receiver = traced
    trace_id = "5" * 32
    headers = {"traceparent": f"00-{trace_id}-{CALLER_SPAN}-01"}
    assert httpx.get(f"{base}/health/ready", headers=headers).status_code == 200
    response = httpx.post(f"{base}/embed", json={"inputs": "x", "encoding_format": "int4"}, headers=headers)
    assert response.status_code == 422
    (span,) = wait_for(receiver, trace_id, {"POST /embed"})
    assert attributes(span)["http.response.status_code"] == 422
    assert span.status.code != span.status.STATUS_CODE_ERROR  # a client's error is not the server's
    assert not any(attributes(s).get("url.path", "").startswith("/health") for _, s in receiver.spans)
