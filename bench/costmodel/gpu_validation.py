"""The offline cost model (bench.costmodel.gpu_model's `gpu_model.json`) against what a GPU
measured (a device session's record, bench.gpu.summary: its attention rows and torch.profiler
tables): per method and length, every Triton kernel's device time summed over its launches,
measured and estimated, and the call's time in a CUDA graph. No GPU needed; it reads committed
files.

    python -m clusterserve.bench.costmodel.gpu_validation [--session bench/results/h100-2026-11-27-2.json]
                                                         [--model bench/results/gpu_model.json]

The comparison, the record's `vs_model` (rewritten in place), lists per kernel `measured_us`,
`model_us` and their ratio (where the measured call launched it as often as the modelled one:
`launches`, `model_launches`), per call the measured and estimated graph time, and the spread of
the ratios over every kernel of at least MIN_US measured: what the model's estimates are worth,
kernel by kernel. Where a kernel was profiled at several lengths, `fits` splits its measured time
a launch into a fixed part and a multiple of the model's estimate (fixed_launch_cost): what the
model misses per launch, and what it misses per unit of the work it counts.
"""
from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path

from clusterserve.kernels import AttentionSpec

from ..common import MEASURED as SPECS
from ..common import RESULTS_DIR, print_table, rows_json
from ..gpu.profiles import profile_tables

HEAD_DIM = 64
# Kernels measured at under this many µs in all are left out of the spread (timer granularity).
MIN_US = 5.0
LIBRARY = "library kernels"  # PyTorch's and cuDNN's, by their total
# A kernel whose modelled time a launch spans less than this factor over the lengths profiled
# gets no slope of its own in fixed_launch_cost: its measured excess is all fixed cost.
MIN_MODEL_SPAN = 2.0


def parse_profile(text: str) -> dict[tuple[str, int], dict[str, tuple[float, int]]]:
    """torch.profiler tables -> {(method, tokens): {kernel: (device µs in all, launches)}}: the
    rows with no CPU time of their own (device kernels), Triton's by name, the rest as LIBRARY."""
    return profiles_of(profile_tables(text))


def profiles_of(tables: list[dict]) -> dict[tuple[str, int], dict[str, tuple[float, int]]]:
    """bench.gpu.profiles' tables of attention calls -> parse_profile's form."""
    result = {}
    for table in tables:
        if table["kind"] != "attention":
            continue
        kernels: dict[str, list] = defaultdict(lambda: [0.0, 0])
        for row in table["kernels"]:
            name = row["kernel"] if row["category"] == "triton" else LIBRARY
            kernels[name][0] += row["us"]
            kernels[name][1] += row["launches"]
        result[(table["method"], table["tokens"])] = {name: (us, calls) for name, (us, calls) in kernels.items()}
    return result


def model_kernels(call: dict) -> dict[str, tuple[float, int]]:
    """A modelled call -> {kernel: (estimated µs in all, launches)}, library ops as LIBRARY."""
    kernels = {name: (row["est_us"], row["launches"]) for name, row in call["kernels"].items()}
    if call["torch_ops"]:
        kernels[LIBRARY] = (sum(op["us"] for op in call["torch_ops"]), sum(op["kernels"] for op in call["torch_ops"]))
    return kernels


