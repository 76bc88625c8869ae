"""One Lloyd iteration of the Triton Hamming K-means in one launch, when all of a head's
clusters fit one tile (hamming_triton runs it for C <= BLOCK_C, the defaults among them):

    _hamming_step_kernel  (chunks, B * H)  the previous iteration's update, then this
                          iteration's assignment. Every program of a head reads the head's
                          vote totals from the launch before (each chunk's votes added with
                          integer atomics: the same sums in any order), takes the majority
                          vote (ties to 0) and re-seeds the empty clusters from the farthest
                          queries as _hamming_update_kernel does, so all of them hold the same
                          new centroids; it then assigns its chunk's queries and adds the
                          chunk's votes to this launch's totals.

With SUMS, the final launch also sums the chunk's query vectors by cluster under the final
assignments, one-hot(cluster) @ rows, as the Euclidean refinement's first step (or the
centroids) needs them (means_triton's per-chunk sums and flags).

No program reads what another program of its launch writes. Launch s (s = 0 .. iterations; the last one FINAL writes the
assignments) reads the centroids (as +-1 signs), flags, levels and level histograms of launch
s - 1 and writes its own in the other half of a pair (the first program of a head writes the
centroids and the flag); its votes go to totals[s % 3], it reads totals[(s - 1) % 3] and
clears totals[(s + 1) % 3], a slice a program, for launch s + 1. A head whose centroids did
not change stops assigning, as the reference stops, and keeps its centroids.
"""

from __future__ import annotations

import triton
import triton.language as tl

from clusterserve.kernels.triton.hamming_update import _donor_position, _level_ranks
from clusterserve.kernels.triton.helpers import code_signs, exact_case, mma, one_hot
from clusterserve.kernels.triton.means import chunk_sums


@triton.jit
def _key_bias(cols, C):
    """KEY_SCALE - 1 - cluster for the clusters `cols`, far below any key past C."""
    return tl.where(cols < C, 8191 - cols, -(1 << 30))


@triton.jit
def _nearest_key(query_signs, centroid_signs, bias, UPCAST: tl.constexpr):
    """(64 + similarity) x KEY_SCALE + bias of each query and centroid (similarity: the +-1
    dot product over BLOCK_BITS, bits - 2 x the Hamming distance, exact in int32; bias from
    _key_bias): the largest key is the nearest centroid, ties to the lowest cluster, in one
    max. KEY_SCALE = 2^13 > any cluster index (spec.clusters <= 4096)."""
    similarity = mma(query_signs, tl.trans(centroid_signs), UPCAST).to(tl.int32)
    return ((64 + similarity) << 13) + bias[None, :]


@triton.jit
def _ranked(cluster, real, rank_seen, exact):
    """A tile's clusters, each real query's its rank among the real ones in the exact case (no
    more real queries than clusters), and the real queries seen after the tile."""
    rank = rank_seen + tl.cumsum(real.to(tl.int32), axis=0) - 1
    return tl.where(exact & real, rank, cluster), rank_seen + tl.sum(real.to(tl.int32), axis=0)


@triton.jit
def _clear_slice(row_ptr, chunk, CHUNKS, SIZE, BLOCK: tl.constexpr):
    """Zero program `chunk`'s share of SIZE int32s: one writer each."""
    per_chunk = tl.cdiv(SIZE, CHUNKS)
    lo = chunk * per_chunk
    hi = tl.minimum(lo + per_chunk, SIZE)
    for first in range(lo, hi, BLOCK):
        slots = first + tl.arange(0, BLOCK)
        tl.store(row_ptr + slots, tl.zeros([BLOCK], tl.int32), mask=slots < hi)


@triton.jit
def _majority_signs(votes_head, C, BITS, BLOCK_C: tl.constexpr, BLOCK_BITS: tl.constexpr):
    """A head's centroids as +-1 signs (BLOCK_C, BLOCK_BITS) int8 from its vote totals: +1
    where the majority of the members' bit is set (ties to 0, as are the bits past BITS and
    the rows past C), and which clusters are empty (int32 flags)."""
    cols = tl.arange(0, BLOCK_C)
    bit = tl.arange(0, BLOCK_BITS)
    votes = tl.load(votes_head + cols[:, None] * BLOCK_BITS + bit[None, :], mask=cols[:, None] < C, other=0)
    # Every code's last bit position is past its bits: each member voted -1 there.
    members = -tl.sum(tl.where(bit[None, :] == BLOCK_BITS - 1, votes, 0), axis=1)
    signs = tl.where((votes > 0) & (bit[None, :] < BITS), 1, -1).to(tl.int8)
    return signs, ((members == 0) & (cols < C)).to(tl.int32)


