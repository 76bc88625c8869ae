"""The native backend of clustered and improved clustered attention: the reference's stages
with the hashing, the K-means, the refinement, the cluster means, i-clustered's centroid pass
(A^c V and the top-k in one sweep over the keys) and the per-query sparse part in the C loops
of native.c (kernels.native), on float32 or bfloat16 CPU tensors.

They do the reference's work without its (N, C) score matrices, (C, M) probabilities and
(T, tile, k) logits, and read bfloat16 q, k, v as they are (the loops widen each row as they
read it): no stage makes a float32 copy of q, k or v. The gathers of each cluster's top-k rows
stay PyTorch ops (those few rows are upcast), and the centroid pass of clustered attention
(no top-k) is PyTorch's SDPA with the centroids as queries, on a quarter of the (batch, head)
slices of k and v at a time, upcast to float32 when they are not, except on bfloat16 k and v
where the CPU has AVX512-BF16: there a native pass multiplies them as they are (vdpbf16ps).
"""

from __future__ import annotations

import torch
from torch import Tensor

from clusterserve.kernels import native
from clusterserve.kernels.reference.clustered import broadcast, gather_rows, seed_assignments
from clusterserve.kernels.reference.full import attend
from clusterserve.kernels.reference.hashing import hash_planes
from clusterserve.kernels.reference.kmeans import initial_centroid_positions, initial_offsets
from clusterserve.kernels.spec import AttentionSpec
from clusterserve.kernels.stages import CentroidAttention, ClusteredStages

# The centroid pass of clustered attention upcasts k and v in this many parts.
UPCAST_PARTS = 4


def hash_queries(q: Tensor, spec: AttentionSpec) -> Tensor:
    _, h, _, d = q.shape
    return native.hash_codes(q, hash_planes(h, d, spec.bits, spec.seed))


def cluster_codes(codes: Tensor, query_mask: Tensor, spec: AttentionSpec) -> Tensor:
    offsets = initial_offsets(codes.shape[1], spec.seed)
    initial = codes.gather(2, initial_centroid_positions(query_mask, spec.clusters, offsets))
    return native.hamming_kmeans(codes, query_mask, initial, spec.iterations, spec.bits)


def refine_assignments(q: Tensor, assign: Tensor, query_mask: Tensor, spec: AttentionSpec) -> Tensor:
    return native.refine_clusters(q, assign, query_mask, spec.clusters, spec.refine)


def centroid_attention(centroids: Tensor, k: Tensor, v: Tensor, key_mask: Tensor, scale: float, topk: int) -> CentroidAttention:
    if not topk:  # V^c alone: SDPA's blocked kernel never holds the (C, M) probabilities
        return CentroidAttention(_centroid_values(centroids, k, v, key_mask, scale))
    values, top_index, top_probs, top_real = native.centroid_attention(centroids, k, v, key_mask, scale, topk)
    return CentroidAttention(values, top_index, top_probs, top_real)


def _centroid_values(centroids: Tensor, k: Tensor, v: Tensor, key_mask: Tensor, scale: float) -> Tensor:
    """V^c: centroids (B, H, C, D) float32, k, v (B, H, M, D|Dv) -> (B, H, C, Dv) float32.

    bfloat16 keys and values on a CPU with AVX512-BF16 take the native bfloat16 pass
    (native.centroid_values_bf16), which computes what a bfloat16 SDPA does: the centroids and
    the probabilities rounded to bfloat16, every sum in float32. Otherwise SDPA in float32:
    it takes one dtype, so k and v are taken in UPCAST_PARTS parts of their (batch, head)
    slices, each upcast on its own (at most that fraction of them is ever held in float32),
    and float32 inputs take the same parts (SDPA's result may depend on the shape of a call):
    there bfloat16 gives what float32 gives on the same values."""
    if native.bf16_centroid_pass(k, v):
        return native.centroid_values_bf16(centroids, k, v, key_mask, scale)
    b, h, c, _ = centroids.shape
    dv = v.shape[-1]
    cent, keys, vals = (t.reshape(b * h, 1, *t.shape[2:]) for t in (centroids, k, v))  # one slice per row
    mask = None if bool(key_mask.all()) else key_mask.repeat_interleave(h, dim=0)  # (B * H, M)
    values = torch.empty(b * h, 1, c, dv, dtype=torch.float32)
    step = -(-b * h // UPCAST_PARTS)
    for s in range(0, b * h, step):
        part = slice(s, s + step)
        part_mask = None if mask is None else mask[part]
        values[part] = attend(cent[part], keys[part].float(), vals[part].float(), part_mask, scale)
    return values.view(b, h, c, dv)


def broadcast_values(centroid_values: Tensor, assign: Tensor, dtype: torch.dtype) -> Tensor:
    # Rounded per cluster, then given to the members: no (B, H, N, Dv) float32 tensor.
    return broadcast(centroid_values.to(dtype), assign, dtype)


def improved_sparse(
    q: Tensor, k: Tensor, v: Tensor, assign: Tensor, centroid: CentroidAttention, key_mask: Tensor, scale: float,
    dtype: torch.dtype,
) -> Tensor:
    top_values = gather_rows(v, centroid.top_index).float()  # (B, H, C, k, Dv)
    bottom_values = centroid.values - (centroid.top_probs[..., None] * top_values).sum(-2)  # eq. (17)
    top_keys = gather_rows(k, centroid.top_index).float()
    mass = centroid.top_probs.sum(-1)
    out = native.improved_sparse(q, assign, top_keys, top_values, centroid.top_real, mass, bottom_values, scale)
    return out.to(dtype)


NATIVE = ClusteredStages(
    name="native", compute=native.compute_dtype, hash=hash_queries, cluster=cluster_codes,
    seed=seed_assignments, refine=refine_assignments, centroids=native.cluster_means, centroid_attention=centroid_attention,
    sparse=improved_sparse, broadcast=broadcast_values, contiguous=True,
)
