"""The speed-fidelity frontier of a model on one real long document per length: for each
configuration, the pooled vector's cosine to exact attention's and its time against exact's,
measured in one run, exact and approximate in the same dtype.

    python -m clusterserve.bench.cpu.frontier [--model PATH|NAME] [--dtype float32 bfloat16] [--lengths 2048 4096 8192]
                             [--grid FILE] [--name frontier-nomic]

The grid is one AttentionSpec's JSON keyword arguments per line (`--grid`, the calibration
grid's format), else GRID. The document: Debian's licence texts framed with the model's default
prompt ("search_document: " for nomic-embed-text-v1.5), held-back texts (bench.common).
Writes bench/results/<name>-<dtype>.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from clusterserve.kernels import AttentionSpec
from clusterserve.models import load_encoder

from ..common import HELD_BACK_TEXTS, device_name, long_text_ids, print_table, write_results

DEFAULT_MODEL = "/root/.cache/clusterserve/nomic-embed-text-v1.5.f16.gguf"
# Each method at its default knobs; banded also with its far field pooled (far_blocks=0), and as
# the shipped nomic table serves 8k documents (band 2, 16 far blocks).
GRID = [
    dict(method="clustered"),
    dict(method="i-clustered"),
    dict(method="smyrf"),
    dict(method="banded", far_blocks=0),
    dict(method="banded"),
    dict(method="banded", band=2, far_blocks=16),
]


def timed(encoder, ids: list[int], spec: AttentionSpec) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    vec = encoder.embed([ids], spec, max_batch_tokens=len(ids))
    return vec, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--grid", type=Path, default=None)
    parser.add_argument("--name", default="frontier-nomic")
    args = parser.parse_args()
    grid = GRID if args.grid is None else [json.loads(line) for line in args.grid.read_text().splitlines() if line.strip()]
    torch.set_grad_enabled(False)
    for dtype in args.dtype:
        encoder = load_encoder(args.model, dtype=getattr(torch, dtype))
        rows = []
        for n in args.lengths:
            ids = long_text_ids(encoder, n, texts=HELD_BACK_TEXTS)
            timed(encoder, ids[:256], AttentionSpec(method="full"))  # warm-up
            exact, exact_s = timed(encoder, ids, AttentionSpec(method="full"))
            for knobs in grid:
                vec, seconds = timed(encoder, ids, AttentionSpec(**knobs))
                rows.append(dict(
                    tokens=n, dtype=dtype, config=json.dumps(knobs), cosine=round(F.cosine_similarity(vec, exact).item(), 5),
                    seconds=round(seconds, 2), exact_s=round(exact_s, 2), speedup=round(exact_s / seconds, 2),
                ))
                print_table(rows[-1:], list(rows[-1]))
        print_table(rows, list(rows[0]))
        meta = dict(device=device_name(), model=encoder.name, dtype=dtype, threads=torch.get_num_threads(),
                    text="Debian common-licenses (held-back texts) with the default prompt")
        print(f"wrote {write_results(f'{args.name}-{dtype}', rows, meta)}")


if __name__ == "__main__":
    main()
