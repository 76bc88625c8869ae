"""Offline cost model of the Triton pipelines on an H100 SXM (sm_90), with no GPU: an estimate
per launch and per call, and its ratio to exact attention (FlashAttention-2 and -3).

    python -m bench.gpu_model [--lengths 4096 16384 65536] [--head-dims 64 32] [--json PATH]

Every figure is an estimate. Per launch (recorded by bench.gpu_static, compiled for sm_90):
programs and waves on 132 SMs; occupancy from registers, shared memory and warps; the
instructions one program issues (SASS per loop x trip counts: bench.sass, bench.trip_counts)
priced by the unit that runs them (bench.warp_cost); HBM and L2 bytes; then

    est_us = launch + max(issue-bound, latency-bound, bandwidth-bound)

issue-bound: waves x warps per SMSP x one warp's busy cycles (bench.warp_cost);
latency-bound: waves x one warp alone, issuing in order and waiting for its operands;
bandwidth-bound: HBM bytes / HBM bandwidth, or L2 bytes / L2 bandwidth, whichever is longer.
Torch ops in a call (fills, SMYRF's argsorts) are priced by their bytes. The report also
validates the model: bench/flash_attention.py's FlashAttention-2 kernel against published H100
figures of Triton's fused attention. bench/README.md explains the model and its constants.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kernels import AttentionSpec

from . import sass, warp_cost
from .common import RESULTS_DIR, print_table
from .gpu_static import HEADS, Launch, compile_kernel, ptxas_usage, record_spec, specialisation
from .trip_counts import UnknownBound, bound_arguments, declared_bounds, loop_trips

SMS = 132  # H100 SXM5 (NVIDIA H100 datasheet)
HBM_BYTES_PER_S = 3.35e12  # HBM3, H100 SXM5 datasheet
L2_BYTES_PER_S = 7.0e12  # modelled: Chips and Cheese measured ~5.5 TB/s on the 114-SM PCIe card
LAUNCH_US = 2.0  # modelled: one kernel boundary inside a CUDA graph (drain + fill)
RADIX_PASSES = 4  # modelled: torch's argsort of float32 keys with int64 indices, read + write per pass
# Per SM on sm_90 (CUDA C++ Programming Guide, technical specifications for compute capability
# 9.0): 64 K registers (allocated per warp in units of 256), 228 KB shared memory (1 KB of it
# reserved per block), 32 blocks, 64 warps.
REGISTERS, REGISTER_UNIT, SHARED_BYTES, SHARED_PER_BLOCK, MAX_BLOCKS, MAX_WARPS = 65536, 256, 233472, 1024, 32, 64

# Exact attention on an H100 80GB SXM5, forward, non-causal, bf16/fp16, TFLOP/s by sequence
# length (Shah et al. 2024, FlashAttention-3, arXiv:2407.08608, figure "Attention forward speed,
# head dim 64"; B x N = 16k, 32 heads). Head dim 32 has no published figure: it uses d = 64's.
FA_TFLOPS = {"fa2": {512: 282, 1024: 306, 2048: 318, 4096: 321, 8192: 322, 16384: 324},
             "fa3": {512: 333, 1024: 392, 2048: 460, 4096: 476, 8192: 496, 16384: 497}}

# What the report covers: the default knobs (bench.cpu) and the calibration grid's.
SPECS = {
    "clustered 100": AttentionSpec(method="clustered", clusters=100, bits=63, iterations=10),
    "i-clustered 100/32 (paper)": AttentionSpec(method="i-clustered", clusters=100, topk=32, refine=0),
    "i-clustered 100/32": AttentionSpec(method="i-clustered", clusters=100, topk=32, refine=3),
    "smyrf 4x64": AttentionSpec(method="smyrf", hash_rounds=4, cluster_size=64),
    "clustered 200": AttentionSpec(method="clustered", clusters=200, iterations=5, refine=3),
    "clustered 400": AttentionSpec(method="clustered", clusters=400, iterations=5, refine=3),
    "clustered 1600": AttentionSpec(method="clustered", clusters=1600, iterations=5, refine=3),
    "i-clustered 200/32": AttentionSpec(method="i-clustered", clusters=200, topk=32, iterations=5, refine=3),
    "i-clustered 400/64": AttentionSpec(method="i-clustered", clusters=400, topk=64, iterations=5, refine=3),
}


@dataclass
class LaunchEstimate:
    kernel: str
    programs: int
    warps: int
    registers: int
    shared_bytes: int
    blocks_per_sm: int  # occupancy: resident programs per SM
    waves: float  # programs / (132 x blocks_per_sm)
    instructions: float  # warp instructions one program issues (SASS per loop x trip counts x warps)
    hbm_bytes: float
    l2_bytes: float
    issue_us: float
    latency_us: float
    bandwidth_us: float
    est_us: float
    loops: list  # per SASS loop: "source: trips per entry, instructions a trip, runs a program"

    @property
    def bound(self) -> str:
        return max(("issue", self.issue_us), ("latency", self.latency_us), ("bandwidth", self.bandwidth_us),
                   key=lambda kv: kv[1])[0]


@dataclass
class Compiled:
    """What the model reads of one compiled kernel variant."""

    listing: sass.Listing
    loops: list
    warps: int
    registers: int
    shared_bytes: int


_compiled: dict = {}  # (kernel, target, specialisation) -> Compiled


def compiled(launch: Launch, capability: int = 90) -> Compiled:
    """The launch's kernel compiled for sm_<capability>, disassembled, its loops found (once per
    variant: Triton specialises on constexprs and on which integers are 1 or multiples of 16)."""
    key = (launch.name, capability, specialisation(launch))
    if key not in _compiled:
        kernel = compile_kernel(launch, capability)
        listing = sass.disassemble(kernel.asm["cubin"])
        registers = ptxas_usage(kernel.asm["ptx"], capability)[0]
        _compiled[key] = Compiled(listing, sass.find_loops(listing), int(kernel.metadata.num_warps), registers,
                                  int(kernel.metadata.shared))
    return _compiled[key]


def loop_trip_counts(launch: Launch, variant: Compiled) -> dict:
    """Trips per entry of every SASS loop of the launch, by id(loop). A source loop that became
    several sibling SASS loops (an unrolled body and its remainder) is counted once, on the
    smallest: its trips at the cost of one source iteration each."""
    arguments = bound_arguments(launch.kernel, launch.args, launch.kwargs)
    declared = declared_bounds(launch.kernel, arguments)
    blocks = sass.basic_blocks(variant.listing)
    trips = {}

    def visit(siblings):
        smallest = {}
        for loop in siblings:
            size = sum(blocks[b][1] - blocks[b][0] for b in loop.blocks)
            if loop.location not in smallest or size < smallest[loop.location][0]:
                smallest[loop.location] = (size, id(loop))
        for loop in siblings:
            chosen = smallest[loop.location][1] == id(loop)
            trips[id(loop)] = _trips(loop) if chosen else 0
            visit(loop.children)

    def _trips(loop) -> float:
        try:
            return loop_trips(launch.kernel, arguments, declared, loop.location)
        except UnknownBound:
            # An mbarrier wait (TMA, warp specialisation) spins until its data lands: its cost
            # is a latency, taken once, not a loop of the source.
            waits = any(ins.opcode.startswith("SYNCS") for b in loop.blocks
                        for ins in variant.listing.instructions[slice(*blocks[b])])
            if waits and not loop.children:
                return 1
            raise

    visit(variant.loops)
    return trips


def occupancy(registers: int, warps: int, shared_bytes: int) -> int:
    """Programs resident per SM: the least that registers, shared memory, warps and blocks allow."""
    per_warp = math.ceil(registers * 32 / REGISTER_UNIT) * REGISTER_UNIT
    by_registers = (REGISTERS // per_warp) // warps if per_warp else MAX_BLOCKS
    by_shared = SHARED_BYTES // (shared_bytes + SHARED_PER_BLOCK)
    return max(1, min(MAX_BLOCKS, MAX_WARPS // warps, by_registers, by_shared))


def estimate_launch(launch: Launch, capability: int = 90) -> LaunchEstimate:
    """The model's figures for one recorded launch (see the module docstring)."""
    variant = compiled(launch, capability)
    trips = loop_trip_counts(launch, variant)
    warp = warp_cost.warp_cost(variant.listing, variant.loops, lambda loop: trips[id(loop)])
    warps, registers, shared = variant.warps, variant.registers, variant.shared_bytes
    resident = occupancy(registers, warps, shared)
    programs = launch.programs
    per_sm = math.ceil(programs / SMS)
    together = min(per_sm, resident)
    waves = math.ceil(per_sm / together)
    warps_per_smsp = math.ceil(together * warps / warp_cost.SMSPS)
    issue = waves * warps_per_smsp * warp.busy / warp_cost.CLOCK_HZ
    latency = waves * warp.latency / warp_cost.CLOCK_HZ
    l2_bytes = warp.global_bytes * warps * programs
    tensor_bytes = sum(math.prod(shape) * size for shape, size in filter(None, launch.shapes))
    hbm_bytes = min(tensor_bytes, l2_bytes) if l2_bytes else tensor_bytes
    bandwidth = max(hbm_bytes / HBM_BYTES_PER_S, l2_bytes / L2_BYTES_PER_S)
    est = LAUNCH_US + 1e6 * max(issue, latency, bandwidth)
    return LaunchEstimate(launch.name, programs, warps, registers, shared, resident, programs / (SMS * resident),
                          warp.instructions * warps, hbm_bytes, l2_bytes, 1e6 * issue, 1e6 * latency, 1e6 * bandwidth, est,
                          _loop_rows(variant.listing, variant.loops, trips))


