"""Query clustering for clustered attention: K-means in Hamming space, then optional Lloyd
refinement on the real query vectors; or, without LSH codes, each query to its nearest seed
query in Euclidean space, then the refinement.

Assignments are (B, H, N) int64 in [0, C]; the extra index C holds padded queries, which
never join a real cluster. Every step is deterministic: initial centroids sit at evenly
spaced ranks of the real queries with a seeded offset per head, ties go to the lowest
cluster index, and an empty cluster is re-seeded with the query farthest from its centroid
(ties to the lowest position), the next empty cluster with the next farthest, and so on.
Iterations stop early once the centroids no longer change; later ones would repeat it.
On CUDA the cluster sums (index_add_) add with float atomics in whatever order the threads
run, so a near-tie can break differently from call to call unless torch's deterministic
algorithms are on.
"""

from __future__ import annotations

import torch
from torch import Tensor

from clusterserve.kernels.reference.hashing import seeded_generator

# Queries per step of the nearest-centroid search: keeps the (chunk, C) scores in cache.
_NEAREST_CHUNK = 2048


def initial_offsets(heads: int, seed: int) -> Tensor:
    """Per-head offsets in [0, 1) that place the initial centroids: (H,) float32 on CPU."""
    return torch.rand(heads, generator=seeded_generator(seed, 1))


def initial_centroid_positions(query_mask: Tensor, clusters: int, offsets: Tensor) -> Tensor:
    """Position of the query that seeds each cluster: (B, H, C) int64.

    Cluster j starts at the real query of rank floor((j + offset_h) * n_real / C).
    """
    b, n = query_mask.shape
    order = torch.argsort((~query_mask).to(torch.int8), dim=1, stable=True)  # real queries first
    n_real = query_mask.sum(dim=1).float()
    j = torch.arange(clusters, device=query_mask.device, dtype=torch.float32)
    ranks = ((j[None, None, :] + offsets.to(query_mask.device)[None, :, None]) * n_real[:, None, None] / clusters)
    ranks = ranks.long().clamp(max=n - 1)
    return order[:, None, :].expand(b, offsets.shape[0], n).gather(2, ranks)


def hamming_kmeans(signs: Tensor, query_mask: Tensor, clusters: int, iterations: int, offsets: Tensor) -> Tensor:
    """Cluster LSH codes, given as +-1 signs (B, H, N, bits), by Lloyd iterations in Hamming space.

    The centroid of a cluster is the majority vote of its members' bits (ties to 0).
    query_mask: (B, N) bool, True = real query. offsets: (H,) from `initial_offsets`.
    Returns assignments (B, H, N) int64, padded queries at index `clusters`.
    """
    bits = signs.shape[-1]
    padded = ~query_mask[:, None, :]
    first = initial_centroid_positions(query_mask, clusters, offsets)
    centroids = signs.gather(2, first[..., None].expand(-1, -1, -1, bits))  # (B, H, C, bits)
    for _ in range(iterations):
        assign = _nearest(signs, centroids, None, padded)
        members = _count_members(assign, clusters)
        ones = _cluster_sums((signs + 1) / 2, assign, clusters)
        majority = torch.where(2 * ones > members[..., None], 1.0, -1.0)
        distance = lambda: (bits - (signs * _rows(centroids, assign)).sum(-1)) / 2  # noqa: E731
        updated = _reseed_empty(majority, members, distance, padded, signs)
        if torch.equal(updated, centroids):
            break
        centroids = updated
    return _nearest(signs, centroids, None, padded)


def seeded_clusters(q: Tensor, query_mask: Tensor, clusters: int, offsets: Tensor) -> Tensor:
    """Each query to its nearest seed query in Euclidean space, the seeds at the ranks the Hamming
    K-means starts from (`initial_centroid_positions`): argmax_c 2 q.s_c - |s_c|^2, ties to the
    lowest cluster, in float32 (float64 for float64 q): half-precision q is upcast a chunk at a
    time. q: (B, H, N, D). Returns (B, H, N), padded queries at C."""
    positions = initial_centroid_positions(query_mask, clusters, offsets)
    seeds = q.gather(2, positions[..., None].expand(-1, -1, -1, q.shape[-1]))  # (B, H, C, D)
    seeds = seeds.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
    # 2 q.s as q.(2 s): doubling is exact, so no copy of q is doubled.
    return _nearest(q, 2 * seeds, -(seeds * seeds).sum(-1), ~query_mask[:, None, :])


def refine_clusters(q: Tensor, assign: Tensor, query_mask: Tensor, clusters: int, iterations: int) -> Tensor:
    """Lloyd iterations with Euclidean distance on the query vectors, from `assign`.

    q: (B, H, N, D) in the compute dtype. Returns the refined assignments (B, H, N).
    """
    padded = ~query_mask[:, None, :]
    for _ in range(iterations):
        members = _count_members(assign, clusters)
        centroids = _cluster_sums(q, assign, clusters) / members.clamp(min=1)[..., None].to(q.dtype)
        distance = lambda: ((q - _rows(centroids, assign)) ** 2).sum(-1)  # noqa: E731
        centroids = _reseed_empty(centroids, members, distance, padded, q)
        # argmin |q - c|^2 = argmax 2 q.c - |c|^2
        updated = _nearest(2 * q, centroids, -(centroids * centroids).sum(-1), padded)
        if torch.equal(updated, assign):
            break
        assign = updated
    return assign


