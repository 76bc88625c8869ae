"""The public entry point: `attention(q, k, v, spec)` checks its inputs, picks the backend with
`backend_for` (the one place that choice is made) and runs the method's stages on it.

    backend     runs (kernels/<backend>/)            where
    reference   clustered.py, smyrf.py, banded.py    any device, any float dtype; computes in float32
                                                     (float64 for float64 inputs)
    native      clustered.py, smyrf.py, banded.py    CPU; reads float32 and bfloat16 q, k, v as they are
                (C loops of native.c)                (float16 converted to float32), accumulates in float32
    triton      clustered.py, smyrf.py, banded.py    CUDA (CPU only under TRITON_INTERPRET=1); reads
                                                     float32, float16, bfloat16, accumulates in float32
    auto        triton on CUDA, native on a CPU where it is built (bfloat16 included), the reference
                otherwise; float64 always runs the reference (the kernels and loops accumulate in float32)

Every backend returns the output in q's dtype.

`apply_rotary(x, cos, sin, interleaved, backend)`, the encoders' rotary positions, takes its
backend from the same `backend_for`; each backend rotates only the tensors its kernel takes and
leaves the rest to the PyTorch definition (kernels/reference/rotary.py), which every kernel
gives bit for bit:

    backend     rotates                                              by
    triton      packed (T, H, D) CUDA tensors                        kernels/triton/rotary.py
    native      packed (T, H, D) contiguous CPU float32 / bfloat16   kernels.native.rotary (C)
                rows of even D, where the loops are built
    reference   everything, and what the two above do not take       apply_rotary_torch

`add_layer_norm` (a post-norm layer's LN(x + branch)) and `gated` (a gated feed-forward block's
act(gate) * up from one [gate | up] product) likewise: on the triton backend, (T, C) CUDA tensors
with unit column stride run one kernel each (kernels/triton/rowwise.py; the gated one for SiLU);
everything else runs the PyTorch definitions (kernels/reference/rowwise.py), which a CPU's
unfused layers computed before them, op for op.
"""

from __future__ import annotations

import importlib
import math
import os
from typing import Any, Callable

import torch
from torch import Tensor

from clusterserve.kernels import native
from clusterserve.kernels.reference.full import full_attention
from clusterserve.kernels.reference.rotary import apply_rotary_torch
from clusterserve.kernels.reference.rowwise import ACTIVATIONS, GATED_ACTIVATIONS, add_layer_norm_torch, gated_torch
from clusterserve.kernels.spec import AttentionSpec, resolve_auto
from clusterserve.kernels.stages import (
    BandedStages,
    ClusteredStages,
    Observe,
    SmyrfStages,
    call,
    run_banded,
    run_clustered,
    run_smyrf,
)

BACKENDS = ("auto", "reference", "native", "triton")
# What the triton and native backends take; other dtypes (float64) need the reference.
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def backend_for(device: torch.device | str, dtype: torch.dtype, requested: str = "auto") -> str:
    """The backend that runs for tensors of this device and dtype: "reference", "native" or
    "triton". `requested` "auto" chooses (see the module docstring); a named backend is
    returned if it can run, else ValueError says why and what to use instead."""
    if requested not in BACKENDS:
        raise ValueError(f"backend: must be one of {', '.join(BACKENDS)}, got {requested!r}")
    kind = torch.device(device).type
    if requested == "auto":
        if dtype not in TRITON_DTYPES:
            return "reference"
        if kind == "cuda":
            return "triton"
        return "native" if kind == "cpu" and native.available() else "reference"
    if requested == "native":
        if kind != "cpu":
            raise ValueError(f"backend='native' runs on CPU tensors, got {kind}; use 'triton' or 'auto'")
        if dtype not in TRITON_DTYPES:
            raise ValueError(
                f"backend='native' takes float32, bfloat16 or float16 and accumulates in float32, got {dtype}; "
                "use backend='reference'"
            )
        if not native.available():
            raise ValueError(
                "backend='native': the native CPU loops were not built (no C compiler when the package "
                "was installed); reinstall with a compiler, or use backend='reference'"
            )
    if requested == "triton":
        if dtype not in TRITON_DTYPES:
            raise ValueError(f"backend='triton' takes float32, float16 or bfloat16, got {dtype}; use backend='reference'")
        if kind != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 in the environment "
                "to run the kernels on CPU tensors through Triton's interpreter"
            )
    return requested


# Each backend's stage tables: clusterserve.kernels.<backend>.<method>.<BACKEND>, imported on demand, so
# triton stays optional.
def _stages(backend: str, method: str) -> Any:
    return getattr(importlib.import_module(f"{__package__}.{backend}.{method}"), backend.upper())


def clustered_stages(backend: str) -> ClusteredStages:
    """The clustered pipeline of a concrete backend."""
    return _stages(backend, "clustered")


def smyrf_stages(backend: str) -> SmyrfStages:
    """The SMYRF pipeline of a concrete backend."""
    return _stages(backend, "smyrf")


