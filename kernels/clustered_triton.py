"""Triton backend of clustered and improved clustered attention (Vyas et al. 2020,
arXiv:2007.04825): the triton backend's stages (kernels/stages.py runs them); the reference
they match is clustered.py.

    hash, cluster, refine, centroids   LSH codes (hashing_triton), Hamming K-means,
                             Euclidean refinement and cluster means (kmeans_triton)
    _centroid_attention_kernel   A^c = softmax(Q^c K^T * scale) over the real keys, V^c = A^c V
    _broadcast_kernel            clustered: every query gets its centroid's row of V^c
    _improved_tile_kernel        improved clustered, one program per tile of one cluster's
                                 queries (clustered.cluster_tiles): exact softmax on the
                                 cluster's top-k keys, scaled to their centroid mass m_j, plus
                                 the centroid attention on the other keys (eq. 15)

Every product and sum is float32 whatever the input dtype, and float32 products use
input_precision="ieee" (TF32 alone would miss the reference by ~1e-3). No host
synchronisation: sizes that the reference reads from the data (the number of tiles) use
their static bound, so a whole forward can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .blocks import pow2_block
from .clustered import TILE, cluster_tiles
from .hashing import hash_planes, on_device
from .hashing_triton import hash_codes_triton
from .kmeans import initial_offsets
from .kmeans_triton import cluster_means_triton, hamming_kmeans_triton, refine_clusters_triton
from .spec import AttentionSpec
from .stages import CentroidAttention, ClusteredStages, applied_by_stages

# Running max of a softmax row before any real key: finite, so exp(m_old - m_new) is never NaN.
_NO_MAX = -1.0e30


@triton.jit
def _rounded(x, dtype: tl.constexpr):
    """float32 x in dtype, rounded to nearest even as torch's .to(dtype) does. bfloat16 is
    rounded by hand: Triton's interpreter truncates a plain cast (a GPU would round)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def _online_softmax_step(acc, row_max, row_sum, logits, values):
    """Fold one block of logits (rows, keys) and its values (keys, Dv) into a running softmax."""
    new_max = tl.maximum(row_max, tl.max(logits, axis=1))
    rescale = tl.exp(row_max - new_max)
    p = tl.exp(logits - new_max[:, None])
    row_sum = row_sum * rescale + tl.sum(p, axis=1)
    acc = acc * rescale[:, None] + tl.dot(p, values, input_precision="ieee")
    return acc, new_max, row_sum


@triton.jit
def _centroid_attention_kernel(
    centroids_ptr, k_ptr, v_ptr, key_mask_ptr, probs_ptr, values_ptr,
    stride_kb, stride_kh, stride_km, stride_kd,
    stride_vb, stride_vh, stride_vm, stride_vd,
    H, M, C, D, DV, scale,
    BLOCK_C: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
    NO_MAX: tl.constexpr, WRITE_PROBS: tl.constexpr,
):
    """V^c for a block of centroids by an online softmax over the keys; with WRITE_PROBS a
    second pass writes A^c itself (B, H, C, M). Rows with no real key are 0."""
    bh = tl.program_id(1).to(tl.int64)
    batch, head = bh // H, bh % H
    rows = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    dims = tl.arange(0, HEAD_DIM)
    vdims = tl.arange(0, VALUE_DIM)
    in_rows = rows < C
    centroids = tl.load(centroids_ptr + (bh * C + rows)[:, None] * D + dims[None, :],
                        mask=in_rows[:, None] & (dims[None, :] < D), other=0.0)
    k_head = k_ptr + batch * stride_kb + head * stride_kh
    v_head = v_ptr + batch * stride_vb + head * stride_vh
    row_max = tl.full([BLOCK_C], NO_MAX, tl.float32)
    row_sum = tl.zeros([BLOCK_C], tl.float32)
    acc = tl.zeros([BLOCK_C, VALUE_DIM], tl.float32)
    for start in range(0, M, BLOCK_M):
        cols = start + tl.arange(0, BLOCK_M)
        real = (cols < M) & (tl.load(key_mask_ptr + batch * M + cols, mask=cols < M, other=0) != 0)
        keys = tl.load(k_head + cols[:, None] * stride_km + dims[None, :] * stride_kd,
                       mask=real[:, None] & (dims[None, :] < D), other=0.0).to(tl.float32)
        values = tl.load(v_head + cols[:, None] * stride_vm + vdims[None, :] * stride_vd,
                         mask=real[:, None] & (vdims[None, :] < DV), other=0.0).to(tl.float32)
        logits = tl.dot(centroids, tl.trans(keys), input_precision="ieee") * scale
        logits = tl.where(real[None, :], logits, float("-inf"))
        acc, row_max, row_sum = _online_softmax_step(acc, row_max, row_sum, logits, values)
    inv_sum = 1.0 / tl.where(row_sum > 0, row_sum, float("inf"))  # 0 where no key is real
    tl.store(values_ptr + (bh * C + rows)[:, None] * DV + vdims[None, :], acc * inv_sum[:, None],
             mask=in_rows[:, None] & (vdims[None, :] < DV))
    if WRITE_PROBS:
        for start in range(0, M, BLOCK_M):
            cols = start + tl.arange(0, BLOCK_M)
            real = (cols < M) & (tl.load(key_mask_ptr + batch * M + cols, mask=cols < M, other=0) != 0)
            keys = tl.load(k_head + cols[:, None] * stride_km + dims[None, :] * stride_kd,
                           mask=real[:, None] & (dims[None, :] < D), other=0.0).to(tl.float32)
            logits = tl.dot(centroids, tl.trans(keys), input_precision="ieee") * scale
            logits = tl.where(real[None, :], logits, float("-inf"))
            probs = tl.exp(logits - row_max[:, None]) * inv_sum[:, None]
            tl.store(probs_ptr + (bh * C + rows)[:, None] * M + cols[None, :], probs,
                     mask=in_rows[:, None] & (cols[None, :] < M))


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
    tl.store(out_ptrs, _rounded(row, out_ptr.dtype.element_ty), mask=in_rows[:, None] & in_vdims)


