"""What the scheduler runs: a `Job` (one client request) of `Run`s (its sequences), and what
it answers, a `JobResult`. A job carries its plan's runs themselves, in the order its rows
come back."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field

from torch import Tensor

from clusterserve.kernels import AttentionSpec
from clusterserve.models.pooling import POOLED, Output


@dataclass(frozen=True)
class BatchKey:
    """Inputs batch together only when one forward pass can run them: the same task adapter
    (the weights). Exact re-runs (engine.fidelity) form batches of their own, in float32, so
    that a request's approximate passes are timed alone. Specs may differ: each sequence of a
    packed batch attends by its own."""

    adapter: str | None = None
    exact_rerun: bool = False


@dataclass(frozen=True)
class Run:
    """One sequence of a job: its token ids (within the length limit), its resolved attention
    (never "auto"), what it returns, its estimated work units (models.planning.cost), and
    whether it is an exact re-run of another (engine.fidelity)."""

    ids: list[int]
    spec: AttentionSpec
    output: Output = POOLED
    work: float = 0.0
    exact_rerun: bool = False


@dataclass
class Job:
    """One client request: its sequences, in the order its rows come back."""

    request_id: str
    runs: list[Run]
    adapter: str | None = None  # the task adapter every sequence runs with (None: the base weights)
    deadline: float = float("inf")  # the scheduler's clock (time.monotonic) by which it must be answered
    timeout_s: float = float("inf")  # the deadline's length, for DeadlineExceeded

    # Filled in by the scheduler.
    enqueued_at: float = 0.0
    started_at: float | None = None
    finished_at: float = 0.0
    peak_memory: int | None = None
    vectors: list[Tensor | None] = field(default_factory=list)
    spans: list[tuple[float, float] | None] = field(default_factory=list)  # per input: its batch's run
    remaining: int = 0
    cancelled: bool = False  # set on the event loop; the worker drops the job's items, queued or running
    gone_because: str = ""  # why it was cancelled: "deadline" or "disconnected" (set with `cancelled`)
    future: asyncio.Future[JobResult] | None = None
    loop: asyncio.AbstractEventLoop | None = None


@dataclass(frozen=True)
class JobResult:
    # Every sequence's rows, in order: (sum of k_i, dim) float32 on the CPU, not normalised
    # (models.runtime.encoder.finish); k_i = Job.runs[i].output.rows(tokens), 1 for a pooled sequence.
    vectors: Tensor
    queue_s: float
    inference_s: float
    peak_memory: int | None
    spans: tuple[tuple[float, float], ...] = ()  # per sequence: (start, end) of the forward pass that ran it

    def run_seconds(self, indices: list[int]) -> float:
        """Seconds of the forward passes that ran these sequences (a pass shared by several counts once)."""
        return sum(end - start for start, end in {self.spans[i] for i in indices})


@dataclass(frozen=True)
class Item:
    """One run of a job, as it waits in the queue and runs in a batch."""

    job: Job
    index: int
    key: BatchKey

    @property
    def run(self) -> Run:
        return self.job.runs[self.index]

    @property
    def tokens(self) -> int:
        return len(self.run.ids)

    @property
    def spec(self) -> AttentionSpec:
        return self.run.spec

    @property
    def work(self) -> float:
        return self.run.work


def jobs_of(items: Iterable[Item]) -> list[Job]:
    """The distinct jobs of these items, in first-seen order."""
    return list({id(item.job): item.job for item in items}.values())


def dominant_method(runs: Iterable[tuple[str, int]]) -> str:
    """The label of work that mixes methods, from (method, tokens) pairs: the method that runs
    the most tokens."""
    tokens: dict[str, int] = {}
    for method, count in runs:
        tokens[method] = tokens.get(method, 0) + count
    return max(tokens, key=lambda method: tokens[method])
