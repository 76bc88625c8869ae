"""Clustered and improved clustered attention (Vyas et al. 2020, arXiv:2007.04825).

Clustered (sec. 3.2): group the queries into C clusters, attend with each cluster's
centroid (the mean of its member queries) over all keys, and give every member its
centroid's output. Cost O(N C D) instead of O(N^2 D).

Improved clustered (sec. 3.3, eqs. 9-10 and supplementary A.2 eqs. 13-17): take each
cluster's top-k keys under the centroid attention A^c; every member query recomputes exact
attention on those k keys, scaled to the mass m_j that A^c put on them, and keeps A^c on the
other keys:  out_i = m_j * softmax(q_i K_top^T) V_top + (V^c_j - A^c_j[top] V_top).

This file holds the reference backend's stages (kernels/stages.py runs them): plain PyTorch,
the definition the native loops (native/clustered.py) and the Triton kernels
(triton/clustered.py) are tested against.
"""

from __future__ import annotations

import torch
from torch import Tensor

from clusterserve.kernels.reference.hashing import hash_codes, hash_planes, unpack_bits
from clusterserve.kernels.reference.kmeans import cluster_means, hamming_kmeans, initial_offsets, refine_clusters, seeded_clusters
from clusterserve.kernels.spec import AttentionSpec
from clusterserve.kernels.stages import CentroidAttention, ClusteredStages, float32_or_64

# Members of one cluster are processed in tiles of this many queries (the Triton kernel's
# BLOCK_M); a tile shares its cluster's top-k keys.
TILE = 32


def hash_queries(q: Tensor, spec: AttentionSpec) -> Tensor:
    """The hash stage: `spec.bits`-bit LSH codes of the queries (B, H, N, D) -> (B, H, N) int64."""
    _, h, _, d = q.shape
    return hash_codes(q, hash_planes(h, d, spec.bits, spec.seed))


def cluster_codes(codes: Tensor, query_mask: Tensor, spec: AttentionSpec) -> Tensor:
    """The cluster stage: Hamming K-means of the codes (B, H, N) -> assignments (B, H, N) in [0, C]."""
    signs = unpack_bits(codes, spec.bits) * 2 - 1
    offsets = initial_offsets(codes.shape[1], spec.seed)
    return hamming_kmeans(signs, query_mask, spec.clusters, spec.iterations, offsets)


def seed_assignments(q: Tensor, query_mask: Tensor, spec: AttentionSpec) -> Tensor:
    """The seed stage (spec.bits 0): each query's nearest seed query, (B, H, N, D) -> (B, H, N) in [0, C]."""
    return seeded_clusters(q, query_mask, spec.clusters, initial_offsets(q.shape[1], spec.seed))


def refine_assignments(q: Tensor, assign: Tensor, query_mask: Tensor, spec: AttentionSpec) -> Tensor:
    """The refine stage: `spec.refine` Euclidean Lloyd steps on the queries from `assign`."""
    return refine_clusters(q, assign, query_mask, spec.clusters, spec.refine)


def centroid_attention(centroids: Tensor, k: Tensor, v: Tensor, key_mask: Tensor, scale: float, topk: int) -> CentroidAttention:
    """The centroid pass: A^c = softmax(Q^c K^T * scale) over the real keys, V^c = A^c V, and
    with topk > 0 each cluster's `topk` most probable keys (their probabilities 0 on padding)."""
    probs = _centroid_attention(centroids, k, key_mask, scale)  # (B, H, C, M)
    values = probs @ v  # (B, H, C, Dv)
    if not topk:
        return CentroidAttention(values)
    top_probs, top_index = probs.topk(topk, dim=-1)  # (B, H, C, k)
    top_real = key_mask[:, None, None, :].expand_as(probs).gather(-1, top_index)
    return CentroidAttention(values, top_index, top_probs * top_real, top_real)


def broadcast(centroid_values: Tensor, assign: Tensor, dtype: torch.dtype) -> Tensor:
    """The broadcast stage: every query gets its cluster's row of V^c; padded queries 0."""
    return _broadcast(centroid_values, assign).to(dtype)


def _centroid_attention(centroids: Tensor, k: Tensor, key_mask: Tensor, scale: float) -> Tensor:
    """A^c = softmax(Q^c K^T * scale) over real keys: (B, H, C, M); rows of 0 if no real key."""
    logits = (centroids @ k.transpose(-1, -2)) * scale
    logits = logits.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.nan_to_num(probs, nan=0.0)


def _broadcast(per_cluster: Tensor, assign: Tensor) -> Tensor:
    """Give each query its cluster's row: (B, H, C, F) -> (B, H, N, F); padded queries 0.

    The rows are picked by one index_select over the flattened (B, H, C + 1) rows (a gather
    along C would expand the index to (B, H, N, F)), in (B, N, H) order: the result is a
    (B, H, N, F) view of a (B, N, H, F) tensor, the token-major layout the encoder's packed
    tokens take back without another copy."""
    b, h, c, f = per_cluster.shape
    padded_row = torch.zeros(b, h, 1, f, dtype=per_cluster.dtype, device=per_cluster.device)
    rows = torch.cat([per_cluster, padded_row], dim=2).view(b * h * (c + 1), f)
    first_row = torch.arange(b * h, device=assign.device).view(b, 1, h) * (c + 1)  # of each (b, h)
    index = (assign.transpose(1, 2) + first_row).reshape(-1)  # (B * N * H,)
    return rows.index_select(0, index).view(b, -1, h, f).transpose(1, 2)


