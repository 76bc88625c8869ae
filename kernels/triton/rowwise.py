"""The encoders' row-wise steps between their products as single Triton kernels, each one
pass over its tensors: what kernels/reference/rowwise.py defines in PyTorch ops.

    _add_layer_norm_kernel  (row blocks,)     BLOCK_R rows of x + branch, rounded to x's dtype,
                                              normalised in float32 (mean, then the mean square
                                              of the centred row), scaled and shifted: read x and
                                              branch once, write the norm once
    _gated_kernel           (T, F blocks)     silu(gate) rounded to the dtype, times up, of one
                                              (T, 2F) product [gate | up]: read it once, write
                                              (T, F) once

The unfused ops they replace run 2 and 2 launches (an add and a LayerNorm; the activation and
the product) and move each intermediate through memory twice more. Rounding follows the
unfused ops' (the sum and the activation rounded to the dtype before the next step); the
reduction's order is the kernel's own, so rows agree with PyTorch's within float32 rounding
of the statistics, not bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from clusterserve.kernels.triton.helpers import pow2_block, rounded

# Rows a program of the LayerNorm normalises; elements of (T, F) a program of the gated kernel takes.
BLOCK_R = 4
BLOCK_F = 1024


@triton.jit
def _add_layer_norm_kernel(
    x_ptr, b_ptr, w_ptr, beta_ptr, out_ptr,
    stride_x, stride_b, T, C, eps,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """x, branch (T, C) by row strides, weight and bias (C,) -> out (T, C) contiguous in x's dtype."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    ok = (rows < T)[:, None] & (cols < C)[None, :]
    at = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + at * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + at * stride_b + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    s = rounded(x + b, out_ptr.dtype.element_ty).to(tl.float32)
    mean = tl.sum(s, axis=1) / C
    centred = tl.where(ok, s - mean[:, None], 0.0)
    var = tl.sum(centred * centred, axis=1) / C
    inv = 1.0 / tl.sqrt(var + eps)
    w = tl.load(w_ptr + cols, mask=cols < C, other=0.0).to(tl.float32)
    y = centred * inv[:, None] * w[None, :]
    if HAS_BIAS:
        y += tl.load(beta_ptr + cols, mask=cols < C, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + at * C + cols[None, :], rounded(y, out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gated_kernel(h_ptr, out_ptr, stride_h, F, BLOCK_F: tl.constexpr):
    """h (T, 2F) = [gate | up] by row stride -> out (T, F) contiguous: silu(gate) * up."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    ok = cols < F
    gate = tl.load(h_ptr + row * stride_h + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + row * stride_h + F + cols, mask=ok, other=0.0).to(tl.float32)
    act = rounded(gate / (1.0 + tl.exp(-gate)), out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * F + cols, rounded(act * up, out_ptr.dtype.element_ty), mask=ok)


def add_layer_norm_triton(x: Tensor, branch: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
    """add_layer_norm_torch for x, branch (T, C) of one dtype with unit column stride -> (T, C)
    contiguous in x's dtype. One launch."""
    if x.dim() != 2 or branch.shape != x.shape or x.dtype != branch.dtype:
        raise ValueError(f"x and branch must be (T, C) of one dtype, got {tuple(x.shape)} {x.dtype} and "
                         f"{tuple(branch.shape)} {branch.dtype}")
    if x.stride(1) != 1 or branch.stride(1) != 1:
        raise ValueError("x and branch must have unit column stride")
    t, c = x.shape
    out = torch.empty(t, c, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    _add_layer_norm_kernel[(triton.cdiv(t, BLOCK_R),)](
        x, branch, weight, weight if bias is None else bias, out, x.stride(0), branch.stride(0), t, c, eps,
        BLOCK_R=BLOCK_R, BLOCK_C=pow2_block(c), HAS_BIAS=bias is not None,
    )
    return out


def gated_triton(gate_up: Tensor) -> Tensor:
    """gated_torch with silu for gate_up (T, 2F) with unit column stride -> (T, F) contiguous. One launch."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up must be (T, 2F) with unit column stride, got {tuple(gate_up.shape)}")
    t, f = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(t, f, dtype=gate_up.dtype, device=gate_up.device)
    if t == 0:
        return out
    _gated_kernel[(t, triton.cdiv(f, BLOCK_F))](gate_up, out, gate_up.stride(0), f, BLOCK_F=BLOCK_F)
    return out
