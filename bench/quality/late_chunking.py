"""What late chunking needs on the served model: chunk retrieval over long man pages, late
chunks against naive chunks of the same size, across the knobs of a context window.

    python -m clusterserve.bench.quality.late_chunking [--set dev|held-out] [--docs 32]
        [--windows 512 2048 8192] [--shares 0.25] [--keeps tail] [--window-prompts yes]
        [--sizes 256] [--methods full auto] [--naive-sizes 256] [--name late-chunking-<model>]

Each document is run once per window configuration: `--windows` tokens a window (special and
prompt tokens included), `--shares` of a window's text re-read by the next one as context,
`--keeps` which window a token's state comes from ("tail": the latest window that holds it
after the overlap, the server's rule, so that every kept token has at least the overlap as left
context; "centered": the window it is nearest the middle of, so that it has context on both
sides), `--window-prompts` whether each window carries the document prompt, and `--methods`
("auto": what the server's default runs for a window). Every token's last hidden state is kept,
so chunk sizes (`--sizes`) and poolings come from one run:

    late           the mean of the chunk's token states (the server's late chunk vector)
    hybrid         the sum of the late and the naive unit vectors of the same chunk
    document mean  the mean of every token state: one vector a document

Naive chunks (`--naive-sizes`) embed each chunk alone, as `chunking: {late: false}` does.
Two query sets, each asked with the default prompt and with prompt "query" where the model has it:
40-word passages from inside the documents, and questions written by hand in other words
(bench/data/man-questions.tsv). A document scores by its best chunk; recall@1 and MRR.
Sets (bench.quality.corpus.split_sets): "dev", a quarter of the distinct pages of
`--min-tokens`..`--max-tokens` tokens, to choose defaults on; "held-out", `--docs` of the
others, to report on. Times are CPU seconds of the forward passes (all threads), with the
tokens they ran. Writes bench/results/<name>.json.
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from clusterserve.kernels import AttentionSpec, resolve_auto
from clusterserve.models import load_encoder
from clusterserve.models.planning.chunking import ChunkingSpec, chunk_spans, unit_starts, windows

from ..common import device_name, print_table, write_results
from .corpus import Document, passages, questions, split_sets
from .retrieval import rank_scores, timed

# label -> prompt_name a query is embedded with: the default (nomic's "search_document: "), and
# the checkpoint's query prompt where it has one.
QUERY_PROMPTS = {"default": None, "query": "query"}


@dataclass(frozen=True)
class Window:
    """How late chunking runs a document: `window` tokens a window, `share` of its text room
    re-read as context, `keep` ("tail" | "centered"), `prompt` in each window, attention `method`."""

    window: int
    share: float
    keep: str
    prompt: bool
    method: str


def keep_ranges(tokens: int, room: int, overlap: int, keep: str) -> list[tuple[int, int, int, int]]:
    """(start, stop, keep_start, keep_stop) per window over `tokens` text tokens: the server's
    windows (models.planning.chunking.windows); "tail" keeps each window from its overlap on,
    "centered" splits each overlap in half between the two windows that hold it."""
    spans = windows(tokens, room, overlap)
    if keep == "tail":
        return [(start, stop, kept, spans[i + 1][2] if i + 1 < len(spans) else stop)
                for i, (start, stop, kept) in enumerate(spans)]  # fmt: skip
    middles = [(stop + spans[i + 1][0]) // 2 for i, (_, stop, _) in enumerate(spans[:-1])]
    bounds = [0, *middles, tokens]
    return [(start, stop, bounds[i], bounds[i + 1]) for i, (start, stop, _) in enumerate(spans)]


def token_states(encoder, body: list[int], window: Window, target: float) -> tuple[Tensor, int]:
    """Every text token's last hidden state under `window` -> ((len(body), dim), tokens run)."""
    checkpoint = encoder.checkpoint
    head, suffix = framing(encoder, window.prompt)
    room = window.window - len(head) - len(suffix)
    ranges = keep_ranges(len(body), room, int(room * window.share), window.keep)
    sequences = [head + body[start:stop] + suffix for start, stop, _, _ in ranges]
    spec = AttentionSpec(method=window.method)
    table, fidelity = (checkpoint.calibration, target) if window.method == "auto" else (None, None)
    specs = [resolve_auto(spec, len(ids), table, fidelity, chunks=True).spec for ids in sequences]
    states = encoder.token_states(sequences, specs)
    kept = [s[len(head) + a - start : len(head) + b - start] for s, (start, _, a, b) in zip(states, ranges)]
    return torch.cat(kept), sum(len(ids) for ids in sequences)


