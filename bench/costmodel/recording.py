"""One attention() call's Triton launches and PyTorch ops, recorded with no GPU: each method's
Triton pipeline runs on meta tensors (shapes and dtypes, no data) that answer is_cuda as CUDA
ones do; every Triton launch is recorded instead of run (bench.timing.counting_launches), with
its grid, arguments and block sizes, and the PyTorch ops are counted by a TorchDispatchMode
(allocations and views aside). The call is made twice and the second one counted, as a warm
call copies no constant to the device. bench.costmodel.gpu_static compiles what this records;
bench.costmodel.gpu_model prices it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from clusterserve.kernels import AttentionSpec

from ..common import SPECS
from ..timing import ALLOCATIONS, counting_launches

HEADS = 12
# The benchmark's methods, clustered with more clusters than one tile holds (its K-means takes
# the two launches an iteration, assignment and update, that up to 128 clusters fuse in one),
# and i-clustered at its defaults, without LSH codes (its seeds, then the refinement).
METHODS = {**{label: spec for label, spec in SPECS.items() if spec.method != "full"},
           "clustered 200": AttentionSpec(method="clustered", clusters=200, bits=63, iterations=10),
           "i-clustered (seeded)": AttentionSpec(method="i-clustered", clusters=100, topk=32)}


@dataclass
class Launch:
    """One recorded Triton launch: the kernel, its grid, its arguments with tensors as dtypes."""

    kernel: object
    grid: tuple
    args: tuple
    kwargs: dict
    shapes: tuple = ()  # per argument: the tensor's shape and element size, None for a scalar

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__

    @property
    def programs(self) -> int:
        return int(math.prod(self.grid))

    def constexprs(self) -> dict:
        return {k: v for k, v in self.kwargs.items() if not isinstance(v, torch.dtype)}


class _SaysCuda(torch.Tensor):
    """A meta tensor (shape and dtype, no data) that answers is_cuda like a CUDA tensor, for
    the launcher decisions that ask (the meta device runs the same ATen ops as CUDA)."""

    @property
    def is_cuda(self) -> bool:
        return True


def record_call(label: str, n: int, head_dim: int, dtype: torch.dtype) -> tuple[list[Launch], dict[str, int]]:
    """The Triton launches and op counts of one `attention()` call of method `label` (a key of
    METHODS) on (1, HEADS, n, head_dim) q, k, v of dtype on a CUDA device, without one."""
    return record_spec(METHODS[label], n, head_dim, dtype)


def record_spec(spec, n: int, head_dim: int, dtype: torch.dtype, heads: int = HEADS, ops: list | None = None
                ) -> tuple[list[Launch], dict[str, int]]:
    """`record_call` for any AttentionSpec of an approximate method, on (1, heads, n, head_dim).
    With `ops`, the call's torch ops are appended as (name, bytes read, bytes written)."""
    from clusterserve.kernels.dispatch import clustered_stages, smyrf_stages
    from clusterserve.kernels.reference.hashing import clear_device_constants
    from clusterserve.kernels.stages import run_clustered, run_smyrf

    def pipeline(*args):
        if spec.method == "smyrf":
            return run_smyrf(smyrf_stages("triton"), *args)
        if spec.method == "banded":  # a local band plus a pooled far field (kernels/reference/banded.py)
            from clusterserve.kernels.dispatch import banded_stages
            from clusterserve.kernels.stages import run_banded

            return run_banded(banded_stages("triton"), *args)
        return run_clustered(clustered_stages("triton"), *args)
    launches: list[Launch] = []

    def keep(kernel, grid, args, kwargs):
        as_dtype = [a.dtype if isinstance(a, torch.Tensor) else a for a in args]
        shapes = [(tuple(a.shape), a.element_size()) if isinstance(a, torch.Tensor) else None for a in args]
        launches.append(Launch(kernel, tuple(grid), tuple(as_dtype), dict(kwargs), tuple(shapes)))

    q, k, v = (torch.empty(1, heads, n, head_dim, dtype=dtype, device="meta").as_subclass(_SaysCuda) for _ in range(3))
    clear_device_constants()  # on_device's cache must not hand meta tensors to a later, real call
    host = _HostOps()
    try:
        with counting_launches(launch=keep):
            pipeline(q, k, v, spec, None, head_dim**-0.5)  # the warm-up copies the constants
        launches.clear()
        with counting_launches(launch=keep, ops=ops) as counts, host:
            pipeline(q, k, v, spec, None, head_dim**-0.5)
    finally:
        clear_device_constants()
    counts = dict(counts)
    counts.update(allocations=host.allocations, syncs=host.syncs)
    if ops is not None:  # each op's input shapes, for pricing it as the kernels PyTorch launches
        for i, (shapes, (name, read, written)) in enumerate(zip(host.kernel_shapes, ops)):
            ops[i] = (name, read, written, shapes)
    return launches, counts


class _HostOps(TorchDispatchMode):
    """The host's side of a call: allocations (an empty tensor, or a new result of an op that
    launches a kernel), device-to-host reads that wait for the device, and each kernel op's input
    shapes (in the order bench.timing's counter lists the ops)."""

    _VIEW_OR_ALIAS = ("detach", "lift_fresh", "alias")

    def __init__(self):
        super().__init__()
        self.allocations = self.syncs = 0
        self.kernel_shapes: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if getattr(func, "is_view", False) or name.startswith(self._VIEW_OR_ALIAS):
            return out
        if name.startswith("_local_scalar_dense"):
            self.syncs += 1
        elif name.startswith(ALLOCATIONS):  # no kernel, as bench.timing counts them
            self.allocations += 1
        else:
            self.kernel_shapes.append([tuple(a.shape) for a in args if isinstance(a, torch.Tensor)])
            if not name.endswith("_") and "out" not in (kwargs or {}):
                self.allocations += 1
        return out


