"""The scheduler's typed errors: why a job got no vectors. Each carries what its message needs
as data; the service maps them to HTTP in its one error table (service.errors)."""

from __future__ import annotations


class EngineError(Exception):
    """A job the scheduler did not run to its end. `reason` is a short name, for counting."""

    reason = "engine"


class ShuttingDown(EngineError):
    """Submitted while the scheduler stops: it admits nothing new."""

    reason = "shutting_down"

    def __init__(self) -> None:
        super().__init__("the scheduler is shutting down")


class Overloaded(EngineError):
    """`limit` jobs are admitted already (between submit and answer)."""

    reason = "overloaded"

    def __init__(self, limit: int) -> None:
        super().__init__(f"{limit} jobs already in progress")
        self.limit = limit


class DeadlineExceeded(EngineError):
    """The job's deadline, `timeout_s` seconds after its arrival, passed before its last vector."""

    reason = "deadline"

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"not finished within its deadline of {timeout_s:g} s")
        self.timeout_s = timeout_s


class OutOfMemory(EngineError):
    """An input of `tokens` tokens ran out of memory even alone in its batch."""

    reason = "out_of_memory"

    def __init__(self, tokens: int) -> None:
        super().__init__(f"out of memory on an input of {tokens} tokens, alone in its batch")
        self.tokens = tokens


class Cancelled(EngineError):
    """The submitter withdrew the job (its client went away) before it finished."""

    reason = "disconnected"

    def __init__(self) -> None:
        super().__init__("withdrawn before its vectors were ready")