@triton.jit
def _improved_tile_kernel(
    q_ptr, k_ptr, v_ptr, key_mask_ptr, positions_ptr, valid_ptr, tile_cluster_ptr,
    top_index_ptr, top_probs_ptr, centroid_values_ptr, out_ptr,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_km, stride_kd,
    stride_vb, stride_vh, stride_vm, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    H, M, C, T, TOPK, D, DV, scale,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
    NO_MAX: tl.constexpr,
):
    """One tile of one cluster's queries: out_i = m_j softmax(q_i K_top^T) V_top + V^b_j with
    V^b_j = V^c_j - A^c_j[top] V_top, written at the queries' original positions."""
    tile = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    batch, head = bh // H, bh % H
    cluster = tl.load(tile_cluster_ptr + bh * T + tile)
    if cluster < C:  # tiles past the last cluster's are unused
        slots = (bh * T + tile) * BLOCK_M + tl.arange(0, BLOCK_M)
        position = tl.load(positions_ptr + slots)
        valid = tl.load(valid_ptr + slots) != 0
        dims = tl.arange(0, HEAD_DIM)
        vdims = tl.arange(0, VALUE_DIM)
        queries = tl.load(
            q_ptr + batch * stride_qb + head * stride_qh + position[:, None] * stride_qn + dims[None, :] * stride_qd,
            mask=valid[:, None] & (dims[None, :] < D), other=0.0,
        ).to(tl.float32)
        k_head = k_ptr + batch * stride_kb + head * stride_kh
        v_head = v_ptr + batch * stride_vb + head * stride_vh
        top_row = (bh * C + cluster) * TOPK
        row_max = tl.full([BLOCK_M], NO_MAX, tl.float32)
        row_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, VALUE_DIM], tl.float32)
        top_mass = tl.zeros([BLOCK_K], tl.float32)  # m_j, summed at the end
        top_values = tl.zeros([VALUE_DIM], tl.float32)  # A^c_j[top] V_top
        for start in range(0, TOPK, BLOCK_K):
            kk = start + tl.arange(0, BLOCK_K)
            index = tl.load(top_index_ptr + top_row + kk, mask=kk < TOPK, other=0)
            real = (kk < TOPK) & (tl.load(key_mask_ptr + batch * M + index, mask=kk < TOPK, other=0) != 0)
            keys = tl.load(k_head + index[:, None] * stride_km + dims[None, :] * stride_kd,
                           mask=real[:, None] & (dims[None, :] < D), other=0.0).to(tl.float32)
            values = tl.load(v_head + index[:, None] * stride_vm + vdims[None, :] * stride_vd,
                             mask=real[:, None] & (vdims[None, :] < DV), other=0.0).to(tl.float32)
            centroid_p = tl.load(top_probs_ptr + top_row + kk, mask=real, other=0.0)
            top_mass += centroid_p
            top_values += tl.sum(centroid_p[:, None] * values, axis=0)
            logits = tl.dot(queries, tl.trans(keys), input_precision="ieee") * scale
            logits = tl.where(real[None, :], logits, float("-inf"))
            acc, row_max, row_sum = _online_softmax_step(acc, row_max, row_sum, logits, values)
        # A tile whose top-k keys are all padded has no exact part (the reference's NaN -> 0).
        exact = acc * (tl.sum(top_mass, axis=0) / tl.where(row_sum > 0, row_sum, float("inf")))[:, None]
        centroid_values = tl.load(centroid_values_ptr + (bh * C + cluster) * DV + vdims,
                                  mask=vdims < DV, other=0.0)
        out = exact + (centroid_values - top_values)[None, :]
        out_ptrs = out_ptr + batch * stride_ob + head * stride_oh + position[:, None] * stride_on + vdims[None, :] * stride_od
        tl.store(out_ptrs, _rounded(out, out_ptr.dtype.element_ty), mask=valid[:, None] & (vdims[None, :] < DV))


