"""The networks' linear layer: nn.Linear, which on a CPU in float32 can also keep its weight laid
out by oneDNN for products of few rows.

A short text is a product of a few rows by each weight matrix. The GEMM library that F.linear
calls on a CPU (MKL) re-packs the weight for every call, so such a product costs far more a
row than a long one; oneDNN's product with a weight reordered once at load time does not, and
its lead shrinks with the rows until MKL leads (figures: docs/backends.md, "Short texts on a
CPU"). So a layer keeps both, and a product of up to SMALL_BATCH_ROWS rows runs on the packed
copy, a longer one through F.linear. The copy costs as many bytes again as the weights it
packs. Its rows are what F.linear gives to float rounding (the two libraries add in other
orders), as MKL's own rows are for another number of rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Rows (tokens of a batch) up to which a product runs on the packed copy: where oneDNN's lead
# is clear (an input of up to 64 tokens is exact under every method's default knobs, so the
# library that runs it moves its vector by rounding only).
SMALL_BATCH_ROWS = 64
# The batch size oneDNN is told to lay the weight out for (a hint: any row count runs on it).
PACKED_FOR_ROWS = 16


def small_batches_supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether layers on `device` in `dtype` can keep a packed copy: float32 on a CPU, with
    torch's oneDNN."""
    return (
        torch.device(device).type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class Linear(nn.Linear):
    small_batch_weight: Tensor | None = None  # the packed copy, once pack_small_batches made it

    def forward(self, x: Tensor) -> Tensor:
        return self.product(x)

    def product(self, x: Tensor) -> Tensor:
        """x W^T + b: on the packed copy for up to SMALL_BATCH_ROWS rows of float32 inputs on a
        CPU outside autograd, else F.linear."""
        packed = self.small_batch_weight
        if (
            packed is not None
            and x.numel() <= SMALL_BATCH_ROWS * x.shape[-1]
            and x.dtype == torch.float32
            and x.device.type == "cpu"
            and not torch.is_grad_enabled()
        ):
            return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def pack_small_batches(model: nn.Module) -> int:
    """Give every Linear of a float32 CPU model its packed copy; returns the bytes they take."""
    size = 0
    for layer in model.modules():
        if isinstance(layer, Linear):
            weight = layer.weight.detach()
            layer.small_batch_weight = torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_FOR_ROWS)
            size += weight.numel() * weight.element_size()
    return size
