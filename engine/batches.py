"""A batch the scheduler forms, and the rules it forms and orders batches by.

A batch starts from the queued item of least estimated work minus the seconds it has waited,
then takes queued items with its key and of like work (within SIMILAR_WORK either way, so a
short input never waits inside a long one's batch) while the batch's real tokens fit
(`models.planning.plan.fits`, the rule `Encoder.embed` batches by). Between layers the one
with the least estimated remaining seconds minus the seconds it has waited runs next
(shortest remaining work first, with ageing).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from clusterserve.models.planning.cost import Throughput
from clusterserve.models.planning.plan import fits

from .jobs import Item

# Inputs share a batch only when their estimated work is within this factor of each other.
SIMILAR_WORK = 4.0


class Abandoned(Exception):
    """Raised inside a batch's step when none of its inputs is wanted any more."""


@dataclass
class Batch:
    """Items that run as one packed forward pass: not started until `forward` is set."""

    items: list[Item]
    work: float  # estimated work units of the whole batch
    waiting_since: float  # when it last ran a layer, or its oldest item was queued
    forward: Any = None  # models.runtime.runner.Forward once started
    started_at: float = 0.0
    peak_memory: int | None = None

    @classmethod
    def of(cls, items: list[Item], waiting_since: float) -> Batch:
        return cls(items, sum(item.work for item in items), waiting_since)

    def remaining(self) -> float:
        """Estimated work units left."""
        if self.forward is None:
            return self.work
        return self.work * (1.0 - self.forward.done / max(self.forward.layers, 1))

    def wanted(self, now: float) -> list[int]:
        """Indices of the items whose job still waits for them at `now`: not cancelled, not past
        its deadline."""
        return [i for i, item in enumerate(self.items) if not item.job.cancelled and now < item.job.deadline]

    def score(self, throughput: Throughput, now: float) -> float:
        """Estimated seconds left minus seconds waited: the least runs next."""
        return throughput.seconds(self.remaining()) - (now - self.waiting_since)


def next_batch(pending: Iterable[Item], throughput: Throughput, max_batch_tokens: int, now: float) -> Batch | None:
    """The batch the queue would start next (see the module docstring); None when it is empty."""
    pending = list(pending)
    if not pending:
        return None
    first = min(pending, key=lambda item: throughput.seconds(item.work) - (now - item.job.enqueued_at))
    batch, used = [first], first.tokens
    for item in pending:
        alike = first.work / SIMILAR_WORK <= item.work <= first.work * SIMILAR_WORK
        if item is not first and item.key == first.key and alike and fits(used, item.tokens, max_batch_tokens):
            batch.append(item)
            used += item.tokens
    return Batch.of(batch, min(item.job.enqueued_at for item in batch))
