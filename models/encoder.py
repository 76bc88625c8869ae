"""Encoder: a loaded checkpoint with its tokenizer and pooling; texts or token ids in, vectors out.

Two levels:
- `Encoder.embed(inputs, spec)`: the Python API. Prepares the inputs (models.inputs: tokenize,
  check, truncate or refuse what is too long), sorts them by length, runs them in batches
  under a padded-token budget and returns the vectors in input order.
- `Encoder.embed_batch(sequences, spec)`: one forward pass over prepared token ids, as given:
  right-padded with a key padding mask (B, N), pooled, cut to Matryoshka `dimensions` and
  normalised. The service's scheduler, which forms its own batches, calls this.
Build one with `models.load_encoder`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels import BACKENDS, AttentionSpec

from .inputs import InputTooLong, is_int, prepare_inputs
from .pooling import PoolingConfig, pool
from .prompts import Prompts
from .tokenization import TextTokenizer, Tokens

__all__ = ["Encoder", "InputTooLong"]


class Encoder:
    """An embedding model ready to run. Attributes:

    name: model name; dim: embedding size; max_input_tokens: longest input accepted
    (special tokens included); native_positions: the longest input the checkpoint was
    trained on; device, dtype: where and in what precision the weights live; folder: the
    checkpoint folder it was loaded from; backend: the `kernels.attention` backend every
    attention layer is called with.
    """

    def __init__(
        self, model: nn.Module, tokenizer: TextTokenizer, pooling: PoolingConfig, *, name: str, architecture: str,
        native_positions: int, max_input_tokens: int, position_extension: str | None, pad_token_id: int,
        vocab_size: int, folder: Path | None = None, adapters: tuple[str, ...] = (), prompts: Prompts | None = None,
        backend: str = "auto",
    ):
        if backend not in BACKENDS:
            raise ValueError(f"backend: must be one of {', '.join(BACKENDS)}, got {backend!r}")
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
        self.backend = backend
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
            "backend": self.backend,
        }

    def tokenize(self, texts: Sequence[str]) -> list[Tokens]:
        """Token ids and character offsets of each text, special tokens included, untruncated."""
        return self.tokenizer.encode(_check_texts(texts))

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Tokens per text, special tokens included (what `max_input_tokens` limits)."""
        return self.tokenizer.count(_check_texts(texts))

    def prepare(
        self, inputs: Sequence[str] | Sequence[Sequence[int]], truncate: bool = False,
        truncation_direction: str = "right", prompt_name: str | None = None,
    ) -> list[list[int]]:
        """Token ids per input, within `max_input_tokens` (see `models.inputs.prepare_inputs`;
        raises its EmptyInput, InvalidTokenIds, InputTooLong). Texts get the prompt
        `prompt_name` (None: the checkpoint's default prompt, if any) prepended; its tokens
        count toward the limit. Naming a prompt for token-id inputs is a ValueError."""
        prompt = self.prompts.text(prompt_name)
        if prompt and not self.pooling.include_prompt:
            raise ValueError(
                "prompt_name: this checkpoint pools without its prompt's tokens (include_prompt: false), "
                "which is not implemented; embed without a prompt"
            )
        is_text = (
            isinstance(inputs, Sequence) and not isinstance(inputs, (str, bytes)) and all(isinstance(x, str) for x in inputs)
        )
        if prompt and is_text:
            inputs = [prompt + text for text in inputs]
        elif prompt_name is not None and not is_text:
            raise ValueError("prompt_name: prompts apply to texts; token-id inputs are used exactly as given")
        return prepare_inputs(
            self.tokenizer,
            inputs,
            vocab_size=self.vocab_size,
            limit=self.max_input_tokens,
            truncate=truncate,
            truncation_direction=truncation_direction,
        )

    def embed(
        self, inputs: Sequence[str] | Sequence[Sequence[int]], spec: AttentionSpec, truncate: bool = False,
        normalize: bool = True, dimensions: int | None = None, truncation_direction: str = "right",
        max_batch_tokens: int = 16384, adapter: str | None = None, prompt_name: str | None = None,
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
        self._check_options(spec, dimensions)
        if not (is_int(max_batch_tokens) and max_batch_tokens >= 1):
            raise ValueError(f"max_batch_tokens: must be a positive integer, got {max_batch_tokens!r}")
        self._adapter_index(adapter)  # an unknown adapter fails before any work
        sequences = self.prepare(inputs, truncate, truncation_direction, prompt_name)
        width = dimensions if dimensions is not None else self.dim
        vectors = torch.empty(len(sequences), width, dtype=torch.float32)
        for batch in _length_batches(sequences, max_batch_tokens):
            vectors[batch] = self.embed_batch([sequences[i] for i in batch], spec, normalize, dimensions, adapter)
        return vectors

    def embed_batch(
        self, sequences: list[list[int]], spec: AttentionSpec, normalize: bool = True, dimensions: int | None = None,
        adapter: str | None = None,
    ) -> Tensor:
        """One forward pass over prepared token ids (`prepare`'s output), in the order given
        -> (len(sequences), dimensions or dim) float32 on the CPU. No re-batching: the caller
        chose the batch."""
        self._check_options(spec, dimensions)
        adapter_index = self._adapter_index(adapter)
        with torch.inference_mode():
            pooled = self._forward(sequences, spec, adapter_index).float().cpu()
        vectors = pooled[:, :dimensions] if dimensions is not None else pooled
        return F.normalize(vectors, dim=-1) if normalize else vectors

    def _adapter_index(self, adapter: str | None) -> int | None:
        """The index of a task adapter of the checkpoint (None: the base weights)."""
        if adapter is None:
            return None
        if adapter not in self.adapters:
            known = ", ".join(self.adapters) if self.adapters else "none: this checkpoint has no adapters"
            raise ValueError(f"adapter: unknown adapter {adapter!r}; known: {known}")
        return self.adapters.index(adapter)

    def _check_options(self, spec: AttentionSpec, dimensions: int | None) -> None:
        if not isinstance(spec, AttentionSpec):
            raise ValueError(f"spec: must be a kernels.AttentionSpec, got {type(spec).__name__}")
        if dimensions is not None and not (is_int(dimensions) and 1 <= dimensions <= self.dim):
            raise ValueError(f"dimensions: must be an integer in [1, {self.dim}], got {dimensions!r}")

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
        hidden = self.model(input_ids, None if min(lengths) == n else mask, spec, backend=self.backend, **extra)
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
