"""The layout of improved clustered attention's sparse part as a counting sort over the whole
GPU: each cluster's real queries in position order, in tiles of TILE (clustered.cluster_tiles
is the reference; the tiles are the same).

    _layout_counts_kernel   (chunks, B * H)  members of every cluster in each chunk of queries
                            (and, for the sparse stage, zero output rows for its padded ones)
    _layout_scatter_kernel  (chunks, B * H)  every real query to its place in the order:
                            its chunk's start for its cluster (summed from the head's counts,
                            chunks x clusters integers in a few loads) + its rank among the
                            chunk's members of that cluster before it; the first chunk's
                            program also writes where each cluster starts, its size and its
                            tiles' end

Integer counts only; each place in the order has one writer, and so has each cluster's
start, size and tile end.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from clusterserve.kernels.triton.helpers import chunking, pow2_block

# Queries per tile of a chunk (of the counts: several tiles a load, so that a program waits for
# fewer loads in turn), and clusters per step of the counts and the scatter.
BLOCK_N = 64
COUNT_BLOCK_N = 256
BLOCK_C = 128
# Counts per load of the scatter's sum over the head's chunks (chunks x clusters).
SCAN_COUNTS = 4096


class ClusterLayout(NamedTuple):
    """order (B * H, N) int32: real query positions grouped by cluster, in position order
    within one; start, size, tile_end (B * H, C) int32: where cluster c begins in `order`,
    its members, and the end of its tiles (cluster c owns tiles [tile_end - ceil(size /
    TILE), tile_end))."""

    order: Tensor
    start: Tensor
    size: Tensor
    tile_end: Tensor


@triton.jit
def _layout_counts_kernel(
    assign_ptr, part_counts_ptr, out_ptr,
    stride_ob, stride_oh, stride_on, stride_od,
    H, N, C, DV, CHUNK, CHUNKS,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, VALUE_DIM: tl.constexpr, ZERO: tl.constexpr,
):
    """part_counts (B * H, CHUNKS, C) int32: members of each cluster in this chunk. With ZERO,
    the rows of out (B, H, N, DV) of the chunk's padded queries (at C) are set to 0: no tile
    writes them."""
    chunk = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    start = chunk * CHUNK
    stop = tl.minimum(start + CHUNK, N)
    padded = 0  # the chunk's padded queries
    for c_start in range(0, C, BLOCK_C):
        counts = tl.zeros([BLOCK_C], tl.int32)
        for first in range(start, stop, BLOCK_N):
            rows = first + tl.arange(0, BLOCK_N)
            cluster = tl.load(assign_ptr + bh * N + rows, mask=rows < stop, other=C)
            local = (cluster - c_start).to(tl.int32)
            counts += tl.histogram(local, BLOCK_C, mask=(local >= 0) & (local < BLOCK_C) & (c_start + local < C))
            if ZERO and c_start == 0:
                padded += tl.sum(((cluster >= C) & (rows < stop)).to(tl.int32), axis=0)
        cols = c_start + tl.arange(0, BLOCK_C)
        tl.store(part_counts_ptr + (bh * CHUNKS + chunk) * C + cols, counts, mask=cols < C)
    if ZERO:
        out_head = out_ptr + (bh // H) * stride_ob + (bh % H) * stride_oh
        vdims = tl.arange(0, VALUE_DIM)
        zero_stop = tl.where(padded > 0, stop, start)  # the rows again, only where some are padded
        for first in range(start, zero_stop, BLOCK_N):
            rows = first + tl.arange(0, BLOCK_N)
            cluster = tl.load(assign_ptr + bh * N + rows, mask=rows < stop, other=C)
            tl.store(out_head + rows[:, None] * stride_on + vdims[None, :] * stride_od,
                     tl.zeros([BLOCK_N, VALUE_DIM], out_ptr.dtype.element_ty),
                     mask=((cluster >= C) & (rows < stop))[:, None] & (vdims[None, :] < DV))


@triton.jit
def _layout_scatter_kernel(
    assign_ptr, part_counts_ptr, order_ptr, start_ptr, size_ptr, tile_end_ptr,
    N, C, CHUNK, CHUNKS,
    TILE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, CHUNK_BLOCK: tl.constexpr,
):
    """order[offset(chunk, c) + rank] = position for each real query of this chunk, rank its
    place among the chunk's members of cluster c (position order): the members in the tiles
    before, plus those before it in its tile. offset(chunk, c), where the chunk's members of c
    begin, is where c begins (the sizes of the clusters before it) plus c's members in the
    chunks before: every program sums the head's counts itself. The first chunk's program
    writes each cluster's start, size and tile_end (B * H, C)."""
    chunk = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    start = chunk * CHUNK
    stop = tl.minimum(start + CHUNK, N)
    before = tl.arange(0, BLOCK_N)[None, :] < tl.arange(0, BLOCK_N)[:, None]  # (i, j): j before i
    members_before = 0  # of the clusters before the block
    tiles_before = 0
    for c_start in range(0, C, BLOCK_C):
        cols = c_start + tl.arange(0, BLOCK_C)
        sizes = tl.zeros([BLOCK_C], tl.int32)
        earlier = tl.zeros([BLOCK_C], tl.int32)  # members in the chunks before this one
        for first_chunk in range(0, CHUNKS, CHUNK_BLOCK):
            chunks = first_chunk + tl.arange(0, CHUNK_BLOCK)
            counts = tl.load(part_counts_ptr + (bh * CHUNKS + chunks[:, None]) * C + cols[None, :],
                             mask=(chunks[:, None] < CHUNKS) & (cols[None, :] < C), other=0)
            sizes += tl.sum(counts, axis=0)
            earlier += tl.sum(tl.where(chunks[:, None] < chunk, counts, 0), axis=0)
        starts = members_before + tl.cumsum(sizes, axis=0) - sizes
        tiles = (sizes + TILE - 1) // TILE
        if chunk == 0:
            tl.store(start_ptr + bh * C + cols, starts, mask=cols < C)
            tl.store(size_ptr + bh * C + cols, sizes, mask=cols < C)
            tl.store(tile_end_ptr + bh * C + cols, tiles_before + tl.cumsum(tiles, axis=0), mask=cols < C)
        members_before += tl.sum(sizes, axis=0)
        tiles_before += tl.sum(tiles, axis=0)
        offsets = starts + earlier
        seen = tl.zeros([BLOCK_C], tl.int32)  # members of each cluster in the tiles before
        # Each tile's clusters are loaded a tile ahead.
        rows = start + tl.arange(0, BLOCK_N)
        ahead = tl.load(assign_ptr + bh * N + rows, mask=rows < stop, other=C).to(tl.int32)
        for first in range(start, stop, BLOCK_N):
            rows = first + tl.arange(0, BLOCK_N)
            cluster = ahead
            ahead = tl.load(assign_ptr + bh * N + BLOCK_N + rows, mask=BLOCK_N + rows < stop, other=C).to(tl.int32)
            local = cluster - c_start
            mine = (local >= 0) & (local < BLOCK_C) & (cluster < C)
            same = tl.sum(((cluster[:, None] == cluster[None, :]) & before).to(tl.int32), axis=1)
            place = tl.gather(offsets + seen, tl.where(mine, local, 0), 0) + same
            tl.store(order_ptr + bh * N + place, rows, mask=mine)
            seen += tl.histogram(local, BLOCK_C, mask=mine)