def hash_queries_triton(q: Tensor, spec: AttentionSpec) -> Tensor:
    """The hash stage on the device: (B, H, N, D) -> codes (B, H, N) int64."""
    _, h, _, d = q.shape
    return hash_codes_triton(q, on_device(hash_planes, (h, d, spec.bits, spec.seed), q.device))


def cluster_codes_triton(codes: Tensor, query_mask: Tensor, spec: AttentionSpec) -> Tensor:
    """The cluster stage on the device: Hamming K-means of codes (B, H, N) -> (B, H, N) in [0, C]."""
    offsets = on_device(initial_offsets, (codes.shape[1], spec.seed), codes.device)
    return hamming_kmeans_triton(codes, query_mask, spec.clusters, spec.iterations, offsets, spec.bits,
                                 exact_case=True)


def refine_assignments_triton(q: Tensor, assign: Tensor, query_mask: Tensor, spec: AttentionSpec) -> Tensor:
    """The refine stage on the device."""
    return refine_clusters_triton(q, assign, query_mask, spec.clusters, spec.refine, exact_case=True)


def centroids_triton(q: Tensor, assign: Tensor, clusters: int) -> Tensor:
    """The centroids stage on the device: member means (B, H, C, D) float32."""
    return cluster_means_triton(q, assign, clusters)[0]


def centroid_attention_triton(
    centroids: Tensor, k: Tensor, v: Tensor, key_mask: Tensor, scale: float, topk: int
) -> CentroidAttention:
    """The centroid pass on the device: V^c = A^c V (B, H, C, Dv) float32 and, with topk > 0,
    each cluster's top-k keys of A^c (B, H, C, M), which is written only then.

    centroids: (B, H, C, D) float32 contiguous; k: (B, H, M, D); v: (B, H, M, Dv); key_mask (B, M).
    """
    b, h, c, d = centroids.shape
    m, dv = k.shape[2], v.shape[-1]
    values = torch.empty(b, h, c, dv, dtype=torch.float32, device=k.device)
    probs = torch.empty(b, h, c, m, dtype=torch.float32, device=k.device) if topk else values
    block_c = 16
    _centroid_attention_kernel[(triton.cdiv(c, block_c), b * h)](
        centroids, k, v, key_mask.contiguous(), probs, values,
        *k.stride(), *v.stride(),
        h, m, c, d, dv, scale,
        BLOCK_C=block_c, BLOCK_M=64, HEAD_DIM=pow2_block(d), VALUE_DIM=pow2_block(dv),
        NO_MAX=_NO_MAX, WRITE_PROBS=bool(topk),
    )
    if not topk:
        return CentroidAttention(values)
    # A^c is 0 on padded keys, so the top-k probabilities need no masking.
    top_probs, top_index = probs.topk(topk, dim=-1)  # (B, H, C, k)
    return CentroidAttention(values, top_index, top_probs)


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
    """The sparse stage (eq. 15) as one fused kernel over cluster-sorted query tiles.

    q: (B, H, N, D), k: (B, H, M, D), v: (B, H, M, Dv), assign: (B, H, N) in [0, C] -> (B, H, N, Dv) in dtype.
    """
    b, h, n, d = q.shape
    m, dv = k.shape[2], v.shape[-1]
    clusters = centroid.values.shape[2]
    n_tiles = triton.cdiv(n, TILE) + clusters  # static bound on sum_j ceil(|cluster j| / TILE)
    positions, valid, tile_cluster = cluster_tiles(assign, clusters, TILE, n_tiles)
    out = torch.zeros(b, h, n, dv, dtype=dtype, device=q.device)  # padded queries stay 0
    top = centroid.top_index.shape[-1]
    _improved_tile_kernel[(n_tiles, b * h)](
        q, k, v, key_mask.contiguous(), positions.contiguous(), valid.contiguous(), tile_cluster.contiguous(),
        centroid.top_index.contiguous(), centroid.top_probs.contiguous(), centroid.values, out,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        h, m, clusters, n_tiles, top, d, dv, scale,
        BLOCK_M=TILE, BLOCK_K=min(64, pow2_block(top)), HEAD_DIM=pow2_block(d), VALUE_DIM=pow2_block(dv),
        NO_MAX=_NO_MAX,
    )
    return out


TRITON = ClusteredStages(
    name="triton",
    compute=lambda dtype: dtype,  # the kernels read float32, float16, bfloat16 and compute in float32
    hash=hash_queries_triton,
    cluster=cluster_codes_triton,
    refine=refine_assignments_triton,
    centroids=centroids_triton,
    centroid_attention=centroid_attention_triton,
    sparse=improved_sparse_triton,
    broadcast=broadcast_triton,
    exact_case=applied_by_stages,  # the K-means kernels write the exact case's ranks
)

