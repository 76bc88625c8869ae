"""The Triton backend of banded attention (banded.py): the attend stage as one kernel, the block
scores that choose the far blocks as another; the pool stage and the top-k of the choice are
the reference's (O(N D) means in float32; a top-k over (NB, NB) scores).

The scores: one program per (batch x head, query block, tile of BLOCK_N pooled blocks) runs
its block's queries in tiles of BLOCK_M against the tile's pooled keys (float32, split parts
for half-precision queries) and writes the largest logit of each block over its real queries.

One program per (batch x head, tile of BLOCK_M queries) writes its own rows of the output and
nothing else (no atomics). Its queries run one online softmax over
    - the keys of the band: the span from the first row's band to the last row's, in tiles of
      BLOCK_N keys, each row masked to its own block's band and to real keys,
    - the sinks (one tile), each row masked to the real sinks outside its band,
    - the far blocks chosen for each query block the tile meets (one when BLOCK_M divides the
      block size), R per query block, in tiles of BLOCK_N keys, each row masked to its own
      block's choice and to counted keys,
    - the pooled keys and values (float32) in tiles of BLOCK_N blocks, each row masked to the
      blocks outside its band that hold a counted key and are not chosen for it (a (NB, NB)
      mask a head, built from the choice), logits raised by their log count.
q . k and p . v run on tensor cores in the inputs' dtype with float32 accumulation; the float32
pooled keys and values meet half-precision operands as split parts (float32 accuracy).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.reference.banded import BandedStages, Pooled, chosen_hits, pool
from kernels.spec import AttentionSpec
from kernels.triton.helpers import dot_split_right, mma, online_softmax_step, pow2_block, rounded, upcast

LOG2E = 1.0 / math.log(2.0)


@triton.jit
def _banded_kernel(
    q_ptr, k_ptr, v_ptr, pk_ptr, pv_ptr, plog_ptr, preal_ptr, sink_ptr, sreal_ptr, real_ptr, counted_ptr, chosen_ptr,
    replaced_ptr, out_ptr, N, H, NB, S, R, SIZE, BAND, scale_log2,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr,
    FAR: tl.constexpr, UPCAST: tl.constexpr,
):
    bh = tl.program_id(0)
    b = bh // H
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    dims = tl.arange(0, BLOCK_D)
    vdims = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + (bh * N + rows)[:, None] * D + dims[None, :], mask=row_ok[:, None] & (dims < D)[None, :], other=0.0)
    t_row = tl.minimum(rows, N - 1) // SIZE  # each row's block
    lo_row = tl.maximum(t_row - BAND, 0) * SIZE
    hi_row = tl.minimum((t_row + BAND + 1) * SIZE, N)
    first = tl.program_id(1) * BLOCK_M
    last = tl.minimum(first + BLOCK_M, N) - 1
    lo = tl.maximum(first // SIZE - BAND, 0) * SIZE
    hi = tl.minimum((last // SIZE + BAND + 1) * SIZE, N)

    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)

    # The band.
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < hi
        keys = tl.load(k_ptr + (bh * N + cols)[None, :] * D + dims[:, None],
            mask=col_ok[None, :] & (dims < D)[:, None], other=0.0)
        values = tl.load(v_ptr + (bh * N + cols)[:, None] * DV + vdims[None, :],
            mask=col_ok[:, None] & (vdims < DV)[None, :], other=0.0)
        real = tl.load(real_ptr + b * N + cols, mask=col_ok, other=0) != 0
        ok = (cols[None, :] >= lo_row[:, None]) & (cols[None, :] < hi_row[:, None]) & (real & col_ok)[None, :]
        logits = tl.where(ok, mma(q, keys, UPCAST) * scale_log2, float("-inf"))
        acc, row_max, row_sum = online_softmax_step(acc, row_max, row_sum, logits, values, True, UPCAST)

    # The sinks outside each row's band.
    slots = tl.arange(0, BLOCK_S)
    slot_ok = slots < S
    pos = tl.load(sink_ptr + b * S + slots, mask=slot_ok, other=0)
    s_real = (tl.load(sreal_ptr + b * S + slots, mask=slot_ok, other=0) != 0) & slot_ok
    s_keys = tl.load(k_ptr + (bh * N + pos)[None, :] * D + dims[:, None], mask=s_real[None, :] & (dims < D)[:, None], other=0.0)
    s_values = tl.load(v_ptr + (bh * N + pos)[:, None] * DV + vdims[None, :],
        mask=s_real[:, None] & (vdims < DV)[None, :], other=0.0)
    s_far = tl.abs((pos // SIZE)[None, :] - t_row[:, None]) > BAND
    s_logits = tl.where(s_far & s_real[None, :], mma(q, s_keys, UPCAST) * scale_log2, float("-inf"))
    acc, row_max, row_sum = online_softmax_step(acc, row_max, row_sum, s_logits, s_values, True, UPCAST)

    # The counted keys of the far blocks chosen for each row's block (their ids read at once).
    steps = tl.arange(0, BLOCK_N)
    slots_r = tl.arange(0, BLOCK_R)
    for t in range(first // SIZE, last // SIZE + 1):
        mine = t_row == t
        picks = tl.load(chosen_ptr + (bh * NB + t) * R + slots_r, mask=slots_r < R, other=-1)
        for r in range(0, R):
            blk = tl.sum(tl.where(slots_r == r, picks, 0))
            width = tl.where(blk >= 0, SIZE, 0)  # -1: no block chosen in this slot
            for start in range(0, SIZE, BLOCK_N):
                cols = tl.maximum(blk, 0) * SIZE + start + steps
                col_ok = (start + steps < width) & (cols < N)
                keys = tl.load(k_ptr + (bh * N + cols)[None, :] * D + dims[:, None],
                    mask=col_ok[None, :] & (dims < D)[:, None], other=0.0)
                values = tl.load(v_ptr + (bh * N + cols)[:, None] * DV + vdims[None, :],
                    mask=col_ok[:, None] & (vdims < DV)[None, :], other=0.0)
                counted = (tl.load(counted_ptr + b * N + cols, mask=col_ok, other=0) != 0) & col_ok
                logits = tl.where(mine[:, None] & counted[None, :], mma(q, keys, UPCAST) * scale_log2, float("-inf"))
                acc, row_max, row_sum = online_softmax_step(acc, row_max, row_sum, logits, values, True, UPCAST)

    # The pooled blocks outside each row's band and not chosen for it (float32 keys and values).
    for start in range(0, NB, BLOCK_N):
        blocks = start + tl.arange(0, BLOCK_N)
        blk_ok = blocks < NB
        keys = tl.load(pk_ptr + (bh * NB + blocks)[None, :] * D + dims[:, None],
            mask=blk_ok[None, :] & (dims < D)[:, None], other=0.0)
        values = tl.load(pv_ptr + (bh * NB + blocks)[:, None] * DV + vdims[None, :],
            mask=blk_ok[:, None] & (vdims < DV)[None, :], other=0.0)
        counted = (tl.load(preal_ptr + b * NB + blocks, mask=blk_ok, other=0) != 0) & blk_ok
        log_count = tl.load(plog_ptr + b * NB + blocks, mask=blk_ok, other=0.0)
        far = tl.abs(blocks[None, :] - t_row[:, None]) > BAND
        if FAR:  # a chosen block's keys replace its pooled key
            replaced = tl.load(replaced_ptr + (bh * NB + t_row)[:, None] * NB + blocks[None, :],
                mask=row_ok[:, None] & blk_ok[None, :], other=0)
            far = far & (replaced == 0)
        dots = dot_split_right(q, keys, UPCAST)
        logits = tl.where(far & counted[None, :], dots * scale_log2 + (log_count * 1.4426950408889634)[None, :], float("-inf"))
        acc, row_max, row_sum = online_softmax_step(acc, row_max, row_sum, logits, values, True, UPCAST)

    own = tl.load(real_ptr + b * N + rows, mask=row_ok, other=0) != 0
    o = tl.where((own & (row_sum > 0))[:, None], acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None], 0.0)
    tl.store(
        out_ptr + (bh * N + rows)[:, None] * DV + vdims[None, :], rounded(o, out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (vdims < DV)[None, :],
    )


def attend(
    q: Tensor, k: Tensor, v: Tensor, pooled: Pooled, key_mask: Tensor, spec: AttentionSpec, scale: float,
    dtype: torch.dtype,
) -> Tensor:
    """banded.attend as one Triton kernel: (B, H, N, D) float32, float16 or bfloat16 ->
    (B, H, N, Dv) in dtype, padded queries 0."""
    b, h, n, d = q.shape
    dv = v.shape[-1]
    blocks = pooled.keys.shape[2]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    pk = pooled.keys.to(torch.float32).contiguous()
    pv = pooled.values.to(torch.float32).contiguous()
    counted = torch.isfinite(pooled.log_count)
    plog = torch.where(counted, pooled.log_count, 0.0).to(torch.float32).contiguous()
    flags = [t.to(torch.uint8).contiguous() for t in (counted, pooled.sink_real, key_mask, pooled.counted)]
    sinks = pooled.sinks.to(torch.int64).contiguous()
    chosen = pooled.chosen.to(torch.int64).contiguous()
    far = chosen.shape[-1] > 0
    # (B, H, NB, NB) uint8: whether query block t attends block c's keys instead of its pooled key
    replaced = chosen_hits(chosen, blocks).to(torch.uint8).contiguous() if far else chosen
    out = torch.empty(b, h, n, dv, dtype=q.dtype, device=q.device)
    if n == 0:
        return out.to(dtype)
    block_m = 16 if q.device.type == "cpu" else 64
    grid = (b * h, triton.cdiv(n, block_m))
    _banded_kernel[grid](
        q, k, v, pk, pv, plog, flags[0], sinks, flags[1], flags[2], flags[3], chosen, replaced, out,
        n, h, blocks, sinks.shape[1], chosen.shape[-1], spec.block, min(spec.band, blocks), scale * LOG2E,
        D=d, DV=dv, BLOCK_D=pow2_block(d), BLOCK_DV=pow2_block(dv), BLOCK_M=block_m,
        BLOCK_N=pow2_block(0, high=64) if q.device.type == "cpu" else 64,
        BLOCK_S=pow2_block(sinks.shape[1]), BLOCK_R=pow2_block(chosen.shape[-1]), FAR=far, UPCAST=upcast(q),
    )
    return out.to(dtype)


@triton.jit
def _block_scores_kernel(
    q_ptr, pk_ptr, real_ptr, out_ptr, N, H, NB, SIZE, scale,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
):
    bh = tl.program_id(0)
    b = bh // H
    t = tl.program_id(1)
    blocks = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    blk_ok = blocks < NB
    dims = tl.arange(0, BLOCK_D)
    keys = tl.load(pk_ptr + (bh * NB + blocks)[None, :] * D + dims[:, None],
        mask=blk_ok[None, :] & (dims < D)[:, None], other=0.0)
    best = tl.full([BLOCK_N], float("-inf"), tl.float32)
    steps = tl.arange(0, BLOCK_M)
    for start in range(0, SIZE, BLOCK_M):
        rows = t * SIZE + start + steps
        row_ok = (start + steps < SIZE) & (rows < N)
        real = (tl.load(real_ptr + b * N + rows, mask=row_ok, other=0) != 0) & row_ok
        q = tl.load(q_ptr + (bh * N + rows)[:, None] * D + dims[None, :], mask=row_ok[:, None] & (dims < D)[None, :],
            other=0.0)
        dots = tl.where(real[:, None], dot_split_right(q, keys, UPCAST), float("-inf"))
        best = tl.maximum(best, tl.max(dots, axis=0))
    tl.store(out_ptr + (bh * NB + t) * NB + blocks, best * scale, mask=blk_ok)


def block_scores(q: Tensor, pooled: Pooled, key_mask: Tensor, spec: AttentionSpec, scale: float) -> Tensor:
    """banded.block_scores as one Triton kernel: (B, H, N, D) float32, float16 or bfloat16 ->
    (B, H, NB, NB) float32."""
    b, h, n, d = q.shape
    blocks = pooled.keys.shape[2]
    q = q.contiguous()
    pk = pooled.keys.to(torch.float32).contiguous()
    real = key_mask.to(torch.uint8).contiguous()
    out = torch.empty(b, h, blocks, blocks, dtype=torch.float32, device=q.device)
    block_n = 16 if q.device.type == "cpu" else 64
    grid = (b * h, blocks, triton.cdiv(blocks, block_n))
    _block_scores_kernel[grid](
        q, pk, real, out, n, h, blocks, spec.block, scale,
        D=d, BLOCK_D=pow2_block(d), BLOCK_M=16 if q.device.type == "cpu" else 64, BLOCK_N=block_n, UPCAST=upcast(q),
    )
    return out


TRITON = BandedStages(
    name="triton", compute=lambda dtype: dtype, pool=pool, attend=attend, contiguous=True, scores=block_scores
)
