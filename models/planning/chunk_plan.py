"""The plan of a chunked call: which sequences run, what each returns, and how the returned
rows become chunk vectors.

    plan_chunks(checkpoint, texts, spec, chunking)    each text cut into chunks (models.planning.chunking)
    plan_late_inputs(checkpoint, texts, spec)         the texts are the consecutive chunks of one
                                                   text (Jina's `late_chunking` form)

Every sequence is framed as a text is: the tokenizer's prefix ([CLS]), the prompt's tokens,
a range of the text's tokens, the suffix ([SEP]). Naive chunking runs one sequence per chunk
and takes its pooled vector, the vector the chunk's tokens get when embedded alone. Late
chunking runs one sequence per context window and asks each for the mean of its states over
the parts of the chunks it keeps (`Output` kind "spans"); a chunk that straddles windows is
the token-weighted mean of its parts, which is the mean over its tokens. Each sequence's
attention is resolved by its own length, as `models.planning.plan` resolves an input's, so a plan's
`Plan` (its sequences) batches, echoes and runs like any other.

`ChunkPlan.assemble(rows)` takes the per-sequence rows concatenated in sequence order (the
scheduler's or `Encoder.run_chunks`' result) and returns each input's (chunks, dim) vectors.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
from torch import Tensor

from clusterserve.kernels import AttentionSpec, FieldError, Resolved, resolve_auto
from clusterserve.models.planning.chunk_defaults import chunk_defaults
from clusterserve.models.planning.chunking import (
    ChunkingSpec,
    ChunkLimits,
    chunk_spans,
    naive_chunk_within_limit,
    unit_starts,
    window_sizes,
    windows,
)
from clusterserve.models.planning.inputs import InputTooLong, NoTokens
from clusterserve.models.planning.plan import Plan, PlannedInput, check_attention, choose_prompt_and_adapter
from clusterserve.models.pooling import POOLED, Output
from clusterserve.models.tokenization import TRUNCATION_DIRECTIONS, Tokens

if TYPE_CHECKING:  # planning reads a checkpoint's data; the checkpoint module imports planning
    from clusterserve.models.checkpoint import Checkpoint


@dataclass(frozen=True)
class Chunk:
    """One chunk of an input. text_span: its [start, stop) characters in the input text
    (from its first token's first character to its last token's last). token_span: its
    [start, stop) tokens, indices into the text's tokens as `Checkpoint.tokenize` (POST
    /tokenize) lists them, special tokens included ([CLS] is 0)."""

    text_span: tuple[int, int]
    token_span: tuple[int, int]


@dataclass(frozen=True)
class ChunkedInput:
    """One input of a chunked call. tokens: its tokens, special tokens and prompt included
    (what the length limit counts); sequences: its range of the plan's sequences; rows: its
    range in the concatenated per-sequence rows; combine: (chunks, len(rows)) weights, its
    chunk vectors = combine @ those rows."""

    chunks: tuple[Chunk, ...]
    tokens: int
    sequences: range
    rows: range
    combine: Tensor


@dataclass(frozen=True)
class ChunkPlan:
    """plan: the sequences to run, in order, each with its resolved attention; outputs: what
    each sequence returns; inputs: how each input's chunk vectors come from the rows."""

    plan: Plan
    outputs: tuple[Output, ...]
    inputs: tuple[ChunkedInput, ...]
    late: bool

    @property
    def chunks(self) -> int:
        return sum(len(one.chunks) for one in self.inputs)

    @property
    def sequence_tokens(self) -> int:
        """Tokens the forward passes run (windows overlap: more than the inputs hold)."""
        return sum(planned.tokens for planned in self.plan.inputs)

    def assemble(self, rows: Tensor) -> list[Tensor]:
        """rows: (R, dim), every sequence's output rows (Output.rows), concatenated in
        sequence order -> per input its (chunks, dim) chunk vectors, not normalised."""
        return [one.combine @ rows[one.rows.start : one.rows.stop].float() for one in self.inputs]


@dataclass(frozen=True)
class _Document:
    """A text's tokens (no special tokens) and its chunks as [start, stop) ranges of them."""

    body: list[int]
    spans: list[tuple[int, int]]
    chunks: tuple[Chunk, ...]
    tokens: int


def chunk_limits(checkpoint: Checkpoint, framing: int) -> ChunkLimits:
    """The chunking rules' limits for this checkpoint, with `framing` special and prompt tokens,
    and its measured chunking defaults (models.planning.chunk_defaults)."""
    defaults = chunk_defaults(checkpoint.name)
    return ChunkLimits(
        framing=framing, max_tokens=checkpoint.max_input_tokens, native_positions=checkpoint.native_positions,
        late=defaults.late, window=defaults.window,
    )


