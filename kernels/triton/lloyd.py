"""Euclidean Lloyd steps on the query vectors as Triton kernels spread over the whole GPU (the
triton backend's refine stage; kmeans.refine_clusters is the reference they match). The
sums and means of each step are means_triton's.

Each head's queries are cut into chunks of whole BLOCK_N tiles, one program a chunk
(kernels.triton.helpers.chunking). Per chunk, cluster sums are one-hot(cluster) @ rows on tensor
cores, written per chunk and summed over the chunks in chunk order by the next launch: the
result does not depend on which program ran first. A refinement step from assignments A (the
candidates' and donors' kernels are kernels.triton.donors'):

    _means_kernel       (cluster blocks, B * H)  member means and counts of A, and the list of
                        empty clusters (means_triton)
    _candidates_kernel  (chunks, B * H)  only where a cluster is empty: per chunk, its
                        queries farthest from their means, as sorted keys
                        (where the means fit CANDIDATES_FUSED_TILE, the two are one
                        launch, _means_candidates_kernel: a chunk's program sums the
                        head's means itself where a cluster is empty)
    _donor_kernel       (chunks, B * H)  only where a cluster is empty, and only for more
                        means than one tile of the nearest-mean search holds: the e-th
                        farthest query of the head (ranked across the chunks' candidates)
                        becomes the e-th empty cluster's centroid
    _nearest_kernel     (chunks, B * H)  argmax_c 2 x.c - |c|^2 (ties to the lowest cluster),
                        x in its dtype against the float32 means (split-precision dots), the
                        chunk's sums under the new assignments for the next step (after the
                        last step: for the final means, where the caller wants them); with
                        the means in one tile, it merges the chunks' candidates and puts the
                        donors in place itself (only where a cluster is empty)

`_sums_kernel` (means_triton) or the Hamming K-means' final launch writes the starting sums.
Without LSH codes (spec.bits 0) the seed queries are the first means (kernels.triton.seeding)
and a nearest-mean step gives each query its nearest seed (kmeans.seeded_clusters), with the
chunk sums of the first refinement step.
The reference stops once the assignments repeat; here a head none of whose queries moved in the
previous step skips the rest on the device. No host synchronisation: one call is a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from clusterserve.kernels.triton import means
from clusterserve.kernels.triton.donors import NO_KEY, _candidates_kernel, _donated, _donor_kernel, _means_candidates_kernel
from clusterserve.kernels.triton.helpers import (
    any_set,
    chunking,
    dot_parts,
    dot_split_right,
    exact_case,
    pow2_block,
    split_parts,
    upcast,
)
from clusterserve.kernels.triton.means import chunk_sums, load_rows
from clusterserve.kernels.triton.seeding import seed_means_triton

# Means per tile of the nearest-mean search: up to this many, they are read and split into
# half-precision parts once per program (more: tiles of NEAREST_NARROW_C).
NEAREST_BLOCK_C = 256
# Warps of the nearest-mean search: with tiles of up to 128 means, 4 warps (~245 registers)
# fit two programs an SM where 8 fit one; wider tiles need 8 (4 would run out of registers).
NEAREST_NARROW_C = 128
# Half-precision parts of the means in the nearest-mean dots (helpers.dot_parts): two keep a
# choice within ~1e-5 of a tie of float32's, for one tensor-core dot a tile fewer.
NEAREST_PARTS = tl.constexpr(2)
# The means and the donors' candidates take one launch where the head's means fit one float32
# tile of this many elements (each program with an empty cluster to fill sums them all: 128
# clusters x 64 dims, 64 registers a thread at 4 warps; a larger tile spills).
CANDIDATES_FUSED_TILE = 128 * 64


@triton.jit
def _nearest_kernel(
    x_ptr, query_mask_ptr, means_ptr, moved_in_ptr, moved_out_ptr, assign_ptr, part_sums_ptr, part_counts_ptr,
    members_ptr, n_empty_ptr, candidates_ptr,
    stride_xb, stride_xh, stride_xn, stride_xd,
    H, N, C, D, CHUNK, CHUNKS,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, HEAD_DIM: tl.constexpr, CHUNK_BLOCK: tl.constexpr,
    COUNT_BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr,
    EXACT_CASE: tl.constexpr, MEANS: tl.constexpr, UPCAST: tl.constexpr, TOP: tl.constexpr, TOP_ALL: tl.constexpr,
    NO_KEY: tl.constexpr,
):
    """One chunk's nearest means (B * H, C, D) float32, written to assign (B, H, N) in place,
    padded queries at C; moved_out (B * H, CHUNKS) says whether any query moved. Unless LAST,
    the chunk's sums and counts under the new assignments. A head that did not move in the
    previous step (moved_in) keeps its assignments; with FIRST there are none before (the seeds'
    step, kernels.triton.seeding): every real query moves. With all the means in one tile (ONE_BLOCK),
    the empty clusters' donors replace their means here (_donated; else _donor_kernel wrote
    them). LAST with EXACT_CASE: a sequence with no
    more real queries than clusters gives each its rank among them. LAST with MEANS: every
    chunk's sums and counts under the final assignments, and moved_out set (the means
    launch after it reads every head)."""
    chunk = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    batch = bh // H
    start = chunk * CHUNK
    stop = tl.minimum(start + CHUNK, N)
    x_head = x_ptr + batch * stride_xb + (bh % H) * stride_xh
    assign_row = assign_ptr + bh * N
    mask_row = query_mask_ptr + batch * N
    dims = tl.arange(0, HEAD_DIM)
    moved = tl.full([], 0, tl.int32)
    if any_set(moved_in_ptr + bh * CHUNKS, CHUNKS, CHUNK_BLOCK):
        if ONE_BLOCK:  # loop invariant: the means, split once for the half-precision dots
            cols = tl.arange(0, BLOCK_C)
            centroids = tl.load(means_ptr + (bh * C + cols)[:, None] * D + dims[None, :],
                                mask=(cols[:, None] < C) & (dims[None, :] < D), other=0.0)
            empties = tl.load(n_empty_ptr + bh)
            donor_lists = tl.where(empties > 0, CHUNKS, 0)
            centroids = _donated(centroids, cols, x_head, stride_xn, stride_xd, members_ptr + bh * C, empties,
                                 candidates_ptr + bh * CHUNKS * TOP, donor_lists, N, C, D, HEAD_DIM, TOP, TOP_ALL,
                                 NO_KEY)
            bias = tl.where(cols < C, -tl.sum(centroids * centroids, axis=1), float("-inf"))
            centroids = tl.trans(centroids)
            parts = split_parts(centroids, x_ptr.dtype.element_ty)  # unused for float32 queries
        for first in range(start, stop, BLOCK_N):
            rows = first + tl.arange(0, BLOCK_N)
            x = load_rows(x_head, rows, stop, D, stride_xn, stride_xd, HEAD_DIM)
            if ONE_BLOCK:
                # argmin |x - c|^2 = argmax 2 x.c - |c|^2, ties to the lowest cluster
                if x_ptr.dtype.element_ty == tl.float32:
                    scores = 2 * tl.dot(x, centroids, input_precision="ieee") + bias[None, :]
                else:
                    scores = 2 * dot_parts(x, parts, UPCAST, NEAREST_PARTS) + bias[None, :]
                best_cluster = tl.argmax(scores, axis=1).to(tl.int64)
            else:
                best = tl.full([BLOCK_N], float("-inf"), tl.float32)
                best_cluster = tl.zeros([BLOCK_N], tl.int64)
                for c_start in range(0, C, BLOCK_C):
                    cols = c_start + tl.arange(0, BLOCK_C)
                    centroids = tl.load(means_ptr + (bh * C + cols)[:, None] * D + dims[None, :],
                                        mask=(cols[:, None] < C) & (dims[None, :] < D), other=0.0)
                    scores = (2 * dot_split_right(x, tl.trans(centroids), UPCAST, NEAREST_PARTS)
                              - tl.sum(centroids * centroids, axis=1)[None, :])
                    scores = tl.where(cols[None, :] < C, scores, float("-inf"))
                    block_best = tl.max(scores, axis=1)
                    block_cluster = (c_start + tl.argmax(scores, axis=1)).to(tl.int64)
                    closer = block_best > best  # strictly: an earlier block keeps its ties
                    best = tl.where(closer, block_best, best)
                    best_cluster = tl.where(closer, block_cluster, best_cluster)
            real = tl.load(mask_row + rows, mask=rows < stop, other=0) != 0
            cluster = tl.where(real, best_cluster, C)
            if FIRST:  # no assignments before: every real query moves
                moved += tl.sum(real.to(tl.int32), axis=0)
            else:
                old = tl.load(assign_row + rows, mask=rows < stop, other=C)
                moved += tl.sum(((old != cluster) & (rows < stop)).to(tl.int32), axis=0)
            tl.store(assign_row + rows, cluster, mask=rows < stop)
        if not LAST:
            tl.debug_barrier()  # the assignments, stored above, are read back by other threads
            chunk_sums(x_head, assign_row, part_sums_ptr + (bh * CHUNKS + chunk) * C * D,
                       part_counts_ptr + (bh * CHUNKS + chunk) * C, start, stop, C, D, stride_xn, stride_xd,
                       BLOCK_N, BLOCK_C, HEAD_DIM, UPCAST)
    if LAST and EXACT_CASE:
        rank_seen, exact = exact_case(mask_row, start, stop, N, C, COUNT_BLOCK, True)
        if exact:
            for first in range(start, stop, BLOCK_N):
                rows = first + tl.arange(0, BLOCK_N)
                real = (tl.load(mask_row + rows, mask=rows < stop, other=0) != 0) & (rows < stop)
                rank = rank_seen + tl.cumsum(real.to(tl.int32), axis=0) - 1
                tl.store(assign_row + rows, tl.where(real, rank.to(tl.int64), C), mask=rows < stop)
                rank_seen += tl.sum(real.to(tl.int32), axis=0)
    if LAST and MEANS:
        tl.debug_barrier()  # the final assignments, stored above, are read back by other threads
        chunk_sums(x_head, assign_row, part_sums_ptr + (bh * CHUNKS + chunk) * C * D,
                   part_counts_ptr + (bh * CHUNKS + chunk) * C, start, stop, C, D, stride_xn, stride_xd,
                   BLOCK_N, BLOCK_C, HEAD_DIM, UPCAST)
        moved = 1
    tl.store(moved_out_ptr + bh * CHUNKS + chunk, (moved > 0).to(tl.int32))



def refine_clusters_triton(
    q: Tensor, assign: Tensor, query_mask: Tensor, clusters: int, iterations: int, exact_case: bool = False
) -> Tensor:
    """`kmeans.refine_clusters`: Lloyd steps with Euclidean distance from `assign`.

    q: (B, H, N, D) float32, float16 or bfloat16; assign (B, H, N) in [0, C]; query_mask
    (B, N) bool. Returns (B, H, N) int64 in [0, C], padded queries at C; with exact_case a
    sequence with no more real queries than clusters gives each its own (its rank).
    Launches: 1 + 2 per step where the means fit CANDIDATES_FUSED_TILE, else 3 (4 past NEAREST_BLOCK_C
    clusters).
    """
    b, h, n, _ = q.shape
    if iterations == 0:
        return assign.clone()
    chunks, chunk = chunking(n, h, means.BLOCK_N)
    buffers = refine_buffers(q, clusters, chunk, chunks)
    out = torch.empty(b, h, n, dtype=torch.int64, device=q.device)
    means.sums(q, assign, query_mask.contiguous(), out, buffers, clusters, chunk, chunks, exact_case)
    _refine(q, out, query_mask, clusters, iterations, exact_case, buffers, chunk, with_means=False)
    return out


def refine_buffers(q: Tensor, clusters: int, chunk: int, chunks: int) -> means.Buffers:
    """The scratch of a refinement of q (B, H, N, D) whose programs take chunks of `chunk`
    queries (a whole number of means.BLOCK_N)."""
    return means.Buffers(q, clusters, chunks, pow2_block(min(clusters, chunk), 1))


def refine_summed_triton(
    q: Tensor, assign: Tensor, query_mask: Tensor, clusters: int, iterations: int, buffers: means.Buffers,
    chunk: int, exact_case: bool = False,
) -> Tensor:
    """refine_clusters_triton (iterations >= 1) of assign in place, from its per-chunk sums and
    flags already in buffers (refine_buffers; hamming_triton's final launch writes them), and
    the member means of the result in buffers.means (B * H, C, D): the last step sums them as
    it assigns. Launches: 1 + 2 per step where the means fit CANDIDATES_FUSED_TILE, else 3 (4 past
    NEAREST_BLOCK_C clusters)."""
    _refine(q, assign, query_mask, clusters, iterations, exact_case, buffers, chunk, with_means=True)
    return assign


def seed_clusters_triton(q: Tensor, query_mask: Tensor, clusters: int, offsets: Tensor,
                         exact_case: bool = False) -> Tensor:
    """`kmeans.seeded_clusters`: each query to its nearest seed query (B, H, N) int64 in [0, C],
    padded queries at C; with exact_case a sequence with no more real queries than clusters
    gives each its own. offsets (H,) float32 on q's device (kmeans.initial_offsets). Two
    launches: the seeds, then one nearest-mean step."""
    b, h, n, _ = q.shape
    chunks, chunk = chunking(n, h, means.BLOCK_N)
    buffers = refine_buffers(q, clusters, chunk, chunks)
    out = torch.empty(b, h, n, dtype=torch.int64, device=q.device)
    _seed_step(q, out, query_mask.contiguous(), clusters, offsets, buffers, chunk, last=True, exact_case=exact_case,
               with_means=False)
    return out


def seeded_summed_triton(q: Tensor, query_mask: Tensor, clusters: int, offsets: Tensor, iterations: int,
                         buffers: means.Buffers, chunk: int, exact_case: bool = False) -> Tensor:
    """seed_clusters_triton, then `iterations` Lloyd steps (refine_summed_triton's), the member
    means of the result in buffers.means (B * H, C, D): buffers from refine_buffers for chunks
    of `chunk` queries. The seeds' nearest-mean step sums the chunks for the first step.
    Launches: the seeds and their step, then refine_summed_triton's (two a step and the
    means), or the means alone without a step."""
    b, h, n, _ = q.shape
    out = torch.empty(b, h, n, dtype=torch.int64, device=q.device)
    mask = query_mask.contiguous()
    _seed_step(q, out, mask, clusters, offsets, buffers, chunk, last=not iterations, exact_case=exact_case,
               with_means=True)
    if iterations:
        _refine(q, out, mask, clusters, iterations, exact_case, buffers, chunk, with_means=True)
    else:
        means.means(q, buffers, buffers.moved[1], clusters, buffers.part_sums.shape[1])
    return out


def _seed_step(q: Tensor, out: Tensor, mask: Tensor, clusters: int, offsets: Tensor, buffers: means.Buffers,
               chunk: int, last: bool, exact_case: bool, with_means: bool) -> None:
    """The seeds as buffers' first means, flagged in buffers.moved[0], then the first
    nearest-mean step to out, its flags in buffers.moved[1] (where a refinement's first step
    reads them)."""
    seed_means_triton(q, mask, offsets, buffers, buffers.moved[0], chunk)
    _nearest_step(q, out, mask, buffers, chunk, buffers.moved[0], buffers.moved[1], _nearest_meta(q, clusters, buffers),
                  last=last, exact_case=exact_case, with_means=with_means, first=True)


def _nearest_meta(q: Tensor, clusters: int, buffers: means.Buffers) -> dict:
    """The compile-time arguments of a refinement's _nearest_kernel launches (one set per
    refinement: the host work of each launch is the launch)."""
    n, d = q.shape[2:]
    chunks = buffers.part_sums.shape[1]
    top = buffers.candidates.shape[-1]
    block_c = pow2_block(clusters, 16, NEAREST_BLOCK_C if clusters <= NEAREST_BLOCK_C else NEAREST_NARROW_C)
    return dict(BLOCK_N=means.BLOCK_N, BLOCK_C=block_c, COUNT_BLOCK=means.COUNT_BLOCK,
                ONE_BLOCK=clusters <= block_c,  # the nearest-mean search takes the donors itself
                UPCAST=upcast(q), TOP=top, TOP_ALL=max(top, pow2_block(min(clusters, n), 1)), NO_KEY=NO_KEY,
                HEAD_DIM=pow2_block(d), CHUNK_BLOCK=pow2_block(chunks, 1),
                num_warps=4 if block_c <= NEAREST_NARROW_C else 8)


def _nearest_step(q: Tensor, out: Tensor, mask: Tensor, buffers: means.Buffers, chunk: int, moved_in: Tensor,
                  moved_out: Tensor, meta: dict, last: bool, exact_case: bool, with_means: bool,
                  first: bool = False) -> None:
    """One launch of _nearest_kernel on a refinement in buffers (meta: _nearest_meta's), chunks
    of `chunk` queries: each query's nearest of buffers.means to out (B, H, N) in place
    (`first`: out holds no assignments yet), and unless `last` (or with `with_means`) the
    chunks' sums."""
    b, h, n, d = q.shape
    chunks = buffers.part_sums.shape[1]
    _nearest_kernel[(chunks, b * h)](
        q, mask, buffers.means, moved_in, moved_out, out, buffers.part_sums, buffers.part_counts, buffers.members,
        buffers.n_empty, buffers.candidates, *q.stride(),
        h, n, buffers.means.shape[1], d, chunk, chunks,
        FIRST=first, LAST=last, EXACT_CASE=exact_case, MEANS=with_means, **meta,
    )


def _refine(q: Tensor, out: Tensor, query_mask: Tensor, clusters: int, iterations: int, exact_case: bool,
            buffers: means.Buffers, chunk: int, with_means: bool) -> None:
    b, h, n, d = q.shape
    chunks = buffers.part_sums.shape[1]
    top = buffers.candidates.shape[-1]
    mask = query_mask.contiguous()
    grid = (chunks, b * h)
    nearest = _nearest_meta(q, clusters, buffers)
    flags = dict(HEAD_DIM=nearest["HEAD_DIM"], CHUNK_BLOCK=nearest["CHUNK_BLOCK"])
    fused = pow2_block(clusters, 16) * pow2_block(d) <= CANDIDATES_FUSED_TILE
    blocks, per_program, means_meta = means.means_launch(clusters, chunks, d)
    for it in range(iterations):
        moved_in, moved_out = buffers.moved[(it + 1) % 2], buffers.moved[it % 2]
        if fused:
            _means_candidates_kernel[(max(blocks, chunks), b * h)](
                buffers.part_sums, buffers.part_counts, moved_in, buffers.means, buffers.members, buffers.empty_list,
                buffers.n_empty, q, mask, out, buffers.keys, buffers.candidates, *q.stride(),
                h, n, clusters, d, chunk, chunks, per_program,
                BLOCK_N=means.BLOCK_N, ALL_C=pow2_block(clusters, 16), TOP=top, NO_KEY=NO_KEY, **means_meta,
            )
        else:
            means.means(q, buffers, moved_in, clusters, chunks)
            _candidates_kernel[grid](
                q, mask, out, buffers.means, moved_in, buffers.n_empty, buffers.keys, buffers.candidates, *q.stride(),
                h, n, clusters, d, chunk, chunks,
                BLOCK_N=means.BLOCK_N, TOP=top, NO_KEY=NO_KEY, **flags,
            )
        if not nearest["ONE_BLOCK"]:
            _donor_kernel[grid](
                q, moved_in, buffers.n_empty, buffers.empty_list, buffers.candidates, buffers.means, *q.stride(),
                h, n, clusters, d, chunks,
                BLOCK_K=min(top, 64), TOP=top, LOG_TOP=top.bit_length() - 1, NO_KEY=NO_KEY, **flags,
            )
        _nearest_step(q, out, mask, buffers, chunk, moved_in, moved_out, nearest, last=it == iterations - 1,
                      exact_case=exact_case, with_means=with_means)
    if with_means:
        means.means(q, buffers, buffers.moved[(iterations - 1) % 2], clusters, chunks)
