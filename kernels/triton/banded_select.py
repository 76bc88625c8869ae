"""Banded attention's select stage as Triton kernels (kernels/triton/banded.py runs the
pipeline; kernels/reference/banded.py is the definition):

    _choice_scores_kernel  one program per (batch x head, run of query blocks), each tile of
                           BLOCK_N mean keys loaded once for the run; per query block, the
                           largest mean key . q over its real queries (the mean keys' split parts
                           against q, float32 accuracy: the top-k decides on it) * scale + log
                           count, -inf within the band.
    _top_blocks_kernel     one program per (batch x head, query block): the far_blocks highest
                           finite scores, ids ascending as the reference's sort leaves them (ties
                           to the lowest id); then, in place of the row of scores, the query
                           block's pooled field (far_bias: each block's log count where it is
                           pooled, else -inf). Rows over TOP_BLOCKS_MAX blocks take torch's topk
                           (and attend builds the field itself).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from clusterserve.kernels import fallbacks
from clusterserve.kernels.reference.banded import far_count
from clusterserve.kernels.reference.banded import select as reference_select
from clusterserve.kernels.spec import AttentionSpec
from clusterserve.kernels.stages import Pooled
from clusterserve.kernels.triton.banded_pool import mean_key_parts
from clusterserve.kernels.triton.helpers import (
    chunking,
    dot_parts_left,
    head_start,
    mma,
    pow2_block,
    split_scale,
    unit_rows,
    upcast,
)

LOG2E = 1.0 / math.log(2.0)


@triton.jit
def log_count_units(scale_log2):
    """What a log count is worth in the logits' units (they are scaled by scale_log2 later)."""
    return 1.4426950408889634 / scale_log2


@triton.jit
def _choice_scores_kernel(
    q_ptr, pk_ptr, plog_ptr, real_ptr, out_ptr, stride_qb, stride_qh, stride_qn, N, H, NB, SIZE, BAND, PLANE, PER,
    scale,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
):
    bh = tl.program_id(0)
    b = bh // H
    q_head = head_start(q_ptr, bh, H, stride_qb, stride_qh)
    dims = tl.arange(0, BLOCK_D)
    steps = tl.arange(0, BLOCK_M)
    half: tl.constexpr = pk_ptr.dtype.element_ty != tl.float32  # the mean keys' half parts, split by the pool
    for start in range(0, NB, BLOCK_N):
        blocks = start + tl.arange(0, BLOCK_N)
        blk_ok = blocks < NB
        at = pk_ptr + (bh * NB + blocks)[:, None] * D + dims[None, :]
        ok = blk_ok[:, None] & (dims < D)[None, :]
        keys = tl.load(at, mask=ok, other=0.0)  # float32 keys, or the hi part of half ones
        if half:
            parts = (keys, tl.load(at + PLANE, mask=ok, other=0.0), tl.load(at + 2 * PLANE, mask=ok, other=0.0),
                     split_scale(pk_ptr.dtype.element_ty))
        log_count = tl.load(plog_ptr + b * NB + blocks, mask=blk_ok, other=float("-inf"))
        for i in range(0, PER):  # the program's query blocks, each against this tile of keys
            t = tl.program_id(1) * PER + i
            best = tl.full([BLOCK_N], float("-inf"), tl.float32)
            for first in range(0, SIZE, BLOCK_M):  # the block's queries, transposed: a max along rows
                rows = t * SIZE + first + steps
                row_ok = (first + steps < SIZE) & (rows < N)
                real = (tl.load(real_ptr + b * N + rows, mask=row_ok, other=0) != 0) & row_ok
                q = tl.load(q_head + rows[None, :] * stride_qn + dims[:, None],
                    mask=row_ok[None, :] & (dims < D)[:, None], other=0.0)
                if half:
                    dots = dot_parts_left(parts, q, UPCAST)
                else:
                    dots = mma(keys, q, UPCAST)
                best = tl.maximum(best, tl.max(tl.where(real[None, :], dots, float("-inf")), axis=1))
            score = tl.where(tl.abs(blocks - t) > BAND, best * scale + log_count, float("-inf"))
            tl.store(out_ptr + (bh * NB + t) * NB + blocks, score, mask=blk_ok & (blocks * 0 + t < NB))


