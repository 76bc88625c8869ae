"""Triton kernels for query clustering: Hamming K-means on LSH codes, Euclidean refinement
and cluster means. They match `kmeans.py` step for step (same initial centroids, ties to the
lowest cluster index, majority vote with ties to 0, empty clusters re-seeded by the farthest
queries, lower position first among equals).

No host synchronisation: the reference stops once the centroids no longer change, which
needs the host to look; here every iteration runs on the device. The result is the same,
because an iteration from a fixed point returns the same point. Between the kernels a few
torch ops (cumsum, top-k, gathers) update the centroids; none of them waits on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .blocks import pow2_block
from .kmeans import initial_centroid_positions

# Hamming distance of a masked-out centroid column: above any real one (<= 63).
_FAR = 1 << 20


@triton.jit
def _popcount(x):
    """Set bits of each int64 by the SWAR bit trick; x must be >= 0 (codes use <= 63 bits)."""
    x = x - ((x >> 1) & 0x5555555555555555)
    x = (x & 0x3333333333333333) + ((x >> 2) & 0x3333333333333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0F
    x = x + (x >> 8)
    x = x + (x >> 16)
    x = x + (x >> 32)
    return x & 0x7F


@triton.jit
def _hamming_assign_kernel(
    codes_ptr, centroids_ptr, query_mask_ptr, assign_ptr, distance_ptr, members_ptr, ones_ptr,
    H, N, C, BITS,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_BITS: tl.constexpr, FAR: tl.constexpr,
    VOTE: tl.constexpr,
):
    """Nearest centroid code by XOR + popcount (ties to the lowest cluster); padded queries -> C.

    With VOTE, also counts each cluster's members and, per bit, its members with that bit set,
    by relaxed integer atomics: the counts do not depend on the order of the adds and nothing
    reads them before the launch ends, so no memory ordering is needed.
    """
    bh = tl.program_id(1).to(tl.int64)
    batch = bh // H
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_range = rows < N
    codes = tl.load(codes_ptr + bh * N + rows, mask=in_range, other=0)
    best = tl.full([BLOCK_N], FAR, tl.int64)
    best_cluster = tl.zeros([BLOCK_N], tl.int64)
    for start in range(0, C, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        centroids = tl.load(centroids_ptr + bh * C + cols, mask=cols < C, other=0)
        distance = _popcount(codes[:, None] ^ centroids[None, :])
        distance = tl.where(cols[None, :] < C, distance, FAR)
        block_best = tl.min(distance, axis=1)
        block_cluster = (start + tl.argmin(distance, axis=1)).to(tl.int64)
        # Strictly closer only: an earlier block keeps its ties.
        closer = block_best < best
        best = tl.where(closer, block_best, best)
        best_cluster = tl.where(closer, block_cluster, best_cluster)
    real = in_range & (tl.load(query_mask_ptr + batch * N + rows, mask=in_range, other=0) != 0)
    tl.store(assign_ptr + bh * N + rows, tl.where(real, best_cluster, C), mask=in_range)
    tl.store(distance_ptr + bh * N + rows, best.to(tl.float32), mask=in_range)
    if VOTE:
        ones = tl.full([BLOCK_N], 1, tl.int32)
        tl.atomic_add(members_ptr + bh * C + best_cluster, ones, mask=real, sem="relaxed")
        bit = tl.arange(0, BLOCK_BITS).to(tl.int64)
        is_set = ((codes[:, None] >> bit[None, :]) & 1) == 1
        vote_ptrs = ones_ptr + (bh * C + best_cluster)[:, None] * BITS + bit[None, :]
        tl.atomic_add(vote_ptrs, is_set.to(tl.int32), mask=real[:, None] & is_set & (bit[None, :] < BITS), sem="relaxed")


@triton.jit
def _euclidean_assign_kernel(
    x_ptr, centroids_ptr, bias_ptr, query_mask_ptr, assign_ptr,
    stride_xb, stride_xh, stride_xn, stride_xd,
    H, N, C, D,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """argmax_c 2 x . centroid_c + bias_c (bias = -|centroid|^2), ties to the lowest cluster."""
    bh = tl.program_id(1).to(tl.int64)
    batch, head = bh // H, bh % H
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    in_range = rows < N
    x = tl.load(
        x_ptr + batch * stride_xb + head * stride_xh + rows[:, None] * stride_xn + dims[None, :] * stride_xd,
        mask=in_range[:, None] & (dims[None, :] < D), other=0.0,
    ).to(tl.float32)
    best = tl.full([BLOCK_N], float("-inf"), tl.float32)
    best_cluster = tl.zeros([BLOCK_N], tl.int64)
    for start in range(0, C, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        centroids = tl.load(
            centroids_ptr + (bh * C + cols)[:, None] * D + dims[None, :],
            mask=(cols[:, None] < C) & (dims[None, :] < D), other=0.0,
        )
        bias = tl.load(bias_ptr + bh * C + cols, mask=cols < C, other=0.0)
        scores = 2 * tl.dot(x, tl.trans(centroids), input_precision="ieee") + bias[None, :]
        scores = tl.where(cols[None, :] < C, scores, float("-inf"))
        block_best = tl.max(scores, axis=1)
        block_cluster = (start + tl.argmax(scores, axis=1)).to(tl.int64)
        closer = block_best > best
        best = tl.where(closer, block_best, best)
        best_cluster = tl.where(closer, block_cluster, best_cluster)
    real = in_range & (tl.load(query_mask_ptr + batch * N + rows, mask=in_range, other=0) != 0)
    tl.store(assign_ptr + bh * N + rows, tl.where(real, best_cluster, C), mask=in_range)


@triton.jit
def _member_rows(x_head, order_ptr, bh, N, start, size, offset, stride_xn, stride_xd, dims, in_dims,
                 BLOCK_N: tl.constexpr):
    """Positions and float32 rows of the cluster members in slots [offset, offset + BLOCK_N)."""
    slot = offset + tl.arange(0, BLOCK_N)
    member = slot < size
    position = tl.load(order_ptr + bh * N + start + slot, mask=member, other=0)
    rows = tl.load(x_head + position[:, None] * stride_xn + dims[None, :] * stride_xd,
                   mask=member[:, None] & in_dims[None, :], other=0.0).to(tl.float32)
    return member, position, rows


@triton.jit
def _cluster_means_kernel(
    x_ptr, order_ptr, starts_ptr, sizes_ptr, means_ptr, distance_ptr,
    stride_xb, stride_xh, stride_xn, stride_xd,
    H, N, C, D,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, WITH_DISTANCE: tl.constexpr,
):
    """Mean of one cluster's member rows (0 if empty), summed in the cluster-sorted order so
    the result does not depend on scheduling; optionally each member's squared distance to it."""
    cluster = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    batch, head = bh // H, bh % H
    dims = tl.arange(0, HEAD_DIM)
    in_dims = dims < D
    start = tl.load(starts_ptr + bh * C + cluster)
    size = tl.load(sizes_ptr + bh * C + cluster)
    x_head = x_ptr + batch * stride_xb + head * stride_xh
    total = tl.zeros([HEAD_DIM], tl.float32)
    for offset in range(0, size, BLOCK_N):
        _, _, rows = _member_rows(x_head, order_ptr, bh, N, start, size, offset, stride_xn, stride_xd,
                                  dims, in_dims, BLOCK_N)
        total += tl.sum(rows, axis=0)
    mean = total / tl.maximum(size, 1).to(tl.float32)
    tl.store(means_ptr + (bh * C + cluster) * D + dims, mean, mask=in_dims)
    if WITH_DISTANCE:
        for offset in range(0, size, BLOCK_N):
            member, position, rows = _member_rows(x_head, order_ptr, bh, N, start, size, offset, stride_xn, stride_xd,
                                                  dims, in_dims, BLOCK_N)
            gap = tl.where(in_dims[None, :], rows - mean[None, :], 0.0)
            tl.store(distance_ptr + bh * N + position, tl.sum(gap * gap, axis=1), mask=member)


