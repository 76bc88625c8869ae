"""Euclidean Lloyd steps on the query vectors as Triton kernels spread over the whole GPU (the
triton backend's refine stage; kmeans.refine_clusters is the reference they match). The
sums and means of each step are means_triton's.

Each head's queries are cut into chunks of whole BLOCK_N tiles, one program a chunk
(kernels.triton.helpers.chunking). Per chunk, cluster sums are one-hot(cluster) @ rows on tensor
cores, written per chunk and summed over the chunks in chunk order by the next launch: the
result does not depend on which program ran first. A refinement step from assignments A:

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
The reference stops once the assignments repeat; here a head none of whose queries moved in the
previous step skips the rest on the device. No host synchronisation: one call is a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.triton import means
from kernels.triton.helpers import (
    any_set,
    chunking,
    dot_parts,
    dot_split_right,
    exact_case,
    pow2_block,
    split_parts,
    top_of_sorted,
    upcast,
)
from kernels.triton.means import block_means, chunk_sums, load_rows

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
# Key of no query: below every real or padded query's key.
NO_KEY = -(1 << 62)


@triton.jit
def _store_donor_keys(keys_row, x_head, stride_xn, stride_xd, mask_row, rows, stop, own, N, D,
                      HEAD_DIM: tl.constexpr):
    """The donor keys of `rows` (see _candidates_kernel) to keys_row, `own` their means (rows,
    HEAD_DIM) float32."""
    gap = load_rows(x_head, rows, stop, D, stride_xn, stride_xd, HEAD_DIM).to(tl.float32) - own
    distance = tl.sum(gap * gap, axis=1)
    real = tl.load(mask_row + rows, mask=rows < stop, other=0) != 0
    key = (distance.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (N - 1 - rows).to(tl.int64)
    tl.store(keys_row + rows, tl.where(real, key, -1 - rows.to(tl.int64)), mask=rows < stop)


@triton.jit
def _store_candidates(keys_row, candidates_row, start, stop, TOP: tl.constexpr, NO_KEY: tl.constexpr):
    """The TOP largest of the keys keys_row[start:stop] stored above, sorted, largest first
    (NO_KEY where fewer), to candidates_row."""
    tl.debug_barrier()  # the keys, stored by other threads, are read back here
    top = tl.full([TOP], NO_KEY, tl.int64)
    for first in range(start, stop, TOP):
        rows = first + tl.arange(0, TOP)
        keys = tl.load(keys_row + rows, mask=rows < stop, other=NO_KEY)
        top = tl.topk(tl.reshape(tl.join(top, keys), (2 * TOP,)), TOP)
    tl.store(candidates_row + tl.arange(0, TOP), top)


@triton.jit
def _candidates_kernel(
    x_ptr, query_mask_ptr, assign_ptr, means_ptr, moved_ptr, n_empty_ptr, keys_ptr, candidates_ptr,
    stride_xb, stride_xh, stride_xn, stride_xd,
    H, N, C, D, CHUNK, CHUNKS,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, CHUNK_BLOCK: tl.constexpr, TOP: tl.constexpr,
    NO_KEY: tl.constexpr,
):
    """Where the head has an empty cluster: the chunk's TOP largest donor keys, sorted, to
    candidates (B * H, CHUNKS, TOP) int64. A real query's key is (|x - its mean|^2 bits << 32)
    | (N - 1 - position): farther first, then the lower position (squared distances are >= 0,
    so their float bits order like them); a padded query's is -1 - position, after every real
    one; keys (B * H, N) is scratch."""
    chunk = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    if any_set(moved_ptr + bh * CHUNKS, CHUNKS, CHUNK_BLOCK):
        if tl.load(n_empty_ptr + bh) > 0:
            start = chunk * CHUNK
            stop = tl.minimum(start + CHUNK, N)
            x_head = x_ptr + (bh // H) * stride_xb + (bh % H) * stride_xh
            dims = tl.arange(0, HEAD_DIM)
            for first in range(start, stop, BLOCK_N):
                rows = first + tl.arange(0, BLOCK_N)
                cluster = tl.load(assign_ptr + bh * N + rows, mask=rows < stop, other=C)
                own = tl.load(means_ptr + (bh * C + cluster)[:, None] * D + dims[None, :],
                              mask=(cluster[:, None] < C) & (dims[None, :] < D), other=0.0)
                _store_donor_keys(keys_ptr + bh * N, x_head, stride_xn, stride_xd, query_mask_ptr + (bh // H) * N,
                                  rows, stop, own, N, D, HEAD_DIM)
            _store_candidates(keys_ptr + bh * N, candidates_ptr + (bh * CHUNKS + chunk) * TOP, start, stop, TOP,
                              NO_KEY)


@triton.jit
def _chunk_candidates(part_sums_ptr, part_counts_ptr, x_ptr, query_mask_ptr, assign_ptr, keys_ptr, candidates_ptr,
                      stride_xb, stride_xh, stride_xn, stride_xd, bh, chunk, H, N, C, D, CHUNK, CHUNKS, summed_chunks,
                      BLOCK_N: tl.constexpr, ALL_C: tl.constexpr, HEAD_DIM: tl.constexpr, TOP: tl.constexpr,
                      NO_KEY: tl.constexpr):
    """_candidates_kernel's work for one chunk, from the head's sums over its chunks (all
    ALL_C >= C clusters in one tile, chunk after chunk), each query's mean its cluster's sum
    over its count. summed_chunks is CHUNKS under a name the cost model's loop bounds give
    (bench.loop_bounds: no cluster empties on real text)."""
    cols = tl.arange(0, ALL_C)
    dims = tl.arange(0, HEAD_DIM)
    sums = tl.zeros([ALL_C, HEAD_DIM], tl.float32)
    members = tl.zeros([ALL_C], tl.int32)
    for part in range(0, summed_chunks):
        sums += tl.load(part_sums_ptr + ((bh * CHUNKS + part) * C + cols)[:, None] * D + dims[None, :],
                        mask=(cols[:, None] < C) & (dims[None, :] < D), other=0.0)
        members += tl.load(part_counts_ptr + (bh * CHUNKS + part) * C + cols, mask=cols < C, other=0)
    start = chunk * CHUNK
    stop = tl.minimum(start + CHUNK, N)
    x_head = x_ptr + (bh // H) * stride_xb + (bh % H) * stride_xh
    for first in range(start, stop, BLOCK_N):
        rows = first + tl.arange(0, BLOCK_N)
        cluster = tl.load(assign_ptr + bh * N + rows, mask=rows < stop, other=C)
        index = tl.where(cluster < C, cluster, 0).to(tl.int32)
        count = tl.maximum(tl.gather(members, index, 0), 1).to(tl.float32)
        summed = tl.gather(sums, tl.broadcast_to(index[:, None], (BLOCK_N, HEAD_DIM)), 0)
        own = tl.where((cluster < C)[:, None], tl.math.div_rn(summed, count[:, None]), 0.0)
        _store_donor_keys(keys_ptr + bh * N, x_head, stride_xn, stride_xd, query_mask_ptr + (bh // H) * N, rows, stop,
                          own, N, D, HEAD_DIM)
    _store_candidates(keys_ptr + bh * N, candidates_ptr + (bh * CHUNKS + chunk) * TOP, start, stop, TOP, NO_KEY)


@triton.jit
def _means_candidates_kernel(
    part_sums_ptr, part_counts_ptr, moved_ptr, means_ptr, members_ptr, empty_list_ptr, n_empty_ptr,
    x_ptr, query_mask_ptr, assign_ptr, keys_ptr, candidates_ptr,
    stride_xb, stride_xh, stride_xn, stride_xd,
    H, N, C, D, CHUNK, CHUNKS, PER_PROGRAM,
    BLOCK_C: tl.constexpr, COUNT_C: tl.constexpr, HEAD_DIM: tl.constexpr, CHUNK_BLOCK: tl.constexpr,
    CHUNK_GROUP: tl.constexpr, SUMS_GROUP: tl.constexpr, BLOCK_N: tl.constexpr, ALL_C: tl.constexpr,
    TOP: tl.constexpr, NO_KEY: tl.constexpr,
):
    """_means_kernel and _candidates_kernel in one launch, for up to ALL_C clusters (programs:
    the more of the means' cluster blocks and the chunks). Program p writes the means of
    cluster block p and, where the head has an empty cluster (rare: none on the default
    model's text), chunk p's candidates. Their means are written by the other programs of this
    launch, so it sums all the head's itself, chunk after chunk in one tile: the candidates'
    distances are within rounding of those to the written means."""
    program = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    if any_set(moved_ptr + bh * CHUNKS, CHUNKS, CHUNK_BLOCK):
        empties = block_means(part_sums_ptr, part_counts_ptr, means_ptr, members_ptr, empty_list_ptr, n_empty_ptr,
                              bh, program, C, D, CHUNKS, PER_PROGRAM, BLOCK_C, COUNT_C, HEAD_DIM, CHUNK_GROUP,
                              SUMS_GROUP)
        if (empties > 0) & (program < CHUNKS):  # rare: no cluster empties on the default model's text
            _chunk_candidates(part_sums_ptr, part_counts_ptr, x_ptr, query_mask_ptr, assign_ptr, keys_ptr,
                              candidates_ptr, stride_xb, stride_xh, stride_xn, stride_xd, bh, program, H, N, C, D,
                              CHUNK, CHUNKS, tl.where(empties > 0, CHUNKS, 0), BLOCK_N, ALL_C, HEAD_DIM, TOP, NO_KEY)


@triton.jit
def _donor_kernel(
    x_ptr, moved_ptr, n_empty_ptr, empty_list_ptr, candidates_ptr, means_ptr,
    stride_xb, stride_xh, stride_xn, stride_xd,
    H, N, C, D, CHUNKS,
    BLOCK_K: tl.constexpr, HEAD_DIM: tl.constexpr, CHUNK_BLOCK: tl.constexpr, TOP: tl.constexpr,
    LOG_TOP: tl.constexpr, NO_KEY: tl.constexpr,
):
    """Where the head has E empty clusters: each of this chunk's first E candidates whose rank
    among all the chunks' candidates (keys are distinct; each chunk's are sorted, so the rank
    is a sum of binary searches) is e < E becomes the centroid of the e-th empty cluster; the
    last query of all also serves the empty clusters past N. One writer per centroid."""
    chunk = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    if any_set(moved_ptr + bh * CHUNKS, CHUNKS, CHUNK_BLOCK):
        empties = tl.load(n_empty_ptr + bh)
        wanted = tl.minimum(empties, TOP)  # the first `wanted` of each chunk's list can rank < E
        x_head = x_ptr + (bh // H) * stride_xb + (bh % H) * stride_xh
        dims = tl.arange(0, HEAD_DIM)
        for first in range(0, wanted, BLOCK_K):
            slots = first + tl.arange(0, BLOCK_K)
            key = tl.load(candidates_ptr + (bh * CHUNKS + chunk) * TOP + slots, mask=slots < wanted, other=NO_KEY)
            rank = tl.zeros([BLOCK_K], tl.int32)
            for other in range(0, CHUNKS):
                listed = candidates_ptr + (bh * CHUNKS + other) * TOP
                low = tl.zeros([BLOCK_K], tl.int32)  # keys of `other` above `key`: [0, low)
                high = tl.zeros([BLOCK_K], tl.int32) + wanted
                for _ in tl.static_range(LOG_TOP + 1):
                    middle = (low + high) // 2
                    searching = low < high
                    above = searching & (tl.load(listed + middle, mask=searching, other=NO_KEY) > key)
                    low = tl.where(above, middle + 1, low)
                    high = tl.where(searching & ~above, middle, high)
                rank += low
            position = tl.where(key >= 0, N - 1 - (key & 0xFFFFFFFF), -1 - key)
            write = (slots < wanted) & (key != NO_KEY) & (rank < empties)
            cluster = tl.load(empty_list_ptr + bh * C + rank, mask=write, other=0)
            vectors = tl.load(x_head + position[:, None] * stride_xn + dims[None, :] * stride_xd,
                              mask=write[:, None] & (dims[None, :] < D), other=0.0)
            tl.store(means_ptr + (bh * C + cluster)[:, None] * D + dims[None, :], vectors.to(tl.float32),
                     mask=write[:, None] & (dims[None, :] < D))
            # More empty clusters than queries: the last query of all serves the rest.
            last = (slots < wanted) & (key != NO_KEY) & (rank == N - 1)
            if (empties > N) & (tl.sum(last.to(tl.int32), axis=0) > 0):
                row = tl.sum(tl.where(last, position, 0), axis=0)
                vector = tl.load(x_head + row * stride_xn + dims * stride_xd, mask=dims < D, other=0.0)
                for e in range(N, empties):
                    tl.store(means_ptr + (bh * C + tl.load(empty_list_ptr + bh * C + e)) * D + dims,
                             vector.to(tl.float32), mask=dims < D)


@triton.jit
def _donated(centroids, cols, x_head, stride_xn, stride_xd, members_row, empties, candidates_head, lists, N, C, D,
             HEAD_DIM: tl.constexpr, TOP: tl.constexpr, TOP_ALL: tl.constexpr, NO_KEY: tl.constexpr):
    """The means `centroids` (rows: the clusters `cols`, all C of them) with each empty one's
    replaced by its donor, as _donor_kernel gives them: the e-th empty cluster (cluster order)
    takes the e-th farthest query of the head, the last of all past the queries. The `lists`
    chunks' candidate lists (sorted, largest first; all the chunks', none where no cluster is
    empty) merge into the head's TOP_ALL largest keys, read backwards (top_of_sorted). Nothing
    is read unless `empties` > 0."""
    if empties > 0:
        slots = tl.arange(0, TOP_ALL)
        top = tl.full([TOP_ALL], NO_KEY, tl.int64)
        for chunk in range(0, lists):
            backwards = tl.load(candidates_head + chunk * TOP + (TOP_ALL - 1 - slots), mask=TOP_ALL - 1 - slots < TOP,
                                other=NO_KEY)
            top = top_of_sorted(top, backwards)
        empty = (tl.load(members_row + cols, mask=cols < C, other=1) == 0) & (cols < C)
        rank = tl.minimum(tl.cumsum(empty.to(tl.int32), axis=0) - 1, N - 1)
        key = tl.gather(top, tl.where(empty, rank, 0), 0)
        position = tl.where(key >= 0, N - 1 - (key & 0xFFFFFFFF), -1 - key)
        dims = tl.arange(0, HEAD_DIM)
        donors = tl.load(x_head + position[:, None] * stride_xn + dims[None, :] * stride_xd,
                         mask=empty[:, None] & (dims[None, :] < D), other=0.0)
        centroids = tl.where(empty[:, None], donors.to(tl.float32), centroids)
    return centroids


@triton.jit
def _nearest_kernel(
    x_ptr, query_mask_ptr, means_ptr, moved_in_ptr, moved_out_ptr, assign_ptr, part_sums_ptr, part_counts_ptr,
    members_ptr, n_empty_ptr, candidates_ptr,
    stride_xb, stride_xh, stride_xn, stride_xd,
    H, N, C, D, CHUNK, CHUNKS,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, HEAD_DIM: tl.constexpr, CHUNK_BLOCK: tl.constexpr,
    COUNT_BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr, LAST: tl.constexpr, EXACT_CASE: tl.constexpr,
    MEANS: tl.constexpr, UPCAST: tl.constexpr, TOP: tl.constexpr, TOP_ALL: tl.constexpr, NO_KEY: tl.constexpr,
):
    """One chunk's nearest means (B * H, C, D) float32, written to assign (B, H, N) in place,
    padded queries at C; moved_out (B * H, CHUNKS) says whether any query moved. Unless LAST,
    the chunk's sums and counts under the new assignments. A head that did not move in the
    previous step (moved_in) keeps its assignments. With all the means in one tile (ONE_BLOCK),
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


