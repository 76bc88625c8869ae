"""A forward pass one layer at a time: what a scheduler needs to interleave and stop work.

Every encoder model splits its forward into `begin` (the embeddings), `advance` (one layer)
and `end` (the final norm, if any), over one `Pass`: the packed batch's hidden states and
what the layers share. `tables` builds, into `Pass.cache`, whatever the layers compute from
the layout beyond its groups and padding mask (rotary angles); `advance` reads the layout
only through those, so a CUDA graph of a layer (models.runtime.graphs) can be handed another layout
of the same shape. `run_pass` chains them; `Pass.keep` drops sequences between layers, so
the inputs of a cancelled request leave a running batch and the rest go on unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from torch import Tensor

from clusterserve.models.batch.packing import Packed


@dataclass
class Pass:
    """A packed forward pass in progress.

    x: (T, C) hidden states after `done` layers; packed: the batch's layout (its `check` is
    called between attention stages); backend: the attention backend; adapter: the task
    adapter's index (None: base weights); cache: tables built from the layout (rotary angles),
    dropped when the layout changes.
    """

    x: Tensor
    packed: Packed
    backend: str = "auto"
    adapter: int | None = None
    done: int = 0
    cache: dict[str, Any] = field(default_factory=dict)

    def cached(self, name: str, build: Callable[[], Any]) -> Any:
        if name not in self.cache:
            self.cache[name] = build()
        return self.cache[name]

    def keep(self, sequences: list[int]) -> None:
        """Keep only these sequences (the caller's indices, ascending); they are renumbered
        0.. in that order."""
        self.packed, tokens = self.packed.keep(sequences)
        self.x = self.x[tokens]
        self.cache.clear()


class LayeredModel(Protocol):
    layers: Any

    def begin(self, input_ids: Tensor, packed: Packed, backend: str = "auto", adapter: int | None = None) -> Pass: ...

    def tables(self, state: Pass) -> None: ...

    def advance(self, state: Pass) -> None: ...

    def end(self, state: Pass) -> Tensor: ...


def run_pass(model: LayeredModel, state: Pass) -> Tensor:
    """Every remaining layer of `state`, then the model's end -> (T, C) last hidden states."""
    while state.done < len(model.layers):
        model.advance(state)
    return model.end(state)
