"""Whether the clusters need LSH codes to start from: i-clustered and clustered 100 on a real
encoder with each query first in the cluster of its nearest seed query in Euclidean space
(bits 0: no hash, no Hamming pass; the same evenly spaced seeds; i-clustered's defaults),
against the Hamming start from 63-bit codes (clustered's defaults: the hash places each query
with its nearest seed's code in Hamming distance), at equal Euclidean steps after the start and
one fewer.

    python -m clusterserve.bench.quality.seeding [--model PATH|NAME]

With every layer approximated (native backend, float32), the pooled vector's cosine to exact
attention on the stretches of text bench.quality.convergence reads (4k and 8k from the start, and its
SAMPLES). Writes bench/results/seeding-<model>.json. A variant is (name, bits, refine): the
seeded start is itself a Euclidean nearest-mean step, so seeded / 2 runs as many such steps
as 0 / 3 from the codes, and one launch of hashing and two of Hamming K-means fewer on the GPU
(bench.costmodel.gpu_model's "i-clustered 100/32" against its "(Hamming start)" row).
"""

from __future__ import annotations

import argparse
import time

import torch

from clusterserve.kernels import AttentionSpec
from clusterserve.models import load_encoder

from ..common import device_name, long_text_ids, print_table, write_report
from .convergence import BASE, SAMPLES, pass_cosine
from .locality import DEFAULT_MODEL

STRETCHES = ((4096, 0), (8192, 0), *SAMPLES)
VARIANTS = (("0 / 3 (codes)", 63, 3), ("0 / 2", 63, 2), ("seeded / 2", 0, 2), ("seeded / 3", 0, 3))
# clustered 100: its defaults (the codes, 3 steps) against the seeded start at 2
METHODS = (("i-clustered", VARIANTS), ("clustered", (VARIANTS[0], VARIANTS[2])))


def main() -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    encoder = load_encoder(args.model, dtype=torch.float32)
    rows = []
    for tokens, offset in STRETCHES:
        ids = long_text_ids(encoder, tokens, offset=offset)
        exact = encoder.embed([ids], AttentionSpec(method="full"), max_batch_tokens=len(ids))
        for method, variants in METHODS:
            for name, bits, refine in variants:
                start = time.perf_counter()
                cosine = pass_cosine(encoder, ids, exact, False, 0, refine, method, bits=bits)
                rows.append(dict(tokens=len(ids), offset=offset, method=method, variant=name, bits=bits, refine=refine,
                                 cosine=round(cosine, 5)))
                print(rows[-1], f"{time.perf_counter() - start:.0f} s", flush=True)
    summary = []
    for method, variants in METHODS:
        base = {(r["tokens"], r["offset"]): r["cosine"] for r in rows if r["method"] == method and r["variant"] == variants[0][0]}
        for name, _, _ in variants[1:]:
            deltas = [r["cosine"] - base[(r["tokens"], r["offset"])] for r in rows
                      if r["method"] == method and r["variant"] == name]
            summary.append(dict(method=method, variant=name, against=variants[0][0], stretches=len(deltas),
                                mean_delta=round(sum(deltas) / len(deltas), 5), min_delta=round(min(deltas), 5),
                                max_delta=round(max(deltas), 5), not_lower=sum(d >= 0 for d in deltas)))
    print_table(rows, list(rows[0]))
    print_table(summary, list(summary[0]))
    meta = dict(device=device_name(), model=encoder.name, dtype="float32", spec=BASE.to_json(),
                text="Debian common-licenses, framed with the default prompt")
    path = write_report(f"seeding-{encoder.name}", dict(meta=meta, summary=summary, rows=rows))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
