"""The chunked and token-level pipelines: the `chunking` extension of /v1/embeddings and
/embed, Jina's `late_chunking` form of /v1/embeddings, and /embed_all.

They are service.pipeline's `embed` with another plan and other outputs per sequence:

    embed_chunks   models.chunk_plan: one sequence per naive chunk or per late-chunking context
                   window, each returning its pooled vector or its means over the chunks' spans
                   -> per input its (chunks, dim) vectors and each chunk's character and token spans
    embed_tokens   models.plan: one sequence per input, returning every token's state
                   -> per input its (tokens, dim) states, not normalised

The sequences queue on the scheduler as one job (`Job.outputs` says what each returns) and
batch with any other request's. Limits: the tokens the passes run (max_request_tokens), the
chunks returned (max_request_chunks), the token vectors returned (max_embed_all_tokens): 413.
Chunks count in clusterserve_chunks{method} (one observation per chunked input: its chunks).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from fastapi import Request
from torch import Tensor

from models import UnknownPrompt
from models.calibration import EXACT
from models.chunk_plan import Chunk, ChunkPlan, plan_chunks, plan_late_inputs
from models.chunking import ChunkingSpec
from models.encoder import finish
from models.inputs import InputError
from models.plan import Plan, UnknownAdapter
from models.pooling import EVERY_TOKEN, Output

from . import errors
from .batching import Job
from .middleware import ARRIVAL_KEY, REQUEST_ID_KEY
from .pipeline import (
    Embedded,
    EmbedOptions,
    check_budget,
    check_request_tokens,
    fidelity_reruns,
    plan_request,
    request_timeout_s,
    run_planner,
    start_request,
    submit_unless_disconnected,
)
from .schemas import ChunkingRequest
from .state import ServiceState

CHUNKING_FIELDS = tuple(field.name for field in dataclasses.fields(ChunkingSpec))
LATE_INPUTS_FIELDS = ("window", "window_overlap")  # what `chunking` may set beside late_chunking


@dataclass(frozen=True)
class ChunkedEmbedded:
    """A chunked request's answer. embedded.vectors: every chunk's vector, input after input
    (normalised and cut as asked); embedded.tokens: per input; embedded.fidelity: per chunk.
    chunks: per input, its chunks' spans."""

    embedded: Embedded
    chunks: list[tuple[Chunk, ...]]

    def per_input(self) -> list[Tensor]:
        """Per input, its (chunks, dim) vectors."""
        return list(self.embedded.vectors.split([len(chunks) for chunks in self.chunks]))


async def embed_chunks(
    request: Request, raw_inputs: Any, options: EmbedOptions, chunking: ChunkingRequest | None, late_inputs: bool = False
) -> ChunkedEmbedded:
    """One chunked request: each text cut as `chunking` says, or (late_inputs, Jina's form)
    the texts as the consecutive chunks of one text. Raises ServiceError with the documented
    status; a bad chunking field is a 422 naming it (`chunking.overlap`)."""
    state, spec, target, encoder, batcher, inputs, params = start_request(request, raw_inputs, options)
    asked = chunking_spec(chunking, late_inputs)
    where = "late_chunking" if late_inputs else "chunking"
    if late_inputs:
        planner: Callable[[], ChunkPlan] = lambda: plan_late_inputs(  # noqa: E731
            encoder, inputs, spec, window=asked.window, window_overlap=asked.window_overlap, target_fidelity=target,
            prompt_name=options.prompt_name, adapter=options.adapter,
        )  # fmt: skip
    else:
        planner = lambda: plan_chunks(  # noqa: E731
            encoder, inputs, spec, asked, target_fidelity=target, truncate=options.truncate,
            truncation_direction=options.truncation_direction.lower(), prompt_name=options.prompt_name,
            adapter=options.adapter,
        )  # fmt: skip
    call = await run_planner(_naming_chunking_fields(planner, where), params, options)
    check_request_tokens(call.sequence_tokens, options.param, state.settings.max_request_tokens)
    if call.chunks > state.settings.max_request_chunks:
        advice = "send fewer inputs" if late_inputs else "send a larger chunking.size or fewer inputs"
        raise errors.request_too_large(options.param, call.chunks, "chunks", state.settings.max_request_chunks, advice)
    sequences = call.plan.inputs
    rerun = fidelity_reruns(encoder, call.plan, options.fidelity)
    job = _job(request, state, call.plan, list(call.outputs), rerun, params, options.param)
    result = await submit_unless_disconnected(request, batcher, job)
    rows = sum(output.rows(planned.tokens) for output, planned in zip(call.outputs, sequences))
    vectors = [finish(v, options.normalize, options.dimensions) for v in call.assemble(result.vectors[:rows])]
    for one, chunk_vectors in zip(call.inputs, vectors):
        state.metrics.chunks.labels(method=_method(call.plan, one.sequences)).observe(len(chunk_vectors))
    embedded = Embedded(
        vectors=torch.cat(vectors),
        tokens=[one.tokens for one in call.inputs],
        attention=call.plan.echo(),
        result=result,
        inference_s=result.run_seconds(list(range(len(sequences)))) if rerun else result.inference_s,
        prompt_name=call.plan.prompt_name,
        adapter=call.plan.adapter,
    )
    if options.fidelity:
        exact = _exact_rows(call, result.vectors, rows, rerun)
        exact_vectors = torch.cat([finish(v, options.normalize, options.dimensions) for v in call.assemble(exact)])
        cosines = torch.nn.functional.cosine_similarity(embedded.vectors, exact_vectors, dim=-1).tolist()
        first = 0
        for one in call.inputs:
            method = _method(call.plan, one.sequences)
            for cosine in cosines[first : first + len(one.chunks)] if method != "full" else ():
                state.metrics.fidelity.labels(method=method).observe(cosine)
            first += len(one.chunks)
        reruns = list(range(len(sequences), len(sequences) + len(rerun)))
        exact_s = result.run_seconds(reruns) if rerun else embedded.inference_s
        embedded = dataclasses.replace(embedded, fidelity=cosines, exact_s=exact_s)
    return ChunkedEmbedded(embedded, [one.chunks for one in call.inputs])


