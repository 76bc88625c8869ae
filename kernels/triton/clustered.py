"""Triton backend of clustered and improved clustered attention (Vyas et al. 2020,
arXiv:2007.04825): the triton backend's stages (kernels/stages.py runs them); the reference
they match is clustered.py.

    hash, cluster, refine, centroids   LSH codes (hashing_triton), Hamming K-means
                             (hamming_triton), Euclidean refinement (lloyd_triton) and cluster
                             means (means_triton), each spread over (chunks of queries, B * H);
                             without codes (spec.bits 0), seed in place of hash and cluster:
                             the seed queries as the first means (seeding), then a step;
                             run as one (cluster_means_triton_stages), the hash also writes
                             the K-means' +-1 signs, and the K-means' final launch and the
                             refinement's last step sum the queries by cluster, so that no
                             launch of their own does
    centroid_attention_triton    V^c = A^c V and each cluster's top-k keys of A^c, the keys
                                 split across programs (centroid_triton; A^c is never written)
    _broadcast_kernel            clustered: every query gets its centroid's row of V^c
    cluster_layout_triton        improved clustered: each cluster's queries in tiles (as
                                 clustered.cluster_tiles), a counting sort in three launches
    _improved_tile_kernel        one program per tile of one cluster's queries: exact softmax
                                 on the cluster's top-k keys, scaled to their centroid mass
                                 m_j, plus the centroid attention on the other keys (eq. 15)

The softmaxes run in base 2 (kernels.triton.helpers.online_softmax_step). Sums and softmaxes are
float32; every dot of half-precision inputs runs on tensor cores (the split-precision dots of
kernels.triton.helpers, where a float32 operand decides something: the hash planes to float32
accuracy, the means and the centroids' logits to within ~1e-5 of a tie), float32 inputs use
input_precision="ieee" (TF32 alone would miss the reference by ~1e-3). Probabilities meet
half-precision values rounded to their dtype, as in flash attention. No host synchronisation:
sizes that the reference reads from the data (the number of tiles) use their static bound, so
a whole forward can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from clusterserve.kernels.reference.hashing import hash_planes, on_device
from clusterserve.kernels.reference.kmeans import initial_offsets
from clusterserve.kernels.spec import AttentionSpec
from clusterserve.kernels.stages import CentroidAttention, ClusteredStages, applied_by_stages, cluster_queries
from clusterserve.kernels.triton import hamming, means
from clusterserve.kernels.triton.centroid import centroid_attention_triton
from clusterserve.kernels.triton.cluster_layout import cluster_layout_triton
from clusterserve.kernels.triton.hamming import hamming_kmeans_triton
from clusterserve.kernels.triton.hashing import hash_codes_triton
from clusterserve.kernels.triton.helpers import chunking, mma, online_softmax_step, pow2_block, rounded, upcast
from clusterserve.kernels.triton.lloyd import (
    refine_buffers,
    refine_clusters_triton,
    refine_summed_triton,
    seed_clusters_triton,
    seeded_summed_triton,
)
from clusterserve.kernels.triton.means import cluster_means_triton

LOG2E = 1.4426950408889634
# Queries per sparse tile and its warps: each tile gathers its cluster's top-k keys and values
# once, so 64 queries a tile halve the gathers of 32; at 4 warps (~128 registers at head dim
# 64) four tiles share an SM.
TILE = 64
TILE_NUM_WARPS = 4


@triton.jit
def _broadcast_kernel(
    values_ptr, assign_ptr, out_ptr,
    stride_ob, stride_oh, stride_on, stride_od,
    H, N, C, DV,
    BLOCK_N: tl.constexpr, VALUE_DIM: tl.constexpr,
):
    """out[b, h, n] = V^c[b, h, assign[b, h, n]], 0 for padded queries (assign == C)."""
    bh = tl.program_id(1).to(tl.int64)
    batch, head = bh // H, bh % H
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    vdims = tl.arange(0, VALUE_DIM)
    in_rows = rows < N
    cluster = tl.load(assign_ptr + bh * N + rows, mask=in_rows, other=C)
    in_vdims = vdims[None, :] < DV
    row = tl.load(values_ptr + (bh * C + cluster)[:, None] * DV + vdims[None, :],
                  mask=(cluster < C)[:, None] & in_vdims, other=0.0)
    out_ptrs = out_ptr + batch * stride_ob + head * stride_oh + rows[:, None] * stride_on + vdims[None, :] * stride_od
    tl.store(out_ptrs, rounded(row, out_ptr.dtype.element_ty), mask=in_rows[:, None] & in_vdims)


@triton.jit
def _improved_tile_kernel(
    q_ptr, k_ptr, v_ptr, key_mask_ptr, order_ptr, start_ptr, size_ptr, tile_end_ptr,
    top_index_ptr, top_probs_ptr, centroid_values_ptr, out_ptr,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_km, stride_kd,
    stride_vb, stride_vh, stride_vm, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    H, N, M, C, TOPK, D, DV, scale,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
    CLUSTER_BLOCK: tl.constexpr, UPCAST: tl.constexpr,
):
    """One tile of one cluster's queries (the layout of cluster_layout_triton; tile t belongs
    to the cluster whose tiles end after it, none for an unused tile): out_i = m_j softmax(q_i
    K_top^T) V_top + V^b_j with V^b_j = V^c_j - A^c_j[top] V_top, written at the queries'
    original positions. `scale` includes log2(e): the softmax runs in base 2."""
    tile = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    batch, head = bh // H, bh % H
    cluster = 0
    for c_start in range(0, C, CLUSTER_BLOCK):
        cols = c_start + tl.arange(0, CLUSTER_BLOCK)
        cluster += tl.sum((tl.load(tile_end_ptr + bh * C + cols, mask=cols < C, other=tile + 1) <= tile).to(tl.int32),
                          axis=0)
    if cluster < C:
        size = tl.load(size_ptr + bh * C + cluster)
        first_tile = tl.load(tile_end_ptr + bh * C + cluster) - (size + BLOCK_M - 1) // BLOCK_M
        slot = (tile - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
        valid = slot < size
        position = tl.load(order_ptr + bh * N + tl.load(start_ptr + bh * C + cluster) + slot, mask=valid, other=0)
        dims = tl.arange(0, HEAD_DIM)
        vdims = tl.arange(0, VALUE_DIM)
        queries = tl.load(
            q_ptr + batch * stride_qb + head * stride_qh + position[:, None] * stride_qn + dims[None, :] * stride_qd,
            mask=valid[:, None] & (dims[None, :] < D), other=0.0,
        )
        k_head = k_ptr + batch * stride_kb + head * stride_kh
        v_head = v_ptr + batch * stride_vb + head * stride_vh
        top_row = (bh * C + cluster) * TOPK
        row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        row_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, VALUE_DIM], tl.float32)
        top_mass = tl.zeros([BLOCK_K], tl.float32)  # m_j, summed at the end
        top_values = tl.zeros([VALUE_DIM], tl.float32)  # A^c_j[top] V_top
        for start in range(0, TOPK, BLOCK_K):
            kk = start + tl.arange(0, BLOCK_K)
            index = tl.load(top_index_ptr + top_row + kk, mask=kk < TOPK, other=0)
            real = (kk < TOPK) & (tl.load(key_mask_ptr + batch * M + index, mask=kk < TOPK, other=0) != 0)
            keys = tl.load(k_head + index[:, None] * stride_km + dims[None, :] * stride_kd,
                           mask=real[:, None] & (dims[None, :] < D), other=0.0)
            values = tl.load(v_head + index[:, None] * stride_vm + vdims[None, :] * stride_vd,
                             mask=real[:, None] & (vdims[None, :] < DV), other=0.0)
            centroid_p = tl.load(top_probs_ptr + top_row + kk, mask=real, other=0.0)
            top_mass += centroid_p
            top_values += tl.sum(centroid_p[:, None] * values.to(tl.float32), axis=0)
            # Queries and keys share a dtype: half products are exact, accumulated in float32.
            logits = mma(queries, tl.trans(keys), UPCAST) * scale
            logits = tl.where(real[None, :], logits, float("-inf"))
            acc, row_max, row_sum = online_softmax_step(acc, row_max, row_sum, logits, values, UPCAST)
        # A tile whose top-k keys are all padded has no exact part (the reference's NaN -> 0).
        exact = acc * (tl.sum(top_mass, axis=0) / tl.where(row_sum > 0, row_sum, float("inf")))[:, None]
        centroid_values = tl.load(centroid_values_ptr + (bh * C + cluster) * DV + vdims,
                                  mask=vdims < DV, other=0.0)
        out = exact + (centroid_values - top_values)[None, :]
        out_ptrs = out_ptr + batch * stride_ob + head * stride_oh + position[:, None] * stride_on + vdims[None, :] * stride_od
        tl.store(out_ptrs, rounded(out, out_ptr.dtype.element_ty), mask=valid[:, None] & (vdims[None, :] < DV))


def hash_queries_triton(q: Tensor, spec: AttentionSpec) -> Tensor:
    """The hash stage on the device: (B, H, N, D) -> codes (B, H, N) int64."""
    _, h, _, d = q.shape
    return hash_codes_triton(q, on_device(hash_planes, (h, d, spec.bits, spec.seed), q.device))


def cluster_codes_triton(codes: Tensor, query_mask: Tensor, spec: AttentionSpec) -> Tensor:
    """The cluster stage on the device: Hamming K-means of codes (B, H, N) -> (B, H, N) in [0, C]."""
    offsets = on_device(initial_offsets, (codes.shape[1], spec.seed), codes.device)
    return hamming_kmeans_triton(codes, query_mask, spec.clusters, spec.iterations, offsets, spec.bits,
                                 exact_case=True)


def seed_assignments_triton(q: Tensor, query_mask: Tensor, spec: AttentionSpec) -> Tensor:
    """The seed stage on the device (spec.bits 0): each query's nearest seed query (B, H, N) in [0, C]."""
    offsets = on_device(initial_offsets, (q.shape[1], spec.seed), q.device)
    return seed_clusters_triton(q, query_mask, spec.clusters, offsets, exact_case=True)


