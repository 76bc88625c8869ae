"""The served clustered methods and banded, one call each per length, bracketed for Nsight
Compute: a warm-up call compiles and caches every kernel outside the bracket, so that

    ncu --profile-from-start off --clock-control none -k regex:_means_kernel ... \\
        python -m clusterserve.bench.gpu.ncu [--model DIR] [--lengths 4096 16384] [--methods ...]

reads the hardware counters (occupancy, issue rate, spills, achieved bandwidth) of exactly
one call's launches. `--clock-control none` leaves the GPU's clocks as they are. On CPU
(TRITON_INTERPRET=1) it runs the calls without a bracket, to test the script.

    python -m clusterserve.bench.gpu.ncu --summarise DETAILS.csv [--log NCU.log] [--out SUMMARY.json]

turns `ncu --import REPORT --page details --csv`'s table into one row a launch, with the
metrics that say where a launch's time goes (SUMMARY), small enough to commit; with the
console log of the profiled run, each launch is labelled with its call.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

import torch

from clusterserve.kernels import attention

from ..common import gpu_script_qkv, gpu_script_setup
from .settings import SPECS, dry_run_spec

METHODS = ("clustered (default)", "i-clustered (default)", "banded")
# ncu's metric name -> the summary's key
SUMMARY = {
    "Duration": "duration_us", "Registers Per Thread": "registers", "Dynamic Shared Memory Per Block": "shared_kb",
    "Theoretical Occupancy": "theoretical_occupancy_pct", "Achieved Occupancy": "achieved_occupancy_pct",
    "Waves Per SM": "waves", "Issued Warp Per Scheduler": "issued_per_scheduler",
    "Warp Cycles Per Issued Instruction": "cycles_per_issue", "Compute (SM) Throughput": "sm_throughput_pct",
    "Memory Throughput": "memory_gb_per_s", "DRAM Throughput": "dram_throughput_pct",
    "L2 Hit Rate": "l2_hit_pct", "Local Memory Spilling Requests": "spill_requests",
}
# Units converted to the summary's (µs, KiB of shared memory, GB/s).
SCALE = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "byte/block": 1 / 1024, "Kbyte/block": 1000 / 1024,
         "Gbyte/s": 1.0, "Tbyte/s": 1e3, "Mbyte/s": 1e-3}


def call_labels(log: str) -> list[str]:
    """The call of each profiled launch, in order, from the run's console: ncu's "Profiling"
    lines, each call's launches followed by this script's line for the call."""
    labels, pending = [], 0
    for line in log.splitlines():
        if line.startswith("==PROF== Profiling "):
            pending += 1
        elif line.endswith(": one call bracketed"):
            labels += [line.removesuffix(": one call bracketed")] * pending
            pending = 0
    return labels


def summarise(details_csv: Path, log: str | None = None) -> list[dict]:
    """One row a profiled launch, in launch order: kernel, grid, block and SUMMARY's metrics
    (and its call, given the run's console log)."""
    launches: dict[str, dict] = {}
    with details_csv.open(newline="") as f:
        for row in csv.DictReader(f):
            launch = launches.setdefault(row["ID"], dict(kernel=row["Kernel Name"], grid=row["Grid Size"],
                                                         block=row["Block Size"]))
            key = SUMMARY.get(row["Metric Name"])
            if key is not None:
                value = float(row["Metric Value"].replace(",", ""))
                launch[key] = round(value * SCALE.get(row["Metric Unit"], 1.0), 3)
    rows = [launches[i] for i in sorted(launches, key=int)]
    if log is not None:
        labels = call_labels(log)
        if len(labels) != len(rows):
            raise SystemExit(f"the log names {len(labels)} profiled launches, the table has {len(rows)}")
        rows = [dict(call=label, **row) for label, row in zip(labels, rows)]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder (default: the embedded all-MiniLM-L6-v2)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(SPECS))
    parser.add_argument("--summarise", type=Path, metavar="DETAILS_CSV", help="summarise ncu's table instead")
    parser.add_argument("--log", type=Path, help="the profiled run's console, to label launches by call")
    parser.add_argument("--out", type=Path, help="the summary's JSON (default: beside DETAILS_CSV)")
    args = parser.parse_args(argv)
    if args.summarise:
        out = args.out or args.summarise.with_suffix(".json")
        log = args.log.read_text() if args.log else None
        out.write_text(json.dumps(summarise(args.summarise, log), indent=1) + "\n")
        print("wrote", out)
        return 0
    device, encoder, dtype = gpu_script_setup(args.model, args.lengths)
    interpret = device.type == "cpu"
    for n in args.lengths:
        q, k, v = gpu_script_qkv(encoder, n, dtype)
        for label in args.methods:
            spec = dry_run_spec(SPECS[label]) if interpret else SPECS[label]
            call = lambda: attention(q, k, v, spec, scale=q.shape[-1] ** -0.5, backend="triton")  # noqa: E731
            call()  # compiles outside the bracket
            if not interpret:
                torch.cuda.synchronize()
                torch.cuda.profiler.start()
            call()
            if not interpret:
                torch.cuda.synchronize()
                torch.cuda.profiler.stop()
            print(f"{label}, {n} tokens: one call bracketed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
