"""The native backend of banded attention (banded.py): the attend stage as the C loop
`banded_attention` of native.c (bound in kernels.native), one (batch, head) slice per call, on
float32 or bfloat16 CPU tensors (bfloat16 rows widened as they are read). The pool and select
stages are the reference's with their heavy parts in C, reading q, k and v as they are (no
float32 copies): the blocks' mean keys and values summed by `cluster_means` (a key's cluster
is its block; keys not counted are in none), and the far blocks' choice logits, the max over
each query block of its queries' dots with the mean keys, by `banded_block_max`.

Each head's keys and values are packed in panels once; a block of queries reads its band and
its chosen far blocks as runs of those panels in place, and gathers only its sinks outside the
band and the other pooled keys into one more run; positions a run covers beyond its keys are
biased to weight 0. One softmax per query over all the runs, each product in register tiles of
8 queries by two vectors (4 on AVX2). On bfloat16 with AVX512-BF16 (native.bf16_dot()) the
band's and far blocks' products run on vdpbf16ps, their weights rounded to bfloat16
(docs/native.md#banded-attention)."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from clusterserve.kernels import native
from clusterserve.kernels.reference.banded import choice_scores, pool, select
from clusterserve.kernels.spec import AttentionSpec
from clusterserve.kernels.stages import BandedStages, Pooled


def block_means(k: Tensor, v: Tensor, counted: Tensor, size: int) -> tuple[Tensor, Tensor]:
    """banded.block_means by native.cluster_means: k (B, H, N, D), v (B, H, N, Dv) float32 or
    bfloat16, counted (B, N) -> mean keys (B, H, NB, D), mean values (B, H, NB, Dv) float32."""
    b, h, n, _ = k.shape
    blocks = -(-n // size)
    block = torch.arange(n, device=k.device) // size
    # not counted: no block; laid out once for both calls (cluster_means reads it contiguous)
    assign = torch.where(counted, block, blocks)[:, None].expand(b, h, n).contiguous()
    return native.cluster_means(k, assign, blocks), native.cluster_means(v, assign, blocks)


def attend(
    q: Tensor, k: Tensor, v: Tensor, pooled: Pooled, key_mask: Tensor, spec: AttentionSpec, scale: float,
    dtype: torch.dtype,
) -> Tensor:
    """banded.attend in native.c: (B, H, N, D) float32 or bfloat16 -> (B, H, N, Dv) in dtype."""
    out = native.banded_attention(
        q, k, v, pooled.keys, pooled.values, pooled.log_count, pooled.sinks, pooled.sink_real, key_mask,
        pooled.counted, pooled.chosen, spec.block, spec.band, scale,
    )
    return out.to(dtype)


NATIVE = BandedStages(
    name="native", compute=native.compute_dtype, pool=functools.partial(pool, means=block_means), attend=attend,
    contiguous=True,
    select=functools.partial(select, scores=functools.partial(choice_scores, block_max=native.banded_block_max)),
)
