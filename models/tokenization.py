"""Text -> token ids and character offsets, from a checkpoint's tokenizer.json.

A thin wrapper over `tokenizers.Tokenizer`. The file's own truncation and padding settings
are switched off (all-MiniLM-L6-v2 ships with truncation at 128 tokens): long documents keep
every token, and the encoder decides what is too long. Truncation, when asked for, cuts the
text's tokens and keeps the special tokens ([CLS] ... [SEP], <s> ... </s>) around them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

from tokenizers import Tokenizer

TRUNCATION_DIRECTIONS = ("right", "left")

_SURROGATE = re.compile("[\ud800-\udfff]")


class Tokens(NamedTuple):
    """One tokenized text: ids and the (start, end) character span of each token in the
    text ((0, 0) for special tokens)."""

    ids: list[int]
    offsets: list[tuple[int, int]]


class TextTokenizer:
    """A checkpoint's tokenizer. `prefix` and `suffix`: the special token ids it puts around
    one text's tokens ([101] and [102], [CLS] and [SEP], for BERT)."""

    def __init__(self, source: str | Path | Tokenizer):
        """source: a tokenizer.json file, or a built `tokenizers.Tokenizer` (a GGUF's vocabulary:
        models.gguf_checkpoint)."""
        self._tokenizer = source if isinstance(source, Tokenizer) else Tokenizer.from_file(str(source))
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        # Special tokens the post-processor adds around one text (2 for [CLS] x [SEP]).
        self.num_special_tokens = self._tokenizer.num_special_tokens_to_add(is_pair=False)
        self.prefix, self.suffix = self._frame()

    def _frame(self) -> tuple[list[int], list[int]]:
        """The special tokens the post-processor puts before and after a text's tokens
        ([CLS] and [SEP] for BERT), found by framing a one-token text."""
        body = self._tokenizer.encode("a", add_special_tokens=False)
        framed = self._tokenizer.post_process(body).ids
        inner = body.ids
        for start in range(len(framed) - len(inner) + 1):
            if framed[start : start + len(inner)] == inner:
                return framed[:start], framed[start + len(inner) :]
        raise ValueError("tokenizer: its post-processor does not keep a text's tokens together")

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(
        self, texts: list[str], max_tokens: int | None = None, direction: str = "right"
    ) -> list[Tokens]:
        """Tokenize texts with special tokens added.

        max_tokens: when given, a text longer than this (special tokens included) loses
            tokens from its end (direction="right") or its start ("left"); special tokens
            are kept. None keeps every token.
        """
        if direction not in TRUNCATION_DIRECTIONS:
            raise ValueError(
                f"truncation_direction: must be one of {', '.join(TRUNCATION_DIRECTIONS)}, got {direction!r}"
            )
        if max_tokens is not None and max_tokens < self.num_special_tokens:
            raise ValueError(
                f"max_tokens: must leave room for the {self.num_special_tokens} special tokens, "
                f"got {max_tokens}"
            )
        encodings = self._tokenizer.encode_batch(_well_formed(texts), add_special_tokens=False)
        result = []
        for encoding in encodings:
            if max_tokens is not None and len(encoding) + self.num_special_tokens > max_tokens:
                encoding.truncate(max_tokens - self.num_special_tokens, direction=direction)
            encoding = self._tokenizer.post_process(encoding)
            result.append(Tokens(encoding.ids, encoding.offsets))
        return result

    def encode_body(self, texts: list[str]) -> list[Tokens]:
        """Tokenize texts without special tokens (a text's tokens alone, with their offsets):
        the pieces that chunking frames with `prefix` and `suffix` itself."""
        return [Tokens(e.ids, e.offsets) for e in self._tokenizer.encode_batch(_well_formed(texts), add_special_tokens=False)]

    def count(self, texts: list[str]) -> list[int]:
        """Tokens per text, special tokens included, nothing truncated."""
        encodings = self._tokenizer.encode_batch(_well_formed(texts), add_special_tokens=False)
        return [len(encoding) + self.num_special_tokens for encoding in encodings]


def _well_formed(texts: list[str]) -> list[str]:
    """The texts with each surrogate code point (a JSON string may carry a lone one, as
    "\\udbc6"; it is no character and the tokenizer refuses it) replaced by U+FFFD, one
    character for one, so that offsets into the text still hold."""
    return [_SURROGATE.sub("\ufffd", text) for text in texts]
