"""The Triton backend of banded attention (banded.py): every stage as Triton kernels, the sink
positions aside (a few PyTorch ops on the (B, N) mask). No atomics; every output element has
one writer. q, k and v are read by their strides (rows of unit stride), so an encoder's heads,
views of its packed tokens, are not copied.

    pool     _pool_kernel: one program per (batch x head, block): the mean key (float32, and for
             half-precision inputs its split_parts, so no later kernel splits it again), the
             mean value (rounded to v's dtype) and, from the first head's program, the block's
             log count, which of its keys count (real, not sinks) and each key's additive masks
             (key_bias: 0 or -inf, for real and for counted).
    select   _choice_scores_kernel: one program per (batch x head, run of query blocks), each
             tile of BLOCK_N mean keys loaded once for the run; per query block, the largest
             mean key . q over its real queries (the mean keys' split parts against q, float32
             accuracy: the top-k decides on it) * scale + log count, -inf within the band.
             _top_blocks_kernel: one program per (batch x head, query block): the far_blocks
             highest finite scores, ids ascending as the reference's sort leaves them (ties
             to the lowest id); then, in place of the row of scores, the query block's pooled
             field (far_bias: each block's log count where it is pooled, else -inf); rows over
             TOP_BLOCKS_MAX blocks take torch's topk (and attend builds the field itself).
    attend   _banded_kernel: one program per (batch x head, tile of BLOCK_M queries), one online
             softmax over
               - the band: the span from the first row's band to the last row's, in tiles of
                 BLOCK_N keys masked to real keys,
               - the sinks (one tile) outside each row's band,
               - the chosen far blocks' counted keys: one flat loop over (query block, slot,
                 tile of the block), so that its loads pipeline,
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

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import fallbacks
from kernels.reference.banded import BandedStages, Pooled, far_count, sink_positions
from kernels.reference.banded import select as reference_select
from kernels.spec import AttentionSpec
from kernels.triton.helpers import (
    chunking,
    dot_parts_left,
    mma,
    online_softmax_step,
    pow2_block,
    rounded,
    split_parts,
    split_scale,
    upcast,
)

LOG2E = 1.0 / math.log(2.0)


@triton.jit
def _head(x_ptr, bh, H, stride_b, stride_h):
    """Where head bh (= batch x H + head) of a (B, H, N, D) tensor starts, by its strides."""
    return x_ptr + (bh // H).to(tl.int64) * stride_b + (bh % H).to(tl.int64) * stride_h


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
    k_head = _head(k_ptr, bh, H, stride_kb, stride_kh)
    v_head = _head(v_ptr, bh, H, stride_vb, stride_vh)
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


def unit_rows(x: Tensor) -> Tensor:
    """x (B, H, N, D) as the kernels read it: by its strides, as long as each row's D values
    are adjacent (a head's view of packed (T, H, D) tokens is read in place); else a copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


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
def _log_count_units(scale_log2):
    """What a log count is worth in the logits' units (they are scaled by scale_log2 later)."""
    return 1.4426950408889634 / scale_log2


@triton.jit
def _banded_kernel(
    q_ptr, k_ptr, v_ptr, pk_ptr, pv_ptr, plog_ptr, sink_ptr, sreal_ptr, real_ptr, bias_ptr, chosen_ptr, far_ptr,
    out_ptr, stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on, N, H, NB, S, R, SIZE, BAND, PLANE, PLANE_N, scale_log2,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, TILES: tl.constexpr,
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
    k_head = _head(k_ptr, bh, H, stride_kb, stride_kh)
    v_head = _head(v_ptr, bh, H, stride_vb, stride_vh)
    q = tl.load(_head(q_ptr, bh, H, stride_qb, stride_qh) + rows[:, None] * stride_qn + dims[None, :],
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
        acc, row_max, row_sum = online_softmax_step(acc, row_max, row_sum, dots, values, False, UPCAST, scale_log2)

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
    acc, row_max, row_sum = online_softmax_step(acc, row_max, row_sum, s_dots, s_values, False, UPCAST, scale_log2)

    # The counted keys of the far blocks chosen for each row's block: one flat loop over (query
    # block, slot, tile of the far block), so that its loads pipeline.
    steps = tl.arange(0, BLOCK_N)
    t_first = first // SIZE
    for i in range(0, (last // SIZE + 1 - first // SIZE) * R * TILES):
        if UNIFORM:  # one query block: no division by R
            t = t_first
            slot = i // TILES
        else:
            t = t_first + i // (R * TILES)
            slot = (i // TILES) % R
        blk = tl.load(chosen_ptr + (bh * NB + t) * R + slot)
        start = (i % TILES) * BLOCK_N
        cols = tl.maximum(blk, 0) * SIZE + start + steps
        width = tl.where(blk >= 0, SIZE, 0)  # -1: no block chosen in this slot
        col_ok = (start + steps < width) & (cols < N)
        keys, values, bias = _key_tile(k_head, v_head, bias_ptr + PLANE_N + b * N, cols, col_ok, dims, vdims,
                                       stride_kn, stride_vn, D, DV)
        dots = mma(q, keys, UPCAST) + bias
        if not UNIFORM:
            dots = tl.where((t_row == t)[:, None], dots, float("-inf"))
        acc, row_max, row_sum = online_softmax_step(acc, row_max, row_sum, dots, values, False, UPCAST, scale_log2)

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
            bias = log_count * _log_count_units(scale_log2)
            dots = tl.where(ok, dots + bias[None, :], float("-inf"))
        acc, row_max, row_sum = online_softmax_step(acc, row_max, row_sum, dots, values, False, UPCAST, scale_log2)

    own = tl.load(real_ptr + b * N + rows, mask=row_ok, other=0) != 0
    o = tl.where((own & (row_sum > 0))[:, None], acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None], 0.0)
    tl.store(
        _head(out_ptr, bh, H, stride_ob, stride_oh) + rows[:, None] * stride_on + vdims[None, :],
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
    keys, plane = _mean_keys(pooled, q.dtype)
    if pooled.values.dtype != v.dtype:
        raise ValueError(f"attend needs the Triton pool's mean values, in {v.dtype}")
    # (B, N, H, Dv) memory seen as (B, H, N, Dv): the token-major layout an encoder packs its
    # heads back into, so that the result is a view there, not a copy.
    out = torch.empty(b, n, h, dv, dtype=q.dtype, device=q.device).transpose(1, 2)
    if n == 0:
        return out.to(dtype)
    block_m = query_tile(spec.block, q.device.type == "cpu")
    block_n = 16 if q.device.type == "cpu" else 64
    grid = (b * h, triton.cdiv(n, block_m))
    uniform = spec.block % block_m == 0
    far_bias = pooled.far_bias if pooled.far_bias is not None else pooled.log_count  # read only with FAR_BIAS
    _banded_kernel[grid](
        q, k, v, keys, pooled.values, pooled.log_count, pooled.sinks, pooled.sink_real, key_mask.contiguous(),
        _key_bias(pooled), chosen, far_bias, out, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        n, h, blocks, pooled.sinks.shape[1], chosen.shape[-1], spec.block, min(spec.band, blocks), plane, b * n,
        scale * LOG2E,
        D=d, DV=dv, BLOCK_D=pow2_block(d), BLOCK_DV=pow2_block(dv), BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_S=pow2_block(pooled.sinks.shape[1]), BLOCK_R=pow2_block(chosen.shape[-1]), TILES=triton.cdiv(spec.block, block_n),
        UNIFORM=uniform, FAR_BIAS=uniform and pooled.far_bias is not None, UPCAST=upcast(q), num_stages=2,
    )
    return out.to(dtype)


def _key_bias(pooled: Pooled) -> Tensor:
    """The Triton pool's additive key masks (Pooled.key_bias)."""
    if pooled.key_bias is None:
        raise ValueError("attend needs the Triton pool's additive key masks")
    return pooled.key_bias


def _mean_keys(pooled: Pooled, dtype: torch.dtype) -> tuple[Tensor, int]:
    """The mean keys the kernels read for queries of `dtype`, and the distance between their
    split parts (PLANE): float32 keys as they are, or the Triton pool's key_parts (3, B, H,
    NB, D) in the half dtype."""
    keys = pooled.keys if dtype == torch.float32 else pooled.key_parts
    if keys is None or keys.dtype != dtype:
        raise ValueError(f"{dtype} queries need the mean keys split into {dtype} parts (the Triton pool's)")
    keys = keys.contiguous()
    return keys, pooled.keys.numel()  # B H NB D


def query_tile(block: int, interpreted: bool) -> int:
    """Queries a program of the attend kernel takes: a power of two that divides the block size
    where one does (16 to 64 on a GPU), so that all of a program's rows share one block and its
    masks are per key; 16 under the interpreter (blocks under 16 then take the per-row masks)."""
    if interpreted:
        return 16
    return next((m for m in (64, 32, 16) if block % m == 0), 64)


@triton.jit
def _choice_scores_kernel(
    q_ptr, pk_ptr, plog_ptr, real_ptr, out_ptr, stride_qb, stride_qh, stride_qn, N, H, NB, SIZE, BAND, PLANE, PER,
    scale,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
):
    bh = tl.program_id(0)
    b = bh // H
    q_head = _head(q_ptr, bh, H, stride_qb, stride_qh)
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
    keys, plane = _mean_keys(pooled, q.dtype)
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
    tl.store(row, tl.where(far & ~hit, log_count * _log_count_units(scale_log2), float("-inf")), mask=ids < NB)


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


TRITON = BandedStages(name="triton", compute=lambda dtype: dtype, pool=pool, attend=attend, select=select)
