"""What `auto` weighs speed by on a GPU that has no calibration table of its own: the end-to-end
speed-ups over exact attention that the offline cost model estimates for this code on an H100
(bench.costmodel.gpu_e2e_model, which writes models/calibrations/<model>.gpu-estimate.json).

A GPU without its own table takes the CPU's (models.planning.calibration.find_calibration): its
fidelities hold on any device, its times do not. So there a configuration is chosen only where
the estimate puts its method at least MIN_SPEEDUP faster than exact attention for the whole pass
at the input's length (interpolated between the estimated lengths, the end ones held beyond),
the fastest by that estimate; a method or model with no estimate runs exact attention.
"""

from __future__ import annotations

import json
from pathlib import Path

# The tables and estimates shipped with clusterserve (models.planning.calibration reads its tables here).
SHIPPED_DIR = Path(__file__).resolve().parents[1] / "calibrations"


def estimate_name(model: str) -> str:
    return f"{model}.gpu-estimate.json"


def load_gpu_speedups(model: str, folder: Path = SHIPPED_DIR) -> dict[str, tuple[tuple[int, float], ...]]:
    """method -> ((tokens, estimated end-to-end speed-up over exact), ...) ascending; {} where
    the model has no estimate (every input then runs exact attention)."""
    path = folder / estimate_name(model)
    if not path.is_file():
        return {}
    raw = json.loads(path.read_text())
    return {method: tuple(sorted((int(n), float(s)) for n, s in points)) for method, points in raw["speedups"].items()}


def estimated_speedup(speedups: dict[str, tuple[tuple[int, float], ...]], method: str, tokens: int) -> float:
    """The estimated speed-up of `method` at `tokens`: linear between the estimated lengths
    around it, the nearest end's beyond them; 0 for a method without an estimate."""
    points = speedups.get(method, ())
    if not points:
        return 0.0
    if tokens <= points[0][0]:
        return points[0][1]
    for (lo, at_lo), (hi, at_hi) in zip(points, points[1:]):
        if tokens <= hi:
            return at_lo + (at_hi - at_lo) * (tokens - lo) / (hi - lo)
    return points[-1][1]
