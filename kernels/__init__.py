"""Attention algorithms: exact, clustered, improved clustered (Vyas et al. 2020) and SMYRF
(Daras et al. 2020), with three backends: the PyTorch reference, native C loops for
the CPU and Triton kernels for the GPU (dispatch.py says which runs where); and the encoders'
rotary positions (`apply_rotary`) and fused row-wise steps (`add_layer_norm`, `gated`) on the
same backends.

    from clusterserve.kernels import AttentionSpec, attention
    out = attention(q, k, v, AttentionSpec(method="i-clustered"))   # (B, H, N, D) in and out
"""

from clusterserve.kernels.dispatch import BACKENDS, add_layer_norm, apply_rotary, attention, backend_for, gated
from clusterserve.kernels.spec import (
    APPROXIMATE_METHODS,
    KNOB_RANGES,
    METHOD_KNOBS,
    METHODS,
    AttentionSpec,
    FieldError,
    Resolved,
    resolve_auto,
)

__all__ = [
    "APPROXIMATE_METHODS",
    "AttentionSpec",
    "BACKENDS",
    "FieldError",
    "KNOB_RANGES",
    "METHODS",
    "METHOD_KNOBS",
    "Resolved",
    "add_layer_norm",
    "apply_rotary",
    "attention",
    "backend_for",
    "gated",
    "resolve_auto",
]
