"""The networks' linear layer: nn.Linear, which on a CPU can also keep its weight laid out by
oneDNN once, at load time.

F.linear on a CPU re-lays the weight out for every call: in float32 the GEMM library (MKL)
re-packs it, in bfloat16 oneDNN reorders it. A product with a weight reordered once does not,
which pays most where a call has few rows to spread that cost over: a short text. So a layer
keeps both, and a product runs on the packed copy
- in float32, up to its `packed_rows` rows: SMALL_BATCH_ROWS, where oneDNN's lead over MKL is
  clear on every CPU measured, or any number where oneDNN also leads on long products on this
  CPU (float32_packed_rows times both libraries once a process: MKL leads there on some CPUs,
  oneDNN on others). Its rows are what F.linear gives to float rounding (the libraries add in
  other orders), as MKL's own rows are for another number of rows;
- in bfloat16, at any number of rows: F.linear runs oneDNN's own kernel there, so the packed
  copy gives the same bits, without the reorder.
The copy costs as many bytes again as the weights it packs (figures: docs/backends.md, "Short
texts on a CPU").
"""

from __future__ import annotations

import functools
import statistics

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from clusterserve.models.timing import alternated_seconds

# float32 rows (tokens of a batch) up to which a product runs on the packed copy: where
# oneDNN's lead over MKL is clear on every CPU measured (an input of up to 64 tokens is exact
# under every method's default knobs, so the library that runs it moves its vector by rounding only).
SMALL_BATCH_ROWS = 64
# The batch size oneDNN is told to lay the weight out for (a hint: any row count runs on it).
PACKED_FOR_ROWS = 16
# Longer float32 products run on the packed copy too where oneDNN's product of MEASURED_ROWS rows
# through the model's widest layer takes at most 1 / PACKED_LEAD of MKL's (medians of
# MEASURED_REPEATS alternated calls): a lead that timing noise does not make up.
MEASURED_ROWS = 1024
MEASURED_REPEATS = 3
PACKED_LEAD = 1.1


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


class Linear(nn.Linear):
    small_batch_weight: Tensor | None = None  # the packed copy, once pack_small_batches made it
    packed_rows: int | None = None  # the most rows a product runs on it; None: any number

    def forward(self, x: Tensor) -> Tensor:
        return self.product(x)

    def product(self, x: Tensor) -> Tensor:
        """x W^T + b: on the packed copy for inputs of the weight's dtype on a CPU outside
        autograd, of up to `packed_rows` rows, else F.linear."""
        packed, rows = self.small_batch_weight, self.packed_rows
        if (
            packed is not None
            and (rows is None or x.numel() <= rows * x.shape[-1])
            and x.dtype == self.weight.dtype
            and x.device.type == "cpu"
            and not torch.is_grad_enabled()
        ):
            return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def pack_small_batches(model: nn.Module, float32_rows: int | None = SMALL_BATCH_ROWS) -> int:
    """Give every Linear of a CPU model (float32 or bfloat16: small_batches_supported) its
    packed copy, for products of up to `float32_rows` rows in float32 (None: any number) and
    of any number in bfloat16; returns the bytes they take."""
    size = 0
    for layer in model.modules():
        if isinstance(layer, Linear):
            weight = layer.weight.detach()
            layer.small_batch_weight = torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_FOR_ROWS)
            layer.packed_rows = None if weight.dtype == torch.bfloat16 else float32_rows
            size += weight.numel() * weight.element_size()
    return size


def float32_packed_rows(model: nn.Module) -> int | None:
    """The most rows a float32 product of `model` (on a CPU, small_batches_supported) should
    run on the packed copy: any number (None) where oneDNN leads MKL by PACKED_LEAD on
    MEASURED_ROWS rows through the model's widest layer, else SMALL_BATCH_ROWS. Measured once a
    process for each shape and thread count, so that one server does not change library."""
    widest = max((m for m in model.modules() if isinstance(m, Linear)), key=lambda m: m.weight.numel(), default=None)
    if widest is None:
        return SMALL_BATCH_ROWS
    lead = packed_lead(widest.in_features, widest.out_features, torch.get_num_threads())
    return None if lead >= PACKED_LEAD else SMALL_BATCH_ROWS


@functools.cache
def packed_lead(in_features: int, out_features: int, threads: int) -> float:
    """MKL's time over oneDNN's packed copy's for a float32 product of MEASURED_ROWS rows through
    a layer of this shape (random weights; medians of MEASURED_REPEATS alternated calls, after
    one of each). `threads` is part of the cache key only."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator) / in_features**0.5
    bias = torch.zeros(out_features)
    x = torch.randn(MEASURED_ROWS, in_features, generator=generator)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_FOR_ROWS)
    runs = {
        "mkl": lambda: F.linear(x, weight, bias),
        "onednn": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], ""),
    }
    with torch.inference_mode():
        times = alternated_seconds(runs, MEASURED_REPEATS)
    mkl, onednn = (statistics.median(times[name]) for name in runs)
    return mkl / onednn


def fused(*layers: nn.Linear) -> Linear:
    """One Linear computing the layers' products side by side, [x W_1^T + b_1 | x W_2^T + b_2 | ...],
    for layers of one input size: a GPU's one product where it ran several. The caller drops
    the layers, so that no weight is held twice."""
    first = layers[0]
    bias = first.bias is not None
    if any(layer.in_features != first.in_features or (layer.bias is not None) != bias for layer in layers):
        raise ValueError("fused: layers need one input size and all or none with a bias")
    one = Linear(first.in_features, sum(layer.out_features for layer in layers), bias=bias, device="meta")
    one.weight = nn.Parameter(torch.cat([layer.weight.detach() for layer in layers]), requires_grad=False)
    if bias:
        one.bias = nn.Parameter(torch.cat([layer.bias.detach() for layer in layers]), requires_grad=False)
    return one
