"""Exact softmax attention through PyTorch's SDPA, with the project's masking rules."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

# With a `check`, exact attention on a CPU runs this many queries at a time and calls it in
# between: at 32k tokens on a 2-core CPU one layer's exact attention is ~10 s, a block well under
# 1 s. On a GPU the layer is milliseconds (and its launches return at once): one call, one check.
CHECKED_QUERY_BLOCK = 2048


def full_attention(
    q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, scale: float,
    check: Callable[[], None] | None = None,
) -> Tensor:
    """Exact attention. q: (B, H, N, D), k: (B, H, M, D), v: (B, H, M, Dv) -> (B, H, N, Dv).

    key_padding_mask: (B, M) bool, True = real key. Padded keys get no weight; when N == M
    the mask also marks padded queries, whose output rows are 0.
    check: None, or called before each block of CHECKED_QUERY_BLOCK queries on a CPU (rows are
    independent: the blocks give what one call gives), once elsewhere; what it raises stops the call.
    """
    n = q.shape[2]
    if check is None or n <= CHECKED_QUERY_BLOCK or q.device.type != "cpu":
        if check is not None:
            check()
        out = attend(q, k, v, key_padding_mask, scale)
    else:
        out = q.new_empty(*q.shape[:3], v.shape[-1])
        for start in range(0, n, CHECKED_QUERY_BLOCK):
            check()
            stop = min(n, start + CHECKED_QUERY_BLOCK)
            out[:, :, start:stop] = attend(q[:, :, start:stop], k, v, key_padding_mask, scale)
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
