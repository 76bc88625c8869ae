"""SMYRF: attention within balanced asymmetric-LSH clusters (Daras et al. 2020, arXiv:2010.05315).

Per hashing round: map queries and keys with the asymmetric transforms of eq. (4),
    F(q) = [q; 0; sqrt(MQ^2 + MK^2 - |q|^2)],   G(k) = [k; sqrt(MQ^2 + MK^2 - |k|^2); 0],
so that |F(q) - G(k)|^2 = 2 (MQ^2 + MK^2 - q.k) falls as the inner product grows; project both
on one random direction (the E2LSH hash without floor, eq. 14; its offset b does not change
the order and is dropped); sort queries and keys separately and cut both sorted lists into
the same number L of balanced clusters; attend inside each cluster, keeping each query's
log-sum-exp. Rounds are merged weighted by their softmax mass (eq. 15).

With N real queries and M real keys, L = min(ceil(max(N, M) / cluster_size), N, M), and the
rank-r query of N falls in cluster floor(r L / N) (keys likewise): clusters differ in size by
at most one, for any length. One cluster (cluster_size >= max(N, M)) is exact attention.
This file holds the reference backend's stages (kernels/stages.py runs them); the Triton
kernels live in triton/smyrf.py.
"""

from __future__ import annotations

import torch
from torch import Tensor

from clusterserve.kernels.reference.hashing import seeded_generator
from clusterserve.kernels.reference.masks import token_masks
from clusterserve.kernels.spec import AttentionSpec
from clusterserve.kernels.stages import SmyrfStages, float32_or_64, sort_by_hash


