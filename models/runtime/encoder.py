"""Encoder: the Python API of a loaded model, a checkpoint (models.checkpoint: tokenizer,
prompts, pooling, adapters, calibration, limits) and a runner (models.runtime.runner: the
weights on a device, CUDA graphs, the packed forward passes).

- `Encoder.embed(inputs, spec)`: plans the call (models.planning.plan: prompt, tokens,
  limits, each input's attention by its own length), runs the plan's packed batches and
  returns the vectors in input order.
- `Encoder.embed_chunks(texts, spec, chunking)`: chunk vectors, naive or late
  (models.planning.chunking), with their character and token spans.
- `Encoder.encode(sequences, specs, outputs)`: one packed forward pass over prepared token ids,
  as given, read out per sequence (`run`: pooled; `token_states`: every token), through
  `Runner.run`, the one loop that starts, steps and reads out a pass. `Encoder.start` hands
  the pass itself to a scheduler that steps it.
Build one with `models.load_encoder`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from clusterserve.kernels import AttentionSpec
from clusterserve.models.checkpoint import Checkpoint
from clusterserve.models.planning.chunk_plan import Chunk, ChunkPlan, plan_chunks
from clusterserve.models.planning.chunking import ChunkingSpec
from clusterserve.models.planning.inputs import is_int
from clusterserve.models.planning.plan import plan
from clusterserve.models.pooling import EVERY_TOKEN, POOLED, Output
from clusterserve.models.runtime.runner import Forward, Runner

__all__ = ["Chunked", "Encoder", "finish"]

def _attributes(cls: type) -> frozenset[str]:
    """A dataclass's public fields and methods: what an Encoder answers of it, by attribute."""
    return frozenset({f.name for f in dataclasses.fields(cls)} | {n for n in vars(cls) if not n.startswith("_")})


# The checkpoint answers first (both hold the pooling and the pad id); the encoder's own
# methods (info, run, start, ...) are found before either.
CHECKPOINT_FIELDS = _attributes(Checkpoint)
RUNNER_FIELDS = _attributes(Runner) - CHECKPOINT_FIELDS

class Chunked(NamedTuple):
    """One input's chunks: vectors (chunks, dimensions or dim) float32 on the CPU, and each
    chunk's character and token spans (models.planning.chunk_plan.Chunk), in order."""

    vectors: Tensor
    chunks: tuple[Chunk, ...]


