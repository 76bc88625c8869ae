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
    _centroid_topk_kernel       (centroid blocks of 64, top splits, B * H)  the logits again;
                                only keys at or above the threshold can be in the top-k (on
                                random logits ~1.3 TOP of a row's M; on real text 2.7-11 TOP,
                                many of them near-ties), and only those are kept: appended
                                to a per-row buffer in scratch, merged into the row's kept
                                keys by a sort of TOP at a time when a row's buffer is full
                                and at the end; after a merge a row's floor rises above the
                                least of the TOP keys it keeps
    _centroid_topk_combine_kernel  (centroid blocks of 4, B * H)  the splits' kept keys merged
                                into the top-k, their indices and probabilities

A block of keys costs the top-k a compare and a predicated store per logit, and a candidate a
share of a sort of 2 TOP keys, instead of a sorting network over every logit or a step per
candidate. Softmaxes run in base 2 (kernels.triton.helpers). The
centroids (float32) meet half-precision keys as split-precision dots of two parts (LOGIT_PARTS),
split once per program: the top-k differs from float32's only within ~1e-5 of a tie. The
probabilities meet half-precision values rounded to the values' dtype, as flash attention's do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import fallbacks
from kernels.reference.clustered import centroid_attention
from kernels.stages import CentroidAttention
from kernels.triton import helpers
from kernels.triton.helpers import dot_parts_left, mma, online_softmax_step, pow2_block, split_parts, upcast

LOG2E = 1.4426950408889634
# The largest top-k (rounded up to a power of two) that the centroid pass selects on chip.
MAX_TOPK_ON_CHIP = 256
# Centroids per tile of the softmax pass (all of a head's up to this many), of the top-k
# filter, and of the two merges (4: 25 programs a head at 100 clusters, 300 at batch 1, more
# than the SMs; a merge's steps are short).
SOFTMAX_BLOCK_C = 128
TOPK_BLOCK_C = 64
COMBINE_BLOCK_C = 4
# Splits the merge loads a step (more spill on sm_80).
COMBINE_SPLITS = 4
# A logit at the threshold may come out an ulp lower when recomputed by a differently tiled dot:
# the top-k kernel keeps what is within this relative margin below it too.
THRESHOLD_MARGIN = 1e-5
# Half-precision parts of the centroids in the logits (helpers.dot_parts): two keep the top-k
# within ~1e-5 of a tie of float32's, for one tensor-core dot a block fewer in both passes.
LOGIT_PARTS = tl.constexpr(2)
# Key of no key: below every logit's.
NO_KEY = -(1 << 63)
# Keys per block of the top-k filter (32 cost the model's estimate 1.3x at 16k: twice the
# blocks at little less a block), and candidates a row of its buffers (at least TOP): a merge
# every (TOPK_BUFFER - TOPK_BLOCK_M) / TOPK_BLOCK_M blocks at most.
TOPK_BLOCK_M = 64
TOPK_BUFFER = 128
# Keys a step of a merge of the buffers sorts: GROUP rows of 2 TOP (a whole block's rows at
# once made ptxas spill).
MERGE_KEYS = 1024


