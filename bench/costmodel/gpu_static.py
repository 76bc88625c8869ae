"""Offline GPU report: what the Triton kernels become on an H100 (sm_90) or A100 (sm_80),
and what one attention call launches, with no GPU. The recording and compiling here are what
bench.costmodel.gpu_model (the offline cost model: estimated time per launch and per call) reads.

    python -m clusterserve.bench.costmodel.gpu_static [--arch 90 80] [--lengths 4096 16384 65536] [--head-dims 32 64 128]
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
A launch count is reported, not budgeted: it says nothing about time. Time is bench.costmodel.gpu_model's
(its budgets: every launch fills the GPU or is negligible, and speed-ups over exact attention).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..common import RESULTS_DIR, print_table, rows_json
from .compiling import Compiled, compile_launch, specialisation
from .recording import HEADS, METHODS, record_call

SPILL_FREE_HEAD_DIM = 64  # no spills at head dims up to this, in bfloat16
HALF_DTYPES = ("bfloat16", "float16")


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


def compact(report: dict) -> dict:
    """The report as committed: per kernel, target, head dim, dtype and variant (its flags) the
    compiler's figures, specialisations that compiled alike merged; the dots as counts (on
    tensor cores, in all). The calls and the violations as they are."""
    kernels: list[dict] = []
    for k in report["kernels"]:
        row = dict(kernel=k["kernel"], arch=k["arch"], head_dim=k["head_dim"], dtype=k["dtype"],
                   variant=_variant(k["constexprs"]), compiled=k["compiled"])
        if k["compiled"]:
            row.update(registers=k["registers"], spill_bytes=k["spill_bytes"], stack_bytes=k["stack_bytes"],
                       shared_bytes=k["shared_bytes"], num_warps=k["num_warps"], dots=len(k["dots"]),
                       dots_on_tensor_cores=sum(d["tensor_cores"] for d in k["dots"]), atomics=k["atomics"])
        else:
            row["error"] = k["error"]
        if row not in kernels:
            kernels.append(row)
    return dict(report, kernels=kernels)


def _short(name: str) -> str:
    return name.removeprefix("_").removesuffix("_kernel")


def _variant(constexprs: dict) -> str:
    """The constexprs that pick a kernel variant (the flags), not the block sizes."""
    flags = [f"{k}={v}" for k, v in constexprs.items() if isinstance(v, bool) or k == "DOT_PRECISION"]
    return " ".join(flags) or "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90, 80], help="compute capabilities (90: H100)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--strict", action="store_true", help="exit 1 if any budget is broken")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "gpu_static.json")
    parser.add_argument("--detail", action="store_true",
                        help="keep each compiled specialisation's constexprs, dots and users in the JSON")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("clusterserve.bench.costmodel.gpu_static compiles the kernels: unset TRITON_INTERPRET")
    import triton

    # Unset, Triton 3.9 fuses multiply-adds and warns that 3.10 will not: the real calls' default.
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
    start = time.perf_counter()
    report = build_report(args.arch, args.lengths, args.head_dims, args.dtypes, args.methods)
    report.update(triton=triton.__version__, torch=torch.__version__,
                  seconds=round(time.perf_counter() - start, 1))
    print_report(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(rows_json(report if args.detail else compact(report)) + "\n")
    print(f"wrote {args.out} ({report['seconds']} s)")
    return 1 if args.strict and report["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