def _loop_rows(listing, loops, trips, runs: float = 1.0) -> list[dict]:
    """Each SASS loop: where it is in the source (the `for`, then the calls it is inlined at), its
    trips per entry, its own instructions (nested loops apart) and its runs per program."""
    blocks = sass.basic_blocks(listing)
    rows = []
    for loop in loops:
        nested = set().union(*(c.blocks for c in loop.children)) if loop.children else set()
        body = sum(blocks[b][1] - blocks[b][0] for b in loop.blocks if b not in nested)
        source = " < ".join(f"{file}:{line}" for file, line in loop.location)
        rows.append(f"{source}: {trips[id(loop)]:.4g} trips, {body} instructions a trip, "
                    f"{runs * trips[id(loop)]:.4g} runs a program")
        rows += _loop_rows(listing, loop.children, trips, runs * trips[id(loop)])
    return rows


def torch_op_us(name: str, read: int, written: int) -> float:
    """A torch op of the call: its bytes at HBM bandwidth (a sort: RADIX_PASSES reads and writes)."""
    passes = 2 * RADIX_PASSES if "sort" in name else 1
    return LAUNCH_US + 1e6 * passes * (read + written) / HBM_BYTES_PER_S


def exact_ms(n: int, head_dim: int, heads: int = HEADS, batch: int = 1, which: str = "fa2") -> float:
    """Exact attention's time from FlashAttention's published H100 throughput at the nearest
    published length (16k beyond it): 4 B H N^2 d FLOPs."""
    table = FA_TFLOPS[which]
    length = min(table, key=lambda m: abs(math.log2(m) - math.log2(n)))
    return 1e3 * 4 * batch * heads * n * n * head_dim / (table[length] * 1e12)


