"""Rotary position embeddings as one Triton kernel: what kernels.reference.rotary.apply_rotary_torch
computes in PyTorch (seven element-wise kernels a tensor: an upcast, a negation, a concat,
two products, a sum and a downcast), in one pass over the tensor; kernels.apply_rotary launches
it for packed CUDA tensors.

    _rotary_kernel  (token blocks,)   for BLOCK_T tokens, their cos / sin rows loaded once, each
                                      head's (BLOCK_T, D) rows and their partners rotated

The arithmetic is apply_rotary_torch's, operation for operation, in float32: x * cos, then the
partner (negated for the first of each pair) * sin, their sum, rounded to x's dtype to
nearest even. The launch turns off the compiler's fusion of the product and the sum into
one multiply-add, so the result is bit for bit PyTorch's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from clusterserve.kernels.triton.helpers import pow2_block, rounded

# Tokens a program rotates: every head of them, their cos / sin rows read once.
BLOCK_T = 32


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr,
    stride_xt, stride_xh, stride_xd, stride_ct, stride_cd, stride_st, stride_sd,
    T, H, D,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, INTERLEAVED: tl.constexpr,
):
    """x (T, H, D) by strides, cos and sin (T, D) by strides (float32) -> out (T, H, D)
    contiguous in x's dtype. A component's partner: d +- D/2 ("half" layout), d ^ 1
    (interleaved); the first of each pair takes its partner negated."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    dims = tl.arange(0, BLOCK_D)
    if INTERLEAVED:
        partner = dims ^ 1
        first = dims % 2 == 0
    else:
        half = D // 2
        partner = tl.where(dims < half, dims + half, dims - half)
        first = dims < half
    ok = (tokens < T)[:, None] & (dims < D)[None, :]
    rows = tokens.to(tl.int64)[:, None]
    cos = tl.load(cos_ptr + rows * stride_ct + dims[None, :] * stride_cd, mask=ok, other=0.0)
    sin = tl.load(sin_ptr + rows * stride_st + dims[None, :] * stride_sd, mask=ok, other=0.0)
    for head in range(0, H):
        at = x_ptr + rows * stride_xt + head * stride_xh
        x = tl.load(at + dims[None, :] * stride_xd, mask=ok, other=0.0).to(tl.float32)
        other = tl.load(at + partner[None, :] * stride_xd, mask=ok, other=0.0).to(tl.float32)
        rotated = tl.where(first[None, :], -other, other)
        out = x * cos + rotated * sin
        tl.store(out_ptr + (rows * H + head) * D + dims[None, :], rounded(out, out_ptr.dtype.element_ty), mask=ok)


def rotary_triton(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> Tensor:
    """apply_rotary_torch on packed tokens: x (T, H, D) float32, float16 or bfloat16, any strides;
    cos, sin (T, 1, D) float32 -> (T, H, D) contiguous in x's dtype. One launch."""
    t, h, d = x.shape
    if cos.shape != (t, 1, d) or sin.shape != (t, 1, d):
        raise ValueError(f"cos and sin must be (T, 1, D) = ({t}, 1, {d}), got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if d % 2:
        raise ValueError(f"head dim must be even to rotate pairs, got {d}")
    out = torch.empty(t, h, d, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    _rotary_kernel[(triton.cdiv(t, BLOCK_T),)](
        x, cos, sin, out, *x.stride(), cos.stride(0), cos.stride(2), sin.stride(0), sin.stride(2), t, h, d,
        BLOCK_T=BLOCK_T, BLOCK_D=pow2_block(d, 2), INTERLEAVED=interleaved, enable_fp_fusion=False,
    )
    return out
