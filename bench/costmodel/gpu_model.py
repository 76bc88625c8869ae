"""Offline cost model of the Triton pipelines on an H100 SXM (sm_90), with no GPU: an estimate
per launch and per call, and its ratio to exact attention (FlashAttention-2 and -3).

    python -m clusterserve.bench.costmodel.gpu_model [--lengths 4096 8192 16384 65536] [--head-dims 64 32] [--json PATH]

Every figure is an estimate. Per launch (recorded by bench.costmodel.gpu_static, compiled for sm_90):
programs and waves on 132 SMs; occupancy from registers, shared memory and warps (CTAs per SM);
the instructions the slowest program issues (SASS per loop x trip counts: bench.costmodel.sass,
bench.costmodel.trip_counts, bench.costmodel.loop_bounds giving the slowest program's data-dependent bounds)
priced by the unit that runs them (bench.costmodel.warp_cost); HBM and L2 bytes by working set; then

    est_us = launch + max(issue-bound, latency-bound, bandwidth-bound)

issue-bound: waves x warps per SMSP x one warp's busy cycles (bench.costmodel.warp_cost);
latency-bound: waves x one warp alone, issuing in order and waiting for its operands, a global
load's latency an L2 hit's or HBM's in the proportion of its bytes each serves;
bandwidth-bound: the longest of HBM bytes / HBM bandwidth, L2 bytes / L2 bandwidth, and L2
bytes / what the grid's SMs move (a grid under 132 programs leaves SMs idle).
Where loads hit: a first touch comes from HBM; a re-read misses the 50 MB L2 in the proportion
by which one wave's share of the launch's working set overflows it (where_loads_hit).
PyTorch ops of a call are priced as the kernels PyTorch launches for them (library_kernels:
a segmented sort is an index fill, a key copy and cub's radix passes of one CTA a segment).
Per call: the device's time in a CUDA graph plus one replay (the speed-ups), and op by op the
host's time per launch, library kernel and allocation against the device's. Exact attention is
FlashAttention-2 / -3 at their published H100 rates (FA2: Triton's, the faster FA2). The report
also validates the model: bench/costmodel/flash_attention.py's FlashAttention-2 kernel against published
H100 figures of Triton's fused attention. bench/README.md explains the model and its constants.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import torch

from clusterserve.kernels import AttentionSpec

from ..common import RESULTS_DIR, print_table, rounded, rows_json
from ..common import SPECS as CPU_SPECS
from . import warp_cost
from .launch_cost import (
    HBM_BYTES_PER_S,
    HBM_LATENCY,
    L2_BYTES,
    L2_BYTES_PER_S,
    LAUNCH_US,
    SM_BYTES_PER_CLK,
    SMS,
    bytes_us,
    estimate_launch,
    validate,
)
from .recording import HEADS, record_spec

# Host time (Python included): a Triton launch through its Python launcher (binding,
# specialisation key, cache look-up, cuLaunchKernel) and the attention() call's own Python around
# its launches, both fitted to the H100's eager calls at 4k (bench/results/h100-2026-11-26.json:
# five methods, 4 to 46 launches, host-bound, within 2%); a torch op through ATen's dispatch, a
# tensor from the caching allocator and one replay of a captured CUDA graph, modelled.
HOST_TRITON_LAUNCH_US = 31.0
HOST_CALL_US = 220.0
HOST_TORCH_OP_US = 6.0
HOST_ALLOCATION_US = 3.0
HOST_GRAPH_REPLAY_US = 10.0
HOST_SYNC_US = 10.0  # a device-to-host read: the host waits, the device idles until the next launch
# torch.sort along a dim longer than 4096: cub's segmented radix sort, one CTA per segment,
# RADIX_BITS digit bits a pass (cub's segmented policy), after an index fill and a key copy.
SORT_IN_SHARED_MAX, RADIX_BITS = 4096, 6

# Exact attention on an H100 80GB SXM5, forward, non-causal, bf16/fp16, head dim 64, TFLOP/s by
# sequence length (Shah et al. 2024, FlashAttention-3, arXiv:2407.08608, figure "Attention
# forward speed, head dim 64"; B x N = 16k). FA2 is the faster of the two FlashAttention-2 kernels
# there, Dao's CUDA one and Triton's fused attention (the kernel this model validates on: 400
# TFLOP/s at 4k, 403 at 16k); below 4k, where only the CUDA one is published, its curve scaled
# to Triton's 4k figure. Head dim 32 has no published figure: it uses d = 64's.
_FA2_CUDA = {512: 282, 1024: 306, 2048: 318, 4096: 321, 8192: 322, 16384: 324}
FA_TFLOPS = {"fa2": {n: max(tf, round(tf * 400 / 321)) if n < 4096 else {4096: 400, 8192: 401, 16384: 403}[n]
                     for n, tf in _FA2_CUDA.items()},
             "fa3": {512: 333, 1024: 392, 2048: 460, 4096: 476, 8192: 496, 16384: 497}}

# Pipeline stages, by kernel: the per-stage figures of the report.
STAGES = {"_hash_kernel": "hash", "_seed_means_kernel": "seed", "_hamming_initial_kernel": "k-means (Hamming)",
          "_hamming_assign_kernel": "k-means (Hamming)", "_hamming_update_kernel": "k-means (Hamming)",
          "_hamming_step_kernel": "k-means (Hamming)",
          "_sums_kernel": "refine (queries)", "_means_kernel": "refine (queries)",
          "_candidates_kernel": "refine (queries)", "_means_candidates_kernel": "refine (queries)",
          "_donor_kernel": "refine (queries)",
          "_nearest_kernel": "refine (queries)", "_centroid_attention_kernel": "centroid attention",
          "_centroid_combine_kernel": "centroid attention", "_centroid_topk_kernel": "top-k",
          "_centroid_topk_combine_kernel": "top-k", "_layout_counts_kernel": "layout",
          "_layout_scatter_kernel": "layout",
          "_broadcast_kernel": "broadcast / sparse", "_improved_tile_kernel": "broadcast / sparse",
          "_smyrf_norms_kernel": "smyrf hash", "_smyrf_hash_kernel": "smyrf hash",
          "_smyrf_attention_kernel": "smyrf attention"}

# What the report covers: the methods' defaults (AttentionSpec's, which service.settings serves;
# i-clustered starts from the seed queries, clustered from LSH codes) with only the knobs the
# label names changed.
SPECS = {
    "clustered 100": AttentionSpec(method="clustered", clusters=100),
    "i-clustered 100/32 (paper)": CPU_SPECS["i-clustered (paper)"],  # 10 Hamming iterations, no refinement
    "i-clustered 100/32": AttentionSpec(method="i-clustered", clusters=100, topk=32),  # the seeds, 2 steps
    # other starts and Lloyd counts: the fidelity points docs/methods.md measures on the default
    # model (bench/results/seeding-*.json), and the 5 Hamming iterations that the H100 runs'
    # "(default)" rows ran
    "i-clustered 100/32 (Hamming start)": AttentionSpec(method="i-clustered", clusters=100, topk=32, bits=63),
    "i-clustered 100/32 (5 iterations)": AttentionSpec(method="i-clustered", clusters=100, topk=32, iterations=5),
    "clustered 100 (5 iterations)": AttentionSpec(method="clustered", clusters=100, iterations=5),
    "i-clustered 100/32 (Hamming start, refine 2)": AttentionSpec(method="i-clustered", clusters=100, topk=32,
                                                                    bits=63, refine=2),
    "i-clustered 100/32 (Hamming start, refine 1)": AttentionSpec(method="i-clustered", clusters=100, topk=32,
                                                                    bits=63, refine=1),
    "i-clustered 100/32 (refine 3)": AttentionSpec(method="i-clustered", clusters=100, topk=32, refine=3),
    "smyrf 4x64": AttentionSpec(method="smyrf", hash_rounds=4, cluster_size=64),
    "clustered 200": AttentionSpec(method="clustered", clusters=200),
    # more clusters than one tile with Hamming iterations: the assign and update launches
    "clustered 200 (5 iterations)": AttentionSpec(method="clustered", clusters=200, iterations=5),
    "clustered 400": AttentionSpec(method="clustered", clusters=400),
    "clustered 1600": AttentionSpec(method="clustered", clusters=1600),
    "i-clustered 200/32": AttentionSpec(method="i-clustered", clusters=200, topk=32),
    "i-clustered 400/64": AttentionSpec(method="i-clustered", clusters=400, topk=64),
    # a local band, the chosen far blocks and a pooled far field, at its defaults
    "banded": AttentionSpec(method="banded"),
    "banded (pooled)": AttentionSpec(method="banded", far_blocks=0),
    "nomic default": CPU_SPECS["banded"],  # what auto serves the default model at 8k
    # bench.common's SPECS, the paper's 10 Hamming iterations: the configurations the H100 run
    # measured, which bench.costmodel.gpu_validation sets beside their estimates (its paper row is above)
    "clustered 100 (10 iterations)": CPU_SPECS["clustered"],
    "i-clustered 100/32 (10 iterations)": CPU_SPECS["i-clustered"],
}


def library_kernels(name: str, read: int, written: int, shapes: list) -> list[tuple[str, float]]:
    """The kernels PyTorch's CUDA backend launches for one op of the call, each (name, est_us).

    sort / argsort along a dim of n > 4096 (the recorded calls' case): an index fill, a copy of
    the keys, then cub's segmented radix sort, ceil(key bits / RADIX_BITS) passes of one CTA per
    segment, each pass reading the keys for its digit counts and keys and values again to
    scatter them (keys float32, values int64); n <= 4096: one sort in shared memory a segment.
    topk: radix selection over the input, 4 digit passes of two kernels, a gather, a sort of the
    k results. cumsum: one scan. Fills, copies and element-wise ops: one kernel at their bytes."""
    base = name.removesuffix("_")
    shape = shapes[0] if shapes else ()
    if base in ("sort", "argsort") and shape:
        n = shape[-1]
        segments = math.prod(shape[:-1])
        key, value = read / max(segments * n, 1), 8
        if n <= SORT_IN_SHARED_MAX:
            return [("sort in shared memory", LAUNCH_US + bytes_us(read + written, segments))]
        passes = math.ceil(8 * key / RADIX_BITS)
        waves = math.ceil(segments / SMS)
        per_pass = waves * 1e6 * n * (key + 2 * (key + value)) / (SM_BYTES_PER_CLK * warp_cost.CLOCK_HZ)
        return ([("index fill", LAUNCH_US + bytes_us(segments * n * value)),
                 ("key copy", LAUNCH_US + bytes_us(2 * read))]
                + [(f"segmented radix pass {i + 1}/{passes}", LAUNCH_US + per_pass) for i in range(passes)])
    if base == "topk" and shape:
        kernels = [(f"radix select {i // 2 + 1}/4", LAUNCH_US + bytes_us(read)) for i in range(8)]
        return kernels + [("gather", LAUNCH_US + bytes_us(read + written)),
                          ("sort of the k", LAUNCH_US + bytes_us(2 * written))]
    return [(base, LAUNCH_US + bytes_us(read + written))]


def host_us(launches: int, torch_kernels: int, allocations: int, syncs: int) -> float:
    """The host's time for one call issued op by op (no CUDA graph)."""
    return (HOST_CALL_US + launches * HOST_TRITON_LAUNCH_US + torch_kernels * HOST_TORCH_OP_US + allocations * HOST_ALLOCATION_US
            + syncs * HOST_SYNC_US)


def exact_ms(n: int, head_dim: int, heads: int = HEADS, batch: int = 1, which: str = "fa2") -> float:
    """Exact attention's time from FlashAttention's published H100 throughput at the nearest
    published length (16k beyond it): 4 B H N^2 d FLOPs."""
    table = FA_TFLOPS[which]
    length = min(table, key=lambda m: abs(math.log2(m) - math.log2(n)))
    return 1e3 * 4 * batch * heads * n * n * head_dim / (table[length] * 1e12)


def estimate_call(label: str, spec: AttentionSpec, n: int, head_dim: int, dtype: torch.dtype = torch.bfloat16,
                  capability: int = 90) -> dict:
    """Per launch and per call: the estimate of one attention() call on (1, 12, n, head_dim).

    device_ms: the launches and the library kernels back to back. In a CUDA graph the call is
    the device's time plus one replay (graph_ms); op by op (eager_ms) the host issues every
    launch, op and allocation, and the device waits whenever the host is behind: the longer
    of the two, plus a sync's wait each. The speed-ups are graph_ms's (the service replays
    captured graphs for batches up to cuda_graph_max_length, 8192 tokens, and runs longer ones
    op by op: eager_speedup_fa2 is theirs)."""
    ops: list = []
    launches, counts = record_spec(spec, n, head_dim, dtype, ops=ops)
    rows = [estimate_launch(launch, capability) for launch in launches]
    library = [(op[0], library_kernels(*op)) for op in ops]
    device_us = sum(r.est_us for r in rows) + sum(us for _, kernels in library for _, us in kernels)
    host = host_us(len(launches), sum(len(kernels) for _, kernels in library), counts["allocations"], counts["syncs"])
    graph_ms = (device_us + HOST_GRAPH_REPLAY_US) / 1e3
    # Op by op the device starts after the first launch is issued and ends after the last one runs.
    first_us = HOST_TRITON_LAUNCH_US if launches else HOST_TORCH_OP_US
    last_us = rows[-1].est_us if rows else 0.0
    eager_ms = (max(first_us + device_us, host + last_us) + counts["syncs"] * HOST_SYNC_US) / 1e3
    stages: dict = {}
    for r in rows:
        stage = STAGES.get(r.kernel, r.kernel)
        stages[stage] = stages.get(stage, 0.0) + r.est_us
    for name, kernels in library:
        stage = "smyrf sort" if "sort" in name and spec.method == "smyrf" else f"torch {name}"
        stages[stage] = stages.get(stage, 0.0) + sum(us for _, us in kernels)
    fa2, fa3 = exact_ms(n, head_dim), exact_ms(n, head_dim, which="fa3")
    launch_rows = [dict(asdict(r), bound=r.bound) for r in rows]
    return dict(method=label, spec=spec.used_knobs(), seq_len=n,
                head_dim=head_dim, dtype=str(dtype).removeprefix("torch."), launches=launch_rows,
                kernels=kernel_totals(launch_rows),
                torch_ops=[dict(op=name, kernels=len(kernels), us=sum(us for _, us in kernels),
                                parts=[dict(kernel=k, us=us) for k, us in kernels]) for name, kernels in library],
                triton_launches=len(launches), library_kernels=sum(len(k) for _, k in library),
                allocations=counts["allocations"], syncs=counts["syncs"], stages_us=stages,
                device_ms=device_us / 1e3, host_eager_ms=host / 1e3, graph_ms=graph_ms, eager_ms=eager_ms,
                graph_host_share=HOST_GRAPH_REPLAY_US / 1e3 / graph_ms,
                est_ms=graph_ms, exact_fa2_ms=fa2, exact_fa3_ms=fa3,
                est_speedup_fa2=fa2 / graph_ms, est_speedup_fa3=fa3 / graph_ms,
                eager_speedup_fa2=fa2 / eager_ms)


def kernel_totals(launches: list[dict]) -> dict[str, dict]:
    """A call's launches by kernel, in the order each first runs: its launches and their
    estimated µs in all."""
    totals: dict[str, dict] = {}
    for launch in launches:
        row = totals.setdefault(launch["kernel"], dict(launches=0, est_us=0.0))
        row["launches"] += 1
        row["est_us"] += launch["est_us"]
    return totals


# ---- the report ---------------------------------------------------------------------------------


def build_report(labels: list[str], lengths: list[int], head_dims: list[int]) -> dict:
    calls, failed = [], []
    for d in head_dims:
        for n in lengths:
            for label in labels:
                try:
                    calls.append(estimate_call(label, SPECS[label], n, d))
                except Exception as error:  # noqa: BLE001 - a kernel that does not compile is the finding
                    message = str(error).strip().splitlines()
                    failed.append(dict(method=label, seq_len=n, head_dim=d, error=f"{type(error).__name__}: "
                                       f"{(message[-1] if message else '')[:300]}"))
    validation = validate()
    errors = [abs(v["error"]) for v in validation]
    return dict(label="estimate, sm_90 offline, no GPU", device="H100 SXM5 (modelled)", batch=1, heads=HEADS,
                dtype="bfloat16", constants=dict(
                    sms=SMS, clock_hz=warp_cost.CLOCK_HZ, hbm_bytes_per_s=HBM_BYTES_PER_S,
                    l2_bytes_per_s=L2_BYTES_PER_S, l2_bytes=L2_BYTES, sm_bytes_per_clk=SM_BYTES_PER_CLK,
                    hbm_latency_cycles=HBM_LATENCY, launch_us=LAUNCH_US, host_call_us=HOST_CALL_US,
                    host_triton_launch_us=HOST_TRITON_LAUNCH_US,
                    host_torch_op_us=HOST_TORCH_OP_US, host_allocation_us=HOST_ALLOCATION_US,
                    host_graph_replay_us=HOST_GRAPH_REPLAY_US, host_sync_us=HOST_SYNC_US,
                    latency_cycles=warp_cost.LATENCY, exact_tflops=FA_TFLOPS),
                validation=validation, validation_error=dict(mean_abs=sum(errors) / len(errors), max_abs=max(errors)),
                calls=calls, failed=failed)


def print_report(report: dict) -> None:
    print("Estimates (sm_90 offline, no GPU; H100 SXM5 modelled): B = 1, 12 heads, bfloat16; exact = "
          "FlashAttention-2 / -3 at their published H100 throughput (FA2: Triton's, the faster)")
    for call in report["calls"]:
        if call["head_dim"] != 64 or call["method"] not in list(SPECS)[:5]:
            continue
        print(f"\n{call['method']} at {call['seq_len']} tokens, d = {call['head_dim']}: est {call['graph_ms']:.3f} ms "
              f"in a CUDA graph ({call['est_speedup_fa2']:.2f}x FA2, {call['est_speedup_fa3']:.2f}x FA3), "
              f"{call['eager_ms']:.3f} ms op by op ({call['eager_speedup_fa2']:.2f}x FA2; host "
              f"{call['host_eager_ms']:.3f} ms for {call['triton_launches']} launches, {call['library_kernels']} "
              f"library kernels, {call['allocations']} allocations); graph replay {100 * call['graph_host_share']:.1f}%")
        rows = [dict(kernel=r["kernel"].removeprefix("_").removesuffix("_kernel"), programs=r["programs"],
                     warps=r["warps"], regs=r["registers"], resident=r["blocks_per_sm"], waves=f"{r['waves']:.2f}",
                     instr=f"{r['instructions']:.3g}", ws_MB=f"{r['working_set_bytes'] / 1e6:.1f}",
                     hbm_MB=f"{r['hbm_bytes'] / 1e6:.1f}", from_hbm=f"{r['hbm_fraction']:.2f}",
                     issue_us=f"{r['issue_us']:.1f}", latency_us=f"{r['latency_us']:.1f}",
                     bw_us=f"{r['bandwidth_us']:.1f}", est_us=f"{r['est_us']:.1f}", bound=r["bound"])
                for r in call["launches"]]
        rows += [dict(kernel=f"torch {op['op']} ({op['kernels']} kernels)", est_us=f"{op['us']:.1f}")
                 for op in call["torch_ops"]]
        print_table(rows, list(rows[0]))
    print("\nPer stage (est us, in a CUDA graph)")
    rows = [dict(method=c["method"], seq_len=c["seq_len"], d=c["head_dim"],
                 stages="  ".join(f"{k} {v:.0f}" for k, v in c["stages_us"].items()))
            for c in report["calls"] if c["head_dim"] == 64]
    if rows:
        print_table(rows, list(rows[0]))
    print("\nPer call")
    rows = [dict(method=c["method"], seq_len=c["seq_len"], d=c["head_dim"], graph_ms=f"{c['graph_ms']:.3f}",
                 eager_ms=f"{c['eager_ms']:.3f}", fa2_ms=f"{c['exact_fa2_ms']:.3f}", fa3_ms=f"{c['exact_fa3_ms']:.3f}",
                 vs_fa2=f"{c['est_speedup_fa2']:.2f}x", vs_fa3=f"{c['est_speedup_fa3']:.2f}x",
                 eager_vs_fa2=f"{c['eager_speedup_fa2']:.2f}x", graph_host=f"{100 * c['graph_host_share']:.1f}%")
            for c in report["calls"]]
    if rows:
        print_table(rows, list(rows[0]))
    print("\nValidation: bench/costmodel/flash_attention.py's FlashAttention-2 kernel against published H100 figures")
    rows = [dict(shape="x".join(map(str, v["shape"])), published=v["tflops"], model=f"{v['est_tflops']:.0f}",
                 error=f"{100 * v['error']:+.0f}%", bound=v["bound"], source=v["source"]) for v in report["validation"]]
    if rows:
        print_table(rows, list(rows[0]))
    error = report["validation_error"]
    print(f"validation error: mean |error| {100 * error['mean_abs']:.0f}%, max {100 * error['max_abs']:.0f}%")
    for f in report["failed"]:
        print(f"NOT ESTIMATED: {f['method']} at {f['seq_len']} tokens, d = {f['head_dim']}: {f['error']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 65536])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64], help="64: the published FlashAttention figures'")
    parser.add_argument("--methods", nargs="+", default=list(SPECS), choices=list(SPECS))
    parser.add_argument("--json", type=Path, default=RESULTS_DIR / "gpu_model.json")
    parser.add_argument("--detail", action="store_true",
                        help="keep every launch's figures and loops, and each PyTorch op's kernels, in the JSON")
    args = parser.parse_args(argv)
    import triton

    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
    start = time.perf_counter()
    report = build_report(args.methods, args.lengths, args.head_dims)
    report.update(triton=triton.__version__, torch=torch.__version__, seconds=round(time.perf_counter() - start, 1))
    print_report(report)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(rows_json(rounded(report if args.detail else compact(report))) + "\n")
    print(f"wrote {args.json} ({report['seconds']} s)")
    return 0


def compact(report: dict) -> dict:
    """The report as committed: each call's kernels (kernel_totals) and PyTorch ops by their
    totals, without the launch-by-launch figures and loops (what --detail keeps and the
    command prints)."""
    calls = [{key: value for key, value in call.items() if key != "launches"}
             | dict(torch_ops=[{key: value for key, value in op.items() if key != "parts"} for op in call["torch_ops"]])
             for call in report["calls"]]
    return dict(report, calls=calls)


if __name__ == "__main__":
    sys.exit(main())
