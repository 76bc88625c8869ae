"""The embedding pipeline both embedding routes share, and the API-key check.

validate (empty, batch size, attention, dimensions, token ids) -> tokenize off the event
loop -> enforce the length limit or truncate -> resolve each input's attention spec by its
length (auto: by the length threshold, or by the calibration table for a target fidelity) ->
queue the job on the scheduler -> vectors, timings, fidelity and the `x-*` headers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from fastapi import Request
from starlette.concurrency import run_in_threadpool
from torch import Tensor

from kernels import AttentionSpec
from models.calibration import EXACT, Calibration

from .. import errors
from ..batching import Batcher, Job, JobResult
from ..middleware import ARRIVAL_KEY, METHOD_KEY, REQUEST_ID_KEY
from ..schemas import AttentionRequest
from ..state import ServiceState, get_state

TIMEOUT_HEADER = "x-request-timeout-ms"


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


async def require_api_key(request: Request) -> None:
    """FastAPI dependency: 401 unless the configured key is sent as `Authorization: Bearer <key>`."""
    key = get_state(request).settings.api_key
    if key is None:
        return
    scheme, _, sent = request.headers.get("authorization", "").partition(" ")
    expected = key.get_secret_value().encode()
    # compare_digest takes the same time wherever the strings differ: no timing oracle.
    if scheme.lower() != "bearer" or not hmac.compare_digest(sent.strip().encode(), expected):
        raise errors.unauthorized()


# Knobs a calibrated choice sets; a request that names target_fidelity leaves them out.
CALIBRATED_KNOBS = ("clusters", "topk", "bits", "iterations", "refine", "hash_rounds", "cluster_size")


def resolve_attention(default: AttentionSpec, requested: AttentionRequest | None) -> tuple[AttentionSpec, float | None]:
    """The request's knobs over the server defaults, validated as an AttentionSpec (422 naming
    the knob), and its target fidelity (None when it names none)."""
    if requested is None:
        return default, None
    knobs = requested.model_dump(exclude_none=True)
    target = knobs.pop("target_fidelity", None)
    if target is not None:
        method = knobs.setdefault("method", "auto")
        if method != "auto":
            raise errors.invalid_field(
                "attention.target_fidelity",
                f'applies to method "auto" only, got method {method!r}; leave method out or set it to "auto"',
            )
        named = [name for name in CALIBRATED_KNOBS if name in knobs]
        if named:
            raise errors.invalid_field(
                f"attention.{named[0]}",
                "is chosen by target_fidelity from the calibration table; leave it out, "
                "or drop target_fidelity to choose the knobs yourself",
            )
    try:
        return dataclasses.replace(default, **knobs), target
    except ValueError as exc:
        field, _, message = str(exc).partition(": ")
        raise errors.invalid_field(f"attention.{field}", message or str(exc)) from None


@dataclass(frozen=True)
class Plan:
    """How one input runs: its concrete spec (never "auto") and what the response echoes."""

    spec: AttentionSpec
    echo: dict[str, Any]


def plan_input(spec: AttentionSpec, target: float | None, tokens: int, calibration: Calibration | None) -> Plan:
    """Resolve "auto" for an input of `tokens` tokens: by the calibration table when the
    request names a target fidelity and a table is loaded, else by the length threshold."""
    if target is None:
        resolved = spec.resolve(tokens)
        return Plan(resolved, resolved.used_knobs())
    if calibration is None:
        resolved = spec.resolve(tokens)
        return Plan(resolved, {**resolved.used_knobs(), "target_fidelity": target, "calibrated_fidelity": None})
    choice = calibration.choose(tokens, target, seed=spec.seed)
    return Plan(choice.spec, choice.echo(target))


def echo_attention(plans: list[Plan], requested: AttentionSpec, target: float | None) -> dict[str, Any]:
    """What the response reports: the one resolved spec, or for "auto" over mixed lengths what
    auto went by (threshold or target) and each input's resolved spec."""
    distinct = {json.dumps(plan.echo, sort_keys=True) for plan in plans}
    if len(distinct) == 1:
        return plans[0].echo
    rule = {"target_fidelity": target} if target is not None else {"auto_threshold": requested.auto_threshold}
    return {"method": "auto", **rule, "inputs": [plan.echo for plan in plans]}