def hamming_kmeans_triton(
    codes: Tensor, query_mask: Tensor, clusters: int, iterations: int, offsets: Tensor, bits: int
) -> Tensor:
    """`kmeans.hamming_kmeans` on packed codes (B, H, N) int64 of `bits` bits.

    query_mask: (B, N) bool, True = real query; offsets: (H,) on the codes' device.
    Returns assignments (B, H, N) int64 in [0, C], padded queries at C.
    """
    b, h, n = codes.shape
    device = codes.device
    centroids = codes.gather(2, initial_centroid_positions(query_mask, clusters, offsets))  # (B, H, C)
    assign = torch.empty(b, h, n, dtype=torch.int64, device=device)
    distance = torch.empty(b, h, n, dtype=torch.float32, device=device)
    members = torch.empty(b, h, clusters, dtype=torch.int32, device=device)
    ones = torch.empty(b, h, clusters, bits, dtype=torch.int32, device=device)
    weights = torch.ones((), dtype=torch.int64, device=device) << torch.arange(bits, device=device)
    block_n = 64
    grid = (triton.cdiv(n, block_n), b * h)
    mask = query_mask.contiguous()

    def assign_step(vote: bool) -> None:
        _hamming_assign_kernel[grid](
            codes, centroids, mask, assign, distance, members, ones,
            h, n, clusters, bits,
            BLOCK_N=block_n, BLOCK_C=32, BLOCK_BITS=64, FAR=_FAR, VOTE=vote,
        )

    for _ in range(iterations):
        members.zero_()
        ones.zero_()
        assign_step(vote=True)
        majority = ((2 * ones > members[..., None]).long() * weights).sum(-1)
        centroids = reseed_empty(majority, members, distance, query_mask, codes)
    assign_step(vote=False)
    return assign


