"""Triton kernels for query clustering: Hamming K-means on LSH codes, Euclidean refinement
and cluster means, each one launch with one program per (batch, head) that runs every
iteration on chip.

Why one program per head: a Lloyd step needs all of a head's assignments before any centroid
moves, and a launch per step (plus the torch glue between) makes a call launch-bound; a
program owning its head needs no grid-wide barrier, no atomics and no host. A head's codes
(8 bytes a query) and queries stay in L2 between the passes. The distances and the votes are
tensor-core dots: Hamming similarity is the dot product of +-1 sign vectors (bits - 2 x the
distance, exact in float32), and the per-cluster bit votes, member counts and coordinate sums
are one-hot(cluster) @ rows, summed in a fixed order, so every result is deterministic.

They follow `kmeans.py`: the same initial centroids, ties to the lowest cluster index,
majority vote with ties to 0, the e-th empty cluster re-seeded with the e-th farthest query
(lower position first), padded queries at index C, and a sequence with no more real queries
than clusters gives each query its own cluster. The reference stops once nothing changes;
here a head skips its remaining iterations once its centroids (Hamming) or assignments
(refinement) repeat, which gives the same result.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .blocks import pow2_block
from .split_dot import dot_split_right, mma

# Queries and clusters per tile of the passes, and the bit tile of the codes (<= 63 bits).
BLOCK_N = 64
BLOCK_C = 64
BLOCK_BITS = 64
# A program owns a whole head, so it takes a whole SM's worth of warps.
NUM_WARPS = 8


# Key of a query no cluster can take as a donor (below every real or padded query's key).
_NO_KEY = -(1 << 62)


@triton.jit
def _real_count(mask_row, N, BLOCK: tl.constexpr):
    """Real queries of one sequence: the True entries of its mask row (B, N)."""
    count = tl.zeros([BLOCK], tl.int32)
    for start in range(0, N, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        count += (tl.load(mask_row + rows, mask=rows < N, other=0) != 0).to(tl.int32)
    return tl.sum(count, axis=0)


@triton.jit
def _signs(codes, BITS, BLOCK_BITS: tl.constexpr):
    """int64 codes (rows,) -> (rows, BLOCK_BITS) float16 +-1 per bit, 0 past BITS."""
    bit = tl.arange(0, BLOCK_BITS).to(tl.int64)
    is_set = ((codes[:, None] >> bit[None, :]) & 1) == 1
    return tl.where(bit[None, :] < BITS, tl.where(is_set, 1.0, -1.0), 0.0).to(tl.float16)


@triton.jit
def _bits(codes, BITS, BLOCK_BITS: tl.constexpr):
    """int64 codes (rows,) -> (rows, BLOCK_BITS) float16 0/1 per bit, 0 past BITS."""
    bit = tl.arange(0, BLOCK_BITS).to(tl.int64)
    is_set = (((codes[:, None] >> bit[None, :]) & 1) == 1) & (bit[None, :] < BITS)
    return is_set.to(tl.float16)


@triton.jit
def _empty_cluster(members_row, C, e, BLOCK_C: tl.constexpr):
    """Index of the e-th empty cluster (0-based, in cluster order)."""
    found = tl.zeros([BLOCK_C], tl.int64)
    seen = 0
    for start in range(0, C, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        empty = (tl.load(members_row + cols, mask=cols < C, other=1) == 0).to(tl.int32)
        rank = seen + tl.cumsum(empty, axis=0) - 1
        found += tl.where((empty != 0) & (rank == e), cols, 0).to(tl.int64)
        seen += tl.sum(empty, axis=0)
    return tl.sum(found, axis=0)


@triton.jit
def _farthest_below(distance_row, mask_row, N, below, BLOCK_N: tl.constexpr, NO_KEY: tl.constexpr):
    """The largest donor key under `below`. A real query's key is (distance bits << 32) |
    (N - 1 - position): farther first, then the lower position (distances are >= 0, so their
    float bits order like them); a padded query's is -1 - position, after every real one."""
    best = tl.full([BLOCK_N], NO_KEY, tl.int64)
    for start in range(0, N, BLOCK_N):
        rows = start + tl.arange(0, BLOCK_N)
        in_range = rows < N
        distance = tl.load(distance_row + rows, mask=in_range, other=0.0)
        real = tl.load(mask_row + rows, mask=in_range, other=0) != 0
        key = (distance.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (N - 1 - rows).to(tl.int64)
        key = tl.where(real, key, -1 - rows.to(tl.int64))
        best = tl.maximum(best, tl.where(in_range & (key < below), key, NO_KEY))
    return tl.max(best, axis=0)


@triton.jit
def _donor_position(key, N):
    return tl.where(key >= 0, N - 1 - (key & 0xFFFFFFFF), -1 - key)


@triton.jit
def _write_ranks(mask_row, assign_row, N, C, BLOCK_N: tl.constexpr):
    """Each real query its rank among the real ones, padded queries C (the exact case)."""
    seen = 0
    for start in range(0, N, BLOCK_N):
        rows = start + tl.arange(0, BLOCK_N)
        real = (tl.load(mask_row + rows, mask=rows < N, other=0) != 0).to(tl.int32)
        rank = seen + tl.cumsum(real, axis=0) - 1
        tl.store(assign_row + rows, tl.where(real != 0, rank.to(tl.int64), C), mask=rows < N)
        seen += tl.sum(real, axis=0)


@triton.jit
def _initial_codes(codes_row, mask_row, out_row, offset, n_real, N, C,
                   BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """Cluster j starts at the query of rank floor((j + offset) n_real / C) among the real
    queries, then the padded ones (kmeans.initial_centroid_positions)."""
    for c_start in range(0, C, BLOCK_C):
        cols = c_start + tl.arange(0, BLOCK_C)
        # IEEE division, as torch's: an approximate one could move a centroid by a rank.
        target = tl.math.div_rn((cols.to(tl.float32) + offset) * n_real.to(tl.float32), C.to(tl.float32))
        target = tl.minimum(target.to(tl.int64), N - 1)
        code = tl.zeros([BLOCK_C], tl.int64)
        real_seen = 0
        padded_seen = 0
        for start in range(0, N, BLOCK_N):
            rows = start + tl.arange(0, BLOCK_N)
            in_range = rows < N
            real = (tl.load(mask_row + rows, mask=in_range, other=0) != 0) & in_range
            padded = (~real) & in_range
            rank = tl.where(real, real_seen + tl.cumsum(real.to(tl.int32), axis=0) - 1,
                            n_real + padded_seen + tl.cumsum(padded.to(tl.int32), axis=0) - 1)
            codes = tl.load(codes_row + rows, mask=in_range, other=0)
            match = in_range[None, :] & (rank.to(tl.int64)[None, :] == target[:, None])
            code += tl.sum(tl.where(match, codes[None, :], 0), axis=1)
            real_seen += tl.sum(real.to(tl.int32), axis=0)
            padded_seen += tl.sum(padded.to(tl.int32), axis=0)
        tl.store(out_row + cols, code, mask=cols < C)


@triton.jit
def _nearest_code(codes, centroids_row, C, BITS,
                  BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_BITS: tl.constexpr, UPCAST: tl.constexpr):
    """Nearest centroid code of each code (ties to the lowest cluster) and its Hamming distance."""
    query_signs = _signs(codes, BITS, BLOCK_BITS)
    best = tl.full([BLOCK_N], -1.0e9, tl.float32)
    best_cluster = tl.zeros([BLOCK_N], tl.int64)
    for start in range(0, C, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        centroid_signs = _signs(tl.load(centroids_row + cols, mask=cols < C, other=0), BITS, BLOCK_BITS)
        # +-1 . +-1 = BITS - 2 x Hamming distance, exact in float32.
        similarity = mma(query_signs, tl.trans(centroid_signs), UPCAST)
        similarity = tl.where(cols[None, :] < C, similarity, -1.0e9)
        block_best = tl.max(similarity, axis=1)
        block_cluster = (start + tl.argmax(similarity, axis=1)).to(tl.int64)
        closer = block_best > best  # strictly: an earlier block keeps its ties
        best = tl.where(closer, block_best, best)
        best_cluster = tl.where(closer, block_cluster, best_cluster)
    return best_cluster, (BITS - best) * 0.5


@triton.jit
def _hamming_kmeans_kernel(
    codes_ptr, query_mask_ptr, offsets_ptr, centroids_ptr, members_ptr, distance_ptr, assign_ptr,
    H, N, C, BITS, ITERATIONS, EXACT_CASE,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_BITS: tl.constexpr, NO_KEY: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """All Lloyd iterations of one (batch, head) in Hamming space, then the final assignment.

    centroids: (2, B * H, C) int64 scratch, the current centroids in buffer it % 2;
    members: (B * H, C) int64 scratch; distance: (B, H, N) float32 scratch.
    """
    bh = tl.program_id(0).to(tl.int64)
    n_heads = tl.num_programs(0).to(tl.int64)
    batch, head = bh // H, bh % H
    mask_row = query_mask_ptr + batch * N
    codes_row = codes_ptr + bh * N
    assign_row = assign_ptr + bh * N
    distance_row = distance_ptr + bh * N
    members_row = members_ptr + bh * C
    n_real = _real_count(mask_row, N, 1024)
    _initial_codes(codes_row, mask_row, centroids_ptr + bh * C, tl.load(offsets_ptr + head), n_real, N, C,
                   BLOCK_N, BLOCK_C)
    tl.debug_barrier()
    changed = 1
    for it in range(ITERATIONS):
        if changed != 0:
            current = centroids_ptr + ((it % 2) * n_heads + bh) * C
            updated = centroids_ptr + (((it + 1) % 2) * n_heads + bh) * C
            for start in range(0, N, BLOCK_N):
                rows = start + tl.arange(0, BLOCK_N)
                codes = tl.load(codes_row + rows, mask=rows < N, other=0)
                cluster, distance = _nearest_code(codes, current, C, BITS, BLOCK_N, BLOCK_C, BLOCK_BITS, UPCAST)
                real = tl.load(mask_row + rows, mask=rows < N, other=0) != 0
                tl.store(assign_row + rows, tl.where(real, cluster, C), mask=rows < N)
                tl.store(distance_row + rows, distance, mask=rows < N)
            tl.debug_barrier()
            # Majority vote: per cluster and bit, one-hot(cluster) @ bits counts the members with it set.
            empties = 0
            bit = tl.arange(0, BLOCK_BITS).to(tl.int64)
            for c_start in range(0, C, BLOCK_C):
                cols = c_start + tl.arange(0, BLOCK_C)
                votes = tl.zeros([BLOCK_C, BLOCK_BITS], tl.float32)
                members = tl.zeros([BLOCK_C], tl.int32)
                for start in range(0, N, BLOCK_N):
                    rows = start + tl.arange(0, BLOCK_N)
                    assigned = tl.load(assign_row + rows, mask=rows < N, other=C)
                    one_hot = assigned[None, :] == cols[:, None]
                    codes = tl.load(codes_row + rows, mask=rows < N, other=0)
                    votes += mma(one_hot.to(tl.float16), _bits(codes, BITS, BLOCK_BITS), UPCAST)
                    members += tl.sum(one_hot.to(tl.int32), axis=1)
                majority = (2 * votes > members[:, None].to(tl.float32)) & (bit[None, :] < BITS)
                code = tl.sum(majority.to(tl.int64) << bit[None, :], axis=1)
                tl.store(updated + cols, code, mask=cols < C)
                tl.store(members_row + cols, members.to(tl.int64), mask=cols < C)
                empties += tl.sum(((members == 0) & (cols < C)).to(tl.int32), axis=0)
            tl.debug_barrier()
            below = tl.full([], 1 << 62, tl.int64)
            position = tl.zeros([], tl.int64)
            for e in range(empties):
                key = _farthest_below(distance_row, mask_row, N, below, BLOCK_N, NO_KEY)
                # More empty clusters than queries: the rest take the last donor, as the reference.
                position = tl.where(key != NO_KEY, _donor_position(key, N), position)
                below = tl.where(key != NO_KEY, key, below)
                tl.store(updated + _empty_cluster(members_row, C, e, BLOCK_C), tl.load(codes_row + position))
            tl.debug_barrier()
            differ = 0
            for c_start in range(0, C, BLOCK_C):
                cols = c_start + tl.arange(0, BLOCK_C)
                old = tl.load(current + cols, mask=cols < C, other=0)
                new = tl.load(updated + cols, mask=cols < C, other=0)
                differ += tl.sum((old != new).to(tl.int32), axis=0)
            changed = differ
    final = centroids_ptr + ((ITERATIONS % 2) * n_heads + bh) * C  # both buffers agree once converged
    for start in range(0, N, BLOCK_N):
        rows = start + tl.arange(0, BLOCK_N)
        codes = tl.load(codes_row + rows, mask=rows < N, other=0)
        cluster, _ = _nearest_code(codes, final, C, BITS, BLOCK_N, BLOCK_C, BLOCK_BITS, UPCAST)
        real = tl.load(mask_row + rows, mask=rows < N, other=0) != 0
        tl.store(assign_row + rows, tl.where(real, cluster, C), mask=rows < N)
    if (EXACT_CASE != 0) & (n_real <= C):
        tl.debug_barrier()
        _write_ranks(mask_row, assign_row, N, C, BLOCK_N)


@triton.jit
def _rows(x_head, rows, N, D, stride_xn, stride_xd, HEAD_DIM: tl.constexpr):
    """Rows of one head's (N, D) matrix in its dtype, zero padded."""
    dims = tl.arange(0, HEAD_DIM)
    return tl.load(x_head + rows[:, None] * stride_xn + dims[None, :] * stride_xd,
                   mask=(rows[:, None] < N) & (dims[None, :] < D), other=0.0)


@triton.jit
def _means(x_head, assign_row, means_row, members_row, N, C, D, stride_xn, stride_xd,
           BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr):
    """Member means (C, D) float32 (0 if empty) and counts (C,) of one head; returns the
    number of empty clusters. Sums are one-hot(cluster) @ rows, in position order."""
    dims = tl.arange(0, HEAD_DIM)
    empties = 0
    for c_start in range(0, C, BLOCK_C):
        cols = c_start + tl.arange(0, BLOCK_C)
        sums = tl.zeros([BLOCK_C, HEAD_DIM], tl.float32)
        members = tl.zeros([BLOCK_C], tl.int32)
        for start in range(0, N, BLOCK_N):
            rows = start + tl.arange(0, BLOCK_N)
            assigned = tl.load(assign_row + rows, mask=rows < N, other=C)
            one_hot = assigned[None, :] == cols[:, None]
            x = _rows(x_head, rows, N, D, stride_xn, stride_xd, HEAD_DIM)
            # Via float32: the interpreter casts bool to bfloat16 bit patterns.
            sums += mma(one_hot.to(tl.float32).to(x.dtype), x, UPCAST)
            members += tl.sum(one_hot.to(tl.int32), axis=1)
        means = tl.math.div_rn(sums, tl.maximum(members, 1).to(tl.float32)[:, None])
        tl.store(means_row + cols[:, None] * D + dims[None, :], means, mask=(cols[:, None] < C) & (dims[None, :] < D))
        tl.store(members_row + cols, members.to(tl.int64), mask=cols < C)
        empties += tl.sum(((members == 0) & (cols < C)).to(tl.int32), axis=0)
    return empties


@triton.jit
def _lloyd_kernel(
    x_ptr, query_mask_ptr, assign_in_ptr, assign_ptr, means_ptr, members_ptr, distance_ptr,
    stride_xb, stride_xh, stride_xn, stride_xd,
    H, N, C, D, ITERATIONS, EXACT_CASE,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, HEAD_DIM: tl.constexpr, NO_KEY: tl.constexpr,
    UPCAST: tl.constexpr, WITH_MEANS: tl.constexpr,
):
    """Euclidean Lloyd iterations of one (batch, head) from assign_in, written to assign; with
    WITH_MEANS, the means and member counts of the final assignment are left in means / members.

    Each iteration: member means, empty clusters re-seeded, then argmax_c 2 x.c - |c|^2 (ties to
    the lowest cluster), x in its own dtype against the float32 means (split_dot).
    means: (B, H, C, D) float32; members: (B, H, C) int64; distance: (B, H, N) float32 scratch.
    """
    bh = tl.program_id(0).to(tl.int64)
    batch, head = bh // H, bh % H
    x_head = x_ptr + batch * stride_xb + head * stride_xh
    mask_row = query_mask_ptr + batch * N
    assign_row = assign_ptr + bh * N
    means_row = means_ptr + bh * C * D
    members_row = members_ptr + bh * C
    distance_row = distance_ptr + bh * N
    dims = tl.arange(0, HEAD_DIM)
    for start in range(0, N, BLOCK_N):
        rows = start + tl.arange(0, BLOCK_N)
        tl.store(assign_row + rows, tl.load(assign_in_ptr + bh * N + rows, mask=rows < N), mask=rows < N)
    tl.debug_barrier()
    changed = 1
    for _ in range(ITERATIONS):
        if changed != 0:
            empties = _means(x_head, assign_row, means_row, members_row, N, C, D, stride_xn, stride_xd,
                             BLOCK_N, BLOCK_C, HEAD_DIM, UPCAST)
            tl.debug_barrier()
            if empties > 0:
                for start in range(0, N, BLOCK_N):
                    rows = start + tl.arange(0, BLOCK_N)
                    assigned = tl.load(assign_row + rows, mask=rows < N, other=C)
                    own = tl.load(means_row + assigned[:, None] * D + dims[None, :],
                                  mask=(assigned[:, None] < C) & (dims[None, :] < D), other=0.0)
                    gap = _rows(x_head, rows, N, D, stride_xn, stride_xd, HEAD_DIM).to(tl.float32) - own
                    tl.store(distance_row + rows, tl.sum(gap * gap, axis=1), mask=rows < N)
                tl.debug_barrier()
                below = tl.full([], 1 << 62, tl.int64)
                position = tl.zeros([], tl.int64)
                for e in range(empties):
                    key = _farthest_below(distance_row, mask_row, N, below, BLOCK_N, NO_KEY)
                    position = tl.where(key != NO_KEY, _donor_position(key, N), position)
                    below = tl.where(key != NO_KEY, key, below)
                    cluster = _empty_cluster(members_row, C, e, BLOCK_C)
                    donor = tl.load(x_head + position * stride_xn + dims * stride_xd, mask=dims < D, other=0.0)
                    tl.store(means_row + cluster * D + dims, donor.to(tl.float32), mask=dims < D)
                tl.debug_barrier()
            moved = 0
            for start in range(0, N, BLOCK_N):
                rows = start + tl.arange(0, BLOCK_N)
                x = _rows(x_head, rows, N, D, stride_xn, stride_xd, HEAD_DIM)
                best = tl.full([BLOCK_N], float("-inf"), tl.float32)
                best_cluster = tl.zeros([BLOCK_N], tl.int64)
                for c_start in range(0, C, BLOCK_C):
                    cols = c_start + tl.arange(0, BLOCK_C)
                    centroids = tl.load(means_row + cols[:, None] * D + dims[None, :],
                                        mask=(cols[:, None] < C) & (dims[None, :] < D), other=0.0)
                    bias = -tl.sum(centroids * centroids, axis=1)
                    scores = 2 * dot_split_right(x, tl.trans(centroids), UPCAST) + bias[None, :]
                    scores = tl.where(cols[None, :] < C, scores, float("-inf"))
                    block_best = tl.max(scores, axis=1)
                    block_cluster = (c_start + tl.argmax(scores, axis=1)).to(tl.int64)
                    closer = block_best > best
                    best = tl.where(closer, block_best, best)
                    best_cluster = tl.where(closer, block_cluster, best_cluster)
                real = tl.load(mask_row + rows, mask=rows < N, other=0) != 0
                cluster = tl.where(real, best_cluster, C)
                old = tl.load(assign_row + rows, mask=rows < N, other=C)
                moved += tl.sum(((old != cluster) & (rows < N)).to(tl.int32), axis=0)
                tl.store(assign_row + rows, cluster, mask=rows < N)
            tl.debug_barrier()
            changed = moved
    if EXACT_CASE != 0:
        if _real_count(mask_row, N, 1024) <= C:
            _write_ranks(mask_row, assign_row, N, C, BLOCK_N)
            tl.debug_barrier()
    if WITH_MEANS:
        _means(x_head, assign_row, means_row, members_row, N, C, D, stride_xn, stride_xd,
               BLOCK_N, BLOCK_C, HEAD_DIM, UPCAST)


def _upcast(x: Tensor) -> bool:
    """Interpreted (CPU) bfloat16 dots run in float32 (see split_dot)."""
    return x.device.type == "cpu"


def hamming_kmeans_triton(
    codes: Tensor, query_mask: Tensor, clusters: int, iterations: int, offsets: Tensor, bits: int,
    exact_case: bool = False,
) -> Tensor:
    """`kmeans.hamming_kmeans` on packed codes (B, H, N) int64 of `bits` bits, one launch.

    query_mask: (B, N) bool, True = real query; offsets: (H,) float32 on the codes' device.
    exact_case: a sequence with no more real queries than clusters gives each its own
    (kmeans.one_query_per_cluster). Returns assignments (B, H, N) int64 in [0, C], padded at C.
    """
    b, h, n = codes.shape
    device = codes.device
    assign = torch.empty(b, h, n, dtype=torch.int64, device=device)
    centroids = torch.empty(2, b * h, clusters, dtype=torch.int64, device=device)
    members = torch.empty(b * h, clusters, dtype=torch.int64, device=device)
    distance = torch.empty(b, h, n, dtype=torch.float32, device=device)
    _hamming_kmeans_kernel[(b * h,)](
        codes, query_mask.contiguous(), offsets, centroids, members, distance, assign,
        h, n, clusters, bits, iterations, int(exact_case),
        BLOCK_N=BLOCK_N, BLOCK_C=BLOCK_C, BLOCK_BITS=BLOCK_BITS, NO_KEY=_NO_KEY, UPCAST=_upcast(codes),
        num_warps=NUM_WARPS,
    )
    return assign


def _lloyd(x: Tensor, assign: Tensor, query_mask: Tensor | None, clusters: int, iterations: int,
           exact_case: bool, with_means: bool) -> tuple[Tensor, Tensor, Tensor]:
    b, h, n, d = x.shape
    device = x.device
    out = torch.empty(b, h, n, dtype=torch.int64, device=device)
    means = torch.empty(b, h, clusters, d, dtype=torch.float32, device=device)
    members = torch.empty(b, h, clusters, dtype=torch.int64, device=device)
    distance = torch.empty(b, h, n, dtype=torch.float32, device=device)
    # Without iterations or the exact case the mask is never read: any pointer stands in.
    mask = query_mask.contiguous() if query_mask is not None else assign
    _lloyd_kernel[(b * h,)](
        x, mask, assign.contiguous(), out, means, members, distance,
        *x.stride(),
        h, n, clusters, d, iterations, int(exact_case),
        BLOCK_N=BLOCK_N, BLOCK_C=BLOCK_C, HEAD_DIM=pow2_block(d), NO_KEY=_NO_KEY, UPCAST=_upcast(x),
        WITH_MEANS=with_means, num_warps=NUM_WARPS,
    )
    return out, means, members


def refine_clusters_triton(
    q: Tensor, assign: Tensor, query_mask: Tensor, clusters: int, iterations: int, exact_case: bool = False
) -> Tensor:
    """`kmeans.refine_clusters`: Lloyd iterations with Euclidean distance from `assign`, one launch.

    q: (B, H, N, D) float32, float16 or bfloat16. Returns (B, H, N) int64 in [0, C].
    """
    return _lloyd(q, assign, query_mask, clusters, iterations, exact_case, with_means=False)[0]


def cluster_means_triton(x: Tensor, assign: Tensor, clusters: int) -> tuple[Tensor, Tensor]:
    """Cluster means of x (B, H, N, D) under assign (B, H, N) in [0, C], one launch.

    Returns means (B, H, C, D) float32 (0 for an empty cluster) and members (B, H, C) int64.
    """
    _, means, members = _lloyd(x, assign, None, clusters, 0, False, with_means=True)
    return means, members


# For the offline cost model (bench/gpu_model.py, bench/trip_counts.py): loop bounds that the
# launch's arguments do not give, as one program sees them on average. Empty clusters per
# Hamming iteration: measured with the reference on real text (12 heads, 4k and 16k tokens),
# about 2 x (C / 100)^2 in the first iteration and almost none after; the refinement's Lloyd
# steps on real queries had none.
LOOP_BOUNDS = {
    "_hamming_kmeans_kernel": lambda a: {"empties": 2 * (a["C"] / 100) ** 2 / max(a["ITERATIONS"], 1)},
    "_lloyd_kernel": lambda a: {"empties": 0},
}
