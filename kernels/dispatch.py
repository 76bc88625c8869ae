"""The public entry point: `attention(q, k, v, spec)` checks inputs and picks an implementation."""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor

from .clustered import clustered_attention_torch
from .full import full_attention
from .smyrf import smyrf_attention_torch
from .spec import AttentionSpec, resolve_auto

BACKENDS = ("auto", "torch", "triton")


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    spec: AttentionSpec,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    backend: str = "auto",
) -> Tensor:
    """Attention by the method of `spec`.

    q: (B, H, N, D), k: (B, H, M, D), v: (B, H, M, Dv) -> (B, H, N, Dv), dtype of q.
    key_padding_mask: (B, M) bool, True = real token. Padded keys get no weight. For
        self-attention (N == M) it also marks the queries: padded queries join no cluster
        and their output rows are 0.
    scale: logit scale, default 1 / sqrt(D).
    backend: "torch" (the reference), "triton" (GPU kernels; CPU tensors only under
        TRITON_INTERPRET=1), or "auto" (triton on CUDA tensors other than float64, torch
        otherwise).
    """
    _check_inputs(q, k, v, key_padding_mask)
    if backend not in BACKENDS:
        raise ValueError(f"backend: must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask.to(device=q.device, dtype=torch.bool)
    spec = resolve_auto(spec, k.shape[2]).spec
    if spec.method == "full":
        return full_attention(q, k, v, key_padding_mask, scale)
    if _use_triton(q, backend):
        # Imported here so that the torch backend never needs triton at import time.
        if spec.method == "smyrf":
            from .smyrf_triton import smyrf_attention_triton

            return smyrf_attention_triton(q, k, v, spec, key_padding_mask, scale)
        from .clustered_triton import clustered_attention_triton

        return clustered_attention_triton(q, k, v, spec, key_padding_mask, scale)
    if spec.method == "smyrf":
        return smyrf_attention_torch(q, k, v, spec, key_padding_mask, scale)
    return clustered_attention_torch(q, k, v, spec, key_padding_mask, scale)


def _use_triton(q: Tensor, backend: str) -> bool:
    if backend == "torch":
        return False
    if backend == "auto":
        # The kernels accumulate in float32; float64 asks for the reference's precision.
        return q.is_cuda and q.dtype != torch.float64
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 in the environment "
            "to run the kernels on CPU tensors through Triton's interpreter"
        )
    return True


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name}: expected 4 dims (B, H, N, D), got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name}: expected a floating-point tensor, got {t.dtype}")
    (b, h, _, d), (bk, hk, m, dk), (bv, hv, mv, _) = q.shape, k.shape, v.shape
    if (bk, hk, dk) != (b, h, d):
        raise ValueError(f"k: shape {tuple(k.shape)} does not match q {tuple(q.shape)} in B, H or D")
    if (bv, hv, mv) != (b, h, m):
        raise ValueError(f"v: shape {tuple(v.shape)} does not match k {tuple(k.shape)} in B, H or M")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if key_padding_mask is not None and tuple(key_padding_mask.shape) != (b, m):
        raise ValueError(
            f"key_padding_mask: expected shape (B, M) = {(b, m)}, got {tuple(key_padding_mask.shape)}"
        )
