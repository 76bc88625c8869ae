"""Where a long document's chunks fall, and the context windows late chunking runs.

Retrieval over long documents works on chunks: one vector for a 7k-token document loses the
passages inside it. A chunk is a range of the document's tokens (never part of a token):

    boundaries "tokens"      fixed windows of `size` tokens, `overlap` tokens shared
    boundaries "sentences"   whole sentences packed up to `size` tokens; a chunk begins with
    boundaries "paragraphs"  the last sentences (paragraphs) of the one before, up to `overlap`
                             tokens of them; a unit longer than `size` is cut into pieces

Naive chunking embeds each chunk as its own sequence. Late chunking (Günther et al. 2024,
"Late Chunking: Contextual Chunk Embeddings Using Long-Context Embedding Models") runs the
model over the document and mean-pools the last hidden states over each chunk's tokens, so
that each chunk vector carries the document's context. A document longer than the context
`window` (default: the positions the checkpoint was trained on) runs in windows that overlap
by `window_overlap` tokens; each later window's first `window_overlap` outputs are context
only, and every token's state comes from exactly one window. `models.planning.chunk_plan` turns this
into the sequences a forward pass runs.
"""

from __future__ import annotations

import dataclasses
import re
from bisect import bisect_left
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Sequence

from clusterserve.kernels import FieldError
from clusterserve.models.planning.inputs import is_int

CHUNKING = "chunking"  # FieldError.within for a ChunkingSpec field
BOUNDARIES = ("tokens", "sentences", "paragraphs")
# The default window_overlap, as a share of a window's text tokens: each later window's kept
# tokens see at least this much left context, for 1 / (1 - share) times the tokens run. A
# quarter (127 tokens of a 512-token window): on bench.quality.retrieval the least share at which late
# chunks retrieve at least as well as naive chunks on both its query sets, for ~1.4x naive
# chunking's CPU time (docs/benchmarks.md has the sweep).
WINDOW_OVERLAP_SHARE = 0.25

# A sentence ends at . ! or ? (and any closing quotes or brackets) before whitespace, or at a
# blank line; a paragraph at a blank line. The next unit begins where the match ends.
_SENTENCE_END = re.compile(r"[.!?][\"'\u2019\u201d)\]]*\s+|\n[ \t]*\n\s*")
_PARAGRAPH_END = re.compile(r"\n[ \t]*\n\s*")


# What `chunking` may set beside late_chunking (Jina's form), whose inputs are the chunks.
LATE_INPUTS_FIELDS = ("window", "window_overlap")


@dataclass(frozen=True)
class ChunkLimits:
    """What the chunking rules need of the model and the prompt: `framing`, the special and
    prompt tokens a sequence adds; `max_tokens`, the model's length limit; `native_positions`,
    its trained positions; `late`, its default for ChunkingSpec.late; `window`, its default
    window where one was measured for it (models.planning.chunk_defaults; None: the trained
    positions). The default window is at most the length limit."""

    framing: int
    max_tokens: int
    native_positions: int
    late: bool = True
    window: int | None = None

    @property
    def default_window(self) -> int:
        return min(self.window or self.native_positions, self.max_tokens)

    def is_late(self, values: Mapping[str, Any]) -> bool:
        """Whether a chunking object (its fields) runs late chunking: its `late`, else the model's."""
        late = values.get("late")
        return self.late if late is None else late is True


