"""SMYRF attention as Triton kernels (Daras et al. 2020, arXiv:2010.05315).

The triton backend's SMYRF stages (kernels/stages.py runs them); they match the reference in
smyrf.py (same seed, same clusters, same output):

1. `_smyrf_norms_kernel`, (chunks of rows, B * H): each chunk's largest squared norm of the
   real queries and of the real keys (chunks as kernels.triton.helpers.chunking cuts them); then
   `_smyrf_hash_kernel` (smyrf_hash.py), (tiles of queries + tiles of keys, B * H; the
   largest tiles, up to 512 rows, that still fill the GPU: hash_block): the radius from the
   chunks' maxima (a max is exact in any order) and every round's hash of F(q) and G(k)
   (eq. 4 and 14) as one dot per tile, float32-accurate (split-precision for half inputs);
   padded tokens hash to +inf so they sort last.
2. `torch.argsort(stable=True)` of the hashes, on device (queries' and keys' as one batch of
   rows where they have one length: kernels.stages.sort_by_hash).
3. `_smyrf_attention_kernel`, once per round: each program takes BLOCK_M consecutive
   sorted query ranks, gathers their rows of Q by index, and streams the contiguous run of
   sorted key ranks that their clusters own (gathering K and V rows by index), with an
   online softmax in float32. Cluster membership is arithmetic - rank r of n real tokens
   lies in cluster floor(r L / n) - so a tile that straddles clusters masks the logits
   block-diagonally and no per-cluster layout, slot size or host-side count is needed.
   The round's output and log-sum-exp are merged by softmax mass (eq. 15) into a float32
   accumulator at the query's original position; the last round writes the output dtype.
   The softmax is kernels.triton.helpers.online_softmax_step, the probabilities rounded to the
   values' dtype before P @ V, as flash attention does.

No host synchronisation and no torch glue: the kernels count each sequence's real tokens
from the mask; the grid depends only on shapes. A call is 2 + R launches and the sort
stage's stack and argsort. The hash directions come from the reference's CPU generator and are
copied without a stream sync; capturing a CUDA graph needs them on the device beforehand,
since a copy from pageable host memory cannot be captured.

Shapes: q (B, H, N, D), k (B, H, M, D), v (B, H, M, Dv) -> (B, H, N, Dv).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from clusterserve.kernels.reference.hashing import on_device
from clusterserve.kernels.reference.smyrf import smyrf_cluster_count, smyrf_projections
from clusterserve.kernels.spec import AttentionSpec
from clusterserve.kernels.stages import SmyrfStages, sort_by_hash
from clusterserve.kernels.triton import helpers
from clusterserve.kernels.triton.helpers import (
    ceil_div,
    chunking,
    count_real,
    mma,
    online_softmax_step,
    pow2_block,
    rounded,
    upcast,
)
from clusterserve.kernels.triton.smyrf_hash import _real_rows, _smyrf_hash_kernel

# Rows per tile of the norms launch, and the fewest per tile of the hash launch; a hash tile
# holds at most HASH_MAX_ROWS rows and HASH_TILE_ELEMENTS of x (512 rows at head dim 64: 165
# registers at 4 warps; its hashes alone fill 255 at 1024 rows).
HASH_TILE = 64
HASH_MAX_ROWS = 512
HASH_TILE_ELEMENTS = 512 * 64
# Warps of the norms pass: a latency-bound stream of rows at ~32 registers, so 8 warps keep
# twice the loads of 4 in flight.
NORMS_NUM_WARPS = 8


@triton.jit
def _real_count(mask_row, n_rows, USE_MASK: tl.constexpr):
    """Real tokens of one sequence: n_rows, or the True entries of its mask row."""
    if USE_MASK:
        total = count_real(mask_row, 0, n_rows, 4096)
    else:
        total = n_rows
    return total


@triton.jit
def _max_sq_norm(base, mask_row, start, stop, n_rows, stride_n, stride_d,
                 USE_MASK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr):
    """Largest squared norm over the real rows in [start, min(stop, n_rows)) (0 if none)."""
    dims = tl.arange(0, BLOCK_D)
    best = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for first in range(start, tl.minimum(stop, n_rows), BLOCK_T):
        rows = first + tl.arange(0, BLOCK_T)
        x = tl.load(base + rows[:, None] * stride_n + dims[None, :] * stride_d,
                    mask=(rows[:, None] < stop) & (rows[:, None] < n_rows) & (dims[None, :] < HEAD_DIM),
                    other=0.0).to(tl.float32)
        real = _real_rows(mask_row, rows, tl.minimum(stop, n_rows), USE_MASK)
        best = tl.maximum(best, tl.where(real, tl.sum(x * x, axis=1), 0.0))
    return tl.max(best, axis=0)


@triton.jit
def _smyrf_norms_kernel(
    Q, K, Mask, PartMax,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_km, stride_kd,
    stride_maskb,
    H, N, M, CHUNK, CHUNKS,
    HAS_MASK: tl.constexpr, MASK_QUERIES: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Largest squared norms of the real queries and keys among rows [chunk CHUNK,
    (chunk + 1) CHUNK) of one (batch, head): PartMax (B * H, CHUNKS, 2) float32."""
    chunk = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    start = chunk * CHUNK
    mask_row = Mask + b * stride_maskb
    max_q = _max_sq_norm(Q + b * stride_qb + h * stride_qh, mask_row, start, start + CHUNK, N, stride_qn, stride_qd,
                         MASK_QUERIES, HEAD_DIM, BLOCK_D, BLOCK_T)
    max_k = _max_sq_norm(K + b * stride_kb + h * stride_kh, mask_row, start, start + CHUNK, M, stride_km, stride_kd,
                         HAS_MASK, HEAD_DIM, BLOCK_D, BLOCK_T)
    tl.store(PartMax + (bh * CHUNKS + chunk) * 2, max_q)
    tl.store(PartMax + (bh * CHUNKS + chunk) * 2 + 1, max_k)