def cluster_layout_triton(assign: Tensor, clusters: int, tile: int, out: Tensor | None = None) -> ClusterLayout:
    """Each cluster's real queries in position order, tiles of `tile`: assign (B, H, N) in
    [0, C], padded queries at C. Two launches; see ClusterLayout. `out` (B, H, N, Dv), the
    sparse stage's output: its padded queries' rows are set to 0 on the way."""
    b, h, n = assign.shape
    device = assign.device
    chunks, chunk = chunking(n, h, BLOCK_N)
    assign = assign.contiguous()
    part_counts = torch.empty(b * h, chunks, clusters, dtype=torch.int32, device=device)
    layout = ClusterLayout(*(torch.empty(b * h, size, dtype=torch.int32, device=device) for size in (n, clusters,
                                                                                                     clusters, clusters)))
    block_c = pow2_block(clusters, 16, BLOCK_C)
    dv = out.shape[-1] if out is not None else 1
    _layout_counts_kernel[(chunks, b * h)](  # without `out` nothing is written to its stand-in
        assign, part_counts, out if out is not None else part_counts, *(out.stride() if out is not None else (0,) * 4),
        h, n, clusters, dv, chunk, chunks, BLOCK_N=COUNT_BLOCK_N, BLOCK_C=block_c, VALUE_DIM=pow2_block(dv),
        ZERO=out is not None,
    )
    _layout_scatter_kernel[(chunks, b * h)](
        assign, part_counts, layout.order, layout.start, layout.size, layout.tile_end, n, clusters, chunk, chunks,
        TILE=tile, BLOCK_N=BLOCK_N, BLOCK_C=block_c, CHUNK_BLOCK=pow2_block(chunks, 1, max(1, SCAN_COUNTS // block_c)),
    )
    return layout
