"""clusterserve.kernels.triton.interpreter: under Triton's interpreter, a helper's call inside a launch skips
re-swapping triton.language's builtins, with the same results, and every launch still puts the
builtins back when it ends, also when it fails; int32 overflow wraps as before, and is still
caught where the interpreter's debug option keeps device asserts."""

import dataclasses
import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter as triton_interpreter

import clusterserve.kernels.triton  # noqa: F401  (applies the wrapper)
from clusterserve.kernels.triton import interpreter

BLOCK = 16


@triton.jit
def _square(x):
    return x * x


@triton.jit
def _sum_of_squares(x):
    return tl.sum(_square(x), axis=0)  # a helper calling a helper, a reduction inside


@triton.jit
def _kernel(x_ptr, out_ptr, n, ROUNDS: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n, other=0.0)
    total = 0.0
    for _ in range(ROUNDS):
        total += _sum_of_squares(x)
    tl.store(out_ptr + tl.program_id(0), total)


@triton.jit
def _failing_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(x_ptr + offsets, _square(tl.load(x_ptr + offsets)), mask=offsets < n)
    tl.arange(0, 3)  # raises: a range must be a power of 2


@triton.jit
def _scale_kernel(x_ptr, out_ptr, factor, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets) * factor)


def run(x: torch.Tensor, rounds: int) -> torch.Tensor:
    out = torch.empty(triton.cdiv(x.numel(), BLOCK))
    _kernel[(out.numel(),)](x, out, x.numel(), ROUNDS=rounds, BLOCK=BLOCK)
    return out


def builtins_restored() -> bool:
    return all(tl.core.is_builtin(f) for f in (tl.load, tl.arange, tl.core.tensor.__mul__, tl.core.tensor.__add__))


def test_the_wrappers_are_in_place():
    if not hasattr(triton_interpreter, "_LangPatchScope"):
        pytest.skip("this Triton's interpreter keeps its swap for good: nothing is wrapped")
    assert interpreter.skip_dropped_work()
    assert triton_interpreter._patch_lang._skips_work
    assert triton_interpreter.interpreter_semantic.binary_op_sanitize_overflow_impl._skips_work


def test_nested_helpers_give_the_reference_and_each_launch_restores_the_builtins():
    x = torch.arange(37, dtype=torch.float32) / 8
    for rounds in (1, 3):
        expected = torch.stack([x[i:i + BLOCK].square().sum() for i in range(0, 37, BLOCK)]) * rounds
        torch.testing.assert_close(run(x, rounds), expected, rtol=1e-6, atol=0)
        assert not interpreter._patched
        assert builtins_restored()


def test_a_launch_swaps_once_however_many_helper_calls_it_makes(monkeypatch):
    swaps = []
    original = triton_interpreter._patch_builtin
    monkeypatch.setattr(triton_interpreter, "_patch_builtin", lambda *args: swaps.append(1) or original(*args))
    counts = []
    for rounds in (1, 4):  # 2 helper calls a round in each of 3 programs
        swaps.clear()
        run(torch.ones(40), rounds)
        counts.append(len(swaps))
    assert counts[0] == counts[1] > 0, counts


def test_a_failed_launch_restores_the_builtins_and_the_next_one_runs():
    with pytest.raises(Exception, match="power of 2"):
        _failing_kernel[(1,)](torch.ones(4), 4, BLOCK=4)
    assert not interpreter._patched
    assert builtins_restored()
    torch.testing.assert_close(run(torch.ones(5), 2), torch.tensor([10.0]))


def test_int32_overflow_wraps_and_is_caught_only_in_debug(monkeypatch):
    x = torch.tensor([1, 3, 2**20, 2**20 + 1], dtype=torch.int32)
    out = torch.empty_like(x)
    _scale_kernel[(1,)](x, out, 2**11, BLOCK=4)
    assert out.tolist() == [2**11, 3 * 2**11, -(2**31), 2**11 - 2**31]  # 2^31 wraps, as on the GPU
    builder = triton_interpreter.interpreter_builder
    monkeypatch.setattr(builder, "options", dataclasses.replace(builder.options, debug=True))
    with pytest.raises(Exception, match="overflow"):
        _scale_kernel[(1,)](x, out, 2**11, BLOCK=4)