def plan_chunks(
    checkpoint: Checkpoint, texts: Sequence[str], spec: AttentionSpec, chunking: ChunkingSpec, *,
    target_fidelity: float | None = None, truncate: bool = False, truncation_direction: str = "right",
    prompt_name: str | None = None, adapter: str | None = None,
) -> ChunkPlan:
    """Plan chunking each text (see the module docstring). A text may be longer than
    `checkpoint.max_input_tokens`: no pass is (each chunk, or late chunking's window, is within
    it), so a caller limits the passes' tokens instead. `truncate` cuts a text longer than
    `checkpoint.max_input_tokens` (prompt and special tokens included) to it first ("right" keeps
    its start, "left" its end). Raises
    kernels.FieldError naming a ChunkingSpec field that does not fit the model (`within`
    "chunking") or "chunking" for token-id inputs, and models.planning.plan's errors."""
    if not isinstance(chunking, ChunkingSpec):
        raise FieldError("chunking", f"must be a models.planning.chunking.ChunkingSpec, got {type(chunking).__name__}")
    chunking = chunking.resolved(chunk_limits(checkpoint, 0))
    if truncation_direction not in TRUNCATION_DIRECTIONS:
        raise FieldError(
            "truncation_direction", f"must be one of {', '.join(TRUNCATION_DIRECTIONS)}, got {truncation_direction!r}"
        )
    prompt_ids, chosen_prompt, chosen_adapter = _prompt(
        checkpoint, texts, spec, target_fidelity, prompt_name, adapter, chunking.late
    )
    framing = len(checkpoint.tokenizer.prefix) + len(prompt_ids) + len(checkpoint.tokenizer.suffix)
    error = naive_chunk_within_limit(vars(chunking), chunk_limits(checkpoint, framing))
    if error is not None:
        raise error
    limit = checkpoint.max_input_tokens - framing
    documents = []
    for index, (text, tokens) in enumerate(zip(texts, checkpoint.tokenizer.encode_body(list(texts)))):
        if len(tokens.ids) > limit and truncate:
            if limit < 1:
                raise InputTooLong(index, len(tokens.ids) + framing, checkpoint.max_input_tokens)
            keep = slice(None, limit) if truncation_direction == "right" else slice(-limit, None)
            tokens = Tokens(tokens.ids[keep], tokens.offsets[keep])
        starts = unit_starts(text, tokens.offsets, chunking.boundaries) if tokens.ids else []
        spans = chunk_spans(starts, len(tokens.ids), chunking.size, chunking.overlap)
        documents.append(_document(checkpoint, text, tokens, spans, framing))
    return _plan(checkpoint, documents, prompt_ids, spec, chunking, target_fidelity, chosen_prompt, chosen_adapter)


def plan_late_inputs(
    checkpoint: Checkpoint, texts: Sequence[str], spec: AttentionSpec, *, window: int | None = None,
    window_overlap: int | None = None, target_fidelity: float | None = None,
    prompt_name: str | None = None, adapter: str | None = None,
) -> ChunkPlan:
    """Jina's `late_chunking` form: the texts are the consecutive chunks of one text, whose
    tokens are theirs end to end; late chunking over it, one chunk per text. The plan has one
    input; its chunk spans index that joined text. The joined text's tokens are limited as
    one input's (InputTooLong with index None: no truncation, a chunk cannot be cut)."""
    chunking = ChunkingSpec(late=True, window=window, window_overlap=window_overlap)  # validates the two
    prompt_ids, chosen_prompt, chosen_adapter = _prompt(
        checkpoint, texts, spec, target_fidelity, prompt_name, adapter, True
    )
    framing = len(checkpoint.tokenizer.prefix) + len(prompt_ids) + len(checkpoint.tokenizer.suffix)
    pieces = checkpoint.tokenizer.encode_body(list(texts))
    body: list[int] = []
    spans, chunks = [], []
    for index, tokens in enumerate(pieces):
        if not tokens.ids:
            raise NoTokens(index, "has no tokens: every chunk needs at least one")
        span = (len(body), len(body) + len(tokens.ids))
        spans.append(span)
        first = len(checkpoint.tokenizer.prefix)  # token_span counts from the joined text's own [CLS]
        chunks.append(Chunk((tokens.offsets[0][0], tokens.offsets[-1][1]), (span[0] + first, span[1] + first)))
        body += tokens.ids
    if len(body) + framing > checkpoint.max_input_tokens:
        raise InputTooLong(None, len(body) + framing, checkpoint.max_input_tokens)  # type: ignore[arg-type]
    document = _Document(body, spans, tuple(chunks), len(body) + framing)
    return _plan(checkpoint, [document], prompt_ids, spec, chunking, target_fidelity, chosen_prompt, chosen_adapter)


