"""Each approximate method as a list of named stages, and the one driver per method that runs
them (`run_clustered`, `run_smyrf`, `run_banded`), with the types the stages hand each other.

Every backend (reference, native, triton) implements the same stages; the driver owns the
order, the masking rule and the exact-case shortcut, so a backend only says how each stage
runs on its hardware. Tests compare backends stage by stage and bench/gpu/stages.py times the
stages of the backend it measures by passing an `observe` hook.

Clustered and improved clustered attention (Vyas et al. 2020):
    hash                (q, spec) -> codes (B, H, N) int64, bit b = sign of projection b
    cluster             (codes, query_mask, spec) -> assign (B, H, N) in [0, C], Hamming K-means
    seed                (q, query_mask, spec) -> assign, in place of hash and cluster where
                        spec.bits is 0: each query's nearest seed query in Euclidean space
    refine              (q, assign, query_mask, spec) -> assign, Euclidean Lloyd steps
    centroids           (q, assign, clusters) -> (B, H, C, D) float32+, member means
    centroid_attention  (centroids, k, v, key_mask, scale, topk) -> CentroidAttention
    sparse              (q, k, v, assign, centroid, key_mask, scale, dtype) -> (B, H, N, Dv), eq. 15
    broadcast           (centroid_values, assign, dtype) -> (B, H, N, Dv), clustered only
A backend may also give cluster_means, (q, query_mask, spec) -> (assign, centroids): hash,
cluster, refine and centroids in one, observed as "cluster" (its launches hand each other
what the separate stages would recompute); run_clustered then takes it.

SMYRF (Daras et al. 2020); the asymmetric transform (eq. 4) is fused into `hash`, the merge of
the rounds by softmax mass (eq. 15) into `cluster_attention`:
    hash                (q, k, key_padding_mask, spec) -> (R, B, H, N), (R, B, H, M) hashes
    sort                (q_hashes, k_hashes) -> positions sorted by hash, real tokens first
    cluster_attention   (q, k, v, q_orders, k_orders, key_padding_mask, spec, scale, dtype) -> out

Banded attention (kernels/reference/banded.py defines the method; self-attention only):
    pool                (k, v, key_mask, spec) -> Pooled: per block mean key, mean value, log count
                        (float32; float64 for float64)
    select              (q, pooled, key_mask, spec, scale) -> Pooled with `chosen` filled in
    attend              (q, k, v, pooled, key_mask, spec, scale, dtype) -> (B, H, N, Dv), padded queries 0
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor

from clusterserve.kernels.reference.kmeans import one_query_per_cluster
from clusterserve.kernels.reference.masks import token_masks
from clusterserve.kernels.spec import AttentionSpec

CLUSTERED_STAGES = ("hash", "cluster", "seed", "refine", "centroids", "centroid_attention", "sparse", "broadcast")
SMYRF_STAGES = ("hash", "sort", "cluster_attention")
BANDED_STAGES = ("pool", "select", "attend")


class CentroidAttention(NamedTuple):
    """What the centroid pass hands on. values: V^c = A^c V (B, H, C, Dv); for improved
    clustered, each cluster's top-k keys under A^c: top_index (B, H, C, k) int64, top_probs
    (B, H, C, k) (0 on padded keys) and top_real (B, H, C, k) bool; None for clustered."""

    values: Tensor
    top_index: Tensor | None = None
    top_probs: Tensor | None = None
    top_real: Tensor | None = None


@dataclass(frozen=True)
class ClusteredStages:
    """One backend's clustered pipeline. compute: the dtype its stages take for an input dtype."""

    name: str
    compute: Callable[[torch.dtype], torch.dtype]
    hash: Callable[..., Tensor]
    cluster: Callable[..., Tensor]
    seed: Callable[..., Tensor]
    refine: Callable[..., Tensor]
    centroids: Callable[..., Tensor]
    centroid_attention: Callable[..., CentroidAttention]
    sparse: Callable[..., Tensor]
    broadcast: Callable[..., Tensor]
    # The exact case (kmeans.one_query_per_cluster) on the final assignments; a backend whose
    # cluster and refine stages apply it themselves passes `applied_by_stages`.
    exact_case: Callable[[Tensor, Tensor, int], Tensor] = one_query_per_cluster
    # Whether its stages read q as contiguous rows: then q is laid out once, before the hash,
    # instead of copied by each stage that needs it so.
    contiguous: bool = False
    # hash, cluster, refine and centroids in one, or None (see the module docstring); a
    # backend whose stages apply the exact case themselves.
    cluster_means: Callable[..., tuple[Tensor, Tensor]] | None = None