def banded_stages(backend: str) -> BandedStages:
    """The banded pipeline of a concrete backend."""
    return _stages(backend, "banded")


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    spec: AttentionSpec,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    backend: str = "auto",
    check: Callable[[], None] | None = None,
) -> Tensor:
    """Attention by the method of `spec`.

    q: (B, H, N, D), k: (B, H, M, D), v: (B, H, M, Dv) -> (B, H, N, Dv), dtype of q.
    key_padding_mask: (B, M) bool, True = real token. Padded keys get no weight. For
        self-attention (N == M) it also marks the queries: padded queries join no cluster
        and their output rows are 0.
    scale: logit scale, default 1 / sqrt(D).
    backend: "auto" | "reference" | "native" | "triton" (see `backend_for`).
    spec "auto" is resolved per batch row by that row's real key count (the length threshold;
    calibration tables are the caller's: see `resolve_auto`).
    check: None, or called before each of the method's stages (and each block of queries of
        exact attention); whatever it raises stops the call (a caller's way to abandon work
        whose request is gone).
    """
    _check_inputs(q, k, v, key_padding_mask)
    chosen = backend_for(q.device, q.dtype, backend)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask.to(device=q.device, dtype=torch.bool)
    if spec.method == "auto":
        return _auto_by_rows(q, k, v, spec, key_padding_mask, scale, chosen, check)
    if spec.method == "full":
        return full_attention(q, k, v, key_padding_mask, scale, check)
    observe = call if check is None else checking(check)
    if spec.method == "banded":
        return run_banded(banded_stages(chosen), q, k, v, spec, key_padding_mask, scale, observe)
    if spec.method == "smyrf":
        return run_smyrf(smyrf_stages(chosen), q, k, v, spec, key_padding_mask, scale, observe)
    return run_clustered(clustered_stages(chosen), q, k, v, spec, key_padding_mask, scale, observe)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False, backend: str = "auto") -> Tensor:
    """Rotate x: (..., N, D) by the angles of its N positions (RoPE), cos and sin float32
    broadcasting to x's shape: (N, D) for (B, H, N, D), or (T, 1, D) for packed (T, H, D)
    (models.networks.rotary builds them). Pairs are (i, i + D/2), or (2i, 2i + 1) when
    `interleaved`. Computed in float32, returned in x's dtype, bit for bit `apply_rotary_torch`
    whichever backend runs.

    backend: "auto" | "reference" | "native" | "triton", chosen by `backend_for` from x's device
    and dtype as for `attention` (a named backend that cannot run there raises its ValueError).
    Triton then rotates packed 3-D CUDA tensors in one launch, the native loop packed contiguous
    CPU rows in float32 or bfloat16 of even D in one pass; a tensor the chosen backend does not
    take (a (B, H, N, D) one, float16 or strided rows on native, a CPU tensor under Triton's
    interpreter) and every tensor on the reference run `apply_rotary_torch`."""
    chosen = backend_for(x.device, x.dtype, backend)
    if chosen == "triton" and x.is_cuda and x.dim() == 3 and cos.dim() == 3:
        from clusterserve.kernels.triton.rotary import rotary_triton

        return rotary_triton(x, cos, sin, interleaved)
    if chosen == "native":
        rotated = native.rotary(x, cos, sin, interleaved)
        if rotated is not None:
            return rotated
    return apply_rotary_torch(x, cos, sin, interleaved)


def _rowwise_kernel(x: Tensor, backend: str) -> bool:
    """Whether x runs a kernels/triton/rowwise.py kernel: 2-D CUDA rows of unit column stride on the triton backend."""
    return backend_for(x.device, x.dtype, backend) == "triton" and x.is_cuda and x.dim() == 2 and x.stride(1) == 1


def add_layer_norm(
    x: Tensor, branch: Tensor, weight: Tensor, bias: Tensor | None, eps: float, backend: str = "auto"
) -> Tensor:
    """LayerNorm over the last dim of x + branch, (..., C) -> (..., C) in x's dtype: one Triton
    kernel for (T, C) CUDA rows on the triton backend, else `add_layer_norm_torch`."""
    if _rowwise_kernel(x, backend) and branch.shape == x.shape and branch.dtype == x.dtype and branch.stride(1) == 1:
        from clusterserve.kernels.triton.rowwise import add_layer_norm_triton

        return add_layer_norm_triton(x, branch, weight, bias, eps)
    return add_layer_norm_torch(x, branch, weight, bias, eps)


def gated(gate_up: Tensor, activation: str, backend: str = "auto") -> Tensor:
    """act(gate) * up for gate_up (..., 2F) = [gate | up] -> (..., F) in its dtype; `activation`
    a name of ACTIVATIONS. One Triton kernel for SiLU on (T, 2F) CUDA rows on the triton
    backend, else `gated_torch`."""
    if activation in GATED_ACTIVATIONS and _rowwise_kernel(gate_up, backend):
        from clusterserve.kernels.triton.rowwise import gated_triton

        return gated_triton(gate_up)
    return gated_torch(gate_up, ACTIVATIONS[activation])


def checking(check: Callable[[], None]) -> Observe:
    """An `observe` hook (kernels.stages) that calls `check` before each stage."""

    def observe(name: str, stage: Callable[..., Any], *args: Any) -> Any:
        check()
        return stage(*args)

    return observe


def _auto_by_rows(
    q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec, key_padding_mask: Tensor | None, scale: float, backend: str,
    check: Callable[[], None] | None,
) -> Tensor:
    """"auto" decided per batch row by that row's own real keys (`resolve_auto` with no table), so
    that a row's output never depends on how long the rows padded beside it are; rows that
    resolve alike run together."""
    b, m = k.shape[0], k.shape[2]
    real_keys = [m] * b if key_padding_mask is None else key_padding_mask.sum(dim=1).tolist()
    rows_by_spec: dict[AttentionSpec, list[int]] = {}
    for row, keys in enumerate(real_keys):
        rows_by_spec.setdefault(resolve_auto(spec, int(keys)).spec, []).append(row)
    if len(rows_by_spec) == 1:
        return attention(q, k, v, next(iter(rows_by_spec)), key_padding_mask, scale, backend, check)
    out = q.new_empty(*q.shape[:3], v.shape[-1])
    for concrete, rows in rows_by_spec.items():
        index = torch.tensor(rows, device=q.device)
        mask = None if key_padding_mask is None else key_padding_mask[index]
        out[index] = attention(q[index], k[index], v[index], concrete, mask, scale, backend, check)
    return out


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
