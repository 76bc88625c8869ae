"""CUDA graphs of an encoder's layers, one set per batch signature: a layer is replayed, not launched.

On a GPU a layer of a short batch is launch-bound: its projections, norms and feed-forward
block and the attention pipeline's Triton kernels are dozens of launches, each paid for in
Python and in the driver, while the GPU waits. A CUDA graph records a layer's launches once
and replays them as one. A graph replays fixed shapes and addresses, so `Encoder.start` pads
each sequence to its length bucket (models.batch.packing.bucket_length, under 1/16 padding) and a
layer's graph is kept per batch *signature*: each attention group's sequence count, slot
length and spec in packed order, whether it has padding (a key mask, or none: exact attention
then stays on SDPA's unmasked flash kernel), and the task adapter. Batches of similar lengths
share one.

The scheduler runs a pass a layer at a time and interleaves passes, so graphs are per layer
and read everything from static buffers: the hidden states x (T, C), the layout's positions
and padding mask, and the tables the model builds from the layout (`tables`: rotary angles).
A step copies the pass's x in (and its layout, when another pass used the buffers last),
replays, and copies x out; several passes of one signature can then be under way at once.

Policy, per signature and layer:
- the first time it runs eagerly: the warm-up that compiles Triton kernels for these shapes,
  lets cuBLAS pick its kernels and initialises what is lazy, outside any capture;
- the second time it runs once more eagerly on the capture stream (per-stream state), is
  captured there into the signature's private memory pool, and replayed;
- after that it is replayed.
The captured signatures form an LRU of `capacity`; dropping one frees its graphs and pool. A
failed capture is logged once and its signature runs eagerly from then on. A pass whose
layout changes (`Forward.keep`) has a new signature and goes on by that one's rule. Inside a
graph the attention's `check` is not called: a replayed pass stops between layers only.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
from torch import Tensor

from clusterserve.kernels import AttentionSpec
from clusterserve.kernels.reference.hashing import holding_device_constants
from clusterserve.models.batch.packing import Packed
from clusterserve.models.batch.passes import LayeredModel, Pass

log = logging.getLogger("clusterserve")

# Signatures remembered as seen (cheap) per captured one kept (a pool each).
SEEN_PER_CAPTURED = 8
EVENTS = ("captured", "replayed", "failed", "evicted")


@dataclass(frozen=True)
class Signature:
    """What a layer's graph is specific to: each attention group's (sequences, slot length,
    spec, whether it has padding: a key mask or none) in packed order, and the task adapter."""

    groups: tuple[tuple[int, int, AttentionSpec, bool], ...]
    adapter: int | None

    @classmethod
    def of(cls, state: Pass) -> Signature:
        return cls(tuple((g.count, g.length, g.spec, g.padded) for g in state.packed.groups), state.adapter)


class GraphBackend(Protocol):
    """How graphs are made: CUDA's (`CudaGraphs`), or a test's stand-in."""

    def pool(self) -> Any:
        """A new memory pool, shared by one signature's graphs."""

    def capture(self, run: Callable[[], None], pool: Any) -> Callable[[], None]:
        """`run` captured into a graph that allocates from `pool` -> a function replaying it."""


