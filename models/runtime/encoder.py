"""Encoder: a loaded checkpoint with its tokenizer and pooling; texts or token ids in, vectors out.

Two levels:
- `Encoder.embed(inputs, spec)`: the Python API. Plans the call (models.planning.plan: prompt, tokens,
  limits, each input's attention by its own length), runs the plan's packed batches and
  returns the vectors in input order.
- `Encoder.run(sequences, specs)`: one packed forward pass over prepared token ids, as given
  (models.runtime.packing: the token-wise layers on real tokens only, attention per sequence by its
  own spec), pooled; `finish` cuts and normalises what it returns.
- `Encoder.start(sequences, specs)`: the same pass as a `Forward`, stepped a layer at a time,
  read out pooled or as each sequence's own output (models.pooling.Output: pooled, the mean
  over token spans, or every token). The service's scheduler, which forms its own batches,
  uses this one.
- `Encoder.embed_chunks(texts, spec, chunking)`: chunk vectors, naive or late
  (models.planning.chunking), with their character and token spans.
On CUDA (`graphs`), a batch whose inputs are at most `graphs.max_length` tokens long is
padded to length buckets instead, and its layers are replayed from CUDA graphs
(models.runtime.graphs); its vectors are the unpadded ones within rounding.
Build one with `models.load_encoder`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from clusterserve.kernels import BACKENDS, AttentionSpec, FieldError
from clusterserve.models.planning.calibration import Calibration
from clusterserve.models.planning.chunk_plan import Chunk, ChunkPlan, plan_chunks
from clusterserve.models.planning.chunking import ChunkingSpec
from clusterserve.models.planning.cost import CostModel
from clusterserve.models.planning.inputs import is_int, prepare_inputs
from clusterserve.models.planning.plan import UnknownAdapter, plan
from clusterserve.models.pooling import Output, PoolingConfig, pool, pool_each
from clusterserve.models.prompts import NO_PROMPT, Prompts
from clusterserve.models.runtime.forward import Pass
from clusterserve.models.runtime.graphs import LayerGraphs
from clusterserve.models.runtime.packing import bucket_length, pack
from clusterserve.models.tokenization import TextTokenizer, Tokens

__all__ = ["Chunked", "Encoder", "finish"]


class Chunked(NamedTuple):
    """One input's chunks: vectors (chunks, dimensions or dim) float32 on the CPU, and each
    chunk's character and token spans (models.planning.chunk_plan.Chunk), in order."""

    vectors: Tensor
    chunks: tuple[Chunk, ...]


