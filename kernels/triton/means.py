"""Cluster sums and means of the query vectors as Triton kernels spread over the whole GPU
(the triton backend's centroids stage, and the sums and means of each refinement step in
lloyd_triton; kmeans.cluster_means is the reference they match).

Each head's queries are cut into chunks of whole BLOCK_N tiles, one program a chunk
(kernels.triton.helpers.chunking). Per chunk, cluster sums are one-hot(cluster) @ rows on tensor
cores, written per chunk and summed over the chunks in chunk order by the next launch: the
result does not depend on which program ran first.

    _sums_kernel   (chunks, B * H)         per-chunk member sums and counts of assignments A
    _means_kernel  (cluster blocks, B * H)  member means and counts of A, and the list of
                                            empty clusters
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from clusterserve.kernels.triton.helpers import (
    any_set,
    chunk_group,
    chunking,
    count_real,
    mma,
    one_hot,
    pow2_block,
    sum_chunks,
    sum_chunks_2d,
    upcast,
)

# Queries per tile (a chunk is whole tiles; lloyd_triton's too) and the most centroids per
# tile of the sums (fewer clusters: the next power of two); the sums read a chunk's rows once
# per tile of centroids, at 4 warps (~245 registers: two programs an SM).
BLOCK_N = 64
BLOCK_C = 128
NUM_WARPS = 4
# Mask bytes per step of a count of real queries.
COUNT_BLOCK = 4096
# The means kernel: about MEANS_PROGRAMS programs a head of at least 2 clusters each, each
# summing its clusters' member sums over SUMS_TILE / clusters-a-program chunks a load (a
# (chunks, clusters, D) float32 load of ~32 registers; the counts take helpers.chunk_group).
# Its time is the chain of loads of one program: on an H100, 100 clusters at 4 a program and 16
# chunks a load made a clustered call 3-6% faster than 8 and 8, and within 2% of 2 and 32,
# which read every cluster's count twice as often (bench/results/2026-11-27-h100-3-shapes.json).
# PER_PROGRAM and SUMS_GROUP, when set, override the rule (bench.gpu.shapes' variants).
MEANS_PROGRAMS = 25
SUMS_TILE = 64
PER_PROGRAM = None
SUMS_GROUP = None


@triton.jit
def load_rows(x_head, rows, stop, D, stride_xn, stride_xd, HEAD_DIM: tl.constexpr):
    """Rows of one head's (N, D) matrix in its dtype, zero past `stop` and D."""
    dims = tl.arange(0, HEAD_DIM)
    return tl.load(x_head + rows[:, None] * stride_xn + dims[None, :] * stride_xd,
                   mask=(rows[:, None] < stop) & (dims[None, :] < D), other=0.0)


@triton.jit
def chunk_sums(x_head, assign_row, part_sums_row, part_counts_row, start, stop, C, D, stride_xn, stride_xd,
               BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr):
    """One chunk's member sums (C, D) float32 and counts (C,) int32: one-hot(cluster) @ rows."""
    dims = tl.arange(0, HEAD_DIM)
    for c_start in range(0, C, BLOCK_C):
        cols = c_start + tl.arange(0, BLOCK_C)
        sums = tl.zeros([BLOCK_C, HEAD_DIM], tl.float32)
        members = tl.zeros([BLOCK_C], tl.int32)
        for first in range(start, stop, BLOCK_N):
            rows = first + tl.arange(0, BLOCK_N)
            x = load_rows(x_head, rows, stop, D, stride_xn, stride_xd, HEAD_DIM)
            cluster = tl.load(assign_row + rows, mask=rows < stop, other=C).to(tl.int32)
            sums += mma(one_hot(cluster, cols, x.dtype), x, UPCAST)
            local = cluster - c_start
            members += tl.histogram(local, BLOCK_C, mask=(local >= 0) & (local < BLOCK_C))
        tl.store(part_sums_row + cols[:, None] * D + dims[None, :], sums, mask=(cols[:, None] < C) & (dims[None, :] < D))
        tl.store(part_counts_row + cols, members, mask=cols < C)