def framing(encoder, prompt: bool) -> tuple[list[int], list[int]]:
    """(head, suffix): the special tokens, and the document prompt when `prompt`, around a
    sequence's text tokens."""
    tokenizer = encoder.checkpoint.tokenizer
    text = encoder.checkpoint.prompts.text(None) if prompt else ""
    return [*tokenizer.prefix, *(tokenizer.encode_body([text])[0].ids if text else [])], list(tokenizer.suffix)


def chunk_vectors(states: Tensor, spans: list[tuple[int, int]]) -> Tensor:
    return F.normalize(torch.stack([states[a:b].mean(dim=0) for a, b in spans]), dim=-1)


@dataclass
class Corpus:
    docs: list[Document]
    bodies: list[list[int]]
    spans: dict[int, list[list[tuple[int, int]]]]  # chunk size -> per document its chunk spans
    queries: dict[str, tuple[dict[str, Tensor], list[int]]]  # set -> (prompt label -> vectors, answers)


def build_corpus(encoder, docs: list[Document], sizes: list[int], seed: int) -> Corpus:
    tokens = encoder.checkpoint.tokenizer.encode_body([d.text for d in docs])
    spans = {}
    for size in sizes:
        starts = [unit_starts(d.text, t.offsets, "sentences") for d, t in zip(docs, tokens)]
        spans[size] = [chunk_spans(s, len(t.ids), size, 0) for s, t in zip(starts, tokens)]
    asked = {"passages": passages(docs, 3, 40, seed=seed), "questions": questions(docs)}
    full, prompts = AttentionSpec(method="full"), encoder.checkpoint.prompts.prompts
    queries = {
        name: ({label: encoder.embed([q.text for q in chosen], full, prompt_name=prompt)
                for label, prompt in QUERY_PROMPTS.items() if prompt in (None, *prompts)}, [q.document for q in chosen])
        for name, chosen in asked.items() if chosen
    }  # fmt: skip
    return Corpus(docs, [t.ids for t in tokens], spans, queries)


def scores(corpus: Corpus, vectors: list[Tensor]) -> dict:
    figures = {}
    for name, (by_prompt, answers) in corpus.queries.items():
        for label, query_vectors in by_prompt.items():
            recall, mrr = rank_scores(query_vectors, vectors, answers)
            figures[f"{name}_r1_{label}"], figures[f"{name}_mrr_{label}"] = round(recall, 4), round(mrr, 4)
    return figures


def naive_rows(encoder, corpus: Corpus, sizes: list[int], args) -> tuple[list[dict], dict[int, list[Tensor]]]:
    rows, vectors = [], {}
    for size in sizes:
        vectors[size], cpu = naive_vectors(encoder, corpus, size, args, args.set)
        head, suffix = framing(encoder, True)
        tokens = sum(b - a + len(head) + len(suffix) for spans in corpus.spans[size] for a, b in spans)
        rows.append(dict(approach="naive", size=size, method="full", cpu_seconds=round(cpu, 1), tokens_run=tokens,
                         **scores(corpus, vectors[size])))  # fmt: skip
        print(f"  naive {size:4d}  {_figures(rows[-1])}  {cpu:7.1f} cpu-s", flush=True)
    return rows, vectors


def naive_vectors(encoder, corpus: Corpus, size: int, args, which: str) -> tuple[list[Tensor], float]:
    """Per document of set `which` its naive chunks' unit vectors (exact attention), and the CPU seconds."""
    texts, full = [d.text for d in corpus.docs], AttentionSpec(method="full")
    return cached(args, f"{encoder.name}-{which}-naive-{size}", lambda: [
        c.vectors for c in encoder.embed_chunks(texts, full, ChunkingSpec(size=size, late=False))
    ])  # fmt: skip


def cached(args, key: str, compute):
    """compute() and the CPU seconds it took; with `--cache`, read from and written to that
    folder under `key` (the seconds of the run that computed it)."""
    path = Path(args.cache) / f"{key}.pt" if args.cache else None
    if path is not None and path.is_file():
        saved = torch.load(path)
        return saved["value"], saved["cpu"]
    value, _, cpu = timed(compute)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"value": value, "cpu": cpu}, path)
    return value, cpu


