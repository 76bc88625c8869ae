"""Exact sliding-window (local) self-attention, as in ModernBERT's local layers.

Query i sees the keys j with |i - j| <= window // 2 (`window` is the full width, ModernBERT's
`local_attention`). `local_attention` cuts the queries into chunks and gives each chunk only
the keys its band can reach, so time and memory grow linearly in N; no N x N tensor is ever
built. `local_attention_dense` is the slow banded-mask version it must match.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

# Queries per step of the chunk loop: bounds the (queries x window) score tensor in memory.
_QUERIES_PER_STEP = 4096


def local_attention(
    q: Tensor, k: Tensor, v: Tensor, window: int, key_padding_mask: Tensor | None = None, scale: float | None = None,
) -> Tensor:
    """Exact banded self-attention. q, k: (B, H, N, D), v: (B, H, N, Dv) -> (B, H, N, Dv).

    window: full band width; query i attends keys j with |i - j| <= window // 2.
    key_padding_mask: (B, N) bool, True = real token. Padded keys get no weight; padded
        query rows are 0 (the rules of `kernels.attention`).
    scale: logit scale, default 1 / sqrt(D).
    """
    _check(q, k, v, window, key_padding_mask)
    b, h, n, d = q.shape
    radius = window // 2
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    real = (
        torch.ones(b, n, dtype=torch.bool, device=q.device)
        if key_padding_mask is None
        else key_padding_mask.to(device=q.device, dtype=torch.bool)
    )
    chunk = min(n, max(64, radius))
    n_chunks = -(-n // chunk)
    span = chunk + 2 * radius  # keys a chunk of queries can reach
    tail = n_chunks * chunk - n

    # Pad the keys by `radius` on both sides (and the chunk remainder) so every chunk's key
    # span is a fixed-size slice; the padding is masked out like padded tokens.
    k_pad = F.pad(k, (0, 0, radius, radius + tail))  # (B, H, N' + 2r, D)
    v_pad = F.pad(v, (0, 0, radius, radius + tail))
    real_pad = F.pad(real, (radius, radius + tail), value=False)  # (B, N' + 2r)
    q_pad = F.pad(q, (0, 0, 0, tail))  # (B, H, N', D)

    # Chunk query c (local index i) and key slot s (local index j) are 2r apart at most
    # exactly when 0 <= j - i <= 2r: the same band for every chunk.
    offsets = torch.arange(span, device=q.device)[None, :] - torch.arange(chunk, device=q.device)[:, None]
    band = (offsets >= 0) & (offsets <= 2 * radius)  # (C, C + 2r)

    out = torch.empty(b, h, n_chunks * chunk, v.shape[-1], dtype=q.dtype, device=q.device)
    chunks_per_step = max(1, _QUERIES_PER_STEP // chunk)
    for first in range(0, n_chunks, chunks_per_step):
        last = min(n_chunks, first + chunks_per_step)
        start, stop = first * chunk, last * chunk
        keys = slice(start, stop + 2 * radius)
        # (B, H, c, D, C + 2r) -> (B, H, c, C + 2r, D): overlapping key spans, one per chunk
        k_win = k_pad[:, :, keys].unfold(2, span, chunk).transpose(-1, -2)
        v_win = v_pad[:, :, keys].unfold(2, span, chunk).transpose(-1, -2)
        key_real = real_pad[:, keys].unfold(1, span, chunk)  # (B, c, C + 2r)
        mask = band & key_real[:, None, :, None, :]  # (B, 1, c, C, C + 2r)
        q_win = q_pad[:, :, start:stop].reshape(b, h, last - first, chunk, d)  # (B, H, c, C, D)
        o = F.scaled_dot_product_attention(q_win, k_win, v_win, attn_mask=mask, scale=scale)
        out[:, :, start:stop] = o.reshape(b, h, stop - start, -1)

    out = out[:, :, :n]
    # Padded queries far from real tokens have no real key in reach (SDPA gives NaN there).
    return torch.where(real[:, None, :, None], out, torch.zeros((), dtype=out.dtype, device=out.device))


def local_attention_dense(
    q: Tensor, k: Tensor, v: Tensor, window: int, key_padding_mask: Tensor | None = None, scale: float | None = None,
) -> Tensor:
    """The reference: the same attention through an N x N banded mask (small N only)."""
    _check(q, k, v, window, key_padding_mask)
    b, _, n, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    pos = torch.arange(n, device=q.device)
    band = (pos[None, :] - pos[:, None]).abs() <= window // 2  # (N, N)
    real = (
        torch.ones(b, n, dtype=torch.bool, device=q.device)
        if key_padding_mask is None
        else key_padding_mask.to(device=q.device, dtype=torch.bool)
    )
    mask = band & real[:, None, None, :]  # (B, 1, N, N)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return torch.where(real[:, None, :, None], out, torch.zeros((), dtype=out.dtype, device=out.device))


def _check(q: Tensor, k: Tensor, v: Tensor, window: int, key_padding_mask: Tensor | None) -> None:
    if q.dim() != 4 or k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            "local_attention is self-attention: q, k must share shape (B, H, N, D) and v must be "
            f"(B, H, N, Dv); got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window: must be a non-negative integer (full band width), got {window!r}")
    b, _, n, _ = q.shape
    if key_padding_mask is not None and tuple(key_padding_mask.shape) != (b, n):
        raise ValueError(
            f"key_padding_mask: expected shape (B, N) = {(b, n)}, got {tuple(key_padding_mask.shape)}"
        )
