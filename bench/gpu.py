"""GPU benchmark: exact attention (SDPA) against clustered, improved clustered and
SMYRF attention through the Triton backend, from 1k to 64k tokens, with a per-stage breakdown
and end-to-end embedding times, as ratios measured in one run.

    python -m clusterserve.bench.gpu [--lengths 1024 ... 65536] [--head-dims 64 32] [--repeats 10]
    python -m clusterserve.bench.gpu --dry-run      # the same script on CPU under TRITON_INTERPRET=1, tiny sizes

Attention alone: B = 1, 12 heads, bfloat16, for each head dim. Q, K, V are the default
model's own projections of real text (Debian's license texts): at the model's head dim (32)
they are its layer 0 as is; at 64 each head concatenates that head's 32-dim projections from
layers 0 and 1 (so its logits are the sum of two real heads' logits, scaled by 1/sqrt(64)).
Times are medians of CUDA-event times after warm-up, each repeat from an idle GPU (the
latency a caller sees); `graph_ms` is the same call replayed from a CUDA graph (no launch
gaps). rel_err is |out - exact| / |exact| (Frobenius), exact = float32 attention on the same
bfloat16 inputs, so the `full` row shows bfloat16's own error. peak_bytes is the CUDA
allocator's peak above what was allocated before the call.

Stage breakdown: the backend's stage functions timed one by one (bench/stages.py), with the
torch ops and Triton launches each makes. End to end: one document of 512, 4k, 16k and 32k
tokens embedded by the default model on the GPU, per method: `ms` with every layer run
eagerly on the unpadded input, `graph_ms` with the layers replayed from the encoder's CUDA
graphs (models.runtime.graphs; after the eager warm-up and the capture call; None above
cuda_graph_max_length), and `graph_cosine`, the cosine between the two vectors.

Writes under --out (default bench/results/): <date>-<gpu>.json, a list of rows
{"method", "seq_len", "batch", "heads", "head_dim", "dtype", "ms", "speedup_vs_full",
"peak_bytes", "rel_err", "device"} (plus "kind": attention | embed, and extras);
<date>-<gpu>-stages.json; <date>-<gpu>.png (time and speed-up against length); with
--profile-lengths, <date>-<gpu>-profile.txt (one call per method at each of those lengths,
attention alone and end to end, eager). Prints the tables. The JSON is rewritten after
every length, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from clusterserve.kernels import AttentionSpec, attention

from .common import (
    RESULTS_DIR,
    device_name,
    eager_layers,
    exact_attention,
    long_text_ids,
    peak_memory_during,
    print_table,
    real_qkv,
    rel_err,
)
from .cpu import MEASURED

# bench.cpu's methods (the paper's 10 Hamming iterations), and the clustered methods as served.
SPECS = MEASURED

# The sizes measured; --dry-run swaps in DRY_RUN's.
LENGTHS = [1024, 2048, 4096, 8192, 16384, 32768, 65536]
E2E_LENGTHS = [512, 4096, 16384, 32768]
DRY_RUN = dict(lengths=[64], e2e_lengths=[64], heads=2, repeats=1, warmup=0, e2e_repeats=1)


def dry_run_spec(spec: AttentionSpec) -> AttentionSpec:
    """The knobs scaled down so that Triton's interpreter runs a method in well under a second
    (100 clusters would make 64 tokens one query per cluster, and take ~10 s)."""
    return dataclasses.replace(
        spec, clusters=4, topk=8, iterations=min(spec.iterations, 2), refine=min(spec.refine, 1), hash_rounds=2,
        cluster_size=16, band=min(spec.band, 1), block=8, sinks=min(spec.sinks, 2), far_blocks=min(spec.far_blocks, 2),
    )


@dataclass(frozen=True)
class Settings:
    """What one run measures and where; built once from the command line."""

    device: torch.device
    dtype: torch.dtype
    heads: int
    head_dims: tuple[int, ...]
    lengths: tuple[int, ...]
    e2e_lengths: tuple[int, ...]
    e2e_dtype: torch.dtype
    repeats: int
    warmup: int
    e2e_repeats: int
    stages: bool
    graphs: bool
    graph_max_length: int | None  # the encoder's cuda_graph_max_length; None: the loader's default
    profile_lengths: tuple[int, ...]
    specs: dict[str, AttentionSpec]
    model: str | None
    out: Path
    stem: str
    dry_run: bool

    @property
    def device_label(self) -> str:
        return device_name()


# ---- attention alone -------------------------------------------------------------------------


def bench_attention(settings: Settings, encoder, n: int, rows: list, stage_rows: list, profile: list) -> None:
    """Every method on the model's q, k, v of n tokens of real text, per head dim: appends a
    row per method to `rows`, stage rows to `stage_rows`, profiler tables to `profile`."""
    ids = long_text_ids(encoder, n)
    for head_dim in settings.head_dims:
        q, k, v = real_qkv(encoder, ids, head_dim, settings.heads, settings.dtype)
        scale = 1.0 / math.sqrt(head_dim)
        exact = exact_attention(q, k, v, None, scale)
        group = []
        for label, spec in settings.specs.items():
            def call(spec=spec):
                return attention(q, k, v, spec, scale=scale, backend="triton")

            out = call()  # compiles, and the row's error
            row = dict(
                kind="attention", method=label, seq_len=n, batch=1, heads=settings.heads, head_dim=head_dim,
                dtype=_name(settings.dtype), ms=_time(settings, call), graph_ms=_graph_ms(settings, call, out),
                speedup_vs_full=None, peak_bytes=int(peak_memory_during(call)), rel_err=rel_err(out, exact),
                device=settings.device_label, spec=spec.used_knobs(),
                backend="sdpa" if spec.method == "full" else "triton",
            )
            group.append(row)
            print(_progress(row), flush=True)
            if settings.stages:
                stage_rows += _stage_rows(settings, q, k, v, spec, scale, out, row)
            if n in settings.profile_lengths and head_dim == settings.head_dims[0]:
                profile.append(_profile(settings, f"{label}, {n} tokens", call))
            del out
        _speedups(group)
        rows += group


def _time(settings: Settings, fn) -> float:
    from .timing import median_ms

    return median_ms(fn, settings.device, settings.repeats, settings.warmup)


def _graph_ms(settings: Settings, fn, eager: Tensor) -> float | None:
    """Replay time of fn from a CUDA graph; None on CPU, with --no-graphs, or when capture
    fails (the failure is printed: it means a host sync or a capture-unsafe op)."""
    if settings.device.type != "cuda" or not settings.graphs:
        return None
    from .timing import capture_graph, median_ms

    try:
        graph, out = capture_graph(fn, settings.device)
    except Exception as error:  # noqa: BLE001 - reported, and the eager time stands
        print(f"  CUDA graph capture failed: {type(error).__name__}: {error}", flush=True)
        return None
    ms = median_ms(graph.replay, settings.device, settings.repeats, settings.warmup)
    if not torch.equal(out, eager):
        print("  CUDA graph replay differs from the eager output", flush=True)
    del graph, out
    torch.cuda.empty_cache()
    return ms


def _stage_rows(settings: Settings, q, k, v, spec: AttentionSpec, scale: float, out: Tensor, row: dict) -> list[dict]:
    """Time and kernel counts of each stage of spec's method, plus their sum, as rows."""
    from .stages import count_stage_launches, same_as_backend, stage_plan, time_stages

    plan = stage_plan(q, k, v, spec, scale)
    if not same_as_backend(plan, out):
        print(f"  WARNING: the stages of {row['method']} do not reproduce the backend's output", flush=True)
    times = time_stages(plan, lambda fn: _time(settings, fn))
    launches = count_stage_launches(plan)
    total = row["ms"]
    result = []
    for stage in plan.stages:
        ms = times[stage.name]
        result.append(dict(
            method=row["method"], seq_len=row["seq_len"], heads=row["heads"], head_dim=row["head_dim"],
            dtype=row["dtype"], stage=stage.name, ms=ms, share_of_call=ms / total if total > 0 else None,
            **launches[stage.name], device=row["device"],
        ))
    result.append(dict(
        method=row["method"], seq_len=row["seq_len"], heads=row["heads"], head_dim=row["head_dim"],
        dtype=row["dtype"], stage="sum of stages", ms=sum(times.values()),
        share_of_call=sum(times.values()) / total if total > 0 else None,
        torch_ops=sum(r["torch_ops"] for r in result), triton_launches=sum(r["triton_launches"] for r in result),
        device=row["device"],
    ))
    return result


