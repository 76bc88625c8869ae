"""The hash launch of SMYRF's Triton stages (smyrf.py's `smyrf_hashes_triton` runs it after the
norms launch, with the rows per tile that its `hash_block` picks):

    _smyrf_hash_kernel  (tiles of queries + tiles of keys, B * H)  the radius from the chunks'
                        largest squared norms (a max is exact in any order), then every
                        round's hash of F(q) and G(k) (eq. 4 and 14) as one dot per tile,
                        float32-accurate (split-precision for half inputs); padded tokens
                        hash to +inf so they sort last.

`_real_rows`, which rows of a tile are real tokens, is shared with the norms pass.
"""

from __future__ import annotations

import triton
import triton.language as tl

from clusterserve.kernels.triton.helpers import dot_split_right


@triton.jit
def _real_rows(mask_row, rows, n_rows, USE_MASK: tl.constexpr):
    """Which rows are real tokens: inside the sequence and (if masked) marked True."""
    real = rows < n_rows
    if USE_MASK:
        real = real & (tl.load(mask_row + rows, mask=real, other=0) != 0)
    return real


@triton.jit
def _hash_tile(base, hashes, proj, mask_row, radius, first, n_rows, rounds_count, stride_n, stride_d, stride_pr,
               stride_pd, stride_hr, EXTRA: tl.constexpr, USE_MASK: tl.constexpr, HEAD_DIM: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, UPCAST: tl.constexpr):
    """Hashes of rows [first, first + BLOCK_T) for every round in one dot:
    x @ a[:D] + sqrt(radius - |x|^2) a[D + EXTRA]; padded rows hash to +inf."""
    rows = first + tl.arange(0, BLOCK_T)
    dims = tl.arange(0, BLOCK_D)
    rounds = tl.arange(0, BLOCK_R)
    x = tl.load(base + rows[:, None] * stride_n + dims[None, :] * stride_d,
                mask=(rows[:, None] < n_rows) & (dims[None, :] < HEAD_DIM), other=0.0)
    a = tl.load(proj + rounds[None, :] * stride_pr + dims[:, None] * stride_pd,
                mask=(dims[:, None] < HEAD_DIM) & (rounds[None, :] < rounds_count), other=0.0)
    a_extra = tl.load(proj + rounds * stride_pr + (HEAD_DIM + EXTRA) * stride_pd, mask=rounds < rounds_count, other=0.0)
    sq = tl.sum(x.to(tl.float32) * x.to(tl.float32), axis=1)
    extra = tl.sqrt(tl.maximum(radius - sq, 0.0))
    hash_values = dot_split_right(x, a, UPCAST) + extra[:, None] * a_extra[None, :]
    hash_values = tl.where(_real_rows(mask_row, rows, n_rows, USE_MASK)[:, None], hash_values, float("inf"))
    tl.store(hashes + rounds[None, :] * stride_hr + rows[:, None], hash_values,
             mask=(rows[:, None] < n_rows) & (rounds[None, :] < rounds_count))


@triton.jit
def _smyrf_hash_kernel(
    Q, K, Proj, Mask, PartMax, QHash, KHash,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_km, stride_kd,
    stride_pr, stride_ph, stride_pd,
    stride_maskb,
    stride_qhashr, stride_qhashb, stride_qhashh,
    stride_khashr, stride_khashb, stride_khashh,
    H, N, M, ROUNDS, CHUNKS, Q_TILES,
    HAS_MASK: tl.constexpr, MASK_QUERIES: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, CHUNK_BLOCK: tl.constexpr, UPCAST: tl.constexpr,
):
    """The hashes of BLOCK_T queries (tiles below Q_TILES) or keys (the rest) of one (batch,
    head) for every round: F(q)'s extra coordinate is the last (D + 1), G(k)'s the one before
    (D); radius = the largest real squared norm of the queries + that of the keys, over the
    chunks of PartMax. QHash (R, B, H, N) and KHash (R, B, H, M) float32."""
    tile = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    chunks = tl.arange(0, CHUNK_BLOCK)
    maxima = PartMax + (bh * CHUNKS + chunks) * 2
    radius = (tl.max(tl.load(maxima, mask=chunks < CHUNKS, other=0.0), axis=0)
              + tl.max(tl.load(maxima + 1, mask=chunks < CHUNKS, other=0.0), axis=0))
    mask_row = Mask + b * stride_maskb
    proj = Proj + h * stride_ph
    if tile < Q_TILES:
        _hash_tile(Q + b * stride_qb + h * stride_qh, QHash + b * stride_qhashb + h * stride_qhashh, proj, mask_row,
                   radius, tile * BLOCK_T, N, ROUNDS, stride_qn, stride_qd, stride_pr, stride_pd, stride_qhashr,
                   1, MASK_QUERIES, HEAD_DIM, BLOCK_D, BLOCK_T, BLOCK_R, UPCAST)
    else:
        _hash_tile(K + b * stride_kb + h * stride_kh, KHash + b * stride_khashb + h * stride_khashh, proj, mask_row,
                   radius, (tile - Q_TILES) * BLOCK_T, M, ROUNDS, stride_km, stride_kd, stride_pr, stride_pd,
                   stride_khashr, 0, HAS_MASK, HEAD_DIM, BLOCK_D, BLOCK_T, BLOCK_R, UPCAST)
