"""Calibrate auto mode: fidelity and time of a grid of attention configurations per length, the
tables the package ships (models/calibrations/) among them.

    make calibrate [MODEL=nomic|minilm] [DTYPE=float32|bfloat16]
    python -m clusterserve.bench.calibration.build --shipped [--model NAME] [--dtype float32|bfloat16]
    python -m clusterserve.bench.calibration.build [--model DIR|FILE.gguf|NAME] [--dtype float32|bfloat16|auto]
                              [--lengths 512 ... 8192] [--docs 2] [--repeats N] [--grid FILE] [--out PATH]
    python -m clusterserve.bench.calibration.build --plot [--table PATH]

`--shipped` (what `make calibrate` runs) measures every table the package ships again on this
machine's CPU, each as SHIPPED says it was measured (model, dtype, lengths, grid, repeats), and
writes it over the shipped file; `--model` and `--dtype` pick some of them.

For each length bucket, embeds `--docs` documents of real text (Debian's license texts, the
calibration set; the held-back set is left for tests) with exact attention and with every
configuration of the grid, on this machine's device, in the served dtype, one document at a
time. Fidelity is the cosine of a configuration's embedding to exact attention's in float32
(a float32 copy of the model runs the reference where the dtype is another), so the table
says what a user gets; in bfloat16 each bucket also records exact attention's own fidelity
(`exact_fidelity_min`). The same passes give late chunking's fidelity: the mean token state
over each CHUNK_TOKENS-token span of a document against exact attention's, worst over every
span (`chunk_fidelity_min`), which auto judges late-chunking windows by. Time is per
document, in the served dtype: the median of 3 calls up to 2048 tokens and of 1 from there
(`--repeats` sets it for every length). Writes the table (models/planning/calibration.py has
the format) next to the model (DIR/calibration.<device>[-bf16].json), or for a model given by
name (the default, nomic-embed-text-v1.5, or all-MiniLM-L6-v2) to models/calibrations/, which
ships with clusterserve; `--out` writes it elsewhere. `--grid` replaces the grid by one
AttentionSpec per line of a file, as JSON keyword arguments. Prints each bucket's frontier and
the configuration chosen for fidelity targets 0.98, 0.99 and 0.995, and draws latency against
fidelity per method and length with the Pareto frontier
(bench/results/calibration-<model>-<device>[-bf16].png, a plot the repository does not keep).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import torch

from clusterserve.kernels import AttentionSpec
from clusterserve.kernels.spec import exact_by_knobs
from clusterserve.models import load_encoder
from clusterserve.models.loader import DEFAULT_MODEL_NAME, MODEL_ALIASES, resolve_model
from clusterserve.models.planning.calibration import (
    DTYPE_SUFFIXES,
    FORMAT,
    SHIPPED_DIR,
    Calibration,
    load_calibration,
    parse_calibration,
    table_name,
)
from clusterserve.models.planning.chunking import ChunkingSpec
from clusterserve.models.pooling import pool_one
from clusterserve.models.runtime.precision import DTYPE_SETTINGS, dtype_name, resolve_dtype

from ..common import CALIBRATION_TEXTS, RESULTS_DIR, device_name, long_text_ids, print_table

# From the cheapest to the most faithful of each method. The cluster count buys fidelity most
# cheaply (clustered with 400-1600 clusters reaches 0.99-0.997 at 8k-32k); a larger top-k
# costs more than it buys, and SMYRF stays below 0.95 at any rounds and cluster size measured
# (docs/native.md), so one cheap point of it is kept.
GRID = [
    AttentionSpec(method="i-clustered", clusters=100, topk=32, iterations=10, refine=3),
    AttentionSpec(method="i-clustered", clusters=100, topk=32, iterations=10, refine=0),
    AttentionSpec(method="i-clustered", clusters=50, topk=32, iterations=5, refine=2),
    AttentionSpec(method="i-clustered", clusters=100, topk=32, iterations=5, refine=3),
    AttentionSpec(method="i-clustered", clusters=200, topk=32, iterations=5, refine=3),
    AttentionSpec(method="i-clustered", clusters=400, topk=64, iterations=5, refine=3),
    AttentionSpec(method="clustered", clusters=200, iterations=3, refine=2),
    AttentionSpec(method="clustered", clusters=200, iterations=5, refine=3),
    AttentionSpec(method="clustered", clusters=400, iterations=5, refine=3),
    AttentionSpec(method="clustered", clusters=800, iterations=5, refine=3),
    AttentionSpec(method="clustered", clusters=1600, iterations=5, refine=3),
    AttentionSpec(method="smyrf", hash_rounds=4, cluster_size=64),
]
TARGETS = (0.98, 0.99, 0.995)
# Late chunking's default chunk size (models.planning.chunking.ChunkingSpec.size): the span whose mean
# token state a late chunk vector is.
CHUNK_TOKENS = ChunkingSpec().size
NOMIC_GRID = Path(__file__).resolve().parents[1] / "data" / "nomic-banded-grid.jsonl"
# The tables the package ships (models/calibrations/, all measured on a 2-core CPU: the
# bfloat16 ones on a CPU that multiplies bfloat16 natively), each as it was measured: what
# --shipped (make calibrate) measures again. docs/calibration.md has each table.
SHIPPED = (
    dict(model="nomic-embed-text-v1.5", dtype="float32", lengths=[512, 1024, 2048, 4096, 8192], grid=NOMIC_GRID),
    dict(model="nomic-embed-text-v1.5", dtype="bfloat16", lengths=[512, 1024, 2048, 4096, 8192], grid=NOMIC_GRID,
         repeats=3),
    dict(model="all-MiniLM-L6-v2", dtype="float32", lengths=[1024, 2048, 4096, 8192, 16384, 32768]),
    dict(model="all-MiniLM-L6-v2", dtype="bfloat16", lengths=[512, 1024, 2048, 4096, 8192, 16384, 32768]),
)
EXACT_SPEC = AttentionSpec(method="full")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint folder, GGUF file or model name (default: the default model)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--grid", type=Path, default=None, help="one AttentionSpec's JSON keyword arguments per line")
    parser.add_argument("--docs", type=int, default=2, help="calibration documents per length")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per document (default: 3 to 2048 tokens, then 1)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=DTYPE_SETTINGS, help="the served precision (default float32)")
    parser.add_argument("--out", type=Path, default=None, help="where to write the table")
    parser.add_argument("--shipped", action="store_true", help="measure the shipped tables again (SHIPPED)")
    parser.add_argument("--plot", action="store_true", help="only draw the plot of an existing table")
    parser.add_argument("--table", type=Path, default=None, help="the table --plot draws")
    args = parser.parse_args(argv)

    if args.plot:
        dtype = dtype_name(resolve_dtype(args.dtype or "float32", args.device))
        table = load_calibration(args.table or SHIPPED_DIR / table_name(DEFAULT_MODEL_NAME, args.device, dtype))
        report(table)
        print(f"wrote {plot(table)}")
        return
    torch.set_grad_enabled(False)
    if args.shipped:
        recipes = shipped_recipes(args.model, args.dtype)
        if not recipes:
            parser.error(f"--shipped: no shipped table of {args.model or 'any model'} in {args.dtype or 'any dtype'}")
        for recipe in recipes:
            grid = read_grid(recipe["grid"]) if "grid" in recipe else GRID
            build_table(recipe["model"], "cpu", recipe["dtype"], recipe["lengths"], args.docs, grid, recipe.get("repeats"),
                        SHIPPED_DIR / table_name(recipe["model"], "cpu", recipe["dtype"]))
        return
    grid = GRID if args.grid is None else read_grid(args.grid)
    build_table(args.model, args.device, args.dtype or "float32", args.lengths, args.docs, grid, args.repeats, args.out)


def shipped_recipes(model: str | None = None, dtype: str | None = None) -> list[dict]:
    """SHIPPED's recipes of `model` (a name or alias; None: every model) in `dtype` (None: both)."""
    name = MODEL_ALIASES.get(model.lower(), model) if model else None
    return [r for r in SHIPPED if name in (None, r["model"]) and dtype in (None, r["dtype"])]