def cluster_tiles(assign: Tensor, clusters: int, tile: int, n_tiles: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Lay the real queries out cluster by cluster in tiles of `tile` queries.

    assign: (B, H, N) in [0, C]. Returns, for T tiles (n_tiles, or as many as needed):
    positions (B, H, T, tile) of the queries, valid (B, H, T, tile), and the cluster of
    each tile (B, H, T) in [0, C] (C = an unused tile).
    """
    b, h, n = assign.shape
    sizes = torch.zeros(b, h, clusters + 1, dtype=torch.int64, device=assign.device)
    sizes.scatter_add_(2, assign, torch.ones_like(assign))
    sizes = sizes[:, :, :clusters]
    tiles_per_cluster = (sizes + tile - 1) // tile
    tile_end = torch.cumsum(tiles_per_cluster, dim=-1)  # (B, H, C)
    if n_tiles is None:
        n_tiles = max(1, int(tile_end[..., -1].max()))
    t = torch.arange(n_tiles, device=assign.device).expand(b, h, n_tiles).contiguous()
    tile_cluster = torch.searchsorted(tile_end, t, right=True)  # (B, H, T)
    c = tile_cluster.clamp(max=clusters - 1)
    first_tile = (tile_end - tiles_per_cluster).gather(2, c)
    cluster_start = (torch.cumsum(sizes, dim=-1) - sizes).gather(2, c)
    offset = (t - first_tile) * tile  # this tile's first member within its cluster
    slot = offset[..., None] + torch.arange(tile, device=assign.device)
    valid = (slot < sizes.gather(2, c)[..., None]) & (tile_cluster < clusters)[..., None]
    rank = (cluster_start[..., None] + slot).clamp(max=n - 1)
    by_cluster = torch.argsort(assign, dim=-1, stable=True)  # real queries grouped by cluster
    positions = by_cluster.gather(2, rank.reshape(b, h, -1)).reshape(b, h, n_tiles, tile)
    return positions, valid, tile_cluster


def improved_sparse(
    q: Tensor, k: Tensor, v: Tensor, assign: Tensor, centroid: CentroidAttention, key_mask: Tensor, scale: float,
    dtype: torch.dtype,
) -> Tensor:
    """The sparse stage, eq. (15): exact attention of every query on its cluster's top-k keys,
    scaled to their centroid mass m_j, plus the centroid attention on the other keys.

    Computed in tiles of TILE queries of one cluster, which share that cluster's top-k keys.
    """
    b, h, n, _ = q.shape
    dv = v.shape[-1]
    clusters = centroid.values.shape[2]
    top_mass = centroid.top_probs.sum(-1)  # m_j, eq. (9)
    top_values = gather_rows(v, centroid.top_index)  # (B, H, C, k, Dv)
    # V^b_j: the centroid attention on every key outside the top-k (eq. 17).
    bottom_values = centroid.values - (centroid.top_probs[..., None] * top_values).sum(-2)
    positions, valid, tile_cluster = cluster_tiles(assign, clusters, TILE)
    c = tile_cluster.clamp(max=clusters - 1)
    queries = gather_rows(q, positions)  # (B, H, T, tile, D)
    keys = gather_rows(k, _select(centroid.top_index, c))  # (B, H, T, k, D)
    logits = (queries @ keys.transpose(-1, -2)) * scale  # (B, H, T, tile, k)
    logits = logits.masked_fill(~_select(centroid.top_real, c)[..., None, :], float("-inf"))
    probs = torch.nan_to_num(torch.softmax(logits, dim=-1), nan=0.0)
    tile_out = _select(top_mass, c)[..., None, None] * (probs @ _select(top_values, c))
    tile_out = tile_out + _select(bottom_values, c)[..., None, :]  # (B, H, T, tile, Dv)
    # Scatter back to query order; empty slots write to a spare row n.
    target = torch.where(valid, positions, n).reshape(b, h, -1)
    out = torch.zeros(b, h, n + 1, dv, dtype=q.dtype, device=q.device)
    out.scatter_(2, target[..., None].expand(-1, -1, -1, dv), tile_out.reshape(b, h, -1, dv))
    return out[:, :, :n].to(dtype)


def gather_rows(x: Tensor, index: Tensor) -> Tensor:
    """x (B, H, M, F), index (B, H, C, k) -> (B, H, C, k, F)."""
    b, h, c, kk = index.shape
    flat = x.gather(2, index.reshape(b, h, c * kk, 1).expand(-1, -1, -1, x.shape[-1]))
    return flat.reshape(b, h, c, kk, x.shape[-1])


def _select(per_cluster: Tensor, cluster: Tensor) -> Tensor:
    """Rows of each query's cluster: per_cluster (B, H, C, ...) , cluster (B, H, n) -> (B, H, n, ...)."""
    tail = per_cluster.shape[3:]
    index = cluster.reshape(*cluster.shape, *([1] * len(tail))).expand(*cluster.shape, *tail)
    return per_cluster.gather(2, index)


REFERENCE = ClusteredStages(
    name="reference", compute=float32_or_64, hash=hash_queries, cluster=cluster_codes,
    seed=seed_assignments, refine=refine_assignments, centroids=cluster_means, centroid_attention=centroid_attention,
    sparse=improved_sparse, broadcast=broadcast,
)
