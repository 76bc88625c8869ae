"""OpenTelemetry traces of requests, off unless the standard OTEL_* variables configure them.

Tracing is on where OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set, or
OTEL_TRACES_EXPORTER names `otlp` or `console`; OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER=none
keep it off. Spans leave through the SDK's batch processor (OTEL_BSP_*) to an OTLP/HTTP
receiver as protobuf (OTEL_EXPORTER_OTLP_PROTOCOL `http/protobuf`, the only one served: `grpc`
is refused at start-up), with the exporter's own variables for endpoint, headers, timeout and
compression. OTEL_SERVICE_NAME (default `clusterserve`), OTEL_RESOURCE_ATTRIBUTES,
OTEL_TRACES_SAMPLER and OTEL_PROPAGATORS (default W3C `traceparent` and baggage) are the SDK's.

One trace a request (a `traceparent` header continues the caller's), every route but
/metrics and /health*:

    POST /v1/embeddings     SERVER span: the whole request, status, attention method, tokens
      tokenize              tokenizing the inputs and planning the request (chunks, attention, batches)
      queue                 from submit to the request's first forward pass
      forward pass          one a batch that ran some of its sequences, from the engine's timings
      render                building and printing the JSON body

The request span's tracer travels with the request's context (a context variable, copied into
the worker threads that plan and render), so code below the middleware opens child spans with
`child` and `record` and needs no tracer of its own; with tracing off both do nothing.
"""

from __future__ import annotations

import contextlib
import os
import time
from contextvars import ContextVar
from typing import Any, Iterator, Mapping

from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode

from .. import __version__

UNTRACED_PREFIXES = ("/metrics", "/health")  # scraped every few seconds: noise, not requests
_TRACER: ContextVar[trace.Tracer | None] = ContextVar("clusterserve_tracer", default=None)


class TracingConfigError(ValueError):
    """OTEL_* variables this server cannot honour (start-up fails with the message)."""


def exporter_from_env(env: Mapping[str, str]) -> SpanExporter | None:
    """The span exporter the OTEL_* variables in `env` ask for, or None (tracing off)."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    named = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if named == "none" or not (named or endpoint):
        return None
    if named == "console":
        return ConsoleSpanExporter()
    if named not in ("", "otlp"):
        raise TracingConfigError(f"OTEL_TRACES_EXPORTER={named!r}: this server exports otlp, console or none")
    protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf")
    if protocol.strip().lower() != "http/protobuf":
        raise TracingConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: this server sends OTLP over http/protobuf only")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()  # endpoint, headers, timeout and compression from the OTEL_* variables


class Tracing:
    """The server's tracer provider (None: tracing off) and the middleware's request spans."""

    def __init__(self) -> None:
        exporter = exporter_from_env(os.environ)
        self.provider: TracerProvider | None = None
        self.tracer: trace.Tracer | None = None
        if exporter is not None:
            resource = Resource.create({"service.version": __version__})  # with OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES
            if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):  # the SDK's "not named"
                resource = resource.merge(Resource({SERVICE_NAME: "clusterserve"}))
            self.provider = TracerProvider(resource=resource)
            self.provider.add_span_processor(BatchSpanProcessor(exporter))
            self.tracer = self.provider.get_tracer("clusterserve", __version__)

    @property
    def enabled(self) -> bool:
        return self.tracer is not None

    @contextlib.contextmanager
    def request_span(self, scope: Mapping[str, Any]) -> Iterator[trace.Span | None]:
        """The SERVER span of one HTTP request (None when off or untraced), current for
        everything the request runs; the caller names it by route and sets its status."""
        path = scope.get("path", "")
        if self.tracer is None or path.startswith(UNTRACED_PREFIXES):
            yield None
            return
        carrier = {key.decode("latin-1"): value.decode("latin-1") for key, value in scope.get("headers", [])}
        attributes = {"http.request.method": scope.get("method", ""), "url.path": path}
        with self.tracer.start_as_current_span(
            scope.get("method", "HTTP"), context=propagate.extract(carrier), kind=SpanKind.SERVER,
            attributes=attributes, record_exception=False, set_status_on_exception=False,
        ) as span:  # fmt: skip
            token = _TRACER.set(self.tracer)
            try:
                yield span
            finally:
                _TRACER.reset(token)

    def shutdown(self) -> None:
        """Export what is buffered, then stop (the lifespan's end)."""
        if self.provider is not None:
            self.provider.shutdown()


def finish_request_span(span: trace.Span, method: str, route: str | None, status: int, attributes: Mapping[str, Any]) -> None:
    """Name the request's span by its route and record its answer (a 5xx is an error)."""
    span.update_name(f"{method} {route}" if route else method)
    if route:
        span.set_attribute("http.route", route)
    span.set_attribute("http.response.status_code", status)
    span.set_attributes({key: value for key, value in attributes.items() if value is not None})
    if status >= 500:
        span.set_status(Status(StatusCode.ERROR))


@contextlib.contextmanager
def child(name: str, **attributes: Any) -> Iterator[None]:
    """A child span of the current request's span around the block; nothing when untraced."""
    tracer = _TRACER.get()
    if tracer is None:
        yield
        return
    with tracer.start_as_current_span(name, attributes=attributes):
        yield


def record(name: str, start: float, end: float, **attributes: Any) -> None:
    """A child span of the current request's span that ran from `start` to `end` (time.monotonic()
    seconds, as the engine times its passes); nothing when untraced."""
    tracer = _TRACER.get()
    if tracer is None:
        return
    offset = time.time_ns() - time.monotonic_ns()
    span = tracer.start_span(name, start_time=int(start * 1e9) + offset, attributes=attributes)
    span.end(end_time=int(end * 1e9) + offset)


def annotate(**attributes: Any) -> None:
    """Attributes of the current span (the request's, or the child open around the caller)."""
    if _TRACER.get() is not None:
        trace.get_current_span().set_attributes({key: value for key, value in attributes.items() if value is not None})