async def submit_unless_disconnected(request: Request, batcher: Batcher, job: Job) -> JobResult:
    """`batcher.submit(job)`, withdrawn if the client disconnects first: its queued inputs are
    dropped unrun, and the request ends as 499 (counted as reason="disconnected")."""
    submitted = asyncio.ensure_future(batcher.submit(job))
    gone = asyncio.ensure_future(_client_gone(request))
    done: set[asyncio.Future[Any]] = set()
    try:
        done, _ = await asyncio.wait({submitted, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not submitted.done():
            submitted.cancel()  # submit's own clean-up marks the job cancelled for the worker
            await asyncio.wait({submitted})
    if submitted in done:
        return submitted.result()
    raise errors.client_disconnected()


async def _client_gone(request: Request) -> None:
    """Return when the client disconnects (the body was read already: nothing else can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@dataclass(frozen=True)
class Embedded:
    vectors: Tensor  # (n, dim) float32, CPU
    tokens: list[int]  # per input, after truncation, special tokens included
    attention: dict[str, Any]
    result: JobResult
    inference_s: float  # the requested attention's forward passes (without the exact ones)
    fidelity: list[float] | None = None  # per input, with "fidelity": true
    exact_s: float | None = None  # the exact forward passes that fidelity took

    def headers(self) -> dict[str, str]:
        headers = {
            "x-queue-time-ms": f"{self.result.queue_s * 1e3:.3f}",
            "x-inference-time-ms": f"{self.inference_s * 1e3:.3f}",
            "x-input-tokens": str(sum(self.tokens)),
            "x-attention": json.dumps(self.attention, separators=(",", ":")),
        }
        if self.result.peak_memory is not None:
            headers["x-peak-memory-bytes"] = str(self.result.peak_memory)
        if self.fidelity is not None:
            headers["x-fidelity"] = ",".join(f"{f:.6f}" for f in self.fidelity)
            headers["x-exact-time-ms"] = f"{(self.exact_s or 0.0) * 1e3:.3f}"
        return headers


def split_inputs(value: Any, param: str) -> tuple[list[Any], list[str], bool]:
    """A request's `input(s)` as a list, the param name of each element, and whether they are ids.

    A string or a flat list of ids is one input; a list of strings or of id lists is several.
    """
    if isinstance(value, str):
        return [value], [param], False
    if value and all(isinstance(v, int) for v in value):
        return [value], [param], True
    is_ids = bool(value) and isinstance(value[0], list)
    return list(value), [f"{param}[{i}]" for i in range(len(value))], is_ids


async def embed(
    request: Request,
    raw_inputs: Any,
    *,
    param: str,
    attention: AttentionRequest | None,
    truncate: bool,
    truncation_direction: str = "right",
    normalize: bool = True,
    dimensions: int | None = None,
    fidelity: bool = False,
) -> Embedded:
    """Run the whole pipeline for one request; raises ServiceError with the documented status."""
    state: ServiceState = get_state(request)
    settings = state.settings
    spec, target = resolve_attention(state.default_spec, attention)
    request.scope[METHOD_KEY] = spec.method
    encoder, batcher = state.require_ready()

    inputs, params, is_ids = split_inputs(raw_inputs, param)
    if not inputs:
        raise errors.empty_input(param)
    if len(inputs) > settings.max_client_batch_size:
        raise errors.batch_too_large(param, len(inputs), settings.max_client_batch_size)
    for value, name in zip(inputs, params):
        if len(value) == 0:
            raise errors.empty_input(name)
    if dimensions is not None and dimensions > encoder.dim:
        raise errors.invalid_field("dimensions", f"must be in [1, {encoder.dim}], got {dimensions}")

    limit = state.max_input_tokens
    direction = truncation_direction.lower()
    if is_ids:
        for ids, name in zip(inputs, params):
            bad = next((t for t in ids if not 0 <= t < encoder.vocab_size), None)
            if bad is not None:
                raise errors.invalid_field(name, f"token ids must be in [0, {encoder.vocab_size}), got {bad}")
        sequences = [list(ids) for ids in inputs]
        if truncate:
            sequences = [s[:limit] if direction == "right" else s[-limit:] for s in sequences]
    else:
        # Tokenizing a 30k-token text takes milliseconds: off the loop, in the thread pool.
        tokenized = await run_in_threadpool(
            encoder.tokenizer.encode, inputs, limit if truncate else None, direction
        )
        sequences = [t.ids for t in tokenized]
    for ids, name in zip(sequences, params):
        if len(ids) > limit:
            raise errors.input_too_long(name, len(ids), limit)

    plans = [plan_input(spec, target, len(ids), state.calibration) for ids in sequences]
    specs = [plan.spec for plan in plans]
    # With "fidelity": true the approximate inputs run a second time with exact attention, in
    # the same job: one admission, one deadline; the scheduler never batches the two together.
    rerun = [i for i, s in enumerate(specs) if s.method != "full"] if fidelity else []
    timeout = request_timeout_s(request, settings.request_timeout_s)
    job = Job(
        request_id=request.scope.get(REQUEST_ID_KEY, ""),
        inputs=sequences + [sequences[i] for i in rerun],
        specs=specs + [EXACT] * len(rerun),
        normalize=normalize,
        dimensions=dimensions,
        deadline=request.scope.get(ARRIVAL_KEY, time.monotonic()) + timeout,
        timeout_s=timeout,
    )
    result = await submit_unless_disconnected(request, batcher, job)
    n = len(sequences)
    vectors = result.vectors[:n]
    embedded = Embedded(
        vectors=vectors,
        tokens=[len(ids) for ids in sequences],
        attention=echo_attention(plans, spec, target),
        result=result,
        inference_s=result.run_seconds(list(range(n))) if rerun else result.inference_s,
    )
    if not fidelity:
        return embedded
    cosines = [1.0] * n  # an input that ran exact attention is its own exact embedding
    exact = result.vectors[n:]
    for i, cosine in zip(rerun, torch.nn.functional.cosine_similarity(vectors[rerun], exact, dim=-1).tolist()):
        cosines[i] = cosine
        state.metrics.fidelity.labels(method=specs[i].method).observe(cosine)
    exact_s = result.run_seconds(list(range(n, n + len(rerun)))) if rerun else embedded.inference_s
    return dataclasses.replace(embedded, fidelity=cosines, exact_s=exact_s)
