"""What one embedding request runs, decided and checked before anything runs: a `RequestPlan`.

    request_plan(encoder, state, inputs, params, spec, target, options)
      -> models.planning.plan       one sequence per input, returning its pooled vector, or
                                    every token's state (/embed_all)
      -> models.planning.chunk_plan with `chunking`: one sequence per naive chunk or per late-
                                    chunking window (or Jina's `late_chunking` form: the inputs
                                    are one text's chunks)
      -> runs                       each sequence as the scheduler runs it (ids, attention,
                                    output, work), and with "fidelity": true its exact re-run
      -> limits, budget             413 over a per-request bound, 422 over the work budget
    -> RequestPlan                  the job, and how the rows it returns become each input's rows

The service's one serving path (service.pipeline) serves any plan the same way. The request's
own fields are read here too: its attention knobs over the server's defaults
(`resolve_request_attention`), its `input(s)` (`parse_inputs`) and its chunking fields
(`chunking_spec`). Bad values raise kernels.FieldError (or models.planning.inputs' typed errors),
which service.errors answers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch
from pydantic import BaseModel
from torch import Tensor

from clusterserve.engine import Run
from clusterserve.engine.fidelity import with_exact_reruns
from clusterserve.kernels import AttentionSpec, FieldError
from clusterserve.kernels.spec import CALIBRATED_KNOBS, knobs_beside_target
from clusterserve.models import Encoder
from clusterserve.models.compact import UNIT_ENCODINGS
from clusterserve.models.planning.chunk_plan import Chunk, plan_chunks, plan_late_inputs
from clusterserve.models.planning.chunking import ChunkingSpec, fields_beside_late_inputs
from clusterserve.models.planning.cost import over_budget
from clusterserve.models.planning.plan import Plan, plan
from clusterserve.models.pooling import EVERY_TOKEN, POOLED, Output

from . import errors
from .schemas import AttentionRequest, ChunkingRequest
from .settings import Settings
from .state import ServiceState

PER_REQUEST = "send fewer or shorter inputs per request"


@dataclass(frozen=True)
class EmbedOptions:
    """What a route asks besides the inputs: `param` is the body field holding them ("input"
    or "inputs"), for error messages; `chunking` / `late_chunking` / `every_token` say what
    each input returns (its pooled vector when none is set)."""

    param: str
    model: str | None = None  # the served model asked for by name (None: the default; ServiceState.pick)
    attention: AttentionRequest | None = None
    truncate: bool = False
    truncation_direction: str = "right"
    normalize: bool = True
    dimensions: int | None = None
    encoding_format: str = "float"  # how the vectors are written (service.responses.encoded_rows)
    fidelity: bool = False
    prompt_name: str | None = None  # None: the model's default prompt, if any
    adapter: str | None = None  # None: the adapter named like the prompt in effect, if any
    chunking: ChunkingRequest | None = None
    late_chunking: bool = False  # Jina's form: the inputs are the consecutive chunks of one text
    every_token: bool = False  # /embed_all: every token's state, not normalised

    @classmethod
    def of(cls, body: BaseModel, param: str, **overrides: Any) -> EmbedOptions:
        """A route's options: every field of these that the request body has, by name, then
        the route's `overrides`. Every other field of the body must be one NOT_OPTIONS names
        (TypeError otherwise), so that a schema field renamed away from its option's name fails
        loudly instead of being dropped."""
        names = {f.name for f in dataclasses.fields(cls)}
        stray = set(type(body).model_fields) - names - NOT_OPTIONS
        if stray:
            raise TypeError(f"{type(body).__name__}: {sorted(stray)} are neither EmbedOptions fields nor NOT_OPTIONS")
        fields = {name: getattr(body, name) for name in type(body).model_fields if name in names}
        return cls(**{**fields, "param": param, **overrides})


# Request fields that are not options: the inputs, and what a route accepts and ignores.
NOT_OPTIONS = frozenset({"input", "inputs", "prompt", "user", "options", "keep_alive"})


@dataclass(frozen=True)
class Limit:
    """A per-request bound the plan must keep (413 naming the inputs' field when over)."""

    count: int
    what: str  # "tokens", "chunks", "token vectors"
    limit: int
    advice: str


@dataclass(frozen=True)
class RequestPlan:
    """sequences: what runs, each sequence's ids and resolved attention (a models Plan);
    runs: the job, each sequence as a scheduler Run (ids, spec, output, work), then with
    "fidelity": true the exact re-runs of the sequences in `rerun`; rows: per sequence, the
    rows it returns; attention: the response's echo of the resolved spec(s); input_tokens: per
    input (what `usage` counts); input_sequences: per input, its range of sequences; assemble:
    the sequences' rows, concatenated in order -> per input its rows, not normalised; limits
    and budget_advice: the per-request bounds the plan is checked against; chunks: per input its
    chunks' spans (None: not chunked)."""

    sequences: Plan
    runs: tuple[Run, ...]
    rerun: tuple[int, ...]
    rows: tuple[int, ...]
    attention: dict[str, Any]
    input_tokens: tuple[int, ...]
    input_sequences: tuple[range, ...]
    assemble: Callable[[Tensor], list[Tensor]]
    limits: tuple[Limit, ...]
    budget_advice: str = PER_REQUEST
    chunks: tuple[tuple[Chunk, ...], ...] | None = None


def request_plan(
    encoder: Encoder, state: ServiceState, inputs: list[Any], params: list[str], spec: AttentionSpec,
    target: float | None, options: EmbedOptions,
) -> RequestPlan:
    """Plan a request (see the module docstring) and check it against the server's bounds:
    413 over a per-request limit, 422 over the work budget. Runs off the event loop
    (tokenizing a 30k-token text takes milliseconds). Raises FieldError, models.planning.inputs'
    errors and ServiceError."""
    settings = state.settings
    if options.dimensions is not None and options.dimensions > encoder.dim:
        raise FieldError("dimensions", f"must be in [1, {encoder.dim}], got {options.dimensions}")
    if options.encoding_format in UNIT_ENCODINGS and not options.normalize:
        raise FieldError(
            "encoding_format", f"{options.encoding_format} encodes unit vectors: send normalize true, or binary / ubinary"
        )
    if options.fidelity and encoder.dtype != torch.float32 and settings.fidelity_reference == "off":
        raise FieldError("fidelity", "this server runs without its float32 reference model (fidelity_reference=off)")
    if options.chunking is not None or options.late_chunking:
        planned = _chunked_plan(encoder, inputs, spec, target, options, settings)
    else:
        planned = _inputs_plan(encoder, inputs, spec, target, options, settings)
    for limit in planned.limits:
        if limit.count > limit.limit:
            raise errors.request_too_large(options.param, limit.count, limit.what, limit.limit, limit.advice)
    _check_budget(encoder, planned, state, options.param, params)
    return planned


def _inputs_plan(
    encoder: Encoder, inputs: list[Any], spec: AttentionSpec, target: float | None, options: EmbedOptions,
    settings: Settings,
) -> RequestPlan:
    """One sequence per input: its pooled vector, or every token's state (/embed_all)."""
    call = plan(
        encoder.checkpoint, inputs, spec, target_fidelity=target, prompt_name=options.prompt_name, adapter=options.adapter,
        truncate=options.truncate, truncation_direction=options.truncation_direction.lower(),
    )
    tokens = tuple(planned.tokens for planned in call.inputs)
    if options.every_token:
        limit = Limit(sum(tokens), "token vectors", settings.max_embed_all_tokens, "send fewer or shorter inputs, or truncate")
    else:
        limit = Limit(sum(tokens), "tokens", settings.max_request_tokens, "send fewer or shorter inputs")
    output = EVERY_TOKEN if options.every_token else POOLED
    return _request_plan(
        encoder, call, (output,) * len(tokens), options.fidelity,
        input_tokens=tokens,
        input_sequences=tuple(range(i, i + 1) for i in range(len(tokens))),  # one sequence an input
        assemble=lambda rows: list(rows.split([output.rows(n) for n in tokens])),
        limits=(limit,),
    )  # fmt: skip


def _chunked_plan(
    encoder: Encoder, inputs: list[Any], spec: AttentionSpec, target: float | None, options: EmbedOptions,
    settings: Settings,
) -> RequestPlan:
    """One sequence per naive chunk or late-chunking window; with Jina's `late_chunking` form
    the inputs are one text's chunks."""
    asked = chunking_spec(options.chunking, options.late_chunking)
    common = dict(target_fidelity=target, prompt_name=options.prompt_name, adapter=options.adapter)
    if options.late_chunking:
        chunked = plan_late_inputs(encoder.checkpoint, inputs, spec, window=asked.window,
                                   window_overlap=asked.window_overlap, **common)
    else:
        chunked = plan_chunks(
            encoder.checkpoint, inputs, spec, asked, truncate=options.truncate,
            truncation_direction=options.truncation_direction.lower(), **common,
        )  # fmt: skip
    tokens = sum(planned.tokens for planned in chunked.plan.inputs)
    advice = "send fewer inputs" if options.late_chunking else "send a larger chunking.size or fewer inputs"
    budget_advice = PER_REQUEST
    if len(chunked.plan.inputs) > len(inputs):  # chunks or windows
        budget_advice += ", larger chunks, or less overlap between windows (chunking.window_overlap)"
    return _request_plan(
        encoder, chunked.plan, chunked.outputs, options.fidelity,
        input_tokens=tuple(one.tokens for one in chunked.inputs),
        input_sequences=tuple(one.sequences for one in chunked.inputs),
        assemble=chunked.assemble,
        limits=(
            Limit(tokens, "tokens", settings.max_request_tokens, "send fewer or shorter inputs"),
            Limit(chunked.chunks, "chunks", settings.max_request_chunks, advice),
        ),
        budget_advice=budget_advice,
        chunks=tuple(one.chunks for one in chunked.inputs),
    )  # fmt: skip


def _request_plan(
    encoder: Encoder, sequences: Plan, outputs: tuple[Output, ...], fidelity: bool, **fields: Any
) -> RequestPlan:
    """The plan of `sequences`, each returning its `outputs`, as the job's runs with their
    estimated work (models.planning.cost). With "fidelity": true every sequence runs a second
    time, with exact attention in float32, in the same job (one admission, one deadline; the
    scheduler never batches the two together), except in float32 those that ran exact
    attention (their own reference)."""
    own = [
        Run(planned.ids, planned.spec, output, encoder.cost.work(planned.tokens, planned.spec))
        for planned, output in zip(sequences.inputs, outputs)
    ]
    runs, rerun = with_exact_reruns(own, encoder.dtype == torch.float32, encoder.cost.work) if fidelity else (own, ())
    return RequestPlan(
        sequences=sequences,
        runs=tuple(runs),
        rerun=rerun,
        rows=tuple(output.rows(planned.tokens) for output, planned in zip(outputs, sequences.inputs)),
        attention=sequences.echo(),
        **fields,
    )


def _check_budget(encoder: Encoder, planned: RequestPlan, state: ServiceState, param: str, params: list[str]) -> None:
    """422 (reason over_budget) when the plan's estimated work, every run's (tokens, resolved
    spec), is over the server's budget: naming the knob that drives it with the largest value
    that fits at these lengths, or, where no knob can, the inputs (and the plan's advice)."""
    runs = [(len(run.ids), run.spec) for run in planned.runs]
    served = state.served(encoder)
    over = over_budget(encoder.cost, runs, served.work_budget, state.default_spec)
    if over is None:
        return
    throughput = served.throughput
    work = f"{throughput.seconds(over.work):.0f} s of this server's time (estimated), over its budget of " \
        f"{throughput.seconds(over.budget):.0f} s per request"
    if over.knob is None:
        tokens = sum(n for n, _ in runs)
        passes = f", run as {len(runs)} sequences," if len(runs) > len(params) else ""
        raise errors.over_budget(
            param, f"{len(params)} input(s){passes} of {tokens} tokens in all would take {work}; {planned.budget_advice}"
        )
    longest = max(n for n, _ in runs)
    also = "".join(f", with {name} at most {value}" for name, value in over.others.items())
    raise errors.over_budget(
        f"attention.{over.knob}",
        f"this request would take {work}; at {longest} tokens, {over.knob} can be at most {over.largest}{also}",
    )


def resolve_request_attention(
    default: AttentionSpec, requested: AttentionRequest | None, default_target: float | None = None
) -> tuple[AttentionSpec, float | None]:
    """The request's knobs over the server defaults, validated as an AttentionSpec (FieldError
    naming the knob), and the target fidelity "auto" aims at: the request's, else the server's
    `default_target` when the request runs "auto" and names no knob a calibration sets. A
    target with no method runs "auto", and names no knob it chooses (that it goes with "auto"
    only is kernels.resolve_auto's rule, met when the plan resolves each input)."""
    knobs = requested.model_dump(exclude_none=True) if requested is not None else {}
    error = knobs_beside_target(knobs)
    if error is not None:
        raise error
    target = knobs.pop("target_fidelity", None)
    if target is not None:
        knobs.setdefault("method", "auto")
    elif knobs.get("method", default.method) == "auto" and not any(name in knobs for name in CALIBRATED_KNOBS):
        target = default_target
    return default.with_knobs(**knobs), target


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


def chunking_spec(requested: ChunkingRequest | None, late_inputs: bool) -> ChunkingSpec:
    """The request's chunking fields over ChunkingSpec's defaults (FieldError naming a bad
    one). With late_inputs (Jina's form) the inputs are the chunks: only the window fields
    apply."""
    fields = requested.model_dump(exclude_none=True) if requested is not None else {}
    error = fields_beside_late_inputs({**fields, "late_chunking": late_inputs})
    if error is not None:
        raise error
    return ChunkingSpec(**fields)
