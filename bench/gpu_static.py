"""Offline GPU report: what the Triton kernels become on an H100 (sm_90) or A100 (sm_80),
and what one attention call launches, with no GPU. The recording and compiling here are what
bench.gpu_model (the offline cost model: estimated time per launch and per call) reads.

    python -m clusterserve.bench.gpu_static [--arch 90 80] [--lengths 4096 16384 65536] [--head-dims 32 64 128]
                               [--dtypes bfloat16] [--strict] [--out bench/results/gpu_static.json]

How it works:
- Launches. Each method's Triton pipeline (clustered_attention_triton, smyrf_attention_triton)
  runs on meta tensors (shapes and dtypes, no data) that answer is_cuda as CUDA ones do, for
  one call: B = 1, 12 heads, N tokens, head dim d. Every Triton launch is recorded
  instead of run (bench.timing.counting_launches), with its grid, arguments and block sizes,
  so the block sizes are the launchers' own. PyTorch ops are counted by a TorchDispatchMode
  on the same call (allocations and views aside): the ops a CUDA call would run. The call is
  made twice and the second one counted, as a warm call copies no constant to the device.
- Compiling. A stand-in Triton driver reports the target (GPUTarget("cuda", arch, 32)), and
  each recorded launch is compiled with `kernel.warmup(...)`: Triton's own pipeline down to
  a cubin through the wheel's ptxas. Registers and spills are ptxas's `-v` report on the PTX
  (Triton's flags); shared memory is Triton's; a dot runs on tensor cores when the TTGIR
  gives it an MMA layout (mma.sync, or warp_group_dot = wgmma); atomics are the PTX's
  atom/red instructions with their semantics and scope.

Budgets checked (a violation is flagged; --strict exits 1 on any):
- no register spills at head dim <= 64 in bfloat16;
- every dot of a bfloat16 / float16 call on tensor cores;
- no acq_rel atomics.
A launch count is reported, not budgeted: it says nothing about time. Time is bench.gpu_model's
(its budgets: every launch fills the GPU or is negligible, and speed-ups over exact attention).
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from clusterserve.kernels import AttentionSpec

from .common import RESULTS_DIR, print_table
from .cpu import SPECS
from .timing import ALLOCATIONS

HEADS = 12
# The benchmark's methods, clustered with more clusters than one tile holds (its K-means takes
# the two launches an iteration, assignment and update, that up to 128 clusters fuse in one),
# and i-clustered at its defaults, without LSH codes (its seeds, then the refinement).
METHODS = {**{label: spec for label, spec in SPECS.items() if spec.method != "full"},
           "clustered 200": AttentionSpec(method="clustered", clusters=200, bits=63, iterations=10),
           "i-clustered (seeded)": AttentionSpec(method="i-clustered", clusters=100, topk=32)}
SPILL_FREE_HEAD_DIM = 64  # no spills at head dims up to this, in bfloat16
HALF_DTYPES = ("bfloat16", "float16")


# ---- recording one call's launches -----------------------------------------------------------


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

    from .timing import counting_launches

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


# ---- compiling for a target without a GPU ----------------------------------------------------


def _stand_in_driver(capability: int):
    """A Triton driver that reports an NVIDIA target and nothing else: enough to compile."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    class StandInDriver(DriverBase):
        @classmethod
        def is_active(cls):
            return False

        def map_python_to_cpp_type(self, ty):
            raise NotImplementedError

        def get_current_target(self):
            return GPUTarget("cuda", capability, 32)

        def get_current_device(self):
            return f"sm_{capability}"  # keys Triton's per-device caches: one per target

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_benchmarker(self):
            raise NotImplementedError

    return StandInDriver()


