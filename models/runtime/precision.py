"""The precision an encoder runs in: what `dtype="auto"` means on a device.

bfloat16 halves the bytes every layer moves and, where the hardware multiplies it natively,
multiplies faster: on CUDA (tensor cores, FlashAttention in SDPA) and on CPUs with AVX512-BF16
or AMX, whose bf16 matrix products run 2-3x float32's in torch. Elsewhere (AVX2-only CPUs)
bf16 is emulated and slower, so `auto` keeps float32 there. A CPU that reports the
instructions is also measured once (`bf16_is_faster`), so a virtual machine that hides or
traps them, or a torch build that does not use them, keeps float32 too.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import torch

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


@functools.lru_cache(maxsize=1)
def bf16_is_faster(rows: int = 2048, width: int = 384, inner: int = 1536) -> bool:
    """Whether a (rows x width) @ (width x inner) product, the shape of an encoder's
    feed-forward block, runs at least MIN_BF16_SPEEDUP times faster in bfloat16 than in
    float32 on this CPU (best of 3 each, once per process: ~0.1 s)."""
    return cpu_matmul_seconds(torch.float32, rows, width, inner) >= MIN_BF16_SPEEDUP * cpu_matmul_seconds(
        torch.bfloat16, rows, width, inner
    )


def cpu_matmul_seconds(dtype: torch.dtype, rows: int, width: int, inner: int, repeats: int = 3) -> float:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, width, generator=generator).to(dtype)
    w = torch.randn(inner, width, generator=generator).to(dtype)
    torch.nn.functional.linear(x, w)  # untimed: first-call costs
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.nn.functional.linear(x, w)
        best = min(best, time.perf_counter() - start)
    return best


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
