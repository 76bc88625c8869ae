"""Which builds of native.c this CPU runs: the x86-64 micro-architecture levels (setup.py
compiles one library per level), the CPU flags each needs, and CLUSTERSERVE_NATIVE_ISA, the
cap that lets the tests run the loops under a lower level than the machine's best."""

from __future__ import annotations

import platform
from pathlib import Path

# x86-64 levels from the lowest; each names the CPU flags it needs beyond the one before.
X86_LEVELS = {
    "x86_64": frozenset(),
    "x86_64_v3": frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave"}),
    "x86_64_v4": frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}),
}
ISA_VARIABLE = "CLUSTERSERVE_NATIVE_ISA"


def runnable_levels(cap: str | None = None) -> list[str]:
    """Library levels this CPU runs, best first, up to `cap` ("generic" off x86-64)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ["generic"]
    names = list(X86_LEVELS)
    if cap is not None:
        if cap not in X86_LEVELS:
            raise ValueError(f"{ISA_VARIABLE}: must be one of {', '.join(X86_LEVELS)}, got {cap!r}")
        names = names[: names.index(cap) + 1]
    flags = _cpu_flags()
    runnable, needed = [], set()
    for name in names:
        needed |= X86_LEVELS[name]
        if needed <= flags:
            runnable.append(name)
    return runnable[::-1]


def _cpu_flags() -> frozenset[str]:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return frozenset()
    for line in lines:
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()