def compare(measured_rows: list[dict], profiles: dict, model: dict) -> dict:
    """The report: per (method, tokens) profiled, its kernels and its call, measured beside modelled."""
    # A bench.gpu.speed method's call is the modelled one with the knobs its measured row records
    # (bench.common.MEASURED' where there is no row): a label such as "(default)" names the knobs the
    # run had, which its row records.
    calls = {(AttentionSpec(**c["spec"]), c["seq_len"]): c for c in model["calls"] if c["head_dim"] == HEAD_DIM}
    times = {(r["method"], r["seq_len"]): r for r in measured_rows
             if r.get("kind", "attention") == "attention" and r["head_dim"] == HEAD_DIM}
    kernel_rows, call_rows = [], []
    for (method, tokens), kernels in sorted(profiles.items(), key=lambda item: (item[0][1], item[0][0])):
        measured_call = times.get((method, tokens))
        if method == "full":  # exact attention: SDPA measured, FlashAttention-2 modelled
            exact_ms = next((c["exact_fa2_ms"] for (_, n), c in calls.items() if n == tokens), None)
            if measured_call is not None and exact_ms is not None:
                call_rows.append(dict(method=method, tokens=tokens, measured_graph_ms=measured_call["graph_ms"],
                                      model_ms=exact_ms, model="FlashAttention-2"))
            continue
        spec = AttentionSpec(**measured_call["spec"]) if measured_call and "spec" in measured_call else SPECS[method]
        call = calls.get((spec, tokens))
        if call is None:
            continue
        estimated = model_kernels(call)
        for name in sorted(set(kernels) | set(estimated), key=lambda k: (-kernels.get(k, (0.0, 0))[0], k)):
            got, want = kernels.get(name, (0.0, 0)), estimated.get(name, (0.0, 0))
            # A kernel launched a different number of times (the measured call ran kernels since
            # fused or split) has no ratio: its times are of different work.
            kernel_rows.append(dict(
                method=method, tokens=tokens, kernel=name, launches=got[1] or want[1], model_launches=want[1],
                measured_us=round(got[0], 1), model_us=round(want[0], 1),
                ratio=round(got[0] / want[0], 3) if got[0] and want[0] and got[1] == want[1] else None,
            ))
        device_us = sum(us for us, _ in kernels.values())
        call_rows.append(dict(
            method=method, tokens=tokens, measured_device_ms=round(device_us / 1e3, 4),
            model_device_ms=call["device_ms"], measured_graph_ms=measured_call and measured_call["graph_ms"],
            model_ms=call["est_ms"], model=call["method"],
        ))
    ratios = [r["ratio"] for r in kernel_rows if r["ratio"] and r["measured_us"] >= MIN_US and r["kernel"] != LIBRARY]
    logs = sorted(math.log(r) for r in ratios)
    spread = dict(
        kernels=len(ratios),
        median_ratio=round(math.exp(logs[len(logs) // 2]), 3) if logs else None,
        min_ratio=round(min(ratios), 3) if ratios else None,
        max_ratio=round(max(ratios), 3) if ratios else None,
        within_25_percent=sum(0.8 <= r <= 1.25 for r in ratios),
    )
    return dict(kernels=kernel_rows, calls=call_rows, spread=spread, fits=fits(kernel_rows))


def fixed_launch_cost(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(fixed µs, slope) with measured ≈ fixed + slope x modelled, a launch, by least squares
    over (modelled µs, measured µs) points at several lengths; the fixed part is at least 0
    (else the slope alone, through the origin). Where the modelled times span less than
    MIN_MODEL_SPAN, the slope is 1 and the fixed part the mean excess."""
    model = [m for m, _ in points]
    if max(model) < MIN_MODEL_SPAN * min(model):
        return sum(t - m for m, t in points) / len(points), 1.0
    mean_m, mean_t = sum(model) / len(points), sum(t for _, t in points) / len(points)
    slope = sum((m - mean_m) * (t - mean_t) for m, t in points) / sum((m - mean_m) ** 2 for m in model)
    fixed = mean_t - slope * mean_m
    if fixed < 0:
        return 0.0, sum(m * t for m, t in points) / sum(m * m for m in model)
    return fixed, slope


def fits(kernel_rows: list[dict]) -> list[dict]:
    """Per method and Triton kernel profiled at two lengths or more: fixed_launch_cost's split."""
    points: dict[tuple[str, str], list[tuple[int, float, float]]] = defaultdict(list)
    for r in kernel_rows:
        if r["kernel"] != LIBRARY and r["ratio"]:
            points[(r["method"], r["kernel"])].append(
                (r["tokens"], r["model_us"] / r["launches"], r["measured_us"] / r["launches"]))
    rows = []
    for (method, kernel), seen in sorted(points.items()):
        if len(seen) < 2:
            continue
        fixed, slope = fixed_launch_cost([(m, t) for _, m, t in seen])
        rows.append(dict(method=method, kernel=kernel, tokens=[n for n, _, _ in seen],
                         fixed_us=round(fixed, 1), slope=round(slope, 2),
                         worst_residual_us=round(max(abs(t - fixed - slope * m) for _, m, t in seen), 1)))
    return rows


def session_comparison(record: dict, model: dict) -> dict:
    """A device session's record (bench.gpu.summary) against the model: its `vs_model`."""
    return dict(measured=record["session"], model_label=model["label"],
                **compare(record["attention"], profiles_of(record["profiles"]), model))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--session", type=Path, default=RESULTS_DIR / "h100-2026-11-27-2.json",
                        help="a device session's record (bench.gpu.summary)")
    parser.add_argument("--model", type=Path, default=RESULTS_DIR / "gpu_model.json")
    args = parser.parse_args(argv)
    record = json.loads(args.session.read_text())
    if not profiles_of(record.get("profiles", [])):
        raise SystemExit(f"{args.session.name}: no profiled attention call")
    report = session_comparison(record, json.loads(args.model.read_text()))
    print_table(report["kernels"], ["method", "tokens", "kernel", "launches", "model_launches", "measured_us", "model_us",
                                    "ratio"])
    print()
    print_table(report["calls"], ["method", "tokens", "measured_device_ms", "model_device_ms", "measured_graph_ms",
                                  "model_ms", "model"])
    print()
    print("kernels of at least", MIN_US, "µs measured, measured / model:", report["spread"])
    if report["fits"]:
        print("\na launch measured as fixed_us + slope x modelled, over the lengths profiled:")
        print_table(report["fits"], ["method", "kernel", "tokens", "fixed_us", "slope", "worst_residual_us"])
    record["vs_model"] = report
    args.session.write_text(rows_json(record) + "\n")
    print(f"wrote {args.session}'s vs_model")


if __name__ == "__main__":
    main()