def estimate_call(label: str, spec: AttentionSpec, n: int, head_dim: int, dtype: torch.dtype = torch.bfloat16,
                  capability: int = 90) -> dict:
    """Per launch and per call: the estimate of one attention() call on (1, 12, n, head_dim)."""
    ops: list = []
    launches, counts = record_spec(spec, n, head_dim, dtype, ops=ops)
    rows = [estimate_launch(launch, capability) for launch in launches]
    torch_us = [torch_op_us(*op) for op in ops]
    est_ms = (sum(r.est_us for r in rows) + sum(torch_us)) / 1e3
    fa2, fa3 = exact_ms(n, head_dim), exact_ms(n, head_dim, which="fa3")
    return dict(method=label, spec=asdict(spec), seq_len=n,
                head_dim=head_dim, dtype=str(dtype).removeprefix("torch."), launches=[
                    dict(asdict(r), bound=r.bound) for r in rows],
                torch_ops=[dict(op=name, us=us) for (name, _, _), us in zip(ops, torch_us)],
                est_ms=est_ms, exact_fa2_ms=fa2, exact_fa3_ms=fa3,
                est_speedup_fa2=fa2 / est_ms, est_speedup_fa3=fa3 / est_ms)


# ---- validation: a FlashAttention-2 kernel against published H100 throughput --------------------

