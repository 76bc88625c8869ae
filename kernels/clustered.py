"""Clustered and improved clustered attention (Vyas et al. 2020, arXiv:2007.04825).

Clustered (sec. 3.2): group the queries into C clusters, attend with each cluster's
centroid (the mean of its member queries) over all keys, and give every member its
centroid's output. Cost O(N C D) instead of O(N^2 D).

Improved clustered (sec. 3.3, eqs. 9-10 and supplementary A.2 eqs. 13-17): take each
cluster's top-k keys under the centroid attention A^c; every member query recomputes exact
attention on those k keys, scaled to the mass m_j that A^c put on them, and keeps A^c on the
other keys:  out_i = m_j * softmax(q_i K_top^T) V_top + (V^c_j - A^c_j[top] V_top).

This file holds the PyTorch reference; the Triton kernels live in clustered_triton.py. On a
CPU, float32 inputs run the clustering, the centroid softmax with its top-k and the per-query
sparse part through the native loops of native.c, when they are built (native.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import native
from .hashing import hash_planes, hash_signs
from .kmeans import (
    cluster_means,
    hamming_kmeans,
    initial_centroid_positions,
    initial_offsets,
    one_query_per_cluster,
    refine_clusters,
)
from .masks import token_masks
from .spec import AttentionSpec

# Members of one cluster are processed in tiles of this many queries (the Triton kernel's
# BLOCK_M); a tile shares its cluster's top-k keys.
TILE = 32


def cluster_queries(q: Tensor, query_mask: Tensor, spec: AttentionSpec) -> Tensor:
    """Assign each query to a cluster: LSH codes, Hamming K-means, Euclidean refinement.

    q: (B, H, N, D); query_mask: (B, N) bool. Returns (B, H, N) int64 in [0, C], padded
    queries at index C = spec.clusters.
    """
    _, h, _, d = q.shape
    planes = hash_planes(h, d, spec.bits, spec.seed)
    offsets = initial_offsets(h, spec.seed)
    if native.usable(q):
        codes = native.hash_codes(q, planes)
        initial = codes.gather(2, initial_centroid_positions(query_mask, spec.clusters, offsets))
        assign = native.hamming_kmeans(codes, query_mask, initial, spec.iterations, spec.bits)
        if spec.refine:
            assign = native.refine_clusters(q, assign, query_mask, spec.clusters, spec.refine)
    else:
        assign = hamming_kmeans(hash_signs(q, planes), query_mask, spec.clusters, spec.iterations, offsets)
        if spec.refine:
            assign = refine_clusters(q, assign, query_mask, spec.clusters, spec.refine)
    return one_query_per_cluster(assign, query_mask, spec.clusters)


def clustered_attention_torch(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    spec: AttentionSpec,
    key_padding_mask: Tensor | None,
    scale: float,
) -> Tensor:
    """Reference clustered / improved clustered attention, by spec.method.

    q: (B, H, N, D), k: (B, H, M, D), v: (B, H, M, Dv) -> (B, H, N, Dv) in q's dtype.
    Computes in float32 (float64 for float64 inputs).
    """
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf, kf, vf = q.to(compute), k.to(compute), v.to(compute)
    key_mask, query_mask = token_masks(q, k, key_padding_mask)
    assign = cluster_queries(qf, query_mask, spec)
    centroids = cluster_means(qf, assign, spec.clusters)  # (B, H, C, D)
    if native.usable(qf):
        return _native_attention(qf, kf, vf, assign, centroids, key_mask, scale, spec).to(q.dtype)
    centroid_probs = _centroid_attention(centroids, kf, key_mask, scale)  # (B, H, C, M)
    centroid_values = centroid_probs @ vf  # (B, H, C, Dv)
    if spec.method == "clustered":
        out = _broadcast(centroid_values, assign)
    else:
        out = _improved(qf, kf, vf, assign, centroid_probs, centroid_values, key_mask, scale, spec.topk)
    return out.to(q.dtype)


def _native_attention(q, k, v, assign, centroids, key_mask, scale, spec: AttentionSpec) -> Tensor:
    """The same as the reference from the centroids on, with the (C, M) softmax and top-k and
    the per-query sparse part in native loops (no tiles, no (T, tile, k) logits)."""
    logits = (centroids @ k.transpose(-1, -2)).mul_(scale)
    topk = min(spec.topk, k.shape[2]) if spec.method == "i-clustered" else 0
    centroid_probs, top_index, top_probs, top_real = native.softmax_topk(logits, key_mask, topk)
    centroid_values = centroid_probs @ v  # (B, H, C, Dv)
    if spec.method == "clustered":
        return _broadcast(centroid_values, assign)
    top_values = _gather_rows(v, top_index)  # (B, H, C, k, Dv)
    bottom_values = centroid_values - (top_probs[..., None] * top_values).sum(-2)  # eq. (17)
    top_keys = _gather_rows(k, top_index)
    return native.improved_sparse(q, assign, top_keys, top_values, top_real, top_probs.sum(-1), bottom_values, scale)


def _centroid_attention(centroids: Tensor, k: Tensor, key_mask: Tensor, scale: float) -> Tensor:
    """A^c = softmax(Q^c K^T * scale) over real keys: (B, H, C, M); rows of 0 if no real key."""
    logits = (centroids @ k.transpose(-1, -2)) * scale
    logits = logits.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.nan_to_num(probs, nan=0.0)


def _broadcast(per_cluster: Tensor, assign: Tensor) -> Tensor:
    """Give each query its cluster's row: (B, H, C, F) -> (B, H, N, F); padded queries 0."""
    b, h, _, f = per_cluster.shape
    padded_row = torch.zeros(b, h, 1, f, dtype=per_cluster.dtype, device=per_cluster.device)
    rows = torch.cat([per_cluster, padded_row], dim=2)
    return rows.gather(2, assign[..., None].expand(-1, -1, -1, f))


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


