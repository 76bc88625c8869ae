"""The native backend of clustered and improved clustered attention: the reference's stages
with the hashing, the K-means, the refinement, i-clustered's centroid pass (A^c V and the
top-k in one sweep over the keys) and the per-query sparse part in the C loops of native.c
(native.py), on float32 CPU tensors.

They do the reference's work without its (N, C) score matrices, (C, M) probabilities and
(T, tile, k) logits. Cluster means and the gathers of the top-k rows stay PyTorch ops, and
the centroid pass of clustered attention (no top-k) is PyTorch's SDPA with the centroids as
queries.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import native
from .clustered import broadcast, gather_rows
from .full import attend
from .hashing import hash_planes
from .kmeans import cluster_means, initial_centroid_positions, initial_offsets
from .spec import AttentionSpec
from .stages import CentroidAttention, ClusteredStages


def hash_queries(q: Tensor, spec: AttentionSpec) -> Tensor:
    _, h, _, d = q.shape
    return native.hash_codes(q, hash_planes(h, d, spec.bits, spec.seed))


def cluster_codes(codes: Tensor, query_mask: Tensor, spec: AttentionSpec) -> Tensor:
    offsets = initial_offsets(codes.shape[1], spec.seed)
    initial = codes.gather(2, initial_centroid_positions(query_mask, spec.clusters, offsets))
    return native.hamming_kmeans(codes, query_mask, initial, spec.iterations, spec.bits)


def refine_assignments(q: Tensor, assign: Tensor, query_mask: Tensor, spec: AttentionSpec) -> Tensor:
    return native.refine_clusters(q, assign, query_mask, spec.clusters, spec.refine)


def centroid_attention(centroids: Tensor, k: Tensor, v: Tensor, key_mask: Tensor, scale: float, topk: int) -> CentroidAttention:
    if not topk:  # V^c alone: SDPA's blocked kernel never holds the (C, M) probabilities
        return CentroidAttention(attend(centroids, k, v, None if bool(key_mask.all()) else key_mask, scale))
    values, top_index, top_probs, top_real = native.centroid_attention(centroids, k, v, key_mask, scale, topk)
    return CentroidAttention(values, top_index, top_probs, top_real)


def improved_sparse(
    q: Tensor, k: Tensor, v: Tensor, assign: Tensor, centroid: CentroidAttention, key_mask: Tensor, scale: float,
    dtype: torch.dtype,
) -> Tensor:
    top_values = gather_rows(v, centroid.top_index)  # (B, H, C, k, Dv)
    bottom_values = centroid.values - (centroid.top_probs[..., None] * top_values).sum(-2)  # eq. (17)
    top_keys = gather_rows(k, centroid.top_index)
    mass = centroid.top_probs.sum(-1)
    out = native.improved_sparse(q, assign, top_keys, top_values, centroid.top_real, mass, bottom_values, scale)
    return out.to(dtype)


NATIVE = ClusteredStages(
    name="native", compute=lambda dtype: torch.float32, hash=hash_queries, cluster=cluster_codes,
    refine=refine_assignments, centroids=cluster_means, centroid_attention=centroid_attention,
    sparse=improved_sparse, broadcast=broadcast,
)