def _profile(settings: Settings, label: str, fn) -> str:
    """torch.profiler's table of one call (kernels by device time on CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = settings.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    fn()
    with profile(activities=activities) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize(settings.device)
    sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
    return f"== {label} ==\n" + prof.key_averages().table(sort_by=sort_by, row_limit=25)


def _speedups(group: list[dict]) -> None:
    full = next((r["ms"] for r in group if r["method"] == "full"), None)
    for r in group:
        r["speedup_vs_full"] = full / r["ms"] if full and r["ms"] > 0 else None


# ---- end to end ------------------------------------------------------------------------------


def bench_embed(settings: Settings, encoder, n: int, rows: list, profile: list) -> None:
    """One document of n tokens embedded by `encoder` (weights in e2e_dtype) per method, and at
    the profile length a profile of one eager call per method.
    On CPU (dry run) the model's attention takes the torch reference, as `auto` does there."""
    from .timing import median_ms

    ids = long_text_ids(encoder, n)
    group, exact = [], None
    for label, spec in settings.specs.items():
        def call(spec=spec):
            return encoder.embed([ids], spec, max_batch_tokens=n)

        with eager_layers(encoder):  # eager first: every layer launched
            vector = call()
            ms = median_ms(call, settings.device, settings.e2e_repeats, min(settings.warmup, 1))
            peak = int(peak_memory_during(call))
            if n in settings.profile_lengths:
                profile.append(_profile(settings, f"embed {label}, {n} tokens", call))
        graph_ms, graph_cosine = _embed_graph_ms(settings, encoder, call, len(ids), vector)
        exact = vector if spec.method == "full" else exact
        row = dict(
            kind="embed", method=label, seq_len=n, batch=1, heads=encoder.model.config.num_heads,
            head_dim=encoder.model.config.head_dim, dtype=_name(settings.e2e_dtype), ms=ms,
            graph_ms=graph_ms, graph_cosine=graph_cosine, speedup_vs_full=None, peak_bytes=peak,
            rel_err=rel_err(vector, exact) if exact is not None else None,
            cosine=torch.nn.functional.cosine_similarity(vector, exact).item() if exact is not None else None,
            device=settings.device_label, spec=spec.used_knobs(), backend="sdpa" if spec.method == "full" else "auto",
        )
        group.append(row)
        print(_progress(row), flush=True)
    _speedups(group)
    rows += group


