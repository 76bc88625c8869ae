"""Banded attention: exact attention on a band of neighbouring blocks, on the sink tokens and on
a few chosen far blocks, pooled blocks for everything further away, merged in one softmax so
that no key counts twice.

The sequence is cut into blocks of `block` tokens. A query in block t attends
    - exactly to every real key of blocks t - band .. t + band (the band),
    - exactly to the sinks: the first `sinks` tokens and the last real token (sinks > 0), where
      they are outside the band,
    - exactly to the real non-sink keys of `far_blocks` blocks outside the band, chosen per
      query block: those whose pooled key scores highest for some query of the block
      (max over its real queries of q . mean key * scale + log count),
    - to one pooled key per other block: the mean key and mean value of that block's real
      non-sink keys, its logit raised by log(count), so that a block of c keys that all had the
      mean's logit would get exactly its c keys' weight,
all in one softmax. A chosen block's keys replace its pooled key, so no key counts twice.
Rotary encoders (nomic-embed-text-v1.5) spread about half of each head's attention beyond
+-256 tokens, smoothly in position (docs/methods.md, "Where the
approximations break"): a pooled block stands for many small weights whose positions differ
little as seen from far away; the few far blocks a query block leans on (a repeated
passage, a heading) are found by their pooled score and attended exactly. With
band + far_blocks >= blocks - 1 every key is attended exactly: exact attention.

Cost per head: O(N (block (2 band + 1 + far_blocks) + N / block + sinks) D).

This file holds the reference backend's stages (PyTorch, the definition the native loops and
the Triton kernels are tested against), whose pool (O(N D)) and choice of far blocks (O(N
N/block D), as the pooled logits) the native backend runs with its own loops inside. The
stages' signatures, the `Pooled` they hand on and the driver, `run_banded`, are in
kernels/stages.py:

    pool    (k, v, key_mask, spec) -> Pooled: per block mean key, mean value, log count
            (float32; float64 for float64)
    select  (q, pooled, key_mask, spec, scale) -> Pooled with `chosen` filled in
    attend  (q, k, v, pooled, key_mask, spec, scale, dtype) -> (B, H, N, Dv), padded queries 0
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from clusterserve.kernels.spec import AttentionSpec
from clusterserve.kernels.stages import BandedStages, Pooled, float32_or_64

# Query blocks per step of the reference's loop: bounds its (blocks, block, keys) logits.
_BLOCKS_PER_STEP = 32


def sink_positions(key_mask: Tensor, sinks: int) -> tuple[Tensor, Tensor]:
    """(B, S) positions of each row's sinks and whether each is real and distinct: the first
    `sinks` positions, then the last real position (S = sinks + 1; none when sinks is 0)."""
    b, n = key_mask.shape
    if sinks == 0:
        return key_mask.new_zeros(b, 0, dtype=torch.int64), key_mask.new_zeros(b, 0)
    first = torch.arange(min(sinks, n), device=key_mask.device).expand(b, -1)
    pos = torch.arange(n, device=key_mask.device)
    last = torch.where(key_mask, pos, -1).max(dim=1).values  # -1 for a row of no real key
    positions = torch.cat([first, last.clamp(min=0)[:, None]], dim=1)
    real = torch.cat([key_mask[:, : first.shape[1]], (last >= first.shape[1])[:, None]], dim=1)
    return positions, real


def is_sink(key_mask: Tensor, sinks: int) -> Tensor:
    """(B, N) bool: the real sink keys."""
    positions, real = sink_positions(key_mask, sinks)
    out = torch.zeros_like(key_mask)
    return out.scatter_(1, positions, real) if positions.numel() else out


def block_means(k: Tensor, v: Tensor, counted: Tensor, size: int) -> tuple[Tensor, Tensor]:
    """Each block's mean key (B, H, NB, D) and mean value (B, H, NB, Dv) over its `counted`
    (B, N) keys, 0 where it has none, in float32 (float64 for float64). The reference's
    matrix products; native.cluster_means sums them in C."""
    b, h, n, _ = k.shape
    k, v = k.to(float32_or_64(k.dtype)), v.to(float32_or_64(v.dtype))
    blocks = -(-n // size)
    weight = F.pad(counted, (0, blocks * size - n)).to(k.dtype).view(b, 1, blocks, 1, size)
    per = weight.sum(dim=4).clamp(min=1)  # (B, 1, NB, 1)
    # Sums as products with each block's row of weights: no (B, H, N, D) temporary.
    keys = (weight @ _blocked(k, blocks, size)).squeeze(3) / per
    values = (weight @ _blocked(v, blocks, size)).squeeze(3) / per
    return keys, values


def pool(
    k: Tensor, v: Tensor, key_mask: Tensor, spec: AttentionSpec,
    means: Callable[..., tuple[Tensor, Tensor]] = block_means,
) -> Pooled:
    """The pool stage (every backend): mean key, mean value (`means`: block_means, or a
    backend's loop of it) and log count of each block's real non-sink keys, in float32 (float64
    for float64). k (B, H, N, D), v (B, H, N, Dv), key_mask (B, N)."""
    b, h, n, d = k.shape
    size = spec.block
    blocks = -(-n // size)
    counted = key_mask & ~is_sink(key_mask, spec.sinks)  # (B, N)
    keys, values = means(k, v, counted, size)
    count = F.pad(counted, (0, blocks * size - n)).view(b, blocks, size).sum(dim=2)
    log_count = count.to(float32_or_64(k.dtype)).log()  # -inf for a block with no counted key
    positions, real = sink_positions(key_mask, spec.sinks)
    chosen = key_mask.new_zeros(b, h, blocks, 0, dtype=torch.int64)
    return Pooled(keys, values, log_count, positions, real, counted, chosen)


def _blocked(x: Tensor, blocks: int, size: int) -> Tensor:
    """(B, H, N, E) -> (B, H, NB, size, E), zero-padded to whole blocks (a view when N is a
    whole number of blocks)."""
    b, h, n, e = x.shape
    tail = blocks * size - n
    return (F.pad(x, (0, 0, 0, tail)) if tail else x).view(b, h, blocks, size, e)


def far_count(spec: AttentionSpec, blocks: int) -> int:
    """How many far blocks each query block attends exactly: far_blocks, at most the blocks
    outside the narrowest band (a first or last block's)."""
    band = min(spec.band, blocks - 1)
    return max(0, min(spec.far_blocks, blocks - band - 1))


def block_max_logits(q: Tensor, keys: Tensor, key_mask: Tensor, size: int) -> Tensor:
    """(B, H, NB, NB) float32 (float64 for float64): for query block t and block c, the largest
    q . key_c over t's real queries (keys: (B, H, NB, D) the pooled keys); -inf where t has
    none. The reference's matrix products; native.banded_block_max is its C loop."""
    b, h, n, d = q.shape
    blocks = keys.shape[2]
    keys_t = keys.transpose(-1, -2)  # (B, H, D, NB)
    q_pad = _blocked(q.to(keys_t.dtype), blocks, size)
    padded = ~F.pad(key_mask, (0, blocks * size - n)).view(b, 1, blocks, size, 1)
    out = keys_t.new_empty(b, h, blocks, blocks)
    for first in range(0, blocks, _BLOCKS_PER_STEP):
        last = min(blocks, first + _BLOCKS_PER_STEP)
        # The run's queries as rows of one product with the mean keys: no broadcast copies.
        rows = q_pad[:, :, first:last].reshape(b, h, (last - first) * size, d)
        logits = (rows @ keys_t).view(b, h, last - first, size, blocks)
        out[:, :, first:last] = logits.masked_fill_(padded[:, :, first:last], float("-inf")).amax(dim=3)
    return out


def choice_scores(
    q: Tensor, pooled: Pooled, key_mask: Tensor, spec: AttentionSpec, scale: float,
    block_max: Callable[..., Tensor] = block_max_logits,
) -> Tensor:
    """(B, H, NB, NB) float32 (float64 for float64): how strongly query block t leans on block c,
    max over t's real queries of q . mean key of c * scale + log count of c (the max:
    `block_max`, block_max_logits or a backend's loop of it); -inf where c is within t's band,
    holds no counted key, or t has no real query. The Triton backend has its own kernel."""
    b, _, n, _ = q.shape
    blocks = pooled.keys.shape[2]
    has_query = F.pad(key_mask, (0, blocks * spec.block - n)).view(b, 1, blocks, spec.block, 1).any(dim=3)
    score = block_max(q, pooled.keys, key_mask, spec.block) * scale
    ids = torch.arange(blocks, device=q.device)
    near = (ids[:, None] - ids[None, :]).abs() <= min(spec.band, blocks - 1)
    score = (score + pooled.log_count.to(score.dtype)[:, None, None, :]).masked_fill(near, float("-inf"))
    return score.masked_fill(~has_query, float("-inf"))


def select(
    q: Tensor, pooled: Pooled, key_mask: Tensor, spec: AttentionSpec, scale: float,
    scores: Callable[..., Tensor] = choice_scores,
) -> Pooled:
    """The select stage (every backend): per query block, the `far_blocks` blocks outside the
    band with the highest `scores` (choice_scores, or a backend's kernel of it), among those
    with a finite score. q (B, H, N, D) -> pooled with `chosen` (B, H, NB, R) ascending, -1
    where fewer blocks qualify."""
    r = far_count(spec, pooled.keys.shape[2])
    if r == 0:
        return pooled
    top = scores(q, pooled, key_mask, spec, scale).topk(r, dim=-1)
    chosen = torch.where(torch.isfinite(top.values), top.indices, -1).sort(dim=-1).values
    return pooled._replace(chosen=chosen)


def chosen_hits(chosen: Tensor, blocks: int) -> Tensor:
    """(..., R) chosen block ids (-1 none) -> (..., NB) bool: which blocks are chosen."""
    hit = torch.zeros(*chosen.shape[:-1], blocks + 1, dtype=torch.bool, device=chosen.device)
    return hit.scatter_(-1, torch.where(chosen < 0, blocks, chosen), True)[..., :blocks]


class _AttendKeys(NamedTuple):
    """The keys and values `attend` reads, laid out once a call. k_pad, v_pad (B, H, reach + N +
    tail + reach, E), real_pad (B, same): k, v and the key mask padded by the band's reach on
    both sides and to whole blocks, so that query block t's band is the run of `span` keys from
    t * size; sink_k, sink_v (B, H, S, E) and sink_block (B, S): the sinks and their blocks;
    k_blocks, v_blocks (B, H, NB, size, E) and counted_blocks (B, 1, NB, size): k, v and the
    counted keys by block, where the chosen far blocks are gathered from."""

    size: int
    band: int
    k_pad: Tensor
    v_pad: Tensor
    real_pad: Tensor
    sink_k: Tensor
    sink_v: Tensor
    sink_block: Tensor
    k_blocks: Tensor
    v_blocks: Tensor
    counted_blocks: Tensor


def _attend_keys(k: Tensor, v: Tensor, pooled: Pooled, key_mask: Tensor, spec: AttentionSpec) -> _AttendKeys:
    b, h, n, d = k.shape
    size = spec.block
    blocks = -(-n // size)
    band = min(spec.band, blocks - 1)
    tail = blocks * size - n
    reach = band * size
    sinks = pooled.sinks[:, None, :, None]  # (B, 1, S, 1)
    return _AttendKeys(
        size=size,
        band=band,
        k_pad=F.pad(k, (0, 0, reach, reach + tail)),
        v_pad=F.pad(v, (0, 0, reach, reach + tail)),
        real_pad=F.pad(key_mask, (reach, reach + tail), value=False),
        sink_k=k.gather(2, sinks.expand(b, h, -1, d)),
        sink_v=v.gather(2, sinks.expand(b, h, -1, v.shape[-1])),
        sink_block=pooled.sinks // size,
        k_blocks=_blocked(k, blocks, size),
        v_blocks=_blocked(v, blocks, size),
        counted_blocks=F.pad(pooled.counted, (0, tail)).view(b, 1, blocks, size),
    )


def _run_logits(qb: Tensor, keys: _AttendKeys, pooled: Pooled, first: int, scale: float) -> tuple[Tensor, Tensor]:
    """The logits (B, H, c, size, L) of the c query blocks from `first` (qb: (B, H, c, size, D))
    over all they attend, L keys: the band, the sinks outside it, the chosen far blocks'
    counted keys and the other blocks' pooled keys (-inf where a key is not attended); and
    those keys' values (B, H, c, L, Dv)."""
    b, h, c, size, d = qb.shape
    dv = keys.v_pad.shape[-1]
    blocks, r = pooled.keys.shape[2], pooled.chosen.shape[-1]
    reach, span = keys.band * size, (2 * keys.band + 1) * size
    block_ids = torch.arange(blocks, device=qb.device)
    t = block_ids[first : first + c]  # (c,)
    window = slice(first * size, (first + c) * size + 2 * reach)
    k_win = keys.k_pad[:, :, window].unfold(2, span, size).transpose(-1, -2)  # (B, H, c, span, D)
    v_win = keys.v_pad[:, :, window].unfold(2, span, size).transpose(-1, -2)
    near_real = keys.real_pad[:, window].unfold(1, span, size)  # (B, c, span)
    far = (t[:, None] - block_ids[None, :]).abs() > keys.band  # (c, NB)
    sink_far = (t[None, :, None] - keys.sink_block[:, None, :]).abs() > keys.band  # (B, c, S)
    chosen = pooled.chosen[:, :, first : first + c]  # (B, H, c, R)
    picked = chosen.clamp(min=0)
    rows, heads = torch.arange(b, device=qb.device)[:, None, None, None], torch.arange(h, device=qb.device)[None, :, None, None]
    k_far = keys.k_blocks[rows, heads, picked].view(b, h, c, r * size, d)
    v_far = keys.v_blocks[rows, heads, picked].view(b, h, c, r * size, dv)
    far_real = (keys.counted_blocks[rows, 0, picked] & (chosen >= 0)[..., None]).view(b, h, c, r * size)
    pooled_ok = far[None, None] & ~chosen_hits(chosen, blocks)  # (B, H, c, NB)
    logits = torch.cat(
        [
            (qb @ k_win.transpose(-1, -2)).masked_fill(~near_real[:, None, :, None, :], float("-inf")),
            (qb @ keys.sink_k[:, :, None].transpose(-1, -2)).masked_fill(
                ~(sink_far & pooled.sink_real[:, None, :])[:, None, :, None, :], float("-inf")
            ),
            (qb @ k_far.transpose(-1, -2)).masked_fill(~far_real[:, :, :, None, :], float("-inf")),
            (qb @ pooled.keys[:, :, None].transpose(-1, -2)) + torch.where(
                pooled_ok, pooled.log_count[:, None, None, :], float("-inf")
            )[:, :, :, None, :] / scale,
        ],
        dim=-1,
    ) * scale
    values = torch.cat(
        [v_win, keys.sink_v[:, :, None].expand(-1, -1, c, -1, -1), v_far,
         pooled.values[:, :, None].expand(-1, -1, c, -1, -1)],
        dim=-2,
    )
    return logits, values


def attend(
    q: Tensor, k: Tensor, v: Tensor, pooled: Pooled, key_mask: Tensor, spec: AttentionSpec, scale: float,
    dtype: torch.dtype,
) -> Tensor:
    """The attend stage: per query block, one softmax over its band's keys, the sinks outside
    the band, the counted keys of its chosen far blocks and the pooled keys of the other
    blocks outside the band. (B, H, N, D) -> (B, H, N, Dv) in dtype, padded queries 0."""
    b, h, n, _ = q.shape
    dv = v.shape[-1]
    size = spec.block
    blocks = -(-n // size)
    keys = _attend_keys(k, v, pooled, key_mask, spec)
    q_pad = _blocked(q, blocks, size)
    out = q.new_empty(b, h, blocks, size, dv)
    step = max(1, min(_BLOCKS_PER_STEP, 16384 // max(1, pooled.chosen.shape[-1] * size)))  # bounds the gathered far keys
    for first in range(0, blocks, step):
        last = min(blocks, first + step)
        logits, values = _run_logits(q_pad[:, :, first:last], keys, pooled, first, scale)
        probs = torch.nan_to_num(torch.softmax(logits, dim=-1), nan=0.0)
        out[:, :, first:last] = probs @ values
    out = out.view(b, h, blocks * size, dv)[:, :, :n]
    return (out * key_mask[:, None, :, None]).to(dtype)


REFERENCE = BandedStages(name="reference", compute=float32_or_64, pool=pool, select=select, attend=attend)
