"""torch.profiler's key_averages tables (bench.gpu.speed's -profile.txt files) as data: per
profiled call, every device kernel's time and launches with its category, the ATen ops' own
device time, and the device's total."""

from __future__ import annotations

import re

# Kernel categories by the name torch.profiler prints (cut at 55 characters): the project's
# Triton kernels, library attention, matrix products, memory, the rest of ATen's kernels.
CATEGORIES = (
    ("triton", r"^_\w+_kernel$"),
    ("attention", r"sdpa|flash|fmha|attention"),
    ("gemm", r"^nvjet|gemm|cutlass|xmma|^sm\d+_"),
    ("memory", r"^Memset|^Memcpy"),
    ("elementwise", r"elementwise|CatArrayBatched|reduce_kernel|index|gather|scatter|layer_norm|softmax"),
)


def category(kernel: str) -> str:
    """The category of a device kernel by its printed name ("other" when none fits)."""
    return next((name for name, pattern in CATEGORIES if re.search(pattern, kernel)), "other")


def microseconds(cell: str) -> float | None:
    """A profiler time cell ("231.655us", "1.500ms", "2s") in microseconds; None if it is none."""
    match = re.fullmatch(r"([\d.]+)(us|ms|s)", cell)
    if match is None:
        return None
    return float(match.group(1)) * {"us": 1.0, "ms": 1e3, "s": 1e6}[match.group(2)]


def profile_tables(text: str) -> list[dict]:
    """torch.profiler's key_averages tables, sections titled "== [embed ]<method>, <n> tokens ==",
    as data: per section its device kernels (rows with no CPU time of their own) in the table's
    order, the ATen ops' own device time, the device's total and what the listed kernels leave."""
    parts = re.split(r"^== (.+), (\d+) tokens ==$", text, flags=re.M)
    tables = []
    for label, tokens, body in zip(parts[1::3], parts[2::3], parts[3::3]):
        kernels, ops = [], []
        for line in body.splitlines():
            cells = re.split(r"\s{2,}", line.strip())
            if len(cells) < 11:
                continue
            self_cpu, device_us, calls = microseconds(cells[2]), microseconds(cells[6]), cells[-1]
            if self_cpu is None or not device_us or not calls.isdigit():
                continue
            if self_cpu == 0:
                kernels.append(dict(kernel=cells[0], us=device_us, launches=int(calls), category=category(cells[0])))
            elif cells[0].startswith("aten::"):
                ops.append(dict(op=cells[0], self_device_us=device_us, calls=int(calls)))
        total = re.search(r"^Self CUDA time total: (\S+)$", body, flags=re.M)
        device_us = microseconds(total.group(1)) if total else None
        kind, method = ("embed", label.removeprefix("embed ")) if label.startswith("embed ") else ("attention", label)
        tables.append(dict(kind=kind, method=method, tokens=int(tokens), device_us=device_us, kernels=kernels,
                           unlisted_us=round(device_us - sum(k["us"] for k in kernels), 3) if device_us else None,
                           ops=ops))
    return tables
