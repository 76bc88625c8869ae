"""The rotary Triton kernel against kernels.reference.rotary.apply_rotary_torch (PyTorch, the
definition), on CPU through Triton's interpreter: bit for bit, in every dtype and layout."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import pytest
import torch
from kernel_inputs import packed_rotary_tables, poison_empty

from clusterserve.kernels.reference.rotary import apply_rotary_torch
from clusterserve.kernels.triton.rotary import BLOCK_T, rotary_triton

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("d", [64, 48])
def test_equals_apply_rotary_torch(dtype, interleaved, d, monkeypatch):
    poison_empty(monkeypatch)
    t, h = 2 * BLOCK_T + 5, 3  # a partial last block of tokens
    x = (torch.randn(t, h, d, generator=torch.Generator().manual_seed(d)) * 4).to(dtype)
    cos, sin = packed_rotary_tables(t, d, interleaved)
    got = rotary_triton(x, cos, sin, interleaved)
    want = apply_rotary_torch(x, cos, sin, interleaved)
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.equal(got, want)
    assert not torch.equal(got, x)


def test_strided_queries_as_a_fused_projection_gives_them():
    """q of a (T, 3, H, D) projection unbound: rows 3 H D apart (modernbert's Wqkv)."""
    t, h, d = 40, 2, 32
    qkv = torch.randn(t, 3, h, d, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    q = qkv.unbind(1)[0]
    cos, sin = packed_rotary_tables(t, d, False)
    assert not q.is_contiguous()
    assert torch.equal(rotary_triton(q, cos, sin), apply_rotary_torch(q, cos, sin))


def test_no_tokens():
    x = torch.empty(0, 2, 16)
    cos, sin = (table[:0] for table in packed_rotary_tables(1, 16, False))
    assert rotary_triton(x, cos, sin).shape == (0, 2, 16)


@pytest.mark.parametrize("table, d, message", [((9, 1, 16), 16, "cos and sin must be"), ((8, 1, 15), 15, "even")])
def test_bad_shapes_raise(table, d, message):
    with pytest.raises(ValueError, match=message):
        rotary_triton(torch.zeros(8, 2, d), torch.zeros(table), torch.zeros(table))


def test_apply_rotary_leaves_cpu_tensors_to_the_definition(monkeypatch):
    """backend="triton" runs (under the interpreter) on CPU tensors, but the rotary kernel is
    launched for CUDA tensors only: a CPU tensor takes PyTorch's ops, neither the kernel nor the
    native loop."""
    from clusterserve.kernels import apply_rotary, native
    from clusterserve.kernels.triton import rotary as rotary_module

    def refuse(*args):
        raise AssertionError("not for CPU tensors")

    monkeypatch.setattr(rotary_module, "rotary_triton", refuse)
    monkeypatch.setattr(native, "rotary", refuse)
    x = torch.randn(40, 2, 32, generator=torch.Generator().manual_seed(2))
    cos, sin = packed_rotary_tables(40, 32, False)
    assert torch.equal(apply_rotary(x, cos, sin, backend="triton"), apply_rotary_torch(x, cos, sin))
