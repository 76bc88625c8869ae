"""Where the clusters start, as Triton helpers and one kernel: the seed queries at evenly spaced
ranks of the real queries (kmeans.initial_centroid_positions is the reference), found by the
program whose chunk of queries holds each, so that each cluster has one writer.

    seed_range, seed_positions  the clusters whose seed lies in a chunk, and where (the Hamming
                                K-means' initial launch takes their codes, the kernel below
                                their vectors)
    _seed_means_kernel          (chunks, B * H)  without LSH codes (spec.bits 0): the seed
                                queries as the first means of the Euclidean refinement, whose
                                nearest-mean step (lloyd) then gives each query the cluster of
                                its nearest seed (kmeans.seeded_clusters)
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from clusterserve.kernels.triton import means
from clusterserve.kernels.triton.helpers import count_real, pow2_block

# Clusters per step of the seeds' search, queries per step of a chunk's rank count, and mask
# bytes per step of a count of real queries.
BLOCK_C = 32
BLOCK_N = 64
COUNT_BLOCK = 4096


@triton.jit
def seed_range(n_real, real_before, real_here, offset, C):
    """The clusters [first, last) whose seed can lie among the real ranks [real_before,
    real_before + real_here) of a chunk, with a cluster to spare each side for rounding (all of
    them where no query is real: every seed is then the first padded query)."""
    per_rank = C.to(tl.float32) / tl.maximum(n_real, 1).to(tl.float32)
    first = tl.maximum(tl.math.floor(real_before.to(tl.float32) * per_rank - offset).to(tl.int32) - 1, 0)
    last = tl.minimum(tl.math.floor((real_before + real_here).to(tl.float32) * per_rank).to(tl.int32) + 2, C)
    return tl.where(n_real > 0, first, 0), tl.where(n_real > 0, last, C)


@triton.jit
def seed_positions(mask_row, start, stop, N, C, n_real, real_before, real_here, offset, c_start,
                   BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr):
    """Of the clusters c_start + arange(BLOCK_C): those whose seed, the query of rank
    floor((c + offset) n_real / C) among the real queries, then the padded ones, lies in the
    chunk [start, stop) of one (N,) mask row (`mine`), and its position (0 for the others).
    In a chunk of real queries only, a position follows from its rank; otherwise the chunk's
    ranks are counted (only where some cluster is mine)."""
    padded_before = start - real_before
    padded_here = stop - start - real_here
    cols = c_start + tl.arange(0, BLOCK_C)
    # IEEE division, as torch's: an approximate one could move a seed by a rank.
    target = tl.math.div_rn((cols.to(tl.float32) + offset) * n_real.to(tl.float32), C.to(tl.float32))
    target = tl.minimum(target.to(tl.int32), N - 1)
    real_rank = (target >= real_before) & (target < real_before + real_here)
    padded_rank = (target >= n_real + padded_before) & (target < n_real + padded_before + padded_here)
    mine = (cols < C) & (real_rank | padded_rank)
    all_real = real_here == stop - start
    direct = mine & (tl.zeros([BLOCK_C], tl.int32) + real_here == stop - start)
    position = tl.where(direct, start + target - real_before, 0)
    if tl.sum(mine.to(tl.int32), axis=0) > 0:
        real_seen = real_before
        padded_seen = n_real + padded_before
        scan_stop = tl.where(all_real, start, stop)  # else the ranks are counted
        for first in range(start, scan_stop, BLOCK_N):
            rows = first + tl.arange(0, BLOCK_N)
            in_range = rows < stop
            real = (tl.load(mask_row + rows, mask=in_range, other=0) != 0) & in_range
            padded = (~real) & in_range
            rank = tl.where(real, real_seen + tl.cumsum(real.to(tl.int32), axis=0) - 1,
                            padded_seen + tl.cumsum(padded.to(tl.int32), axis=0) - 1)
            match = in_range[None, :] & (rank[None, :] == target[:, None])
            position += tl.sum(tl.where(match, rows[None, :], 0), axis=1)
            real_seen += tl.sum(real.to(tl.int32), axis=0)
            padded_seen += tl.sum(padded.to(tl.int32), axis=0)
    return cols, mine, position


@triton.jit
def _seed_means_kernel(
    x_ptr, query_mask_ptr, offsets_ptr, means_ptr, moved_ptr, n_empty_ptr,
    stride_xb, stride_xh, stride_xn, stride_xd,
    H, N, C, D, CHUNK, CHUNKS,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, HEAD_DIM: tl.constexpr, COUNT_BLOCK: tl.constexpr,
):
    """Each cluster's seed query of x (B, H, N, D) as its first mean, means (B * H, C, D)
    float32: program (p, bh) writes the clusters whose seed lies in its chunk [p CHUNK, (p + 1)
    CHUNK), each cluster one writer. It also sets its chunk's flag in moved (B * H, CHUNKS)
    (the first nearest-mean step runs), and the first program of a head n_empty (B * H,) to 0
    (no empty cluster, no donor to read)."""
    chunk = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    batch, head = bh // H, bh % H
    start = chunk * CHUNK
    stop = tl.minimum(start + CHUNK, N)
    mask_row = query_mask_ptr + batch * N
    real_before = count_real(mask_row, 0, start, COUNT_BLOCK)
    real_here = count_real(mask_row, start, stop, COUNT_BLOCK)
    n_real = real_before + real_here + count_real(mask_row, stop, N, COUNT_BLOCK)
    offset = tl.load(offsets_ptr + head)
    c_first, c_last = seed_range(n_real, real_before, real_here, offset, C)
    x_head = x_ptr + batch * stride_xb + head * stride_xh
    dims = tl.arange(0, HEAD_DIM)
    in_dims = dims[None, :] < D
    for c_start in range(c_first, c_last, BLOCK_C):
        cols, mine, position = seed_positions(mask_row, start, stop, N, C, n_real, real_before, real_here, offset,
                                              c_start, BLOCK_C, BLOCK_N)
        seeds = tl.load(x_head + position[:, None] * stride_xn + dims[None, :] * stride_xd,
                        mask=mine[:, None] & in_dims, other=0.0)
        tl.store(means_ptr + (bh * C + cols)[:, None] * D + dims[None, :], seeds.to(tl.float32),
                 mask=mine[:, None] & in_dims)
    tl.store(moved_ptr + bh * CHUNKS + chunk, 1)
    if chunk == 0:
        tl.store(n_empty_ptr + bh, 0)


def seed_means_triton(x: Tensor, query_mask: Tensor, offsets: Tensor, buffers: means.Buffers, moved: Tensor,
                      chunk: int) -> None:
    """The seed queries of x (B, H, N, D) as the first means of a refinement in buffers
    (lloyd.refine_buffers: buffers.means, buffers.n_empty), its chunks of `chunk` queries
    flagged in moved (B * H, chunks), for the first nearest-mean step (FIRST) to read.
    query_mask (B, N) bool; offsets (H,) float32 on x's device (kmeans.initial_offsets). One
    launch."""
    b, h, n, d = x.shape
    chunks = moved.shape[-1]
    _seed_means_kernel[(chunks, b * h)](
        x, query_mask.contiguous(), offsets, buffers.means, moved, buffers.n_empty, *x.stride(),
        h, n, buffers.means.shape[1], d, chunk, chunks,
        BLOCK_N=BLOCK_N, BLOCK_C=BLOCK_C, HEAD_DIM=pow2_block(d), COUNT_BLOCK=COUNT_BLOCK,
    )

