"""Exact softmax attention through PyTorch's SDPA, with the project's masking rules."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def full_attention(
    q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, scale: float
) -> Tensor:
    """Exact attention. q: (B, H, N, D), k: (B, H, M, D), v: (B, H, M, Dv) -> (B, H, N, Dv).

    key_padding_mask: (B, M) bool, True = real key. Padded keys get no weight; when N == M
    the mask also marks padded queries, whose output rows are 0.
    """
    out = attend(q, k, v, key_padding_mask, scale)
    if key_padding_mask is not None and q.shape[2] == k.shape[2]:
        out = out * key_padding_mask[:, None, :, None].to(out.dtype)
    return out


def attend(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, scale: float) -> Tensor:
    """softmax(q k^T * scale) v over the real keys, every query row kept (rows 0 where no key is
    real): full_attention without its padded-query rule, for queries that are not tokens."""
    if key_padding_mask is None:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    attn_mask = key_padding_mask[:, None, None, :]  # (B, 1, 1, M)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
    # A row whose keys are all padded has no softmax; SDPA returns NaN there.
    has_keys = key_padding_mask.any(dim=1)[:, None, None, None]
    return torch.where(has_keys, out, torch.zeros((), dtype=out.dtype, device=out.device))
