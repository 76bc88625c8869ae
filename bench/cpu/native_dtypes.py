"""The native backend on float32 against bfloat16 inputs: one layer's attention, best of
`repeats`, on one and on two threads.

    python -m clusterserve.bench.cpu.native_dtypes [--lengths 16384] [--repeats 3] [--runs 1] [--threads 1 2]

q, k, v are the default model's first layer on real text (1 x 12 heads x N x 32); the
bfloat16 run takes them rounded to bfloat16, the float32 run takes them as the model computed
them. `bf16_vs_upcast` is the largest difference between the bfloat16 output and the float32
path's output on the same bfloat16 values upcast (what the bfloat16 loops must reproduce, to
the output's rounding). With --runs R the whole measurement is made R times, a minute apart,
and each time is the lowest of the runs (on a shared machine, load from elsewhere only ever
adds time); every run's times are kept in the JSON. Prints a table, writes
bench/results/native-dtypes.json.
"""

from __future__ import annotations

import argparse
import time

import torch

from clusterserve.kernels import AttentionSpec, attention, native
from clusterserve.models import load_encoder
from clusterserve.models.timing import alternated_seconds

from ..common import capture_qkv, device_name, long_text_ids, print_table, write_results

SPECS = {
    "clustered 200": AttentionSpec(method="clustered", clusters=200, iterations=3, refine=2),
    "i-clustered 100/32": AttentionSpec(method="i-clustered", clusters=100, topk=32, iterations=3, refine=2),
    "smyrf 4x64": AttentionSpec(method="smyrf", hash_rounds=4, cluster_size=64),
}


def best_ms(calls: dict, repeats: int) -> dict[str, float]:
    """Best milliseconds of each call over `repeats` rounds; the calls alternate within a round,
    so that load from elsewhere on the machine falls on all of them alike (the caller has run
    each once already)."""
    times = alternated_seconds(calls, repeats, warm_up=False)
    return {name: 1000 * min(t) for name, t in times.items()}


def measure(inputs: dict, threads_list: list[int], repeats: int) -> list[dict]:
    """One run: per length and method, the float32 and bfloat16 times on each thread count."""
    rows = []
    for n, (q, k, v) in inputs.items():
        half = [t.to(torch.bfloat16) for t in (q, k, v)]
        upcast = [t.float() for t in half]
        for label, spec in SPECS.items():
            bf16_out = attention(*half, spec, backend="native")
            drift = (bf16_out.float() - attention(*upcast, spec, backend="native").to(torch.bfloat16).float()).abs().max()
            row = dict(method=label, seq_len=n, bf16_vs_upcast=drift.item())
            for threads in threads_list:
                torch.set_num_threads(threads)
                ms = best_ms(
                    {
                        "fp32": lambda spec=spec: attention(q, k, v, spec, backend="native"),
                        "bf16": lambda spec=spec: attention(*half, spec, backend="native"),
                    },
                    repeats,
                )
                row |= {f"fp32_ms_{threads}t": ms["fp32"], f"bf16_ms_{threads}t": ms["bf16"]}
                row[f"bf16_speedup_{threads}t"] = ms["fp32"] / ms["bf16"]
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--pause", type=float, default=60.0, help="seconds between runs")
    args = parser.parse_args()

    torch.set_grad_enabled(False)
    encoder = load_encoder(None)
    inputs = {n: capture_qkv(encoder, long_text_ids(encoder, n)) for n in args.lengths}
    runs = []
    for run in range(args.runs):
        if run:
            time.sleep(args.pause)
        runs.append(measure(inputs, args.threads, args.repeats))
        print_table(runs[-1], list(runs[-1][0]))
    rows = []
    for cells in zip(*runs):
        row = {key: min(cell[key] for cell in cells) if "_ms_" in key else value
               for key, value in cells[0].items()}
        for threads in args.threads:
            row[f"bf16_speedup_{threads}t"] = row[f"fp32_ms_{threads}t"] / row[f"bf16_ms_{threads}t"]
        row["runs_ms"] = [{key: cell[key] for key in cell if "_ms_" in key} for cell in cells]
        rows.append(row)
    print()
    print_table(rows, [key for key in rows[0] if key != "runs_ms"])
    meta = dict(device=device_name(), native_level=native.level(), bf16_dot=native.bf16_dot(), model=encoder.name,
                heads=12, head_dim=32, batch=1, repeats=args.repeats, runs=args.runs,
                timing="best of repeats, fp32 and bf16 alternating; the lowest of the runs")
    print(f"wrote {write_results('native-dtypes', rows, meta)}")


if __name__ == "__main__":
    main()
