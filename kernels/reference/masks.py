"""The masking rule every method shares: which keys and which queries are real."""

from __future__ import annotations

import torch
from torch import Tensor

from clusterserve.kernels.reference.hashing import on_device


def _all_real(batch: int, length: int) -> Tensor:
    return torch.ones(batch, length, dtype=torch.bool)


def token_masks(q: Tensor, k: Tensor, key_padding_mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """(key_mask (B, M), query_mask (B, N)), True = real token.

    The key padding mask marks the queries too only for self-attention (N == M); with
    N != M every query is real. A mask of all real tokens is a device constant (on_device),
    read, never written: no call fills one.
    """
    b, n, m = q.shape[0], q.shape[2], k.shape[2]
    if key_padding_mask is None:
        key_mask = on_device(_all_real, (b, m), q.device)
    else:
        key_mask = key_padding_mask
    query_mask = key_mask if n == m else on_device(_all_real, (b, n), q.device)
    return key_mask, query_mask