async def embed_tokens(request: Request, raw_inputs: Any, options: EmbedOptions) -> Embedded:
    """/embed_all: every token's last hidden state, per input (n_i, dim) rows of
    `Embedded.vectors`, input after input (n_i = `Embedded.tokens[i]`), not normalised."""
    state, spec, target, encoder, batcher, inputs, params = start_request(request, raw_inputs, options)
    call = await plan_request(encoder, inputs, params, spec, target, options)
    tokens = [planned.tokens for planned in call.inputs]
    if sum(tokens) > state.settings.max_embed_all_tokens:
        raise errors.request_too_large(
            options.param, sum(tokens), "token vectors", state.settings.max_embed_all_tokens,
            "send fewer or shorter inputs, or truncate",
        )  # fmt: skip
    job = _job(request, state, call, [EVERY_TOKEN] * len(call.inputs), [], params, options.param)
    result = await submit_unless_disconnected(request, batcher, job)
    return Embedded(
        vectors=result.vectors,
        tokens=tokens,
        attention=call.echo(),
        result=result,
        inference_s=result.inference_s,
        prompt_name=call.prompt_name,
        adapter=call.adapter,
    )


def chunking_spec(requested: ChunkingRequest | None, late_inputs: bool) -> ChunkingSpec:
    """The request's chunking fields over ChunkingSpec's defaults; 422 naming a bad one. With
    late_inputs (Jina's form) the inputs are the chunks: only the window fields apply."""
    fields = requested.model_dump(exclude_none=True) if requested is not None else {}
    if late_inputs:
        for name in fields:
            if name not in LATE_INPUTS_FIELDS:
                raise errors.invalid_field(
                    f"chunking.{name}",
                    "does not apply with late_chunking, whose inputs are the chunks; set window and window_overlap only",
                )
    try:
        return ChunkingSpec(**fields)
    except ValueError as exc:
        field, _, message = str(exc).partition(": ")
        raise errors.invalid_field(f"chunking.{field}", message) from None


def _naming_chunking_fields(planner: Callable[[], ChunkPlan], where: str) -> Callable[[], ChunkPlan]:
    """`planner` whose ValueErrors about a chunking field (a size or window the model cannot
    take) are 422s naming it, and token-id inputs a 422 on `where`; the other errors are left
    for run_planner."""

    def run() -> ChunkPlan:
        try:
            return planner()
        except (InputError, UnknownPrompt, UnknownAdapter):
            raise
        except ValueError as exc:
            field, _, message = str(exc).partition(": ")
            if field == "chunking":
                raise errors.invalid_field(where, message) from None
            if field in CHUNKING_FIELDS:
                raise errors.invalid_field(f"chunking.{field}", message) from None
            raise

    return run


def _job(
    request: Request, state: ServiceState, call: Plan, outputs: list[Output], rerun: list[int], params: list[str], param: str
) -> Job:
    """The scheduler job of a plan's sequences, each returning its output; the `rerun` ones
    again with exact attention ("fidelity": true), after them. Every sequence (a naive chunk, a
    late-chunking window, a re-run) counts toward the request's work budget: 422 over it."""
    encoder = state.require_ready()[0]
    runs = [(p.tokens, p.spec) for p in call.inputs] + [(call.inputs[i].tokens, EXACT) for i in rerun]
    advice = "send fewer or shorter inputs per request"
    if len(call.inputs) > len(params):  # chunks or windows
        advice += ", larger chunks, or less overlap between windows (chunking.window_overlap)"
    check_budget(encoder, runs, state, param, params, advice)
    timeout = request_timeout_s(request, state.settings.request_timeout_s)
    return Job(
        request_id=request.scope.get(REQUEST_ID_KEY, ""),
        inputs=[planned.ids for planned in call.inputs] + [call.inputs[i].ids for i in rerun],
        specs=[planned.spec for planned in call.inputs] + [EXACT] * len(rerun),
        adapter=call.adapter,
        exact_reruns=len(rerun),
        outputs=outputs + [outputs[i] for i in rerun],
        work=[encoder.cost.work(n, spec) for n, spec in runs],
        deadline=request.scope.get(ARRIVAL_KEY, time.monotonic()) + timeout,
        timeout_s=timeout,
    )


def _exact_rows(call: ChunkPlan, vectors: Tensor, rows: int, rerun: list[int]) -> Tensor:
    """The rows every sequence gives with exact attention: its own where it ran exact, its
    re-run's (after the first `rows` rows of `vectors`) where it did not."""
    exact = vectors[:rows].clone()
    starts, start = [], 0
    for output, planned in zip(call.outputs, call.plan.inputs):
        starts.append(start)
        start += output.rows(planned.tokens)
    at = rows
    for i in rerun:
        count = call.outputs[i].rows(call.plan.inputs[i].tokens)
        exact[starts[i] : starts[i] + count] = vectors[at : at + count]
        at += count
    return exact


def _method(call: Plan, sequences: range) -> str:
    """The attention method that runs most of these sequences' tokens (a metric's label)."""
    tokens: dict[str, int] = {}
    for planned in call.inputs[sequences.start : sequences.stop]:
        tokens[planned.spec.method] = tokens.get(planned.spec.method, 0) + planned.tokens
    return max(tokens, key=lambda method: tokens[method])