def one_query_per_cluster(assign: Tensor, query_mask: Tensor, clusters: int) -> Tensor:
    """Where a sequence has no more real queries than clusters, give each query its own
    cluster (its rank among the real queries): exact attention, whatever the hashes say."""
    ranks = torch.cumsum(query_mask.long(), dim=1) - 1  # (B, N)
    ranks = ranks.masked_fill(~query_mask, clusters)
    fits = (query_mask.sum(dim=1) <= clusters)[:, None, None]
    return torch.where(fits, ranks[:, None, :].expand_as(assign), assign)


def cluster_means(x: Tensor, assign: Tensor, clusters: int) -> Tensor:
    """Mean of the member vectors of each cluster: x (B, H, N, D) -> (B, H, C, D); 0 if empty."""
    members = _count_members(assign, clusters)
    return _cluster_sums(x, assign, clusters) / members.clamp(min=1)[..., None].to(x.dtype)


def _nearest(points: Tensor, centroids: Tensor, bias: Tensor | None, padded: Tensor) -> Tensor:
    """argmax_c points . centroid_c (+ bias_c), in query chunks (each in the centroids' dtype);
    padded queries -> C.

    points: (B, H, N, F), centroids: (B, H, C, F), bias: (B, H, C) or None -> (B, H, N).
    """
    b, h, n, _ = points.shape
    clusters = centroids.shape[2]
    transposed = centroids.transpose(-1, -2).contiguous()
    assign = torch.empty(b, h, n, dtype=torch.int64, device=points.device)
    for start in range(0, n, _NEAREST_CHUNK):
        scores = points[:, :, start : start + _NEAREST_CHUNK].to(transposed.dtype) @ transposed  # (B, H, chunk, C)
        if bias is not None:
            scores += bias[:, :, None, :]
        assign[:, :, start : start + _NEAREST_CHUNK] = scores.argmax(dim=-1)
    return assign.masked_fill_(padded, clusters)


def _count_members(assign: Tensor, clusters: int) -> Tensor:
    """Members per cluster (B, H, C) float32, padded queries (index C) dropped."""
    b, h, _ = assign.shape
    counts = torch.zeros(b, h, clusters + 1, device=assign.device)
    counts.scatter_add_(2, assign, torch.ones_like(assign, dtype=counts.dtype))
    return counts[:, :, :clusters]


def _cluster_sums(x: Tensor, assign: Tensor, clusters: int) -> Tensor:
    """Sum of the member rows of each cluster: x (B, H, N, F) -> (B, H, C, F)."""
    b, h, n, f = x.shape
    base = torch.arange(b * h, device=x.device).reshape(b, h, 1) * (clusters + 1)
    sums = torch.zeros(b * h * (clusters + 1), f, dtype=x.dtype, device=x.device)
    sums.index_add_(0, (assign + base).reshape(-1), x.reshape(-1, f))
    return sums.reshape(b, h, clusters + 1, f)[:, :, :clusters]


def _rows(per_cluster: Tensor, assign: Tensor) -> Tensor:
    """Each query's cluster row: (B, H, C, F) -> (B, H, N, F); padded queries get row C - 1."""
    index = assign.clamp(max=per_cluster.shape[2] - 1)
    return per_cluster.gather(2, index[..., None].expand(-1, -1, -1, per_cluster.shape[-1]))


def _reseed_empty(centroids: Tensor, members: Tensor, distance, padded: Tensor, points: Tensor) -> Tensor:
    """Replace the e-th empty cluster's centroid by the e-th farthest real query.

    centroids: (B, H, C, F); members: (B, H, C); distance: a callable giving (B, H, N), each
    query's distance to its centroid (only evaluated when a cluster is empty);
    points: (B, H, N, F), the per-query vectors centroids are made of.
    """
    empty = members == 0
    most_empty = int(empty.sum(-1).max())
    if most_empty == 0:
        return centroids
    # Farthest first; a stable sort puts the lower position first among equals.
    distance = distance().masked_fill(padded, float("-inf"))
    farthest = torch.sort(distance, dim=-1, descending=True, stable=True).indices[..., :most_empty]
    empty_rank = (torch.cumsum(empty.long(), dim=-1) - 1).clamp(min=0, max=farthest.shape[-1] - 1)
    donor = farthest.gather(2, empty_rank)  # (B, H, C)
    donor_vectors = points.gather(2, donor[..., None].expand(-1, -1, -1, points.shape[-1]))
    return torch.where(empty[..., None], donor_vectors, centroids)
