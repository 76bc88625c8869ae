"""The native backend of banded attention (banded.py): the attend stage as the C loop
`banded_attention` of native.c (bound in kernels.native), one (batch, head) slice per call, on
float32 or bfloat16 CPU tensors (bfloat16 rows widened as they are read). The pool and select
stages are the reference's (O(N D) means in float32; the far blocks' scores, one matrix
product).

Each head's keys and values are packed in panels once; a block of queries reads its band and
its chosen far blocks as runs of those panels in place, and gathers only its sinks outside the
band and the other pooled keys into one more run; positions a run covers beyond its keys are
biased to weight 0. One softmax per query over all the runs, each product in register tiles of
8 queries by two vectors (4 on AVX2). On bfloat16 with AVX512-BF16 (native.bf16_dot()) the
band's and far blocks' products run on vdpbf16ps, their weights rounded to bfloat16
(docs/native.md#banded-attention)."""

from __future__ import annotations

import torch
from torch import Tensor

from kernels import native
from kernels.reference.banded import BandedStages, Pooled, pool
from kernels.spec import AttentionSpec


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


NATIVE = BandedStages(name="native", compute=native.compute_dtype, pool=pool, attend=attend, contiguous=True)