# Triton's fused-attention (FlashAttention-2) kernel on an H100 SXM5, forward, non-causal, bf16/fp16,
# TFLOP/s at (batch, heads, tokens, head dim).
PUBLISHED_TRITON_ATTENTION = [
    dict(shape=(4, 32, 4096, 64), tflops=400, source="Shah et al. 2024 (FlashAttention-3), fig. head dim 64, 'Triton'"),
    dict(shape=(1, 32, 16384, 64), tflops=403, source="Shah et al. 2024 (FlashAttention-3), fig. head dim 64, 'Triton'"),
    dict(shape=(4, 16, 4096, 128), tflops=389, source="Shah et al. 2024 (FlashAttention-3), fig. head dim 128, 'Triton'"),
    dict(shape=(1, 16, 16384, 128), tflops=395, source="Shah et al. 2024 (FlashAttention-3), fig. head dim 128, 'Triton'"),
    dict(shape=(4, 16, 4096, 128), tflops=458, source="pytorch/benchmark ff65cb6, triton_tutorial_flash_v2 on H100"),
    dict(shape=(1, 16, 16384, 128), tflops=477, source="pytorch/benchmark ff65cb6, triton_tutorial_flash_v2 on H100"),
]


def flash_launch(batch: int, heads: int, n: int, head_dim: int, dtype: torch.dtype = torch.bfloat16) -> Launch:
    """The recorded launch of bench.flash_attention at one shape (meta tensors, nothing runs)."""
    from .flash_attention import _flash_forward_kernel, launch_arguments

    q, k, v, out = (torch.empty(batch, heads, n, head_dim, dtype=dtype, device="meta") for _ in range(4))
    grid, args, kwargs = launch_arguments(q, k, v, out)
    tensor = [isinstance(a, torch.Tensor) for a in args]
    return Launch(_flash_forward_kernel, grid, tuple(a.dtype if t else a for a, t in zip(args, tensor)), kwargs,
                  tuple((tuple(a.shape), a.element_size()) if t else None for a, t in zip(args, tensor)))


def validate() -> list[dict]:
    """The model's estimate of the FlashAttention-2 kernel at each published shape, and its error."""
    rows = []
    for ref in PUBLISHED_TRITON_ATTENTION:
        b, h, n, d = ref["shape"]
        estimate = estimate_launch(flash_launch(b, h, n, d))
        tflops = 4 * b * h * n * n * d / (estimate.est_us * 1e6)
        rows.append(dict(ref, est_us=estimate.est_us, est_tflops=tflops, bound=estimate.bound,
                         error=tflops / ref["tflops"] - 1))
    return rows


# ---- the report ---------------------------------------------------------------------------------