@triton.jit
def _ordered(logits):
    """The float32 bits of logits as signed int32s that order like them (negatives flip their
    magnitude bits)."""
    bits = logits.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _key_logits(keys):
    """The logits of keys (upper half: _ordered, lower: M - 1 - index)."""
    ordered = (keys >> 32).to(tl.int32)
    return (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _logits(parts, centroids, keys, scale, UPCAST: tl.constexpr):
    """Base-2 logits (rows, keys) of float32 centroids against keys in their dtype; `parts`
    are the centroids split once for half-precision keys (split_parts)."""
    if keys.dtype == tl.float32:
        product = tl.dot(centroids, tl.trans(keys), input_precision="ieee")
    else:
        product = dot_parts_left(parts, tl.trans(keys), UPCAST, LOGIT_PARTS)
    return product * scale


@triton.jit
def _lane_shift(block, BLOCK_M: tl.constexpr):
    """The rotation of key block `block`'s columns, in [0, BLOCK_M): Fibonacci hashing on 16 bits
    (the top bits of block x 2^16 / golden ratio, mod 2^16); every product fits an int32."""
    return (((block & 0x7FFF) * 40503) & 0xFFFF) * BLOCK_M >> 16


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
    for start in range(first, stop, BLOCK_M):
        cols = start + tl.arange(0, BLOCK_M)
        if LANES > 0:
            # A block's keys enter its columns rotated by a hash of the block (_lane_shift), so
            # that keys BLOCK_M apart (a copied position table, repeated text) fall in other lanes.
            cols = start + (tl.arange(0, BLOCK_M) + _lane_shift(start // BLOCK_M, BLOCK_M)) % BLOCK_M
        in_split = cols < stop
        real = in_split & (tl.load(key_mask_ptr + batch * M + cols, mask=in_split, other=0) != 0)
        keys = tl.load(k_head + cols[:, None] * stride_km + dims[None, :] * stride_kd,
                       mask=real[:, None] & (dims[None, :] < D), other=0.0)
        values = tl.load(v_head + cols[:, None] * stride_vm + vdims[None, :] * stride_vd,
                         mask=real[:, None] & (vdims[None, :] < DV), other=0.0)
        logits = tl.where(real[None, :], _logits(parts, centroids, keys, scale, UPCAST), float("-inf"))
        acc, row_max, row_sum = online_softmax_step(acc, row_max, row_sum, logits, values, UPCAST)
        if LANES > 0:
            lanes = tl.maximum(lanes, tl.max(tl.reshape(logits, (BLOCK_C, BLOCK_M // LANES, LANES)), axis=1))
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


@triton.jit
def _merge_kept(kept_ptr, buffer_ptr, counts_ptr, floors_ptr, floor, count, C, merges, fresh, BLOCK_C: tl.constexpr,
                TOP: tl.constexpr, BUFFER: tl.constexpr, GROUP: tl.constexpr, NO_KEY: tl.constexpr,
                FLOORS: tl.constexpr):
    """Each of a program's BLOCK_C rows keeps the TOP largest of its kept keys (kept_ptr: C rows
    of TOP; none yet if `fresh`; rows past C have none) and the first `count` (BLOCK_C,) keys of
    its buffer (buffer_ptr: BLOCK_C rows of BUFFER), all int64: `merges` x TOP buffered keys of
    GROUP rows at a time, so that a sort holds GROUP x 2 TOP keys, not BLOCK_C x 2 TOP. All of
    it inside the loop over `merges` (0: nothing is touched); the counts pass through the
    program's counts_ptr (BLOCK_C int32s) to the threads that hold each group. With FLOORS the
    last step raises each row's `floor` (BLOCK_C,), returned, through floors_ptr (BLOCK_C
    float32s) to the least logit a later key of the split needs to enter: the float just above
    the least kept key's (a later key with that logit has a higher index and loses the tie);
    unchanged while the row keeps fewer than TOP keys."""
    slots = tl.arange(0, TOP)
    for first in range(0, merges * TOP, TOP):
        tl.store(counts_ptr + tl.arange(0, BLOCK_C), count, mask=tl.full([BLOCK_C], first, tl.int32) == 0)
        tl.debug_barrier()  # the counts, stored on the first step, are read back by other threads
        for group in tl.static_range(0, BLOCK_C, GROUP):
            rows = group + tl.arange(0, GROUP)
            present = (rows < C)[:, None]
            kept = kept_ptr + rows[:, None] * TOP + slots[None, :]
            held = tl.load(kept, mask=present & ((first > 0) | (fresh == 0)), other=NO_KEY)
            filled = first + slots[None, :] < tl.load(counts_ptr + rows)[:, None]
            buffered = tl.load(buffer_ptr + rows[:, None] * BUFFER + first + slots[None, :], mask=filled, other=NO_KEY)
            merged = tl.topk(tl.reshape(tl.join(held, buffered), (GROUP, 2 * TOP)), TOP)
            tl.store(kept, merged, mask=present)
            if FLOORS:
                if first + TOP == merges * TOP:
                    least = tl.min(merged, axis=1)  # one above it in the logit's bits: the next float up
                    risen = _key_logits(least + (1 << 32))
                    tl.store(floors_ptr + rows, tl.where(least > NO_KEY, risen, float("-inf")))
        if FLOORS:
            if first + TOP == merges * TOP:
                tl.debug_barrier()  # the floors, stored above, are read back by other threads
                floor = tl.maximum(floor, tl.load(floors_ptr + tl.arange(0, BLOCK_C)))
    return floor


@triton.jit
def _centroid_topk_kernel(
    centroids_ptr, k_ptr, key_mask_ptr, threshold_ptr, part_top_ptr, buffer_ptr, counts_ptr, floors_ptr,
    stride_kb, stride_kh, stride_km, stride_kd,
    H, M, C, D, SPLITS, CHUNK, scale,
    BLOCK_C: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, TOP: tl.constexpr,
    BUFFER: tl.constexpr, GROUP: tl.constexpr, MARGIN: tl.constexpr, NO_KEY: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """A block of centroids against one split of the keys: the TOP largest keys of each row
    (int64: the logit as _ordered above M - 1 - index, so the lower index wins a tie) among
    those whose logit is at least its threshold, to part_top (B * H, SPLITS, C, TOP) int64
    (unsorted; NO_KEY where fewer), which holds the kept keys as they change. Each block's
    candidates are appended to the row's BUFFER keys of scratch (buffer: (B * H, SPLITS, C
    blocks x BLOCK_C, BUFFER) int64, the program's own rows) at the places a running count
    gives them, one writer each; once a row could not take another block's, every row merges
    its buffer into its kept keys (_merge_kept; counts and floors: (B * H, SPLITS, C blocks x
    BLOCK_C) int32 and float32 scratch), as all do at the end. After a merge a row that keeps
    TOP keys takes only logits above the least of them: its floor rises. A block costs a
    compare and a predicated store per logit, whatever its candidates."""
    split = tl.program_id(1)
    bh = tl.program_id(2).to(tl.int64)
    batch, head = bh // H, bh % H
    first_row = tl.program_id(0) * BLOCK_C
    rows = first_row + tl.arange(0, BLOCK_C)
    dims = tl.arange(0, HEAD_DIM)
    block_cols = tl.arange(0, BLOCK_M)
    in_rows = rows < C
    centroids = tl.load(centroids_ptr + (bh * C + rows)[:, None] * D + dims[None, :],
                        mask=in_rows[:, None] & (dims[None, :] < D), other=0.0)
    parts = split_parts(centroids, k_ptr.dtype.element_ty)  # loop invariant
    k_head = k_ptr + batch * stride_kb + head * stride_kh
    threshold = tl.load(threshold_ptr + bh * C + rows, mask=in_rows, other=0.0)
    floor = tl.where(in_rows, threshold - MARGIN * (tl.abs(threshold) + 1.0), float("inf"))
    kept = part_top_ptr + ((bh * SPLITS + split) * C + first_row) * TOP  # the block's rows
    program_row = (bh * SPLITS + split) * tl.num_programs(0) * BLOCK_C + first_row
    buffer, counts, floors = buffer_ptr + program_row * BUFFER, counts_ptr + program_row, floors_ptr + program_row
    # A row's running count of candidates in a block on the tensor cores: live @ (j <= c).
    prefix = (block_cols[:, None] <= block_cols[None, :]).to(tl.int8)
    count = tl.zeros([BLOCK_C], tl.int32)
    fresh = 1  # nothing kept yet
    first = split * CHUNK
    stop = tl.minimum(first + CHUNK, M)
    for start in range(first, stop, BLOCK_M):
        cols = start + block_cols
        in_split = cols < stop
        # The keys load does not wait for the mask's: a padded key's logit is set to -inf.
        keys = tl.load(k_head + cols[:, None] * stride_km + dims[None, :] * stride_kd,
                       mask=in_split[:, None] & (dims[None, :] < D), other=0.0)
        real = in_split & (tl.load(key_mask_ptr + batch * M + cols, mask=in_split, other=0) != 0)
        logits = tl.where(real[None, :], _logits(parts, centroids, keys, scale, UPCAST), float("-inf"))
        live = in_split[None, :] & (logits >= floor[:, None])
        place = count[:, None] + mma(live.to(tl.int8), prefix, UPCAST).to(tl.int32) - 1
        candidates = (_ordered(logits).to(tl.int64) << 32) | (M - 1 - cols).to(tl.int64)[None, :]
        tl.store(buffer + (tl.arange(0, BLOCK_C)[:, None] * BUFFER + place), candidates, mask=live)  # int32 offsets
        count += tl.sum(live.to(tl.int32), axis=1)
        most = tl.max(count, axis=0)
        # A row that could not take another block's: every row merges its buffer (rare: on the
        # default model's real text, 0-2 times a split up to 64k tokens).
        merges = tl.where(most > BUFFER - BLOCK_M, tl.cdiv(most, TOP), 0)
        tl.debug_barrier()  # the candidates, stored above, are read back by other threads
        floor = _merge_kept(kept, buffer, counts, floors, floor, count, C - first_row, merges, fresh, BLOCK_C, TOP,
                            BUFFER, GROUP, NO_KEY, True)
        tl.debug_barrier()  # and read before the next block's overwrite them
        fresh = tl.where(merges > 0, 0, fresh)
        count = tl.where(merges > 0, 0, count)
    tl.debug_barrier()  # the candidates, stored above, are read back by other threads
    last_merges = tl.maximum(tl.cdiv(tl.max(count, axis=0), TOP), fresh)  # once at least: the kept keys' stores
    _merge_kept(kept, buffer, counts, floors, floor, count, C - first_row, last_merges, fresh, BLOCK_C, TOP, BUFFER,
                GROUP, NO_KEY, False)


@triton.jit
def _centroid_topk_combine_kernel(
    part_top_ptr, stats_ptr, top_index_ptr, top_probs_ptr,
    M, C, SPLITS, TOPK,
    BLOCK_C: tl.constexpr, TOP: tl.constexpr,
):
    """The TOPK most probable keys of a block of centroids over all splits: indices and
    probabilities (B * H, C, TOPK), 0 on padded keys (their logits are -inf)."""
    bh = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    slots = tl.arange(0, TOP)
    in_rows = rows < C
    top = tl.full([BLOCK_C, TOP], -(1 << 63), tl.int64)
    for split in range(0, SPLITS):
        part = (bh * SPLITS + split) * C + rows
        candidates = tl.load(part_top_ptr + part[:, None] * TOP + slots[None, :], mask=in_rows[:, None],
                             other=-(1 << 63))
        top = tl.topk(tl.reshape(tl.join(top, candidates), (BLOCK_C, 2 * TOP)), TOP)
    shift = tl.load(stats_ptr + (bh * C + rows) * 2, mask=in_rows, other=0.0)
    inv_sum = tl.load(stats_ptr + (bh * C + rows) * 2 + 1, mask=in_rows, other=0.0)
    index = tl.minimum(tl.maximum(M - 1 - (top & 0xFFFFFFFF), 0), M - 1)
    probs = tl.math.exp2(_key_logits(top) - shift[:, None]) * inv_sum[:, None]
    out = (bh * C + rows)[:, None] * TOPK + slots[None, :]
    written = in_rows[:, None] & (slots[None, :] < TOPK)
    tl.store(top_index_ptr + out, index, mask=written)
    tl.store(top_probs_ptr + out, probs, mask=written)


def _splits(m: int, programs_per_split: int, block_m: int) -> tuple[int, int]:
    """(splits, keys per split): enough splits for helpers.TARGET_PROGRAMS in all (read at the
    call, as chunking reads it), whole blocks each."""
    splits = max(1, min(triton.cdiv(helpers.TARGET_PROGRAMS, programs_per_split), triton.cdiv(m, block_m)))
    chunk = triton.cdiv(triton.cdiv(m, splits), block_m) * block_m
    return triton.cdiv(m, chunk), chunk


def _topk_scratch(heads: int, splits: int, rows: int, buffer_keys: int, device) -> tuple[Tensor, Tensor, Tensor]:
    """The top-k filter's scratch, per head, split and row of its programs: the candidate
    buffers (int64 keys), and what a merge reads and leaves (counts, floors)."""
    buffer = torch.empty(heads, splits, rows, buffer_keys, dtype=torch.int64, device=device)
    counts = torch.empty(heads, splits, rows, dtype=torch.int32, device=device)
    floors = torch.empty(heads, splits, rows, dtype=torch.float32, device=device)
    return buffer, counts, floors


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
    splits, chunk = _splits(m, b * h * triton.cdiv(c, block_c), block_m)
    part_values = torch.empty(b * h, splits, c, dv, dtype=torch.float32, device=device)
    part_max = torch.empty(b * h, splits, c, dtype=torch.float32, device=device)
    part_sum = torch.empty(b * h, splits, c, dtype=torch.float32, device=device)
    part_lanes = torch.empty(b * h, splits, c, max(2 * top, 1), dtype=torch.float32, device=device)
    _centroid_attention_kernel[(triton.cdiv(c, block_c), splits, b * h)](
        centroids, k, v, mask, part_values, part_max, part_sum, part_lanes,
        *k.stride(), *v.stride(),
        h, m, c, d, dv, splits, chunk, scale * LOG2E,
        BLOCK_C=block_c, BLOCK_M=block_m, HEAD_DIM=pow2_block(d), VALUE_DIM=pow2_block(dv),
        LANES=2 * top, UPCAST=upcast(k), num_warps=8 if block_c >= 64 else 4,
    )
    values = torch.empty(b, h, c, dv, dtype=torch.float32, device=device)
    stats = torch.empty(b * h, c, 2, dtype=torch.float32, device=device)
    threshold = torch.empty(b * h, c, dtype=torch.float32, device=device)
    _centroid_combine_kernel[(triton.cdiv(c, COMBINE_BLOCK_C), b * h)](
        part_values, part_max, part_sum, part_lanes, values, stats, threshold,
        c, dv, splits,
        BLOCK_C=COMBINE_BLOCK_C, VALUE_DIM=pow2_block(dv), LANES=2 * top, SPLIT_GROUP=COMBINE_SPLITS,
    )
    if not topk:
        return CentroidAttention(values)
    topk_block_c = pow2_block(c, 16, TOPK_BLOCK_C)
    blocks = triton.cdiv(c, topk_block_c)
    top_splits, top_chunk = _splits(m, b * h * blocks, block_m)
    part_top = torch.empty(b * h, top_splits, c, top, dtype=torch.int64, device=device)
    buffer_keys = max(TOPK_BUFFER, top)
    buffer, counts, floors = _topk_scratch(b * h, top_splits, blocks * topk_block_c, buffer_keys, device)
    _centroid_topk_kernel[(blocks, top_splits, b * h)](
        centroids, k, mask, threshold, part_top, buffer, counts, floors,
        *k.stride(),
        h, m, c, d, top_splits, top_chunk, scale * LOG2E,
        BLOCK_C=topk_block_c, BLOCK_M=TOPK_BLOCK_M, HEAD_DIM=pow2_block(d), TOP=top, BUFFER=buffer_keys,
        GROUP=min(topk_block_c, max(1, MERGE_KEYS // (2 * top))), MARGIN=THRESHOLD_MARGIN, NO_KEY=NO_KEY,
        UPCAST=upcast(k),
    )
    top_index = torch.empty(b, h, c, topk, dtype=torch.int64, device=device)
    top_probs = torch.empty(b, h, c, topk, dtype=torch.float32, device=device)
    _centroid_topk_combine_kernel[(triton.cdiv(c, COMBINE_BLOCK_C), b * h)](
        part_top, stats, top_index, top_probs,
        m, c, top_splits, topk,
        BLOCK_C=COMBINE_BLOCK_C, TOP=top,
    )
    return CentroidAttention(values, top_index, top_probs)
