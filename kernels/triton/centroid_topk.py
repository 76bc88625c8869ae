"""The centroid top-k of improved clustered attention as Triton kernels: each cluster's TOPK
keys of A^c = softmax(Q^c K^T * scale), from the thresholds and softmax statistics the centroid
pass leaves (kernels.triton.centroid). A^c is never written.

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
candidate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from clusterserve.kernels.triton.helpers import centroid_logits, key_splits, mma, pow2_block, split_parts, top_of_sorted, upcast

# Centroids per tile of the top-k filter, and of its merge (4: 25 programs a head at 100
# clusters, 300 at batch 1, more than the SMs; a merge's steps are short).
TOPK_BLOCK_C = 64
COMBINE_BLOCK_C = 4
# A logit at the threshold may come out an ulp lower when recomputed by a differently tiled dot:
# the top-k kernel keeps what is within this relative margin below it too.
THRESHOLD_MARGIN = 1e-5
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
def _flip_negatives(bits):
    """int32 bits with a negative's magnitude bits flipped: float32 bits to signed int32s that
    order like the floats, and back (the flip is its own inverse)."""
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _ordered(logits):
    """The float32 bits of logits as signed int32s that order like them."""
    return _flip_negatives(logits.to(tl.int32, bitcast=True))


@triton.jit
def _key_logits(keys):
    """The logits of keys (upper half: _ordered, lower: M - 1 - index)."""
    return _flip_negatives((keys >> 32).to(tl.int32)).to(tl.float32, bitcast=True)


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
            merged = top_of_sorted(held, tl.sort(buffered))  # held is sorted, largest first
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
    (sorted, largest first; NO_KEY where fewer), which holds the kept keys as they change.
    Each block's candidates are appended to the row's BUFFER keys of scratch (buffer: (B * H,
    SPLITS, C blocks x BLOCK_C, BUFFER) int64, the program's own rows) at the places a running
    count gives them, one writer each; once a row could not take another block's, every row merges
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
        logits = tl.where(real[None, :], centroid_logits(parts, centroids, keys, scale, UPCAST), float("-inf"))
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
    BLOCK_C: tl.constexpr, TOP: tl.constexpr, NO_KEY: tl.constexpr,
):
    """The TOPK most probable keys of a block of centroids over all splits: indices and
    probabilities (B * H, C, TOPK), 0 on padded keys (their logits are -inf). Each split's
    list is sorted (largest first), so a split merges in read backwards (top_of_sorted); the
    next split's list is loaded while one merges, so the merges do not wait on the loads."""
    bh = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    slots = tl.arange(0, TOP)
    in_rows = rows < C
    lists = part_top_ptr + (bh * SPLITS * C + rows)[:, None] * TOP + (TOP - 1 - slots)[None, :]  # split 0's
    top = tl.full([BLOCK_C, TOP], NO_KEY, tl.int64)
    ahead = tl.load(lists, mask=in_rows[:, None], other=NO_KEY)
    for split in range(0, SPLITS):
        backwards = ahead
        more = in_rows & (tl.zeros([BLOCK_C], tl.int32) + split + 1 < SPLITS)  # the last split's loads none
        ahead = tl.load(lists + (split + 1) * C * TOP, mask=more[:, None], other=NO_KEY)
        top = top_of_sorted(top, backwards)
    shift = tl.load(stats_ptr + (bh * C + rows) * 2, mask=in_rows, other=0.0)
    inv_sum = tl.load(stats_ptr + (bh * C + rows) * 2 + 1, mask=in_rows, other=0.0)
    index = tl.minimum(tl.maximum(M - 1 - (top & 0xFFFFFFFF), 0), M - 1)
    probs = tl.math.exp2(_key_logits(top) - shift[:, None]) * inv_sum[:, None]
    out = (bh * C + rows)[:, None] * TOPK + slots[None, :]
    written = in_rows[:, None] & (slots[None, :] < TOPK)
    tl.store(top_index_ptr + out, index, mask=written)
    tl.store(top_probs_ptr + out, probs, mask=written)


def _topk_scratch(heads: int, splits: int, rows: int, buffer_keys: int, device) -> tuple[Tensor, Tensor, Tensor]:
    """The top-k filter's scratch, per head, split and row of its programs: the candidate
    buffers (int64 keys), and what a merge reads and leaves (counts, floors)."""
    buffer = torch.empty(heads, splits, rows, buffer_keys, dtype=torch.int64, device=device)
    counts = torch.empty(heads, splits, rows, dtype=torch.int32, device=device)
    floors = torch.empty(heads, splits, rows, dtype=torch.float32, device=device)
    return buffer, counts, floors


def centroid_topk_triton(centroids: Tensor, k: Tensor, mask: Tensor, threshold: Tensor, stats: Tensor,
                         scale: float, topk: int, block_m: int) -> tuple[Tensor, Tensor]:
    """Each cluster's top-k keys of A^c: indices (B, H, C, topk) int64 and probabilities float32
    (0 on padded keys). centroids (B, H, C, D) float32; k (B, H, M, D); mask (B, M) contiguous;
    threshold (B * H, C) and stats (B * H, C, 2: max, 1 / sum) from the centroid pass; scale
    in base 2; the keys split in whole blocks of block_m. Two launches."""
    b, h, c, d = centroids.shape
    m, device = k.shape[2], k.device
    top = triton.next_power_of_2(topk)
    topk_block_c = pow2_block(c, 16, TOPK_BLOCK_C)
    blocks = triton.cdiv(c, topk_block_c)
    top_splits, top_chunk = key_splits(m, b * h * blocks, block_m)
    part_top = torch.empty(b * h, top_splits, c, top, dtype=torch.int64, device=device)
    buffer_keys = max(TOPK_BUFFER, top)
    buffer, counts, floors = _topk_scratch(b * h, top_splits, blocks * topk_block_c, buffer_keys, device)
    _centroid_topk_kernel[(blocks, top_splits, b * h)](
        centroids, k, mask, threshold, part_top, buffer, counts, floors,
        *k.stride(),
        h, m, c, d, top_splits, top_chunk, scale,
        BLOCK_C=topk_block_c, BLOCK_M=TOPK_BLOCK_M, HEAD_DIM=pow2_block(d), TOP=top, BUFFER=buffer_keys,
        GROUP=min(topk_block_c, max(1, MERGE_KEYS // (2 * top))), MARGIN=THRESHOLD_MARGIN, NO_KEY=NO_KEY,
        UPCAST=upcast(k),
    )
    top_index = torch.empty(b, h, c, topk, dtype=torch.int64, device=device)
    top_probs = torch.empty(b, h, c, topk, dtype=torch.float32, device=device)
    _centroid_topk_combine_kernel[(triton.cdiv(c, COMBINE_BLOCK_C), b * h)](
        part_top, stats, top_index, top_probs,
        m, c, top_splits, topk,
        BLOCK_C=COMBINE_BLOCK_C, TOP=top, NO_KEY=NO_KEY,
    )
    return top_index, top_probs