@dataclass(eq=False, repr=False)
class Encoder:
    """An embedding model ready to run. Attributes:

    name: model name; dim: embedding size; max_input_tokens: longest input accepted
    (special tokens included); native_positions: the longest input the checkpoint was
    trained on; device, dtype: where and in what precision the weights live; folder: the
    checkpoint folder it was loaded from; backend: the `kernels.attention` backend every
    attention layer is called with; calibration: the table "auto" picks from for a target
    fidelity (None: auto goes by its length threshold); cost: what an input's work is
    estimated from (models.planning.cost); graphs: the CUDA graphs its layers replay (models.runtime.graphs;
    None: every layer runs eagerly, on unpadded batches); reload: load_encoder bound to this
    checkpoint's arguments but the dtype (what `float32()` loads).
    """

    model: nn.Module
    tokenizer: TextTokenizer
    pooling: PoolingConfig
    _: KW_ONLY
    name: str
    architecture: str
    native_positions: int
    max_input_tokens: int
    position_extension: str | None
    pad_token_id: int
    vocab_size: int
    folder: Path | None = None
    adapters: tuple[str, ...] = ()
    prompts: Prompts = field(default_factory=Prompts)
    backend: str = "auto"
    calibration: Calibration | None = None
    reload: Callable[..., Encoder] | None = None  # load_encoder bound to this checkpoint's arguments but dtype
    graphs: LayerGraphs | None = None
    device: torch.device = field(init=False)
    dtype: torch.dtype = field(init=False)
    dim: int = field(init=False)
    cost: CostModel = field(init=False)
    _float32: Encoder | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        first = next(self.model.parameters())
        self.device = first.device
        self.dtype = first.dtype
        self.dim = self.model.config.hidden_size
        self.cost = CostModel.of(self.model.config, self.model)

    def info(self) -> dict[str, Any]:
        """What the model is, for /info and logs."""
        return {
            "model": self.name,
            "architecture": self.architecture,
            "dim": self.dim,
            "max_input_tokens": self.max_input_tokens,
            "native_positions": self.native_positions,
            "position_extension": self.position_extension,
            "position_scaling": _position_scaling(self.model.config),
            "pooling": self.pooling.mode,
            "normalize": self.pooling.normalize,
            "special_tokens": self.tokenizer.num_special_tokens,
            "adapters": list(self.adapters),
            "prompts": dict(self.prompts.prompts),
            "default_prompt_name": self.prompts.default_name,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "backend": self.backend,
            "cuda_graphs": None if self.graphs is None else {
                "signatures": self.graphs.capacity, "max_length": self.graphs.max_length,
            },
        }  # fmt: skip

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
            self, inputs, spec, target_fidelity=target_fidelity, truncate=truncate,
            truncation_direction=truncation_direction, prompt_name=prompt_name, adapter=adapter,
        )  # fmt: skip
        width = dimensions if dimensions is not None else self.dim
        vectors = torch.empty(len(call.inputs), width, dtype=torch.float32)
        for batch in call.batches(max_batch_tokens):
            planned = [call.inputs[i] for i in batch]
            pooled = self.run([p.ids for p in planned], [p.spec for p in planned], call.adapter)
            vectors[batch] = finish(pooled, normalize, dimensions)
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
            self, texts, spec, chunking or ChunkingSpec(), target_fidelity=target_fidelity, truncate=truncate,
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

    def run(self, sequences: Sequence[Sequence[int]], specs: Sequence[AttentionSpec], adapter: str | None = None) -> Tensor:
        """One packed forward pass over prepared token ids (`prepare`'s output), each sequence
        attending by its own concrete spec -> (len(sequences), dim) pooled float32 on the CPU,
        not normalised (`finish` does that). No re-batching: the caller chose the batch."""
        forward = self.start(sequences, specs, adapter)
        while not forward.finished:
            forward.step()
        return forward.pooled()

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
        forward = self.start(sequences, specs, adapter)
        while not forward.finished:
            forward.step()
        return forward.outputs(outputs)

    def token_states(
        self, sequences: Sequence[Sequence[int]], specs: Sequence[AttentionSpec], adapter: str | None = None
    ) -> list[Tensor]:
        """One packed forward pass -> each sequence's last hidden states (n_i, dim) float32 on
        the CPU, in the order given."""
        forward = self.start(sequences, specs, adapter)
        while not forward.finished:
            forward.step()
        return forward.token_states()

    def start(
        self, sequences: Sequence[Sequence[int]], specs: Sequence[AttentionSpec], adapter: str | None = None,
        check: Callable[[], None] | None = None,
    ) -> Forward:
        """A packed forward pass, embedded and ready to run a layer at a time (`Forward`), as
        `run` runs it. check: None, or called between attention stages; what it raises stops
        the step."""
        for spec in specs:
            if not isinstance(spec, AttentionSpec) or spec.method == "auto":
                raise ValueError(f"specs: each must be a concrete kernels.AttentionSpec (plan resolves auto), got {spec!r}")
        adapter_index = self._adapter_index(adapter)
        graphs = self.graphs if self.graphs is not None and self.graphs.takes([len(s) for s in sequences]) else None
        pad_id = self.pad_token_id if 0 <= self.pad_token_id < self.vocab_size else 0
        input_ids, packed = pack(sequences, specs, self.device, bucket_length if graphs else None, pad_id)
        with torch.inference_mode():
            state = self.model.begin(input_ids, dataclasses.replace(packed, check=check), self.backend, adapter_index)
        return Forward(self.model, state, self.pooling.mode, graphs)

    def float32(self) -> Encoder:
        """This encoder in float32, the precision fidelity is measured against: itself when it
        runs in float32, else the same checkpoint loaded again in float32 (once; its weights
        as the checkpoint has them, not upcast from this encoder's; without packed copies of
        them: it serves the occasional fidelity check, where its memory weighs more than its
        short inputs' speed)."""
        if self.dtype == torch.float32:
            return self
        if self._float32 is None:
            if self.reload is None:
                raise ValueError("float32: this encoder was not built by load_encoder; load a float32 one")
            self._float32 = self.reload(dtype=torch.float32, small_batch_weights=False)
            if self.graphs is not None and self._float32.graphs is not None:
                self._float32.graphs.on_event = self.graphs.on_event  # counted with this encoder's
        return self._float32

    def check_dimensions(self, dimensions: int | None) -> None:
        """FieldError naming `dimensions` unless it is None or in [1, dim]."""
        if dimensions is not None and not (is_int(dimensions) and 1 <= dimensions <= self.dim):
            raise FieldError("dimensions", f"must be an integer in [1, {self.dim}], got {dimensions!r}")

    def _adapter_index(self, adapter: str | None) -> int | None:
        """The index of a task adapter of the checkpoint (None: the base weights)."""
        if adapter is None:
            return None
        if adapter not in self.adapters:
            raise UnknownAdapter(adapter, self.adapters)
        return self.adapters.index(adapter)


