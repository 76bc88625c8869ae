"""Rotary position embeddings (RoPE, Su et al. 2021, arXiv:2104.09864) in PyTorch element-wise
ops: the definition that the Triton kernel (kernels/triton/rotary.py) and the native loop
(kernels.native.rotary) give bit for bit. `kernels.apply_rotary` chooses which runs."""

from __future__ import annotations

import torch
from torch import Tensor


def apply_rotary_torch(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> Tensor:
    """Rotate x: (..., N, D) by the angles of its N positions, cos and sin (float32) broadcasting
    to x's shape: (N, D) for (B, H, N, D), or (T, 1, D) for packed (T, H, D). Pairs are
    (i, i + D/2), or (2i, 2i + 1) when `interleaved`. Computed in float32, returned in x's dtype."""
    xf = x.float()
    if interleaved:
        even, odd = xf[..., 0::2], xf[..., 1::2]
        rotated = torch.stack((-odd, even), dim=-1).flatten(-2)
    else:
        half = x.shape[-1] // 2
        rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)