@dataclass(eq=False, repr=False)
class Encoder:
    """An embedding model ready to run: `checkpoint` (what planning reads) and `runner` (what
    runs). The checkpoint's and the runner's attributes read as the encoder's own
    (`encoder.dim`, `encoder.device`; setting one sets it there). reload: load_encoder bound to this checkpoint's
    arguments but the dtype (what `float32()` loads)."""

    checkpoint: Checkpoint
    runner: Runner
    reload: Callable[..., Encoder] | None = None
    _float32: Encoder | None = field(default=None, init=False)

    def __getattr__(self, name: str) -> Any:
        if name in CHECKPOINT_FIELDS:
            return getattr(self.checkpoint, name)
        if name in RUNNER_FIELDS:
            return getattr(self.runner, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        delegated = not hasattr(type(self), name)  # the encoder's own methods and fields stay its own
        owner = None if not delegated else self.checkpoint if name in CHECKPOINT_FIELDS else \
            self.runner if name in RUNNER_FIELDS else None
        object.__setattr__(self if owner is None else owner, name, value)

    def info(self) -> dict[str, Any]:
        """What the model is and where it runs, for /info and logs."""
        return {**self.checkpoint.info(), **self.runner.info()}

    def embed(
        self, inputs: Sequence[str] | Sequence[Sequence[int]], spec: AttentionSpec, truncate: bool = False,
        normalize: bool = True, dimensions: int | None = None, truncation_direction: str = "right",
        max_batch_tokens: int = 16384, adapter: str | None = None, prompt_name: str | None = None,
        target_fidelity: float | None = None,
    ) -> Tensor:
        """Embed texts or token-id lists -> (n, dimensions or dim) float32 on the CPU, in input order.

        inputs: a list of strings (tokenized here, special tokens added) or a list of token-id
            lists, used exactly as given: no special tokens are added to raw ids, as the
            OpenAI API expects ids to be the model's input.
        spec: the attention method for every layer that attends globally. "auto" is resolved
            per input by its own length (`models.planning.plan`).
        target_fidelity: with spec "auto", the least calibrated cosine to exact attention: the
            fastest configuration of `calibration` that keeps it at each input's length.
        truncate: cut inputs longer than `max_input_tokens` (texts keep their special
            tokens) instead of raising InputTooLong.
        normalize: L2-normalise the output vectors (after the `dimensions` cut).
        dimensions: keep the first `dimensions` components (Matryoshka embeddings).
        truncation_direction: "right" keeps the start of an input, "left" its end.
        max_batch_tokens: at most this many tokens per packed forward pass (no padding is
            computed); a longer input runs alone.
        adapter: a task adapter of the checkpoint (`adapters`, e.g. Jina v3's
            "retrieval.query"); None runs the adapter named like the prompt, if any, else the
            base weights.
        prompt_name: a prompt of the checkpoint (`prompts`), prepended to every text; None
            prepends the default prompt where the checkpoint names one. Its tokens count toward
            `max_input_tokens`. Token-id inputs are used as given: naming a prompt for them is
            an error. An unknown name raises UnknownPrompt (a ValueError) naming it.
        """
        self.check_dimensions(dimensions)
        if not (is_int(max_batch_tokens) and max_batch_tokens >= 1):
            raise ValueError(f"max_batch_tokens: must be a positive integer, got {max_batch_tokens!r}")
        call = plan(
            self.checkpoint, inputs, spec, target_fidelity=target_fidelity, truncate=truncate,
            truncation_direction=truncation_direction, prompt_name=prompt_name, adapter=adapter,
        )  # fmt: skip
        width = dimensions if dimensions is not None else self.dim
        vectors = torch.empty(len(call.inputs), width, dtype=torch.float32)
        for batch in call.batches(max_batch_tokens):
            planned = [call.inputs[i] for i in batch]
            vectors[batch] = finish(self.run([p.ids for p in planned], [p.spec for p in planned], call.adapter),
                                    normalize, dimensions)
        return vectors

    def embed_chunks(
        self, texts: Sequence[str], spec: AttentionSpec, chunking: ChunkingSpec | None = None, *,
        normalize: bool = True, dimensions: int | None = None, truncate: bool = False,
        truncation_direction: str = "right", max_batch_tokens: int = 16384, adapter: str | None = None,
        prompt_name: str | None = None, target_fidelity: float | None = None,
    ) -> list[Chunked]:
        """Chunk each text and embed its chunks (models.planning.chunking; None: ChunkingSpec's
        defaults, late chunking) -> per text its `Chunked` (vectors and spans). The other
        arguments are `embed`'s; `truncate` cuts a text longer than `max_input_tokens` before
        it is chunked. A late chunk vector is the mean of the token states over the chunk's
        tokens; a naive one is the checkpoint's pooled vector of the chunk alone."""
        self.check_dimensions(dimensions)
        call = plan_chunks(
            self.checkpoint, texts, spec, chunking or ChunkingSpec(), target_fidelity=target_fidelity, truncate=truncate,
            truncation_direction=truncation_direction, prompt_name=prompt_name, adapter=adapter,
        )  # fmt: skip
        vectors = self.run_chunks(call, max_batch_tokens)
        return [Chunked(finish(v, normalize, dimensions), one.chunks) for v, one in zip(vectors, call.inputs)]

    def run_chunks(self, call: ChunkPlan, max_batch_tokens: int = 16384) -> list[Tensor]:
        """Run a chunk plan's sequences in packed batches (`Plan.batches`) -> per input its
        (chunks, dim) float32 chunk vectors on the CPU, not normalised."""
        if not (is_int(max_batch_tokens) and max_batch_tokens >= 1):
            raise ValueError(f"max_batch_tokens: must be a positive integer, got {max_batch_tokens!r}")
        planned = call.plan.inputs
        rows: list[Tensor | None] = [None] * len(planned)
        for batch in call.plan.batches(max_batch_tokens):
            outputs = self.encode(
                [planned[i].ids for i in batch], [planned[i].spec for i in batch], [call.outputs[i] for i in batch],
                call.plan.adapter,
            )
            for i, rows_i in zip(batch, outputs):
                rows[i] = rows_i
        return call.assemble(torch.cat(rows))  # type: ignore[arg-type]

    def encode(
        self, sequences: Sequence[Sequence[int]], specs: Sequence[AttentionSpec], outputs: Sequence[Output],
        adapter: str | None = None,
    ) -> list[Tensor]:
        """One packed forward pass over prepared token ids, each sequence attending by its own
        concrete spec -> per sequence, in the order given, the (k_i, dim) float32 rows on the
        CPU that outputs[i] asks for (models.pooling.Output): k_i = 1 for "pooled" (the
        checkpoint's pooling, not normalised), one row per span for "spans" (the mean of the
        token states over each span), n_i rows for "tokens" (every token's last hidden state).
        No re-batching: the caller chose the batch."""
        return self.runner.run(sequences, specs, outputs, self.checkpoint.adapter_index(adapter))

    def run(self, sequences: Sequence[Sequence[int]], specs: Sequence[AttentionSpec], adapter: str | None = None) -> Tensor:
        """`encode` pooled -> (len(sequences), dim) float32 on the CPU, not normalised (`finish`
        does that)."""
        return torch.cat(self.encode(sequences, specs, [POOLED] * len(sequences), adapter))

    def token_states(
        self, sequences: Sequence[Sequence[int]], specs: Sequence[AttentionSpec], adapter: str | None = None
    ) -> list[Tensor]:
        """`encode` every token -> each sequence's last hidden states (n_i, dim) float32 on the
        CPU, in the order given."""
        return self.encode(sequences, specs, [EVERY_TOKEN] * len(sequences), adapter)

    def start(
        self, sequences: Sequence[Sequence[int]], specs: Sequence[AttentionSpec], adapter: str | None = None,
        check: Callable[[], None] | None = None,
    ) -> Forward:
        """A packed forward pass, embedded and ready to run a layer at a time (`Runner.start`),
        with the task adapter named `adapter` (None: the base weights)."""
        return self.runner.start(sequences, specs, self.checkpoint.adapter_index(adapter), check)

    def float32(self) -> Encoder:
        """This encoder in float32, the precision fidelity is measured against: itself when it
        runs in float32, else the same checkpoint loaded again in float32 (once; its weights
        as the checkpoint has them, not upcast from this encoder's; without packed copies of
        them: it serves the occasional fidelity check, where its memory weighs more than its
        short inputs' speed)."""
        if self.runner.dtype == torch.float32:
            return self
        if self._float32 is None:
            if self.reload is None:
                raise ValueError("float32: this encoder was not built by load_encoder; load a float32 one")
            self._float32 = self.reload(dtype=torch.float32, small_batch_weights=False)
            graphs, twin = self.runner.graphs, self._float32.runner.graphs
            if graphs is not None and twin is not None:
                twin.on_event = graphs.on_event  # counted with this encoder's
        return self._float32


def finish(pooled: Tensor, normalize: bool = True, dimensions: int | None = None) -> Tensor:
    """Pooled vectors (B, dim) -> the first `dimensions` components (Matryoshka), L2-normalised
    when asked."""
    vectors = pooled[:, :dimensions] if dimensions is not None else pooled
    return F.normalize(vectors, dim=-1) if normalize else vectors