@dataclass(frozen=True)
class SmyrfStages:
    """One backend's SMYRF pipeline (see the module docstring)."""

    name: str
    compute: Callable[[torch.dtype], torch.dtype]
    hash: Callable[..., tuple[Tensor, Tensor]]
    sort: Callable[..., tuple[Tensor, Tensor]]
    cluster_attention: Callable[..., Tensor]
    # Whether its stages read q, k and v as contiguous rows: then they are laid out once.
    contiguous: bool = False


class Pooled(NamedTuple):
    """What banded's pool and select hand on. keys (B, H, NB, D) and values (B, H, NB, Dv): means
    over each block's real non-sink keys (0 where it has none); log_count (B, NB): log of how
    many there are (-inf for none); sinks (B, S) int64 positions of the sink keys, sink_real
    (B, S) bool; counted (B, N) bool: the keys a pooled block stands for (real, not sinks);
    chosen (B, H, NB, R) int64: the far blocks each query block attends exactly, ascending, -1
    for none (R = 0 before `select`); key_parts: a backend's own form of the mean keys (the
    Triton pool's split into half parts, kernels/triton/helpers.py), None where it has none;
    key_bias: a backend's additive masks, (2, B, N) float32 0 where a key is real (row 0) or
    counted (row 1), else -inf (the Triton pool's), None where it has none; far_bias (B, H, NB,
    NB) float32: a backend's pooled field per query block, each block's log count in its
    logits' units where the query block pools it (outside the band, counted, not chosen), else
    -inf (the Triton select's), None where it has none."""

    keys: Tensor
    values: Tensor
    log_count: Tensor
    sinks: Tensor
    sink_real: Tensor
    counted: Tensor
    chosen: Tensor
    key_parts: Tensor | None = None
    key_bias: Tensor | None = None
    far_bias: Tensor | None = None


@dataclass(frozen=True)
class BandedStages:
    """One backend's banded pipeline (see the module docstring); a backend without a select of
    its own passes the reference's."""

    name: str
    compute: Callable[[torch.dtype], torch.dtype]
    pool: Callable[..., Pooled]
    select: Callable[..., Pooled]
    attend: Callable[..., Tensor]
    # Whether its stages read q, k and v as contiguous rows: then they are laid out once.
    contiguous: bool = False


Observe = Callable[..., Any]


def call(name: str, stage: Callable[..., Any], *args: Any) -> Any:
    """The default `observe`: run the stage."""
    return stage(*args)


def float32_or_64(dtype: torch.dtype) -> torch.dtype:
    """The reference's and the native loops' compute dtype: float64 stays, the rest float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def run_clustered(
    stages: ClusteredStages, q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec,
    key_padding_mask: Tensor | None, scale: float, observe: Observe = call,
) -> Tensor:
    """Clustered or improved clustered attention (spec.method) through `stages`.

    q: (B, H, N, D), k: (B, H, M, D), v: (B, H, M, Dv) -> (B, H, N, Dv) in q's dtype.
    observe(name, stage, *args) runs each stage; the default calls it.
    """
    compute = stages.compute(q.dtype)
    qc, kc, vc = q.to(compute), k.to(compute), v.to(compute)
    qc = qc.contiguous() if stages.contiguous else qc
    key_mask, query_mask = token_masks(q, k, key_padding_mask)
    assign, centroids = _assignments(stages, qc, query_mask, spec, observe, means=True)
    if centroids is None:
        centroids = observe("centroids", stages.centroids, qc, assign, spec.clusters)
    topk = min(spec.topk, k.shape[2]) if spec.method == "i-clustered" else 0
    centroid = observe("centroid_attention", stages.centroid_attention, centroids, kc, vc, key_mask, scale, topk)
    if topk:
        return observe("sparse", stages.sparse, qc, kc, vc, assign, centroid, key_mask, scale, q.dtype)
    return observe("broadcast", stages.broadcast, centroid.values, assign, q.dtype)


def cluster_queries(
    stages: ClusteredStages, q: Tensor, query_mask: Tensor, spec: AttentionSpec, observe: Observe = call
) -> Tensor:
    """The hash, cluster and refine stages: q (B, H, N, D) in the compute dtype, query_mask
    (B, N) -> assignments (B, H, N) int64 in [0, C], padded queries at C. A sequence with no
    more real queries than clusters gives each query its own cluster: exact attention."""
    return _assignments(stages, q, query_mask, spec, observe, means=False)[0]


def _assignments(
    stages: ClusteredStages, q: Tensor, query_mask: Tensor, spec: AttentionSpec, observe: Observe, means: bool
) -> tuple[Tensor, Tensor | None]:
    """cluster_queries, and with `means` the centroids where the backend's cluster_means gives them."""
    if means and stages.cluster_means is not None:
        assign, centroids = observe("cluster", stages.cluster_means, q, query_mask, spec)
        return stages.exact_case(assign, query_mask, spec.clusters), centroids
    if spec.bits:
        codes = observe("hash", stages.hash, q, spec)
        assign = observe("cluster", stages.cluster, codes, query_mask, spec)
    else:
        assign = observe("seed", stages.seed, q, query_mask, spec)
    if spec.refine:
        assign = observe("refine", stages.refine, q, assign, query_mask, spec)
    return stages.exact_case(assign, query_mask, spec.clusters), None


