"""The encoders' fused row-wise steps in PyTorch ops: the definitions the Triton kernels of
kernels/triton/rowwise.py compute in one pass, and what every other device runs.

- `add_layer_norm_torch`: a post-norm layer's LN(x + branch), the sum rounded to x's dtype
  first (what the unfused `norm(x + branch)` normalises);
- `gated_torch`: a gated feed-forward block's act(gate) * up from one (T, 2F) product, gate
  first, the activation rounded to the input's dtype before the product (what
  `act(gate).mul_(up)` computes).
"""

from __future__ import annotations

from typing import Callable

import torch.nn.functional as F
from torch import Tensor

# HF activation names -> functions (models.config reads checkpoints' names against it). "gelu"
# is the exact erf GELU; the tanh variants agree with HF's "gelu_new" to ~1e-7.
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}
# Activations the fused gated kernel computes; the rest run as PyTorch ops on every device.
GATED_ACTIVATIONS = ("silu", "swish")


def add_layer_norm_torch(x: Tensor, branch: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
    """LayerNorm over the last dim of x + branch: (..., C) -> (..., C) in x's dtype."""
    return F.layer_norm(x + branch, (x.shape[-1],), weight, bias, eps)


def gated_torch(gate_up: Tensor, activation: Callable[[Tensor], Tensor]) -> Tensor:
    """act(gate) * up for gate_up (..., 2F) = [gate | up] -> (..., F) in its dtype; `activation`
    is the elementwise function (ACTIVATIONS)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return activation(gate) * up
