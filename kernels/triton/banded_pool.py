"""Banded attention's pool stage as one Triton kernel (kernels/triton/banded.py runs the
pipeline; kernels/reference/banded.py is the definition):

    _pool_kernel  one program per (batch x head, block): the mean key (float32, and for
                  half-precision inputs its split_parts, so no later kernel splits it again), the
                  mean value (rounded to v's dtype) and, from the first head's program, the
                  block's log count, which of its keys count (real, not sinks) and each key's
                  additive masks (key_bias: 0 or -inf, for real and for counted).

k and v are read by their strides (rows of unit stride). `key_bias` and `mean_key_parts` hand
the later stages what the pool wrote.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from clusterserve.kernels.reference.banded import sink_positions
from clusterserve.kernels.spec import AttentionSpec
from clusterserve.kernels.stages import Pooled
from clusterserve.kernels.triton.helpers import head_start, pow2_block, rounded, split_parts, unit_rows


@triton.jit
def _pool_kernel(
    k_ptr, v_ptr, real_ptr, sink_ptr, sreal_ptr, pk_ptr, parts_ptr, pv_ptr, plog_ptr, counted_ptr, bias_ptr,
    stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, N, H, NB, S, SIZE, PLANE, PLANE_N,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    bh = tl.program_id(0)
    b = bh // H
    t = tl.program_id(1)
    k_head = head_start(k_ptr, bh, H, stride_kb, stride_kh)
    v_head = head_start(v_ptr, bh, H, stride_vb, stride_vh)
    dims = tl.arange(0, BLOCK_D)
    vdims = tl.arange(0, BLOCK_DV)
    slots = tl.arange(0, BLOCK_S)
    pos = tl.load(sink_ptr + b * S + slots, mask=slots < S, other=-1)
    pos = tl.where(tl.load(sreal_ptr + b * S + slots, mask=slots < S, other=0) != 0, pos, -1)
    key_sum = tl.zeros([BLOCK_D], tl.float32)
    value_sum = tl.zeros([BLOCK_DV], tl.float32)
    count = tl.zeros([BLOCK_ROWS], tl.float32)
    steps = tl.arange(0, BLOCK_ROWS)
    for start in range(0, SIZE, BLOCK_ROWS):
        rows = t * SIZE + start + steps
        row_ok = (start + steps < SIZE) & (rows < N)
        sink = tl.max((rows[:, None] == pos[None, :]).to(tl.int32), axis=1) > 0
        real = (tl.load(real_ptr + b * N + rows, mask=row_ok, other=0) != 0) & row_ok
        counted = real & ~sink
        # the first head's program writes the row's flags and additive masks (one writer each)
        first_head = row_ok & (bh % H + steps * 0 == 0)
        tl.store(counted_ptr + b * N + rows, counted.to(tl.uint8), mask=first_head)
        tl.store(bias_ptr + b * N + rows, tl.where(real, 0.0, float("-inf")), mask=first_head)
        tl.store(bias_ptr + PLANE_N + b * N + rows, tl.where(counted, 0.0, float("-inf")), mask=first_head)
        weight = counted.to(tl.float32)
        keys = tl.load(k_head + rows[:, None] * stride_kn + dims[None, :], mask=row_ok[:, None] & (dims < D)[None, :],
            other=0.0)
        values = tl.load(v_head + rows[:, None] * stride_vn + vdims[None, :],
            mask=row_ok[:, None] & (vdims < DV)[None, :], other=0.0)
        key_sum += tl.sum(keys.to(tl.float32) * weight[:, None], axis=0)
        value_sum += tl.sum(values.to(tl.float32) * weight[:, None], axis=0)
        count += weight
    total = tl.sum(count, axis=0)
    per = tl.maximum(total, 1.0)
    mean = key_sum / per
    tl.store(pk_ptr + (bh * NB + t) * D + dims, mean, mask=dims < D)
    if k_ptr.dtype.element_ty != tl.float32:  # the mean key's half parts, for the choice scores
        hi, mid, lo, _ = split_parts(mean, k_ptr.dtype.element_ty)
        at = parts_ptr + (bh * NB + t) * D + dims  # (3, B, H, NB, D): PLANE apart
        tl.store(at, hi, mask=dims < D)
        tl.store(at + PLANE, mid, mask=dims < D)
        tl.store(at + 2 * PLANE, lo, mask=dims < D)
    tl.store(pv_ptr + (bh * NB + t) * DV + vdims, rounded(value_sum / per, pv_ptr.dtype.element_ty), mask=vdims < DV)
    log_count = tl.where(total > 0, tl.log(per), float("-inf")) + tl.zeros([BLOCK_S], tl.float32)
    tl.store(plog_ptr + b * NB + t + slots * 0, log_count, mask=slots + bh % H == 0)  # slot 0 of the first head



def pool(k: Tensor, v: Tensor, key_mask: Tensor, spec: AttentionSpec) -> Pooled:
    """banded.pool as one Triton kernel (one program per head and block): k (B, H, N, D),
    v (B, H, N, Dv) in their dtype, key_mask (B, N) -> Pooled: mean keys in float32, mean values
    rounded to v's dtype (what attend multiplies), counted uint8; for half-precision k, the mean
    keys also as split_parts (key_parts (3, B, H, NB, D), hi first: the mean key rounded)."""
    b, h, n, d = k.shape
    dv = v.shape[-1]
    size = spec.block
    blocks = -(-n // size)
    k, v = unit_rows(k), unit_rows(v)
    sinks, sink_real = sink_positions(key_mask, spec.sinks)
    keys = k.new_empty(b, h, blocks, d, dtype=torch.float32)
    half = k.dtype != torch.float32
    parts = k.new_empty(3, b, h, blocks, d) if half else keys
    values = v.new_empty(b, h, blocks, dv)
    log_count = k.new_empty(b, blocks, dtype=torch.float32)
    counted = key_mask.new_empty(b, n, dtype=torch.uint8)
    bias = key_mask.new_empty(2, b, n, dtype=torch.float32)
    chosen = key_mask.new_zeros(b, h, blocks, 0, dtype=torch.int64)
    if n:
        _pool_kernel[(b * h, blocks)](
            k, v, key_mask.contiguous(), sinks, sink_real, keys, parts, values, log_count, counted, bias,
            *k.stride()[:3], *v.stride()[:3], n, h, blocks,
            sinks.shape[1], size, b * h * blocks * d, b * n, D=d, DV=dv, BLOCK_D=pow2_block(d), BLOCK_DV=pow2_block(dv),
            BLOCK_ROWS=pow2_block(size, high=64), BLOCK_S=pow2_block(sinks.shape[1]),
        )
    return Pooled(keys, values, log_count, sinks, sink_real, counted, chosen, parts if half else None, bias)


def key_bias(pooled: Pooled) -> Tensor:
    """The Triton pool's additive key masks (Pooled.key_bias)."""
    if pooled.key_bias is None:
        raise ValueError("attend needs the Triton pool's additive key masks")
    return pooled.key_bias


def mean_key_parts(pooled: Pooled, dtype: torch.dtype) -> tuple[Tensor, int]:
    """The mean keys the kernels read for queries of `dtype`, and the distance between their
    split parts (PLANE): float32 keys as they are, or the Triton pool's key_parts (3, B, H,
    NB, D) in the half dtype."""
    keys = pooled.keys if dtype == torch.float32 else pooled.key_parts
    if keys is None or keys.dtype != dtype:
        raise ValueError(f"{dtype} queries need the mean keys split into {dtype} parts (the Triton pool's)")
    keys = keys.contiguous()
    return keys, pooled.keys.numel()  # B H NB D
