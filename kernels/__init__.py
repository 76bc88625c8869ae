"""Attention algorithms: exact, clustered, improved clustered (Vyas et al. 2020) and SMYRF
(Daras et al. 2020), as a PyTorch reference and as Triton kernels.

    from kernels import AttentionSpec, attention
    out = attention(q, k, v, AttentionSpec(method="i-clustered"))   # (B, H, N, D) in and out
"""

from .dispatch import BACKENDS, attention
from .spec import APPROXIMATE_METHODS, KNOB_RANGES, METHOD_KNOBS, METHODS, AttentionSpec, Resolved, resolve_auto

__all__ = [
    "APPROXIMATE_METHODS",
    "AttentionSpec",
    "BACKENDS",
    "KNOB_RANGES",
    "METHODS",
    "METHOD_KNOBS",
    "Resolved",
    "attention",
    "resolve_auto",
]