def read_grid(path: Path) -> list[AttentionSpec]:
    """A grid file: one AttentionSpec's JSON keyword arguments per line."""
    return [AttentionSpec(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def build_table(model: str | None, device: str, dtype: str, lengths: list[int], docs: int, grid: list[AttentionSpec],
                repeats: int | None, out: Path | None) -> Path:
    """Measure one table (`measure`) and write it: to `out`, else for a model named to the shipped
    tables, for a folder beside its checkpoint; prints the choices, draws the plot."""
    encoder = load_encoder(model, max_input_tokens=max(lengths), device=device, dtype=dtype)
    kind, served = encoder.device.type, dtype_name(encoder.dtype)
    named = model is None or model.lower() in MODEL_ALIASES
    out = out or (
        SHIPPED_DIR / table_name(encoder.name, kind, served)
        if named
        else resolve_model(model).folder / f"calibration.{kind}{DTYPE_SUFFIXES[served]}.json"
    )
    raw = measure(encoder, lengths, docs, grid, repeats)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(raw, indent=1) + "\n")
    table = parse_calibration(raw, str(out))
    report(table)
    print(f"wrote {out} and {plot(table)}")
    return out


def pooled_and_chunks(encoder, ids: list[int], spec: AttentionSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward pass over a document's ids -> its pooled vector (1, C) and its late-chunk
    vectors (k, C): the mean token state over each CHUNK_TOKENS-token span of its text."""
    states = encoder.token_states([ids], [spec])[0]
    body = range(1, len(ids) - 1, CHUNK_TOKENS)  # the text's tokens, not [CLS] and [SEP]
    chunks = torch.stack([states[start : min(start + CHUNK_TOKENS, len(ids) - 1)].mean(dim=0) for start in body])
    return pool_one(states, encoder.pooling.mode), chunks


def measure(encoder, lengths: list[int], docs: int, grid: list[AttentionSpec] = GRID, repeats: int | None = None) -> dict:
    """Run the grid on `docs` calibration documents per length, timing the median of `repeats`
    calls (None: 3 up to 2048 tokens, 1 past it); the table as JSON-ready dicts."""
    reference = encoder.float32()  # fidelity is measured against exact attention in float32
    warm = long_text_ids(encoder, min(lengths), texts=CALIBRATION_TEXTS)
    for spec in (EXACT_SPEC, *grid):
        pooled_and_chunks(encoder, warm, spec)  # one-off costs (first calls, Triton compiles) stay out of the times
    buckets = [measure_bucket(encoder, reference, n, docs, grid, repeats or (3 if n <= 2048 else 1)) for n in lengths]
    return {
        "format": FORMAT,
        "model": encoder.name,
        "device": encoder.device.type,
        "device_name": device_name(),
        "dtype": dtype_name(encoder.dtype),
        "fidelity_reference": {"method": "full", "dtype": "float32"},
        "measured": datetime.date.today().isoformat(),
        "seed": 0,
        "docs": docs,
        "chunk_tokens": CHUNK_TOKENS,
        "texts": "Debian common-licenses: " + ", ".join(CALIBRATION_TEXTS),
        "buckets": buckets,
    }


def measure_bucket(encoder, reference, n: int, docs: int, grid: list[AttentionSpec], calls: int) -> dict:
    """One length bucket of the table: exact attention's time (and, where `reference`, the
    float32 copy, is another model, its fidelity) and each configuration's fidelity and time."""
    documents = [long_text_ids(encoder, n, offset=5000 * d, texts=CALIBRATION_TEXTS) for d in range(docs)]
    exact = [timed(encoder, ids, EXACT_SPEC, calls) for ids in documents]
    if reference is not encoder:
        references = [pooled_and_chunks(reference, ids, EXACT_SPEC) for ids in documents]
    else:
        references = [(vector, chunks) for vector, chunks, _ in exact]
    configs = []
    for spec in grid:
        if exact_by_knobs(spec, n):  # the server runs exact attention for it (resolve_auto): timing it is noise
            continue
        cosines, chunk_cosines, times = [], [], []
        for ids, (exact_vector, exact_chunks) in zip(documents, references):
            vector, chunks, ms = timed(encoder, ids, spec, calls)
            cosines.append(worst_cosine(vector, exact_vector))
            chunk_cosines.append(worst_cosine(chunks, exact_chunks))
            times.append(ms)
        configs.append({
            "attention": {k: v for k, v in spec.used_knobs().items() if k != "seed"},
            "fidelity_min": min(cosines),
            "fidelity_mean": statistics.fmean(cosines),
            "chunk_fidelity_min": min(chunk_cosines),
            "ms": statistics.fmean(times),
        })  # fmt: skip
        print(f"{n:>6} tokens  {spec.to_json():<90} min {min(cosines):.4f}  chunks {min(chunk_cosines):.4f}  "
              f"{statistics.fmean(times):9.1f} ms")
    exact_fidelity = min(worst_cosine(vector, ref) for (vector, _, _), (ref, _) in zip(exact, references))
    exact_ms = statistics.fmean(ms for _, _, ms in exact)
    print(f"{n:>6} tokens  exact {exact_ms:.1f} ms, cosine to float32 exact {exact_fidelity:.5f}")
    bucket = {"tokens": n, "exact_ms": exact_ms, "timed_calls": calls, "configs": configs}
    if reference is not encoder:
        bucket["exact_fidelity_min"] = exact_fidelity
        bucket["exact_chunk_fidelity_min"] = min(worst_cosine(chunks, ref) for (_, chunks, _), (_, ref) in zip(exact, references))
    return bucket


def timed(encoder, ids: list[int], spec: AttentionSpec, repeats: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """pooled_and_chunks's vectors of one document and the median ms of `repeats` calls."""
    sync = torch.cuda.synchronize if encoder.device.type == "cuda" else (lambda: None)
    if encoder.graphs is not None and encoder.graphs.takes([len(ids)]):
        for _ in range(2):  # CUDA graphs: this shape's eager warm-up and its capture, untimed
            pooled_and_chunks(encoder, ids, spec)
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        vector, chunks = pooled_and_chunks(encoder, ids, spec)
        sync()
        times.append(time.perf_counter() - start)
    return vector, chunks, statistics.median(times) * 1e3


def worst_cosine(vectors: torch.Tensor, references: torch.Tensor) -> float:
    """The least cosine of a row of `vectors` to its row of `references`, within [-1, 1]."""
    cosine = torch.nn.functional.cosine_similarity(vectors, references, dim=-1).min().item()
    return min(1.0, max(-1.0, cosine))  # float32 rounding can pass 1


def report(table: Calibration) -> None:
    """Print each bucket's frontier and the choice for each target."""
    rows = []
    for bucket in table.buckets:
        for target in TARGETS:
            choice = table.choose(bucket.tokens, target)
            rows.append(
                dict(
                    tokens=bucket.tokens,
                    target=target,
                    chosen=choice.spec.to_json(),
                    fidelity=choice.fidelity,
                    speedup=choice.speedup,
                )
            )
    print_table(rows, ["tokens", "target", "chosen", "fidelity", "speedup"])


def plot(table: Calibration) -> Path:
    """Latency against fidelity per method, one panel per length, frontier drawn as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"full": "black", "clustered": "tab:blue", "i-clustered": "tab:orange", "smyrf": "tab:green",
              "banded": "tab:red"}
    columns = min(3, len(table.buckets))
    rows = -(-len(table.buckets) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.5 * columns, 3.6 * rows), squeeze=False)
    for ax, bucket in zip(axes.flat, table.buckets):
        for entry in (bucket.exact(), *bucket.configs):
            ax.scatter(entry.fidelity_min, entry.ms, color=colors[entry.spec.method], s=18)
        frontier = bucket.frontier()
        ax.plot([m.fidelity_min for m in frontier], [m.ms for m in frontier], color="gray", lw=1, ls="--")
        ax.set_title(f"{bucket.tokens} tokens")
        ax.set_xlabel("worst cosine to exact")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    for row in axes:
        row[0].set_ylabel("ms per document")
    for ax in axes.flat[len(table.buckets) :]:
        ax.set_visible(False)
    for method, color in colors.items():
        axes[0][0].scatter([], [], color=color, label=method)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{table.model} on {table.device_name}: latency against fidelity (dashed: Pareto frontier)", fontsize=9)
    fig.tight_layout()
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"calibration-{table.model}-{table.device}{DTYPE_SUFFIXES.get(table.dtype, '')}.png"
    fig.savefig(path, dpi=110)
    return path


if __name__ == "__main__":
    main()
