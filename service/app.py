"""`create_app(settings)`: the FastAPI app, its routes, error handlers, middleware and lifespan.

The lifespan starts loading and warming the model on a background thread and returns at
once, so the server answers `/health/live` (and `/health/ready` with 503) while a large
checkpoint loads; readiness turns true only when the model has run every attention method
once and the scheduler is running. On shutdown readiness turns false, new embedding
requests get 503, and the scheduler finishes what it has queued.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import torch
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from clusterserve import kernels
from clusterserve.engine import Scheduler
from clusterserve.kernels import APPROXIMATE_METHODS, AttentionSpec
from clusterserve.models import Encoder
from clusterserve.models.planning.calibration import EXACT
from clusterserve.models.planning.cost import Throughput, default_budget
from clusterserve.models.runtime.precision import dtype_name, resolve_dtype

from . import __version__, openapi
from .errors import install_error_handlers
from .metrics import Metrics, MetricsObserver
from .middleware import RequestMiddleware
from .routes import health, info, metrics, ollama, openai, tei, tokenize
from .settings import Settings
from .state import Served, ServiceState
from .tracing import Tracing

log = logging.getLogger("clusterserve")

# Shown to the browser by CORS (the timings and the resolved attention).
EXPOSED_HEADERS = [
    "x-request-id",
    "x-queue-time-ms",
    "x-inference-time-ms",
    "x-total-time-ms",
    "x-input-tokens",
    "x-attention",
    "x-prompt-name",
    "x-adapter",
    "x-peak-memory-bytes",
    "x-fidelity",
    "x-fidelity-reference",
    "x-exact-time-ms",
]
_WARMUP_TEXT = "Clustered attention groups queries and attends once per cluster. " * 8  # ~100 tokens


def load_model(settings: Settings) -> Encoder:
    """The encoder the settings name (None = the embedded default), on the configured device,
    in the configured dtype ("auto": bfloat16 on CUDA and on CPUs with fast bf16, else
    float32; models.runtime.precision), with the attention backend resolved once, here, for that
    device and dtype: the concrete
    one ("reference", "native" or "triton") that every attention call then names, and that
    /info and clusterserve_build_info show; and with its calibration table (the configured
    one, else one found for the model and device kind); on CUDA with the triton backend,
    with its CUDA graphs unless `cuda_graphs` is off. ValueError when the configured
    backend cannot run; CalibrationError for a configured table that is missing, a malformed
    one, or one for another model."""
    from clusterserve.models import load_encoder

    device = settings.resolved_device()
    dtype = resolve_dtype(settings.dtype, device)
    backend = kernels.backend_for(device, dtype, settings.backend)
    return load_encoder(
        settings.model,
        max_input_tokens=settings.max_input_tokens,
        device=device,
        dtype=dtype,
        backend=backend,
        calibration=settings.calibration,
        cuda_graphs=settings.cuda_graph_signatures if settings.cuda_graphs else 0,
        cuda_graph_max_length=settings.cuda_graph_max_length,
        small_batch_weights=settings.small_batch_weights,
    )


def log_calibration(encoder: Encoder) -> None:
    """Say which table auto's target_fidelity uses, and warn when it was measured elsewhere."""
    table, device = encoder.calibration, encoder.device.type
    if table is None:
        log.info("no calibration table for %s on %s: target_fidelity falls back to auto's threshold", encoder.name, device)
        return
    if table.device != device:
        log.warning("calibration table %s was measured on %s, not %s: its times may mislead", table.source, table.device, device)
    served = dtype_name(encoder.dtype)
    if table.dtype != served:
        log.warning("calibration table %s was measured in %s, not %s: its times may mislead", table.source, table.dtype, served)
    log.info("calibration table %s: buckets %s", table.source, [b.tokens for b in table.buckets])


