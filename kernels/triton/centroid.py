"""The centroid pass of clustered and improved clustered attention as Triton kernels (the
triton backend's `centroid_attention` stage; clustered.centroid_attention is the reference):
V^c = A^c V with A^c = softmax(Q^c K^T * scale) over the real keys, and for improved clustered
each cluster's top-k keys of A^c. A^c is never written.

    _centroid_attention_kernel  (centroid blocks, splits, B * H)  a split of the keys against
                                all of a head's centroids in one tile (up to 128: K and V are
                                read once per head): the split's online softmax and, for the
                                top-k, the largest logit of each of 2 TOP lanes (a key's column
                                in its block, rotated by a hash of the block, mod 2 TOP)
    _centroid_combine_kernel    (centroid blocks of 4, B * H)  V^c from the splits, each row's
                                softmax max and sum, and its threshold: the TOP-th largest lane
                                maximum, at most the row's TOP-th largest logit (lane maxima
                                are distinct keys)
    centroid_topk.centroid_topk_triton  for improved clustered: each row's keys at or above
                                its threshold, the top-k among them (kernels.triton.centroid_topk)

Softmaxes run in base 2 (kernels.triton.helpers). The centroids (float32) meet half-precision
keys as split-precision dots of two parts (helpers.LOGIT_PARTS, helpers.centroid_logits),
split once per program: the top-k differs from float32's only within ~1e-5 of a tie. The
probabilities meet half-precision values rounded to the values' dtype, as flash attention's do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from clusterserve.kernels import fallbacks
from clusterserve.kernels.reference.clustered import centroid_attention
from clusterserve.kernels.stages import CentroidAttention
from clusterserve.kernels.triton.centroid_topk import COMBINE_BLOCK_C, centroid_topk_triton
from clusterserve.kernels.triton.helpers import (
    centroid_logits,
    has_padding,
    key_splits,
    online_softmax_step,
    pow2_block,
    split_parts,
    upcast,
)

LOG2E = 1.4426950408889634
# The largest top-k (rounded up to a power of two) that the centroid pass selects on chip.
MAX_TOPK_ON_CHIP = 256
# Centroids per tile of the softmax pass (all of a head's up to this many).
SOFTMAX_BLOCK_C = 128
# Splits the merge loads a step: at most COMBINE_SPLITS (one step for up to 16 splits, where 4
# a step waited on 3 rounds of loads a pass) and no more than there are, fewer where the
# top-k's lanes are wide, so that a step holds at most COMBINE_LANE_LOADS lane maxima (4,096:
# 32 registers a thread at 4 warps).
COMBINE_SPLITS = 16
COMBINE_LANE_LOADS = 4096


@triton.jit
def _lane_shift(block, BLOCK_M: tl.constexpr):
    """The rotation of key block `block`'s columns, in [0, BLOCK_M): Fibonacci hashing on 16 bits
    (the top bits of block x 2^16 / golden ratio, mod 2^16); every product fits an int32."""
    return (((block & 0x7FFF) * 40503) & 0xFFFF) * BLOCK_M >> 16


@triton.jit
def _split_softmax(
    acc, row_max, row_sum, lanes, parts, centroids, k_head, v_head, key_mask_row, first, end, stop,
    stride_km, stride_kd, stride_vm, stride_vd, D, DV, scale,
    BLOCK_C: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
    LANES: tl.constexpr, UPCAST: tl.constexpr, MASKED: tl.constexpr,
):
    """The split's key blocks [first, end) (keys past `stop` are not the split's) folded into
    the running softmax and lane maxima; MASKED: the key mask says which keys are real, else
    all are."""
    dims = tl.arange(0, HEAD_DIM)
    vdims = tl.arange(0, VALUE_DIM)
    for start in range(first, end, BLOCK_M):
        cols = start + tl.arange(0, BLOCK_M)
        if LANES > 0:
            # A block's keys enter its columns rotated by a hash of the block (_lane_shift), so
            # that keys BLOCK_M apart (a copied position table, repeated text) fall in other lanes.
            cols = start + (tl.arange(0, BLOCK_M) + _lane_shift(start // BLOCK_M, BLOCK_M)) % BLOCK_M
        real = cols < stop
        if MASKED:
            real = real & (tl.load(key_mask_row + cols, mask=real, other=0) != 0)
        keys = tl.load(k_head + cols[:, None] * stride_km + dims[None, :] * stride_kd,
                       mask=real[:, None] & (dims[None, :] < D), other=0.0)
        values = tl.load(v_head + cols[:, None] * stride_vm + vdims[None, :] * stride_vd,
                         mask=real[:, None] & (vdims[None, :] < DV), other=0.0)
        logits = tl.where(real[None, :], centroid_logits(parts, centroids, keys, scale, UPCAST), float("-inf"))
        acc, row_max, row_sum = online_softmax_step(acc, row_max, row_sum, logits, values, UPCAST)
        if LANES > 0:
            lanes = tl.maximum(lanes, tl.max(tl.reshape(logits, (BLOCK_C, BLOCK_M // LANES, LANES)), axis=1))
    return acc, row_max, row_sum, lanes


@triton.jit
def _centroid_attention_kernel(
    centroids_ptr, k_ptr, v_ptr, key_mask_ptr, part_values_ptr, part_max_ptr, part_sum_ptr, part_lanes_ptr,
    stride_kb, stride_kh, stride_km, stride_kd,
    stride_vb, stride_vh, stride_vm, stride_vd,
    H, M, C, D, DV, SPLITS, CHUNK, scale,
    BLOCK_C: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
    LANES: tl.constexpr, UPCAST: tl.constexpr,
):
    """A block of centroids against one split of the keys, [split CHUNK, (split + 1) CHUNK):
    the split's online softmax (unnormalised values, running max and sum, float32, base 2:
    `scale` includes log2(e)) and, with LANES > 0, the largest logit of each lane (a key's
    column in its rotated block, mod LANES), to part_lanes (B * H, SPLITS, C, LANES)."""
    split = tl.program_id(1)
    bh = tl.program_id(2).to(tl.int64)
    batch, head = bh // H, bh % H
    rows = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    dims = tl.arange(0, HEAD_DIM)
    vdims = tl.arange(0, VALUE_DIM)
    in_rows = rows < C
    centroids = tl.load(centroids_ptr + (bh * C + rows)[:, None] * D + dims[None, :],
                        mask=in_rows[:, None] & (dims[None, :] < D), other=0.0)
    k_head = k_ptr + batch * stride_kb + head * stride_kh
    v_head = v_ptr + batch * stride_vb + head * stride_vh
    parts = split_parts(centroids, k_ptr.dtype.element_ty)  # loop invariant
    row_max = tl.full([BLOCK_C], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_C], tl.float32)
    acc = tl.zeros([BLOCK_C, VALUE_DIM], tl.float32)
    lanes = tl.full([BLOCK_C, LANES if LANES > 0 else 1], float("-inf"), tl.float32)
    first = split * CHUNK
    stop = tl.minimum(first + CHUNK, M)
    # A split with a padded key runs its blocks with the key mask, any other without (loads of
    # one byte a column, each at its own address: the columns are rotated).
    key_mask_row = key_mask_ptr + batch * M
    padded = has_padding(key_mask_row, first, stop)
    masked_stop = tl.where(padded, stop, first)
    clean_stop = tl.where(padded, first, stop)
    acc, row_max, row_sum, lanes = _split_softmax(
        acc, row_max, row_sum, lanes, parts, centroids, k_head, v_head, key_mask_row, first, masked_stop, stop,
        stride_km, stride_kd, stride_vm, stride_vd, D, DV, scale, BLOCK_C, BLOCK_M, HEAD_DIM, VALUE_DIM, LANES,
        UPCAST, True)
    acc, row_max, row_sum, lanes = _split_softmax(
        acc, row_max, row_sum, lanes, parts, centroids, k_head, v_head, key_mask_row, first, clean_stop, stop,
        stride_km, stride_kd, stride_vm, stride_vd, D, DV, scale, BLOCK_C, BLOCK_M, HEAD_DIM, VALUE_DIM, LANES,
        UPCAST, False)
    part = (bh * SPLITS + split) * C + rows
    tl.store(part_values_ptr + part[:, None] * DV + vdims[None, :], acc,
             mask=in_rows[:, None] & (vdims[None, :] < DV))
    tl.store(part_max_ptr + part, row_max, mask=in_rows)
    tl.store(part_sum_ptr + part, row_sum, mask=in_rows)
    if LANES > 0:
        slots = tl.arange(0, LANES)
        tl.store(part_lanes_ptr + part[:, None] * LANES + slots[None, :], lanes, mask=in_rows[:, None])


@triton.jit
def _centroid_combine_kernel(
    part_values_ptr, part_max_ptr, part_sum_ptr, part_lanes_ptr, values_ptr, stats_ptr, threshold_ptr,
    C, DV, SPLITS,
    BLOCK_C: tl.constexpr, VALUE_DIM: tl.constexpr, LANES: tl.constexpr, SPLIT_GROUP: tl.constexpr,
):
    """Merge the splits of a block of centroids: V^c (B * H, C, DV) by their softmax masses;
    stats (B * H, C, 2): each row's max (0 if no key is real) and 1 / sum (0 then); with
    LANES > 0 the row's top-k threshold (B * H, C): its smallest lane maximum over all splits."""
    bh = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    vdims = tl.arange(0, VALUE_DIM)
    in_rows = rows < C
    row_max = tl.full([BLOCK_C], float("-inf"), tl.float32)
    lanes = tl.full([BLOCK_C, LANES if LANES > 0 else 1], float("-inf"), tl.float32)
    slots = tl.arange(0, LANES if LANES > 0 else 1)
    group = tl.arange(0, SPLIT_GROUP)  # splits a step: their loads are independent
    for first in range(0, SPLITS, SPLIT_GROUP):
        part = (bh * SPLITS + first + group)[:, None] * C + rows[None, :]
        present = (first + group < SPLITS)[:, None] & in_rows[None, :]
        row_max = tl.maximum(row_max, tl.max(tl.load(part_max_ptr + part, mask=present, other=float("-inf")), axis=0))
        if LANES > 0:
            lanes = tl.maximum(lanes, tl.max(tl.load(part_lanes_ptr + part[:, :, None] * LANES + slots[None, None, :],
                                                     mask=present[:, :, None], other=float("-inf")), axis=0))
    shift = tl.where(row_max == float("-inf"), 0.0, row_max)  # no real key: no inf - inf
    row_sum = tl.zeros([BLOCK_C], tl.float32)
    acc = tl.zeros([BLOCK_C, VALUE_DIM], tl.float32)
    for first in range(0, SPLITS, SPLIT_GROUP):
        part = (bh * SPLITS + first + group)[:, None] * C + rows[None, :]
        present = (first + group < SPLITS)[:, None] & in_rows[None, :]
        weight = tl.math.exp2(tl.load(part_max_ptr + part, mask=present, other=float("-inf")) - shift[None, :])
        row_sum += tl.sum(weight * tl.load(part_sum_ptr + part, mask=present, other=0.0), axis=0)
        values = tl.load(part_values_ptr + part[:, :, None] * DV + vdims[None, None, :],
                         mask=present[:, :, None] & (vdims[None, None, :] < DV), other=0.0)
        acc += tl.sum(weight[:, :, None] * values, axis=0)
    inv_sum = 1.0 / tl.where(row_sum > 0, row_sum, float("inf"))  # 0 where no key is real
    tl.store(values_ptr + (bh * C + rows)[:, None] * DV + vdims[None, :], acc * inv_sum[:, None],
             mask=in_rows[:, None] & (vdims[None, :] < DV))
    tl.store(stats_ptr + (bh * C + rows) * 2, shift, mask=in_rows)
    tl.store(stats_ptr + (bh * C + rows) * 2 + 1, inv_sum, mask=in_rows)
    if LANES > 0:
        # The TOP-th largest of the LANES = 2 TOP lane maxima: TOP distinct keys are at least it.
        tl.store(threshold_ptr + bh * C + rows, tl.min(tl.topk(lanes, LANES // 2), axis=1), mask=in_rows)


def centroid_attention_triton(
    centroids: Tensor, k: Tensor, v: Tensor, key_mask: Tensor, scale: float, topk: int
) -> CentroidAttention:
    """The centroid pass on the device: V^c = A^c V (B, H, C, Dv) float32 and, with topk > 0,
    each cluster's top-k keys of A^c (indices, probabilities 0 on padded keys), chosen inside
    the kernels for topk <= MAX_TOPK_ON_CHIP. Two launches, four with the top-k.

    centroids: (B, H, C, D) float32 contiguous; k: (B, H, M, D); v: (B, H, M, Dv); key_mask (B, M).
    """
    b, h, c, d = centroids.shape
    m, dv = k.shape[2], v.shape[-1]
    device = k.device
    top = triton.next_power_of_2(topk) if topk else 0
    if top > MAX_TOPK_ON_CHIP:
        # Beyond what a program holds in registers: A^c in float32 and torch's top-k.
        fallbacks.record("centroid_triton", "topk_over_on_chip", f"topk {topk} > {MAX_TOPK_ON_CHIP}")
        return centroid_attention(centroids, k.float(), v.float(), key_mask, scale, topk)
    mask = key_mask.contiguous()
    block_m = max(64, 2 * top)
    # All of a head's centroids in one tile, unless the top-k's lanes would not fit beside them.
    block_c = pow2_block(c, 16, SOFTMAX_BLOCK_C if top <= 32 else 16)
    # Eight warps of a wide tile take ~255 registers a thread: one program an SM at a time.
    warps = 8 if block_c >= 64 else 4
    splits, chunk = key_splits(m, b * h * triton.cdiv(c, block_c), block_m, resident=1 if warps == 8 else 2)
    part_values = torch.empty(b * h, splits, c, dv, dtype=torch.float32, device=device)
    part_max = torch.empty(b * h, splits, c, dtype=torch.float32, device=device)
    part_sum = torch.empty(b * h, splits, c, dtype=torch.float32, device=device)
    part_lanes = torch.empty(b * h, splits, c, max(2 * top, 1), dtype=torch.float32, device=device)
    _centroid_attention_kernel[(triton.cdiv(c, block_c), splits, b * h)](
        centroids, k, v, mask, part_values, part_max, part_sum, part_lanes,
        *k.stride(), *v.stride(),
        h, m, c, d, dv, splits, chunk, scale * LOG2E,
        BLOCK_C=block_c, BLOCK_M=block_m, HEAD_DIM=pow2_block(d), VALUE_DIM=pow2_block(dv),
        LANES=2 * top, UPCAST=upcast(k), num_warps=warps,
    )
    values = torch.empty(b, h, c, dv, dtype=torch.float32, device=device)
    stats = torch.empty(b * h, c, 2, dtype=torch.float32, device=device)
    threshold = torch.empty(b * h, c, dtype=torch.float32, device=device)
    _centroid_combine_kernel[(triton.cdiv(c, COMBINE_BLOCK_C), b * h)](
        part_values, part_max, part_sum, part_lanes, values, stats, threshold,
        c, dv, splits,
        BLOCK_C=COMBINE_BLOCK_C, VALUE_DIM=pow2_block(dv), LANES=2 * top,
        SPLIT_GROUP=min(COMBINE_SPLITS, triton.next_power_of_2(splits),
                        COMBINE_LANE_LOADS // (COMBINE_BLOCK_C * max(2 * top, 1))),
    )
    if not topk:
        return CentroidAttention(values)
    top_index, top_probs = centroid_topk_triton(centroids, k, mask, threshold, stats, scale * LOG2E, topk, block_m)
    return CentroidAttention(values, top_index, top_probs)
