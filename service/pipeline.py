"""The embedding pipeline both embedding routes share: one request in, one `Embedded` out.

    embed(request, raw inputs, options)
      -> resolve_request_attention   the request's knobs over the server defaults (422 naming a bad one)
      -> parse_inputs                the HTTP shape of `input(s)`: one or several, empty (400), too many (413)
      -> choose_prompt_and_adapter   the prompt (sent or default) and task adapter (422 naming an unknown one)
      -> prepare                     models: prompt, tokenize, check ids, truncate or refuse (413 / 422), off the loop
      -> kernels.resolve_auto        each input's concrete spec and echo (threshold, or calibration table)
      -> submit_unless_disconnected  one Job on the scheduler (service.batching), which batches and runs it
      -> collect                     vectors, timings, the fidelity re-run's cosines -> Embedded
    Embedded.headers() is the response's `x-*` headers, built from that one result.
"""

from __future__ import annotations

import asyncio
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

from kernels import AttentionSpec, Resolved, resolve_auto
from models.calibration import EXACT
from models.inputs import EmptyInput, InputError, InputTooLong
from models.prompts import UnknownPrompt

from . import errors
from .batching import Batcher, Job, JobResult
from .metrics import Metrics
from .middleware import ARRIVAL_KEY, METHOD_KEY, REQUEST_ID_KEY
from .schemas import CALIBRATED_KNOBS, AttentionRequest
from .state import get_state

TIMEOUT_HEADER = "x-request-timeout-ms"


@dataclass(frozen=True)
class EmbedOptions:
    """What a route asks of the pipeline besides the inputs."""

    param: str  # the body field holding the inputs ("input" or "inputs"), for error messages
    attention: AttentionRequest | None = None
    truncate: bool = False
    truncation_direction: str = "right"
    normalize: bool = True
    dimensions: int | None = None
    fidelity: bool = False
    prompt_name: str | None = None  # None: the model's default prompt, if any
    adapter: str | None = None  # None: the adapter named like the prompt in effect, if any


@dataclass(frozen=True)
class Embedded:
    """One request's answer: what the route puts in its body, and the headers."""

    vectors: Tensor  # (n, dim) float32, CPU
    tokens: list[int]  # per input, after truncation, special tokens included
    attention: dict[str, Any]  # the echo of the resolved spec(s)
    result: JobResult
    inference_s: float  # the requested attention's forward passes (without the exact ones)
    fidelity: list[float] | None = None  # per input, with "fidelity": true
    exact_s: float | None = None  # the exact forward passes that fidelity took
    prompt_name: str | None = None  # the prompt prepended to the texts (sent or default)
    adapter: str | None = None  # the task adapter that ran (None: the base weights)

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
            headers["x-exact-time-ms"] = f"{(self.exact_s or 0.0) * 1e3:.3f}"
        return headers


