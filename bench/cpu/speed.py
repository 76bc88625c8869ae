"""CPU benchmark: exact attention against each approximate method, attention alone and end to
end, from 1k to 32k tokens, as ratios measured in one run.

    python -m clusterserve.bench.cpu.speed [--lengths 1024 4096 16384] [--repeats 3] [--no-e2e]

Attention alone runs on the q, k, v that the default model's first layer computes from real
text (1 x heads x N x head dim, float32: 12 x 64 for nomic-embed-text-v1.5). End to end embeds
one document of N tokens with the default model, at the lengths it accepts (nomic: up to
8192). Peak memory is the rise of the process's resident set during one call.
Prints a table, writes bench/results/cpu.json and bench/results/cpu.png.
"""

from __future__ import annotations

import argparse

import torch

from clusterserve.kernels import attention
from clusterserve.models import load_encoder

from ..common import MEASURED, capture_qkv, device_name, long_text_ids, peak_memory_during, print_table, write_results
from ..timing import median_ms

CPU = torch.device("cpu")



def main() -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-e2e", action="store_true", help="attention alone only")
    parser.add_argument("--name", default="cpu")
    args = parser.parse_args()

    torch.set_grad_enabled(False)
    encoder = load_encoder(None)
    rows = []
    for n in args.lengths:
        ids = long_text_ids(encoder, n)
        q, k, v = capture_qkv(encoder, ids)
        exact_out = None
        for label, spec in MEASURED.items():
            repeats = args.repeats if n <= 8192 else 1
            call = lambda spec=spec: attention(q, k, v, spec)  # noqa: E731
            out = call()
            exact_out = out if label == "full" else exact_out
            row = dict(
                kind="attention",
                method=label,
                seq_len=n,
                ms=median_ms(call, CPU, repeats, warmup=0),
                peak_bytes_per_token=peak_memory_during(call) / n,
                rel_err=((out - exact_out).norm() / exact_out.norm()).item(),
            )
            rows.append(row)
            print_table([row], list(row))
        if not args.no_e2e and n <= encoder.max_input_tokens:
            for label, spec in MEASURED.items():
                call = lambda spec=spec: encoder.embed([ids], spec)  # noqa: E731
                rows.append(
                    dict(
                        kind="embed",
                        method=label,
                        seq_len=n,
                        ms=median_ms(call, CPU, 1, warmup=0),
                        peak_bytes_per_token=peak_memory_during(call) / n,
                    )
                )
                print_table(rows[-1:], list(rows[-1]))
    _add_speedups(rows)
    print()
    print_table(rows, ["kind", "method", "seq_len", "ms", "speedup_vs_full", "peak_bytes_per_token", "rel_err"])
    meta = dict(device=device_name(), model=encoder.name, heads=q.shape[1], head_dim=q.shape[-1], dtype="float32",
                batch=1)
    path = write_results(args.name, rows, meta)
    _plot(rows, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")


def _add_speedups(rows: list[dict]) -> None:
    full = {(r["kind"], r["seq_len"]): r["ms"] for r in rows if r["method"] == "full"}
    for r in rows:
        r["speedup_vs_full"] = full[(r["kind"], r["seq_len"])] / r["ms"]


def _plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = sorted({r["kind"] for r in rows})
    fig, axes = plt.subplots(2, len(kinds), figsize=(6 * len(kinds), 8), squeeze=False)
    for col, kind in enumerate(kinds):
        for method in MEASURED:
            mine = (r for r in rows if r["kind"] == kind and r["method"] == method)
            pts = sorted((r["seq_len"], r["ms"], r["speedup_vs_full"]) for r in mine)
            if not pts:
                continue
            lengths, ms, speedup = zip(*pts)
            axes[0][col].loglog(lengths, ms, marker="o", label=method, base=2)
            axes[1][col].semilogx(lengths, speedup, marker="o", label=method, base=2)
        axes[0][col].set_title(f"{kind}: time (ms)")
        axes[1][col].set_title(f"{kind}: speed-up over full")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xlabel("tokens")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
