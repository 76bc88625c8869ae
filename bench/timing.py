"""Timing for the GPU benchmark: median milliseconds by CUDA events (wall clock on CPU), the
same for a CUDA-graph replay, and how many kernels a call launches.

Each timed repeat starts from an idle device (synchronised), so a CUDA-event time is the
latency a caller sees: GPU work plus any gap while the host is still launching. Replaying a
CUDA graph removes the launch gaps; the ratio of the two says how launch-bound a method is.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def median_ms(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int) -> float:
    """Median milliseconds of fn() over `repeats` runs after `warmup` runs: CUDA events on a
    CUDA device, perf_counter otherwise."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(1, repeats)):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            start_s = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - start_s))
    return statistics.median(times)


def capture_graph(fn: Callable[[], object], device: torch.device) -> tuple[torch.cuda.CUDAGraph, object]:
    """fn captured in a CUDA graph (after two warm-up calls on a side stream, as PyTorch asks).
    Returns the graph and the output tensors its replays overwrite. Raises whatever the
    capture raises, e.g. on a host synchronisation inside fn."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@contextmanager
def counting_launches(launch: Callable[..., object] | None = None, ops: list | None = None
                      ) -> Iterator[dict[str, int]]:
    """Count, inside the block, the torch ops that launch a kernel (views and allocations left
    out: roughly one device kernel each) and the Triton kernel launches of the kernels/
    package. Yields {"torch_ops": n, "triton_launches": n}, filled in as the block runs.

    Only for a counting pass, never a timed one: it wraps each Triton kernel's `run` for
    the duration of the block (and the interpreter's own tensor copies are not counted).
    With `launch`, a launch calls launch(kernel, grid, args, kwargs) instead of the kernel:
    the offline report records the launches of a call on fake tensors that way. With `ops`,
    each counted torch op is appended as (name, bytes read, bytes written) of its tensors.
    """
    counts = {"torch_ops": 0, "triton_launches": 0}
    mode = _OpCounter(counts, ops)
    kernels = triton_kernels()
    own = [vars(kernel).get("run") for kernel in kernels]  # None: the class's method
    for kernel in kernels:
        kernel.run = _counted_run(kernel, counts, mode, launch)
    try:
        with mode:
            yield counts
    finally:
        for kernel, run in zip(kernels, own):
            if run is None:
                del kernel.run
            else:
                kernel.run = run


# Ops that allocate without a kernel (name prefixes).
ALLOCATIONS = ("empty", "new_empty")


class _OpCounter(TorchDispatchMode):
    # Ops that allocate or alias without a kernel; everything else launches (about) one.
    _NO_KERNEL = ALLOCATIONS + ("detach", "lift_fresh", "alias", "_local_scalar_dense")

    def __init__(self, counts: dict[str, int], ops: list | None = None):
        super().__init__()
        self.counts = counts
        self.ops = ops
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        out = func(*args, **(kwargs or {}))
        if not self.paused and not getattr(func, "is_view", False) and not name.startswith(self._NO_KERNEL):
            self.counts["torch_ops"] += 1
            if self.ops is not None:
                self.ops.append((name, _nbytes((args, kwargs)), _nbytes(out)))
        return out


def _nbytes(tree) -> int:
    """Bytes of the tensors in a nest of tuples, lists and dicts."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, (tuple, list)):
        return sum(_nbytes(t) for t in tree)
    if isinstance(tree, dict):
        return sum(_nbytes(t) for t in tree.values())
    return 0


def _counted_run(kernel, counts: dict[str, int], mode: _OpCounter, launch):
    run = kernel.run

    def counted(*args, grid, warmup, **kwargs):
        counts["triton_launches"] += 1
        if launch is not None:
            return launch(kernel, grid, args, kwargs)
        mode.paused = True  # the interpreter copies tensors with torch ops: not ours
        try:
            return run(*args, grid=grid, warmup=warmup, **kwargs)
        finally:
            mode.paused = False

    return counted


def triton_kernels() -> list:
    """Every Triton kernel of the kernels package: the module-level `*_kernel` functions of
    each of its modules and subpackages' modules (found by walking the package, so a new kernel
    module is counted too)."""
    import importlib
    import pkgutil

    import triton

    from clusterserve import kernels

    found: dict[int, object] = {}
    for info in pkgutil.walk_packages(kernels.__path__, f"{kernels.__name__}."):
        if info.name.rpartition(".")[2].startswith("_"):  # the native loops' shared libraries
            continue
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if name.endswith("_kernel") and isinstance(value, triton.runtime.KernelInterface):
                found.setdefault(id(value), value)
    return list(found.values())