def create_app(settings: Settings | None = None, load: Callable[[Settings], Encoder] = load_model) -> FastAPI:
    """Build the service. `load(settings) -> encoder` runs in the lifespan (tests pass their own)."""
    settings = settings or Settings()
    logging.getLogger("clusterserve").setLevel(settings.log_level.upper())
    metrics_ = Metrics()
    state = ServiceState(settings=settings, metrics=metrics_, default_spec=settings.default_spec())
    tracing = Tracing()  # off unless OTEL_* variables configure it (service.tracing)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # A daemon thread, not the loop's executor: shutdown must not wait for a slow load.
        loader = threading.Thread(target=_load_and_start, args=(state, load), name="clusterserve-loader", daemon=True)
        loader.start()
        yield
        with state.lock:
            state.draining, state.ready = True, False
        for served in state.models.values():  # one after another: each drains within the timeout
            await asyncio.to_thread(served.scheduler.stop, settings.drain_timeout_s)
        await asyncio.to_thread(tracing.shutdown)

    app = FastAPI(
        title="clusterserve",
        version=__version__,
        description="Long-document embeddings with clustered, improved clustered and SMYRF attention.",
        lifespan=lifespan,
    )
    app.state.service = state
    app.state.metrics = metrics_
    openapi.install(app, state)
    install_error_handlers(app)
    for module in (openai, tei, ollama, tokenize, info, health, metrics):
        app.include_router(module.router)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["*"],
            expose_headers=EXPOSED_HEADERS,
        )
    # Added last, so outermost: it sees (and times, and counts) every response.
    app.add_middleware(RequestMiddleware, metrics=metrics_, max_body_bytes=settings.max_body_bytes, tracing=tracing)
    return app


def _load_and_start(state: ServiceState, load: Callable[[Settings], Encoder]) -> None:
    """Load, warm up and start every served model in turn, the default first (a configured
    calibration table is the default model's); ready once all are. A failure, or models whose
    weights do not fit the memory budget together, is the load error /health and /info report."""
    settings = state.settings
    served: dict[str, Served] = {}
    try:
        budget_bytes = memory_budget(settings)
        for i, model in enumerate(settings.served_models()):
            one = settings if i == 0 else settings.model_copy(update={"model": model, "more_models": [], "calibration": None})
            encoder = load(one)
            if encoder.name in served:
                raise ValueError(f"--model {model}: {encoder.name} is served already (each model once)")
            weights = weight_bytes(encoder, settings)
            total = weights + sum(s.weight_bytes for s in served.values())
            if total > budget_bytes:
                sizes = ", ".join(f"{s.name} {s.weight_bytes / 2**20:.0f} MiB" for s in served.values())
                raise MemoryError(
                    f"the models do not fit the memory budget of {budget_bytes / 2**20:.0f} MiB (memory_budget_bytes): "
                    f"{sizes + ', ' if sizes else ''}{encoder.name} {weights / 2**20:.0f} MiB"
                )
            served[encoder.name] = _start_model(encoder, state, weights)
    except Exception as exc:  # reported by /health/* and /info; the process stays up to say so
        log.exception("loading the model failed")
        state.load_error = f"{type(exc).__name__}: {exc}"
        return
    with state.lock:
        if state.draining:
            return
        state.models = served
        for one in served.values():
            one.scheduler.start()
        state.ready, state.ready_since = True, int(time.time())
    state.metrics.set_build_info(
        __version__, [(e.name, str(e.device), e.backend, dtype_name(e.dtype)) for e in (s.encoder for s in served.values())]
    )
    for encoder in (one.encoder for one in served.values()):
        log.info(
            "ready: %s on %s in %s (%s attention backend), up to %d tokens per input",
            encoder.name, encoder.device, dtype_name(encoder.dtype), encoder.backend, encoder.max_input_tokens,
        )  # fmt: skip
        if encoder.graphs is not None:
            log.info(
                "CUDA graphs: layers replayed for up to %d batch shapes, inputs up to %d tokens (padded to length buckets)",
                encoder.graphs.capacity, encoder.graphs.max_length,
            )  # fmt: skip


