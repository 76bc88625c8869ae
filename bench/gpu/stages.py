"""Stage breakdown of a backend: the method's own stages (kernels/stages.py), each called
alone on the inputs the pipeline handed it, so that each can be timed and its kernels counted.

    clustered / i-clustered: hash -> cluster -> refine -> centroids -> centroid_attention ->
                             broadcast | sparse
    smyrf:                   hash -> sort -> cluster_attention
    banded:                  pool -> select -> attend

`stage_plan` runs the pipeline once through `kernels.stages.run_*` with an observer that
records every stage and its arguments; the plan replays them. `StagePlan.output` is what that
run produced, and the benchmark checks it equals `attention(...)`'s output, so the breakdown
is the backend's own list of stages and cannot drift from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from clusterserve.kernels import AttentionSpec
from clusterserve.kernels.dispatch import banded_stages, clustered_stages, smyrf_stages
from clusterserve.kernels.reference.full import full_attention
from clusterserve.kernels.stages import run_banded, run_clustered, run_smyrf


@dataclass
class Stage:
    """One stage: `run` calls it on the inputs the pipeline gave it."""

    name: str
    run: Callable[[], object]


@dataclass
class StagePlan:
    stages: list[Stage]
    output: Tensor  # (B, H, N, Dv): what the pipeline computed
    notes: list[str] = field(default_factory=list)


def stage_plan(q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec, scale: float, backend: str = "triton") -> StagePlan:
    """The stages of spec.method on q (B, H, N, D), k, v without padding, as `backend` runs
    them (a concrete backend: "reference", "native" or "triton")."""
    if spec.method == "full":
        out = full_attention(q, k, v, None, scale)
        return StagePlan([Stage("sdpa", lambda: full_attention(q, k, v, None, scale))], out)
    stages: list[Stage] = []

    def record(name: str, stage: Callable[..., Any], *args: Any) -> Any:
        stages.append(Stage(name, lambda: stage(*args)))
        return stage(*args)

    if spec.method == "smyrf":
        out = run_smyrf(smyrf_stages(backend), q, k, v, spec, None, scale, observe=record)
    elif spec.method == "banded":
        out = run_banded(banded_stages(backend), q, k, v, spec, None, scale, observe=record)
    else:
        out = run_clustered(clustered_stages(backend), q, k, v, spec, None, scale, observe=record)
    return StagePlan(stages, out)


def time_stages(plan: StagePlan, timer: Callable[[Callable[[], object]], float]) -> dict[str, float]:
    """Milliseconds per stage, by `timer(fn) -> ms`."""
    return {stage.name: timer(stage.run) for stage in plan.stages}


def count_stage_launches(plan: StagePlan) -> dict[str, dict[str, int]]:
    """Torch ops and Triton launches per stage."""
    from ..timing import counting_launches

    result = {}
    for stage in plan.stages:
        with counting_launches() as counts:
            stage.run()
        result[stage.name] = dict(counts)
    return result


def same_as_backend(plan: StagePlan, out: Tensor) -> bool:
    """Whether the chain of stages reproduced the backend's output exactly."""
    return torch.equal(plan.output, out)
