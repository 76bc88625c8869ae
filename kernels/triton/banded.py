"""The Triton backend of banded attention (banded.py): every stage as Triton kernels, the sink
positions aside (a few PyTorch ops on the (B, N) mask). No atomics; every output element has
one writer. q, k and v are read by their strides (rows of unit stride), so an encoder's heads,
views of its packed tokens, are not copied.

    pool     _pool_kernel (banded_pool.py): per block the mean key and value, its log count,
             which keys count, and each key's additive masks (key_bias).
    select   _choice_scores_kernel and _top_blocks_kernel (banded_select.py): each query
             block's far blocks, and its pooled field (far_bias).
    attend   _banded_kernel: one program per (batch x head, tile of BLOCK_M queries), one online
             softmax over
               - the band: the span from the first row's band to the last row's, in tiles of
                 BLOCK_N keys masked to real keys,
               - the sinks (one tile) outside each row's band,
               - the chosen far blocks' counted keys: one flat loop over (query block, tile)
                 that pipelines its loads; a tile holds whole blocks, or part of a long one,
               - the mean keys and values of the blocks outside the band not chosen, logits
                 raised by their log count (the mean key's hi and mid split parts against
                 q: 16 bits of it, not a rounded key's 8).
             BLOCK_M divides the block size on a GPU (query_tile), so all of a program's rows
             share one block and its masks are per key (UNIFORM); otherwise (blocks not a
             multiple of 16, and under the interpreter blocks under 16) each row is masked to
             its own block's band and choice. Masks are additions of key_bias and far_bias,
             where an element-wise select would cost a compare and a select more.
q . k and p . v run on tensor cores in the inputs' dtype with float32 accumulation; the
probabilities are rounded to v's dtype before p . v, as flash attention does, and the mean
values enter in v's dtype, like every other value.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from clusterserve.kernels.spec import AttentionSpec
from clusterserve.kernels.stages import BandedStages, Pooled
from clusterserve.kernels.triton.banded_pool import key_bias, mean_key_parts, pool
from clusterserve.kernels.triton.banded_select import LOG2E, log_count_units, select
from clusterserve.kernels.triton.helpers import (
    head_start,
    mma,
    online_softmax_step,
    pow2_block,
    rounded,
    split_scale,
    unit_rows,
    upcast,
)


@triton.jit
def _chosen_hit(chosen_ptr, bh, NB, R, t, blocks, BLOCK_R: tl.constexpr):
    """(len(blocks),) bool: which of `blocks` are chosen for query block t."""
    slots = tl.arange(0, BLOCK_R)
    picks = tl.load(chosen_ptr + (bh * NB + t) * R + slots, mask=slots < R, other=-1)
    return tl.max((blocks[:, None] == picks[None, :]).to(tl.int32), axis=1) > 0


@triton.jit
def _key_tile(k_head, v_head, bias_row, cols, col_ok, dims, vdims, stride_kn, stride_vn,
              D: tl.constexpr, DV: tl.constexpr):
    """Keys (D, tile) and values (tile, DV) at positions `cols` of one head (k_head, v_head:
    where its rows start), and (1, tile) additive masks from a (N,) row of the pool's key_bias
    (0 where a key counts, -inf where it does not or is out of range, col_ok): added to the
    logits, they mask as a select would, bit for bit, in one add."""
    keys = tl.load(k_head + cols[None, :] * stride_kn + dims[:, None], mask=col_ok[None, :] & (dims < D)[:, None],
                   other=0.0)
    values = tl.load(v_head + cols[:, None] * stride_vn + vdims[None, :],
                     mask=col_ok[:, None] & (vdims < DV)[None, :], other=0.0)
    bias = tl.load(bias_row + cols, mask=col_ok, other=float("-inf"))[None, :]
    return keys, values, bias


@triton.jit
def _banded_kernel(
    q_ptr, k_ptr, v_ptr, pk_ptr, pv_ptr, plog_ptr, sink_ptr, sreal_ptr, real_ptr, bias_ptr, chosen_ptr, far_ptr,
    out_ptr, stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on, N, H, NB, S, R, SIZE, BAND, PLANE, PLANE_N, scale_log2,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, GROUP: tl.constexpr,
    TILES: tl.constexpr,
    UNIFORM: tl.constexpr, FAR_BIAS: tl.constexpr, UPCAST: tl.constexpr,
):
    bh = tl.program_id(0)
    b = bh // H
    first = tl.program_id(1) * BLOCK_M
    last = tl.minimum(first + BLOCK_M, N) - 1
    rows = first + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    dims = tl.arange(0, BLOCK_D)
    vdims = tl.arange(0, BLOCK_DV)
    k_head = head_start(k_ptr, bh, H, stride_kb, stride_kh)
    v_head = head_start(v_ptr, bh, H, stride_vb, stride_vh)
    q = tl.load(head_start(q_ptr, bh, H, stride_qb, stride_qh) + rows[:, None] * stride_qn + dims[None, :],
                mask=row_ok[:, None] & (dims < D)[None, :], other=0.0)
    t_row = tl.minimum(rows, N - 1) // SIZE  # each row's block (all one block when UNIFORM)
    lo_row = tl.maximum(t_row - BAND, 0) * SIZE
    hi_row = tl.minimum((t_row + BAND + 1) * SIZE, N)
    lo = tl.maximum(first // SIZE - BAND, 0) * SIZE
    hi = tl.minimum((last // SIZE + BAND + 1) * SIZE, N)

    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)

    # The band: [lo, hi) is every row's band when UNIFORM, else each row is masked to its own.
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < hi
        keys, values, bias = _key_tile(k_head, v_head, bias_ptr + b * N, cols, col_ok, dims, vdims, stride_kn,
                                       stride_vn, D, DV)
        dots = mma(q, keys, UPCAST) + bias
        if not UNIFORM:
            own = (cols[None, :] >= lo_row[:, None]) & (cols[None, :] < hi_row[:, None])
            dots = tl.where(own, dots, float("-inf"))
        acc, row_max, row_sum = online_softmax_step(acc, row_max, row_sum, dots, values, UPCAST, scale_log2)

    # The sinks outside each row's band.
    slots = tl.arange(0, BLOCK_S)
    slot_ok = slots < S
    pos = tl.load(sink_ptr + b * S + slots, mask=slot_ok, other=0)
    s_real = (tl.load(sreal_ptr + b * S + slots, mask=slot_ok, other=0) != 0) & slot_ok
    s_keys = tl.load(k_head + pos[None, :] * stride_kn + dims[:, None], mask=s_real[None, :] & (dims < D)[:, None],
                     other=0.0)
    s_values = tl.load(v_head + pos[:, None] * stride_vn + vdims[None, :],
        mask=s_real[:, None] & (vdims < DV)[None, :], other=0.0)
    s_far = tl.abs((pos // SIZE)[None, :] - t_row[:, None]) > BAND
    s_dots = tl.where(s_far & s_real[None, :], mma(q, s_keys, UPCAST), float("-inf"))
    acc, row_max, row_sum = online_softmax_step(acc, row_max, row_sum, s_dots, s_values, UPCAST, scale_log2)

    # The counted keys of the far blocks chosen for each row's block: one flat loop over (query
    # block, tile), so that its loads pipeline. A tile takes GROUP whole chosen blocks, lane l
    # the l % SIZE-th key of block l // SIZE (GROUP > 1, a block shorter than half a tile), or
    # a chosen block takes TILES tiles (GROUP = 1).
    steps = tl.arange(0, BLOCK_N)
    lane_key = steps
    if GROUP > 1:
        lane_slot = steps // SIZE
        lane_key = steps % SIZE
    t_first = first // SIZE
    per_block = tl.cdiv(R, GROUP) * TILES  # tiles a query block takes
    # (the bound spelled out in the launch's arguments: bench.trip_counts evaluates it)
    for i in range(0, (last // SIZE + 1 - first // SIZE) * tl.cdiv(R, GROUP) * TILES):
        if UNIFORM:  # one query block: no division by per_block
            t = t_first
            j = i
        else:
            t = t_first + i // per_block
            j = i % per_block
        start = (j % TILES) * BLOCK_N
        if GROUP > 1:  # each lane its block's id
            slot = (j // TILES) * GROUP + lane_slot
            blk = tl.load(chosen_ptr + (bh * NB + t) * R + slot, mask=(slot < R) & (lane_slot < GROUP), other=-1)
        else:  # one block's id for the tile: a scalar load
            blk = tl.load(chosen_ptr + (bh * NB + t) * R + j // TILES)
        cols = tl.maximum(blk, 0) * SIZE + start + lane_key
        col_ok = (start + lane_key < tl.where(blk >= 0, SIZE, 0)) & (cols < N)  # -1: no block chosen in this slot
        keys, values, bias = _key_tile(k_head, v_head, bias_ptr + PLANE_N + b * N, cols, col_ok, dims, vdims,
                                       stride_kn, stride_vn, D, DV)
        dots = mma(q, keys, UPCAST) + bias
        if not UNIFORM:
            dots = tl.where((t_row == t)[:, None], dots, float("-inf"))
        acc, row_max, row_sum = online_softmax_step(acc, row_max, row_sum, dots, values, UPCAST, scale_log2)

    # The pooled blocks outside each row's band and not chosen for it, logits raised by log count.
    for start in range(0, NB, BLOCK_N):
        blocks = start + tl.arange(0, BLOCK_N)
        blk_ok = blocks < NB
        at = pk_ptr + (bh * NB + blocks)[None, :] * D + dims[:, None]
        keys = tl.load(at, mask=blk_ok[None, :] & (dims < D)[:, None], other=0.0)  # float32, or the hi part
        if pk_ptr.dtype.element_ty != tl.float32:  # hi and mid of the split parts: 16 bits of the mean key
            mid = tl.load(at + PLANE, mask=blk_ok[None, :] & (dims < D)[:, None], other=0.0)
            dots = mma(q, keys, UPCAST, mma(q, mid, UPCAST) / split_scale(pk_ptr.dtype.element_ty))
        else:
            dots = mma(q, keys, UPCAST)
        values = tl.load(pv_ptr + (bh * NB + blocks)[:, None] * DV + vdims[None, :],
            mask=blk_ok[:, None] & (vdims < DV)[None, :], other=0.0)
        if FAR_BIAS:  # the select's row for this query block: the pooled blocks' log counts, else -inf
            dots = dots + tl.load(far_ptr + (bh * NB + t_first) * NB + blocks, mask=blk_ok, other=float("-inf"))[None, :]
        else:
            log_count = tl.load(plog_ptr + b * NB + blocks, mask=blk_ok, other=float("-inf"))  # -inf: no counted key
            counted = log_count > float("-inf")
            if UNIFORM:
                ok = (counted & (tl.abs(blocks - t_first) > BAND)
                      & ~_chosen_hit(chosen_ptr, bh, NB, R, t_first, blocks, BLOCK_R))[None, :]
            else:
                ok = counted[None, :] & (tl.abs(blocks[None, :] - t_row[:, None]) > BAND)
                for t in range(t_first, last // SIZE + 1):
                    hit = _chosen_hit(chosen_ptr, bh, NB, R, t, blocks, BLOCK_R)
                    ok = ok & ~((t_row == t)[:, None] & hit[None, :])
            bias = log_count * log_count_units(scale_log2)
            dots = tl.where(ok, dots + bias[None, :], float("-inf"))
        acc, row_max, row_sum = online_softmax_step(acc, row_max, row_sum, dots, values, UPCAST, scale_log2)

    own = tl.load(real_ptr + b * N + rows, mask=row_ok, other=0) != 0
    o = tl.where((own & (row_sum > 0))[:, None], acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None], 0.0)
    tl.store(
        head_start(out_ptr, bh, H, stride_ob, stride_oh) + rows[:, None] * stride_on + vdims[None, :],
        rounded(o, out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (vdims < DV)[None, :],
    )


def attend(
    q: Tensor, k: Tensor, v: Tensor, pooled: Pooled, key_mask: Tensor, spec: AttentionSpec, scale: float,
    dtype: torch.dtype,
) -> Tensor:
    """banded.attend as one Triton kernel: (B, H, N, D) float32, float16 or bfloat16 ->
    (B, H, N, Dv) in dtype, padded queries 0: a view of token-major (B, N, H, Dv) memory."""
    b, h, n, d = q.shape
    dv = v.shape[-1]
    blocks = pooled.keys.shape[2]
    q, k, v = unit_rows(q), unit_rows(k), unit_rows(v)
    chosen = pooled.chosen.contiguous()
    keys, plane = mean_key_parts(pooled, q.dtype)
    if pooled.values.dtype != v.dtype:
        raise ValueError(f"attend needs the Triton pool's mean values, in {v.dtype}")
    # (B, N, H, Dv) memory seen as (B, H, N, Dv): the token-major layout an encoder packs its
    # heads back into, so that the result is a view there, not a copy.
    out = torch.empty(b, n, h, dv, dtype=q.dtype, device=q.device).transpose(1, 2)
    if n == 0:
        return out.to(dtype)
    block_m = query_tile(spec.block, q.device.type == "cpu")
    block_n = key_tile(max(d, dv), q.dtype, q.device.type == "cpu")
    grid = (b * h, triton.cdiv(n, block_m))
    uniform = spec.block % block_m == 0
    far_bias = pooled.far_bias if pooled.far_bias is not None else pooled.log_count  # read only with FAR_BIAS
    _banded_kernel[grid](
        q, k, v, keys, pooled.values, pooled.log_count, pooled.sinks, pooled.sink_real, key_mask.contiguous(),
        key_bias(pooled), chosen, far_bias, out, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        n, h, blocks, pooled.sinks.shape[1], chosen.shape[-1], spec.block, min(spec.band, blocks), plane, b * n,
        scale * LOG2E,
        D=d, DV=dv, BLOCK_D=pow2_block(d), BLOCK_DV=pow2_block(dv), BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_S=pow2_block(pooled.sinks.shape[1]), BLOCK_R=pow2_block(chosen.shape[-1]), GROUP=max(1, block_n // spec.block),
        TILES=triton.cdiv(spec.block, block_n),
        UNIFORM=uniform, FAR_BIAS=uniform and pooled.far_bias is not None, UPCAST=upcast(q), num_stages=2,
    )
    return out.to(dtype)



def key_tile(head_dim: int, dtype: torch.dtype, interpreted: bool) -> int:
    """Keys a step of the attend kernel takes: 64 on a GPU, 16 under the interpreter. Tiles of
    128 keys (a far tile then takes two chosen blocks of 64) issue about 16% fewer instructions
    for half-precision heads up to 64 wide, but fit two programs an SM where 64 fit three: an
    H100 ran the default model's banded calls 8-15% slower with them at 16k and 4k tokens."""
    return 16 if interpreted else 64


def query_tile(block: int, interpreted: bool) -> int:
    """Queries a program of the attend kernel takes: a power of two that divides the block size
    where one does (16 to 64 on a GPU), so that all of a program's rows share one block and its
    masks are per key; 16 under the interpreter (blocks under 16 then take the per-row masks)."""
    if interpreted:
        return 16
    return next((m for m in (64, 32, 16) if block % m == 0), 64)


TRITON = BandedStages(name="triton", compute=lambda dtype: dtype, pool=pool, attend=attend, select=select)