def _improved(q, k, v, assign, centroid_probs, centroid_values, key_mask, scale, topk) -> Tensor:
    """Improved clustered attention, eq. (15): exact on each cluster's top-k, A^c elsewhere."""
    b, h, n, d = q.shape
    m, dv = k.shape[2], v.shape[-1]
    clusters = centroid_probs.shape[2]
    top_probs, top_index = centroid_probs.topk(min(topk, m), dim=-1)  # (B, H, C, k)
    top_real = key_mask[:, None, None, :].expand_as(centroid_probs).gather(-1, top_index)
    top_probs = top_probs * top_real
    top_mass = top_probs.sum(-1)  # m_j, eq. (9)
    top_values = _gather_rows(v, top_index)  # (B, H, C, k, Dv)
    # V^b_j: the centroid attention on every key outside the top-k (eq. 17).
    bottom_values = centroid_values - (top_probs[..., None] * top_values).sum(-2)
    positions, valid, tile_cluster = cluster_tiles(assign, clusters, TILE)
    c = tile_cluster.clamp(max=clusters - 1)
    queries = _gather_rows(q, positions)  # (B, H, T, tile, D)
    keys = _gather_rows(k, _select(top_index, c))  # (B, H, T, k, D)
    logits = (queries @ keys.transpose(-1, -2)) * scale  # (B, H, T, tile, k)
    logits = logits.masked_fill(~_select(top_real, c)[..., None, :], float("-inf"))
    probs = torch.nan_to_num(torch.softmax(logits, dim=-1), nan=0.0)
    tile_out = _select(top_mass, c)[..., None, None] * (probs @ _select(top_values, c))
    tile_out = tile_out + _select(bottom_values, c)[..., None, :]  # (B, H, T, tile, Dv)
    # Scatter back to query order; empty slots write to a spare row n.
    target = torch.where(valid, positions, n).reshape(b, h, -1)
    out = torch.zeros(b, h, n + 1, dv, dtype=q.dtype, device=q.device)
    out.scatter_(2, target[..., None].expand(-1, -1, -1, dv), tile_out.reshape(b, h, -1, dv))
    return out[:, :, :n]


def _gather_rows(x: Tensor, index: Tensor) -> Tensor:
    """x (B, H, M, F), index (B, H, C, k) -> (B, H, C, k, F)."""
    b, h, c, kk = index.shape
    flat = x.gather(2, index.reshape(b, h, c * kk, 1).expand(-1, -1, -1, x.shape[-1]))
    return flat.reshape(b, h, c, kk, x.shape[-1])


def _select(per_cluster: Tensor, cluster: Tensor) -> Tensor:
    """Rows of each query's cluster: per_cluster (B, H, C, ...) , cluster (B, H, n) -> (B, H, n, ...)."""
    tail = per_cluster.shape[3:]
    index = cluster.reshape(*cluster.shape, *([1] * len(tail))).expand(*cluster.shape, *tail)
    return per_cluster.gather(2, index)
