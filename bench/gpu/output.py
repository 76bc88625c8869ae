"""bench.gpu.speed's output: the JSON files, the printed tables, the plot, a line per measurement."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..common import print_table
from .settings import Settings


def write_outputs(settings: Settings, rows: list[dict], stage_rows: list[dict], profile: list[str]) -> list[Path]:
    settings.out.mkdir(parents=True, exist_ok=True)
    main = settings.out / f"{settings.stem}.json"
    main.write_text(json.dumps(rows, indent=1) + "\n")
    paths = [main]
    if stage_rows:
        stages = settings.out / f"{settings.stem}-stages.json"
        stages.write_text(json.dumps(stage_rows, indent=1) + "\n")
        paths.append(stages)
    if profile:
        text = settings.out / f"{settings.stem}-profile.txt"
        text.write_text("\n\n".join(profile) + "\n")
        paths.append(text)
    return paths


def print_tables(rows: list[dict], stage_rows: list[dict]) -> None:
    shown = [
        dict(kind=r["kind"], method=r["method"], seq_len=r["seq_len"], head_dim=r["head_dim"], dtype=r["dtype"],
             ms=r["ms"], graph_ms=r["graph_ms"], speedup_vs_full=r["speedup_vs_full"],
             peak_MiB=r["peak_bytes"] / 2**20, peak_B_per_token=r["peak_bytes"] / r["seq_len"], rel_err=r["rel_err"])
        for r in rows
    ]
    print()
    print_table(shown, list(shown[0]) if shown else [])
    if stage_rows:
        print()
        columns = ["method", "seq_len", "head_dim", "stage", "ms", "share_of_call", "torch_ops", "triton_launches"]
        print_table(stage_rows, columns)


def plot(rows: list[dict], path: Path) -> None:
    """Time and speed-up over full against length: one column per (kind, head dim)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["kind"], r["head_dim"]) for r in rows}, key=lambda g: (g[0], -g[1]))
    if not groups:
        return
    fig, axes = plt.subplots(2, len(groups), figsize=(6 * len(groups), 8), squeeze=False)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    for col, (kind, head_dim) in enumerate(groups):
        for method in methods:
            pts = sorted((r["seq_len"], r["ms"], r["speedup_vs_full"], r["graph_ms"]) for r in rows
                         if (r["kind"], r["head_dim"], r["method"]) == (kind, head_dim, method))
            if not pts:
                continue
            lengths, ms, speedup, graph = zip(*pts)
            line, = axes[0][col].loglog(lengths, ms, marker="o", label=method, base=2)
            if all(g is not None for g in graph):
                axes[0][col].loglog(lengths, graph, ls="--", color=line.get_color(), base=2, label=f"{method} (graph)")
            axes[1][col].semilogx(lengths, [s or float("nan") for s in speedup], marker="o", label=method, base=2)
        axes[0][col].set_title(f"{kind}, head dim {head_dim}: time (ms)")
        axes[1][col].set_title(f"{kind}, head dim {head_dim}: speed-up over full")
        axes[1][col].axhline(1.0, color="grey", lw=0.8)
        for ax in axes[:, col]:
            ax.set_xlabel("tokens")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(f"{rows[0]['device']}, {rows[0]['dtype']}, batch 1", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def progress(row: dict) -> str:
    graph = f" graph {row['graph_ms']:.3f} ms" if row.get("graph_ms") is not None else ""
    err = f" rel_err {row['rel_err']:.3g}" if row.get("rel_err") is not None else ""
    return (f"{row['kind']:9s} {row['method']:20s} N={row['seq_len']:6d} d={row['head_dim']:3d} "
            f"{row['ms']:9.3f} ms{graph} peak {row['peak_bytes'] / 2**20:8.1f} MiB{err}")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
