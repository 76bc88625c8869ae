"""Exact softmax attention through PyTorch's SDPA, with the project's masking rules.

SDPA with a key mask leaves the flash kernels. So on CUDA, in float16 / bfloat16, padded self-
attention runs flash attention's variable-length form instead (torch.nn.attention.varlen with
`seqused_k`: each row attends to its first n real keys, the padded ones never read, no mask),
which keeps fixed shapes for CUDA graphs; where that call fails (an older torch, a GPU its
kernels do not take) it is logged once and the masked SDPA runs from then on.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

# With a `check`, exact attention on a CPU runs this many queries at a time and calls it in
# between: at 32k tokens on a 2-core CPU one layer's exact attention is ~10 s, a block well under
# 1 s. On a GPU the layer is milliseconds (and its launches return at once): one call, one check.
CHECKED_QUERY_BLOCK = 2048
VARLEN_DTYPES = (torch.float16, torch.bfloat16)
log = logging.getLogger("clusterserve")
_varlen_failed = False


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
    out = padded_varlen(q, k, v, key_padding_mask, scale) if takes_varlen(q) else None
    if out is None:
        attn_mask = key_padding_mask[:, None, None, :]  # (B, 1, 1, M)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
    # A row whose keys are all padded has no softmax; SDPA returns NaN there.
    has_keys = key_padding_mask.any(dim=1)[:, None, None, None]
    return torch.where(has_keys, out, torch.zeros((), dtype=out.dtype, device=out.device))


def takes_varlen(q: Tensor) -> bool:
    """Whether padded attention on q runs the variable-length flash kernel: CUDA, half precision."""
    return q.is_cuda and q.dtype in VARLEN_DTYPES and not _varlen_failed


def padded_varlen(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor, scale: float) -> Tensor | None:
    """softmax(q k^T * scale) v over each row's first n_b keys, n_b = its mask's count (the
    project's padding is at a row's end), by torch's varlen flash attention with seqused_k; None
    where that call fails (logged once; the caller masks instead)."""
    global _varlen_failed
    b, h, n, _ = q.shape
    m = k.shape[2]

    def tokens(t: Tensor) -> Tensor:  # (B, H, N, D) -> (B N, H, D), a view for packed inputs
        return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3])

    try:
        from torch.nn.attention.varlen import varlen_attn

        starts_q = torch.arange(0, (b + 1) * n, n, device=q.device, dtype=torch.int32)
        starts_k = torch.arange(0, (b + 1) * m, m, device=q.device, dtype=torch.int32)
        used = key_padding_mask.sum(dim=1, dtype=torch.int32)
        out = varlen_attn(tokens(q), tokens(k), tokens(v), starts_q, starts_k, n, m, scale=scale, seqused_k=used)
    except Exception as error:  # noqa: BLE001 - the masked SDPA computes the same
        _varlen_failed = True
        log.warning("variable-length flash attention unavailable (%s: %s); padded exact attention runs SDPA with a "
                    "key mask", type(error).__name__, error)
        return None
    return out.view(b, n, h, -1).transpose(1, 2)
