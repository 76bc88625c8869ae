"""The row-wise Triton kernels (kernels/triton/rowwise.py) against their PyTorch definitions
(kernels/reference/rowwise.py), on CPU through Triton's interpreter, in every dtype; and the
dispatch that runs them only for CUDA rows."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import pytest
import torch
import torch.nn.functional as F
from kernel_inputs import poison_empty

from clusterserve.kernels import add_layer_norm, gated
from clusterserve.kernels.reference.rowwise import add_layer_norm_torch, gated_torch
from clusterserve.kernels.triton import rowwise
from clusterserve.kernels.triton.rowwise import BLOCK_F, BLOCK_R, add_layer_norm_triton, gated_triton

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# float32: the statistics' rounding; 16-bit: one unit in the last place of the output.
TOLERANCE = {torch.float32: dict(atol=2e-6, rtol=2e-6), torch.bfloat16: dict(atol=0.0, rtol=8e-3),
             torch.float16: dict(atol=0.0, rtol=1e-3)}


def _rows(t, c, dtype, seed, scale=3.0, shift=0.0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(t, c, generator=generator) * scale + shift).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("c, bias", [(96, True), (100, False)])  # a power-of-two block with unused columns
def test_add_layer_norm_matches_the_definition(dtype, c, bias, monkeypatch):
    poison_empty(monkeypatch)
    t = 3 * BLOCK_R + 1  # a partial last block of rows
    x, branch = _rows(t, c, dtype, 1, shift=5.0), _rows(t, c, dtype, 2)  # a mean far from 0
    weight = _rows(1, c, torch.float32, 3, 0.5, 1.0)[0].to(dtype)
    beta = _rows(1, c, torch.float32, 4, 0.5)[0].to(dtype) if bias else None
    got = add_layer_norm_triton(x, branch, weight, beta, 1e-5)
    want = add_layer_norm_torch(x, branch, weight, beta, 1e-5)
    assert got.dtype == dtype and got.shape == (t, c) and got.is_contiguous()
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])
    # The branch is added: normalising x alone is far from it.
    assert not torch.allclose(got.float(), F.layer_norm(x.float(), (c,), weight.float()).float(), atol=0.1)


def test_add_layer_norm_reads_strided_rows():
    """x a column slice of a wider tensor: rows further apart than C."""
    wide = _rows(9, 80, torch.bfloat16, 5)
    x, branch = wide[:, :48], _rows(9, 48, torch.bfloat16, 6)
    weight = torch.ones(48, dtype=torch.bfloat16)
    torch.testing.assert_close(add_layer_norm_triton(x, branch, weight, None, 1e-12),
                               add_layer_norm_torch(x, branch, weight, None, 1e-12), **TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_matches_the_definition(dtype, monkeypatch):
    poison_empty(monkeypatch)
    t, f = 5, BLOCK_F + 24  # two blocks of columns, the second partial
    gate_up = _rows(t, 2 * f, dtype, 7)
    got = gated_triton(gate_up)
    want = gated_torch(gate_up, F.silu)
    assert got.dtype == dtype and got.shape == (t, f)
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])
    # gate and up are not swapped: silu(up) * gate differs.
    gate, up = gate_up.chunk(2, dim=-1)
    assert not torch.allclose(got.float(), (F.silu(up) * gate).float(), atol=0.1)


def test_no_rows():
    assert add_layer_norm_triton(torch.empty(0, 8), torch.empty(0, 8), torch.ones(8), None, 1e-5).shape == (0, 8)
    assert gated_triton(torch.empty(0, 8)).shape == (0, 4)


@pytest.mark.parametrize("call, message", [
    (lambda: add_layer_norm_triton(torch.zeros(4, 8), torch.zeros(4, 6), torch.ones(8), None, 1e-5), "one dtype"),
    (lambda: add_layer_norm_triton(torch.zeros(8, 4).t(), torch.zeros(4, 8), torch.ones(8), None, 1e-5), "unit column"),
    (lambda: gated_triton(torch.zeros(4, 7)), "2F"),
])  # fmt: skip
def test_bad_shapes_raise(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_dispatch_leaves_cpu_rows_to_the_definition(monkeypatch):
    """backend="triton" runs under the interpreter on CPU tensors, but the row-wise kernels are
    launched for CUDA rows only: a CPU tensor takes the PyTorch definition, op for op what the
    unfused layers compute (nn.LayerNorm of the sum; the activation times up)."""
    def refuse(*args, **kwargs):
        raise AssertionError("a row-wise kernel launched for CPU tensors")

    monkeypatch.setattr(rowwise, "add_layer_norm_triton", refuse)
    monkeypatch.setattr(rowwise, "gated_triton", refuse)
    x, branch = _rows(6, 16, torch.float32, 8), _rows(6, 16, torch.float32, 9)
    norm = torch.nn.LayerNorm(16)
    for backend in ("triton", "auto", "reference"):
        assert torch.equal(add_layer_norm(x, branch, norm.weight, norm.bias, norm.eps, backend), norm(x + branch))
    gate_up = _rows(6, 32, torch.float32, 10)
    assert torch.equal(gated(gate_up, "silu", "triton"), F.silu(gate_up[:, :16]).mul_(gate_up[:, 16:]))
    assert torch.equal(gated(gate_up, "gelu"), F.gelu(gate_up[:, :16]) * gate_up[:, 16:])