def refine_clusters_triton(q: Tensor, assign: Tensor, query_mask: Tensor, clusters: int, iterations: int) -> Tensor:
    """`kmeans.refine_clusters`: Lloyd iterations with Euclidean distance, from `assign`.

    q: (B, H, N, D) any float dtype (computed in float32). Returns (B, H, N) int64.
    """
    b, h, n, d = q.shape
    block_n = 64
    grid = (triton.cdiv(n, block_n), b * h)
    mask = query_mask.contiguous()
    for _ in range(iterations):
        centroids, members, distance = cluster_means_triton(q, assign, clusters, with_distance=True)
        centroids = reseed_empty(centroids, members, distance, query_mask, q)
        bias = -(centroids * centroids).sum(-1)
        assign = torch.empty(b, h, n, dtype=torch.int64, device=q.device)
        _euclidean_assign_kernel[grid](
            q, centroids, bias, mask, assign,
            *q.stride(),
            h, n, clusters, d,
            BLOCK_N=block_n, BLOCK_C=32, HEAD_DIM=pow2_block(d),
        )
    return assign


def cluster_means_triton(
    x: Tensor, assign: Tensor, clusters: int, with_distance: bool = False
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Cluster means of x (B, H, N, D) under assign (B, H, N) in [0, C].

    Returns means (B, H, C, D) float32 (0 for an empty cluster), members (B, H, C) int64 and,
    with_distance, each query's squared distance to its cluster's mean (B, H, N) float32
    (unset for padded queries).
    """
    b, h, n, d = x.shape
    sizes = torch.zeros(b, h, clusters + 1, dtype=torch.int64, device=x.device)
    sizes = sizes.scatter_add_(2, assign, torch.ones_like(assign))[..., :clusters].contiguous()
    starts = torch.cumsum(sizes, dim=-1) - sizes
    order = torch.argsort(assign, dim=-1, stable=True)  # members of each cluster in position order
    means = torch.empty(b, h, clusters, d, dtype=torch.float32, device=x.device)
    distance = torch.empty(b, h, n, dtype=torch.float32, device=x.device) if with_distance else means
    _cluster_means_kernel[(clusters, b * h)](
        x, order, starts, sizes, means, distance,
        *x.stride(),
        h, n, clusters, d,
        BLOCK_N=32, HEAD_DIM=pow2_block(d), WITH_DISTANCE=with_distance,
    )
    return means, sizes, (distance if with_distance else None)


def reseed_empty(centroids: Tensor, members: Tensor, distance: Tensor, query_mask: Tensor, points: Tensor) -> Tensor:
    """`kmeans._reseed_empty` with static shapes: the e-th empty cluster takes the e-th
    farthest real query (lower position first among equal distances).

    centroids: (B, H, C, ...) ; members: (B, H, C); distance: (B, H, N) float32 >= 0;
    query_mask: (B, N); points: (B, H, N, ...), the per-query values centroids are made of.
    """
    b, h, n = distance.shape
    clusters = members.shape[-1]
    position = torch.arange(n, device=distance.device)
    # One distinct int64 per query whose descending order is the reference's stable sort:
    # a float >= 0 orders like its bits, and the lower position breaks ties. Padded queries
    # come last, in position order, as the reference's -inf does.
    key = (distance.view(torch.int32).long() << 32) | (n - 1 - position)
    key = torch.where(query_mask[:, None, :], key, -1 - position)
    farthest = key.topk(min(clusters, n), dim=-1).indices  # (B, H, min(C, N))
    empty = members == 0
    empty_rank = (torch.cumsum(empty.long(), dim=-1) - 1).clamp(min=0, max=farthest.shape[-1] - 1)
    donor = farthest.gather(2, empty_rank)  # (B, H, C)
    tail = points.shape[3:]
    donor_index = donor.reshape(b, h, clusters, *([1] * len(tail))).expand(b, h, clusters, *tail)
    donor_points = points.gather(2, donor_index).to(centroids.dtype)
    return torch.where(empty.reshape(b, h, clusters, *([1] * len(tail))), donor_points, centroids)
