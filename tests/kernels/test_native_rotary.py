"""The native rotary loop (kernels.native.rotary) against kernels.reference.rotary.apply_rotary_torch,
the definition: bit for bit, in float32 and bfloat16, both layouts, on every x86-64 level this
CPU runs. The loop must round each product and the sum as PyTorch's separate ops do; a fused
multiply-add (which -ffast-math allows where the CPU has FMA) moves about half the elements by
an ulp, which these comparisons see."""

import pytest
import torch
from kernel_inputs import packed_rotary_tables

from clusterserve.kernels import apply_rotary, native
from clusterserve.kernels.reference.rotary import apply_rotary_torch

pytestmark = pytest.mark.skipif(native.library() is None, reason="the native loops were not built (no C compiler)")

DTYPES = [torch.float32, torch.bfloat16]


def rows(t: int, h: int, d: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """(T, H, D) values over many magnitudes, with zeros and (in float32) subnormals among them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, d, generator=g) * 10.0 ** torch.randint(-30, 30, (t, h, d), generator=g).float()
    x.view(-1)[::7] = 0.0
    if dtype == torch.float32:
        x.view(-1)[3::11] = 1e-40
    return x.to(dtype)


@pytest.mark.parametrize("level", native.runnable_levels())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_equals_apply_rotary_torch_at_every_level(level, dtype, interleaved, monkeypatch, reloaded):
    monkeypatch.setenv(native.ISA_VARIABLE, level)
    assert native.level() == level
    # one token; odd head counts and widths that are no multiple of a vector; a long input
    # that the loop splits over threads (ROTARY_SPLIT_ELEMENTS)
    for t, h, d in [(1, 1, 2), (7, 3, 6), (33, 2, 128), (300, 12, 64), (2000, 5, 48)]:
        x = rows(t, h, d, dtype, seed=t)
        cos, sin = packed_rotary_tables(t, d, interleaved)
        got = native.rotary(x, cos, sin, interleaved)
        want = apply_rotary_torch(x, cos, sin, interleaved)
        assert got is not None and got.dtype == dtype
        assert torch.equal(got, want), (level, t, h, d, (got.float() - want.float()).abs().max())


def test_apply_rotary_takes_the_loop_for_packed_cpu_rows_only(monkeypatch):
    taken = []
    loop = native.rotary
    monkeypatch.setattr(native, "rotary", lambda *args: taken.append(args[0].shape) or loop(*args))
    cos, sin = packed_rotary_tables(40, 64, False)
    x = rows(40, 4, 64, torch.bfloat16)
    assert torch.equal(apply_rotary(x, cos, sin), apply_rotary_torch(x, cos, sin))
    assert taken == [(40, 4, 64)]
    # what the loop does not take comes back None and runs PyTorch's ops: float16, an odd width,
    # a strided x, (B, H, N, D) rows with an (N, D) table
    half = torch.randn(40, 4, 64).half()
    assert native.rotary(half, cos, sin, False) is None
    assert torch.equal(apply_rotary(half, cos, sin), apply_rotary_torch(half, cos, sin))
    odd_cos, odd_sin = (torch.randn(40, 1, 5) for _ in range(2))
    assert native.rotary(rows(40, 4, 5, torch.float32), odd_cos, odd_sin, False) is None
    assert native.rotary(x.transpose(0, 1).contiguous().transpose(0, 1), cos, sin, False) is None
    batched = rows(2, 4, 40, torch.float32).view(2, 4, 40, 1).expand(2, 4, 40, 64).contiguous()
    assert native.rotary(batched, cos[:, 0], sin[:, 0], False) is None
    assert torch.equal(apply_rotary(batched, cos[:, 0], sin[:, 0]), apply_rotary_torch(batched, cos[:, 0], sin[:, 0]))


@pytest.mark.parametrize("backend, loop", [("auto", True), ("native", True), ("reference", False)])
def test_apply_rotary_runs_the_backend_it_is_given(backend, loop, monkeypatch):
    """The backend comes from kernels.backend_for, as attention's does: the reference rotates by
    PyTorch's ops even where the loop would take the tensor; the bits are the same."""
    taken = []
    original = native.rotary
    monkeypatch.setattr(native, "rotary", lambda *args: taken.append(args[0].shape) or original(*args))
    cos, sin = packed_rotary_tables(40, 64, True)
    x = rows(40, 4, 64, torch.float32)
    assert torch.equal(apply_rotary(x, cos, sin, True, backend=backend), apply_rotary_torch(x, cos, sin, True))
    assert taken == ([(40, 4, 64)] if loop else [])


def test_apply_rotary_refuses_a_backend_that_cannot_run_as_attention_does(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cos, sin = packed_rotary_tables(8, 16, False)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        apply_rotary(torch.zeros(8, 2, 16), cos, sin, backend="triton")
    with pytest.raises(ValueError, match="backend: must be one of"):
        apply_rotary(torch.zeros(8, 2, 16), cos, sin, backend="cuda")
