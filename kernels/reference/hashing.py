"""Locality-sensitive hashing of queries: signs of random projections packed into int64 codes.

Clustered attention (Vyas et al. 2020, sec. 3.2.2) hashes every query with `bits` random
hyperplanes (with a bias term) and clusters the codes by K-means in Hamming space.
All randomness comes from a CPU `torch.Generator` seeded by the spec, so the planes are the
same on every device and for every batch the request lands in.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Callable, Iterator

import torch
from torch import Tensor


def seeded_generator(seed: int, stream: int) -> torch.Generator:
    """A CPU generator for one purpose (`stream`) of one seed; streams never share draws."""
    return torch.Generator().manual_seed((seed * 1_000_003 + stream) % (2**63))


# The list that `holding_device_constants` collects into, while its block runs.
_HOLDER: contextvars.ContextVar[list[Tensor] | None] = contextvars.ContextVar("device_constants", default=None)


def on_device(make: Callable[..., Tensor], args: tuple, device: torch.device) -> Tensor:
    """`make(*args)`, a seeded CPU tensor, copied to `device` once and kept (the last 128
    kept). The GPU paths use it so that a call neither waits on a host-to-device copy nor
    breaks CUDA-graph capture. A captured graph reads the tensor by address after the cache
    may have let it go: capture inside `holding_device_constants` and keep what it collects."""
    tensor = _device_constant(make, args, device)
    holder = _HOLDER.get()
    if holder is not None:
        holder.append(tensor)
    return tensor


@functools.lru_cache(maxsize=128)
def _device_constant(make: Callable[..., Tensor], args: tuple, device: torch.device) -> Tensor:
    return make(*args).to(device)


def clear_device_constants() -> None:
    """Forget every tensor `on_device` kept (a graph that holds one keeps it alive)."""
    _device_constant.cache_clear()


@contextlib.contextmanager
def holding_device_constants() -> Iterator[list[Tensor]]:
    """Within the block, every tensor `on_device` hands out is also appended to the yielded
    list, so that whoever captures a CUDA graph there can keep the constants it reads alive."""
    held: list[Tensor] = []
    token = _HOLDER.set(held)
    try:
        yield held
    finally:
        _HOLDER.reset(token)


def hash_planes(heads: int, dim: int, bits: int, seed: int) -> Tensor:
    """Random hyperplanes (H, D + 1, bits), float32 on CPU; row D is the bias term."""
    return torch.randn(heads, dim + 1, bits, generator=seeded_generator(seed, 0))


def hash_signs(x: Tensor, planes: Tensor) -> Tensor:
    """Signs of the projections of x on the planes, as +-1.

    x: (B, H, N, D), planes: (H, D + 1, bits) -> (B, H, N, bits) float32; +1 where the
    projection (with its bias) is positive. The K-means works on these directly: the dot
    product of two sign vectors is bits - 2 * (their Hamming distance).
    """
    planes = planes.to(device=x.device, dtype=torch.float32)
    projections = x.float() @ planes[:, :-1] + planes[:, -1:, :]
    return torch.where(projections > 0, 1.0, -1.0)


def pack_codes(signs: Tensor) -> Tensor:
    """(..., bits) +-1 signs -> (...) int64 codes, bit b set where sign b is +1."""
    bits = signs.shape[-1]
    weights = torch.ones((), dtype=torch.int64, device=signs.device) << torch.arange(bits, device=signs.device)
    return ((signs > 0).long() * weights).sum(-1)


def hash_codes(x: Tensor, planes: Tensor) -> Tensor:
    """Integer LSH codes of x: (B, H, N, D) -> (B, H, N) int64 (see `hash_signs`)."""
    return pack_codes(hash_signs(x, planes))


def unpack_bits(codes: Tensor, bits: int) -> Tensor:
    """codes (...) int64 -> (..., bits) float32 of 0/1, bit b of each code at index b."""
    shifts = torch.arange(bits, device=codes.device)
    return ((codes[..., None] >> shifts) & 1).float()
