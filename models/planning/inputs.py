"""Input preparation: texts or token-id lists -> token ids the encoder can run, in input order.

The one place where inputs are checked and cut to size: texts are tokenized with the
model's special tokens; token-id lists are used exactly as given (no special tokens added,
as the OpenAI API expects ids to be the model's input) after a range check against the
vocabulary; `truncate` cuts an input longer than the limit ("right" keeps its start, "left"
its end; texts keep their special tokens), otherwise such an input is refused.

Failures are typed `InputError`s (all `kernels.FieldError`s) that name the input by its index, so
a caller can map each kind to its own answer (the HTTP service: 400, 413, 422).
"""

from __future__ import annotations

from numbers import Integral
from typing import Any, Protocol, Sequence

from clusterserve.kernels import FieldError
from clusterserve.models.tokenization import TRUNCATION_DIRECTIONS, Tokens


class InputError(FieldError):
    """An input that cannot be embedded. `index`: its position in the call (None: the call
    as a whole); `detail`: what is wrong, without the input's name."""

    def __init__(self, index: int | None, detail: str):
        super().__init__("inputs" if index is None else f"inputs[{index}]", detail)
        self.index = index


class EmptyInput(InputError):
    """No inputs at all, or an empty token-id list."""


class NoTokens(EmptyInput):
    """A text that is not empty but has no token of its own (blanks, private-use characters)
    where a call needs one: a piece of Jina's late-chunking form, which must be a chunk."""


class InvalidTokenIds(InputError):
    """A token-id list with an id outside the vocabulary (or not an integer), or a call
    that mixes texts and token-id lists."""


class InputTooLong(InputError):
    """Input `index` has `tokens` tokens (special tokens included), more than `limit`."""

    def __init__(self, index: int, tokens: int, limit: int):
        super().__init__(
            index, f"has {tokens} tokens, more than the limit of {limit}; shorten it or pass truncate=True"
        )
        self.tokens = tokens
        self.limit = limit


class Tokenizer(Protocol):
    def encode(self, texts: list[str], max_tokens: int | None = None, direction: str = "right") -> list[Tokens]: ...


def prepare_inputs(
    tokenizer: Tokenizer, inputs: Sequence[str] | Sequence[Sequence[int]], *, vocab_size: int, limit: int,
    truncate: bool = False, truncation_direction: str = "right",
) -> list[list[int]]:
    """Token ids per input, each at most `limit` long (special tokens included).

    inputs: a list of strings or a list of token-id lists (not both).
    Raises EmptyInput, InvalidTokenIds, InputTooLong (each names the input's index), or
    FieldError for a `truncation_direction` other than "right" or "left".
    """
    if truncation_direction not in TRUNCATION_DIRECTIONS:
        raise FieldError(
            "truncation_direction", f"must be one of {', '.join(TRUNCATION_DIRECTIONS)}, got {truncation_direction!r}"
        )
    if isinstance(inputs, (str, bytes)) or not isinstance(inputs, Sequence):
        raise InputError(None, "must be a list of strings or a list of token-id lists")
    if len(inputs) == 0:
        raise EmptyInput(None, "empty list; send at least one text or token-id list")
    if all(isinstance(x, str) for x in inputs):
        tokens = tokenizer.encode(list(inputs), limit if truncate else None, truncation_direction)
        sequences = [t.ids for t in tokens]
    else:
        sequences = [_checked_ids(i, x, vocab_size) for i, x in enumerate(inputs)]
        if truncate:
            right = truncation_direction == "right"
            sequences = [s[:limit] if right else s[-limit:] for s in sequences]
    for i, ids in enumerate(sequences):
        if len(ids) > limit:
            raise InputTooLong(i, len(ids), limit)
    return sequences


def _checked_ids(index: int, ids: Any, vocab_size: int) -> list[int]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise InvalidTokenIds(
            index,
            f"expected a string or a list of token ids, got {type(ids).__name__}; "
            "do not mix texts and token ids in one call",
        )
    if len(ids) == 0:
        raise EmptyInput(index, "empty token-id list; send at least one token id")
    if all(type(t) is int for t in ids) and 0 <= min(ids) and max(ids) < vocab_size:
        return list(ids)  # plain ints in range: the common case, a few passes in C
    for t in ids:
        if not (is_int(t) and 0 <= t < vocab_size):
            raise InvalidTokenIds(index, f"token ids must be in [0, {vocab_size}), got {t!r}")
    return [int(t) for t in ids]


def is_int(value: Any) -> bool:
    """An integer that is not a bool."""
    return isinstance(value, Integral) and not isinstance(value, bool)