def _prompt(
    checkpoint: Checkpoint, texts: Sequence[str], spec: AttentionSpec, target_fidelity: float | None,
    prompt_name: str | None, adapter: str | None, late: bool,
) -> tuple[list[int], str | None, str | None]:
    """The prompt's tokens (no special tokens), the prompt's name and the adapter (models.planning.plan),
    after checking the attention and that the inputs are texts."""
    check_attention(spec, target_fidelity)
    if isinstance(texts, str) or not texts or not all(isinstance(text, str) for text in texts):
        raise FieldError("chunking", "applies to a list of texts; token-id inputs cannot be chunked")
    chosen_prompt, chosen_adapter = choose_prompt_and_adapter(checkpoint, texts, prompt_name, adapter)
    prompt = checkpoint.prompts.text(chosen_prompt) if chosen_prompt is not None else ""
    if not late:  # late chunking pools spans of the text, never the prompt
        checkpoint.pooling.check_prompt(prompt)
    prompt_ids = checkpoint.tokenizer.encode_body([prompt])[0].ids if prompt else []
    return prompt_ids, chosen_prompt, chosen_adapter


def _document(checkpoint: Checkpoint, text: str, tokens: Tokens, spans: list[tuple[int, int]], framing: int) -> _Document:
    if not tokens.ids:  # no token of its own (private-use characters only, say): one chunk, the whole framed text
        return _Document([], [], (Chunk((0, len(text)), (0, framing)),), framing)
    first = len(checkpoint.tokenizer.prefix)  # token_span counts from the text's own [CLS]
    chunks = tuple(
        Chunk((tokens.offsets[start][0], tokens.offsets[stop - 1][1]), (start + first, stop + first))
        for start, stop in spans
    )
    return _Document(tokens.ids, spans, chunks, len(tokens.ids) + framing)


def _window_attention(spec: AttentionSpec, tokens: int, target: float | None) -> Resolved:
    """How a late-chunking window runs: a concrete method as asked; "auto" exact attention.
    A chunk vector's cosine to exact attention does not keep what it is for: on
    nomic-embed-text-v1.5, twelve technical documents of ~7k tokens found 0.08-0.17 fewer of
    their passages by chunks from the windows a 0.98 chunk target chose than from exact windows
    (docs/benchmarks.md#late-chunking-on-the-default-model), so no table choice is trusted for a
    window. The echo says so (`"late_windows": "exact"`)."""
    if spec.method != "auto":
        return resolve_auto(spec, tokens)
    echo: dict = {"method": "full", "late_windows": "exact"}
    if target is not None:
        echo["target_fidelity"] = target
    return Resolved(dataclasses.replace(spec, method="full"), echo)


def _plan(
    checkpoint: Checkpoint, documents: list[_Document], prompt_ids: list[int], spec: AttentionSpec, chunking: ChunkingSpec,
    target_fidelity: float | None, prompt_name: str | None, adapter: str | None,
) -> ChunkPlan:
    """The sequences of every document, with their outputs, attention and assembly."""
    prefix, suffix = list(checkpoint.tokenizer.prefix), list(checkpoint.tokenizer.suffix)
    head = prefix + prompt_ids  # where a sequence's text tokens begin
    framing = len(head) + len(suffix)
    sequences: list[list[int]] = []
    outputs: list[Output] = []
    inputs = []
    rows = 0
    # Checked with naive chunks too: the window fields are bounded whichever chunking runs.
    room, overlap = window_sizes(chunking, chunk_limits(checkpoint, framing))
    for document in documents:
        first_row, first_sequence = rows, len(sequences)
        if not document.body:  # its one chunk is the text's own embedding
            sequences.append(head + suffix)
            outputs.append(POOLED)
            combine = torch.eye(1)
            rows += 1
        elif chunking.late:
            weights = []
            for start, stop, keep in windows(len(document.body), room, overlap):
                parts = [(c, max(a, keep), min(b, stop)) for c, (a, b) in enumerate(document.spans) if a < stop and b > keep]
                sequences.append(head + document.body[start:stop] + suffix)
                outputs.append(Output("spans", tuple((a - start + len(head), b - start + len(head)) for _, a, b in parts)))
                weights += [(c, b - a) for c, a, b in parts]
            combine = torch.zeros(len(document.spans), len(weights))
            for row, (chunk, tokens) in enumerate(weights):
                combine[chunk, row] = tokens / (document.spans[chunk][1] - document.spans[chunk][0])
            rows += len(weights)
        else:
            for start, stop in document.spans:
                sequences.append(head + document.body[start:stop] + suffix)
                outputs.append(POOLED)
            combine = torch.eye(len(document.spans))
            rows += len(document.spans)
        inputs.append(
            ChunkedInput(document.chunks, document.tokens, range(first_sequence, len(sequences)), range(first_row, rows), combine)
        )
    table = checkpoint.calibration if target_fidelity is not None else None
    planned = tuple(
        PlannedInput(ids, _window_attention(spec, len(ids), target_fidelity) if chunking.late
                     else resolve_auto(spec, len(ids), table, target_fidelity))
        for ids in sequences
    )  # fmt: skip
    return ChunkPlan(Plan(planned, spec, target_fidelity, prompt_name, adapter), tuple(outputs), tuple(inputs), chunking.late)
