"""The update launch of the Triton Hamming K-means (hamming_triton runs it once per
iteration, after the assignment):

    _hamming_update_kernel  (cluster blocks, B * H)   sums the chunks' votes in chunk order
                            (integers: any order gives the same), majority vote (ties to 0),
                            and re-seeds the e-th empty cluster with the e-th farthest query

Donors. A query's level is 1 + its Hamming distance to its centroid (padded queries 0): the
reference's donor order (kmeans.hamming_kmeans) is level descending, then position. From the
chunks' level histograms the kernel finds the level, the chunk and the rank within that
chunk of the e-th donor, then reads only that chunk: no scan over a head's N queries.
"""

from __future__ import annotations

import triton
import triton.language as tl

from clusterserve.kernels.triton.helpers import (
    any_set,
    code_signs,
    scalar_at,
    sum_chunks,
    sum_chunks_2d,
)


@triton.jit
def _donor_position(level_row, part_levels_row, above, through, rank, N, CHUNK, CHUNKS,
                    LEVELS: tl.constexpr, CHUNK_BLOCK: tl.constexpr, SCAN: tl.constexpr):
    """Position of the donor of rank `rank` (0 = farthest): its level from the head's level
    counts (above[l]: donors above level l, through[l]: above[l] + level l's), its chunk from
    the chunks' counts of that level, its place from that chunk's levels in position order."""
    levels = tl.arange(0, LEVELS)
    level = tl.sum(tl.where((above <= rank) & (rank < through), levels, 0), axis=0)
    rank_in_level = rank - scalar_at(above, levels, level)
    chunks = tl.arange(0, CHUNK_BLOCK)
    per_chunk = tl.load(part_levels_row + chunks * LEVELS + level, mask=chunks < CHUNKS, other=0)
    through_chunk = tl.cumsum(per_chunk, axis=0)
    holds = (through_chunk - per_chunk <= rank_in_level) & (rank_in_level < through_chunk)
    chunk = tl.sum(tl.where(holds, chunks, 0), axis=0)
    rank_in_chunk = rank_in_level - scalar_at(through_chunk - per_chunk, chunks, chunk)
    position = 0
    seen = 0
    stop = tl.minimum(chunk * CHUNK + CHUNK, N)
    for first in range(chunk * CHUNK, stop, SCAN):
        rows = first + tl.arange(0, SCAN)
        same = tl.load(level_row + rows, mask=rows < stop, other=-1).to(tl.int32) == level
        order = seen + tl.cumsum(same.to(tl.int32), axis=0) - 1
        position += tl.sum(tl.where(same & (order == rank_in_chunk), rows, 0), axis=0)
        seen += tl.sum(same.to(tl.int32), axis=0)
    return position


@triton.jit
def _level_ranks(part_levels_row, CHUNKS, LEVELS: tl.constexpr, CHUNK_GROUP: tl.constexpr):
    """A head's donor counts by level from its chunks' histograms: (above[l], through[l]), the
    donors above level l and those at it or above (_donor_position's ranks)."""
    levels = tl.arange(0, LEVELS)
    level_counts = sum_chunks(part_levels_row, LEVELS, CHUNKS, levels, levels >= 0, CHUNK_GROUP)
    through = tl.cumsum(level_counts, axis=0, reverse=True)
    return through - level_counts, through


@triton.jit
def _hamming_update_kernel(
    codes_ptr, centroids_ptr, centroid_signs_ptr, flags_in_ptr, flags_out_ptr, level_ptr,
    part_votes_ptr, part_counts_ptr, part_levels_ptr,
    N, C, BITS, CHUNK, CHUNKS, BLOCKS, PER_PROGRAM,
    BLOCK_C: tl.constexpr, COUNT_C: tl.constexpr, BLOCK_BITS: tl.constexpr, LEVELS: tl.constexpr,
    CHUNK_BLOCK: tl.constexpr, CHUNK_GROUP: tl.constexpr, VOTE_GROUP: tl.constexpr, FLAG_BLOCK: tl.constexpr,
    SCAN: tl.constexpr,
):
    """New centroids of PER_PROGRAM clusters of one (batch, head): the majority vote of their
    members' bits (ties to 0), the chunks' signed votes summed in chunk order, and for the e-th empty
    cluster (in cluster order) the code of the e-th farthest query, the padded ones after the
    real ones (more empty clusters than queries: the rest take the last). flags_out says
    whether any of them changed; a head that did not change before is left as it is."""
    block = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    changed = tl.full([], 0, tl.int32)
    if any_set(flags_in_ptr + bh * BLOCKS, BLOCKS, FLAG_BLOCK):
        first_cluster = block * PER_PROGRAM
        last_cluster = tl.minimum(first_cluster + PER_PROGRAM, C)
        # Empty clusters before this program's, from every cluster's member count.
        counts_head = part_counts_ptr + bh * CHUNKS * C
        empties_before = 0
        for c_start in range(0, first_cluster, COUNT_C):
            cols = c_start + tl.arange(0, COUNT_C)
            counts = sum_chunks(counts_head, C, CHUNKS, cols, cols < first_cluster, CHUNK_GROUP)
            empties_before += tl.sum(((counts == 0) & (cols < first_cluster)).to(tl.int32), axis=0)
        bit = tl.arange(0, BLOCK_BITS).to(tl.int64)
        index = tl.arange(0, BLOCK_C)
        for c_start in range(first_cluster, last_cluster, BLOCK_C):
            cols = c_start + index
            in_block = cols < last_cluster
            votes = sum_chunks_2d(part_votes_ptr + bh * CHUNKS * C * BLOCK_BITS, C * BLOCK_BITS, CHUNKS,
                                  cols[:, None] * BLOCK_BITS + bit[None, :], in_block[:, None] & (bit[None, :] >= 0),
                                  VOTE_GROUP)
            members = sum_chunks(counts_head, C, CHUNKS, cols, in_block, CHUNK_GROUP)
            majority = (votes > 0) & (bit[None, :] < BITS)  # ties (votes 0) to 0
            code = tl.sum(majority.to(tl.int64) << bit[None, :], axis=1)
            empty = ((members == 0) & in_block).to(tl.int32)
            block_empties = tl.sum(empty, axis=0)
            if block_empties > 0:
                above, through = _level_ranks(part_levels_ptr + bh * CHUNKS * LEVELS, CHUNKS, LEVELS, CHUNK_GROUP)
                order = tl.cumsum(empty, axis=0) - 1  # each empty cluster's place among the block's
                for e in range(0, block_empties):
                    i = tl.sum(tl.where((empty != 0) & (order == e), index, 0), axis=0)
                    position = _donor_position(level_ptr + bh * N, part_levels_ptr + bh * CHUNKS * LEVELS,
                                               above, through, tl.minimum(empties_before + e, N - 1),
                                               N, CHUNK, CHUNKS, LEVELS, CHUNK_BLOCK, SCAN)
                    code = tl.where(index == i, tl.load(codes_ptr + bh * N + position), code)
            empties_before += block_empties
            old = tl.load(centroids_ptr + bh * C + cols, mask=in_block, other=0)
            changed += tl.sum(((old != code) & in_block).to(tl.int32), axis=0)
            tl.store(centroids_ptr + bh * C + cols, code, mask=in_block)
            tl.store(centroid_signs_ptr + (bh * C + cols)[:, None] * BLOCK_BITS + bit[None, :],
                     code_signs(code, BLOCK_BITS), mask=in_block[:, None])
    tl.store(flags_out_ptr + bh * BLOCKS + block, (changed > 0).to(tl.int32))