def late_rows(encoder, corpus: Corpus, window: Window, args, naive: dict[int, list[Tensor]]) -> list[dict]:
    key = f"{encoder.name}-{args.set}-{window.window}-{window.share}-{window.keep}-{window.prompt}-{window.method}"
    per_doc, cpu = cached(args, key, lambda: [token_states(encoder, b, window, args.target_fidelity) for b in corpus.bodies])
    states = [s for s, _ in per_doc]
    base = dict(**asdict(window), cpu_seconds=round(cpu, 1), tokens_run=sum(n for _, n in per_doc))
    rows = [dict(approach="document mean", **base, **scores(corpus, [F.normalize(s.mean(0, keepdim=True), dim=-1)
                                                                        for s in states]))]  # fmt: skip
    for size in args.sizes:
        late = [chunk_vectors(s, spans) for s, spans in zip(states, corpus.spans[size])]
        rows.append(dict(approach="late", size=size, **base, **scores(corpus, late)))
        if size in naive:
            hybrid = [F.normalize(a + b, dim=-1) for a, b in zip(late, naive[size])]
            rows.append(dict(approach="hybrid", size=size, **base, **scores(corpus, hybrid)))
    for row in rows:
        print(f"  {row['approach']:13s} {_label(window)} size {row.get('size', '-')!s:4s} {_figures(row)}  {cpu:7.1f} cpu-s",
              flush=True)  # fmt: skip
    return rows


def _label(window: Window) -> str:
    return (f"window {window.window:5d} share {window.share:.2f} {window.keep:8s} "
            f"prompt {'yes' if window.prompt else 'no ':3s} {window.method:4s}")  # fmt: skip


def _figures(row: dict) -> str:
    return "  ".join(f"{key.replace('_r1_', ' R@1 ')} {value:.3f}" for key, value in row.items() if "_r1_" in key)


def main() -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the served default model")
    parser.add_argument("--set", choices=("dev", "held-out"), default="held-out")
    parser.add_argument("--docs", type=int, default=32, help="held-out documents")
    parser.add_argument("--min-tokens", type=int, default=4000)
    parser.add_argument("--max-tokens", type=int, default=8000)
    parser.add_argument("--windows", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--shares", type=float, nargs="+", default=[0.25])
    parser.add_argument("--keeps", nargs="+", choices=("tail", "centered"), default=["tail"])
    parser.add_argument("--window-prompts", nargs="+", choices=("yes", "no"), default=["yes"])
    parser.add_argument("--methods", nargs="+", choices=("full", "auto"), default=["full", "auto"])
    parser.add_argument("--sizes", type=int, nargs="+", default=[256])
    parser.add_argument("--naive-sizes", type=int, nargs="*", default=[256])
    parser.add_argument("--target-fidelity", type=float, default=0.98, help='method "auto": its target')
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", default=None, help="a folder to keep token states in, for a rerun to reuse")
    parser.add_argument("--name", default=None, help="default: late-chunking-<model>-<set>")
    args = parser.parse_args()

    torch.set_grad_enabled(False)
    encoder = load_encoder(args.model, dtype="float32")
    dev, held = split_sets(encoder, args.min_tokens, args.max_tokens, args.docs)
    docs = dev if args.set == "dev" else held
    corpus = build_corpus(encoder, docs, sorted(set(args.sizes) | set(args.naive_sizes)), args.seed)
    print(f"{args.set}: {len(docs)} man pages, {sum(d.tokens for d in docs)} tokens, "
          + ", ".join(f"{len(a)} {name}" for name, (_, a) in corpus.queries.items()), flush=True)  # fmt: skip
    rows, naive = naive_rows(encoder, corpus, args.naive_sizes, args)
    for size, share, keep, prompt, method in itertools.product(
        args.windows, args.shares, args.keeps, args.window_prompts, args.methods
    ):
        window = Window(min(size, encoder.max_input_tokens), share, keep, prompt == "yes", method)
        rows += late_rows(encoder, corpus, window, args, naive)
    columns = ["approach", "size", "window", "share", "keep", "prompt", "method"]
    print_table(rows, [*columns, *[k for k in rows[0] if "_r1_" in k], "cpu_seconds", "tokens_run"])
    name = args.name or f"late-chunking-{encoder.name}-{args.set}"
    meta = {"device": device_name(), "model": encoder.name, "set": args.set, "documents": [d.name for d in docs],
            "args": vars(args)}  # fmt: skip
    print(f"wrote {write_results(name, rows, meta)}")


if __name__ == "__main__":
    main()
