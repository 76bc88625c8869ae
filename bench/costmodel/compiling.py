"""Compiling a recorded launch for an NVIDIA target with no GPU: a stand-in Triton driver reports
the target (GPUTarget("cuda", arch, 32)), and `kernel.warmup(...)` runs Triton's own pipeline
down to a cubin through the wheel's ptxas. Registers and spills are ptxas's `-v` report on the
PTX (Triton's flags); shared memory is Triton's; a dot runs on tensor cores when the TTGIR gives
it an MMA layout (mma.sync, or warp_group_dot = wgmma); atomics are the PTX's atom/red
instructions with their semantics and scope.
"""

from __future__ import annotations

import functools
import inspect
import re
import subprocess
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .recording import Launch


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