@dataclass(frozen=True)
class ChunkingSpec:
    """How to chunk, validated on construction (kernels.FieldError naming the field). Sizes count the
    text's own tokens; a naive chunk's sequence adds the special tokens and the prompt, and a
    window counts every token it runs (positions).

    size: tokens per chunk (at most). overlap: tokens a chunk shares with the one before
    (below size). boundaries: one of BOUNDARIES. late: late chunking, else naive (None: the
    model's default, models.planning.chunk_defaults; `resolved` sets it). window:
    late chunking's context window in tokens, special tokens and prompt included (None: the
    checkpoint's trained positions). window_overlap: tokens each later window re-reads from
    the one before, as context only (None: WINDOW_OVERLAP_SHARE of the window's text tokens).
    """

    size: int = 256
    overlap: int = 0
    boundaries: str = "sentences"
    late: bool | None = None
    window: int | None = None
    window_overlap: int | None = None

    def resolved(self, limits: ChunkLimits) -> ChunkingSpec:
        """This spec with `late` decided: its own, else the model's (limits.late)."""
        return self if self.late is not None else dataclasses.replace(self, late=limits.late)

    def __post_init__(self) -> None:
        if not (is_int(self.size) and self.size >= 1):
            raise FieldError("size", f"must be a positive integer, got {self.size!r}", CHUNKING)
        if not (is_int(self.overlap) and self.overlap >= 0):
            raise FieldError("overlap", f"must be a non-negative integer, got {self.overlap!r}", CHUNKING)
        _raise(overlap_within_size(vars(self)))
        if self.boundaries not in BOUNDARIES:
            detail = f"must be one of {', '.join(BOUNDARIES)}, got {self.boundaries!r}"
            raise FieldError("boundaries", detail, CHUNKING)
        if self.late is not None and not isinstance(self.late, bool):
            raise FieldError("late", f"must be true or false, got {self.late!r}", CHUNKING)
        if self.window is not None and not (is_int(self.window) and self.window >= 1):
            raise FieldError("window", f"must be a positive integer, got {self.window!r}", CHUNKING)
        if self.window_overlap is not None and not (is_int(self.window_overlap) and self.window_overlap >= 0):
            detail = f"must be a non-negative integer, got {self.window_overlap!r}"
            raise FieldError("window_overlap", detail, CHUNKING)


# The chunking object's cross-field rules, each a function of its fields (given or resolved;
# `late_chunking` is the request's flag beside it) and the model's ChunkLimits that returns the
# FieldError a breaking object gets, else None. A missing field takes ChunkingSpec's default.
# models.planning.rules lists them with the attention rules; the service's OpenAPI document
# and the fuzz hooks read that list.
def overlap_within_size(values: Mapping[str, Any], limits: ChunkLimits | None = None) -> FieldError | None:
    """overlap below size."""
    size, overlap = _field(values, "size"), _field(values, "overlap")
    if size is None or overlap is None or overlap < size:
        return None
    return FieldError("overlap", f"must be an integer in [0, size - 1] = [0, {size - 1}], got {overlap}", CHUNKING)


def naive_chunk_within_limit(values: Mapping[str, Any], limits: ChunkLimits) -> FieldError | None:
    """With late false, a chunk and its special and prompt tokens within the model's limit."""
    size = _field(values, "size")
    if limits.is_late(values) or size is None or size + limits.framing <= limits.max_tokens:
        return None
    detail = (f"a chunk's sequence adds {limits.framing} special and prompt tokens; size must be at most "
              f"{limits.max_tokens - limits.framing}, got {size}")
    return FieldError("size", detail, CHUNKING)


def window_holds_framing(values: Mapping[str, Any], limits: ChunkLimits) -> FieldError | None:
    """A window holds its special and prompt tokens and some text."""
    window = _field(values, "window")
    if window is None or window > limits.framing:
        return None
    return FieldError("window", f"must hold the {limits.framing} special and prompt tokens and some text, got {window}",
                      CHUNKING)


def window_overlap_within_room(values: Mapping[str, Any], limits: ChunkLimits) -> FieldError | None:
    """window_overlap below the window's room for text: the window (default the model's trained
    positions, at most its limit) less its special and prompt tokens."""
    window = _field(values, "window")
    window = limits.default_window if window is None else window
    overlap, room = _field(values, "window_overlap"), window - limits.framing
    if overlap is None or room < 1 or overlap < room:
        return None
    detail = (f"must be below the window's {room} tokens of text (window {window} less {limits.framing} special and "
              f"prompt tokens), got {overlap}")
    return FieldError("window_overlap", detail, CHUNKING)


def fields_beside_late_inputs(values: Mapping[str, Any], limits: ChunkLimits | None = None) -> FieldError | None:
    """With late_chunking (Jina's form: the inputs are the chunks), chunking sets only the
    window fields."""
    if values.get("late_chunking") is not True:
        return None
    named = [name for name, value in values.items() if value is not None and name != "late_chunking"
             and name not in LATE_INPUTS_FIELDS]
    if not named:
        return None
    detail = "does not apply with late_chunking, whose inputs are the chunks; set window and window_overlap only"
    return FieldError(named[0], detail, CHUNKING)


