"""What the scheduler reports as it works, to whoever counts it (the service's Prometheus
metrics implement it): the engine itself holds no metric."""

from __future__ import annotations

from typing import Protocol


class Observer(Protocol):
    def admitted(self, jobs: int) -> None:
        """Jobs between submit and answer."""

    def waiting(self, jobs: int) -> None:
        """Jobs whose first batch has not started."""

    def running(self, batches: int) -> None:
        """Batches whose forward pass is under way."""

    def layer(self) -> None:
        """One layer of one batch has run."""

    def started(self, method: str, queue_s: float, tokens: int) -> None:
        """An input's batch started: its method, seconds queued and tokens."""

    def finished(self, method: str, seconds: float, inputs: int, tokens: int, peak_memory: int | None) -> None:
        """A batch finished: the method that ran most of its tokens, its forward pass's seconds,
        inputs, tokens and peak memory in bytes (None where it cannot be measured)."""

    def stopped(self, reason: str, inputs: int) -> None:
        """Inputs whose work stopped because their job is gone ("deadline", "disconnected")."""


class Unobserved:
    """An Observer that counts nothing."""

    def admitted(self, jobs: int) -> None: ...
    def waiting(self, jobs: int) -> None: ...
    def running(self, batches: int) -> None: ...
    def layer(self) -> None: ...
    def started(self, method: str, queue_s: float, tokens: int) -> None: ...
    def finished(self, method: str, seconds: float, inputs: int, tokens: int, peak_memory: int | None) -> None: ...
    def stopped(self, reason: str, inputs: int) -> None: ...
