"""The native backend of SMYRF: the reference's stages (smyrf.py) as C loops of native.c
(bound in kernels.native), one (batch, head) slice per call, on float32 or bfloat16 CPU tensors
(bfloat16 rows are widened as the loops read them, never copied to float32):

    hash                smyrf_hashes: max norms, the asymmetric transform and every round's
                        projection in one pass over the tokens; padded tokens +inf
    sort                argsort_rows: a stable LSD radix sort of each row of hashes, the order
                        of torch's stable argsort
    cluster_attention   smyrf_attention: every round's clusters and the merge by mass

The loop walks the balanced clusters of each round's sorted orders (the same L and the same
rank -> cluster rule as the reference, smyrf.cluster_slots), gathers each cluster's keys and
values once, and folds the cluster's logits into every query's running softmax (largest
logit, sum of exponentials and the weighted sum of values, kept in the output row). Summing
exp(logit) v over every (round, key) pair a query meets and dividing by the sum of
exp(logit) is the reference's merge by mass (eq. 15), without its per-round output tensors,
(L, S, S) logits and scatters.
"""

from __future__ import annotations

import torch
from torch import Tensor

from clusterserve.kernels import native
from clusterserve.kernels.reference.masks import token_masks
from clusterserve.kernels.reference.smyrf import cluster_counts, smyrf_projections
from clusterserve.kernels.spec import AttentionSpec
from clusterserve.kernels.stages import SmyrfStages


def hash_tokens(q: Tensor, k: Tensor, key_padding_mask: Tensor | None, spec: AttentionSpec) -> tuple[Tensor, Tensor]:
    """smyrf.hash_tokens: (R, B, H, N) and (R, B, H, M) hashes, padded tokens +inf."""
    key_mask, query_mask = token_masks(q, k, key_padding_mask)
    projections = smyrf_projections(spec.hash_rounds, q.shape[1], q.shape[-1], spec.seed)
    return native.smyrf_hashes(q, k, query_mask, key_mask, projections)


def sort_by_hash(q_hashes: Tensor, k_hashes: Tensor) -> tuple[Tensor, Tensor]:
    """stages.sort_by_hash: positions in hash order, ties by position."""
    return native.argsort(q_hashes), native.argsort(k_hashes)


def cluster_attention(
    q: Tensor, k: Tensor, v: Tensor, q_orders: Tensor, k_orders: Tensor,
    key_padding_mask: Tensor | None, spec: AttentionSpec, scale: float, dtype: torch.dtype,
) -> Tensor:
    """smyrf.cluster_attention in native.c: (B, H, N, D), (B, H, M, D), (B, H, M, Dv) float32
    or bfloat16 and the sort orders (R, B, H, N), (R, B, H, M) -> (B, H, N, Dv) in dtype,
    padded queries 0."""
    key_mask, query_mask = token_masks(q, k, key_padding_mask)
    n_real, m_real, n_clusters = cluster_counts(query_mask, key_mask, spec.cluster_size)
    out, _, _ = native.smyrf_attention(q, k, v, q_orders, k_orders, n_real, m_real, n_clusters, scale)
    return out.to(dtype)


NATIVE = SmyrfStages(
    name="native", compute=native.compute_dtype, hash=hash_tokens, sort=sort_by_hash,
    cluster_attention=cluster_attention, contiguous=True,
)
