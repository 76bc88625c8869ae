"""What compact vectors cost in retrieval: recall@1 of int8, uint8, binary and ubinary
chunk vectors against float, on the held-out man pages of bench.quality.late_chunking, and
the int8 range each model is served with (models.compact).

    python -m clusterserve.bench.quality.compact_vectors [--model M] [--docs 30] [--size 256]
        [--dims 768 256] [--cache DIR] [--calibrate]

Documents are cut into naive chunks of `--size` tokens (exact attention, as the server's
default chunking); queries are the late-chunking bench's passages and hand-written questions,
each asked with the default prompt and with prompt "query". Both sides are encoded in the
format, as a vector store holding only the compact codes would: int8 and float score by inner
product, uint8 by (negative) squared L2 distance on the raw bytes, binary and ubinary by
Hamming distance (the bits are the same, so they score the same). `--dims` are the sizes the
vectors are cut to before normalising (`dimensions`).

`--calibrate` also measures, on the development set, the largest |x_i| * sqrt(d) over the
chunk vectors and queries at every Matryoshka size (64, 128, ... up to the model's dimension),
the figure models.compact.MEASURED rounds up to a quarter. Writes
bench/results/compact-vectors-<model>.json.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from clusterserve.models import load_encoder
from clusterserve.models.compact import FORMATS, calibration, compact, expand

from ..common import device_name, print_table, write_results
from .corpus import split_sets
from .late_chunking import build_corpus, naive_vectors
from .retrieval import rank_scores


def _l2(queries: Tensor, doc: Tensor) -> Tensor:
    return -torch.cdist(queries, doc).square()


def encoded(vectors: Tensor, encoding: str, value_range: float) -> Tensor:
    """Unit vectors as a store of `encoding` codes holds them, as float tensors to score: the
    raw bytes for uint8 (scored by L2), the codes' values otherwise."""
    if encoding == "float":
        return vectors
    codes = compact(vectors, encoding, value_range)
    if encoding == "uint8":
        return torch.from_numpy(codes.astype("float32"))
    return expand(codes, encoding, value_range, vectors.shape[-1])


def format_rows(corpus, chunk_vectors: list[Tensor], dims: int, value_range: float) -> list[dict]:
    cut = [F.normalize(v[:, :dims], dim=-1) for v in chunk_vectors]
    rows = []
    for encoding in ("float", *FORMATS):
        docs = [encoded(v, encoding, value_range) for v in cut]
        row = {"format": encoding, "dimensions": dims, "bytes": dims * 4 if encoding == "float" else
               dims if encoding in ("int8", "uint8") else math.ceil(dims / 8)}  # fmt: skip
        for name, (by_prompt, answers) in corpus.queries.items():
            for label, queries in by_prompt.items():
                asked = encoded(F.normalize(queries[:, :dims], dim=-1), encoding, value_range)
                recall, mrr = rank_scores(asked, docs, answers, _l2 if encoding == "uint8" else None)
                row[f"{name}_r1_{label}"], row[f"{name}_mrr_{label}"] = round(recall, 4), round(mrr, 4)
        rows.append(row)
    return rows


def measured_range(corpus, chunk_vectors: list[Tensor], dim: int) -> dict[int, float]:
    """Per Matryoshka size, the largest |x_i| * sqrt(d) over the chunks and every query."""
    every = torch.cat([*chunk_vectors, *(v for by_prompt, _ in corpus.queries.values() for v in by_prompt.values())])
    sizes = sorted({*(2**k for k in range(6, 16) if 2**k < dim), dim})
    return {d: round((F.normalize(every[:, :d], dim=-1).abs().amax() * math.sqrt(d)).item(), 3) for d in sizes}


def main() -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the served default model")
    parser.add_argument("--docs", type=int, default=30, help="held-out documents")
    parser.add_argument("--min-tokens", type=int, default=4000)
    parser.add_argument("--max-tokens", type=int, default=8000)
    parser.add_argument("--size", type=int, default=256, help="chunk size in tokens")
    parser.add_argument("--dims", type=int, nargs="*", default=None, help="default: the model's dimension")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", default=None, help="the late-chunking bench's cache folder (the same naive chunks)")
    parser.add_argument("--calibrate", action="store_true", help="measure the int8 range on the development set")
    parser.add_argument("--name", default=None, help="default: compact-vectors-<model>")
    args = parser.parse_args()

    torch.set_grad_enabled(False)
    encoder = load_encoder(args.model, dtype="float32")
    dev, held = split_sets(encoder, args.min_tokens, args.max_tokens, args.docs)
    meta = {"device": device_name(), "model": encoder.name, "chunk_size": args.size, "args": vars(args)}
    if args.calibrate:
        corpus = build_corpus(encoder, dev, [args.size], args.seed)
        vectors, _ = naive_vectors(encoder, corpus, args.size, args, "dev")
        meta["measured_range"] = measured_range(corpus, vectors, encoder.dim)
        print(f"dev set, {len(dev)} pages: largest |x_i| * sqrt(d) per size {meta['measured_range']}", flush=True)
    value_range = calibration(encoder.name)
    meta["range"], meta["range_measured"] = value_range.range, value_range.measured
    corpus = build_corpus(encoder, held, [args.size], args.seed)
    vectors, _ = naive_vectors(encoder, corpus, args.size, args, "held-out")
    print(f"held-out: {len(held)} man pages, " + ", ".join(f"{len(a)} {n}" for n, (_, a) in corpus.queries.items()),
          flush=True)  # fmt: skip
    rows = [row for dims in args.dims or [encoder.dim] for row in format_rows(corpus, vectors, dims, value_range.range)]
    print_table(rows, ["format", "dimensions", "bytes", *[k for k in rows[0] if "_r1_" in k]])
    meta["documents"] = [d.name for d in held]
    print(f"wrote {write_results(args.name or f'compact-vectors-{encoder.name}', rows, meta)}")


if __name__ == "__main__":
    main()
