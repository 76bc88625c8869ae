"""The networks' linear layer: nn.Linear, which on a CPU can also keep its weight laid out by
oneDNN once, at load time.

F.linear on a CPU re-lays the weight out for every call: in float32 the GEMM library (MKL)
re-packs it, in bfloat16 oneDNN reorders it. A product with a weight reordered once does not,
which pays most where a call has few rows to spread that cost over: a short text. So a layer
keeps both, and a product runs on the packed copy
- in float32, up to SMALL_BATCH_ROWS rows: oneDNN's lead over MKL shrinks with the rows until
  MKL leads on some CPUs; its rows are what F.linear gives to float rounding (the libraries add
  in other orders), as MKL's own rows are for another number of rows;
- in bfloat16, at any number of rows: F.linear runs oneDNN's own kernel there, so the packed
  copy gives the same bits, without the reorder.
The copy costs as many bytes again as the weights it packs (figures: docs/backends.md, "Short
texts on a CPU").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# float32 rows (tokens of a batch) up to which a product runs on the packed copy: where
# oneDNN's lead over MKL is clear on every CPU measured (an input of up to 64 tokens is exact
# under every method's default knobs, so the library that runs it moves its vector by rounding only).
SMALL_BATCH_ROWS = 64
# The batch size oneDNN is told to lay the weight out for (a hint: any row count runs on it).
PACKED_FOR_ROWS = 16


def small_batches_supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether layers on `device` in `dtype` can keep a packed copy: on a CPU with torch's
    oneDNN, in float32, or in bfloat16 where oneDNN has bf16 kernels for the CPU (AVX-512 or
    AVX-NE-CONVERT)."""
    if not (
        torch.device(device).type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    if dtype == torch.bfloat16:
        return hasattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported") and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


def packed_rows(dtype: torch.dtype) -> int | None:
    """The most rows a product in `dtype` runs on the packed copy; None: any number."""
    return None if dtype == torch.bfloat16 else SMALL_BATCH_ROWS


class Linear(nn.Linear):
    small_batch_weight: Tensor | None = None  # the packed copy, once pack_small_batches made it

    def forward(self, x: Tensor) -> Tensor:
        return self.product(x)

    def product(self, x: Tensor) -> Tensor:
        """x W^T + b: on the packed copy for inputs of the weight's dtype on a CPU outside
        autograd, of up to packed_rows(dtype) rows, else F.linear."""
        packed, rows = self.small_batch_weight, packed_rows(self.weight.dtype)
        if (
            packed is not None
            and (rows is None or x.numel() <= rows * x.shape[-1])
            and x.dtype == self.weight.dtype
            and x.device.type == "cpu"
            and not torch.is_grad_enabled()
        ):
            return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def pack_small_batches(model: nn.Module) -> int:
    """Give every Linear of a CPU model (float32 or bfloat16: small_batches_supported) its
    packed copy; returns the bytes they take."""
    size = 0
    for layer in model.modules():
        if isinstance(layer, Linear):
            weight = layer.weight.detach()
            layer.small_batch_weight = torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_FOR_ROWS)
            size += weight.numel() * weight.element_size()
    return size
