"""Block sizes of the Triton kernels: a power of two (tl.arange needs one) covering a size,
the rest masked. 16 is the smallest block tl.dot takes."""

from __future__ import annotations

import triton


def pow2_block(size: int, low: int = 16, high: int | None = None) -> int:
    """The smallest power of two >= size, raised to `low` and capped at `high`."""
    block = max(low, triton.next_power_of_2(max(size, 1)))
    return block if high is None else min(high, block)
