"""A FlashAttention-2 forward kernel in Triton, written here to validate the offline cost model
(bench/costmodel/gpu_model.py) against published H100 throughput of Triton's own fused-attention kernel.

The algorithm is FlashAttention-2's (Dao 2023, arXiv:2307.08691): one program per block of
BLOCK_M queries of one (batch, head) streams the keys in blocks of BLOCK_N with an online
softmax in base 2, both products on tensor cores with float32 accumulation. Non-causal, no
padding; N must be a multiple of the blocks. Nothing in clusterserve calls it: the model compiles
it for sm_90 like the pipelines' kernels and compares its estimate with the published figures.

    out = flash_attention(q, k, v)   # q, k, v: (B, H, N, D) float16 / bfloat16 on CUDA -> (B, H, N, D)
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _flash_forward_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    H, N, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """Rows [tile BLOCK_M, (tile + 1) BLOCK_M) of one (batch, head): softmax(q k^T) v, with
    qk_scale the logit scale times log2(e)."""
    tile = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    batch, head = bh // H, bh % H
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + batch * stride_qb + head * stride_qh + rows[:, None] * stride_qn + dims[None, :] * stride_qd)
    k_head = k_ptr + batch * stride_kb + head * stride_kh
    v_head = v_ptr + batch * stride_vb + head * stride_vh
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        keys = tl.load(k_head + cols[:, None] * stride_kn + dims[None, :] * stride_kd)
        logits = tl.dot(q, tl.trans(keys)) * qk_scale
        new_max = tl.maximum(row_max, tl.max(logits, axis=1))
        probs = tl.math.exp2(logits - new_max[:, None])
        rescale = tl.math.exp2(row_max - new_max)
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        values = tl.load(v_head + cols[:, None] * stride_vn + dims[None, :] * stride_vd)
        acc = acc * rescale[:, None] + tl.dot(probs.to(values.dtype), values)
        row_max = new_max
    out = acc / row_sum[:, None]
    tl.store(out_ptr + batch * stride_ob + head * stride_oh + rows[:, None] * stride_on + dims[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty))


def blocks(head_dim: int) -> dict:
    """Block sizes, warps and pipeline stages by head dim (the usual FlashAttention-2 shapes on
    sm_90: 128 queries a program, 4 warps at d <= 64 and 8 at d = 128)."""
    return dict(BLOCK_M=128, BLOCK_N=128 if head_dim <= 64 else 64, num_warps=4 if head_dim <= 64 else 8,
                num_stages=3)


def launch_arguments(q: Tensor, k: Tensor, v: Tensor, out: Tensor, scale: float | None = None):
    """(grid, positional arguments, keyword arguments) of the launch for (B, H, N, D) tensors."""
    b, h, n, d = q.shape
    config = blocks(d)
    if n % config["BLOCK_M"] or n % config["BLOCK_N"] or d not in (16, 32, 64, 128):
        raise ValueError(f"flash_attention: N ({n}) must be a multiple of {config['BLOCK_M']} and D in 16-128")
    scale = d ** -0.5 if scale is None else scale
    grid = (n // config["BLOCK_M"], b * h)
    args = (q, k, v, out, *q.stride(), *k.stride(), *v.stride(), *out.stride(), h, n, scale * math.log2(math.e))
    return grid, args, dict(config, HEAD_DIM=d)


def flash_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
    """softmax(q k^T scale) v for q, k, v (B, H, N, D) half precision on CUDA -> (B, H, N, D)."""
    out = torch.empty_like(q)
    grid, args, kwargs = launch_arguments(q, k, v, out, scale)
    _flash_forward_kernel[grid](*args, **kwargs)
    return out
