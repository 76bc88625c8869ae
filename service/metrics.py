"""Prometheus metrics (DESIGN.md's table), one `CollectorRegistry` per app.

Every series is created when the app is built, labelled children included, so a scrape
before the first request already lists each name (dashboards and alerts need no
`absent()` guards). Labels stay low-cardinality: endpoints are route templates ("other"
for anything unrouted), methods are attention methods, reasons a fixed set.

Peak memory per batch is measured by the engine (engine.memory).
"""

from __future__ import annotations

import threading

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from clusterserve.engine.memory import read_proc_status
from clusterserve.kernels import APPROXIMATE_METHODS, METHODS, fallbacks
from clusterserve.models.runtime.graphs import EVENTS, LayerGraphs

from .errors import FAILURE_REASONS

# Labels of the endpoint series, pre-created at start-up.
INFERENCE_ENDPOINTS = (  # "/": TEI's root route, the same as /embed; /api/*: Ollama's; /models/*: a named model's TEI routes
    "/v1/embeddings", "/embed", "/", "/embed_all", "/api/embed", "/api/embeddings",
    "/models/{model}/embed", "/models/{model}", "/models/{model}/embed_all",
)
OTHER_ENDPOINTS = (
    "/v1/models",
    "/v1/models/{model}",
    "/tokenize",
    "/api/tags",
    "/api/show",
    "/api/version",
    "/info",
    "/health",
    "/health/live",
    "/health/ready",
    "/metrics",
    "other",
)
# "none" is the method label of requests that run no attention (tokenize, info, ...) or fail
# before their attention object is known.
NO_METHOD = "none"
RESOLVED_METHODS = tuple(m for m in METHODS if m != "auto")

STOP_REASONS = ("deadline", "disconnected")  # why a running input's work stopped
_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_TOKENS = tuple(float(2**i) for i in range(4, 17))  # 16 .. 65536
_BATCH = tuple(float(2**i) for i in range(0, 9))  # 1 .. 256
_BATCH_TOKENS = tuple(float(2**i) for i in range(6, 19))  # 64 .. 262144
_CHUNKS = tuple(float(2**i) for i in range(0, 13))  # 1 .. 4096
_FIDELITY = (0.5, 0.8, 0.9, 0.95, 0.97, 0.98, 0.99, 0.995, 0.998, 0.999, 1.0)
_BYTES = tuple(float(2**i) for i in range(26, 37))  # 64 MiB .. 64 GiB


