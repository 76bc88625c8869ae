"""Wall-clock timing for the start-up measurements that decide how a process runs (dtype
`auto`'s bfloat16 check, float32's GEMM library, a device's throughput) and for the
benchmarks' variants: the ways of doing the same work are called in turn, a call of each a
round, so that load from another process falls on all of them alike."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping


def alternated_seconds(
    runs: Mapping[Hashable, Callable[[], object]], rounds: int, warm_up: bool = True
) -> dict[Hashable, list[float]]:
    """Each run's seconds over `rounds` rounds, one call of each a round in the mapping's
    order, after one untimed call of each (first-call costs) unless not `warm_up` (the caller
    has called them already)."""
    if warm_up:
        for run in runs.values():
            run()
    times: dict[Hashable, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return times