def refine_assignments_triton(q: Tensor, assign: Tensor, query_mask: Tensor, spec: AttentionSpec) -> Tensor:
    """The refine stage on the device."""
    return refine_clusters_triton(q, assign, query_mask, spec.clusters, spec.refine, exact_case=True)


def cluster_means_triton_stages(q: Tensor, query_mask: Tensor, spec: AttentionSpec) -> tuple[Tensor, Tensor]:
    """The hash, cluster, refine and centroids stages in one: (B, H, N) assignments and member
    means (B, H, C, D) float32. Up to hamming.BLOCK_C clusters, the hash writes the signs that
    the Hamming K-means reads, whose final launch sums the query vectors under its
    assignments, and the refinement's last step sums them under its own: no launch of their
    own converts codes or sums. More clusters run the stages one by one (the driver's own order).
    Without codes (spec.bits 0) the seeds' nearest-mean step sums the vectors for the first
    refinement step, whatever the clusters."""
    b, h, n, d = q.shape
    offsets = on_device(initial_offsets, (h, spec.seed), q.device)
    if not spec.bits:
        # No K-means: chunks of the refinement's own tiles, 264 programs from 4k tokens at 12 heads
        # (the K-means' tiles of 128 give 192 programs of 4 tiles there, not 264 of 3).
        chunks, chunk = chunking(n, h, means.BLOCK_N)
        buffers = refine_buffers(q, spec.clusters, chunk, chunks)
        assign = seeded_summed_triton(q, query_mask, spec.clusters, offsets, spec.refine, buffers, chunk,
                                      exact_case=True)
        return assign, buffers.means.view(b, h, spec.clusters, d)
    chunks, chunk = chunking(n, h, hamming.BLOCK_N)  # the K-means' chunks, which the sums follow
    if spec.clusters > hamming.BLOCK_C:
        assign = cluster_queries(TRITON, q, query_mask, spec)
        return assign, centroids_triton(q, assign, spec.clusters)
    signs = torch.empty(b * h, n, hamming.BLOCK_BITS, dtype=torch.int8, device=q.device)
    codes = hash_codes_triton(q, on_device(hash_planes, (h, d, spec.bits, spec.seed), q.device), signs)
    buffers = refine_buffers(q, spec.clusters, chunk, chunks)
    assign = hamming_kmeans_triton(codes, query_mask, spec.clusters, spec.iterations, offsets, spec.bits,
                                   exact_case=True, sums=hamming.VectorSums(q, buffers, all_moved=not spec.refine),
                                   signs=signs)
    if spec.refine:
        refine_summed_triton(q, assign, query_mask, spec.clusters, spec.refine, buffers, chunk, exact_case=True)
    else:
        means.means(q, buffers, buffers.moved[1], spec.clusters, chunks)
    return assign, buffers.means.view(b, h, spec.clusters, d)


