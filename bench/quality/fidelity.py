"""Fidelity of each attention method on real long text: cosine of its document embedding to
the exact-attention embedding of the same document, per length and knob setting.

    python -m clusterserve.bench.quality.fidelity [--model all-MiniLM-L6-v2] [--lengths 2048 8192] [--docs 2] [--quick]

Prints a table, writes bench/results/fidelity-cpu.json and bench/results/fidelity-cpu.png.
"""

from __future__ import annotations

import argparse
import time

import torch

from clusterserve.kernels import AttentionSpec
from clusterserve.models import load_encoder

from ..common import device_name, long_text_ids, print_table, write_results

# (method, knobs) to measure; the first rows are the paper's setting (100 clusters, top-32, 10
# Hamming iterations, no refinement), the defaults (no Hamming iteration, 3 refinement steps), and
# their refinement, iteration and cluster-count variants.
GRID = [
    ("i-clustered", dict(clusters=100, topk=32, iterations=10, refine=0)),
    ("i-clustered", dict(clusters=100, topk=32, refine=3)),
    ("i-clustered", dict(clusters=100, topk=32, iterations=5, refine=3)),
    ("i-clustered", dict(clusters=100, topk=32, refine=1)),
    ("i-clustered", dict(clusters=100, topk=32, refine=5)),
    ("i-clustered", dict(clusters=200, topk=32, iterations=10, refine=0)),
    ("i-clustered", dict(clusters=200, topk=32, refine=3)),
    ("i-clustered", dict(clusters=100, topk=64, refine=3)),
    ("clustered", dict(clusters=100, iterations=10, refine=0)),
    ("clustered", dict(clusters=100, refine=3)),
    ("clustered", dict(clusters=100, iterations=5, refine=3)),
    ("clustered", dict(clusters=200, refine=3)),
    ("smyrf", dict(hash_rounds=4, cluster_size=64)),
    ("smyrf", dict(hash_rounds=8, cluster_size=64)),
    ("smyrf", dict(hash_rounds=4, cluster_size=128)),
]


def main() -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--docs", type=int, default=2, help="documents (text offsets) per length")
    parser.add_argument("--quick", action="store_true", help="only the first rows of the grid")
    parser.add_argument("--model", default="all-MiniLM-L6-v2", help="a path or name for models.load_encoder")
    parser.add_argument("--name", default="fidelity-cpu")
    args = parser.parse_args()

    torch.set_grad_enabled(False)
    encoder = load_encoder(args.model)
    grid = GRID[:3] if args.quick else GRID
    rows = []
    for n in args.lengths:
        docs = [long_text_ids(encoder, n, offset=3000 * d) for d in range(args.docs)]
        start = time.perf_counter()
        exact = encoder.embed(docs, AttentionSpec(method="full"), max_batch_tokens=n)
        exact_s = (time.perf_counter() - start) / len(docs)
        for method, knobs in grid:
            spec = AttentionSpec(method=method, **knobs)
            start = time.perf_counter()
            approx = encoder.embed(docs, spec, max_batch_tokens=n)
            seconds = (time.perf_counter() - start) / len(docs)
            cosines = torch.nn.functional.cosine_similarity(approx, exact, dim=-1)
            rows.append(
                dict(
                    seq_len=n,
                    method=method,
                    knobs=_knobs(knobs),
                    cosine_mean=cosines.mean().item(),
                    cosine_min=cosines.min().item(),
                    seconds=seconds,
                    speedup_vs_full=exact_s / seconds,
                )
            )
            print_table(rows[-1:], list(rows[-1]))
    print()
    print_table(rows, ["seq_len", "method", "knobs", "cosine_mean", "cosine_min", "seconds", "speedup_vs_full"])
    meta = dict(device=device_name(), model=encoder.name, docs=args.docs, text="Debian common-licenses")
    path = write_results(args.name, rows, meta)
    _plot(rows, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")


def _knobs(knobs: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in knobs.items())


def _plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["seq_len"] for r in rows})
    fig, axes = plt.subplots(1, len(lengths), figsize=(6 * len(lengths), 4.5), squeeze=False)
    markers = {"clustered": "s", "i-clustered": "o", "smyrf": "^"}
    for ax, n in zip(axes[0], lengths):
        for r in (r for r in rows if r["seq_len"] == n):
            ax.scatter(r["speedup_vs_full"], r["cosine_mean"], marker=markers[r["method"]])
            ax.annotate(f"{r['method']} {r['knobs']}", (r["speedup_vs_full"], r["cosine_mean"]), fontsize=6)
        ax.set_title(f"{n} tokens")
        ax.set_xlabel("speed-up over exact (embedding)")
        ax.set_ylabel("cosine to exact embedding")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