class Metrics:
    """The service's series on a registry of its own (tests build several apps per process)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "clusterserve_requests", "HTTP requests answered", ["endpoint", "method", "code"], registry=r
        )
        self.request_duration = Histogram(
            "clusterserve_request_duration_seconds",
            "time from request arrival to response start",
            ["endpoint", "method"],
            buckets=_SECONDS,
            registry=r,
        )
        per_method = self._per_method
        self.queue_duration = per_method(
            "clusterserve_queue_duration_seconds", "time an input waited in the queue before its batch started", _SECONDS
        )
        self.inference_duration = per_method(
            "clusterserve_inference_duration_seconds", "time of one batch's forward pass", _SECONDS
        )
        self.input_tokens = per_method("clusterserve_input_tokens", "tokens per input (after truncation)", _TOKENS)
        self.batch_size = per_method("clusterserve_batch_size", "inputs per batch", _BATCH)
        self.batch_tokens = per_method("clusterserve_batch_tokens", "real (unpadded) tokens per batch", _BATCH_TOKENS)
        self.peak_memory = per_method(
            "clusterserve_peak_memory_bytes", "peak memory while a batch ran (CUDA allocator peak; CPU: process peak RSS)", _BYTES
        )
        self.chunks = per_method("clusterserve_chunks", "chunks per chunked input (chunking, late_chunking)", _CHUNKS)
        self.fidelity = per_method(
            "clusterserve_fidelity",
            'cosine of an approximate embedding to the exact one, per input of a "fidelity": true request',
            _FIDELITY,
        )
        self.failures = Counter("clusterserve_request_failures", "failed requests by reason", ["reason"], registry=r)
        self.layers = Counter("clusterserve_layers", "encoder layers run by the scheduler, over all batches", registry=r)
        self.stopped_inputs = Counter(
            "clusterserve_stopped_inputs",
            "inputs whose forward pass stopped part-way because their request passed its deadline or its client left",
            ["reason"],
            registry=r,
        )
        self.cuda_graph_events = Counter(
            "clusterserve_cuda_graph_events",
            "CUDA graphs: layers captured and replayed; batch shapes whose capture failed (they run eagerly) "
            "and batch shapes dropped by the LRU",
            ["event"],
            registry=r,
        )
        r.register(_KernelFallbacks())
        self._add_gauges()
        self._add_per_model()
        self._create_children()

    def _add_per_model(self) -> None:
        """Series by served model (a handful of names, set at start-up): each model's children
        appear when it is loaded (add_model)."""
        r = self.registry
        self.model_requests = Counter(
            "clusterserve_model_requests", "embedding requests answered, by the served model they named", ["model", "code"],
            registry=r,
        )  # fmt: skip
        self.model_inference_duration = Histogram(
            "clusterserve_model_inference_duration_seconds", "time of one batch's forward pass, by served model", ["model"],
            buckets=_SECONDS, registry=r,
        )  # fmt: skip
        self.model_inflight = Gauge(
            "clusterserve_model_inflight_requests", "embedding requests admitted and not yet answered, by served model",
            ["model"], registry=r,
        )  # fmt: skip
        # Per model, its scheduler's last (admitted, waiting, running): the unlabelled gauges are their sums.
        self._counts: dict[str, list[int]] = {}
        self._counts_lock = threading.Lock()

    def add_model(self, model: str) -> None:
        """Create a served model's series (at zero)."""
        self.model_inference_duration.labels(model=model)
        self.model_inflight.labels(model=model).set(0)
        for code in ("200",):
            self.model_requests.labels(model=model, code=code)
        with self._counts_lock:
            self._counts.setdefault(model, [0, 0, 0])

    def scheduler_counts(self, model: str, which: int, value: int) -> None:
        """One model's scheduler reports a count (0 admitted, 1 waiting, 2 running batches); the
        server-wide gauges show the sum over models."""
        with self._counts_lock:
            counts = self._counts.setdefault(model, [0, 0, 0])
            counts[which] = value
            total = sum(c[which] for c in self._counts.values())
        (self.inflight, self.queue_depth, self.running_batches)[which].set(total)
        if which == 0:
            self.model_inflight.labels(model=model).set(value)

    def _add_gauges(self) -> None:
        """The series that say what is now: queue, in-flight requests, memory, the build."""
        r = self.registry
        self.queue_depth = Gauge("clusterserve_queue_depth", "embedding requests waiting for their first batch", registry=r)
        self.inflight = Gauge("clusterserve_inflight_requests", "embedding requests admitted and not yet answered", registry=r)
        self.running_batches = Gauge(
            "clusterserve_running_batches", "batches whose forward pass is under way (they run a layer at a time)", registry=r
        )
        self.cuda_graph_signatures = Gauge(
            "clusterserve_cuda_graph_signatures", "batch shapes whose layers are captured in CUDA graphs now", registry=r
        )
        self.device_memory = Gauge(
            "clusterserve_device_memory_bytes",
            "memory now: CUDA allocated and reserved (0 on CPU), process RSS",
            ["kind"],
            registry=r,
        )
        self.build_info = Gauge(
            "clusterserve_build_info",
            "always 1; labels describe the build",
            ["version", "model", "device", "backend", "dtype"],
            registry=r,
        )

    def _per_method(self, name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
        """A histogram labelled by attention method, on this registry."""
        return Histogram(name, documentation, ["method"], buckets=buckets, registry=self.registry)

    def _create_children(self) -> None:
        for endpoint in INFERENCE_ENDPOINTS:
            for method in (*METHODS, NO_METHOD):
                self.requests.labels(endpoint=endpoint, method=method, code="200")
                self.request_duration.labels(endpoint=endpoint, method=method)
        for endpoint in OTHER_ENDPOINTS:
            self.requests.labels(endpoint=endpoint, method=NO_METHOD, code="200")
            self.request_duration.labels(endpoint=endpoint, method=NO_METHOD)
        for method in RESOLVED_METHODS:
            for family in (
                self.queue_duration,
                self.inference_duration,
                self.input_tokens,
                self.batch_size,
                self.batch_tokens,
                self.peak_memory,
                self.chunks,
            ):
                family.labels(method=method)
        for method in APPROXIMATE_METHODS:
            self.fidelity.labels(method=method)
        for kind in ("allocated", "reserved", "rss"):
            self.device_memory.labels(kind=kind)
        for reason in FAILURE_REASONS:
            self.failures.labels(reason=reason)
        for reason in STOP_REASONS:
            self.stopped_inputs.labels(reason=reason)
        for event in EVENTS:
            self.cuda_graph_events.labels(event=event)

    def cuda_graph_event(self, event: str) -> None:
        """Count one of models.runtime.graphs.EVENTS (the encoder's graphs call it)."""
        self.cuda_graph_events.labels(event=event).inc()

    def update_graphs(self, graphs: LayerGraphs | None) -> None:
        """Refresh the captured-signatures gauge (called on each scrape)."""
        self.cuda_graph_signatures.set(0 if graphs is None else graphs.signatures)

    def set_build_info(self, version: str, models: list[tuple[str, str, str, str]]) -> None:
        """One series a served model: its (name, device, backend, dtype)."""
        self.build_info.clear()
        for model, device, backend, dtype in models:
            self.build_info.labels(version=version, model=model, device=device, backend=backend, dtype=dtype).set(1)

    def update_memory(self, device: torch.device | None) -> None:
        """Refresh the memory gauges (called on each scrape)."""
        allocated = reserved = 0
        if device is not None and device.type == "cuda":
            allocated = torch.cuda.memory_allocated(device)
            reserved = torch.cuda.memory_reserved(device)
        self.device_memory.labels(kind="allocated").set(allocated)
        self.device_memory.labels(kind="reserved").set(reserved)
        rss = read_proc_status("VmRSS")
        if rss is not None:
            self.device_memory.labels(kind="rss").set(rss)


class _KernelFallbacks:
    """clusterserve_kernel_fallbacks_total, read at scrape time from kernels.fallbacks (the
    counts are process-wide: kernels know nothing of the service)."""

    def describe(self):
        return [CounterMetricFamily("clusterserve_kernel_fallbacks", "", labels=["kernel", "reason"])]

    def collect(self):
        family = CounterMetricFamily(
            "clusterserve_kernel_fallbacks",
            "kernel calls that fell back to a slower path (the log says why, once per kind)",
            labels=["kernel", "reason"],
        )
        for (kernel, reason), count in sorted(fallbacks.counts().items()):
            family.add_metric([kernel, reason], count)
        yield family


class MetricsObserver:
    """The engine's Observer (engine.observer) as the service's Prometheus series."""

    def __init__(self, metrics: Metrics, model: str = "") -> None:
        self.metrics, self.model = metrics, model
        metrics.add_model(model)

    def admitted(self, jobs: int) -> None:
        self.metrics.scheduler_counts(self.model, 0, jobs)

    def waiting(self, jobs: int) -> None:
        self.metrics.scheduler_counts(self.model, 1, jobs)

    def running(self, batches: int) -> None:
        self.metrics.scheduler_counts(self.model, 2, batches)

    def layer(self) -> None:
        self.metrics.layers.inc()

    def started(self, method: str, queue_s: float, tokens: int) -> None:
        self.metrics.queue_duration.labels(method=method).observe(queue_s)
        self.metrics.input_tokens.labels(method=method).observe(tokens)

    def finished(self, method: str, seconds: float, inputs: int, tokens: int, peak_memory: int | None) -> None:
        self.metrics.inference_duration.labels(method=method).observe(seconds)
        self.metrics.model_inference_duration.labels(model=self.model).observe(seconds)
        self.metrics.batch_size.labels(method=method).observe(inputs)
        self.metrics.batch_tokens.labels(method=method).observe(tokens)
        if peak_memory is not None:
            self.metrics.peak_memory.labels(method=method).observe(peak_memory)

    def stopped(self, reason: str, inputs: int) -> None:
        self.metrics.stopped_inputs.labels(reason=reason).inc(inputs)