def _embed_graph_ms(settings: Settings, encoder, call, tokens: int, eager: Tensor) -> tuple[float | None, float | None]:
    """Median ms of `call` with the encoder's layers replayed from CUDA graphs, and the cosine
    of its vector to the eager one; (None, None) without graphs (CPU, --no-graphs) or for an
    input longer than they take."""
    from .timing import median_ms

    graphs = encoder.graphs
    if graphs is None or not settings.graphs or not graphs.takes([tokens]):
        return None, None
    captured = graphs.counts["captured"]
    call()  # this batch shape's eager warm-up
    vector = call()  # captured, then replayed
    if graphs.counts["captured"] == captured:
        print(f"  CUDA graphs: nothing captured for {tokens} tokens (failed: {graphs.counts['failed']})", flush=True)
    ms = median_ms(call, settings.device, settings.e2e_repeats, 0)
    return ms, torch.nn.functional.cosine_similarity(vector, eager).item()


def load_model(settings: Settings, dtype: torch.dtype):
    """The model (embedded default or --model) on the device, with positions for the longest
    length asked (a learned table is extended by copying)."""
    from clusterserve.models import load_encoder

    longest = max((*settings.lengths, *settings.e2e_lengths, 32768))
    graphs = {} if settings.graph_max_length is None else {"cuda_graph_max_length": settings.graph_max_length}
    return load_encoder(settings.model, max_input_tokens=longest, device=settings.device, dtype=dtype, **graphs)


# ---- output ----------------------------------------------------------------------------------


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


def _progress(row: dict) -> str:
    graph = f" graph {row['graph_ms']:.3f} ms" if row.get("graph_ms") is not None else ""
    err = f" rel_err {row['rel_err']:.3g}" if row.get("rel_err") is not None else ""
    return (f"{row['kind']:9s} {row['method']:20s} N={row['seq_len']:6d} d={row['head_dim']:3d} "
            f"{row['ms']:9.3f} ms{graph} peak {row['peak_bytes'] / 2**20:8.1f} MiB{err}")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---- command line ----------------------------------------------------------------------------


