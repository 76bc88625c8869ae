"""Compact vectors: unit embeddings as int8, uint8, binary or ubinary numbers, the encodings
Cohere's and Jina's APIs, sentence-transformers and Infinity return.

For a vector x of d dimensions (after `dimensions` and normalisation):

    int8     q_i = clamp(round(x_i * sqrt(d) * 127 / R), -127, 127)   (so x_i ~ q_i * R / (127 sqrt(d)))
    uint8    q_i + 128, in [1, 255]
    ubinary  bit i = (x_i > 0), packed 8 to a byte, dimension 8j in the most significant bit of
             byte j; ceil(d / 8) bytes (a last partial byte is padded with zero bits)
    binary   the ubinary bytes minus 128, as int8

R is the model's range in units of a unit vector's RMS component (1 / sqrt(d)), one number per
model for every `dimensions`: the largest |x_i| * sqrt(d) that bench.quality.compact_vectors
measured on its development set (chunk vectors and queries, at each of the model's Matryoshka
sizes), rounded up to a quarter. A model it has not measured gets GENERAL_RANGE. GET /info
publishes R and these rules, so that a client can map int8 back to floats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

FORMATS = ("int8", "uint8", "binary", "ubinary")
UNIT_ENCODINGS = ("int8", "uint8")  # their steps are calibrated for unit vectors
LEVELS = 127  # int8 steps each side of zero: symmetric, so that -x encodes as -q


@dataclass(frozen=True)
class Calibration:
    """range: R (see the module docstring); measured: whether R was measured on this model."""

    range: float
    measured: bool


# The largest |x_i| * sqrt(d) on the dev set of 4k-8k-token man pages, 256-token chunks and
# their queries, at every Matryoshka size (python -m clusterserve.bench.quality.compact_vectors
# --calibrate): nomic 6.03 at 768 (4.82 at 64), MiniLM 5.27 at 256 (5.03 at 384).
MEASURED = {"nomic-embed-text-v1.5": 6.25, "all-MiniLM-L6-v2": 5.5}
GENERAL_RANGE = 8.0  # above both measured models: fewer clipped components, coarser steps


def calibration(model: str) -> Calibration:
    """The int8 calibration of the model named `model` (a checkpoint's name)."""
    if model in MEASURED:
        return Calibration(MEASURED[model], measured=True)
    return Calibration(GENERAL_RANGE, measured=False)


def int8_step(value_range: float, dim: int) -> float:
    """The float an int8 step stands for, for vectors of `dim` dimensions."""
    return value_range / (LEVELS * math.sqrt(dim))


def compact(vectors: Tensor, encoding: str, value_range: float) -> np.ndarray:
    """vectors (n, d) float, unit rows for int8 / uint8 -> (n, d) int8 / uint8, or
    (n, ceil(d / 8)) int8 / uint8 bytes for binary / ubinary (see the module docstring)."""
    if encoding not in FORMATS:
        raise ValueError(f"encoding must be one of {FORMATS}, got {encoding!r}")
    x = vectors.detach().to(torch.float32).cpu().numpy()
    if encoding in ("binary", "ubinary"):
        packed = np.packbits(x > 0, axis=-1)  # big-endian bit order: dimension 0 is bit 7 of byte 0
        return packed if encoding == "ubinary" else (packed.astype(np.int16) - 128).astype(np.int8)
    q = np.clip(np.rint(x / int8_step(value_range, x.shape[-1])), -LEVELS, LEVELS).astype(np.int8)
    return q if encoding == "int8" else (q.astype(np.int16) + 128).astype(np.uint8)


def expand(codes: np.ndarray, encoding: str, value_range: float, dim: int) -> Tensor:
    """The inverse a client applies: codes from `compact` -> (n, dim) float32, the int8 and
    uint8 values as the floats they stand for, the bits as +1 / -1."""
    if encoding in ("binary", "ubinary"):
        raw = codes.astype(np.int16) + (128 if encoding == "binary" else 0)
        bits = np.unpackbits(raw.astype(np.uint8), axis=-1)[:, :dim]
        return torch.from_numpy(bits.astype(np.float32) * 2 - 1)
    q = codes.astype(np.float32) - (128 if encoding == "uint8" else 0)
    return torch.from_numpy(q * int8_step(value_range, dim))
