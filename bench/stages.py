"""Stage breakdown of the Triton backend: each stage function of a method, called alone on
the inputs the previous stages produced, so that each can be timed and its kernels counted.

    clustered / i-clustered: hash -> k-means -> refine -> centroids -> centroid attention ->
                             broadcast | top-k -> tiles -> sparse part
    smyrf:                   hash -> sort -> cluster attention

The stages call the same functions, in the same order and with the same arguments, as
`clustered_attention_triton` and `smyrf_attention_triton`; `StagePlan.output` is what that
chain produced, and the benchmark checks it equals `attention(...)`'s output, so the
breakdown cannot silently drift from the backend. The improved kernel's launcher also does
its own top-k and tiling: the "sparse part" is its time less those two stages' times.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import triton
from torch import Tensor

from kernels import AttentionSpec
from kernels.clustered import TILE, cluster_tiles
from kernels.clustered_triton import (
    broadcast_triton,
    centroid_attention_triton,
    improved_triton,
)
from kernels.full import full_attention
from kernels.hashing import hash_planes, on_device
from kernels.hashing_triton import hash_codes_triton
from kernels.kmeans import initial_offsets, one_query_per_cluster
from kernels.kmeans_triton import cluster_means_triton, hamming_kmeans_triton, refine_clusters_triton
from kernels.masks import token_masks
from kernels.smyrf import smyrf_projections
from kernels.smyrf_triton import smyrf_cluster_attention_triton, smyrf_hashes_triton


@dataclass
class Stage:
    """One stage: `run` calls it on stored inputs. Its time is run's time less the times of
    the stages named in `minus` (work that run repeats from earlier stages)."""

    name: str
    run: Callable[[], object]
    minus: tuple[str, ...] = ()


@dataclass
class StagePlan:
    stages: list[Stage]
    output: Tensor  # (B, H, N, Dv): what the chain of stages computed
    notes: list[str] = field(default_factory=list)


def stage_plan(q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec, scale: float) -> StagePlan:
    """The stages of spec.method on q (B, H, N, D), k, v without padding, run once to get
    each stage's inputs."""
    if spec.method == "full":
        out = full_attention(q, k, v, None, scale)
        return StagePlan([Stage("sdpa", lambda: full_attention(q, k, v, None, scale))], out)
    if spec.method == "smyrf":
        return _smyrf_plan(q, k, v, spec, scale)
    return _clustered_plan(q, k, v, spec, scale)


def _clustered_plan(q, k, v, spec: AttentionSpec, scale: float) -> StagePlan:
    """clustered_attention_triton and cluster_queries_triton, one call per stage."""
    _, h, n, d = q.shape
    clusters = spec.clusters
    key_mask, query_mask = token_masks(q, k, None)
    planes = on_device(hash_planes, (h, d, spec.bits, spec.seed), q.device)
    offsets = on_device(initial_offsets, (h, spec.seed), q.device)
    codes = hash_codes_triton(q, planes)
    hamming = hamming_kmeans_triton(codes, query_mask, clusters, spec.iterations, offsets, spec.bits)
    refined = refine_clusters_triton(q, hamming, query_mask, clusters, spec.refine) if spec.refine else hamming
    assign = one_query_per_cluster(refined, query_mask, clusters)
    centroids, _, _ = cluster_means_triton(q, assign, clusters)
    improved = spec.method == "i-clustered"
    probs, values = centroid_attention_triton(centroids, k, v, key_mask, scale, improved)

    stages = [
        Stage("hash", lambda: hash_codes_triton(q, planes)),
        Stage("k-means",
              lambda: hamming_kmeans_triton(codes, query_mask, clusters, spec.iterations, offsets, spec.bits)),
    ]
    if spec.refine:
        stages.append(Stage("refine", lambda: refine_clusters_triton(q, hamming, query_mask, clusters, spec.refine)))
    stages += [
        Stage("centroids",
              lambda: cluster_means_triton(q, one_query_per_cluster(refined, query_mask, clusters), clusters)),
        Stage("centroid attention", lambda: centroid_attention_triton(centroids, k, v, key_mask, scale, improved)),
    ]
    if not improved:
        stages.append(Stage("broadcast", lambda: broadcast_triton(values, assign, q.dtype)))
        return StagePlan(stages, broadcast_triton(values, assign, q.dtype))
    top = min(spec.topk, k.shape[2])
    n_tiles = triton.cdiv(n, TILE) + clusters  # improved_triton's static bound
    stages += [
        Stage("top-k", lambda: probs.topk(top, dim=-1)),
        Stage("tiles", lambda: cluster_tiles(assign, clusters, TILE, n_tiles)),
        Stage(
            "sparse part",
            lambda: improved_triton(q, k, v, assign, probs, values, key_mask, scale, spec.topk),
            minus=("top-k", "tiles"),
        ),
    ]
    out = improved_triton(q, k, v, assign, probs, values, key_mask, scale, spec.topk)
    return StagePlan(stages, out)


def _smyrf_plan(q, k, v, spec: AttentionSpec, scale: float) -> StagePlan:
    """smyrf_attention_triton, one call per stage."""
    _, h, _, d = q.shape
    projections = on_device(smyrf_projections, (spec.hash_rounds, h, d, spec.seed), q.device)
    q_hashes, k_hashes = smyrf_hashes_triton(q, k, None, projections)
    q_orders = q_hashes.argsort(dim=-1, stable=True)
    k_orders = k_hashes.argsort(dim=-1, stable=True)

    def sort():
        return q_hashes.argsort(dim=-1, stable=True), k_hashes.argsort(dim=-1, stable=True)

    def cluster_attention():
        return smyrf_cluster_attention_triton(q, k, v, q_orders, k_orders, None, spec.cluster_size, scale)

    stages = [
        Stage("hash", lambda: smyrf_hashes_triton(q, k, None, projections)),
        Stage("sort", sort),
        Stage("cluster attention", cluster_attention),
    ]
    return StagePlan(stages, cluster_attention()[0])


def time_stages(plan: StagePlan, timer: Callable[[Callable[[], object]], float]) -> dict[str, float]:
    """Milliseconds per stage, by `timer(fn) -> ms`; a stage's `minus` stages are subtracted
    (floored at 0: a difference of medians can dip below it)."""
    raw = {stage.name: timer(stage.run) for stage in plan.stages}
    return {
        stage.name: max(0.0, raw[stage.name] - sum(raw[other] for other in stage.minus))
        for stage in plan.stages
    }


def count_stage_launches(plan: StagePlan) -> dict[str, dict[str, int]]:
    """Torch ops and Triton launches per stage (less those of its `minus` stages)."""
    from .timing import counting_launches

    raw = {}
    for stage in plan.stages:
        with counting_launches() as counts:
            stage.run()
        raw[stage.name] = dict(counts)
    result = {}
    for stage in plan.stages:
        result[stage.name] = {
            key: raw[stage.name][key] - sum(raw[other][key] for other in stage.minus) for key in raw[stage.name]
        }
    return result


def same_as_backend(plan: StagePlan, out: Tensor) -> bool:
    """Whether the chain of stages reproduced the backend's output exactly."""
    return torch.equal(plan.output, out)