@triton.jit
def _smyrf_attention_kernel(
    Q, K, V, QOrder, KOrder, Mask, Acc, AccLse, Out,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_km, stride_kd,
    stride_vb, stride_vh, stride_vm, stride_vd,
    stride_qob, stride_qoh,
    stride_kob, stride_koh,
    stride_accb, stride_acch, stride_accn, stride_accd,
    stride_lseb, stride_lseh,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_maskb,
    H, N, M, cluster_size, qk_scale,
    HAS_MASK: tl.constexpr, MASK_QUERIES: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_FIRST: tl.constexpr, IS_LAST: tl.constexpr, UPCAST: tl.constexpr,
):
    """One round of attention inside balanced clusters, merged into the running result.

    Program (i, b * H + h) owns sorted query ranks [i BLOCK_M, (i + 1) BLOCK_M). qk_scale is
    the logit scale times log2(e): the softmax runs in base 2, and AccLse holds base-2
    log-sum-exps. Acc/AccLse are read unless IS_FIRST and written unless IS_LAST; the last
    round writes Out (B, H, N, Dv) in its own dtype. Ranks past the real queries hold the
    padded ones (their hashes sort last): each round gives them lse -inf, the last output 0.
    Real counts come from the mask row (read by every program: no count pass, no host copy).
    """
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)

    # Per-batch counts and clusters, as in the reference: L = min(ceil(max(n, m) / cs), n, m) >= 1.
    mask_row = Mask + b * stride_maskb
    m_real = _real_count(mask_row, M, HAS_MASK).to(tl.int64)
    if MASK_QUERIES:  # the same mask row over the same length (N == M): counted once
        n_real = m_real
    else:
        n_real = _real_count(mask_row, N, False).to(tl.int64)
    n_clusters = tl.minimum(tl.cdiv(tl.maximum(n_real, m_real), cluster_size), tl.minimum(n_real, m_real))
    n_clusters = tl.maximum(n_clusters, 1)
    n_safe = tl.maximum(n_real, 1)
    m_safe = tl.maximum(m_real, 1)

    # Query ranks of this tile and their clusters; int64 because rank * L can pass 2^31.
    first = pid_m.to(tl.int64) * BLOCK_M
    ranks = first + tl.arange(0, BLOCK_M)
    rank_valid = ranks < n_real
    query_cluster = (ranks * n_clusters // n_safe).to(tl.int32)  # < N: compared per key in int32
    last = tl.minimum(first + BLOCK_M, n_real) - 1
    first_cluster = first * n_clusters // n_safe
    last_cluster = tl.maximum(last, 0) * n_clusters // n_safe
    # The key ranks of clusters first_cluster..last_cluster: [ceil(c m / L), ceil((c_last + 1) m / L)).
    key_start = tl.cdiv(first_cluster * m_real, n_clusters)
    key_stop = tl.cdiv((last_cluster + 1) * m_real, n_clusters)
    key_stop = tl.where(first < n_real, key_stop, key_start)

    dims = tl.arange(0, BLOCK_D)
    dims_v = tl.arange(0, BLOCK_DV)
    q_pos = tl.load(QOrder + b * stride_qob + h * stride_qoh + ranks, mask=ranks < N, other=0)
    padded_query = (ranks >= n_real) & (ranks < N)
    q_ptrs = Q + b * stride_qb + h * stride_qh + q_pos[:, None] * stride_qn + dims[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=rank_valid[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)

    k_order = KOrder + b * stride_kob + h * stride_koh
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    row_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
    for start in range(key_start.to(tl.int32), key_stop.to(tl.int32), BLOCK_N):
        key_ranks = start + tl.arange(0, BLOCK_N).to(tl.int64)
        key_valid = key_ranks < key_stop
        k_pos = tl.load(k_order + key_ranks, mask=key_valid, other=0)
        k = tl.load(k_base + k_pos[:, None] * stride_km + dims[None, :] * stride_kd,
                    mask=key_valid[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
        v = tl.load(v_base + k_pos[:, None] * stride_vm + dims_v[None, :] * stride_vd,
                    mask=key_valid[:, None] & (dims_v[None, :] < HEAD_DIM_V), other=0.0)
        key_cluster = (key_ranks * n_clusters // m_safe).to(tl.int32)
        same_cluster = (query_cluster[:, None] == key_cluster[None, :]) & key_valid[None, :]
        dots = tl.where(same_cluster, mma(q, tl.trans(k), UPCAST), float("-inf"))
        acc, row_max, row_sum = online_softmax_step(acc, row_max, row_sum, dots, v, UPCAST, qk_scale)

    # A query whose cluster has no key (all keys padded) gets 0 and lse -inf, as in the reference.
    has_mass = row_sum > 0
    out = acc / tl.where(has_mass, row_sum, 1.0)[:, None]
    lse = tl.where(has_mass, row_max + tl.math.log2(tl.where(has_mass, row_sum, 1.0)), float("-inf"))

    acc_ptrs = Acc + b * stride_accb + h * stride_acch + q_pos[:, None] * stride_accn + dims_v[None, :] * stride_accd
    lse_ptrs = AccLse + b * stride_lseb + h * stride_lseh + q_pos
    row_mask = rank_valid[:, None] & (dims_v[None, :] < HEAD_DIM_V)
    if not IS_FIRST:
        # Eq. 15: weight each side by its share of the total softmax mass.
        old_out = tl.load(acc_ptrs, mask=row_mask, other=0.0)
        old_lse = tl.load(lse_ptrs, mask=rank_valid, other=float("-inf"))
        top = tl.maximum(old_lse, lse)
        top = tl.where(top == float("-inf"), 0.0, top)
        w_old = tl.math.exp2(old_lse - top)
        w_new = tl.math.exp2(lse - top)
        total = w_old + w_new
        has_total = total > 0
        inv_total = tl.where(has_total, 1.0 / tl.where(has_total, total, 1.0), 0.0)
        out = (old_out * w_old[:, None] + out * w_new[:, None]) * inv_total[:, None]
        lse = tl.where(has_total, top + tl.math.log2(tl.where(has_total, total, 1.0)), float("-inf"))
    tl.store(lse_ptrs, tl.where(rank_valid, lse, float("-inf")), mask=rank_valid | padded_query)
    if IS_LAST:
        out_ptrs = Out + b * stride_ob + h * stride_oh + q_pos[:, None] * stride_on + dims_v[None, :] * stride_od
        out = tl.where(rank_valid[:, None], out, 0.0)
        written = (rank_valid | padded_query)[:, None] & (dims_v[None, :] < HEAD_DIM_V)
        tl.store(out_ptrs, rounded(out, Out.dtype.element_ty), mask=written)
    else:
        tl.store(acc_ptrs, out, mask=row_mask)


def smyrf_hashes_triton(
    q: Tensor, k: Tensor, key_padding_mask: Tensor | None, projections: Tensor
) -> tuple[Tensor, Tensor]:
    """Hashes of F(q) and G(k) for every round, as `smyrf.asymmetric_hashes`.

    q: (B, H, N, D), k: (B, H, M, D); key_padding_mask (B, M) bool or None, marking the
    queries too when N == M; projections (R, H, D + 2) on any device.
    Returns (R, B, H, N) and (R, B, H, M) float32; padded tokens hash to +inf.
    """
    b, h, n, d = q.shape
    m = k.shape[2]
    rounds = projections.shape[0]
    # non_blocking: a pageable host-to-device copy then needs no stream synchronisation.
    projections = projections.to(device=q.device, dtype=torch.float32, non_blocking=True)
    q_hash = torch.empty(rounds, b, h, n, dtype=torch.float32, device=q.device)
    k_hash = torch.empty(rounds, b, h, m, dtype=torch.float32, device=q.device)
    has_mask = key_padding_mask is not None
    # Triton reads bool as bytes; a dummy pointer stands in when there is no mask.
    mask = key_padding_mask.contiguous().view(torch.uint8) if has_mask else q_hash
    chunks, chunk = chunking(max(n, m), h, HASH_TILE)
    part_max = torch.empty(b * h, chunks, 2, dtype=torch.float32, device=q.device)
    common = dict(HAS_MASK=has_mask, MASK_QUERIES=has_mask and n == m, HEAD_DIM=d,
                  BLOCK_D=pow2_block(d, 16, 1024))
    _smyrf_norms_kernel[(chunks, b * h)](
        q, k, mask, part_max, *q.stride(), *k.stride(), mask.stride(0) if has_mask else 0,
        h, n, m, chunk, chunks, BLOCK_T=HASH_TILE, num_warps=NORMS_NUM_WARPS, **common,
    )
    block_t = hash_block(n, m, h, common["BLOCK_D"])
    q_tiles = ceil_div(n, block_t)
    _smyrf_hash_kernel[(q_tiles + ceil_div(m, block_t), b * h)](
        q, k, projections, mask, part_max, q_hash, k_hash,
        *q.stride(), *k.stride(), *projections.stride(),
        mask.stride(0) if has_mask else 0,
        *q_hash.stride()[:3], *k_hash.stride()[:3],
        h, n, m, rounds, chunks, q_tiles,
        BLOCK_R=pow2_block(rounds), CHUNK_BLOCK=pow2_block(chunks, 1), UPCAST=upcast(q), BLOCK_T=block_t,
        **common,
    )
    return q_hash, k_hash


def hash_block(n: int, m: int, heads: int, block_d: int) -> int:
    """Rows per tile of the hash launch for n queries and m keys a head: the largest power of two
    from HASH_TILE up to HASH_MAX_ROWS and HASH_TILE_ELEMENTS / block_d whose tiles still make
    helpers.TARGET_PROGRAMS programs over `heads` heads (the model's head count, as in chunking:
    a sequence is cut the same way whatever it is batched with). Each program pays the radius
    and the projections once, so the fewest programs that fill the GPU issue the least."""
    block = HASH_TILE
    most = min(HASH_MAX_ROWS, HASH_TILE_ELEMENTS // block_d)
    while 2 * block <= most and (ceil_div(n, 2 * block) + ceil_div(m, 2 * block)) * heads >= helpers.TARGET_PROGRAMS:
        block *= 2
    return block


def smyrf_cluster_attention_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_orders: Tensor,
    k_orders: Tensor,
    key_padding_mask: Tensor | None,
    cluster_size: int,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """Attention inside balanced clusters for every round, rounds merged by softmax mass.

    q: (B, H, N, D), k: (B, H, M, D), v: (B, H, M, Dv); q_orders (R, B, H, N) and
    k_orders (R, B, H, M): positions sorted by hash, real tokens first. Returns out
    (B, H, N, Dv) in q.dtype (padded queries 0) and its natural log-sum-exp (B, H, N) float32
    (-inf for padded queries).
    """
    out, lse2 = _smyrf_rounds(q, k, v, q_orders, k_orders, key_padding_mask, cluster_size, scale)
    return out, lse2 * math.log(2.0)


def _smyrf_rounds(
    q: Tensor, k: Tensor, v: Tensor, q_orders: Tensor, k_orders: Tensor, key_padding_mask: Tensor | None,
    cluster_size: int, scale: float,
) -> tuple[Tensor, Tensor]:
    """`smyrf_cluster_attention_triton` with the log-sum-exp left in base 2. The kernels write
    every buffer before reading it (torch.empty): a call is its launches and nothing else."""
    b, h, n, d = q.shape
    m, dv = k.shape[2], v.shape[-1]
    rounds = q_orders.shape[0]
    out = torch.empty(b, h, n, dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, h, n, dtype=torch.float32, device=q.device)
    has_mask = key_padding_mask is not None
    # Triton reads bool as bytes; a dummy pointer stands in when there is no mask.
    mask = key_padding_mask.contiguous().view(torch.uint8) if has_mask else lse
    # float32 outputs accumulate in place; half precisions keep a float32 accumulator.
    in_place = q.dtype == torch.float32 or rounds == 1
    acc = out if in_place else torch.empty(b, h, n, dv, dtype=torch.float32, device=q.device)
    # Typical cluster sizes set the tiles (any size is correct): a tile spanning clusters wastes work.
    n_clusters = smyrf_cluster_count(n, m, cluster_size)
    block_m = pow2_block(math.ceil(n / n_clusters), 16, 64)
    block_n = pow2_block(math.ceil(m / n_clusters), 16, 64)
    grid = (triton.cdiv(n, block_m), b * h)
    for r in range(rounds):
        q_order, k_order = q_orders[r], k_orders[r]
        _smyrf_attention_kernel[grid](
            q, k, v, q_order, k_order, mask, acc, lse, out,
            *q.stride(), *k.stride(), *v.stride(),
            *q_order.stride()[:2], *k_order.stride()[:2],
            *acc.stride(), *lse.stride()[:2], *out.stride(),
            mask.stride(0) if has_mask else 0,
            h, n, m, cluster_size, scale * math.log2(math.e),
            HAS_MASK=has_mask, MASK_QUERIES=has_mask and n == m, HEAD_DIM=d, HEAD_DIM_V=dv,
            BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_D=pow2_block(d, 16, 1024), BLOCK_DV=pow2_block(dv, 16, 1024),
            IS_FIRST=r == 0, IS_LAST=r == rounds - 1, UPCAST=upcast(q),
        )
    return out, lse


def hash_tokens_triton(q: Tensor, k: Tensor, key_padding_mask: Tensor | None, spec: AttentionSpec) -> tuple[Tensor, Tensor]:
    """The hash stage on the device (see `smyrf_hashes_triton`)."""
    projections = on_device(smyrf_projections, (spec.hash_rounds, q.shape[1], q.shape[-1], spec.seed), q.device)
    return smyrf_hashes_triton(q, k, key_padding_mask, projections)


def cluster_attention_triton(
    q: Tensor, k: Tensor, v: Tensor, q_orders: Tensor, k_orders: Tensor, key_padding_mask: Tensor | None,
    spec: AttentionSpec, scale: float, dtype: torch.dtype,
) -> Tensor:
    """The cluster-attention stage on the device: output (B, H, N, Dv) in q's dtype."""
    out, _ = _smyrf_rounds(q, k, v, q_orders, k_orders, key_padding_mask, spec.cluster_size, scale)
    return out.to(dtype)


# The kernels read float32, float16 and bfloat16 and accumulate in float32.
TRITON = SmyrfStages(
    name="triton", compute=lambda dtype: dtype, hash=hash_tokens_triton, sort=sort_by_hash,
    cluster_attention=cluster_attention_triton,
)