def _field(values: Mapping[str, Any], name: str) -> int | None:
    """An integer field, or its ChunkingSpec default when absent; None when it is not an integer
    (its own check answers that)."""
    value = values.get(name)
    value = getattr(ChunkingSpec, name, None) if value is None else value
    return value if is_int(value) else None


def _raise(error: FieldError | None) -> None:
    if error is not None:
        raise error


def window_sizes(chunking: ChunkingSpec, limits: ChunkLimits) -> tuple[int, int]:
    """(room, overlap): the text tokens a context window runs and the ones it re-reads, for
    windows of `chunking.window` tokens (None: the limits' default window) that spend
    `limits.framing` tokens on special tokens and the prompt. FieldError naming window or
    window_overlap when they do not fit."""
    window = chunking.window if chunking.window is not None else limits.default_window
    if window > limits.max_tokens:
        raise FieldError("window", f"must be at most the model's {limits.max_tokens} tokens, got {window}", CHUNKING)
    _raise(window_holds_framing(vars(chunking), limits))
    _raise(window_overlap_within_room(vars(chunking), limits))
    room = window - limits.framing
    overlap = chunking.window_overlap if chunking.window_overlap is not None else int(room * WINDOW_OVERLAP_SHARE)
    return room, overlap


def unit_starts(text: str, offsets: Sequence[tuple[int, int]], boundaries: str) -> list[int]:
    """Token indices where a unit (a token, a sentence, a paragraph) begins, ascending, 0
    first. offsets: the (start, stop) characters of each of the text's tokens (no special
    tokens). A boundary between characters falls before the first token that starts at or
    after it, so no token is ever split."""
    if boundaries == "tokens":
        return list(range(len(offsets)))
    pattern = _SENTENCE_END if boundaries == "sentences" else _PARAGRAPH_END
    token_starts = [start for start, _ in offsets]
    starts = {0}
    for match in pattern.finditer(text):
        index = bisect_left(token_starts, match.end())
        if index < len(offsets):
            starts.add(index)
    return sorted(starts)


def chunk_spans(starts: Sequence[int], tokens: int, size: int, overlap: int) -> list[tuple[int, int]]:
    """[start, stop) token ranges of the chunks of a text of `tokens` tokens whose units begin
    at `starts` (unit_starts): each chunk as many whole units as fit in `size` tokens (a
    longer unit is cut into pieces of `size`), each next one beginning with the last units of
    the one before that fit in `overlap` tokens. The chunks cover every token, in order."""
    ends = [*starts[1:], tokens]
    units = [(begin, min(begin + size, end)) for start, end in zip(starts, ends) for begin in range(start, end, size)]
    chunks: list[tuple[int, int]] = []
    first = 0
    while first < len(units):
        last = first  # units[first..last] fit: every unit is at most `size` tokens
        while last + 1 < len(units) and units[last + 1][1] - units[first][0] <= size:
            last += 1
        stop = units[last][1]
        chunks.append((units[first][0], stop))
        if last + 1 == len(units):
            break
        # The next chunk carries back this one's last units that fit in `overlap`, as long as
        # it still reaches the next unit (else it would add no token).
        following, reach = last + 1, units[last + 1][1]
        while (
            following - 1 > first
            and stop - units[following - 1][0] <= overlap
            and reach - units[following - 1][0] <= size
        ):
            following -= 1
        first = following
    return chunks


def windows(tokens: int, room: int, overlap: int) -> list[tuple[int, int, int]]:
    """The context windows over a text of `tokens` tokens: (start, stop, keep) token ranges,
    each at most `room` tokens, each after the first starting `overlap` tokens before the one
    before ends; a window's outputs from `keep` on are the ones used (keep = start for the
    first window, start + overlap after), so every token is kept from exactly one window."""
    if not 0 <= overlap < room:
        raise ValueError(f"overlap: must be in [0, room - 1] = [0, {room - 1}], got {overlap}")
    result = [(0, min(room, tokens), 0)]
    while result[-1][1] < tokens:
        start = result[-1][1] - overlap
        result.append((start, min(start + room, tokens), start + overlap))
    return result