def _header_safe(name: str) -> str:
    """A checkpoint's name as a header value: printable ASCII as is, anything else percent-encoded."""
    return urllib.parse.quote(name, safe="".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%"))


async def embed(request: Request, raw_inputs: Any, options: EmbedOptions) -> Embedded:
    """Run the whole pipeline for one request; raises ServiceError with the documented status."""
    state = get_state(request)
    spec, target = resolve_request_attention(state.default_spec, options.attention, state.settings.target_fidelity)
    request.scope[METHOD_KEY] = spec.method
    encoder, batcher = state.require_ready()
    inputs, params = parse_inputs(raw_inputs, options.param, state.settings.max_client_batch_size)
    if options.dimensions is not None and options.dimensions > encoder.dim:
        raise errors.invalid_field("dimensions", f"must be in [1, {encoder.dim}], got {options.dimensions}")
    prompt_name, adapter = choose_prompt_and_adapter(encoder, inputs, options)
    sequences = await prepare(encoder, inputs, params, options)
    plans = [resolve_auto(spec, len(ids), state.calibration, target) for ids in sequences]
    # With "fidelity": true the approximate inputs run a second time with exact attention, in
    # the same job: one admission, one deadline; the scheduler never batches the two together.
    rerun = [i for i, plan in enumerate(plans) if plan.spec.method != "full"] if options.fidelity else []
    timeout = request_timeout_s(request, state.settings.request_timeout_s)
    job = Job(
        request_id=request.scope.get(REQUEST_ID_KEY, ""),
        inputs=sequences + [sequences[i] for i in rerun],
        specs=[plan.spec for plan in plans] + [EXACT] * len(rerun),
        adapter=adapter,
        normalize=options.normalize,
        dimensions=options.dimensions,
        deadline=request.scope.get(ARRIVAL_KEY, time.monotonic()) + timeout,
        timeout_s=timeout,
    )
    result = await submit_unless_disconnected(request, batcher, job)
    embedded = Embedded(
        vectors=result.vectors[: len(sequences)],
        tokens=[len(ids) for ids in sequences],
        attention=echo_attention(plans, spec, target),
        result=result,
        inference_s=result.run_seconds(list(range(len(sequences)))) if rerun else result.inference_s,
        prompt_name=prompt_name,
        adapter=adapter,
    )
    return with_fidelity(embedded, plans, rerun, state.metrics) if options.fidelity else embedded


def resolve_request_attention(
    default: AttentionSpec, requested: AttentionRequest | None, default_target: float | None = None
) -> tuple[AttentionSpec, float | None]:
    """The request's knobs over the server defaults, validated as an AttentionSpec (422 naming
    the knob), and the target fidelity "auto" aims at: the request's, else the server's
    `default_target` when the request runs "auto" and names no knob a calibration sets."""
    knobs = requested.model_dump(exclude_none=True) if requested is not None else {}
    target = knobs.pop("target_fidelity", None)
    named_knobs = any(name in knobs for name in CALIBRATED_KNOBS)
    if target is None and knobs.get("method", default.method) == "auto" and not named_knobs:
        target = default_target
    elif target is not None:
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


def parse_inputs(
    value: Any, param: str, max_inputs: int, allow_empty_items: bool = False
) -> tuple[list[Any], list[str]]:
    """A request's `input(s)` as a list of inputs and the param name of each.

    A string or a flat list of ids is one input; a list of strings or of id lists is several.
    400 when there is none, or one is empty (unless `allow_empty_items`: /tokenize answers ""
    with its special tokens); 413 when there are more than `max_inputs`.
    """
    if isinstance(value, str):
        inputs, params = [value], [param]
    elif value and all(isinstance(v, int) for v in value):
        inputs, params = [value], [param]
    else:
        inputs, params = list(value), [f"{param}[{i}]" for i in range(len(value))]
    if not inputs:
        raise errors.empty_input(param)
    if len(inputs) > max_inputs:
        raise errors.batch_too_large(param, len(inputs), max_inputs)
    for one, name in zip(inputs, params):
        if len(one) == 0 and not allow_empty_items:
            raise errors.empty_input(name)
    return inputs, params


def choose_prompt_and_adapter(encoder: Any, inputs: list[Any], options: EmbedOptions) -> tuple[str | None, str | None]:
    """The prompt the texts get and the task adapter that runs (None: none, the base weights).

    The prompt is the one sent, else the model's default prompt; token-id inputs get none
    (naming one for them is refused by `prepare`). The adapter is the one sent, else the
    adapter named like the prompt in effect: Jina v3 names its prompts after its tasks, so a
    TEI client's `prompt_name="retrieval.query"` selects both. 422 naming `prompt_name` or
    `adapter` when the model has no such prompt or adapter, listing the ones it has."""
    prompts, adapters = encoder.prompts, tuple(encoder.adapters)
    if options.prompt_name is not None and options.prompt_name not in prompts.prompts:
        raise errors.invalid_field("prompt_name", _detail(UnknownPrompt(options.prompt_name, tuple(prompts.prompts))))
    if options.adapter is not None and options.adapter not in adapters:
        known = ", ".join(adapters) if adapters else "none: this model has no task adapters"
        raise errors.invalid_field("adapter", f"unknown adapter {options.adapter!r}; known: {known}")
    texts = all(isinstance(one, str) for one in inputs)
    sent = options.prompt_name
    prompt_name = (sent if sent is not None else prompts.default_name) if texts else None
    if options.adapter is not None:
        return prompt_name, options.adapter
    return prompt_name, prompt_name if prompt_name in adapters else None


async def prepare(encoder: Any, inputs: list[Any], params: list[str], options: EmbedOptions) -> list[list[int]]:
    """Token ids per input (models.inputs, via `encoder.prepare`, which prepends the prompt),
    with its typed errors as statuses: too long 413 (the prompt's tokens count), empty 400,
    anything else 422, each naming the input's param (or `prompt_name` for a prompt the
    inputs cannot take)."""
    try:
        # Tokenizing a 30k-token text takes milliseconds: off the loop, in the thread pool.
        return await run_in_threadpool(
            encoder.prepare, inputs, options.truncate, options.truncation_direction.lower(), options.prompt_name
        )
    except InputError as exc:
        param = options.param if exc.index is None else params[exc.index]
        if isinstance(exc, InputTooLong):
            raise errors.input_too_long(param, exc.tokens, exc.limit) from None
        if isinstance(exc, EmptyInput):
            raise errors.empty_input(param) from None
        raise errors.invalid_field(param, exc.detail) from None
    except ValueError as exc:  # the prompt: token-id inputs, or a pooling that excludes it
        if not str(exc).startswith("prompt_name: "):
            raise
        raise errors.invalid_field("prompt_name", _detail(exc)) from None


def _detail(exc: ValueError) -> str:
    """A models ValueError's message without its leading "field: " (the error names the param)."""
    return str(exc).partition(": ")[2] or str(exc)


def echo_attention(plans: list[Resolved], requested: AttentionSpec, target: float | None) -> dict[str, Any]:
    """What the response reports: the one resolved spec, or, where inputs resolved differently
    (auto over mixed lengths, or a method exact by its knobs for the short inputs only), the
    method asked for, what auto went by (threshold or target), and each input's resolved spec."""
    distinct = {json.dumps(plan.echo, sort_keys=True) for plan in plans}
    if len(distinct) == 1:
        return plans[0].echo
    if requested.method != "auto":
        return {"method": requested.method, "inputs": [plan.echo for plan in plans]}
    rule = {"target_fidelity": target} if target is not None else {"auto_threshold": requested.auto_threshold}
    return {"method": "auto", **rule, "inputs": [plan.echo for plan in plans]}


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


def with_fidelity(embedded: Embedded, plans: list[Resolved], rerun: list[int], metrics: Metrics) -> Embedded:
    """`embedded` with each input's cosine to its exact-attention embedding (the job's extra
    vectors after the first n), observed in the fidelity histogram, and the exact runs' time."""
    n, result = len(plans), embedded.result
    cosines = [1.0] * n  # an input that ran exact attention is its own exact embedding
    exact = result.vectors[n:]
    for i, cosine in zip(rerun, torch.nn.functional.cosine_similarity(embedded.vectors[rerun], exact, dim=-1).tolist()):
        cosines[i] = cosine
        metrics.fidelity.labels(method=plans[i].spec.method).observe(cosine)
    exact_s = result.run_seconds(list(range(n, n + len(rerun)))) if rerun else embedded.inference_s
    return dataclasses.replace(embedded, fidelity=cosines, exact_s=exact_s)