def choice_scores(q: Tensor, pooled: Pooled, key_mask: Tensor, spec: AttentionSpec, scale: float) -> Tensor:
    """banded.choice_scores as one Triton kernel (one program per head and run of query blocks,
    each tile of mean keys loaded once for the run): (B, H, N, D) float32, or float16 /
    bfloat16 with the pool's key_parts -> (B, H, NB, NB) float32."""
    b, h, n, d = q.shape
    blocks = pooled.keys.shape[2]
    q = unit_rows(q)
    keys, plane = mean_key_parts(pooled, q.dtype)
    out = torch.empty(b, h, blocks, blocks, dtype=torch.float32, device=q.device)
    block_n = 16 if q.device.type == "cpu" else 64
    programs, per = chunking(blocks, h, 1)
    _choice_scores_kernel[(b * h, programs)](
        q, keys, pooled.log_count.contiguous(), key_mask.contiguous(), out, *q.stride()[:3], n, h, blocks,
        spec.block, min(spec.band, blocks - 1), plane, per, scale,
        D=d, BLOCK_D=pow2_block(d), BLOCK_M=pow2_block(spec.block, high=block_n), BLOCK_N=block_n, UPCAST=upcast(q),
    )
    return out



@triton.jit
def _top_blocks_kernel(score_ptr, chosen_ptr, plog_ptr, NB, R, H, scale_log2,
                       BLOCK_NB: tl.constexpr, BLOCK_R: tl.constexpr):
    """Query block t's far blocks (chosen), and in place of its row of scores the pooled field
    attend adds to its logits: a block's log count (in the logits' units) where the block has
    a finite score (outside the band, counted; the query block has a real query) and is not
    chosen, else -inf. Each program reads and writes its own row only."""
    bh = tl.program_id(0)
    t = tl.program_id(1)
    ids = tl.arange(0, BLOCK_NB)
    slots = tl.arange(0, BLOCK_R)
    row = score_ptr + (bh * NB + t) * NB + ids
    score = tl.load(row, mask=ids < NB, other=float("-inf"))
    far = score > float("-inf")
    hit = ids < 0
    for _ in range(0, R):  # the highest finite score left, the lowest id among equals
        best = tl.max(score, axis=0)
        pick = tl.min(tl.where(score == best, ids, BLOCK_NB), axis=0)
        taken = (ids == pick) & (score > float("-inf"))
        hit = hit | taken
        score = tl.where(taken, float("-inf"), score)
    # ascending, as a sort would put them: first a -1 for each slot no block took, then the ids
    count = hit.to(tl.int32)
    place = tl.cumsum(count, axis=0) - 1 + R - tl.sum(count, axis=0)
    at = (place[None, :] == slots[:, None]) & hit[None, :]
    picked = tl.sum(tl.where(at, ids[None, :] + 1, 0), axis=1) - 1
    tl.store(chosen_ptr + (bh * NB + t) * R + slots, picked.to(tl.int64), mask=slots < R)
    log_count = tl.load(plog_ptr + (bh // H) * NB + ids, mask=ids < NB, other=float("-inf"))
    tl.store(row, tl.where(far & ~hit, log_count * log_count_units(scale_log2), float("-inf")), mask=ids < NB)


# The top-k kernel holds a row of scores in registers: longer rows take torch's topk.
TOP_BLOCKS_MAX = 2048


def select(q: Tensor, pooled: Pooled, key_mask: Tensor, spec: AttentionSpec, scale: float) -> Pooled:
    """banded.select with the choice scores and their top far_blocks as Triton kernels (ties to
    the lowest block id; torch's topk for rows over TOP_BLOCKS_MAX blocks)."""
    blocks = pooled.keys.shape[2]
    r = far_count(spec, blocks)
    if r == 0:
        return pooled
    if triton.next_power_of_2(blocks) > TOP_BLOCKS_MAX:
        fallbacks.record("banded_triton", "blocks_over_on_chip", f"{blocks} blocks > {TOP_BLOCKS_MAX}")
        return reference_select(q, pooled, key_mask, spec, scale, choice_scores)
    score = choice_scores(q, pooled, key_mask, spec, scale)
    b, h = score.shape[:2]
    chosen = torch.empty(b, h, blocks, r, dtype=torch.int64, device=q.device)
    _top_blocks_kernel[(b * h, blocks)](score, chosen, pooled.log_count, blocks, r, h, scale * LOG2E,
                                        BLOCK_NB=pow2_block(blocks), BLOCK_R=pow2_block(r))
    return pooled._replace(chosen=chosen, far_bias=score)
