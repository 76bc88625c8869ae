"""Hamming K-means of LSH codes as Triton kernels spread over the whole GPU (the triton
backend's cluster stage; kmeans.hamming_kmeans is the reference it matches).

Each head's queries are cut into chunks of whole BLOCK_N tiles, one program a chunk, enough
programs per head to fill an H100 at batch 1 (kernels.triton.helpers.chunking). Hamming
similarity is the dot product of +-1 sign vectors (bits - 2 x the distance, exact on int8
tensor cores); a cluster's votes are one-hot(cluster) @ bits, exact. When all clusters fit one
tile (C <= BLOCK_C) one Lloyd iteration is one launch, `_hamming_step_kernel`
(hamming_step_triton: each program updates the centroids from the vote totals of the launch
before, then assigns its chunk). More clusters take two:

    _hamming_assign_kernel  (chunks, B * H)   each query's nearest centroid, block of clusters
                            by block, then per chunk the bit votes and member counts of every
                            cluster (a second pass) and a histogram of the donor levels below
    _hamming_update_kernel  (cluster blocks, B * H)   sums the chunks' votes in chunk order
                            (integers: any order gives the same), majority vote (ties to 0),
                            and re-seeds the e-th empty cluster with the e-th farthest query

`_hamming_initial_kernel` places the initial centroids first, and a final launch (FINAL)
writes the assignments. The host loops over the iterations with static shapes: no host
synchronisation, so a call is captured in a CUDA graph. The reference stops once the
centroids repeat; here an iteration whose head did not change in the previous one is
skipped on the device (a flag per head or cluster block), which gives the same.

Donors. A query's level is 1 + its Hamming distance to its centroid (padded queries 0): the
reference's donor order is level descending, then position. The update kernel
(hamming_update_triton) finds the e-th donor from the chunks' level histograms.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from clusterserve.kernels.triton import means
from clusterserve.kernels.triton.hamming_step import (
    _clear_slice,
    _hamming_step_kernel,
    _key_bias,
    _nearest_key,
    _ranked,
)
from clusterserve.kernels.triton.hamming_update import _hamming_update_kernel
from clusterserve.kernels.triton.helpers import (
    any_set,
    chunk_group,
    chunking,
    cluster_block,
    code_signs,
    count_real,
    exact_case,
    mma,
    one_hot,
    pow2_block,
    upcast,
)
from clusterserve.kernels.triton.seeding import seed_positions, seed_range


class VectorSums(NamedTuple):
    """What the final launch sums besides the codes: the query vectors x (B, H, N, D) by
    cluster into buffers (means_triton's, sized for this module's chunking), each chunk's flag
    set in buffers.moved[1] (the refinement's first step reads it) unless its sequence is the
    exact case and not all_moved (set: the means of every head are wanted)."""

    x: Tensor
    buffers: means.Buffers
    all_moved: bool


# Queries per tile (a chunk is whole tiles), centroids per tile of the search and the votes
# (up to BLOCK_C clusters: one launch an iteration, the centroids' signs and the votes in
# registers), and the bit tile of the codes (<= 63 bits). The assignment runs 4 warps (one
# warpgroup of int8 wgmma): at ~255 registers, two programs share an SM where 8 warps fit one.
BLOCK_N = 128
BLOCK_C = 128
BLOCK_BITS = 64
NUM_WARPS = 4
# Queries and clusters per step of the initial placement (a (clusters, queries) int64 match
# matrix) and of the signs it writes.
INITIAL_BLOCK_N = 64
INITIAL_BLOCK_C = 32
# Donor levels: 0 for padded queries, 1 + the Hamming distance (0..63) for real ones.
LEVELS = 128
# Positions per step of a donor's look-up in its chunk, mask bytes per step of a count, and
# int32s per store of the vote totals a step launch clears.
SCAN = 1024
COUNT_BLOCK = 4096
CLEAR_BLOCK = 1024


@triton.jit
def _hamming_initial_kernel(
    codes_ptr, query_mask_ptr, offsets_ptr, centroids_ptr, centroid_signs_ptr, flags_ptr, signs_ptr, votes_clear_ptr,
    H, N, C, CHUNK, CHUNKS, BLOCKS,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_BITS: tl.constexpr, COUNT_BLOCK: tl.constexpr,
    FLAG_BLOCK: tl.constexpr, SIGNS: tl.constexpr, EXACT_CASE: tl.constexpr, CLEAR: tl.constexpr,
    CLEAR_BLOCK: tl.constexpr,
):
    """With SIGNS, each query's code as +-1 signs (B * H, N, BLOCK_BITS) int8, which every
    iteration reads (else the hash wrote them). Cluster j starts at the query of rank
    floor((j + offset) n_real / C) among the real queries, then the padded ones
    (kmeans.initial_centroid_positions; kernels.triton.seeding finds it: in a chunk of real
    queries only, its position follows from its rank; otherwise the chunk's ranks are
    counted). Program (p, bh) writes the clusters whose rank falls in its chunk: each cluster
    has exactly one writer. The
    first program of a head sets its flags (B * H, BLOCKS): iterate, unless EXACT_CASE and no
    more real queries than clusters (the final assignment gives each query its own). With
    CLEAR, the programs zero the first step launch's vote totals (B * H, C, BLOCK_BITS) int32, a
    slice each."""
    bh = tl.program_id(1).to(tl.int64)
    batch, head = bh // H, bh % H
    if CLEAR:
        _clear_slice(votes_clear_ptr + bh * C * BLOCK_BITS, tl.program_id(0), CHUNKS, C * BLOCK_BITS, CLEAR_BLOCK)
    start = tl.program_id(0) * CHUNK
    stop = tl.minimum(start + CHUNK, N)
    mask_row = query_mask_ptr + batch * N
    codes_row = codes_ptr + bh * N
    real_before = count_real(mask_row, 0, start, COUNT_BLOCK)
    real_here = count_real(mask_row, start, stop, COUNT_BLOCK)
    n_real = real_before + real_here + count_real(mask_row, stop, N, COUNT_BLOCK)
    if tl.program_id(0) == 0:
        blocks = tl.arange(0, FLAG_BLOCK)
        iterate = (n_real > C) | (not EXACT_CASE)
        tl.store(flags_ptr + bh * BLOCKS + blocks, tl.zeros([FLAG_BLOCK], tl.int32) + iterate.to(tl.int32),
                 mask=blocks < BLOCKS)
    bit = tl.arange(0, BLOCK_BITS)
    if SIGNS:
        for first in range(start, stop, BLOCK_N):
            rows = first + tl.arange(0, BLOCK_N)
            signs = code_signs(tl.load(codes_row + rows, mask=rows < stop, other=0), BLOCK_BITS)
            tl.store(signs_ptr + (bh * N + rows)[:, None] * BLOCK_BITS + bit[None, :], signs,
                     mask=rows[:, None] < stop)
    offset = tl.load(offsets_ptr + head)
    c_first, c_last = seed_range(n_real, real_before, real_here, offset, C)
    for c_start in range(c_first, c_last, BLOCK_C):
        cols, mine, position = seed_positions(mask_row, start, stop, N, C, n_real, real_before, real_here, offset,
                                              c_start, BLOCK_C, BLOCK_N)
        code = tl.load(codes_row + position, mask=mine, other=0)
        tl.store(centroids_ptr + bh * C + cols, code, mask=mine)
        tl.store(centroid_signs_ptr + (bh * C + cols)[:, None] * BLOCK_BITS + bit[None, :], code_signs(code, BLOCK_BITS),
                 mask=mine[:, None])


@triton.jit
def _hamming_assign_kernel(
    signs_ptr, query_mask_ptr, centroid_signs_ptr, flags_in_ptr, level_ptr,
    part_votes_ptr, part_counts_ptr, part_levels_ptr, assign_ptr,
    H, N, C, CHUNK, CHUNKS, BLOCKS,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_BITS: tl.constexpr, LEVELS: tl.constexpr,
    FLAG_BLOCK: tl.constexpr, COUNT_BLOCK: tl.constexpr,
    FINAL: tl.constexpr, EXACT_CASE: tl.constexpr, UPCAST: tl.constexpr,
):
    """One chunk of one (batch, head), its queries' signs (B * H, N, BLOCK_BITS) int8 against
    the current centroid codes (B * H, C) in blocks of BLOCK_C, on int8 tensor cores.

    An iteration (not FINAL) writes the chunk's votes part_votes (B * H, CHUNKS, C, BLOCK_BITS)
    int32 (the sum of the members' +-1 signs: the majority bit is set where it is > 0) and
    member counts part_counts (B * H, CHUNKS, C), each query's donor level (B * H, N) int8
    and the chunk's level histogram part_levels (B * H, CHUNKS, LEVELS); the assignments go
    to `assign` as scratch and a second pass sums the votes block by block. It does nothing
    when its head's centroids did not change in the previous iteration (flags_in, one per
    cluster block; the first iteration's come from the initial kernel). FINAL writes the
    assignments (B, H, N) int64, padded queries at C, and with EXACT_CASE a sequence with no
    more real queries than clusters gives each its rank.
    """
    chunk = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    batch = bh // H
    start = chunk * CHUNK
    stop = tl.minimum(start + CHUNK, N)
    mask_row = query_mask_ptr + batch * N
    signs_head = signs_ptr + bh * N * BLOCK_BITS
    assign_row = assign_ptr + bh * N
    centroid_signs_head = centroid_signs_ptr + bh * C * BLOCK_BITS
    bit = tl.arange(0, BLOCK_BITS)
    if FINAL:
        active = True
    else:
        active = any_set(flags_in_ptr + bh * BLOCKS, BLOCKS, FLAG_BLOCK)
    if active:
        rank_seen, exact = exact_case(mask_row, start, stop, N, C, COUNT_BLOCK, FINAL and EXACT_CASE)
        cols = tl.arange(0, BLOCK_C)
        histogram = tl.zeros([LEVELS], tl.int32)
        for first in range(start, stop, BLOCK_N):
            rows = first + tl.arange(0, BLOCK_N)
            in_range = rows < stop
            query_signs = tl.load(signs_head + rows[:, None] * BLOCK_BITS + bit[None, :], mask=in_range[:, None],
                                  other=-1)
            best = tl.full([BLOCK_N], -1, tl.int32)
            for c_start in range(0, C, BLOCK_C):
                block_signs = tl.load(centroid_signs_head + (c_start + cols)[:, None] * BLOCK_BITS + bit[None, :],
                                      mask=(c_start + cols)[:, None] < C, other=-1)
                best = tl.maximum(best, tl.max(_nearest_key(query_signs, block_signs, _key_bias(c_start + cols, C),
                                                            UPCAST), axis=1))
            similarity = (best >> 13) - 64  # over all BLOCK_BITS positions
            real = (tl.load(mask_row + rows, mask=in_range, other=0) != 0) & in_range
            cluster = tl.where(real, 8191 - (best & 8191), C)
            if FINAL:
                cluster, rank_seen = _ranked(cluster, real, rank_seen, exact)
                tl.store(assign_row + rows, cluster.to(tl.int64), mask=in_range)
            else:
                level = tl.where(real, 1 + ((BLOCK_BITS - similarity) >> 1), 0)  # 1 + the Hamming distance
                tl.store(level_ptr + bh * N + rows, level.to(tl.int8), mask=in_range)
                histogram += tl.histogram(level, LEVELS, mask=in_range)
                tl.store(assign_row + rows, cluster.to(tl.int64), mask=in_range)
        if not FINAL:
            part = bh * CHUNKS + chunk
            tl.store(part_levels_ptr + part * LEVELS + tl.arange(0, LEVELS), histogram)
            tl.debug_barrier()  # the chunk's assignments, stored above, are read back by other threads
            for c_start in range(0, C, BLOCK_C):
                votes = tl.zeros([BLOCK_C, BLOCK_BITS], tl.int32)
                for first in range(start, stop, BLOCK_N):
                    rows = first + tl.arange(0, BLOCK_N)
                    cluster = tl.load(assign_row + rows, mask=rows < stop, other=C).to(tl.int32)
                    query_signs = tl.load(signs_head + rows[:, None] * BLOCK_BITS + bit[None, :],
                                          mask=rows[:, None] < stop, other=-1)
                    votes += mma(one_hot(cluster, c_start + cols, tl.int8), query_signs, UPCAST).to(tl.int32)
                _store_votes(part_votes_ptr, part_counts_ptr, votes, part, c_start + cols, C, BLOCK_BITS)


@triton.jit
def _store_votes(part_votes_ptr, part_counts_ptr, votes, part, cols, C, BLOCK_BITS: tl.constexpr):
    """A chunk's signed votes of clusters `cols`, and their member counts: every code's last
    bit position is past its bits (<= 63), so each member voted -1 there."""
    bit = tl.arange(0, BLOCK_BITS)
    tl.store(part_votes_ptr + (part * C + cols)[:, None] * BLOCK_BITS + bit[None, :], votes, mask=cols[:, None] < C)
    members = -tl.sum(tl.where(bit[None, :] == BLOCK_BITS - 1, votes, 0), axis=1)
    tl.store(part_counts_ptr + part * C + cols, members, mask=cols < C)


def hamming_kmeans_triton(
    codes: Tensor, query_mask: Tensor, clusters: int, iterations: int, offsets: Tensor, bits: int,
    exact_case: bool = False, sums: VectorSums | None = None, signs: Tensor | None = None,
) -> Tensor:
    """`kmeans.hamming_kmeans` on packed codes (B, H, N) int64 of `bits` bits.

    query_mask: (B, N) bool, True = real query; offsets: (H,) float32 on the codes' device.
    exact_case: a sequence with no more real queries than clusters gives each its own
    (kmeans.one_query_per_cluster). Returns assignments (B, H, N) int64 in [0, C], padded at C.
    sums (C <= BLOCK_C only): the final launch also writes the query vectors' per-chunk sums
    under the assignments it returns (see VectorSums). signs: the codes as +-1 (B * H, N,
    BLOCK_BITS) int8 where the hash wrote them (hash_codes_triton), else the first launch
    writes them. Launches, each of at least chunks x B x H programs: 1 + 1 per iteration + 1
    for C <= BLOCK_C, else 1 + 2 per iteration + 1.
    """
    if sums is not None and clusters > BLOCK_C:
        raise ValueError(f"the vector sums ride on the one-launch iteration: at most {BLOCK_C} clusters")
    run = _kmeans_buffers(codes, query_mask, clusters, bits, signs)
    _initial_launch(run, offsets, write_signs=signs is None, exact_case=exact_case)
    if run.one_block:
        _one_launch_iterations(run, iterations, exact_case, sums)
    else:
        _two_launch_iterations(run, iterations, exact_case)
    return run.assign


class _KMeansRun(NamedTuple):
    """One hamming_kmeans_triton call: its inputs, how it cuts the work (chunks of `chunk`
    queries a head; `blocks` cluster blocks of `per_program` clusters, 1 when one_block, i.e.
    C <= BLOCK_C; `grid` (chunks, B * H)) and the buffers its launches share (shapes in
    _kmeans_buffers)."""

    codes: Tensor
    mask: Tensor
    clusters: int
    bits: int
    chunk: int
    chunks: int
    blocks: int
    per_program: int
    one_block: bool
    centroids: Tensor
    centroid_signs: Tensor
    flags: Tensor
    level: Tensor
    signs: Tensor
    part_levels: Tensor
    assign: Tensor
    totals: Tensor | None
    grid: tuple[int, int]


def _kmeans_buffers(codes: Tensor, query_mask: Tensor, clusters: int, bits: int, signs: Tensor | None) -> _KMeansRun:
    """The grid of a call and the buffers every launch of it reads or writes."""
    b, h, n = codes.shape
    device = codes.device
    chunks, chunk = chunking(n, h, BLOCK_N)
    one_block = clusters <= BLOCK_C
    per_program = cluster_block(clusters)
    blocks = 1 if one_block else triton.cdiv(clusters, per_program)
    mask = query_mask.contiguous()
    pairs = 2 if one_block else 1  # one launch an iteration reads the previous launch's copy
    centroids = torch.empty(b * h, clusters, dtype=torch.int64, device=device)
    centroid_signs = torch.empty(pairs, b * h, clusters, BLOCK_BITS, dtype=torch.int8, device=device)
    flags = torch.empty(2, b * h, blocks, dtype=torch.int32, device=device)
    level = torch.empty(pairs, b * h, n, dtype=torch.int8, device=device)
    if signs is None:
        signs = torch.empty(b * h, n, BLOCK_BITS, dtype=torch.int8, device=device)
    part_levels = torch.empty(pairs, b * h, chunks, LEVELS, dtype=torch.int32, device=device)
    assign = torch.empty(b, h, n, dtype=torch.int64, device=device)
    # One launch an iteration: launch s reads what launch s - 1 wrote: pairs of centroids,
    # flags, levels and histograms (s - 1 at (s + 1) % 2), and three vote totals (it adds to
    # s % 3, reads (s - 1) % 3, clears (s + 1) % 3 for the next); the initial launch clears the
    # first launch's.
    totals = torch.empty(3, b * h, clusters, BLOCK_BITS, dtype=torch.int32, device=device) if one_block else None
    return _KMeansRun(codes, mask, clusters, bits, chunk, chunks, blocks, per_program, one_block, centroids,
                      centroid_signs, flags, level, signs, part_levels, assign, totals, grid=(chunks, b * h))


def _initial_launch(run: _KMeansRun, offsets: Tensor, write_signs: bool, exact_case: bool) -> None:
    """The initial centroids, their flags and (write_signs) the codes' signs."""
    h, n = run.codes.shape[1:]
    _hamming_initial_kernel[run.grid](  # without the totals nothing is cleared: the codes stand in
        run.codes, run.mask, offsets, run.centroids, run.centroid_signs[-1], run.flags[1], run.signs,
        run.totals[0] if run.one_block else run.codes,
        h, n, run.clusters, run.chunk, run.chunks, run.blocks,
        BLOCK_N=min(BLOCK_N, INITIAL_BLOCK_N), BLOCK_C=INITIAL_BLOCK_C, BLOCK_BITS=BLOCK_BITS, COUNT_BLOCK=COUNT_BLOCK,
        FLAG_BLOCK=pow2_block(run.blocks, 1), SIGNS=write_signs, EXACT_CASE=exact_case, CLEAR=run.one_block,
        CLEAR_BLOCK=CLEAR_BLOCK,
    )


def _one_launch_iterations(run: _KMeansRun, iterations: int, exact_case: bool, sums: VectorSums | None) -> None:
    """C <= BLOCK_C: one _hamming_step_kernel launch an iteration, then the final one, which
    writes the assignments (and with `sums` the vector sums under them)."""
    b, h, n = run.codes.shape
    clusters, chunks, totals = run.clusters, run.chunks, run.totals
    block_c = pow2_block(clusters, 16, BLOCK_C)
    scratch = torch.empty(b * h, chunks, block_c, BLOCK_BITS, dtype=torch.int8, device=run.codes.device)
    d = sums.x.shape[-1] if sums is not None else 1
    # Launches that sum nothing get stand-ins, never read.
    no_sums = (run.codes, totals, totals, totals, 0, 0, 0, 0)
    summed = (sums.x, sums.buffers.part_sums, sums.buffers.part_counts, sums.buffers.moved[1],
              *sums.x.stride()) if sums is not None else no_sums
    step = dict(BLOCK_N=BLOCK_N, BLOCK_C=block_c, BLOCK_BITS=BLOCK_BITS, LEVELS=LEVELS,
                CHUNK_BLOCK=pow2_block(chunks, 1), CHUNK_GROUP=chunk_group(chunks), SCAN=SCAN,
                COUNT_BLOCK=COUNT_BLOCK, CLEAR_BLOCK=CLEAR_BLOCK, SUMS_BLOCK_N=means.BLOCK_N,
                SUMS_BLOCK_C=means.sums_block(clusters), HEAD_DIM=pow2_block(d),
                ALL_MOVED=sums is not None and sums.all_moved, UPCAST=upcast(run.codes), num_warps=NUM_WARPS)
    for s in range(iterations + 1):
        before, now = (s + 1) % 2, s % 2
        final = s == iterations
        _hamming_step_kernel[run.grid](
            run.codes, run.signs, run.mask, run.flags[before], run.flags[now], run.centroid_signs[before],
            run.centroid_signs[now], totals[(s + 2) % 3], totals[s % 3], totals[(s + 1) % 3],
            run.level[before], run.level[now], run.part_levels[before], run.part_levels[now], run.assign, scratch,
            *(summed if final else no_sums),
            h, n, clusters, run.bits, run.chunk, chunks, d,
            FIRST=s == 0, FINAL=final, EXACT_CASE=exact_case, SUMS=final and sums is not None, **step,
        )


def _two_launch_iterations(run: _KMeansRun, iterations: int, exact_case: bool) -> None:
    """C > BLOCK_C: an assignment and an update launch an iteration, then the final
    assignment."""
    b, h, n = run.codes.shape
    clusters, chunks, blocks, per_program = run.clusters, run.chunks, run.blocks, run.per_program
    device = run.codes.device
    part_votes = torch.empty(b * h, chunks, clusters, BLOCK_BITS, dtype=torch.int32, device=device)
    part_counts = torch.empty(b * h, chunks, clusters, dtype=torch.int32, device=device)
    common = dict(BLOCK_BITS=BLOCK_BITS, LEVELS=LEVELS, FLAG_BLOCK=pow2_block(blocks, 1))
    assign_blocks = dict(BLOCK_N=BLOCK_N, BLOCK_C=BLOCK_C, COUNT_BLOCK=COUNT_BLOCK, UPCAST=upcast(run.codes),
                         num_warps=NUM_WARPS)
    signs, mask = run.signs, run.mask
    centroid_signs, level, part_levels = run.centroid_signs[-1], run.level[0], run.part_levels[0]  # one copy each
    for it in range(iterations):
        flags_in, flags_out = run.flags[(it + 1) % 2], run.flags[it % 2]
        _hamming_assign_kernel[run.grid](
            signs, mask, centroid_signs, flags_in, level, part_votes, part_counts, part_levels, run.assign,
            h, n, clusters, run.chunk, chunks, blocks,
            FINAL=False, EXACT_CASE=False, **assign_blocks, **common,
        )
        _hamming_update_kernel[(blocks, b * h)](
            run.codes, run.centroids, centroid_signs, flags_in, flags_out, level, part_votes, part_counts, part_levels,
            n, clusters, run.bits, run.chunk, chunks, blocks, per_program,
            BLOCK_C=min(per_program, 16), COUNT_C=pow2_block(clusters, 16, 256), CHUNK_BLOCK=pow2_block(chunks, 1),
            CHUNK_GROUP=chunk_group(chunks), VOTE_GROUP=max(1, 4096 // (min(per_program, 16) * BLOCK_BITS)), SCAN=SCAN,
            **common,
        )
    _hamming_assign_kernel[run.grid](
        signs, mask, centroid_signs, run.flags, level, part_votes, part_counts, part_levels, run.assign,
        h, n, clusters, run.chunk, chunks, blocks,
        FINAL=True, EXACT_CASE=exact_case, **assign_blocks, **common,
    )
