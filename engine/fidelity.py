"""The fidelity re-run: a job that asks how close its vectors are to exact attention runs each
approximate sequence a second time, with exact attention in float32, in the same job (one
admission, one deadline). The scheduler batches the re-runs apart and runs them on the
encoder's float32 twin (`Encoder.float32`); the caller compares each row with its twin's.

    with_exact_reruns(runs, in_float32, work)  the job's runs and, after them, the re-runs
    exact_rows(vectors, rows, rerun)           every sequence's rows with exact attention
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from clusterserve.kernels import AttentionSpec
from clusterserve.models.planning.calibration import EXACT

from .jobs import Run


def with_exact_reruns(
    runs: list[Run], in_float32: bool, work: Callable[[int, AttentionSpec], float]
) -> tuple[list[Run], tuple[int, ...]]:
    """`runs` followed by the exact re-run of each one that needs it, and the indices of those:
    every run, except in float32 those that run exact attention already (their own reference).
    work(tokens, spec): a re-run's estimated work units."""
    rerun = tuple(i for i, run in enumerate(runs) if run.spec.method != "full" or not in_float32)
    exact = [Run(runs[i].ids, EXACT, runs[i].output, work(len(runs[i].ids), EXACT), True) for i in rerun]
    return runs + exact, rerun


def exact_rows(vectors: Tensor, rows: list[int], rerun: tuple[int, ...]) -> Tensor:
    """The rows every sequence gives with exact attention: its own where it ran exact, its
    re-run's (after the first sum(rows) rows of `vectors`, in `rerun` order) where it did not."""
    starts = [0]
    for count in rows:
        starts.append(starts[-1] + count)
    exact = vectors[: starts[-1]].clone()
    at = starts[-1]
    for i in rerun:
        exact[starts[i] : starts[i + 1]] = vectors[at : at + rows[i]]
        at += rows[i]
    return exact
