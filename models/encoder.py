"""Encoder: a loaded checkpoint with its tokenizer and pooling; texts or token ids in, vectors out.

`Encoder.embed` tokenizes, checks lengths against `max_input_tokens`, sorts the inputs by
length and runs them in batches under a padded-token budget with key padding masks (B, N),
pools, truncates to Matryoshka `dimensions`, normalises and returns the vectors in input order.
Build one with `models.load_encoder`.
"""

from __future__ import annotations

from numbers import Integral
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels import AttentionSpec

from .pooling import PoolingConfig, pool
from .prompts import Prompts
from .tokenization import TRUNCATION_DIRECTIONS, TextTokenizer, Tokens


class InputTooLong(ValueError):
    """Input `index` has `tokens` tokens (special tokens included), more than `limit`."""

    def __init__(self, index: int, tokens: int, limit: int):
        super().__init__(
            f"input {index} has {tokens} tokens, more than the limit of {limit}; "
            "shorten it or pass truncate=True"
        )
        self.index = index
        self.tokens = tokens
        self.limit = limit


class Encoder:
    """An embedding model ready to run. Attributes:

    name: model name; dim: embedding size; max_input_tokens: longest input accepted
    (special tokens included); native_positions: the longest input the checkpoint was
    trained on; device, dtype: where and in what precision the weights live; folder: the
    checkpoint folder it was loaded from.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: TextTokenizer,
        pooling: PoolingConfig,
        *,
        name: str,
        architecture: str,
        native_positions: int,
        max_input_tokens: int,
        position_extension: str | None,
        pad_token_id: int,
        vocab_size: int,
        folder: Path | None = None,
        adapters: tuple[str, ...] = (),
        prompts: Prompts | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.pooling = pooling
        self.name = name
        self.architecture = architecture
        self.native_positions = native_positions
        self.max_input_tokens = max_input_tokens
        self.position_extension = position_extension
        self.pad_token_id = pad_token_id
        self.vocab_size = vocab_size
        self.folder = folder
        self.adapters = adapters
        self.prompts = prompts or Prompts()
        first = next(model.parameters())
        self.device = first.device
        self.dtype = first.dtype
        self.dim = model.config.hidden_size

    def info(self) -> dict[str, Any]:
        """What the model is, for /info and logs."""
        return {
            "model": self.name,
            "architecture": self.architecture,
            "dim": self.dim,
            "max_input_tokens": self.max_input_tokens,
            "native_positions": self.native_positions,
            "position_extension": self.position_extension,
            "pooling": self.pooling.mode,
            "normalize": self.pooling.normalize,
            "special_tokens": self.tokenizer.num_special_tokens,
            "adapters": list(self.adapters),
            "prompts": dict(self.prompts.prompts),
            "default_prompt_name": self.prompts.default_name,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
        }

    def tokenize(self, texts: Sequence[str]) -> list[Tokens]:
        """Token ids and character offsets of each text, special tokens included, untruncated."""
        return self.tokenizer.encode(_check_texts(texts))

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Tokens per text, special tokens included (what `max_input_tokens` limits)."""
        return self.tokenizer.count(_check_texts(texts))

    def embed(
        self,
        inputs: Sequence[str] | Sequence[Sequence[int]],
        spec: AttentionSpec,
        truncate: bool = False,
        normalize: bool = True,
        dimensions: int | None = None,
        truncation_direction: str = "right",
        max_batch_tokens: int = 16384,
        adapter: str | None = None,
        prompt_name: str | None = None,
    ) -> Tensor:
        """Embed texts or token-id lists -> (n, dimensions or dim) float32 on the CPU, in input order.

        inputs: a list of strings (tokenized here, special tokens added) or a list of token-id
            lists, used exactly as given: no special tokens are added to raw ids, as the
            OpenAI API expects ids to be the model's input.
        spec: the attention method for every layer that attends globally.
        truncate: cut inputs longer than `max_input_tokens` (texts keep their special
            tokens) instead of raising InputTooLong.
        normalize: L2-normalise the output vectors (after the `dimensions` cut).
        dimensions: keep the first `dimensions` components (Matryoshka embeddings).
        truncation_direction: "right" keeps the start of an input, "left" its end.
        max_batch_tokens: at most this many tokens, padding included, per forward pass;
            a longer input runs alone.
        adapter: a task adapter of the checkpoint (`adapters`, e.g. Jina v3's
            "retrieval.query"); None runs the base weights.
        prompt_name: a prompt of the checkpoint (`prompts`), prepended to every text; None
            prepends the default prompt where the checkpoint names one. Its tokens count toward
            `max_input_tokens`. Token-id inputs are used as given: naming a prompt for them is
            an error. An unknown name raises UnknownPrompt (a ValueError) naming it.
        """
        if not isinstance(spec, AttentionSpec):
            raise ValueError(f"spec: must be a kernels.AttentionSpec, got {type(spec).__name__}")
        if truncation_direction not in TRUNCATION_DIRECTIONS:
            raise ValueError(
                f"truncation_direction: must be one of {', '.join(TRUNCATION_DIRECTIONS)}, "
                f"got {truncation_direction!r}"
            )
        if dimensions is not None and not (_is_int(dimensions) and 1 <= dimensions <= self.dim):
            raise ValueError(f"dimensions: must be an integer in [1, {self.dim}], got {dimensions!r}")
        if not (_is_int(max_batch_tokens) and max_batch_tokens >= 1):
            raise ValueError(f"max_batch_tokens: must be a positive integer, got {max_batch_tokens!r}")

        if adapter is not None and adapter not in self.adapters:
            known = ", ".join(self.adapters) if self.adapters else "none: this checkpoint has no adapters"
            raise ValueError(f"adapter: unknown adapter {adapter!r}; known: {known}")
        adapter_index = None if adapter is None else self.adapters.index(adapter)

        prompt = self.prompts.text(prompt_name)
        if prompt and not self.pooling.include_prompt:
            raise ValueError(
                "prompt_name: this checkpoint pools without its prompt's tokens (include_prompt: false), "
                "which is not implemented; embed without a prompt"
            )
        is_text = (
            isinstance(inputs, Sequence)
            and not isinstance(inputs, (str, bytes))
            and all(isinstance(x, str) for x in inputs)
        )
        if prompt and is_text:
            inputs = [prompt + text for text in inputs]
        elif prompt_name is not None and not is_text:
            raise ValueError("prompt_name: prompts apply to texts; token-id inputs are used exactly as given")

        sequences = self._input_ids(inputs, truncate, truncation_direction)
        pooled = torch.empty(len(sequences), self.dim, dtype=torch.float32)
        with torch.inference_mode():
            for batch in _length_batches(sequences, max_batch_tokens):
                pooled[batch] = self._forward([sequences[i] for i in batch], spec, adapter_index).cpu()
        vectors = pooled[:, :dimensions] if dimensions is not None else pooled
        return F.normalize(vectors, dim=-1) if normalize else vectors

    def _input_ids(
        self, inputs: Sequence[str] | Sequence[Sequence[int]], truncate: bool, direction: str
    ) -> list[list[int]]:
        """Token ids per input, truncated or checked against max_input_tokens."""
        if isinstance(inputs, (str, bytes)) or not isinstance(inputs, Sequence):
            raise ValueError("inputs: must be a list of strings or a list of token-id lists")
        if len(inputs) == 0:
            raise ValueError("inputs: empty list; send at least one text or token-id list")
        limit = self.max_input_tokens
        if all(isinstance(x, str) for x in inputs):
            tokens = self.tokenizer.encode(list(inputs), limit if truncate else None, direction)
            sequences = [t.ids for t in tokens]
        else:
            sequences = [_check_ids(i, x, self.vocab_size) for i, x in enumerate(inputs)]
            if truncate:
                sequences = [s[:limit] if direction == "right" else s[-limit:] for s in sequences]
        for i, ids in enumerate(sequences):
            if len(ids) > limit:
                raise InputTooLong(index=i, tokens=len(ids), limit=limit)
        return sequences

    def _forward(self, sequences: list[list[int]], spec: AttentionSpec, adapter: int | None = None) -> Tensor:
        """Right-pad a batch, run the model and pool -> (B, dim) float32."""
        lengths = [len(s) for s in sequences]
        n = max(lengths)
        input_ids = torch.full((len(sequences), n), self.pad_token_id, dtype=torch.long)
        for row, ids in enumerate(sequences):
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        mask = torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]  # (B, N) True = real
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        # Without padding the mask says nothing; leaving it out lets SDPA take its fused path.
        # Only models with task adapters take the argument.
        extra = {} if adapter is None else {"adapter": adapter}
        hidden = self.model(input_ids, None if min(lengths) == n else mask, spec, **extra)  # (B, N, C)
        return pool(hidden, mask, self.pooling.mode)


def _length_batches(sequences: list[list[int]], max_batch_tokens: int) -> list[list[int]]:
    """Indices grouped longest first so each batch's rows x longest length <= the budget."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]), reverse=True)
    batches: list[list[int]] = []
    for i in order:
        # Sorted descending: the first member of a batch is its longest.
        if batches and (len(batches[-1]) + 1) * len(sequences[batches[-1][0]]) <= max_batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def _check_texts(texts: Sequence[str]) -> list[str]:
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise ValueError("texts: must be a list of strings")
    return list(texts)


def _check_ids(index: int, ids: Any, vocab_size: int) -> list[int]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise ValueError(
            f"inputs[{index}]: expected a string or a list of token ids, got {type(ids).__name__}; "
            "do not mix texts and token ids in one call"
        )
    if len(ids) == 0:
        raise ValueError(f"inputs[{index}]: empty token-id list; send at least one token id")
    for t in ids:
        if not (_is_int(t) and 0 <= t < vocab_size):
            raise ValueError(f"inputs[{index}]: token ids must be integers in [0, {vocab_size}), got {t!r}")
    return [int(t) for t in ids]


def _is_int(value: Any) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)