def _start_model(encoder: Encoder, state: ServiceState, weights: int) -> Served:
    """One loaded model, warmed up, measured and given its (not yet started) scheduler."""
    settings = state.settings
    log_calibration(encoder)
    if settings.fidelity_reference == "startup" and encoder.float32() is not encoder:
        log.info("fidelity reference: %s loaded in float32 beside the served %s", encoder.name, dtype_name(encoder.dtype))
    if encoder.graphs is not None:  # counted from the warm-up on
        encoder.graphs.on_event = state.metrics.cuda_graph_event
    if settings.warmup:
        _warm_up(encoder, state)
    throughput = measure_throughput(encoder)
    budget = work_budget(encoder, settings, state.default_spec, throughput)
    scheduler = Scheduler(
        encoder, settings.max_batch_tokens, settings.max_concurrent_requests, throughput=throughput,
        observer=MetricsObserver(state.metrics, encoder.name),
    )  # fmt: skip
    return Served(encoder, scheduler, budget, throughput, weights)


def weight_bytes(encoder: Encoder, settings: Settings) -> int:
    """The bytes of a model's weights, and of its float32 fidelity reference where one is loaded beside it."""
    models = [encoder]
    if settings.fidelity_reference == "startup" and encoder.float32() is not encoder:
        models.append(encoder.float32())
    return sum(p.numel() * p.element_size() for one in models for p in one.model.parameters())


def memory_budget(settings: Settings) -> int:
    """The bytes the served models' weights may take together: the setting, else nine tenths of
    the device's memory (CUDA: its total; CPU: MemAvailable now; unbounded where neither is known)."""
    if settings.memory_budget_bytes is not None:
        return settings.memory_budget_bytes
    device = settings.resolved_device()
    if device.type == "cuda":
        return int(0.9 * torch.cuda.get_device_properties(device).total_memory)
    available = _mem_available()
    return int(0.9 * available) if available is not None else 2**62


def _mem_available() -> int | None:
    """/proc/meminfo's MemAvailable in bytes (None off Linux)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def measure_throughput(encoder: Encoder, tokens: int = 1024) -> Throughput:
    """This device's work units per second (models.planning.cost): a forward pass with exact attention
    over up to `tokens` tokens, timed. It turns the work budget into seconds and back."""
    ids = (encoder.prepare([_WARMUP_TEXT * 16], truncate=True)[0] * 2)[: min(tokens, encoder.max_input_tokens)]
    return Throughput.measure(lambda: encoder.run([ids], [EXACT]), encoder.cost.work(len(ids), EXACT))


def work_budget(encoder: Encoder, settings: Settings, default: AttentionSpec, throughput: Throughput) -> float:
    """Work units a request may take: the configured seconds at this device's throughput, or
    the default (models.planning.cost.default_budget) over every method at the server's default knobs
    and every configuration of the calibration table, at the model's longest input."""
    if settings.max_request_work_s is not None:
        budget = throughput.units(settings.max_request_work_s)
    else:
        specs = [default.with_knobs(method=method) for method in ("full", *APPROXIMATE_METHODS)]
        if encoder.calibration is not None:
            specs += [entry.spec for bucket in encoder.calibration.buckets for entry in bucket.configs]
        budget = default_budget(encoder.cost, encoder.max_input_tokens, specs)
    log.info(
        "work budget per request: %.0f s of this device's time (%.3g work units; %.3g units/s measured)",
        throughput.seconds(budget), budget, throughput.units_per_s,
    )  # fmt: skip
    return budget


def _warm_up(encoder: Encoder, state: ServiceState) -> None:
    """Run every method once, the way requests run, so the first request of each pays no
    one-off costs (kernel compilation, the native loops' build, allocator growth)."""
    sequences = encoder.prepare([_WARMUP_TEXT])
    for method in ("full", *APPROXIMATE_METHODS):
        encoder.run(sequences, [state.default_spec.with_knobs(method=method)])