@contextmanager
def targeting(capability: int):
    from triton.runtime.driver import driver

    # Triton >= 3.5 keeps the active driver in `_active` (None until a real driver is looked up,
    # none on a CPU machine); earlier versions in `active` (a lazy proxy until then).
    attribute = "_active" if hasattr(driver, "_active") else "active"
    before = getattr(driver, attribute)
    driver.set_active(_stand_in_driver(capability))
    try:
        yield
    finally:
        setattr(driver, attribute, before)


@dataclass
class Compiled:
    kernel: str
    arch: int
    head_dim: int
    dtype: str
    constexprs: dict
    compiled: bool
    error: str | None = None
    registers: int | None = None
    spill_bytes: int | None = None  # spill stores + spill loads, as ptxas reports them
    stack_bytes: int | None = None
    shared_bytes: int | None = None
    num_warps: int | None = None
    dots: list = field(default_factory=list)  # [{"operands": "f32", "tensor_cores": bool, "op": ...}]
    atomics: dict = field(default_factory=dict)  # PTX instruction -> static count
    ptx_mma: int = 0  # mma / wgmma instructions in the PTX


def compile_kernel(launch: Launch, capability: int):
    """Triton's compiled kernel (asm: ttgir, ptx, cubin; metadata) for one recorded launch on
    sm_<capability>; Triton's cache makes a repeat cheap."""
    with targeting(capability):
        return launch.kernel.warmup(*launch.args, grid=launch.grid, **launch.kwargs)


def compile_launch(launch: Launch, capability: int, head_dim: int, dtype: str) -> Compiled:
    """Compile one recorded launch for sm_<capability> and read what it became."""
    result = Compiled(launch.name, capability, head_dim, dtype, _jsonable(launch.constexprs()), compiled=False)
    try:
        kernel = compile_kernel(launch, capability)
    except Exception as error:  # noqa: BLE001 - a compile error is the finding
        result.error = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}"
        return result
    result.compiled = True
    result.shared_bytes = int(kernel.metadata.shared)
    result.num_warps = int(kernel.metadata.num_warps)
    result.registers, result.spill_bytes, result.stack_bytes = ptxas_usage(kernel.asm["ptx"], capability)
    result.dots = _dots(kernel.asm["ttgir"])
    ptx = kernel.asm["ptx"]
    result.ptx_mma = len(re.findall(r"^\s*(?:@!?%p\d+\s+)?(?:mma\.sync|wgmma\.mma_async)", ptx, re.M))
    for op in re.findall(r"^\s*(?:@!?%p\d+\s+)?((?:atom|red)\.[\w.]+)", ptx, re.M):
        result.atomics[op] = result.atomics.get(op, 0) + 1
    return result


@functools.cache
def _ptxas(capability: int) -> tuple[str, tuple[str, ...]]:
    """The ptxas this Triton compiles sm_<capability> with, and its register-allocation flag if
    it passes one: Triton >= 3.6 picks ptxas by target (3.4 and 3.5 have one), and 3.9 passes
    --regAllocOptLevel=2 (3.4-3.6 do not)."""
    from triton.backends.nvidia.compiler import CUDABackend, get_ptxas

    ptxas = get_ptxas(capability) if inspect.signature(get_ptxas).parameters else get_ptxas()
    passes = "regAllocOptLevel" in inspect.getsource(CUDABackend.make_cubin)
    return ptxas.path, ("--regAllocOptLevel=2",) if passes else ()


