"""The one serving path: every embedding route's request in, one `Embedded` out.

    embed(request, raw inputs, options)
      -> ServiceState.pick          the served model asked for: 503 while loading, after a failed
                                    load, or draining; 404 for a name none answers to
      -> resolve_request_attention  the request's knobs over the server defaults (service.planning)
      -> parse_inputs               the HTTP shape of `input(s)`: one or several, empty (400), too many (413)
      -> request_plan               service.planning, off the loop: each sequence's ids, attention,
                                    output and work as the job's runs, how its rows become the
                                    inputs' rows; 413 over a per-request bound, 422 over the budget
      -> Scheduler.submit_unless    one Job on the scheduler (engine), which batches and runs it,
                                    withdrawn if the client disconnects first
      -> answer                     per input its rows (cut and normalised), timings, and with
                                    "fidelity": true each row's cosine to its exact twin
    Embedded.headers is the response's `x-*` headers, built from that one result.

Pooled vectors, chunks, late-chunking windows and token states differ only in the plan; a
failure anywhere is a ServiceError with its status (service.errors), the planners' and the
scheduler's typed errors answered by the tables there.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

import torch
from fastapi import Request
from starlette.concurrency import run_in_threadpool
from torch import Tensor

from clusterserve.engine import EngineError, Job, JobResult, dominant_method
from clusterserve.engine.fidelity import exact_rows
from clusterserve.kernels import FieldError
from clusterserve.models.planning.chunk_plan import Chunk
from clusterserve.models.runtime.encoder import finish

from . import errors, tracing
from .metrics import Metrics
from .middleware import ARRIVAL_KEY, METHOD_KEY, MODEL_KEY, REQUEST_ID_KEY
from .planning import EmbedOptions, RequestPlan, parse_inputs, request_plan, resolve_request_attention
from .state import get_state

TIMEOUT_HEADER = "x-request-timeout-ms"
# What "fidelity": true compares against, whatever dtype the server runs in.
FIDELITY_REFERENCE = {"method": "full", "dtype": "float32"}


@dataclass(frozen=True)
class Embedded:
    """One request's answer: what the route puts in its body, and the headers."""

    vectors: Tensor  # (rows, dim) float32, CPU: every input's rows, input after input
    rows: list[int]  # per input, its rows: 1 (pooled), its chunks, or its tokens (every_token)
    tokens: list[int]  # per input, after truncation, special tokens included
    attention: dict[str, Any]  # the echo of the resolved spec(s)
    result: JobResult
    inference_s: float  # the requested attention's forward passes (without the exact ones)
    fidelity: list[float] | None = None  # per row, with "fidelity": true
    exact_s: float | None = None  # the exact forward passes that fidelity took
    prompt_name: str | None = None  # the prompt prepended to the texts (sent or default)
    adapter: str | None = None  # the task adapter that ran (None: the base weights)
    model: str = ""  # the served model's name
    chunks: list[tuple[Chunk, ...]] | None = None  # per input, its chunks' spans (None: not chunked)

    def per_input(self) -> list[Tensor]:
        """Per input, its (rows, dim) vectors."""
        return list(self.vectors.split(self.rows))

    @property
    def headers(self) -> dict[str, str]:
        headers = {
            "x-queue-time-ms": f"{self.result.queue_s * 1e3:.3f}",
            "x-inference-time-ms": f"{self.inference_s * 1e3:.3f}",
            "x-input-tokens": str(sum(self.tokens)),
            "x-attention": json.dumps(self.attention, separators=(",", ":")),
        }
        if self.prompt_name is not None:
            headers["x-prompt-name"] = _header_safe(self.prompt_name)
        if self.adapter is not None:
            headers["x-adapter"] = _header_safe(self.adapter)
        if self.result.peak_memory is not None:
            headers["x-peak-memory-bytes"] = str(self.result.peak_memory)
        if self.fidelity is not None:
            headers["x-fidelity"] = ",".join(f"{f:.6f}" for f in self.fidelity)
            headers["x-fidelity-reference"] = json.dumps(FIDELITY_REFERENCE, separators=(",", ":"))
            headers["x-exact-time-ms"] = f"{(self.exact_s or 0.0) * 1e3:.3f}"
        return headers


