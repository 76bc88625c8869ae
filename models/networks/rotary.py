"""Rotary position embeddings (RoPE, Su et al. 2021, arXiv:2104.09864) for every rotary encoder.

`rotary_tables` builds the (N, D) cos / sin angles for positions 0..n-1 and `packed_rotary`
the (T, 1, D) angles of a packed batch; `kernels.apply_rotary` rotates queries or keys by them
on the backend the pass runs with (packed tokens: on a GPU in one Triton kernel, on a CPU in
one pass of the native loops; kernels/dispatch.py).
The frequency schedules checkpoints ship:

- "default": theta^(-2i/D);
- "linear": positions divided by `factor` (equivalently, frequencies);
- "dynamic": dynamic NTK; beyond `original` positions the base grows to
  theta * (factor * n / original - (factor - 1))^(D / (D - 2)), n the sequence length;
- "ntk": fixed NTK as GTE's "new" architecture applies it at every length: base theta * factor,
  and every frequency divided by factor^(2 / D).

Layouts: "half" pairs component i with i + D/2 (GPT-NeoX, HF's rotate_half); "interleaved"
pairs 2i with 2i + 1 (GPT-J, the original paper).
"""

from __future__ import annotations

import torch
from torch import Tensor

from clusterserve.models.batch.packing import Packed
from clusterserve.models.config import ROPE_TYPES


def rotary_base(n: int, head_dim: int, theta: float, rope_type: str = "default", factor: float = 1.0, original: int = 0) -> float:
    """The rotary base a sequence of n tokens runs with: `theta`, grown by dynamic NTK past
    `original` positions. For one sequence that is a plain base, which is how another engine
    (llama.cpp's rope_freq_base) is given the same scaling."""
    if rope_type == "dynamic" and n > original:
        return theta * ((factor * n / original) - (factor - 1)) ** (head_dim / (head_dim - 2))
    return theta


def inverse_frequencies(
    n: int, head_dim: int, theta: float, device: torch.device, rope_type: str = "default", factor: float = 1.0,
    original: int = 0,
) -> Tensor:
    """(D/2,) float32 angular frequency per rotated pair, for a sequence of n tokens."""
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type: must be one of {', '.join(ROPE_TYPES)}, got {rope_type!r}")
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float() / head_dim
    theta = rotary_base(n, head_dim, theta, rope_type, factor, original)
    if rope_type == "ntk":
        return 1.0 / ((theta * factor) ** exponents) / factor ** (2 / head_dim)
    inv_freq = 1.0 / (theta**exponents)
    return inv_freq / factor if rope_type == "linear" else inv_freq


def rotary_tables(
    n: int, head_dim: int, theta: float, device: torch.device, rope_type: str = "default", factor: float = 1.0,
    original: int = 0, interleaved: bool = False,
) -> tuple[Tensor, Tensor]:
    """cos, sin: (N, D) float32 for positions 0..n-1 in the layout `kernels.apply_rotary` expects."""
    inv_freq = inverse_frequencies(n, head_dim, theta, device, rope_type, factor, original)
    freqs = torch.arange(n, device=device, dtype=torch.float32)[:, None] * inv_freq  # (N, D/2)
    if interleaved:
        angles = freqs.repeat_interleave(2, dim=-1)  # (N, D): pairs (2i, 2i+1) rotate together
    else:
        angles = torch.cat((freqs, freqs), dim=-1)  # (N, D): halves rotate together
    return angles.cos(), angles.sin()


def packed_rotary(
    packed: Packed, head_dim: int, theta: float, device: torch.device, rope_type: str = "default",
    factor: float = 1.0, original: int = 0, interleaved: bool = False,
) -> tuple[Tensor, Tensor]:
    """cos, sin: (T, 1, D) for every token of a packed batch at its position in its own
    sequence, broadcasting over the heads of (T, H, D) queries and keys. Dynamic NTK's angles
    depend on the sequence's length, so each length gets its own table; every other schedule
    reads one table by position."""
    def table(n: int) -> Tensor:  # (n, 2, D): cos and sin
        return torch.stack(rotary_tables(n, head_dim, theta, device, rope_type, factor, original, interleaved), dim=1)

    if rope_type == "dynamic":
        both = packed.per_sequence(table)
    else:
        both = table(packed.longest)[packed.positions]
    return both[:, :1], both[:, 1:]
