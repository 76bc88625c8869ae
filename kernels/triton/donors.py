"""The donors of a refinement step's empty clusters (kernels.triton.lloyd runs the step):
where a cluster is empty, the e-th empty one (cluster order) takes the e-th farthest query of
the head from its mean, as kmeans.refine_clusters does. Each chunk's program lists its
farthest queries as sorted keys; the nearest-mean search merges the lists and puts the donors
in place (_donated), or, for more means than one of its tiles holds, _donor_kernel does.

    _candidates_kernel        (chunks, B * H)  only where a cluster is empty: per chunk, its
                              queries farthest from their means, as sorted keys
    _means_candidates_kernel  (the more of cluster blocks and chunks, B * H)  the means
                              kernel's work and the candidates in one launch, where the head's
                              means fit one tile: a chunk's program sums them itself where a
                              cluster is empty (the other programs write them in this launch)
    _donor_kernel             (chunks, B * H)  the e-th farthest query of the head, ranked
                              across the chunks' candidates, becomes the e-th empty cluster's
                              centroid
"""

from __future__ import annotations

import triton
import triton.language as tl

from clusterserve.kernels.triton.helpers import any_set, top_of_sorted
from clusterserve.kernels.triton.means import block_means, load_rows

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