def build_report(labels: list[str], lengths: list[int], head_dims: list[int]) -> dict:
    calls = [estimate_call(label, SPECS[label], n, d) for d in head_dims for n in lengths for label in labels]
    return dict(label="estimate, sm_90 offline, no GPU", device="H100 SXM5 (modelled)", batch=1, heads=HEADS,
                dtype="bfloat16", constants=dict(sms=SMS, clock_hz=warp_cost.CLOCK_HZ, hbm_bytes_per_s=HBM_BYTES_PER_S,
                                                 l2_bytes_per_s=L2_BYTES_PER_S, launch_us=LAUNCH_US,
                                                 latency_cycles=warp_cost.LATENCY, exact_tflops=FA_TFLOPS),
                validation=validate(), calls=calls)


def print_report(report: dict) -> None:
    print("Estimates (sm_90 offline, no GPU): B = 1, 12 heads, bfloat16; exact = FlashAttention-2 / -3's "
          "published H100 throughput")
    for call in report["calls"]:
        if call["head_dim"] != 64 or call["method"] not in list(SPECS)[:4]:
            continue
        print(f"\n{call['method']} at {call['seq_len']} tokens, d = {call['head_dim']}: est {call['est_ms']:.3f} ms, "
              f"{call['est_speedup_fa2']:.2f}x FA2, {call['est_speedup_fa3']:.2f}x FA3")
        rows = [dict(kernel=r["kernel"].removeprefix("_").removesuffix("_kernel"), programs=r["programs"],
                     resident=r["blocks_per_sm"], waves=f"{r['waves']:.2f}", regs=r["registers"],
                     instr=f"{r['instructions']:.3g}", hbm_MB=f"{r['hbm_bytes'] / 1e6:.1f}",
                     issue_us=f"{r['issue_us']:.1f}", latency_us=f"{r['latency_us']:.1f}",
                     bw_us=f"{r['bandwidth_us']:.1f}", est_us=f"{r['est_us']:.1f}", bound=r["bound"])
                for r in call["launches"]]
        rows += [dict(kernel=f"torch {op['op']}", est_us=f"{op['us']:.1f}") for op in call["torch_ops"]]
        print_table(rows, list(rows[0]))
    print("\nPer call")
    rows = [dict(method=c["method"], seq_len=c["seq_len"], d=c["head_dim"], est_ms=f"{c['est_ms']:.3f}",
                 fa2_ms=f"{c['exact_fa2_ms']:.3f}", fa3_ms=f"{c['exact_fa3_ms']:.3f}",
                 vs_fa2=f"{c['est_speedup_fa2']:.2f}x", vs_fa3=f"{c['est_speedup_fa3']:.2f}x") for c in report["calls"]]
    print_table(rows, list(rows[0]))
    print("\nValidation: bench/flash_attention.py's FlashAttention-2 kernel against published H100 figures")
    rows = [dict(shape="x".join(map(str, v["shape"])), published=v["tflops"], model=f"{v['est_tflops']:.0f}",
                 error=f"{100 * v['error']:+.0f}%", source=v["source"]) for v in report["validation"]]
    print_table(rows, list(rows[0]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 32])
    parser.add_argument("--methods", nargs="+", default=list(SPECS), choices=list(SPECS))
    parser.add_argument("--json", type=Path, default=RESULTS_DIR / "gpu_model.json")
    args = parser.parse_args(argv)
    import triton

    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
    start = time.perf_counter()
    report = build_report(args.methods, args.lengths, args.head_dims)
    report.update(triton=triton.__version__, torch=torch.__version__, seconds=round(time.perf_counter() - start, 1))
    print_report(report)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(_rounded(report), indent=1) + "\n")
    print(f"wrote {args.json} ({report['seconds']} s)")
    return 0


def _rounded(tree):
    """Estimates to 4 significant digits: more would claim a precision the model does not have."""
    if isinstance(tree, float):
        return float(f"{tree:.4g}")
    if isinstance(tree, dict):
        return {k: _rounded(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_rounded(v) for v in tree]
    return tree


if __name__ == "__main__":
    sys.exit(main())
