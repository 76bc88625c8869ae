"""Runner: a model's weights on a device, and the packed forward passes it runs.

`Runner.start(sequences, specs)` packs prepared token ids (models.batch.packing: the token-wise
layers on real tokens only, attention per sequence by its own spec) and returns a `Forward`,
run a layer at a time (`step`) and read out per sequence as its output asks
(models.pooling.Output: pooled, the mean over token spans, or every token). `Runner.run` is
the one loop that starts, steps and reads out a pass. The service's scheduler, which forms its
own batches and interleaves them, steps `Forward`s itself.

On CUDA (`graphs`), a batch whose inputs are at most `graphs.max_length` tokens long is padded
to length buckets instead, and its layers are replayed from CUDA graphs
(models.runtime.graphs); its rows are the unpadded ones within rounding.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from clusterserve.kernels import BACKENDS, AttentionSpec
from clusterserve.models.batch.packing import bucket_length, pack
from clusterserve.models.batch.passes import Pass
from clusterserve.models.pooling import POOLED, Output, pool_each
from clusterserve.models.runtime.graphs import LayerGraphs


@dataclass(eq=False, repr=False)
class Runner:
    """model: the network (models.networks); pooling: the checkpoint's pooling mode; backend:
    the `kernels.attention` backend every attention layer is called with; pad_token_id,
    vocab_size: what padded slots hold; graphs: the CUDA graphs its layers replay (None: every
    layer runs eagerly, on unpadded batches). device and dtype are the weights'."""

    model: nn.Module
    pooling: str
    pad_token_id: int
    vocab_size: int
    backend: str = "auto"
    graphs: LayerGraphs | None = None
    device: torch.device = field(init=False)
    dtype: torch.dtype = field(init=False)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        first = next(self.model.parameters())
        self.device = first.device
        self.dtype = first.dtype

    def info(self) -> dict[str, Any]:
        """Where and how it runs, for /info and logs."""
        return {
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "backend": self.backend,
            "cuda_graphs": None if self.graphs is None else {
                "signatures": self.graphs.capacity, "max_length": self.graphs.max_length,
            },
        }  # fmt: skip

    def start(
        self, sequences: Sequence[Sequence[int]], specs: Sequence[AttentionSpec], adapter: int | None = None,
        check: Callable[[], None] | None = None,
    ) -> Forward:
        """A packed forward pass over prepared token ids, embedded and ready to run a layer at a
        time. adapter: the task adapter's index (None: the base weights). check: None, or called
        between attention stages; what it raises stops the step."""
        for spec in specs:
            if not isinstance(spec, AttentionSpec) or spec.method == "auto":
                raise ValueError(f"specs: each must be a concrete kernels.AttentionSpec (plan resolves auto), got {spec!r}")
        graphs = self.graphs if self.graphs is not None and self.graphs.takes([len(s) for s in sequences]) else None
        pad_id = self.pad_token_id if 0 <= self.pad_token_id < self.vocab_size else 0
        input_ids, packed = pack(sequences, specs, self.device, bucket_length if graphs else None, pad_id)
        with torch.inference_mode():
            state = self.model.begin(input_ids, dataclasses.replace(packed, check=check), self.backend, adapter)
        return Forward(self.model, state, self.pooling, graphs)

    def run(
        self, sequences: Sequence[Sequence[int]], specs: Sequence[AttentionSpec], outputs: Sequence[Output],
        adapter: int | None = None,
    ) -> list[Tensor]:
        """One packed forward pass, each sequence attending by its own concrete spec -> per
        sequence, in the order given, the (k_i, dim) float32 rows on the CPU that outputs[i]
        asks for, not normalised. No re-batching: the caller chose the batch."""
        forward = self.start(sequences, specs, adapter)
        while not forward.finished:
            forward.step()
        return forward.outputs(outputs)


class Forward:
    """One packed batch's forward pass, run a layer at a time (`Runner.start`).

    A scheduler steps it, can drop sequences between steps (`keep`), and reads each sequence's
    rows once `finished`. With `graphs` (a padded layout), each step goes through them
    (models.runtime.graphs: replayed once captured for the batch's signature).
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

    def outputs(self, outputs: Sequence[Output]) -> list[Tensor]:
        """Per sequence (in the order started, after any `keep`), the (k_i, dim) float32 rows on
        the CPU that outputs[i] asks for (models.pooling.Output), not normalised."""
        with torch.inference_mode():
            hidden = self.model.end(self.state)
            return [rows.cpu() for rows in pool_each(hidden, self.state.packed, self.pooling, outputs)]

    def pooled(self) -> Tensor:
        """(n, dim) float32 on the CPU: each sequence's pooled vector, `outputs` with POOLED."""
        return torch.cat(self.outputs([POOLED] * len(self.state.packed.lengths)))
