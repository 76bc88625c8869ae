"""Tensor-core dot products for half-precision inputs that keep float32 accuracy.

A float32 operand b (centroids, probabilities, hash planes) is split into three parts of the
half dtype, b = hi + mid / S + lo / S^2 with S = 2^8 (bfloat16) or 2^11 (float16), and
a @ b = a @ hi + (a @ mid) / S + (a @ lo) / S^2: three tensor-core dots with float32
accumulation whose products are exact (half x half fits float32), against the FMA units of
one float32 dot. The split carries 24 bits of b, so decisions made on the result (signs,
nearest centroids, top-k) agree with a float32 computation up to float32 rounding.
float32 inputs keep one float32 dot ("ieee": TF32 would round them to 10 bits).

Triton's interpreter multiplies bfloat16 bit patterns as integers in tl.dot
(triton-lang/triton#11584); UPCAST runs the same dots in float32 there (exact for half parts).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mma(a, b, UPCAST: tl.constexpr):
    """a @ b with float32 accumulation; half operands on tensor cores, float32 ones in ieee."""
    if UPCAST or a.dtype == tl.float32:
        product = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        product = tl.dot(a, b)
    return product


@triton.jit
def _parts(b, HALF: tl.constexpr):
    """float32 b as hi + mid / S + lo / S^2 in the half dtype HALF."""
    if HALF == tl.bfloat16:
        scale = 256.0
    else:
        scale = 2048.0
    hi = b.to(HALF)
    rest = (b - hi.to(tl.float32)) * scale
    mid = rest.to(HALF)
    lo = ((rest - mid.to(tl.float32)) * scale).to(HALF)
    return hi, mid, lo, scale


@triton.jit
def dot_split_right(a, b, UPCAST: tl.constexpr):
    """a @ b for a in its dtype (half or float32) and b float32, with float32 accuracy."""
    if a.dtype == tl.float32:
        product = tl.dot(a, b, input_precision="ieee")
    else:
        hi, mid, lo, scale = _parts(b, a.dtype)
        product = mma(a, hi, UPCAST) + (mma(a, mid, UPCAST) + mma(a, lo, UPCAST) / scale) / scale
    return product


@triton.jit
def dot_split_left(a, b, UPCAST: tl.constexpr):
    """a @ b for a float32 and b in its dtype (half or float32), with float32 accuracy."""
    if b.dtype == tl.float32:
        product = tl.dot(a, b, input_precision="ieee")
    else:
        hi, mid, lo, scale = _parts(a, b.dtype)
        product = mma(hi, b, UPCAST) + (mma(mid, b, UPCAST) + mma(lo, b, UPCAST) / scale) / scale
    return product

