"""Retrieval over long documents: a query must find its document among the others, on two
query sets: verbatim passages from inside the documents, and questions written by hand in
other words (bench/data/man-questions.tsv, for the default corpus's pages). One vector per
document against chunk vectors (naive chunks, late chunks over the whole context, late
chunks in windows), for every attention method; then the passkey and needle probes
(bench.quality.probes) at growing lengths.

    python -m clusterserve.bench.quality.retrieval [--docs 8] [--min-tokens 2000] [--max-tokens 4500] [--queries 10]
        [--methods full clustered i-clustered smyrf banded auto] [--approaches document late-window]
        [--target-fidelity 0.98]
        [--probe-lengths 1024 4096]
        [--probe-candidates 4] [--probe-methods full] [--sweep 0 63 127 255] [--name retrieval-cpu]

A document scores by its best chunk (cosine); recall@1 and MRR over the queries of each set
(`recall_at_1`, `mrr`: passages; `question_recall_at_1`, `question_mrr`: questions). Times are
the embedding calls (the forward passes and their planning), what the server spends on the
approach: wall-clock seconds and CPU seconds of this process (one torch thread by default, so
that other work on a shared machine changes the wall clock more than the CPU seconds);
`vs_naive` is the ratio of CPU seconds to naive chunking with the same method, in this run.
Method "auto" is what the server runs for a request that names none: auto at
`--target-fidelity` (the server's default target), chosen per pass from the model's calibration
table. Chunk vectors of every method are compared with exact attention's (`cos_mean`, `cos_min`:
over the chunks, or the documents). `--sweep` also runs windowed late
chunking with exact attention at each window_overlap: the figures the default is chosen from.
Corpus: this machine's man pages (bench.quality.corpus). Prints tables, writes
bench/results/<name>.json and <name>.png.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from clusterserve.kernels import AttentionSpec
from clusterserve.models import load_encoder
from clusterserve.models.planning.chunking import ChunkingSpec

from ..common import RESULTS_DIR, device_name, print_table, write_results
from .corpus import documents, passages, questions
from .probes import TASKS, haystack, probe

APPROACHES = ("document", "naive", "late-window", "late-whole")
METHODS = ("full", "clustered", "i-clustered", "smyrf", "banded", "auto")


def embed_approach(
    encoder, approach: str, texts: list[str], spec: AttentionSpec, chunking: ChunkingSpec, target: float | None = None
) -> list[Tensor]:
    """Per text its (k, dim) unit vectors: k = 1 for "document", its chunks otherwise.
    target: the target fidelity of spec "auto" (None for the other methods)."""
    if approach == "document":
        return list(encoder.embed(texts, spec, target_fidelity=target).split(1))
    if approach == "naive":
        chunking = ChunkingSpec(**{**chunking.__dict__, "late": False})
    elif approach == "late-whole":
        chunking = ChunkingSpec(**{**chunking.__dict__, "late": True, "window": encoder.max_input_tokens})
    else:
        chunking = ChunkingSpec(**{**chunking.__dict__, "late": True})
    return [chunked.vectors for chunked in encoder.embed_chunks(texts, spec, chunking, target_fidelity=target)]


def method_spec(method: str, args) -> tuple[AttentionSpec, float | None]:
    """A method's name -> its spec at the defaults and its target fidelity (auto's; None)."""
    return AttentionSpec(method=method), args.target_fidelity if method == "auto" else None


def timed(fn: Callable[[], list[Tensor]], repeats: int = 1) -> tuple[list[Tensor], float, float]:
    """fn()'s result, and the least wall-clock and CPU seconds (this process, all threads) of
    `repeats` calls. On a machine shared with other work the CPU seconds are the steadier cost."""
    wall, cpu = float("inf"), float("inf")
    for _ in range(repeats):
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        result = fn()
        wall, cpu = min(wall, time.perf_counter() - start_wall), min(cpu, time.process_time() - start_cpu)
    return result, wall, cpu


def rank_scores(
    queries: Tensor, vectors: list[Tensor], answers: list[int], similarity: Callable[[Tensor, Tensor], Tensor] | None = None
) -> tuple[float, float]:
    """(recall@1, MRR): each document scored by its best vector's similarity to the query
    (`similarity(queries, doc)` -> (queries, doc's vectors); default the inner product, the
    cosine of unit vectors). A tie with the answer is broken at random, in expectation: recall
    counts 1 / (1 + ties) where nothing scores higher, and the rank counts half the ties (integer
    scores such as Hamming distances tie often; float ones almost never)."""
    similarity = similarity or (lambda q, d: q @ d.T)
    scores = torch.stack([similarity(queries, doc).amax(dim=1) for doc in vectors], dim=1)  # (queries, documents)
    truth = scores[torch.arange(len(answers)), answers]
    higher = (scores > truth[:, None]).sum(dim=1).float()
    ties = (scores == truth[:, None]).sum(dim=1).float() - 1
    recall = torch.where(higher == 0, 1.0 / (1.0 + ties), 0.0)
    return recall.mean().item(), (1.0 / (higher + 1 + ties / 2)).mean().item()


def cosines_to_exact(vectors: list[Tensor], exact: list[Tensor]) -> tuple[float, float]:
    cos = torch.cat([F.cosine_similarity(v, e, dim=-1) for v, e in zip(vectors, exact)])
    return cos.mean().item(), cos.min().item()


def retrieval(encoder, args, chunking: ChunkingSpec) -> list[dict]:
    docs = documents(encoder, args.docs, args.min_tokens, args.max_tokens)
    # Each query set by the prefix of its figures' names: "" for passages, "question_".
    asked = {"": passages(docs, args.queries, args.query_words, seed=args.seed), "question_": questions(docs)}
    print(f"corpus: {len(docs)} man pages, {sum(d.tokens for d in docs)} tokens "
          f"({min(d.tokens for d in docs)}-{max(d.tokens for d in docs)} each), {len(asked[''])} passages, "
          f"{len(asked['question_'])} questions")  # fmt: skip
    texts = [d.text for d in docs]
    embedded = {prefix: encoder.embed([q.text for q in queries], AttentionSpec(method="full"))
                for prefix, queries in asked.items() if queries}  # fmt: skip

    def scores(vectors: list[Tensor]) -> dict:
        figures = {}
        for prefix, query_vectors in embedded.items():
            answers = [q.document for q in asked[prefix]]
            figures[f"{prefix}recall_at_1"], figures[f"{prefix}mrr"] = rank_scores(query_vectors, vectors, answers)
        return figures

    rows, exact = [], {}
    for method in sorted(args.methods, key=lambda m: m != "full"):  # exact first: the others compare to it
        spec, target = method_spec(method, args)
        for approach in args.approaches:
            vectors, seconds, cpu = timed(
                lambda: embed_approach(encoder, approach, texts, spec, chunking, target), args.repeats
            )
            if method == "full":
                exact[approach] = vectors
            cos = cosines_to_exact(vectors, exact[approach]) if approach in exact else (None, None)
            rows.append(dict(
                approach=approach, method=method, **scores(vectors), seconds=seconds, cpu_seconds=cpu,
                chunks=sum(v.shape[0] for v in vectors), cos_mean=cos[0], cos_min=cos[1],
            ))  # fmt: skip
            print(f"  {approach:12s} {method:12s} {_figures(rows[-1])}  {seconds:7.2f} s  {cpu:7.2f} cpu-s", flush=True)
    for overlap in args.sweep:
        swept = ChunkingSpec(**{**chunking.__dict__, "window_overlap": overlap})
        full = AttentionSpec(method="full")
        vectors, seconds, cpu = timed(lambda: embed_approach(encoder, "late-window", texts, full, swept), args.repeats)
        rows.append(dict(approach=f"late-window overlap {overlap}", method="full", **scores(vectors),
                         seconds=seconds, cpu_seconds=cpu, chunks=sum(v.shape[0] for v in vectors)))  # fmt: skip
        print(f"  window_overlap {overlap:4d}  {_figures(rows[-1])}  {seconds:7.2f} s  {cpu:7.2f} cpu-s", flush=True)
    naive_cpu = {r["method"]: r["cpu_seconds"] for r in rows if r["approach"] == "naive"}
    for row in rows:
        row["vs_naive"] = row["cpu_seconds"] / naive_cpu[row["method"]] if row["method"] in naive_cpu else None
    return rows


def _figures(row: dict) -> str:
    text = f"passages R@1 {row['recall_at_1']:.3f} MRR {row['mrr']:.3f}"
    if "question_mrr" in row:
        text += f"  questions R@1 {row['question_recall_at_1']:.3f} MRR {row['question_mrr']:.3f}"
    return text


def probes(encoder, args, chunking: ChunkingSpec) -> list[dict]:
    filler = haystack(encoder)
    rows = []
    for task in TASKS:
        for length in args.probe_lengths:
            case = probe(encoder, task, length, args.probe_candidates, seed=args.seed, filler=filler)
            query_vectors = encoder.embed(case.queries, AttentionSpec(method="full"))
            answers = list(range(len(case.documents)))
            for method in args.probe_methods:
                for approach in ("document", "naive", "late-window"):
                    spec, target = method_spec(method, args)
                    vectors, seconds, cpu = timed(
                        lambda: embed_approach(encoder, approach, case.documents, spec, chunking, target)
                    )
                    recall, mrr = rank_scores(query_vectors, vectors, answers)
                    rows.append(dict(task=task, tokens=length, approach=approach, method=method,
                                     recall_at_1=recall, mrr=mrr, seconds=seconds, cpu_seconds=cpu))  # fmt: skip
                    print(f"  {task:8s} {length:6d} {approach:12s} {method:12s} R@1 {recall:.3f}  {seconds:6.2f} s", flush=True)
    return rows


def plot(rows: list[dict], name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("mrr", "passages")] + ([("question_mrr", "questions")] if "question_mrr" in rows[0] else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.5), squeeze=False)
    for ax, (key, label) in zip(axes[0], panels):
        for approach, marker in zip(APPROACHES, "osD^"):
            points = [r for r in rows if r["approach"] == approach]
            ax.scatter([r["cpu_seconds"] for r in points], [r[key] for r in points], marker=marker, label=approach)
            for r in points:
                ax.annotate(r["method"], (r["cpu_seconds"], r[key]), fontsize=7, xytext=(3, 2), textcoords="offset points")
        ax.set_xlabel("CPU seconds to embed the corpus (this CPU)")
        ax.set_ylabel(f"MRR, {label} -> document")
        ax.set_title(f"Retrieval over long documents ({label}), per attention method")
        ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS_DIR / f"{name}.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--min-tokens", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=4500)
    parser.add_argument("--queries", type=int, default=10, help="passages per document (cheap: short texts)")
    parser.add_argument("--query-words", type=int, default=32)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--approaches", nargs="+", default=list(APPROACHES), choices=APPROACHES)
    parser.add_argument("--target-fidelity", type=float, default=0.98, help='method "auto": its target')
    parser.add_argument("--size", type=int, default=ChunkingSpec.size)
    parser.add_argument("--overlap", type=int, default=ChunkingSpec.overlap)
    parser.add_argument("--boundaries", default=ChunkingSpec.boundaries)
    parser.add_argument("--window-overlap", type=int, default=None, help="default: models.planning.chunking's")
    parser.add_argument("--sweep", type=int, nargs="*", default=[], help="window_overlap values to compare")
    parser.add_argument("--probe-lengths", type=int, nargs="*", default=[1024, 4096])
    parser.add_argument("--probe-candidates", type=int, default=4)
    parser.add_argument("--probe-methods", nargs="*", default=["full"], choices=METHODS)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: CPU seconds are the work done)")
    parser.add_argument("--repeats", type=int, default=1, help="timing: the least of this many runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="retrieval-cpu")
    args = parser.parse_args()
    if "full" not in args.methods:
        parser.error("--methods: needs full (the reference the others are compared with)")

    torch.set_grad_enabled(False)
    torch.set_num_threads(args.threads)
    encoder = load_encoder(None)
    chunking = ChunkingSpec(size=args.size, overlap=args.overlap, boundaries=args.boundaries, window_overlap=args.window_overlap)
    print(f"chunking: {chunking}")
    rows = retrieval(encoder, args, chunking)
    print_table(rows, ["approach", "method", "recall_at_1", "mrr", "question_recall_at_1", "question_mrr", "seconds",
                       "cpu_seconds", "vs_naive", "chunks", "cos_mean", "cos_min"])  # fmt: skip
    probe_rows = probes(encoder, args, chunking) if args.probe_lengths else []
    if probe_rows:
        print_table(probe_rows, ["task", "tokens", "approach", "method", "recall_at_1", "mrr", "seconds", "cpu_seconds"])
    meta = {"device": device_name(), "model": encoder.name, "chunking": chunking.__dict__, "args": vars(args)}
    path = write_results(args.name, rows + probe_rows, meta)
    plot(rows, args.name)
    print(f"wrote {path} and {args.name}.png")


if __name__ == "__main__":
    main()