@triton.jit
def _sums_kernel(
    x_ptr, query_mask_ptr, assign_in_ptr, assign_ptr, part_sums_ptr, part_counts_ptr, moved_ptr,
    stride_xb, stride_xh, stride_xn, stride_xd,
    H, N, C, D, CHUNK, CHUNKS,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, HEAD_DIM: tl.constexpr, COUNT_BLOCK: tl.constexpr,
    EXACT_CASE: tl.constexpr, UPCAST: tl.constexpr,
):
    """A chunk's member sums and counts under assign_in (B, H, N), copied to assign; its flag
    in moved (B * H, CHUNKS) set for the first step, unless EXACT_CASE and the sequence has no
    more real queries than clusters (the last step gives each query its own)."""
    chunk = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    start = chunk * CHUNK
    stop = tl.minimum(start + CHUNK, N)
    if EXACT_CASE:
        iterate = count_real(query_mask_ptr + (bh // H) * N, 0, N, COUNT_BLOCK) > C
    else:
        iterate = True
    tl.store(moved_ptr + bh * CHUNKS + chunk, iterate.to(tl.int32))
    for first in range(start, stop, BLOCK_N):
        rows = first + tl.arange(0, BLOCK_N)
        tl.store(assign_ptr + bh * N + rows, tl.load(assign_in_ptr + bh * N + rows, mask=rows < stop), mask=rows < stop)
    tl.debug_barrier()  # the copy, stored above, is read back by other threads
    chunk_sums(x_ptr + (bh // H) * stride_xb + (bh % H) * stride_xh, assign_ptr + bh * N,
                part_sums_ptr + (bh * CHUNKS + chunk) * C * D, part_counts_ptr + (bh * CHUNKS + chunk) * C,
                start, stop, C, D, stride_xn, stride_xd, BLOCK_N, BLOCK_C, HEAD_DIM, UPCAST)


@triton.jit
def block_means(part_sums_ptr, part_counts_ptr, means_ptr, members_ptr, empty_list_ptr, n_empty_ptr, bh, block, C, D,
                CHUNKS, PER_PROGRAM, BLOCK_C: tl.constexpr, COUNT_C: tl.constexpr, HEAD_DIM: tl.constexpr,
                CHUNK_GROUP: tl.constexpr, SUMS_GROUP: tl.constexpr):
    """_means_kernel's work for clusters [block x PER_PROGRAM, + PER_PROGRAM) of head bh (none
    past C); returns the head's number of empty clusters."""
    first_cluster = block * PER_PROGRAM
    last_cluster = tl.minimum(first_cluster + PER_PROGRAM, C)
    counts_head = part_counts_ptr + bh * CHUNKS * C
    empties_before = 0
    empties = 0
    for c_start in range(0, C, COUNT_C):
        cols = c_start + tl.arange(0, COUNT_C)
        empty = ((sum_chunks(counts_head, C, CHUNKS, cols, cols < C, CHUNK_GROUP) == 0) & (cols < C)).to(tl.int32)
        empties_before += tl.sum(tl.where(cols < first_cluster, empty, 0), axis=0)
        empties += tl.sum(empty, axis=0)
    if block == 0:
        tl.store(n_empty_ptr + bh, empties)
    dims = tl.arange(0, HEAD_DIM)
    for c_start in range(first_cluster, last_cluster, BLOCK_C):
        cols = c_start + tl.arange(0, BLOCK_C)
        in_block = cols < last_cluster
        sums = sum_chunks_2d(part_sums_ptr + bh * CHUNKS * C * D, C * D, CHUNKS, cols[:, None] * D + dims[None, :],
                             in_block[:, None] & (dims[None, :] < D), SUMS_GROUP)
        members = sum_chunks(counts_head, C, CHUNKS, cols, in_block, CHUNK_GROUP)
        means = tl.math.div_rn(sums, tl.maximum(members, 1).to(tl.float32)[:, None])
        tl.store(means_ptr + (bh * C + cols)[:, None] * D + dims[None, :], means,
                 mask=in_block[:, None] & (dims[None, :] < D))
        tl.store(members_ptr + bh * C + cols, members.to(tl.int64), mask=in_block)
        empty = (members == 0) & in_block
        rank = empties_before + tl.cumsum(empty.to(tl.int32), axis=0) - 1
        tl.store(empty_list_ptr + bh * C + rank, cols, mask=empty)
        empties_before += tl.sum(empty.to(tl.int32), axis=0)
    return empties


@triton.jit
def _means_kernel(
    part_sums_ptr, part_counts_ptr, moved_ptr, means_ptr, members_ptr, empty_list_ptr, n_empty_ptr,
    C, D, CHUNKS, PER_PROGRAM,
    BLOCK_C: tl.constexpr, COUNT_C: tl.constexpr, HEAD_DIM: tl.constexpr, CHUNK_BLOCK: tl.constexpr,
    CHUNK_GROUP: tl.constexpr, SUMS_GROUP: tl.constexpr,
):
    """Means (B * H, C, D) float32 (0 if empty) and counts (B * H, C) int64 of PER_PROGRAM
    clusters, summed over the chunks in a fixed order; the e-th empty cluster (cluster order)
    in empty_list (B * H, C) int32, their number in n_empty (B * H,). Nothing is written for a
    head whose assignments did not move in the previous step (moved, one flag per chunk)."""
    bh = tl.program_id(1).to(tl.int64)
    if any_set(moved_ptr + bh * CHUNKS, CHUNKS, CHUNK_BLOCK):
        block_means(part_sums_ptr, part_counts_ptr, means_ptr, members_ptr, empty_list_ptr, n_empty_ptr, bh,
                    tl.program_id(0), C, D, CHUNKS, PER_PROGRAM, BLOCK_C, COUNT_C, HEAD_DIM, CHUNK_GROUP, SUMS_GROUP)


class Buffers:
    """Scratch of one refinement or means call: per-chunk sums and counts, the means, the
    empty clusters and their donors' candidates."""

    def __init__(self, x: Tensor, clusters: int, chunks: int, top: int):
        b, h, n, d = x.shape
        empty = lambda *shape, dtype: torch.empty(*shape, dtype=dtype, device=x.device)  # noqa: E731
        self.part_sums = empty(b * h, chunks, clusters, d, dtype=torch.float32)
        self.part_counts = empty(b * h, chunks, clusters, dtype=torch.int32)
        self.means = empty(b * h, clusters, d, dtype=torch.float32)
        self.members = empty(b * h, clusters, dtype=torch.int64)
        self.empty_list = empty(b * h, clusters, dtype=torch.int32)
        self.n_empty = empty(b * h, dtype=torch.int32)
        self.moved = empty(2, b * h, chunks, dtype=torch.int32)
        self.keys = empty(b * h, n, dtype=torch.int64)
        self.candidates = empty(b * h, chunks, top, dtype=torch.int64)


def sums_block(clusters: int) -> int:
    """Centroids per tile of the sums (chunk_sums' BLOCK_C) for `clusters` clusters."""
    return pow2_block(clusters, 16, BLOCK_C)


def sums(x: Tensor, assign: Tensor, query_mask: Tensor | None, out: Tensor, buffers: Buffers, clusters: int,
          chunk: int, chunks: int, exact_case: bool) -> None:
    b, h, n, d = x.shape
    # Without the exact case the mask is never read: any pointer stands in.
    mask = query_mask.contiguous() if query_mask is not None else assign
    _sums_kernel[(chunks, b * h)](
        x, mask, assign.contiguous(), out, buffers.part_sums, buffers.part_counts, buffers.moved[1], *x.stride(),
        h, n, clusters, d, chunk, chunks,
        BLOCK_N=BLOCK_N, BLOCK_C=sums_block(clusters), HEAD_DIM=pow2_block(d), COUNT_BLOCK=COUNT_BLOCK,
        EXACT_CASE=exact_case,
        UPCAST=upcast(x), num_warps=NUM_WARPS,
    )


def means_block(clusters: int) -> int:
    """Clusters per program of the means kernel: about MEANS_PROGRAMS programs a head, a power of
    two from 2 to 256 (PER_PROGRAM, when set)."""
    return PER_PROGRAM or min(256, max(2, triton.next_power_of_2(triton.cdiv(clusters, MEANS_PROGRAMS))))


def means_launch(clusters: int, chunks: int, d: int) -> tuple[int, int, dict]:
    """The means kernel's programs a head, clusters a program and compile-time arguments."""
    per_program = means_block(clusters)
    block_c = min(per_program, 16)
    group = chunk_group(chunks)
    return triton.cdiv(clusters, per_program), per_program, dict(
        BLOCK_C=block_c, COUNT_C=pow2_block(clusters, 16, 256), HEAD_DIM=pow2_block(d),
        CHUNK_BLOCK=pow2_block(chunks, 1), CHUNK_GROUP=group, SUMS_GROUP=min(SUMS_GROUP or SUMS_TILE // block_c, group),
    )


def means(x: Tensor, buffers: Buffers, moved: Tensor, clusters: int, chunks: int) -> None:
    b, h, _, d = x.shape
    blocks, per_program, meta = means_launch(clusters, chunks, d)
    _means_kernel[(blocks, b * h)](
        buffers.part_sums, buffers.part_counts, moved, buffers.means, buffers.members, buffers.empty_list,
        buffers.n_empty, clusters, d, chunks, per_program, **meta,
    )


def cluster_means_triton(x: Tensor, assign: Tensor, clusters: int) -> tuple[Tensor, Tensor]:
    """Cluster means of x (B, H, N, D) under assign (B, H, N) in [0, C]: two launches.

    Returns means (B, H, C, D) float32 (0 for an empty cluster) and members (B, H, C) int64.
    """
    b, h, n, d = x.shape
    chunks, chunk = chunking(n, h, BLOCK_N)
    buffers = Buffers(x, clusters, chunks, 1)
    copy = torch.empty(b, h, n, dtype=torch.int64, device=x.device)
    sums(x, assign, None, copy, buffers, clusters, chunk, chunks, exact_case=False)
    means(x, buffers, buffers.moved[1], clusters, chunks)
    return buffers.means.view(b, h, clusters, d), buffers.members.view(b, h, clusters)
