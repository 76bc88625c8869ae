"""Row-wise layers applied a block of tokens at a time, on a CPU.

A feed-forward block widens every token to its intermediate size (4x the hidden size for
BERT): at 16k tokens that is a 100 MB activation per layer, allocated, faulted in and freed
again on every call, and GELU over it runs from memory rather than cache. On a CPU, applied to
blocks of `ROWS` tokens, the same arithmetic keeps that activation at a few MB and reuses it;
each output row is what the whole-input call gives. On a GPU the whole input is one product:
the activation is small beside device memory, and blocks would cost their launches and a
`cat` per layer (0.2 ms at 16k on an H100, bench/results/h100-2026-11-27-2.json's profiles).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

ROWS = 2048


def block_rows(device: torch.device) -> int | None:
    """Tokens a row-wise layer takes at a time on `device`: ROWS on a CPU, None (all) elsewhere."""
    return ROWS if device.type == "cpu" else None


def by_rows(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """fn(x) for a row-wise fn on x (..., C), computed block_rows(x.device) tokens at a time."""
    flat = x.reshape(-1, x.shape[-1])
    rows = block_rows(x.device)
    if rows is None or flat.shape[0] <= rows:
        return fn(x)
    return torch.cat([fn(part) for part in flat.split(rows)]).view(*x.shape[:-1], -1)