def ptxas_usage(ptx: str, capability: int) -> tuple[int, int, int]:
    """Registers, spill bytes (stores + loads) and stack frame bytes from `ptxas -v` with the
    flags Triton compiles with."""
    from triton.backends.nvidia.compiler import sm_arch_from_capability

    ptxas, flags = _ptxas(capability)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        command = [ptxas, "-lineinfo", "-v", *flags,
                   f"--gpu-name={sm_arch_from_capability(capability)}", str(src), "-o", str(src.with_suffix(".o"))]
        log = subprocess.run(command, capture_output=True, text=True, check=True).stderr
    registers = max((int(r) for r in re.findall(r"Used (\d+) registers", log)), default=0)
    spills = sum(int(b) for b in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    stack = max((int(b) for b in re.findall(r"(\d+) bytes stack frame", log)), default=0)
    return registers, spills, stack


def _dots(ttgir: str) -> list[dict]:
    """Each dot of the TTGIR: its operands' element type and whether it has an MMA layout."""
    found = []
    for line in ttgir.splitlines():
        match = re.search(r"= (tt\.dot|ttng\.warp_group_dot) ", line)
        if not match:
            continue
        types = re.findall(r"(?:tensor|memdesc)<[\dx]+x(\w+?)[,>]", line.split(" : ", 1)[-1])
        result_type = line.rsplit("->", 1)[-1]
        on_mma = match.group(1) == "ttng.warp_group_dot" or "#mma" in result_type
        found.append(dict(op=match.group(1), operands=types[0] if types else "?", tensor_cores=on_mma))
    return found


def _jsonable(values: dict) -> dict:
    return {k: v if isinstance(v, (int, float, str, bool)) or v is None else str(v) for k, v in values.items()}


# ---- the report ------------------------------------------------------------------------------


@dataclass
class Call:
    method: str
    seq_len: int
    head_dim: int
    dtype: str
    triton_launches: int
    torch_ops: int
    launches_by_kernel: dict

    @property
    def kernels(self) -> int:
        return self.triton_launches + self.torch_ops


def build_report(archs: list[int], lengths: list[int], head_dims: list[int], dtypes: list[str],
                 methods: list[str]) -> dict:
    calls: list[Call] = []
    compiled: dict[tuple, Compiled] = {}
    uses: dict[tuple, set] = {}  # compiled key -> {(method, seq_len)}
    for dtype in dtypes:
        for head_dim in head_dims:
            for n in lengths:
                for label in methods:
                    launches, counts = record_call(label, n, head_dim, getattr(torch, dtype))
                    by_kernel: dict[str, int] = {}
                    for launch in launches:
                        by_kernel[launch.name] = by_kernel.get(launch.name, 0) + 1
                    calls.append(Call(label, n, head_dim, dtype, counts["triton_launches"], counts["torch_ops"],
                                      by_kernel))
                    for launch in launches:
                        for arch in archs:
                            key = (launch.name, arch, head_dim, dtype, specialisation(launch))
                            if key not in compiled:
                                compiled[key] = compile_launch(launch, arch, head_dim, dtype)
                            uses.setdefault(key, set()).add((label, n))
    kernels = []
    for key, result in compiled.items():
        row = asdict(result)
        row["used_by"] = sorted(f"{label} @ {n}" for label, n in uses[key])
        kernels.append(row)
    report = dict(archs=archs, lengths=lengths, head_dims=head_dims, dtypes=dtypes, heads=HEADS,
                  calls=[dict(asdict(c), kernels=c.kernels) for c in calls], kernels=kernels)
    report["violations"] = violations(report)
    return report


def specialisation(launch: Launch) -> str:
    """What Triton specialises a kernel on, near enough: argument types, constexprs, and which
    integers are 1 or divisible by 16."""
    def arg(a):
        if isinstance(a, torch.dtype):
            return str(a)
        if isinstance(a, bool) or not isinstance(a, int):
            return repr(a) if isinstance(a, bool) else type(a).__name__
        return "1" if a == 1 else ("d16" if a % 16 == 0 else "i")

    return repr(([arg(a) for a in launch.args], sorted(_jsonable(launch.kwargs).items())))


def violations(report: dict) -> list[dict]:
    """Every budget each compiled kernel breaks, one entry each."""
    found = []
    for k in report["kernels"]:
        where = dict(kernel=k["kernel"], arch=k["arch"], head_dim=k["head_dim"], dtype=k["dtype"])
        if not k["compiled"]:
            found.append(dict(budget="compiles", **where, detail=k["error"]))
            continue
        if k["dtype"] == "bfloat16" and k["head_dim"] <= SPILL_FREE_HEAD_DIM and k["spill_bytes"]:
            found.append(dict(budget="no spills", **where, detail=f"{k['spill_bytes']} bytes spilled"))
        if k["dtype"] in HALF_DTYPES:
            off = [d for d in k["dots"] if not d["tensor_cores"]]
            if off:
                found.append(dict(budget="tensor cores", **where,
                                  detail=f"{len(off)} of {len(k['dots'])} dots on FMA units "
                                         f"(operands {', '.join(sorted({d['operands'] for d in off}))})"))
        acq_rel = {op: n for op, n in k["atomics"].items() if ".acq_rel" in op}
        if acq_rel:
            found.append(dict(budget="no acq_rel atomics", **where,
                              detail=", ".join(f"{n} x {op}" for op, n in sorted(acq_rel.items()))))
    return found


def print_report(report: dict) -> None:
    print("Per call (B = 1, 12 heads): Triton launches + PyTorch ops (allocations and views aside)")
    rows = [dict(method=c["method"], seq_len=c["seq_len"], head_dim=c["head_dim"], dtype=c["dtype"],
                 launches=c["triton_launches"], torch_ops=c["torch_ops"], kernels=c["kernels"],
                 by_kernel=" ".join(f"{_short(k)}x{n}" for k, n in c["launches_by_kernel"].items()))
            for c in report["calls"]]
    print_table(rows, list(rows[0]))
    print()
    print("Per compiled kernel")
    rows = [dict(kernel=_short(k["kernel"]), arch=k["arch"], d=k["head_dim"], dtype=k["dtype"],
                 ok="yes" if k["compiled"] else "NO", regs=k["registers"], spill_B=k["spill_bytes"],
                 smem_B=k["shared_bytes"], warps=k["num_warps"],
                 dots_tc=f"{sum(d['tensor_cores'] for d in k['dots'])}/{len(k['dots'])}" if k["dots"] else "-",
                 dot_in=",".join(sorted({d["operands"] for d in k["dots"]})) or "-",
                 atomics=" ".join(f"{n}x{op}" for op, n in sorted(k["atomics"].items())) or "-",
                 variant=_variant(k["constexprs"]))
            for k in sorted(report["kernels"], key=lambda k: (k["arch"], k["dtype"], k["head_dim"], k["kernel"]))]
    print_table(rows, list(rows[0]))
    print()
    if report["violations"]:
        print(f"{len(report['violations'])} budget violations:")
        for v in report["violations"]:
            where = " ".join(f"{k}={v[k]}" for k in ("method", "kernel", "arch", "seq_len", "head_dim", "dtype") if k in v)
            print(f"  VIOLATION [{v['budget']}] {where}: {v['detail']}")
    else:
        print("every budget holds")


def _short(name: str) -> str:
    return name.removeprefix("_").removesuffix("_kernel")


def _variant(constexprs: dict) -> str:
    """The constexprs that pick a kernel variant (the flags), not the block sizes."""
    flags = [f"{k}={v}" for k, v in constexprs.items() if isinstance(v, bool) or k == "DOT_PRECISION"]
    return " ".join(flags) or "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90, 80], help="compute capabilities (90: H100)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--strict", action="store_true", help="exit 1 if any budget is broken")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "gpu_static.json")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("clusterserve.bench.gpu_static compiles the kernels: unset TRITON_INTERPRET")
    import triton

    # Unset, Triton 3.9 fuses multiply-adds and warns that 3.10 will not: the real calls' default.
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
    start = time.perf_counter()
    report = build_report(args.arch, args.lengths, args.head_dims, args.dtypes, args.methods)
    report.update(triton=triton.__version__, torch=torch.__version__,
                  seconds=round(time.perf_counter() - start, 1))
    print_report(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out} ({report['seconds']} s)")
    return 1 if args.strict and report["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