def _header_safe(name: str) -> str:
    """A checkpoint's name as a header value: printable ASCII as is, anything else percent-encoded."""
    return urllib.parse.quote(name, safe="".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%"))


async def embed(request: Request, raw_inputs: Any, options: EmbedOptions) -> Embedded:
    """Serve one request (see the module docstring); raises ServiceError with the documented status."""
    state = get_state(request)
    served = state.pick(options.model)
    request.scope[MODEL_KEY] = served.name
    encoder, scheduler = served.encoder, served.scheduler
    params: list[str] = []
    try:
        spec, target = resolve_request_attention(state.default_spec, options.attention, state.settings.target_fidelity)
        request.scope[METHOD_KEY] = spec.method
        inputs, params = parse_inputs(raw_inputs, options.param, state.settings.max_client_batch_size)
        with tracing.child("tokenize", **{"clusterserve.inputs": len(inputs)}):
            planned = await run_in_threadpool(request_plan, encoder, state, inputs, params, spec, target, options)
    except FieldError as exc:
        renames = {"chunking": "late_chunking"} if options.late_chunking else {}  # Jina's form names it so
        raise errors.from_field_error(exc, options.param, params, renames) from None
    timeout = request_timeout_s(request, state.settings.request_timeout_s)
    job = Job(
        request_id=request.scope.get(REQUEST_ID_KEY, ""),
        runs=list(planned.runs),
        adapter=planned.sequences.adapter,
        deadline=request.scope.get(ARRIVAL_KEY, time.monotonic()) + timeout,
        timeout_s=timeout,
    )
    submitted = time.monotonic()
    try:
        result = await scheduler.submit_unless(job, _client_gone(request))
    except EngineError as exc:
        raise errors.from_engine_error(exc) from None
    _trace_job(planned, result, submitted, encoder.name)
    return answer(planned, result, options, state.metrics, encoder.name)


def _trace_job(planned: RequestPlan, result: JobResult, submitted: float, model: str) -> None:
    """The job's queueing and forward passes as child spans of the request's, and what it ran
    as the request span's attributes (service.tracing; nothing when untraced)."""
    runs = planned.runs
    tracing.annotate(**{
        "clusterserve.model": model,
        "clusterserve.attention.method": planned.attention.get("method"),
        "clusterserve.attention": json.dumps(planned.attention, separators=(",", ":")),
        "clusterserve.input_tokens": sum(planned.input_tokens),
        "clusterserve.sequences": len(planned.rows),
        "clusterserve.chunks": sum(map(len, planned.chunks)) if planned.chunks is not None else None,
    })  # fmt: skip
    passes: dict[tuple[float, float], list[int]] = {}
    for index, span in enumerate(result.spans):
        passes.setdefault(span, []).append(index)
    if not passes:
        return
    tracing.record("queue", submitted, min(start for start, _ in passes))
    exact = len(planned.rows)  # runs from here on are fidelity's exact re-runs
    for (start, end), indices in sorted(passes.items()):
        tracing.record("forward pass", start, end, **{
            "clusterserve.sequences": len(indices),
            "clusterserve.tokens": sum(len(runs[i].ids) for i in indices),
            "clusterserve.attention.methods": sorted({runs[i].spec.method for i in indices}),
            "clusterserve.exact_rerun": any(i >= exact for i in indices),
        })  # fmt: skip


def answer(planned: RequestPlan, result: JobResult, options: EmbedOptions, metrics: Metrics, model: str) -> Embedded:
    """The job's rows as the request's answer: per input its rows, finished (cut to
    `dimensions`, normalised as asked); chunk counts observed; with "fidelity": true each row's
    cosine to the same row with exact attention in float32 (1.0 for an input that ran exact
    attention in float32 throughout: its own reference), observed per method."""
    rows, rerun = list(planned.rows), planned.rerun
    own = result.vectors[: sum(rows)]
    vectors = [finish(v, options.normalize, options.dimensions) for v in planned.assemble(own)]
    methods = [
        dominant_method((p.spec.method, p.tokens) for p in planned.sequences.inputs[which.start : which.stop])
        for which in planned.input_sequences
    ]
    if planned.chunks is not None:
        for method, one in zip(methods, vectors):
            metrics.chunks.labels(method=method).observe(len(one))
    sequences = len(rows)
    embedded = Embedded(
        vectors=torch.cat(vectors),
        rows=[len(one) for one in vectors],
        tokens=list(planned.input_tokens),
        attention=planned.attention,
        result=result,
        inference_s=result.run_seconds(list(range(sequences))) if rerun else result.inference_s,
        prompt_name=planned.sequences.prompt_name,
        adapter=planned.sequences.adapter,
        model=model,
        chunks=list(planned.chunks) if planned.chunks is not None else None,
    )
    if not options.fidelity:
        return embedded
    exact = [finish(v, options.normalize, options.dimensions) for v in planned.assemble(exact_rows(result.vectors, rows, rerun))]
    cosines: list[float] = []
    for which, method, one, twin in zip(planned.input_sequences, methods, vectors, exact):
        if any(i in rerun for i in which):
            part = torch.nn.functional.cosine_similarity(one, twin, dim=-1).tolist()
            for cosine in part if method != "full" else ():
                metrics.fidelity.labels(method=method).observe(cosine)
        else:
            part = [1.0] * len(one)
        cosines += part
    exact_s = result.run_seconds(list(range(sequences, sequences + len(rerun)))) if rerun else embedded.inference_s
    return dataclasses.replace(embedded, fidelity=cosines, exact_s=exact_s)


def request_timeout_s(request: Request, server_timeout_s: float) -> float:
    """The request's deadline in seconds from arrival: the server's, or a shorter one the client
    sends as `x-request-timeout-ms` (a longer one is capped: a client cannot extend it)."""
    sent = request.headers.get(TIMEOUT_HEADER)
    if sent is None:
        return server_timeout_s
    try:
        milliseconds = float(sent)
    except ValueError:
        milliseconds = math.nan
    if not (math.isfinite(milliseconds) and milliseconds > 0):
        raise errors.invalid_field(TIMEOUT_HEADER, f"must be a positive number of milliseconds, got {sent!r}")
    return min(server_timeout_s, milliseconds / 1e3)


async def _client_gone(request: Request) -> None:
    """Return when the client disconnects (the body was read already: nothing else can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
