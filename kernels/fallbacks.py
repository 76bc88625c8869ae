"""Where a kernel hands its work to a slower path, it says so: each fallback is counted here,
process-wide, and logged the first time it happens (kind and reason), so that an operator sees
it in the log and in `clusterserve_kernel_fallbacks_total` instead of in latency alone.

The known fallbacks are listed in FALLBACKS, so a metrics exporter can show each at 0 before
it first happens.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("clusterserve.kernels")

# (kernel, reason) -> what the slower path is.
FALLBACKS: dict[tuple[str, str], str] = {
    ("centroid_triton", "topk_over_on_chip"): (
        "i-clustered's top-k is over what the Triton centroid pass selects on chip; "
        "A^c is computed in float32 with torch and torch.topk picks the keys"
    ),
    ("banded_triton", "blocks_over_on_chip"): (
        "banded's far-block choice has more blocks a row than its Triton top-k holds on chip; "
        "torch.topk and a sort pick them"
    ),
}

_lock = threading.Lock()
_counts: dict[tuple[str, str], int] = dict.fromkeys(FALLBACKS, 0)


def record(kernel: str, reason: str, detail: str = "") -> None:
    """Count one call of `kernel` that fell back for `reason` (a key of FALLBACKS)."""
    key = (kernel, reason)
    if key not in FALLBACKS:
        raise KeyError(f"unknown fallback {key}: add it to kernels.fallbacks.FALLBACKS")
    with _lock:
        first = _counts[key] == 0
        _counts[key] += 1
    if first:
        log.warning("kernel fallback %s/%s: %s%s", kernel, reason, FALLBACKS[key], f" ({detail})" if detail else "")


def counts() -> dict[tuple[str, str], int]:
    """Calls that fell back so far in this process, per (kernel, reason)."""
    with _lock:
        return dict(_counts)