def parse_settings(argv: list[str] | None = None) -> Settings:
    """The run's settings from the command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="*", help=f"attention lengths (default {LENGTHS})")
    parser.add_argument("--methods", nargs="+", choices=list(SPECS), default=list(SPECS),
                        help="methods to run (full always runs in the benchmark: speed-ups are over it)")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 32], help="multiples of the model's 32")
    parser.add_argument("--heads", type=int, help="heads (default 12, the model's)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--repeats", type=int, help="timed repeats per measurement (default 10)")
    parser.add_argument("--warmup", type=int, help="untimed calls before them (default 3)")
    parser.add_argument("--e2e-lengths", type=int, nargs="*",
                        help=f"document lengths embedded end to end (default {E2E_LENGTHS}); none to skip")
    parser.add_argument("--e2e-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                        help="model weights for end to end")
    parser.add_argument("--e2e-repeats", type=int, help="timed repeats end to end (default 3)")
    parser.add_argument("--no-stages", action="store_true", help="skip the stage breakdown")
    parser.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph replay times")
    parser.add_argument("--graph-max-length", type=int,
                        help="end to end: the longest input replayed from CUDA graphs (default: the loader's 8192)")
    parser.add_argument("--profile-lengths", "--profile-length", type=int, nargs="*", default=[16384],
                        dest="profile_lengths",
                        help="torch.profiler table per method at each of these lengths, attention alone "
                             "and end to end (default 16384; none or 0: no profile)")
    parser.add_argument("--dry-run", "--interpret", action="store_true", dest="dry_run",
                        help="CPU, Triton's interpreter, tiny sizes and knobs: tests the script, measures nothing")
    parser.add_argument("--model", help="checkpoint folder (default: the default model, nomic-embed-text-v1.5)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for the results")
    parser.add_argument("--name", help="file stem (default <date>-<gpu>)")
    args = parser.parse_args(argv)

    defaults = dict(lengths=LENGTHS, e2e_lengths=E2E_LENGTHS, heads=12, repeats=10,
                    warmup=3, e2e_repeats=3)
    if args.dry_run:
        defaults.update(DRY_RUN)
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton first decorates a kernel
        if os.environ["TRITON_INTERPRET"] != "1" or "clusterserve.kernels.triton.clustered" in sys.modules:
            raise SystemExit("--dry-run needs TRITON_INTERPRET=1 before the kernels are imported")
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU, or pass --dry-run to test the script on CPU")
    else:
        device = torch.device("cuda")
    pick = {name: getattr(args, name) if getattr(args, name) is not None else value for name, value in defaults.items()}
    specs = {
        label: dry_run_spec(spec) if args.dry_run and spec.method != "full" else spec
        for label, spec in SPECS.items() if label in args.methods or spec.method == "full"
    }
    profile_lengths = tuple(n for n in args.profile_lengths if n > 0)
    if args.dry_run and profile_lengths and not set(profile_lengths) & set(pick["lengths"]):
        profile_lengths = (pick["lengths"][0],)  # so that the dry run goes through the profiler too
    machine = "cpu-interpret" if args.dry_run else device_name()
    stem = args.name or f"{datetime.date.today().isoformat()}-{_slug(machine)}"
    settings = Settings(
        device=device, dtype=getattr(torch, args.dtype), heads=pick["heads"], head_dims=tuple(args.head_dims),
        lengths=tuple(pick["lengths"]), e2e_lengths=tuple(pick["e2e_lengths"]),
        e2e_dtype=getattr(torch, args.e2e_dtype),
        repeats=pick["repeats"], warmup=pick["warmup"], e2e_repeats=pick["e2e_repeats"],
        stages=not args.no_stages, graphs=not args.no_graphs,
        graph_max_length=args.graph_max_length, profile_lengths=profile_lengths,
        specs=specs, model=args.model, out=args.out, stem=stem, dry_run=args.dry_run,
    )
    return settings


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(argv)
    torch.set_grad_enabled(False)
    dry = "; DRY RUN: nothing here is a measurement" if settings.dry_run else ""
    print(f"{settings.device_label}; torch {torch.__version__}{dry}", flush=True)
    encoder = load_model(settings, torch.float32)  # float32 projections, cast per benchmark dtype
    embed_encoder = load_model(settings, settings.e2e_dtype) if settings.e2e_lengths else None
    rows, stage_rows, profile = [], [], []
    for n in settings.lengths:
        bench_attention(settings, encoder, n, rows, stage_rows, profile)
        write_outputs(settings, rows, stage_rows, profile)
    for n in settings.e2e_lengths:
        bench_embed(settings, embed_encoder, n, rows, profile)
        write_outputs(settings, rows, stage_rows, profile)
    paths = write_outputs(settings, rows, stage_rows, profile)
    print_tables(rows, stage_rows)
    png = settings.out / f"{settings.stem}.png"
    plot(rows, png)
    print("wrote " + ", ".join(str(p) for p in [*paths, png]))


if __name__ == "__main__":
    main()