@triton.jit
def _hamming_step_kernel(
    codes_ptr, signs_ptr, query_mask_ptr, flags_in_ptr, flags_out_ptr, centroids_in_ptr, centroids_out_ptr,
    votes_in_ptr, votes_out_ptr, votes_clear_ptr, level_in_ptr, level_out_ptr,
    part_levels_in_ptr, part_levels_out_ptr, assign_ptr, scratch_ptr,
    x_ptr, part_sums_ptr, part_counts_ptr, moved_ptr,
    stride_xb, stride_xh, stride_xn, stride_xd,
    H, N, C, BITS, CHUNK, CHUNKS, D,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_BITS: tl.constexpr, LEVELS: tl.constexpr,
    CHUNK_BLOCK: tl.constexpr, CHUNK_GROUP: tl.constexpr, SCAN: tl.constexpr, COUNT_BLOCK: tl.constexpr,
    CLEAR_BLOCK: tl.constexpr, FIRST: tl.constexpr, FINAL: tl.constexpr, EXACT_CASE: tl.constexpr,
    SUMS: tl.constexpr, ALL_MOVED: tl.constexpr, SUMS_BLOCK_N: tl.constexpr, SUMS_BLOCK_C: tl.constexpr,
    HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr,
):
    """One chunk of one (batch, head), C <= BLOCK_C clusters, the centroids as +-1 signs
    (B * H, C, BLOCK_BITS) int8. Centroids: FIRST, the initial ones (centroids_in); else, where
    the head assigned in the launch before (flags_in), the update of its totals (votes_in,
    level_in, part_levels_in), otherwise those it kept (centroids_in). Not FINAL: the first
    program writes them to centroids_out and whether the head assigns in this launch (FIRST:
    the initial flag; else: its centroids changed) to flags_out; where it
    does, each program adds its chunk's signed votes (B * H, C, BLOCK_BITS) int32 to votes_out
    and writes its queries' donor levels (level_out, int8) and their histogram (part_levels_out).
    FINAL writes the assignments (B, H, N) int64, padded queries at C, and with EXACT_CASE a
    sequence with no more real queries than clusters gives each its rank; with SUMS, the
    chunk's sums of x (B, H, N, D) by cluster (part_sums (B * H, CHUNKS, C, D) float32,
    part_counts (B * H, CHUNKS, C) int32) and its flag in moved (B * H, CHUNKS): set, unless
    the sequence is the exact case and not ALL_MOVED (the refinement then has nothing to move).
    `scratch` is the program's own."""
    chunk = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    batch = bh // H
    start = chunk * CHUNK
    stop = tl.minimum(start + CHUNK, N)
    mask_row = query_mask_ptr + batch * N
    signs_head = signs_ptr + bh * N * BLOCK_BITS
    cols = tl.arange(0, BLOCK_C)
    bit = tl.arange(0, BLOCK_BITS)
    in_c = cols < C
    if not FINAL:
        _clear_slice(votes_clear_ptr + bh * C * BLOCK_BITS, chunk, CHUNKS, C * BLOCK_BITS, CLEAR_BLOCK)
    ran = tl.load(flags_in_ptr + bh) != 0
    centroids_head = (bh * C + cols)[:, None] * BLOCK_BITS + bit[None, :]
    old = tl.load(centroids_in_ptr + centroids_head, mask=in_c[:, None], other=-1)
    centroid_signs = old
    if FIRST:
        assigns = ran
    else:
        if ran:
            centroid_signs, empty = _majority_signs(votes_in_ptr + bh * C * BLOCK_BITS, C, BITS, BLOCK_C, BLOCK_BITS)
            n_empty = tl.sum(empty, axis=0)
            if n_empty > 0:
                # The e-th empty cluster (cluster order) takes the code of the e-th farthest
                # query, the last one past N (_hamming_update_kernel's rule).
                part_levels_row = part_levels_in_ptr + bh * CHUNKS * LEVELS
                above, through = _level_ranks(part_levels_row, CHUNKS, LEVELS, CHUNK_GROUP)
                order = tl.cumsum(empty, axis=0) - 1
                for e in range(0, n_empty):
                    i = tl.sum(tl.where((empty != 0) & (order == e), cols, 0), axis=0)
                    position = _donor_position(level_in_ptr + bh * N, part_levels_row, above, through,
                                               tl.minimum(e, N - 1), N, CHUNK, CHUNKS, LEVELS, CHUNK_BLOCK, SCAN)
                    donor = code_signs(tl.load(codes_ptr + bh * N + position + tl.zeros([1], tl.int64)), BLOCK_BITS)
                    centroid_signs = tl.where((cols == i)[:, None], donor, centroid_signs)
        assigns = tl.sum(tl.sum((centroid_signs != old).to(tl.int32), axis=1), axis=0) > 0
    if not FINAL:
        if chunk == 0:
            tl.store(centroids_out_ptr + centroids_head, centroid_signs, mask=in_c[:, None])
            tl.store(flags_out_ptr + bh, assigns.to(tl.int32))
        # Through this program's own scratch (B * H, CHUNKS, BLOCK_C, BLOCK_BITS): signs computed
        # in registers here made ptxas spill the loop below (152 bytes on sm_90); loaded, they
        # enter it as the first launch's do.
        scratch = scratch_ptr + ((bh * CHUNKS + chunk) * BLOCK_C + cols)[:, None] * BLOCK_BITS + bit[None, :]
        tl.store(scratch, centroid_signs)
        tl.debug_barrier()
        centroid_signs = tl.load(scratch)
    if assigns | FINAL:
        bias = _key_bias(cols, C)
        rank_seen, exact = exact_case(mask_row, start, stop, N, C, COUNT_BLOCK, FINAL and EXACT_CASE)
        histogram = tl.zeros([LEVELS], tl.int32)
        votes = tl.zeros([BLOCK_C, BLOCK_BITS], tl.int32)
        for first in range(start, stop, BLOCK_N):
            rows = first + tl.arange(0, BLOCK_N)
            in_range = rows < stop
            query_signs = tl.load(signs_head + rows[:, None] * BLOCK_BITS + bit[None, :], mask=in_range[:, None],
                                  other=-1)
            best = tl.max(_nearest_key(query_signs, centroid_signs, bias, UPCAST), axis=1)
            real = (tl.load(mask_row + rows, mask=in_range, other=0) != 0) & in_range
            cluster = tl.where(real, 8191 - (best & 8191), C)
            if FINAL:
                cluster, rank_seen = _ranked(cluster, real, rank_seen, exact)
                tl.store(assign_ptr + bh * N + rows, cluster.to(tl.int64), mask=in_range)
            else:
                level = tl.where(real, 1 + ((BLOCK_BITS - ((best >> 13) - 64)) >> 1), 0)  # 1 + the Hamming distance
                tl.store(level_out_ptr + bh * N + rows, level.to(tl.int8), mask=in_range)
                histogram += tl.histogram(level, LEVELS, mask=in_range)
                votes += mma(one_hot(cluster, cols, tl.int8), query_signs, UPCAST).to(tl.int32)
        if not FINAL:
            tl.store(part_levels_out_ptr + (bh * CHUNKS + chunk) * LEVELS + tl.arange(0, LEVELS), histogram)
            # Integer sums: the totals are the same whatever order the chunks add in.
            tl.atomic_add(votes_out_ptr + (bh * C + cols)[:, None] * BLOCK_BITS + bit[None, :], votes,
                          mask=in_c[:, None], sem="relaxed")
        if FINAL and SUMS:
            tl.debug_barrier()  # the assignments, stored above, are read back by other threads
            chunk_sums(x_ptr + batch * stride_xb + (bh % H) * stride_xh, assign_ptr + bh * N,
                       part_sums_ptr + (bh * CHUNKS + chunk) * C * D, part_counts_ptr + (bh * CHUNKS + chunk) * C,
                       start, stop, C, D, stride_xn, stride_xd, SUMS_BLOCK_N, SUMS_BLOCK_C, HEAD_DIM, UPCAST)
            if ALL_MOVED:
                tl.store(moved_ptr + bh * CHUNKS + chunk, 1)
            else:
                tl.store(moved_ptr + bh * CHUNKS + chunk, 1 - exact.to(tl.int32))
