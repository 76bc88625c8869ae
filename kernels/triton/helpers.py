"""The pieces every Triton kernel file shares: tensor-core dots with float32 accuracy, one
online-softmax step, one count of real tokens, one rounding rule for stores, and how a launch
spreads a head's rows over programs.

Split-precision dots. A float32 operand b (centroids, means, hash planes) is split
into three parts of the half dtype, b = hi + mid / S + lo / S^2 with S = 1 for bfloat16 (it
has float32's exponent range) and 2^11 for float16, and a @ b = a @ hi + (a @ mid) / S +
(a @ lo) / S^2: three tensor-core dots with float32 accumulation whose products are exact
(half x half fits float32), against the FMA units of one float32 dot. The split carries 24
bits of b, so decisions made on the result (signs) agree with a float32 computation up to
float32 rounding. The nearest means and the centroids' logits (the top-k) take two parts,
hi + mid: 16 bits of b for bfloat16, 22 for float16; their choices differ from float32's only
within ~1e-5 (relative) of a tie.
float32 inputs keep one float32 dot ("ieee": TF32 would round them to 10 bits).

The upcast rule. Triton's interpreter multiplies bfloat16 bit patterns as integers in tl.dot
(triton-lang/triton#11584) and float16 ones in float16; on CPU tensors (the interpreter) every
dot runs in float32 instead, which is exact for half-precision products (`upcast`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

# An H100's SMs: what launches are shaped for where no GPU is present (Triton's interpreter,
# the offline cost model, which prices an H100).
H100_SMS = 132


def device_sms() -> int:
    """The SMs of the current CUDA device, read once at import; H100_SMS without one."""
    if not torch.cuda.is_available():
        return H100_SMS
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


# The GPU's SMs, and the programs a launch over a head's rows aims for in all: two an SM.
SMS = device_sms()
TARGET_PROGRAMS = 2 * SMS


def upcast(x: Tensor) -> bool:
    """The UPCAST flag of the dots for kernels reading x: True on CPU tensors (the interpreter)."""
    return x.device.type == "cpu"


def chunking(n: int, heads: int, block: int) -> tuple[int, int]:
    """Spread n rows of each head over programs: (programs per head, rows per program), the
    rows a whole number of `block`s, enough programs for TARGET_PROGRAMS over `heads` heads.
    `heads` is the model's head count, not batch x heads, so a sequence is cut the same way
    whatever it is batched with."""
    tiles = triton.cdiv(max(n, 1), block)
    per_program = triton.cdiv(tiles, triton.cdiv(TARGET_PROGRAMS, heads))
    return triton.cdiv(tiles, per_program), per_program * block




def key_splits(m: int, programs_per_split: int, block_m: int, resident: int = 2) -> tuple[int, int]:
    """(splits, keys per split) of m keys, whole blocks of block_m each: at most enough splits
    for TARGET_PROGRAMS in all (read at the call, as chunking reads it), and of those the
    fewest that leave an SM the fewest keys, its waves of `resident` programs at a time taken
    whole (a kernel one program of which fills an SM: one wave of longer splits, not two
    waves and twice the partial results to merge)."""
    most = max(1, min(ceil_div(TARGET_PROGRAMS, programs_per_split), ceil_div(m, block_m)))
    per_wave = SMS * resident
    # The least waves(s) / s, the first (fewest splits) of equals: IEEE division rounds equal
    # ratios of small integers to the same float, and unequal ones stay apart.
    splits = min(range(1, most + 1), key=lambda s: ceil_div(programs_per_split * s, per_wave) / s)
    chunk = ceil_div(ceil_div(m, splits), block_m) * block_m
    return ceil_div(m, chunk), chunk


def ceil_div(a: int, b: int) -> int:
    """ceil(a / b) of integers, for launch arithmetic on the host of every call, where
    triton.cdiv costs ~4 us a call."""
    return -(-a // b)


def cluster_block(clusters: int) -> int:
    """Clusters per program of a per-cluster reduction: about 16 programs a head, 8 to 256
    clusters each (each program also reads every cluster's member count)."""
    return min(256, max(8, triton.next_power_of_2(triton.cdiv(clusters, 16))))


@triton.jit
def mma(a, b, UPCAST: tl.constexpr, acc=None):
    """a @ b (+ acc) with float32 accumulation; half operands on tensor cores, float32 ones in ieee."""
    if UPCAST or a.dtype == tl.float32:
        product = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        product = tl.dot(a, b, acc)
    return product


@triton.jit
def split_scale(HALF: tl.constexpr):
    """S of split_parts in the half dtype HALF: bfloat16 has float32's exponent range, so its
    parts need no scaling (S = 1); float16's do (S = 2^11)."""
    if HALF == tl.bfloat16:
        scale = 1.0
    else:
        scale = 2048.0
    return scale


@triton.jit
def split_parts(b, HALF: tl.constexpr):
    """float32 b as hi + mid / S + lo / S^2 in the half dtype HALF: (hi, mid, lo, S)."""
    scale = split_scale(HALF)
    hi = b.to(HALF)
    rest = (b - hi.to(tl.float32)) * scale
    mid = rest.to(HALF)
    lo = ((rest - mid.to(tl.float32)) * scale).to(HALF)
    return hi, mid, lo, scale


@triton.jit
def dot_parts(a, parts, UPCAST: tl.constexpr, PARTS: tl.constexpr = 3):
    """a @ b for a half and b given as its split_parts (split once, used by many dots): the
    small parts first, each dot accumulating onto the (scaled) sum of the ones before.
    PARTS = 3: b to float32's 24 bits; 2 (hi + mid): to 16 bits for bfloat16 (22 for
    float16), a relative error of at most 2^-17 per element: one tensor-core dot fewer, for
    choices (a nearest mean, a top-k) that may then differ from float32's only within ~1e-5
    of a tie."""
    hi, mid, lo, scale = parts
    if PARTS == 2:
        rest = mma(a, mid, UPCAST)
    elif hi.dtype == tl.bfloat16:
        rest = mma(a, mid, UPCAST, mma(a, lo, UPCAST))
    else:
        rest = mma(a, mid, UPCAST, mma(a, lo, UPCAST) / scale)
    if hi.dtype != tl.bfloat16:  # bfloat16's parts are unscaled (S = 1)
        rest = rest / scale
    return mma(a, hi, UPCAST, rest)


@triton.jit
def dot_parts_left(parts, b, UPCAST: tl.constexpr, PARTS: tl.constexpr = 3):
    """a @ b for b half and a given as its split_parts (PARTS as dot_parts)."""
    hi, mid, lo, scale = parts
    if PARTS == 2:
        rest = mma(mid, b, UPCAST)
    elif hi.dtype == tl.bfloat16:
        rest = mma(mid, b, UPCAST, mma(lo, b, UPCAST))
    else:
        rest = mma(mid, b, UPCAST, mma(lo, b, UPCAST) / scale)
    if hi.dtype != tl.bfloat16:  # bfloat16's parts are unscaled (S = 1)
        rest = rest / scale
    return mma(hi, b, UPCAST, rest)


@triton.jit
def dot_split_right(a, b, UPCAST: tl.constexpr, PARTS: tl.constexpr = 3):
    """a @ b for a in its dtype (half or float32) and b float32: float32 accuracy, or PARTS
    as dot_parts."""
    if a.dtype == tl.float32:
        product = tl.dot(a, b, input_precision="ieee")
    else:
        product = dot_parts(a, split_parts(b, a.dtype), UPCAST, PARTS)
    return product


# Half-precision parts of the centroids in the centroid passes' logits (dot_parts_left): two keep
# the top-k within ~1e-5 of a tie of float32's, for one tensor-core dot a block fewer.
LOGIT_PARTS = tl.constexpr(2)


@triton.jit
def centroid_logits(parts, centroids, keys, scale, UPCAST: tl.constexpr):
    """Base-2 logits (rows, keys) of float32 centroids against keys in their dtype; `parts`
    are the centroids split once for half-precision keys (split_parts)."""
    if keys.dtype == tl.float32:
        product = tl.dot(centroids, tl.trans(keys), input_precision="ieee")
    else:
        product = dot_parts_left(parts, tl.trans(keys), UPCAST, LOGIT_PARTS)
    return product * scale


@triton.jit
def online_softmax_step(acc, row_max, row_sum, logits, values, UPCAST: tl.constexpr, scale=1.0):
    """Fold one block of base-2 logits (rows, keys) x scale (> 0), -inf where a key does not
    count, and its values (keys, Dv) into a running softmax: acc (rows, Dv) unnormalised,
    row_max (from -inf, scaled) and row_sum, all float32. Passing the scale here lets it fuse
    with the shift (one FMA an element). The probabilities are rounded to the values' dtype
    before they meet them, as flash attention's are."""
    new_max = tl.maximum(row_max, tl.max(logits, axis=1) * scale)
    # A row with no key yet keeps max -inf; subtract 0 there so no inf - inf appears.
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    p = tl.math.exp2(logits * scale - shift[:, None])
    rescale = tl.math.exp2(row_max - shift)
    row_sum = row_sum * rescale + tl.sum(p, axis=1)
    pv = mma(p.to(values.dtype), values, UPCAST)
    return acc * rescale[:, None] + pv, new_max, row_sum


@triton.jit
def head_start(x_ptr, bh, H, stride_b, stride_h):
    """Where head bh (= batch x H + head) of a (B, H, N, D) tensor starts, by its strides."""
    return x_ptr + (bh // H).to(tl.int64) * stride_b + (bh % H).to(tl.int64) * stride_h


def unit_rows(x: Tensor) -> Tensor:
    """x (B, H, N, D) as kernels that take its strides read it: in place, as long as each row's
    D values are adjacent (a head's view of packed (T, H, D) tokens); else a copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


@triton.jit
def count_real(mask_row, start, stop, BLOCK: tl.constexpr):
    """Real tokens among positions [start, stop) of one (N,) mask row (nonzero bytes)."""
    count = tl.zeros([BLOCK], tl.int32)
    for first in range(start, stop, BLOCK):
        rows = first + tl.arange(0, BLOCK)
        count += (tl.load(mask_row + rows, mask=rows < stop, other=0) != 0).to(tl.int32)
    return tl.sum(count, axis=0)


@triton.jit
def top_of_sorted(top, ascending):
    """The largest len(top) of two sorted lists, largest first: `top` largest first, `ascending`
    the other way (a list read backwards). The larger of each pair are the largest of both, in
    bitonic order, which log2(len) compare-and-swap steps sort."""
    return tl.bitonic_merge(tl.maximum(top, ascending), descending=True)


@triton.jit
def has_padding(mask_row, start, stop):
    """Whether positions [start, stop) of one (N,) mask row hold a padded token: a loop over
    them can then skip its per-block loads of the mask (an unpadded input's every loop does)."""
    return count_real(mask_row, start, stop, 1024) < stop - start


@triton.jit
def exact_case(mask_row, start, stop, N, C, BLOCK: tl.constexpr, EXACT_CASE: tl.constexpr):
    """With EXACT_CASE, the real queries before the chunk [start, stop) of a (N,) mask row, and
    whether the row has no more real queries than the C clusters (each real query is then its
    own cluster); else 0 and False. A chunk of more than C real queries settles it alone: the
    rest of the row is not counted (on long inputs, the slowest chunk's count of the row)."""
    rank_seen = tl.full([], 0, tl.int32)
    exact = rank_seen < 0
    if EXACT_CASE:
        here = count_real(mask_row, start, stop, BLOCK)
        few = here <= C
        before_stop = tl.where(few, start, 0)
        after_start = tl.where(few, stop, N)
        rank_seen = count_real(mask_row, 0, before_stop, BLOCK)
        exact = few & (rank_seen + here + count_real(mask_row, after_start, N, BLOCK) <= C)
    return rank_seen, exact


@triton.jit
def rounded(x, dtype: tl.constexpr):
    """float32 x in dtype, rounded to nearest even as torch's .to(dtype) does. bfloat16 is
    rounded by hand: Triton's interpreter truncates a plain cast (a GPU would round)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def any_set(flags_row, COUNT, BLOCK: tl.constexpr):
    """Whether any of the first COUNT int32 flags of a row is nonzero (COUNT <= BLOCK)."""
    slots = tl.arange(0, BLOCK)
    return tl.sum(tl.load(flags_row + slots, mask=slots < COUNT, other=0), axis=0) > 0


# The most chunks a sum_chunks load takes: all of a head's (22 at batch 1, chunking) at once.
CHUNK_GROUP = 32


def chunk_group(chunks: int) -> int:
    """GROUP for sum_chunks over `chunks` chunks: a power of two covering them, at most CHUNK_GROUP."""
    return min(CHUNK_GROUP, pow2_block(chunks, 1))


@triton.jit
def sum_chunks(part_ptr, chunk_stride, CHUNKS, offsets, mask, GROUP: tl.constexpr):
    """The sum over chunks of part_ptr[chunk * chunk_stride + offsets], offsets 1-d, GROUP
    chunks a load (so a reduction over the programs of a head is a few loads deep)."""
    total = tl.zeros(offsets.shape, part_ptr.dtype.element_ty)
    for first in range(0, CHUNKS, GROUP):
        chunks = first + tl.arange(0, GROUP)
        values = tl.load(part_ptr + chunks[:, None] * chunk_stride + offsets[None, :],
                         mask=(chunks[:, None] < CHUNKS) & mask[None, :], other=0)
        total += tl.sum(values, axis=0)
    return total


@triton.jit
def sum_chunks_2d(part_ptr, chunk_stride, CHUNKS, offsets, mask, GROUP: tl.constexpr):
    """`sum_chunks` for 2-d offsets."""
    total = tl.zeros(offsets.shape, part_ptr.dtype.element_ty)
    for first in range(0, CHUNKS, GROUP):
        chunks = first + tl.arange(0, GROUP)
        values = tl.load(part_ptr + chunks[:, None, None] * chunk_stride + offsets[None, :, :],
                         mask=(chunks[:, None, None] < CHUNKS) & mask[None, :, :], other=0)
        total += tl.sum(values, axis=0)
    return total


@triton.jit
def scalar_at(vector, index, i):
    """The entry of a 1-d tensor at the position where `index` (its positions) equals i."""
    return tl.sum(tl.where(index == i, vector, 0), axis=0)


@triton.jit
def one_hot(index, cols, dtype: tl.constexpr):
    """(len(cols), len(index)) of 1 where cols[i] == index[j], else 0, in dtype (floats via
    float32: the interpreter casts bool to bfloat16 bit patterns)."""
    if dtype.is_floating():
        hot = (cols[:, None] == index[None, :]).to(tl.float32).to(dtype)
    else:
        hot = (cols[:, None] == index[None, :]).to(dtype)
    return hot


@triton.jit
def code_signs(codes, BLOCK_BITS: tl.constexpr):
    """int64 codes (rows,) -> (rows, BLOCK_BITS) int8, +1 where bit b is set, else -1. Bits
    past the code's are 0 in every code: -1 on both sides of a dot, a constant +1 each."""
    bit = tl.arange(0, BLOCK_BITS)
    word = tl.where(bit[None, :] < 32, codes.to(tl.int32)[:, None], (codes >> 32).to(tl.int32)[:, None])
    return (((word >> (bit[None, :] & 31)) & 1) * 2 - 1).to(tl.int8)


def pow2_block(size: int, low: int = 16, high: int | None = None) -> int:
    """The smallest power of two >= size, raised to `low` and capped at `high`."""
    block = max(low, triton.next_power_of_2(max(size, 1)))
    return block if high is None else min(high, block)