def _refine(q: Tensor, out: Tensor, query_mask: Tensor, clusters: int, iterations: int, exact_case: bool,
            buffers: means.Buffers, chunk: int, with_means: bool) -> None:
    b, h, n, d = q.shape
    chunks = buffers.part_sums.shape[1]
    top = buffers.candidates.shape[-1]
    mask = query_mask.contiguous()
    grid = (chunks, b * h)
    flags = dict(HEAD_DIM=pow2_block(d), CHUNK_BLOCK=pow2_block(chunks, 1))
    nearest_block = pow2_block(clusters, 16, NEAREST_BLOCK_C if clusters <= NEAREST_BLOCK_C else NEAREST_NARROW_C)
    one_block = clusters <= nearest_block  # the nearest-mean search takes the donors itself
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
        if not one_block:
            _donor_kernel[grid](
                q, moved_in, buffers.n_empty, buffers.empty_list, buffers.candidates, buffers.means, *q.stride(),
                h, n, clusters, d, chunks,
                BLOCK_K=min(top, 64), TOP=top, LOG_TOP=top.bit_length() - 1, NO_KEY=NO_KEY, **flags,
            )
        _nearest_kernel[grid](
            q, mask, buffers.means, moved_in, moved_out, out, buffers.part_sums, buffers.part_counts, buffers.members,
            buffers.n_empty, buffers.candidates, *q.stride(),
            h, n, clusters, d, chunk, chunks,
            BLOCK_N=means.BLOCK_N, BLOCK_C=nearest_block, COUNT_BLOCK=means.COUNT_BLOCK, ONE_BLOCK=one_block,
            LAST=it == iterations - 1, EXACT_CASE=exact_case, MEANS=with_means, UPCAST=upcast(q),
            TOP=top, TOP_ALL=max(top, pow2_block(min(clusters, n), 1)), NO_KEY=NO_KEY,
            num_warps=4 if nearest_block <= NEAREST_NARROW_C else 8, **flags,
        )
    if with_means:
        means.means(q, buffers, buffers.moved[(iterations - 1) % 2], clusters, chunks)