class CudaGraphs:
    """`torch.cuda.CUDAGraph`s captured on a stream of their own."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)

    def pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def capture(self, run: Callable[[], None], pool: Any) -> Callable[[], None]:
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            run()  # what is lazy per stream (cuBLAS's workspace) is set up here, not in the capture
        current.wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the event loop's thread may read allocator statistics meanwhile.
        with torch.cuda.graph(graph, pool=pool, stream=self.stream, capture_error_mode="thread_local"):
            run()
        return graph.replay


@dataclass
class _Seen:
    layers: set[int] = field(default_factory=set)  # layers that ran eagerly (warmed up)
    failed: bool = False  # a capture failed: eager from now on


@dataclass
class _Captured:
    static: Pass  # the buffers the graphs read and write
    pool: Any
    replays: list[Callable[[], None] | None]  # per layer, once captured
    held: list[Tensor] = field(default_factory=list)  # device constants the graphs read (kernels.reference.hashing)
    layout: Packed | None = None  # the layout whose positions, mask and tables are in `static`


class LayerGraphs:
    """Captured layers per batch signature (the module docstring says when each runs how).

    backend: how graphs are captured (`CudaGraphs(device)` on CUDA); capacity: captured
    signatures kept, least recently used dropped first; max_length: the longest sequence a
    padded, graphed batch may hold (`takes`); on_event: None, or called with one of EVENTS
    each time one happens (the service counts them). `counts` keeps the same tallies.
    """

    def __init__(
        self, backend: GraphBackend, capacity: int = 16, max_length: int = 8192,
        on_event: Callable[[str], None] | None = None,
    ):
        for name, value in (("capacity", capacity), ("max_length", max_length)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        self.backend = backend
        self.capacity = capacity
        self.max_length = max_length
        self.on_event = on_event
        self.counts = dict.fromkeys(EVENTS, 0)
        self._captured: OrderedDict[Signature, _Captured] = OrderedDict()
        self._seen: OrderedDict[Signature, _Seen] = OrderedDict()
        self._lock = threading.Lock()

    def takes(self, lengths: list[int]) -> bool:
        """Whether a batch of sequences this long runs padded and graphed: its longest is at
        most `max_length` (beyond it a layer's kernels run long enough to hide their launches,
        and a pool would hold a long batch's activations)."""
        return bool(lengths) and max(lengths) <= self.max_length

    @property
    def signatures(self) -> int:
        """Signatures with graphs now."""
        return len(self._captured)

    def clear(self) -> None:
        """Drop every graph and its pool (out of memory); signatures seen stay warm."""
        with self._lock:
            self._captured.clear()

    def step(self, model: LayeredModel, state: Pass) -> None:
        """Run layer `state.done` of a padded pass: replayed, captured and replayed, or eagerly."""
        if state.packed.real is None:
            model.advance(state)  # an unpadded layout has no fixed shape to replay
            return
        signature, layer = Signature.of(state), state.done
        with self._lock:
            seen = self._remember(signature)
            captured = self._captured.get(signature)
            if captured is not None:
                self._captured.move_to_end(signature)
            ready = captured is not None and captured.replays[layer] is not None
            if seen.failed or not (ready or layer in seen.layers):
                seen.layers.add(layer)
                model.advance(state)
                return
            try:
                if captured is None:
                    captured = self._add(signature, model, state)
                self._load(captured, model, state)
                if not ready:
                    captured.replays[layer] = self._capture(captured, model, layer)
                    captured.static.x.copy_(state.x)  # the capture's warm-up ran on the buffer
                    self._event("captured")
            except Exception as error:  # noqa: BLE001 - a graph is an optimisation: run eagerly
                self._fail(signature, seen, error)
                model.advance(state)
                return
            captured.replays[layer]()
            state.x = captured.static.x.clone()
            state.done += 1
            self._event("replayed")

    def _remember(self, signature: Signature) -> _Seen:
        seen = self._seen.get(signature)
        if seen is None:
            seen = self._seen[signature] = _Seen()
            while len(self._seen) > SEEN_PER_CAPTURED * self.capacity:
                self._seen.popitem(last=False)
        self._seen.move_to_end(signature)
        return seen

    def _add(self, signature: Signature, model: LayeredModel, state: Pass) -> _Captured:
        """Static buffers for a signature, shaped as `state`'s."""
        model.tables(state)
        packed = state.packed
        static = Pass(
            torch.empty_like(state.x),
            dataclasses.replace(
                packed, positions=torch.empty_like(packed.positions), real=torch.empty_like(packed.real), check=None
            ),
            state.backend,
            state.adapter,
            cache={name: _map(torch.empty_like, value) for name, value in state.cache.items()},
        )
        captured = self._captured[signature] = _Captured(static, self.backend.pool(), [None] * len(model.layers))
        while len(self._captured) > self.capacity:
            self._captured.popitem(last=False)
            self._event("evicted")
        return captured

    @staticmethod
    def _load(captured: _Captured, model: LayeredModel, state: Pass) -> None:
        """Copy the pass's x, and its layout unless the buffers hold it already, into the buffers."""
        static = captured.static
        if captured.layout is not state.packed:
            model.tables(state)
            static.packed.positions.copy_(state.packed.positions)
            static.packed.real.copy_(state.packed.real)
            for name, value in state.cache.items():
                _copy(static.cache[name], value)
            captured.layout = state.packed
        static.x.copy_(state.x)

    def _capture(self, captured: _Captured, model: LayeredModel, layer: int) -> Callable[[], None]:
        static = captured.static
        x = static.x

        def run() -> None:  # layer `layer` on the buffers, its output written back into x
            static.x, static.done = x, layer
            model.advance(static)
            x.copy_(static.x)
            static.x = x

        with holding_device_constants() as held:
            replay = self.backend.capture(run, captured.pool)
        captured.held.extend(t for t in held if all(t is not h for h in captured.held))
        return replay

    def _fail(self, signature: Signature, seen: _Seen, error: Exception) -> None:
        seen.failed = True
        self._captured.pop(signature, None)
        self._event("failed")
        lengths = [length for _, length, _, _ in signature.groups]
        log.warning(
            "CUDA graph capture failed for a batch of slot lengths %s (%s: %s); that batch shape runs eagerly",
            lengths, type(error).__name__, error,
        )  # fmt: skip

    def _event(self, name: str) -> None:
        self.counts[name] += 1
        if self.on_event is not None:
            self.on_event(name)


def _map(fn: Callable[[Tensor], Tensor], value: Any) -> Any:
    """fn on every tensor of a table (a tensor or a tuple of them)."""
    if isinstance(value, Tensor):
        return fn(value)
    return tuple(_map(fn, item) for item in value)


def _copy(target: Any, source: Any) -> None:
    if isinstance(target, Tensor):
        target.copy_(source)
        return
    for t, s in zip(target, source):
        _copy(t, s)
