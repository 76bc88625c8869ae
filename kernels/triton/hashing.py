"""Triton kernel for the LSH codes of clustered attention: projection on the random planes,
bias, sign and packing of the sign bits into one int64 per query, in one pass.

Matches `hashing.hash_codes` (bit b set where projection b, bias included, is positive).
Half-precision queries meet the float32 planes on tensor cores through kernels.triton.helpers (three
half-precision parts of the planes, split once per program), which keeps every sign that float32
keeps. Each head's queries are cut into chunks of whole BLOCK_N tiles (kernels.triton.helpers.chunking),
one program a chunk; the sign bits are packed as two int32 halves. For the Hamming K-means
the same launch can also write each query's bits as +-1 signs (int8), which its tensor-core
dots read.
The planes come from the same seeded CPU generator as the reference; they are copied to the
device once per (heads, dim, bits, seed, device) and kept, because a blocking host-to-device
copy inside every attention call would synchronise the host (and break CUDA-graph capture).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from clusterserve.kernels.triton.helpers import chunking, dot_parts, pow2_block, split_parts, upcast

# Codes are packed into one int64, so at most 63 bits (spec.bits <= 63): the tile is 64 wide.
BLOCK_BITS = 64
# Queries per tile (a chunk is whole tiles).
BLOCK_N = 64


@triton.jit
def _hash_kernel(
    x_ptr, planes_ptr, codes_ptr, signs_ptr,
    stride_xb, stride_xh, stride_xn, stride_xd,
    stride_ph, stride_pd, stride_pbit,
    H, N, D, BITS, CHUNK,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_BITS: tl.constexpr, SIGNS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """codes[b, h, n] = sum_bit [x[b, h, n] . planes[h, :D, bit] + planes[h, D, bit] > 0] << bit
    for the rows [chunk CHUNK, (chunk + 1) CHUNK) of one (batch, head); with SIGNS, the bits
    also as signs (B * H, N, BLOCK_BITS) int8: +1 where set, else -1 (bits past BITS too)."""
    bh = tl.program_id(1).to(tl.int64)
    batch, head = bh // H, bh % H
    start = tl.program_id(0) * CHUNK
    stop = tl.minimum(start + CHUNK, N)
    dims = tl.arange(0, HEAD_DIM)
    bit = tl.arange(0, BLOCK_BITS)
    x_head = x_ptr + batch * stride_xb + head * stride_xh
    planes_head = planes_ptr + head * stride_ph
    weights = tl.load(
        planes_head + dims[:, None] * stride_pd + bit[None, :] * stride_pbit,
        mask=(dims[:, None] < D) & (bit[None, :] < BITS), other=0.0,
    )
    bias = tl.load(planes_head + D * stride_pd + bit * stride_pbit, mask=bit < BITS, other=0.0)
    parts = split_parts(weights, x_ptr.dtype.element_ty)  # loop invariant; unused for float32 queries
    shift = (bit % 32)[None, :]
    for first in range(start, stop, BLOCK_N):
        rows = first + tl.arange(0, BLOCK_N)
        x = tl.load(x_head + rows[:, None] * stride_xn + dims[None, :] * stride_xd,
                    mask=(rows[:, None] < stop) & (dims[None, :] < D), other=0.0)
        # float32 accuracy (no TF32): a rounded plane would flip the signs of small projections.
        if x_ptr.dtype.element_ty == tl.float32:
            projections = tl.dot(x, weights, input_precision="ieee") + bias[None, :]
        else:
            projections = dot_parts(x, parts, UPCAST) + bias[None, :]
        is_set = ((projections > 0) & (bit[None, :] < BITS)).to(tl.int32)
        # Bits 0-31 and 32-63 as two int32 words: distinct bits, so their sum is their OR.
        low, high = tl.split(tl.sum(tl.reshape(is_set << shift, (BLOCK_N, 2, 32)), axis=2))
        codes = (high.to(tl.int64) << 32) | (low.to(tl.int64) & 0xFFFFFFFF)
        tl.store(codes_ptr + bh * N + rows, codes, mask=rows < stop)
        if SIGNS:
            tl.store(signs_ptr + (bh * N + rows)[:, None] * BLOCK_BITS + bit[None, :], tl.where(is_set != 0, 1, -1).to(tl.int8),
                     mask=rows[:, None] < stop)


def hash_codes_triton(x: Tensor, planes: Tensor, signs: Tensor | None = None) -> Tensor:
    """LSH codes of x: (B, H, N, D) -> (B, H, N) int64; planes (H, D + 1, bits) float32 on x's
    device. signs (B * H, N, BLOCK_BITS) int8, if given, receives the bits as +-1."""
    b, h, n, d = x.shape
    bits = planes.shape[-1]
    if planes.shape[:2] != (h, d + 1) or not 1 <= bits <= 63:
        raise ValueError(
            f"planes: expected shape (H, D + 1, bits <= 63) = ({h}, {d + 1}, bits), got {tuple(planes.shape)}"
        )
    codes = torch.empty(b, h, n, dtype=torch.int64, device=x.device)
    chunks, chunk = chunking(n, h, BLOCK_N)
    _hash_kernel[(chunks, b * h)](
        x, planes, codes, signs if signs is not None else codes,  # without signs nothing is written there
        *x.stride(),
        *planes.stride(),
        h, n, d, bits, chunk,
        BLOCK_N=BLOCK_N, HEAD_DIM=pow2_block(d), BLOCK_BITS=BLOCK_BITS, SIGNS=signs is not None, UPCAST=upcast(x),
    )
    return codes