class Forward:
    """One packed batch's forward pass, run a layer at a time (`Encoder.start`).

    A scheduler steps it, can drop sequences between steps (`keep`), and reads the pooled
    vectors or the token states once `finished`. With `graphs` (a padded layout), each step
    goes through them (models.runtime.graphs: replayed once captured for the batch's signature).
    """

    def __init__(self, model: nn.Module, state: Pass, pooling: str, graphs: LayerGraphs | None = None):
        self.model = model
        self.state = state
        self.pooling = pooling
        self.graphs = graphs
        self.layers = len(model.layers)

    @property
    def done(self) -> int:
        """Layers run so far."""
        return self.state.done

    @property
    def finished(self) -> bool:
        return self.state.done >= self.layers

    def step(self) -> None:
        """Run the next layer."""
        with torch.inference_mode():
            if self.graphs is not None:
                self.graphs.step(self.model, self.state)
            else:
                self.model.advance(self.state)

    def keep(self, sequences: list[int]) -> None:
        """Go on with these sequences only (indices in the order started, ascending); they are
        renumbered 0.. in that order. Each keeps its slot: the kept layout is a signature of
        its own for the graphs."""
        with torch.inference_mode():
            self.state.keep(sequences)

    def pooled(self) -> Tensor:
        """(B, dim) pooled float32 on the CPU, not normalised, in the order started."""
        with torch.inference_mode():
            return pool(self.model.end(self.state), self.state.packed, self.pooling).cpu()

    def outputs(self, outputs: Sequence[Output]) -> list[Tensor]:
        """Per sequence (in the order started, after any `keep`), the (k_i, dim) float32 rows on
        the CPU that outputs[i] asks for (models.pooling.Output), not normalised."""
        with torch.inference_mode():
            hidden = self.model.end(self.state)
            return [rows.cpu() for rows in pool_each(hidden, self.state.packed, self.pooling, outputs)]

    def token_states(self) -> list[Tensor]:
        """Each sequence's last hidden states (n_i, dim) float32 on the CPU, in the order started."""
        with torch.inference_mode():
            hidden = self.model.end(self.state)
        return [part.float().cpu() for part in self.state.packed.split(hidden)]


def _position_scaling(config) -> dict[str, Any] | None:
    """The rotary scaling a checkpoint is published with (nomic-embed-text: dynamic NTK x2 past
    its 2,048 trained positions, to 8,192); None for none."""
    if not config.uses_rope or config.rope_type == "default":
        return None
    scaling = {"type": config.rope_type, "factor": config.rope_factor}
    if config.rope_type == "dynamic":
        scaling["trained_positions"] = config.rope_original_positions
    return scaling


def finish(pooled: Tensor, normalize: bool = True, dimensions: int | None = None) -> Tensor:
    """Pooled vectors (B, dim) -> the first `dimensions` components (Matryoshka), L2-normalised
    when asked."""
    vectors = pooled[:, :dimensions] if dimensions is not None else pooled
    return F.normalize(vectors, dim=-1) if normalize else vectors


def _check_texts(texts: Sequence[str]) -> list[str]:
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise ValueError("texts: must be a list of strings")
    return list(texts)
