"""Checkpoint: what a loaded model is, as data: tokenizer, prompts, pooling, task adapters,
calibration, limits and the work estimate. Planning (models.planning) reads only this; the
weights and the device are the runner's (models.runtime.runner).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from clusterserve.kernels import FieldError
from clusterserve.models.planning.calibration import Calibration
from clusterserve.models.planning.cost import CostModel
from clusterserve.models.planning.inputs import is_int, prepare_inputs
from clusterserve.models.pooling import PoolingConfig
from clusterserve.models.prompts import NO_PROMPT, Prompts, UnknownAdapter
from clusterserve.models.tokenization import TextTokenizer, Tokens


@dataclass(eq=False, repr=False)
class Checkpoint:
    """A served model's data. name: model name; architecture: its model type; dim: embedding
    size; native_positions: the longest input it was trained on; max_input_tokens: the longest
    input accepted (special tokens included); position_extension: how positions past training
    are served (None, "rope", "copied"); position_scaling: the published rotary scaling (None:
    none); pad_token_id, vocab_size: the tokenizer's; folder: where it was loaded from;
    adapters: its task adapters' names; prompts; calibration: the table "auto" picks from for a
    target fidelity (None: auto goes by its length threshold); cost: what an input's work is
    estimated from (models.planning.cost)."""

    tokenizer: TextTokenizer
    pooling: PoolingConfig
    _: KW_ONLY
    name: str
    architecture: str
    dim: int
    native_positions: int
    max_input_tokens: int
    position_extension: str | None
    pad_token_id: int
    vocab_size: int
    cost: CostModel
    position_scaling: dict[str, Any] | None = None
    folder: Path | None = None
    adapters: tuple[str, ...] = ()
    prompts: Prompts = field(default_factory=Prompts)
    calibration: Calibration | None = None

    def info(self) -> dict[str, Any]:
        """What the model is, for /info and logs."""
        return {
            "model": self.name,
            "architecture": self.architecture,
            "dim": self.dim,
            "max_input_tokens": self.max_input_tokens,
            "native_positions": self.native_positions,
            "position_extension": self.position_extension,
            "position_scaling": self.position_scaling,
            "pooling": self.pooling.mode,
            "normalize": self.pooling.normalize,
            "special_tokens": self.tokenizer.num_special_tokens,
            "adapters": list(self.adapters),
            "prompts": dict(self.prompts.prompts),
            "default_prompt_name": self.prompts.default_name,
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
        """Token ids per input, within `max_input_tokens` (see `models.planning.inputs.prepare_inputs`;
        raises its EmptyInput, InvalidTokenIds, InputTooLong). Texts get the prompt
        `prompt_name` (None: the checkpoint's default prompt, if any; NO_PROMPT: none)
        prepended; its tokens count toward the limit. Naming a prompt for token-id inputs is a
        FieldError."""
        prompt = self.prompts.text(prompt_name)
        self.pooling.check_prompt(prompt)
        is_text = (
            isinstance(inputs, Sequence) and not isinstance(inputs, (str, bytes)) and all(isinstance(x, str) for x in inputs)
        )
        if prompt and is_text:
            inputs = [self.prompts.prepend(prompt_name, text) for text in inputs]
        elif prompt_name not in (None, NO_PROMPT) and not is_text:
            raise FieldError("prompt_name", "prompts apply to texts; token-id inputs are used exactly as given")
        return prepare_inputs(
            self.tokenizer,
            inputs,
            vocab_size=self.vocab_size,
            limit=self.max_input_tokens,
            truncate=truncate,
            truncation_direction=truncation_direction,
        )

    def check_dimensions(self, dimensions: int | None) -> None:
        """FieldError naming `dimensions` unless it is None or in [1, dim]."""
        if dimensions is not None and not (is_int(dimensions) and 1 <= dimensions <= self.dim):
            raise FieldError("dimensions", f"must be an integer in [1, {self.dim}], got {dimensions!r}")

    def adapter_index(self, adapter: str | None) -> int | None:
        """The index of a task adapter of the checkpoint (None: the base weights)."""
        if adapter is None:
            return None
        if adapter not in self.adapters:
            raise UnknownAdapter(adapter, self.adapters)
        return self.adapters.index(adapter)


def position_scaling(config: Any) -> dict[str, Any] | None:
    """The rotary scaling a checkpoint is published with (nomic-embed-text: dynamic NTK x2 past
    its 2,048 trained positions, to 8,192); None for none."""
    if not config.uses_rope or config.rope_type == "default":
        return None
    scaling = {"type": config.rope_type, "factor": config.rope_factor}
    if config.rope_type == "dynamic":
        scaling["trained_positions"] = config.rope_original_positions
    return scaling


def _check_texts(texts: Sequence[str]) -> list[str]:
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise ValueError("texts: must be a list of strings")
    return list(texts)
