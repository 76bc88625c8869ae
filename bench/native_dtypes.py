"""The native backend on float32 against bfloat16 inputs: one layer's attention, best of
`repeats`, on one and on two threads.

    python -m bench.native_dtypes [--lengths 16384] [--repeats 3] [--threads 1 2]

q, k, v are the default model's first layer on real text (1 x 12 heads x N x 32); the
bfloat16 run takes them rounded to bfloat16, the float32 run takes them as the model computed
them. `bf16_vs_upcast` is the largest difference between the bfloat16 output and the float32
path's output on the same bfloat16 values upcast (what the bfloat16 loops must reproduce, to
the output's rounding). Prints a table, writes bench/results/native-dtypes.json.
"""

from __future__ import annotations

import argparse
import time

import torch

from kernels import AttentionSpec, attention, native
from models import load_encoder

from .common import capture_qkv, device_name, long_text_ids, print_table, write_results

SPECS = {
    "clustered 200": AttentionSpec(method="clustered", clusters=200, iterations=3, refine=2),
    "i-clustered 100/32": AttentionSpec(method="i-clustered", clusters=100, topk=32, iterations=3, refine=2),
    "smyrf 4x64": AttentionSpec(method="smyrf", hash_rounds=4, cluster_size=64),
}


def best_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - start))
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()

    torch.set_grad_enabled(False)
    encoder = load_encoder(None)
    rows = []
    for n in args.lengths:
        q, k, v = capture_qkv(encoder, long_text_ids(encoder, n))
        half = [t.to(torch.bfloat16) for t in (q, k, v)]
        upcast = [t.float() for t in half]
        for label, spec in SPECS.items():
            bf16_out = attention(*half, spec, backend="native")
            drift = (bf16_out.float() - attention(*upcast, spec, backend="native").to(torch.bfloat16).float()).abs().max()
            row = dict(method=label, seq_len=n, bf16_vs_upcast=drift.item())
            for threads in args.threads:
                torch.set_num_threads(threads)
                f32 = best_ms(lambda spec=spec: attention(q, k, v, spec, backend="native"), args.repeats)
                bf16 = best_ms(lambda spec=spec: attention(*half, spec, backend="native"), args.repeats)
                row |= {f"fp32_ms_{threads}t": f32, f"bf16_ms_{threads}t": bf16, f"bf16_speedup_{threads}t": f32 / bf16}
            rows.append(row)
            print_table([row], list(row))
    print()
    print_table(rows, list(rows[0]))
    meta = dict(device=device_name(), native_level=native.level(), model=encoder.name, heads=12, head_dim=32, batch=1,
                repeats=args.repeats, timing="best of repeats")
    print(f"wrote {write_results('native-dtypes', rows, meta)}")


if __name__ == "__main__":
    main()
