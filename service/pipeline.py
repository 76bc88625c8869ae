"""The embedding pipeline both embedding routes share: one request in, one `Embedded` out.

    embed(request, raw inputs, options)
      -> resolve_request_attention   the request's knobs over the server defaults (422 naming a bad one)
      -> parse_inputs                the HTTP shape of `input(s)`: one or several, empty (400), too many (413)
      -> plan_request                models.plan, off the loop: prompt and adapter, tokens and limits, each
                                     input's attention by its own length (413 / 422 / 400 naming the field)
      -> submit_unless_disconnected  one Job on the scheduler (service.batching), which batches and runs it
      -> collect                     vectors (cut and normalised), timings, the fidelity re-run's cosines
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
from typing import Any, Callable, TypeVar

import torch
from fastapi import Request
from starlette.concurrency import run_in_threadpool
from torch import Tensor

from kernels import AttentionSpec
from models import Encoder, UnknownPrompt
from models.calibration import EXACT
from models.cost import over_budget
from models.encoder import finish
from models.inputs import EmptyInput, InputError, InputTooLong, NoTokens
from models.plan import Plan, UnknownAdapter, plan

from . import errors
from .batching import Batcher, Job, JobResult
from .metrics import Metrics
from .middleware import ARRIVAL_KEY, METHOD_KEY, REQUEST_ID_KEY
from .schemas import CALIBRATED_KNOBS, AttentionRequest
from .state import ServiceState, get_state

TIMEOUT_HEADER = "x-request-timeout-ms"
T = TypeVar("T")
# What "fidelity": true compares against, whatever dtype the server runs in.
FIDELITY_REFERENCE = {"method": "full", "dtype": "float32"}


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
            headers["x-fidelity-reference"] = json.dumps(FIDELITY_REFERENCE, separators=(",", ":"))
            headers["x-exact-time-ms"] = f"{(self.exact_s or 0.0) * 1e3:.3f}"
        return headers


def _header_safe(name: str) -> str:
    """A checkpoint's name as a header value: printable ASCII as is, anything else percent-encoded."""
    return urllib.parse.quote(name, safe="".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%"))


def start_request(
    request: Request, raw_inputs: Any, options: EmbedOptions
) -> tuple[ServiceState, AttentionSpec, float | None, Encoder, Batcher, list, list[str]]:
    """What every embedding route does first: the request's attention (and target fidelity),
    the ready encoder and scheduler, the parsed inputs and their parameter names, and
    `dimensions` checked against the model. Raises ServiceError."""
    state = get_state(request)
    spec, target = resolve_request_attention(state.default_spec, options.attention, state.settings.target_fidelity)
    request.scope[METHOD_KEY] = spec.method
    encoder, batcher = state.require_ready()
    inputs, params = parse_inputs(raw_inputs, options.param, state.settings.max_client_batch_size)
    if options.dimensions is not None and options.dimensions > encoder.dim:
        raise errors.invalid_field("dimensions", f"must be in [1, {encoder.dim}], got {options.dimensions}")
    if options.fidelity and encoder.dtype != torch.float32 and state.settings.fidelity_reference == "off":
        raise errors.invalid_field(
            "fidelity", "this server runs without its float32 reference model (fidelity_reference=off)"
        )
    return state, spec, target, encoder, batcher, inputs, params


async def embed(request: Request, raw_inputs: Any, options: EmbedOptions) -> Embedded:
    """Run the whole pipeline for one request; raises ServiceError with the documented status."""
    state, spec, target, encoder, batcher, inputs, params = start_request(request, raw_inputs, options)
    call = await plan_request(encoder, inputs, params, spec, target, options)
    check_request_tokens(sum(planned.tokens for planned in call.inputs), options.param, state.settings.max_request_tokens)
    rerun = fidelity_reruns(encoder, call, options.fidelity)
    runs = [(p.tokens, p.spec) for p in call.inputs] + [(call.inputs[i].tokens, EXACT) for i in rerun]
    check_budget(encoder, runs, state, options.param, params)
    timeout = request_timeout_s(request, state.settings.request_timeout_s)
    job = Job(
        request_id=request.scope.get(REQUEST_ID_KEY, ""),
        inputs=[planned.ids for planned in call.inputs] + [call.inputs[i].ids for i in rerun],
        specs=[planned.spec for planned in call.inputs] + [EXACT] * len(rerun),
        adapter=call.adapter,
        exact_reruns=len(rerun),
        work=[encoder.cost.work(n, run_spec) for n, run_spec in runs],
        deadline=request.scope.get(ARRIVAL_KEY, time.monotonic()) + timeout,
        timeout_s=timeout,
    )
    result = await submit_unless_disconnected(request, batcher, job)
    n = len(call.inputs)
    vectors = finish(result.vectors, options.normalize, options.dimensions)
    embedded = Embedded(
        vectors=vectors[:n],
        tokens=[planned.tokens for planned in call.inputs],
        attention=call.echo(),
        result=result,
        inference_s=result.run_seconds(list(range(n))) if rerun else result.inference_s,
        prompt_name=call.prompt_name,
        adapter=call.adapter,
    )
    return with_fidelity(embedded, call, rerun, vectors[n:], state.metrics) if options.fidelity else embedded


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


async def plan_request(
    encoder: Encoder, inputs: list[Any], params: list[str], spec: AttentionSpec, target: float | None,
    options: EmbedOptions,
) -> Plan:
    """`models.plan` off the event loop (tokenizing a 30k-token text takes milliseconds), with
    its typed errors as statuses: too long 413 (the prompt's tokens count), empty 400, an
    unknown prompt or adapter 422 naming `prompt_name` or `adapter`, anything else 422 naming
    the input's param (or `prompt_name` for a prompt the inputs cannot take)."""
    return await run_planner(
        lambda: plan(
            encoder, inputs, spec, target_fidelity=target, truncate=options.truncate,
            truncation_direction=options.truncation_direction.lower(), prompt_name=options.prompt_name,
            adapter=options.adapter,
        ),  # fmt: skip
        params,
        options,
    )


async def run_planner(planner: Callable[[], T], params: list[str], options: EmbedOptions) -> T:
    """`planner()` (a models planning call) off the event loop, with its typed errors as
    `plan_request` answers them."""
    try:
        return await run_in_threadpool(planner)
    except InputError as exc:
        param = options.param if exc.index is None else params[exc.index]
        if isinstance(exc, InputTooLong):
            raise errors.input_too_long(param, exc.tokens, exc.limit) from None
        if isinstance(exc, EmptyInput) and not isinstance(exc, NoTokens):  # text with no token: 422 below
            raise errors.empty_input(param) from None
        raise errors.invalid_field(param, exc.detail) from None
    except (UnknownPrompt, UnknownAdapter) as exc:
        raise errors.invalid_field("adapter" if isinstance(exc, UnknownAdapter) else "prompt_name", _detail(exc)) from None
    except ValueError as exc:  # the prompt: token-id inputs, or a pooling that excludes it
        if not str(exc).startswith("prompt_name: "):
            raise
        raise errors.invalid_field("prompt_name", _detail(exc)) from None


def check_request_tokens(tokens: int, param: str, limit: int) -> None:
    """413 naming `param` when a request's forward passes would run more than `limit` tokens."""
    if tokens > limit:
        raise errors.request_too_large(param, tokens, "tokens", limit, "send fewer or shorter inputs")


def _detail(exc: ValueError) -> str:
    """A models ValueError's message without its leading "field: " (the error names the param)."""
    return str(exc).partition(": ")[2] or str(exc)


def fidelity_reruns(encoder: Encoder, call: Plan, fidelity: bool) -> list[int]:
    """The sequences that "fidelity": true runs a second time, with exact attention in float32,
    in the same job (one admission, one deadline; the scheduler never batches the two
    together): all of them, except in float32 those that ran exact attention (their own
    reference)."""
    if not fidelity:
        return []
    in_float32 = encoder.dtype == torch.float32
    return [i for i, planned in enumerate(call.inputs) if planned.spec.method != "full" or not in_float32]


def check_budget(
    encoder: Encoder, runs: list[tuple[int, AttentionSpec]], state: ServiceState, param: str, params: list[str],
    advice: str = "send fewer or shorter inputs per request",
) -> None:
    """422 (reason over_budget) when the request's estimated work, (tokens, resolved spec) per
    forward pass, is over the server's budget: naming the knob that drives it with the largest
    value that fits at these lengths, or, where no knob can, the inputs (and `advice`)."""
    throughput = state.throughput
    over = over_budget(encoder.cost, runs, state.work_budget, state.default_spec)
    if over is None:
        return
    work = f"{throughput.seconds(over.work):.0f} s of this server's time (estimated), over its budget of " \
        f"{throughput.seconds(over.budget):.0f} s per request"
    if over.knob is None:
        tokens = sum(n for n, _ in runs)
        passes = f", run as {len(runs)} sequences," if len(runs) > len(params) else ""
        raise errors.over_budget(param, f"{len(params)} input(s){passes} of {tokens} tokens in all would take {work}; {advice}")
    longest = max(n for n, _ in runs)
    also = "".join(f", with {name} at most {value}" for name, value in over.others.items())
    raise errors.over_budget(
        f"attention.{over.knob}",
        f"this request would take {work}; at {longest} tokens, {over.knob} can be at most {over.largest}{also}",
    )


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


def with_fidelity(embedded: Embedded, call: Plan, rerun: list[int], exact: Tensor, metrics: Metrics) -> Embedded:
    """`embedded` with each input's cosine to its exact-attention embedding (`exact`: the
    re-run inputs' vectors, finished alike), observed in the fidelity histogram, and the exact
    runs' time."""
    n, result = len(call.inputs), embedded.result
    cosines = [1.0] * n  # not re-run: it ran exact attention in float32, its own reference
    for i, cosine in zip(rerun, torch.nn.functional.cosine_similarity(embedded.vectors[rerun], exact, dim=-1).tolist()):
        cosines[i] = cosine
        if call.inputs[i].spec.method != "full":
            metrics.fidelity.labels(method=call.inputs[i].spec.method).observe(cosine)
    exact_s = result.run_seconds(list(range(n, n + len(rerun)))) if rerun else embedded.inference_s
    return dataclasses.replace(embedded, fidelity=cosines, exact_s=exact_s)