def applied_by_stages(assign: Tensor, query_mask: Tensor, clusters: int) -> Tensor:
    """`exact_case` of a backend whose cluster and refine stages give each query its own
    cluster themselves when a sequence has no more real queries than clusters."""
    return assign


def run_smyrf(
    stages: SmyrfStages, q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec,
    key_padding_mask: Tensor | None, scale: float, observe: Observe = call,
) -> Tensor:
    """SMYRF attention through `stages`: (B, H, N, D), (B, H, M, D), (B, H, M, Dv) -> (B, H, N, Dv)."""
    compute = stages.compute(q.dtype)
    qc, kc, vc = q.to(compute), k.to(compute), v.to(compute)
    if stages.contiguous:
        qc, kc, vc = qc.contiguous(), kc.contiguous(), vc.contiguous()
    q_hashes, k_hashes = observe("hash", stages.hash, qc, kc, key_padding_mask, spec)
    q_orders, k_orders = observe("sort", stages.sort, q_hashes, k_hashes)
    return observe(
        "cluster_attention", stages.cluster_attention, qc, kc, vc, q_orders, k_orders, key_padding_mask, spec, scale, q.dtype
    )


def sort_by_hash(q_hashes: Tensor, k_hashes: Tensor) -> tuple[Tensor, Tensor]:
    """SMYRF's sort stage on every backend: positions in hash order, ties by position (padded
    tokens hash to +inf and come last). Queries and keys of one length sort as one batch of
    rows: one segmented sort on a GPU instead of two, each of which fills under half of it."""
    if q_hashes.shape == k_hashes.shape:
        q_orders, k_orders = torch.stack([q_hashes, k_hashes]).argsort(dim=-1, stable=True)
        return q_orders, k_orders
    return q_hashes.argsort(dim=-1, stable=True), k_hashes.argsort(dim=-1, stable=True)


def run_banded(
    stages: BandedStages, q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec, key_padding_mask: Tensor | None,
    scale: float, observe: Observe = call,
) -> Tensor:
    """Banded attention through `stages`: (B, H, N, D), (B, H, N, D), (B, H, N, Dv) ->
    (B, H, N, Dv) in q's dtype. Self-attention only (positions are shared by queries and keys)."""
    if q.shape[2] != k.shape[2]:
        raise ValueError(
            f"method 'banded' is self-attention: q and k need the same length, got {q.shape[2]} and {k.shape[2]}"
        )
    compute = stages.compute(q.dtype)
    qc, kc, vc = q.to(compute), k.to(compute), v.to(compute)
    if stages.contiguous:
        qc, kc, vc = qc.contiguous(), kc.contiguous(), vc.contiguous()
    key_mask, _ = token_masks(q, k, key_padding_mask)
    pooled = observe("pool", stages.pool, kc, vc, key_mask, spec)
    pooled = observe("select", stages.select, qc, pooled, key_mask, spec, scale)
    return observe("attend", stages.attend, qc, kc, vc, pooled, key_mask, spec, scale, q.dtype)