def centroids_triton(q: Tensor, assign: Tensor, clusters: int) -> Tensor:
    """The centroids stage on the device: member means (B, H, C, D) float32."""
    return cluster_means_triton(q, assign, clusters)[0]


def broadcast_triton(centroid_values: Tensor, assign: Tensor, dtype: torch.dtype) -> Tensor:
    """The broadcast stage: each query's row of V^c (B, H, C, Dv) under assign (B, H, N) -> (B, H, N, Dv)."""
    b, h, c, dv = centroid_values.shape
    n = assign.shape[-1]
    out = torch.empty(b, h, n, dv, dtype=dtype, device=assign.device)
    block_n = 32
    _broadcast_kernel[(triton.cdiv(n, block_n), b * h)](
        centroid_values, assign, out,
        *out.stride(),
        h, n, c, dv,
        BLOCK_N=block_n, VALUE_DIM=pow2_block(dv),
    )
    return out


def improved_sparse_triton(
    q: Tensor, k: Tensor, v: Tensor, assign: Tensor, centroid: CentroidAttention, key_mask: Tensor, scale: float,
    dtype: torch.dtype,
) -> Tensor:
    """The sparse stage (eq. 15): two layout launches put each cluster's queries in tiles
    (cluster_layout_triton), then one fused kernel runs the tiles.

    q: (B, H, N, D), k: (B, H, M, D), v: (B, H, M, Dv), assign: (B, H, N) in [0, C] -> (B, H, N, Dv) in dtype.
    """
    b, h, n, d = q.shape
    m, dv = k.shape[2], v.shape[-1]
    clusters = centroid.values.shape[2]
    n_tiles = triton.cdiv(n, TILE) + clusters  # static bound on sum_j ceil(|cluster j| / TILE)
    out = torch.empty(b, h, n, dv, dtype=dtype, device=q.device)  # the layout zeroes padded queries' rows
    layout = cluster_layout_triton(assign, clusters, TILE, out)
    top = centroid.top_index.shape[-1]
    block_k = min(64, pow2_block(top))
    # Top-k keys that fit one block (the defaults' 32) make the kernel's loop one trip: nothing
    # to overlap, and a software pipeline would only copy the block in a prologue and again
    # (masked) in the loop.
    pipelining = {"num_stages": 1} if top <= block_k else {}
    _improved_tile_kernel[(n_tiles, b * h)](
        q, k, v, key_mask.contiguous(), *layout,
        centroid.top_index, centroid.top_probs, centroid.values, out,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        h, n, m, clusters, top, d, dv, scale * LOG2E,
        BLOCK_M=TILE, BLOCK_K=block_k, HEAD_DIM=pow2_block(d), VALUE_DIM=pow2_block(dv),
        CLUSTER_BLOCK=pow2_block(clusters, 16, 1024), UPCAST=upcast(q), num_warps=TILE_NUM_WARPS, **pipelining,
    )
    return out


# The kernels read float32, float16 and bfloat16 and compute in float32; the K-means kernels
# write the exact case's ranks themselves.
TRITON = ClusteredStages(
    name="triton", compute=lambda dtype: dtype, hash=hash_queries_triton, cluster=cluster_codes_triton,
    seed=seed_assignments_triton, refine=refine_assignments_triton, centroids=centroids_triton,
    centroid_attention=centroid_attention_triton, sparse=improved_sparse_triton, broadcast=broadcast_triton,
    exact_case=applied_by_stages, cluster_means=cluster_means_triton_stages,
)
