"""The precision an encoder runs in: what `dtype="auto"` means on a device.

bfloat16 halves the bytes every layer moves and, where the hardware multiplies it natively,
multiplies faster: on CUDA (tensor cores, FlashAttention in SDPA) and on CPUs with AVX512-BF16
or AMX, whose bf16 matrix products run 2-3x float32's in torch. Elsewhere (AVX2-only CPUs)
bf16 is emulated and slower, so `auto` keeps float32 there. A CPU that reports the
instructions is also measured once (`bf16_speedup`), so a virtual machine that hides or
traps them, or a torch build that does not use them, keeps float32 too.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from clusterserve.models.timing import alternated_seconds

log = logging.getLogger("clusterserve")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_SETTINGS = ("auto", *DTYPES)
# CPU flags of native bf16 matrix arithmetic (Linux /proc/cpuinfo names).
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
# bf16 must beat float32 by this factor in the start-up measurement to be chosen on a CPU.
MIN_BF16_SPEEDUP = 1.3


def resolve_dtype(setting: str | torch.dtype | None, device: torch.device | str) -> torch.dtype:
    """The torch dtype for a setting: a dtype as given, a name ("float32", "bfloat16",
    "float16"), or "auto"/None: bfloat16 on CUDA and on CPUs with fast bf16, float32 elsewhere."""
    if isinstance(setting, torch.dtype):
        return setting
    if setting not in (None, *DTYPE_SETTINGS):
        raise ValueError(f"dtype: must be one of {', '.join(DTYPE_SETTINGS)} or a torch dtype, got {setting!r}")
    if setting in DTYPES:
        return DTYPES[setting]
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.bfloat16
    if kind == "cpu" and cpu_has_bf16() and bf16_is_faster():
        return torch.bfloat16
    return torch.float32


def cpu_has_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether the CPU reports native bf16 matrix instructions (AVX512-BF16 or AMX-BF16)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return any(flag in flags for flag in BF16_CPU_FLAGS)


def bf16_is_faster() -> bool:
    """Whether bfloat16 matrix products run at least MIN_BF16_SPEEDUP times faster than
    float32's on this CPU (bf16_speedup, measured once per process)."""
    return bf16_speedup() >= MIN_BF16_SPEEDUP


@functools.lru_cache(maxsize=1)
def bf16_speedup(rows: int = 2048, width: int = 384, inner: int = 1536, rounds: int = 7) -> float:
    """float32's time over bfloat16's for a (rows x width) @ (width x inner) product, the shape
    of an encoder's feed-forward block, on this CPU (~0.2 s, once per process). The two dtypes
    are timed in alternation, one call each a round, and each keeps its fastest call: a burst
    of load from another process slows both sides of a round, and a quiet moment in any round
    counts, so a busy machine still measures what its instructions can do."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, width, generator=generator)
    w = torch.randn(inner, width, generator=generator)
    operands = {dtype: (x.to(dtype), w.to(dtype)) for dtype in (torch.float32, torch.bfloat16)}
    runs = {dtype: functools.partial(torch.nn.functional.linear, *pair) for dtype, pair in operands.items()}
    times = alternated_seconds(runs, rounds)
    speedup = min(times[torch.float32]) / min(times[torch.bfloat16])
    log.info("bfloat16 matrix products ran %.1fx as fast as float32's on this CPU (dtype auto takes bfloat16 from %.1fx)",
             speedup, MIN_BF16_SPEEDUP)  # fmt: skip
    return speedup


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
