"""The masking rule every method shares: which keys and which queries are real."""

from __future__ import annotations

import torch
from torch import Tensor


def token_masks(q: Tensor, k: Tensor, key_padding_mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """(key_mask (B, M), query_mask (B, N)), True = real token.

    The key padding mask marks the queries too only for self-attention (N == M); with
    N != M every query is real.
    """
    b, n, m = q.shape[0], q.shape[2], k.shape[2]
    if key_padding_mask is None:
        key_mask = torch.ones(b, m, dtype=torch.bool, device=q.device)
    else:
        key_mask = key_padding_mask
    query_mask = key_mask if n == m else torch.ones(b, n, dtype=torch.bool, device=q.device)
    return key_mask, query_mask