def smyrf_cluster_count(n_real, m_real, cluster_size: int):
    """L = min(ceil(max(N, M) / cluster_size), N, M), at least 1: the clusters of N real
    queries and M real keys. n_real, m_real: ints, or integer tensors of the same shape."""
    if isinstance(n_real, Tensor):
        most = (torch.maximum(n_real, m_real) + cluster_size - 1) // cluster_size
        return torch.minimum(most, torch.minimum(n_real, m_real)).clamp(min=1)
    return max(1, min(-(-max(n_real, m_real) // cluster_size), n_real, m_real))


def smyrf_projections(rounds: int, heads: int, dim: int, seed: int) -> Tensor:
    """Random hash directions for the (D + 2)-dim transformed vectors: (R, H, D + 2) on CPU."""
    return torch.randn(rounds, heads, dim + 2, generator=seeded_generator(seed, 2))


def asymmetric_hashes(
    q: Tensor, k: Tensor, query_mask: Tensor, key_mask: Tensor, projections: Tensor
) -> tuple[Tensor, Tensor]:
    """Hash values of F(q) and G(k) for every round: (R, B, H, N) and (R, B, H, M).

    Max norms are taken over real tokens per (batch, head). Padded tokens hash to +inf so
    they sort last.
    """
    q_sq, k_sq = (q * q).sum(-1), (k * k).sum(-1)  # (B, H, N), (B, H, M)
    max_q = q_sq.masked_fill(~query_mask[:, None, :], 0).amax(-1, keepdim=True)
    max_k = k_sq.masked_fill(~key_mask[:, None, :], 0).amax(-1, keepdim=True)
    radius = max_q + max_k
    q_extra = (radius - q_sq).clamp(min=0).sqrt()  # F(q)'s last coordinate
    k_extra = (radius - k_sq).clamp(min=0).sqrt()  # G(k)'s second-to-last coordinate
    a = projections.to(device=q.device, dtype=q.dtype)[:, None]  # (R, 1, H, D + 2)
    d = q.shape[-1]
    q_hash = torch.einsum("bhnd,rbhd->rbhn", q, a[..., :d]) + q_extra * a[..., d + 1, None]
    k_hash = torch.einsum("bhmd,rbhd->rbhm", k, a[..., :d]) + k_extra * a[..., d, None]
    inf = torch.tensor(float("inf"), dtype=q.dtype, device=q.device)
    q_hash = torch.where(query_mask[None, :, None, :], q_hash, inf)
    k_hash = torch.where(key_mask[None, :, None, :], k_hash, inf)
    return q_hash, k_hash


def cluster_slots(order: Tensor, counts: Tensor, n_clusters: Tensor) -> tuple[Tensor, Tensor]:
    """Lay sorted positions out as clusters.

    order: (B, H, N) positions sorted by hash; counts: (B,) real tokens; n_clusters: (B,) L.
    Returns positions (B, H, L_max, S) and validity (B, 1, L_max, S), S the largest cluster.
    """
    b, h, n = order.shape
    l_max = int(n_clusters.max())
    size = int(((counts + n_clusters - 1) // n_clusters).max())
    c = torch.arange(l_max, device=order.device)[None, :]
    lc = n_clusters[:, None]
    start = (c * counts[:, None] + lc - 1) // lc  # ceil(c N / L)
    stop = ((c + 1) * counts[:, None] + lc - 1) // lc
    rank = start[:, :, None] + torch.arange(size, device=order.device)  # (B, L, S)
    valid = (rank < stop[:, :, None]) & (c < lc)[:, :, None]
    rank = rank.clamp(max=n - 1).reshape(b, 1, l_max * size).expand(b, h, -1)
    positions = order.gather(2, rank).reshape(b, h, l_max, size)
    return positions, valid[:, None]


def hash_tokens(q: Tensor, k: Tensor, key_padding_mask: Tensor | None, spec: AttentionSpec) -> tuple[Tensor, Tensor]:
    """The hash stage: F(q) and G(k) projected on each round's direction, (R, B, H, N) and
    (R, B, H, M); padded tokens hash to +inf."""
    key_mask, query_mask = token_masks(q, k, key_padding_mask)
    projections = smyrf_projections(spec.hash_rounds, q.shape[1], q.shape[-1], spec.seed)
    return asymmetric_hashes(q, k, query_mask, key_mask, projections)


def cluster_counts(query_mask: Tensor, key_mask: Tensor, cluster_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Real queries (B,), real keys (B,) and the number of clusters L (B,) of each sequence."""
    n_real, m_real = query_mask.sum(1), key_mask.sum(1)
    return n_real, m_real, smyrf_cluster_count(n_real, m_real, cluster_size)


def cluster_attention(
    q: Tensor, k: Tensor, v: Tensor, q_orders: Tensor, k_orders: Tensor,
    key_padding_mask: Tensor | None, spec: AttentionSpec, scale: float, dtype: torch.dtype,
) -> Tensor:
    """The cluster-attention stage: per round, cut the sorted queries and keys into the same
    number of balanced clusters, attend inside each, and merge the rounds by softmax mass.

    q: (B, H, N, D), k: (B, H, M, D), v: (B, H, M, Dv); q_orders (R, B, H, N), k_orders
    (R, B, H, M) -> (B, H, N, Dv) in dtype, padded queries 0.
    """
    b, h, n, _ = q.shape
    key_mask, query_mask = token_masks(q, k, key_padding_mask)
    n_real, m_real, n_clusters = cluster_counts(query_mask, key_mask, spec.cluster_size)
    out = torch.zeros(b, h, n, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.full((b, h, n), float("-inf"), dtype=q.dtype, device=q.device)
    for q_order, k_order in zip(q_orders, k_orders):
        q_pos, q_valid = cluster_slots(q_order, n_real, n_clusters)
        k_pos, k_valid = cluster_slots(k_order, m_real, n_clusters)
        round_out, round_lse = _cluster_attention(q, k, v, q_pos, q_valid, k_pos, k_valid, scale)
        out, lse = merge_by_mass(out, lse, round_out, round_lse)
    return (out * query_mask[:, None, :, None]).to(dtype)


def _cluster_attention(q, k, v, q_pos, q_valid, k_pos, k_valid, scale) -> tuple[Tensor, Tensor]:
    """Exact attention inside each cluster, scattered back to query order.

    Returns out (B, H, N, Dv) and lse (B, H, N); queries in no cluster get 0 and -inf.
    """
    b, h, n, d = q.shape
    dv = v.shape[-1]
    l_max, s_q = q_pos.shape[2:]
    s_k = k_pos.shape[3]
    q_cl = q.gather(2, q_pos.reshape(b, h, -1, 1).expand(-1, -1, -1, d)).reshape(b, h, l_max, s_q, d)
    k_cl = k.gather(2, k_pos.reshape(b, h, -1, 1).expand(-1, -1, -1, d)).reshape(b, h, l_max, s_k, d)
    v_cl = v.gather(2, k_pos.reshape(b, h, -1, 1).expand(-1, -1, -1, dv)).reshape(b, h, l_max, s_k, dv)
    logits = (q_cl @ k_cl.transpose(-1, -2)) * scale  # (B, H, L, Sq, Sk)
    logits = logits.masked_fill(~k_valid[..., None, :], float("-inf"))
    lse_cl = torch.logsumexp(logits, dim=-1)  # (B, H, L, Sq)
    probs = torch.nan_to_num(torch.exp(logits - lse_cl[..., None]), nan=0.0)
    out_cl = probs @ v_cl  # (B, H, L, Sq, Dv)
    # Scatter back; slots that hold no query write to a spare row n.
    target = torch.where(q_valid, q_pos, n).reshape(b, h, -1)
    out = torch.zeros(b, h, n + 1, dv, dtype=q.dtype, device=q.device)
    out.scatter_(2, target[..., None].expand(-1, -1, -1, dv), out_cl.reshape(b, h, -1, dv))
    lse = torch.full((b, h, n + 1), float("-inf"), dtype=q.dtype, device=q.device)
    lse.scatter_(2, target, lse_cl.reshape(b, h, -1))
    return out[:, :, :n], lse[:, :, :n]


def merge_by_mass(out: Tensor, lse: Tensor, round_out: Tensor, round_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Merge two partial attentions by their softmax mass (eq. 15), online.

    out, round_out: (B, H, N, Dv); lse, round_lse: (B, H, N). A side with lse = -inf has no
    mass; both -inf gives 0 and -inf.
    """
    new_lse = torch.logaddexp(lse, round_lse)
    finite = torch.isfinite(new_lse)
    safe = torch.where(finite, new_lse, torch.zeros_like(new_lse))
    w_old = torch.where(finite, torch.exp(lse - safe), torch.zeros_like(lse))
    w_new = torch.where(finite, torch.exp(round_lse - safe), torch.zeros_like(lse))
    return out * w_old[..., None] + round_out * w_new[..., None], new_lse


REFERENCE = SmyrfStages(

    name="reference", compute=float32_or_64, hash=hash_tokens, sort=sort_by_hash, cluster_attention=cluster_attention,
)
